"""The sampler's fast path gives the tokens of the plain one, bit for bit.

The draw finds a row's candidates with a tree of block maxima instead of ``topk`` over the row,
first among 64 (more for a top-k) of them and only then among all 256, divides only what it
reads by the temperature, finds a wide top-p nucleus among the row's largest probabilities
instead of sorting the row, and writes into reused buffers. Each test here checks one of those
against the plain computation: :func:`reference_sample_tokens` is the draw as it was written
before them (``topk(256)`` of the scaled row, the softmax and cumulative sum of the same
vectors), and the tokens must be equal, not close. Vocabularies are >= 16 x 256, where the tree
and the narrow first search run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import resin
from resin.sampling import Sampler
from resin.sampling_candidates import top_candidates
from resin.sampling_draw import draw_tokens, inverse_cdf, sample_tokens
from resin.sampling_filters import apply_top_p
from resin.sampling_greedy import greedy_tokens
from resin.sampling_penalties import TokenTally
from resin.sampling_state import SlotState
from resin.sampling_workspace import Workspace

C = 256


def reference_sample_tokens(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The batched inverse-CDF draw without the fast path (resin/sampling.py at 9c242cf, the
    wide-nucleus sort ordered by logit): the tokens, and each row's vector of logits the
    inverse CDF ran over (its cumulative sums decide the token); ``NUCLEUS_SUMS[r]`` gets the
    cumulative probabilities a top-p row's nucleus was cut from."""
    vocab_size = scaled.shape[1]
    filtered = ((top_k > 0) & (top_k < vocab_size)) | (top_p < 1) | (min_p > 0)
    tokens = torch.empty(len(scaled), dtype=torch.int64)
    vectors: list[torch.Tensor] = [scaled[r] for r in range(len(scaled))]
    at = (~filtered).nonzero()[:, 0]
    tokens[at] = _reference_inverse_cdf(scaled[at], uniforms[at])[:, 0]
    at = filtered.nonzero()[:, 0]
    if len(at) == 0:
        return tokens, vectors
    logits, top_k, top_p, min_p, u = scaled[at], top_k[at], top_p[at], min_p[at], uniforms[at]
    values, indices = logits.topk(min(C, vocab_size), dim=-1)
    # top-k
    active = (top_k > 0) & (top_k < vocab_size)
    kth = values.gather(1, (top_k.clamp(1, values.shape[1]) - 1)[:, None])[:, 0]
    kth = kth.masked_fill(~active | (top_k > values.shape[1]), -torch.inf)
    for r in (active & (top_k > values.shape[1])).nonzero()[:, 0].tolist():
        kth[r] = logits[r].topk(int(top_k[r])).values[-1]
    threshold = kth.clone()
    # top-p
    for r in (top_p < 1).nonzero()[:, 0].tolist():
        if C < vocab_size and not kth[r] > values[r, -1]:  # over the whole row
            row = logits[r].masked_fill(logits[r] < kth[r], -torch.inf)
            probs = row.softmax(dim=-1)
            order = row.argsort(descending=True, stable=True)
            cumulative = probs[order].cumsum(dim=-1)
            first = min(int((cumulative < top_p[r]).sum()), vocab_size - 1)
            cut = row[order[first]]
        else:  # over the candidates
            v = values[r]
            cumulative = v.masked_fill(v < kth[r], -torch.inf).softmax(dim=-1).cumsum(dim=-1)
            cut = v[min(int((cumulative < top_p[r]).sum()), len(v) - 1)]
        NUCLEUS_SUMS[int(at[r])] = cumulative
        threshold[r] = torch.maximum(threshold[r], cut)
    # min-p
    threshold = torch.maximum(threshold, values[:, 0] + torch.log(min_p.clamp(min=0)))
    inside = (
        threshold > values[:, -1]
        if C < vocab_size
        else torch.ones_like(threshold, dtype=torch.bool)
    )
    drawn = torch.empty(len(at), dtype=torch.int64)
    for r in range(len(at)):
        if inside[r]:
            kept = values[r] >= threshold[r]
            order, perm = torch.where(kept, indices[r], vocab_size).sort()
            v = values[r][perm].masked_fill(order == vocab_size, -torch.inf)
            drawn[r] = order[_reference_inverse_cdf(v[None], u[r : r + 1])[0, 0]]
        else:
            v = logits[r].masked_fill(logits[r] < threshold[r], -torch.inf)
            drawn[r] = _reference_inverse_cdf(v[None], u[r : r + 1])[0, 0]
        vectors[int(at[r])] = v
    tokens[at] = drawn
    return tokens, vectors


def edge_uniforms(vectors: list[torch.Tensor], rng: np.random.Generator) -> torch.Tensor:
    """Per row, a uniform whose draw target lands exactly on one of the row's cumulative sums
    (where there is one): a draw computing that sum one ulp off picks the neighbouring token,
    so equal tokens mean equal sums."""
    uniforms = torch.from_numpy(rng.random(len(vectors)).astype(np.float32))
    for r, v in enumerate(vectors):
        cdf = v.softmax(dim=-1).cumsum(dim=-1)
        total = cdf[-1]
        steps = ((cdf[1:] > cdf[:-1]) & (cdf[:-1] < total)).nonzero()[:, 0]
        if len(steps) == 0:
            continue
        edge = cdf[steps[rng.integers(len(steps))]]
        u = (edge / total).reshape(1)
        for _ in range(8):  # the float32 u whose product with the total is the sum itself
            product = u * total
            if product == edge:
                uniforms[r] = u[0]
                break
            u = torch.nextafter(u, u + (1.0 if product < edge else -1.0))
    return uniforms


NUCLEUS_SUMS: dict[int, torch.Tensor] = {}


def edge_top_p(top_p: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """``top_p`` with each top-p row's mass set to one of the cumulative sums its nucleus was
    cut from (``NUCLEUS_SUMS``, of the last reference draw): a cut computing that sum one ulp
    off keeps one token more or less."""
    top_p = top_p.clone()
    for r, cumulative in NUCLEUS_SUMS.items():
        steps = ((cumulative[1:] > cumulative[:-1]) & (cumulative[1:] < 1)).nonzero()[:, 0] + 1
        steps = steps[:12]  # near the top, where the values differ (not along a plateau)
        if len(steps):
            top_p[r] = cumulative[steps[rng.integers(len(steps))]]
    return top_p


def _reference_inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, cdf.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def random_logits(
    kind: str, num_rows: int, vocab_size: int, rng: np.random.Generator
) -> np.ndarray:
    """LLM-like ("peaked": a bulk and a few tokens far above it), flat at three scales,
    quantised like bf16 logits (many exact ties), mostly ``-inf`` (a grammar mask), or peaked
    over a plateau of equal logits."""
    x = rng.normal(0.0, 2.0, (num_rows, vocab_size))
    if kind in ("peaked", "plateau"):
        top = rng.integers(0, vocab_size, (num_rows, 8))
        lift = np.array([16, 13, 12, 11.5, 11, 10.5, 10, 10]) + rng.normal(0, 1, (num_rows, 8))
        np.put_along_axis(x, top, lift, axis=1)
    elif kind == "flat":
        x *= rng.choice([0.25, 1.0, 3.0], (num_rows, 1))
    elif kind == "ties":
        x = np.round(x * 4) / 4
    elif kind == "masked":
        x[rng.random((num_rows, vocab_size)) < 0.98] = -np.inf
    if kind == "plateau":  # and 20-400 tokens tied below those: ties with every boundary
        for row, length in zip(x, rng.integers(20, 400, num_rows)):
            row[rng.choice(vocab_size, length, replace=False)] = 9.5
    return x.astype(np.float32)


SETTINGS = [  # (top_k, top_p, min_p): each filter alone and together, near every boundary
    (0, 1.0, 0.0), (1, 1.0, 0.0), (40, 1.0, 0.0), (63, 1.0, 0.0), (64, 1.0, 0.0),
    (65, 1.0, 0.0), (127, 1.0, 0.0), (128, 1.0, 0.0), (200, 1.0, 0.0), (255, 1.0, 0.0),
    (256, 1.0, 0.0), (257, 1.0, 0.0), (700, 1.0, 0.0), (0, 0.3, 0.0), (0, 0.9, 0.0),
    (0, 0.95, 0.0), (0, 0.999, 0.0), (40, 0.95, 0.0), (100, 0.8, 0.0), (300, 0.9, 0.0),
    (0, 1.0, 0.01), (0, 1.0, 0.05), (0, 1.0, 0.3), (20, 0.9, 0.1), (0, 0.9, 0.02),
]  # fmt: skip


def batch(
    kind: str, num_rows: int, vocab_size: int, seed: int, max_top_k: int = 1000
) -> tuple[torch.Tensor, ...]:
    """Rows of ``kind`` with settings from SETTINGS (top-k up to ``max_top_k``: the width of
    the first search follows the batch's largest top-k up to 256)."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(random_logits(kind, num_rows, vocab_size, rng))
    settings = [s for s in SETTINGS if s[0] <= max_top_k]
    picks = [settings[i] for i in rng.integers(0, len(settings), num_rows)]
    top_k, top_p, min_p = (torch.tensor(column) for column in zip(*picks))
    uniforms = torch.from_numpy(rng.random(num_rows).astype(np.float32))
    temperature = torch.from_numpy(rng.choice([0.5, 0.8, 1.0, 1.3], num_rows).astype(np.float32))
    return logits, top_k.to(torch.int64), top_p.float(), min_p.float(), uniforms, temperature


@pytest.mark.parametrize("kernel", [True, False])  # _core.top_candidates, the torch tree
@pytest.mark.parametrize("vocab_size", [4096, 5003, 40000])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked", "plateau"])
def test_top_candidates_are_the_topk_values(
    vocab_size: int, kind: str, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("resin.sampling_candidates.candidates_kernel", kernel)
    logits = torch.from_numpy(random_logits(kind, 24, vocab_size, np.random.default_rng(1)))
    for num in (64, 128, 256, 2048):
        values, indices = top_candidates(logits, num, Workspace())
        assert torch.equal(values, logits.topk(num, dim=-1).values), num
        assert torch.equal(logits.gather(1, indices), values)
        assert all(len(set(row)) == num for row in indices.tolist())  # no column twice
    values, indices = top_candidates(logits, 0, Workspace())  # none asked (logprobs=0)
    assert values.shape == indices.shape == (24, 0)


@pytest.mark.parametrize("max_top_k", [63, 127, 1000])  # a first search of 64, 128, 256
@pytest.mark.parametrize("vocab_size,num_rows", [(5003, 96), (20000, 24)])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked", "plateau"])
def test_draw_matches_the_plain_draw_bit_for_bit(
    vocab_size: int, num_rows: int, kind: str, max_top_k: int
) -> None:
    logits, top_k, top_p, min_p, uniforms, temperature = batch(
        kind, num_rows, vocab_size, 2, max_top_k
    )
    scaled = logits / temperature[:, None]
    NUCLEUS_SUMS.clear()
    reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    top_p = edge_top_p(top_p, np.random.default_rng(3))
    _, vectors = reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    uniforms = edge_uniforms(vectors, np.random.default_rng(3))
    expected, _ = reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    assert torch.equal(sample_tokens(scaled, top_k, top_p, min_p, uniforms), expected)
    # Dividing only what the draw reads gives the same bits as dividing the rows first.
    workspace = Workspace()
    args = (temperature, top_k, top_p, min_p, uniforms, workspace)
    assert torch.equal(draw_tokens(logits, *args), expected)
    assert torch.equal(draw_tokens(logits.clone(), *args, owned=True), expected)
    assert torch.equal(draw_tokens(logits, *args), expected)  # the buffers reused


@pytest.mark.parametrize("estimate", ["too small", "everything"])
def test_wide_nucleus_sizes_decide_only_the_cost(
    estimate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nuclei of thousands of tokens (flat logits, top-p 0.9-0.999): however wrong the size
    estimate (a search too small to hold the nucleus, so it grows; or a sort of the row),
    the tokens are the plain draw's."""
    vocab_size, num_rows = 20000, 16
    rng = np.random.default_rng(8)
    logits = torch.from_numpy(random_logits("flat", num_rows, vocab_size, rng))
    top_p = torch.from_numpy(rng.choice([0.9, 0.95, 0.999], num_rows).astype(np.float32))
    off = torch.zeros(num_rows)
    top_k = torch.zeros(num_rows, dtype=torch.int64)
    uniforms = torch.from_numpy(rng.random(num_rows).astype(np.float32))

    def sizes(
        row: Any, probs: Any, beyond: Any, cumulative: Any, last: Any, mass: Any, least: int
    ) -> list[int]:
        return [least if estimate == "too small" else vocab_size] * len(beyond)

    monkeypatch.setattr("resin.sampling_filters._sampled_nucleus_sizes", sizes)
    monkeypatch.setattr("resin.sampling_filters.nucleus_kernel", False)  # the torch search
    expected, _ = reference_sample_tokens(logits, top_k, top_p, off, uniforms)
    assert torch.equal(sample_tokens(logits, top_k, top_p, off, uniforms), expected)


def sorted_cut(row: torch.Tensor, probs: torch.Tensor, top_p: float) -> tuple[float, torch.Tensor]:
    """The plain rule: the logit where ``row``'s nucleus of ``top_p`` ends by a sort and
    torch's cumulative sum, and the cumulative sums."""
    order = row.argsort(descending=True, stable=True)
    cumulative = probs[order].cumsum(dim=-1)
    first = min(int((cumulative < top_p).sum()), len(row) - 1)
    return float(row[order[first]]), cumulative


@pytest.mark.parametrize("vocab_size", [5003, 40000])
@pytest.mark.parametrize("kind", ["flat", "ties", "masked", "plateau", "top-k"])
def test_the_nucleus_kernel_cuts_where_the_sort_does(vocab_size: int, kind: str) -> None:
    """``_core.nucleus_cut`` (the CPU path for a nucleus past the candidates) against a sort:
    the same cut for masses anywhere in the row, including each one exactly equal to a
    cumulative sum deep in the nucleus (one ulp off in any partial sum moves the cut there),
    and the row's 256 largest logits with their columns."""
    from resin import _core

    rng = np.random.default_rng(vocab_size)
    logits = torch.from_numpy(
        random_logits("peaked" if kind == "top-k" else kind, 12, vocab_size, rng)
    )
    if kind == "top-k":  # a top-k mask past the candidates: the rest -inf
        logits = logits.masked_fill(logits < logits.topk(3000).values[:, -1:], -torch.inf)
    probs = logits.softmax(dim=-1)
    masses = []
    for r in range(len(logits)):
        _, cumulative = sorted_cut(logits[r], probs[r], 1.0)
        steps = ((cumulative[1:] > cumulative[:-1]) & (cumulative[1:] < 1)).nonzero()[:, 0] + 1
        deep = steps[steps >= C]
        edge = float(cumulative[deep[rng.integers(len(deep))]]) if len(deep) else 0.9
        masses.append([edge, float(rng.uniform(0.5, 1.0)), 0.999999, 1.0])
    for column in range(4):
        top_p = torch.tensor([m[column] for m in masses], dtype=torch.float32)
        rows = torch.arange(len(logits))
        threshold = torch.empty(len(rows))
        values, indices = torch.empty(len(rows), C), torch.empty(len(rows), C, dtype=torch.int64)
        _core.nucleus_cut(
            logits.numpy(), probs.numpy(), rows.numpy(), top_p.numpy(),
            threshold.numpy(), values.numpy(), indices.numpy(),
        )  # fmt: skip
        for r in range(len(logits)):
            expected, _ = sorted_cut(logits[r], probs[r], float(top_p[r]))
            assert float(threshold[r]) == expected, (kind, r, column)
        assert torch.equal(values, logits.topk(C, dim=-1).values)
        assert torch.equal(logits.gather(1, indices), values)
        assert all(len(set(row)) == C for row in indices.tolist())


def test_the_nucleus_kernel_and_the_torch_search_draw_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampler's tokens with the kernel on and off (top-p masses on the nucleus's own
    cumulative sums, so any difference in a cut shows)."""
    logits, top_k, top_p, min_p, uniforms, temperature = batch("flat", 48, 20000, 5)
    scaled = logits / temperature[:, None]
    NUCLEUS_SUMS.clear()
    reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    deep = np.random.default_rng(6)
    for r, cumulative in NUCLEUS_SUMS.items():  # a mass deep in each wide nucleus
        steps = ((cumulative[1:] > cumulative[:-1]) & (cumulative[1:] < 1)).nonzero()[:, 0] + 1
        steps = steps[steps >= C]
        if len(steps):
            top_p[r] = cumulative[steps[deep.integers(len(steps))]]
    expected, _ = reference_sample_tokens(scaled, top_k, top_p, min_p, uniforms)
    tokens = {}
    for on in (True, False):
        monkeypatch.setattr("resin.sampling_filters.nucleus_kernel", on)
        tokens[on] = draw_tokens(logits, temperature, top_k, top_p, min_p, uniforms, Workspace())
    assert torch.equal(tokens[True], expected) and torch.equal(tokens[False], expected)
    # A float64 top_p is compared in float64 (torch's promotion): the torch search serves it.
    wide = top_p.double() + 1e-12
    monkeypatch.setattr("resin.sampling_filters.nucleus_kernel", True)
    kernel_rows = apply_top_p(scaled, wide)
    monkeypatch.setattr("resin.sampling_filters.nucleus_kernel", False)
    assert torch.equal(kernel_rows, apply_top_p(scaled, wide))


def test_the_nucleus_kernel_refuses_bad_arguments() -> None:
    from resin import _core

    logits = torch.randn(4, 300)
    probs = logits.softmax(dim=-1)

    def call(**change: Any) -> None:
        args = dict(
            logits=logits.numpy(), probs=probs.numpy(), rows=np.arange(2, dtype=np.int64),
            top_p=np.full(2, 0.9, np.float32), threshold=np.empty(2, np.float32),
            top_values=np.empty((2, 8), np.float32), top_indices=np.empty((2, 8), np.int64),
        )  # fmt: skip
        args.update(change)
        _core.nucleus_cut(*args.values())

    call()  # the good call
    bad = {
        "do not agree": dict(probs=probs[:3].numpy()),
        "not a row": dict(rows=np.array([0, 4], np.int64)),
        "C-contiguous": dict(logits=np.asfortranarray(logits.numpy())),
        "overlap": dict(top_values=probs.numpy().reshape(-1)[:16].reshape(2, 8)),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            call(**change)
    values = torch.empty(2, 8)  # two outputs over the same bytes (views numpy cannot link)
    with pytest.raises(ValueError, match="overlap"):
        call(top_values=values.numpy(), threshold=values.view(-1)[:2].numpy())
    shared = torch.zeros(16, dtype=torch.int64)  # an output over the row indices
    with pytest.raises(ValueError, match="overlap"):
        call(rows=shared[:2].numpy(), top_indices=shared.view(2, 8).numpy())
    # top_candidates: [S, V] in, [S, n <= V] out, apart from each other and the input.
    good = (np.empty((4, 8), np.float32), np.empty((4, 8), np.int64))
    _core.top_candidates(logits.numpy(), *good)
    for message, outputs in {
        "do not agree": (np.empty((3, 8), np.float32), np.empty((3, 8), np.int64)),
        "C-contiguous": (np.empty((8, 4), np.float32).T, good[1]),
        "overlap": (logits.numpy().reshape(-1)[:32].reshape(4, 8), good[1]),
    }.items():
        with pytest.raises(ValueError, match=message):
            _core.top_candidates(logits.numpy(), *outputs)
    with pytest.raises(ValueError, match="do not agree"):
        _core.top_candidates(
            logits.numpy(), np.empty((4, 301), np.float32), np.empty((4, 301), np.int64)
        )


@pytest.mark.parametrize("vocab_size", [450, 5003])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked", "plateau"])
def test_inverse_cdf_kernel_is_torchs_cumsum_and_search(
    kind: str, vocab_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_core.inverse_cdf`` (the CPU whole-row draw) gives the token of torch's cumsum and
    searchsorted on every row, with uniforms right at the cumulative sums' edges, and leaves
    the rows of NaN or infinite logits to torch."""
    rng = np.random.default_rng(vocab_size)
    logits = torch.from_numpy(random_logits(kind, 23, vocab_size, rng))
    logits[3] = torch.nan
    logits[4] = -torch.inf  # softmax of NaN
    logits[5, vocab_size // 2] = torch.inf
    probs = logits.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    at = torch.from_numpy(rng.integers(0, vocab_size, len(logits)))
    edge = (cdf.gather(1, at[:, None])[:, 0] / total).clamp(0, 1 - 2**-24)
    up, down = torch.full_like(edge, 1.0), torch.zeros_like(edge)
    for uniforms in (
        torch.from_numpy(rng.random(len(logits)).astype(np.float32)),
        torch.zeros(len(logits)),
        torch.full((len(logits),), 1 - 2**-24),
        edge,
        torch.nextafter(edge, up).clamp(max=1 - 2**-24),
        torch.nextafter(edge, down),
    ):
        monkeypatch.setattr("resin.sampling_draw.draw_kernel", False)
        expected = inverse_cdf(logits, uniforms, Workspace())
        monkeypatch.setattr("resin.sampling_draw.draw_kernel", True)
        assert torch.equal(inverse_cdf(logits, uniforms, Workspace()), expected)
        assert torch.equal(inverse_cdf(logits, uniforms), expected)  # no workspace: torch's


def test_inverse_cdf_kernel_refuses_bad_arrays() -> None:
    from resin import _core

    probs, uniforms = np.full((4, 8), 0.125, np.float32), np.full(4, 0.5, np.float32)
    tokens = np.empty(4, np.int64)
    _core.inverse_cdf(probs, uniforms, tokens)
    assert tokens.tolist() == [4, 4, 4, 4]
    _core.inverse_cdf(np.ones((4, 1), np.float32), uniforms, tokens)  # one column: always it
    assert tokens.tolist() == [0, 0, 0, 0]
    for message, args in {
        "do not agree": (probs, uniforms[:3], tokens),
        "do not agree ": (probs, uniforms, tokens[:3]),
        "do not agree  ": (np.zeros((4, 0), np.float32), uniforms, tokens),
        "C-contiguous": (np.zeros((8, 4), np.float32).T, uniforms, tokens),
        "C-contiguous ": (probs, np.zeros(8, np.float32)[::2], tokens),
    }.items():
        with pytest.raises(ValueError, match=message.strip()):
            _core.inverse_cdf(*args)
    shared = torch.zeros(4, 8)  # tokens over the probabilities' bytes
    with pytest.raises(ValueError, match="overlap"):
        _core.inverse_cdf(shared.numpy(), uniforms, shared.view(-1)[:8].view(torch.int64).numpy())


@pytest.mark.parametrize("vocab_size", [1, 15, 16, 17, 5003, 32000])
def test_greedy_tokens_are_torchs_argmax(vocab_size: int) -> None:
    """``_core.argmax`` (the CPU greedy pick) gives torch's column on every row: ties of the
    largest (the first wins), NaN anywhere (the first NaN), -inf rows, +inf, -0.0 / 0.0."""
    gen = torch.Generator().manual_seed(vocab_size)
    rows = (torch.randint(0, 24, (12, vocab_size), generator=gen) * 0.5).float()  # ties
    rows[1] = -torch.inf
    rows[2] = torch.where(torch.arange(vocab_size) % 2 == 0, -0.0, 0.0)
    rows[3, vocab_size // 2] = torch.inf
    rows[4, vocab_size - 1] = torch.nan  # in the tail past the last block of 16
    rows[5, vocab_size // 3] = torch.nan
    rows[5, (2 * vocab_size) // 3] = torch.nan
    rows[6] = torch.arange(vocab_size, dtype=torch.float32)  # a new maximum each logit
    rows[7, 0] = torch.nan
    got = greedy_tokens(rows)
    assert got.dtype == torch.int64
    assert got.tolist() == rows.argmax(dim=-1).tolist()
    # Strided rows and other dtypes take torch's argmax; the answer is the same.
    assert greedy_tokens(rows.t().contiguous().t()).tolist() == rows.argmax(dim=-1).tolist()
    if vocab_size > 1:
        assert greedy_tokens(rows[:, 1:]).tolist() == rows[:, 1:].argmax(dim=-1).tolist()
    # Named rows, in any order and repeated, read in place (the kernel's threads dealt them
    # out, each asking for its next row as it reads one).
    picked = np.array([7, 0, 5, 5, 11, 2, 3, 9, 1], dtype=np.int64)
    want = rows.argmax(dim=-1)[torch.from_numpy(picked)].tolist()
    assert greedy_tokens(rows, picked).tolist() == want
    assert greedy_tokens(rows.t().contiguous().t(), picked).tolist() == want  # torch's path


def test_argmax_kernel_refuses_bad_arrays() -> None:
    from resin import _core

    logits = np.zeros((4, 8), np.float32)
    _core.argmax(logits, np.empty(4, np.int64))
    for message, (rows, tokens) in {
        "do not agree": (logits, np.empty(3, np.int64)),
        "do not agree ": (np.zeros((4, 0), np.float32), np.empty(4, np.int64)),
        "C-contiguous": (np.zeros((8, 4), np.float32).T, np.empty(4, np.int64)),
    }.items():
        with pytest.raises(ValueError, match=message.strip()):
            _core.argmax(rows, tokens)
    with pytest.raises(ValueError, match="row 4 is not a row"):
        _core.argmax(logits, np.empty(2, np.int64), rows=np.array([0, 4], np.int64))
    with pytest.raises(ValueError, match="as rows"):
        _core.argmax(logits, np.empty(3, np.int64), rows=np.array([0, 1], np.int64))
    shared = torch.zeros(4, 8)  # tokens over the logits' bytes (views numpy cannot link)
    with pytest.raises(ValueError, match="overlap"):
        _core.argmax(shared.numpy(), shared.view(-1)[:8].view(torch.int64).numpy())


def test_draw_of_a_row_does_not_depend_on_the_batch() -> None:
    logits, top_k, top_p, min_p, uniforms, temperature = batch("peaked", 64, 5003, 3)
    args = (temperature, top_k, top_p, min_p, uniforms)
    batched = draw_tokens(logits, *args, Workspace())
    alone = [
        int(draw_tokens(logits[r : r + 1], *(a[r : r + 1] for a in args), Workspace())[0])
        for r in range(64)
    ]
    assert batched.tolist() == alone


class TableRunner:
    """Logits of a sampling row = TABLE[its last token % 64], a vocabulary of 5003."""

    TABLE = torch.from_numpy(random_logits("peaked", 64, 5003, np.random.default_rng(4)))

    def __init__(self) -> None:
        self.sampler = Sampler(5003)

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.sampler.begin_step(plan)
        rows = np.flatnonzero(np.diff(plan.sample_indptr) == 1)
        last_tokens = plan.input_ids[plan.query_indptr[rows + 1] - 1].astype(np.int64) % 64
        logits = self.TABLE[torch.from_numpy(last_tokens)]
        before = logits.clone()
        out = self.sampler.sample(logits, plan, rows)
        assert torch.equal(logits, before), "the sampler wrote into the logits"
        for slot, state in self.sampler.slots.items():  # the tallies: a recount of the history
            for outputs_only in (False, True):
                tally = self.sampler.penalties.tallies.get((slot, outputs_only))
                if tally is None or tally.state is not state:
                    continue
                history = state.token_ids[state.num_prompt_tokens if outputs_only else 0 :]
                ids, counts = np.unique(history, return_counts=True)
                order = np.argsort(tally.ids[: tally.size])
                assert tally.ids[: tally.size][order].tolist() == ids.tolist()
                assert tally.counts[: tally.size][order].tolist() == counts.tolist()
        return out


MIXED = [
    dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
    dict(temperature=0.7),
    dict(temperature=0.8, top_k=50),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.6, top_k=40, top_p=0.95),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, top_p=0.95, repetition_penalty=1.2),
    dict(temperature=0.9, top_k=100, frequency_penalty=0.4, presence_penalty=0.5),
]


def generate(requests: dict[str, tuple[list[int], dict[str, Any]]]) -> dict[str, list[int]]:
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=512, max_model_len=64, vocab_size=5003),
        TableRunner(),
    )
    for request_id, (prompt, settings) in requests.items():
        engine.add_request(request_id, prompt, resin.SamplingParams(max_tokens=12, **settings))
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return finished


def test_mixed_settings_give_each_request_its_tokens_alone() -> None:
    """A batch of every kind of row (greedy with penalties, temperature alone, each filter,
    penalised filters; seeded) gives each request the tokens it gets alone, and the sampler
    never writes into the runner's logits (checked every step, with the penalty counts)."""
    requests = {
        f"r{i}": ([i % 7, 3 + i % 5, i % 64], dict(MIXED[i % len(MIXED)], seed=i))
        for i in range(32)
    }
    together = generate(requests)
    for request_id in ("r0", "r3", "r6", "r7", "r13", "r22"):
        assert generate({request_id: requests[request_id]})[request_id] == together[request_id]
    assert len({tuple(t) for t in together.values()}) > 16  # the settings draw different tokens


def test_token_tally_counts_appends_and_restarts_on_a_rewrite() -> None:
    state = SlotState([5, 6, 5, 99999, -1], num_prompt_tokens=2)
    tally = TokenTally(state, 2, vocab_size=100)  # outputs only; out-of-vocabulary ignored
    tally.update()
    assert dict(zip(tally.ids[: tally.size].tolist(), tally.counts[: tally.size].tolist())) == {
        5: 1
    }
    state.token_ids.extend([7, 5] + list(range(100)))  # a long append: counted in numpy
    tally.update()
    counts = dict(zip(tally.ids[: tally.size].tolist(), tally.counts[: tally.size].tolist()))
    assert counts[5] == 3 and counts[7] == 2 and counts[0] == 1 and len(counts) == 100
    del state.token_ids[4:]  # a rewrite (as SlotHistory does for a re-sent diff)
    state.token_ids.append(8)
    state.num_rewrites += 1
    tally.update()
    assert dict(zip(tally.ids[: tally.size].tolist(), tally.counts[: tally.size].tolist())) == {
        5: 1,
        8: 1,
    }


def test_workspace_hands_out_one_buffer_per_name() -> None:
    workspace = Workspace("cpu")
    a = workspace.get("a", (4, 8), torch.float32)
    b = workspace.get("b", (4, 8), torch.float32)
    assert a.data_ptr() != b.data_ptr()
    assert workspace.get("a", (2, 8), torch.float32).data_ptr() == a.data_ptr()  # reused
    bigger = workspace.get("a", (16, 8), torch.float32)  # grown
    assert bigger.shape == (16, 8) and workspace.num_bytes == (16 * 8 + 4 * 8) * 4
