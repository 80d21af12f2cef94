"""The greedy and the mixed sampler step of ``sampler_step.py`` with the logits out of L2: one
line of JSON, for A/B runs of two trees in separate processes taking turns.

``sampler_step.py`` times every contender in interleaved rounds in one process; two builds of
``resin._core`` cannot share a process, so an A/B between commits runs this once per tree
(its Python package on ``PYTHONPATH``, its ``_core`` built there, as ``ab_bench.sh`` says):

    for round in 1 2 3; do for tree in /tmp/old /work/main; do
      (cd /tmp && PYTHONPATH=$tree /work/main/.venv/bin/python /work/main/benchmarks/sampler_cold.py)
    done; done

Per vocabulary: the greedy step (256 rows at temperature 0) and the mixed step (``MIXED``, 64
generated tokens of history) on peaked logits, taking turns, a 64 MB buffer written before
each call (the logits then come from L3, as after a forward pass), median of ``--repeats``.
Prints ``{vocab: [greedy ms, mixed ms, mixed / greedy]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampler_step  # noqa: E402

from resin.sampling import Sampler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {}
    for vocab in args.vocab:
        greedy, mixed = Sampler(vocab), Sampler(vocab)
        greedy_plan = sampler_step.capture([dict(temperature=0.0)], 16, vocab, [greedy])
        mixed_plan = sampler_step.capture(sampler_step.MIXED, 64, vocab, [mixed])
        logits = sampler_step.make_logits("peaked", vocab)
        calls = {
            "greedy": sampler_step.step(greedy, logits, greedy_plan),
            "mixed": sampler_step.step(mixed, logits, mixed_plan),
        }
        evict = np.ones(64 << 20, np.uint8)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, call in calls.items():
                evict += 1
                start = time.perf_counter()
                call()
                if round_:
                    times[name].append(time.perf_counter() - start)
        g, m = (float(np.median(times[name])) * 1e3 for name in ("greedy", "mixed"))
        out[vocab] = [round(g, 2), round(m, 2), round(m / g, 2)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
