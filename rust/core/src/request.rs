//! A request: its tokens, sampling parameters, progress and cache pages.
//!
//! Progress follows one rule: `num_computed_tokens` (tokens whose KV is in the cache)
//! catches up with `num_tokens()` (prompt + sampled tokens). Prefill, chunked prefill,
//! decode, prefix hits and preemption-by-recompute are all just values of these two.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::block_hash::BlockHash;
use crate::error::CoreError;
use crate::page_pool::PageId;

/// Why a request stopped.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Sampled an EOS id (unless `ignore_eos`) or one of `stop_token_ids`.
    Stop,
    /// Reached `max_tokens` or `max_model_len`.
    Length,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Generation parameters of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: u32,
    pub min_tokens: u32,
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = disabled.
    pub top_k: i32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// None: no logprobs; Some(0): the sampled token's; Some(k): also the top k.
    pub logprobs: Option<u32>,
    /// The same for every prompt token after the first (vLLM's `prompt_logprobs`; what
    /// OpenAI's `echo` + `logprobs` report): the logprob of prompt token `p + 1` given tokens
    /// `0..=p`. A request asking for them takes no prefix-cache hit until they are recorded
    /// (each position's logits must be computed).
    pub prompt_logprobs: Option<u32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// (token id, bias) pairs, sorted by token, one per token: the bias is added to the
    /// token's logit before the penalties (OpenAI's `logit_bias`; vLLM's order). Each bias
    /// is finite and in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// Lower is served first under the priority policy.
    pub priority: i32,
    /// False: speculative decoding never drafts for this request (its rows are plain decode
    /// rows): a grammar-constrained request, whose drafts the sampler cannot mask.
    pub speculate: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            priority: 0,
            speculate: true,
        }
    }
}

/// Largest `logprobs` value accepted (as vLLM's default cap).
pub const MAX_LOGPROBS: u32 = 20;

/// Largest `|logit_bias|` accepted (OpenAI's range: -100 bans a token, 100 all but forces it).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

impl SamplingParams {
    /// Checks every field's range; the error names the field. `top_k == -1` is
    /// normalised to 0 (disabled).
    pub fn validated(mut self) -> Result<Self, CoreError> {
        let bad = |field: &str, why: String| Err(CoreError::invalid(format!("SamplingParams.{field}: {why}")));
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be >= 1".into());
        }
        if self.min_tokens > self.max_tokens {
            return bad("min_tokens", format!("{} is greater than max_tokens {}", self.min_tokens, self.max_tokens));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", format!("must be finite and >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k < -1 {
            return bad("top_k", format!("must be -1 or 0 (disabled) or >= 1, got {}", self.top_k));
        }
        if self.top_k == -1 {
            self.top_k = 0;
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        if let Some(seed) = self.seed {
            if seed > i64::MAX as u64 {
                return bad("seed", format!("must be < 2**63, got {seed}"));
            }
        }
        for (field, value) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(k) = value.filter(|&k| k > MAX_LOGPROBS) {
                return bad(field, format!("must be in [0, {MAX_LOGPROBS}], got {k}"));
            }
        }
        for (field, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, format!("must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", format!("must be finite and > 0, got {}", self.repetition_penalty));
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b)) {
            return bad("logit_bias", format!("token {token}: must be in [-100, 100], got {bias}"));
        }
        self.logit_bias.sort_by_key(|&(token, _)| token);
        if let Some(pair) = self.logit_bias.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return bad("logit_bias", format!("token {} is given twice", pair[0].0));
        }
        Ok(self)
    }
}

/// What a request's outputs share with the `RequestOutput`s handed to callers, so an
/// output can list all tokens so far without copying them every step.
#[derive(Debug)]
pub struct RequestRecord {
    pub request_id: Arc<str>,
    pub prompt_token_ids: Vec<u32>,
    pub log: OutputLog,
}

/// Output tokens (and their logprobs when asked for), append-only, written by the engine.
///
/// Token slots are allocated once for the most outputs the request can produce, so an
/// append is one plain store: no lock, no reallocation. A reader only reads the prefix
/// a `RequestOutput` recorded, written before that output was created; handing the output
/// to another thread (through Python or a channel) orders those writes before the read.
#[derive(Debug)]
pub struct OutputLog {
    token_ids: Box<[AtomicU32]>,
    /// Per output token: (token id, logprob) pairs, the sampled token first. Locked only
    /// for requests that asked for logprobs.
    logprobs: Mutex<Vec<Vec<(u32, f32)>>>,
    /// Per prompt token from the second on, in order: (that token, its logprob) first, then
    /// the top k. Locked only for requests that asked for prompt logprobs.
    prompt_logprobs: Mutex<Vec<Vec<(u32, f32)>>>,
}

impl OutputLog {
    pub fn with_capacity(max_num_outputs: usize) -> Self {
        OutputLog {
            token_ids: (0..max_num_outputs).map(|_| AtomicU32::new(0)).collect(),
            logprobs: Mutex::default(),
            prompt_logprobs: Mutex::default(),
        }
    }

    pub fn push_prompt_logprobs(&self, entry: Vec<(u32, f32)>) {
        self.prompt_logprobs.lock().unwrap_or_else(|e| e.into_inner()).push(entry);
    }

    /// Prompt tokens (from the second) whose logprob entry is recorded.
    pub fn num_prompt_logprobs(&self) -> usize {
        self.prompt_logprobs.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Entries of prompt tokens `1..=n` recorded so far (entry i is prompt token i + 1's).
    pub fn prompt_logprobs(&self) -> Vec<Vec<(u32, f32)>> {
        self.prompt_logprobs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Writes output token `index`; the engine writes each index once, in order.
    pub fn set_token(&self, index: usize, token: u32) {
        self.token_ids[index].store(token, Ordering::Relaxed);
    }

    pub fn push_logprobs(&self, entry: Vec<(u32, f32)>) {
        self.logprobs.lock().unwrap_or_else(|e| e.into_inner()).push(entry);
    }

    /// Output tokens `range` (all already written).
    pub fn tokens(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        self.token_ids[range].iter().map(|t| t.load(Ordering::Relaxed)).collect()
    }

    /// Logprob entries of output tokens `range` (a streamed response asks for the new ones
    /// only, so a step costs the same at any generation length).
    pub fn logprobs(&self, range: std::ops::Range<usize>) -> Vec<Vec<(u32, f32)>> {
        self.logprobs.lock().unwrap_or_else(|e| e.into_inner())[range].to_vec()
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
}

/// A live request (waiting or running).
#[derive(Debug)]
pub struct Request {
    pub record: Arc<RequestRecord>,
    pub params: SamplingParams,
    pub status: RequestStatus,
    /// Prompt then sampled tokens.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: u32,
    /// Tokens whose KV is in the cache.
    pub num_computed_tokens: u32,
    /// Prompt tokens served by the prefix cache on first scheduling.
    pub num_cached_tokens: u32,
    /// Whether the prefix cache was already queried (metrics count first queries only).
    pub prefix_queried: bool,
    /// Chained hashes of every full page of `token_ids` (when prefix caching is on).
    pub block_hashes: Vec<BlockHash>,
    /// Per cache group: position-indexed page table (entry j holds positions
    /// `[j*page_size, (j+1)*page_size)`; `NULL_PAGE` where a window page was released).
    pub pages: Vec<Vec<PageId>>,
    /// Per cache group: leading pages already released (sliding window) — all `NULL_PAGE`.
    pub num_released_pages: Vec<u32>,
    /// Per cache group: leading full pages already offered to the prefix cache.
    pub num_hashed_pages: Vec<u32>,
    /// Runner state row while running.
    pub slot: Option<u32>,
    /// Draft tokens proposed after the last committed step, verified by the next plan's row
    /// (speculative decoding); never part of `token_ids` until the target model agrees.
    pub drafts: Vec<u32>,
    /// A draft was rejected in a recurrent layout: the next plan restores the states from the
    /// spares (saved before the verify row) and recomputes from the verify row's start.
    pub restore_states: bool,
    /// Tokens the runner has been shown through committed plans: everything when its slot
    /// was announced (`new_request_token_ids`), then up to the last committed plan that
    /// carried a row for it. The plan's `committed_token_ids` for this request start here.
    pub num_tokens_shown: u32,
    /// Arrival order, for FCFS ties.
    pub arrival_seq: u64,
    pub arrival_time: Instant,
    pub first_scheduled_time: Option<Instant>,
    pub last_token_time: Option<Instant>,
}

impl Request {
    /// A waiting request. `max_num_tokens` (prompt + most outputs) sizes its token
    /// vectors once, so decoding never reallocates them.
    pub fn new(
        request_id: String,
        prompt_token_ids: Vec<u32>,
        params: SamplingParams,
        num_groups: usize,
        arrival_seq: u64,
        now: Instant,
        max_num_tokens: usize,
    ) -> Self {
        let num_prompt_tokens = prompt_token_ids.len() as u32;
        let mut token_ids = Vec::with_capacity(max_num_tokens.max(prompt_token_ids.len()));
        token_ids.extend_from_slice(&prompt_token_ids);
        let max_num_outputs = max_num_tokens.saturating_sub(prompt_token_ids.len());
        Request {
            token_ids,
            record: Arc::new(RequestRecord {
                request_id: request_id.into(),
                prompt_token_ids,
                log: OutputLog::with_capacity(max_num_outputs),
            }),
            params,
            status: RequestStatus::Waiting,
            num_prompt_tokens,
            num_computed_tokens: 0,
            num_cached_tokens: 0,
            prefix_queried: false,
            block_hashes: Vec::new(),
            pages: vec![Vec::new(); num_groups],
            num_released_pages: vec![0; num_groups],
            num_hashed_pages: vec![0; num_groups],
            slot: None,
            drafts: Vec::new(),
            restore_states: false,
            num_tokens_shown: 0,
            arrival_seq,
            arrival_time: now,
            first_scheduled_time: None,
            last_token_time: None,
        }
    }

    pub fn id(&self) -> &str {
        &self.record.request_id
    }

    pub fn num_tokens(&self) -> u32 {
        self.token_ids.len() as u32
    }

    pub fn num_output_tokens(&self) -> u32 {
        self.num_tokens() - self.num_prompt_tokens
    }

    /// Extends `block_hashes` to cover every full page of `token_ids`.
    pub fn update_block_hashes(&mut self, page_size: u32) {
        let ps = page_size as usize;
        while (self.block_hashes.len() + 1) * ps <= self.token_ids.len() {
            let i = self.block_hashes.len();
            let parent = self.block_hashes.last().copied();
            self.block_hashes.push(BlockHash::chain(parent, &self.token_ids[i * ps..(i + 1) * ps], 0));
        }
    }

    /// Whether `token` is one of this request's stop tokens (EOS unless `ignore_eos`, or a
    /// `stop_token_ids` entry).
    pub fn is_stop_token(&self, token: u32, eos_token_ids: &[u32]) -> bool {
        self.params.stop_token_ids.contains(&token) || (!self.params.ignore_eos && eos_token_ids.contains(&token))
    }

    /// Positions `p` (`num_computed..end`, the row's real tokens) whose prompt logprob the
    /// next forward computes: the logprob of prompt token `p + 1`, for every `p` below
    /// `num_prompt_tokens - 1` not recorded yet. Empty unless the request asks for them.
    pub fn prompt_logprob_positions(&self, num_computed: u32, end: u32) -> std::ops::Range<u32> {
        if self.params.prompt_logprobs.is_none() {
            return 0..0;
        }
        let recorded = self.record.log.num_prompt_logprobs() as u32;
        let start = num_computed.max(recorded);
        start..end.min(self.num_prompt_tokens.saturating_sub(1)).max(start)
    }

    /// Whether prompt logprobs are still to be computed (then the request takes no prefix hit).
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs.is_some()
            && (self.record.log.num_prompt_logprobs() as u32) < self.num_prompt_tokens.saturating_sub(1)
    }

    /// Appends a sampled token (and its logprob entry, when asked for) and says whether it
    /// finishes the request. A stop token counts once `min_tokens` outputs came before it,
    /// the same rule as the plan's `banned_token_ids`; the stop token itself is kept.
    pub fn append_output(
        &mut self,
        token: u32,
        logprobs: Option<Vec<(u32, f32)>>,
        eos_token_ids: &[u32],
        max_model_len: u32,
    ) -> Option<FinishReason> {
        self.record.log.set_token(self.num_output_tokens() as usize, token);
        self.token_ids.push(token);
        if let Some(entry) = logprobs {
            self.record.log.push_logprobs(entry);
        }
        let num_output = self.num_output_tokens();
        if self.is_stop_token(token, eos_token_ids) && num_output > self.params.min_tokens {
            Some(FinishReason::Stop)
        } else if num_output >= self.params.max_tokens || self.num_tokens() >= max_model_len {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}
