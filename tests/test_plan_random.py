"""Seeded random scenarios through ``harness.Harness``: every plan checked by formula.

Each scenario mixes adds (prompts built from a few shared prefixes, so the prefix cache
hits), aborts (waiting, running, mid-prefill), chunked prefill, EOS / stop tokens, and a
pool small enough to force preemption, over one full-attention group or a full plus a
sliding-window group, under FCFS or priority. The harness checks each plan's arrays, page
tables, lifecycle diff and outputs; at the end every request has finished, the pool
passes ``check_integrity`` and every page is free. Also: aborting a request whose prefix
pages another request shares leaves the sharer's pages alone.
"""

from __future__ import annotations

import random

import pytest
from harness import CacheRunner, Harness, RecordingRunner

import resin
from resin import LayerCacheSpec, SamplingParams

EOS = 1


def token_for(rid: str, seq_len: int) -> int:
    value = random.Random(f"{rid}/{seq_len}").randrange(60)
    return EOS if value == 0 else 2 + value


SCENARIOS = [
    # (seed, policy, layers, page_size, num_pages)
    (0, "fcfs", "full", 4, 24),
    (1, "fcfs", "full+window", 4, 22),
    (2, "priority", "full", 2, 40),
    # two window layers and one full: groups of one layer (the smallest bucket), so the two
    # window layers are two groups; one 40-token request needs 10 + 2 x 6 pages
    (3, "priority", "window+full", 4, 24),
    (4, "fcfs", "full", 8, 12),
]


def make_runner(layers: str) -> RecordingRunner:
    if layers == "full":
        return RecordingRunner(token_for)
    specs = {
        "full+window": [LayerCacheSpec.full(8), LayerCacheSpec.sliding_window(6, 8)],
        "window+full": [
            LayerCacheSpec.sliding_window(5, 8),
            LayerCacheSpec.full(8),
            LayerCacheSpec.sliding_window(5, 8),
        ],
    }[layers]
    return CacheRunner(specs, token_for)


@pytest.mark.parametrize(("seed", "policy", "layers", "page_size", "num_pages"), SCENARIOS)
def test_random_scenario(
    seed: int, policy: str, layers: str, page_size: int, num_pages: int
) -> None:
    rng = random.Random(seed)
    config = resin.EngineConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=40,
        eos_token_ids=[EOS],
        policy=policy,
    )  # type: ignore[arg-type]
    h = Harness(config, make_runner(layers))
    prefixes = [[rng.randrange(2, 60) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    count = 0
    for _ in range(400):
        live = [r for r in h.prompts if r not in h.final and r not in h.aborted]
        roll = rng.random()
        if roll < 0.25 and len(live) < 10:
            prompt = rng.choice(prefixes) + [
                rng.randrange(2, 60) for _ in range(rng.randrange(1, 12))
            ]
            max_tokens = rng.randrange(1, 20)
            min_tokens = rng.randrange(0, min(3, max_tokens) + 1)
            params = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                ignore_eos=rng.random() < 0.2,
                priority=rng.randrange(3),
                stop_token_ids=rng.choice([[], [7], [8, 9]]),
            )
            h.add(f"q{count}", prompt[:39], params)
            count += 1
        elif roll < 0.32 and live:
            assert h.abort(rng.choice(live))
        else:
            h.step()
    h.run()
    assert sorted(h.final) == sorted(h.prompts)
    for rid, out in h.final.items():
        assert out.finish_reason == "abort" or rid not in h.aborted
    assert h.engine.num_free_pages == num_pages - 1
    h.engine.reset_prefix_cache()
    assert h.engine.num_free_pages == num_pages - 1
    h.engine.check_integrity()
    hits = sum(o.num_cached_tokens for o in h.final.values())
    assert hits > 0 and count > 20


def test_abort_keeps_pages_another_request_shares() -> None:
    config = resin.EngineConfig(
        page_size=4, num_pages=24, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48
    )
    h = Harness(config, RecordingRunner(token_for))
    prompt = list(range(10, 27))
    h.add("a", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    h.step()
    h.add("b", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    h.step()
    assert h.abort("a")
    h.add("c", list(range(30, 62)), SamplingParams(max_tokens=8, ignore_eos=True))
    h.run()  # c must not be handed b's shared pages: the harness checks no row writes them
    assert h.final["b"].num_cached_tokens == 16 and len(h.final["b"].token_ids) == 20
    assert len(h.final["c"].token_ids) == 8
    assert h.engine.num_free_pages == 23
