"""FlashInfer's CSR page table from a Resin plan, and what FlashInfer reads through it.

Owns :class:`PageTable` and :func:`build_page_table` (the plan's per-group ``kv_indptr`` /
``kv_indices`` as FlashInfer's ``qo_indptr``, ``kv_indptr``, ``kv_indices``,
``kv_last_page_len``, int32 on the host, once per step and cache group), plus two statements of
the contract the ``flashinfer`` backend (:mod:`.flashinfer_backend`) relies on, in plain torch:
:func:`trailing_positions` (the query positions FlashInfer assumes: each row's last tokens) and
:func:`table_views` (the slots and bottom-right causal / window mask its kernels read), which
the tests hold against the reference backend's per-row views. Imports torch, not FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class PageTable:
    """One cache group's FlashInfer page table for a step (module doc); int32 on the host.

    ``qo_indptr`` [S+1] (row i's queries are the step's tokens ``[qo_indptr[i],
    qo_indptr[i+1])``), ``kv_indptr`` [S+1] / ``kv_indices`` [nnz] (the pages it lists, in
    position order), ``kv_last_page_len`` [S] (entries used in its last listed page, 1..page
    size; 0 when it lists none), ``kv_lens`` [S] (its listed keys: ``(pages - 1) * page_size +
    last``), ``seq_lens`` [S]; ``window_left`` is FlashInfer's (``window - 1``, -1 for none).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    window_left: int

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def qo_lens(self) -> torch.Tensor:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]

    @property
    def decode_only(self) -> bool:
        """Every row has exactly one query (FlashInfer's decode wrapper then applies)."""
        return self.num_rows > 0 and bool((self.qo_lens == 1).all())


def host_int64(array: Any) -> torch.Tensor:
    """A plan array (uint32 numpy, or anything ``np.asarray`` takes) as int64 on the host."""
    return torch.as_tensor(np.asarray(array).astype(np.int64))


def build_page_table(
    query_indptr: Any,
    seq_lens: Any,
    kv_indptr: Any,
    kv_indices: Any,
    page_size: int,
    window: int | None,
) -> PageTable:
    """FlashInfer's CSR page table for one token group from the plan's arrays (uint32 numpy,
    or anything ``np.asarray`` takes). The pages are the plan's own (no copy of the cache, no
    re-listing): the last page's length follows from ``seq_len``, since the plan lists every
    row through its last page. ValueError when a row's listed keys cannot hold its queries."""
    qo_indptr, seq = host_int64(query_indptr), host_int64(seq_lens)
    indptr, indices = host_int64(kv_indptr), host_int64(kv_indices)
    num_listed = indptr[1:] - indptr[:-1]
    num_pages = (seq + page_size - 1) // page_size
    last = torch.where(num_listed > 0, seq - (num_pages - 1) * page_size, 0)
    kv_lens = torch.where(num_listed > 0, (num_listed - 1) * page_size + last, 0)
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    bad = (num_listed > num_pages) | (qo_lens > kv_lens)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"row {row}: {int(num_listed[row])} listed pages of {page_size} hold "
            f"{int(kv_lens[row])} keys for seq_len {int(seq[row])} and {int(qo_lens[row])} "
            "queries: the plan must list every row's pages through its last one"
        )
    return PageTable(
        qo_indptr=qo_indptr.to(torch.int32),
        kv_indptr=indptr.to(torch.int32),
        kv_indices=indices.to(torch.int32),
        kv_last_page_len=last.to(torch.int32),
        kv_lens=kv_lens.to(torch.int32),
        seq_lens=seq.to(torch.int32),
        page_size=page_size,
        window_left=-1 if window is None else int(window) - 1,
    )


def trailing_positions(table: PageTable) -> torch.Tensor:
    """int64 [T]: the position FlashInfer assumes for each query — row i's are its last ``q``
    tokens, ``seq_len - q .. seq_len - 1``."""
    qo_lens = table.qo_lens.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(table.num_rows), qo_lens)
    offsets = torch.arange(int(qo_lens.sum())) - table.qo_indptr.to(torch.int64)[rows]
    return (table.seq_lens.to(torch.int64) - qo_lens)[rows] + offsets


def table_views(table: PageTable) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per row, what FlashInfer's kernels read from ``table``: ``(query slice, slots int64
    [kv_len], mask bool [q, kv_len])`` — key j of the listed pages lives at slot ``page *
    page_size + offset``; query i sees key j iff ``j <= kv_len - q + i`` (bottom-right causal)
    and, with a window, ``j >= kv_len - q + i - window_left``. For tests and for reading: the
    contract the backend relies on, in plain torch."""
    views = []
    ps, offsets = table.page_size, torch.arange(table.page_size)
    for row in range(table.num_rows):
        start, stop = int(table.kv_indptr[row]), int(table.kv_indptr[row + 1])
        pages = table.kv_indices[start:stop].to(torch.int64)
        kv_len = int(table.kv_lens[row])
        slots = (pages[:, None] * ps + offsets[None, :]).reshape(-1)[:kv_len]
        q0, q1 = int(table.qo_indptr[row]), int(table.qo_indptr[row + 1])
        query_at = kv_len - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        keys = torch.arange(kv_len)[None, :]
        mask = keys <= query_at
        if table.window_left >= 0:
            mask &= keys >= query_at - table.window_left
        views.append((slice(q0, q1), slots, mask))
    return views
