"""``torch.topk``'s choice among tied values on the CPU, reproduced in numpy (no torch).

Owns :func:`torch_cpu_topk`, the indices ``torch.topk(x, k)`` (``largest=True``,
``sorted=True``) returns for one row on the CPU, ties included, and the libstdc++ algorithms it
runs on. The MLX MoE routers (:func:`resin.runners.mlx.layers.top_k_indices`) use it for the
rows whose top k is ambiguous, so they pick the experts HF and the torch runners pick.

What torch does (``aten/src/ATen/native/TopKImpl.h``, ``topk_impl_loop``): per row it fills a
vector of ``(value, index)`` pairs in index order and, with a comparator that looks at the value
only (``x > y``, NaN above everything),

- ``k * 64 <= n``: ``std::partial_sort(begin, begin + k, end)``;
- otherwise: ``std::nth_element(begin, begin + k - 1, end)``, then ``std::sort`` of the first
  ``k - 1`` pairs (not ``k``: the ``k``-th is already in place);

and returns the first ``k`` indices. The comparator never looks at the index, so which of
several equal values is kept is whatever the swaps of libstdc++'s introselect / heap select /
introsort leave in front: deterministic (no randomness, the same for the same row), but not
"lowest index first". ``[1, 1, 1, 1]`` with k = 2 gives ``[2, 3]``; ``[0.197, -1.23, 0.197,
1.227]`` gives ``[3, 2]``. The functions below are libstdc++'s (``bits/stl_algo.h``,
``bits/stl_heap.h``) step for step on a Python list; ``tests/test_mlx_numerics.py`` checks them
against ``torch.topk`` on rows full of ties. This is the CPU kernel, the one the parity
harness's HF reference runs; CUDA's ``torch.topk`` is another kernel, not checked here.
"""

from __future__ import annotations

import math

import numpy as np

Pair = tuple[float, int]
SORT_THRESHOLD = 16  # libstdc++'s _S_threshold


def _before(x: Pair, y: Pair) -> bool:
    """torch's ``largest`` comparator: NaN first, then greater values first."""
    a, b = x[0], y[0]
    return (math.isnan(a) and not math.isnan(b)) or a > b


def _lg(n: int) -> int:
    return n.bit_length() - 1


def _push_heap(q: list[Pair], first: int, hole: int, top: int, value: Pair) -> None:
    parent = (hole - 1) // 2
    while hole > top and _before(q[first + parent], value):
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = value


def _adjust_heap(q: list[Pair], first: int, hole: int, length: int, value: Pair) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _before(q[first + child], q[first + child - 1]):
            child -= 1
        q[first + hole] = q[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        q[first + hole] = q[first + child - 1]
        hole = child - 1
    _push_heap(q, first, hole, top, value)


def _make_heap(q: list[Pair], first: int, last: int) -> None:
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(q, first, parent, length, q[first + parent])
        if parent == 0:
            return
        parent -= 1


def _pop_heap(q: list[Pair], first: int, last: int, result: int) -> None:
    value = q[result]
    q[result] = q[first]
    _adjust_heap(q, first, 0, last - first, value)


def _heap_select(q: list[Pair], first: int, middle: int, last: int) -> None:
    _make_heap(q, first, middle)
    for i in range(middle, last):
        if _before(q[i], q[first]):
            _pop_heap(q, first, middle, i)


def _sort_heap(q: list[Pair], first: int, last: int) -> None:
    while last - first > 1:
        last -= 1
        _pop_heap(q, first, last, last)


def partial_sort(q: list[Pair], first: int, middle: int, last: int) -> None:
    """``std::partial_sort``: heap select, then sort the heap."""
    _heap_select(q, first, middle, last)
    _sort_heap(q, first, middle)


def _move_median_to_first(q: list[Pair], result: int, a: int, b: int, c: int) -> None:
    if _before(q[a], q[b]):
        if _before(q[b], q[c]):
            pick = b
        elif _before(q[a], q[c]):
            pick = c
        else:
            pick = a
    elif _before(q[a], q[c]):
        pick = a
    elif _before(q[b], q[c]):
        pick = c
    else:
        pick = b
    q[result], q[pick] = q[pick], q[result]


def _unguarded_partition(q: list[Pair], first: int, last: int, pivot: int) -> int:
    while True:
        while _before(q[first], q[pivot]):
            first += 1
        last -= 1
        while _before(q[pivot], q[last]):
            last -= 1
        if not first < last:
            return first
        q[first], q[last] = q[last], q[first]
        first += 1


def _unguarded_partition_pivot(q: list[Pair], first: int, last: int) -> int:
    mid = first + (last - first) // 2
    _move_median_to_first(q, first, first + 1, mid, last - 1)
    return _unguarded_partition(q, first + 1, last, first)


def _unguarded_linear_insert(q: list[Pair], last: int) -> None:
    value = q[last]
    prev = last - 1
    while _before(value, q[prev]):
        q[last] = q[prev]
        last = prev
        prev -= 1
    q[last] = value


def _insertion_sort(q: list[Pair], first: int, last: int) -> None:
    if first == last:
        return
    for i in range(first + 1, last):
        if _before(q[i], q[first]):
            value = q[i]
            q[first + 1 : i + 1] = q[first:i]
            q[first] = value
        else:
            _unguarded_linear_insert(q, i)


def nth_element(q: list[Pair], nth: int) -> None:
    """``std::nth_element(begin, begin + nth, end)`` (introselect)."""
    first, last = 0, len(q)
    if first == last or nth == last:
        return
    depth = 2 * _lg(last - first)
    while last - first > 3:
        if depth == 0:
            _heap_select(q, first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]
            return
        depth -= 1
        cut = _unguarded_partition_pivot(q, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last)


def _introsort_loop(q: list[Pair], first: int, last: int, depth: int) -> None:
    while last - first > SORT_THRESHOLD:
        if depth == 0:
            partial_sort(q, first, last, last)
            return
        depth -= 1
        cut = _unguarded_partition_pivot(q, first, last)
        _introsort_loop(q, cut, last, depth)
        last = cut


def sort(q: list[Pair], first: int, last: int) -> None:
    """``std::sort(begin + first, begin + last)`` (introsort + final insertion sort)."""
    if first == last:
        return
    _introsort_loop(q, first, last, 2 * _lg(last - first))
    if last - first > SORT_THRESHOLD:
        _insertion_sort(q, first, first + SORT_THRESHOLD)
        for i in range(first + SORT_THRESHOLD, last):
            _unguarded_linear_insert(q, i)
    else:
        _insertion_sort(q, first, last)


def torch_cpu_topk(row: np.ndarray, k: int) -> np.ndarray:
    """The indices (int64 [k], in order) of ``torch.topk(row, k)`` on the CPU, for one row."""
    n = len(row)
    if not 0 <= k <= n:
        raise ValueError(f"top {k} of {n} values")
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    q: list[Pair] = [(float(v), j) for j, v in enumerate(row)]
    if k * 64 <= n:
        partial_sort(q, 0, k, n)
    else:
        nth_element(q, k - 1)
        sort(q, 0, k - 1)
    return np.array([j for _, j in q[:k]], dtype=np.int64)
