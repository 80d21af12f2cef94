"""Tests of ``resin.sampling.Sampler``, through the engine and on its own.

A table runner gives each sampling row the logits ``TABLE[last token]``, so a reference can
be computed independently in numpy: penalties (repetition on prompt + output, frequency and
presence on output), banned stop tokens before ``min_tokens``, seeds reproducible whatever
the batch (and across preemption), top-k / top-p / min-p masks, logprobs = log_softmax.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import resin
from resin.sampling import Sampler, apply_min_p, apply_top_k, apply_top_p

VOCAB_SIZE = 32
TABLE = np.random.default_rng(0).normal(0.0, 2.0, (VOCAB_SIZE, VOCAB_SIZE)).astype(np.float32)


class TableRunner:
    """Logits of a sampling row = TABLE[its last token]; no cache."""

    def __init__(self, table: np.ndarray = TABLE):
        self.table = torch.from_numpy(table.copy())
        self.sampler = Sampler(table.shape[1])

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.sampler.begin_step(plan)
        rows = np.flatnonzero(np.diff(plan.sample_indptr) == 1)
        last_tokens = plan.input_ids[plan.query_indptr[rows + 1] - 1].astype(np.int64)
        return self.sampler.sample(self.table[torch.from_numpy(last_tokens)], plan, rows)


def generate(
    requests: dict[str, tuple[list[int], resin.SamplingParams]],
    table: np.ndarray = TABLE,
    expect_preemption: bool = False,
    **config: Any,
) -> dict[str, Any]:
    engine = resin.Engine(
        resin.EngineConfig(**{"page_size": 4, "num_pages": 256, "max_model_len": 128, **config}),
        TableRunner(table),
    )
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    engine.check_integrity()
    if expect_preemption:
        (line,) = [
            line
            for line in engine.metrics_text().splitlines()
            if line.startswith("resin:num_preemptions_total")
        ]
        assert float(line.split()[-1]) > 0
    return finished


def reference_penalised_greedy(
    prompt: list[int], num_tokens: int, repetition: float, frequency: float, presence: float
) -> list[int]:
    """Independent numpy reference of penalised greedy decoding over TABLE."""
    outputs: list[int] = []
    for _ in range(num_tokens):
        logits = TABLE[(prompt + outputs)[-1]].copy()
        seen = np.zeros(VOCAB_SIZE, dtype=bool)
        seen[prompt + outputs] = True
        logits = np.where(
            seen,
            np.where(logits > 0, logits / np.float32(repetition), logits * np.float32(repetition)),
            logits,
        )
        counts = np.bincount(np.array(outputs, dtype=np.int64), minlength=VOCAB_SIZE)
        logits = logits - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)
        outputs.append(int(np.argmax(logits)))
    return outputs


PROMPTS = {"a": [1, 2, 3], "b": [7, 7, 9, 11, 13, 2, 5, 8, 1, 0, 3], "c": [30, 31, 4, 4, 4]}


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(
            page_size=1,
            num_pages=40,
            max_model_len=32,
            max_num_batched_tokens=4,
            expect_preemption=True,
        ),
    ],
    ids=["plain", "chunked_preempted"],
)
def test_penalties_match_reference(config: dict[str, Any]) -> None:
    penalties = dict(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.5)
    params = resin.SamplingParams(max_tokens=12, temperature=0.0, **penalties)
    # Twice the same prompts: the second copy hits the prefix cache, so its prompt tokens are
    # never in input_ids: penalties must come from new_request_token_ids.
    requests = {
        f"{name}{copy}": (prompt, params) for copy in range(2) for name, prompt in PROMPTS.items()
    }
    finished = generate(requests, **config)
    for request_id, (prompt, _) in requests.items():
        expected = reference_penalised_greedy(prompt, 12, 1.7, 0.6, 0.5)
        assert finished[request_id].token_ids == expected, request_id
        unpenalised = reference_penalised_greedy(prompt, 12, 1.0, 0.0, 0.0)
        assert expected != unpenalised  # the test exercises the penalties


def test_banned_stop_tokens_before_min_tokens() -> None:
    table = TABLE.copy()
    table[:, 5] += 100.0  # token 5 always wins
    params = resin.SamplingParams(max_tokens=8, min_tokens=3, temperature=0.0, stop_token_ids=[5])
    out = generate({"r": ([1, 2], params)}, table)["r"]
    expected, last = [], 2
    for _ in range(3):  # token 5 banned: the best other token
        last = int(np.argmax(np.where(np.arange(VOCAB_SIZE) == 5, -np.inf, table[last])))
        expected.append(last)
    assert out.token_ids == expected + [5]
    assert out.finish_reason == "stop"


def seeded(seed: int, max_tokens: int = 12, **kwargs: Any) -> resin.SamplingParams:
    return resin.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, **kwargs)


def test_seed_reproducible_across_batches() -> None:
    alone = generate({"s": ([1, 2, 3], seeded(7))})["s"].token_ids
    crowd = {
        "x": ([4, 5], seeded(1)),
        "y": ([9] * 7, resin.SamplingParams(max_tokens=20)),
        "s": ([1, 2, 3], seeded(7)),
        "z": ([3, 1], seeded(7, max_tokens=5)),
    }
    assert generate(crowd)["s"].token_ids == alone
    preempted = generate(
        crowd,
        page_size=1,
        num_pages=24,
        max_model_len=23,
        max_num_batched_tokens=3,
        expect_preemption=True,
    )
    assert preempted["s"].token_ids == alone
    assert generate({"s": ([1, 2, 3], seeded(8))})["s"].token_ids != alone


def test_top_k_one_is_greedy_and_masks_hold() -> None:
    greedy = generate({"g": ([1, 2, 3], resin.SamplingParams(max_tokens=10, temperature=0.0))})
    top1 = generate({"g": ([1, 2, 3], seeded(3, max_tokens=10, top_k=1))})
    assert top1["g"].token_ids == greedy["g"].token_ids
    prompt = [1, 2, 3]
    for params, allowed in [
        (seeded(5, 30, top_k=3), lambda row: np.argsort(-row)[:3]),
        (seeded(5, 30, min_p=0.3), lambda row: min_p_allowed(row, 0.3)),
        (seeded(5, 30, top_p=0.5), lambda row: top_p_allowed(row, 0.5)),
    ]:
        tokens = generate({"r": (prompt, params)})["r"].token_ids
        for previous, token in zip(prompt[-1:] + tokens, tokens):
            assert token in allowed(TABLE[previous])


def min_p_allowed(logits: np.ndarray, min_p: float) -> np.ndarray:
    probs = np.exp(logits - logits.max())
    return np.flatnonzero(probs >= min_p * probs.max())


def top_p_allowed(logits: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-logits)
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    num_kept = int(np.searchsorted(np.cumsum(probs), top_p)) + 1  # reach top_p mass
    return order[:num_kept]


def test_mask_functions() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    kept = lambda x: torch.isfinite(x).tolist()  # noqa: E731
    assert kept(apply_top_k(logits, torch.tensor([2, 0]))) == [
        [False, True, True, False],
        [True] * 4,
    ]
    # Row 0 probs ~ [.09, .67, .24, .03]: 0.7 needs the top two; row 1: top_p 1 keeps all.
    assert kept(apply_top_p(logits, torch.tensor([0.7, 1.0]))) == [
        [False, True, True, False],
        [True] * 4,
    ]
    # min_p 0.3: row 0 keeps p >= 0.3 * 0.67 (tokens 1, 2); row 1 keeps p >= 0.3 * p(2).
    assert kept(apply_min_p(logits, torch.tensor([0.3, 0.01]))) == [
        [False, True, True, False],
        [False, False, True, True],
    ]


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    requests = {
        "k3": ([1, 2, 3], seeded(11, 6, logprobs=3)),
        "k0": ([4, 5], resin.SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)),
        "none": ([6], seeded(2, 6)),
    }
    finished = generate(requests)
    assert finished["none"].logprobs is None
    for request_id, num_top in (("k3", 3), ("k0", 0)):
        out = finished[request_id]
        previous = requests[request_id][0][-1:] + out.token_ids
        assert len(out.logprobs) == len(out.token_ids)
        for last, token, entry in zip(previous, out.token_ids, out.logprobs):
            expected = torch.log_softmax(torch.from_numpy(TABLE[last]), dim=-1)
            top = expected.topk(num_top).indices.tolist() if num_top else []
            assert set(entry) == {token, *top}
            for token_id, logprob in entry.items():
                assert logprob == pytest.approx(float(expected[token_id]), abs=1e-5)


def test_slot_state_follows_lifecycle() -> None:
    runner = TableRunner()
    engine = resin.Engine(resin.EngineConfig(page_size=4, num_pages=64, max_model_len=64), runner)
    engine.add_request("a", [1, 2, 3], resin.SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()
    (slot,) = runner.sampler.slots
    assert runner.sampler.slots[slot].num_prompt_tokens == 3
    engine.step()
    assert len(runner.sampler.slots[slot].token_ids) == 4  # prompt + first output (as input)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", [9], resin.SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()
    assert [s.token_ids for s in runner.sampler.slots.values()] == [[9]]
