"""Token sampling for torch runners: :class:`Sampler` turns each sampling row's logits into a token.

Owns the per-request sampler state (the token history penalties need, keyed by
``plan.request_slots``) and the sampling semantics, applied in this order:

1. penalties on the raw logits — repetition (prompt + output tokens, HF/vLLM: a positive
   logit is divided by the penalty, a negative one multiplied), then frequency and presence
   (output tokens only, OpenAI/vLLM: ``logit -= frequency * count + presence * (count > 0)``);
2. ``banned_token_ids`` set to ``-inf`` (stop tokens before ``min_tokens``);
3. temperature 0 = greedy (argmax of the penalised logits); otherwise divide by the
   temperature, then top-k (0 = off), top-p, min-p (each keeps at least one token, in
   transformers' order), softmax and draw.

The history comes from the engine's lifecycle diff alone, never from ``input_ids``: a slot in
``new_request_slots`` starts from ``new_request_token_ids`` (prompt, then any outputs it
already has), and each row then appends ``committed_token_ids`` (the outputs the engine
committed since the runner last saw the request) at their place, output tokens
``num_output_tokens - n ..``, so a plan re-sent after a discarded one changes nothing. That
history, the per-sample seeds and the output layout are framework-neutral and shared with the
MLX sampler (:mod:`resin.sampling_state`).

Seeds: a row with ``seed >= 0`` draws with its own ``torch.Generator`` seeded from
``(seed, plan.num_output_tokens[row])`` (output tokens so far), so a seeded request yields the
same tokens whatever else is in the batch, and again after preemption. Unseeded rows share
one generator.

Logprobs (``num_logprobs >= 0``) are ``log_softmax`` of the raw model logits (before penalties,
bans and temperature; vLLM's default "raw" mode), in float32. ``top_logprob_ids`` has
``k = max num_logprobs`` of the batch columns; rows asking fewer just carry extra columns.

Structured outputs (:mod:`resin.structured_output`): ``sampler.grammars`` is a
:class:`~resin.structured_output.GrammarRegistry` the server fills (request id -> compiled
grammar). A slot whose request has a grammar when it is (re)created gets a matcher, advanced
over the outputs it already has; each row's ``committed_token_ids`` advance it further (never
the sampled tokens, so a discarded plan replays exactly). In :meth:`Sampler.sample` the grammar
rows' logits are masked (disallowed tokens ``-inf``, after penalties and bans, before greedy /
temperature), one bitmask for the batch; rows without a grammar are untouched. A grammar row
whose bans leave no allowed token falls back to the grammar mask alone.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

import numpy as np
import torch

from resin._core import BatchPlan, ForwardOutput
from resin.sampling_state import (
    SlotHistory,
    max_num_logprobs,
    offsets_in_row,
    pack_output,
    sample_seed,
)
from resin.structured_output import GrammarRegistry, GrammarSlot, MaskBuffer, apply_grammar_masks


class Sampler(SlotHistory):
    """Samples one token per sampling row; keeps per-request state across plans (the token
    history of :class:`~resin.sampling_state.SlotHistory`, plus grammar matchers)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.grammars = GrammarRegistry()
        self.grammar_slots: dict[int, GrammarSlot] = {}
        self._mask_buffer = MaskBuffer(vocab_size)

    def begin_step(self, plan: BatchPlan) -> list[int]:
        """Apply the plan's lifecycle diff: drop finished slots, start new ones from their
        request's tokens, and append each row's ``committed_token_ids``.

        Call once per plan, before :meth:`sample`. Idempotent for a re-sent diff (the plan
        after a discarded one): a slot reset twice starts from the same
        ``new_request_token_ids``, and committed tokens land at their output index.
        """
        for slot in plan.finished_request_slots.tolist():
            self.grammar_slots.pop(slot, None)
        new_slots = super().begin_step(plan)  # the token history
        if new_slots and (self.grammars.active or self.grammar_slots):
            self._start_grammars(plan, new_slots)
        for slot, grammar in self.grammar_slots.items():
            state = self.slots.get(slot)
            if state is not None:
                grammar.sync(state.token_ids, state.num_prompt_tokens)
        return new_slots

    def _start_grammars(self, plan: BatchPlan, new_slots: list[int]) -> None:
        """A (re)created slot drops its old matcher; one whose request has a grammar gets a
        new one (:meth:`begin_step` then advances it over the outputs the request has)."""
        row_of = {slot: row for row, slot in enumerate(plan.request_slots.tolist())}
        request_ids = plan.request_ids if self.grammars.active else []
        for slot in new_slots:
            self.grammar_slots.pop(slot, None)
            row = row_of.get(slot)
            if row is None or not request_ids:
                continue
            grammar = self.grammars.get(request_ids[row])
            if grammar is not None:
                self.grammar_slots[slot] = GrammarSlot(grammar)

    def sample(self, logits: torch.Tensor, plan: BatchPlan, rows: np.ndarray) -> ForwardOutput:
        """Sample ``logits`` float32[len(rows), vocab]: one entry per sample of the step, ``rows``
        its plan row (``sampling_rows``; a row verifying k drafts has 1 + k consecutive
        entries, the j-th predicting output token ``num_output_tokens + j``).

        Returns, per plan row, its samples' tokens (one 0 for a row that does not sample, which
        the engine ignores), with logprobs when any sampling row asks for them. A seeded row's
        j-th sample draws from the generator of output index ``num_output_tokens + j``: the
        same tokens with and without speculative decoding.
        """
        sampling = plan.sampling
        slots = plan.request_slots[rows].tolist()
        offsets = offsets_in_row(rows)
        num_output_tokens = (plan.num_output_tokens[rows] + offsets).tolist()
        if self.grammar_slots and len(rows) != len(set(rows.tolist())):
            verifying = {slots[r] for r in np.flatnonzero(offsets > 0).tolist()}
            if verifying & set(self.grammar_slots):
                raise NotImplementedError(
                    "a grammar-constrained request in a verify row (speculative decoding): "
                    "structured outputs need num_speculative_tokens = 0"
                )
        temperature = torch.as_tensor(np.array(sampling.temperature[rows]), device=self.device)
        processed = logits.clone()
        banned_rows: list[int] = []
        for r, row in enumerate(rows.tolist()):
            self._penalise(
                processed[r],
                slots[r],
                float(sampling.repetition_penalty[row]),
                float(sampling.frequency_penalty[row]),
                float(sampling.presence_penalty[row]),
            )
            banned = plan.banned_token_ids[
                plan.banned_token_indptr[row] : plan.banned_token_indptr[row + 1]
            ]
            if len(banned):
                banned_rows.append(r)
                processed[
                    r, torch.as_tensor(banned.astype(np.int64), device=self.device)
                ] = -torch.inf
        if self.grammar_slots:
            self._mask(processed, logits, slots, banned_rows)

        greedy = temperature == 0
        if bool(greedy.all()):  # the greedy fast path: no filters, no softmax, no sort
            return self._output(plan, rows, offsets, processed.argmax(dim=-1), logits)
        scaled = processed / torch.where(greedy, 1.0, temperature)[:, None]
        scaled = apply_top_k(
            scaled, torch.as_tensor(np.array(sampling.top_k[rows]), device=self.device)
        )
        scaled = apply_top_p(
            scaled, torch.as_tensor(np.array(sampling.top_p[rows]), device=self.device)
        )
        scaled = apply_min_p(
            scaled, torch.as_tensor(np.array(sampling.min_p[rows]), device=self.device)
        )
        probs = torch.softmax(scaled, dim=-1)

        tokens = processed.argmax(dim=-1)
        for r, row in enumerate(rows.tolist()):
            if greedy[r]:
                continue
            seed = int(sampling.seed[row])
            generator = self.generator if seed < 0 else self._seeded(seed, num_output_tokens[r])
            tokens[r] = torch.multinomial(probs[r], 1, generator=generator)[0]
        return self._output(plan, rows, offsets, tokens, logits)

    def _mask(
        self, processed: torch.Tensor, logits: torch.Tensor, slots: list[int], banned: list[int]
    ) -> None:
        """Apply the grammar rows' token masks to ``processed`` in place; a row of ``banned``
        (rows with banned tokens) left with no allowed token gets the grammar mask alone."""
        indices, grammars = [], []
        for r, slot in enumerate(slots):
            grammar = self.grammar_slots.get(slot)
            if grammar is not None and grammar.constrains:
                indices.append(r)
                grammars.append(grammar)
        if not grammars:
            return
        apply_grammar_masks(processed, indices, grammars, self._mask_buffer)
        for r in set(banned).intersection(indices):
            if bool(torch.isneginf(processed[r]).all()):  # the bans left nothing: grammar wins
                processed[r] = logits[r]
                apply_grammar_masks(
                    processed, [r], [self.grammar_slots[slots[r]]], self._mask_buffer
                )

    def _penalise(
        self, logits: torch.Tensor, slot: int, repetition: float, frequency: float, presence: float
    ) -> None:
        """Apply the row's penalties to its logits [vocab] in place."""
        if repetition == 1.0 and frequency == 0.0 and presence == 0.0:
            return
        state = self.slots[slot]
        if repetition != 1.0:
            seen = self._counts(state.token_ids) > 0
            penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits.copy_(torch.where(seen, penalised, logits))
        if frequency != 0.0 or presence != 0.0:
            counts = self._counts(state.output_token_ids).to(logits.dtype)
            logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)

    def _counts(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size]

    def _seeded(self, seed: int, num_output_tokens: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(sample_seed(seed, num_output_tokens))
        return generator

    def _output(
        self,
        plan: BatchPlan,
        rows: np.ndarray,
        offsets: np.ndarray,
        tokens: torch.Tensor,
        logits: torch.Tensor,
    ) -> ForwardOutput:
        k = max_num_logprobs(plan, rows)
        if k < 0:
            return pack_output(plan, rows, offsets, tokens.cpu().numpy())
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_values, top_ids = torch.topk(logprobs, k, dim=-1)
        sampled = logprobs.gather(1, tokens[:, None])[:, 0]
        return pack_output(
            plan,
            rows,
            offsets,
            tokens.cpu().numpy(),
            sampled.cpu().numpy(),
            top_ids.cpu().numpy(),
            top_values.cpu().numpy(),
        )


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the k-th kept); 0 = keep all."""
    vocab_size = logits.shape[-1]
    k = top_k.to(torch.int64).clamp(1, vocab_size)
    kth_largest = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    remove = (logits < kth_largest) & (top_k > 0)[:, None]
    return logits.masked_fill(remove, -torch.inf)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``.

    transformers' ``TopPLogitsWarper``: ascending sort, drop tokens whose cumulative
    probability is <= 1 - top_p, always keep the most likely token.
    """
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)[:, None]
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
    return logits.masked_fill(remove, -torch.inf)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -torch.inf)
