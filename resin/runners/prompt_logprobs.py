"""Prompt logprobs: what a runner adds to its output for the plan's prompt logprob targets.

A request asking for ``prompt_logprobs`` (vLLM's; OpenAI's ``echo`` with ``logprobs``) gets,
for every prompt token after the first, that token's logprob given the tokens before it. The
engine marks the plan tokens whose next prompt token is wanted (``plan.prompt_logprob_targets``:
>= 0, the target id; -1 otherwise) and how many top entries each row wants
(``plan.sampling.num_prompt_logprobs``); the runner returns, in token order, each target's
logprob and the top k (``ForwardOutput.prompt_logprobs`` and ``prompt_top_logprob_ids`` /
``prompt_top_logprobs``). The logprobs are the model's own (fp32 log-softmax of the raw logits:
no temperature, penalty or bias), as the sampled tokens' logprobs are.

This module owns the framework-free parts: reading the plan (:func:`asked`) and the output
with the arrays added (:func:`with_prompt_logprobs`). Each runner computes the logits with its
own model, in chunks of :data:`CHUNK_TOKENS` tokens so a long prompt never holds logits of
every token at once (2,048 tokens of a 152k vocabulary would be 1.2 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from resin._core import ForwardOutput
from resin.runners.forward_outputs import output_with

CHUNK_TOKENS = 256


@dataclass(frozen=True)
class PromptLogprobsAsked:
    """The plan's targets: ``token_indices`` int64[M] (which of the step's tokens),
    ``target_ids`` int64[M] (the prompt token each predicts), ``num_top`` the widest top k."""

    token_indices: np.ndarray
    target_ids: np.ndarray
    num_top: int

    def chunks(self) -> list[slice]:
        """Slices of the M targets, :data:`CHUNK_TOKENS` at a time."""
        m = len(self.token_indices)
        return [slice(start, min(start + CHUNK_TOKENS, m)) for start in range(0, m, CHUNK_TOKENS)]


def asked(plan: Any) -> PromptLogprobsAsked | None:
    """The plan's prompt logprob targets, or None when no token has one (most steps: the
    array is then empty)."""
    targets = np.asarray(plan.prompt_logprob_targets)
    if not targets.size:
        return None
    indices = np.flatnonzero(targets >= 0)
    if not indices.size:
        return None
    num_top = max(0, int(np.asarray(plan.sampling.num_prompt_logprobs).max()))
    return PromptLogprobsAsked(indices.astype(np.int64), targets[indices], num_top)


def with_prompt_logprobs(
    out: ForwardOutput,
    logprobs: np.ndarray,
    top_ids: np.ndarray | None,
    top_logprobs: np.ndarray | None,
) -> ForwardOutput:
    """``out`` with the prompt arrays: ``logprobs`` float32[M], ``top_ids`` / ``top_logprobs``
    uint32 / float32 [M, k] (None when no row wants top entries)."""
    return output_with(
        out,
        prompt_logprobs=np.ascontiguousarray(logprobs, dtype=np.float32),
        prompt_top_logprob_ids=None
        if top_ids is None
        else np.ascontiguousarray(top_ids, dtype=np.uint32),
        prompt_top_logprobs=None
        if top_logprobs is None
        else np.ascontiguousarray(top_logprobs, dtype=np.float32),
    )
