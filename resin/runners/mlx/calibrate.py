"""The device peaks ``resin bench --runner mlx`` holds MLX steps to: what MLX reaches here.

Owns :func:`calibrate_mlx`, the MLX counterpart of :func:`resin.evals.roofline.calibrate` (which
measures with torch): the best of a few large matmuls (FLOP/s in the runner's dtype) and large
copies (bytes/s, read + write), each evaluated with ``mx.eval`` so the lazy graph really runs.
Sizes: 1024^2 and 64 MiB on the CPU, 8192^2 and 1 GiB on Metal.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from resin.evals.roofline import DevicePeaks
from resin.runners.mlx.layers import mlx_dtype
from resin.runners.mlx.runner import mlx_device


def calibrate_mlx(device: str, dtype: str, repeats: int = 5) -> DevicePeaks:
    """Measure MLX's matmul FLOP/s and copy bytes/s on ``device`` (best of ``repeats`` after
    one warm-up)."""
    started = time.perf_counter()
    mx_device = mlx_device(device)
    gpu = mx_device == mx.gpu
    n = 8192 if gpu else 1024
    copy_bytes = (1 << 30) if gpu else (64 << 20)

    def best_time(fn: Callable[[], mx.array]) -> float:
        mx.eval(fn())
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(fn())
            best = min(best, time.perf_counter() - t0)
        return best

    with mx.stream(mx_device):
        a = mx.random.normal((n, n)).astype(mlx_dtype(dtype))
        b = mx.random.normal((n, n)).astype(mlx_dtype(dtype))
        mx.eval(a, b)
        matmul_s = best_time(lambda: a @ b)
        a = b = mx.zeros((0,))  # free the matrices before the copy buffers
        src = mx.ones((copy_bytes // 4,), dtype=mx.float32)
        mx.eval(src)
        # + 0 forces a real read and write of every element (a plain copy may be elided)
        copy_s = best_time(lambda: src + 0)
    return DevicePeaks(
        device=f"mlx:{'gpu' if gpu else 'cpu'}",
        dtype=dtype,
        peak_flops_per_s=2 * n**3 / matmul_s,
        peak_bytes_per_s=2 * copy_bytes / copy_s,
        matmul_n=n,
        copy_bytes=copy_bytes,
        calibration_s=time.perf_counter() - started,
    )
