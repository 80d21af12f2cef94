"""Pool bytes one request holds on a model directory's real cache layout (issue 11 / 12).

Builds the layer caches a model directory declares (``blocks.layer_cache``, else Resin's
defaults) for a full-size HF config — the config class's defaults for the model's
architecture unless ``--config`` names a ``config.json`` — drives one request of ``--tokens``
prompt tokens through a real :class:`resin.Engine` (a runner that only declares the specs;
prefill in 2,048-token chunks, prefix caching off) and one decode step, and reads each group's
pages from that decode row (a decode row lists exactly the pages a request keeps: the window
of a sliding group, every entry page of a compressed one). Checked: the pages add up to what
the request owns (``num_free_pages`` before and after). Bytes per group = pages x the group's
layers x its page bytes (``CacheGroup.page_bytes``; a token page is ``page_size`` tokens of the
layer's buffers). Next to it: the formula (raw window + entries at ``tokens // ratio``) and what
a full-attention cache of the same layers would hold (every token's main ``kv`` / K and V).

    .venv/bin/python benchmarks/model_cache_memory.py                      # DeepSeek-V4-Flash
    .venv/bin/python benchmarks/model_cache_memory.py --model resin/models/qwen3_next

Prints a table and writes results/model_cache_memory_<model>.json. Also printed: what the torch
runners reserve for those page ids (``resin.llm.page_id_bytes`` per id).
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
import torch

import resin
from resin import Engine, EngineConfig, ForwardOutput, LayerCacheSpec, SamplingParams
from resin.evals.model_ref import import_model_module
from resin.llm import page_id_bytes
from resin.runners.torch.model_dir import (
    _split_layer_cache,
    declare_layer_cache,
    default_layer_cache,
    head_dim_of,
    num_kv_heads_of,
)
from resin.scaffold.layer_map import layer_types_from_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


class SpecRunner:
    def __init__(self, specs: list[LayerCacheSpec]) -> None:
        self.specs = specs

    def cache_spec(self) -> list[LayerCacheSpec]:
        return self.specs

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        n = plan.num_sequences
        return ForwardOutput(np.zeros(n, np.uint32), np.arange(n + 1, dtype=np.uint32))


def full_size_config(model_dir: Path, config_path: Path | None) -> Any:
    import transformers

    if config_path is not None:
        return transformers.AutoConfig.from_pretrained(config_path.parent)
    record = json.loads((model_dir / "architecture.json").read_text())
    return transformers.AutoConfig.for_model(record["model_types"][0])


def layer_caches(model_dir: Path, config: Any, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per cache (main, then extras) of each layer: its LayerCache and engine spec."""
    blocks = import_model_module(model_dir, "blocks", model_dir.name)
    head_dim = int(blocks.head_dim(config)) if hasattr(blocks, "head_dim") else head_dim_of(config)
    declare = getattr(blocks, "layer_cache", default_layer_cache)
    out = []
    for index, (layer_type, window) in enumerate(layer_types_from_config(config)):
        main, extra = _split_layer_cache(
            declare_layer_cache(
                declare, index, layer_type, window, config, head_dim, num_kv_heads_of(config)
            )
        )
        for name, cache in [("", main), *extra.items()]:
            out.append(
                {
                    "layer": index,
                    "layer_type": layer_type,
                    "cache": name or "main",
                    "kind": cache.kind,
                    "window": cache.window,
                    "ratio": cache.ratio,
                    "buffers": {k: list(v) for k, v in cache.buffers.items()},
                    "spec": cache.spec(dtype),
                    "head_dim": head_dim,
                }
            )
    return out


def measure(
    model_dir: Path, config: Any, tokens: int, page_size: int, dtype: torch.dtype
) -> dict[str, Any]:
    caches = layer_caches(model_dir, config, dtype)
    specs = [c["spec"] for c in caches]
    budget = 2048
    layout = resin.CacheLayout.from_specs(specs, page_size)
    per_request = layout.pages_per_request(tokens + 16, budget, False)
    config_ = EngineConfig(
        page_size=page_size,
        num_pages=1 + 2 * per_request,
        max_num_seqs=1,
        max_num_batched_tokens=budget,
        max_model_len=tokens + 16,
        enable_prefix_caching=False,
    )
    runner = SpecRunner(specs)
    engine = Engine(config_, runner)
    free_at_start = engine.num_free_pages
    engine.add_request(
        "r", list(range(1, tokens + 1)), SamplingParams(max_tokens=4, ignore_eos=True)
    )
    while True:
        plan = engine.schedule()
        decode = plan.num_decode_sequences == 1 and int(plan.num_computed_tokens[0]) == tokens
        engine.update(plan, runner.forward(plan))
        if decode:
            break
    owned = free_at_start - engine.num_free_pages
    engine_layout = engine.layout
    groups = []
    listed_total = 0
    for g, group in enumerate(engine_layout.groups):
        indptr = plan.kv_indptr[g]
        pages = int(indptr[1] - indptr[0])
        listed_total += pages
        members = [caches[i] for i in group.layer_indices]
        first = members[0]
        page_bytes = group.page_bytes if group.pages_per_state == 0 else engine_layout.page_bytes
        spec = group.spec
        if spec.kind == "compressed":
            formula = (tokens // spec.ratio) * (spec.bytes_per_entry or 0)
        elif spec.kind == "sliding_window":
            formula = min(tokens + 1, spec.window) * spec.bytes_per_token  # window incl. new token
        elif spec.kind == "recurrent":
            formula = spec.state_bytes or 0
        else:
            formula = (tokens + 1) * spec.bytes_per_token
        groups.append(
            {
                "group": g,
                "kind": spec.kind,
                "layer_types": sorted({m["layer_type"] for m in members}),
                "cache": first["cache"],
                "layers": len(members),
                "window": spec.window,
                "ratio": spec.ratio,
                "buffers": first["buffers"],
                "pages": pages,
                "page_bytes": page_bytes,
                "bytes": pages * page_bytes * len(members),
                "formula_bytes": formula * len(members),
            }
        )
    # What a full-attention cache of the same layers would hold: each layer's main per-token
    # K / V (the "kv" buffer for a shared K = V layer, "k" + "v" otherwise) for every token.
    item = torch.empty((), dtype=dtype).element_size()
    full = 0
    for c in caches:
        if c["cache"] == "main" and c["kind"] != "recurrent":
            per_token = sum(
                math.prod(c["buffers"][n]) for n in ("kv", "k", "v") if n in c["buffers"]
            )
            full += (tokens + 1) * per_token * item
    return {
        "tokens": tokens,
        "page_size": page_size,
        "owned_pages": owned,
        "listed_pages": listed_total,
        "groups": groups,
        "total_bytes": sum(g["bytes"] for g in groups),
        "formula_bytes": sum(g["formula_bytes"] for g in groups),
        "full_attention_bytes": full,
        # What the torch runners reserve for those page ids (shared layer slots + compressed
        # layers' own pages per id: resin.llm.page_id_bytes).
        "runner_reserved_bytes": owned * page_id_bytes(engine_layout),
    }


def markdown(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        "| group | kind | layer types | cache | layers | window / ratio | pages | page bytes | MiB | formula MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in result["groups"]:
        shape = g["window"] if g["window"] else (f"r={g['ratio']}" if g["ratio"] else "-")
        lines.append(
            f"| {g['group']} | {g['kind']} | {', '.join(g['layer_types'])} | {g['cache']} "
            f"| {g['layers']} | {shape} | {g['pages']} | {g['page_bytes']:,} "
            f"| {g['bytes'] / mib:,.2f} | {g['formula_bytes'] / mib:,.2f} |"
        )
    lines.append(
        f"\nTotal {result['total_bytes'] / mib:,.1f} MiB of pool (formula "
        f"{result['formula_bytes'] / mib:,.1f} MiB); a full-attention cache of the same attention "
        "layers: "
        f"{result['full_attention_bytes'] / mib:,.1f} MiB. Pages owned {result['owned_pages']}, "
        f"listed by the decode row {result['listed_pages']}; the torch runners reserve "
        f"{result['runner_reserved_bytes'] / mib:,.1f} MiB for them (page ids x bytes per id)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=REPO / "resin" / "models" / "deepseek_v4_flash"
    )
    parser.add_argument("--config", type=Path, default=None, help="a full-size config.json")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    config = full_size_config(args.model, args.config)
    result = measure(args.model, config, args.tokens, args.page_size, dtype)
    result.update(
        benchmark="model_cache_memory",
        model=args.model.name,
        dtype=args.dtype,
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    output = args.output or RESULTS / f"model_cache_memory_{args.model.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.model.name}: one request of {args.tokens} tokens after prefill and one decode "
        f"step, page size {args.page_size}, {args.dtype}\n"
    )
    print(markdown(result))
    print(f"JSON: {output}")
    return 0 if result["owned_pages"] == result["listed_pages"] else 1


if __name__ == "__main__":
    sys.exit(main())
