//! Runner output (`ForwardOutputRef`) validation, and what a step reports per request
//! (`RequestOutput`).

use std::sync::Arc;

use crate::error::CoreError;
use crate::request::{FinishReason, RequestRecord};

/// A runner's output, borrowed from wherever it lives (numpy arrays in the bindings).
///
/// - `token_ids`: u32[N] sampled tokens, rows concatenated;
/// - `token_indptr`: u32[S+1], row i produced `token_ids[token_indptr[i]..token_indptr[i+1]]`;
/// - `logprobs`: f32[N], logprob of each sampled token (optional);
/// - `top_logprob_ids` / `top_logprobs`: u32[N, k] / f32[N, k], row-major (optional, together);
/// - `prompt_logprobs`: f32[M], one per plan token with a `prompt_logprob_targets` entry
///   (>= 0), in token order: that target's logprob (required when M > 0);
/// - `prompt_top_logprob_ids` / `prompt_top_logprobs`: u32[M, k] / f32[M, k], the top entries
///   (together; required with k columns at least when a row asks for k > 0);
/// - `draft_token_ids` / `draft_indptr`: u32[D] / u32[S+1], the runner's own drafter's
///   proposals for each row's request, verified by the next plan (optional, together; at most
///   `num_speculative_tokens` per row; they replace the n-gram drafter's for that row).
#[derive(Copy, Clone, Debug, Default)]
pub struct ForwardOutputRef<'a> {
    pub token_ids: &'a [u32],
    pub token_indptr: &'a [u32],
    pub logprobs: Option<&'a [f32]>,
    pub top_logprob_ids: Option<&'a [u32]>,
    pub top_logprobs: Option<&'a [f32]>,
    /// k, the number of columns of the top arrays (0 without them).
    pub num_top_logprobs: usize,
    pub prompt_logprobs: Option<&'a [f32]>,
    pub prompt_top_logprob_ids: Option<&'a [u32]>,
    pub prompt_top_logprobs: Option<&'a [f32]>,
    /// Columns of the prompt top arrays (0 without them).
    pub num_prompt_top_logprobs: usize,
    pub draft_token_ids: Option<&'a [u32]>,
    pub draft_indptr: Option<&'a [u32]>,
}

/// What the engine needs to know about one row of the pending plan to check the output.
#[derive(Copy, Clone, Debug)]
pub struct RowExpectation {
    /// Whether the row samples: then it must return 1..=`max_returned_tokens` tokens; a
    /// mid-prefill chunk may return up to that many, which are ignored.
    pub samples: bool,
    /// 1 + drafts being verified in the row.
    pub max_returned_tokens: u32,
    /// -1: no logprobs wanted; k >= 0: logprobs and k top entries wanted.
    pub num_logprobs: i32,
    /// Tokens of the row with a prompt logprob target (the row's share of M).
    pub num_prompt_targets: u32,
    /// -1: none; k >= 0: the row's prompt logprobs want k top entries.
    pub num_prompt_logprobs: i32,
}

impl<'a> ForwardOutputRef<'a> {
    /// Checks the output against the plan's rows. Errors name the field.
    pub fn validate(&self, rows: &[RowExpectation], vocab_size: Option<u32>) -> Result<(), CoreError> {
        let s = rows.len();
        let n = self.token_ids.len();
        let indptr = self.token_indptr;
        if indptr.len() != s + 1 {
            return Err(CoreError::invalid(format!(
                "ForwardOutput.token_indptr must have num_sequences + 1 = {} entries, got {}",
                s + 1,
                indptr.len()
            )));
        }
        if indptr[0] != 0 {
            return Err(CoreError::invalid(format!("ForwardOutput.token_indptr[0] must be 0, got {}", indptr[0])));
        }
        for i in 0..s {
            if indptr[i + 1] < indptr[i] {
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.token_indptr must be non-decreasing: entry {} is {} after {}",
                    i + 1,
                    indptr[i + 1],
                    indptr[i]
                )));
            }
        }
        if indptr[s] as usize != n {
            return Err(CoreError::invalid(format!(
                "ForwardOutput.token_indptr[-1] = {} must equal len(token_ids) = {n}",
                indptr[s]
            )));
        }
        for (i, row) in rows.iter().enumerate() {
            let count = indptr[i + 1] - indptr[i];
            if count > row.max_returned_tokens || (row.samples && count == 0) {
                let want = if row.samples {
                    format!("1..={}", row.max_returned_tokens)
                } else {
                    format!("0..={}", row.max_returned_tokens)
                };
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.token_indptr: row {i} returned {count} tokens, expected {want}"
                )));
            }
        }
        match (self.draft_token_ids, self.draft_indptr) {
            (None, None) => {}
            (Some(ids), Some(ptr)) => {
                let monotone = ptr.windows(2).all(|w| w[0] <= w[1]);
                if ptr.len() != s + 1 || ptr[0] != 0 || !monotone || ptr[s] as usize != ids.len() {
                    return Err(CoreError::invalid(format!(
                        "ForwardOutput.draft_indptr must be {} non-decreasing offsets from 0 to len(draft_token_ids) = {}",
                        s + 1,
                        ids.len()
                    )));
                }
            }
            _ => return Err(CoreError::invalid("ForwardOutput.draft_token_ids and draft_indptr must be given together")),
        }
        if let Some(vocab) = vocab_size {
            for (field, ids) in [
                ("token_ids", Some(self.token_ids)),
                ("top_logprob_ids", self.top_logprob_ids),
                ("prompt_top_logprob_ids", self.prompt_top_logprob_ids),
                ("draft_token_ids", self.draft_token_ids),
            ] {
                if let Some(pos) = ids.and_then(|ids| ids.iter().position(|&t| t >= vocab)) {
                    return Err(CoreError::invalid(format!(
                        "ForwardOutput.{field}[{pos}] = {} is out of vocabulary range [0, {vocab})",
                        ids.unwrap()[pos]
                    )));
                }
            }
        }
        if let Some(lp) = self.logprobs {
            if lp.len() != n {
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.logprobs must have len(token_ids) = {n} entries, got {}",
                    lp.len()
                )));
            }
        }
        match (self.top_logprob_ids, self.top_logprobs) {
            (Some(ids), Some(lps)) => {
                let k = self.num_top_logprobs;
                if ids.len() != n * k || lps.len() != n * k {
                    return Err(CoreError::invalid(format!(
                        "ForwardOutput.top_logprob_ids and top_logprobs must both have shape [{n}, {k}]"
                    )));
                }
            }
            (None, None) => {}
            _ => {
                return Err(CoreError::invalid(
                    "ForwardOutput.top_logprob_ids and ForwardOutput.top_logprobs must be given together",
                ))
            }
        }
        for (i, row) in rows.iter().enumerate() {
            if !row.samples || row.num_logprobs < 0 {
                continue;
            }
            if self.logprobs.is_none() {
                return Err(CoreError::invalid(format!("ForwardOutput.logprobs is missing but row {i} asked for logprobs")));
            }
            let k = row.num_logprobs as usize;
            if k > 0 && (self.top_logprob_ids.is_none() || self.num_top_logprobs < k) {
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.top_logprob_ids has {} columns but row {i} asked for {k} top logprobs",
                    self.num_top_logprobs
                )));
            }
        }
        self.validate_prompt_logprobs(rows)
    }

    /// The prompt logprob arrays against the rows' targets (M in all).
    fn validate_prompt_logprobs(&self, rows: &[RowExpectation]) -> Result<(), CoreError> {
        let m: usize = rows.iter().map(|r| r.num_prompt_targets as usize).sum();
        match self.prompt_logprobs {
            Some(lp) if lp.len() != m => {
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.prompt_logprobs must have one entry per prompt_logprob_targets entry >= 0 ({m}), got {}",
                    lp.len()
                )));
            }
            None if m > 0 => {
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.prompt_logprobs is missing but the plan has {m} prompt logprob targets"
                )));
            }
            _ => {}
        }
        let k = self.num_prompt_top_logprobs;
        match (self.prompt_top_logprob_ids, self.prompt_top_logprobs) {
            (Some(ids), Some(lps)) if ids.len() != m * k || lps.len() != m * k => {
                return Err(CoreError::invalid(format!(
                    "ForwardOutput.prompt_top_logprob_ids and prompt_top_logprobs must both have shape [{m}, {k}]"
                )));
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(CoreError::invalid(
                    "ForwardOutput.prompt_top_logprob_ids and prompt_top_logprobs must be given together",
                ));
            }
            _ => {}
        }
        if let Some((i, row)) = rows
            .iter()
            .enumerate()
            .find(|(_, r)| r.num_prompt_targets > 0 && r.num_prompt_logprobs as usize > self.prompt_top_width())
        {
            return Err(CoreError::invalid(format!(
                "ForwardOutput.prompt_top_logprob_ids has {} columns but row {i} asked for {} top prompt logprobs",
                self.prompt_top_width(),
                row.num_prompt_logprobs
            )));
        }
        Ok(())
    }

    /// Columns of the prompt top arrays actually given (0 without them).
    fn prompt_top_width(&self) -> usize {
        if self.prompt_top_logprob_ids.is_some() {
            self.num_prompt_top_logprobs
        } else {
            0
        }
    }
}

impl ForwardOutputRef<'_> {
    /// Logprob entry of output token `n`: the sampled token first, then up to `k` top
    /// entries (call only after `validate`, which checks the arrays exist and are wide enough).
    pub fn logprob_entry(&self, n: usize, k: usize) -> Vec<(u32, f32)> {
        let mut entry = vec![(self.token_ids[n], self.logprobs.expect("validated")[n])];
        let cols = self.num_top_logprobs;
        if let (Some(ids), Some(lps)) = (self.top_logprob_ids, self.top_logprobs) {
            entry.extend((0..k.min(cols)).map(|j| (ids[n * cols + j], lps[n * cols + j])));
        }
        entry
    }

    /// Prompt logprob entry `m` (the m-th target of the plan): (target, its logprob), then up
    /// to `k` top entries (call only after `validate`).
    pub fn prompt_logprob_entry(&self, m: usize, target: u32, k: usize) -> Vec<(u32, f32)> {
        let mut entry = vec![(target, self.prompt_logprobs.expect("validated")[m])];
        let cols = self.num_prompt_top_logprobs;
        if let (Some(ids), Some(lps)) = (self.prompt_top_logprob_ids, self.prompt_top_logprobs) {
            entry.extend((0..k.min(cols)).map(|j| (ids[m * cols + j], lps[m * cols + j])));
        }
        entry
    }
}

/// A request's state after a step. `token_ids()` lists every output token so far
/// without the engine copying them each step: the record is shared and append-only.
#[derive(Clone, Debug)]
pub struct RequestOutput {
    pub record: Arc<RequestRecord>,
    /// Output tokens so far (a prefix of the shared log).
    pub num_output_tokens: usize,
    /// Output tokens produced by this step (the tail of that prefix).
    pub num_new_tokens: usize,
    pub finished: bool,
    pub finish_reason: Option<FinishReason>,
    pub num_cached_tokens: u32,
    pub has_logprobs: bool,
    pub has_prompt_logprobs: bool,
}

impl RequestOutput {
    pub fn request_id(&self) -> &str {
        &self.record.request_id
    }

    pub fn token_ids(&self) -> Vec<u32> {
        self.record.log.tokens(0..self.num_output_tokens)
    }

    pub fn new_token_ids(&self) -> Vec<u32> {
        self.record.log.tokens(self.num_output_tokens - self.num_new_tokens..self.num_output_tokens)
    }

    /// Per output token, (token id, logprob) pairs with the sampled token first.
    pub fn logprobs(&self) -> Option<Vec<Vec<(u32, f32)>>> {
        self.has_logprobs.then(|| self.record.log.logprobs(0..self.num_output_tokens))
    }

    /// Per prompt token from the second on, (that token, its logprob) then the top k: all of
    /// them once the prompt is computed (with the first output).
    pub fn prompt_logprobs(&self) -> Option<Vec<Vec<(u32, f32)>>> {
        self.has_prompt_logprobs.then(|| self.record.log.prompt_logprobs())
    }

    /// The entries of output tokens `start..` only: a stream reads each step's new ones, so
    /// its per-step cost does not grow with the generation (`start` is clamped).
    pub fn logprobs_from(&self, start: usize) -> Option<Vec<Vec<(u32, f32)>>> {
        let start = start.min(self.num_output_tokens);
        self.has_logprobs.then(|| self.record.log.logprobs(start..self.num_output_tokens))
    }
}
