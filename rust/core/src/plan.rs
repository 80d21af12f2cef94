//! The `BatchPlan`: everything a runner needs for one forward pass, built once per step.
//!
//! `S` = sequences (rows), `T` = new tokens. Rows are ordered decode rows first (one new
//! token that is sampled), then prefill chunks. Arrays are plain `Vec`s the bindings
//! hand to numpy without copying. Field meanings agree with `resin/_core.pyi` and
//! `docs/batch_plan.md`.

use std::sync::{Arc, Mutex};

use crate::cache_manager::KvCacheManager;
use crate::request::Request;

/// Sampling parameters per row (struct of arrays, each `[S]`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingArrays {
    /// f32[S]; 0 = greedy.
    pub temperature: Vec<f32>,
    /// f32[S]; 1 = disabled.
    pub top_p: Vec<f32>,
    /// i32[S]; 0 = disabled.
    pub top_k: Vec<i32>,
    /// f32[S]; 0 = disabled.
    pub min_p: Vec<f32>,
    /// i64[S]; -1 = no seed.
    pub seed: Vec<i64>,
    /// i32[S]; -1 = none, 0 = sampled token only, k = sampled token and top k.
    pub num_logprobs: Vec<i32>,
    /// i32[S]; -1 = no prompt logprobs in this row, k >= 0: the row's tokens with a
    /// `prompt_logprob_targets` entry want their target's logprob and the top k.
    pub num_prompt_logprobs: Vec<i32>,
    /// f32[S]; 0 = disabled.
    pub presence_penalty: Vec<f32>,
    /// f32[S]; 0 = disabled.
    pub frequency_penalty: Vec<f32>,
    /// f32[S]; 1 = disabled.
    pub repetition_penalty: Vec<f32>,
}

impl SamplingArrays {
    fn f32_arrays(&mut self) -> [&mut Vec<f32>; 6] {
        [
            &mut self.temperature,
            &mut self.top_p,
            &mut self.min_p,
            &mut self.presence_penalty,
            &mut self.frequency_penalty,
            &mut self.repetition_penalty,
        ]
    }

    fn clear(&mut self) {
        self.f32_arrays().into_iter().for_each(Vec::clear);
        self.top_k.clear();
        self.seed.clear();
        self.num_logprobs.clear();
        self.num_prompt_logprobs.clear();
    }

    fn reserve(&mut self, s: usize) {
        self.f32_arrays().into_iter().for_each(|v| v.reserve(s));
        self.top_k.reserve(s);
        self.seed.reserve(s);
        self.num_logprobs.reserve(s);
        self.num_prompt_logprobs.reserve(s);
    }
}

/// Spare plans, so building a plan writes into arrays that are already allocated (and
/// warm in cache) instead of fresh memory every step. Whoever drops a plan may hand it
/// back with `put`; the engine takes one per `schedule()`.
#[derive(Clone, Default)]
pub struct PlanRecycler(Arc<Mutex<Vec<BatchPlan>>>);

impl PlanRecycler {
    /// Spare plans kept at most (a runner may hold a plan or two across steps).
    const MAX_SPARE: usize = 4;

    pub fn put(&self, plan: BatchPlan) {
        let mut spare = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < Self::MAX_SPARE {
            spare.push(plan);
        }
    }

    pub fn take(&self) -> BatchPlan {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default()
    }
}

/// Page tables of one cache group for this step (FlashInfer CSR layout).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupPlan {
    /// Pages per recurrent state; 0 for a token (full / sliding-window) or compressed group.
    pub pages_per_state: u32,
    /// Source tokens per entry for a compressed group; 0 otherwise.
    pub ratio: u32,
    /// Positions (entries, for a compressed group) one page holds: `page_size` for a token
    /// group, `lcm(page_size, ratio) / ratio` for a compressed group, 0 for a recurrent one.
    pub entries_per_page: u32,
    /// u32[S+1]: row i's pages are `kv_indices[kv_indptr[i]..kv_indptr[i+1]]`.
    pub kv_indptr: Vec<u32>,
    /// u32[nnz]: page ids in position order. A sliding-window group lists only pages
    /// intersecting `[max(0, num_computed - window + 1), seq_len)`; the first listed
    /// page of row i is logical page `ceil(seq_len/page_size) - (kv_indptr[i+1]-kv_indptr[i])`.
    /// A recurrent group lists each row's `pages_per_state` state pages, in byte order.
    /// A compressed group lists the pages holding the row's entries closed by `seq_len`
    /// (`num_entries = seq_len / ratio`, in `ceil(num_entries / entries_per_page)` pages,
    /// from entry 0; none while `num_entries` is 0).
    pub kv_indices: Vec<u32>,
    /// u32[S]: tokens in the row's last page, 1..=page_size; 0 for a recurrent group. For a
    /// compressed group, entries in the last listed page (1..=entries_per_page; 0 when none
    /// is listed), so `num_entries = (listed - 1) * entries_per_page + kv_last_page_len` if
    /// listed > 0.
    pub kv_last_page_len: Vec<u32>,
    /// i64[T]: `page * page_size + offset` where each new token's KV is written; -1 = skip
    /// (every token of a recurrent group, which has no per-token cache). For a compressed
    /// group, the slot of the entry a token *closes*: the token at position `p` with
    /// `(p + 1) % ratio == 0` writes entry `e = p / ratio` at `page * entries_per_page + e %
    /// entries_per_page` (page = table index `e / entries_per_page`); every other token is -1.
    pub slot_mapping: Vec<i64>,
    /// u32[S], recurrent groups only (empty otherwise): the first page of the row's state
    /// (= its first `kv_indices` entry); byte b of a state lives in the row's state page
    /// `b // page_bytes`, at offset `b % page_bytes`.
    pub state_slots: Vec<u32>,
    /// u8[S], recurrent groups only (empty otherwise): 1 if the row's state pages hold its
    /// state after `num_computed_tokens` tokens (continuing, or copied from a checkpoint by
    /// this plan's `copy_pages`); 0 if the row starts fresh (`num_computed_tokens == 0`):
    /// the runner starts from a zero state and ignores the pages' stale bytes.
    pub has_initial_state: Vec<u8>,
}

/// One step's plan. Immutable once built.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchPlan {
    /// Monotone step id.
    pub step: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// S.
    pub num_sequences: u32,
    /// Rows `[0, num_decode_sequences)` are decode rows.
    pub num_decode_sequences: u32,
    /// T.
    pub num_tokens: u32,
    /// CUDA-graph bucket size (`EngineConfig::padded_num_sequences`): for a pure-decode step
    /// with `EngineConfig::cuda_graph_batch_sizes` set, the smallest bucket >= S; otherwise S.
    /// Every array stays S rows long: a runner that replays a graph at this size pads its own
    /// static buffers with rows `[S, padded_num_sequences)` that read and write nothing (one
    /// query token at position 0, `seq_len` 1, page list = the null page 0, slot -1, samples
    /// discarded). Set by the engine after `build` (which sets S).
    pub padded_num_sequences: u32,
    /// [S] the caller's request ids, packed (copying a few bytes per row is cheaper than
    /// reference counting): row i's id is `request_id_bytes[request_id_ends[i-1]..request_id_ends[i]]`.
    pub request_id_bytes: String,
    /// u32[S]: end offset of each row's id in `request_id_bytes`.
    pub request_id_ends: Vec<u32>,
    /// u32[S]: stable row in `[0, max_num_seqs)` for per-request runner state.
    pub request_slots: Vec<u32>,
    /// u32[T]: new tokens, rows concatenated.
    pub input_ids: Vec<u32>,
    /// i64[T]: absolute position of each new token.
    pub positions: Vec<i64>,
    /// u32[S+1]: row i's tokens are `input_ids[query_indptr[i]..query_indptr[i+1]]`.
    pub query_indptr: Vec<u32>,
    /// u32[S]: tokens in the cache before this step (= position of the first new token).
    pub num_computed_tokens: Vec<u32>,
    /// u32[S]: `num_computed_tokens + query length`.
    pub seq_lens: Vec<u32>,
    /// u32[S+1]: rows to sample: +0 for a mid-prefill chunk, +1 otherwise.
    pub sample_indptr: Vec<u32>,
    /// i64[T], or empty when no row asks for prompt logprobs: for new token t at position p
    /// of a row whose request asks for them, prompt token `p + 1` (the token whose logprob
    /// given tokens `0..=p` the runner returns, in token order, in
    /// `ForwardOutput.prompt_logprobs`); -1 for every other token (the prompt's last, an
    /// output token, a position already recorded, a row that does not ask).
    pub prompt_logprob_targets: Vec<i64>,
    /// u32[S]: drafts verified in the row (0: no speculative decoding yet).
    pub num_draft_tokens: Vec<u32>,
    /// u32[S]: output tokens the row's request has before this step (what a seeded
    /// sampler's stream position is; 0 for a fresh prompt).
    pub num_output_tokens: Vec<u32>,
    /// u32[S+1]: CSR offsets into `committed_token_ids`.
    pub committed_token_indptr: Vec<u32>,
    /// u32[nnz]: row i's request's output tokens the engine committed since the runner last
    /// saw the request in a committed plan (usually the one token sampled in its previous
    /// step; none for a slot new in this plan, whose tokens are in `new_request_token_ids`).
    /// They are its last outputs: output tokens `num_output_tokens[i] - n_i ..
    /// num_output_tokens[i]`, so re-applying them after a discarded plan is idempotent.
    pub committed_token_ids: Vec<u32>,
    pub sampling: SamplingArrays,
    /// u32[S+1]: CSR offsets into `banned_token_ids`.
    pub banned_token_indptr: Vec<u32>,
    /// u32[nnz]: tokens row i must not sample this step (stop tokens before `min_tokens`).
    pub banned_token_ids: Vec<u32>,
    /// u32[S+1]: CSR offsets into `logit_bias_token_ids` / `logit_bias_values`.
    pub logit_bias_indptr: Vec<u32>,
    /// u32[nnz]: row i's request's `logit_bias` tokens, ascending (rows that sample only).
    pub logit_bias_token_ids: Vec<u32>,
    /// f32[nnz]: the bias added to each of those tokens' logits, before the penalties.
    pub logit_bias_values: Vec<f32>,
    /// One per cache group.
    pub groups: Vec<GroupPlan>,
    /// u32[n]: slots that serve a new request from this plan on (apply after `finished_request_slots`).
    pub new_request_slots: Vec<u32>,
    /// u32[n+1]: CSR offsets into `new_request_token_ids`, in `new_request_slots` order.
    pub new_request_token_indptr: Vec<u32>,
    /// u32[nnz]: every token each new slot's request has so far (its prompt, then outputs
    /// already sampled if it resumes after preemption): what penalties and per-request
    /// sampler state start from, since prefix-cache hits never show those tokens in `input_ids`.
    pub new_request_token_ids: Vec<u32>,
    /// u32[n]: how many of those tokens are the prompt.
    pub new_request_num_prompt_tokens: Vec<u32>,
    /// u32[n]: slots whose request finished, was aborted or preempted since the last committed plan.
    pub finished_request_slots: Vec<u32>,
    /// u32[n, 2] row-major (src, dst) page pairs the runner copies before the forward, in
    /// every layer of every recurrent group, reading all sources before writing any
    /// destination (`buf[dst] = buf[src]`): own state -> checkpoint after a chunk that ended
    /// on a page boundary, and checkpoint -> own state for a prefix hit (copy-on-write).
    pub copy_pages: Vec<u32>,
    /// u32[n]: pages the runner zeroes after `copy_pages` and before the forward: pages that
    /// last held a recurrent state and now hold token K/V (needed only by runners whose
    /// buffers alias across groups: stale state bytes read as K/V can be NaN).
    pub zero_pages: Vec<u32>,
}

/// One scheduled row: a request and how many new tokens it computes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ScheduledRow {
    /// Index of the request in the scheduler's table.
    pub req: usize,
    /// Tokens the row computes: the request's uncomputed tokens, plus its drafts in a verify row.
    pub num_new_tokens: u32,
    /// Drafts verified by the row (its last `num_drafts` new tokens are `req.drafts`).
    pub num_drafts: u32,
}

impl BatchPlan {
    /// Builds the plan for `rows` (already ordered decode first) of requests in `requests`.
    pub fn build(
        step: u64,
        rows: &[ScheduledRow],
        num_decode_sequences: u32,
        requests: &[Option<Request>],
        kv: &KvCacheManager,
        eos_token_ids: &[u32],
        recycled: BatchPlan,
    ) -> BatchPlan {
        let s = rows.len();
        let t: usize = rows.iter().map(|r| r.num_new_tokens as usize).sum();
        let ps = kv.page_size();
        let mut plan = recycled;
        plan.clear(kv.num_groups());
        plan.step = step;
        plan.page_size = ps;
        plan.num_sequences = s as u32;
        plan.num_decode_sequences = num_decode_sequences;
        plan.num_tokens = t as u32;
        plan.padded_num_sequences = s as u32;
        plan.request_id_bytes.reserve(s * 16);
        for v in [
            &mut plan.request_id_ends,
            &mut plan.request_slots,
            &mut plan.num_computed_tokens,
            &mut plan.seq_lens,
            &mut plan.num_output_tokens,
        ] {
            v.reserve(s);
        }
        for v in [
            &mut plan.query_indptr,
            &mut plan.sample_indptr,
            &mut plan.banned_token_indptr,
            &mut plan.logit_bias_indptr,
            &mut plan.committed_token_indptr,
        ] {
            v.reserve(s + 1);
        }
        plan.input_ids.reserve(t);
        plan.positions.reserve(t);
        plan.num_draft_tokens.resize(s, 0);
        plan.sampling.reserve(s);
        // kv_indices grows as rows are added; a recycled plan already has the capacity.
        for (gp, group) in plan.groups.iter_mut().zip(&kv.layout.groups) {
            gp.pages_per_state = group.pages_per_state;
            gp.ratio = group.spec.ratio().unwrap_or(0);
            gp.entries_per_page = group.spec.entries_per_page(ps);
            gp.kv_indptr.reserve(s + 1);
            gp.kv_last_page_len.reserve(s);
            gp.slot_mapping.reserve(t);
            if group.is_recurrent() {
                gp.state_slots.reserve(s);
                gp.has_initial_state.reserve(s);
            }
        }
        plan.query_indptr.push(0);
        plan.sample_indptr.push(0);
        plan.banned_token_indptr.push(0);
        plan.logit_bias_indptr.push(0);
        plan.committed_token_indptr.push(0);
        for g in &mut plan.groups {
            g.kv_indptr.push(0);
        }
        for (i, row) in rows.iter().enumerate() {
            let req = requests[row.req].as_ref().expect("scheduled request exists");
            let start = req.num_computed_tokens;
            let seq_len = start + row.num_new_tokens;
            // A verify row: the request's last token, then its drafts (not in token_ids yet).
            let real_end = seq_len - row.num_drafts;
            plan.request_id_bytes.push_str(req.id());
            plan.request_id_ends.push(plan.request_id_bytes.len() as u32);
            plan.request_slots.push(req.slot.expect("running request has a slot"));
            plan.input_ids.extend_from_slice(&req.token_ids[start as usize..real_end as usize]);
            plan.input_ids.extend_from_slice(&req.drafts[..row.num_drafts as usize]);
            plan.num_draft_tokens[i] = row.num_drafts;
            plan.positions.extend((start..seq_len).map(i64::from));
            plan.query_indptr.push(plan.input_ids.len() as u32);
            plan.num_computed_tokens.push(start);
            plan.seq_lens.push(seq_len);
            let samples = real_end == req.num_tokens();
            let num_samples = if samples { 1 + row.num_drafts } else { 0 };
            plan.sample_indptr.push(plan.sample_indptr.last().unwrap() + num_samples);
            plan.push_sampling(req);
            plan.push_prompt_logprob_targets(req, start, real_end, seq_len, t);
            plan.num_output_tokens.push(req.num_output_tokens());
            plan.committed_token_ids.extend_from_slice(&req.token_ids[req.num_tokens_shown as usize..]);
            plan.committed_token_indptr.push(plan.committed_token_ids.len() as u32);
            if samples && req.num_output_tokens() < req.params.min_tokens {
                if !req.params.ignore_eos {
                    plan.banned_token_ids.extend_from_slice(eos_token_ids);
                }
                plan.banned_token_ids.extend_from_slice(&req.params.stop_token_ids);
            }
            plan.banned_token_indptr.push(plan.banned_token_ids.len() as u32);
            if samples {
                plan.logit_bias_token_ids.extend(req.params.logit_bias.iter().map(|&(t, _)| t));
                plan.logit_bias_values.extend(req.params.logit_bias.iter().map(|&(_, b)| b));
            }
            plan.logit_bias_indptr.push(plan.logit_bias_token_ids.len() as u32);
            for (g, gp) in plan.groups.iter_mut().enumerate() {
                let (_, listed) = kv.listed_pages(req, g, start, seq_len);
                gp.kv_indices.extend_from_slice(listed);
                gp.kv_indptr.push(gp.kv_indices.len() as u32);
                if gp.pages_per_state > 0 {
                    gp.kv_last_page_len.push(0);
                    gp.slot_mapping.extend(std::iter::repeat_n(-1, row.num_new_tokens as usize));
                    gp.state_slots.push(listed[0]);
                    gp.has_initial_state.push(u8::from(start > 0));
                    continue;
                }
                let pages = &req.pages[g];
                if gp.ratio > 0 {
                    let (r, epp) = (gp.ratio, gp.entries_per_page);
                    let num_entries = seq_len / r;
                    gp.kv_last_page_len.push(num_entries - num_entries.div_ceil(epp).saturating_sub(1) * epp);
                    gp.slot_mapping.extend((start..seq_len).map(|p| {
                        if !(p + 1).is_multiple_of(r) {
                            return -1;
                        }
                        let e = p / r;
                        i64::from(pages[(e / epp) as usize]) * i64::from(epp) + i64::from(e % epp)
                    }));
                    continue;
                }
                gp.kv_last_page_len.push(seq_len - (seq_len.div_ceil(ps) - 1) * ps);
                gp.slot_mapping
                    .extend((start..seq_len).map(|p| i64::from(pages[(p / ps) as usize]) * i64::from(ps) + i64::from(p % ps)));
            }
        }
        plan
    }

    /// The row's `sampling.num_prompt_logprobs` and its tokens' `prompt_logprob_targets`
    /// (positions `start..seq_len`; `real_end` ends its real tokens). The targets array stays
    /// empty until a row has a target, which fills it with -1 for the tokens before it.
    fn push_prompt_logprob_targets(&mut self, req: &Request, start: u32, real_end: u32, seq_len: u32, t: usize) {
        let targets = req.prompt_logprob_positions(start, real_end);
        let k = req.params.prompt_logprobs.filter(|_| !targets.is_empty());
        self.sampling.num_prompt_logprobs.push(k.map_or(-1, |k| k as i32));
        if k.is_some() && self.prompt_logprob_targets.is_empty() {
            let before = self.input_ids.len() - (seq_len - start) as usize;
            self.prompt_logprob_targets.reserve(t);
            self.prompt_logprob_targets.resize(before, -1);
        }
        if !self.prompt_logprob_targets.is_empty() || k.is_some() {
            let target = |p: u32| if targets.contains(&p) { i64::from(req.token_ids[p as usize + 1]) } else { -1 };
            self.prompt_logprob_targets.extend((start..seq_len).map(target));
        }
    }

    fn push_sampling(&mut self, req: &Request) {
        let p = &req.params;
        let sa = &mut self.sampling;
        sa.temperature.push(p.temperature);
        sa.top_p.push(p.top_p);
        sa.top_k.push(p.top_k);
        sa.min_p.push(p.min_p);
        sa.seed.push(p.seed.map_or(-1, |s| s as i64));
        sa.num_logprobs.push(p.logprobs.map_or(-1, |k| k as i32));
        sa.presence_penalty.push(p.presence_penalty);
        sa.frequency_penalty.push(p.frequency_penalty);
        sa.repetition_penalty.push(p.repetition_penalty);
    }

    /// Empties every array (keeping its allocation) for `num_groups` cache groups.
    fn clear(&mut self, num_groups: usize) {
        self.request_id_bytes.clear();
        for v in [
            &mut self.request_id_ends,
            &mut self.request_slots,
            &mut self.input_ids,
            &mut self.query_indptr,
            &mut self.num_computed_tokens,
            &mut self.seq_lens,
            &mut self.sample_indptr,
            &mut self.num_draft_tokens,
            &mut self.num_output_tokens,
            &mut self.committed_token_indptr,
            &mut self.committed_token_ids,
            &mut self.banned_token_indptr,
            &mut self.banned_token_ids,
            &mut self.logit_bias_indptr,
            &mut self.logit_bias_token_ids,
            &mut self.new_request_slots,
            &mut self.new_request_token_indptr,
            &mut self.new_request_token_ids,
            &mut self.new_request_num_prompt_tokens,
            &mut self.finished_request_slots,
            &mut self.copy_pages,
            &mut self.zero_pages,
        ] {
            v.clear();
        }
        self.positions.clear();
        self.prompt_logprob_targets.clear();
        self.logit_bias_values.clear();
        self.sampling.clear();
        self.groups.resize_with(num_groups, GroupPlan::default);
        for g in &mut self.groups {
            g.kv_indptr.clear();
            g.kv_indices.clear();
            g.kv_last_page_len.clear();
            g.slot_mapping.clear();
            g.state_slots.clear();
            g.has_initial_state.clear();
        }
    }

    /// Sets the lifecycle diff: `new_slots` with each one's request tokens (from `requests`,
    /// found among `running`), and `finished_slots`.
    pub fn set_lifecycle(
        &mut self,
        new_slots: Vec<u32>,
        finished_slots: Vec<u32>,
        running: &[usize],
        requests: &[Option<Request>],
    ) {
        self.new_request_token_indptr.push(0);
        for &slot in &new_slots {
            let req = running
                .iter()
                .filter_map(|&i| requests[i].as_ref())
                .find(|r| r.slot == Some(slot))
                .expect("a new slot belongs to a running request");
            self.new_request_token_ids.extend_from_slice(&req.token_ids);
            self.new_request_token_indptr.push(self.new_request_token_ids.len() as u32);
            self.new_request_num_prompt_tokens.push(req.num_prompt_tokens);
        }
        self.new_request_slots = new_slots;
        self.finished_request_slots = finished_slots;
    }

    /// Positions of row `i` whose prompt logprob the plan asks for (its tokens with a
    /// `prompt_logprob_targets` entry, which are consecutive), read off the plan.
    pub fn prompt_logprob_positions(&self, i: usize) -> std::ops::Range<u32> {
        if self.prompt_logprob_targets.is_empty() {
            return 0..0;
        }
        let tokens = self.query_indptr[i] as usize..self.query_indptr[i + 1] as usize;
        let marked = &self.prompt_logprob_targets[tokens.clone()];
        match marked.iter().position(|&target| target >= 0) {
            Some(first) => {
                let start = self.positions[tokens.start + first] as u32;
                start..start + marked.iter().filter(|&&target| target >= 0).count() as u32
            }
            None => 0..0,
        }
    }

    /// The request id of row `i`.
    pub fn request_id(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.request_id_ends[i - 1] as usize };
        &self.request_id_bytes[start..self.request_id_ends[i] as usize]
    }

    /// Request ids, row by row.
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        (0..self.num_sequences as usize).map(|i| self.request_id(i))
    }

    /// Dense page table of group `g`: (row-major u32[S * num_columns], num_columns).
    /// Column j holds the page of positions `[j*page_size, (j+1)*page_size)`; entries
    /// before a sliding window and past a row's end are 0, the null page. For a recurrent
    /// group: `pages_per_state` columns, the row's state pages. For a compressed group,
    /// column j holds entries `[j*entries_per_page, (j+1)*entries_per_page)`.
    pub fn block_table(&self, g: usize) -> (Vec<u32>, usize) {
        let gp = &self.groups[g];
        if gp.pages_per_state > 0 {
            return (gp.kv_indices.clone(), gp.pages_per_state as usize);
        }
        let pages_of = |l: u32| l.checked_div(gp.ratio).unwrap_or(l).div_ceil(gp.entries_per_page) as usize;
        let cols = self.seq_lens.iter().map(|&l| pages_of(l)).max().unwrap_or(0);
        let mut table = vec![0u32; self.num_sequences as usize * cols];
        for i in 0..self.num_sequences as usize {
            let listed = &gp.kv_indices[gp.kv_indptr[i] as usize..gp.kv_indptr[i + 1] as usize];
            let first = pages_of(self.seq_lens[i]) - listed.len();
            table[i * cols + first..i * cols + first + listed.len()].copy_from_slice(listed);
        }
        (table, cols)
    }
}
