"""End-to-end tests of the torch reference runner against live HF transformers.

For each supported architecture a tiny random checkpoint (weights scaled up so greedy
choices are not near ties) is saved with ``save_pretrained``; greedy generation through
``resin.Engine`` + ``TorchRunner`` must equal ``generate(do_sample=False)`` token for token,
for several prompts in one batch, under the stress settings of the parity harness: page
sizes 1, 16 and 64, chunked prefill, a prefix-cache hit and preemption. Logits are compared
with HF's at every prompt position (capture hooks) and at the last one (logprobs).
Also: weight loading (sharded, tied embeddings, bf16) and its error messages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import resin
from resin.loading import load_model_config
from resin.loading.weights import WeightsError, load_weights
from resin.runners.torch import TorchRunner

PROMPTS = [
    [3, 5, 7],
    [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 7],
    [100 - i for i in range(21)],
]
NUM_NEW_TOKENS = 8
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHITECTURES: dict[str, Any] = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2
    ),
}


def make_checkpoint(hf_config: Any, directory: Path, seed: int = 0, **save_kwargs: Any) -> Any:
    """A random HF model with large weights, saved as safetensors; returns the model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param.dim() == 1:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None  # generate exactly NUM_NEW_TOKENS
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    return model


class Reference:
    def __init__(self, architecture: str, directory: Path, model: Any):
        self.architecture = architecture
        self.directory = directory
        self.model = model
        with torch.no_grad():
            self.tokens = [
                model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS)[
                    0, len(p) :
                ].tolist()
                for p in PROMPTS
            ]
            self.prompt_logits = [model(torch.tensor([p])).logits[0] for p in PROMPTS]
        assert all(len(t) == NUM_NEW_TOKENS for t in self.tokens)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    directory = tmp_path_factory.mktemp(request.param)
    return Reference(
        request.param, directory, make_checkpoint(ARCHITECTURES[request.param](), directory)
    )


def run_engine(directory: Path, batches: int = 1, **config: Any) -> tuple[list[list[Any]], Any]:
    """Greedy-generate PROMPTS in one batch (``batches`` times in a row); outputs per batch."""
    engine = resin.Engine(resin.EngineConfig(**config), TorchRunner.from_pretrained(directory))
    params = resin.SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = []
    for batch in range(batches):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{batch}-{i}", prompt, params)
        finished: dict[str, Any] = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        results.append([finished[f"{batch}-{i}"] for i in range(len(PROMPTS))])
    engine.check_integrity()
    return results, engine


STRESS = {
    "page_size_1_chunked": dict(page_size=1, num_pages=512, max_num_batched_tokens=5),
    "page_size_16": dict(page_size=16, num_pages=64),
    "page_size_64_chunked": dict(page_size=64, num_pages=16, max_num_batched_tokens=11),
}


@pytest.mark.parametrize("setting", list(STRESS))
def test_greedy_matches_hf(reference: Reference, setting: str) -> None:
    (outputs,), _ = run_engine(reference.directory, max_model_len=64, **STRESS[setting])
    assert [o.token_ids for o in outputs] == reference.tokens


def test_prefix_cache_hit_matches_hf(reference: Reference) -> None:
    (first, second), _ = run_engine(
        reference.directory, batches=2, page_size=4, num_pages=128, max_model_len=64
    )
    assert [o.token_ids for o in first] == reference.tokens
    assert [o.token_ids for o in second] == reference.tokens
    assert max(o.num_cached_tokens for o in second) > 0


def test_preemption_matches_hf(reference: Reference) -> None:
    # The pool fits one request of max_model_len but not all three prompts' growth. Mistral's
    # window frees pages as it goes, so it needs a smaller pool (and small prefill chunks, so
    # that one chunk plus the window fits in it).
    small_pool = (
        dict(num_pages=22, max_num_batched_tokens=8)
        if reference.architecture == "mistral"
        else dict(num_pages=42)
    )
    (outputs,), engine = run_engine(
        reference.directory, page_size=1, max_model_len=32, **small_pool
    )
    assert [o.token_ids for o in outputs] == reference.tokens
    preemptions = [
        line
        for line in engine.metrics_text().splitlines()
        if line.startswith("resin:num_preemptions_total")
    ]
    assert preemptions and float(preemptions[0].split()[-1]) > 0


def test_logits_match_hf(reference: Reference) -> None:
    """Every prompt position (capture hook) and the sampled position (logprobs) vs HF."""
    runner = TorchRunner.from_pretrained(reference.directory)
    engine = resin.Engine(resin.EngineConfig(page_size=16, num_pages=64, max_model_len=64), runner)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(
            str(i), prompt, resin.SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        )
    captured: dict[str, torch.Tensor] = {}
    runner.capture = captured
    outputs = {o.request_id: o for o in engine.step()}
    start = 0
    for i, (prompt, hf_logits) in enumerate(zip(PROMPTS, reference.prompt_logits)):
        ours = captured["lm_head"][start : start + len(prompt)]
        start += len(prompt)
        torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=1e-5)
        hf_top = torch.log_softmax(hf_logits[-1], dim=-1).topk(5)
        assert list(outputs[str(i)].logprobs[0]) == hf_top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor(list(outputs[str(i)].logprobs[0].values())),
            hf_top.values,
            atol=1e-4,
            rtol=1e-5,
        )
    layers = {name for name in captured if name.startswith("model.layers.0")}
    assert layers == {
        "model.layers.0",
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp",
    }


# -- weights -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama_weights")
    make_checkpoint(ARCHITECTURES["llama"](), directory)
    return directory


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_sharded_and_tied_checkpoints(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)
    model = make_checkpoint(config, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    weights = load_weights(tmp_path, load_model_config(tmp_path))
    assert "lm_head.weight" not in weights
    runner = TorchRunner.from_pretrained(tmp_path)
    assert runner.lm_head is runner.embed_tokens  # tied: no lm_head tensor loaded
    (outputs,), _ = run_engine(tmp_path, page_size=4, num_pages=128, max_model_len=64)
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]
    assert [o.token_ids for o in outputs] == expected


def test_load_dtype_and_device(llama_dir: Path) -> None:
    weights = load_weights(llama_dir, load_model_config(llama_dir), dtype=torch.bfloat16)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert {w.device.type for w in weights.values()} == {"cpu"}
    with pytest.raises(WeightsError, match="unsupported dtype"):
        load_weights(llama_dir, load_model_config(llama_dir), dtype=torch.int8)


def test_missing_weights_file(llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    (directory / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="model.safetensors"):
        TorchRunner.from_pretrained(directory)


def test_a_quantization_config_over_plain_weights_is_refused(
    llama_dir: Path, tmp_path: Path
) -> None:
    # (A block-scaled FP8 checkpoint loads dequantised: test_checkpoint_errors.)
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"quantization_config \(fp8\), but no tensor"):
        TorchRunner.from_pretrained(directory)


def test_missing_shard(tmp_path: Path) -> None:
    make_checkpoint(ARCHITECTURES["llama"](), tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(WeightsError, match=shard):
        TorchRunner.from_pretrained(tmp_path)


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        TorchRunner.from_pretrained(directory)


def test_shape_mismatch_is_named(llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    config["num_key_value_heads"] = 4  # k_proj/v_proj in the file have 2 heads
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"k_proj\.weight has shape \(32, 64\).*\(64, 64\)"):
        TorchRunner.from_pretrained(directory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_matches_cpu(llama_dir: Path) -> None:
    cpu, _ = run_engine(llama_dir, page_size=16, num_pages=64, max_model_len=64)
    engine = resin.Engine(
        resin.EngineConfig(page_size=16, num_pages=64, max_model_len=64),
        TorchRunner.from_pretrained(llama_dir, device="cuda"),
    )
    params = resin.SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [finished[str(i)] for i in range(len(PROMPTS))] == [o.token_ids for o in cpu[0]]
