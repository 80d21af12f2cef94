"""``Sampler.begin_step`` keeps each request's token history from the plan's lifecycle diff
alone (``new_request_*``, ``finished_request_slots``, ``committed_token_ids`` at
``num_output_tokens``), never from ``input_ids``: after every plan, every row's history is its
request's prompt + outputs, through prefix hits, chunked prefill, preemption and plans that
failed after the sampler saw them; and seeded, penalised sampling is unchanged by failures."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import resin
from resin.sampling import Sampler

VOCAB_SIZE = 32
TABLE = np.random.default_rng(1).normal(0.0, 2.0, (VOCAB_SIZE, VOCAB_SIZE)).astype(np.float32)
LIFECYCLE_FIELDS = {
    "finished_request_slots",
    "new_request_slots",
    "new_request_token_indptr",
    "new_request_token_ids",
    "new_request_num_prompt_tokens",
    "request_slots",
    "committed_token_indptr",
    "committed_token_ids",
    "num_output_tokens",
}


class DiffOnly:
    """A plan whose only readable fields are the lifecycle diff."""

    def __init__(self, plan: resin.BatchPlan) -> None:
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        if name not in LIFECYCLE_FIELDS:
            raise AssertionError(f"begin_step read plan.{name}")
        return getattr(self._plan, name)


class CheckingRunner:
    """Logits = TABLE[last token]; checks the sampler's history after every begin_step; fails
    (after begin_step) on the calls in ``fail_calls``."""

    def __init__(self, fail_calls: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.sampler = Sampler(VOCAB_SIZE)
        self.table = torch.from_numpy(TABLE.copy())
        self.fail_calls, self.calls = fail_calls, 0
        self.expected: dict[str, list[int]] = {}  # request id -> prompt + outputs so far
        self.num_rows_checked = 0

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.calls += 1
        self.sampler.begin_step(DiffOnly(plan))  # type: ignore[arg-type]
        for row, request_id in enumerate(plan.request_ids):
            state = self.sampler.slots[int(plan.request_slots[row])]
            assert state.token_ids == self.expected[request_id], (plan.step, request_id)
            assert len(state.output_token_ids) == plan.num_output_tokens[row]
            self.num_rows_checked += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("fails after begin_step")
        rows = np.flatnonzero(np.diff(plan.sample_indptr) == 1)
        last_tokens = plan.input_ids[plan.query_indptr[rows + 1] - 1].astype(np.int64)
        return self.sampler.sample(self.table[torch.from_numpy(last_tokens)], plan, rows)


PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21], "c": [3, 3, 3]}


def run(runner: CheckingRunner, **config: Any) -> dict[str, list[int]]:
    engine = resin.Engine(
        resin.EngineConfig(**{"page_size": 4, "num_pages": 64, "max_model_len": 64, **config}),
        runner,
    )
    params = [
        resin.SamplingParams(
            max_tokens=14, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5
        ),
        resin.SamplingParams(max_tokens=14, temperature=0.9, seed=11, presence_penalty=0.7),
    ]
    for copy in range(2):
        for name, prompt in PROMPTS.items():
            request_id = f"{name}{copy}"
            engine.add_request(request_id, prompt, params[copy])
            runner.expected[request_id] = list(prompt)
    finished: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except resin.StepError:
            continue
        for out in outputs:
            runner.expected[out.request_id] = list(out.prompt_token_ids) + out.token_ids
            if out.finished:
                finished[out.request_id] = out.token_ids
    engine.check_integrity()
    return finished


@pytest.mark.parametrize(
    "config",
    [dict(), dict(page_size=1, num_pages=48, max_model_len=40, max_num_batched_tokens=5)],
    ids=["plain", "chunked_preempted"],
)
def test_history_comes_from_the_diff_and_survives_failed_plans(config: dict[str, Any]) -> None:
    clean = CheckingRunner()
    expected = run(clean, **config)
    assert len(expected) == 6 and clean.num_rows_checked > 0
    flaky = CheckingRunner(fail_calls={2, 3, 5, 8, 13, 21})
    assert run(flaky, **config) == expected, "seeded, penalised sampling is unchanged by failures"
    assert flaky.calls > clean.calls
