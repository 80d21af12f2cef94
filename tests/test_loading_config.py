"""``resin.loading.config``: HF ``config.json`` parsing, per-layer cache specs, errors.

Config dicts are copies of the real checkpoints' ``config.json`` (``tests/hf_configs.py``:
Llama-3.1-8B, Mistral-7B-v0.1, Qwen2.5-7B-Instruct with YaRN, Qwen3-8B, Qwen3-30B-A3B,
Mixtral-8x7B-v0.1), plus dicts written by transformers' own config classes (which use the
transformers-5 ``rope_parameters`` spelling); parsed fields are checked against both the
values the modeling code uses and transformers' config objects. RoPE: ``test_loading_rope.py``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers  # noqa: E402  (test dependency, installed by make; fail loudly if missing)
from hf_configs import (
    HF_CLASSES,
    LLAMA31_8B,
    MISTRAL_7B,
    MIXTRAL_8X7B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN25_7B,
    REAL,
)

import resin
from resin.loading import (
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    RopeConfig,
    layer_cache_specs,
    load_model_config,
    rope_inv_freq,
)


def hf_config(model_type: str, raw: dict[str, Any]) -> Any:
    # Deep copy: transformers' config classes fill defaults into the nested rope dict in place.
    return getattr(transformers, HF_CLASSES[model_type]).from_dict(copy.deepcopy(raw))


def test_llama31_8b() -> None:
    cfg = load_model_config(LLAMA31_8B)
    assert (cfg.architecture, cfg.model_type) == ("LlamaForCausalLM", "llama")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128256, 14336, 32)
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.qk_norm) == (False,) * 4
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.bos_token_id == 128000
    assert cfg.rms_norm_eps == 1e-5 and cfg.dtype == "bfloat16" and cfg.moe is None
    assert cfg.layer_types == ("full_attention",) * 32 and cfg.sliding_window_tokens is None
    assert cfg.rope == RopeConfig(
        "llama3",
        500000.0,
        factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )


def test_mistral_7b_v01_slides_every_layer() -> None:
    cfg = load_model_config(MISTRAL_7B)
    assert cfg.layer_types == ("sliding_attention",) * 32 and cfg.sliding_window_tokens == 4096
    assert cfg.layer_window_tokens(0) == 4096 and cfg.rope == RopeConfig(theta=10000.0)
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.eos_token_ids) == (False, False, (2,))
    specs = layer_cache_specs(cfg, kv_dtype_bytes=2)
    assert len(specs) == 32 and {s.kind for s in specs} == {"sliding_window"}
    assert specs[0].window == 4096 and specs[0].bytes_per_token == 2 * 8 * 128 * 2
    # Mistral v0.2+ write "sliding_window": null: full attention everywhere.
    full = load_model_config({**MISTRAL_7B, "sliding_window": None})
    assert full.sliding_window_tokens is None and full.layer_types == ("full_attention",) * 32


def test_mistral_listing_layer_types_alternates_as_transformers_auto_config(
    tmp_path: Path,
) -> None:
    # transformers' AutoConfig reads a "mistral" config with `layer_types` as Ministral
    # (Ministral-8B's checkpoints are written this way), which honours the list per layer.
    raw = {**MISTRAL_7B, "num_hidden_layers": 4}
    raw["layer_types"] = ["full_attention", "sliding_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    cfg = load_model_config(raw)
    assert type(hf).__name__ == "MinistralConfig"
    assert cfg.layer_types == tuple(hf.layer_types) == tuple(raw["layer_types"])
    assert cfg.layer_window_tokens(0) is None and cfg.layer_window_tokens(1) == 4096
    # A null list is Ministral's default: the window on every layer, as plain Mistral.
    assert load_model_config({**raw, "layer_types": None}).layer_types == ("sliding_attention",) * 4


def test_qwen25_7b_yarn_and_qkv_bias() -> None:
    cfg = load_model_config(QWEN25_7B)
    assert cfg.head_dim == 3584 // 28 == 128 and cfg.num_key_value_heads == 4
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.qk_norm) == (True, False, False, False)
    # use_sliding_window false: the 131072 window is not in effect on any layer.
    assert cfg.layer_types == ("full_attention",) * 28 and cfg.sliding_window_tokens is None
    assert cfg.rope == RopeConfig(
        "yarn",
        1e6,
        factor=4.0,
        original_max_position_embeddings=32768,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=True,
    )
    assert {s.kind for s in layer_cache_specs(cfg, 2)} == {"full"}


def test_qwen2_max_window_layers_and_explicit_layer_types() -> None:
    raw = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 20}
    cfg = load_model_config(raw)
    assert cfg.layer_types == ("full_attention",) * 20 + ("sliding_attention",) * 8
    assert cfg.layer_types == tuple(hf_config("qwen2", raw).layer_types)
    specs = layer_cache_specs(cfg, kv_dtype_bytes=1)
    assert [s.kind for s in specs[19:21]] == ["full", "sliding_window"]
    assert specs[20].window == 1024 and specs[20].bytes_per_token == 2 * 4 * 128 * 1
    explicit = ["sliding_attention" if i % 2 else "full_attention" for i in range(28)]
    cfg = load_model_config({**raw, "layer_types": explicit})
    assert cfg.layer_types == tuple(explicit) and cfg.layer_window_tokens(1) == 1024
    assert cfg.layer_window_tokens(0) is None


def test_qwen3_8b_qk_norm() -> None:
    cfg = load_model_config(QWEN3_8B)
    assert cfg.qk_norm and cfg.head_dim == 128 and cfg.rope == RopeConfig(theta=1e6)
    assert isinstance(cfg.rope.theta, float)
    assert (cfg.qkv_bias, cfg.o_proj_bias) == (False, False)
    assert cfg.layer_types == ("full_attention",) * 36 and cfg.max_position_embeddings == 40960
    biased = load_model_config({**QWEN3_8B, "attention_bias": True})
    assert (biased.qkv_bias, biased.o_proj_bias) == (True, True)  # Qwen3 biases o_proj too
    # Qwen3Config's class default head_dim is 128, not hidden_size // num_attention_heads.
    no_head_dim = {k: v for k, v in QWEN3_8B.items() if k != "head_dim"}
    assert load_model_config({**no_head_dim, "hidden_size": 1024}).head_dim == 128


def test_qwen3_30b_a3b_moe() -> None:
    cfg = load_model_config(QWEN3_30B_A3B)
    assert cfg.qk_norm and cfg.head_dim == 128 and cfg.hidden_size == 2048  # head_dim != 2048/32
    moe = cfg.moe
    assert moe is not None
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.num_shared_experts == 0
    assert moe.moe_layer_indices == tuple(range(48)) and cfg.is_moe_layer(47)
    raw = {
        **QWEN3_30B_A3B,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [1, 5],
    }
    moe = load_model_config(raw).moe
    assert moe is not None and not moe.norm_topk_prob
    # Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % step == 0.
    assert moe.moe_layer_indices == tuple(i for i in range(48) if i % 2 == 1 and i not in (1, 5))
    windowed = load_model_config(
        {**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 512}
    )
    assert windowed.layer_types == ("sliding_attention",) * 48  # every layer, no max_window_layers


def test_mixtral_8x7b_always_renormalises() -> None:
    cfg = load_model_config(MIXTRAL_8X7B)
    moe = cfg.moe
    assert moe is not None and moe.norm_topk_prob  # MixtralTopKRouter divides by the top-k sum
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 14336)
    assert moe.moe_layer_indices == tuple(range(32)) and cfg.rope == RopeConfig(theta=1e6)
    assert cfg.layer_types == ("full_attention",) * 32
    assert load_model_config({**MIXTRAL_8X7B, "norm_topk_prob": False}).moe == moe


@pytest.mark.parametrize("model_type", sorted(REAL))
def test_agrees_with_transformers_config_classes(model_type: str) -> None:
    raw = REAL[model_type]
    ours, hf = load_model_config(raw), hf_config(model_type, raw)
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.head_dim == (
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    )
    assert ours.sliding_window_tokens == getattr(hf, "sliding_window", None)
    if hasattr(hf, "layer_types"):
        assert ours.layer_types == tuple(hf.layer_types)
    # transformers' to_dict() writes `rope_parameters` (the >= 5 spelling); same config back.
    again = load_model_config(hf.to_dict())
    assert again == ours


@pytest.mark.parametrize("model_type", sorted(HF_CLASSES))
def test_transformers_class_defaults_round_trip(model_type: str) -> None:
    small = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    hf = getattr(transformers, HF_CLASSES[model_type])(**small)
    cfg = load_model_config(hf.to_dict())
    assert cfg.model_type == model_type and cfg.architecture in SUPPORTED_ARCHITECTURES
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers) == (16, 2, 3)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"]
    assert cfg.eos_token_ids == (() if hf.eos_token_id is None else (hf.eos_token_id,))
    if cfg.moe is not None:
        assert cfg.moe.num_experts == hf.num_local_experts
        assert cfg.moe.num_experts_per_tok == hf.num_experts_per_tok


def test_parsing_does_not_mutate_its_input() -> None:
    for raw in (
        *REAL.values(),
        {**MISTRAL_7B, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
    ):
        before = copy.deepcopy(raw)
        load_model_config(raw)
        assert raw == before


def test_load_from_directory_and_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    assert load_model_config(tmp_path) == load_model_config(QWEN3_8B)
    assert load_model_config(str(tmp_path / "config.json")) == load_model_config(QWEN3_8B)


def test_error_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"config.json not found: {tmp_path / 'config.json'}"):
        load_model_config(tmp_path)
    with pytest.raises(ConfigError, match="nope.json"):
        load_model_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_model_config(tmp_path)


def test_error_unsupported_architecture() -> None:
    with pytest.raises(
        ConfigError, match="'GPT2LMHeadModel'.*LlamaForCausalLM.*MixtralForCausalLM"
    ):
        load_model_config({**LLAMA31_8B, "architectures": ["GPT2LMHeadModel"]})
    no_arch = {k: v for k, v in LLAMA31_8B.items() if k != "architectures"}
    with pytest.raises(ConfigError, match="model_type 'gpt2'.*Qwen3MoeForCausalLM"):
        load_model_config({**no_arch, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="'architectures'"):
        load_model_config({k: v for k, v in no_arch.items() if k != "model_type"})


def test_error_model_type_of_another_family() -> None:
    # transformers builds the model from model_type: a Granite config naming LlamaForCausalLM
    # is a Granite (its embedding / residual / logit multipliers), not a Llama.
    with pytest.raises(
        ConfigError, match="'granite' \\(a transformers family Resin does not run\\)"
    ):
        load_model_config({**LLAMA31_8B, "model_type": "granite"})
    with pytest.raises(ConfigError, match="'qwen2' \\(Qwen2ForCausalLM\\)"):
        load_model_config({**LLAMA31_8B, "model_type": "qwen2"})


def test_error_bidirectional_attention() -> None:
    # is_causal false makes transformers build a bidirectional mask for any decoder
    # (masking_utils.create_causal_mask): positions see later tokens, which a KV cache cannot.
    for raw in (LLAMA31_8B, MISTRAL_7B, QWEN3_8B):
        with pytest.raises(ConfigError, match="is_causal false"):
            load_model_config({**raw, "is_causal": False})
    assert load_model_config({**LLAMA31_8B, "is_causal": True}).architecture == "LlamaForCausalLM"


def test_legacy_layer_type_names_as_transformers_renames_them() -> None:
    raw = {**QWEN25_7B, "num_hidden_layers": 2, "layer_types": ["attention", "attention"]}
    assert load_model_config(raw).layer_types == ("full_attention",) * 2
    assert tuple(hf_config("qwen2", raw).layer_types) == ("full_attention",) * 2


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"],
)
def test_error_missing_required_field(field: str) -> None:
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        load_model_config({k: v for k, v in LLAMA31_8B.items() if k != field})


def test_error_missing_moe_fields() -> None:
    with pytest.raises(ConfigError, match="'num_experts'"):
        load_model_config({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"})
    with pytest.raises(ConfigError, match="'moe_intermediate_size'"):
        load_model_config({k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"})


def test_error_unsupported_rope_type() -> None:
    for spelling in ("rope_scaling", "rope_parameters"):
        with pytest.raises(ConfigError, match="unsupported rope type 'su'.*llama3, yarn"):
            load_model_config({**MISTRAL_7B, spelling: {"type": "su", "factor": 2.0}})
    with pytest.raises(ConfigError, match="'longrope'"):
        rope_inv_freq(RopeConfig("longrope", 10000.0, factor=2.0), 64)
    llama3 = {k: v for k, v in LLAMA31_8B["rope_scaling"].items() if k != "low_freq_factor"}
    with pytest.raises(ConfigError, match="missing required field 'low_freq_factor'"):
        load_model_config({**LLAMA31_8B, "rope_scaling": llama3})


def test_error_inconsistent_shapes_and_types() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_model_config({**LLAMA31_8B, "num_key_value_heads": 5})
    with pytest.raises(ConfigError, match="'hidden_size' must be int"):
        load_model_config({**LLAMA31_8B, "hidden_size": "4096"})
    with pytest.raises(ConfigError, match="'layer_types' must list 28"):
        load_model_config({**QWEN25_7B, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ConfigError, match=r"layer_types\[0\].*no sliding window"):
        load_model_config({**QWEN25_7B, "layer_types": ["sliding_attention"] * 28})
    # The default rope ignores partial_rotary_factor, as every built-in modeling file's
    # compute_default_rope_parameters does; the other types size inv_freq by it, and HF then
    # fails on the shape, so Resin refuses.
    assert load_model_config({**QWEN3_8B, "partial_rotary_factor": 0.5}).rope == (
        load_model_config(QWEN3_8B).rope
    )
    linear = {**QWEN3_8B, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        load_model_config({**linear, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="kv_dtype_bytes"):
        layer_cache_specs(load_model_config(QWEN3_8B), 0)


def test_import_resin_does_not_load_transformers_or_torch() -> None:
    code = (
        "import sys, resin; a = set(sys.modules); import resin.loading; b = set(sys.modules);"
        "print(' '.join(sorted(a))); print(' '.join(sorted(b)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    after_resin, after_loading = (set(line.split()) for line in done.stdout.splitlines())
    assert "resin.loading" not in after_resin
    for modules in (after_resin, after_loading):
        assert not {m.split(".")[0] for m in modules} & {"torch", "transformers"}
    assert "LayerCacheSpec" in dir(resin)
