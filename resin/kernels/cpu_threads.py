"""Threads for ``resin._core``'s CPU kernels (paged attention, the decode linear, the
sampler's ``sample_rows`` and ``argmax``).

Owns :func:`kernel_threads`, the one rule every kernel caller passes as ``threads``.
"""

from __future__ import annotations

import os

import torch

from resin import _core


def kernel_threads() -> int:
    """Torch's thread count when the kernels run on torch's OpenMP team
    (``_core.openmp_team_available()``: the team's spin-waiting workers take the work); else
    the calling thread plus the cores torch's pool leaves idle, since a thread of the kernel's
    own competing with a spinning worker for a core made a 64-row decode step ~30% slower than
    the kernel on one thread (2 cores, 2 torch threads; skills/optimize-perf)."""
    if _core.openmp_team_available():
        return torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - torch.get_num_threads() + 1)
