"""The ``torch`` attention backend: every row of a step in one batched attention call per layer.

The reference backend loops over the plan's rows in Python inside every layer. This one builds,
once per step and cache group, a padded batch from the same per-row views
(:func:`~.layers.build_sequence_views`: slots and masks): ``slot_index`` ``[S, K]`` (each row's
readable cache slots, padded with the row's first slot), ``query_index`` ``[S, Q]`` (each row's
tokens in the step's flat order, padded) and ``mask`` ``[S, Q, K]`` (the row's causal / window
mask; padding keys and queries masked). A layer then gathers K and V for all rows with one index,
and runs ``torch.nn.functional.scaled_dot_product_attention`` over ``[S, Hkv, r * Q, K]`` — GQA /
MQA by folding the r query heads that share a KV head into the query axis (no copy of K and V
per head), a shared K = V cache by slicing — or, with attention sinks or a logit
softcap (which SDPA cannot express), the same masked softmax as the reference backend, batched.
The result is scattered back to the step's token order.

Padding costs ``S * Q * K``: a decode batch (Q = 1) pads only keys to the longest row; a step
mixing one long prefill chunk with many decode rows pads every decode row's queries to the
chunk. ``gather`` (compressed / indexed attention) is the reference backend's.

Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resin.runners.torch.attention import ReferenceBackend, head_layout, masked_softmax
from resin.runners.torch.layers import read_slots


@dataclass
class RowBatch:
    """One cache group's padded batch for this step (see the module doc)."""

    slot_index: torch.Tensor  # int64 [S, K]
    query_index: torch.Tensor  # int64 [S, Q]
    query_valid: torch.Tensor  # bool [S, Q]
    mask: torch.Tensor  # bool [S, Q, K]


class TorchBackend(ReferenceBackend):
    """Batched attention in plain torch (module doc)."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        self.batches: dict[int, RowBatch] = {}

    def begin_step(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().begin_step(*args, **kwargs)
        self.batches = {}

    def _batch(self, group: int) -> RowBatch:
        batch = self.batches.get(group)
        if batch is not None:
            return batch
        views = self._views(group)
        assert self._step is not None
        device = self._step[0].device
        num_rows = len(views)
        num_keys = max((len(v.slots) for v in views), default=0) or 1
        num_queries = max((v.query.stop - v.query.start for v in views), default=0) or 1
        slot_index = torch.zeros((num_rows, num_keys), dtype=torch.int64, device=device)
        query_index = torch.zeros((num_rows, num_queries), dtype=torch.int64, device=device)
        query_valid = torch.zeros((num_rows, num_queries), dtype=torch.bool, device=device)
        mask = torch.zeros((num_rows, num_queries, num_keys), dtype=torch.bool, device=device)
        for row, view in enumerate(views):
            keys, queries = len(view.slots), view.query.stop - view.query.start
            if keys:
                slot_index[row, :keys] = view.slots
                slot_index[row, keys:] = view.slots[0]
            query_index[row, :queries] = torch.arange(view.query.start, view.query.stop)
            query_valid[row, :queries] = True
            mask[row, :queries, :keys] = view.mask
            # Padding queries see the row's first key, so no softmax row is empty (no NaN).
            mask[row, queries:, 0] = True
        batch = RowBatch(slot_index, query_index, query_valid, mask)
        self.batches[group] = batch
        return batch

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        group: int,
        *,
        scale: float,
        value_dim: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_heads, repeat, dim_v = head_layout(q, k_cache, v_cache, value_dim)
        num_kv_heads = num_heads // repeat
        b = self._batch(group)
        rows, keys = b.slot_index.shape
        flat = b.slot_index.reshape(-1)
        k = read_slots(k_cache, flat).reshape(rows, keys, num_kv_heads, -1)
        v = (
            k
            if v_cache is None
            else read_slots(v_cache, flat).reshape(rows, keys, num_kv_heads, -1)
        )
        k = k.to(q.dtype).transpose(1, 2)  # [S, Hkv, K, D]
        v = v[..., :dim_v].to(q.dtype).transpose(1, 2)
        # GQA / MQA without copying K and V per query head: fold the heads that share a KV head
        # into the query axis, [S, Hkv, repeat * Q, D] (query head = kv head * repeat + r).
        num_queries = b.query_index.shape[1]
        queries = q[b.query_index].transpose(1, 2)  # [S, H, Q, D]
        queries = queries.reshape(rows, num_kv_heads, repeat * num_queries, -1)
        mask = b.mask.repeat(1, repeat, 1)[:, None]  # [S, 1, repeat * Q, K]
        if sinks is None and softcap is None:
            out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
        else:
            sink = None
            if sinks is not None:  # [1, Hkv, repeat * Q, 1]: each folded row's head's sink
                sink = sinks.reshape(num_kv_heads, repeat, 1).expand(-1, -1, num_queries)
                sink = sink.reshape(1, num_kv_heads, repeat * num_queries, 1)
            out = _softmax_attention(queries, k, v, mask, scale, sink, softcap)
        # [S, Hkv, repeat * Q, Dv] -> [S, Q, H, Dv]
        out = out.reshape(rows, num_heads, num_queries, dim_v).transpose(1, 2)
        result = q.new_empty(q.shape[0], num_heads, dim_v)
        result[b.query_index[b.query_valid]] = out[b.query_valid]
        return result


def _softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """The reference backend's masked softmax (sinks, softcap) over a padded batch; ``sinks``
    broadcasts to ``[S, H, Q, 1]``."""
    scores = torch.einsum("shqd,shkd->shqk", q, k) * scale
    probs = masked_softmax(scores, mask, sinks, softcap, q.dtype, v.dtype)
    return torch.einsum("shqk,shkd->shqd", probs, v)
