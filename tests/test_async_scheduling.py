"""Overlapped scheduling (``EngineConfig.async_scheduling``): ``Engine.step()`` finishes the plan
the last call began, commits it, then plans and begins the next one before returning.

The engine's side is checked on a recording runner (the call order, failures of either half,
aborts while a plan is in flight); the torch runner's side on the tiny Llama: the same tokens,
logprobs and finish reasons as the plain step for every kind of sampling, no page left behind,
and a server that streams with it on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import resin
from resin import Engine, EngineConfig, ForwardOutput, SamplingParams
from resin._core import StepError
from resin.runner import SplitForwardRunner

FIXTURE = Path(__file__).parent / "fixtures" / "llama"


class RecordingRunner:
    """Emits token ``seq_len % 50 + 10`` for every row, splits its forward in two and records
    the calls; ``fail_finish`` / ``fail_begin`` make the n-th call of that half raise."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.begun: resin.BatchPlan | None = None
        self.fail_begin: set[int] = set()
        self.fail_finish: set[int] = set()
        self.num_begin = self.num_finish = 0

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        self.begin_forward(plan)
        return self.finish_forward()

    def begin_forward(self, plan: resin.BatchPlan) -> None:
        self.num_begin += 1
        self.calls.append(("begin", plan.step))
        if self.num_begin in self.fail_begin:
            raise RuntimeError(f"begin {self.num_begin} failed")
        self.begun = plan

    def finish_forward(self) -> ForwardOutput:
        plan, self.begun = self.begun, None
        assert plan is not None, "finish_forward without begin_forward"
        self.num_finish += 1
        self.calls.append(("finish", plan.step))
        if self.num_finish in self.fail_finish:
            raise RuntimeError(f"finish {self.num_finish} failed")
        tokens = (plan.seq_lens % 50 + 10).astype(np.uint32)
        return ForwardOutput(tokens, np.arange(plan.num_sequences + 1, dtype=np.uint32))


def engine(runner: object, **config: object) -> Engine:
    settings = dict(page_size=4, num_pages=64, max_num_seqs=4, max_model_len=64)
    settings.update(config)
    return Engine(EngineConfig(async_scheduling=True, **settings), runner)  # type: ignore[arg-type]


def run_all(e: Engine, limit: int = 200) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(limit):
        if not e.has_unfinished():
            return done
        for out in e.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    raise AssertionError("engine did not finish")


def test_step_begins_the_next_plan_before_returning() -> None:
    runner = RecordingRunner()
    assert isinstance(runner, SplitForwardRunner)
    e = engine(runner)
    assert e.async_scheduling and e.config.async_scheduling
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    first = e.step()
    # Plan 0 begun and finished, plan 1 begun before the outputs of plan 0 came back.
    assert runner.calls == [("begin", 0), ("finish", 0), ("begin", 1)]
    assert [o.new_token_ids for o in first] == [[13]]
    assert e.step()[0].new_token_ids == [14]
    assert runner.calls[-2:] == [("finish", 1), ("begin", 2)]
    last = e.step()
    assert last[0].finished and last[0].token_ids == [13, 14, 15]
    # Nothing left: no plan begun after the last one.
    assert runner.calls[-1] == ("finish", 2) and not e.has_unfinished()
    assert e.num_forward_calls == 3
    e.check_integrity()


def test_same_tokens_as_the_plain_step() -> None:
    def outputs(async_scheduling: bool) -> dict[str, list[int]]:
        e = Engine(
            EngineConfig(
                page_size=4, num_pages=24, max_num_seqs=3, max_model_len=64,
                max_num_batched_tokens=8, async_scheduling=async_scheduling,
            ),
            RecordingRunner(),
        )  # fmt: skip
        for i in range(7):  # chunked prefills, admissions and (few pages) preemptions
            e.add_request(f"r{i}", list(range(1, 6 + 3 * i)), SamplingParams(max_tokens=5 + i))
        done = run_all(e)
        assert e.num_free_pages == 23
        e.check_integrity()
        return done

    assert outputs(True) == outputs(False)


def test_a_failed_finish_discards_its_plan() -> None:
    runner = RecordingRunner()
    runner.fail_finish = {2}
    e = engine(runner)
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    e.step()
    with pytest.raises(StepError, match="finish 2 failed") as info:
        e.step()
    assert info.value.request_ids == ["a"]
    # Nothing committed: the next step plans the same work again, and the request completes.
    assert run_all(e) == {"a": [13, 14, 15, 16]}
    e.check_integrity()


def test_a_failed_begin_of_the_next_plan_comes_after_this_steps_outputs() -> None:
    runner = RecordingRunner()
    runner.fail_begin = {2}  # the plan begun at the end of the first step()
    e = engine(runner)
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    assert [o.new_token_ids for o in e.step()] == [[13]]
    with pytest.raises(StepError, match="begin 2 failed") as info:
        e.step()
    assert info.value.request_ids == ["a"]
    assert run_all(e) == {"a": [13, 14, 15]}
    e.check_integrity()


def test_abort_while_a_plan_is_in_flight() -> None:
    runner = RecordingRunner()
    e = engine(runner)
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    e.add_request("b", [4, 5, 6, 7], SamplingParams(max_tokens=8))
    e.step()  # plan 1 (both rows) is in flight now
    assert e.abort("a")
    outs = e.step()  # finishes plan 1: a's row is ignored, a is reported aborted
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].finish_reason == "abort" and by_id["a"].token_ids == [13]
    assert by_id["b"].new_token_ids == [15]
    done = run_all(e)
    assert done["b"] == [14, 15, 16, 17, 18, 19, 20, 21]
    assert e.num_free_pages == 63
    e.check_integrity()


def test_a_runner_without_the_split_steps_plainly() -> None:
    class Plain:
        def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
            tokens = (plan.seq_lens % 50 + 10).astype(np.uint32)
            return ForwardOutput(tokens, np.arange(plan.num_sequences + 1, dtype=np.uint32))

    e = engine(Plain())
    assert e.config.async_scheduling and not e.async_scheduling
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    assert run_all(e) == {"a": [13, 14]}


def test_discard_plan_drops_the_begun_plan() -> None:
    runner = RecordingRunner()
    e = engine(runner)
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    e.step()
    e.discard_plan()
    runner.begun = None  # the runner's begun plan is dropped with it
    assert run_all(e) == {"a": [13, 14, 15]}
    e.check_integrity()


# -- the torch runner -------------------------------------------------------------------


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=3, logprobs=2),
        SamplingParams(max_tokens=7, temperature=0.7, top_k=20, seed=5, repetition_penalty=1.3),
        SamplingParams(max_tokens=11, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(max_tokens=10, temperature=1.0, min_p=0.1, seed=9, prompt_logprobs=1),
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[17, 42, 99], min_tokens=2),
    ]


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_the_torch_runner_gives_the_plain_steps_outputs(backend: str) -> None:
    prompts = [f"the {i} quick brown fox " * (1 + i % 3) for i in range(12)]
    params = mixed_params() * 2

    def generate(async_scheduling: bool) -> list[tuple[object, ...]]:
        llm = resin.LLM(
            FIXTURE,
            attention_backend=backend,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            async_scheduling=async_scheduling,
        )
        assert llm.engine.async_scheduling is async_scheduling
        outs = llm.generate(prompts, params)
        assert not llm.engine.has_unfinished()
        free = llm.engine.num_free_pages
        llm.engine.check_integrity()
        return [(o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs, free) for o in outs]

    assert generate(True) == generate(False)


def test_serving_with_async_scheduling() -> None:
    from openai import OpenAI

    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    options = ServerOptions(served_model_names=["tiny"])
    ctx = build_context(FIXTURE, options=options, async_scheduling=True, max_num_seqs=4)
    assert ctx.loop.engine.async_scheduling
    with LiveServer(ctx) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="hello", max_tokens=6, stream=True, temperature=0
        )
        text = "".join(c.choices[0].text for c in stream if c.choices)
        plain = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
        assert text == plain.choices[0].text
        assert plain.usage is not None and plain.usage.completion_tokens == 6
