//! Scheduler scenarios: one rule for prefill and decode, chunked prefill, decode rows
//! first, max_num_seqs, preemption by recompute (tail-first frees, cached prefix
//! survives), FCFS and priority policies, aborts, bad runner output.

mod common;
use common::*;
use resin_core::{EngineConfig, FinishReason, ForwardOutputRef, SamplingParams, SchedulingPolicy};

fn ids(plan: &resin_core::BatchPlan) -> Vec<String> {
    plan.request_ids().map(str::to_string).collect()
}

#[test]
fn chunked_prefill_then_decode_under_the_token_budget() {
    let mut e = engine(EngineConfig { max_num_batched_tokens: 4, ..config(4, 16) });
    e.add_request("a", tokens(0..10), params(2)).unwrap();
    let mut chunks = Vec::new();
    while e.has_unfinished() {
        let (plan, _) = step(&mut e, 5);
        chunks.push((plan.num_computed_tokens[0], plan.num_tokens, plan.sample_indptr.clone()));
    }
    assert_eq!(
        chunks,
        vec![(0, 4, vec![0, 0]), (4, 4, vec![0, 0]), (8, 2, vec![0, 1]), (10, 1, vec![0, 1])],
        "chunks of 4, 4, 2 (only the last samples), then one decode step"
    );
}

#[test]
fn decode_rows_come_first_and_budget_is_shared() {
    let mut e = engine(EngineConfig { max_num_batched_tokens: 6, ..config(4, 32) });
    e.add_request("a", tokens(0..3), params(4)).unwrap();
    step(&mut e, 5);
    e.add_request("b", tokens(10..20), params(4)).unwrap();
    let (plan, _) = step(&mut e, 5);
    assert_eq!(ids(&plan), vec!["a", "b"]);
    assert_eq!(plan.num_decode_sequences, 1);
    assert_eq!(plan.query_indptr, vec![0, 1, 6], "a decodes 1 token, b gets the other 5 of the budget");
    assert_eq!(plan.positions, vec![3, 0, 1, 2, 3, 4]);
    assert_eq!(plan.seq_lens, vec![4, 5]);
    e.add_request("c", tokens(30..33), params(1)).unwrap();
    let (plan, _) = step(&mut e, 5);
    // a decodes, b finishes its prompt with the other 5 tokens; no budget is left for c.
    assert_eq!(ids(&plan), vec!["a", "b"]);
    assert_eq!(plan.query_indptr, vec![0, 1, 6]);
    assert_eq!(plan.sample_indptr, vec![0, 1, 2]);
    let (plan, _) = step(&mut e, 5);
    assert_eq!(ids(&plan), vec!["a", "b", "c"]);
    assert_eq!((plan.num_decode_sequences, plan.query_indptr.clone()), (2, vec![0, 1, 2, 5]));
}

#[test]
fn max_num_seqs_limits_running_requests() {
    let mut e = engine(EngineConfig { max_num_seqs: 2, ..config(4, 32) });
    for id in ["a", "b", "c"] {
        e.add_request(id, tokens(0..3), params(2)).unwrap();
    }
    let (plan, _) = step(&mut e, 5);
    assert_eq!(ids(&plan), vec!["a", "b"]);
    assert_eq!(plan.request_slots, vec![0, 1]);
    assert_eq!(e.num_waiting(), 1);
    let (plan, _) = step(&mut e, 5); // a, b finish
    assert_eq!(plan.num_decode_sequences, 2);
    let (plan, _) = step(&mut e, 5);
    assert_eq!(ids(&plan), vec!["c"]);
    assert_eq!(plan.finished_request_slots, vec![0, 1]);
    assert_eq!(plan.new_request_slots, vec![1], "slot 1 was released last, so it is reused first");
}

#[test]
fn preemption_frees_the_newest_request_tail_first_and_it_resumes_from_its_prefix() {
    // 6 usable pages of 4 tokens; two requests of 8-token prompts growing to 16 tokens.
    let mut e = engine(EngineConfig { max_model_len: 24, ..config(4, 7) });
    e.add_request("old", tokens(0..8), params(8)).unwrap();
    e.add_request("new", tokens(100..108), params(8)).unwrap();
    let (plan, _) = step(&mut e, 5);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2]);
    assert_eq!(row_pages(&plan, 0, 1), vec![3, 4]);
    // Both decode: each needs a third page at position 8 (pages 5, 6); then at 12 a fourth.
    for _ in 0..4 {
        step(&mut e, 5);
    }
    assert_eq!(e.num_free_pages(), 0);
    let (plan, _) = step(&mut e, 5);
    // old needs page 4 of its table: the pool is empty, so "new" is preempted.
    assert_eq!(ids(&plan), vec!["old"]);
    assert!(e.metrics_text().contains("resin:num_preemptions_total 1\n"));
    assert_eq!(e.num_waiting(), 1);
    // new held pages 3, 4, 6 (all full, so cached); freed tail first they joined the back
    // as 6, 4, 3, and old took page 6 from the front: its prefix 3, 4 survives.
    assert_eq!(e.pool().free_queue(), vec![4, 3]);
    assert_eq!(e.request_pages("old", 0).unwrap(), vec![1, 2, 5, 6]);
    let mut outs = Vec::new();
    let resumed = loop {
        let (plan, o) = step(&mut e, 5);
        outs.extend(o);
        if let Some(i) = ids(&plan).iter().position(|id| id == "new") {
            break (plan.num_computed_tokens[i], row_pages(&plan, 0, i)[..2].to_vec());
        }
    };
    assert_eq!(resumed, (8, vec![3, 4]), "re-admitted from its cached prefix");
    outs.extend(run_to_completion(&mut e, 5, 50));
    let new_out = outs.iter().find(|o| o.request_id() == "new" && o.finished).unwrap();
    assert_eq!(new_out.token_ids().len(), 8);
    assert_eq!(new_out.finish_reason, Some(FinishReason::Length));
    e.check_integrity().unwrap();
}

#[test]
fn priority_policy_serves_lower_values_first_and_preempts_the_highest() {
    let cfg = EngineConfig { policy: SchedulingPolicy::Priority, max_num_seqs: 1, ..config(4, 32) };
    let mut e = engine(cfg);
    for (id, prio) in [("p2", 2), ("p0", 0), ("p1", 1)] {
        e.add_request(id, tokens(0..3), SamplingParams { max_tokens: 1, priority: prio, ..SamplingParams::default() }).unwrap();
    }
    let order: Vec<String> = (0..3).map(|_| ids(&step(&mut e, 5).0)[0].clone()).collect();
    assert_eq!(order, vec!["p0", "p1", "p2"]);

    // Preemption victim under priority: the highest value, even if it is older.
    let mut e = engine(EngineConfig { policy: SchedulingPolicy::Priority, max_model_len: 24, ..config(4, 7) });
    e.add_request("low", tokens(0..8), SamplingParams { max_tokens: 8, priority: 5, ..SamplingParams::default() }).unwrap();
    e.add_request("high", tokens(100..108), SamplingParams { max_tokens: 8, priority: 0, ..SamplingParams::default() }).unwrap();
    for _ in 0..6 {
        step(&mut e, 5);
    }
    assert!(e.metrics_text().contains("resin:num_preemptions_total 1\n"));
    assert_eq!(e.request_pages("low", 0).unwrap(), Vec::<u32>::new(), "low-priority request was preempted");
    run_to_completion(&mut e, 5, 50);
}

#[test]
fn abort_waiting_running_and_mid_prefill_returns_pages() {
    let mut e = engine(EngineConfig { max_num_batched_tokens: 4, ..config(4, 32) });
    e.add_request("mid", tokens(0..12), params(2)).unwrap();
    step(&mut e, 5);
    e.add_request("wait", tokens(0..3), params(2)).unwrap();
    assert!(e.abort("mid"));
    assert!(e.abort("wait"));
    assert!(!e.abort("wait"), "already gone");
    assert_eq!(e.num_free_pages(), 31);
    let (_, outs) = step(&mut e, 5);
    let reasons: Vec<_> = outs.iter().map(|o| (o.request_id().to_string(), o.finish_reason)).collect();
    assert_eq!(reasons, vec![("mid".into(), Some(FinishReason::Abort)), ("wait".into(), Some(FinishReason::Abort))]);
    assert!(!e.has_unfinished());
    // Abort while a plan is in flight: the row is ignored at update.
    e.add_request("r", tokens(0..3), params(4)).unwrap();
    let plan = e.schedule().unwrap();
    assert!(e.abort("r"));
    let outs = commit(&mut e, &plan, 5);
    assert_eq!(outs.len(), 1);
    assert_eq!(outs[0].finish_reason, Some(FinishReason::Abort));
    assert_eq!(e.num_free_pages(), 31);
    e.check_integrity().unwrap();
}

#[test]
fn stop_tokens_min_tokens_and_max_model_len() {
    let mut e = engine(EngineConfig { eos_token_ids: vec![2], ..config(4, 32) });
    e.add_request("eos", tokens(10..13), params(5)).unwrap();
    let (_, outs) = step(&mut e, 2);
    assert_eq!(outs[0].finish_reason, Some(FinishReason::Stop));
    assert_eq!(outs[0].token_ids(), vec![2]);

    e.add_request("min", tokens(10..13), SamplingParams { max_tokens: 5, min_tokens: 2, ..SamplingParams::default() }).unwrap();
    let (plan, outs) = step(&mut e, 2);
    assert_eq!(plan.banned_token_ids, vec![2], "EOS is banned before min_tokens");
    assert!(!outs[0].finished, "EOS before min_tokens does not stop");
    let (plan, outs) = step(&mut e, 2);
    assert_eq!(plan.banned_token_ids, vec![2], "one token generated, min_tokens = 2: still banned");
    assert!(!outs[0].finished);
    let (plan, outs) = step(&mut e, 2);
    assert_eq!(plan.banned_token_ids, Vec::<u32>::new());
    assert_eq!(outs[0].finish_reason, Some(FinishReason::Stop));
    assert_eq!(outs[0].token_ids(), vec![2, 2, 2]);

    e.add_request(
        "ign",
        tokens(10..13),
        SamplingParams { max_tokens: 2, ignore_eos: true, stop_token_ids: vec![7], ..SamplingParams::default() },
    )
    .unwrap();
    let (_, outs) = step(&mut e, 2);
    assert!(!outs[0].finished);
    let (_, outs) = step(&mut e, 7);
    assert_eq!(outs[0].finish_reason, Some(FinishReason::Stop));

    // max_model_len = 16: a 14-token prompt can produce 2 tokens.
    e.add_request("len", tokens(0..14), params(10)).unwrap();
    let outs = run_to_completion(&mut e, 5, 10);
    assert_eq!(outs.last().unwrap().token_ids().len(), 2);
    assert_eq!(outs.last().unwrap().finish_reason, Some(FinishReason::Length));
}

#[test]
fn logit_bias_rides_the_rows_that_sample_sorted_by_token() {
    let mut e = engine(EngineConfig { vocab_size: Some(50), max_num_batched_tokens: 4, ..config(4, 32) });
    let biased = SamplingParams { logit_bias: vec![(9, -100.0), (2, 3.5)], ..params(2) };
    e.add_request("chunked", tokens(0..6), biased).unwrap();
    e.add_request("plain", tokens(10..12), params(2)).unwrap();
    // A 4-token budget: the first chunk of "chunked" does not sample, so carries no bias.
    let (plan, _) = step(&mut e, 1);
    assert_eq!(plan.sample_indptr, vec![0, 0]);
    assert_eq!((plan.logit_bias_indptr, plan.logit_bias_token_ids), (vec![0, 0], vec![]));
    let (plan, _) = step(&mut e, 1);
    assert_eq!(plan.request_id(0), "chunked");
    assert_eq!(plan.logit_bias_indptr, vec![0, 2, 2]);
    assert_eq!(plan.logit_bias_token_ids, vec![2, 9]);
    assert_eq!(plan.logit_bias_values, vec![3.5, -100.0]);
}

#[test]
fn bad_requests_are_rejected_and_nothing_is_queued() {
    let mut e = engine(EngineConfig { vocab_size: Some(50), ..config(4, 32) });
    let cases: Vec<(&str, Vec<u32>, SamplingParams, &str)> = vec![
        ("e", vec![], params(1), "empty"),
        ("l", tokens(0..16), params(1), "max_model_len"),
        ("v", vec![1, 60], params(1), "vocab_size"),
        ("t", vec![1], SamplingParams { temperature: -1.0, ..params(1) }, "temperature"),
        ("p", vec![1], SamplingParams { top_p: 0.0, ..params(1) }, "top_p"),
        ("m", vec![1], SamplingParams { max_tokens: 0, ..params(1) }, "max_tokens"),
        ("n", vec![1], SamplingParams { min_tokens: 5, ..params(2) }, "min_tokens"),
        ("r", vec![1], SamplingParams { repetition_penalty: 0.0, ..params(1) }, "repetition_penalty"),
        ("s", vec![1], SamplingParams { stop_token_ids: vec![99], ..params(1) }, "stop_token_ids"),
        ("b", vec![1], SamplingParams { logit_bias: vec![(60, 1.0)], ..params(1) }, "logit_bias: token 60"),
        ("c", vec![1], SamplingParams { logit_bias: vec![(3, 100.5)], ..params(1) }, "must be in [-100, 100]"),
        ("d", vec![1], SamplingParams { logit_bias: vec![(3, f32::NAN)], ..params(1) }, "must be in [-100, 100]"),
        ("f", vec![1], SamplingParams { logit_bias: vec![(3, 1.0), (4, 2.0), (3, -1.0)], ..params(1) }, "token 3 is given twice"),
    ];
    for (id, prompt, p, field) in cases {
        let err = e.add_request(id, prompt, p).unwrap_err();
        assert!(err.message().contains(field), "{field}: {err}");
    }
    e.add_request("ok", vec![1], params(1)).unwrap();
    let err = e.add_request("ok", vec![1], params(1)).unwrap_err();
    assert!(err.message().contains("already in use"));
    assert_eq!(e.num_waiting(), 1);
}

#[test]
fn bad_output_changes_nothing_and_the_plan_can_be_retried() {
    let mut e = engine(EngineConfig { vocab_size: Some(50), ..config(4, 32) });
    e.add_request("a", tokens(0..5), params(2)).unwrap();
    e.add_request("b", tokens(0..9), params(2)).unwrap();
    let plan = e.schedule().unwrap();
    let free = e.num_free_pages();
    let bad: Vec<(Vec<u32>, Vec<u32>, &str)> = vec![
        (vec![1, 1], vec![0, 1], "num_sequences + 1"),
        (vec![1, 1], vec![0, 2, 1], "non-decreasing"),
        (vec![1, 1], vec![0, 1, 1], "len(token_ids)"),
        (vec![1], vec![0, 0, 1], "returned 0 tokens"),
        (vec![1, 77], vec![0, 1, 2], "vocabulary"),
        (vec![1, 1], vec![1, 1, 2], "[0] must be 0"),
    ];
    for (ids, indptr, msg) in bad {
        let err =
            e.update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() }).unwrap_err();
        assert!(err.message().contains(msg), "{msg}: {err}");
        assert_eq!(e.num_free_pages(), free);
        assert_eq!(e.pending_step(), Some(plan.step));
    }
    let err = e.update(plan.step + 1, &ForwardOutputRef { token_ids: &[1, 1], token_indptr: &[0, 1, 2], ..Default::default() });
    assert!(err.is_err(), "a stale or future step id is refused");
    assert!(e.schedule().is_err(), "a plan is pending");
    let outs = commit(&mut e, &plan, 3);
    assert_eq!(outs.len(), 2);

    // discard_plan: the same work is planned again, lifecycle notices included.
    e.add_request("c", tokens(0..3), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.new_request_slots, vec![2]);
    e.discard_plan();
    let again = e.schedule().unwrap();
    assert_eq!(again.input_ids, plan.input_ids);
    assert_eq!(again.new_request_slots, vec![2]);
    assert_eq!(again.step, plan.step + 1);
    commit(&mut e, &again, 3);
    e.check_integrity().unwrap();
}

#[test]
fn logprobs_are_recorded_per_output_token() {
    let mut e = engine(config(4, 32));
    e.add_request("a", tokens(0..3), SamplingParams { max_tokens: 2, logprobs: Some(1), ..params(2) }).unwrap();
    let plan = e.schedule().unwrap();
    let missing = e.update(plan.step, &ForwardOutputRef { token_ids: &[4], token_indptr: &[0, 1], ..Default::default() });
    assert!(missing.unwrap_err().message().contains("logprobs"));
    let outs = e
        .update(
            plan.step,
            &ForwardOutputRef {
                token_ids: &[4],
                token_indptr: &[0, 1],
                logprobs: Some(&[-0.5]),
                top_logprob_ids: Some(&[4, 9]),
                top_logprobs: Some(&[-0.5, -1.5]),
                num_top_logprobs: 2,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(outs[0].logprobs().unwrap(), vec![vec![(4, -0.5), (4, -0.5)]], "k = 1 of the 2 columns");
    // The next token's entry alone: what a stream reads each step.
    let plan = e.schedule().unwrap();
    let outs = e
        .update(
            plan.step,
            &ForwardOutputRef {
                token_ids: &[7],
                token_indptr: &[0, 1],
                logprobs: Some(&[-0.25]),
                top_logprob_ids: Some(&[7, 4]),
                top_logprobs: Some(&[-0.25, -2.0]),
                num_top_logprobs: 2,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(outs[0].logprobs().unwrap().len(), 2);
    assert_eq!(outs[0].logprobs_from(1).unwrap(), vec![vec![(7, -0.25), (7, -0.25)]]);
    assert_eq!(outs[0].logprobs_from(5).unwrap(), Vec::<Vec<(u32, f32)>>::new(), "clamped");
}

#[test]
fn a_slot_announced_by_a_discarded_plan_is_reported_when_its_request_ends() {
    let mut e = engine(config(4, 32));
    e.add_request("a", tokens(0..3), params(4)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.new_request_slots, vec![0]);
    e.discard_plan(); // the runner may have seen slot 0 already
    assert!(e.abort("a"));
    e.add_request("b", tokens(0..3), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.finished_request_slots, vec![0], "the runner must drop slot 0's state");
    assert_eq!(plan.new_request_slots, vec![0]);
    commit(&mut e, &plan, 5); // b finishes: slot 0 is released again
    e.add_request("c", tokens(0..3), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!((plan.finished_request_slots.clone(), plan.new_request_slots.clone()), (vec![0], vec![0]));
    commit(&mut e, &plan, 5);
}

#[test]
fn empty_plans_keep_lifecycle_notices_for_the_next_plan_with_rows() {
    let mut e = engine(config(4, 32));
    e.add_request("a", tokens(0..3), params(1)).unwrap();
    step(&mut e, 5); // a finishes, slot 0 released
    let (idle, _) = step(&mut e, 5);
    assert_eq!(idle.num_sequences, 0);
    assert!(idle.finished_request_slots.is_empty(), "no runner sees an empty plan");
    e.add_request("b", tokens(0..3), params(1)).unwrap();
    let (plan, _) = step(&mut e, 5);
    assert_eq!(plan.finished_request_slots, vec![0]);
    assert_eq!(plan.new_request_slots, vec![0]);
}

#[test]
fn new_slots_carry_their_requests_tokens_including_outputs_after_preemption() {
    let mut e = engine(config(4, 32));
    e.add_request("a", tokens(10..13), params(3)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.new_request_slots, vec![0]);
    assert_eq!(plan.new_request_token_indptr, vec![0, 3]);
    assert_eq!(plan.new_request_token_ids, vec![10, 11, 12]);
    assert_eq!(plan.new_request_num_prompt_tokens, vec![3]);
    let (plan, _) = step(&mut e, 8);
    assert!(plan.new_request_token_ids.is_empty() && plan.new_request_token_indptr == vec![0]);

    // A preempted request comes back with its prompt and the outputs it already has.
    let mut e = engine(EngineConfig { max_model_len: 24, ..config(4, 7) });
    e.add_request("old", tokens(0..8), params(8)).unwrap();
    e.add_request("new", tokens(100..108), params(8)).unwrap();
    let mut resumed = None;
    for _ in 0..20 {
        let (plan, _) = step(&mut e, 5);
        if plan.finished_request_slots.is_empty() || plan.new_request_slots.is_empty() {
            continue;
        }
        resumed = Some(plan);
        break;
    }
    let plan = resumed.expect("new is preempted and re-admitted");
    let n = plan.new_request_token_indptr[1] as usize;
    assert_eq!(plan.new_request_num_prompt_tokens, vec![8]);
    assert_eq!(&plan.new_request_token_ids[..8], &tokens(100..108)[..]);
    assert!(n > 8 && plan.new_request_token_ids[8..n].iter().all(|&t| t == 5), "outputs so far follow the prompt");
}
