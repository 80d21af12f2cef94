//! Speculative decoding with the n-gram drafter, exact ids: after a committed step the engine
//! proposes drafts (what followed the last occurrence of the sequence's tail), the next plan
//! verifies them in one row of 1 + k tokens (`num_draft_tokens`, 1 + k sampling rows), and the
//! engine commits the longest prefix the runner's tokens agree with plus the token after it.
//! Rejected positions are recomputed (their KV slots rewritten), nothing is leaked, an EOS or
//! `max_tokens` inside the accepted run ends the request there, and the prefix cache only
//! hashes committed tokens.

mod common;
use common::*;
use resin_core::{BatchPlan, Engine, EngineConfig, ForwardOutputRef, KvCacheSpec, RequestOutput, SamplingParams};

const EOS: u32 = 50;

fn cfg(k: u32) -> EngineConfig {
    EngineConfig {
        page_size: 4,
        num_pages: 64,
        max_model_len: 40,
        max_num_batched_tokens: 64,
        eos_token_ids: vec![EOS],
        num_speculative_tokens: k,
        ngram_prompt_lookup_min: 1,
        ngram_prompt_lookup_max: 3,
        ..EngineConfig::default()
    }
}

/// Commits `plan` with `tokens[i]` for row i (as many as it samples).
fn commit_rows(e: &mut Engine, plan: &BatchPlan, tokens: &[&[u32]]) -> Vec<RequestOutput> {
    let ids: Vec<u32> = tokens.iter().flat_map(|t| t.iter().copied()).collect();
    let mut indptr = vec![0u32];
    for t in tokens {
        indptr.push(indptr.last().unwrap() + t.len() as u32);
    }
    e.update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() }).unwrap()
}

/// A prompt whose tail repeats: after sampling 3 the drafter proposes [1, 2, 3].
fn started(k: u32, max_tokens: u32) -> Engine {
    let mut e = engine_with(cfg(k), &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    e.add_request("a", vec![5, 1, 2, 3, 1, 2, 3, 1, 2], SamplingParams { max_tokens, ..params(max_tokens) }).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_draft_tokens, vec![0]);
    commit_rows(&mut e, &plan, &[&[3]]);
    e
}

#[test]
fn a_verify_row_carries_the_drafts_and_samples_every_position() {
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    assert_eq!(plan.input_ids, vec![3, 1, 2, 3], "the last token, then the drafts");
    assert_eq!(plan.positions, vec![9, 10, 11, 12]);
    assert_eq!((plan.num_draft_tokens.clone(), plan.sample_indptr.clone()), (vec![3], vec![0, 4]));
    assert_eq!(plan.num_decode_sequences, 0, "a verify row is not a one-token decode row");
    assert_eq!(plan.seq_lens, vec![13]);
    // Every accepted: 1, 2, 3 agree and 9 follows.
    let outs = commit_rows(&mut e, &plan, &[&[1, 2, 3, 9]]);
    assert_eq!(outs[0].new_token_ids(), vec![1, 2, 3, 9]);
    let m = e.metrics();
    assert_eq!((m.spec_decode_num_drafts, m.spec_decode_num_draft_tokens, m.spec_decode_num_accepted_tokens), (1, 3, 3));
    assert_eq!(m.spec_decode_num_accepted_tokens_per_pos, vec![1, 1, 1]);
    // 14 tokens, 13 computed: the next row starts at 13.
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![13]);
    e.check_integrity().unwrap();
}

#[test]
fn a_rejection_keeps_the_correction_and_recomputes_from_it() {
    // None accepted: 7 disagrees with draft 1, so 7 is the one new token.
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    let outs = commit_rows(&mut e, &plan, &[&[7, 2, 3, 4]]);
    assert_eq!(outs[0].new_token_ids(), vec![7]);
    let plan = e.schedule().unwrap();
    assert_eq!((plan.num_computed_tokens.clone(), plan.input_ids[0]), (vec![10], 7));
    // Partial: after 7 the tail [.., 3, 7] has no earlier match of length >= 1 for 7: a
    // plain decode row; the engine proposes again after it.
    assert_eq!(plan.num_draft_tokens, vec![0]);
    e.check_integrity().unwrap();

    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    let outs = commit_rows(&mut e, &plan, &[&[1, 2, 5, 6]]);
    assert_eq!(outs[0].new_token_ids(), vec![1, 2, 5], "1 and 2 agree; 5 replaces draft 3");
    assert_eq!(e.metrics().spec_decode_num_accepted_tokens, 2);
    assert_eq!(e.metrics().spec_decode_num_accepted_tokens_per_pos, vec![1, 1, 0], "positions 0 and 1");
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![12], "3, 1 and 2 computed; 5 is the next input");
    assert_eq!(plan.input_ids[0], 5);
    e.check_integrity().unwrap();
}

#[test]
fn eos_and_max_tokens_inside_the_accepted_run_end_the_request_there() {
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    let outs = commit_rows(&mut e, &plan, &[&[1, EOS, 3, 9]]);
    assert_eq!(outs[0].new_token_ids(), vec![1, EOS]);
    assert!(outs[0].finished && outs[0].finish_reason.map(|r| r.as_str()) == Some("stop"));
    assert_eq!(e.num_free_pages(), 63, "every page back");
    // max_tokens 3: one token out, so drafts are capped at 3 - 1 - 1 = 1.
    let mut e = started(3, 3);
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_draft_tokens, vec![1]);
    let outs = commit_rows(&mut e, &plan, &[&[1, 2]]);
    assert_eq!(outs[0].new_token_ids(), vec![1, 2]);
    assert!(outs[0].finished && outs[0].finish_reason.map(|r| r.as_str()) == Some("length"));
    assert_eq!(e.num_free_pages(), 63);
}

#[test]
fn abort_and_preemption_with_drafts_pending_lose_nothing() {
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    assert!(e.abort("a"));
    let outs = commit_rows(&mut e, &plan, &[&[1, 2, 3, 9]]);
    assert_eq!(outs[0].finish_reason.map(|r| r.as_str()), Some("abort"));
    assert_eq!(e.num_free_pages(), 63);
    e.check_integrity().unwrap();
    // A pool too small for two requests: the newer is preempted (its drafts dropped) and
    // recomputes; both finish and every page comes back.
    let mut config = cfg(3);
    config.num_pages = 9;
    config.max_model_len = 24;
    let mut e = engine_with(config, &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    for id in ["a", "b"] {
        e.add_request(id, vec![5, 1, 2, 3, 1, 2, 3, 1, 2], params(12)).unwrap();
    }
    for _ in 0..200 {
        if !e.has_unfinished() {
            break;
        }
        let plan = e.schedule().unwrap();
        // Agree with every draft: maximal growth per step, so the pool runs short.
        let tokens: Vec<Vec<u32>> = (0..plan.num_sequences as usize)
            .map(|i| {
                let samples = (plan.sample_indptr[i + 1] - plan.sample_indptr[i]) as usize;
                let end = plan.query_indptr[i + 1] as usize;
                let k = plan.num_draft_tokens[i] as usize;
                let mut t: Vec<u32> = plan.input_ids[end - k..end].to_vec();
                t.push(3);
                t.truncate(samples.max(1));
                t
            })
            .collect();
        let refs: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
        commit_rows(&mut e, &plan, &refs);
        e.check_integrity().unwrap();
    }
    assert!(!e.has_unfinished());
    assert!(e.metrics().num_preemptions > 0, "the pool was meant to force preemption");
    assert!(e.metrics().spec_decode_num_accepted_tokens > 0);
    assert_eq!(e.num_free_pages(), 8);
}

#[test]
fn the_prefix_cache_hashes_only_committed_tokens() {
    // Rejected: 10 tokens computed, page 2 (positions 8..12) holds two rejected drafts'
    // KV at 10, 11: only pages 0 and 1 are hashed.
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    commit_rows(&mut e, &plan, &[&[7, 2, 3, 4]]);
    assert_eq!(e.pool().num_cached_pages(), 2);
    // Accepted: drafts 1, 2, 3 agreed, 13 positions computed, pages 0..=2 full of committed
    // tokens: three hashed.
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    commit_rows(&mut e, &plan, &[&[1, 2, 3, 9]]);
    assert_eq!(e.pool().num_cached_pages(), 3);
    // A new request with a's committed tokens hits all three pages.
    let mut prompt = vec![5, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3];
    prompt.push(9);
    e.add_request("b", prompt, params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens.last(), Some(&12));
}

#[test]
fn recurrent_states_are_saved_before_a_verify_row_and_restored_after_a_rejection() {
    // Full + recurrent (one page per state): a request holds its state (page 1) and a spare
    // (page 2), allocated with its first pages.
    let specs = [KvCacheSpec::Full { bytes_per_token: 8 }, KvCacheSpec::Recurrent { state_bytes: 16 }];
    let mut e = engine_with(EngineConfig { enable_prefix_caching: false, ..cfg(3) }, &specs);
    e.add_request("a", vec![5, 1, 2, 3, 1, 2, 3, 1, 2], params(10)).unwrap();
    let plan = e.schedule().unwrap();
    let state = row_pages(&plan, 1, 0);
    assert_eq!(state.len(), 1, "the plan lists the state only, not the spare");
    commit_rows(&mut e, &plan, &[&[3]]);
    // The verify row saves the state into the spare before its forward.
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_draft_tokens, vec![3]);
    assert_eq!(plan.copy_pages.len(), 2, "one (src, dst) pair");
    let (src, spare) = (plan.copy_pages[0], plan.copy_pages[1]);
    assert_eq!(src, state[0]);
    // Partial accept (1 agrees, 5 replaces 2): the state advanced over rejected drafts, so
    // the next plan restores it from the spare and recomputes from the row's start (9).
    let outs = commit_rows(&mut e, &plan, &[&[1, 5, 7, 7]]);
    assert_eq!(outs[0].new_token_ids(), vec![1, 5]);
    let plan = e.schedule().unwrap();
    assert_eq!(plan.copy_pages, vec![spare, src]);
    assert_eq!((plan.num_computed_tokens.clone(), plan.input_ids.clone()), (vec![9], vec![3, 1, 5]));
    assert_eq!(plan.num_draft_tokens, vec![0]);
    commit_rows(&mut e, &plan, &[&[2]]);
    // Fully accepted rows need no restore.
    let plan = e.schedule().unwrap();
    assert!(plan.num_draft_tokens[0] > 0);
    let k = plan.num_draft_tokens[0] as usize;
    let end = plan.input_ids.len();
    let mut agree: Vec<u32> = plan.input_ids[end - k..].to_vec();
    agree.push(4);
    commit_rows(&mut e, &plan, &[&agree]);
    let plan = e.schedule().unwrap();
    assert!(plan.copy_pages.is_empty() || plan.copy_pages == vec![src, spare], "a save, no restore");
    e.check_integrity().unwrap();
}

#[test]
fn a_runner_drafter_replaces_the_ngram_one() {
    let mut e = started(3, 10);
    let plan = e.schedule().unwrap();
    // All accepted (1, 2, 3, then 9); the runner proposes [4, 4, 4, 4] for what follows 9:
    // the engine keeps k = 3 of them.
    let ids = [1, 2, 3, 9];
    let (drafts, draft_indptr) = ([4u32, 4, 4, 4], [0u32, 4]);
    let out = ForwardOutputRef {
        token_ids: &ids,
        token_indptr: &[0, 4],
        draft_token_ids: Some(&drafts),
        draft_indptr: Some(&draft_indptr),
        ..Default::default()
    };
    e.update(plan.step, &out).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.input_ids, vec![9, 4, 4, 4]);
    // Bad draft arrays are refused and change nothing.
    let bad = ForwardOutputRef {
        token_ids: &[4, 4, 4, 4],
        token_indptr: &[0, 4],
        draft_token_ids: Some(&[1]),
        draft_indptr: Some(&[0, 2]),
        ..Default::default()
    };
    assert!(e.update(plan.step, &bad).unwrap_err().message().contains("draft_indptr"));
    let half = ForwardOutputRef { token_ids: &[4], token_indptr: &[0, 1], draft_token_ids: Some(&[1]), ..Default::default() };
    assert!(e.update(plan.step, &half).unwrap_err().message().contains("together"));
    commit_rows(&mut e, &plan, &[&[4, 4, 4, 4]]);
    e.check_integrity().unwrap();
}
