//! Shared helpers for the engine scenario and invariant tests: a driver that plays a
//! runner returning chosen tokens, and shorthand constructors.
#![allow(dead_code)]

use resin_core::{BatchPlan, Engine, EngineConfig, ForwardOutputRef, KvCacheSpec, RequestOutput, SamplingParams};

pub fn config(page_size: u32, num_pages: u32) -> EngineConfig {
    EngineConfig { page_size, num_pages, max_model_len: 16, max_num_batched_tokens: 64, ..EngineConfig::default() }
}

pub fn engine(config: EngineConfig) -> Engine {
    Engine::new(config, &[]).expect("valid config")
}

pub fn engine_with(config: EngineConfig, specs: &[KvCacheSpec]) -> Engine {
    Engine::new(config, specs).expect("valid config")
}

pub fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ..SamplingParams::default() }
}

pub fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Commits `plan` with `token` sampled for every row.
pub fn commit(engine: &mut Engine, plan: &BatchPlan, token: u32) -> Vec<RequestOutput> {
    let s = plan.num_sequences as usize;
    let ids = vec![token; s];
    let indptr: Vec<u32> = (0..=s as u32).collect();
    engine
        .update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() })
        .expect("valid output")
}

/// schedule + commit with `token` for every row.
pub fn step(engine: &mut Engine, token: u32) -> (BatchPlan, Vec<RequestOutput>) {
    let plan = engine.schedule().expect("no pending plan");
    let outs = commit(engine, &plan, token);
    (plan, outs)
}

/// Pages of group 0 a plan lists for row `i`.
pub fn row_pages(plan: &BatchPlan, group: usize, i: usize) -> Vec<u32> {
    let g = &plan.groups[group];
    g.kv_indices[g.kv_indptr[i] as usize..g.kv_indptr[i + 1] as usize].to_vec()
}

/// Steps until nothing is left; returns every output.
pub fn run_to_completion(engine: &mut Engine, token: u32, max_steps: usize) -> Vec<RequestOutput> {
    let mut all = Vec::new();
    for _ in 0..max_steps {
        if !engine.has_unfinished() {
            return all;
        }
        all.extend(step(engine, token).1);
    }
    panic!("requests still unfinished after {max_steps} steps");
}
