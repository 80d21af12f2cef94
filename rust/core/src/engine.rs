//! The engine: requests in, plans out, runner outputs committed.
//!
//! ```text
//! add_request ──► waiting ──schedule()──► BatchPlan ──runner──► update(output) ──► RequestOutputs
//!                    ▲                                                   │
//!                    └────────────── preemption (recompute) ◄───────────┘
//! ```
//! `schedule()` allocates pages and slots but advances no token counts; `update()`
//! validates the output first and only then commits it, so a bad output changes
//! nothing and the same plan can be retried, or dropped with `discard_plan()` and
//! planned again. `abort()` works at any time; a request aborted while its plan is in
//! flight gets its pages back at once (no later plan can hand them out before
//! `update`/`discard_plan`), and its row of the output is ignored.

use std::time::Instant;

use crate::cache_manager::KvCacheManager;
use crate::draft;
use crate::engine_config::EngineConfig;
use crate::error::CoreError;
use crate::kv_spec::{CacheLayout, KvCacheSpec};
use crate::metrics::{Gauges, Metrics};
use crate::output::{ForwardOutputRef, RequestOutput, RowExpectation};
use crate::plan::{BatchPlan, PlanRecycler};
use crate::request::{FinishReason, Request, SamplingParams};
use crate::scheduler::{Scheduler, SchedulerLimits};

/// Whether the n-gram drafter may propose for `req`: sampling that does not depend on the
/// tokens before each position in ways one verify row cannot reproduce — no repetition,
/// frequency or presence penalties (the sampler would need the drafts in its history) and
/// `min_tokens` already met (the EOS ban is per row) — and a request that allows it
/// (`SamplingParams::speculate`: not a grammar-constrained one).
fn may_draft(req: &Request) -> bool {
    let p = &req.params;
    p.speculate
        && p.repetition_penalty == 1.0
        && p.frequency_penalty == 0.0
        && p.presence_penalty == 0.0
        && req.num_output_tokens() >= p.min_tokens
}

#[derive(Copy, Clone, Debug)]
struct PendingRow {
    req: usize,
    arrival_seq: u64,
    num_new_tokens: u32,
    /// Drafts the row verifies (the request's first `num_drafts` drafts).
    num_drafts: u32,
    /// Positions `[start, end)` whose prompt logprob the row computes
    /// (`Request::prompt_logprob_positions`).
    prompt_logprob_positions: (u32, u32),
}

impl PendingRow {
    fn prompt_logprob_positions(&self) -> std::ops::Range<u32> {
        self.prompt_logprob_positions.0..self.prompt_logprob_positions.1
    }
}

/// The plan handed out and not yet committed.
struct PendingStep {
    step: u64,
    rows: Vec<PendingRow>,
    /// Per row, what the runner's output must look like (read off the plan).
    expectations: Vec<RowExpectation>,
    /// The plan's `zero_pages` (re-listed if the plan is discarded).
    zero_pages: Vec<u32>,
}

pub struct Engine {
    config: EngineConfig,
    sched: Scheduler,
    metrics: Metrics,
    next_step: u64,
    next_arrival_seq: u64,
    pending: Option<PendingStep>,
    /// Outputs of aborted requests, reported by the next `update`.
    abort_outputs: Vec<RequestOutput>,
    recycler: PlanRecycler,
}

impl Engine {
    /// An engine for a runner whose layers keep `layer_specs` (empty: one full-attention group).
    pub fn new(config: EngineConfig, layer_specs: &[KvCacheSpec]) -> Result<Engine, CoreError> {
        config.validate()?;
        let layout = CacheLayout::from_layer_specs(layer_specs, config.num_pages, config.page_size)?;
        let pages_per_request = layout.pages_per_request(
            config.max_model_len,
            config.max_num_batched_tokens,
            config.enable_prefix_caching,
            config.num_speculative_tokens > 0,
        );
        if pages_per_request > config.num_pages - 1 {
            return Err(CoreError::invalid(format!(
                "EngineConfig.num_pages = {} is too small: one request of max_model_len = {} tokens needs {} pages \
                 across {} cache group(s), plus the null page; raise num_pages or lower max_model_len",
                config.num_pages,
                config.max_model_len,
                pages_per_request,
                layout.groups.len()
            )));
        }
        let limits = SchedulerLimits {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            policy: config.policy,
        };
        let mut kv = KvCacheManager::new(layout, config.enable_prefix_caching)?;
        kv.checkpoint_interval = config.checkpoint_interval_tokens();
        kv.spare_states = config.num_speculative_tokens > 0 && kv.layout.has_recurrent();
        let draft_positions = config.num_speculative_tokens as usize;
        Ok(Engine {
            sched: Scheduler::new(limits, kv),
            config,
            metrics: Metrics::with_draft_positions(draft_positions),
            next_step: 0,
            next_arrival_seq: 0,
            pending: None,
            abort_outputs: Vec::new(),
            recycler: PlanRecycler::default(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn layout(&self) -> &CacheLayout {
        &self.sched.kv.layout
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Queues a request. Errors (nothing queued): duplicate id, empty prompt, prompt not
    /// shorter than `max_model_len`, token ids out of vocabulary, out-of-range params.
    pub fn add_request(&mut self, request_id: &str, prompt_token_ids: Vec<u32>, params: SamplingParams) -> Result<(), CoreError> {
        if self.sched.index_of.contains_key(request_id) {
            return Err(CoreError::invalid(format!("request_id {request_id:?} is already in use by an unfinished request")));
        }
        if prompt_token_ids.is_empty() {
            return Err(CoreError::invalid(format!("request {request_id:?}: prompt_token_ids is empty")));
        }
        let len = prompt_token_ids.len();
        if len >= self.config.max_model_len as usize {
            return Err(CoreError::invalid(format!(
                "request {request_id:?}: prompt_token_ids has {len} tokens but max_model_len is {}; \
                 the prompt must be shorter to leave room for at least one output token",
                self.config.max_model_len
            )));
        }
        if let Some(vocab) = self.config.vocab_size {
            if let Some(pos) = prompt_token_ids.iter().position(|&t| t >= vocab) {
                return Err(CoreError::invalid(format!(
                    "request {request_id:?}: prompt_token_ids[{pos}] = {} is not below vocab_size {vocab}",
                    prompt_token_ids[pos]
                )));
            }
            if let Some(&t) = params.stop_token_ids.iter().find(|&&t| t >= vocab) {
                return Err(CoreError::invalid(format!("SamplingParams.stop_token_ids: {t} is not below vocab_size {vocab}")));
            }
            if let Some(&(t, _)) = params.logit_bias.iter().find(|&&(t, _)| t >= vocab) {
                return Err(CoreError::invalid(format!("SamplingParams.logit_bias: token {t} is not below vocab_size {vocab}")));
            }
        }
        let params = params.validated()?;
        let max_num_tokens = (len + params.max_tokens as usize).min(self.config.max_model_len as usize);
        let mut req = Request::new(
            request_id.to_string(),
            prompt_token_ids,
            params,
            self.sched.kv.num_groups(),
            self.next_arrival_seq,
            Instant::now(),
            max_num_tokens,
        );
        self.next_arrival_seq += 1;
        if self.config.enable_prefix_caching {
            req.update_block_hashes(self.config.page_size);
        }
        self.sched.add(req);
        Ok(())
    }

    /// Aborts a waiting or running request: its pages and slot are freed now and the
    /// next `update` reports it with `FinishReason::Abort`. False if the id is unknown.
    pub fn abort(&mut self, request_id: &str) -> bool {
        self.finish_early(request_id, FinishReason::Abort)
    }

    /// Ends a request as `abort` does, reported and counted with `reason`: `Stop` for one
    /// whose caller found a stop string in its text (the engine sees only tokens).
    pub fn finish_early(&mut self, request_id: &str, reason: FinishReason) -> bool {
        let Some(&idx) = self.sched.index_of.get(request_id) else { return false };
        let req = self.sched.remove(idx);
        self.metrics.record_finished(reason);
        let num_output_tokens = req.num_output_tokens() as usize;
        self.abort_outputs.push(RequestOutput {
            record: req.record,
            num_output_tokens,
            num_new_tokens: 0,
            finished: true,
            finish_reason: Some(reason),
            num_cached_tokens: req.num_cached_tokens,
            has_logprobs: req.params.logprobs.is_some(),
            has_prompt_logprobs: req.params.prompt_logprobs.is_some(),
        });
        self.debug_check();
        true
    }

    /// Plans the next step. Fails if a plan is pending.
    pub fn schedule(&mut self) -> Result<BatchPlan, CoreError> {
        if let Some(p) = &self.pending {
            return Err(CoreError::state(format!(
                "plan {} is still pending: call update(plan, output) or discard_plan() first",
                p.step
            )));
        }
        let now = Instant::now();
        let (rows, num_decode) = self.sched.schedule(now, &mut self.metrics);
        let step = self.next_step;
        self.next_step += 1;
        let recycled = self.recycler.take();
        let mut plan =
            BatchPlan::build(step, &rows, num_decode, &self.sched.requests, &self.sched.kv, &self.config.eos_token_ids, recycled);
        plan.padded_num_sequences = self.config.padded_num_sequences(plan.num_sequences, plan.num_decode_sequences);
        // Lifecycle notices ride only on plans with rows: an empty plan reaches no runner
        // (step() skips forward), so its notices wait for the next real plan.
        let diff = if rows.is_empty() { Default::default() } else { self.sched.slots.take_diff() };
        plan.set_lifecycle(diff.new, diff.finished, &self.sched.running, &self.sched.requests);
        // Cache ops ride on plans with rows too (copies are only made for such plans).
        debug_assert!(!rows.is_empty() || self.sched.kv.pending_copies.is_empty());
        std::mem::swap(&mut plan.copy_pages, &mut self.sched.kv.pending_copies);
        let mut zero_pages = Vec::new();
        if !rows.is_empty() {
            self.sched.kv.pool.take_zero_pages(&mut plan.zero_pages);
            zero_pages.clone_from(&plan.zero_pages);
        }
        let pending_rows: Vec<PendingRow> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let positions = plan.prompt_logprob_positions(i);
                PendingRow {
                    req: r.req,
                    arrival_seq: self.sched.request(r.req).arrival_seq,
                    num_new_tokens: r.num_new_tokens,
                    num_drafts: r.num_drafts,
                    prompt_logprob_positions: (positions.start, positions.end),
                }
            })
            .collect();
        // What the output must look like, read off the plan itself.
        let expectations = (0..rows.len())
            .map(|i| RowExpectation {
                samples: plan.sample_indptr[i + 1] > plan.sample_indptr[i],
                max_returned_tokens: 1 + plan.num_draft_tokens[i],
                num_logprobs: plan.sampling.num_logprobs[i],
                num_prompt_targets: pending_rows[i].prompt_logprob_positions().len() as u32,
                num_prompt_logprobs: plan.sampling.num_prompt_logprobs[i],
            })
            .collect();
        self.pending = Some(PendingStep { step, rows: pending_rows, expectations, zero_pages });
        self.debug_check();
        Ok(plan)
    }

    /// Hands a plan the caller is done with back for reuse (optional: saves allocation).
    pub fn recycle(&self, plan: BatchPlan) {
        self.recycler.put(plan);
    }

    /// A handle that recycles plans into this engine, for owners that outlive a borrow
    /// of the engine (the Python bindings drop plans whenever Python frees them).
    pub fn recycler(&self) -> PlanRecycler {
        self.recycler.clone()
    }

    /// The step id of the pending plan, if any.
    pub fn pending_step(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.step)
    }

    /// Drops the pending plan uncommitted. Its lifecycle notices are re-sent with the next plan.
    /// With recurrent groups, its forward may have advanced states in place, so every
    /// request with a row in it restarts (pages and slot freed, back to waiting: it
    /// recomputes from its longest cached checkpoint), its checkpoints are dropped, and
    /// its `zero_pages` count as not zeroed.
    pub fn discard_plan(&mut self) {
        let Some(pending) = self.pending.take() else { return };
        self.sched.slots.resend_after_discard();
        if self.sched.kv.layout.has_recurrent() {
            self.sched.kv.drop_checkpoints();
            self.sched.kv.pool.mark_holding_state(&pending.zero_pages);
            let live: Vec<usize> = pending
                .rows
                .iter()
                .filter(|r| matches!(&self.sched.requests.get(r.req), Some(Some(q)) if q.arrival_seq == r.arrival_seq))
                .map(|r| r.req)
                .collect();
            // Newest first, so FCFS keeps their order at the front of the queue.
            for pos in (0..self.sched.running.len()).rev() {
                let idx = self.sched.running[pos];
                if live.contains(&idx) {
                    self.sched.restart(idx);
                }
            }
        }
        self.debug_check();
    }

    /// Validates `output` against the pending plan (`step` must be its id), then commits
    /// it. On error nothing changes and the plan stays pending.
    pub fn update(&mut self, step: u64, output: &ForwardOutputRef) -> Result<Vec<RequestOutput>, CoreError> {
        let pending = self.pending.as_ref().ok_or_else(|| CoreError::state("update() called with no pending plan"))?;
        if pending.step != step {
            return Err(CoreError::invalid(format!("plan {step} is not the pending plan (that is plan {})", pending.step)));
        }
        output.validate(&pending.expectations, self.config.vocab_size)?;
        let pending = self.pending.take().expect("checked above");
        self.sched.slots.commit(); // the runner has now seen the plan's lifecycle notices for good
        self.sched.kv.commit_checkpoints(); // and applied its copy_pages
        let now = Instant::now();
        let mut outputs = std::mem::take(&mut self.abort_outputs);
        outputs.reserve(pending.rows.len());
        let mut prompt_entry = 0; // the next row's first entry in the prompt logprob arrays
        for (i, row) in pending.rows.iter().enumerate() {
            let first_prompt_entry = prompt_entry;
            prompt_entry += row.prompt_logprob_positions().len();
            let live = matches!(&self.sched.requests.get(row.req), Some(Some(r)) if r.arrival_seq == row.arrival_seq);
            if !live {
                continue; // aborted while the plan was in flight
            }
            if !row.prompt_logprob_positions().is_empty() {
                let req = self.sched.requests[row.req].as_ref().expect("live request index");
                let k = req.params.prompt_logprobs.unwrap_or(0) as usize;
                for (m, p) in (first_prompt_entry..).zip(row.prompt_logprob_positions()) {
                    let target = req.token_ids[p as usize + 1];
                    req.record.log.push_prompt_logprobs(output.prompt_logprob_entry(m, target, k));
                }
            }
            let lo = output.token_indptr[i] as usize;
            let hi = output.token_indptr[i + 1] as usize;
            let drafts = match (output.draft_token_ids, output.draft_indptr) {
                (Some(ids), Some(ptr)) => Some(&ids[ptr[i] as usize..ptr[i + 1] as usize]),
                _ => None,
            };
            if let Some(out) = self.commit_row(row, pending.expectations[i].samples, output, lo..hi, drafts, now) {
                outputs.push(out);
            }
        }
        self.debug_check();
        Ok(outputs)
    }

    fn commit_row(
        &mut self,
        row: &PendingRow,
        samples: bool,
        output: &ForwardOutputRef,
        range: std::ops::Range<usize>,
        runner_drafts: Option<&[u32]>,
        now: Instant,
    ) -> Option<RequestOutput> {
        let eos = &self.config.eos_token_ids;
        let page_size = self.config.page_size;
        let max_model_len = self.config.max_model_len;
        let sched = &mut self.sched;
        let req = sched.requests[row.req].as_mut().expect("live request index");
        // A verify row's drafts count as computed only once the model agreed with them.
        let row_start = req.num_computed_tokens;
        req.num_computed_tokens += row.num_new_tokens - row.num_drafts;
        let drafts = std::mem::take(&mut req.drafts);
        // The runner has seen this plan's row; tokens appended below go in the next plan's
        // committed_token_ids.
        req.num_tokens_shown = req.num_tokens();
        let mut finish = None;
        let mut num_new = 0;
        let mut num_accepted = 0u32;
        if samples {
            // Token j is the model's choice after the row's first j + 1 inputs; while it equals
            // draft j, that draft's KV (computed in this row) is valid and token j + 1 follows
            // from it. The first disagreement is the row's last token (the correction).
            for (j, n) in range.enumerate() {
                let token = output.token_ids[n];
                let logprobs = req.params.logprobs.map(|k| output.logprob_entry(n, k as usize));
                finish = req.append_output(token, logprobs, eos, max_model_len);
                num_new += 1;
                if finish.is_some() {
                    break; // tokens after a stop are dropped
                }
                if j >= row.num_drafts as usize || drafts.get(j) != Some(&token) {
                    break;
                }
                req.num_computed_tokens += 1;
                num_accepted += 1;
            }
            if row.num_drafts > 0 && num_accepted < row.num_drafts && finish.is_none() && sched.kv.spare_states {
                // The recurrent states advanced over rejected drafts: restore them (the spares
                // hold the states at the row's start) and recompute the row's committed tokens.
                req.num_computed_tokens = row_start;
                req.restore_states = true;
            }
            if row.num_drafts > 0 {
                self.metrics.spec_decode_num_drafts += 1;
                self.metrics.spec_decode_num_draft_tokens += u64::from(row.num_drafts);
                self.metrics.spec_decode_num_accepted_tokens += u64::from(num_accepted);
                // (A runner's drafts are cut to num_speculative_tokens: every position counts.)
                for count in self.metrics.spec_decode_num_accepted_tokens_per_pos.iter_mut().take(num_accepted as usize) {
                    *count += 1;
                }
            }
            if self.config.enable_prefix_caching {
                req.update_block_hashes(page_size);
            }
            if num_new > 0 {
                self.metrics.generation_tokens += num_new as u64;
                match req.last_token_time {
                    None => {
                        self.metrics.time_to_first_token_s.observe(now.duration_since(req.arrival_time).as_secs_f64());
                        self.metrics.prompt_tokens += u64::from(req.num_prompt_tokens);
                    }
                    Some(last) => self.metrics.inter_token_latency_s.observe(now.duration_since(last).as_secs_f64()),
                }
                req.last_token_time = Some(now);
            }
        }
        sched.kv.cache_full_pages(req);
        if finish.is_none() {
            let k = self.config.num_speculative_tokens;
            if k > 0 && req.num_computed_tokens + 1 == req.num_tokens() && may_draft(req) {
                // Room for the drafts and the token after them, within max_tokens and the context.
                let outputs_left = req.params.max_tokens.saturating_sub(req.num_output_tokens());
                let context_left = max_model_len.saturating_sub(req.num_tokens());
                let cap = k.min(outputs_left.saturating_sub(1)).min(context_left.saturating_sub(1));
                req.drafts = match runner_drafts {
                    // The runner's own drafter (MTP, EAGLE-style heads) proposed for this row.
                    Some(d) if !d.is_empty() => d[..d.len().min(cap as usize)].to_vec(),
                    _ => draft::propose_ngram(
                        &req.token_ids,
                        self.config.ngram_prompt_lookup_min as usize,
                        self.config.ngram_prompt_lookup_max as usize,
                        cap as usize,
                    ),
                };
            }
            sched.kv.release_out_of_window(req);
            let computed = req.num_computed_tokens;
            // (Not while a restore is pending: the states are right only after it, and this
            // boundary's checkpoint was queued when the request first reached it.)
            if sched.kv.checkpointing && !req.restore_states && sched.kv.checkpoint_due(req, computed) {
                sched.checkpoints_due.push((row.req, row.arrival_seq, computed / page_size));
            }
        }
        let out = RequestOutput {
            record: req.record.clone(),
            num_output_tokens: req.num_output_tokens() as usize,
            num_new_tokens: num_new,
            finished: finish.is_some(),
            finish_reason: finish,
            num_cached_tokens: req.num_cached_tokens,
            has_logprobs: req.params.logprobs.is_some(),
            has_prompt_logprobs: req.params.prompt_logprobs.is_some(),
        };
        if let Some(reason) = finish {
            let req = self.sched.remove(row.req);
            self.metrics.record_finished(reason);
            self.metrics.e2e_request_latency_s.observe(now.duration_since(req.arrival_time).as_secs_f64());
        }
        (num_new > 0).then_some(out)
    }

    pub fn has_unfinished(&self) -> bool {
        !self.sched.waiting.is_empty() || !self.sched.running.is_empty() || !self.abort_outputs.is_empty()
    }

    pub fn num_waiting(&self) -> usize {
        self.sched.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.sched.running.len()
    }

    pub fn num_free_pages(&self) -> u32 {
        self.sched.kv.pool.num_free_pages()
    }

    pub fn num_cached_pages(&self) -> usize {
        self.sched.kv.pool.num_cached_pages()
    }

    /// The page pool (read-only: for tests and introspection).
    pub fn pool(&self) -> &crate::page_pool::PagePool {
        &self.sched.kv.pool
    }

    /// The pages request `request_id` holds in group `group`, position-indexed.
    pub fn request_pages(&self, request_id: &str, group: usize) -> Option<Vec<u32>> {
        self.sched.index_of.get(request_id).map(|&i| self.sched.request(i).pages[group].clone())
    }

    /// Forgets every cached block hash (running requests are unaffected).
    pub fn reset_prefix_cache(&mut self) {
        self.sched.kv.pool.reset_prefix_cache();
    }

    pub fn metrics_text(&self) -> String {
        self.metrics.render(&Gauges {
            num_requests_running: self.sched.running.len(),
            num_requests_waiting: self.sched.waiting.len(),
            kv_cache_usage: self.sched.kv.pool.usage(),
        })
    }

    /// Every pool and scheduler invariant (see `PagePool::check_integrity`).
    pub fn check_integrity(&self) -> Result<(), CoreError> {
        self.sched.check_integrity().map_err(|e| CoreError::state(format!("integrity check failed: {e}")))
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            if let Err(e) = self.check_integrity() {
                panic!("{e}");
            }
        }
    }
}
