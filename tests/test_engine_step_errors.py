"""``Engine.step()`` failures: ``StepError`` (forward raised) and ``InvalidOutputError`` (output
rejected) name the failed plan's requests and keep the original exception, after the plan is
discarded; the server's engine loop is ``engine.step()`` plus that error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import resin
from resin import InvalidOutputError, SamplingParams, StepError
from resin.server.engine_loop import EngineLoop, RunnerFailure

CONFIG: dict[str, Any] = dict(
    page_size=4,
    num_pages=32,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    vocab_size=100,
)


class Runner:
    """One token (7) per row; call number ``bad_call`` misbehaves with ``misbehave(plan)``."""

    def __init__(self, bad_call: int = 0, misbehave: Any = None) -> None:
        self.calls, self.bad_call, self.misbehave = 0, bad_call, misbehave
        self.plans: list[dict[str, Any]] = []

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.calls += 1
        self.plans.append(
            {"request_ids": list(plan.request_ids), "input_ids": plan.input_ids.tolist()}
        )
        if self.calls == self.bad_call:
            return self.misbehave(plan)
        n = plan.num_sequences
        return resin.ForwardOutput(np.full(n, 7, np.uint32), np.arange(n + 1, dtype=np.uint32))


def engine_with(runner: Runner, *request_ids: str) -> resin.Engine:
    engine = resin.Engine(resin.EngineConfig(**CONFIG), runner)
    for request_id in request_ids:
        engine.add_request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    return engine


def finish(engine: resin.Engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    engine.check_integrity()
    return done


BOOM = RuntimeError("kernel exploded")


def raise_boom(plan: Any) -> Any:
    raise BOOM


def test_step_error_names_the_plans_requests_and_keeps_the_cause() -> None:
    runner = Runner(bad_call=2, misbehave=raise_boom)
    engine = engine_with(runner, "a", "b")
    engine.step()
    with pytest.raises(StepError) as raised:
        engine.step()
    error = raised.value
    assert isinstance(error, RuntimeError) and not isinstance(error, InvalidOutputError)
    assert error.request_ids == runner.plans[-1]["request_ids"] == ["a", "b"]
    assert error.cause is BOOM and error.__cause__ is BOOM
    assert str(error) == "kernel exploded"
    engine.check_integrity()
    engine.step()  # the same work again
    assert runner.plans[-1] == runner.plans[-2]
    assert finish(engine) == {"a": [7, 7, 7], "b": [7, 7, 7]}


def test_a_runner_raising_value_error_is_a_step_error_not_an_output_error() -> None:
    cause = ValueError("bad shape inside the model")

    def raise_value_error(plan: Any) -> Any:
        raise cause

    engine = engine_with(Runner(bad_call=1, misbehave=raise_value_error), "a")
    with pytest.raises(StepError) as raised:
        engine.step()
    assert not isinstance(raised.value, InvalidOutputError) and raised.value.cause is cause


@pytest.mark.parametrize(
    ("misbehave", "field"),
    [
        (
            lambda plan: resin.ForwardOutput(
                np.zeros(plan.num_sequences, np.int64),
                np.arange(plan.num_sequences + 1, dtype=np.uint32),
            ),
            "token_ids",
        ),
        (
            lambda plan: resin.ForwardOutput(
                np.full(plan.num_sequences, 100, np.uint32),
                np.arange(plan.num_sequences + 1, dtype=np.uint32),
            ),
            "token_ids",
        ),
        (
            lambda plan: resin.ForwardOutput(
                np.zeros(plan.num_sequences, np.uint32),
                np.zeros(plan.num_sequences + 1, dtype=np.uint32),
            ),
            "token_indptr",
        ),
        (lambda plan: None, "ForwardOutput"),
    ],
    ids=["dtype", "out_of_vocab", "indptr", "none"],
)
def test_invalid_output_error_is_a_value_error_naming_the_field(misbehave: Any, field: str) -> None:
    runner = Runner(bad_call=1, misbehave=misbehave)
    engine = engine_with(runner, "a", "b")
    with pytest.raises(InvalidOutputError) as raised:
        engine.step()
    error = raised.value
    assert isinstance(error, ValueError) and isinstance(error, StepError)
    assert field in str(error) and str(error) == str(error.cause)
    assert isinstance(error.cause, ValueError) and error.__cause__ is error.cause
    assert error.request_ids == ["a", "b"]
    assert finish(engine) == {"a": [7, 7, 7], "b": [7, 7, 7]}


def test_keyboard_interrupt_passes_through_after_the_discard() -> None:
    def interrupt(plan: Any) -> Any:
        raise KeyboardInterrupt

    engine = engine_with(Runner(bad_call=1, misbehave=interrupt), "a")
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert finish(engine) == {"a": [7, 7, 7]}  # no plan was left pending


def test_num_forward_calls_counts_only_plans_that_reach_the_runner() -> None:
    runner = Runner(bad_call=2, misbehave=raise_boom)
    engine = engine_with(runner, "a")
    assert engine.num_forward_calls == 0
    engine.step()
    assert engine.num_forward_calls == 1
    with pytest.raises(StepError):
        engine.step()
    assert engine.num_forward_calls == 2, "a failed call counts"
    engine.abort("a")
    (aborted,) = engine.step()  # an empty plan: only the abort is reported
    assert aborted.finish_reason == "abort"
    assert engine.num_forward_calls == runner.calls == 2


def test_engine_loop_step_fails_only_the_failed_plans_requests() -> None:
    runner = Runner(bad_call=2, misbehave=raise_boom)
    engine = engine_with(runner, "a", "b")
    loop = EngineLoop(engine, runner)
    outputs, errors, ran_runner = loop._step()
    assert {o.request_id for o in outputs} == {"a", "b"} and errors == {} and ran_runner
    engine.add_request("c", [9, 9], SamplingParams(max_tokens=1))
    outputs, errors, ran_runner = loop._step()
    assert outputs == [] and ran_runner
    assert set(errors) == {"a", "b", "c"}
    error = errors["a"]
    assert isinstance(error, RunnerFailure) and error.__cause__ is BOOM
    assert "the runner failed on this request: kernel exploded" == str(error)
    # The failed requests were aborted: the next step is empty and only reports the aborts.
    outputs, errors, ran_runner = loop._step()
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        ("a", "abort"),
        ("b", "abort"),
        ("c", "abort"),
    ]
    assert errors == {} and not ran_runner
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.num_free_pages == CONFIG["num_pages"] - 1
