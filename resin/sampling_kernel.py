"""The torch sampler's draw in one Rust call: ``_core.sample_rows`` (temperature, top-k, top-p,
min-p and the inverse-CDF draw of every row, read in place), and whether it may run here.

Owns :data:`rows_kernel` (the switch), :func:`softmax_lanes` (the probe) and
:func:`kernel_tokens`. The kernel (rust/kernels/src/sampling.rs) restates
:func:`~resin.sampling_draw.draw_tokens` operation for operation; the floats it cannot take
from torch it computes as torch does: the softmax (SLEEF's ``expf`` and ATen's order of
additions, rust/kernels/src/softmax.rs) and the cumulative sums (rust/kernels/src/draw.rs).
Those bits hold for a torch whose CPU vectors are 8 (AVX2) or 16 (AVX-512) floats wide and
whose softmax calls SLEEF, so the first call checks them: :func:`softmax_lanes` compares
``_core.softmax`` with ``torch.softmax`` on a fixed probe (rows of 8 to 40,001 tokens, spreads
up to hundreds of logits, ``-inf`` entries) for 8 and then 16 lanes, and keeps the width that
agrees bit for bit; if neither does (another capability, another torch), it warns once and the
sampler keeps the torch path. Cost: ``benchmarks/sampler_step.py`` (docs/benchmarks.md).

A whole-row draw (temperature alone, or a kept set past the candidates) is first tried from
cheap exponentials and a rigorous error bound (:data:`bounded_draw`): the bound decides torch's
token for certain, or the exact draw runs; LLM-like rows nearly always decide. A top-p cut
over the whole row's softmax is decided the same way, from bounds of the softmax's sum
(rust/kernels/src/cheap_exp.rs), the exact sum only where they disagree.

A sample the kernel does not take comes back -1 and is drawn by the torch path: a temperature
that is not a positive finite number, a NaN top-p or min-p, a top-k past the 256 candidates, a
row holding NaN or ``+inf`` or nothing but ``-inf``, scaled logits that overflow, a kept set
that is empty (a min-p above 1). ``-inf`` entries (bans, masks) are fine.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

import warnings
from functools import cache

import numpy as np
import torch

from resin import _core
from resin.kernels.cpu_threads import kernel_threads

rows_kernel = True
"""Whether the Sampler draws float32 CPU rows through ``_core.sample_rows`` (when
:func:`softmax_lanes` found the bits). False takes the torch path everywhere (A/B runs, tests)."""

bounded_draw = True
"""Whether ``_core.sample_rows`` first tries a whole-row draw, and a top-p cut over the whole
row, from cheap exponentials and an error bound (rust/kernels/src/bounded_draw.rs,
cheap_exp.rs: torch's token when it decides, the exact path when it cannot). False: the exact
path for every row (A/B runs, tests; same tokens)."""


def _probe() -> list[np.ndarray]:
    """Fixed rows: widths around the vector widths and a vocabulary's, mixed spreads, ``-inf``."""
    rng = np.random.default_rng(20261203)
    rows = []
    for width in (8, 9, 15, 16, 17, 31, 100, 256, 257, 1000, 4099, 32000, 40001):
        for spread in (0.5, 3.0, 40.0):
            row = rng.normal(0.0, spread, width).astype(np.float32)
            row[:: max(2, width // 5)] = -np.inf
            row[width // 2] = 0.0
            rows.append(row)
    return rows


@cache
def softmax_lanes() -> int | None:
    """torch's float vector width here (8 or 16) if ``_core.softmax`` gives torch's softmax bit
    for bit with it on the probe, else None (after one warning)."""
    probe = _probe()
    try:
        for lanes in (8, 16):
            agrees = True
            for row in probe:
                x = np.ascontiguousarray(row[None, :], dtype=np.float32)
                want = torch.from_numpy(x).softmax(dim=-1).numpy()
                got = np.empty_like(x)
                _core.softmax(x, lanes, got)
                if not np.array_equal(want.view(np.int32), got.view(np.int32)):
                    agrees = False
                    break
            if agrees:
                return lanes
        why = f"torch's CPU softmax here (capability {torch.backends.cpu.get_cpu_capability()})"
        why += " is not the one the sampling kernel restates"
    except (AttributeError, ValueError, TypeError) as error:  # a build without the kernel
        why = f"the sampling kernel did not run ({error})"
    warnings.warn(
        f"resin: {why}; the sampler keeps the torch path (same tokens, slower)",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def takes(logits: torch.Tensor) -> bool:
    """Whether :func:`kernel_tokens` may draw from ``logits`` (float32 CPU rows, the kernel on,
    the probe passed)."""
    return (
        rows_kernel
        and logits.dtype is torch.float32
        and logits.is_cpu
        and logits.dim() == 2
        and 0 < logits.shape[1] < 1 << 32
        and softmax_lanes() is not None
    )


def kernel_tokens(
    logits: torch.Tensor,
    rows: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    uniforms: np.ndarray,
) -> np.ndarray:
    """int64 [n]: the token :func:`~resin.sampling_draw.draw_tokens` gives sample i drawn from
    row ``rows[i]`` of ``logits`` [R, V] (read in place) with its settings and uniform (each
    [n]), or -1 where the kernel leaves the sample to the torch path. Call only where
    :func:`takes`."""
    lanes = softmax_lanes()
    assert lanes is not None
    n = len(rows)
    min_p = np.ascontiguousarray(min_p, dtype=np.float32)
    # torch's log (the torch path's threshold adds it to the row's largest logit).
    log_min_p = torch.log(torch.from_numpy(min_p).clamp(min=0)).numpy()
    tokens = np.empty(n, dtype=np.int64)
    _core.sample_rows(
        logits.contiguous().numpy(),
        np.ascontiguousarray(rows, dtype=np.int64),
        np.ascontiguousarray(temperature, dtype=np.float32),
        np.ascontiguousarray(top_k, dtype=np.int64),
        np.ascontiguousarray(top_p, dtype=np.float32),
        min_p,
        log_min_p,
        np.ascontiguousarray(uniforms, dtype=np.float32),
        lanes,
        tokens,
        threads=kernel_threads(),
        bounded=bounded_draw,
    )
    return tokens
