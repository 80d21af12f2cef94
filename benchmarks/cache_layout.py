"""Page size across cache groups: equal-byte pages vs equal token spans (issue 10).

Compares ways to lay hybrid caches out in pages, on two real layouts:

- ``resin`` (what the engine does, read from a real ``resin.Engine``: a toy runner declares the
  layout's specs; the engine allocates no buffers, so the real byte sizes are used unscaled):
  token and recurrent groups share equal-byte pages, ``page_bytes`` = the largest ``page_size
  * bytes_per_token`` over the token groups, a recurrent state spans ``pages_per_state =
  ceil(state_bytes / page_bytes)`` pages, the last one padded; a compressed group (DeepSeek-V4
  CSA / HCA) has pages of its own size spanning ``lcm(P, ratio)`` raw tokens
  (``CacheGroup.entries_per_page`` entries, ``CacheGroup.page_bytes`` bytes).
- ``equal-byte`` (the engine's first rule, before the measurement below chose ``resin``): as
  ``resin``, but a compressed page holds ``page_size`` entries (``page_size * ratio`` raw
  tokens) and ``page_bytes`` also counts ``page_size * bytes_per_entry``. Token and recurrent
  groups read from the engine, compressed ones worked out by that rule.
- ``equal-byte-pad``: equal-byte pages, but a compressed page covers the token span of the
  others (``max(P, ratio)`` tokens, ``span / ratio`` entries) and the rest of it is padding.
- ``vllm-single`` (vLLM's ``_align_hybrid_block_size``): like equal-byte, but the page size in
  tokens is raised (to a multiple of 16) until one recurrent state fits one page. Also read
  from a real engine configured with that page size.
- ``equal-span`` (hybrid-models.md section 6): every token group's page covers the same raw
  token span P (a compressed page holds ``P / ratio`` entries; at least one entry, so its span
  is ``max(P, ratio)``) and its own number of bytes; a recurrent state is one slot of exactly
  ``state_bytes``. Analytical: the engine has one pool of equal pages.

Per (layout, policy, page size): bytes per page per group (per layer), pages per state and
padding, the minimum prefix-hit granularity (tokens a cached unit covers in every group: the
lcm of the groups' spans; recurrent checkpoints sit at page boundaries), the pool bytes and
internal fragmentation (1 - live bytes / allocated bytes) of two seeded workloads after
prefill, the number of distinct page sizes (= pools an allocator must manage), and what the
torch runners reserve for one 4,096-token request: a page id is one page in each of the G
layer slots token and recurrent groups share (same-spec layers split into groups of G) plus
one page in each compressed layer's own buffer, so (page ids held) x (bytes per page id).

    .venv/bin/python benchmarks/cache_layout.py      # prints tables, writes results/cache_layout.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import resin
from resin import Engine, EngineConfig, ForwardOutput, LayerCacheSpec

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "cache_layout.json"
PAGE_SIZES = (16, 64, 256)
SEED = 0
NUM_REQUESTS = 1000
VLLM_ALIGN = 16  # vLLM rounds the grown attention block to a multiple of 16 tokens


@dataclass(frozen=True)
class Group:
    """One cache group: ``layers`` layers of one kind (bytes are per layer)."""

    name: str
    kind: str  # full | sliding_window | recurrent | compressed
    layers: int
    bytes_per_token: int = 0  # full / sliding_window
    window: int = 0  # sliding_window
    state_bytes: int = 0  # recurrent
    ratio: int = 0  # compressed: raw tokens per entry
    entry_bytes: int = 0  # compressed


# Qwen3-Next-80B-A3B (HF Qwen3NextConfig defaults): 48 layers, full attention every 4th.
# Gated delta net: conv_dim = 2 * 16*128 + 32*128 = 8192, conv state (conv_dim, K-1 = 3) and
# recurrent state [32, 128, 128], both fp32 (as models/qwen3_next keeps them).
# Full attention: 2 KV heads x 256 head_dim, K and V, bf16.
QWEN3_NEXT = [
    Group("full", "full", 12, bytes_per_token=2 * 2 * 256 * 2),
    Group("gdn", "recurrent", 36, state_bytes=(8192 * 3 + 32 * 128 * 128) * 4),
]
# DeepSeek-V4-Flash (hybrid-models.md section 1), bf16, 43 layers: SWA K=V 512 wide, window
# 128, every layer; CSA (21 layers) compressed 512 per 4 tokens + indexer keys 128 per 4
# tokens; HCA (20 layers) 512 per 128 tokens. Compressor state / pending buffers not counted.
DSV4_FLASH = [
    Group("swa", "sliding_window", 43, bytes_per_token=512 * 2, window=128),
    Group("csa", "compressed", 21, ratio=4, entry_bytes=512 * 2),
    Group("csa_indexer", "compressed", 21, ratio=4, entry_bytes=128 * 2),
    Group("hca", "compressed", 20, ratio=128, entry_bytes=512 * 2),
]
LAYOUTS = {"qwen3_next_80b_a3b": QWEN3_NEXT, "deepseek_v4_flash": DSV4_FLASH}


class SpecRunner:
    """Declares a spec list; returns one token per row and reads nothing."""

    def __init__(self, specs: list[LayerCacheSpec]) -> None:
        self.specs = specs

    def cache_spec(self) -> list[LayerCacheSpec]:
        return self.specs

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        n = plan.num_sequences
        return ForwardOutput(np.zeros(n, np.uint32), np.arange(n + 1, dtype=np.uint32))


def engine_specs(groups: list[Group]) -> list[LayerCacheSpec]:
    """The layout's per-layer engine specs."""
    specs = []
    for g in groups:
        if g.kind == "full":
            specs += [LayerCacheSpec.full(g.bytes_per_token)] * g.layers
        elif g.kind == "sliding_window":
            specs += [LayerCacheSpec.sliding_window(g.window, g.bytes_per_token)] * g.layers
        elif g.kind == "recurrent":
            specs += [LayerCacheSpec.recurrent(g.state_bytes)] * g.layers
        elif g.kind == "compressed":
            specs += [LayerCacheSpec.compressed(g.ratio, g.entry_bytes)] * g.layers
    return specs


def engine_layout(groups: list[Group], page_size: int) -> dict[str, Any]:
    """Build a real Engine for the layout; read page_bytes and pages_per_state back."""
    specs = engine_specs(groups)
    config = EngineConfig(page_size=page_size, num_pages=1 << 16, max_model_len=8192)
    layout = Engine(config, SpecRunner(specs)).layout
    per_state = {
        g.spec.state_bytes: g.pages_per_state for g in layout.groups if g.spec.kind == "recurrent"
    }
    compressed = {
        (g.spec.ratio, g.spec.bytes_per_entry): {
            "entries_per_page": g.entries_per_page,
            "page_bytes": g.page_bytes,
        }
        for g in layout.groups
        if g.spec.kind == "compressed"
    }
    return {"page_bytes": layout.page_bytes, "pages_per_state": per_state, "compressed": compressed}


def lcm_all(values: list[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def plan_policy(groups: list[Group], policy: str, page_size: int) -> dict[str, Any]:
    """Per group: span (tokens per page), bytes per page (per layer), pages per state."""
    token_bpt = [g.bytes_per_token for g in groups if g.kind in ("full", "sliding_window")]
    rec = [g for g in groups if g.kind == "recurrent"]
    source = "analytical"
    if policy == "vllm-single" and rec and token_bpt:
        need = max(g.state_bytes for g in rec) / max(token_bpt)
        page_size = max(page_size, VLLM_ALIGN * math.ceil(need / VLLM_ALIGN))
    if policy in ("resin", "equal-byte", "equal-byte-pad", "vllm-single"):
        measured = engine_layout(groups, page_size)
        page_bytes = measured["page_bytes"]
        source = "engine"
        analytical = any(g.kind == "compressed" for g in groups) and policy != "resin"
        if analytical:  # the first rule: page_size entries per compressed page, equal bytes
            page_bytes = max(
                [page_bytes] + [page_size * g.entry_bytes for g in groups if g.kind == "compressed"]
            )
            source = "engine + analytical (compressed)"
        if policy == "equal-byte-pad":
            source = "engine page_bytes + analytical (padded compressed pages)"
    out = []
    for g in groups:
        row: dict[str, Any] = {"group": g.name, "kind": g.kind, "layers": g.layers}
        if g.kind in ("full", "sliding_window"):
            span = page_size
            bytes_ = page_size * g.bytes_per_token
            if policy != "equal-span":
                assert bytes_ <= page_bytes
                bytes_ = page_bytes
            row.update(span=span, page_bytes=bytes_, pages_per_state=0)
        elif g.kind == "recurrent":
            if policy == "equal-span":
                row.update(span=page_size, page_bytes=g.state_bytes, pages_per_state=1)
            else:
                pps = measured["pages_per_state"][g.state_bytes]
                assert pps == max(1, math.ceil(g.state_bytes / page_bytes))
                row.update(span=page_size, page_bytes=page_bytes, pages_per_state=pps)
            row["state_padding_bytes"] = row["pages_per_state"] * row["page_bytes"] - g.state_bytes
        else:  # compressed
            if policy == "equal-span":
                span = max(page_size, g.ratio)
                row.update(span=span, page_bytes=span // g.ratio * g.entry_bytes)
            elif policy == "resin":
                compressed = measured["compressed"][(g.ratio, g.entry_bytes)]
                assert compressed["entries_per_page"] * g.ratio == lcm_all([page_size, g.ratio])
                row.update(
                    span=compressed["entries_per_page"] * g.ratio,
                    page_bytes=compressed["page_bytes"],
                    entries_per_page=compressed["entries_per_page"],
                )
            elif policy == "equal-byte-pad":
                span = max(page_size, g.ratio)
                row.update(span=span, page_bytes=page_bytes)
                row["entries_per_page"] = span // g.ratio
            else:  # the first rule
                row.update(span=page_size * g.ratio, page_bytes=page_bytes)
                row["entries_per_page"] = page_size
            row.setdefault("entries_per_page", row["page_bytes"] // g.entry_bytes)
            row["pages_per_state"] = 0
        out.append(row)
    return {
        "policy": policy,
        "page_size": page_size,
        "source": source,
        "groups": out,
        "min_hit_tokens": lcm_all([r["span"] for r in out]),
        "num_page_sizes": len({r["page_bytes"] for r in out}),
    }


def request_bytes(groups: list[Group], plan: dict[str, Any], length: int) -> tuple[int, int]:
    """(allocated, live) pool bytes of one request after prefilling ``length`` tokens."""
    allocated = live = 0
    for g, row in zip(groups, plan["groups"], strict=True):
        span, pb = row["span"], row["page_bytes"]
        if g.kind == "full":
            pages = -(-length // span)
            used = length * g.bytes_per_token
        elif g.kind == "sliding_window":
            # The engine keeps pages from the one holding position length - W + 1 on.
            first = max(0, length - g.window + 1) // span
            pages = -(-length // span) - first
            used = min(length, g.window - 1) * g.bytes_per_token
        elif g.kind == "recurrent":
            pages = row["pages_per_state"]
            used = g.state_bytes
        else:
            entries = length // g.ratio
            pages = -(-entries // row["entries_per_page"])
            used = entries * g.entry_bytes
        allocated += pages * pb * g.layers
        live += used * g.layers
    return allocated, live


def layer_slots(groups: list[Group]) -> int:
    """The engine's group size G: same-spec token / recurrent buckets split into groups of G
    layers (the smallest bucket, or the largest when all are within 1.5x of it)."""
    sizes = [g.layers for g in groups if g.kind != "compressed"]
    return max(sizes) if 2 * max(sizes) < 3 * min(sizes) else min(sizes)


def runner_bytes(groups: list[Group], plan: dict[str, Any], length: int) -> int:
    """Bytes the torch runners reserve for one request of ``length`` tokens: a page id is one
    page of the token page size in each of G shared layer slots (token and recurrent groups
    share them) plus one page in each compressed layer's own buffer, so a request reserves
    (page ids it holds, every G-layer group's) x (bytes per page id)."""
    size = layer_slots(groups)
    page_ids = 0
    for g, row in zip(groups, plan["groups"], strict=True):
        span = row["span"]
        copies = 1 if g.kind == "compressed" else -(-g.layers // size)
        if g.kind == "full":
            pages = -(-length // span)
        elif g.kind == "sliding_window":
            pages = -(-length // span) - max(0, length - g.window + 1) // span
        elif g.kind == "recurrent":
            pages = row["pages_per_state"]
        else:
            pages = -(-(length // g.ratio) // row["entries_per_page"])
        page_ids += copies * pages
    shared = max(
        row["page_bytes"]
        for g, row in zip(groups, plan["groups"], strict=True)
        if g.kind != "compressed"
    )
    own = sum(
        row["page_bytes"] * g.layers
        for g, row in zip(groups, plan["groups"], strict=True)
        if g.kind == "compressed"
    )
    return page_ids * (size * shared + own)


def workloads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    lognormal = rng.lognormal(mean=math.log(2048), sigma=0.8, size=NUM_REQUESTS)
    return {
        "lognormal_2k": np.clip(lognormal.astype(np.int64), 16, 32768),
        "fixed_4096": np.full(NUM_REQUESTS, 4096, dtype=np.int64),
    }


def evaluate() -> list[dict[str, Any]]:
    loads = workloads()
    rows = []
    for layout_name, groups in LAYOUTS.items():
        for policy in ("resin", "equal-byte", "equal-byte-pad", "vllm-single", "equal-span"):
            for page_size in PAGE_SIZES:
                plan = plan_policy(groups, policy, page_size)
                if policy in ("equal-byte", "equal-byte-pad") and not any(
                    g.kind == "compressed" for g in groups
                ):
                    continue  # no compressed group: the same as resin
                if policy == "vllm-single":
                    if not any(g.kind == "recurrent" for g in groups):
                        continue  # no state to fit: the same as equal-byte
                    if plan["page_size"] != page_size and page_size != PAGE_SIZES[0]:
                        continue  # the forced size is the same for every requested one
                plan["layout"] = layout_name
                plan["fragmentation"] = {}
                for load_name, lengths in loads.items():
                    alloc = live = 0
                    for length in lengths.tolist():
                        a, u = request_bytes(groups, plan, length)
                        alloc, live = alloc + a, live + u
                    plan["fragmentation"][load_name] = {
                        "allocated_bytes": alloc,
                        "live_bytes": live,
                        "allocated_mib_per_request": alloc / len(lengths) / 2**20,
                        "internal_fragmentation": 1 - live / alloc,
                    }
                # The runners' shared-slot layout: only for the engine's page geometries.
                plan["runner_mib_4096"] = (
                    runner_bytes(groups, plan, 4096) / 2**20
                    if policy in ("resin", "equal-byte")
                    else None
                )
                rows.append(plan)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = []
    for layout_name in LAYOUTS:
        out.append(f"**{layout_name}**\n")
        names = [g.name for g in LAYOUTS[layout_name]]
        out.append(
            "| policy | P | bytes/page per group ("
            + ", ".join(names)
            + ") | tokens/page per group "
            "| pages/state (padding) | min hit tokens | page sizes | MiB/req lognormal "
            "| frag lognormal | MiB/req 4096 | frag 4096 | runner MiB/req 4096 "
            "| source |"
        )
        out.append("|---" * 13 + "|")
        for r in rows:
            if r["layout"] != layout_name:
                continue
            rec = [g for g in r["groups"] if g["kind"] == "recurrent"]
            state = (
                ", ".join(f"{g['pages_per_state']} ({g['state_padding_bytes']:,} B)" for g in rec)
                if rec
                else "-"
            )
            f_ln, f_4k = r["fragmentation"]["lognormal_2k"], r["fragmentation"]["fixed_4096"]
            page_bytes = ", ".join(f"{g['page_bytes']:,}" for g in r["groups"])
            spans = ", ".join(str(g["span"]) for g in r["groups"])
            runner = "-" if r["runner_mib_4096"] is None else f"{r['runner_mib_4096']:,.1f}"
            out.append(
                f"| {r['policy']} | {r['page_size']} | {page_bytes} | {spans} | {state} "
                f"| {r['min_hit_tokens']:,} | {r['num_page_sizes']} "
                f"| {f_ln['allocated_mib_per_request']:,.1f} | {f_ln['internal_fragmentation']:.1%} "
                f"| {f_4k['allocated_mib_per_request']:,.1f} | {f_4k['internal_fragmentation']:.1%} "
                f"| {runner} | {r['source']} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON path")
    args = parser.parse_args(argv)
    rows = evaluate()
    lengths = workloads()["lognormal_2k"]
    result = {
        "benchmark": "cache_layout",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resin": resin.__version__,
        "workloads": {
            "lognormal_2k": {
                "num_requests": NUM_REQUESTS,
                "seed": SEED,
                "median": float(np.median(lengths)),
                "mean": float(lengths.mean()),
                "p99": float(np.percentile(lengths, 99)),
            },
            "fixed_4096": {"num_requests": NUM_REQUESTS},
        },
        "layouts": {k: [g.__dict__ for g in v] for k, v in LAYOUTS.items()},
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"cache layout: {NUM_REQUESTS} requests per workload (lognormal median "
        f"{np.median(lengths):.0f}, mean {lengths.mean():.0f} tokens; seed {SEED}); bytes per "
        "page are per layer; MiB/req = pool bytes a request holds after prefill, all layers\n"
    )
    print(markdown(rows))
    print(f"JSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
