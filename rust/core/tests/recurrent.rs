//! Recurrent groups, exact ids (page_size 4; a full group of 8 bytes per token, so a page
//! holds 32 bytes): one state per request allocated at admission, `state_slots` /
//! `has_initial_state`, chunks cut on page boundaries so states are checkpointed there
//! (`copy_pages` own -> checkpoint in the next plan), hits restored by copy-on-write
//! (checkpoint -> own), checkpoint eviction, `zero_pages`, preemption, abort and discard.

mod common;
use common::*;
use resin_core::{BatchPlan, Engine, EngineConfig, KvCacheSpec};

const FULL: KvCacheSpec = KvCacheSpec::Full { bytes_per_token: 8 };
/// One page per state (32 bytes).
const REC: KvCacheSpec = KvCacheSpec::Recurrent { state_bytes: 32 };
/// Two pages per state (33..=64 bytes).
const REC2: KvCacheSpec = KvCacheSpec::Recurrent { state_bytes: 40 };

/// Checkpoints at every page boundary (interval 0), so the scenarios see each one.
fn cfg(num_pages: u32, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        page_size: 4,
        num_pages,
        max_model_len: 16,
        max_num_batched_tokens: 64,
        enable_prefix_caching: prefix_caching,
        recurrent_checkpoint_interval: 0,
        ..EngineConfig::default()
    }
}

fn pairs(plan: &BatchPlan) -> Vec<[u32; 2]> {
    plan.copy_pages.chunks(2).map(|c| [c[0], c[1]]).collect()
}

fn all_free_after_reset(e: &mut Engine) {
    e.reset_prefix_cache();
    assert_eq!(e.num_free_pages(), e.pool().num_pages() - 1);
    e.check_integrity().unwrap();
}

#[test]
fn a_state_is_allocated_at_admission_and_freed_at_finish() {
    let mut e = engine_with(cfg(16, false), &[FULL, REC]);
    assert_eq!(e.layout().page_bytes, 32);
    assert_eq!(e.layout().groups[1].pages_per_state, 1);
    e.add_request("a", tokens(0..6), params(2)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2]);
    let rec = &plan.groups[1];
    assert_eq!((rec.kv_indptr.clone(), rec.kv_indices.clone()), (vec![0, 1], vec![3]));
    assert_eq!(rec.state_slots, vec![3]);
    assert_eq!(rec.has_initial_state, vec![0], "a fresh state: the runner ignores page 3's stale bytes");
    assert_eq!(rec.kv_last_page_len, vec![0]);
    assert_eq!(rec.slot_mapping, vec![-1; 6], "no per-token cache");
    assert!(plan.groups[0].state_slots.is_empty() && plan.groups[0].has_initial_state.is_empty());
    assert_eq!(plan.block_table(1), (vec![3], 1));
    assert!(plan.copy_pages.is_empty() && plan.zero_pages.is_empty());
    commit(&mut e, &plan, 7);
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(plan.groups[1].state_slots, vec![3]);
    assert_eq!(plan.groups[1].has_initial_state, vec![1]);
    assert!(outs[0].finished);
    assert_eq!(e.num_free_pages(), 15);
    e.check_integrity().unwrap();
}

#[test]
fn without_prefix_caching_chunks_are_not_cut() {
    let mut e = engine_with(cfg(16, false), &[FULL, REC]);
    e.add_request("a", tokens(0..10), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_tokens, 10);
    assert!(plan.copy_pages.is_empty());
    commit(&mut e, &plan, 7);
}

/// `a` (10 tokens) runs; returns the engine after it finished, with its checkpoint at 8
/// tokens on page 5. Pages: full 1, 2 then 4; state 3.
fn checkpointed_engine(num_pages: u32) -> Engine {
    let mut e = engine_with(cfg(num_pages, true), &[FULL, REC]);
    e.add_request("a", tokens(0..10), params(1)).unwrap();
    // The last chunk [0, 10) crosses the last boundary before the final token (8): cut there.
    let (plan, outs) = step(&mut e, 7);
    assert_eq!((plan.num_tokens, plan.sample_indptr.clone()), (8, vec![0, 0]));
    assert!(outs.is_empty());
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2]);
    assert_eq!(plan.groups[1].state_slots, vec![3]);
    // Next plan: the state after 8 tokens is copied into checkpoint page 5 before the forward.
    let plan = e.schedule().unwrap();
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![8], 2));
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 4]);
    assert_eq!(pairs(&plan), vec![[3, 5]]);
    assert_eq!(plan.groups[1].has_initial_state, vec![1]);
    assert_eq!(e.pool().ref_count(5), 1, "the checkpoint is held while its copy is in flight");
    assert!(!e.pool().is_cached(5), "and not hit before the copy is committed");
    e.check_integrity().unwrap();
    let outs = commit(&mut e, &plan, 7);
    assert!(outs[0].finished);
    assert!(e.pool().is_cached(5) && e.pool().ref_count(5) == 0, "registered, then idle in the LRU queue");
    // Freed: 4 (unhashed) front, 2, 1 (hashed) back, state 3 front; checkpoint 5 was released first.
    let q = e.pool().free_queue();
    assert_eq!(&q[..2], &[3, 4]);
    assert_eq!(&q[q.len() - 3..], &[5, 2, 1]);
    e
}

#[test]
fn checkpoint_at_the_cut_boundary_then_hit_by_copy_on_write() {
    let mut e = checkpointed_engine(16);
    e.add_request("b", tokens(0..10), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    // Hit 8 tokens: full pages 1, 2 and the checkpoint at 8 (page 5).
    assert_eq!(plan.num_computed_tokens, vec![8]);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3]);
    assert_eq!(plan.groups[1].state_slots, vec![4]);
    assert_eq!(plan.groups[1].has_initial_state, vec![1]);
    assert_eq!(pairs(&plan), vec![[5, 4]], "copy-on-write: checkpoint 5 -> own state 4");
    assert_eq!(plan.zero_pages, vec![3], "page 3 held a's state and now holds b's K/V");
    let outs = commit(&mut e, &plan, 7);
    assert_eq!(outs[0].num_cached_tokens, 8);
    assert!(e.pool().is_cached(5), "the checkpoint stays cached");
    all_free_after_reset(&mut e);
}

#[test]
fn hits_stop_at_the_longest_boundary_with_a_checkpoint() {
    let mut e = checkpointed_engine(16);
    // Full pages cover 8 tokens of this prompt too, but only 8 has a checkpoint: a
    // 13-token prompt sharing 12 tokens would hit 12 with full attention alone.
    let mut prompt = tokens(0..13);
    prompt[10] = 500;
    e.add_request("b", prompt, params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![8], 4), "hit 8, cut at 12");
    commit(&mut e, &plan, 7);
    run_to_completion(&mut e, 7, 10);
    // A prompt diverging inside the first page has no checkpoint at 4: no hit.
    let mut prompt = tokens(0..10);
    prompt[5] = 500;
    e.add_request("c", prompt, params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0]);
    assert_eq!(plan.groups[1].has_initial_state, vec![0]);
    commit(&mut e, &plan, 7);
}

#[test]
fn checkpoints_are_evicted_like_cached_pages() {
    // 8 usable pages; after `a`, the queue is 3, 4, 6, 7, 8, 5, 2, 1.
    let mut e = checkpointed_engine(9);
    assert_eq!(e.pool().free_queue(), vec![3, 4, 6, 7, 8, 5, 2, 1]);
    e.add_request("big", tokens(100..115), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7); // cut at 12
    assert_eq!((plan.num_tokens, row_pages(&plan, 0, 0)), (12, vec![3, 4, 6]));
    assert_eq!(plan.groups[1].state_slots, vec![7]);
    assert_eq!(plan.zero_pages, vec![3]);
    let plan = e.schedule().unwrap();
    assert_eq!(row_pages(&plan, 0, 0), vec![3, 4, 6, 8]);
    assert_eq!(pairs(&plan), vec![[7, 5]], "the checkpoint page reuses a's evicted checkpoint 5");
    commit(&mut e, &plan, 7);
    // a's full pages 1, 2 are still cached, its checkpoint is gone: no hit for its prompt.
    assert!(e.pool().is_cached(1) && e.pool().is_cached(2));
    e.add_request("b", tokens(0..10), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0]);
    assert!(plan.copy_pages.is_empty());
    commit(&mut e, &plan, 7);
    e.check_integrity().unwrap();
}

#[test]
fn mid_prefill_chunks_end_on_boundaries_and_decode_boundaries_checkpoint() {
    let mut e = engine_with(EngineConfig { max_num_batched_tokens: 6, ..cfg(16, true) }, &[FULL, REC]);
    e.add_request("a", tokens(0..11), params(3)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.num_tokens, 4, "a 6-token budget is cut back to the boundary at 4");
    assert!(plan.copy_pages.is_empty());
    let (plan, _) = step(&mut e, 7);
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![4], 4));
    assert_eq!(pairs(&plan), vec![[2, 4]], "checkpoint at 4 (state 2 -> page 4)");
    let (plan, outs) = step(&mut e, 7);
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![8], 3), "last chunk 8..11");
    assert_eq!(plan.copy_pages.len(), 2, "checkpoint at 8");
    assert_eq!(outs[0].num_output_tokens, 1);
    // Decode 11 -> 12 ends on a boundary: the next plan checkpoints at 12.
    let (plan, _) = step(&mut e, 7);
    assert!(plan.copy_pages.is_empty());
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(plan.num_computed_tokens, vec![12]);
    assert_eq!(plan.copy_pages.len(), 2, "checkpoint at 12");
    assert!(outs[0].finished);
    assert_eq!(e.pool().num_cached_pages(), 3 + 3, "full pages 0..3 and checkpoints at 4, 8, 12");
    all_free_after_reset(&mut e);
}

#[test]
fn checkpoints_come_every_interval_and_at_the_prompt_boundary() {
    // page_size 4, interval 8 tokens: due at 8, 16, ... and at the prompt boundary
    // floor((13 - 1) / 4) * 4 = 12; not at 4 or 20.
    let config = EngineConfig { max_model_len: 24, max_num_batched_tokens: 5, recurrent_checkpoint_interval: 8, ..cfg(32, true) };
    let mut e = engine_with(config, &[FULL, REC]);
    e.add_request("a", tokens(0..13), params(6)).unwrap();
    // [0, 5) holds no due boundary (4 is not): not cut.
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.num_tokens, 5, "no due boundary inside [0, 5)");
    // [5, 10) holds 8 (due): cut back to it.
    let (plan, _) = step(&mut e, 7);
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![5], 3));
    // The next plan checkpoints at 8; [8, 13), the last chunk, is cut at the prompt boundary 12.
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.copy_pages.len(), 2, "checkpoint at 8");
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![8], 4));
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(plan.copy_pages.len(), 2, "checkpoint at 12, the prompt boundary");
    assert_eq!((plan.num_computed_tokens.clone(), outs[0].num_output_tokens), (vec![12], 1));
    // Decode passes 16 (due: a multiple of 8), not 20.
    let mut checkpoints_at = Vec::new();
    while e.has_unfinished() {
        let (plan, _) = step(&mut e, 7);
        if !plan.copy_pages.is_empty() {
            checkpoints_at.push(plan.num_computed_tokens[0]);
        }
    }
    assert_eq!(checkpoints_at, vec![16]);
    // The same prompt hits at 12; one sharing 10 tokens at 8; one sharing 6 gets none (no
    // checkpoint at 4, where every-page checkpoints would have given it a hit).
    e.add_request("b", tokens(0..13), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.num_computed_tokens, vec![12]);
    assert!(!e.has_unfinished());
    for (diverge, hit) in [(10, 8), (6, 0)] {
        let mut prompt = tokens(0..13);
        prompt[diverge] = 500;
        e.add_request(&format!("c{diverge}"), prompt, params(1)).unwrap();
        let (plan, _) = step(&mut e, 7);
        assert_eq!(plan.num_computed_tokens, vec![hit], "diverging at {diverge}");
        while e.has_unfinished() {
            step(&mut e, 7);
        }
    }
    all_free_after_reset(&mut e);
}

#[test]
fn multi_page_states_list_every_page_and_copy_page_by_page() {
    let mut e = engine_with(cfg(24, true), &[REC2, FULL]);
    assert_eq!(e.layout().groups[0].pages_per_state, 2, "40 bytes over 32-byte pages (24 bytes of padding)");
    e.add_request("a", tokens(0..10), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    let rec = &plan.groups[0];
    assert_eq!((rec.kv_indptr.clone(), rec.kv_indices.clone(), rec.state_slots.clone()), (vec![0, 2], vec![1, 2], vec![1]));
    assert_eq!(plan.block_table(0), (vec![1, 2], 2));
    assert_eq!(row_pages(&plan, 1, 0), vec![3, 4]);
    let plan = e.schedule().unwrap();
    assert_eq!(pairs(&plan), vec![[1, 6], [2, 7]]);
    commit(&mut e, &plan, 7);
    e.add_request("b", tokens(0..10), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![8]);
    let own = plan.groups[0].kv_indices.clone();
    assert_eq!(pairs(&plan), vec![[6, own[0]], [7, own[1]]]);
    commit(&mut e, &plan, 7);
    all_free_after_reset(&mut e);
}

#[test]
fn preempted_requests_rerun_from_their_longest_checkpoint() {
    // Pools from tight to roomy; in each, every re-admission with a hit restores the state
    // by a copy into its own state page, and some preempted request resumes from a checkpoint.
    let mut resumed = 0;
    for num_pages in 9..=20 {
        let mut e = engine_with(EngineConfig { max_num_batched_tokens: 8, ..cfg(num_pages, true) }, &[FULL, REC]);
        e.add_request("a", tokens(100..101), params(15)).unwrap();
        e.add_request("b", tokens(0..9), params(7)).unwrap();
        e.add_request("c", tokens(0..10), params(6)).unwrap();
        let mut admitted = std::collections::HashSet::new();
        for _ in 0..60 {
            if !e.has_unfinished() {
                break;
            }
            let plan = e.schedule().unwrap();
            let rec = &plan.groups[1];
            for (i, id) in plan.request_ids().enumerate() {
                let fresh = plan.new_request_slots.contains(&plan.request_slots[i]);
                assert_eq!(rec.has_initial_state[i], u8::from(plan.num_computed_tokens[i] > 0));
                if fresh && plan.num_computed_tokens[i] > 0 {
                    assert_eq!(plan.num_computed_tokens[i] % 4, 0);
                    assert!(pairs(&plan).iter().any(|p| p[1] == rec.state_slots[i]), "copy-on-write into the own state");
                    if !admitted.insert(id.to_string()) {
                        resumed += 1; // a second admission: after preemption
                    }
                } else if fresh {
                    admitted.insert(id.to_string());
                }
            }
            commit(&mut e, &plan, 7);
        }
        assert!(!e.has_unfinished());
        all_free_after_reset(&mut e);
    }
    assert!(resumed > 0, "a preempted request resumed from a checkpoint");
}

#[test]
fn abort_frees_the_state_and_an_in_flight_checkpoint_still_registers() {
    let mut e = engine_with(cfg(16, true), &[FULL, REC]);
    e.add_request("a", tokens(0..10), params(4)).unwrap();
    step(&mut e, 7); // 0..8
    let plan = e.schedule().unwrap(); // carries the copy 3 -> 5
    assert_eq!(pairs(&plan), vec![[3, 5]]);
    assert!(e.abort("a"));
    assert_eq!(e.pool().ref_count(3), 0, "the state is freed at once");
    assert_eq!(e.pool().ref_count(5), 1, "the checkpoint copy is in flight");
    let outs = commit(&mut e, &plan, 7);
    assert_eq!(outs[0].finish_reason.map(|r| r.as_str()), Some("abort"));
    assert!(e.pool().is_cached(5), "the copy ran before the forward: the checkpoint is valid");
    all_free_after_reset(&mut e);
}

#[test]
fn a_discarded_plan_restarts_its_recurrent_rows_and_drops_its_checkpoints() {
    let mut e = engine_with(cfg(16, true), &[FULL, REC]);
    e.add_request("a", tokens(0..10), params(4)).unwrap();
    step(&mut e, 7); // 0..8
    let plan = e.schedule().unwrap();
    assert_eq!(pairs(&plan), vec![[3, 5]]);
    e.discard_plan();
    // The forward may have advanced a's state in place: a recomputes, from a hit if any
    // (none: the checkpoint at 8 was dropped), with a fresh state.
    assert_eq!(e.num_waiting(), 1);
    assert!(!e.pool().is_cached(5));
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0]);
    assert_eq!(plan.groups[1].has_initial_state, vec![0]);
    assert_eq!(plan.new_request_slots, vec![0]);
    commit(&mut e, &plan, 7);
    run_to_completion(&mut e, 7, 20);
    all_free_after_reset(&mut e);
}

#[test]
fn the_pool_must_hold_one_request_and_its_checkpoint() {
    // 4 full pages + 1 state + 1 checkpoint in flight = 6 usable pages.
    assert!(Engine::new(cfg(7, true), &[FULL, REC]).is_ok());
    assert!(Engine::new(cfg(6, true), &[FULL, REC]).is_err());
    assert!(Engine::new(cfg(6, false), &[FULL, REC]).is_ok());
}
