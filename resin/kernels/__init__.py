"""Hand-written GPU kernels behind torch-shaped functions, each opt-in and off by default.

Owns :data:`linear` — the function the shared blocks' MLP projections call
(:func:`resin.runners.torch.layers.swiglu_mlp`: the shared SwiGLU block and the MoE experts): ``torch.nn.functional.linear`` itself,
or, with ``RESIN_CUTLASS_GEMM=1`` in the environment when this package is first imported,
:func:`.cutlass_gemm.cutlass_linear` (a CUTLASS DSL tensor-core GEMM, falling back to
``F.linear`` for what it does not take). Opting in where the kernel cannot run (no CUDA, no
``nvidia-cutlass-dsl``) is a RuntimeError at import naming what is missing, not a silent
fallback. Imports torch; ``cutlass`` only when a kernel is compiled (docs/architecture.md,
"Kernels").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from resin.kernels import cutlass_gemm

Linear = Callable[..., torch.Tensor]


def select_linear(environ: dict[str, str] | None = None) -> Linear:
    """``F.linear``, or the CUTLASS one when ``RESIN_CUTLASS_GEMM`` opts in (module doc)."""
    if not cutlass_gemm.enabled(environ):
        return F.linear
    reason = cutlass_gemm.cutlass_unavailable()
    if reason is not None:
        raise RuntimeError(f"{cutlass_gemm.ENV_VAR}=1: {reason}; unset it to use torch's GEMM")
    return cutlass_gemm.cutlass_linear


linear: Linear = select_linear()
