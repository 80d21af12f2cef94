//! Pure-Rust engine cost per decode step (no Python): schedule + update with a null
//! runner, B sequences of 512-token prompts decoding 256 tokens, page size 16, prefix
//! caching on. Separates the core's own cost from the bindings' in docs/benchmarks.md.
//!
//! `cargo run --release -p resin-core --example decode_overhead -- 256 1024`

use std::time::Instant;

use resin_core::{Engine, EngineConfig, ForwardOutputRef, SamplingParams};

fn main() {
    let batch_sizes: Vec<u32> = std::env::args().skip(1).map(|a| a.parse().expect("batch size")).collect();
    let batch_sizes = if batch_sizes.is_empty() { vec![256, 1024] } else { batch_sizes };
    println!("| B | decode steps | mean µs/step | p50 µs | p99 µs | schedule µs | update µs | ns/seq |");
    println!("|---|---|---|---|---|---|---|---|");
    for b in batch_sizes {
        let config = EngineConfig {
            page_size: 16,
            num_pages: b * 50 + 1,
            max_num_seqs: b,
            max_num_batched_tokens: 512 * b, // prefill everything in one step, then pure decode
            max_model_len: 1024,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(config, &[]).expect("config");
        for i in 0..b {
            let prompt: Vec<u32> = (0..512).map(|t| (i * 7919 + t * 31) % 32000).collect();
            let params = SamplingParams { max_tokens: 256, ignore_eos: true, ..SamplingParams::default() };
            engine.add_request(&format!("r{i}"), prompt, params).unwrap();
        }
        let (mut sched_ns, mut update_ns, mut totals) = (0u128, 0u128, Vec::new());
        let ids = vec![7u32; b as usize];
        let indptr: Vec<u32> = (0..=b).collect();
        while engine.has_unfinished() {
            let t0 = Instant::now();
            let plan = engine.schedule().unwrap();
            let t1 = Instant::now();
            let s = plan.num_sequences as usize;
            let out = ForwardOutputRef { token_ids: &ids[..s], token_indptr: &indptr[..=s], ..Default::default() };
            engine.update(plan.step, &out).unwrap();
            let t2 = Instant::now();
            let (num_decode, step_plan) = (plan.num_decode_sequences, plan);
            engine.recycle(step_plan);
            if num_decode == b {
                sched_ns += (t1 - t0).as_nanos();
                update_ns += (t2 - t1).as_nanos();
                totals.push((t2 - t0).as_nanos());
            }
        }
        totals.sort_unstable();
        let n = totals.len() as u128;
        let mean = totals.iter().sum::<u128>() / n;
        println!(
            "| {b} | {n} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
            mean as f64 / 1e3,
            totals[totals.len() / 2] as f64 / 1e3,
            totals[(totals.len() * 99 / 100).min(totals.len() - 1)] as f64 / 1e3,
            (sched_ns / n) as f64 / 1e3,
            (update_ns / n) as f64 / 1e3,
            mean as f64 / f64::from(b)
        );
    }
}
