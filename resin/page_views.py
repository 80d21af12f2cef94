"""Which cache slots a plan row reads, from the pages it lists (numpy only, no framework).

Owns the page-table arithmetic every runner's paged attention shares (the torch runners'
:func:`resin.runners.torch.layers.build_sequence_views`, the MLX runner's
:class:`resin.runners.mlx.paged_attention.GroupAttention`):

- :func:`readable_keys`: a row's listed pages -> the flat cache slots (``page * page_size +
  offset``) of its keys and their key positions, in position order. A sliding-window group
  lists only the pages that intersect the window, so the first listed page is logical page
  ``ceil(units / page_size) - num_listed`` (docs/batch_plan.md, "Sliding-window group"); slots
  past the row's end in its last page are dropped (never read: with shared layer-slot
  buffers their bytes may be another cache group's, e.g. NaN as this dtype). A compressed
  group (``ratio`` > 1) counts closed entries instead of tokens, ``page_size`` (its
  ``entries_per_page``) per page, and an entry's key position is the position of the token
  that closes it, ``(e + 1) * ratio - 1``;
- :func:`key_mask`: which of those keys each query may read: causal, and for a sliding
  window ``key > query - window``.
"""

from __future__ import annotations

import numpy as np


def readable_keys(
    pages: np.ndarray, seq_len: int, page_size: int, ratio: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``pages`` (the row's slice of ``kv_indices``) -> (slots int64 [K], key positions int64
    [K]) of the keys the row can read (module doc)."""
    pages = np.asarray(pages).astype(np.int64)
    units = seq_len // ratio if ratio > 1 else seq_len  # tokens, or closed entries
    first_page = -(-units // page_size) - len(pages)
    offsets = np.arange(page_size, dtype=np.int64)
    slots = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)
    key_index = first_page * page_size + np.arange(len(slots), dtype=np.int64)
    written = key_index < units
    slots, key_index = slots[written], key_index[written]
    key_positions = (key_index + 1) * ratio - 1 if ratio > 1 else key_index
    return slots, key_positions


def key_mask(
    query_positions: np.ndarray, key_positions: np.ndarray, window: int | None
) -> np.ndarray:
    """bool [Q, K]: query ``q`` reads key ``k`` iff ``k <= q`` (and ``k > q - window``)."""
    queries = np.asarray(query_positions)[:, None]
    mask = key_positions[None, :] <= queries
    if window is not None:
        mask &= key_positions[None, :] > queries - window
    return mask
