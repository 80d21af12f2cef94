//! Compressed groups (DeepSeek-V4 CSA / HCA style), exact ids: one entry per `ratio`
//! tokens; a page spans `lcm(page_size, ratio)` tokens (`page_size / ratio` entries when
//! the ratio divides the page size, one entry spanning `ratio / page_size` token pages when
//! the page size divides the ratio). Pages are allocated as entries close, `slot_mapping`
//! marks the token that closes each entry (across chunk boundaries that split a compression
//! window), full compressed pages are cached under the hash of the last token page they
//! cover so hits come in multiples of `lcm(page_size, ratio)` tokens alongside a raw
//! sliding-window group, and preemption, abort and LRU eviction free compressed pages like
//! any other.

mod common;
use common::*;
use resin_core::{BatchPlan, Engine, EngineConfig, KvCacheSpec};

fn swa(window: u32) -> KvCacheSpec {
    KvCacheSpec::SlidingWindow { window, bytes_per_token: 8 }
}

fn csa(ratio: u32) -> KvCacheSpec {
    KvCacheSpec::Compressed { ratio, bytes_per_entry: 8 }
}

fn cfg(num_pages: u32, max_model_len: u32, budget: u32, prefix_caching: bool) -> EngineConfig {
    cfg_ps(2, num_pages, max_model_len, budget, prefix_caching)
}

fn cfg_ps(page_size: u32, num_pages: u32, max_model_len: u32, budget: u32, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        page_size,
        num_pages,
        max_model_len,
        max_num_batched_tokens: budget,
        enable_prefix_caching: prefix_caching,
        ..EngineConfig::default()
    }
}

fn all_free_after_reset(e: &mut Engine) {
    e.reset_prefix_cache();
    assert_eq!(e.num_free_pages(), e.pool().num_pages() - 1);
    e.check_integrity().unwrap();
}

/// Entries per compressed page, worked out here: the fewest whole entries spanning a whole
/// number of token pages.
fn entries_per_page(page_size: u32, ratio: u32) -> u32 {
    (1..=page_size).find(|e| (e * ratio).is_multiple_of(page_size)).unwrap()
}

/// For every row of `plan`, group `g` (compressed, `ratio`): the listed pages hold exactly
/// the entries closed by `seq_len`, `kv_last_page_len` counts entries in the last one, and
/// each token's slot is its closed entry's slot in those pages, -1 if it closes none.
fn check_compressed_rows(plan: &BatchPlan, g: usize, ratio: u32) {
    let gp = &plan.groups[g];
    let ps = entries_per_page(plan.page_size, ratio);
    assert_eq!((gp.ratio, gp.entries_per_page), (ratio, ps));
    for i in 0..plan.num_sequences as usize {
        let listed = row_pages(plan, g, i);
        let num_entries = plan.seq_lens[i] / ratio;
        assert_eq!(listed.len() as u32, num_entries.div_ceil(ps));
        let derived = if listed.is_empty() { 0 } else { (listed.len() as u32 - 1) * ps + gp.kv_last_page_len[i] };
        assert_eq!(derived, num_entries, "num_entries = (listed - 1) * entries_per_page + kv_last_page_len");
        for t in plan.query_indptr[i]..plan.query_indptr[i + 1] {
            let p = plan.positions[t as usize] as u32;
            let want = if (p + 1).is_multiple_of(ratio) {
                let e = p / ratio;
                i64::from(listed[(e / ps) as usize]) * i64::from(ps) + i64::from(e % ps)
            } else {
                -1
            };
            assert_eq!(gp.slot_mapping[t as usize], want, "row {i}, position {p}");
        }
    }
}

#[test]
fn entries_get_pages_as_they_close_and_slots_mark_the_closing_token() {
    // ratio 3, page_size 2: a compressed page holds entries of 6 tokens; 4-token chunks split
    // the windows [3, 6) and [9, 12).
    let mut e = engine_with(cfg(32, 32, 4, false), &[swa(6), csa(3)]);
    assert_eq!(e.layout().groups[1].spec.ratio(), Some(3));
    e.add_request("a", tokens(0..11), params(3)).unwrap();
    // [0, 4): token 2 closes entry 0 (page 3, offset 0).
    let (plan, _) = step(&mut e, 7);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2]);
    assert_eq!(row_pages(&plan, 1, 0), vec![3]);
    assert_eq!(plan.groups[1].slot_mapping, vec![-1, -1, 6, -1]);
    assert_eq!(plan.groups[1].kv_last_page_len, vec![1]);
    check_compressed_rows(&plan, 1, 3);
    // [4, 8): token 5 closes entry 1, whose window [3, 6) began in the previous chunk; no
    // new compressed page (entry 1 is page 3's second).
    let (plan, _) = step(&mut e, 7);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 4, 5]);
    assert_eq!(row_pages(&plan, 1, 0), vec![3]);
    assert_eq!(plan.groups[1].slot_mapping, vec![-1, 7, -1, -1]);
    assert_eq!(plan.groups[1].kv_last_page_len, vec![2]);
    // [8, 11): the window moved past page 1 (released to the front of the queue and reused
    // by the window); token 8 closes entry 2, the first of a new compressed page 7.
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(row_pages(&plan, 0, 0), vec![2, 4, 5, 1, 6]);
    assert_eq!(row_pages(&plan, 1, 0), vec![3, 7]);
    assert_eq!(plan.groups[1].slot_mapping, vec![14, -1, -1]);
    assert_eq!(plan.groups[1].kv_last_page_len, vec![1]);
    assert_eq!(outs[0].num_output_tokens, 1);
    // Decode at 11 closes entry 3 (page 7, offset 1); decode at 12 closes none.
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.groups[1].slot_mapping, vec![15]);
    assert_eq!(plan.block_table(1), (vec![3, 7], 2));
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(plan.groups[1].slot_mapping, vec![-1]);
    assert_eq!((row_pages(&plan, 1, 0), plan.groups[1].kv_last_page_len.clone()), (vec![3, 7], vec![2]));
    assert!(outs[0].finished);
    assert_eq!(e.num_free_pages(), 31);
    e.check_integrity().unwrap();
}

#[test]
fn a_row_with_no_closed_entry_lists_no_compressed_page() {
    let mut e = engine_with(cfg(32, 32, 64, false), &[csa(4), swa(8)]);
    e.add_request("a", tokens(0..3), params(2)).unwrap();
    let (plan, _) = step(&mut e, 7);
    let g = &plan.groups[0];
    assert_eq!((g.kv_indptr.clone(), g.kv_last_page_len.clone(), g.slot_mapping.clone()), (vec![0, 0], vec![0], vec![-1; 3]));
    assert_eq!(plan.block_table(0), (vec![], 0));
    assert_eq!(row_pages(&plan, 1, 0), vec![1, 2]);
    // Decode at 3 closes entry 0: its page (one entry: ratio 4 > page_size 2) is allocated now.
    let (plan, _) = step(&mut e, 7);
    assert_eq!((row_pages(&plan, 0, 0), plan.groups[0].slot_mapping.clone()), (vec![3], vec![3]));
    check_compressed_rows(&plan, 0, 4);
    assert_eq!(e.num_free_pages(), 31);
}

/// ratio 4, page_size 2 (a compressed page = one entry = 4 tokens = 2 token pages), raw
/// window 4, 13 usable pages. `a` (11 tokens) ran and finished: window pages 1..=6
/// (1..=5 hashed H0..H4), compressed pages 7 (entry 0, under H1) and 8 (entry 1, under H3).
fn engine_after_a() -> Engine {
    let mut e = engine_with(cfg(14, 12, 64, true), &[swa(4), csa(4)]);
    e.add_request("a", tokens(0..11), params(1)).unwrap();
    let (plan, outs) = step(&mut e, 7);
    assert!(outs[0].finished);
    assert_eq!(row_pages(&plan, 0, 0), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(row_pages(&plan, 1, 0), vec![7, 8]);
    assert_eq!(plan.groups[1].slot_mapping, vec![-1, -1, -1, 7, -1, -1, -1, 8, -1, -1, -1]);
    check_compressed_rows(&plan, 1, 4);
    // Freed last position first: a compressed page goes with the last token page it covers;
    // the unhashed page 6 to the front, the rest to the LRU end.
    let q = e.pool().free_queue();
    assert_eq!(&q[..3], &[6, 9, 10]);
    assert_eq!(&q[q.len() - 7..], &[5, 4, 8, 3, 2, 7, 1]);
    e
}

#[test]
fn hits_come_in_whole_compressed_pages_with_the_window_alongside() {
    let mut e = engine_after_a();
    e.add_request("b", tokens(0..11), params(1)).unwrap();
    let plan = e.schedule().unwrap();
    // The window alone could serve 10 tokens (5 pages); the compressed group serves 8
    // (2 pages of 4 tokens). At 8 the window needs positions 5..8: pages 3, 4.
    assert_eq!((plan.num_computed_tokens.clone(), plan.num_tokens), (vec![8], 3));
    assert_eq!(row_pages(&plan, 0, 0), vec![3, 4, 6, 9]);
    assert_eq!(row_pages(&plan, 1, 0), vec![7, 8]);
    assert_eq!(plan.groups[1].slot_mapping, vec![-1, -1, -1], "entry 2 closes at 11");
    check_compressed_rows(&plan, 1, 4);
    let outs = commit(&mut e, &plan, 7);
    assert_eq!(outs[0].num_cached_tokens, 8);
    // Diverging at token 6 (token page 3) breaks the compressed chain after page 0: hit 4.
    let mut prompt = tokens(0..11);
    prompt[6] = 500;
    e.add_request("c", prompt, params(1)).unwrap();
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(plan.num_computed_tokens, vec![4]);
    assert_eq!(&row_pages(&plan, 1, 0)[..1], &[7]);
    assert_eq!(outs[0].num_cached_tokens, 4);
    // An 8-token prompt can hit at most 3 token pages (6 tokens): cut to 4.
    e.add_request("d", tokens(0..8), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.num_computed_tokens, vec![4]);
    all_free_after_reset(&mut e);
}

#[test]
fn compressed_pages_are_evicted_with_the_last_token_page_they_cover() {
    let mut e = engine_after_a();
    // 11 fresh tokens take 6 window + 2 compressed pages: 6, 9..=13 from the front, then
    // a's 5 (H4) and 4 (H3) are evicted; a's compressed page 8 (under H3) is next in line.
    e.add_request("big", tokens(100..111), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!(row_pages(&plan, 0, 0), vec![6, 9, 10, 11, 12, 13]);
    assert_eq!(row_pages(&plan, 1, 0), vec![5, 4]);
    assert!(e.pool().is_cached(8) && e.pool().is_cached(3));
    // Two window pages for 3 tokens (no entry closes): big's unhashed last page 13, then
    // the eviction of 8.
    e.add_request("small", tokens(200..203), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!((row_pages(&plan, 0, 0), row_pages(&plan, 1, 0)), (vec![13, 8], vec![]));
    assert!(e.pool().is_cached(7) && e.pool().is_cached(3) && e.pool().is_cached(2));
    // a's prompt again: compressed page 1 (8) is gone, with the token page 4 it went with;
    // page 7 and window pages 1, 2 serve 4 tokens.
    e.add_request("b", tokens(0..11), params(1)).unwrap();
    let (plan, outs) = step(&mut e, 7);
    assert_eq!(plan.num_computed_tokens, vec![4]);
    assert_eq!(&row_pages(&plan, 1, 0)[..1], &[7]);
    assert_eq!(outs[0].num_cached_tokens, 4);
    all_free_after_reset(&mut e);
}

#[test]
fn a_ratio_that_divides_the_page_size_hits_at_every_token_page() {
    // page_size 4, ratio 2: a compressed page holds 2 entries and spans exactly one token
    // page, so the compressed group serves any whole number of token pages.
    let mut e = engine_with(cfg_ps(4, 32, 16, 64, true), &[swa(4), csa(2)]);
    assert_eq!(e.layout().groups[1].spec.entries_per_page(4), 2);
    e.add_request("a", tokens(0..13), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    // 13 tokens close 6 entries: 3 pages; token 11 closes entry 5, the second of page 3's.
    assert_eq!(row_pages(&plan, 1, 0).len(), 3);
    assert_eq!(plan.groups[1].kv_last_page_len, vec![2]);
    check_compressed_rows(&plan, 1, 2);
    // Sharing 9 tokens (two whole token pages and one token): hit 8, not 0 as a page of
    // page_size entries (16 tokens) would give.
    let mut prompt = tokens(0..13);
    prompt[9] = 500;
    e.add_request("b", prompt, params(1)).unwrap();
    let (plan, outs) = step(&mut e, 7);
    assert_eq!((plan.num_computed_tokens.clone(), outs[0].num_cached_tokens), (vec![8], 8));
    check_compressed_rows(&plan, 1, 2);
    all_free_after_reset(&mut e);
}

#[test]
fn preemption_frees_compressed_pages_and_the_victim_rewrites_its_entries() {
    // 9 usable pages; one request needs at most 5 window + 4 compressed pages (ratio 4).
    let mut e = engine_with(cfg(10, 16, 4, false), &[swa(4), csa(4)]);
    e.add_request("a", tokens(0..4), params(10)).unwrap();
    e.add_request("b", tokens(10..14), params(10)).unwrap();
    let (plan, _) = step(&mut e, 7);
    // a: window 1, 2 and compressed 3 ([0, 4) closes entries 0, 1); b waits (budget 4).
    assert_eq!((row_pages(&plan, 0, 0), row_pages(&plan, 1, 0)), (vec![1, 2], vec![3]));
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.request_ids().collect::<Vec<_>>(), vec!["a", "b"]);
    // b's first chunk [0, 3) closes no entry (the first closes at 3): no compressed page yet.
    assert_eq!((row_pages(&plan, 0, 1), row_pages(&plan, 1, 1)), (vec![5, 6], vec![]));
    let mut preempted_plan = None;
    for _ in 0..40 {
        if !e.has_unfinished() {
            break;
        }
        let before = e.metrics().num_preemptions;
        let (plan, _) = step(&mut e, 7);
        check_compressed_rows(&plan, 1, 4);
        e.check_integrity().unwrap();
        if e.metrics().num_preemptions > before && preempted_plan.is_none() {
            preempted_plan = Some(plan);
        }
    }
    assert!(!e.has_unfinished());
    let plan = preempted_plan.expect("the pool is too small for both: b is preempted");
    assert_eq!(plan.request_ids().collect::<Vec<_>>(), vec!["a"], "the victim (newest) lost its pages");
    assert!(e.metrics().num_preemptions >= 1);
    assert_eq!(e.num_free_pages(), 9);
    e.check_integrity().unwrap();
}

#[test]
fn abort_frees_compressed_pages() {
    let mut e = engine_with(cfg(32, 32, 4, true), &[swa(4), csa(4)]);
    e.add_request("a", tokens(0..12), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7); // [0, 4): compressed page 3 full, cached under H1
    assert_eq!(row_pages(&plan, 1, 0), vec![3]);
    assert!(e.pool().is_cached(3));
    let plan = e.schedule().unwrap(); // [4, 8)
    assert_eq!(row_pages(&plan, 1, 0), vec![3, 6]);
    assert!(e.abort("a"));
    assert_eq!((e.pool().ref_count(3), e.pool().ref_count(6)), (0, 0));
    let outs = commit(&mut e, &plan, 7);
    assert_eq!(outs[0].finish_reason.map(|r| r.as_str()), Some("abort"));
    assert!(!e.pool().is_cached(6), "an aborted row's pages are not cached by its plan");
    assert_eq!(e.num_free_pages(), 31);
    all_free_after_reset(&mut e);
}

#[test]
fn the_pool_must_hold_one_request_of_entries() {
    // 16 tokens: 8 window pages (budget 64 caps nothing) + 16/4 = 4 entries, one per page.
    assert!(Engine::new(cfg(13, 16, 64, false), &[swa(4), csa(4)]).is_ok());
    assert!(Engine::new(cfg(12, 16, 64, false), &[swa(4), csa(4)]).is_err());
    assert!(Engine::new(cfg(10, 16, 64, false), &[KvCacheSpec::Compressed { ratio: 0, bytes_per_entry: 1 }]).is_err());
}

#[test]
fn a_compressed_page_is_keyed_by_the_last_token_page_it_covers() {
    // ratio 8, page_size 2: compressed page 0 (one entry) covers token pages 0..=3. With no
    // window group to check the tail (a window's last page has a chained hash too), only
    // the key tells a prompt diverging in token page 1 or 2 from `a`'s: no hit.
    let mut e = engine_with(cfg(32, 16, 64, true), &[csa(8)]);
    e.add_request("a", tokens(0..10), params(1)).unwrap();
    run_to_completion(&mut e, 7, 5);
    for diverge in [2, 5] {
        let mut prompt = tokens(0..10);
        prompt[diverge] = 500;
        e.add_request("b", prompt, params(1)).unwrap();
        let (plan, _) = step(&mut e, 7);
        assert_eq!(plan.num_computed_tokens, vec![0], "diverging at token {diverge}");
    }
    e.add_request("c", tokens(0..10), params(1)).unwrap();
    let (plan, _) = step(&mut e, 7);
    assert_eq!(plan.num_computed_tokens, vec![8]);
    all_free_after_reset(&mut e);
}
