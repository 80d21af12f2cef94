"""Runners that compute no model: for serving benchmarks and server tests.

- ``CyclingRunner(token_ids)``: a request's j-th output token is ``token_ids[(prompt_len + j) %
  len(token_ids)]`` — plausible text that never hits EOS, with no per-request state and two
  numpy operations per step: the "null runner" of ``benchmarks/serve.py`` (server overhead
  without model time).
- ``ScriptedRunner(script)``: every request emits the same fixed token sequence, then EOS
  (``eos_token_id``) forever — the test runner for tool-call and reasoning parsing, whose
  markers arrive split across tokens exactly as a real model would send them.

``ScriptedRunner`` keeps per-request state keyed by ``request_slots`` and reset from the plan's
lifecycle diff (``new_request_slots``), the way real runners keep sampler state. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from resin._core import BatchPlan, ForwardOutput


class _PerSlotCounter:
    """How many tokens each sampling row's request has already emitted: ``seq_lens`` minus the
    prompt length recorded when the slot's request was announced (so a request that resumes
    after preemption continues where it was)."""

    def __init__(self) -> None:
        self.num_prompt_tokens = np.zeros(0, dtype=np.int64)

    def advance(self, plan: BatchPlan) -> tuple[np.ndarray, np.ndarray]:
        """The sampling-row mask and the number of tokens each of those rows emitted before."""
        slots = plan.request_slots
        needed = int(slots.max()) + 1 if len(slots) else 0
        if needed > len(self.num_prompt_tokens):
            grown = np.zeros(needed, dtype=np.int64)
            grown[: len(self.num_prompt_tokens)] = self.num_prompt_tokens
            self.num_prompt_tokens = grown
        new = plan.new_request_slots
        if len(new):
            self.num_prompt_tokens[new] = plan.new_request_num_prompt_tokens
        indptr = plan.sample_indptr
        samples = indptr[1:] != indptr[:-1]
        counts = plan.seq_lens[samples] - self.num_prompt_tokens[slots[samples]]
        return samples, counts


class CyclingRunner:
    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("CyclingRunner needs at least one token id")
        self.token_ids = np.asarray(token_ids, dtype=np.uint32)
        self._indptr = np.arange(1, dtype=np.uint32)

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        # Stateless: a row sampling its j-th output token has seq_len = prompt + j, so the
        # token is cycle[(prompt + j) % len]. Rows that do not sample (mid-prefill) are
        # ignored by the engine, so every row gets a token.
        num_rows = plan.num_sequences
        if len(self._indptr) < num_rows + 1:
            self._indptr = np.arange(2 * num_rows + 1, dtype=np.uint32)
        tokens = self.token_ids[plan.seq_lens % len(self.token_ids)]
        return ForwardOutput(token_ids=tokens, token_indptr=self._indptr[: num_rows + 1])


class ScriptedRunner:
    def __init__(self, script: Sequence[int], eos_token_id: int) -> None:
        self.script = np.asarray(list(script) + [eos_token_id], dtype=np.uint32)
        self._counter = _PerSlotCounter()

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        samples, counts = self._counter.advance(plan)
        tokens = np.zeros(plan.num_sequences, dtype=np.uint32)
        tokens[samples] = self.script[np.minimum(counts, len(self.script) - 1)]
        return ForwardOutput(
            token_ids=tokens, token_indptr=np.arange(plan.num_sequences + 1, dtype=np.uint32)
        )
