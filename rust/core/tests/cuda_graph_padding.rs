//! CUDA-graph padding: with `cuda_graph_batch_sizes` set, a pure-decode step reports the
//! smallest bucket >= S as `padded_num_sequences`; mixed and prefill steps, verify rows and
//! batches above every bucket report S; no buckets (the default) never pads. The plan's
//! arrays stay S rows long whatever the bucket.

mod common;
use common::*;
use resin_core::{EngineConfig, KvCacheSpec};

fn buckets(sizes: &[u32]) -> EngineConfig {
    EngineConfig { cuda_graph_batch_sizes: sizes.to_vec(), ..config(4, 64) }
}

#[test]
fn the_bucket_is_the_smallest_one_that_holds_a_pure_decode_step() {
    let c = buckets(&[1, 2, 4, 8]);
    let chosen: Vec<u32> = (0..=10).map(|s| c.padded_num_sequences(s, s)).collect();
    assert_eq!(chosen, vec![0, 1, 2, 4, 4, 8, 8, 8, 8, 9, 10], "0 rows: 0; above 8: S itself");
    assert_eq!(c.padded_num_sequences(3, 2), 3, "a step with a prefill chunk (or verify row) is not padded");
    assert_eq!(c.padded_num_sequences(5, 0), 5);
    let none = config(4, 64);
    assert!((0..10).all(|s| none.padded_num_sequences(s, s) == s), "no buckets: never padded");
}

#[test]
fn buckets_must_be_strictly_ascending_and_positive() {
    for bad in [vec![0, 2], vec![2, 1], vec![4, 4]] {
        let err = buckets(&bad).validate().unwrap_err().to_string();
        assert!(err.contains("cuda_graph_batch_sizes"), "{err}");
    }
    assert!(buckets(&[]).validate().is_ok());
    assert!(buckets(&[3]).validate().is_ok());
}

#[test]
fn decode_steps_are_padded_and_mixed_steps_are_not() {
    let mut e = engine(EngineConfig { max_num_batched_tokens: 64, ..buckets(&[2, 8]) });
    for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
        e.add_request(id, tokens(10 * i as u32..10 * i as u32 + 3), params(4)).unwrap();
    }
    let (plan, _) = step(&mut e, 5);
    assert_eq!((plan.num_sequences, plan.num_decode_sequences, plan.padded_num_sequences), (3, 0, 3), "prefill");
    let (plan, _) = step(&mut e, 5);
    assert_eq!((plan.num_sequences, plan.num_decode_sequences, plan.padded_num_sequences), (3, 3, 8), "decode");
    // The arrays describe the 3 real rows only.
    assert_eq!((plan.query_indptr.len(), plan.seq_lens.len(), plan.groups[0].kv_indptr.len()), (4, 3, 4));
    assert_eq!((plan.input_ids.len(), plan.groups[0].slot_mapping.len()), (3, 3));
    // A new prompt joins: a mixed step (decode rows + a prefill chunk) is not padded.
    e.add_request("d", tokens(40..43), params(4)).unwrap();
    let (plan, _) = step(&mut e, 5);
    assert_eq!((plan.num_sequences, plan.num_decode_sequences, plan.padded_num_sequences), (4, 3, 4));
    assert_eq!(plan.num_tokens, 6);
    let (plan, _) = step(&mut e, 5);
    assert_eq!((plan.num_sequences, plan.num_decode_sequences, plan.padded_num_sequences), (4, 4, 8), "decode again");
}

#[test]
fn a_batch_above_every_bucket_runs_at_its_own_size() {
    let mut e = engine(buckets(&[1, 2]));
    for id in ["a", "b", "c"] {
        e.add_request(id, tokens(0..3), params(3)).unwrap();
    }
    step(&mut e, 5);
    let (plan, _) = step(&mut e, 5);
    assert_eq!((plan.num_decode_sequences, plan.padded_num_sequences), (3, 3));
}

#[test]
fn verify_rows_are_not_padded() {
    let config =
        EngineConfig { num_speculative_tokens: 2, ngram_prompt_lookup_min: 1, ngram_prompt_lookup_max: 3, ..buckets(&[2, 4]) };
    let mut e = engine_with(config, &[KvCacheSpec::Full { bytes_per_token: 8 }]);
    // The prompt's tail repeats, so after sampling 3 the drafter proposes [1, 2].
    e.add_request("a", vec![5, 1, 2, 3, 1, 2, 3, 1, 2], params(8)).unwrap();
    step(&mut e, 3);
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_draft_tokens, vec![2], "a verify row");
    assert_eq!((plan.num_sequences, plan.num_decode_sequences, plan.padded_num_sequences), (1, 0, 1));
}
