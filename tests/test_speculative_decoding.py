"""Speculative decoding with the n-gram drafter, end to end on real models: identical tokens.

The engine proposes drafts (prompt lookup over the request's tokens), the runner samples every
position of a verify row, the engine commits the agreed prefix plus one: so greedy output with
speculation on must be token-for-token the output with it off, on every model in CI that
supports it — under chunked prefill, prefix-cache hits and preemption — and so must seeded
sampling (the j-th sample of a verify row draws from output index num_output_tokens + j's
generator). Prompts repeat a phrase, so drafts are proposed and accepted (checked on the
metrics). Recurrent models (Qwen3-Next) refuse speculation with a clear error.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "llama": REPO / "tests" / "fixtures" / "llama",
    "gpt_oss": REPO / "resin" / "models" / "gpt_oss" / "tiny",
    "gemma3": REPO / "resin" / "models" / "gemma3" / "tiny",
    "deepseek_v4_flash": REPO / "resin" / "models" / "deepseek_v4_flash" / "tiny",
}
PHRASE = [17, 42, 99, 7, 63]
PROMPTS = [
    PHRASE * 4,
    [5, 6] + PHRASE * 3 + [11],
    [(13 * i) % 200 + 3 for i in range(23)],
    PHRASE * 2 + [8, 9, 10] * 3,
]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _metric(llm: LLM, name: str) -> float:
    match = re.search(rf"^resin:{name}(?:\{{\}})? (\S+)", llm.engine.metrics_text(), re.M)
    assert match, name
    return float(match.group(1))


def _generate(model: Path, k: int, params: resin.SamplingParams, **engine) -> tuple[list, LLM]:
    engine = {"max_model_len": 128, **engine}
    llm = LLM(model, max_num_seqs=4, num_speculative_tokens=k, **engine)
    return [out.token_ids for out in llm.generate(PROMPTS, params)], llm


def _small_pool(model: Path) -> int:
    """A pool of 4-token pages barely above one 64-token request: the four ~45-token requests
    must take turns (preemption)."""
    llm = LLM(model, max_num_seqs=4, max_model_len=64, page_size=4, max_num_batched_tokens=16)
    layout = resin.CacheLayout.from_specs(llm.runner.cache_spec(), 4)
    per_request = layout.pages_per_request(64, 16)
    return 1 + per_request + per_request // 5


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_is_identical_with_speculation(name: str) -> None:
    params = resin.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off, _ = _generate(MODELS[name], 0, params)
    for k, engine in [
        (1, {}),
        (4, {}),
        (3, {"max_num_batched_tokens": 7}),  # chunked prefill; verify rows cut to the budget
        (
            2,
            {
                "page_size": 4,
                "max_model_len": 64,
                "max_num_batched_tokens": 16,
                "num_pages": _small_pool(MODELS[name]),
            },
        ),  # a small pool: preemption
    ]:
        on, llm = _generate(MODELS[name], k, params, **engine)
        assert on == off, (name, k, engine)
        if "num_pages" in engine:
            assert _metric(llm, "num_preemptions_total") > 0
        assert _metric(llm, "spec_decode_num_drafts_total") > 0
        assert _metric(llm, "spec_decode_num_accepted_tokens_total") > 0
    # Prefix hits: the same prompts again on one engine.
    llm = LLM(MODELS[name], max_num_seqs=4, max_model_len=128, num_speculative_tokens=3)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    again = llm.generate(PROMPTS, params)
    assert first == off and [o.token_ids for o in again] == off
    assert sum(o.num_cached_tokens for o in again) > 0


def test_seeded_sampling_is_identical_with_speculation() -> None:
    params = resin.SamplingParams(
        max_tokens=24, temperature=0.7, top_p=0.95, seed=3, ignore_eos=True
    )
    off, _ = _generate(MODELS["llama"], 0, params)
    on, llm = _generate(MODELS["llama"], 3, params)
    assert on == off
    assert _metric(llm, "spec_decode_num_drafts_total") > 0


def test_recurrent_models_refuse_speculation() -> None:
    with pytest.raises(ValueError, match="recurrent"):
        LLM(REPO / "resin" / "models" / "qwen3_next" / "tiny", num_speculative_tokens=2)
