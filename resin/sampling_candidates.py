"""The candidate search of the torch sampler: a row's n largest logits without a ``topk`` over
the whole row (:func:`top_candidates`).

Owns the tree of block maxima and its guarantee: the values are exactly
``logits.topk(n).values`` (the indices may order equal values differently). Cost per row of V
logits, torch on a CPU (``topk`` ~10 ns a value, a vectorised max well under one): one max
over blocks of eight (reading the row once, writing an eighth), then of four over that, ...,
and one ``topk`` over 4n (8n at the bottom) values per level, instead of a ``topk`` over V.
On the CPU, float32 rows go to ``_core.top_candidates`` instead (:data:`candidates_kernel`):
one scan of the row against a rising threshold in Rust, the same values, ~2.6-3.3x faster
than the tree here (160 flat rows of 32,000, one thread: ~2.1 vs ~5.5 ms at n = 64, ~4.2 vs ~14
at 256; rust/kernels/src/candidates.rs); the tree serves other devices.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

import torch

from resin import _core
from resin.sampling_workspace import Workspace

FIRST_BRANCHING = 8
"""Logits per block of the tree's first level: its max reads the whole row, and its fill of
the level (1/8 of the row) costs less than a quarter's; the bottom search reads 8 per node."""

BRANCHING = 4
"""Children per node of the tree's levels above the first."""


candidates_kernel = True
"""Whether float32 CPU rows are searched by ``_core.top_candidates`` (one scan of the row
against a rising threshold, in Rust) rather than the torch tree below: the same values. False
takes the tree everywhere (for A/B runs and the tests)."""


def _kernel_candidates(logits: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = logits.new_empty((len(logits), num))
    indices = torch.empty((len(logits), num), dtype=torch.int64)
    _core.top_candidates(logits.contiguous().numpy(), values.numpy(), indices.numpy())
    return values, indices


def top_candidates(
    logits: torch.Tensor, num: int, workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num`` largest values of each row of ``logits`` [S, V], descending, and their
    columns: ``values`` equal ``logits.topk(num).values`` exactly; ``indices`` int64 [S, num]
    (columns of equal values may come in another order than ``topk``'s).

    A tree of block maxima: level 1 holds the maximum of each block of ``FIRST_BRANCHING``
    logits (strided blocks, so the max is one vectorised pass), level 2 that of each block of
    ``BRANCHING`` level-1 nodes, ... up to a level of 2-8 ``num`` nodes. Going down, each level keeps its ``num`` largest nodes among
    the children of the nodes kept above (plus the few nodes a level's blocks leave over). Why
    that loses nothing: let t be the row's ``num``-th largest logit. A node above t contains a
    logit above t, so fewer than ``num`` nodes of a level are above t and all are kept (their
    parents were); and the kept nodes of a level contain at least ``num`` logits >= t (either
    all kept nodes are >= t, each holding one, or every node >= t among the children was
    kept). So the leaves reached hold every logit above t and enough equal to t.
    """
    num_rows, vocab_size = logits.shape
    if num == 0 or vocab_size < 16 * num:  # none asked, or a small row: one topk is as cheap
        values, indices = logits.topk(min(num, vocab_size), dim=-1)
        return values, indices
    if candidates_kernel and logits.dtype is torch.float32 and logits.is_cpu:
        return _kernel_candidates(logits, num)
    ws = workspace if workspace is not None else Workspace(logits.device)
    levels, widths = [logits.contiguous()], []  # widths[i]: children per node of level i + 1
    b = FIRST_BRANCHING
    while levels[-1].shape[1] // b >= 2 * num:
        below = levels[-1]
        m = below.shape[1] // b
        level = ws.get(f"candidates.level{len(levels)}", (num_rows, m), logits.dtype)
        torch.amax(below[:, : b * m].view(num_rows, b, m), dim=1, out=level)
        levels.append(level)
        widths.append(b)
        b = BRANCHING
    values, ids = levels[-1].topk(num, dim=-1, sorted=False)
    row_starts = torch.arange(num_rows, device=logits.device)[:, None]
    for depth in range(len(levels) - 2, -1, -1):  # at least one level: V >= 16 num
        below, m, b = levels[depth], levels[depth + 1].shape[1], widths[depth]
        n = below.shape[1]
        # Node j of the level above is the max of below[j + i * m] for i < b; flat indices.
        start = row_starts * n
        flat = ids[:, None, :] + (start + m * torch.arange(b, device=logits.device))[:, :, None]
        flat = flat.view(num_rows, b * num)
        if n > b * m:  # the columns past the last whole block are always candidates
            rest = start + torch.arange(b * m, n, device=logits.device)
            flat = torch.cat([flat, rest], dim=1)
        pool = ws.get("candidates.pool", (flat.numel(),), logits.dtype)
        torch.index_select(below.view(-1), 0, flat.view(-1), out=pool)
        values, at = pool.view(num_rows, -1).topk(num, dim=-1, sorted=depth == 0)
        ids = flat.gather(1, at).sub_(start)
    return values, ids
