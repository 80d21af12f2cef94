//! The lifecycle diff is enough for per-request runner state: a runner that keeps each
//! slot's token history from `new_request_*`, `finished_request_slots` and
//! `committed_token_ids` alone (never `input_ids`) holds exactly the request's prompt and
//! outputs on every row, through chunked prefill, prefix hits, preemption, aborts and
//! discarded plans (which the runner may or may not have seen).

mod common;
use std::collections::{BTreeMap, HashMap};

use common::{config, engine, params, tokens};
use resin_core::{BatchPlan, Engine, EngineConfig, ForwardOutputRef, RequestOutput};

/// xorshift64*: small, seeded, reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What a sampler keeps per slot: every token so far and how many are prompt. Also, to
/// check the diff is minimal: per slot, the tokens it had at the last committed plan.
#[derive(Default)]
struct MirrorRunner {
    slots: HashMap<u32, (Vec<u32>, u32)>,
    confirmed: HashMap<u32, usize>,
    seen: Vec<(u32, usize)>,
}

impl MirrorRunner {
    /// `Sampler.begin_step`, in Rust.
    fn begin_step(&mut self, plan: &BatchPlan) {
        self.seen.clear();
        for s in &plan.finished_request_slots {
            self.slots.remove(s);
            self.confirmed.remove(s);
        }
        for (j, &s) in plan.new_request_slots.iter().enumerate() {
            let ids = &plan.new_request_token_ids
                [plan.new_request_token_indptr[j] as usize..plan.new_request_token_indptr[j + 1] as usize];
            self.slots.insert(s, (ids.to_vec(), plan.new_request_num_prompt_tokens[j]));
            self.confirmed.remove(&s);
        }
        for i in 0..plan.num_sequences as usize {
            let committed =
                &plan.committed_token_ids[plan.committed_token_indptr[i] as usize..plan.committed_token_indptr[i + 1] as usize];
            let slot = plan.request_slots[i];
            let (history, num_prompt) = self.slots.get_mut(&slot).expect("a row's slot was announced");
            let end = (*num_prompt + plan.num_output_tokens[i]) as usize;
            // Minimal: exactly what the runner has not seen in a committed plan.
            let start = self.confirmed.get(&slot).copied().unwrap_or(end);
            assert_eq!(
                end - committed.len(),
                start,
                "plan {} row {i}: committed tokens start where the runner's committed view ends",
                plan.step
            );
            self.seen.push((slot, end));
            history.truncate(start);
            history.extend_from_slice(committed);
        }
    }

    /// The plan the runner last saw was committed.
    fn committed(&mut self) {
        self.confirmed.extend(self.seen.drain(..));
    }

    /// Every row's history is its request's prompt + outputs.
    fn check(&self, plan: &BatchPlan, expected: &BTreeMap<String, (Vec<u32>, u32)>) {
        for i in 0..plan.num_sequences as usize {
            let id = plan.request_id(i);
            let (want, num_prompt) = &expected[id];
            let (history, history_prompt) = &self.slots[&plan.request_slots[i]];
            assert_eq!(history, want, "plan {} row {i} ({id}): history", plan.step);
            assert_eq!(history_prompt, num_prompt);
            assert_eq!(plan.num_output_tokens[i] as usize, want.len() - *num_prompt as usize, "num_output_tokens");
        }
    }
}

fn record(outputs: &[RequestOutput], expected: &mut BTreeMap<String, (Vec<u32>, u32)>) {
    for out in outputs {
        if let Some((tokens, num_prompt)) = expected.get_mut(out.request_id()) {
            tokens.truncate(*num_prompt as usize);
            tokens.extend(out.token_ids());
            if out.finished {
                expected.remove(out.request_id());
            }
        }
    }
}

fn commit(e: &mut Engine, plan: &BatchPlan, rng: &mut Rng) -> Vec<RequestOutput> {
    let s = plan.num_sequences as usize;
    let ids: Vec<u32> = (0..s).map(|_| 2 + rng.below(6) as u32).collect();
    let indptr: Vec<u32> = (0..=s as u32).collect();
    e.update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() }).expect("valid output")
}

#[test]
fn per_request_history_follows_from_the_diff_alone() {
    let (mut num_preemptions, mut num_hit_tokens, mut num_committed_rows) = (0, 0, 0);
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let page_size = [1, 2, 4][rng.below(3) as usize];
        let mut e = engine(EngineConfig {
            max_model_len: 40,
            max_num_seqs: 1 + rng.below(5) as u32,
            max_num_batched_tokens: 1 + rng.below(12) as u32,
            ..config(page_size, 40 / page_size + 2 + rng.below(8) as u32)
        });
        let mut runner = MirrorRunner::default();
        let mut expected: BTreeMap<String, (Vec<u32>, u32)> = BTreeMap::new();
        let mut next_id = 0;
        for _ in 0..400 {
            if rng.chance(25) {
                // Shared prefixes, so some admissions start with a prefix hit.
                let len = 1 + rng.below(14) as u32;
                let prompt: Vec<u32> = (0..len).map(|k| if k < 8 { 3 } else { 2 + rng.below(6) as u32 }).collect();
                let id = format!("r{next_id}");
                next_id += 1;
                e.add_request(&id, prompt.clone(), params(1 + rng.below(24) as u32)).unwrap();
                expected.insert(id, (prompt.clone(), prompt.len() as u32));
            }
            if rng.chance(5) && !expected.is_empty() {
                let id = expected.keys().nth(rng.below(expected.len() as u64) as usize).unwrap().clone();
                assert!(e.abort(&id));
                expected.remove(&id);
            }
            let plan = e.schedule().unwrap();
            if plan.num_sequences == 0 {
                record(&commit(&mut e, &plan, &mut rng), &mut expected); // step() skips the runner
                continue;
            }
            // The runner may fail before it applies the diff, or after.
            let runner_sees = !rng.chance(10);
            if runner_sees {
                runner.begin_step(&plan);
                runner.check(&plan, &expected);
                num_committed_rows += plan.committed_token_indptr.windows(2).filter(|w| w[1] > w[0]).count();
            }
            if !runner_sees || rng.chance(20) {
                if rng.chance(30) {
                    // A request aborted while its plan is in flight.
                    let id = plan.request_id(rng.below(u64::from(plan.num_sequences)) as usize).to_string();
                    if e.abort(&id) {
                        expected.remove(&id);
                    }
                }
                e.discard_plan();
                continue;
            }
            record(&commit(&mut e, &plan, &mut rng), &mut expected);
            runner.committed();
        }
        e.check_integrity().unwrap();
        num_preemptions += e.metrics().num_preemptions;
        num_hit_tokens += e.metrics().prefix_cache_hits_tokens;
    }
    // The scenarios exercise what the diff must survive.
    assert!(
        num_preemptions > 0 && num_hit_tokens > 0 && num_committed_rows > 1000,
        "{num_preemptions} {num_hit_tokens} {num_committed_rows}"
    );
}

#[test]
fn a_decode_row_carries_the_token_sampled_in_its_previous_step() {
    let mut e = engine(config(4, 32));
    e.add_request("a", tokens(10..13), params(4)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!((plan.num_output_tokens.clone(), plan.committed_token_indptr.clone()), (vec![0], vec![0, 0]));
    let ids = [7u32];
    e.update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &[0, 1], ..Default::default() }).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.committed_token_ids, vec![7]);
    assert_eq!(plan.num_output_tokens, vec![1]);
    e.discard_plan();
    let again = e.schedule().unwrap();
    assert_eq!(again.committed_token_ids, vec![7], "a discarded plan's committed tokens are re-sent, at the same place");
    assert_eq!(again.num_output_tokens, vec![1]);
    e.update(again.step, &ForwardOutputRef { token_ids: &[8], token_indptr: &[0, 1], ..Default::default() }).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!((plan.committed_token_ids.clone(), plan.num_output_tokens.clone()), (vec![8], vec![2]));
}
