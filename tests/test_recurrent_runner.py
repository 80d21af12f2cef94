"""The shared paged runner on a recurrent layer: states live in the engine's state pages.

A toy model — a decaying-sum recurrence (``s = a * s + W x``, two state buffers of different
shapes, so the byte layout and page padding matter) followed by a full-attention layer — runs
on :class:`resin.runners.torch.PagedRunner` through ``ctx.state`` and ``ctx.attention``. Its
greedy tokens must equal a no-cache recomputation of the whole sequence under chunked prefill,
prefix-cache hits (copy-on-write from checkpoints: ``num_cached_tokens > 0`` on the second
pass) and preemption in a small pool.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import resin  # noqa: E402
from resin.runners.torch import LayerCache, LayerDefinition, ModelDefinition, PagedRunner  # noqa: E402
from resin.runners.torch.model_weights import ModelWeights  # noqa: E402

VOCAB, D, DECAY = 48, 8, 0.7
GREEDY = resin.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _weights(seed: int = 0) -> ModelWeights:
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return ModelWeights(
        {"embed_tokens.weight": rnd(VOCAB, D), "lm_head.weight": rnd(VOCAB, D) * 3},
        [
            {"rec.w": rnd(D, D) / D**0.5, "rec.u": rnd(2, D)},
            {"attn.q": rnd(D, D), "attn.k": rnd(D, D), "attn.v": rnd(D, D)},
        ],
    )


def _recurrence(x: torch.Tensor, s: torch.Tensor, m: torch.Tensor, w: Any) -> Any:
    """One row: state ``s`` [D] and a [2, D] memory ``m``; returns (outputs [T, D], s, m)."""
    out = []
    for t in range(x.shape[0]):
        s = DECAY * s + w["w"] @ x[t]
        m = torch.stack([m[1], s])
        out.append(torch.tanh(s + (w["u"] * m).sum(0)))
    return torch.stack(out), s, m


def rec_block(x: torch.Tensor, w: Any, ctx: Any) -> torch.Tensor:
    state = ctx.require_state()
    states = state.load()
    out = torch.empty_like(x)
    bounds = ctx.query_indptr.tolist()
    for row in range(len(bounds) - 1):
        start, end = bounds[row], bounds[row + 1]
        y, s, m = _recurrence(x[start:end], states["s"][row, 0], states["m"][row], w)
        out[start:end], states["s"][row, 0], states["m"][row] = y, s, m
    state.store(states)
    return out


def attn_block(x: torch.Tensor, w: Any, ctx: Any) -> torch.Tensor:
    q, k, v = (torch.tanh(x @ w[n]).view(x.shape[0], 1, D) for n in ("q", "k", "v"))
    return ctx.require_attention()(q, k, v, scale=D**-0.5).view(x.shape[0], D)


def decoder(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
    (child,) = fns
    return hidden + fns[child](hidden, weights[child], ctx)


def _runner() -> PagedRunner:
    layers = [
        LayerDefinition(
            0,
            "linear_attention",
            None,
            decoder,
            {"rec": rec_block},
            LayerCache("recurrent", {"s": (1, D), "m": (2, D)}, dtype=torch.float32),
        ),
        LayerDefinition(
            1,
            "full_attention",
            None,
            decoder,
            {"attn": attn_block},
            LayerCache("full", {"k": (1, D), "v": (1, D)}),
        ),
    ]
    model = ModelDefinition("toy", "Toy", config=None, vocab_size=VOCAB, head_dim=D, layers=layers)
    return PagedRunner(model, _weights(), torch.device("cpu"), torch.float32)


def reference(prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by recomputing every sequence from scratch (no cache at all)."""
    w = _weights()
    tokens = list(prompt)
    for _ in range(n):
        x = w.globals["embed_tokens.weight"][torch.tensor(tokens)]
        y, _, _ = _recurrence(x, torch.zeros(D), torch.zeros(2, D), w.module(0, "rec"))
        h = x + y
        q, k, v = (torch.tanh(h @ w.module(1, "attn")[n]) for n in ("q", "k", "v"))
        scores = (q @ k.T) * D**-0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -1e30)
        h = h + torch.softmax(scores, -1) @ v
        tokens.append(int((h[-1] @ w.globals["lm_head.weight"].T).argmax()))
    return tokens[len(prompt) :]


PROMPTS = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (1, 5, 9, 17, 30)]


def _run(engine: resin.Engine, prompts: list[list[int]], tag: str) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, GREEDY)
    done: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize(
    "budget,num_pages",
    [(64, 256), (7, 256), (64, 40)],
    ids=["one_step_prefill", "chunked", "small_pool"],
)
def test_recurrent_layer_is_exact_under_chunking_prefix_hits_and_preemption(
    budget: int, num_pages: int
) -> None:
    config = resin.EngineConfig(
        page_size=4,
        num_pages=num_pages,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=64,
    )
    engine = resin.Engine(config, _runner())
    expected = [reference(p, GREEDY.max_tokens) for p in PROMPTS]
    first = _run(engine, PROMPTS, "a")
    assert [first[f"a{i}"].token_ids for i in range(len(PROMPTS))] == expected
    # Second pass: the same prompts hit the checkpoints the first pass left (copy-on-write).
    second = _run(engine, PROMPTS, "b")
    assert [second[f"b{i}"].token_ids for i in range(len(PROMPTS))] == expected
    assert max(o.num_cached_tokens for o in second.values()) > 0
    # Prompts extending a cached prefix: the hit is the longest checkpointed boundary.
    longer = [p + [5, 6, 7, 8, 9] for p in PROMPTS[2:]]
    third = _run(engine, longer, "c")
    assert [third[f"c{i}"].token_ids for i in range(len(longer))] == [
        reference(p, GREEDY.max_tokens) for p in longer
    ]


def test_abort_mid_prefill_leaves_nothing_behind() -> None:
    """An abort while a long prompt is mid-prefill (its state half-built in its pages) frees
    the state; the next request that reuses those pages starts fresh and is exact."""
    config = resin.EngineConfig(
        page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=5, max_model_len=64
    )
    engine = resin.Engine(config, _runner())
    free_before = engine.num_free_pages
    engine.add_request("long", PROMPTS[-1], GREEDY)
    engine.step()
    engine.step()  # two 5-token chunks of a 30-token prompt computed
    engine.abort("long")
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_pages == free_before
    done = _run(engine, PROMPTS[1:3], "n")
    assert [done[f"n{i}"].token_ids for i in range(2)] == [
        reference(p, GREEDY.max_tokens) for p in PROMPTS[1:3]
    ]
