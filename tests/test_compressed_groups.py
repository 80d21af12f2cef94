"""Compressed cache groups end to end, without a model.

A toy runner in the DeepSeek-V4 shape declares one sliding-window layer that keeps each
token's raw vector (window W) and one compressed layer (ratio R) whose entry e is computed
when its closing token (position (e+1)*R - 1) arrives, from the raw vectors of its own R
tokens plus, twice weighted, the previous R (CSA's overlapping windows), read back from
the raw window through the plan's sliding-window page table (tokens written earlier in
the same step included). W >= 2R, so that carry is always in the window: the engine
stores none. The sampled token is a function of every entry closed by the last position
and of the raw window there, so it is right only if the plan (slot_mapping, kv_indices
and kv_last_page_len of both groups) is. Every output is checked against a recomputation
over the whole token list with no cache: under chunked prefill (chunks of 7 split windows
of 3), prefix hits (at multiples of lcm(page_size, R) tokens: a compressed page spans 12)
and preemption.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import numpy.typing as npt

import resin
from resin import ForwardOutput, LayerCacheSpec, SamplingParams

PAGE_SIZE = 4
RATIO = 3
WINDOW = 8  # >= 2 * RATIO: the current and the previous compression window
DIM = 4
VOCAB = 97
WEIGHTS = np.array([1, 3, 5, 7], dtype=np.int64)


def raw_vector(token: int, position: int) -> npt.NDArray[np.int64]:
    return np.array(
        [(token + 1) * (k + 2) + position * (k + 1) for k in range(DIM)], dtype=np.int64
    )


def entry_of(raw: dict[int, npt.NDArray[np.int64]], e: int) -> npt.NDArray[np.int64]:
    own = sum((raw[q] for q in range(e * RATIO, (e + 1) * RATIO)), np.zeros(DIM, np.int64))
    prev = sum((raw[q] for q in range(max(0, (e - 1) * RATIO), e * RATIO)), np.zeros(DIM, np.int64))
    return own + 2 * prev


def readout(
    entries: list[npt.NDArray[np.int64]], window: list[tuple[int, npt.NDArray[np.int64]]]
) -> int:
    total = sum(int(WEIGHTS @ v) * (e + 1) for e, v in enumerate(entries))
    total += sum(int(WEIGHTS @ v) * (q + 1) * 7 for q, v in window)
    return total % VOCAB


def reference_next(tokens: list[int]) -> int:
    raw = {q: raw_vector(t, q) for q, t in enumerate(tokens)}
    entries = [entry_of(raw, e) for e in range(len(tokens) // RATIO)]
    p = len(tokens) - 1
    return readout(entries, [(q, raw[q]) for q in range(max(0, p - WINDOW + 1), p + 1)])


class RawSlots:
    """Slot of position q in a row's listed sliding-window pages (which start at first_page)."""

    def __init__(self, pages: npt.NDArray[np.uint32], first_page: int) -> None:
        self.pages, self.first_page = pages, first_page

    def __call__(self, q: int) -> int:
        j = q // PAGE_SIZE - self.first_page
        assert 0 <= j < len(self.pages) and self.pages[j] != 0, (q, self.first_page)
        return int(self.pages[j]) * PAGE_SIZE + q % PAGE_SIZE


class EntrySlots:
    """Slot of entry e in a row's listed compressed pages (from entry 0)."""

    def __init__(self, pages: npt.NDArray[np.uint32]) -> None:
        self.pages = pages

    def __call__(self, e: int) -> int:
        return int(self.pages[e // PAGE_SIZE]) * PAGE_SIZE + e % PAGE_SIZE


class ToyCompressedRunner:
    def __init__(self) -> None:
        self.num_entries_written = 0

    def cache_spec(self) -> list[LayerCacheSpec]:
        return [
            LayerCacheSpec.sliding_window(WINDOW, DIM * 8),
            LayerCacheSpec.compressed(RATIO, DIM * 8),
        ]

    def bind_cache(self, layout: resin.CacheLayout) -> None:
        self.sw, self.cg = layout.group_of_layer(0), layout.group_of_layer(1)
        comp = layout.groups[self.cg].spec
        assert comp.kind == "compressed" and comp.ratio == RATIO and comp.bytes_per_entry == DIM * 8
        assert layout.page_bytes == PAGE_SIZE * DIM * 8
        # Garbage everywhere but the null page: a wrong slot reads nonsense.
        rng = np.random.default_rng(0)
        self.raw = rng.integers(1, 1000, (layout.num_pages * PAGE_SIZE, DIM)).astype(np.int64)
        self.comp = rng.integers(1, 1000, (layout.num_pages * PAGE_SIZE, DIM)).astype(np.int64)
        self.raw[:PAGE_SIZE] = 0
        self.comp[:PAGE_SIZE] = 0

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        sw, cg = self.sw, self.cg
        out = np.zeros(plan.num_sequences, dtype=np.uint32)
        for i in range(plan.num_sequences):
            lo, hi = int(plan.query_indptr[i]), int(plan.query_indptr[i + 1])
            seq_len = int(plan.seq_lens[i])
            sw_pages = plan.kv_indices[sw][plan.kv_indptr[sw][i] : plan.kv_indptr[sw][i + 1]]
            first_page = -(-seq_len // PAGE_SIZE) - len(sw_pages)

            raw_slot = RawSlots(sw_pages, first_page)
            c_pages = plan.kv_indices[cg][plan.kv_indptr[cg][i] : plan.kv_indptr[cg][i + 1]]
            num_entries = seq_len // RATIO
            assert len(c_pages) == -(-num_entries // PAGE_SIZE)
            last = int(plan.kv_last_page_len[cg][i])
            assert (
                (len(c_pages) - 1) * PAGE_SIZE + last == num_entries if len(c_pages) else last == 0
            )

            entry_slot = EntrySlots(c_pages)
            for t in range(lo, hi):
                p, token = int(plan.positions[t]), int(plan.input_ids[t])
                slot = int(plan.slot_mapping[sw][t])
                assert slot == raw_slot(p)
                self.raw[slot] = raw_vector(token, p)
                cslot = int(plan.slot_mapping[cg][t])
                if (p + 1) % RATIO:
                    assert cslot == -1
                    continue
                e = p // RATIO
                assert cslot == entry_slot(e)
                # The carry is read back from the raw window, this step's tokens included.
                raw = {q: self.raw[raw_slot(q)] for q in range(max(0, (e - 1) * RATIO), p + 1)}
                self.comp[cslot] = entry_of(raw, e)
                self.num_entries_written += 1
            if plan.sample_indptr[i + 1] > plan.sample_indptr[i]:
                p = seq_len - 1
                entries = [self.comp[entry_slot(e)] for e in range(num_entries)]
                window = [(q, self.raw[raw_slot(q)]) for q in range(max(0, p - WINDOW + 1), p + 1)]
                out[i] = readout(entries, window)
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
    return {
        f"r{i}": (shared[:n] if i % 2 else rng.integers(0, VOCAB, n).tolist())
        for i, n in enumerate(lengths)
    }


def engine(num_pages: int, prefix_caching: bool = True, budget: int = 7) -> resin.Engine:
    config = resin.EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=48,
        enable_prefix_caching=prefix_caching,
        vocab_size=VOCAB,
    )
    return resin.Engine(config, ToyCompressedRunner())


LENGTHS = [1, 2, 3, 5, 8, 11, 12, 13, 17, 23, 25, 30, 37]


def test_spec_round_trips() -> None:
    spec = LayerCacheSpec.compressed(4, 64)
    assert (spec.kind, spec.ratio, spec.bytes_per_entry, spec.bytes_per_token) == (
        "compressed",
        4,
        64,
        0,
    )
    assert repr(spec) == "LayerCacheSpec.compressed(4, 64)"
    assert LayerCacheSpec.full(8).ratio is None and LayerCacheSpec.full(8).bytes_per_entry is None
    try:
        LayerCacheSpec.compressed(0, 8)
    except ValueError:
        pass
    else:
        raise AssertionError("ratio 0 is refused")


def test_chunked_prefill_without_prefix_caching_matches_recomputation() -> None:
    e = engine(256, prefix_caching=False)
    run(e, prompts_of(LENGTHS, 1), max_tokens=7)
    assert e.runner.num_entries_written > 0


def test_prefix_hits_come_in_whole_compressed_pages() -> None:
    e = engine(512)
    prompts = prompts_of(LENGTHS, 2)
    first = run(e, prompts, max_tokens=6)
    second = run(e, {f"{rid}-again": p for rid, p in prompts.items()}, max_tokens=6)
    for rid, prompt in prompts.items():
        assert first[rid].token_ids == second[f"{rid}-again"].token_ids
        cached = second[f"{rid}-again"].num_cached_tokens
        # The longest whole compressed page (lcm(page_size, ratio) = 12 tokens) before the last token.
        assert cached == (len(prompt) - 1) // (PAGE_SIZE * RATIO) * PAGE_SIZE * RATIO, (rid, cached)
    assert sum(out.num_cached_tokens for out in second.values()) > 0
    longer = {f"{rid}-more": p + first[rid].token_ids + [5, 6] for rid, p in prompts.items()}
    more = run(e, longer, max_tokens=3)
    assert all(out.num_cached_tokens % (PAGE_SIZE * RATIO) == 0 for out in more.values())


def test_preemption_in_a_small_pool_recomputes_exactly() -> None:
    # One request of 48 tokens needs 5 window pages + 16 entries in 4 pages.
    e = engine(16, budget=9)
    prompts = prompts_of(LENGTHS + [19, 26, 33], 3)
    run(e, prompts, max_tokens=10)
    m = re.search(r"^resin:num_preemptions_total(\{\})? (\d+)", e.metrics_text(), re.M)
    assert m and int(m.group(2)) > 0
    again = run(e, {f"{rid}-again": p for rid, p in prompts.items()}, max_tokens=10)
    assert all(out.num_cached_tokens % (PAGE_SIZE * RATIO) == 0 for out in again.values())
    e.reset_prefix_cache()
    assert e.num_free_pages == 15


# -- the same toy on the shared paged runner: a raw window and compressed entries per layer --


def test_shared_runner_binds_a_layer_with_a_window_and_compressed_entries() -> None:
    """The DeepSeek-V4 shape on :class:`resin.runners.torch.PagedRunner`: one layer whose main
    cache is the raw sliding window (``ctx.attention``) and whose extra cache is the compressed
    entries (``ctx.extra["entries"]``): entries are written at their closing token from the
    raw window read back with ``gather`` and read with ``gather`` on the compressed group (the
    causal rule on closing positions is the visibility rule). Exact against the no-cache
    reference under chunked prefill, prefix hits and preemption."""
    import torch

    from resin.runners.torch import LayerCache, LayerDefinition, ModelDefinition, PagedRunner
    from resin.runners.torch.model_weights import ModelWeights

    def block(x: Any, w: Any, ctx: Any) -> Any:
        raw_cache, entries = ctx.require_attention(), ctx.extra["entries"]
        tokens, positions = ctx.input_ids.tolist(), ctx.positions.tolist()
        raw_new = torch.from_numpy(
            np.array([raw_vector(t, p) for t, p in zip(tokens, positions)], dtype=np.float64)
        ).reshape(len(tokens), 1, DIM)
        raw_cache.write(raw=raw_new)
        logits = torch.full((len(tokens), VOCAB), -1.0, dtype=torch.float64)
        new_entries = torch.zeros(len(tokens), 1, DIM, dtype=torch.float64)
        for row in raw_cache.gather("raw"):
            window = {
                int(q): v[0].numpy().astype(np.int64) for q, v in zip(row.positions, row.values)
            }
            for t in range(row.query.start, row.query.stop):
                p = positions[t]
                if (p + 1) % RATIO == 0:
                    new_entries[t, 0] = torch.from_numpy(entry_of(window, p // RATIO))
        entries.write(e=new_entries)
        for row in entries.gather("e"):
            raw_rows = {r.query.start: r for r in raw_cache.gather("raw")}[row.query.start]
            for j, t in enumerate(range(row.query.start, row.query.stop)):
                p = positions[t]
                seen = [
                    v[0].numpy().astype(np.int64) for v, ok in zip(row.values, row.mask[j]) if ok
                ]
                win = [
                    (int(q), v[0].numpy().astype(np.int64))
                    for q, v, ok in zip(raw_rows.positions, raw_rows.values, raw_rows.mask[j])
                    if ok and q > p - WINDOW
                ]
                logits[t, readout(seen, win)] = 1.0
        return logits

    def decoder(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
        return fns["attn"](hidden, weights["attn"], ctx)

    layer = LayerDefinition(
        0,
        "compressed_sparse_attention",
        WINDOW,
        decoder,
        {"attn": block},
        LayerCache("sliding_window", {"raw": (1, DIM)}, window=WINDOW, dtype=torch.float64),
        extra_caches={
            "entries": LayerCache("compressed", {"e": (1, DIM)}, ratio=RATIO, dtype=torch.float64)
        },
    )
    model = ModelDefinition(
        "toy",
        "Toy",
        config=None,
        vocab_size=VOCAB,
        head_dim=DIM,
        layers=[layer],
        embed=lambda ids, w, ctx: torch.zeros(len(ids), VOCAB, dtype=torch.float64),
        logits=lambda hidden, w, ctx: hidden,
    )
    weights = ModelWeights({}, [{}])
    prompts = [[(5 * i + k) % VOCAB for i in range(n)] for k, n in enumerate((2, 7, 13, 25))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for budget, num_pages in ((64, 128), (7, 128), (64, 23)):
        runner = PagedRunner(model, weights, torch.device("cpu"), torch.float64)
        engine = resin.Engine(
            resin.EngineConfig(
                page_size=PAGE_SIZE,
                num_pages=num_pages,
                max_num_seqs=4,
                max_num_batched_tokens=budget,
                max_model_len=64,
            ),
            runner,
        )
        for round_ in range(2):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{round_}-{i}", prompt, params)
            done = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            for i, prompt in enumerate(prompts):
                tokens = list(prompt)
                for _ in range(params.max_tokens):
                    tokens.append(reference_next(tokens))
                assert done[f"{round_}-{i}"].token_ids == tokens[len(prompt) :], (budget, i)
            if round_ == 1 and num_pages == 128:
                assert max(o.num_cached_tokens for o in done.values()) > 0
        if num_pages == 26:  # the small pool really preempted
            m = re.search(r"^resin:num_preemptions_total(\{\})? (\d+)", engine.metrics_text(), re.M)
            assert m and int(m.group(2)) > 0
