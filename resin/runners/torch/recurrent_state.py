"""``ctx.state``: a recurrent layer's per-request state, kept in the engine's state pages.

Owns :class:`RecurrentState`, the handle a recurrent block (linear attention, SSM) gets for one
layer in one step. The engine gives each request, per recurrent cache group, ``pages_per_state``
pages of ``page_bytes`` bytes (``plan.kv_indices[g]``, in byte order) and says whether they hold
a state to continue from (``plan.has_initial_state[g]``; the pages of a row that starts fresh
hold stale bytes). The runner keeps, per recurrent layer, one byte buffer ``[num_pages,
page_bytes]``; a state is the layer's declared buffers (``LayerCache.buffers``, e.g. ``conv`` and
``ssm``) flattened in declaration order, in the layer's dtype, padded to whole pages.

:meth:`RecurrentState.load` gathers every row's state as tensors ``[S, *shape]`` (zeros for a
fresh row); :meth:`RecurrentState.store` writes them back in place. Copy-on-write from prefix
checkpoints (``plan.copy_pages``) happens before the forward (:meth:`apply_copies`), so a block
never sees the checkpoint mechanics. Imports torch.
"""

from __future__ import annotations

import math

import torch


class RecurrentState:
    """One recurrent layer's states for the rows of one step (see module doc).

    ``pages``: the layer's uint8 ``[num_pages, page_bytes]`` buffer; ``page_table``: int64
    ``[S, pages_per_state]``; ``has_initial_state``: bool ``[S]``.
    """

    def __init__(
        self,
        pages: torch.Tensor,
        buffers: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        page_table: torch.Tensor,
        has_initial_state: torch.Tensor,
    ):
        self.pages = pages
        self.buffers = buffers
        self.dtype = dtype
        self.page_table = page_table
        self.has_initial_state = has_initial_state
        self.sizes = [math.prod(shape) for shape in buffers.values()]
        self.state_bytes = sum(self.sizes) * dtype.itemsize

    @property
    def num_rows(self) -> int:
        return int(self.page_table.shape[0])

    def load(self) -> dict[str, torch.Tensor]:
        """Every row's state, ``name -> [S, *shape]`` in the layer's dtype; zeros for rows
        without an initial state."""
        raw = self.pages[self.page_table].reshape(self.num_rows, -1)[:, : self.state_bytes]
        values = raw.contiguous().view(self.dtype)
        # Stale bytes -> 0 by selection, not multiplication: a page's previous owner may have
        # left bytes that read as NaN in this dtype (0 * NaN = NaN).
        values = torch.where(self.has_initial_state[:, None], values, values.new_zeros(()))
        out, offset = {}, 0
        for (name, shape), size in zip(self.buffers.items(), self.sizes):
            out[name] = values[:, offset : offset + size].reshape(self.num_rows, *shape)
            offset += size
        return out

    def store(self, states: dict[str, torch.Tensor]) -> None:
        """Write every row's new state back into its pages (``name -> [S, *shape]``)."""
        if self.num_rows == 0:
            return
        flat = torch.cat(
            [states[name].reshape(self.num_rows, -1).to(self.dtype) for name in self.buffers], dim=1
        )
        raw = flat.contiguous().view(torch.uint8)
        page_bytes = self.pages.shape[1]
        padded = raw.new_zeros(self.num_rows, self.page_table.shape[1] * page_bytes)
        padded[:, : raw.shape[1]] = raw
        self.pages[self.page_table] = padded.reshape(self.num_rows, -1, page_bytes)


def apply_copies(pages: torch.Tensor, copy_pages: torch.Tensor) -> None:
    """The plan's ``copy_pages`` (int64 ``[n, 2]`` of (src, dst)) on one layer's state pages:
    every source read before any destination is written."""
    if copy_pages.numel():
        pages[copy_pages[:, 1]] = pages[copy_pages[:, 0]].clone()
