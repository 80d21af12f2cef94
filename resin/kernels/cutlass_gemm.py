"""The CUTLASS DSL GEMM behind linear layers, opt-in: ``RESIN_CUTLASS_GEMM=1``.

Owns :func:`cutlass_linear` (``F.linear``'s signature: ``y = x @ weight.T + bias``), which runs
:class:`~.cute_tiled_gemm.TiledGemmTN` (a tiled ``mma.sync`` tensor-core kernel written in the
CUTLASS Python DSL, ``nvidia-cutlass-dsl``) when it can, and ``F.linear`` when it cannot,
counting why in :data:`FALLBACKS`:

- the kernel runs: CUDA tensors, bf16 or fp16, ``x`` [..., K] and ``weight`` [N, K] of one
  dtype, ``weight`` contiguous, ``N % 128 == 0`` and ``K % 64 == 0`` (an 8B Llama's every
  projection), 16-byte aligned pointers; M (the tokens) is padded up to the tile (64 rows for
  M <= 64, else 128) and the padding rows cut off again; a bias is added by torch afterwards;
- one compiled kernel per (dtype, N, K, tile): compiled on first use with fake tensors (M
  dynamic), kept for the process.

Off by default and off CUDA: :func:`resin.kernels.linear` is not this kernel (it is the CPU
decode linear, :mod:`.cpu_linear`, which is ``F.linear`` on a GPU) unless
``RESIN_CUTLASS_GEMM=1`` was set when :mod:`resin.kernels` was first imported, and then fails
at once, with the reason, if the package or a GPU is missing (:func:`cutlass_unavailable`).
:func:`gemm_reference` is the torch reference the GPU test compares with.

Imports torch; ``cutlass`` only when a kernel is compiled.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

ENV_VAR = "RESIN_CUTLASS_GEMM"
TILE_N, TILE_K = 128, 64
SMALL_M = 64  # at most this many rows: the 64-row tile, else 128
DTYPES = (torch.bfloat16, torch.float16)
FALLBACKS: Counter[str] = Counter()  # why cutlass_linear ran F.linear, per reason
_COMPILED: dict[tuple[Any, ...], Any] = {}


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether the opt-in is set (``RESIN_CUTLASS_GEMM`` = 1 / true / on / yes)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "on", "yes")


def cutlass_unavailable() -> str | None:
    """Why the kernel cannot run in this process (no CUDA, no package, an old GPU), or None."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    elif torch.cuda.get_device_capability() < (8, 0):
        missing.append("an sm_80+ GPU (mma.sync bf16)")
    if importlib.util.find_spec("cutlass") is None:
        missing.append("the 'nvidia-cutlass-dsl' package (pip install nvidia-cutlass-dsl)")
    if missing:
        return "the CUTLASS GEMM needs " + " and ".join(missing)
    return None


def gemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` in torch: what :func:`cutlass_gemm` computes (fp32 accumulation)."""
    return torch.matmul(a, b.t())


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`cutlass_linear` runs ``F.linear`` for these operands, or None."""
    if not (x.is_cuda and weight.is_cuda):
        return "not on CUDA"
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"dtype {x.dtype} / {weight.dtype} (kernel: one of bfloat16, float16)"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return "shapes"
    n, k = weight.shape
    if n % TILE_N or k % TILE_K:
        return f"N={n} / K={k} not multiples of {TILE_N} / {TILE_K}"
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        return "weight not contiguous and 16-byte aligned"
    return None


def tile_m_for(num_rows: int) -> int:
    return SMALL_M if num_rows <= SMALL_M else 2 * SMALL_M


def compile_gemm(dtype: torch.dtype, n: int, k: int, tile_m: int) -> Any:
    """The compiled kernel for ``[M, K] @ [N, K]^T`` (M any multiple of ``tile_m``), compiled
    once per process. Compiling needs the package, not a GPU (``CUTE_DSL_ARCH`` names the
    target when there is none: the CPU test compiles for ``sm_90a``)."""
    key = (dtype, n, k, tile_m)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    cutlass = importlib.import_module("cutlass")
    cute = importlib.import_module("cutlass.cute")
    runtime = importlib.import_module("cutlass.cute.runtime")
    from resin.kernels.cute_tiled_gemm import TiledGemmTN

    element = cutlass.BFloat16 if dtype == torch.bfloat16 else cutlass.Float16
    rows = cute.sym_int64(divisibility=tile_m, symbol="M")

    def fake(shape: tuple[Any, ...]) -> Any:  # row-major, 16-byte aligned, in global memory
        return runtime.make_fake_compact_tensor(
            element, shape, stride_order=(1, 0), assumed_align=16
        )

    compiled = cute.compile(
        TiledGemmTN(tile_m, TILE_N, TILE_K),
        fake((rows, k)),
        fake((n, k)),
        fake((rows, n)),
        runtime.make_fake_stream(),
    )
    _COMPILED[key] = compiled
    return compiled


def cutlass_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` for ``a`` [M, K], ``b`` [N, K] (checked by :func:`unsupported_reason`) on the
    current CUDA stream; ``a`` is padded to the tile's rows when M is not a multiple of it."""
    num_rows, k = a.shape
    n = b.shape[0]
    tile_m = tile_m_for(num_rows)
    padded = -(-num_rows // tile_m) * tile_m
    if padded != num_rows or not a.is_contiguous() or a.data_ptr() % 16:
        staged = a.new_zeros((padded, k))
        staged[:num_rows] = a
        a = staged
    out = a.new_empty((padded, n))
    compiled = compile_gemm(a.dtype, n, k, tile_m)
    runtime = importlib.import_module("cutlass.cute.runtime")
    driver = importlib.import_module("cuda.bindings.driver")

    def cute_tensor(t: torch.Tensor, dynamic_rows: bool) -> Any:
        tensor = runtime.from_dlpack(t, assumed_align=16)
        if dynamic_rows:  # the compiled M: dynamic, a multiple of the tile
            tensor = tensor.mark_compact_shape_dynamic(
                mode=0, stride_order=(0, 1), divisibility=tile_m
            )
        return tensor

    stream = driver.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    compiled(cute_tensor(a, True), cute_tensor(b, False), cute_tensor(out, True), stream)
    return out[:num_rows]


def cutlass_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` through the CUTLASS kernel where it applies (module doc)."""
    reason = unsupported_reason(x, weight)
    if reason is not None:
        FALLBACKS[reason] += 1
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = cutlass_gemm(flat, weight).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
