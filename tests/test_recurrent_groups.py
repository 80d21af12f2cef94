"""Recurrent cache groups end to end, without a model.

A toy runner declares one full-attention layer and one recurrent layer. The recurrent
state is 8 uint64 lanes (64 bytes, so 2 pages of 32 bytes: page_size 4 x 8 bytes per
token), a running hash of the tokens, kept only in the state pages the plan names; the
full layer stores each token in its slot and reads them back through ``kv_indices``. The
sampled token is a function of both, so it is right only if the engine's plan (state
pages, has_initial_state, copy_pages, zero_pages, page tables) is. Every output is
checked against a recomputation over the whole token list with no cache: under chunked
prefill, prefix hits (checkpoints restored by copy-on-write) and preemption.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

import resin
from resin import ForwardOutput, LayerCacheSpec, SamplingParams

PAGE_SIZE = 4
VOCAB = 97
LANES = 8  # uint64 lanes of state: 64 bytes
MUL = np.array([3, 5, 7, 11, 13, 17, 19, 23], dtype=np.uint64)


def advance(state: npt.NDArray[np.uint64], token: int) -> None:
    with np.errstate(over="ignore"):
        state *= MUL
        state += np.uint64(token + 1) + np.arange(LANES, dtype=np.uint64)


def readout(state: npt.NDArray[np.uint64], tokens: list[int]) -> int:
    attention = sum((p + 1) * (t + 1) for p, t in enumerate(tokens))
    return (int(state.sum(dtype=np.uint64)) ^ attention) % VOCAB


def reference_next(tokens: list[int]) -> int:
    state = np.zeros(LANES, dtype=np.uint64)
    for t in tokens:
        advance(state, t)
    return readout(state, tokens)


class ToyHybridRunner:
    def __init__(self) -> None:
        self.max_copies = 0
        self.num_zeroed = 0
        self.num_fresh_rows = 0

    def cache_spec(self) -> list[LayerCacheSpec]:
        return [LayerCacheSpec.full(8), LayerCacheSpec.recurrent(LANES * 8)]

    def bind_cache(self, layout: resin.CacheLayout) -> None:
        assert layout.page_bytes == PAGE_SIZE * 8
        rec = layout.groups[layout.group_of_layer(1)]
        assert rec.spec.kind == "recurrent" and rec.pages_per_state == 2
        self.full_g, self.rec_g = layout.group_of_layer(0), layout.group_of_layer(1)
        lanes_per_page = layout.page_bytes // 8
        # Garbage everywhere but the null page: a fresh state must never read stale bytes.
        rng = np.random.default_rng(0)
        self.kv = rng.integers(1, 1000, layout.num_pages * PAGE_SIZE).astype(np.int64)
        self.kv[:PAGE_SIZE] = 0
        self.states = rng.integers(1, 2**63, (layout.num_pages, lanes_per_page)).astype(np.uint64)
        self.states[0] = 0

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        copies = plan.copy_pages
        assert copies.shape[1] == 2 and copies.dtype == np.uint32
        self.max_copies = max(self.max_copies, len(copies))
        self.states[copies[:, 1]] = self.states[copies[:, 0]]  # all sources read first
        self.kv.reshape(-1, PAGE_SIZE)[plan.zero_pages] = 0
        self.num_zeroed += len(plan.zero_pages)
        g, r = self.full_g, self.rec_g
        assert len(plan.state_slots[g]) == 0 and len(plan.state_slots[r]) == plan.num_sequences
        out = np.zeros(plan.num_sequences, dtype=np.uint32)
        for i in range(plan.num_sequences):
            lo, hi = plan.query_indptr[i], plan.query_indptr[i + 1]
            pages = plan.kv_indices[r][plan.kv_indptr[r][i] : plan.kv_indptr[r][i + 1]]
            assert len(pages) == 2 and pages[0] == plan.state_slots[r][i]
            if plan.has_initial_state[r][i]:
                state = self.states[pages].reshape(-1).copy()
            else:
                assert plan.num_computed_tokens[i] == 0
                self.num_fresh_rows += 1
                state = np.zeros(LANES, dtype=np.uint64)
            for t, slot in zip(plan.input_ids[lo:hi], plan.slot_mapping[g][lo:hi], strict=True):
                advance(state, int(t))
                self.kv[slot] = int(t) + 1
            assert (plan.slot_mapping[r][lo:hi] == -1).all()
            self.states[pages] = state.reshape(2, -1)
            kv_pages = plan.kv_indices[g][plan.kv_indptr[g][i] : plan.kv_indptr[g][i + 1]]
            seq_len = int(plan.seq_lens[i])
            slots = (kv_pages[:, None].astype(np.int64) * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(
                -1
            )
            tokens = [int(v) - 1 for v in self.kv[slots[:seq_len]]]
            out[i] = readout(state, tokens)
        return ForwardOutput(out, np.arange(plan.num_sequences + 1, dtype=np.uint32))


def run(
    engine: resin.Engine, prompts: dict[str, list[int]], max_tokens: int
) -> dict[str, resin.RequestOutput]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    final: dict[str, resin.RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
    assert set(final) == set(prompts)
    for rid, prompt in prompts.items():
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(reference_next(tokens))
        assert final[rid].token_ids == tokens[len(prompt) :], rid
    return final


def prompts_of(lengths: list[int], seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 64).tolist()
    # Half share a long prefix, half are unrelated.
    return {
        f"r{i}": (shared[:n] if i % 2 else rng.integers(0, VOCAB, n).tolist())
        for i, n in enumerate(lengths)
    }


def engine(
    num_pages: int, prefix_caching: bool = True, budget: int = 7, checkpoint_interval: int = 0
) -> resin.Engine:
    """Checkpoints at every page boundary unless ``checkpoint_interval`` says otherwise."""
    config = resin.EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=48,
        enable_prefix_caching=prefix_caching,
        vocab_size=VOCAB,
        recurrent_checkpoint_interval=checkpoint_interval,
    )
    return resin.Engine(config, ToyHybridRunner())


LENGTHS = [1, 3, 4, 5, 8, 9, 13, 17, 23, 30]


def test_chunked_prefill_without_prefix_caching_matches_recomputation() -> None:
    e = engine(256, prefix_caching=False)
    run(e, prompts_of(LENGTHS, 1), max_tokens=6)
    assert e.runner.max_copies == 0


def test_prefix_hits_restore_checkpoints_exactly() -> None:
    e = engine(512)
    prompts = prompts_of(LENGTHS, 2)
    first = run(e, prompts, max_tokens=6)
    # The second pass hits: the longest page boundary before the last token that has a
    # checkpoint, restored by copy-on-write.
    second = run(e, {f"{rid}-again": p for rid, p in prompts.items()}, max_tokens=6)
    cached = {rid: out.num_cached_tokens for rid, out in second.items()}
    for rid, prompt in prompts.items():
        assert first[rid].token_ids == second[f"{rid}-again"].token_ids
        expected = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
        assert cached[f"{rid}-again"] == expected, (rid, len(prompt), cached)
    assert e.runner.max_copies > 0
    # Continuations of a finished conversation hit too (checkpoints at decode boundaries).
    longer = {f"{rid}-more": p + first[rid].token_ids + [5, 6] for rid, p in prompts.items()}
    more = run(e, longer, max_tokens=4)
    assert sum(out.num_cached_tokens for out in more.values()) > sum(cached.values())


def test_checkpoints_every_interval_still_restore_exactly() -> None:
    """With checkpoints every 3 pages (plus each prompt's last boundary), hits fall only on
    those boundaries and every output still equals the recomputation."""
    interval = 3 * PAGE_SIZE
    e = engine(512, checkpoint_interval=interval)
    prompts = prompts_of(LENGTHS, 2)
    first = run(e, prompts, max_tokens=6)
    second = run(e, {f"{rid}-again": p for rid, p in prompts.items()}, max_tokens=6)
    for rid, prompt in prompts.items():
        assert first[rid].token_ids == second[f"{rid}-again"].token_ids
        # The prompt's own last boundary is always checkpointed.
        expected = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
        assert second[f"{rid}-again"].num_cached_tokens == expected, (rid, len(prompt))
    longer = {f"{rid}-more": p + first[rid].token_ids + [5, 6] for rid, p in prompts.items()}
    more = run(e, longer, max_tokens=4)
    for rid, out in more.items():
        hit = out.num_cached_tokens
        prompt_boundary = (len(prompts[rid.removesuffix("-more")]) - 1) // PAGE_SIZE * PAGE_SIZE
        assert hit % interval == 0 or hit == prompt_boundary, (rid, hit)


def test_preemption_in_a_small_pool_recomputes_exactly() -> None:
    # One request of 48 tokens needs 12 pages + a 2-page state + a 2-page checkpoint.
    e = engine(24, budget=9)
    prompts = prompts_of(LENGTHS + [11, 19, 26, 33], 3)
    run(e, prompts, max_tokens=12)
    m = re.search(r"^resin:num_preemptions_total(\{\})? (\d+)", e.metrics_text(), re.M)
    assert m and int(m.group(2)) > 0
    assert e.runner.num_zeroed > 0, "pages that held states were reused for K/V"
    run(e, {f"{rid}-again": p for rid, p in prompts.items()}, max_tokens=12)
    e.reset_prefix_cache()
    assert e.num_free_pages == 23
