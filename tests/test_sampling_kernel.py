"""The draw in one Rust call (``_core.sample_rows``, resin/sampling_kernel.py) gives the torch
path's tokens, bit for bit, and ``_core.softmax`` gives torch's softmax bits.

Every comparison is ``==`` on tokens or on float bits: the kernel restates the torch path's
arithmetic (SLEEF's ``expf``, ATen's order of additions, the cumulative sums), so a token that
differs is a bug, not rounding. The uniforms and top-p masses are put on the rows' cumulative
sums (``edge_uniforms``, ``edge_top_p``), where a sum one ulp off picks another token. On a
machine whose torch softmax the kernel does not restate (the probe says so) the bit tests skip
and the sampler's fallback is what is tested.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import resin
import resin.sampling_kernel as sampling_kernel
from resin import _core
from resin.sampling import Sampler
from resin.sampling_draw import draw_tokens
from resin.sampling_workspace import Workspace
from tests.test_sampling_fast_path import (
    NUCLEUS_SUMS,
    TableRunner,
    batch,
    edge_top_p,
    edge_uniforms,
    generate,
    random_logits,
    reference_sample_tokens,
)

LANES = sampling_kernel.softmax_lanes()
needs_bits = pytest.mark.skipif(LANES is None, reason="torch's CPU softmax here is not restated")


def torch_path(logits: torch.Tensor, *settings: torch.Tensor) -> np.ndarray:
    """The torch path's tokens (``draw_tokens``, its Rust searches on)."""
    return draw_tokens(logits, *settings, Workspace()).numpy()


def kernel(logits: torch.Tensor, *settings: torch.Tensor) -> np.ndarray:
    """The kernel's tokens (-1: left) for ``settings`` = temperature, top-k, top-p, min-p and
    uniforms, every row in order."""
    temperature, top_k, top_p, min_p, uniforms = settings
    rows = np.arange(len(logits), dtype=np.int64)
    return sampling_kernel.kernel_tokens(
        logits,
        rows,
        temperature.numpy(),
        top_k.numpy(),
        top_p.numpy(),
        min_p.numpy(),
        uniforms.numpy(),
    )


@needs_bits
@pytest.mark.parametrize("width", [1, 7, 8, 9, 16, 17, 255, 256, 1000, 4099, 32000])
@pytest.mark.parametrize("spread", [0.1, 3.0, 60.0])
def test_softmax_is_torchs_bit_for_bit(width: int, spread: float) -> None:
    rng = np.random.default_rng(width)
    x = (rng.normal(0.0, spread, (3, width))).astype(np.float32)
    x[1, ::3] = -np.inf
    x[2, :] = x[2, 0]  # all equal
    want = torch.from_numpy(x).softmax(dim=-1).numpy()
    got = np.empty_like(x)
    _core.softmax(x, LANES, got)
    assert np.array_equal(want.view(np.int32), got.view(np.int32))


@needs_bits
@pytest.mark.parametrize("max_top_k", [63, 127, 256])  # a first search of 64, 128, 256
@pytest.mark.parametrize(
    "vocab_size,num_rows", [(100, 64), (256, 48), (3000, 64), (5003, 96), (40000, 24)]
)
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked", "plateau"])
def test_the_kernel_draws_the_torch_paths_tokens(
    vocab_size: int, num_rows: int, kind: str, max_top_k: int
) -> None:
    if kind == "plateau" and vocab_size < 400:
        pytest.skip("plateaus of up to 400 tokens need a larger vocabulary")
    logits, top_k, top_p, min_p, uniforms, temperature = batch(
        kind, num_rows, vocab_size, 5, max_top_k
    )
    # Masses and uniforms on the rows' cumulative sums (of the plain draw of the scaled rows).
    scaled = logits / temperature[:, None]
    NUCLEUS_SUMS.clear()
    reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    top_p = edge_top_p(top_p, np.random.default_rng(6))
    _, vectors = reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    uniforms = edge_uniforms(vectors, np.random.default_rng(6))
    settings = (temperature, top_k, top_p, min_p, uniforms)
    want = torch_path(logits, *settings)
    got = kernel(logits, *settings)
    taken = got >= 0
    assert np.array_equal(got[taken], want[taken])
    # Left: a top-k past the 256 candidates and a row of nothing but -inf, nothing else.
    wide_top_k = (top_k.numpy() > 256) & (top_k.numpy() < vocab_size)
    assert np.array_equal(~taken, wide_top_k | torch.isneginf(logits).all(dim=1).numpy())
    assert taken.mean() > 0.7


@needs_bits
def test_the_kernel_reads_rows_in_place_and_leaves_what_it_does_not_take() -> None:
    logits = torch.from_numpy(random_logits("peaked", 12, 5003, np.random.default_rng(7)))
    n = 12
    temperature = torch.full((n,), 0.8)
    top_k = torch.zeros(n, dtype=torch.int64)
    top_p = torch.full((n,), 0.9)
    min_p = torch.zeros(n)
    uniforms = torch.full((n,), 0.5)
    logits[0, 3] = float("nan")
    logits[1, 4] = float("inf")
    logits[2, :] = -float("inf")
    temperature[3] = 0.0  # greedy: not the draw's
    temperature[4] = float("nan")
    top_p[5] = float("nan")
    min_p[6] = float("nan")
    top_k[7] = 1000  # past the candidates
    temperature[8] = 1e-38  # the scaled logits overflow
    before = logits.clone()
    got = kernel(logits, temperature, top_k, top_p, min_p, uniforms)
    assert (got[:9] == -1).all() and (got[9:] >= 0).all()
    # Rows in any order, some twice, from a larger tensor: each row's own token.
    rows = np.array([11, 9, 9, 10], dtype=np.int64)
    tokens = sampling_kernel.kernel_tokens(
        logits, rows, *(a.numpy()[rows] for a in (temperature, top_k, top_p, min_p, uniforms))
    )
    assert tokens.tolist() == [got[11], got[9], got[9], got[10]]
    assert torch.equal(logits.isnan(), before.isnan())  # read, never written
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())


@needs_bits
def test_the_thread_split_changes_no_token() -> None:
    """``sample_rows`` and ``argmax`` split their rows over threads: the same tokens."""
    logits, top_k, top_p, min_p, uniforms, temperature = batch("peaked", 40, 5003, 8)
    args = [
        logits.numpy(),
        np.arange(40, dtype=np.int64),
        temperature.numpy(),
        top_k.numpy(),
        top_p.numpy(),
        min_p.numpy(),
        torch.log(min_p.clamp(min=0)).numpy(),
        uniforms.numpy(),
        LANES,
    ]
    runs = []
    for threads in (1, 2, 3, 7, 64):
        tokens = np.empty(40, dtype=np.int64)
        _core.sample_rows(*args, tokens, threads=threads)
        runs.append(tokens)
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    assert (runs[0] >= 0).sum() > 30
    picks = []
    for threads in (1, 2, 5, 64):
        tokens = np.empty(40, dtype=np.int64)
        _core.argmax(args[0], tokens, threads=threads)
        picks.append(tokens)
    assert all(np.array_equal(picks[0], p) for p in picks[1:])
    assert np.array_equal(picks[0], logits.argmax(dim=-1).numpy())
    empty = np.empty(0, dtype=np.int64)
    f32 = np.empty(0, dtype=np.float32)
    _core.sample_rows(
        args[0], empty, f32, empty, f32, f32, f32, f32, LANES, empty.copy(), threads=4
    )


@needs_bits
def test_the_sampler_with_the_kernel_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed settings with penalties, seeds and unseeded rows through the engine: the same
    tokens with the kernel on and off, unseeded rows included (every sampler's generator starts
    from one state, so the uniforms must be drawn in the same order, one call a step); rows the
    kernel leaves (a top-k past 256, with and without a penalty) take the torch path from both
    the logits and the penalised copy."""
    init = Sampler.__init__

    def seeded_init(self: Sampler, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self.generator.manual_seed(0)

    monkeypatch.setattr(Sampler, "__init__", seeded_init)
    drawn, left = [0], [0]
    kernel_tokens = sampling_kernel.kernel_tokens

    def counting(*args: object) -> np.ndarray:
        tokens = kernel_tokens(*args)  # type: ignore[arg-type]
        drawn[0] += int((tokens >= 0).sum())
        left[0] += int((tokens < 0).sum())
        return tokens

    monkeypatch.setattr(sampling_kernel, "kernel_tokens", counting)
    requests = {
        f"r{i}": (
            [i % 7, 3 + i % 5, i % 64],
            dict(MIXED_SETTINGS[i % len(MIXED_SETTINGS)], seed=i if i % 3 else None),
        )
        for i in range(48)
    }
    on = generate(requests)
    assert drawn[0] > 200 and left[0] > 20  # the kernel drew most rows and left some
    monkeypatch.setattr(sampling_kernel, "rows_kernel", False)
    drawn[0] = 0
    off = generate(requests)
    assert drawn[0] == 0
    assert on == off
    # The penalties written into a copy of the rows (no in-place patch) give them too.
    monkeypatch.setattr(Sampler, "_patchable", lambda self, logits: False)
    assert generate(requests) == on


@needs_bits
def test_penalties_patched_in_place_are_restored_when_the_draw_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU path writes a step's penalties, biases and bans into the logits for its pick;
    an error in the pick still leaves the runner's logits bit for bit as they were."""

    def failing(*args: object) -> np.ndarray:
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(sampling_kernel, "kernel_tokens", failing)
    failures = []

    class Runner(TableRunner):
        def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
            self.sampler.begin_step(plan)
            rows = np.arange(plan.num_sequences)
            logits = self.TABLE[: plan.num_sequences].clone()
            before = logits.clone()
            try:
                self.sampler.sample(logits, plan, rows)
            except RuntimeError as error:
                failures.append(str(error))
            assert torch.equal(logits, before)
            n = plan.num_sequences
            return resin.ForwardOutput(np.full(n, 7, np.uint32), np.arange(n + 1, dtype=np.uint32))

    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=64, max_model_len=32, vocab_size=5003),
        Runner(),
    )
    penalised = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3, logit_bias={5: 2.0})
    engine.add_request("a", [1, 2, 3], resin.SamplingParams(max_tokens=3, **penalised))
    engine.add_request(
        "b", [4, 5], resin.SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[9])
    )
    while engine.has_unfinished():
        engine.step()
    assert failures and all("the kernel failed" in f for f in failures)


MIXED_SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=0.8, top_k=50, repetition_penalty=1.2),
    dict(temperature=1.0, top_p=0.9, presence_penalty=0.4),
    dict(temperature=0.6, top_k=40, top_p=0.95, frequency_penalty=0.5),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.9, top_k=1000),  # past the candidates: the torch path's
    dict(temperature=1.1, top_k=2000, repetition_penalty=1.1),  # the same, from the copy
    dict(temperature=0.8, top_p=0.95, logit_bias={5: 3.0, 9: -100.0, 17: 1.5}),
    # greedy and drawn rows with a bias, a penalty and bans (stop tokens before min_tokens)
    dict(
        temperature=0.0,
        presence_penalty=0.5,
        logit_bias={3: 2.0},
        min_tokens=6,
        stop_token_ids=[3, 11],
    ),
    dict(temperature=0.9, frequency_penalty=0.2, min_tokens=6, stop_token_ids=[7]),
]


def test_a_softmax_that_disagrees_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_an_ulp(x: np.ndarray, lanes: int, out: np.ndarray) -> None:
        out[:] = np.nextafter(torch.from_numpy(x).softmax(dim=-1).numpy(), np.float32(1))

    monkeypatch.setattr(sampling_kernel._core, "softmax", off_by_an_ulp)
    sampling_kernel.softmax_lanes.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="keeps the torch path"):
            assert sampling_kernel.softmax_lanes() is None
        assert not sampling_kernel.takes(torch.zeros(2, 8))
        # Sampling goes on through the torch path, with its tokens.
        requests = {"a": ([1, 2, 3], dict(temperature=0.8, top_p=0.9, seed=1))}
        monkeypatch.setattr(sampling_kernel, "rows_kernel", False)
        want = generate(requests)["a"]
        monkeypatch.setattr(sampling_kernel, "rows_kernel", True)
        assert generate(requests)["a"] == want
    finally:
        monkeypatch.undo()
        sampling_kernel.softmax_lanes.cache_clear()


def test_a_build_without_the_kernel_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(sampling_kernel._core, "softmax")
    sampling_kernel.softmax_lanes.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="keeps the torch path"):
            assert sampling_kernel.softmax_lanes() is None
    finally:
        monkeypatch.undo()
        sampling_kernel.softmax_lanes.cache_clear()


def test_sample_rows_refuses_bad_arguments() -> None:
    logits = np.zeros((4, 300), dtype=np.float32)
    n = 2
    f32, i64 = np.zeros(n, np.float32), np.zeros(n, np.int64)
    ones = np.ones(n, np.float32)
    rows = np.array([0, 3], dtype=np.int64)
    out = np.empty(n, np.int64)
    _core.sample_rows(logits, rows, ones, i64, ones, f32, f32 - np.inf, f32, 8, out)
    cases = [
        ((logits, np.array([0, 4]), ones, i64, ones, f32, f32, f32, 8, out), "not a row"),
        ((logits, np.array([-1, 0]), ones, i64, ones, f32, f32, f32, 8, out), "not a row"),
        ((logits, rows, ones[:1], i64, ones, f32, f32, f32, 8, out), "do not agree"),
        ((logits, rows, ones, i64, ones, f32, f32, f32, 8, out[:1]), "do not agree"),
        ((logits, rows, ones, i64, ones, f32, f32, f32, 12, out), "lanes"),
        ((logits[:, ::2], rows, ones, i64, ones, f32, f32, f32, 8, out), "C-contiguous"),
        ((np.zeros((4, 0), np.float32), rows, ones, i64, ones, f32, f32, f32, 8, out), "agree"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _core.sample_rows(*args)
    shared = np.zeros(n, np.int64)  # an output that is an input: numpy's borrow check or ours
    with pytest.raises((ValueError, TypeError), match="overlap|borrowed"):
        _core.sample_rows(logits, rows, ones, shared, ones, f32, f32, f32, 8, shared)
    with pytest.raises(ValueError, match="lanes"):
        _core.softmax(logits, 4, np.empty_like(logits))
    with pytest.raises((ValueError, TypeError), match="overlap|borrowed"):
        _core.softmax(logits, 8, logits)
