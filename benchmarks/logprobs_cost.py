"""Per-step cost of reading a streamed request's logprobs, at 64 and 1,024 generated tokens.

One request with ``logprobs=5`` decodes ``--tokens`` tokens through a real ``resin.Engine`` and a
runner that returns fixed logprobs (no model). At the 64th and the last step, the time to read
the entries the way a stream does — ``RequestOutput.logprobs_from(num_output_tokens - 1)``, the
new token's entry — is compared with reading the whole list (``RequestOutput.logprobs``, what the
server read before: it rebuilt every entry each step, O(n) per step, O(n^2) per request).
Median of ``--repeats`` reads each.

    .venv/bin/python benchmarks/logprobs_cost.py          # prints a table, writes results/logprobs_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import resin
from resin import Engine, EngineConfig, ForwardOutput, SamplingParams

K = 5
RESULTS = Path(__file__).resolve().parent / "results"


class FixedLogprobRunner:
    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        n = plan.num_sequences
        ids = np.full(n, 7, np.uint32)
        top_ids = np.tile(np.arange(7, 7 + K, dtype=np.uint32), (n, 1))
        top = np.tile(-np.arange(K, dtype=np.float32), (n, 1))
        return ForwardOutput(
            ids, np.arange(n + 1, dtype=np.uint32), np.zeros(n, np.float32), top_ids, top
        )


def median_us(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    config = EngineConfig(
        page_size=16, num_pages=256, max_model_len=args.tokens + 16, vocab_size=1000
    )
    engine = Engine(config, FixedLogprobRunner())
    engine.add_request(
        "r", [1, 2, 3], SamplingParams(max_tokens=args.tokens, logprobs=K, ignore_eos=True)
    )
    rows = []
    marks = {64, args.tokens}
    while engine.has_unfinished():
        for out in engine.step():
            n = out.num_output_tokens
            if n in marks:
                rows.append(
                    {
                        "generated_tokens": n,
                        "new_entry_us": median_us(
                            lambda o=out, n=n: o.logprobs_from(n - 1), args.repeats
                        ),
                        "whole_list_us": median_us(lambda o=out: o.logprobs, args.repeats),
                    }
                )
    print(f"logprobs read per step, k = {K}, median of {args.repeats} reads\n")
    print("| generated tokens | new entry (logprobs_from) µs | whole list (logprobs) µs |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['generated_tokens']:,} | {r['new_entry_us']:.2f} | {r['whole_list_us']:.1f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / "logprobs_cost.json"
    out_path.write_text(
        json.dumps({"benchmark": "logprobs_cost", "k": K, "rows": rows}, indent=2) + "\n"
    )
    print(f"\nJSON: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
