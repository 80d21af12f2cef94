"""Engine overhead of a decode step on a hybrid (full + recurrent) layout vs full attention only.

Same loop, timers, null runner and workload as ``benchmarks/engine_overhead.py`` (whose
helpers it imports and whose defaults it leaves alone): B concurrent requests with distinct
seeded random prompts, ``SamplingParams(max_tokens=output_len, ignore_eos=True)``, page size
16 (``--page-size``), ``max_num_seqs = B``, ``max_num_batched_tokens`` 2048, enough pages that nothing is
preempted. Only the runner's ``cache_spec()`` differs between the layouts, all in one run:

- ``full_only``: 48 full-attention layers (2,048 B/token) -> one cache group;
- ``qwen3_next``: Qwen3-Next-80B-A3B's 12 full-attention layers + 36 gated-delta-net layers
  (recurrent state (8192 x 3 + 32 x 128 x 128) x 4 B = 67 pages of 32 KiB at page size 16)
  -> four groups (same-spec layers split into groups of 12, the smallest bucket: one full,
  three recurrent). With prefix caching on, a decode that reaches a checkpoint boundary
  (``--checkpoint-interval`` tokens, default the engine's; 0 = every page) checkpoints each
  of the request's three states (3 x 67 ``copy_pages`` pairs) and registers them.

Each layout runs with prefix caching on and off. Engine time per step = schedule + forward
(the Python call) + update + drop; the table shows decode steps with all B sequences.

    .venv/bin/python benchmarks/hybrid_step.py            # B = 256, writes results/hybrid_step.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import (  # noqa: E402
    NullRunner,
    fmt,
    machine_info,
    make_prompts,
    read_counter,
    step_stats,
)

from resin import CacheLayout, Engine, EngineConfig, LayerCacheSpec, SamplingParams  # noqa: E402

PAGE_SIZE = 16
VOCAB_SIZE = 32000
FULL_BPT = 2 * 2 * 256 * 2
STATE_BYTES = (8192 * 3 + 32 * 128 * 128) * 4
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "hybrid_step.json"


def layouts() -> dict[str, list[LayerCacheSpec]]:
    qwen = [
        LayerCacheSpec.full(FULL_BPT) if (i + 1) % 4 == 0 else LayerCacheSpec.recurrent(STATE_BYTES)
        for i in range(48)
    ]
    return {"full_only": [LayerCacheSpec.full(FULL_BPT)] * 48, "qwen3_next": qwen}


class SpecNullRunner(NullRunner):
    def __init__(self, specs: list[LayerCacheSpec]) -> None:
        self.specs = specs

    def cache_spec(self) -> list[LayerCacheSpec]:
        return self.specs


def run_once(args: argparse.Namespace, specs: list[LayerCacheSpec], prefix: bool) -> dict[str, Any]:
    b = args.batch_size
    page_size = args.page_size
    max_model_len = args.prompt_len + args.output_len + page_size
    # Every request's pages at full length, its states and a checkpoint in flight per
    # recurrent group (the engine's own bound), plus slack; cached checkpoints are evicted
    # LRU when the pool runs short.
    layout = CacheLayout.from_specs(specs, page_size)
    per_request = layout.pages_per_request(max_model_len, args.max_num_batched_tokens, prefix)
    num_pages = b * per_request + 1 + 64
    config = EngineConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=b,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix,
        vocab_size=VOCAB_SIZE,
        recurrent_checkpoint_interval=args.checkpoint_interval,
    )
    runner = SpecNullRunner(specs)
    engine = Engine(config, runner)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(b, args.prompt_len)):
        engine.add_request(f"req-{i}", prompt.tolist(), params)
    steps = []
    num_copies = 0
    num_finished = 0
    gc.collect()
    clock = time.perf_counter_ns
    while engine.has_unfinished():
        t0 = clock()
        plan = engine.schedule()
        t1 = clock()
        output = runner.forward(plan)
        t2 = clock()
        request_outputs = engine.update(plan, output)
        t3 = clock()
        shape = (plan.num_sequences, plan.num_decode_sequences, plan.num_tokens)
        copies = len(plan.copy_pages)
        num_finished += sum(1 for r in request_outputs if r.finished)
        t4 = clock()
        del plan, output, request_outputs
        t5 = clock()
        if shape[0] == 0:
            continue
        num_copies += copies
        steps.append((t1 - t0, t2 - t1, t3 - t2, t5 - t4, *shape, copies))
    engine.check_integrity()
    if num_finished != b:
        raise RuntimeError(f"expected {b} finished requests, got {num_finished}")
    return {
        "table": np.array(steps, dtype=np.int64).reshape(-1, 8),
        "num_preemptions": read_counter(engine.metrics_text(), "num_preemptions"),
        "num_copy_pages": num_copies,
        "num_groups": len(engine.layout.groups),
    }


def measure(
    args: argparse.Namespace, name: str, specs: list[LayerCacheSpec], prefix: bool
) -> dict[str, Any]:
    runs = [run_once(args, specs, prefix) for _ in range(args.repeats)]
    table = np.concatenate([r["table"] for r in runs])
    full_decode = (table[:, 5] == table[:, 4]) & (table[:, 4] == args.batch_size)
    copies = table[full_decode, 7]
    return {
        "layout": name,
        "prefix_caching": prefix,
        "num_groups": runs[0]["num_groups"],
        "num_runs": len(runs),
        "num_preemptions": sum(r["num_preemptions"] or 0 for r in runs),
        "num_copy_pages": sum(r["num_copy_pages"] for r in runs),
        "decode_full": step_stats(table[full_decode, :7]),
        "decode_full_with_checkpoints": step_stats(table[full_decode & (table[:, 7] > 0), :7]),
        "decode_full_without_checkpoints": step_stats(table[full_decode & (table[:, 7] == 0), :7]),
        "mean_copy_pages_per_decode_step": float(copies.mean()) if len(copies) else 0.0,
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | groups | prefix caching | steps | mean µs | p50 µs | p99 µs | schedule µs "
        "| forward µs | update µs | drop µs | µs/seq | steps with checkpoints (mean µs) "
        "| copy_pages per step |",
        "|---" * 14 + "|",
    ]
    for r in runs:
        s = r["decode_full"]
        if s is None:
            lines.append(f"| {r['layout']} | {r['num_groups']} | - | 0 |" + " n/a |" * 10)
            continue
        c = r["decode_full_with_checkpoints"]
        ckpt = f"{c['num_steps']} ({fmt(c['total_us']['mean'])})" if c else "0"
        lines.append(
            f"| {r['layout']} | {r['num_groups']} | {'on' if r['prefix_caching'] else 'off'} "
            f"| {s['num_steps']} | {fmt(s['total_us']['mean'])} | {fmt(s['total_us']['p50'])} "
            f"| {fmt(s['total_us']['p99'])} | {fmt(s['schedule_us']['mean'])} "
            f"| {fmt(s['forward_us']['mean'])} | {fmt(s['update_us']['mean'])} "
            f"| {fmt(s['drop_us']['mean'])} | {s['us_per_sequence']:.3f} | {ckpt} "
            f"| {r['mean_copy_pages_per_decode_step']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE, help="tokens per page")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=EngineConfig().recurrent_checkpoint_interval,
        help="tokens between recurrent checkpoints (0 = every page; default: the engine's)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON path")
    args = parser.parse_args(argv)
    runs = []
    for prefix in (True, False):
        for name, specs in layouts().items():
            print(f"running {name} prefix_caching={prefix} ...", file=sys.stderr, flush=True)
            runs.append(measure(args, name, specs, prefix))
    result = {
        "benchmark": "hybrid_step",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"hybrid decode step: B {args.batch_size}, prompt {args.prompt_len}, output "
        f"{args.output_len}, page size {args.page_size}, checkpoint interval "
        f"{args.checkpoint_interval or args.page_size} tokens, {args.repeats} run(s) each; decode steps "
        "with all B sequences; µs = schedule + forward + update + drop\n"
    )
    print(markdown(runs))
    print(f"JSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
