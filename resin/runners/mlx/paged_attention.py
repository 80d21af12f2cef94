"""Paged attention on MLX arrays, read straight from the plan's page tables and slot mapping.

Owns :class:`GroupAttention`: one cache group's metadata for one step, built once on the host
from the plan (numpy) and used by every layer of the group, and :func:`attend`, the softmax
attention of the step's queries over the keys each row may read.

Caches are flat ``[num_pages * page_size, kv_heads, head_dim]`` MLX arrays: slot ``page *
page_size + offset`` is one row, so the plan's ``slot_mapping`` and the slots of its
``kv_indices`` index them directly (the null page, page 0, is rows ``0 .. page_size - 1``, zeros).

- **Write**: new tokens' K/V go to ``slot_mapping[g]`` (an in-place scatter); slot -1 is never
  used as an index (those tokens are dropped before the scatter).
- **Read**: row i's listed pages cover its keys in position order from logical page
  ``ceil(seq_len / page_size) - num_listed`` (docs/batch_plan.md: a sliding-window group lists
  only the pages that intersect the window); slots past ``seq_len`` in the last page are
  dropped; the mask is causal and, for a sliding-window group, ``key > query - window``
  (:mod:`resin.page_views`, the arithmetic the torch runners share).
- **Batching**: the decode rows (the plan puts them first, one token each) attend in one batched
  call, their keys padded to the longest with masked slot-0 entries; every other row (a prefill
  chunk, a verify row) attends alone with its own shapes, so nothing pads a prompt. Outputs come
  back in the step's token order.

Softmax as transformers' eager attention: scores ``q @ k.T * scale`` in the runner dtype, masked,
softmax in fp32, cast back, then ``@ v``. With per-head ``sinks`` (gpt-oss) the sink logit
joins each query's softmax and is dropped after it, the row max (sink included) subtracted
first and the softmax run in the promoted dtype of scores and sinks (as HF's gpt-oss).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from resin._core import BatchPlan
from resin.page_views import key_mask, readable_keys
from resin.runners.mlx.layers import scale as scale_by


@dataclass
class RowKeys:
    """What one non-decode row reads: its tokens ``[start, end)`` of the step, the cache
    slots of its readable keys (int32 [K]) and its mask (bool [query_len, K])."""

    start: int
    end: int
    slots: mx.array
    mask: mx.array


@dataclass
class GroupAttention:
    """One cache group's reads and writes for one step (see the module doc).

    ``write_slots`` int32[W] and ``write_tokens`` int32[W] (None when every token writes) say
    where the step's new per-token values go; ``num_decode`` decode rows attend as one batch
    over ``decode_slots`` int32[num_decode, K] with ``decode_mask`` bool[num_decode, K];
    ``rows`` are the other rows, each alone.
    """

    write_slots: mx.array
    write_tokens: mx.array | None
    num_decode: int
    decode_slots: mx.array | None
    decode_mask: mx.array | None
    rows: list[RowKeys]

    @classmethod
    def from_plan(
        cls, plan: BatchPlan, group: int, page_size: int, window: int | None
    ) -> GroupAttention:
        slot_mapping = np.asarray(plan.slot_mapping[group])
        keep = slot_mapping >= 0
        write_tokens = None if bool(keep.all()) else mx.array(np.flatnonzero(keep).astype(np.int32))
        write_slots = mx.array(slot_mapping[keep].astype(np.int32))
        query_indptr = plan.query_indptr.astype(np.int64)
        positions = np.asarray(plan.positions)
        kv_indptr, kv_indices = plan.kv_indptr[group], plan.kv_indices[group]
        seq_lens = plan.seq_lens.astype(np.int64)
        num_decode = int(plan.num_decode_sequences)

        def keys_of(row: int) -> tuple[np.ndarray, np.ndarray]:
            pages = kv_indices[kv_indptr[row] : kv_indptr[row + 1]]
            return readable_keys(pages, int(seq_lens[row]), page_size)

        def mask_of(row: int, key_positions: np.ndarray) -> np.ndarray:
            queries = positions[query_indptr[row] : query_indptr[row + 1]]
            return key_mask(queries, key_positions, window)

        decode_slots = decode_mask = None
        if num_decode:
            keys = [keys_of(row) for row in range(num_decode)]
            width = max(len(slots) for slots, _ in keys)
            slot_table = np.zeros((num_decode, width), dtype=np.int32)
            mask_table = np.zeros((num_decode, width), dtype=bool)
            for row, (slots, key_positions) in enumerate(keys):
                slot_table[row, : len(slots)] = slots
                mask_table[row, : len(slots)] = mask_of(row, key_positions)[0]
            decode_slots, decode_mask = mx.array(slot_table), mx.array(mask_table)
        rows = []
        for row in range(num_decode, len(seq_lens)):
            slots, key_positions = keys_of(row)
            rows.append(
                RowKeys(
                    int(query_indptr[row]),
                    int(query_indptr[row + 1]),
                    mx.array(slots.astype(np.int32)),
                    mx.array(mask_of(row, key_positions)),
                )
            )
        return cls(write_slots, write_tokens, num_decode, decode_slots, decode_mask, rows)

    def write(self, cache: mx.array, values: mx.array) -> None:
        """Store the step's ``values`` [T, ...] into ``cache`` at the slot mapping, in place."""
        if self.write_tokens is not None:
            values = values[self.write_tokens]
        if values.shape[0]:
            cache[self.write_slots] = values.astype(cache.dtype)

    def attend(
        self,
        q: mx.array,
        k_cache: mx.array,
        v_cache: mx.array,
        *,
        scale: float,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention of ``q`` [T, heads, head_dim] over each row's readable cached keys ->
        [T, heads, value_dim]. GQA: ``heads`` must be a multiple of the caches' KV heads."""
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads"
            )
        repeat = num_heads // num_kv_heads
        head_sinks = None if sinks is None else sinks.reshape(num_kv_heads, repeat, 1, 1)
        outs = []
        if self.num_decode:
            assert self.decode_slots is not None and self.decode_mask is not None
            n = self.num_decode
            # [n, kv, rep, 1, D] against keys [n, kv, 1, K, D]
            queries = q[:n].reshape(n, num_kv_heads, repeat, 1, -1)
            keys = k_cache[self.decode_slots].transpose(0, 2, 1, 3)[:, :, None]
            values = v_cache[self.decode_slots].transpose(0, 2, 1, 3)[:, :, None]
            mask = self.decode_mask[:, None, None, None, :]
            out = _attention(queries, keys, values, mask, scale, head_sinks)  # [n, kv, rep, 1, Dv]
            outs.append(out.reshape(n, num_heads, -1))
        for row in self.rows:
            length = row.end - row.start
            # [kv, rep, Q, D] against keys [kv, 1, K, D]
            queries = q[row.start : row.end].reshape(length, num_kv_heads, repeat, -1)
            queries = queries.transpose(1, 2, 0, 3)
            keys = k_cache[row.slots].transpose(1, 0, 2)[:, None]
            values = v_cache[row.slots].transpose(1, 0, 2)[:, None]
            out = _attention(queries, keys, values, row.mask, scale, head_sinks)  # [kv, rep, Q, Dv]
            outs.append(out.transpose(2, 0, 1, 3).reshape(length, num_heads, -1))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    mask: mx.array,
    scale: float,
    sinks: mx.array | None,
) -> mx.array:
    """``softmax(q @ k.T * scale, masked) @ v`` with transformers' eager dtype rules (module
    doc); ``sinks`` broadcasts as a [..., 1] logit column per head."""
    scores = scale_by(queries @ keys.swapaxes(-1, -2), scale)
    scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
    if sinks is None:
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype)
        return probs @ values
    # torch's promotion of two float dtypes: equal stays, any two different ones give fp32
    dtype = scores.dtype if scores.dtype == sinks.dtype else mx.float32
    sink = mx.broadcast_to(sinks.astype(dtype), (*scores.shape[:-1], 1))
    logits = mx.concatenate([scores.astype(dtype), sink], axis=-1)
    logits = logits - mx.max(logits, axis=-1, keepdims=True)
    probs = mx.softmax(logits, axis=-1, precise=True)[..., :-1].astype(values.dtype)
    return probs @ values
