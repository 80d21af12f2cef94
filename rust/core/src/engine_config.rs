//! `EngineConfig`: the engine's settings, each checked on its own (`Engine::new` also
//! checks them against the cache layout).

use crate::error::CoreError;
pub use crate::scheduler::SchedulingPolicy;

/// Most pages a pool may have: far above any device's cache today (141 GB in 16-token
/// pages of 1 KB per token is ~9M pages), low enough that the pool's host bookkeeping
/// (~50 bytes a page) cannot exhaust the host.
pub const MAX_NUM_PAGES: u32 = 1 << 27;

/// Engine settings. See `resin/_core.pyi` for the Python names and defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per page.
    pub page_size: u32,
    /// Pages in the pool, the null page 0 included.
    pub num_pages: u32,
    pub max_num_seqs: u32,
    /// Token budget of one step (chunked prefill splits prompts to fit).
    pub max_num_batched_tokens: u32,
    /// Longest sequence (prompt + output) in tokens.
    pub max_model_len: u32,
    pub enable_prefix_caching: bool,
    pub eos_token_ids: Vec<u32>,
    /// When known, token ids (prompts, stop ids, runner output) must be below it.
    pub vocab_size: Option<u32>,
    pub policy: SchedulingPolicy,
    /// Recurrent groups with prefix caching: tokens between state checkpoints (rounded up
    /// to a multiple of `page_size`; 0 = every page boundary). The boundary just before a
    /// prompt's last token is always checkpointed (a repeated or extended prompt hits there).
    pub recurrent_checkpoint_interval: u32,
    /// Speculative decoding with the n-gram drafter (`crate::draft`): up to this many draft
    /// tokens per decoding request and step, verified in one row of 1 + k tokens (0 = off).
    pub num_speculative_tokens: u32,
    /// The n-gram drafter's match lengths: the last `max` .. `min` tokens are looked up.
    pub ngram_prompt_lookup_min: u32,
    pub ngram_prompt_lookup_max: u32,
    /// CUDA-graph batch buckets, strictly ascending (empty: no padding, the default). A
    /// pure-decode step (every row a one-token decode row, so no verify rows and no prefill
    /// chunks) of S rows reports `BatchPlan::padded_num_sequences` = the smallest bucket >= S;
    /// any other step, or S above every bucket, reports S (`padded_num_sequences`). The plan's
    /// arrays stay S rows long either way: the runner pads its own static buffers.
    pub cuda_graph_batch_sizes: Vec<u32>,
}

/// Default tokens between recurrent checkpoints: a checkpoint copies every recurrent
/// layer's state (Qwen3-Next-80B: 79 MB per request), so taking one per 16-token page made
/// a 256-sequence decode step 20x a full-attention one (docs/benchmarks.md).
pub const DEFAULT_RECURRENT_CHECKPOINT_INTERVAL: u32 = 256;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page_size: 16,
            num_pages: 4096,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            enable_prefix_caching: true,
            eos_token_ids: Vec::new(),
            vocab_size: None,
            policy: SchedulingPolicy::Fcfs,
            recurrent_checkpoint_interval: DEFAULT_RECURRENT_CHECKPOINT_INTERVAL,
            num_speculative_tokens: 0,
            ngram_prompt_lookup_min: 1,
            ngram_prompt_lookup_max: 4,
            cuda_graph_batch_sizes: Vec::new(),
        }
    }
}

impl EngineConfig {
    /// Checks each field on its own; `Engine::new` also checks them against the layout.
    pub fn validate(&self) -> Result<(), CoreError> {
        let positive = [
            ("page_size", self.page_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(CoreError::invalid(format!("EngineConfig.{field} must be >= 1")));
            }
        }
        if self.num_pages < 2 {
            return Err(CoreError::invalid(format!(
                "EngineConfig.num_pages must be >= 2 (page 0 is the reserved null page), got {}",
                self.num_pages
            )));
        }
        if self.num_pages > MAX_NUM_PAGES {
            return Err(CoreError::invalid(format!(
                "EngineConfig.num_pages must be <= {MAX_NUM_PAGES} (2**27: ~7 GB of host bookkeeping), got {}",
                self.num_pages
            )));
        }
        if self.num_speculative_tokens > 0
            && (self.ngram_prompt_lookup_min == 0 || self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max)
        {
            return Err(CoreError::invalid(format!(
                "EngineConfig: speculative decoding needs 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got {} and {}",
                self.ngram_prompt_lookup_min, self.ngram_prompt_lookup_max
            )));
        }
        if self.max_model_len < 2 {
            return Err(CoreError::invalid(format!(
                "EngineConfig.max_model_len must be >= 2 (one prompt token and one output token), got {}",
                self.max_model_len
            )));
        }
        if self.cuda_graph_batch_sizes.first() == Some(&0) || self.cuda_graph_batch_sizes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CoreError::invalid(format!(
                "EngineConfig.cuda_graph_batch_sizes must be strictly ascending sizes >= 1, got {:?}",
                self.cuda_graph_batch_sizes
            )));
        }
        if let Some(vocab) = self.vocab_size {
            if vocab == 0 {
                return Err(CoreError::invalid("EngineConfig.vocab_size must be >= 1"));
            }
            if let Some(&t) = self.eos_token_ids.iter().find(|&&t| t >= vocab) {
                return Err(CoreError::invalid(format!("EngineConfig.eos_token_ids: {t} is not below vocab_size {vocab}")));
            }
        }
        Ok(())
    }

    /// Tokens between recurrent checkpoints: `recurrent_checkpoint_interval` rounded up to a
    /// multiple of `page_size` (`page_size` for 0).
    pub fn checkpoint_interval_tokens(&self) -> u32 {
        let ps = self.page_size.max(1);
        self.recurrent_checkpoint_interval.max(1).div_ceil(ps).saturating_mul(ps)
    }

    /// The CUDA-graph bucket a step of `num_sequences` rows runs at: the smallest of
    /// `cuda_graph_batch_sizes` >= `num_sequences` when the step is pure decode (every row a
    /// one-token decode row: `num_decode_sequences == num_sequences`), else `num_sequences`
    /// (a mixed or prefill step, a verify row, no bucket that large, no buckets, no rows).
    pub fn padded_num_sequences(&self, num_sequences: u32, num_decode_sequences: u32) -> u32 {
        if num_sequences == 0 || num_decode_sequences != num_sequences {
            return num_sequences;
        }
        let buckets = &self.cuda_graph_batch_sizes;
        buckets.get(buckets.partition_point(|&b| b < num_sequences)).copied().unwrap_or(num_sequences)
    }
}
