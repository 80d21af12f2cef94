"""The decode attention kernel (`_core.paged_attention`) over a cold cache and a warm one.

A decode step reads each layer's K and V once, and the benchmark Llama's 8 layers of cache at
64 rows are far larger than the L3, so every layer's read comes from memory. Per dtype, row
count and context: one call per layer over 8 layers' caches in turn (cold: what a step pays),
and the same call repeated on one layer's cache (warm: what the kernel's math costs once the
rows are near; only while one layer's K + V fit in the caches: 64 rows of 96 do, of 512 do
not), best of `--repeats`, the K + V bytes over the time, and cold / warm. The
shapes are the benchmark Llama's (8 query / 4 KV heads, head dim 64, pages of 16 entries);
each row's pages are scattered over the pool as a long-running engine leaves them.

    .venv/bin/python benchmarks/decode_attention.py   # prints a table, writes results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 4, 64, 16
LAYERS = 8


def case(rows: int, context: int, dtype: str, threads: int, repeats: int) -> dict[str, Any]:
    import torch

    from resin import _core

    pages_per_row = -(-context // PAGE)
    num_pages = rows * pages_per_row + 1
    gen = torch.Generator().manual_seed(0)

    def cache() -> Any:
        x = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, generator=gen)
        return x.bfloat16().view(torch.int16).numpy() if dtype == "bfloat16" else x.numpy()

    k_caches, v_caches = [cache() for _ in range(LAYERS)], [cache() for _ in range(LAYERS)]
    order = np.random.default_rng(0).permutation(np.arange(1, num_pages)).astype(np.uint32)
    kv_indices = np.ascontiguousarray(order[: rows * pages_per_row])
    kv_indptr = (np.arange(rows + 1) * pages_per_row).astype(np.uint32)
    seq_lens = np.full(rows, context, np.uint32)
    query_indptr = np.arange(rows + 1, dtype=np.uint32)
    positions = np.full(rows, context - 1, np.int64)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).numpy()
    out = np.empty((rows, HEADS, HEAD_DIM), np.float32)

    def call(layer: int) -> None:
        _core.paged_attention(
            q, k_caches[layer], v_caches[layer], out, query_indptr, seq_lens, kv_indptr,
            kv_indices, positions, scale=HEAD_DIM**-0.5, value_dim=HEAD_DIM, threads=threads,
            bf16_rounding=dtype == "bfloat16",
        )  # fmt: skip

    def best(layers: list[int]) -> float:
        for layer in layers:
            call(layer)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                call(layer)
            times.append((time.perf_counter() - start) / len(layers))
        return min(times)

    cold, warm = best(list(range(LAYERS))), best([0] * LAYERS)
    kv_bytes = rows * context * KV_HEADS * HEAD_DIM * 2 * (2 if dtype == "bfloat16" else 4)
    return {
        "dtype": dtype,
        "rows": rows,
        "context": context,
        "threads": threads,
        "cold_ms": cold * 1e3,
        "warm_ms": warm * 1e3,
        "cold_gb_s": kv_bytes / cold / 1e9,
        "warm_gb_s": kv_bytes / warm / 1e9,
        "cold_over_warm": cold / warm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--contexts", default="96,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--output", default=str(REPO / "benchmarks" / "results" / "decode_attention.json")
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    results = [
        case(rows, context, dtype, args.threads, args.repeats)
        for dtype in ("float32", "bfloat16")
        for rows in (int(x) for x in args.rows.split(","))
        for context in (int(x) for x in args.contexts.split(","))
    ]
    print(f"\n{args.threads} threads, best of {args.repeats}, one call per layer\n")
    print("| dtype | rows | context | cold ms | cold GB/s | warm ms | warm GB/s | cold / warm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['dtype']} | {r['rows']} | {r['context']} | {r['cold_ms']:.3f} "
            f"| {r['cold_gb_s']:.1f} | {r['warm_ms']:.3f} | {r['warm_gb_s']:.1f} "
            f"| {r['cold_over_warm']:.2f}x |"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "decode_attention", "results": results}, indent=2))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
