"""Tests of ``resin.sampling.Sampler``, through the engine and on its own.

A table runner gives each sampling row the logits ``TABLE[last token]``, so a reference can
be computed independently in numpy: penalties (repetition on prompt + output, frequency and
presence on output), banned stop tokens before ``min_tokens``, seeds reproducible whatever
the batch (and across preemption), top-k / top-p / min-p masks, logprobs = log_softmax.
The batched draw (:func:`resin.sampling.sample_tokens`) is checked on its own at a vocabulary
larger than its candidate set against a float64 inverse-CDF reference, row by row and batched;
seeded draws through the engine pass a chi-square test against the filtered softmax.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import resin
from resin.sampling import (
    CANDIDATES,
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    sample_tokens,
)
from resin.sampling_state import sample_uniforms

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
    prompt: list[int],
    num_tokens: int,
    repetition: float,
    frequency: float,
    presence: float,
    bias: dict[int, float] | None = None,
) -> list[int]:
    """Independent numpy reference of penalised greedy decoding over TABLE (``bias`` added to
    the logits first, as vLLM orders logit_bias and the penalties)."""
    outputs: list[int] = []
    for _ in range(num_tokens):
        logits = TABLE[(prompt + outputs)[-1]].copy()
        for token, value in (bias or {}).items():
            logits[token] += np.float32(value)
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


def test_logit_bias_before_the_penalties_matches_reference() -> None:
    bias = {3: 2.5, 7: -100.0, 20: 1.25, 31: 4.0}
    penalties = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias, **penalties)
    plain = resin.SamplingParams(max_tokens=10, temperature=0.0, **penalties)
    requests = {f"{name}": (prompt, params) for name, prompt in PROMPTS.items()}
    requests.update({f"{name}-plain": (prompt, plain) for name, prompt in PROMPTS.items()})
    finished = generate(requests)
    for name, prompt in PROMPTS.items():
        expected = reference_penalised_greedy(prompt, 10, 1.4, 0.3, 0.2, bias)
        assert finished[name].token_ids == expected, name
        assert 7 not in expected
        unbiased = reference_penalised_greedy(prompt, 10, 1.4, 0.3, 0.2)
        assert finished[f"{name}-plain"].token_ids == unbiased  # nothing leaks to other rows
        assert expected != unbiased  # the test exercises the bias
    # +100 all but forces a token, whatever the sampling settings
    forced = resin.SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, logit_bias={11: 100})
    assert generate({"f": ([1, 2], forced)})["f"].token_ids == [11] * 6


def test_logit_bias_is_checked() -> None:
    assert resin.SamplingParams(logit_bias={4: 1}).logit_bias == {4: 1.0}
    for bias, message in (
        ({4: 101.0}, "must be in \\[-100, 100\\]"),
        ({4: float("nan")}, "must be in"),
        ({-1: 1.0}, "logit_bias: must be in \\[0, 2\\*\\*32\\)"),
    ):
        with pytest.raises(ValueError, match=message):
            resin.SamplingParams(logit_bias=bias)
    engine = resin.Engine(resin.EngineConfig(vocab_size=VOCAB_SIZE), TableRunner())
    with pytest.raises(ValueError, match="logit_bias: token 32 is not below vocab_size 32"):
        engine.add_request("r", [1], resin.SamplingParams(logit_bias={32: 1.0}))


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


def test_sample_uniforms_are_splitmix64_of_the_seed_mix() -> None:
    # splitmix64 from state 0 first outputs 0xE220A8397B1DCDAF (its published test vector);
    # sample_seed(0, 0) = 0, so the uniform is that output's top 24 bits.
    assert sample_uniforms(np.array([0]), np.array([0]))[0] == np.float32(0xE220A8 / 2**24)
    seeds = np.array([7, 7, 7, 8, 2**40], dtype=np.int64)
    indices = np.array([0, 1, 2, 0, 5], dtype=np.int64)
    u = sample_uniforms(seeds, indices)
    assert u.dtype == np.float32 and ((u >= 0) & (u < 1)).all()
    assert len(set(u.tolist())) == len(u)  # every (seed, index) its own number
    one_by_one = [sample_uniforms(seeds[i : i + 1], indices[i : i + 1])[0] for i in range(5)]
    assert u.tolist() == one_by_one
    many = sample_uniforms(np.arange(20000), np.zeros(20000, dtype=np.int64))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.std()) - 12**-0.5) < 0.01


BIG_VOCAB = 1000  # > CANDIDATES: rows draw inside the candidates or over the whole vocabulary


def reference_draw(
    logits: np.ndarray, top_k: int, top_p: float, min_p: float, u: float
) -> tuple[int, float, int]:
    """Independent float64 reference of one row's draw: the kept set (top-k with ties, top-p
    over the survivors in descending order, min-p against the top probability), then the first
    kept token in token-id order whose cumulative probability exceeds ``u``. Returns the token,
    the distance of the nearest decision (a threshold or a CDF step) from the row's values,
    and the number of kept tokens."""
    x = logits.astype(np.float64)
    keep = np.ones(len(x), dtype=bool)
    margin = np.inf
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        masked = np.where(keep, x, -np.inf)
        probs = np.exp(masked - masked.max())
        probs /= probs.sum()
        order = np.argsort(-masked, kind="stable")
        cumulative = np.cumsum(probs[order])
        first = min(int(np.searchsorted(cumulative, top_p)), len(x) - 1)
        margin = min(margin, float(np.abs(cumulative - top_p).min()))
        keep &= x >= masked[order[first]]
    if min_p > 0:
        cut = x.max() + np.log(min_p)
        margin = min(margin, float(np.abs(x - cut).min()))
        keep &= x >= cut
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    cdf = np.cumsum(probs) / probs.sum()
    margin = min(margin, float(np.abs(cdf - u).min()))
    return int(np.searchsorted(cdf, u, side="right")), margin, int(keep.sum())


def random_rows(num_rows: int, seed: int) -> tuple[np.ndarray, list[tuple[int, float, float]]]:
    """Logits from peaked to flat, and settings covering every filter, alone and together."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.5, 2.0, 6.0], size=(num_rows, 1))
    logits = (rng.normal(0.0, 1.0, (num_rows, BIG_VOCAB)) * scale).astype(np.float32)
    choices = [
        (0, 1.0, 0.0),
        (1, 1.0, 0.0),
        (40, 1.0, 0.0),
        (600, 1.0, 0.0),
        (0, 0.9, 0.0),
        (0, 0.3, 0.0),
        (50, 0.8, 0.0),
        (700, 0.95, 0.0),
        (0, 1.0, 0.05),
        (20, 0.9, 0.1),
    ]
    return logits, [choices[i % len(choices)] for i in rng.permutation(num_rows)]


def draw(logits: np.ndarray, settings: list[tuple[int, float, float]], u: np.ndarray) -> list[int]:
    top_k, top_p, min_p = (np.array(column) for column in zip(*settings))
    return sample_tokens(
        torch.from_numpy(logits),
        torch.from_numpy(top_k.astype(np.int64)),
        torch.from_numpy(top_p.astype(np.float32)),
        torch.from_numpy(min_p.astype(np.float32)),
        torch.from_numpy(u.astype(np.float32)),
    ).tolist()


def test_batched_draw_matches_the_reference_inverse_cdf() -> None:
    logits, settings = random_rows(300, seed=3)
    u = np.random.default_rng(4).random(300).astype(np.float32)
    tokens = draw(logits, settings, u)
    checked, kept_sizes = 0, []
    for row, (top_k, top_p, min_p) in enumerate(settings):
        expected, margin, num_kept = reference_draw(logits[row], top_k, top_p, min_p, u[row])
        kept_sizes.append(num_kept)
        if margin > 1e-4:  # float32 vs float64 can only disagree at a decision's edge
            assert tokens[row] == expected, (row, settings[row])
            checked += 1
    assert checked > 0.9 * len(settings)
    # Both ways of drawing were exercised: kept sets inside the candidates and past them.
    assert min(kept_sizes) < CANDIDATES < max(kept_sizes)


def test_draw_of_a_row_does_not_depend_on_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, settings = random_rows(120, seed=5)
    u = np.random.default_rng(6).random(120).astype(np.float32)
    batched = draw(logits, settings, u)
    alone = [draw(logits[r : r + 1], settings[r : r + 1], u[r : r + 1])[0] for r in range(120)]
    assert batched == alone
    order = np.random.default_rng(7).permutation(120)
    shuffled = draw(logits[order], [settings[i] for i in order], u[order])
    assert shuffled == [batched[i] for i in order]
    # Drawing every row among the candidates (as many as the vocabulary) gives the same tokens.
    monkeypatch.setattr("resin.sampling_draw.CANDIDATES", BIG_VOCAB)
    assert draw(logits, settings, u) == batched


def chi_square_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the cells expecting >= 5 draws (the rest pooled in one), and
    its degrees of freedom."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    return float(((observed - expected)[keep] ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def chi_square_999(df: int) -> float:
    """The Wilson-Hilferty approximation of the 99.9% chi-square quantile (0.1% false alarms),
    slightly above the exact value: df 5 -> 20.8 (exact 20.5), 10 -> 29.8 (29.6), 31 -> 61.2
    (61.1)."""
    z, a = 3.0902, 2.0 / (9 * df)
    return float(df * (1 - a + z * a**0.5) ** 3)


@pytest.mark.parametrize(
    "settings", [dict(temperature=1.0), dict(temperature=0.6, top_k=8), dict(top_p=0.8)]
)
def test_seeded_draws_follow_the_filtered_softmax(settings: dict[str, Any]) -> None:
    """2,000 requests seeded 0..1999 draw one token each from TABLE[3]: the counts pass a
    chi-square test against softmax(logits / T) restricted to the kept set, and fail it
    against a shifted distribution (so the test can fail)."""
    token, num_requests = 3, 2000
    requests = {
        f"r{i}": ([token], resin.SamplingParams(max_tokens=1, seed=i, **settings))
        for i in range(num_requests)
    }
    finished = generate(requests, num_pages=2 * num_requests + 8, max_num_seqs=256)
    counts = np.bincount([out.token_ids[0] for out in finished.values()], minlength=VOCAB_SIZE)
    params = resin.SamplingParams(**settings)
    scaled = torch.from_numpy(TABLE[token] / np.float32(params.temperature))[None]
    kept = apply_top_p(
        apply_top_k(scaled, torch.tensor([params.top_k])), torch.tensor([params.top_p])
    )
    probs = torch.softmax(kept, dim=-1)[0].double().numpy()
    statistic, df = chi_square_statistic(counts, probs)
    assert statistic < chi_square_999(df), (statistic, df, counts)
    shifted = np.roll(probs, 1)
    statistic, df = chi_square_statistic(counts, shifted)
    assert statistic > chi_square_999(df)
