"""ForwardOutput validation (DESIGN.md "ForwardOutput", _core.pyi ``Engine.update`` / ``step``).

A malformed output (wrong dtype or shape, bad ``token_indptr``, token id outside
``vocab_size``, a sampling row with no token or two, malformed logprobs, not a
ForwardOutput at all) raises a ValueError naming the field (TypeError accepted only for
a wrong Python type). Afterwards nothing has changed: pages, queues, metrics, integrity.
With the explicit API the same plan stays pending and a corrected output commits it;
with ``step()`` the plan is discarded and the next step plans the same work. Every
request still finishes with exactly the right tokens and every page is free at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from harness import Harness, RecordingRunner

import resin
from resin import ForwardOutput, SamplingParams

VOCAB = 100
PROMPTS = {
    "a": [11, 12, 13, 14, 15],
    "b": [21, 22, 23, 24, 25, 26],
    "c": [31, 32, 33, 34, 35, 36, 37],
}
MAX_TOKENS = 4


def good_token(request_id: str, seq_len: int) -> int:
    return 10 + seq_len  # < VOCAB for these prompts


def u32(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.uint32)


def good_output(plan: Any, k: int | None = None) -> ForwardOutput:
    """One valid token per row (every row samples here); with k, valid logprob arrays too."""
    ids = [good_token(rid, int(n)) for rid, n in zip(plan.request_ids, plan.seq_lens)]
    extra = {}
    if k is not None:
        n = len(ids)
        extra = dict(
            logprobs=np.full(n, -0.5, np.float32),
            top_logprob_ids=np.tile(np.arange(1, k + 1, dtype=np.uint32), (n, 1)),
            top_logprobs=np.full((n, k), -1.0, np.float32),
        )
    return ForwardOutput(
        token_ids=u32(ids), token_indptr=np.arange(len(ids) + 1, dtype=np.uint32), **extra
    )


def make_engine(logprobs: int | None = None, step_first: bool = True) -> resin.Engine:
    config = resin.EngineConfig(
        page_size=4,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        vocab_size=VOCAB,
    )
    runner = RecordingRunner(good_token)
    if logprobs is not None:
        runner.forward = lambda plan: good_output(plan, logprobs)  # type: ignore[method-assign]
    engine = resin.Engine(config, runner)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, logprobs=logprobs))
    if step_first:
        engine.step()  # all three prefilled: every later row is a sampling decode row
    return engine


def out(ids: Any, indptr: Any, **kw: Any) -> ForwardOutput:
    return ForwardOutput(token_ids=ids, token_indptr=indptr, **kw)


S = len(PROMPTS)
ARANGE = np.arange(S + 1, dtype=np.uint32)
ZEROS = np.zeros(S, dtype=np.uint32)
BAD: dict[str, tuple[Callable[[], ForwardOutput], tuple[str, ...]]] = {
    "token_ids_int64": (lambda: out(np.zeros(S, np.int64), ARANGE), ("token_ids",)),
    "token_ids_float32": (lambda: out(np.zeros(S, np.float32), ARANGE), ("token_ids",)),
    "token_ids_2d": (lambda: out(np.zeros((S, 1), np.uint32), ARANGE), ("token_ids",)),
    "token_indptr_int64": (lambda: out(ZEROS, np.arange(S + 1, dtype=np.int64)), ("token_indptr",)),
    "token_indptr_too_short": (
        lambda: out(ZEROS, np.arange(S, dtype=np.uint32)),
        ("token_indptr",),
    ),
    "token_indptr_too_long": (
        lambda: out(u32([0] * (S + 1)), np.arange(S + 2, dtype=np.uint32)),
        ("token_indptr",),
    ),
    "token_indptr_not_monotone": (lambda: out(ZEROS, u32([0, 2, 1, 3])), ("token_indptr",)),
    "token_indptr_not_from_zero": (lambda: out(u32([0] * 4), u32([1, 2, 3, 4])), ("token_indptr",)),
    "token_indptr_end_mismatch": (lambda: out(u32([0] * 4), ARANGE), ("token_indptr", "token_ids")),
    "token_id_out_of_vocab": (lambda: out(u32([0, VOCAB, 0]), ARANGE), ("token_ids",)),
    "sampling_row_without_token": (
        lambda: out(u32([0, 0]), u32([0, 0, 1, 2])),
        ("token_indptr", "token_ids"),
    ),
    "row_with_two_tokens": (
        lambda: out(u32([0] * 4), u32([0, 2, 3, 4])),
        ("token_indptr", "token_ids"),
    ),
}


def GOOD_IDS(plan: Any) -> np.ndarray:  # noqa: N802
    return u32([good_token(r, int(n)) for r, n in zip(plan.request_ids, plan.seq_lens)])


F32 = np.float32
BAD_LOGPROBS: dict[str, Callable[[Any], ForwardOutput]] = {
    "logprobs_float64": lambda p: out(
        GOOD_IDS(p),
        ARANGE,
        logprobs=np.zeros(S),
        top_logprob_ids=np.ones((S, 2), np.uint32),
        top_logprobs=np.zeros((S, 2), F32),
    ),
    "logprobs_wrong_length": lambda p: out(
        GOOD_IDS(p),
        ARANGE,
        logprobs=np.zeros(S + 1, F32),
        top_logprob_ids=np.ones((S, 2), np.uint32),
        top_logprobs=np.zeros((S, 2), F32),
    ),
    "top_logprobs_shape_mismatch": lambda p: out(
        GOOD_IDS(p),
        ARANGE,
        logprobs=np.zeros(S, F32),
        top_logprob_ids=np.ones((S, 2), np.uint32),
        top_logprobs=np.zeros((S, 3), F32),
    ),
    "top_logprob_ids_alone": lambda p: out(
        GOOD_IDS(p), ARANGE, logprobs=np.zeros(S, F32), top_logprob_ids=np.ones((S, 2), np.uint32)
    ),
    "top_logprob_ids_1d": lambda p: out(
        GOOD_IDS(p),
        ARANGE,
        logprobs=np.zeros(S, F32),
        top_logprob_ids=np.ones(S, np.uint32),
        top_logprobs=np.zeros(S, F32),
    ),
    "top_logprob_ids_int64": lambda p: out(
        GOOD_IDS(p),
        ARANGE,
        logprobs=np.zeros(S, F32),
        top_logprob_ids=np.ones((S, 2), np.int64),
        top_logprobs=np.zeros((S, 2), F32),
    ),
}


def snapshot(engine: resin.Engine) -> tuple[Any, ...]:
    return (
        engine.num_free_pages,
        engine.num_running,
        engine.num_waiting,
        engine.has_unfinished(),
        engine.metrics_text(),
    )


def committed(engine: resin.Engine) -> tuple[Any, ...]:
    """What only a commit changes: token counters, finished requests, live request count.

    A discarded plan commits nothing, but the requests it admitted keep their pages and
    slots (documented in docs/runners.md), so free pages and the running/waiting split are
    not part of this.
    """
    lines = [
        line
        for line in engine.metrics_text().splitlines()
        if line.startswith(
            (
                "resin:prompt_tokens_total",
                "resin:generation_tokens_total",
                "resin:request_success_total",
            )
        )
    ]
    return (engine.num_running + engine.num_waiting, engine.has_unfinished(), tuple(lines))


def finish_all(engine: resin.Engine) -> dict[str, Any]:
    final = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


def assert_all_served(engine: resin.Engine, final: dict[str, Any]) -> None:
    assert sorted(final) == sorted(PROMPTS)
    for rid, prompt in PROMPTS.items():
        expected = [good_token(rid, len(prompt) + k) for k in range(MAX_TOKENS)]
        assert (final[rid].token_ids, final[rid].finish_reason) == (expected, "length"), rid
    engine.check_integrity()
    num_pages = engine.layout.num_pages
    assert engine.num_free_pages == num_pages - 1
    engine.reset_prefix_cache()
    assert engine.num_free_pages == num_pages - 1
    engine.check_integrity()


@pytest.mark.parametrize("case", list(BAD))
def test_update_rejects_then_same_plan_commits(case: str) -> None:
    build, fields = BAD[case]
    engine = make_engine()
    plan = engine.schedule()
    assert plan.num_sequences == S and plan.sample_indptr.tolist() == list(range(S + 1))
    before = snapshot(engine)
    with pytest.raises(ValueError) as error:
        engine.update(plan, build())
    assert any(f in str(error.value) for f in fields), str(error.value)
    assert snapshot(engine) == before
    engine.check_integrity()
    with pytest.raises(RuntimeError):
        engine.schedule()  # the plan is still pending
    outs = engine.update(plan, good_output(plan))
    assert sorted(o.request_id for o in outs) == sorted(PROMPTS)
    assert all(len(o.token_ids) == 2 and len(o.new_token_ids) == 1 for o in outs)
    assert_all_served(engine, finish_all(engine))


@pytest.mark.parametrize("case", list(BAD_LOGPROBS))
def test_malformed_logprobs_rejected_then_same_plan_commits(case: str) -> None:
    engine = make_engine(logprobs=2)
    plan = engine.schedule()
    before = snapshot(engine)
    with pytest.raises(ValueError) as error:
        engine.update(plan, BAD_LOGPROBS[case](plan))
    field = "top_logprob" if case.startswith("top_") else "logprobs"
    assert field in str(error.value), str(error.value)
    assert snapshot(engine) == before
    engine.check_integrity()
    outs = engine.update(plan, good_output(plan, 2))
    assert all(o.logprobs is not None and len(o.logprobs) == 2 for o in outs)
    assert_all_served(engine, finish_all(engine))


@pytest.mark.parametrize(
    "wrong", [None, {"token_ids": [0, 0, 0]}, (ZEROS, ARANGE)], ids=["none", "dict", "tuple"]
)
def test_update_rejects_objects_that_are_not_forward_outputs(wrong: Any) -> None:
    engine = make_engine()
    plan = engine.schedule()
    before = snapshot(engine)
    with pytest.raises((TypeError, ValueError)) as error:
        engine.update(plan, wrong)
    assert "ForwardOutput" in str(error.value) or "output" in str(error.value), str(error.value)
    assert snapshot(engine) == before
    engine.update(plan, good_output(plan))
    assert_all_served(engine, finish_all(engine))


@pytest.mark.parametrize("admitting", [True, False], ids=["admission", "decode"])
def test_discarded_plan_is_planned_again(admitting: bool) -> None:
    engine = make_engine(step_first=not admitting)
    before = committed(engine)
    plan = engine.schedule()
    with pytest.raises(ValueError):
        engine.update(plan, BAD["token_ids_int64"][0]())
    engine.discard_plan()
    assert committed(engine) == before
    engine.check_integrity()
    again = engine.schedule()
    assert again.request_ids == plan.request_ids
    assert again.input_ids.tolist() == plan.input_ids.tolist()
    assert again.num_computed_tokens.tolist() == plan.num_computed_tokens.tolist()
    assert sorted(again.new_request_slots.tolist()) == sorted(plan.new_request_slots.tolist())
    engine.update(again, good_output(again))
    assert_all_served(engine, finish_all(engine))


def test_committed_plan_cannot_be_committed_twice() -> None:
    engine = make_engine()
    plan = engine.schedule()
    engine.update(plan, good_output(plan))
    before = snapshot(engine)
    with pytest.raises((RuntimeError, ValueError)):
        engine.update(plan, good_output(plan))
    assert snapshot(engine) == before
    assert_all_served(engine, finish_all(engine))


class FlakyRunner(RecordingRunner):
    """Answers like RecordingRunner, except that call number ``bad_call`` misbehaves."""

    def __init__(self, bad_call: int, misbehave: Callable[[Any], Any]) -> None:
        super().__init__(good_token)
        self.calls, self.bad_call, self.misbehave = 0, bad_call, misbehave

    def forward(self, plan: Any) -> Any:
        self.calls += 1
        good = super().forward(plan)
        return self.misbehave(plan) if self.calls == self.bad_call else good


def raise_boom(plan: Any) -> Any:
    raise RuntimeError("boom from the runner")


@pytest.mark.parametrize("bad_call", [1, 2, 4])
@pytest.mark.parametrize(
    ("misbehave", "error", "text"),
    [
        (
            lambda plan: out(
                np.zeros(plan.num_sequences, np.int64),
                np.arange(plan.num_sequences + 1, dtype=np.uint32),
            ),
            ValueError,
            "token_ids",
        ),
        (
            lambda plan: out(
                u32([VOCAB] * plan.num_sequences),
                np.arange(plan.num_sequences + 1, dtype=np.uint32),
            ),
            ValueError,
            "token_ids",
        ),
        (lambda plan: None, (TypeError, ValueError), "ForwardOutput"),
        (raise_boom, RuntimeError, "boom from the runner"),
    ],
    ids=["int64", "out_of_vocab", "none", "raises"],
)
def test_step_discards_a_failed_plan_and_keeps_serving(
    bad_call: int, misbehave: Any, error: Any, text: str
) -> None:
    runner = FlakyRunner(bad_call, misbehave)
    config = resin.EngineConfig(
        page_size=4,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        vocab_size=VOCAB,
    )
    h = Harness(config, runner)
    for rid, prompt in PROMPTS.items():
        h.add(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    for _ in range(bad_call - 1):
        h.step()
    before = committed(h.engine)
    with pytest.raises(error) as raised:
        h.step()  # the harness checks the failed plan too, without committing it
    assert text in str(raised.value)
    assert committed(h.engine) == before
    h.engine.check_integrity()
    failed = h.runner.plans[-1]
    h.step()
    retried = h.runner.plans[-1]
    for key in ("request_ids", "input_ids", "positions", "seq_lens", "sample_indptr"):
        assert np.array_equal(np.asarray(failed[key]), np.asarray(retried[key])), key
    for key in ("new_request_slots", "finished_request_slots"):
        assert sorted(failed[key].tolist()) == sorted(retried[key].tolist()), key
    h.run()
    assert_all_served(h.engine, h.final)


def test_forward_output_keeps_its_fields() -> None:
    ids, indptr = u32([3, 4]), u32([0, 1, 2])
    lp, top_ids, top_lp = (
        np.array([-1.0, -2.0], F32),
        u32([[5], [6]]),
        np.array([[-0.5], [-0.25]], F32),
    )
    full = ForwardOutput(
        token_ids=ids,
        token_indptr=indptr,
        logprobs=lp,
        top_logprob_ids=top_ids,
        top_logprobs=top_lp,
    )
    assert np.asarray(full.token_ids).tolist() == [3, 4]
    assert np.asarray(full.token_indptr).tolist() == [0, 1, 2]
    assert np.asarray(full.logprobs).tolist() == [-1.0, -2.0]
    assert np.asarray(full.top_logprob_ids).tolist() == [[5], [6]]
    assert np.asarray(full.top_logprobs).tolist() == [[-0.5], [-0.25]]
    bare = ForwardOutput(token_ids=ids, token_indptr=indptr)
    assert (bare.logprobs, bare.top_logprob_ids, bare.top_logprobs) == (None, None, None)


def test_mid_prefill_row_may_return_no_token() -> None:
    config = resin.EngineConfig(
        page_size=4,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        vocab_size=VOCAB,
    )
    engine = resin.Engine(config, RecordingRunner(good_token))
    engine.add_request("long", list(range(1, 21)), SamplingParams(max_tokens=2))
    plan = engine.schedule()
    assert plan.sample_indptr.tolist() == [0, 0]
    assert engine.update(plan, out(u32([]), u32([0, 0]))) == []
    plan = engine.schedule()
    assert plan.num_computed_tokens.tolist() == [8]
    assert engine.update(plan, out(u32([5]), u32([0, 1]))) == []  # ignored: row does not sample
    final = finish_all(engine)
    assert final["long"].token_ids == [good_token("long", 20), good_token("long", 21)]


def test_malformed_prompt_logprobs_rejected_then_the_same_plan_commits() -> None:
    """A request asking for prompt logprobs: the prefill plan marks 4 targets (prompt tokens 1 to
    4, two top entries each); missing, short, wrongly typed or mismatched arrays are refused
    naming the field, nothing is recorded, and the right output commits the same plan."""
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=32, max_model_len=64, vocab_size=VOCAB),
        RecordingRunner(good_token),
    )
    engine.add_request("a", PROMPTS["a"], SamplingParams(max_tokens=2, prompt_logprobs=2))
    plan = engine.schedule()
    targets = plan.prompt_logprob_targets
    assert targets.tolist() == [12, 13, 14, 15, -1] and plan.sampling.num_prompt_logprobs[0] == 2
    ids, indptr = u32([good_token("a", 5)]), u32([0, 1])
    top_ids = np.tile(u32([1, 2]), (4, 1))
    top = np.full((4, 2), -1.0, np.float32)
    lps = np.full(4, -0.25, np.float32)
    bad = {
        "missing": (out(ids, indptr), "prompt_logprobs"),
        "short": (out(ids, indptr, prompt_logprobs=lps[:3]), "prompt_logprobs"),
        "float64": (out(ids, indptr, prompt_logprobs=lps.astype(np.float64)), "prompt_logprobs"),
        "no_top": (out(ids, indptr, prompt_logprobs=lps), "prompt_top_logprob_ids"),
        "shapes_differ": (
            out(
                ids,
                indptr,
                prompt_logprobs=lps,
                prompt_top_logprob_ids=top_ids,
                prompt_top_logprobs=top[:, :1].copy(),
            ),
            "prompt_top_logprob",
        ),
        "top_out_of_vocab": (
            out(
                ids,
                indptr,
                prompt_logprobs=lps,
                prompt_top_logprob_ids=np.full((4, 2), VOCAB, np.uint32),
                prompt_top_logprobs=top,
            ),
            "prompt_top_logprob_ids",
        ),
    }
    for case, (output, field) in bad.items():
        with pytest.raises(ValueError, match=field):
            engine.update(plan, output)
            pytest.fail(f"{case}: accepted")
        assert engine.metrics_text()  # still serving
    good = out(
        ids, indptr, prompt_logprobs=lps, prompt_top_logprob_ids=top_ids, prompt_top_logprobs=top
    )
    [first] = engine.update(plan, good)
    assert first.prompt_logprobs == [None] + [
        {t: -0.25, 1: -1.0, 2: -1.0} for t in PROMPTS["a"][1:]
    ]
