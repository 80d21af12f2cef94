"""The framework-neutral half of sampling (numpy only): what every runner's sampler shares.

Owns, for the torch sampler (:mod:`resin.sampling`) and the MLX sampler
(:mod:`resin.runners.mlx.sampler`) alike:

- :class:`SlotHistory`: the per-request token history penalties need, kept by
  ``plan.request_slots`` and driven by the engine's lifecycle diff alone, never by
  ``input_ids`` (docs/batch_plan.md, "Lifecycle diff"): a slot in ``new_request_slots`` starts
  from ``new_request_token_ids`` (prompt, then any outputs it already has), and each row then
  puts ``committed_token_ids`` at their place, output tokens ``num_output_tokens - n ..``, so a
  plan re-sent after a discarded one changes nothing;
- :func:`sampling_rows` / :func:`offsets_in_row`: which plan row each sample of the step
  belongs to, the token whose logits it samples and its index within the row (a row verifying
  k drafts has 1 + k samples);
- :func:`sample_seed`: the seed of a seeded row's sample, from ``(seed, output index)``, so a
  seeded request draws the same stream whatever else is in the batch, after preemption, and
  with speculative decoding on; :func:`sample_uniforms`: the uniform number in [0, 1) that
  draws such a sample (splitmix64 of that seed, vectorised over the step's samples);
- :func:`pack_output`: sampled tokens (and logprobs) laid out as a :class:`ForwardOutput`, one
  ignored 0 for a row that does not sample.

Importing this module loads numpy and ``resin._core`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resin._core import BatchPlan, ForwardOutput

SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct (seed, step) -> distinct seeds
SEED_MASK = (1 << 63) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the same golden-ratio constant)


@dataclass
class SlotState:
    """One live request: every token it has (prompt, then outputs) and how many are prompt;
    ``num_rewrites`` counts the times tokens it already had were replaced (a diff re-sent
    after a discarded plan), so a reader that keeps a summary of the tokens (the torch
    sampler's penalty counts) knows when appending the new ones is not enough."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_rewrites: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class SlotHistory:
    """Per-request token histories keyed by runner slot (see the module doc)."""

    def __init__(self) -> None:
        self.slots: dict[int, SlotState] = {}

    def begin_step(self, plan: BatchPlan) -> list[int]:
        """Apply the plan's lifecycle diff: drop finished slots, start new ones from their
        request's tokens, and put each row's ``committed_token_ids`` at their output index.
        Returns the slots started by this plan.

        Call once per plan, before sampling. Idempotent for a re-sent diff (the plan after a
        discarded one): a slot reset twice starts from the same ``new_request_token_ids``, and
        committed tokens land at their output index.
        """
        for slot in plan.finished_request_slots.tolist():
            self.slots.pop(slot, None)
        indptr, token_ids = plan.new_request_token_indptr, plan.new_request_token_ids
        new_slots: list[int] = plan.new_request_slots.tolist()
        for j, slot in enumerate(new_slots):
            self.slots[slot] = SlotState(
                token_ids[indptr[j] : indptr[j + 1]].tolist(),
                int(plan.new_request_num_prompt_tokens[j]),
            )
        self._append_committed(plan)
        return new_slots

    def _append_committed(self, plan: BatchPlan) -> None:
        committed = plan.committed_token_ids
        if len(committed) == 0:
            return
        committed_indptr = plan.committed_token_indptr.tolist()
        num_output_tokens = plan.num_output_tokens.tolist()
        for row, slot in enumerate(plan.request_slots.tolist()):
            lo, hi = committed_indptr[row], committed_indptr[row + 1]
            state = self.slots.get(slot)
            if lo == hi or state is None:
                continue
            start = state.num_prompt_tokens + num_output_tokens[row] - (hi - lo)
            if start < len(state.token_ids):
                del state.token_ids[start:]
                state.num_rewrites += 1
            state.token_ids.extend(committed[lo:hi].tolist())


def sampling_rows(plan: BatchPlan) -> tuple[np.ndarray, np.ndarray]:
    """One entry per sample of the step, in ``sample_indptr`` order: the plan row it belongs to
    and the index (in the step's flat token order) of the token whose logits are sampled. A
    row samples its last token; a row verifying k drafts samples its last 1 + k tokens (the
    model's choice after its last committed token and after each draft). A mid-prefill chunk
    does not sample."""
    counts: np.ndarray = np.diff(plan.sample_indptr.astype(np.int64)).astype(np.int64)
    rows = np.repeat(np.arange(len(counts)), counts)
    ends = plan.query_indptr[1:].astype(np.int64)
    # Within a row, samples 0 .. c-1 sit at its last c tokens.
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = np.arange(len(rows)) - first
    return rows, ends[rows] - counts[rows] + offset


def offsets_in_row(rows: np.ndarray) -> np.ndarray:
    """For samples listed row by row (a row's samples consecutive), each one's index within
    its row: 0 for a row's first sample, j for a verify row's j-th."""
    if len(rows) == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[True], rows[1:] != rows[:-1]])
    first = np.maximum.accumulate(np.where(starts, np.arange(len(rows)), 0))
    return np.arange(len(rows)) - first


def sample_seed(seed: int, output_index: int) -> int:
    """The seed of the sample at output index ``output_index`` of a request seeded ``seed``
    (>= 0): a 63-bit mix, so distinct (seed, index) pairs give distinct streams."""
    return ((seed * SEED_MIX) + output_index) & SEED_MASK


def sample_uniforms(seeds: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """float32 [n] in [0, 1): the uniform of each sample, for ``seeds`` int64 [n] (>= 0) and
    ``output_indices`` int64 [n] (the output index each sample predicts).

    A counter-based generator, no state: the splitmix64 output function of
    :func:`sample_seed`'s 63-bit mix, its top 24 bits scaled by 2**-24 (exact in float32).
    The same (seed, output index) always gives the same number, on any framework; the torch
    sampler turns it into a token by inverse-CDF sampling
    (:func:`resin.sampling_draw.sample_tokens`).
    """
    x = np.asarray(seeds, dtype=np.int64).astype(np.uint64) * np.uint64(SEED_MIX)
    x = (x + np.asarray(output_indices, dtype=np.int64).astype(np.uint64)) & np.uint64(SEED_MASK)
    z = x + np.uint64(SPLITMIX_GAMMA)  # splitmix64: state x, one step, then the output mix
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def pack_output(
    plan: BatchPlan,
    rows: np.ndarray,
    offsets: np.ndarray,
    tokens: np.ndarray,
    logprobs: np.ndarray | None = None,
    top_ids: np.ndarray | None = None,
    top_logprobs: np.ndarray | None = None,
) -> ForwardOutput:
    """The step's :class:`ForwardOutput`: per plan row its samples' ``tokens`` (one entry per
    sample, in ``rows`` order; ``offsets`` from :func:`offsets_in_row`), a row that does not
    sample returning one ignored 0. ``logprobs`` [R] (the sampled tokens'), ``top_ids`` /
    ``top_logprobs`` [R, k] go with them when any row asked for logprobs."""
    counts = np.maximum(np.diff(plan.sample_indptr.astype(np.int64)), 1)
    token_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    at = token_indptr[rows].astype(np.int64) + offsets
    num_rows = int(token_indptr[-1])
    token_ids = np.zeros(num_rows, dtype=np.uint32)
    token_ids[at] = np.asarray(tokens).astype(np.uint32)
    if logprobs is None or top_ids is None or top_logprobs is None:
        return ForwardOutput(token_ids, token_indptr)
    k = top_ids.shape[1]
    out_logprobs = np.zeros(num_rows, dtype=np.float32)
    out_top_ids = np.zeros((num_rows, k), dtype=np.uint32)
    out_top_logprobs = np.zeros((num_rows, k), dtype=np.float32)
    out_logprobs[at] = logprobs
    out_top_ids[at] = top_ids.astype(np.uint32)
    out_top_logprobs[at] = top_logprobs
    return ForwardOutput(token_ids, token_indptr, out_logprobs, out_top_ids, out_top_logprobs)


def max_num_logprobs(plan: BatchPlan, rows: np.ndarray) -> int:
    """The most logprobs any sample of the step asks for: -1 when none asks (no logprobs
    returned), else k = the top-k columns to return (0: only the sampled token's)."""
    if len(rows) == 0:
        return -1
    return int(plan.sampling.num_logprobs[rows].max())
