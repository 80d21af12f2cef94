"""One plan's arrays as device tensors, made once per step for every layer to share.

Owns :class:`StepInputs`: the plan's ``input_ids``, ``positions`` and per-group
``slot_mapping`` turned into tensors with ``torch.from_numpy`` (no host copy) and moved to the
device once, plus the rows that sample this step and the index of each one's last new token.
Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from resin._core import BatchPlan
from resin.runners.torch.layers import plan_tensor, sampling_rows


@dataclass
class StepInputs:
    """Tensors of one plan. ``input_ids`` int64[T]; ``positions`` int64[T]; ``query_indptr``
    int64[S+1] (row i's tokens are ``[query_indptr[i], query_indptr[i+1])``);
    ``slot_mappings[g]`` int64[T] per cache group; ``copy_pages`` int64[n, 2] and ``zero_pages``
    int64[m] (the plan's cache ops, applied before the forward); ``sample_rows`` (numpy) the rows that sample and
    ``last_token_indices`` int64[R] each one's last token in the step's flat token order."""

    plan: BatchPlan
    device: torch.device
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_indptr: torch.Tensor
    slot_mappings: list[torch.Tensor]
    copy_pages: torch.Tensor
    zero_pages: torch.Tensor
    sample_rows: np.ndarray
    last_token_indices: torch.Tensor

    @classmethod
    def from_plan(cls, plan: BatchPlan, device: torch.device) -> StepInputs:
        rows, last = sampling_rows(plan)
        return cls(
            plan=plan,
            device=device,
            input_ids=plan_tensor(plan.input_ids, device).long(),
            positions=plan_tensor(plan.positions, device),
            query_indptr=plan_tensor(plan.query_indptr, device).long(),
            copy_pages=plan_tensor(plan.copy_pages, device).long().reshape(-1, 2),
            zero_pages=plan_tensor(plan.zero_pages, device).long(),
            slot_mappings=[
                plan_tensor(plan.slot_mapping[g], device) for g in range(plan.num_cache_groups)
            ],
            sample_rows=rows,
            last_token_indices=torch.as_tensor(last, device=device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
