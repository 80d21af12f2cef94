"""Pool bytes one 4,096-token request holds, per cache-group kind, measured from the engine.

One request of ``--num-tokens`` prompt tokens (``max_tokens=2``, prefix caching off so no
checkpoint pages are involved, prefill chunked at ``max_num_batched_tokens`` 2048) is driven
through ``schedule -> forward -> update`` by a runner that only declares cache specs. Right
after the update that completes its prefill, the pages it owns are read as
``num_free_pages`` at start minus ``num_free_pages`` now. Per group kind, the engine is built
with a base full-attention layer alone and with the base layer plus one layer of that kind;
the difference is the group's pages (the base layer fixes ``page_bytes`` for every variant).
Those counts are checked against the formula:

- full: ``ceil(tokens / page_size)``;
- sliding window: at most ``window / page_size + 1`` (the engine keeps the pages from the one
  holding position ``tokens - window + 1`` on);
- recurrent: ``pages_per_state``, the same at every length (also measured at tokens / 4);
- compressed (ratio r): ``ceil((tokens // r) / E)`` pages of ``E = lcm(page_size, r) / r``
  entries (a page spans ``lcm(page_size, r)`` tokens), each ``E * bytes_per_entry`` bytes (its
  own page size, ``CacheGroup.page_bytes``). Its carry (the open window) lives in a
  sliding-window group of the same layer, measured separately above.

The full group's count is also read from the last prefill plan (``kv_indptr[g]`` of the row)
and the recurrent one from every plan's row. Shapes: Qwen3-Next-80B-A3B's full-attention
layer (2 KV heads x 256, K and V, bf16 = 2,048 B/token) and gated-delta-net state
((8192 x 3 + 32 x 128 x 128) x 4 B = 2,195,456 B); sliding windows of that per-token size.

    .venv/bin/python benchmarks/cache_memory.py     # prints a table, writes results/cache_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import resin
from resin import Engine, EngineConfig, ForwardOutput, LayerCacheSpec, SamplingParams

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "cache_memory.json"
FULL_BPT = 2 * 2 * 256 * 2
STATE_BYTES = (8192 * 3 + 32 * 128 * 128) * 4
WINDOWS = (128, 1000)
RATIOS = (4, 128)  # DeepSeek-V4 CSA, HCA


class SpecRunner:
    def __init__(self, specs: list[LayerCacheSpec]) -> None:
        self.specs = specs
        self.plans: list[dict[str, Any]] = []

    def cache_spec(self) -> list[LayerCacheSpec]:
        return self.specs

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        n = plan.num_sequences
        return ForwardOutput(np.zeros(n, np.uint32), np.arange(n + 1, dtype=np.uint32))


def owned_after_prefill(
    specs: list[LayerCacheSpec], page_size: int, num_tokens: int
) -> dict[str, Any]:
    """Pages the request owns once its prompt is computed, and per-group plan row counts."""
    config = EngineConfig(
        page_size=page_size,
        num_pages=4 * (num_tokens // page_size) + 64 * (STATE_BYTES // (page_size * FULL_BPT) + 2),
        max_num_seqs=1,
        max_num_batched_tokens=2048,
        max_model_len=num_tokens + 16,
        enable_prefix_caching=False,
    )
    runner = SpecRunner(specs)
    engine = Engine(config, runner)
    layout = engine.layout
    free_at_start = engine.num_free_pages
    prompt = (np.arange(num_tokens) % 30000 + 1).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    row_pages: dict[int, int] = {}
    while True:
        plan = engine.schedule()
        seq_len = int(plan.seq_lens[0])
        for g in range(plan.num_cache_groups):
            indptr = plan.kv_indptr[g]
            row_pages[g] = int(indptr[1] - indptr[0])
        engine.update(plan, runner.forward(plan))
        if seq_len >= num_tokens:
            break
    engine.check_integrity()
    return {
        "owned_pages": free_at_start - engine.num_free_pages,
        "page_bytes": layout.page_bytes,
        "groups": [
            {
                "kind": g.spec.kind,
                "layers": len(g.layer_indices),
                "pages_per_state": g.pages_per_state,
                "page_bytes": g.page_bytes if g.pages_per_state == 0 else layout.page_bytes,
                "row_pages_last_plan": row_pages[i],
            }
            for i, g in enumerate(layout.groups)
        ],
    }


def measure(page_size: int, num_tokens: int) -> list[dict[str, Any]]:
    base_spec = LayerCacheSpec.full(FULL_BPT)
    base = owned_after_prefill([base_spec], page_size, num_tokens)
    rows = []
    full_formula = -(-num_tokens // page_size)
    rows.append(
        {
            "kind": "full",
            "measured_pages": base["owned_pages"],
            "plan_row_pages": base["groups"][0]["row_pages_last_plan"],
            "formula_pages": full_formula,
            "formula": f"ceil({num_tokens}/{page_size})",
        }
    )
    variants: list[tuple[str, LayerCacheSpec, int, str]] = []
    for window in WINDOWS:
        bound = window // page_size + 1
        variants.append(
            (
                f"sliding_window({window})",
                LayerCacheSpec.sliding_window(window, FULL_BPT),
                bound,
                f"{window}/{page_size} + 1 (bound)",
            )
        )
    variants.append(("recurrent", LayerCacheSpec.recurrent(STATE_BYTES), -1, "pages_per_state"))
    for ratio in RATIOS:
        entries = num_tokens // ratio
        per_page = math.lcm(page_size, ratio) // ratio
        variants.append(
            (
                f"compressed({ratio})",
                LayerCacheSpec.compressed(ratio, FULL_BPT),
                -(-entries // per_page),
                f"ceil(({num_tokens}//{ratio})/{per_page}) pages of {per_page} entries",
            )
        )
    for name, spec, formula_pages, formula in variants:
        both = owned_after_prefill([base_spec, spec], page_size, num_tokens)
        measured = both["owned_pages"] - base["owned_pages"]
        group = next(g for g in both["groups"] if g["kind"] == spec.kind)
        row: dict[str, Any] = {
            "kind": name,
            "measured_pages": measured,
            "page_bytes": group["page_bytes"],
        }
        if spec.kind == "compressed":
            row["plan_row_pages"] = group["row_pages_last_plan"]
        if spec.kind == "recurrent":
            formula_pages = group["pages_per_state"]
            row["plan_row_pages"] = group["row_pages_last_plan"]
            short = owned_after_prefill([base_spec, spec], page_size, num_tokens // 4)
            short_base = owned_after_prefill([base_spec], page_size, num_tokens // 4)
            row["measured_pages_at_quarter_length"] = (
                short["owned_pages"] - short_base["owned_pages"]
            )
            assert formula_pages == math.ceil(STATE_BYTES / both["page_bytes"])
        row.update(formula_pages=formula_pages, formula=formula)
        rows.append(row)
    for row in rows:
        if "measured_pages" not in row:
            continue
        row.setdefault("page_bytes", base["page_bytes"])
        row["bytes_per_layer"] = row["measured_pages"] * row["page_bytes"]
        row["live_bytes_per_layer"] = live_bytes(row["kind"], num_tokens)
        row["agrees_within_one_page"] = abs(row["measured_pages"] - row["formula_pages"]) <= 1
        row["page_size"] = page_size
    return rows


def live_bytes(kind: str, num_tokens: int) -> int:
    if kind == "full":
        return num_tokens * FULL_BPT
    if kind == "recurrent":
        return STATE_BYTES
    if kind.startswith("compressed"):
        return num_tokens // int(kind.split("(")[1].rstrip(")")) * FULL_BPT
    window = int(kind.split("(")[1].rstrip(")"))
    return min(num_tokens, window - 1) * FULL_BPT


def markdown(rows: list[dict[str, Any]], num_tokens: int) -> str:
    lines = [
        "| page size | group kind | pages measured | pages in plan row | formula | pages by formula "
        "| pool bytes per layer | live bytes per layer | within 1 page |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        plan_row = r.get("plan_row_pages", "-")
        if "measured_pages_at_quarter_length" in r:
            plan_row = (
                f"{plan_row} (at {num_tokens // 4} tokens: {r['measured_pages_at_quarter_length']})"
            )
        lines.append(
            f"| {r['page_size']} | {r['kind']} | {r['measured_pages']} | {plan_row} | {r['formula']} "
            f"| {r['formula_pages']} | {r['bytes_per_layer']:,} | {r['live_bytes_per_layer']:,} "
            f"| {'yes' if r['agrees_within_one_page'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON path")
    args = parser.parse_args(argv)
    rows = []
    for page_size in [int(p) for p in args.page_sizes.split(",") if p]:
        rows += measure(page_size, args.num_tokens)
    result = {
        "benchmark": "cache_memory",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resin": resin.__version__,
        "num_tokens": args.num_tokens,
        "full_bytes_per_token": FULL_BPT,
        "state_bytes": STATE_BYTES,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"cache memory: one request of {args.num_tokens} tokens after prefill; full layer "
        f"{FULL_BPT} B/token (compressed entries of that size), recurrent state "
        f"{STATE_BYTES:,} B; pool bytes per layer = pages x the group's page bytes\n"
    )
    print(markdown(rows, args.num_tokens))
    print(f"JSON: {args.output}")
    return 0 if all(r.get("agrees_within_one_page", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
