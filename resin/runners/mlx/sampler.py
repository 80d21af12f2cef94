"""Token sampling on MLX: :class:`MlxSampler`, the same semantics as the torch sampler.

The per-request token history (from the engine's lifecycle diff), which rows sample, the
per-sample seeds and the output layout are :mod:`resin.sampling_state`'s, shared with the torch
sampler (:mod:`resin.sampling`). The order is the torch sampler's:

0. ``logit_bias`` (the plan's ``logit_bias_token_ids`` / ``logit_bias_values``) added to the
   raw logits;
1. penalties on the biased logits — repetition (prompt + output tokens: a positive logit divided
   by the penalty, a negative one multiplied), then frequency and presence (output tokens
   only: ``logit -= frequency * count + presence * (count > 0)``);
2. ``banned_token_ids`` set to ``-inf`` (stop tokens before ``min_tokens``);
3. temperature 0 = greedy (argmax of the penalised logits); otherwise divide by the
   temperature, then top-k (0 = off; ties at the k-th kept), top-p (transformers' order:
   ascending sort, drop tokens whose cumulative probability is <= 1 - top_p, keep the most
   likely), min-p, and draw.

Logprobs are ``log_softmax`` of the raw logits in float32 (before penalties, bans and
temperature), with ``k = max num_logprobs`` top columns, as the torch sampler.

**Seeds.** A row with ``seed >= 0`` draws with the MLX key ``mx.random.key(sample_seed(seed,
output_index))`` — the same (seed, output index) mix the torch sampler seeds its
``torch.Generator`` with — so a seeded request yields the same tokens whatever else is in the
batch, after preemption, and with speculative decoding on. Unseeded rows split one key the
sampler seeds from the OS. **Where frameworks necessarily differ:** MLX draws with its own
counter-based generator and ``categorical`` (Gumbel-max over the logits), torch with its
Mersenne-Twister generator and ``multinomial`` over the probabilities; the same seed therefore
gives a different (equally distributed) token stream on MLX and on torch. Greedy rows agree
across frameworks up to floating-point ties. Within MLX, the stream is reproducible on the same
device; CPU and Metal kernels may round logits differently and so flip near-equal choices.

**Structured outputs** (:mod:`resin.structured_output`), as the torch sampler: ``grammars``
is the registry the server fills; a slot whose request has a grammar when it is (re)created
gets a matcher that follows the request's committed outputs (:class:`SlotGrammars`), and after
penalties and bans each constrained row's disallowed tokens are ``-inf`` (the mask filled on the
host as numpy — llguidance's numpy fill, so no torch — and applied with one ``mx.where``). A
row whose bans leave no allowed token samples under the grammar mask alone; a constrained
request in a verify row raises ``NotImplementedError`` (structured outputs need
``num_speculative_tokens = 0``).
"""

from __future__ import annotations

import secrets

import mlx.core as mx
import numpy as np

from resin._core import BatchPlan, ForwardOutput
from resin.sampling_state import (
    SlotHistory,
    max_num_logprobs,
    offsets_in_row,
    pack_output,
    sample_seed,
)
from resin.structured_output import SlotGrammars, allowed_tokens


class MlxSampler(SlotHistory):
    """Samples the step's rows from their logits; keeps per-request token histories."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self._key = mx.random.key(secrets.randbits(63))
        mx.eval(self._key)  # not lazy: the forward may run on another thread (resin serve)
        self.grammar_state = SlotGrammars()
        self.grammars = self.grammar_state.registry  # what resin serve registers grammars in

    def begin_step(self, plan: BatchPlan) -> list[int]:
        """The token history's lifecycle diff (:class:`~resin.sampling_state.SlotHistory`),
        then the grammar matchers'."""
        new_slots = super().begin_step(plan)
        self.grammar_state.begin_step(plan, new_slots, self.slots)
        return new_slots

    def sample(self, logits: mx.array, plan: BatchPlan, rows: np.ndarray) -> ForwardOutput:
        """Sample ``logits`` float32 [R, vocab]: one entry per sample of the step, ``rows`` its
        plan row (:func:`resin.sampling_state.sampling_rows`; a row verifying k drafts has
        1 + k consecutive entries, the j-th drawing from output index
        ``num_output_tokens + j``'s seed)."""
        sampling = plan.sampling
        offsets = offsets_in_row(rows)
        if len(rows) == 0:  # every row is a mid-prefill chunk
            return pack_output(plan, rows, offsets, np.zeros(0, dtype=np.uint32))
        slots = plan.request_slots[rows].tolist()
        self.grammar_state.check_no_verify_rows(slots, offsets)
        processed = self._penalise(_biased(logits, plan, rows, self.vocab_size), plan, rows)
        banned = _banned_mask(plan, rows, self.vocab_size)
        if banned is not None:
            processed = mx.where(mx.array(banned), -mx.inf, processed)
        if self.grammar_state.slots:
            processed = self._mask(processed, logits, slots, banned)
        temperature = np.asarray(sampling.temperature[rows], dtype=np.float32)
        tokens = mx.argmax(processed, axis=-1)
        sampled_rows = np.flatnonzero(temperature > 0)
        if len(sampled_rows):
            tokens = self._draw(processed, plan, rows, offsets, sampled_rows, tokens)
        return self._output(plan, rows, offsets, tokens, logits)

    def _draw(
        self,
        processed: mx.array,
        plan: BatchPlan,
        rows: np.ndarray,
        offsets: np.ndarray,
        sampled: np.ndarray,
        greedy_tokens: mx.array,
    ) -> mx.array:
        """Tokens for the rows that draw (``sampled``, indices into ``rows``): temperature,
        top-k, top-p, min-p, then one categorical draw per row with its own key."""
        sampling = plan.sampling
        picked = rows[sampled]
        index = mx.array(sampled.astype(np.int32))
        scaled = processed[index] / mx.array(sampling.temperature[picked])[:, None]
        scaled = apply_top_k(scaled, np.asarray(sampling.top_k[picked]))
        scaled = apply_top_p(scaled, np.asarray(sampling.top_p[picked]))
        scaled = apply_min_p(scaled, np.asarray(sampling.min_p[picked]))
        output_index = (plan.num_output_tokens[rows].astype(np.int64) + offsets)[sampled]
        draws = []
        for j, row in enumerate(picked.tolist()):
            seed = int(sampling.seed[row])
            if seed < 0:
                self._key, key = mx.random.split(self._key)
            else:
                key = mx.random.key(sample_seed(seed, int(output_index[j])))
            draws.append(mx.random.categorical(scaled[j], key=key))
        tokens = np.array(greedy_tokens)
        tokens[sampled] = np.array(mx.stack(draws))
        return mx.array(tokens)

    def _mask(
        self, processed: mx.array, logits: mx.array, slots: list[int], banned: np.ndarray | None
    ) -> mx.array:
        """``processed`` with each constrained sample's disallowed tokens at ``-inf``; a sample
        with bans (``banned`` rows) left with no allowed token gets its raw ``logits`` under
        the grammar mask alone (the torch sampler's rule)."""
        indices, grammars = self.grammar_state.constraining(slots)
        if not grammars:
            return processed
        allowed = np.ones(processed.shape, dtype=bool)
        allowed[indices] = allowed_tokens(grammars, self.vocab_size)
        allowed_array = mx.array(allowed)
        processed = mx.where(allowed_array, processed, -mx.inf)
        if banned is None:
            return processed
        candidates = [r for r in indices if banned[r].any()]
        if not candidates:
            return processed
        nothing_left = np.zeros(len(slots), dtype=bool)
        nothing_left[candidates] = np.array(
            mx.all(mx.isneginf(processed[mx.array(candidates)]), axis=-1)
        )
        if not nothing_left.any():
            return processed
        grammar_only = mx.where(allowed_array, logits, -mx.inf)
        return mx.where(mx.array(nothing_left)[:, None], grammar_only, processed)

    def _penalise(self, logits: mx.array, plan: BatchPlan, rows: np.ndarray) -> mx.array:
        """The rows' penalties applied to their logits (a new array; rows without penalties
        unchanged)."""
        sampling = plan.sampling
        repetition = np.asarray(sampling.repetition_penalty[rows], dtype=np.float32)
        frequency = np.asarray(sampling.frequency_penalty[rows], dtype=np.float32)
        presence = np.asarray(sampling.presence_penalty[rows], dtype=np.float32)
        active = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)
        if not active.any():
            return logits
        slots = plan.request_slots[rows].tolist()
        seen = np.zeros((len(rows), self.vocab_size), dtype=bool)
        counts = np.zeros((len(rows), self.vocab_size), dtype=np.float32)
        for r in np.flatnonzero(active).tolist():
            state = self.slots[slots[r]]
            seen[r] = _counts(state.token_ids, self.vocab_size) > 0
            counts[r] = _counts(state.output_token_ids, self.vocab_size)
        rep = mx.array(repetition)[:, None]
        penalised = mx.where(logits > 0, logits / rep, logits * rep)
        out = mx.where(mx.array(seen) & mx.array(repetition != 1.0)[:, None], penalised, logits)
        count_array = mx.array(counts)
        return out - (
            mx.array(frequency)[:, None] * count_array
            + mx.array(presence)[:, None] * (count_array > 0).astype(mx.float32)
        )

    def _output(
        self,
        plan: BatchPlan,
        rows: np.ndarray,
        offsets: np.ndarray,
        tokens: mx.array,
        logits: mx.array,
    ) -> ForwardOutput:
        k = max_num_logprobs(plan, rows)
        if k < 0:
            return pack_output(plan, rows, offsets, np.array(tokens))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top_ids = mx.argsort(-logprobs, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        sampled = mx.take_along_axis(logprobs, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
        return pack_output(
            plan,
            rows,
            offsets,
            np.array(tokens),
            np.array(sampled),
            np.array(top_ids),
            np.array(top_values),
        )


def _counts(token_ids: list[int], vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)
    return np.bincount(ids[ids < vocab_size], minlength=vocab_size)[:vocab_size]


def _biased(logits: mx.array, plan: BatchPlan, rows: np.ndarray, vocab_size: int) -> mx.array:
    """``logits`` with each sample's ``logit_bias`` added (``logits`` itself when none has one;
    a token past the vocabulary has no logit to change)."""
    indptr = plan.logit_bias_indptr
    if len(rows) == 0 or indptr[-1] == 0:
        return logits
    bias = np.zeros((len(rows), vocab_size), dtype=np.float32)
    for r, row in enumerate(rows.tolist()):
        tokens = plan.logit_bias_token_ids[indptr[row] : indptr[row + 1]].astype(np.int64)
        values = plan.logit_bias_values[indptr[row] : indptr[row + 1]]
        inside = tokens < vocab_size
        bias[r, tokens[inside]] = values[inside]
    return logits + mx.array(bias)


def _banned_mask(plan: BatchPlan, rows: np.ndarray, vocab_size: int) -> np.ndarray | None:
    """bool [R, vocab]: the tokens each sample must not produce (None when none is banned)."""
    indptr = plan.banned_token_indptr
    if len(rows) == 0 or indptr[-1] == 0:
        return None
    mask = np.zeros((len(rows), vocab_size), dtype=bool)
    for r, row in enumerate(rows.tolist()):
        banned = plan.banned_token_ids[indptr[row] : indptr[row + 1]].astype(np.int64)
        mask[r, banned[banned < vocab_size]] = True
    return mask


def apply_top_k(logits: mx.array, top_k: np.ndarray) -> mx.array:
    """Keep each row's ``top_k`` largest logits (ties at the k-th kept); 0 = keep all."""
    if not (top_k > 0).any():
        return logits
    vocab_size = logits.shape[-1]
    k = np.clip(top_k.astype(np.int64), 1, vocab_size)
    ascending = mx.sort(logits, axis=-1)
    kth_largest = mx.take_along_axis(ascending, mx.array((vocab_size - k)[:, None]), axis=-1)
    remove = (logits < kth_largest) & mx.array(top_k > 0)[:, None]
    return mx.where(remove, -mx.inf, logits)


def apply_top_p(logits: mx.array, top_p: np.ndarray) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``
    (transformers' ``TopPLogitsWarper``, as the torch sampler)."""
    if not (top_p < 1.0).any():
        return logits
    order = mx.argsort(logits, axis=-1)
    ascending = mx.take_along_axis(logits, order, axis=-1)
    cumulative = mx.cumsum(mx.softmax(ascending, axis=-1), axis=-1)
    remove_sorted = cumulative <= mx.array(1 - top_p.astype(np.float32))[:, None]
    keep_last = mx.arange(logits.shape[-1]) == logits.shape[-1] - 1
    remove_sorted = remove_sorted & ~keep_last[None, :]
    remove = mx.put_along_axis(
        mx.zeros(logits.shape, dtype=mx.bool_), order, remove_sorted, axis=-1
    )
    return mx.where(remove, -mx.inf, logits)


def apply_min_p(logits: mx.array, min_p: np.ndarray) -> mx.array:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    if not (min_p > 0).any():
        return logits
    probs = mx.softmax(logits, axis=-1)
    threshold = mx.array(min_p.astype(np.float32))[:, None] * mx.max(probs, axis=-1, keepdims=True)
    return mx.where(probs < threshold, -mx.inf, logits)
