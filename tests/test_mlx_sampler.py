"""The MLX sampler has the torch sampler's semantics and seeds contract.

- On the same logits and plans (logits = a fixed table row of each row's last token, so every
  step is reproducible), through a real engine with chunked prefill and preemption: greedy rows
  with repetition / frequency / presence penalties and ``min_tokens`` bans pick the torch
  sampler's token, with its log-probs and top log-probs; top-k 1, a tiny top-p and min-p 1 all
  reduce sampling to the penalised argmax, as they do in torch.
- Seeds: a seeded request draws the same tokens alone, in a batch of others and under
  preemption (its stream depends on (seed, output index) only); the draws follow
  ``softmax(logits / temperature)`` (frequencies of 1,200 one-token requests with distinct
  seeds within 0.06 of the probabilities, three standard deviations).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

import resin  # noqa: E402
from resin.runners.mlx.sampler import MlxSampler  # noqa: E402
from resin.sampling import Sampler  # noqa: E402
from resin.sampling_state import sampling_rows  # noqa: E402

VOCAB_SIZE = 24
TABLE = np.random.default_rng(3).normal(0.0, 2.0, (VOCAB_SIZE, VOCAB_SIZE)).astype(np.float32)
EOS = 2


def _logits(plan: resin.BatchPlan) -> tuple[np.ndarray, np.ndarray]:
    rows, last = sampling_rows(plan)
    return rows, TABLE[plan.input_ids[last].astype(np.int64)]


class TwinRunner:
    """Samples every step with both samplers on the same logits; commits the torch tokens and
    records both outputs."""

    def __init__(self) -> None:
        self.torch_sampler = Sampler(VOCAB_SIZE)
        self.mlx_sampler = MlxSampler(VOCAB_SIZE)
        self.pairs: list[tuple[resin.BatchPlan, Any, Any, np.ndarray]] = []

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.torch_sampler.begin_step(plan)
        self.mlx_sampler.begin_step(plan)
        rows, logits = _logits(plan)
        expected = self.torch_sampler.sample(torch.from_numpy(logits), plan, rows)
        got = self.mlx_sampler.sample(mx.array(logits), plan, rows)
        self.pairs.append((plan, expected, got, rows))
        return expected


class MlxOnlyRunner:
    def __init__(self) -> None:
        self.sampler = MlxSampler(VOCAB_SIZE)

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.sampler.begin_step(plan)
        rows, logits = _logits(plan)
        return self.sampler.sample(mx.array(logits), plan, rows)


def _engine(runner: Any, **config: Any) -> resin.Engine:
    settings = {"page_size": 4, "num_pages": 128, "max_model_len": 64, "eos_token_ids": [EOS]}
    return resin.Engine(resin.EngineConfig(**{**settings, **config}), runner)


def _drive(engine: resin.Engine, requests: dict[str, tuple[list[int], Any]]) -> dict[str, Any]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.token_ids)
    engine.check_integrity()
    return finished


def _preemptions(engine: resin.Engine) -> float:
    for line in engine.metrics_text().splitlines():
        if line.startswith("resin:num_preemptions_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


GREEDY_LIKE = {
    "penalties": resin.SamplingParams(
        max_tokens=12,
        temperature=0.0,
        repetition_penalty=1.6,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        logprobs=3,
    ),
    "min_tokens": resin.SamplingParams(max_tokens=8, temperature=0.0, min_tokens=6, logprobs=0),
    "top_k_1": resin.SamplingParams(max_tokens=8, temperature=0.8, top_k=1, seed=5),
    "tiny_top_p": resin.SamplingParams(
        max_tokens=8, temperature=1.3, top_p=1e-4, seed=6, repetition_penalty=1.4
    ),
    "min_p_1": resin.SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, seed=7),
    "logit_bias": resin.SamplingParams(
        max_tokens=8,
        temperature=0.0,
        repetition_penalty=1.3,
        logit_bias={3: 2.5, 5: -100.0, 11: 1.5, 23: 3.0},
        logprobs=2,
    ),
}


@pytest.mark.parametrize(
    "config",
    [dict(), dict(page_size=1, num_pages=42, max_model_len=40, max_num_batched_tokens=5)],
    ids=["plain", "chunked_preempted"],
)
def test_same_tokens_and_logprobs_as_the_torch_sampler(config: dict[str, Any]) -> None:
    runner = TwinRunner()
    prompts = [[1, 3, 5, 7, 9, 11, 13], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8], [2, 6, 10]]
    requests = {
        f"{name}-{i}": (prompt, params)
        for name, params in GREEDY_LIKE.items()
        for i, prompt in enumerate(prompts)
    }
    engine = _engine(runner, **config)
    finished = _drive(engine, requests)
    assert len(finished) == len(requests)
    assert (_preemptions(engine) > 0) == bool(config)
    checked = logprob_rows = 0
    for plan, expected, got, rows in runner.pairs:
        np.testing.assert_array_equal(got.token_indptr, expected.token_indptr)
        sampled = np.asarray(expected.token_indptr[rows], dtype=np.int64)
        np.testing.assert_array_equal(got.token_ids[sampled], expected.token_ids[sampled])
        checked += len(sampled)
        if expected.logprobs is not None:
            asks = plan.sampling.num_logprobs[rows] >= 0
            at = sampled[asks]
            np.testing.assert_allclose(got.logprobs[at], expected.logprobs[at], atol=1e-5)
            np.testing.assert_array_equal(got.top_logprob_ids[at], expected.top_logprob_ids[at])
            np.testing.assert_allclose(got.top_logprobs[at], expected.top_logprobs[at], atol=1e-5)
            logprob_rows += len(at)
    assert checked >= sum(p.max_tokens for _, p in requests.values()) - len(requests)
    assert logprob_rows > 0
    # min_tokens banned the EOS the table would otherwise pick: no early stop below 6 tokens
    assert all(len(finished[f"min_tokens-{i}"]) >= 6 for i in range(len(prompts)))


SEEDED = resin.SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=8, seed=1234)


@pytest.mark.parametrize(
    "config",
    [dict(), dict(page_size=1, num_pages=32, max_model_len=30, max_num_batched_tokens=5)],
    ids=["batched", "preempted"],
)
def test_seeded_stream_is_the_same_alone_and_in_a_batch(config: dict[str, Any]) -> None:
    prompt = [1, 5, 9, 13]
    alone = _drive(_engine(MlxOnlyRunner()), {"s": (prompt, SEEDED)})["s"]
    others = {
        # ignore_eos: these are unseeded, and an early EOS could end them before the pool fills
        # (no preemption: the preempted case flaked in CI)
        f"o{i}": (
            [i + 3, i + 4, 7],
            resin.SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True),
        )
        for i in range(5)
    }
    engine = _engine(MlxOnlyRunner(), **config)
    crowded = _drive(engine, {**others, "s": (prompt, SEEDED)})
    assert crowded["s"] == alone
    assert (_preemptions(engine) > 0) == bool(config)
    again = _drive(_engine(MlxOnlyRunner()), {"s": (prompt, SEEDED)})["s"]
    assert again == alone
    reseeded = resin.SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=8, seed=99)
    assert _drive(_engine(MlxOnlyRunner()), {"s": (prompt, reseeded)})["s"] != alone


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_seeded_draws_follow_the_tempered_softmax(temperature: float) -> None:
    num_requests, token = 1200, 0
    requests = {
        f"r{i}": ([token], resin.SamplingParams(max_tokens=1, temperature=temperature, seed=i))
        for i in range(num_requests)
    }
    engine = _engine(
        MlxOnlyRunner(), num_pages=2 * num_requests + 8, max_num_seqs=256, eos_token_ids=[]
    )
    finished = _drive(engine, requests)
    counts = np.bincount([t[0] for t in finished.values()], minlength=VOCAB_SIZE)
    scaled = TABLE[token] / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    assert np.abs(counts / num_requests - probs).max() < 0.06, (counts, probs)


class FlatRunner(MlxOnlyRunner):
    """Every step the same near-uniform logits, whatever the tokens."""

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.sampler.begin_step(plan)
        rows, _ = sampling_rows(plan)
        logits = np.tile(np.linspace(0.0, 0.2, VOCAB_SIZE, dtype=np.float32), (len(rows), 1))
        return self.sampler.sample(mx.array(logits), plan, rows)


def test_seeded_stream_advances_with_the_output_index() -> None:
    """Equal logits at every step: a stream that did not move with the output index would
    repeat one token (the torch sampler's contract: generator of (seed, output index))."""
    params = resin.SamplingParams(max_tokens=12, temperature=1.0, seed=42)
    tokens = _drive(_engine(FlatRunner(), eos_token_ids=[]), {"s": ([1, 2], params)})["s"]
    assert len(set(tokens)) > 4, tokens
