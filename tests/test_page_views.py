"""resin.page_views: a row's listed pages -> the cache slots and key positions it reads, and
its mask (the arithmetic both the torch and the MLX runners' paged attention use)."""

from __future__ import annotations

import numpy as np

from resin.page_views import key_mask, readable_keys


def test_a_window_row_reads_its_listed_pages_from_their_logical_place() -> None:
    # 10 tokens, 4 per page: logical pages 0..2; the window lists the last two (ids 7 and 3).
    slots, keys = readable_keys(np.array([7, 3], dtype=np.uint32), 10, 4)
    assert slots.tolist() == [28, 29, 30, 31, 12, 13]  # page 3's slots 14, 15 are unwritten
    assert keys.tolist() == [4, 5, 6, 7, 8, 9]
    assert slots.dtype == keys.dtype == np.int64


def test_a_compressed_row_reads_closed_entries_at_their_closing_token() -> None:
    # ratio 4: 13 tokens close 3 entries; 2 entries per page, pages 5 and 6.
    slots, keys = readable_keys(np.array([5, 6]), 13, 2, ratio=4)
    assert slots.tolist() == [10, 11, 12]
    assert keys.tolist() == [3, 7, 11]


def test_an_empty_row_reads_nothing() -> None:
    slots, keys = readable_keys(np.zeros(0, dtype=np.int32), 0, 16)
    assert slots.shape == keys.shape == (0,)


def test_mask_is_causal_and_windowed() -> None:
    keys = np.arange(4, 10)
    assert key_mask(np.array([9]), keys, 4).tolist() == [[False, False, True, True, True, True]]
    assert key_mask(np.array([5, 6]), keys, None).tolist() == [
        [True, True, False, False, False, False],
        [True, True, True, False, False, False],
    ]
