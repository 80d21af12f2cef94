"""The torch runners share cache memory across groups: one byte buffer per layer slot that the
k-th cache of every token / recurrent group views (a page id belongs to one group at a time),
and stale bytes a page keeps from its previous owner are never read.

Each model runs the same greedy requests twice on a small pool (pages move between groups:
recurrent states, full and sliding-window K/V), once on zeroed buffers and once on buffers
whose every page but the null page was filled with 0xFF bytes first (NaN in bf16 / fp32). The
tokens must be equal: the reference backend never reads past a row's end in its last page
(removing that cut fails the DeepSeek-V4 case), and a fresh recurrent state starts from zeros
by selection (multiplying stale NaN bytes by 0 failed the Qwen3-Next case). The runner also
zeroes the pages the plan lists in ``zero_pages`` (a former state page now holding K/V) for
backends that read whole pages; the Qwen3-Next run checks the plan lists some.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "qwen3_next": REPO / "resin" / "models" / "qwen3_next" / "tiny",  # recurrent + full
    "gpt_oss": REPO / "resin" / "models" / "gpt_oss" / "tiny",  # sliding window + full
    "deepseek_v4_flash": REPO / "resin" / "models" / "deepseek_v4_flash" / "tiny",
}
PROMPTS = [[(11 * i + 7 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((37, 5, 52, 21))]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(model_dir: Path, poison: bool) -> tuple[list[list[int]], LLM, int]:
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=80, max_num_batched_tokens=16)
    runner = llm.runner
    if poison:
        for pages in runner.slot_buffers:
            pages[1:] = 0xFF
    zeroed = 0
    forward = runner.forward

    def counting(plan: resin.BatchPlan) -> resin.ForwardOutput:
        nonlocal zeroed
        zeroed += len(plan.zero_pages)
        return forward(plan)

    runner.forward = counting
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    return [out.token_ids for out in outputs], llm, zeroed


@pytest.mark.parametrize("name", sorted(MODELS))
def test_stale_bytes_in_shared_pages_are_never_read(name: str) -> None:
    clean, llm, _ = _run(MODELS[name], poison=False)
    poisoned, _, zeroed = _run(MODELS[name], poison=True)
    assert poisoned == clean
    assert llm.runner.unshared == []
    if name == "qwen3_next":
        assert zeroed > 0, "the small pool should hand a former state page to K/V"


def test_layer_slots_are_shared_across_groups() -> None:
    llm = LLM(MODELS["qwen3_next"], max_num_seqs=2, max_model_len=80)
    runner, layout = llm.runner, llm.engine.layout
    # 3 linear_attention + 1 full_attention layers: groups of 1, one shared slot.
    assert (len(layout.groups), layout.num_layer_slots) == (4, 1)
    (slot,) = runner.slot_buffers
    assert tuple(slot.shape) == (layout.num_pages, layout.page_bytes)
    full = next(i for i, caches in enumerate(runner.layer_caches) if caches)
    states = [pages for pages in runner.state_pages if pages is not None]
    assert len(states) == 3 and all(pages.data_ptr() == slot.data_ptr() for pages in states)
    for buffer in runner.layer_caches[full].values():
        start = buffer.data_ptr() - slot.data_ptr()
        assert 0 <= start < layout.page_bytes  # a view into the same page rows
