"""The projections on CPU: ``F.linear`` of a few rows through ``resin._core.linear``, and of
more rows in bfloat16 through oneDNN with the weight packed once.

Owns :func:`cpu_linear` (a drop-in for ``F.linear``), when the Rust kernel takes a call
(:func:`takes`) and the packed bfloat16 weights (:func:`packed_weight`). At one to a few rows a
projection reads every weight once to make a few outputs, so it is bound by memory; torch's CPU
GEMM reads cold weights at a third (float32) to a half (oneDNN's bfloat16) of the machine's
streaming rate there, the Rust kernel (``rust/kernels/src/linear.rs``) at 80-90% of it at one
row (docs/benchmarks.md, "The weights asked for in step with the reads"). The floats: one
float32 dot product per output plus the bias, rounded once to the dtype, as torch's GEMM
computes them but in another summation order, so they agree to float32 rounding, not bit for
bit (parity holds within its tolerances: tests/test_cpu_linear.py, the parity suite).

Taken: CPU tensors of a dtype in :data:`MAX_ROWS` (float32, bfloat16) with up to its rows
(bfloat16: every row count on a CPU where oneDNN has no bfloat16 GEMM, where torch's is slow),
``x`` [rows, in] and ``weight`` [out, in] dense, contiguous and aligned, a bias [out] of the
same dtype, no autograd, on a CPU the kernels vectorise for (``_core.kernels_vectorised()``).

Past the kernel's rows, a bfloat16 projection on a CPU where oneDNN has a bfloat16 GEMM runs
``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once into oneDNN's blocked
layout (``_reorder_linear_weight``, what inductor's CPU freezing does): ``F.linear`` reorders
it on every call, which cost a third of a 64-row step's projections and two fifths of a
4,096-row prefill's (docs/benchmarks.md, "Packed bfloat16 weights"). Same oneDNN GEMM: for a
contiguous ``x`` bit-equal to ``F.linear`` (tests/test_packed_weights.py: 2 to 300 rows, 3-D;
a strided ``x`` takes ``F.linear``). A weight is packed the second time it is seen alive (a
tensor made for one call, a ``torch.cat`` of two or a slice taken per call, is never packed;
a weight loaded as a view of its checkpoint's buffer is) and its pack is dropped with it. The
cost: each packed weight is held twice (its plain tensor stays: an embedding tied to the LM
head, the kernel's few-row calls read it), so packs stop at :data:`PACK_MEMORY_SHARE` of the
memory free when the first one is made (``MemAvailable``, or less room under a cgroup's
memory limit; the weights past it run on ``F.linear``, with one warning) and a model that
barely fits is not pushed out of memory. ``RESIN_CPU_PACKED_WEIGHTS=0`` at import, or
:data:`packing` False, turns it off. A weight written in place after it was packed keeps its
old pack (Resin loads weights once).

Anything else, and everything with ``RESIN_CPU_LINEAR=0`` in the environment at import or
:data:`enabled` and :data:`packing` False, is ``F.linear`` (on a GPU too:
:data:`resin.kernels.linear` is :func:`cpu_linear` wherever the CUTLASS GEMM is not opted in,
and a CUDA tensor fails :func:`takes` and the packing's device test).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from resin import _core
from resin.kernels.cpu_threads import kernel_threads
from resin.kernels.numpy_view import numpy_view

ENV_VAR = "RESIN_CPU_LINEAR"
PACKED_ENV_VAR = "RESIN_CPU_PACKED_WEIGHTS"


def _packing_available() -> bool:
    """Whether this torch's oneDNN has the packed bfloat16 linear: built with oneDNN, a CPU it
    has a bfloat16 GEMM for, and the two ops (private to torch: inductor's)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        ops = torch.ops.mkldnn
        return bool(ops._is_mkldnn_bf16_supported()) and all(
            hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


# False: no weight is packed (module doc).
packing = (
    os.environ.get(ENV_VAR, "") != "0"
    and os.environ.get(PACKED_ENV_VAR, "") != "0"
    and _packing_available()
)

PACK_ROWS_HINT = 4096
"""The row count oneDNN picks the packed layout for; any row count runs on it (measured: from
3 to 4,096 rows, hints of 4 to 4,096 were within the machine's noise of each other)."""

PACK_MEMORY_SHARE = 0.5
"""The share of the memory free at the first pack (:func:`_available_bytes`: ``MemAvailable``,
at most the room under a cgroup's limit) that packs may hold."""


class _Pack(NamedTuple):
    """A weight seen by :func:`packed_weight`: its pack (None: seen once, or refused), the
    pack's bytes, and whether it was refused (over the budget: never tried again)."""

    tensor: torch.Tensor | None = None
    nbytes: int = 0
    refused: bool = False


# weight (by identity, weakly: an entry goes with its weight) -> its entry.
_packs: WeakIdKeyDictionary = WeakIdKeyDictionary()
_pack_budget_bytes: int | None = None  # set at the first pack (PACK_MEMORY_SHARE)
_pack_lock = threading.Lock()  # packing and its budget: one thread at a time


def _bfloat16_rows() -> int:
    """The kernel's bfloat16 row limit: 8 where torch's oneDNN has a bfloat16 GEMM for this
    CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: a CPU with bfloat16 instructions
    or conversions, AVX-512 BF16, AMX, AVX-NE-CONVERT), with or without :data:`packing` (on
    packed weights oneDNN's GEMM alone beats the kernel from 5 rows, but a model's decode
    step at 4 rows ran 18-27% slower on it and level at 8: each oneDNN call pays tens of
    microseconds a step's other ops leave cold, docs/benchmarks.md, "Packed bfloat16
    weights"); else every row count, in slices of :data:`ROWS_PER_CALL`: without it (e.g.
    an AVX2-only AMD EPYC) torch's bfloat16 ``mm`` costs about a GEMV a row, 4.9-6.8x the
    kernel from 8 to 256 rows (docs/benchmarks.md, "An AVX2-only machine, and bfloat16
    where oneDNN has no GEMM"). A torch without oneDNN has no such GEMM either; one without
    the query keeps the tuned limit."""
    if not torch.backends.mkldnn.is_available():
        return 1 << 30
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: keep the tuned limit
        supported = True
    return 8 if supported else 1 << 30


def _float32_rows() -> int:
    """The kernel's float32 row limit: 32 where torch's CPU kernels are AVX2 (the kernel's own
    width; there MKL's SGEMV read cold weights at a third of the streaming rate), none (0: every
    float32 call is torch's) where torch runs AVX-512: on a Sapphire Rapids machine MKL's
    AVX-512 GEMV beat the kernel at 1 to 32 rows (1 row of a 512 x 512 projection 32 µs against
    46, 1,536 x 512 89 against 123) and the whole model decoded one request 14% faster without
    it (docs/benchmarks.md, "An AVX-512 machine")."""
    return 0 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32


MAX_ROWS: dict[torch.dtype, int] = {
    torch.float32: _float32_rows(),
    torch.bfloat16: _bfloat16_rows(),
}
"""Rows up to which the kernel takes a dtype: where it beat torch's CPU GEMM on a decode step's
cold weights (docs/benchmarks.md, "The weights asked for in step with the reads": float32
2.3-5x torch at 1-4 rows, 1.4x at 32, on an AVX2 machine — none on an AVX-512 one,
:func:`_float32_rows`; bfloat16 1.5-1.8x oneDNN at 1 row, 1.8-2.7x at 2, 0.93-1.08x at 8 and
behind from 16, where each pass over a block widens its bfloat16 weights again; at 8 rows it is
kept for its end-to-end gain at 8 requests, measured against the kernel off, not against a
limit of 4; the same against oneDNN on packed weights). bfloat16 has no limit on a CPU where
oneDNN has no bfloat16 GEMM (:func:`_bfloat16_rows`)."""

ROWS_PER_CALL = 256
"""Rows of ``x`` per kernel call: the widest measured (docs/benchmarks.md, "An AVX2-only
machine, and bfloat16 where oneDNN has no GEMM"); only the bfloat16 limit reaches past it."""

# False: no call is the Rust kernel's (an A/B in one process: benchmarks/offline_throughput.py).
enabled = os.environ.get(ENV_VAR, "") != "0" and _core.kernels_vectorised()


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`cpu_linear` runs the kernel for these operands (module doc)."""
    dtype = x.dtype
    limit = MAX_ROWS.get(dtype)
    return (  # cheapest tests first: this runs for every projection of a step
        enabled
        and limit is not None
        and x.is_cpu
        and weight.dtype is dtype
        and x.dim() == 2
        and 0 < x.shape[0] <= limit
        and weight.dim() == 2
        and weight.is_cpu
        and x.layout is torch.strided
        and weight.layout is torch.strided
        and (bias is None or _bias_takes(bias, weight))
        and not (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[1] == weight.shape[1]
        and weight.shape[1] > 0
        # Rust slices need aligned elements (a tensor at an odd byte offset of a buffer).
        and x.data_ptr() % x.element_size() == 0
        and weight.data_ptr() % weight.element_size() == 0
    )


def _bias_takes(bias: torch.Tensor, weight: torch.Tensor) -> bool:
    """A bias the kernel adds as given: [out_features] of the weight's dtype (``F.linear``
    broadcasts other shapes, which :func:`cpu_linear` leaves to it)."""
    return (
        bias.dtype is weight.dtype
        and bias.is_cpu
        and bias.layout is torch.strided
        and bias.dim() == 1
        and bias.shape[0] == weight.shape[0]
        and bias.is_contiguous()
        and bias.data_ptr() % bias.element_size() == 0
    )


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: the Rust kernel where :func:`takes`, else oneDNN on the
    packed weight where there is one (:func:`packed_weight`), else torch's."""
    if not takes(x, weight, bias):
        packed = packed_weight(x, weight, bias)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = x.new_empty((x.shape[0], weight.shape[0]))
    w, b, threads = numpy_view(weight), None if bias is None else numpy_view(bias), kernel_threads()
    xs, outs = numpy_view(x), numpy_view(out)
    # A long prefill chunk in slices: the kernel widens its rows to float32 once a call and
    # rereads them for every block of weight rows, so each slice's rows stay in the cache.
    for start in range(0, x.shape[0], ROWS_PER_CALL):
        end = start + ROWS_PER_CALL
        _core.linear(xs[start:end], w, b, outs[start:end], threads=threads)
    return out


def packed_weight(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``weight`` in oneDNN's packed layout, for a bfloat16 call of :func:`cpu_linear` the
    Rust kernel did not take; None for any other call, and the first time a weight is seen
    (module doc)."""
    if not (
        packing
        and x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and x.dim() >= 2
        and x.shape[-1] == weight.shape[1]
        and x.is_contiguous()  # a strided x: oneDNN sums another way than F.linear
        and weight.layout is torch.strided
        and weight.is_contiguous()
        and (bias is None or _bias_takes(bias, weight))
        and not (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
    ):
        return None
    entry = _packs.get(weight)
    if entry is None:  # first seen
        _packs[weight] = _Pack()
        return None
    if entry.tensor is None and not entry.refused:  # seen again, alive: kept between calls
        with _pack_lock:
            _packs[weight] = entry = _pack(weight)
    return entry.tensor


def packed_bytes() -> int:
    """Bytes the live packs hold (their weights' sizes)."""
    return sum(entry.nbytes for entry in list(_packs.values()))


def _pack(weight: torch.Tensor) -> _Pack:
    """``weight``'s entry: packed, or refused if the pack would pass the budget."""
    global _pack_budget_bytes
    nbytes = weight.numel() * weight.element_size()
    if _pack_budget_bytes is None:
        _pack_budget_bytes = int(_available_bytes() * PACK_MEMORY_SHARE)
    held = packed_bytes()
    if held + nbytes > _pack_budget_bytes:
        # Warned once, at the first refusal; no warning where the free memory is unknown.
        if _pack_budget_bytes > 0 and not any(e.refused for e in list(_packs.values())):
            warnings.warn(
                f"packed bfloat16 weights stop at {held / 2**30:.2f} GiB "
                f"({PACK_MEMORY_SHARE:.0%} of the memory free at the first pack): the other "
                f"projections run on F.linear; {PACKED_ENV_VAR}=0 turns packing off",
                RuntimeWarning,
                stacklevel=4,
            )
        return _Pack(refused=True)
    return _Pack(torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), nbytes)


def _available_bytes() -> int:
    """Memory free for new allocations: ``MemAvailable`` (Linux), at most the room left under
    this process's cgroup memory limit (a container's: the host's ``MemAvailable`` does not
    see it), else the physical pages free; 0 where none of these can be read (nothing is
    packed)."""
    free = _meminfo_available()
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0
    room = _cgroup_room()
    return free if room is None else min(free, room)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit less the usage of this process's cgroup (v2: ``memory.max`` /
    ``memory.current`` of the group ``/proc/self/cgroup`` names; v1: ``memory.limit_in_bytes``
    / ``memory.usage_in_bytes``); None without a limit or where none can be read."""
    group = ""
    try:
        with open("/proc/self/cgroup") as cgroups:
            for line in cgroups:
                hierarchy, _, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0":  # v2's unified hierarchy
                    group = path
    except (OSError, ValueError):
        pass
    candidates = [
        (f"{root}{group}/memory.max", f"{root}{group}/memory.current"),
        (f"{root}/memory.max", f"{root}/memory.current"),
        (f"{root}/memory/memory.limit_in_bytes", f"{root}/memory/memory.usage_in_bytes"),
    ]
    for limit_file, usage_file in candidates:
        try:
            with open(limit_file) as f:
                text = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
            limit = None if text == "max" else int(text)
        except (OSError, ValueError):
            continue
        if limit is None or limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, limit - usage)
    return None
