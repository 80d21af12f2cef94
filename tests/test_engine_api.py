"""The Python Engine API (DESIGN.md "Engine API", _core.pyi ``Engine`` / ``SamplingParams``).

Covers: add_request and SamplingParams validation (ValueError naming the field, nothing
queued); abort of waiting, running and mid-prefill requests and between schedule/update;
stop on EOS / stop_token_ids, ignore_eos, min_tokens, max_model_len; FCFS and priority
order; preemption under a tiny pool; logprobs; Prometheus metrics (format and values);
and the engine driven from two threads (run in a subprocess so a deadlock fails cleanly).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from harness import Harness, RecordingRunner
from metrics_text import parse_metrics, sample_value

import resin
from resin import SamplingParams


def config(**kw: Any) -> resin.EngineConfig:
    base = dict(
        page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )
    return resin.EngineConfig(**{**base, **kw})


def scripted(script: dict[str, list[int]], prompt_lens: dict[str, int], avoid_banned: bool = False):
    """A runner that emits script[rid][k] as output k (skipping banned ids when asked)."""

    class Scripted(RecordingRunner):
        def forward(self, plan: Any) -> resin.ForwardOutput:
            banned = {}
            b = plan.banned_token_indptr
            for i, rid in enumerate(plan.request_ids):
                banned[rid] = (
                    set(plan.banned_token_ids[b[i] : b[i + 1]].tolist()) if avoid_banned else set()
                )
            self.token_fn = lambda rid, n: (
                5
                if script[rid][n - prompt_lens[rid]] in banned[rid]
                else script[rid][n - prompt_lens[rid]]
            )
            return super().forward(plan)

    return Scripted()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("top_k", -2),
        ("min_tokens", -1),
        ("logprobs", -1),
    ],
)
def test_sampling_params_out_of_range(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    engine = resin.Engine(config(), RecordingRunner())
    params = SamplingParams(max_tokens=4)
    try:
        setattr(params, field, value)
    except ValueError as error:  # a validating setter is fine too
        assert field in str(error)
        return
    with pytest.raises(ValueError, match=field):
        engine.add_request("x", [1, 2, 3], params)
    assert (engine.num_waiting, engine.has_unfinished()) == (0, False)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 2**64),
        ("min_tokens", -(2**70)),
        ("top_k", 2**31),
        ("priority", -(2**40)),
        ("seed", 2**63),
        ("logprobs", 2**100),
        ("stop_token_ids", [1, 2**64]),
        ("logit_bias", {2**64: 1.0}),
    ],
)
def test_sampling_params_ints_past_their_width_name_the_field(field: str, value: Any) -> None:
    """An int too wide for its field is a ValueError naming the field, not an OverflowError."""
    with pytest.raises(ValueError, match=f"SamplingParams.{field}: .* is out of range"):
        SamplingParams(**{field: value})
    with pytest.raises(TypeError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: "x" if field not in ("stop_token_ids", "logit_bias") else 3})


def test_sampling_params_edges_and_defaults() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    p = SamplingParams(
        max_tokens=3,
        min_tokens=3,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        logprobs=0,
        seed=0,
        stop_token_ids=[4, 5],
    )
    assert (p.top_k, p.logprobs, p.seed, p.stop_token_ids) == (0, 0, 0, [4, 5])
    d = SamplingParams()
    assert (
        d.max_tokens,
        d.min_tokens,
        d.temperature,
        d.top_p,
        d.top_k,
        d.seed,
        d.logprobs,
        d.ignore_eos,
        d.stop_token_ids,
        d.repetition_penalty,
        d.priority,
    ) == (16, 0, 1.0, 1.0, 0, None, None, False, [], 1.0, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 0),
        ("num_pages", 1),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 0),
        ("policy", "lifo"),
    ],
)
def test_engine_config_rejects_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        resin.Engine(resin.EngineConfig(**{field: value}), RecordingRunner())


def test_engine_properties_and_default_layout() -> None:
    runner = RecordingRunner()
    engine = resin.Engine(config(eos_token_ids=[2, 3], vocab_size=1000), runner)
    assert engine.runner is runner
    c = engine.config
    assert (c.page_size, c.num_pages, c.max_model_len, c.eos_token_ids, c.vocab_size, c.policy) == (
        4,
        64,
        64,
        [2, 3],
        1000,
        "fcfs",
    )
    layout = engine.layout
    assert (layout.num_pages, layout.page_size, len(layout.groups)) == (64, 4, 1)
    assert layout.groups[0].spec.kind == "full" and layout.groups[0].layer_indices == [0]
    assert (engine.num_free_pages, engine.num_running, engine.num_waiting) == (63, 0, 0)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("empty", "prompt"),
        ("equal", "max_model_len"),
        ("longer", "max_model_len"),
        ("duplicate", "dup-id"),
    ],
)
def test_add_request_rejects_and_queues_nothing(case: str, field: str) -> None:
    engine = resin.Engine(config(max_model_len=16), RecordingRunner())
    if case == "duplicate":
        engine.add_request("dup-id", [1, 2, 3])
    prompt = {
        "empty": [],
        "equal": list(range(16)),
        "longer": list(range(17)),
        "duplicate": [4, 5],
    }[case]
    waiting = engine.num_waiting
    with pytest.raises(ValueError, match=field):
        engine.add_request("dup-id", prompt, SamplingParams(max_tokens=2))
    assert engine.num_waiting == waiting and engine.num_free_pages == 63
    engine.add_request("ok", list(range(15)), SamplingParams(max_tokens=2))
    assert engine.num_waiting == waiting + 1


def test_abort_waiting_running_and_mid_prefill() -> None:
    h = Harness(config(max_num_seqs=2, max_num_batched_tokens=8))
    h.add("run", [1, 2, 3], SamplingParams(max_tokens=50))
    h.add("chunk", list(range(10, 40)), SamplingParams(max_tokens=5))
    h.add("wait", [7, 8, 9], SamplingParams(max_tokens=5))
    h.step()
    h.step()  # "run" decoding, "chunk" mid-prefill, "wait" waiting (max_num_seqs=2)
    assert (h.engine.num_running, h.engine.num_waiting) == (2, 1)
    assert h.engine.abort("nope") is False
    assert h.abort("wait") and h.abort("chunk") and h.abort("run")
    assert (h.engine.num_running, h.engine.num_waiting) == (0, 0)
    assert h.engine.num_free_pages == 63  # pages return at abort time
    assert h.engine.abort("run") is False  # already aborted
    outs = {o.request_id: o for o in h.step()}
    assert {r: (o.finished, o.finish_reason, len(o.token_ids)) for r, o in outs.items()} == {
        "run": (True, "abort", 2),
        "chunk": (True, "abort", 0),
        "wait": (True, "abort", 0),
    }
    assert not h.engine.has_unfinished()
    h.engine.check_integrity()


def test_abort_between_schedule_and_update() -> None:
    engine = resin.Engine(config(), RecordingRunner())
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=3))
    plan = engine.schedule()
    assert engine.abort("a") is True
    outs = engine.update(
        plan,
        resin.ForwardOutput(
            token_ids=np.zeros(2, np.uint32), token_indptr=np.arange(3, dtype=np.uint32)
        ),
    )
    reports = {o.request_id: o for o in outs}
    while engine.has_unfinished():
        reports.update({o.request_id: o for o in engine.step() if o.finished})
    assert (reports["a"].finish_reason, reports["b"].finish_reason) == ("abort", "length")
    assert len(reports["b"].token_ids) == 3
    engine.check_integrity()
    assert engine.num_free_pages == 63


def test_stop_conditions() -> None:
    prompts = {
        "eos": [1, 1],
        "stop_id": [1, 2],
        "ignore": [1, 3],
        "min": [1, 4],
        "min_stop": [1, 5],
        "cap": list(range(10, 20)),
    }
    script = {
        "eos": [5, 6, 2, 8],
        "stop_id": [5, 6, 8, 8],
        "ignore": [2] * 4,
        "min": [2] * 8,
        "min_stop": [6] * 8,
        "cap": [8] * 20,
    }
    runner = scripted(script, {r: len(p) for r, p in prompts.items()}, avoid_banned=True)
    h = Harness(config(eos_token_ids=[2], max_model_len=16), runner)
    params = {
        "eos": SamplingParams(max_tokens=10),
        "stop_id": SamplingParams(stop_token_ids=[6]),
        "ignore": SamplingParams(max_tokens=4, ignore_eos=True),
        "min": SamplingParams(max_tokens=8, min_tokens=3),
        "min_stop": SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[6]),
        "cap": SamplingParams(max_tokens=100),
    }
    for rid, prompt in prompts.items():
        h.add(rid, prompt, params[rid])
    final = h.run()
    got = {r: (o.token_ids, o.finish_reason) for r, o in final.items()}
    assert got == {
        "eos": ([5, 6, 2], "stop"),
        "stop_id": ([5, 6], "stop"),
        "ignore": ([2] * 4, "length"),
        "min": ([5, 5, 5, 2], "stop"),
        "min_stop": ([5, 5, 6], "stop"),
        "cap": ([8] * 6, "length"),
    }


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["p5", "p1", "p3", "p1b"]), ("priority", ["p1", "p1b", "p3", "p5"])],
)
def test_scheduling_policy_order(policy: str, order: list[str]) -> None:
    h = Harness(config(max_num_seqs=1, policy=policy))
    for rid, priority in [("p5", 5), ("p1", 1), ("p3", 3), ("p1b", 1)]:
        h.add(rid, [1, 2, 3, priority], SamplingParams(max_tokens=2, priority=priority))
    h.run()
    first_seen: list[str] = []
    for plan in h.runner.plans:
        first_seen += [r for r in plan["request_ids"] if r not in first_seen]
    assert first_seen == order


@pytest.mark.parametrize(("policy", "protected"), [("fcfs", "r0"), ("priority", "r1")])
def test_preemption_under_a_tiny_pool_finishes_everything(policy: str, protected: str) -> None:
    token = lambda rid, seq_len: 100 * int(rid[1:]) + seq_len  # noqa: E731
    h = Harness(
        config(num_pages=12, max_num_seqs=4, max_model_len=40, policy=policy),
        RecordingRunner(token),
    )
    for i, priority in enumerate([3, 0, 2, 1]):
        h.add(
            f"r{i}", [50 + i] * 3 + list(range(5)), SamplingParams(max_tokens=16, priority=priority)
        )
    final = h.run()  # the harness checks recomputed rows carry prompt + generated tokens
    for i in range(4):
        assert final[f"r{i}"].token_ids == [100 * i + 8 + k for k in range(16)]
        assert final[f"r{i}"].finish_reason == "length"
    metrics = parse_metrics(h.engine.metrics_text())
    # The victim is the newest (FCFS) or lowest-priority request, never the one served first.
    assert h.preempted and protected not in h.preempted
    assert sample_value(metrics, "resin:num_preemptions_total") == len(h.preempted)
    assert h.engine.num_free_pages == 11
    h.engine.reset_prefix_cache()
    assert h.engine.num_free_pages == 11


def test_metrics_text_is_prometheus_text() -> None:
    engine = resin.Engine(config(), RecordingRunner())
    parse_metrics(engine.metrics_text())
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    m = parse_metrics(engine.metrics_text())
    required = {
        "resin:num_requests_running": "gauge",
        "resin:num_requests_waiting": "gauge",
        "resin:prompt_tokens_total": "counter",
        "resin:generation_tokens_total": "counter",
        "resin:request_success_total": "counter",
        "resin:num_preemptions_total": "counter",
        "resin:prefix_cache_queries_total": "counter",
        "resin:prefix_cache_hits_total": "counter",
        "resin:time_to_first_token_seconds": "histogram",
        "resin:e2e_request_latency_seconds": "histogram",
        "resin:request_queue_time_seconds": "histogram",
    }
    assert {n: m["types"].get(n) for n in required} == required
    assert {"resin:kv_cache_usage_perc", "resin:gpu_cache_usage_perc"} & set(m["types"])
    assert {"resin:inter_token_latency_seconds", "resin:time_per_output_token_seconds"} & set(
        m["types"]
    )
    assert sample_value(m, "resin:e2e_request_latency_seconds_count") == 1


def test_metrics_values() -> None:
    script = {"r0": [7] * 3, "r1": [7] * 4, "r2": [7] * 5, "r3": [7, 2, 7]}
    prompts = {r: [10 + i] * (5 + i) for i, r in enumerate(script)}
    runner = scripted(
        {**script, "again": [7]}, {"again": 5, **{r: len(p) for r, p in prompts.items()}}
    )
    h = Harness(config(eos_token_ids=[2], max_num_seqs=2), runner)
    for rid, prompt in prompts.items():
        h.add(rid, prompt, SamplingParams(max_tokens=len(script[rid])))
    h.step()
    m = parse_metrics(h.engine.metrics_text())
    assert sample_value(m, "resin:num_requests_running") == h.engine.num_running == 2
    assert sample_value(m, "resin:num_requests_waiting") == h.engine.num_waiting == 2
    usage = next(
        n for n in ("resin:kv_cache_usage_perc", "resin:gpu_cache_usage_perc") if n in m["types"]
    )
    assert 0 < sample_value(m, usage) <= 1
    h.run()
    h.add("again", prompts["r0"], SamplingParams(max_tokens=1))
    h.run()
    m = parse_metrics(h.engine.metrics_text())
    assert sample_value(m, "resin:prompt_tokens_total") == 5 + 6 + 7 + 8 + 5
    assert sample_value(m, "resin:generation_tokens_total") == 3 + 4 + 5 + 2 + 1
    success = "resin:request_success_total"
    assert sample_value(m, success, finished_reason="length") == 4
    assert sample_value(m, success, finished_reason="stop") == 1
    assert sample_value(m, "resin:prefix_cache_queries_total") == 5 + 6 + 7 + 8 + 5
    assert sample_value(m, "resin:prefix_cache_hits_total") == 4
    assert h.final["again"].num_cached_tokens == 4
    assert (
        sample_value(m, "resin:num_requests_running")
        == sample_value(m, "resin:num_requests_waiting")
        == 0
    )
    assert sample_value(m, usage) == 0
    for name in (
        "resin:time_to_first_token_seconds",
        "resin:e2e_request_latency_seconds",
        "resin:request_queue_time_seconds",
    ):
        assert m["types"][name] == "histogram" and sample_value(m, name + "_count") == 5, name
    itl = next(
        n
        for n in ("resin:inter_token_latency_seconds", "resin:time_per_output_token_seconds")
        if n in m["types"]
    )
    assert sample_value(m, itl + "_count") == (3 + 4 + 5 + 2 + 1) - 5
    assert m["types"]["resin:num_preemptions_total"] == "counter"


def test_logprobs_reach_request_outputs() -> None:
    class LogprobRunner:
        def forward(self, plan: Any) -> resin.ForwardOutput:
            n = plan.num_sequences
            seq = plan.seq_lens.astype(np.int64)
            return resin.ForwardOutput(
                token_ids=(100 + seq).astype(np.uint32),
                token_indptr=np.arange(n + 1, dtype=np.uint32),
                logprobs=(-seq / 4).astype(np.float32),
                top_logprob_ids=np.stack([200 + seq, 300 + seq], axis=1).astype(np.uint32),
                top_logprobs=np.stack([-seq / 8, -seq / 2], axis=1).astype(np.float32),
            )

    engine = resin.Engine(config(), LogprobRunner())
    wanted = {"k2": 2, "k1": 1, "k0": 0, "none": None}
    for rid, k in wanted.items():
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=3, logprobs=k))
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, k in wanted.items():
        out = final[rid]
        assert out.token_ids == [103, 104, 105]
        if k is None:
            assert out.logprobs is None
            continue
        expected = []
        for n in (3, 4, 5):
            entry = {100 + n: -n / 4}
            entry.update(list({200 + n: -n / 8, 300 + n: -n / 2}.items())[:k])
            expected.append(entry)
        assert out.logprobs == expected, rid


THREADS = textwrap.dedent("""
    import json, threading
    import numpy as np
    import resin

    class Runner:
        def __init__(self):
            self.calls, self.go, self.aborted = 0, threading.Event(), threading.Event()
        def forward(self, plan):
            self.calls += 1
            if self.calls == 3:
                self.go.set()
                self.aborted.wait(5)  # let an abort land while forward runs, if it can
            return resin.ForwardOutput(token_ids=np.zeros(plan.num_sequences, dtype=np.uint32),
                                       token_indptr=np.arange(plan.num_sequences + 1, dtype=np.uint32))

    runner = Runner()
    engine = resin.Engine(resin.EngineConfig(page_size=4, num_pages=256, max_num_seqs=8,
                                             max_num_batched_tokens=64, max_model_len=512), runner)
    ids = [f"r{i}" for i in range(16)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(1, 6 + i)), resin.SamplingParams(max_tokens=40))
    final, errors, aborted = {}, [], []

    def stepper():
        try:
            for _ in range(10000):
                if not engine.has_unfinished() and len(final) == len(ids):
                    break
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = [out.finish_reason, len(out.token_ids)]
        except BaseException as e:
            errors.append("stepper: " + repr(e))

    def aborter():
        try:
            runner.go.wait(30)
            for rid in ids[::2]:
                if engine.abort(rid):
                    aborted.append(rid)
                runner.aborted.set()
        except BaseException as e:
            errors.append("aborter: " + repr(e))

    threads = [threading.Thread(target=stepper), threading.Thread(target=aborter)]
    for t in threads: t.start()
    for t in threads: t.join()
    engine.check_integrity()
    print(json.dumps({"final": final, "errors": errors, "aborted": aborted,
                      "free": engine.num_free_pages}))
""")


def test_engine_from_two_threads() -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"deadlock: stepping + aborting from two threads did not finish ({error})")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert sorted(result["final"]) == sorted(f"r{i}" for i in range(16))
    assert result["aborted"], "no abort landed before the requests finished"
    for rid, (reason, length) in result["final"].items():
        if rid in result["aborted"]:
            assert reason == "abort" and length < 40, (rid, reason, length)
        else:
            assert (reason, length) == ("length", 40), (rid, reason, length)
    assert result["free"] == 255
