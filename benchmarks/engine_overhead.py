"""Engine overhead: what the Rust engine costs per step when the runner costs nothing.

A null runner (one token per row, no model) drives ``resin.Engine`` through the explicit
loop ``schedule() -> runner.forward(plan) -> update(plan, output)``; each call is timed
separately with ``time.perf_counter_ns``, and so is *drop*: freeing the plan (its numpy
views), the output and the ``RequestOutput`` list at the end of the step, a cost that would
otherwise land inside whichever call comes next. Engine time per step = schedule + forward
+ update + drop. A step is a *decode* step when
every row is a decode row (``plan.num_decode_sequences == plan.num_sequences``); any
other step carries at least one prefill chunk and is reported as a *prefill* step.

Two runners per batch size:

- ``null``  returns ``ForwardOutput(zeros(S), arange(S + 1))`` and reads nothing;
- ``touch`` also materialises the plan arrays a real runner reads (``input_ids``,
  ``positions``, ``query_indptr``, ``seq_lens``, group-0 page table and slot mapping,
  ``sample_indptr``, ``sampling.temperature``), which shows the cost of the numpy views.

Workload (issue 2): B concurrent requests with distinct random prompts (seeded; the first
token of each prompt is the request index, so no two requests share a prefix page),
``SamplingParams(max_tokens=output_len, ignore_eos=True)``, page size 16, prefix caching
on, enough pages that nothing is preempted, ``max_num_seqs = B``, and
``max_num_batched_tokens`` 2048 (prefill is chunked).

Prints markdown tables and writes JSON (default ``benchmarks/results/engine_overhead.json``)::

    .venv/bin/python benchmarks/engine_overhead.py                 # 256 and 1024 sequences
    .venv/bin/python benchmarks/engine_overhead.py --quick         # CI smoke size
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import resin
from resin import BatchPlan, Engine, EngineConfig, ForwardOutput, SamplingParams

PAGE_SIZE = 16
VOCAB_SIZE = 32000
SEED = 0
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "engine_overhead.json"
# Full size (issue 2) and --quick size; explicit flags override either.
FULL = {"batch_sizes": "256,1024", "prompt_len": 512, "output_len": 256, "repeats": 3}
QUICK = {"batch_sizes": "16,64", "prompt_len": 64, "output_len": 32, "repeats": 1}


class NullRunner:
    """Returns one token (id 0) per row and reads nothing from the plan."""

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        num_sequences = plan.num_sequences
        return ForwardOutput(
            np.zeros(num_sequences, dtype=np.uint32),
            np.arange(num_sequences + 1, dtype=np.uint32),
        )


class TouchRunner(NullRunner):
    """Like NullRunner, but first materialises every plan array a real runner reads."""

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        arrays = (
            plan.input_ids,
            plan.positions,
            plan.query_indptr,
            plan.seq_lens,
            plan.kv_indptr[0],
            plan.kv_indices[0],
            plan.kv_last_page_len[0],
            plan.slot_mapping[0],
            plan.sample_indptr,
            plan.sampling.temperature,
        )
        # Touch one element of each so a lazily built view is really built.
        for array in arrays:
            if array.size:
                _ = array[-1]
        return super().forward(plan)


RUNNERS = {"null": NullRunner, "touch": TouchRunner}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    parser.add_argument("--prompt-len", type=int, help=f"tokens (default {FULL['prompt_len']})")
    parser.add_argument("--output-len", type=int, help=f"tokens (default {FULL['output_len']})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--runners", default="null,touch", help="comma-separated: null, touch")
    parser.add_argument("--quick", action="store_true", help="CI smoke size: " + json.dumps(QUICK))
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"runs per (batch size, runner), steps pooled (default {FULL['repeats']})",
    )
    parser.add_argument("--disable-gc", action="store_true", help="gc.disable() while timing")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON path")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b]
    args.runners = [r for r in args.runners.split(",") if r]
    for runner in args.runners:
        if runner not in RUNNERS:
            parser.error(f"--runners: unknown runner {runner!r} (choose from {sorted(RUNNERS)})")
    if min(args.batch_sizes, default=0) < 1 or min(args.prompt_len, args.output_len) < 1:
        parser.error("--batch-sizes, --prompt-len and --output-len must be positive")
    if args.repeats < 1 or args.max_num_batched_tokens < 1:
        parser.error("--repeats and --max-num-batched-tokens must be positive")
    return args


def make_config(batch_size: int, prompt_len: int, output_len: int, budget: int) -> EngineConfig:
    max_model_len = prompt_len + output_len + PAGE_SIZE
    pages_per_request = -(-max_model_len // PAGE_SIZE)
    return EngineConfig(
        page_size=PAGE_SIZE,
        # Every request's whole sequence fits at once (+1 for the null page): no preemption.
        num_pages=batch_size * pages_per_request + 1 + 64,
        max_num_seqs=batch_size,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        vocab_size=VOCAB_SIZE,
    )


def make_prompts(batch_size: int, prompt_len: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(0, VOCAB_SIZE, size=(batch_size, prompt_len), dtype=np.int64)
    # Distinct first tokens: no two prompts share even their first page.
    prompts[:, 0] = np.arange(batch_size) % VOCAB_SIZE
    return prompts


def read_counter(metrics_text: str, name_part: str) -> float | None:
    """Sum of the samples of every metric whose name contains ``name_part`` (None if absent)."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match and name_part in match.group(1):
            total += float(match.group(3))
            found = True
    return total if found else None


def run_once(args: argparse.Namespace, batch_size: int, runner_name: str) -> dict[str, Any]:
    """One full run; returns the raw per-step table and what the run checked."""
    config = make_config(batch_size, args.prompt_len, args.output_len, args.max_num_batched_tokens)
    runner = RUNNERS[runner_name]()
    engine = Engine(config, runner)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch_size, args.prompt_len)):
        engine.add_request(f"req-{i}", prompt.tolist(), params)

    # Per step: schedule, forward, update, drop (ns), num_sequences, num_decode, num_tokens.
    steps = []
    finished: dict[str, int] = {}
    num_cached_tokens = 0
    num_empty_in_a_row = 0
    gc.collect()
    if args.disable_gc:
        gc.disable()
    clock = time.perf_counter_ns
    wall_start = clock()
    try:
        while engine.has_unfinished():
            t0 = clock()
            plan = engine.schedule()
            t1 = clock()
            output = runner.forward(plan)
            t2 = clock()
            request_outputs = engine.update(plan, output)
            t3 = clock()
            shape = (plan.num_sequences, plan.num_decode_sequences, plan.num_tokens)
            for request_output in request_outputs:
                if request_output.finished:
                    finished[request_output.request_id] = len(request_output.token_ids)
                    num_cached_tokens += request_output.num_cached_tokens
            t4 = clock()
            del plan, output, request_outputs
            t5 = clock()
            if shape[0] == 0:
                # Legal (e.g. a step that only reports aborts) but never expected here.
                num_empty_in_a_row += 1
                if num_empty_in_a_row > 1000:
                    raise RuntimeError("engine has unfinished requests but plans only empty steps")
                continue
            num_empty_in_a_row = 0
            steps.append((t1 - t0, t2 - t1, t3 - t2, t5 - t4, *shape))
    finally:
        if args.disable_gc:
            gc.enable()
    wall_ns = clock() - wall_start
    engine.check_integrity()

    if len(finished) != batch_size or set(finished.values()) != {args.output_len}:
        raise RuntimeError(
            f"expected {batch_size} requests with {args.output_len} tokens each, got "
            f"{len(finished)} finished with lengths {sorted(set(finished.values()))}"
        )
    return {
        "table": np.array(steps, dtype=np.int64).reshape(-1, 7),
        "wall_s": wall_ns / 1e9,
        "num_preemptions": read_counter(engine.metrics_text(), "num_preemptions"),
        "num_cached_tokens": num_cached_tokens,
    }


def measure(args: argparse.Namespace, batch_size: int, runner_name: str) -> dict[str, Any]:
    """``args.repeats`` runs of one (batch size, runner); statistics over the pooled steps."""
    runs = [run_once(args, batch_size, runner_name) for _ in range(args.repeats)]
    table = np.concatenate([run["table"] for run in runs])
    is_decode = table[:, 5] == table[:, 4]
    preemptions = [run["num_preemptions"] for run in runs]
    return {
        "batch_size": batch_size,
        "runner": runner_name,
        "num_runs": len(runs),
        "num_steps": len(table) // len(runs),
        "wall_s": float(np.median([run["wall_s"] for run in runs])),
        "num_preemptions": None if None in preemptions else sum(preemptions),
        "num_cached_tokens": sum(run["num_cached_tokens"] for run in runs),
        "decode": step_stats(table[is_decode]),
        "decode_full": step_stats(table[is_decode & (table[:, 4] == batch_size)]),
        "prefill": step_stats(table[~is_decode]),
    }


def step_stats(rows: np.ndarray) -> dict[str, Any] | None:
    """Timing statistics (µs) of a set of steps; None when the set is empty."""
    if len(rows) == 0:
        return None
    parts = {
        "schedule": rows[:, 0],
        "forward": rows[:, 1],
        "update": rows[:, 2],
        "drop": rows[:, 3],
    }
    total = rows[:, :4].sum(axis=1)

    def summary(ns: np.ndarray) -> dict[str, float]:
        us = ns / 1e3
        return {
            "mean": float(us.mean()),
            "p50": float(np.percentile(us, 50)),
            "p99": float(np.percentile(us, 99)),
            "max": float(us.max()),
        }

    return {
        "num_steps": int(len(rows)),
        "mean_num_sequences": float(rows[:, 4].mean()),
        "max_num_sequences": int(rows[:, 4].max()),
        "mean_num_tokens": float(rows[:, 6].mean()),
        "total_us": summary(total),
        **{f"{name}_us": summary(ns) for name, ns in parts.items()},
        "steps_per_s": float(1e9 / total.mean()),
        "us_per_sequence": float(total.sum() / 1e3 / rows[:, 4].sum()),
        "us_per_token": float(total.sum() / 1e3 / rows[:, 6].sum()),
    }


def fmt(value: float) -> str:
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def markdown(runs: list[dict[str, Any]]) -> str:
    header = (
        "| B | runner | steps | mean S | mean µs | p50 µs | p99 µs | schedule µs | forward µs "
        "| update µs | drop µs | steps/s | µs/seq |\n" + "|---" * 13 + "|\n"
    )
    sections = [
        ("decode_full", "Decode steps with all B sequences (steady state)"),
        ("decode", "All decode steps (the batch fills during prefill and drains at the end)"),
        ("prefill", "Prefill steps (at least one prefill chunk; decode rows ride along)"),
    ]
    out = []
    for key, title in sections:
        lines = [f"**{title}**\n\n", header]
        for run in runs:
            s = run[key]
            if s is None:
                lines.append(
                    f"| {run['batch_size']} | {run['runner']} | 0 |" + " n/a |" * 10 + "\n"
                )
                continue
            cells = [
                str(run["batch_size"]),
                run["runner"],
                str(s["num_steps"]),
                fmt(s["mean_num_sequences"]),
                fmt(s["total_us"]["mean"]),
                fmt(s["total_us"]["p50"]),
                fmt(s["total_us"]["p99"]),
                fmt(s["schedule_us"]["mean"]),
                fmt(s["forward_us"]["mean"]),
                fmt(s["update_us"]["mean"]),
                fmt(s["drop_us"]["mean"]),
                fmt(s["steps_per_s"]),
                f"{s['us_per_sequence']:.3f}",
            ]
            lines.append("| " + " | ".join(cells) + " |\n")
        out.append("".join(lines))
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "resin": resin.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    for batch_size in args.batch_sizes:
        for runner_name in args.runners:
            print(f"running B={batch_size} runner={runner_name} ...", file=sys.stderr, flush=True)
            runs.append(measure(args, batch_size, runner_name))
    result: dict[str, Any] = {
        "benchmark": "engine_overhead",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "config": {
            "batch_sizes": args.batch_sizes,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "page_size": PAGE_SIZE,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": True,
            "vocab_size": VOCAB_SIZE,
            "seed": SEED,
            "repeats": args.repeats,
            "gc_disabled": args.disable_gc,
            "runners": args.runners,
        },
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"engine overhead: prompt {args.prompt_len}, output {args.output_len}, page size "
        f"{PAGE_SIZE}, max_num_batched_tokens {args.max_num_batched_tokens}, {args.repeats} run(s) "
        "each; µs per step = schedule + forward (Python call) + update + drop\n"
    )
    print(markdown(runs))
    print(f"JSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
