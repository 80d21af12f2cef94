"""Exact-value tests of the BatchPlan a real Engine builds (DESIGN.md "BatchPlan", _core.pyi).

Every scenario runs through ``harness.Harness``, which checks each plan by formula
(dtypes, shapes, CSR consistency, input ids, sample rows, decode-first order, page tables
per cache group, slot mapping, sampling arrays, banned tokens, lifecycle diff). The tests
here add exact expectations per scenario: a single request's plans, chunked prefill,
decode-first ordering, read-only arrays, request slots, prefix-cache hits, sliding-window
groups and ``bind_cache``, banned tokens and sampling arrays.
"""

from __future__ import annotations

import gc
import re
from typing import Any

import numpy as np
import pytest
from harness import CacheRunner, Harness, live_array_problems

import resin
from resin import LayerCacheSpec, SamplingParams


def config(**kw: Any) -> resin.EngineConfig:
    base = dict(
        page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128
    )
    return resin.EngineConfig(**{**base, **kw})


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 900, length).tolist()


def rows_of(plans: list[dict[str, Any]], rid: str) -> list[tuple[dict[str, Any], int]]:
    return [(p, p["request_ids"].index(rid)) for p in plans if rid in p["request_ids"]]


def row_pages(plan: dict[str, Any], g: int, i: int) -> list[int]:
    indptr = plan["kv_indptr"][g]
    return plan["kv_indices"][g][indptr[i] : indptr[i + 1]].tolist()


def test_single_request_exact_plans() -> None:
    h = Harness(config())
    prompt = list(range(5, 15))
    h.add("r", prompt, SamplingParams(max_tokens=3))
    final = h.run()
    plans = h.runner.plans
    shape = [
        (
            p["num_computed_tokens"].tolist(),
            p["seq_lens"].tolist(),
            p["query_indptr"].tolist(),
            p["sample_indptr"].tolist(),
            p["num_decode_sequences"],
        )
        for p in plans
    ]
    assert shape == [
        ([0], [10], [0, 10], [0, 1], 0),
        ([10], [11], [0, 1], [0, 1], 1),
        ([11], [12], [0, 1], [0, 1], 1),
    ]
    assert plans[0]["input_ids"].tolist() == prompt
    assert plans[0]["positions"].tolist() == list(range(10))
    assert [p["input_ids"].tolist() for p in plans[1:]] == [[1010], [1011]]
    assert [p["positions"].tolist() for p in plans[1:]] == [[10], [11]]
    assert [p["kv_last_page_len"][0].tolist() for p in plans] == [[2], [3], [4]]
    pages = row_pages(plans[0], 0, 0)
    assert len(pages) == 3 and 0 not in pages
    assert all(row_pages(p, 0, 0) == pages for p in plans)
    assert plans[0]["slot_mapping"][0].tolist() == [pages[p // 4] * 4 + p % 4 for p in range(10)]
    assert plans[2]["slot_mapping"][0].tolist() == [pages[2] * 4 + 3]
    assert plans[0]["block_table"][0][0, :3].tolist() == pages
    slot = int(plans[0]["request_slots"][0])
    assert [p["new_request_slots"].tolist() for p in plans] == [[slot], [], []]
    assert [p["finished_request_slots"].tolist() for p in plans] == [[], [], []]
    assert list(final) == ["r"]
    assert final["r"].token_ids == [1010, 1011, 1012]
    assert final["r"].finish_reason == "length" and final["r"].num_cached_tokens == 0


def test_chunked_prefill_samples_only_the_last_chunk() -> None:
    h = Harness(config(max_num_batched_tokens=8))
    h.add("r", prompt_of(20, 1), SamplingParams(max_tokens=2))
    reported = []
    while h.engine.has_unfinished():
        reported.append([o.request_id for o in h.step()])
    rows = [
        (
            int(p["num_computed_tokens"][0]),
            int(p["seq_lens"][0]) - int(p["num_computed_tokens"][0]),
            int(p["sample_indptr"][1]),
        )
        for p in h.runner.plans
    ]
    assert rows == [(0, 8, 0), (8, 8, 0), (16, 4, 1), (20, 1, 1)]
    assert reported == [[], [], ["r"], ["r"]]
    assert h.final["r"].token_ids == [1020, 1021]
    # Mid-prefill chunks list every page written so far.
    assert [p["kv_indptr"][0].tolist() for p in h.runner.plans] == [[0, 2], [0, 4], [0, 5], [0, 6]]


def test_decode_rows_come_first() -> None:
    h = Harness(config())
    h.add("A", prompt_of(6, 2), SamplingParams(max_tokens=4))
    h.step()
    h.add("B", prompt_of(9, 3), SamplingParams(max_tokens=2))
    h.add("C", prompt_of(5, 4), SamplingParams(max_tokens=2))
    h.step()
    plan = h.runner.plans[-1]
    assert plan["request_ids"][0] == "A" and sorted(plan["request_ids"][1:]) == ["B", "C"]
    assert plan["num_decode_sequences"] == 1
    assert plan["query_indptr"].tolist() in ([0, 1, 10, 15], [0, 1, 6, 15])
    h.step()
    assert h.runner.plans[-1]["num_decode_sequences"] == 3
    h.run()
    assert {r: len(o.token_ids) for r, o in h.final.items()} == {"A": 4, "B": 2, "C": 2}


def test_priority_newcomer_prefill_still_after_decode_rows() -> None:
    h = Harness(config(policy="priority", max_num_batched_tokens=8))
    h.add("low", prompt_of(3, 5), SamplingParams(max_tokens=8, priority=5))
    h.step()
    h.add("high", prompt_of(30, 6), SamplingParams(max_tokens=2, priority=0))
    h.run()  # the harness checks decode-first order in every plan
    assert {r: len(o.token_ids) for r, o in h.final.items()} == {"low": 8, "high": 2}


def test_plan_arrays_have_contract_dtypes_and_are_read_only() -> None:
    runner = CacheRunner([LayerCacheSpec.full(64), LayerCacheSpec.sliding_window(8, 64)])
    engine = resin.Engine(config(), runner)
    engine.add_request("a", list(range(1, 7)), SamplingParams(max_tokens=2))
    engine.add_request("b", list(range(1, 10)), SamplingParams(max_tokens=2))
    plan = engine.schedule()
    assert live_array_problems(plan) == []
    assert isinstance(plan.step, int) and plan.num_cache_groups == 2 and len(plan) == 2
    assert plan.request_ids == ["a", "b"] and all(isinstance(r, str) for r in plan.request_ids)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "slot_mapping", "block_table"):
        arrays = getattr(plan, name)
        assert isinstance(arrays, tuple) and len(arrays) == 2, name
    assert plan.block_table[0].shape[0] == 2 and plan.block_table[0].ndim == 2
    targets: list[Any] = [
        plan.input_ids,
        plan.positions,
        plan.query_indptr,
        plan.seq_lens,
        plan.request_slots,
        plan.num_computed_tokens,
        plan.sample_indptr,
        plan.new_request_slots,
        plan.sampling.temperature,
        plan.sampling.seed,
        plan.kv_indptr[1],
        plan.kv_indices[0],
        plan.kv_indices[1],
        plan.kv_last_page_len[0],
        plan.slot_mapping[1],
    ]
    for array in targets:
        with pytest.raises(ValueError):
            array[0] = 1
    with pytest.raises(ValueError):
        plan.block_table[0][0, 0] = 1
    assert plan.input_ids.tolist() == list(range(1, 7)) + list(range(1, 10))
    assert np.shares_memory(plan.input_ids, plan.input_ids)  # no copy per access
    with pytest.raises(RuntimeError):
        engine.schedule()  # a plan is pending
    kept = (plan.input_ids, plan.kv_indices[1], plan.sampling.top_p)
    del targets, arrays, plan
    engine.discard_plan()
    again = engine.schedule()
    gc.collect()  # the arrays keep the dropped plan's memory alive
    assert kept[0].tolist() == again.input_ids.tolist() == list(range(1, 7)) + list(range(1, 10))
    assert len(kept[1]) > 0 and kept[2].tolist() == [1.0, 1.0]
    assert again.request_ids == ["a", "b"]


def test_request_slots_and_lifecycle_diff() -> None:
    h = Harness(config(max_num_seqs=2))
    for rid, (length, max_tokens) in {
        "r0": (5, 2),
        "r1": (6, 5),
        "r2": (7, 3),
        "r3": (4, 1),
    }.items():
        h.add(rid, prompt_of(length, length), SamplingParams(max_tokens=max_tokens))
    for _ in range(3):
        h.step()
    assert h.abort("r1") is True
    aborted = [o for o in h.step() if o.request_id == "r1"]
    assert [(o.finished, o.finish_reason, len(o.token_ids)) for o in aborted] == [
        (True, "abort", 3)
    ]
    h.run()
    plans = h.runner.plans
    slot = {
        rid: int(p["request_slots"][i]) for rid in h.prompts for p, i in rows_of(plans, rid)[:1]
    }
    assert {slot["r0"], slot["r1"]} == {0, 1}
    assert slot["r2"] == slot["r0"] and slot["r3"] == slot["r1"]
    for rid in h.prompts:
        assert {int(p["request_slots"][i]) for p, i in rows_of(plans, rid)} == {slot[rid]}
    diff = [
        (sorted(p["new_request_slots"].tolist()), p["finished_request_slots"].tolist())
        for p in plans
    ]
    assert diff == [
        ([0, 1], []),
        ([], []),
        ([slot["r0"]], [slot["r0"]]),
        ([slot["r1"]], [slot["r1"]]),
        ([], [slot["r3"]]),
    ]
    assert [p["request_ids"] for p in plans] == [
        ["r0", "r1"],
        ["r0", "r1"],
        ["r1", "r2"],
        ["r2", "r3"],
        ["r2"],
    ]
    assert {r: (o.finish_reason, len(o.token_ids)) for r, o in h.final.items()} == {
        "r0": ("length", 2),
        "r1": ("abort", 3),
        "r2": ("length", 3),
        "r3": ("length", 1),
    }


def test_finished_slots_reach_the_runner_across_idle_steps() -> None:
    h = Harness(config())
    h.add("a", [1, 2, 3], SamplingParams(max_tokens=1))
    h.add("b", [4, 5, 6], SamplingParams(max_tokens=2))
    h.step()
    slots = dict(zip(h.runner.plans[0]["request_ids"], h.runner.plans[0]["request_slots"].tolist()))
    h.step()  # b finishes; a finished in the step before
    assert not h.engine.has_unfinished()
    h.engine.step()  # nothing to run: an idle step
    h.add("c", [7, 8, 9], SamplingParams(max_tokens=1))
    h.engine.step()
    assert sorted(h.runner.plans[-1]["finished_request_slots"].tolist()) == [slots["b"]]
    assert sorted(h.runner.plans[1]["finished_request_slots"].tolist()) == [slots["a"]]


@pytest.mark.parametrize("length", [17, 16, 9, 4])
def test_prefix_cache_hit_on_identical_prompt(length: int) -> None:
    h = Harness(config())
    prompt = prompt_of(length, 7)
    h.add("a", prompt, SamplingParams(max_tokens=1))
    h.run()
    h.add("b", prompt, SamplingParams(max_tokens=2))
    h.run()
    hit = (length - 1) // 4 * 4  # full pages only, capped at num_tokens - 1
    (pa, ia), (pb, ib) = rows_of(h.runner.plans, "a")[0], rows_of(h.runner.plans, "b")[0]
    assert int(pb["num_computed_tokens"][ib]) == hit
    assert int(pb["seq_lens"][ib]) == length
    assert row_pages(pb, 0, ib)[: hit // 4] == row_pages(pa, 0, ia)[: hit // 4]
    assert h.final["a"].num_cached_tokens == 0 and h.final["b"].num_cached_tokens == hit
    assert h.final["b"].token_ids == h.final["a"].token_ids + [1000 + length + 1]


@pytest.mark.parametrize(
    ("variant", "hit"),
    [("tail_differs", 12), ("head_differs", 0), ("extends", 16), ("caching_off", 0), ("reset", 0)],
)
def test_prefix_cache_hit_is_the_longest_matching_chain(variant: str, hit: int) -> None:
    h = Harness(config(enable_prefix_caching=variant != "caching_off"))
    prompt = prompt_of(16, 8)
    h.add("a", prompt, SamplingParams(max_tokens=1))
    h.run()
    other = {
        "tail_differs": prompt[:12] + [901, 902, 903, 904, 905],
        "head_differs": [prompt[0] + 1] + prompt[1:] + [7],
        "extends": prompt + [5, 6, 7, 8, 9],
        "caching_off": prompt + [3],
        "reset": prompt + [3],
    }[variant]
    if variant == "reset":
        h.engine.reset_prefix_cache()
    h.add("b", other, SamplingParams(max_tokens=1))
    h.run()
    (pa, ia), (pb, ib) = rows_of(h.runner.plans, "a")[0], rows_of(h.runner.plans, "b")[0]
    assert int(pb["num_computed_tokens"][ib]) == hit == h.final["b"].num_cached_tokens
    assert row_pages(pb, 0, ib)[: hit // 4] == row_pages(pa, 0, ia)[: hit // 4]


def test_prefix_pages_shared_with_a_running_request() -> None:
    h = Harness(config())
    prompt = prompt_of(17, 9)
    h.add("a", prompt, SamplingParams(max_tokens=6))
    h.step()
    h.step()
    h.add("b", prompt, SamplingParams(max_tokens=2))
    h.step()
    plan = h.runner.plans[-1]
    ia, ib = plan["request_ids"].index("a"), plan["request_ids"].index("b")
    assert int(plan["num_computed_tokens"][ib]) == 16
    assert row_pages(plan, 0, ib)[:4] == row_pages(plan, 0, ia)[:4]
    assert row_pages(plan, 0, ib)[4] not in row_pages(plan, 0, ia)
    h.run()
    assert h.final["b"].num_cached_tokens == 16


def test_prefix_cache_evicts_the_tail_first() -> None:
    # 8 usable pages. "a" fills pages with 16 tokens and ends: its pages are freed tail
    # first, behind the 4 never-used ones. "b" needs 6 pages: the 4 unused, then a's
    # last two. a's first two pages keep their hashes, so "c" (a's prompt) hits 8 tokens.
    h = Harness(config(num_pages=9, max_model_len=32))
    prompt = prompt_of(16, 20)
    h.add("a", prompt, SamplingParams(max_tokens=1))
    h.run()
    h.add("b", prompt_of(21, 21), SamplingParams(max_tokens=1))
    h.run()
    h.add("c", prompt, SamplingParams(max_tokens=1))
    h.run()
    (pa, ia), (pc, ic) = rows_of(h.runner.plans, "a")[0], rows_of(h.runner.plans, "c")[0]
    assert h.final["c"].num_cached_tokens == 8 == int(pc["num_computed_tokens"][ic])
    assert row_pages(pc, 0, ic)[:2] == row_pages(pa, 0, ia)[:2]
    assert h.engine.num_free_pages == 8


def test_prefix_cache_hit_with_a_sliding_window_group() -> None:
    runner = CacheRunner([LayerCacheSpec.full(64), LayerCacheSpec.sliding_window(8, 64)])
    h = Harness(config(num_pages=128), runner)
    prompt = prompt_of(30, 22)
    h.add("a", prompt, SamplingParams(max_tokens=1))
    h.run()
    h.add("b", prompt, SamplingParams(max_tokens=1))
    h.run()
    (pa, ia), (pb, ib) = rows_of(h.runner.plans, "a")[0], rows_of(h.runner.plans, "b")[0]
    assert int(pb["num_computed_tokens"][ib]) == 28 == h.final["b"].num_cached_tokens
    assert row_pages(pb, 0, ib)[:7] == row_pages(pa, 0, ia)[:7]
    # b reads window [21, 30): logical pages 5..7; 5 and 6 are a's cached pages.
    assert row_pages(pb, 1, ib)[:2] == row_pages(pa, 1, ia)[5:7]


def test_sliding_window_group_lists_only_window_pages() -> None:
    window = 8
    specs = [
        LayerCacheSpec.full(64),
        LayerCacheSpec.sliding_window(window, 64),
        LayerCacheSpec.full(64),
        LayerCacheSpec.sliding_window(window, 64),
    ]
    runner = CacheRunner(specs)
    h = Harness(config(num_pages=128, max_num_batched_tokens=16), runner)
    assert len(runner.layouts) == 1
    for layout in (runner.layouts[0], h.engine.layout):
        assert (layout.num_pages, layout.page_size) == (128, 4)
        assert [g.spec.kind for g in layout.groups] == ["full", "sliding_window"]
        assert [g.spec.window for g in layout.groups] == [None, window]
        assert [g.layer_indices for g in layout.groups] == [[0, 2], [1, 3]]
        assert [layout.group_of_layer(i) for i in range(4)] == [0, 1, 0, 1]
    h.add("long", prompt_of(30, 10), SamplingParams(max_tokens=12))
    h.add("short", prompt_of(7, 11), SamplingParams(max_tokens=20))
    h.run()
    assert {r: len(o.token_ids) for r, o in h.final.items()} == {"long": 12, "short": 20}
    narrower = 0
    for plan in h.runner.plans:
        for i in range(plan["num_sequences"]):
            c, sl = int(plan["num_computed_tokens"][i]), int(plan["seq_lens"][i])
            first = max(0, c - window + 1) // 4
            assert len(row_pages(plan, 0, i)) == -(-sl // 4)
            assert len(row_pages(plan, 1, i)) == (sl - 1) // 4 - first + 1
            narrower += len(row_pages(plan, 1, i)) < len(row_pages(plan, 0, i))
    assert narrower > 10
    last = h.runner.plans[-1]  # "short" samples its 20th token: c=25, window [18, 26) -> pages 4..6
    assert last["request_ids"] == ["short"] and int(last["seq_lens"][0]) == 7 + 19
    assert row_pages(last, 1, 0) == last["block_table"][1][0, 4:7].tolist()
    assert not last["block_table"][1][0, :4].any()


def test_sliding_window_frees_pages_behind_the_window() -> None:
    runner = CacheRunner([LayerCacheSpec.sliding_window(8, 64)])
    h = Harness(config(num_pages=8, max_num_batched_tokens=8), runner)
    h.add("r", prompt_of(8, 12), SamplingParams(max_tokens=60))
    while h.engine.has_unfinished():
        h.step()
        assert 7 - h.engine.num_free_pages <= 4
    assert len(h.final["r"].token_ids) == 60 and h.final["r"].finish_reason == "length"
    assert re.search(r"^resin:num_preemptions_total(\{\})? 0(\.0)?$", h.engine.metrics_text(), re.M)
    assert h.engine.num_free_pages == 7


def test_layer_cache_spec_properties_and_recurrent_pool_size() -> None:
    full, sw = LayerCacheSpec.full(64), LayerCacheSpec.sliding_window(8, 32)
    rec = LayerCacheSpec.recurrent(4096)
    assert (full.kind, full.bytes_per_token, full.window, full.state_bytes) == (
        "full",
        64,
        None,
        None,
    )
    assert (sw.kind, sw.bytes_per_token, sw.window) == ("sliding_window", 32, 8)
    assert (rec.kind, rec.state_bytes) == ("recurrent", 4096)
    # A recurrent group is schedulable, but its state (and one checkpoint in flight, with
    # prefix caching) must fit beside one full-length request's pages: 64 pages are too few
    # for 32 full pages + a 16-page state + a 16-page checkpoint.
    with pytest.raises(ValueError, match="num_pages"):
        resin.Engine(config(), CacheRunner([LayerCacheSpec.full(64), rec]))
    engine = resin.Engine(config(num_pages=80), CacheRunner([LayerCacheSpec.full(64), rec]))
    (group,) = [g for g in engine.layout.groups if g.spec.kind == "recurrent"]
    assert group.pages_per_state == 16 and engine.layout.page_bytes == 256


def test_banned_tokens_and_sampling_arrays_follow_params() -> None:
    h = Harness(config(eos_token_ids=[2, 3]))
    h.add(
        "A",
        prompt_of(5, 13),
        SamplingParams(
            max_tokens=5,
            min_tokens=3,
            stop_token_ids=[7],
            temperature=0.5,
            top_p=0.9,
            top_k=-1,
            min_p=0.1,
            seed=42,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
        ),
    )
    h.add(
        "B",
        prompt_of(6, 14),
        SamplingParams(
            max_tokens=3,
            min_tokens=2,
            ignore_eos=True,
            stop_token_ids=[9],
            top_k=5,
            logprobs=2,
            temperature=0,
        ),
    )
    h.add("C", prompt_of(7, 15), SamplingParams(max_tokens=2))
    h.run()  # the harness checks every row's sampling arrays and banned ids
    banned = {}
    for rid in "ABC":
        sets = []
        for plan, i in rows_of(h.runner.plans, rid):
            b = plan["banned_token_indptr"]
            sets.append(sorted(plan["banned_token_ids"][b[i] : b[i + 1]].tolist()))
        banned[rid] = sets
    assert banned == {"A": [[2, 3, 7]] * 3 + [[]] * 2, "B": [[9], [9], []], "C": [[], []]}
    plan = h.runner.plans[0]
    sa = plan["sampling"]
    a, b, c = (plan["request_ids"].index(r) for r in "ABC")
    assert sa["temperature"][[a, b, c]].tolist() == [np.float32(0.5), 0.0, 1.0]
    assert sa["top_p"][a] == np.float32(0.9) and sa["min_p"][a] == np.float32(0.1)
    assert sa["top_k"][[a, b, c]].tolist() == [0, 5, 0]
    assert sa["seed"][[a, b, c]].tolist() == [42, -1, -1]
    assert sa["num_logprobs"][[a, b, c]].tolist() == [-1, 2, -1]
    assert sa["repetition_penalty"][a] == np.float32(1.2)
    assert (sa["presence_penalty"][a], sa["frequency_penalty"][a]) == (0.5, -0.5)
