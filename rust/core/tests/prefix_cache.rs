//! Exact-id prefix-cache scenarios through the engine (page_size 4), in the style of
//! vLLM's test_prefix_caching.py: which pages a hit reuses, the num_tokens - 1 cap,
//! eviction order, and reset.

mod common;
use common::*;

#[test]
fn second_request_reuses_full_pages_of_the_first() {
    let mut e = engine(config(4, 16));
    e.add_request("a", tokens(0..10), params(1)).unwrap();
    let (plan, outs) = step(&mut e, 99);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3]);
    assert_eq!(outs[0].finish_reason.map(|r| r.as_str()), Some("length"));
    // Freed tail first: page 3 (partial, unhashed) to the front; 2 then 1 (cached) to the back.
    let queue = e.pool().free_queue();
    assert_eq!(queue[0], 3);
    assert_eq!(&queue[queue.len() - 2..], &[2, 1]);
    assert_eq!(e.pool().num_cached_pages(), 2);

    e.add_request("b", tokens(0..12), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![8]);
    assert_eq!(plan.input_ids, vec![8, 9, 10, 11]);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3], "hit pages 1, 2 then a fresh page from the front");
    let outs = commit(&mut e, &plan, 99);
    assert_eq!(outs[0].num_cached_tokens, 8);
    e.check_integrity().unwrap();
}

#[test]
fn hit_is_capped_so_the_last_prompt_token_is_recomputed() {
    let mut e = engine(config(4, 16));
    e.add_request("a", tokens(0..8), params(1)).unwrap();
    step(&mut e, 99);
    assert_eq!(e.pool().num_cached_pages(), 2);
    e.add_request("b", tokens(0..8), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    // 8 tokens cached, but at most 7 may be reused: whole pages only, so 4.
    assert_eq!(plan.num_computed_tokens, vec![4]);
    assert_eq!(plan.input_ids, vec![4, 5, 6, 7]);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2 + 1], "page 2 is hashed-idle; a new page comes from the front");
    commit(&mut e, &plan, 99);
}

#[test]
fn diverging_prompts_share_only_the_common_prefix() {
    let mut e = engine(config(4, 16));
    e.add_request("a", tokens(0..9), params(1)).unwrap();
    step(&mut e, 99);
    let mut other = tokens(0..9);
    other[5] = 500; // second page differs
    e.add_request("b", other, params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![4]);
    let outs = commit(&mut e, &plan, 99);
    assert_eq!(outs[0].num_cached_tokens, 4);
    let text = e.metrics_text();
    assert!(text.contains("resin:prefix_cache_queries_total 18\n"), "{text}");
    assert!(text.contains("resin:prefix_cache_hits_total 4\n"), "{text}");
}

#[test]
fn concurrent_identical_prompts_share_pages_with_refcounts() {
    let mut e = engine(config(4, 16));
    e.add_request("a", tokens(0..9), params(3)).unwrap();
    step(&mut e, 99); // a computed 9, pages 1,2 cached, page 3 partial
    e.add_request("b", tokens(0..9), params(3)).unwrap();
    let plan = e.schedule().unwrap();
    // Rows: a decodes (first), b prefills its last page.
    assert_eq!(plan.request_ids().collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3]);
    assert_eq!(row_pages(&plan, 0, 1), vec![1, 2, 4]);
    assert_eq!(e.pool().ref_count(1), 2);
    assert_eq!(e.pool().ref_count(2), 2);
    commit(&mut e, &plan, 99);
    e.check_integrity().unwrap();
}

#[test]
fn evicted_pages_are_no_longer_hit_and_reset_clears_everything() {
    let mut e = engine(config(4, 5)); // 4 usable pages
    e.add_request("a", tokens(0..9), params(1)).unwrap();
    step(&mut e, 99);
    assert_eq!(e.pool().free_queue(), vec![3, 4, 2, 1]);
    // A 16-token unrelated prompt needs all four pages: it evicts 2 and 1.
    e.add_request("x", tokens(100..115), params(1)).unwrap();
    step(&mut e, 99);
    e.add_request("b", tokens(0..9), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0], "a's pages were evicted");
    commit(&mut e, &plan, 99);
    assert!(e.pool().num_cached_pages() > 0);
    e.reset_prefix_cache();
    assert_eq!(e.pool().num_cached_pages(), 0);
    assert_eq!(e.num_free_pages(), 4);
}

#[test]
fn prefix_caching_off_never_hits() {
    let mut e = engine(resin_core::EngineConfig { enable_prefix_caching: false, ..config(4, 16) });
    e.add_request("a", tokens(0..9), params(1)).unwrap();
    step(&mut e, 99);
    e.add_request("b", tokens(0..9), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0]);
    assert_eq!(e.pool().num_cached_pages(), 0);
    commit(&mut e, &plan, 99);
}
