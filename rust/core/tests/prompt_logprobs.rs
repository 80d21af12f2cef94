//! Prompt logprobs (`SamplingParams::prompt_logprobs`): the plan marks each token whose next
//! prompt token's logprob is wanted (`prompt_logprob_targets`), the runner returns one entry per
//! mark in token order, and the engine records them per prompt token, exactly once, across
//! chunked prefill, other rows, preemption by recompute and a prefix cache that would
//! otherwise skip the prompt. A bad output is refused naming the field, with nothing recorded.

mod common;
use common::*;
use resin_core::{BatchPlan, Engine, EngineConfig, ForwardOutputRef, KvCacheSpec, SamplingParams};

fn cfg(budget: u32, num_pages: u32) -> EngineConfig {
    EngineConfig {
        page_size: 4,
        num_pages,
        max_model_len: 32,
        max_num_batched_tokens: budget,
        enable_prefix_caching: true,
        ..EngineConfig::default()
    }
}

fn with_prompt_logprobs(max_tokens: u32, k: u32) -> SamplingParams {
    SamplingParams { prompt_logprobs: Some(k), ..params(max_tokens) }
}

/// A runner's answer: token 7 for every row; for mark m, the logprob -(target + m / 1000)
/// (so the recorded value says which mark it came from) and, with `k` columns, top entries
/// (id 100 + j, logprob -j).
fn commit_marked(e: &mut Engine, plan: &BatchPlan, k: usize) -> Result<Vec<resin_core::RequestOutput>, resin_core::CoreError> {
    let s = plan.num_sequences as usize;
    let ids = vec![7u32; s];
    let indptr: Vec<u32> = (0..=s as u32).collect();
    let marks: Vec<i64> = plan.prompt_logprob_targets.iter().copied().filter(|&t| t >= 0).collect();
    let logprobs: Vec<f32> = marks.iter().enumerate().map(|(m, &t)| -(t as f32 + m as f32 / 1000.0)).collect();
    let top_ids: Vec<u32> = (0..marks.len()).flat_map(|_| (0..k as u32).map(|j| 100 + j)).collect();
    let top_lps: Vec<f32> = (0..marks.len()).flat_map(|_| (0..k).map(|j| -(j as f32))).collect();
    e.update(
        plan.step,
        &ForwardOutputRef {
            token_ids: &ids,
            token_indptr: &indptr,
            prompt_logprobs: (!marks.is_empty()).then_some(&logprobs[..]),
            prompt_top_logprob_ids: (k > 0 && !marks.is_empty()).then_some(&top_ids[..]),
            prompt_top_logprobs: (k > 0 && !marks.is_empty()).then_some(&top_lps[..]),
            num_prompt_top_logprobs: k,
            ..Default::default()
        },
    )
}

#[test]
fn every_prompt_token_after_the_first_gets_one_entry_across_chunks() {
    // Budget 4: the 10-token prompt runs in chunks of 4, 4, 2.
    let mut e = engine_with(cfg(4, 32), &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    let prompt: Vec<u32> = (20..30).collect();
    e.add_request("a", prompt.clone(), with_prompt_logprobs(2, 2)).unwrap();
    let mut targets = Vec::new();
    let mut outputs = Vec::new();
    while e.has_unfinished() {
        let plan = e.schedule().unwrap();
        let t = plan.prompt_logprob_targets.len();
        assert!(t == 0 || t == plan.input_ids.len(), "empty, or one entry per token");
        for (t, &target) in plan.prompt_logprob_targets.iter().enumerate() {
            if target >= 0 {
                assert_eq!(target, i64::from(prompt[plan.positions[t] as usize + 1]), "the next prompt token");
                assert_eq!(plan.sampling.num_prompt_logprobs[0], 2);
                targets.push(target);
            }
        }
        outputs.extend(commit_marked(&mut e, &plan, 2).unwrap());
    }
    assert_eq!(targets, (21..30).map(i64::from).collect::<Vec<_>>(), "positions 0..=8, once each");
    let entries = outputs[0].prompt_logprobs().expect("asked for");
    assert_eq!(entries.len(), 9);
    for (i, entry) in entries.iter().enumerate() {
        let target = prompt[i + 1];
        assert_eq!(entry[0].0, target);
        assert!((entry[0].1 + target as f32).abs() < 0.01);
        assert_eq!(&entry[1..], &[(100, 0.0), (101, -1.0)]);
    }
    // Decode steps carry no targets: the arrays stay empty.
    assert!(outputs.iter().all(|o| o.prompt_logprobs().unwrap().len() == 9));
}

#[test]
fn only_rows_that_ask_are_marked_and_entries_follow_token_order() {
    let mut e = engine_with(cfg(64, 32), &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    e.add_request("plain", vec![1, 2, 3, 4, 5], params(1)).unwrap();
    e.add_request("asks", vec![9, 8, 7], with_prompt_logprobs(1, 0)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.prompt_logprob_targets, vec![-1, -1, -1, -1, -1, 8, 7, -1]);
    assert_eq!(plan.sampling.num_prompt_logprobs, vec![-1, 0]);
    let outs = commit_marked(&mut e, &plan, 0).unwrap();
    let asks = outs.iter().find(|o| o.request_id() == "asks").unwrap();
    // Marks 0 and 1 of the plan: -(8 + 0.000) and -(7 + 0.001).
    let entries = asks.prompt_logprobs().unwrap();
    assert_eq!(entries.iter().map(|e| e[0].0).collect::<Vec<_>>(), vec![8, 7]);
    assert!((entries[1][0].1 + 7.001).abs() < 1e-4);
    assert!(outs.iter().find(|o| o.request_id() == "plain").unwrap().prompt_logprobs().is_none());
    // A plan without such rows has no targets array at all.
    e.add_request("later", vec![1, 2], params(1)).unwrap();
    assert!(e.schedule().unwrap().prompt_logprob_targets.is_empty());
}

#[test]
fn a_request_asking_for_them_takes_no_prefix_hit_until_recorded() {
    let mut e = engine_with(cfg(64, 32), &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    let prompt: Vec<u32> = (40..53).collect();
    e.add_request("warm", prompt.clone(), params(1)).unwrap();
    run_to_completion(&mut e, 7, 10);
    e.add_request("cold", prompt.clone(), with_prompt_logprobs(1, 0)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0], "every position's logits are needed");
    let outs = commit_marked(&mut e, &plan, 0).unwrap();
    assert_eq!((outs[0].num_cached_tokens, outs[0].prompt_logprobs().unwrap().len()), (0, 12));
    e.add_request("hit", prompt, params(1)).unwrap();
    assert_eq!(e.schedule().unwrap().num_computed_tokens, vec![12], "others still hit");
}

#[test]
fn preemption_recomputes_without_recording_twice() {
    // 6 pages of 4 tokens: two 10-token prompts chunked at 8 tokens a step fill them; the
    // second request is preempted when the first needs a 4th page, then resumes from scratch.
    let mut e = engine_with(
        EngineConfig { enable_prefix_caching: false, max_model_len: 20, ..cfg(8, 7) },
        &[KvCacheSpec::Full { bytes_per_token: 8 }],
    );
    e.add_request("old", (60..70).collect(), params(9)).unwrap();
    e.add_request("new", (80..90).collect(), with_prompt_logprobs(3, 0)).unwrap();
    let mut marks = Vec::new();
    let mut last = None;
    let mut recomputed = false;
    for _ in 0..60 {
        if !e.has_unfinished() {
            break;
        }
        let plan = e.schedule().unwrap();
        marks.extend(plan.prompt_logprob_targets.iter().copied().filter(|&t| t >= 0));
        let new_row = plan.request_ids().position(|id| id == "new");
        recomputed |= new_row.is_some_and(|i| plan.num_computed_tokens[i] == 0 && last.is_some());
        for out in commit_marked(&mut e, &plan, 0).unwrap() {
            if out.request_id() == "new" {
                last = Some(out);
            }
        }
    }
    assert!(!e.metrics_text().contains("resin:num_preemptions_total 0\n"), "a preemption happened");
    let entries = last.unwrap().prompt_logprobs().unwrap();
    assert_eq!(entries.iter().map(|e| e[0].0).collect::<Vec<_>>(), (81..90).collect::<Vec<_>>());
    assert_eq!(marks, (81..90).collect::<Vec<i64>>(), "the recomputed prompt marks nothing again");
    assert!(recomputed, "new was preempted after its prompt and recomputed it");
}

#[test]
fn a_bad_prompt_logprob_output_is_refused_and_nothing_is_recorded() {
    let mut e = engine_with(cfg(64, 32), &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    e.add_request("a", vec![1, 2, 3, 4], with_prompt_logprobs(1, 2)).unwrap();
    let plan = e.schedule().unwrap();
    let (ids, indptr) = (vec![7u32], vec![0u32, 1]);
    let missing = ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() };
    let err = e.update(plan.step, &missing).unwrap_err().to_string();
    assert!(err.contains("prompt_logprobs is missing"), "{err}");
    let short = ForwardOutputRef { prompt_logprobs: Some(&[-1.0, -2.0]), ..missing };
    let err = e.update(plan.step, &short).unwrap_err().to_string();
    assert!(err.contains("prompt_logprobs must have one entry per"), "{err}");
    let narrow = ForwardOutputRef { prompt_logprobs: Some(&[-1.0, -2.0, -3.0]), ..missing };
    let err = e.update(plan.step, &narrow).unwrap_err().to_string();
    assert!(err.contains("asked for 2 top prompt logprobs"), "{err}");
    let outs = commit_marked(&mut e, &plan, 2).unwrap();
    assert_eq!(outs[0].prompt_logprobs().unwrap().len(), 3, "recorded once, by the good output");
}

#[test]
fn prompt_logprobs_past_the_cap_are_refused_naming_the_field() {
    let mut e = engine(cfg(64, 32));
    let err = e.add_request("a", vec![1, 2], with_prompt_logprobs(1, 21)).unwrap_err().to_string();
    assert!(err.contains("SamplingParams.prompt_logprobs"), "{err}");
}
