"""The minimal runner from Resin's README: it keeps no cache and samples token 0 for every row.

Run it with ``python examples/minimal_runner.py``. It serves a few requests (one long
enough to be prefilled in chunks) and prints each finished request's tokens. The runner
also returns a token for rows that do not sample (mid-prefill chunks); the engine ignores
those, so a runner need not special-case them.
"""

from __future__ import annotations

import numpy as np

import resin
from resin import BatchPlan, ForwardOutput


# Verbatim as in the README and DESIGN.md:
# fmt: off
class Runner:
    def forward(self, plan: BatchPlan) -> ForwardOutput:
        return ForwardOutput(token_ids=np.zeros(plan.num_sequences, dtype=np.uint32),
                             token_indptr=np.arange(plan.num_sequences + 1, dtype=np.uint32))
# fmt: on


def main() -> None:
    config = resin.EngineConfig(
        page_size=16, num_pages=1024, max_model_len=2048, max_num_batched_tokens=256
    )
    engine = resin.Engine(config, Runner())
    engine.add_request("r1", [1, 2, 3, 4], resin.SamplingParams(max_tokens=8, temperature=0.0))
    engine.add_request("r2", list(range(1, 301)), resin.SamplingParams(max_tokens=3))
    engine.add_request("r3", [7, 8, 9], resin.SamplingParams(max_tokens=6, temperature=0.0))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                print(out.request_id, out.token_ids, out.finish_reason)


if __name__ == "__main__":
    main()
