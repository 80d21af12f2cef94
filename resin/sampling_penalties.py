"""Penalties and bans for the torch sampler, applied to the step's copy of the raw logits.

Owns the rules, applied in this order, each at the entries it touches only (one
``index_select`` + ``index_copy_`` / ``index_fill_`` for the batch each; :meth:`Penalties.rules`
lists them with their entries, :meth:`Penalties.apply` applies them, to a copy of the rows or,
on the sampler's CPU path, to the logits in place, whose raw values at those entries the
sampler writes back after the step's pick):

0. ``logit_bias`` (the plan's ``logit_bias_token_ids`` / ``logit_bias_values``, OpenAI's): the
   bias added to the token's logit, before the penalties, as vLLM orders them;
1. repetition (prompt + output tokens, HF/vLLM): a positive logit is divided by the penalty, a
   negative one multiplied;
2. frequency and presence (output tokens only, OpenAI/vLLM):
   ``logit -= frequency * count + presence * (count > 0)``;
3. ``banned_token_ids`` (stop tokens before ``min_tokens``) set to ``-inf``.

A bias or ban on a token id past the logits' width (possible only for an engine without
``vocab_size``) touches nothing: there is no such logit to change.

And the counts they read: :class:`Penalties` keeps, per request slot, a :class:`TokenTally` of
its history (the distinct tokens and how often each occurs; one over prompt + outputs, one
over the outputs), built the first time a penalised row needs it and then brought up to date
with the tokens appended since: O(new tokens) a step, not O(history). A tally starts again
from the history when the slot holds a new request or its history was rewritten
(:attr:`~resin.sampling_state.SlotState.num_rewrites`).

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from resin._core import BatchPlan
from resin.sampling_state import SlotState


class TokenTally:
    """The distinct tokens of ``state.token_ids[start:]`` in ``[0, vocab_size)`` and how often
    each occurs, in order of first occurrence (``ids[:size]``, ``counts[:size]``, int64)."""

    def __init__(self, state: SlotState, start: int, vocab_size: int) -> None:
        self.state, self.start, self.vocab_size = state, start, vocab_size
        self._restart()

    def _restart(self) -> None:
        self.num_rewrites = self.state.num_rewrites
        self.end = self.start  # state.token_ids[start:end] are counted
        self.position: dict[int, int] = {}
        self.ids = np.zeros(16, dtype=np.int64)
        self.counts = np.zeros(16, dtype=np.int64)
        self.size = 0

    def update(self) -> None:
        """Count the tokens appended since the last update (all of them after a rewrite)."""
        tokens = self.state.token_ids
        if self.state.num_rewrites != self.num_rewrites or len(tokens) < self.end:
            self._restart()
        if len(tokens) == self.end:
            return
        new = tokens[self.end :]
        self.end = len(tokens)
        if len(new) > 64:  # a prompt or a long catch-up: count it in numpy
            values = np.asarray(new, dtype=np.int64)
            values = values[(values >= 0) & (values < self.vocab_size)]
            ids, first, counts = np.unique(values, return_index=True, return_counts=True)
            order = np.argsort(first, kind="stable")  # keep first-occurrence order
            for token, count in zip(ids[order].tolist(), counts[order].tolist()):
                self._add(token, count)
            return
        for token in new:
            if 0 <= token < self.vocab_size:
                self._add(token, 1)

    def _add(self, token: int, count: int) -> None:
        at = self.position.get(token)
        if at is not None:
            self.counts[at] += count
            return
        if self.size == len(self.ids):
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
        self.position[token] = self.size
        self.ids[self.size], self.counts[self.size] = token, count
        self.size += 1


@dataclass
class PenaltyPlan:
    """One step's penalties for the samples of a group: the per-sample settings (float32 [n])
    and which samples each rule touches (indices into the group)."""

    repetition: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    repeating: np.ndarray
    counting: np.ndarray
    banned_indptr: np.ndarray  # int64 [num plan rows + 1]
    num_banned: np.ndarray  # int64 [n]
    bias_indptr: np.ndarray  # int64 [num plan rows + 1]
    num_biased: np.ndarray  # int64 [n]
    rows: np.ndarray  # the samples' plan rows

    @property
    def changed(self) -> np.ndarray:
        """bool [n]: the samples whose logits a bias, penalty or ban changes."""
        changed = (self.num_banned > 0) | (self.num_biased > 0)
        changed[self.repeating] = True
        changed[self.counting] = True
        return changed

    @property
    def changes_logits(self) -> bool:
        return bool(self.changed.any())


@dataclass
class Rule:
    """One penalty rule of a step: ``kind`` ("bias", "repetition", "counting" or "ban"), the
    flat indices it touches (int64; an entry may repeat across rules) and its per-entry
    operands (the bias; the penalty; frequency, presence and count)."""

    kind: str
    at: torch.Tensor
    operands: tuple[torch.Tensor, ...]


class Penalties:
    """The per-slot tallies of the penalised requests; applies a step's penalties and bans."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.tallies: dict[tuple[int, bool], TokenTally] = {}  # (slot, outputs only) -> tally

    def plan(self, plan: BatchPlan, rows: np.ndarray) -> PenaltyPlan:
        """The penalties of the samples of plan rows ``rows``."""
        sampling = plan.sampling
        repetition = np.asarray(sampling.repetition_penalty[rows], dtype=np.float32)
        frequency = np.asarray(sampling.frequency_penalty[rows], dtype=np.float32)
        presence = np.asarray(sampling.presence_penalty[rows], dtype=np.float32)
        indptr = plan.banned_token_indptr.astype(np.int64)
        bias_indptr = plan.logit_bias_indptr.astype(np.int64)
        return PenaltyPlan(
            repetition,
            frequency,
            presence,
            np.flatnonzero(repetition != 1.0),
            np.flatnonzero((frequency != 0.0) | (presence != 0.0)),
            indptr,
            indptr[rows + 1] - indptr[rows],
            bias_indptr,
            bias_indptr[rows + 1] - bias_indptr[rows],
            rows,
        )

    def rules(
        self,
        step: PenaltyPlan,
        plan: BatchPlan,
        slots: list[int],
        states: dict[int, SlotState],
        row_of: np.ndarray | None = None,
    ) -> list[Rule]:
        """The rules ``step`` applies, in order, each with the entries it touches in a [R, V]
        tensor's contiguous storage where sample r's logits are row ``row_of[r]`` (r when None;
        ``slots[r]`` its request slot)."""
        rows = np.arange(len(step.rows), dtype=np.int64) if row_of is None else row_of
        rules = []
        if step.num_biased.any():  # logit_bias: logit += bias
            ids, keys = self._row_entries(
                step.bias_indptr, step.num_biased, step.rows, plan.logit_bias_token_ids, rows
            )
            bias = torch.as_tensor(plan.logit_bias_values[ids], device=self.device)
            rules.append(Rule("bias", self._tensor(keys), (bias,)))
        if len(step.repeating):  # prompt + output tokens: positive / penalty, negative * penalty
            keys, r, _ = self._entries(step.repeating, slots, states, rows, outputs_only=False)
            penalty = self._tensor(step.repetition[r])
            rules.append(Rule("repetition", self._tensor(keys), (penalty,)))
        if len(step.counting):  # output tokens: logit -= frequency * count + presence * (count > 0)
            keys, r, counts = self._entries(step.counting, slots, states, rows, outputs_only=True)
            f, p = self._tensor(step.frequency[r]), self._tensor(step.presence[r])
            rules.append(Rule("counting", self._tensor(keys), (f, p, self._tensor(counts))))
        if step.num_banned.any():
            _, keys = self._row_entries(
                step.banned_indptr, step.num_banned, step.rows, plan.banned_token_ids, rows
            )
            rules.append(Rule("ban", self._tensor(keys), ()))
        return rules

    @staticmethod
    def apply(flat: torch.Tensor, rules: list[Rule]) -> None:
        """Apply ``rules`` to ``flat`` (the storage :meth:`rules` indexed) in place, each at its
        entries only. float32 CPU logits go through numpy (the same float32 operations, one by
        one: the same bits; a torch indexing op costs ~10x numpy's at a step's few thousand
        entries)."""
        if flat.device.type == "cpu" and flat.dtype is torch.float32 and not flat.requires_grad:
            _apply_numpy(flat.numpy(), rules)
            return
        for rule in rules:
            at = rule.at
            if rule.kind == "bias":
                (bias,) = rule.operands
                flat.index_copy_(0, at, flat.index_select(0, at) + bias.to(flat.dtype))
            elif rule.kind == "repetition":
                (penalty,) = rule.operands
                values = flat.index_select(0, at)
                flat.index_copy_(0, at, torch.where(values > 0, values / penalty, values * penalty))
            elif rule.kind == "counting":
                f, p, counts = rule.operands
                counts = counts.to(flat.dtype)
                penalty = f * counts + p * (counts > 0).to(counts.dtype)
                flat.index_copy_(0, at, flat.index_select(0, at) - penalty)
            else:
                flat.index_fill_(0, at, -torch.inf)

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(values, device=self.device)

    def _row_entries(
        self,
        indptr: np.ndarray,
        counts: np.ndarray,
        rows: np.ndarray,
        token_ids: np.ndarray,
        row_of: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The entries of a per-row CSR list of tokens (``indptr`` over plan rows, ``counts``
        [n] the samples' lengths) for the samples of plan ``rows``: their indices into
        ``token_ids`` and their flat indices ``row_of[sample] * vocab_size + token``, both
        int64, tokens past the vocabulary dropped."""
        first = np.repeat(np.cumsum(counts) - counts, counts)
        ids = np.repeat(indptr[rows], counts) + np.arange(int(counts.sum())) - first
        sample = np.repeat(row_of.astype(np.int64), counts)
        tokens = token_ids[ids].astype(np.int64)
        inside = tokens < self.vocab_size
        return ids[inside], (sample * self.vocab_size + tokens)[inside]

    def _entries(
        self,
        samples: np.ndarray,
        slots: list[int],
        states: dict[int, SlotState],
        row_of: np.ndarray,
        outputs_only: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct (sample, token) pairs of the ``samples``' histories (prompt + output
        tokens, or output tokens only) as flat indices ``row_of[sample] * vocab_size +
        token``, their samples, and how often each token occurs: three int64 [n]."""
        ids, counts, sizes = [], [], []
        for r in samples.tolist():
            tally = self._tally(slots[r], states[slots[r]], outputs_only)
            ids.append(tally.ids[: tally.size])
            counts.append(tally.counts[: tally.size])
            sizes.append(tally.size)
        sample = np.repeat(samples.astype(np.int64), sizes)
        keys = row_of.astype(np.int64)[sample] * self.vocab_size + np.concatenate(ids)
        return keys, sample, np.concatenate(counts)

    def _tally(self, slot: int, state: SlotState, outputs_only: bool) -> TokenTally:
        tally = self.tallies.get((slot, outputs_only))
        if tally is None or tally.state is not state:  # a new request in the slot
            start = state.num_prompt_tokens if outputs_only else 0
            tally = TokenTally(state, start, self.vocab_size)
            self.tallies[(slot, outputs_only)] = tally
        tally.update()
        return tally

    def drop(self, slot: int) -> None:
        """Forget a finished slot's tallies."""
        self.tallies.pop((slot, False), None)
        self.tallies.pop((slot, True), None)


def _apply_numpy(flat: np.ndarray, rules: list[Rule]) -> None:
    """:meth:`Penalties.apply` on a float32 CPU array (``flat``, viewing the logits)."""
    for rule in rules:
        at = rule.at.numpy()
        if rule.kind == "bias":
            flat[at] = flat[at] + rule.operands[0].numpy().astype(np.float32)
        elif rule.kind == "repetition":
            penalty = rule.operands[0].numpy()
            values = flat[at]
            flat[at] = np.where(values > 0, values / penalty, values * penalty)
        elif rule.kind == "counting":
            f, p, counts = (operand.numpy() for operand in rule.operands)
            counts = counts.astype(np.float32)
            penalty = f * counts + p * (counts > 0).astype(np.float32)
            flat[at] = flat[at] - penalty
        else:
            flat[at] = -np.inf
