"""Instructions per decode step, counted by callgrind: a noise-free companion to
engine_overhead.py on a shared machine, where wall-clock numbers swing by ±40%.

For each batch size B it runs the engine_overhead workload (null runner, 512-token
prompts, page size 16, prefix caching on, everything prefilled in the first step) twice
under `valgrind --tool=callgrind`, collecting only inside `Engine.step`: once for the
prefill step alone and once for the prefill plus N decode steps. The difference over N is
the instruction count of one decode step: Rust scheduling and plan building, the runner's
Python call, validation and commit, and the RequestOutput objects. Counts grow linearly
when instructions per sequence stay flat across B.

    .venv/bin/python benchmarks/step_instructions.py --batch-sizes 64,256,1024
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOAD = """
import sys
import numpy as np
import resin
b, n = int(sys.argv[1]), int(sys.argv[2])
class NullRunner:
    def forward(self, plan):
        s = plan.num_sequences
        return resin.ForwardOutput(np.zeros(s, np.uint32), np.arange(s + 1, dtype=np.uint32))
config = resin.EngineConfig(page_size=16, num_pages=b * 50 + 1, max_num_seqs=b,
                            max_num_batched_tokens=512 * b, max_model_len=1024)
engine = resin.Engine(config, NullRunner())
for i in range(b):
    prompt = [(i * 7919 + t * 31) % 32000 for t in range(512)]
    engine.add_request(f"r{i}", prompt, resin.SamplingParams(max_tokens=n + 2, ignore_eos=True))
for _ in range(n + 1):
    engine.step()
"""


def count_instructions(b: int, n: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "workload.py", Path(tmp) / "callgrind.out"
        script.write_text(WORKLOAD)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        result = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                "--toggle-collect=*Engine*step*",
                sys.executable,
                str(script),
                str(b),
                str(n),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        match = re.search(r"Collected : (\d+)", result.stderr) or re.search(
            r"I\s+refs:\s+([\d,]+)", result.stderr
        )
        if match is None:
            raise RuntimeError(f"no instruction count in valgrind output:\n{result.stderr[-2000:]}")
        return int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=50, help="decode steps counted (default 50)")
    parser.add_argument("--output", default="benchmarks/results/step_instructions.json")
    args = parser.parse_args()
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prefill_only = count_instructions(b, 0)
        with_decode = count_instructions(b, args.steps)
        per_step = (with_decode - prefill_only) / args.steps
        rows.append(
            {
                "batch_size": b,
                "instructions_per_decode_step": per_step,
                "instructions_per_sequence": per_step / b,
            }
        )
        print(f"B={b}: {per_step:,.0f} instructions per decode step", file=sys.stderr)
    print("| B | instructions / decode step | per sequence | vs smallest B, per sequence |")
    print("|---|---|---|---|")
    base = rows[0]["instructions_per_sequence"]
    for r in rows:
        print(
            f"| {r['batch_size']} | {r['instructions_per_decode_step']:,.0f} | "
            f"{r['instructions_per_sequence']:,.0f} | {r['instructions_per_sequence'] / base:.2f}x |"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2))
    print(f"\nJSON: {args.output}")


if __name__ == "__main__":
    main()
