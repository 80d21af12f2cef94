"""The triton backend's graph-safe half: its K / V write kernel and its static page tables.

Owns :class:`GraphSafeTables`, the mixin :class:`~.triton_backend.TritonBackend` builds on,
and :class:`GroupTable` (one group's page table of a step, as the attention kernel reads it):

- ``write``: one Triton kernel per cache (a program per new token and feature block) stores
  each token's row at its ``slot_mapping`` slot and skips slot -1 inside the kernel — no
  boolean mask of the slots, so no host sync (capturable), and a padding row stores nothing;
  a cache whose per-entry dims do not flatten to one stride falls back to the base write.
- the CUDA-graph hook of :mod:`.cuda_graphs` (``graph_safe``): ``prepare_static`` keeps per
  group the one-token rows' ``query_indptr``, ``seq_lens``, ``kv_indptr`` and a ``kv_indices``
  of a fixed width per row in static buffers (pinned host twins);
  ``update_static(plan, num_rows)`` copies a decode plan's rows in and pads them to
  ``num_rows`` (``seq_len`` 1, one page: the null page 0); ``begin_static_step`` points the
  attention kernel at the first ``num_rows`` rows (one query block per row, so its grid
  depends on ``num_rows`` only).

Imports torch; triton only when a backend is built (``write_kernel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from resin.runners.torch.cuda_graphs import StagedBuffer

try:
    import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:  # TritonBackend says so when built
    triton = None
    tl = None

MAX_WRITE_BLOCK = 1024  # features per program of the write kernel
_WRITE_KERNELS: dict[bool, Any] = {}


def _write_slots(
    values_ptr,
    cache_ptr,
    slots_ptr,
    stride_vt,
    stride_vf,
    stride_cp,
    stride_ce,
    stride_cf,
    num_features,
    PAGE_ENTRIES: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    # The token's slot in every lane (the interpreter cannot mask with a scalar condition).
    slot = tl.zeros([BLOCK_F], dtype=tl.int64) + tl.load(slots_ptr + token)
    keep = (f < num_features) & (slot >= 0)
    slot = tl.where(keep, slot, 0)  # -1 never becomes an address
    value = tl.load(values_ptr + token * stride_vt + f * stride_vf, mask=keep, other=0)
    tl.store(
        cache_ptr
        + (slot // PAGE_ENTRIES) * stride_cp
        + (slot % PAGE_ENTRIES) * stride_ce
        + f * stride_cf,
        value.to(cache_ptr.dtype.element_ty),
        mask=keep,
    )


def write_kernel(interpret: bool) -> Any:
    """The write kernel, decorated for the interpreter or not (as the attention kernel)."""
    kernel = _WRITE_KERNELS.get(interpret)
    if kernel is None:
        kernel = _WRITE_KERNELS[interpret] = triton.jit(_write_slots)
    return kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rows(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache`` [num_pages, entries, *shape] as a [num_pages, entries, features] view (None
    when its per-entry dims do not flatten to one stride)."""
    try:
        return cache.view(cache.shape[0], cache.shape[1], -1)
    except RuntimeError:
        return None


@dataclass
class GroupTable:
    """One cache group's page table for this step, as int64 device tensors."""

    query_indptr: torch.Tensor
    seq_lens: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_query_len: int


@dataclass
class StaticTable:
    """One group's static page table for CUDA graphs: up to ``max_rows`` one-token rows, each
    listing at most ``width`` pages."""

    query_indptr: torch.Tensor
    seq_lens: StagedBuffer
    kv_indptr: StagedBuffer
    kv_indices: StagedBuffer
    width: int


class GraphSafeTables:
    """The write kernel and static tables of the triton backend (module doc). Expects
    ``interpret``, ``tables`` and ``begin_step`` / ``write`` of a :class:`ReferenceBackend`
    further along the MRO."""

    graph_safe = True  # per-step metadata can live in static buffers (.cuda_graphs)
    interpret: bool
    tables: dict[int, GroupTable]

    def init_graph_safe(self) -> None:
        self.write_kernel = write_kernel(self.interpret)
        self.static: list[StaticTable] = []

    def prepare_static(self, max_rows: int, max_pages: Sequence[int], device: torch.device) -> None:
        """Static tables for up to ``max_rows`` one-token rows, row i of group g listing at
        most ``max_pages[g]`` pages; every row starts as a padding row (``seq_len`` 1, the
        null page)."""
        int64 = torch.int64
        self.static = [
            StaticTable(
                query_indptr=torch.arange(max_rows + 1, dtype=int64, device=device),
                seq_lens=StagedBuffer(torch.ones(max_rows, dtype=int64), device),
                kv_indptr=StagedBuffer(torch.arange(max_rows + 1, dtype=int64), device),
                kv_indices=StagedBuffer(torch.zeros(max_rows * width, dtype=int64), device),
                width=int(width),
            )
            for width in max_pages
        ]

    def update_static(self, plan: Any, num_rows: int) -> bool:
        """A decode plan's S rows into the static tables, then padding rows up to
        ``num_rows``; False, before anything is written, when a row lists more pages than
        a static row holds."""
        s = plan.num_sequences
        indptrs, indices = plan.kv_indptr, plan.kv_indices
        if len(indptrs) != len(self.static) or num_rows > len(self.static[0].seq_lens.np):
            return False
        for table, indptr in zip(self.static, indptrs):
            if s and int(np.diff(indptr).max()) > table.width:
                return False
        num_pad = num_rows - s
        seq_lens = plan.seq_lens
        for table, indptr, pages in zip(self.static, indptrs, indices):
            nnz = int(indptr[s])
            table.kv_indptr.np[: s + 1] = indptr
            table.kv_indptr.np[s + 1 : num_rows + 1] = nnz + np.arange(1, num_pad + 1)
            table.kv_indices.np[:nnz] = pages
            table.kv_indices.np[nnz : nnz + num_pad] = 0  # the null page
            table.seq_lens.np[:s] = seq_lens
            table.seq_lens.np[s:num_rows] = 1
            table.kv_indptr.upload(num_rows + 1)
            table.kv_indices.upload(nnz + num_pad)
            table.seq_lens.upload(num_rows)
        return True

    def begin_static_step(
        self,
        step: Any,
        num_rows: int,
        group_windows: Any,
        group_page_entries: Any,
        group_ratios: Any = None,
    ) -> None:
        """``begin_step`` for a step over the static buffers' first ``num_rows`` rows."""
        self.begin_step(step, group_windows, group_page_entries, group_ratios)  # type: ignore[attr-defined]
        self.tables = {
            g: GroupTable(
                table.query_indptr[: num_rows + 1],
                table.seq_lens.device[:num_rows],
                table.kv_indptr.device[: num_rows + 1],
                table.kv_indices.device,
                1,
            )
            for g, table in enumerate(self.static)
        }

    def write(
        self,
        caches: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store each ``values[i]`` [T, ...] at ``slot_mapping`` (int64[T]) of ``caches[i]``
        in one kernel per cache; slot -1 stores nothing (no host sync)."""
        num_tokens = int(slot_mapping.shape[0])
        if num_tokens == 0:
            return
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        for cache, tensor in zip(caches, values):
            rows = _rows(cache)
            if rows is None or tensor.device != cache.device:
                super().write([cache], [tensor], slot_mapping)  # type: ignore[misc]
                continue
            flat = tensor.reshape(num_tokens, -1)
            features = int(flat.shape[1])
            if features != rows.shape[2]:
                raise ValueError(
                    f"write: {tuple(tensor.shape)} values for a cache of entries "
                    f"{tuple(cache.shape[2:])}"
                )
            block = min(_next_pow2(features), MAX_WRITE_BLOCK)
            self.write_kernel[(num_tokens, -(-features // block))](
                flat,
                rows,
                slots,
                *flat.stride(),
                *rows.stride(),
                features,
                PAGE_ENTRIES=int(rows.shape[1]),
                BLOCK_F=block,
            )
