//! Sliding-window groups: pages wholly outside the window go back to the pool every
//! step, the plan lists only in-window pages, block tables keep absolute positions, and
//! prefix hits need every in-window page.

mod common;
use common::*;
use resin_core::{EngineConfig, KvCacheSpec};

const SWA6: KvCacheSpec = KvCacheSpec::SlidingWindow { window: 6, bytes_per_token: 8 };
const FULL: KvCacheSpec = KvCacheSpec::Full { bytes_per_token: 8 };

fn cfg() -> EngineConfig {
    EngineConfig { page_size: 4, num_pages: 32, max_model_len: 32, max_num_batched_tokens: 16, ..EngineConfig::default() }
}

#[test]
fn window_pages_are_released_every_step_and_listed_only_in_window() {
    let mut e = engine_with(cfg(), &[SWA6]);
    e.add_request("a", tokens(0..10), params(8)).unwrap();
    // Prefill positions 0..10 read [0, 10): all three pages.
    let (plan, _) = step(&mut e, 7);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3]);
    assert_eq!(plan.groups[0].slot_mapping, (4..14).collect::<Vec<i64>>());
    // computed = 10: the next query (pos 10) reads (4, 10] = [5, 10]; page 0 (pos 0..4) is out.
    assert_eq!(e.request_pages("a", 0).unwrap(), vec![0, 2, 3]);
    assert_eq!(e.pool().ref_count(1), 0);
    let (plan, _) = step(&mut e, 7); // decode pos 10
    assert_eq!(row_pages(&plan, 0, 0), vec![2, 3]);
    assert_eq!(plan.groups[0].kv_last_page_len, vec![3]);
    let (table, cols) = plan.block_table(0);
    assert_eq!((table, cols), (vec![0, 2, 3], 3), "block table keeps absolute page columns");
    step(&mut e, 7); // pos 11 -> computed 12
    let (plan, _) = step(&mut e, 7); // pos 12 reads [7, 12]: pages 1.. (logical), new page for pos 12
    assert_eq!(row_pages(&plan, 0, 0), vec![2, 3, 4], "released page 1 is cached, so it waits at the back of the queue");
    // computed 13: next query pos 13 reads [8, 13]: logical page 1 (pos 4..8) is out.
    assert_eq!(e.request_pages("a", 0).unwrap(), vec![0, 0, 3, 4]);
    e.check_integrity().unwrap();
}

#[test]
fn hybrid_full_and_window_groups_share_one_pool() {
    let mut e = engine_with(cfg(), &[FULL, SWA6, FULL, SWA6]);
    assert_eq!(e.layout().groups.len(), 2);
    e.add_request("a", tokens(0..10), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    // Both groups allocate from the same queue, position by position.
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3]);
    assert_eq!(row_pages(&plan, 1, 0), vec![4, 5, 6]);
    e.check_integrity().unwrap();
    assert_eq!(e.num_free_pages(), 31);
}

#[test]
fn window_hit_needs_only_in_window_pages() {
    let mut e = engine_with(cfg(), &[SWA6]);
    e.add_request("a", tokens(0..13), params(1)).unwrap();
    step(&mut e, 7);
    // a finished; full pages 0..3 (pos 0..12) were cached before release.
    e.add_request("b", tokens(0..14), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    // Hit of 12 tokens: the query at 12 reads [7, 12] -> logical pages 1, 2 must be cached.
    assert_eq!(plan.num_computed_tokens, vec![12]);
    let pages = e.request_pages("b", 0).unwrap();
    assert_eq!(pages[0], 0, "page before the window is the null page");
    assert_eq!(row_pages(&plan, 0, 0).len(), 3, "listed: logical pages 1, 2 and the new page 3");
    commit(&mut e, &plan, 7);
    e.check_integrity().unwrap();
}

#[test]
fn reset_prefix_cache_drops_hybrid_hits() {
    let mut e = engine_with(EngineConfig { num_pages: 12, max_model_len: 16, ..cfg() }, &[SWA6, FULL]);
    e.add_request("a", tokens(0..9), params(1)).unwrap();
    step(&mut e, 7);
    e.reset_prefix_cache();
    e.add_request("b", tokens(0..9), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0]);
    commit(&mut e, &plan, 7);
}

#[test]
fn max_pages_per_request_is_bounded_by_the_window() {
    // Full attention for 32 tokens would need 8 pages; the window needs at most
    // ceil((6 - 1 + 16) / 4) + 1 = 7, so 7 usable pages are enough for a SWA-only model.
    assert!(resin_core::Engine::new(EngineConfig { num_pages: 8, ..cfg() }, &[SWA6]).is_ok());
    assert!(resin_core::Engine::new(EngineConfig { num_pages: 8, ..cfg() }, &[FULL]).is_err());
}
