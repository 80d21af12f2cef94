//! Seeded randomized invariant test: ≥ 100,000 operations (add, step with random
//! outputs, abort, bad output, discard, prefix-cache reset) over many engine shapes —
//! page sizes, random mixes of full / sliding-window / recurrent / compressed groups (states
//! of 1 to 3 pages, checkpoints with prefix caching at every page or an interval; compression ratios 1 to 5, with or
//! without a raw window alongside), prefix caching on and off, FCFS
//! and priority, pools small enough to force preemption, speculative decoding (n-gram drafts
//! verified in rows of 1 + k tokens, random partial accepts) where the layout allows it. After every operation:
//! pages free + pages owned + pages cached = pool size - 1 (the null page), page 0
//! never owned, refcounts equal owners, no page owned by two groups (`check_integrity`),
//! every compressed row lists exactly the pages of its closed entries and marks exactly the
//! closing tokens in `slot_mapping`, and at the end, once every
//! request is finished and the prefix cache is reset, every page is free.

mod common;
use resin_core::{BatchPlan, Engine, EngineConfig, ForwardOutputRef, KvCacheSpec, SamplingParams, SchedulingPolicy};

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

const EOS: u32 = 1;
const VOCAB: u32 = 12;

/// Every compressed group of `plan`: a page holds the fewest whole entries that span whole
/// token pages, rows list `ceil((seq_len / ratio) / entries_per_page)` pages, none null,
/// `kv_last_page_len` counts the last page's entries, and a token's slot is set iff it
/// closes an entry, pointing into the listed page of that entry.
/// `padded_num_sequences` is the smallest bucket >= S for a pure-decode step (S otherwise),
/// and every array still has S rows.
fn check_padding(e: &Engine, plan: &BatchPlan) {
    let s = plan.num_sequences;
    let buckets = &e.config().cuda_graph_batch_sizes;
    let pure_decode = s > 0 && plan.num_decode_sequences == s;
    let expected = if pure_decode { buckets.iter().copied().find(|&b| b >= s).unwrap_or(s) } else { s };
    assert_eq!(plan.padded_num_sequences, expected);
    assert!(plan.padded_num_sequences >= s);
    assert_eq!((plan.seq_lens.len(), plan.query_indptr.len()), (s as usize, s as usize + 1));
    if pure_decode {
        assert_eq!(plan.num_tokens, s, "a pure-decode step has one token per row");
    }
}

fn check_compressed_plan(e: &Engine, plan: &BatchPlan) {
    for (g, group) in e.layout().groups.iter().enumerate() {
        let Some(ratio) = group.spec.ratio() else { continue };
        let gp = &plan.groups[g];
        let ps = (1..=plan.page_size).find(|k| (k * ratio).is_multiple_of(plan.page_size)).unwrap();
        assert_eq!((gp.ratio, gp.entries_per_page), (ratio, ps));
        for i in 0..plan.num_sequences as usize {
            let listed = &gp.kv_indices[gp.kv_indptr[i] as usize..gp.kv_indptr[i + 1] as usize];
            let num_entries = plan.seq_lens[i] / ratio;
            assert_eq!(listed.len() as u32, num_entries.div_ceil(ps));
            assert!(!listed.contains(&0));
            let last = if listed.is_empty() { 0 } else { num_entries - (listed.len() as u32 - 1) * ps };
            assert_eq!(gp.kv_last_page_len[i], last);
            for t in plan.query_indptr[i]..plan.query_indptr[i + 1] {
                let p = plan.positions[t as usize] as u32;
                let want = if (p + 1).is_multiple_of(ratio) {
                    let e = p / ratio;
                    i64::from(listed[(e / ps) as usize]) * i64::from(ps) + i64::from(e % ps)
                } else {
                    -1
                };
                assert_eq!(gp.slot_mapping[t as usize], want);
            }
        }
    }
}

fn check_pool_accounting(e: &Engine) {
    e.check_integrity().unwrap_or_else(|err| panic!("{err}"));
    let pool = e.pool();
    let n = pool.num_pages();
    let queue = pool.free_queue();
    let cached_idle = queue.iter().filter(|&&p| pool.is_cached(p)).count() as u32;
    let free = queue.len() as u32 - cached_idle;
    let owned = (1..n).filter(|&p| pool.ref_count(p) > 0).count() as u32;
    assert_eq!(free + owned + cached_idle, n - 1, "free {free} + owned {owned} + cached {cached_idle} != {}", n - 1);
    assert_eq!(pool.ref_count(0), 0, "page 0 is never owned");
    assert!(!queue.contains(&0), "page 0 is never free");
}

fn random_engine(rng: &mut Rng) -> Engine {
    let page_size = [1, 2, 4, 8][rng.below(4) as usize];
    let max_model_len = 16 + rng.below(48) as u32;
    let max_num_batched_tokens = 1 + rng.below(32) as u32;
    let window = 1 + rng.below(20) as u32;
    let specs: Vec<KvCacheSpec> = match rng.below(4) {
        0 => vec![],
        1 => vec![KvCacheSpec::SlidingWindow { window, bytes_per_token: 2 }],
        2 => vec![KvCacheSpec::Full { bytes_per_token: 2 }, KvCacheSpec::SlidingWindow { window, bytes_per_token: 2 }],
        _ => vec![
            KvCacheSpec::SlidingWindow { window, bytes_per_token: 2 },
            KvCacheSpec::SlidingWindow { window: window + 7, bytes_per_token: 2 },
        ],
    };
    // Half the engines mix in recurrent layers (1 or 2 groups; page_bytes = 2 * page_size).
    let mut specs = specs;
    if rng.chance(50) {
        for _ in 0..1 + rng.below(2) {
            let state_bytes = 1 + rng.below(3 * 2 * u64::from(page_size));
            specs.insert(rng.below(specs.len() as u64 + 1) as usize, KvCacheSpec::Recurrent { state_bytes });
        }
        if rng.chance(10) {
            specs.retain(|s| matches!(s, KvCacheSpec::Recurrent { .. })); // recurrent only
        }
    }
    // Half the engines mix in compressed layers (1 or 2 ratios; sometimes compressed only).
    if rng.chance(50) {
        for _ in 0..1 + rng.below(2) {
            let spec = KvCacheSpec::Compressed { ratio: 1 + rng.below(5) as u32, bytes_per_entry: 1 + rng.below(4) };
            specs.insert(rng.below(specs.len() as u64 + 1) as usize, spec);
        }
        if rng.chance(10) {
            specs.retain(|s| matches!(s, KvCacheSpec::Compressed { .. }));
        }
    }
    let mut config = EngineConfig {
        page_size,
        num_pages: 2,
        max_num_seqs: 1 + rng.below(8) as u32,
        max_num_batched_tokens,
        max_model_len,
        enable_prefix_caching: rng.chance(75),
        eos_token_ids: vec![EOS],
        vocab_size: Some(VOCAB),
        policy: if rng.chance(50) { SchedulingPolicy::Fcfs } else { SchedulingPolicy::Priority },
        // Every page boundary, a few pages, or a non-multiple of the page size (rounded up).
        recurrent_checkpoint_interval: [0, page_size * 3, 5][rng.below(3) as usize],
        // Speculative decoding (n-gram drafts, verify rows; spare states in recurrent layouts).
        num_speculative_tokens: if rng.chance(40) { 1 + rng.below(3) as u32 } else { 0 },
        ngram_prompt_lookup_min: 1,
        ngram_prompt_lookup_max: 3,
        // CUDA-graph buckets (padding is reported only; the plan's arrays never change).
        cuda_graph_batch_sizes: if rng.chance(30) { vec![1, 2, 4] } else { Vec::new() },
    };
    // Smallest pool that fits one request, plus a little: preemption is common.
    let min_pages = match Engine::new(config.clone(), &specs) {
        Ok(_) => 2,
        Err(err) => err.message().split("needs ").nth(1).unwrap().split(' ').next().unwrap().parse::<u32>().unwrap() + 1,
    };
    config.num_pages = min_pages + rng.below(min_pages as u64) as u32;
    Engine::new(config, &specs).expect("sized to fit")
}

fn random_prompt(rng: &mut Rng, max_len: u64) -> Vec<u32> {
    // Few distinct prefixes so the prefix cache is hit often.
    let prefix = rng.below(3) as u32;
    let len = 1 + rng.below(max_len) as usize;
    (0..len).map(|i| if i < 6 { 2 + prefix + (i as u32 % 2) } else { 2 + rng.below(VOCAB as u64 - 2) as u32 }).collect()
}

/// One random output for the pending plan: 1 token per row (sometimes EOS), and for a row
/// verifying k drafts 1 + k tokens, each agreeing with its draft 70% of the time.
fn random_output(rng: &mut Rng, plan: &BatchPlan) -> (Vec<u32>, Vec<u32>) {
    let (mut ids, mut indptr) = (Vec::new(), vec![0u32]);
    for i in 0..plan.num_sequences as usize {
        let drafts = plan.num_draft_tokens[i] as usize;
        let samples = (plan.sample_indptr[i + 1] - plan.sample_indptr[i]) as usize;
        let end = plan.query_indptr[i + 1] as usize;
        for j in 0..samples.max(1) {
            let draft = (j < drafts).then(|| plan.input_ids[end - drafts + j]);
            let token = match draft {
                Some(d) if rng.chance(70) => d,
                _ if rng.chance(8) => EOS,
                _ => rng.below(VOCAB as u64) as u32,
            };
            ids.push(token);
        }
        indptr.push(ids.len() as u32);
    }
    (ids, indptr)
}

#[test]
fn randomized_operations_keep_every_invariant() {
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let mut num_ops = 0u64;
    let mut num_engines = 0;
    let mut num_preempting_engines = 0;
    let mut num_recurrent_engines = 0;
    let mut num_compressed_engines = 0;
    let mut num_compressed_hits = 0;
    let mut num_speculating_engines = 0;
    let mut num_partial_accepts = 0;
    while num_ops < 100_000 {
        let mut e = random_engine(&mut rng);
        num_engines += 1;
        let max_prompt = u64::from(e.config().max_model_len - 1);
        let mut next_id = 0u64;
        let mut live: Vec<String> = Vec::new();
        for _ in 0..2_000 {
            num_ops += 1;
            match rng.below(100) {
                0..=24 => {
                    let id = format!("r{next_id}");
                    next_id += 1;
                    let params = SamplingParams {
                        max_tokens: 1 + rng.below(24) as u32,
                        min_tokens: rng.below(2) as u32,
                        ignore_eos: rng.chance(20),
                        priority: rng.below(3) as i32,
                        ..SamplingParams::default()
                    };
                    e.add_request(&id, random_prompt(&mut rng, max_prompt), params).unwrap();
                    live.push(id);
                }
                25..=29 if !live.is_empty() => {
                    let id = live.swap_remove(rng.below(live.len() as u64) as usize);
                    e.abort(&id);
                }
                30..=31 => e.reset_prefix_cache(),
                _ => {
                    let plan = e.schedule().unwrap();
                    check_compressed_plan(&e, &plan);
                    check_padding(&e, &plan);
                    if plan.num_sequences > 0 && rng.chance(3) {
                        // A bad output (wrong length) is refused and changes nothing.
                        let free = e.num_free_pages();
                        let bad =
                            e.update(plan.step, &ForwardOutputRef { token_ids: &[], token_indptr: &[0], ..Default::default() });
                        assert!(bad.is_err());
                        assert_eq!(e.num_free_pages(), free);
                    }
                    if rng.chance(3) {
                        e.discard_plan();
                    } else {
                        let (ids, indptr) = random_output(&mut rng, &plan);
                        let outs = e
                            .update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() })
                            .unwrap();
                        for o in outs.iter().filter(|o| o.finished) {
                            live.retain(|id| id != o.request_id());
                        }
                    }
                }
            }
            check_pool_accounting(&e);
        }
        // Drain: everything finishes (no starvation), then every page is free.
        let mut steps = 0;
        while e.has_unfinished() {
            let plan = e.schedule().unwrap();
            check_compressed_plan(&e, &plan);
            check_padding(&e, &plan);
            let (ids, indptr) = random_output(&mut rng, &plan);
            e.update(plan.step, &ForwardOutputRef { token_ids: &ids, token_indptr: &indptr, ..Default::default() }).unwrap();
            check_pool_accounting(&e);
            steps += 1;
            assert!(steps < 100_000, "requests starved");
        }
        if e.metrics().num_preemptions > 0 {
            num_preempting_engines += 1;
        }
        if e.layout().has_recurrent() {
            num_recurrent_engines += 1;
        }
        let m = e.metrics();
        if m.spec_decode_num_drafts > 0 {
            num_speculating_engines += 1;
            num_partial_accepts += u64::from(
                m.spec_decode_num_accepted_tokens > 0 && m.spec_decode_num_accepted_tokens < m.spec_decode_num_draft_tokens,
            );
        }
        if e.layout().groups.iter().any(|g| g.spec.ratio().is_some()) {
            num_compressed_engines += 1;
            num_compressed_hits += u64::from(e.metrics().prefix_cache_hits_tokens > 0);
        }
        e.reset_prefix_cache();
        assert_eq!(e.num_free_pages(), e.pool().num_pages() - 1, "every page is free at the end");
        assert_eq!(e.pool().num_cached_pages(), 0);
    }
    assert!(num_ops >= 100_000);
    assert!(num_preempting_engines * 2 > num_engines, "most engines must have exercised preemption");
    assert!(num_recurrent_engines * 3 > num_engines, "recurrent groups are well represented");
    assert!(num_compressed_engines * 3 > num_engines, "compressed groups are well represented");
    assert!(num_compressed_hits * 4 > num_compressed_engines, "compressed groups serve prefix hits");
    assert!(num_speculating_engines * 4 > num_engines, "verify rows are well represented");
    assert!(num_partial_accepts * 2 > num_speculating_engines, "drafts are accepted and rejected");
}
