//! `bounded_draw`: a whole-row inverse-CDF draw decided from cheap exponentials and an error
//! bound, giving the token torch's softmax + `cumsum` + `searchsorted` gives, or saying it
//! cannot tell (then the caller runs the exact draw, [`crate::softmax`] + [`crate::draw`]).
//!
//! The exact draw (`resin/sampling_draw.py`'s `inverse_cdf` over `softmax(x / T)`) needs
//! SLEEF's `expf` bits of every token (27 vector operations per 8 values, most of a 32,000-token
//! row's cost), the float32 sum in torch's lane order, the probabilities written out, and a
//! chain of float64 additions. But its token depends on those bits only through comparisons
//! of the cumulative sums with the target, and those are nearly always decided by a wide
//! margin. Torch's token is the first column j with `cdf[j] > target`, where (module doc of
//! [`crate::draw`]) `cdf[j]` is the float32 rounding of the float64 running sum of `p_i =
//! fl(e_i * fl(1 / S))`, `target = min(fl(u * cdf[V-1]), one ulp below it)` and `e_i` SLEEF's
//! `exp(x_i - max)`. The common factor `fl(1 / S)` cancels between `cdf[j]` and the target, so
//! with `E_j = sum_{i <= j} e_i`:
//!
//! `cdf[j] / cdf[V-1] = (E_j / E_{V-1}) (1 ± ρ)`, `ρ` a few float32 roundings (`p_i`, the
//! rounded sums, the target) plus float64 additions: taken here as `6 · 2^-24 + V · 2^-52`.
//!
//! This computes `Ê_j`, the sums of a cheaper `exp` (a degree-6 polynomial, a cutoff and no
//! other range checks:
//! relative error under [`EXP_ERROR`] against the true exponential, so under
//! `EXP_ERROR + 2^-23` against SLEEF's), in float32 lanes over blocks of [`BLOCK`] columns
//! (each block sum within `10 · 2^-24` of its terms' sum) and float64 across them, finds the
//! first column whose `Ê_j` passes `u · Ê_{V-1}`, and keeps it only when both comparisons torch
//! makes there hold with the bound, taken twice over: `cdf[j] > target` and
//! `cdf[j-1] <= target`. Tokens below `max - 87` are counted as 0 here, while SLEEF gives them
//! up to `e^-87`; that and float32 underflow are an absolute slack of `V · 2^-120` against
//! `E_{V-1} >= 1` (the largest value's own term is 1). A uniform within `2^-20` of 1 (where
//! the target's one-ulp clamp could bind) is left to the exact draw, as is a row whose largest
//! scaled value is not finite. The undecided band at each edge is ~2e-5 · u of the row's
//! mass, far below a token's share on LLM-like (peaked) rows, which nearly always decide; on a
//! flat row of 32,000 tokens (shares ~3e-5) about half the draws are left to the exact draw.
//! The tests place uniforms on the exact sums' edges, where a decided token must still be
//! torch's.

use crate::softmax::{scale_into, Scaling};
use crate::vector::Ahead;

/// Columns per block sum.
pub const BLOCK: usize = 256;

/// Bound on `|exp_term(x) / exp(x) - 1|` for `-87 <= x <= 0` (measured: under 4e-7; the
/// test checks a third of this).
pub const EXP_ERROR: f64 = 1.5e-6;

/// Bound on a block sum's relative error against its terms' float64 sum: each of the 32 lane
/// sums adds 8 terms (4 accumulators), then float64.
const BLOCK_SUM_ERROR: f64 = 10.0 / 16_777_216.0;

/// Below this (relative to the row's largest value) a term is counted as 0.
const CUTOFF: f32 = -87.0;

/// Scratch reused across rows.
#[derive(Default)]
pub struct BoundedScratch {
    scaled: Vec<f32>,
    block_sums: Vec<f64>,
}

/// The draw's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Torch's token, for certain.
    Token(usize),
    /// The bound cannot tell (or the row is out of reach): run the exact draw.
    Undecided,
}

/// The token of `row` scaled and kept by `scaling`, drawn with `uniform`, if the bound decides
/// it (module doc).
/// `ahead` asks for other memory while the exponentials are summed (see
/// [`crate::softmax::exp_sum`]).
pub fn draw(row: &[f32], scaling: Scaling, uniform: f32, scratch: &mut BoundedScratch, ahead: &mut Ahead) -> Outcome {
    let width = row.len();
    if width == 0 || !(0.0..1.0 - 1.0 / 1_048_576.0).contains(&uniform) {
        return Outcome::Undecided;
    }
    scratch.scaled.resize(width, 0.0);
    let max = scale_into(row, scaling, &mut scratch.scaled);
    if !max.is_finite() {
        return Outcome::Undecided;
    }
    let num_blocks = width.div_ceil(BLOCK);
    scratch.block_sums.resize(num_blocks, 0.0);
    block_sums(&scratch.scaled, max, &mut scratch.block_sums, ahead);
    let total: f64 = scratch.block_sums.iter().sum();
    let n = width as f64;
    let delta = EXP_ERROR + 2f64.powi(-23) + BLOCK_SUM_ERROR + n * 2f64.powi(-52);
    let rho = 6.0 * 2f64.powi(-24) + n * 2f64.powi(-52);
    let kappa = 2.0 * (2.0 * delta + rho);
    let slack = n * 2f64.powi(-120);
    let u = f64::from(uniform);
    let target = u * total;
    // The first block whose end passes the target, then the column inside it.
    let mut before = 0.0f64;
    let mut block = None;
    for (b, &sum) in scratch.block_sums.iter().enumerate() {
        if before + sum > target {
            block = Some(b);
            break;
        }
        before += sum;
    }
    let Some(block) = block else { return Outcome::Undecided };
    let start = block * BLOCK;
    let mut previous = before;
    for (offset, &x) in scratch.scaled[start..(start + BLOCK).min(width)].iter().enumerate() {
        let sum = previous + f64::from(exp_term(x - max));
        if sum > target {
            let j = start + offset;
            // cdf[j] > target for certain, and cdf[j-1] <= target for certain (none before 0).
            let passes = sum * (1.0 - kappa) - slack > u * total * (1.0 + kappa) + slack;
            let below = j == 0 || previous * (1.0 + kappa) + slack < u * total * (1.0 - kappa) - slack;
            return if passes && below { Outcome::Token(j) } else { Outcome::Undecided };
        }
        previous = sum;
    }
    Outcome::Undecided // the block's sum and its terms' disagree by a rounding: let exact decide
}

/// `exp(x)` to [`EXP_ERROR`] for `CUTOFF <= x <= 0`, 0 below (and for `-inf`).
#[inline(always)]
pub fn exp_term(x: f32) -> f32 {
    // Below the cutoff, -inf and NaN alike: 0 (a NaN never gets here: its row is left).
    if x.is_nan() || x < CUTOFF {
        return 0.0;
    }
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let f = k.mul_add(-LN2_HIGH, x);
    let f = k.mul_add(-LN2_LOW, f);
    let p = poly(f);
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

const LN2_HIGH: f32 = 0.693_145_75;
#[allow(clippy::excessive_precision)]
const LN2_LOW: f32 = 1.428_606_765_330_187e-6;
/// e^f for |f| <= ln 2 / 2: Taylor to degree 6 (remainder under 1.2e-7).
const C: [f32; 7] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

#[inline(always)]
fn poly(f: f32) -> f32 {
    let mut p = C[0];
    for &c in &C[1..] {
        p = p.mul_add(f, c);
    }
    p
}

/// Each block's sum of `exp_term(x - max)` (float32 lanes, then float64).
fn block_sums(scaled: &[f32], max: f32, out: &mut [f64], ahead: &mut Ahead) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        unsafe { avx2::block_sums(scaled, max, out, ahead) };
        return;
    }
    for (chunk, o) in scaled.chunks(BLOCK).zip(out.iter_mut()) {
        ahead.step(4 * chunk.len());
        let mut lanes = [0.0f32; 32];
        for (i, &x) in chunk.iter().enumerate() {
            lanes[i % 32] += exp_term(x - max);
        }
        *o = lanes.iter().map(|&v| f64::from(v)).sum();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Ahead, BLOCK, C, CUTOFF, LN2_HIGH, LN2_LOW};
    use std::arch::x86_64::*;

    /// [`super::exp_term`] on 8 lanes (the same operations).
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        let keep = _mm256_cmp_ps(x, _mm256_set1_ps(CUTOFF), _CMP_GE_OQ);
        let x = _mm256_max_ps(x, _mm256_set1_ps(CUTOFF));
        let k = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let f = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_HIGH), x);
        let f = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_LOW), f);
        let mut p = _mm256_set1_ps(C[0]);
        for &c in &C[1..] {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        let scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_sums(scaled: &[f32], max: f32, out: &mut [f64], ahead: &mut Ahead) {
        let m = _mm256_set1_ps(max);
        for (chunk, o) in scaled.chunks(BLOCK).zip(out.iter_mut()) {
            let mut acc = [_mm256_setzero_ps(); 4];
            let full = chunk.len() / 32 * 32;
            for i in (0..full).step_by(32) {
                ahead.step(128);
                for (a, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(chunk.as_ptr().add(i + 8 * a));
                    *acc = _mm256_add_ps(*acc, exp8(_mm256_sub_ps(x, m)));
                }
            }
            let mut lanes = [0.0f32; 32];
            for (a, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * a), *acc);
            }
            let mut sum: f64 = lanes.iter().map(|&v| f64::from(v)).sum();
            for &x in &chunk[full..] {
                sum += f64::from(super::exp_term(x - max));
            }
            *o = sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draw::draw_rows;
    use crate::nucleus::tests::logits as data;
    use crate::softmax::{softmax_in_place, Lanes};

    fn exact(row: &[f32], scaling: Scaling, uniform: f32) -> Option<usize> {
        let mut probs = vec![0.0; row.len()];
        let max = scale_into(row, scaling, &mut probs);
        softmax_in_place(&mut probs, max, Lanes::new(8).unwrap());
        draw_rows(&probs, row.len(), &[uniform], &mut Vec::new())[0]
    }

    #[test]
    fn the_cheap_exp_is_within_its_bound() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = f64::from(exp_term(x));
            let want = f64::from(x).exp();
            worst = worst.max((got / want - 1.0).abs());
            x += 1.3e-4;
        }
        assert!(worst < EXP_ERROR / 3.0, "worst relative error {worst}");
        assert_eq!(exp_term(0.0), 1.0);
        assert_eq!(exp_term(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_term(-87.01), 0.0);
        let xs: Vec<f32> = (0..4096).map(|i| -(i as f32) * 0.0213).collect();
        let mut sums = vec![0.0; xs.len().div_ceil(BLOCK)];
        block_sums(&xs, 0.0, &mut sums, &mut Ahead::none());
        let want: f64 = xs.iter().map(|&x| f64::from(exp_term(x))).sum();
        assert!((sums.iter().sum::<f64>() / want - 1.0).abs() < 1e-6);
    }

    /// Every decided token is the exact draw's; random uniforms are nearly all decided, and
    /// uniforms placed on the exact cumulative sums' edges are left undecided or right.
    #[test]
    fn decided_tokens_are_the_exact_draws() {
        let mut scratch = BoundedScratch::default();
        let mut state = 11u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let (mut decided, mut total, mut decided_peaked, mut total_peaked) = (0, 0, 0, 0);
        let rows = [
            (1u64, 7usize, 3.0f32),
            (2, 300, 12.0),
            (3, 5000, 4.0),
            (4, 32000, 4.0),
            (5, 40001, 30.0),
            (6, 32000, 0.0),
            (7, 151_936, 0.0),
        ];
        for (seed, width, spread) in rows {
            // spread 0: LLM-like (a bulk of 4 logits' spread, 8 tokens 10-16 above it)
            let llm = spread == 0.0;
            let mut row = data(width, seed, if llm { 4.0 } else { spread });
            if llm {
                for t in 0..8 {
                    row[(t * 7919 + seed as usize) % width] = 12.0 + t as f32 * 0.8;
                }
            } else if width > 100 {
                for v in row.iter_mut().step_by(7) {
                    *v = f32::NEG_INFINITY;
                }
            }
            for scaling in [
                Scaling::NONE,
                Scaling { temperature: 0.7, keep_from: f32::NEG_INFINITY },
                Scaling { temperature: 1.3, keep_from: 0.5 },
            ] {
                for _ in 0..40 {
                    let u = next();
                    total += 1;
                    total_peaked += usize::from(llm);
                    if let Outcome::Token(t) = draw(&row, scaling, u, &mut scratch, &mut Ahead::none()) {
                        decided += 1;
                        decided_peaked += usize::from(llm);
                        assert_eq!(Some(t), exact(&row, scaling, u), "width {width} u {u}");
                    }
                }
                // Uniforms on the edges: the exact cumsums' own values (and their neighbours).
                let mut probs = vec![0.0; width];
                let max = scale_into(&row, scaling, &mut probs);
                softmax_in_place(&mut probs, max, Lanes::new(8).unwrap());
                let mut sum = 0.0f64;
                let cdf: Vec<f32> = probs
                    .iter()
                    .map(|&p| {
                        sum += f64::from(p);
                        sum as f32
                    })
                    .collect();
                let last = cdf[width - 1];
                for j in (0..width).step_by((width / 13).max(1)) {
                    let edge = cdf[j] / last;
                    for u in [edge, f32::from_bits(edge.to_bits().saturating_sub(1)), f32::from_bits(edge.to_bits() + 1)] {
                        if let Outcome::Token(t) = draw(&row, scaling, u, &mut scratch, &mut Ahead::none()) {
                            assert_eq!(Some(t), exact(&row, scaling, u), "edge width {width} u {u}");
                        }
                    }
                }
            }
        }
        // LLM-like rows decide nearly always; flat ones (a token's share ~1e-4) most of the time.
        assert!(decided_peaked * 100 >= total_peaked * 97, "LLM-like: {decided_peaked} of {total_peaked}");
        assert!(decided * 10 >= total * 7, "decided {decided} of {total}");
        let row = data(1000, 9, 5.0);
        assert_eq!(draw(&row, Scaling::NONE, 0.999_999_9, &mut scratch, &mut Ahead::none()), Outcome::Undecided);
        let mut nan = row.clone();
        nan[3] = f32::NAN;
        assert_eq!(draw(&nan, Scaling::NONE, 0.5, &mut scratch, &mut Ahead::none()), Outcome::Undecided);
    }
}
