//! The candidate search (`candidates::largest`) against the greedy pick (`argmax::argmax`)
//! on LLM-like rows: 32,000 N(0, 2) logits with 8 lifted 9-16 above the bulk, µs a row, the
//! best of `REPS` (default 15) passes over 32 rows (in the cache) or 256 rows (32 MB: not).
//!
//!     cargo run --release -p resin-kernels --example candidate_search
use resin_kernels::argmax::argmax;
use resin_kernels::candidates::largest;
use resin_kernels::vector::Ahead;
use std::time::Instant;

const VOCAB: usize = 32_000;
const ROWS: usize = 256;

/// N(0, 2) logits with 8 lifted a row (a 64-bit LCG and Box-Muller; fixed seed).
fn logits() -> Vec<f32> {
    let mut state = 11u64;
    let mut uniform = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut data: Vec<f32> = (0..VOCAB * ROWS)
        .map(|_| {
            let (a, b) = (uniform(), uniform());
            ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32 * 2.0
        })
        .collect();
    for r in 0..ROWS {
        for j in 0..8 {
            data[r * VOCAB + (r * 7919 + j * 104_729) % VOCAB] = 16.0 - j as f32;
        }
    }
    data
}

/// The best over `reps` passes of `f(row)` on the first `rows` rows, µs a row.
fn best_us(data: &[f32], rows: usize, reps: usize, mut f: impl FnMut(&[f32])) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            for r in 0..rows {
                f(&data[r * VOCAB..(r + 1) * VOCAB]);
            }
            t.elapsed().as_secs_f64() / rows as f64 * 1e6
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let reps = std::env::var("REPS").map_or(15, |r| r.parse().expect("REPS: a count"));
    let data = logits();
    println!("| rows | argmax µs | n = 64 µs | n = 128 µs | n = 256 µs |\n|---|---|---|---|---|");
    for rows in [32, ROWS] {
        let mut line = format!(
            "| {rows} | {:.2}",
            best_us(&data, rows, reps, |row| {
                std::hint::black_box(argmax(row, &mut Ahead::none()));
            })
        );
        for n in [64, 128, 256] {
            let (mut values, mut indices, mut buffer) = (vec![0.0f32; n], vec![0i64; n], Vec::new());
            let us = best_us(&data, rows, reps, |row| {
                largest(row, &mut values, &mut indices, &mut buffer, &mut Ahead::none());
                std::hint::black_box(&values);
            });
            line += &format!(" | {us:.2}");
        }
        println!("{line} |");
    }
}
