"""Hand-written kernels behind torch-shaped functions: a CUTLASS GEMM for CUDA (opt-in) and
the CPU projections (the Rust decode kernel, oneDNN's packed bfloat16 GEMM).

Owns :data:`linear` — the function the shared blocks' projections call (the attention
projections and the SwiGLU MLP of :mod:`resin.runners.torch.blocks` and
:func:`resin.runners.torch.layers.swiglu_mlp`, the MoE experts, the LM head): with
``RESIN_CUTLASS_GEMM=1`` in the environment when this package is first imported,
:func:`.cutlass_gemm.cutlass_linear` (a CUTLASS DSL tensor-core GEMM, falling back to
``F.linear`` for what it does not take); otherwise :func:`.cpu_linear.cpu_linear` (the Rust
kernel for a decode step's few rows on CPU, oneDNN on packed weights for more bfloat16 rows,
``F.linear`` for everything else), or ``F.linear`` itself where both are off
(``RESIN_CPU_LINEAR=0``, or a CPU without AVX2 + FMA and without oneDNN's bfloat16 GEMM).
Opting in to CUTLASS where it cannot run (no CUDA, no ``nvidia-cutlass-dsl``) is a RuntimeError
at import naming what is missing, not a silent fallback. Imports torch; ``cutlass`` only when a
kernel is compiled (docs/architecture.md, "Kernels").
:mod:`.numpy_view` is the tensor-to-array conversion every CPU kernel caller uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from resin.kernels import cpu_linear, cutlass_gemm

Linear = Callable[..., torch.Tensor]


def select_linear(environ: dict[str, str] | None = None) -> Linear:
    """The CUTLASS linear when ``RESIN_CUTLASS_GEMM`` opts in; else the CPU decode linear, or
    ``F.linear`` itself where that is off (module doc)."""
    if not cutlass_gemm.enabled(environ):
        env = os.environ if environ is None else environ
        packing = cpu_linear.packing and env.get(cpu_linear.PACKED_ENV_VAR, "") != "0"
        if env.get(cpu_linear.ENV_VAR, "") == "0" or not (cpu_linear.enabled or packing):
            return F.linear
        return cpu_linear.cpu_linear
    reason = cutlass_gemm.cutlass_unavailable()
    if reason is not None:
        raise RuntimeError(f"{cutlass_gemm.ENV_VAR}=1: {reason}; unset it to use torch's GEMM")
    return cutlass_gemm.cutlass_linear


linear: Linear = select_linear()
