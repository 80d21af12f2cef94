"""``resin.llm.LLM``: the offline API over the tiny fixture checkpoints in ``tests/fixtures``.

Most tests drive the engine with a stand-in runner whose next token is ``(last token + 1) mod
vocab`` (no torch needed), so batching, ordering, text, finish reasons, prefix-cache hits,
logprobs and ``chat`` are checked exactly. The end-to-end test runs the torch reference runner
and compares greedy tokens with the HF goldens written by ``scripts/make_fixtures.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import resin
from resin.llm import LLM, LLMOutput, default_num_pages, page_id_bytes
from resin.registry import UnknownArchitectureError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL_FIXTURES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
LLAMA = FIXTURES / "llama"
VOCAB = 384
EOS = 1


class CountingRunner:
    """Samples ``(last input token of the row + 1) % VOCAB``; logprobs are fixed fakes."""

    def __init__(self) -> None:
        self.num_steps = 0

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        self.num_steps += 1
        ends = plan.query_indptr[1:].astype(np.int64) - 1
        rows = np.repeat(np.arange(plan.num_sequences), np.diff(plan.sample_indptr))
        tokens = ((plan.input_ids[ends[rows]].astype(np.int64) + 1) % VOCAB).astype(np.uint32)
        k = int(plan.sampling.num_logprobs.max(initial=-1))
        if k < 0:
            return resin.ForwardOutput(tokens, plan.sample_indptr)
        n = len(tokens)
        top_ids = (tokens[:, None].astype(np.int64) + np.arange(k)) % VOCAB if k else None
        top_vals = np.tile(-np.arange(k, dtype=np.float32) - 0.25, (n, 1)) if k else None
        return resin.ForwardOutput(
            tokens,
            plan.sample_indptr,
            np.full(n, -0.25, np.float32),
            None if top_ids is None else top_ids.astype(np.uint32),
            top_vals,
        )


class SpecRunner(CountingRunner):
    """A counting runner that declares ``specs`` as its layers' caches."""

    def __init__(self, specs: list[resin.LayerCacheSpec]) -> None:
        super().__init__()
        self.specs = specs

    def cache_spec(self) -> list[resin.LayerCacheSpec]:
        return self.specs

    def bind_cache(self, layout: resin.CacheLayout) -> None:
        pass


def counting(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % VOCAB
        out.append(last)
        if last == EOS:
            break
    return out


@pytest.fixture
def llm() -> LLM:
    return LLM(LLAMA, runner=CountingRunner())


def greedy(n: int, **kwargs: object) -> resin.SamplingParams:
    return resin.SamplingParams(max_tokens=n, temperature=0.0, **kwargs)  # type: ignore[arg-type]


def test_generate_strings_and_token_ids_in_order(llm: LLM) -> None:
    prompts: list[str | list[int]] = ["def main():", [0, 5, 6, 7], "Hello, world!", [0, 200]]
    outputs = llm.generate(prompts, greedy(6))
    assert len(outputs) == 4 and all(isinstance(o, LLMOutput) for o in outputs)
    assert len({o.request_id for o in outputs}) == 4
    for prompt, out in zip(prompts, outputs):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt == (prompt if isinstance(prompt, str) else None)
        assert out.prompt_token_ids == ids
        assert out.token_ids == counting(ids, 6)
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.logprobs is None
    # A single string and a single token-id list are one prompt each.
    assert llm.generate("def main():", greedy(6))[0].token_ids == outputs[0].token_ids
    assert llm.generate([0, 5, 6, 7], greedy(6))[0].token_ids == outputs[1].token_ids
    assert llm.generate([], greedy(1)) == []


def test_per_prompt_params_and_stop_token_excluded_from_text(llm: LLM) -> None:
    stop_prompt = [0, 380]  # 381, 382, 383, 0 (<|bos|>), 1 (<|eos|>) -> stop
    outputs = llm.generate([stop_prompt, [0], [0, 10]], [greedy(16), greedy(16), greedy(3)])
    stopped, immediate, short = outputs
    assert stopped.token_ids == [381, 382, 383, 0, EOS] and stopped.finish_reason == "stop"
    assert stopped.text == llm.tokenizer.decode([381, 382, 383, 0], skip_special_tokens=True)
    assert (immediate.token_ids, immediate.finish_reason, immediate.text) == ([EOS], "stop", "")
    assert (short.token_ids, short.finish_reason) == ([11, 12, 13], "length")
    # A non-special stop token is in token_ids but not in the text.
    out = llm.generate([0, 40], greedy(16, stop_token_ids=[44]))[0]
    assert out.token_ids == [41, 42, 43, 44] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode([41, 42, 43])
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[0, 1], [0, 2]], [greedy(1)])


def test_prefix_cache_hit_on_repeated_prompt(llm: LLM) -> None:
    prompt = [0] + list(range(100, 150))  # 51 tokens: three full pages of 16
    first = llm.generate(prompt, greedy(4))[0]
    second = llm.generate(prompt, greedy(4))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48
    assert second.token_ids == first.token_ids == counting(prompt, 4)
    assert not llm.engine.has_unfinished()


def test_logprobs(llm: LLM) -> None:
    out = llm.generate([0, 7], greedy(3, logprobs=2))[0]
    assert out.token_ids == [8, 9, 10]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token] == pytest.approx(-0.25)
        assert set(entry) == {token, token + 1}


def test_chat_equals_generate_of_rendered_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(messages, greedy(5))[0]
    rendered = llm.chat_template.render(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt == rendered
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)  # the template adds specials
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate(ids, greedy(5))[0].token_ids
    both = llm.chat([messages, [{"role": "user", "content": "yo"}]], greedy(2))
    assert [o.prompt_token_ids for o in both][0] == ids and len(both) == 2


def test_default_sampling_params_come_from_generation_config(tmp_path: Path) -> None:
    model = tmp_path / "llama"
    shutil.copytree(LLAMA, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, max_new_tokens=7)
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(model, runner=CountingRunner())
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (
        pytest.approx(0.6),
        pytest.approx(0.9),
        7,
    )
    assert len(llm.generate([0, 20])[0].token_ids) == 7
    assert llm.engine.config.eos_token_ids == [1, 3]
    assert llm.engine.config.vocab_size == VOCAB


def test_engine_defaults_and_overrides() -> None:
    llm = LLM(LLAMA, runner=CountingRunner(), page_size=4, max_num_seqs=2)
    config = llm.engine.config
    assert (config.page_size, config.max_num_seqs, config.max_model_len) == (4, 2, 512)
    assert config.num_pages == 1 + 2 * 512 // 4
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(LLAMA, runner=CountingRunner(), pages=3)


def test_default_num_pages_rule() -> None:
    # Everything fits: max_num_seqs full-length requests plus the null page.
    assert default_num_pages(16, 2 * 16 * 64, 4, 1 << 30) == 1 + 4 * 16
    # Memory-bound: as many pages as fit, but never less than one full-length request.
    assert default_num_pages(16, 2 * 16 * 64, 4, 10 * 16 * 128) == 1 + 16
    assert default_num_pages(16, 2 * 16 * 64, 4, 40 * 16 * 128) == 1 + 40


def test_pool_sizing_counts_every_group_by_the_engine_rule() -> None:
    # Two full layers of 64 B/token, a sliding-window layer, a compressed layer (ratio 4,
    # 32 B entries) and a recurrent one, at page_size 16.
    spec = resin.LayerCacheSpec
    specs = [
        spec.full(64),
        spec.full(64),
        spec.sliding_window(32, 64),
        spec.compressed(4, 32),
        spec.recurrent(5000),
    ]
    layout = resin.CacheLayout.from_specs(specs, 16)
    # 256 tokens: 16 pages in each full group (two, of one layer each); window 32 + a 64-token
    # chunk: ceil(95 / 16) + 1 = 7; 64 entries at 4 per page: 16; one state of
    # ceil(5000 / 1024) = 5 pages + a checkpoint.
    assert layout.pages_per_request(256, 64, True) == 2 * 16 + 7 + 16 + 10
    assert layout.pages_per_request(256, 64, False) == 2 * 16 + 7 + 16 + 5
    # Buckets of 2 full, 1 window, 1 recurrent layer -> groups of 1 layer, one shared slot of
    # 1 KiB pages; plus a compressed page of 4 * 32 B.
    assert layout.num_layer_slots == 1
    assert page_id_bytes(layout) == 1024 + 128
    # The engine accepts exactly that many pages plus the null page.
    runner = SpecRunner(specs)

    def config(num_pages: int) -> resin.EngineConfig:
        return resin.EngineConfig(
            page_size=16, num_pages=num_pages, max_model_len=256, max_num_batched_tokens=64
        )

    assert resin.Engine(config(1 + 65), runner).config.num_pages == 66
    with pytest.raises(ValueError, match="too small"):
        resin.Engine(config(65), runner)


def test_missing_model_dir_and_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope", runner=CountingRunner())
    model = tmp_path / "gpt2"
    shutil.copytree(LLAMA, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model / "config.json").write_text(json.dumps(config))
    # No registered model runs GPT-2: one error naming it, what is registered, how to add one.
    with pytest.raises(UnknownArchitectureError, match="GPT2LMHeadModel") as info:
        LLM(model)
    assert "resin new-model" in str(info.value) and "LlamaForCausalLM" in str(info.value)
    LLM(model, runner=CountingRunner())  # an explicit runner runs any architecture
    with pytest.raises(TypeError, match="prompt"):
        LLM(LLAMA, runner=CountingRunner()).generate([1.5])  # type: ignore[arg-type]


def test_import_does_not_load_torch() -> None:
    code = "import sys, resin, resin.llm, resin.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _torch_runner_available() -> bool:
    try:
        from resin.runners.torch import TorchRunner  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _torch_runner_available(), reason="resin.runners.torch not available")
@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_greedy_tokens_equal_hf_goldens(name: str) -> None:
    goldens = json.loads((FIXTURES / name / "goldens.json").read_text())
    llm = LLM(FIXTURES / name)
    cases = goldens["prompts"]
    outputs = llm.generate(
        [c["prompt_token_ids"] for c in cases], greedy(goldens["max_new_tokens"], logprobs=0)
    )
    for case, out in zip(cases, outputs):
        length = len(case["prompt_token_ids"])
        assert out.token_ids == case["token_ids"], f"{name}: prompt of {length} tokens"
        assert out.finish_reason == case["finish_reason"], f"{name}: prompt of {length} tokens"
        assert out.logprobs is not None
        for entry, token, top in zip(out.logprobs, out.token_ids, case["top_logprobs"]):
            assert entry[token] == pytest.approx(top[str(token)], abs=2e-3)
    text_case = next(c for c in cases if c["text"] == "def main():")
    assert llm.generate("def main():", greedy(16))[0].token_ids == text_case["token_ids"]
