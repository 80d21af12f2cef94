"""The ``torch`` attention backend: every row of a step in one batched attention call per layer.

The reference backend loops over the plan's rows in Python inside every layer. This one plans,
once per step and cache group, a padded batch over whole pages (:class:`RowBatch`, built with
numpy from the plan's CSR page table, no loop over rows): ``page_table`` ``[S * P]`` (each row's
listed pages, padded to the longest row's ``P``), so a layer gathers K and V for all rows with
one ``index_select`` of whole pages (a page is one contiguous block: a memcpy, several times
faster than gathering slot by slot), and ``mask`` ``[S, Q, P * E]`` (``E`` entries per page: the
row's causal / window mask over those keys; keys past the row's end, padding keys and padding
queries masked). It then runs ``torch.nn.functional.scaled_dot_product_attention`` over
``[S, Hkv, r * Q, K]`` — GQA / MQA by folding the r query heads that share a KV head into the
query axis (no copy of K and V per head), a shared K = V cache by slicing — or, with attention
sinks or a logit softcap (which SDPA cannot express), the same masked softmax as the reference
backend, batched. A decode-only step (one query per row, in order) reads and writes the
queries in place; otherwise they are gathered from, and scattered back to, the step's token
order.

Masked keys must still be finite (``0 * NaN`` is NaN): the unwritten tail of a row's last page
may hold another cache group's bytes in a shared buffer (docs/batch_plan.md), so the gathered
keys there are zeroed (``blank_keys``); padding pages repeat the row's first page when it is
full, else read the null page and are zeroed too.

Padding costs ``S * Q * P * E``: a decode batch (Q = 1) pads only keys to the longest row; a step
mixing one long prefill chunk with many decode rows pads every decode row's queries to the
chunk. ``gather`` (compressed / indexed attention) is the reference backend's.

On CPU in float32 or bfloat16 (:data:`KERNEL_DTYPES`; the kernel computes in float32 and a
bfloat16 output is rounded once) the backend skips the gather altogether when :func:`kernel_pays` (the
default where the kernel is vectorised, ``_core.kernels_vectorised()``: AVX2 + FMA;
``RESIN_TORCH_CPU_KERNEL=0`` turns it off, ``=1`` on even without them): it calls ``resin._core.paged_attention``
(rust/kernels), which reads each row's pages in place through the same page table, on numpy
views of the layer's tensors (no copy), its threads a parallel region of torch's own OpenMP
team — decode steps, verify rows and short chunks always, and mixed steps whose padding would
cost SDPA more than 4x the kernel's exact work. On the 23M-parameter Llama of
``benchmarks/offline_throughput.py`` (2 threads) it was 10-20% faster end to end than the SDPA
path at 1, 8 and 64 requests in float32; in bfloat16 1.6x at 64, level at 1 and 8, where
bfloat16 SDPA is the slow part (docs/benchmarks.md).

Imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from resin import _core
from resin.kernels.cpu_threads import kernel_threads
from resin.kernels.numpy_view import numpy_view
from resin.runners.torch.attention import ReferenceBackend, head_layout, masked_softmax


@dataclass
class RowBatch:
    """One cache group's padded batch for this step (see the module doc)."""

    num_rows: int
    num_keys: int  # P * E
    page_table: torch.Tensor  # int64 [S * P]: the pages a layer gathers, row-major
    blank_keys: torch.Tensor | None  # int64: flat [S * K] indices of gathered keys to zero
    query_index: torch.Tensor | None  # int64 [S, Q] (None: one query per row, in order)
    query_valid: torch.Tensor | None  # bool [S, Q]
    mask: torch.Tensor  # bool [S, Q, K]
    folded_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def folded_mask(self, repeat: int) -> torch.Tensor:
        """``mask`` for ``repeat`` query heads folded into the query axis: [S, 1, r * Q, K]."""
        mask = self.folded_masks.get(repeat)
        if mask is None:
            mask = self.mask.repeat(1, repeat, 1)[:, None]
            self.folded_masks[repeat] = mask
        return mask

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Every row's keys (or values) of ``cache`` [pages, E, heads, dim]: [S, K, heads, dim]."""
        pages = cache.index_select(0, self.page_table)
        if self.blank_keys is not None:
            pages.view(self.num_rows * self.num_keys, -1).index_fill_(0, self.blank_keys, 0)
        return pages.view(self.num_rows, self.num_keys, *cache.shape[2:])


def plan_row_batch(
    query_indptr: np.ndarray,
    seq_lens: np.ndarray,
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    positions: torch.Tensor,
    page_entries: int,
    window_tokens: int | None,
    ratio: int = 1,
) -> RowBatch:
    """The group's :class:`RowBatch` from the plan's arrays (module doc). Key ``j`` of a row is
    entry ``first_page * E + j`` with ``first_page = ceil(units / E) - num_listed`` (a window
    group lists only the pages intersecting the window); ``units`` is the row's tokens, or its
    closed entries (``seq_len // ratio``) in a compressed group, whose entry e has key position
    ``(e + 1) * ratio - 1`` (:func:`resin.page_views.readable_keys`, vectorised)."""
    device = positions.device
    query_indptr = np.asarray(query_indptr, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    kv_indptr = np.asarray(kv_indptr, dtype=np.int64)
    kv_indices = np.asarray(kv_indices, dtype=np.int64)
    num_rows = len(seq_lens)
    entries = page_entries
    num_listed = np.diff(kv_indptr)
    width = max(int(num_listed.max(initial=0)), 1)  # P
    units = seq_lens // ratio if ratio > 1 else seq_lens
    first_page = -(-units // entries) - num_listed
    column = np.arange(width)
    listed = column[None, :] < num_listed[:, None]  # [S, P]
    # Padding pages repeat the row's first listed page when that page is full (finite bytes,
    # masked), else the null page (zeroed after the gather).
    first_full = (num_listed > 0) & ((first_page + 1) * entries <= units)
    if len(kv_indices):
        source = kv_indptr[:-1, None] + np.minimum(
            column[None, :], np.maximum(num_listed - 1, 0)[:, None]
        )
        pages = kv_indices[np.minimum(source, len(kv_indices) - 1)]
        pages = np.where(listed | first_full[:, None], np.where(listed, pages, pages[:, :1]), 0)
    else:
        pages = np.zeros((num_rows, width), dtype=np.int64)
    key_index = first_page[:, None] * entries + np.arange(width * entries)[None, :]  # [S, K]
    key_listed = np.repeat(listed, entries, axis=1)
    written = key_listed & (key_index < units[:, None])
    # Zero what may be garbage: unwritten keys in a listed page (the last page's tail) and
    # every key of a null padding page.
    blank = ~written & (key_listed | ~first_full[:, None])
    blank_flat = np.flatnonzero(blank)
    key_positions = (key_index + 1) * ratio - 1 if ratio > 1 else key_index

    query_lens = np.diff(query_indptr)
    num_queries = max(int(query_lens.max(initial=0)), 1)
    in_order = num_queries == 1 and bool((query_lens == 1).all())
    key_pos = torch.from_numpy(key_positions).to(device)
    key_ok = torch.from_numpy(written).to(device)
    if in_order:
        query_index = query_valid = None
        query_positions = positions[:, None]  # [S, 1]
    else:
        offsets = np.arange(num_queries)[None, :]
        valid = offsets < query_lens[:, None]
        index = np.where(valid, query_indptr[:-1, None] + offsets, 0)
        query_index = torch.from_numpy(index).to(device)
        query_valid = torch.from_numpy(valid).to(device)
        query_positions = positions[query_index]  # [S, Q]
    mask = key_ok[:, None, :] & (key_pos[:, None, :] <= query_positions[:, :, None])
    if window_tokens is not None:
        mask &= key_pos[:, None, :] > query_positions[:, :, None] - window_tokens
    if query_valid is not None:
        mask &= query_valid[:, :, None]
        # Padding queries see the row's first key (finite: real or zeroed), so no softmax
        # row is empty (no NaN).
        mask[:, :, 0] |= ~query_valid
    return RowBatch(
        num_rows=num_rows,
        num_keys=width * entries,
        page_table=torch.from_numpy(pages.reshape(-1)).to(device),
        blank_keys=torch.from_numpy(blank_flat).to(device) if len(blank_flat) else None,
        query_index=query_index,
        query_valid=query_valid,
        mask=mask,
    )


@dataclass
class KernelRows:
    """One cache group's plan arrays as the CPU paged-attention kernel takes them (uint32 page
    table, int64 positions), made once per step."""

    query_indptr: np.ndarray
    seq_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    positions: np.ndarray
    page_entries: int
    window: int | None
    ratio: int


def kernel_pays(query_indptr: np.ndarray, seq_lens: np.ndarray) -> bool:
    """Whether the CPU kernel beats the padded SDPA batch for this step's rows: always when no
    row has more than :data:`KERNEL_MAX_QUERIES` queries (decode, verify rows, short chunks);
    otherwise when padding would inflate SDPA's work past :data:`KERNEL_PADDING_RATIO` times
    the kernel's (a long chunk mixed with decode rows). The kernel does each row's exact
    queries x keys but without SDPA's blocked matmuls."""
    query_lens = np.diff(np.asarray(query_indptr, dtype=np.int64))
    if len(query_lens) == 0 or int(query_lens.max()) <= KERNEL_MAX_QUERIES:
        return True
    keys = np.asarray(seq_lens, dtype=np.int64)
    padded = len(query_lens) * int(query_lens.max()) * int(keys.max())
    return padded > KERNEL_PADDING_RATIO * int((query_lens * keys).sum())


KERNEL_MAX_QUERIES = 16
KERNEL_PADDING_RATIO = 4

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""What the CPU kernel reads: float32 or bfloat16 queries (widened to float32) and caches of
either (both K and V of one dtype; a bfloat16 one widened exactly as each row loads)."""


class TorchBackend(ReferenceBackend):
    """Batched attention in plain torch (module doc); on CPU in float32 or bfloat16, the paged-attention
    kernel of ``resin._core`` when :func:`kernel_pays` (``use_cpu_kernel``: module doc)."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        self.batches: dict[int, RowBatch] = {}
        self.kernel_rows: dict[int, KernelRows | None] = {}
        # On where it was measured to win: vectorised (AVX2 + FMA). Its scalar fallback loses
        # to SDPA, so there only RESIN_TORCH_CPU_KERNEL=1 turns it on.
        setting = os.environ.get("RESIN_TORCH_CPU_KERNEL", "")
        self.use_cpu_kernel = setting == "1" or (setting != "0" and _core.kernels_vectorised())

    def begin_step(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().begin_step(*args, **kwargs)
        self.batches = {}
        self.kernel_rows = {}

    def _kernel_rows(self, group: int) -> KernelRows | None:
        if group in self.kernel_rows:
            return self.kernel_rows[group]
        t = self.group_arrays(group)
        rows = None
        if kernel_pays(t.query_indptr, t.seq_lens):
            rows = KernelRows(
                query_indptr=np.ascontiguousarray(t.query_indptr, dtype=np.uint32),
                seq_lens=np.ascontiguousarray(t.seq_lens, dtype=np.uint32),
                kv_indptr=np.ascontiguousarray(t.kv_indptr, dtype=np.uint32),
                kv_indices=np.ascontiguousarray(t.kv_indices, dtype=np.uint32),
                positions=t.positions.numpy().astype(np.int64),
                page_entries=t.page_entries,
                window=t.window,
                ratio=t.ratio,
            )
        self.kernel_rows[group] = rows
        return rows

    def _kernel_attend(
        self,
        rows: KernelRows,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        scale: float,
        dim_v: int,
        sinks: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:
        # float32 queries and output; a bfloat16 cache goes as its bits (numpy has no bfloat16)
        # and is widened to float32 as the kernel reads it; the output is rounded once.
        out = q.new_empty(q.shape[0], q.shape[1], dim_v, dtype=torch.float32)
        _core.paged_attention(
            q.to(torch.float32).contiguous().numpy(),
            numpy_view(k_cache),
            None if v_cache is None else numpy_view(v_cache),
            out.numpy(),
            rows.query_indptr,
            rows.seq_lens,
            rows.kv_indptr,
            rows.kv_indices,
            rows.positions,
            scale=scale,
            value_dim=dim_v,
            window=rows.window,
            ratio=rows.ratio,
            softcap=softcap,
            sinks=None if sinks is None else sinks.float().contiguous().numpy(),
            threads=kernel_threads(),
            # A bfloat16 model: HF's roundings (scores, probabilities), so greedy tokens depart
            # from HF's no more than the bfloat16 SDPA path's do.
            bf16_rounding=q.dtype is torch.bfloat16,
        )
        return out if q.dtype is torch.float32 else out.to(q.dtype)

    def _kernel_takes(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None
    ) -> bool:
        # `is` dtype tests and `is_cpu` (not `t.device.type` in a generator: ~7 us a call).
        if not (self.use_cpu_kernel and q.dim() == 3 and k_cache.dim() == 4):
            return False
        if q.dtype not in KERNEL_DTYPES or k_cache.dtype not in KERNEL_DTYPES:
            return False
        for t in (q, k_cache) if v_cache is None else (q, k_cache, v_cache):
            if not t.is_cpu or t.stride(-1) != 1:
                return False
        return v_cache is None or (v_cache.dim() == 4 and v_cache.dtype is k_cache.dtype)

    def _batch(self, group: int) -> RowBatch:
        batch = self.batches.get(group)
        if batch is None:
            batch = plan_row_batch(*self.group_arrays(group))
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
        if self._kernel_takes(q, k_cache, v_cache):
            kernel_rows = self._kernel_rows(group)
            if kernel_rows is not None and kernel_rows.page_entries == k_cache.shape[1]:
                return self._kernel_attend(
                    kernel_rows, q, k_cache, v_cache, scale, dim_v, sinks, softcap
                )
        b = self._batch(group)
        rows = b.num_rows
        k = b.gather(k_cache)
        v = k if v_cache is None else b.gather(v_cache)
        k = k.to(q.dtype).transpose(1, 2)  # [S, Hkv, K, D]
        v = v[..., :dim_v].to(q.dtype).transpose(1, 2)
        # GQA / MQA without copying K and V per query head: fold the heads that share a KV head
        # into the query axis, [S, Hkv, repeat * Q, D] (query head = kv head * repeat + r).
        if b.query_index is None:
            num_queries = 1
            queries = q.reshape(rows, 1, num_heads, -1)
        else:
            num_queries = b.query_index.shape[1]
            queries = q[b.query_index]
        queries = queries.transpose(1, 2).reshape(rows, num_kv_heads, repeat * num_queries, -1)
        mask = b.folded_mask(repeat)  # [S, 1, repeat * Q, K]
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
        if b.query_index is None:
            return out.reshape(rows, num_heads, dim_v)
        assert b.query_valid is not None
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
