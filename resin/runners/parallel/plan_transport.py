"""Handing each step's :class:`resin.BatchPlan` to the other ranks of a parallel runner.

Owns :class:`PlanWriter` (rank 0: the plan's arrays copied once into a shared-memory segment)
and :class:`PlanView` (the other ranks: the same attribute names, copied out of it — what the
torch runner reads of a plan). Only a small layout message — field names, dtypes, shapes and
offsets, a few hundred bytes — crosses the control pipe per step; the arrays themselves are
never pickled. The segment grows (a new one, named in the message) when a plan outgrows it.

One host only: across hosts the same layout would be sent first and the flat buffer
broadcast with ``torch.distributed.broadcast`` (NCCL / gloo), which this module's split into
"layout" and "bytes" is shaped for.

The sampling arrays, lifecycle arrays and request ids go too: under DP attention every rank
samples its own rows.
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

import numpy as np

SCALARS = (
    "step",
    "num_sequences",
    "num_decode_sequences",
    "num_tokens",
    "padded_num_sequences",
    "page_size",
    "num_cache_groups",
)
ARRAYS = (
    "request_slots",
    "input_ids",
    "positions",
    "query_indptr",
    "num_computed_tokens",
    "seq_lens",
    "sample_indptr",
    "num_draft_tokens",
    "num_output_tokens",
    "copy_pages",
    "zero_pages",
    # what a sampling rank reads too (data parallel: every rank samples its own rows)
    "committed_token_indptr",
    "committed_token_ids",
    "banned_token_indptr",
    "banned_token_ids",
    "logit_bias_indptr",
    "logit_bias_token_ids",
    "logit_bias_values",
    "new_request_slots",
    "new_request_token_indptr",
    "new_request_token_ids",
    "new_request_num_prompt_tokens",
    "finished_request_slots",
    "prompt_logprob_targets",
)
SAMPLING = (  # plan.sampling's per-row arrays
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "num_logprobs",
    "num_prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
GROUP_ARRAYS = (  # one array per cache group
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "slot_mapping",
    "state_slots",
    "has_initial_state",
    "block_table",
)
ALIGN = 64


class PlanWriter:
    """Rank 0's side: ``write(plan)`` -> the layout message the other ranks open."""

    def __init__(self, initial_bytes: int = 1 << 20):
        self.segment = shared_memory.SharedMemory(create=True, size=initial_bytes)

    def write(self, plan: Any) -> dict[str, Any]:
        arrays: list[tuple[str, np.ndarray]] = [(name, getattr(plan, name)) for name in ARRAYS]
        for name in GROUP_ARRAYS:
            arrays += [(f"{name}.{g}", a) for g, a in enumerate(getattr(plan, name))]
        arrays += [(f"sampling:{name}", getattr(plan.sampling, name)) for name in SAMPLING]
        layout, offset = [], 0
        for name, array in arrays:
            array = np.ascontiguousarray(array)
            layout.append((name, array.dtype.str, array.shape, offset))
            offset += -(-array.nbytes // ALIGN) * ALIGN
        if offset > self.segment.size:
            self.close()
            self.segment = shared_memory.SharedMemory(
                create=True, size=max(offset, 2 * self.segment.size)
            )
        buffer = self.segment.buf
        for (_, dtype, shape, start), (_, array) in zip(layout, arrays):
            view = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=start)
            view[...] = array
        return {
            "segment": self.segment.name,
            "scalars": {name: int(getattr(plan, name)) for name in SCALARS},
            "request_ids": list(plan.request_ids),
            "arrays": layout,
        }

    def close(self) -> None:
        self.segment.close()
        self.segment.unlink()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open rank 0's segment. (Spawned workers share rank 0's resource tracker, which drops
    the segment when rank 0 unlinks it: nothing to unregister here.)"""
    return shared_memory.SharedMemory(name=name)


class _SamplingView:
    """``plan.sampling`` on the other ranks: the per-row sampling arrays."""

    temperature: np.ndarray

    def __len__(self) -> int:
        return len(self.temperature)


class PlanView:
    """A plan as the other ranks see it: the scalars and arrays of :class:`PlanWriter`'s
    message, copied out of the shared segment as the message arrives (read-only)."""

    _segments: dict[str, shared_memory.SharedMemory] = {}

    def __init__(self, message: dict[str, Any]):
        name = message["segment"]
        segment = self._segments.get(name)
        if segment is None:
            for old in self._segments.values():
                old.close()
            self._segments.clear()
            segment = _attach(name)
            self._segments[name] = segment
        for key, value in message["scalars"].items():
            setattr(self, key, value)
        self.request_ids = message.get("request_ids", [])
        self.sampling = _SamplingView()
        groups: dict[str, list[np.ndarray]] = {name: [] for name in GROUP_ARRAYS}
        for key, dtype, shape, offset in message["arrays"]:
            # A private copy (a plan is small): rank 0 may write the next plan into the
            # segment while this rank is still in the step's last layers (e.g. after EP's
            # last collective), so nothing of this step may alias it.
            view = np.ndarray(tuple(shape), dtype=dtype, buffer=segment.buf, offset=offset).copy()
            view.flags.writeable = False
            if key.startswith("sampling:"):
                setattr(self.sampling, key.removeprefix("sampling:"), view)
                continue
            base, _, group = key.partition(".")
            if group:
                groups[base].append(view)
            else:
                setattr(self, key, view)
        for base, views in groups.items():
            setattr(self, base, tuple(views))
