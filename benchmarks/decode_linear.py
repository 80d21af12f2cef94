"""The decode projections: torch's CPU GEMM against the Rust linear (`_core.linear`), cold weights.

One "step" is the benchmark Llama's 57 projections (8 layers of q/k/v/o and gate/up/down, then
the 32,000 x 512 LM head; ~160 MB in float32, ~80 MB in bfloat16, more than the L3), each
applied to `rows` input rows, so every weight comes from memory as it does in a decode step
(timing one weight in a loop would time the cache). Per dtype and row count: the best of
`--repeats` steps for `F.linear` and for `resin.kernels.cpu_linear.cpu_linear` (the kernel
forced on, whatever `MAX_ROWS` says), the weight bytes over the time, and torch / Rust. In
bfloat16 where oneDNN has packed weights (`cpu_linear.packing`), also `cpu_linear` with the
kernel off (every projection oneDNN's GEMM on the weight packed once: the rows past
`MAX_ROWS`). Also the machine's streaming rate over the same weights (`w.sum()` each), the
bound for all.

Checked before timing: every projection agrees with `F.linear` to float32 rounding.

    .venv/bin/python benchmarks/decode_linear.py --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LAYER_SHAPES = (
    (512, 512),
    (256, 512),
    (256, 512),
    (512, 512),
    (1376, 512),
    (1376, 512),
    (512, 1376),
)
LAYERS, VOCAB, HIDDEN = 8, 32_000, 512


def best_seconds(fn: Any, repeats: int) -> float:
    fn()  # first-touch and first-call costs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", default=str(REPO / "benchmarks" / "results" / "decode_linear.json")
    )
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from resin.kernels import cpu_linear

    torch.set_num_threads(args.threads)
    cpu_linear.MAX_ROWS.update({torch.float32: 1 << 30, torch.bfloat16: 1 << 30})
    rows_out: list[dict[str, Any]] = []
    print(
        "| dtype | rows | torch ms | torch GB/s | rust ms | rust GB/s | torch / rust | packed ms | "
        "torch / packed | stream GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        g = torch.Generator().manual_seed(0)
        shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [(VOCAB, HIDDEN)]
        weights = [(torch.randn(*s, generator=g) / s[1] ** 0.5).to(dtype) for s in shapes]
        total_bytes = sum(w.numel() * w.element_size() for w in weights)
        stream = best_seconds(lambda ws=weights: [w.sum() for w in ws], args.repeats)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {s[1] for s in shapes}}
            with torch.inference_mode():
                for w in weights[: len(LAYER_SHAPES)]:
                    x = xs[w.shape[1]]
                    assert cpu_linear.takes(x, w)
                    torch.testing.assert_close(
                        cpu_linear.cpu_linear(x, w).float(),
                        F.linear(x, w).float(),
                        rtol=1e-5 if dtype is torch.float32 else 1e-2,
                        atol=1e-4 if dtype is torch.float32 else 1e-2,
                    )

                def step(linear: Any, ws: list[Any] = weights, xs: dict[int, Any] = xs) -> None:
                    for w in ws:
                        linear(xs[w.shape[1]], w)

                torch_s = best_seconds(lambda: step(F.linear), args.repeats)
                rust_s = best_seconds(lambda: step(cpu_linear.cpu_linear), args.repeats)
                packed_s = None
                if dtype is torch.bfloat16 and cpu_linear.packing:
                    cpu_linear.MAX_ROWS[dtype] = 0  # the kernel off: every call packed
                    step(cpu_linear.cpu_linear)  # seen once; packed at the next call
                    packed_s = best_seconds(lambda: step(cpu_linear.cpu_linear), args.repeats)
                    cpu_linear.MAX_ROWS[dtype] = 1 << 30
            row = {
                "dtype": name,
                "rows": rows,
                "torch_ms": torch_s * 1e3,
                "rust_ms": rust_s * 1e3,
                "torch_gb_s": total_bytes / torch_s / 1e9,
                "rust_gb_s": total_bytes / rust_s / 1e9,
                "packed_ms": None if packed_s is None else packed_s * 1e3,
                "stream_gb_s": total_bytes / stream / 1e9,
            }
            rows_out.append(row)
            packed = "-" if packed_s is None else f"{packed_s * 1e3:.2f}"
            packed_ratio = "-" if packed_s is None else f"{torch_s / packed_s:.2f}x"
            print(
                f"| {name} | {rows} | {row['torch_ms']:.2f} | {row['torch_gb_s']:.1f} | "
                f"{row['rust_ms']:.2f} | {row['rust_gb_s']:.1f} | {torch_s / rust_s:.2f}x | "
                f"{packed} | {packed_ratio} | {row['stream_gb_s']:.1f} |"
            )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"rows": rows_out, "threads": args.threads}, indent=2))
    print(f"\nJSON: {args.output}")


if __name__ == "__main__":
    main()
