"""Paired A/B of `resin.LLM.generate` throughput: another tree (a commit) against this one.

On a shared machine two runs of `offline_throughput.py` minutes apart differ by ±20% (the
neighbours), more than most changes. Here each side is one resident process (model loaded,
first-call costs paid) and the sides take turns on the same prompts, a few seconds apart, so a
round's ratio compares two runs under the same load; the table gives each side's median and
the median of the per-round ratios. Sides: `old` (the other tree, `--old`: a worktree with its
own built `resin/_core.abi3.so`, as benchmarks/ab_bench.sh sets one up), `new` (this tree), and
`new ENV=VALUE` per `--new-env` (this tree with an environment switch, e.g.
`RESIN_CPU_PACKED_WEIGHTS=0`, to split a change into its parts). Every side gets this
process's environment plus its own; the checkpoint is `offline_throughput.py`'s.

    git worktree add /tmp/old COMMIT   # then build its _core there (benchmarks/ab_bench.sh)
    .venv/bin/python benchmarks/ab_throughput.py --old /tmp/old --concurrency 16,64 \\
        --dtype bfloat16 --new-env RESIN_CPU_PACKED_WEIGHTS=0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def worker(concurrency: int, dtype: str, output_len: int) -> None:
    """One side: load, warm up, then one timed `generate` per prompt seed read from stdin."""
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import offline_throughput as ot

    vocab = json.loads((ot.make_checkpoint() / "config.json").read_text())["vocab_size"]
    warmup = ot.random_prompts(1, 64, vocab, seed=10_000)[0]
    run = ot.resin_contender(concurrency, output_len, "torch", warmup, dtype)
    run(ot.random_prompts(concurrency, 64, vocab, seed=10_001))
    print("ready", flush=True)
    for line in sys.stdin:
        print(run(ot.random_prompts(concurrency, 64, vocab, seed=int(line))), flush=True)


def compare(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    sides: dict[str, tuple[Path, dict[str, str]]] = {
        "old": (Path(args.old).resolve(), {}),
        "new": (REPO, {}),
    }
    for assignment in args.new_env:
        name, _, value = assignment.partition("=")
        sides[f"new {assignment}"] = (REPO, {name: value})
    procs = {}
    for side, (tree, extra) in sides.items():
        env = {**os.environ, "PYTHONPATH": str(tree), **extra}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        command += [f"--concurrency={concurrency}", f"--dtype={args.dtype}"]
        command += [f"--output-len={args.output_len}"]
        procs[side] = subprocess.Popen(
            command, cwd=tree, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
    for side, proc in procs.items():
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", side
    rates: dict[str, list[float]] = {side: [] for side in procs}
    names = list(procs)
    for round_ in range(args.rounds):
        shift = round_ % len(names)  # each side goes first in turn
        for side in names[shift:] + names[:shift]:
            proc = procs[side]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{round_}\n")
            proc.stdin.flush()
            rates[side].append(float(proc.stdout.readline()))
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    ratios = {
        side: [b / a for a, b in zip(rates["old"], rates[side], strict=True)] for side in names[1:]
    }
    return {"concurrency": concurrency, "tok_s": rates, "ratios_to_old": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old", help="the other tree (a worktree with its _core built)")
    parser.add_argument("--concurrency", default="64")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--output", default=str(REPO / "benchmarks" / "results" / "ab_throughput.json")
    )
    args = parser.parse_args()
    if args.worker:
        worker(int(args.concurrency), args.dtype, args.output_len)
        return
    if not args.old:
        parser.error("--old is required")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import offline_throughput

    offline_throughput.make_checkpoint()  # once, before this tree's sides start
    results = [compare(args, int(c)) for c in args.concurrency.split(",")]
    print(f"\n{args.dtype}, {args.rounds} rounds, sides taking turns; tok/s medians\n")
    sides = list(results[0]["tok_s"])
    header = " | ".join(sides + [f"{s} / old (min-max)" for s in sides[1:]])
    print(f"| requests | {header} |")
    print("|---" * (1 + 2 * len(sides) - 1) + "|")
    for r in results:
        medians = [f"{statistics.median(r['tok_s'][s]):.0f}" for s in sides]
        paired = [
            f"{statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})"
            for v in r["ratios_to_old"].values()
        ]
        print(f"| {r['concurrency']} | " + " | ".join(medians + paired) + " |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "results": results}, indent=2))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
