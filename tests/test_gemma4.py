"""resin/models/gemma4 (Gemma 4's text model, shipped as the multimodal wrapper
Gemma4ForConditionalGeneration; the text model is served) passes the parity harness on its
committed tiny checkpoint and on the layouts of the released checkpoints, the harness would
catch the bugs a port is prone to, and ``resin serve`` runs it.

- The tiny checkpoint is a wrapper checkpoint (``model.language_model.*`` + one-layer vision
  and audio towers) whose text model has every Gemma 4 sub-module at once: sliding and full
  layers (full: their own head dim, one K = V head, proportional rope), the last three layers
  reusing the K/V of layers 2 and 3 with double-wide MLPs, the MoE branch beside the dense MLP,
  per-layer embeddings, randomised norm / router / ``layer_scalar`` weights (HF inits them to
  ones), a window and a logit cap the parity prompts reach.
- fp32 every stage, bf16 / fp16 layers bit-exact.
- Planted bugs: a shared layer attending over its own (never written) cache, proportional rope
  read as plain partial rope, ``attention_k_eq_v``'s V taken after the K norm, the router's
  ``per_expert_scale`` dropped, the experts summed in the model dtype (the class's eager
  forward, not transformers' default dispatch), ``layer_scalar`` dropped, the wrapper's
  placeholder ids embedded as themselves.
- Variants (fresh checkpoints from source/make_tiny.py): the E2B / E4B layout (per-layer
  embeddings, K/V sharing, no MoE), 26B-A4B's (MoE, K = V full layers, bidirectional-vision
  flag) and 31B's (dense, K = V), a hub-style config.json (``global_head_dim`` /
  ``num_global_key_value_heads`` instead of ``per_layer_config``), the text model saved by
  ``Gemma4ForCausalLM`` (``gemma4_text``), which the registry resolves to this directory.
- Configs the blocks do not compute are refused at load, naming the field.
- Serving: a chat request through the tiny's template answers as ``LLM.chat``.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from tests.model_variants import model_parity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "gemma4"
TINY = MODEL_DIR / "tiny"
parity = partial(model_parity, MODEL_DIR)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "gemma4")


@pytest.fixture(scope="module")
def make_tiny() -> Any:
    """source/make_tiny.py: ``write(out, text_config(**changes), seed)``."""
    return import_model_module(MODEL_DIR / "source", "make_tiny", "gemma4_source")


def departs_at(report: Any) -> tuple[Any, Any]:
    first = report.first_departure
    assert first is not None, report.summary()
    return first["layer"], first["module"]


def test_tiny_is_a_wrapper_checkpoint_that_cannot_hide_gemma4_bugs(blocks: Any) -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert {"vision_config", "audio_config", "text_config"} <= set(config)
    text = blocks.normalise_config(config)
    assert text["layer_types"].count("full_attention") == 3 and text["sliding_window"] < 70
    assert blocks.kv_sources(text) == [None] * 4 + [2, 3, 2]  # both types shared
    assert text["attention_k_eq_v"] and text["enable_moe_block"]
    assert blocks.per_layer_dim(text) and text["use_double_wide_mlp"]
    assert blocks.layer_geometry(text, 2) == (24, 1) and blocks.layer_geometry(text, 0) == (16, 2)
    assert float(text["hidden_size"]) ** 0.5 != float(
        torch.tensor(float(text["hidden_size"]) ** 0.5).bfloat16()
    )
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert any(n.startswith("model.vision_tower.") for n in tensors)
    assert any(n.startswith("model.audio_tower.") for n in tensors)
    ones = ("norm.weight", "router.scale", "per_expert_scale", "layer_scalar")
    for name, t in tensors.items():
        if name.startswith("model.language_model.") and name.endswith(ones):
            assert not torch.allclose(t, torch.ones_like(t)), name
    assert "model.language_model.layers.4.self_attn.k_proj.weight" not in tensors  # shared
    assert "model.language_model.layers.2.self_attn.v_proj.weight" not in tensors  # K = V
    wide = tensors["model.language_model.layers.5.mlp.gate_proj.weight"].shape[0]
    assert wide == 2 * text["intermediate_size"]


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    layers = report.stage("layers")
    assert not layers.metrics["missing"] and layers.metrics["num_checkpoints"] == 114
    assert layers.metrics["max_scaled_diff"] < 1e-6
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    assert report.stage("greedy/preemption").metrics["num_preemptions"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parity_half_layers_bit_exact(dtype: str) -> None:
    report = parity(dtype=dtype, layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0


def test_a_shared_layer_reading_its_own_cache_fails_at_layer_4(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 4 (the first K/V-sharing layer) attending over the cache the runner gave it (never
    written) instead of its producer's."""
    right = blocks.step_state

    def own_cache(ctx: Any) -> Any:
        state = right(ctx)
        if blocks.kv_sources(ctx.config)[ctx.index] is not None:
            state[("kv", blocks.kv_sources(ctx.config)[ctx.index])] = ctx.attention
        return state

    monkeypatch.setattr(blocks, "step_state", own_cache)
    assert departs_at(parity(layers_only=True)) == (4, "self_attn")


def test_proportional_rope_read_as_partial_rope_fails_at_the_first_full_layer(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rotating the first ``partial_rotary_factor * head_dim`` channels with exponents over that
    width (the usual partial rope) instead of HF's proportional layout."""
    from resin.runners.torch.layers import RotaryEmbedding

    right = blocks.gemma4_text_rotary_embedding

    def partial(config: Any, head_dim: int, device: Any) -> Any:
        tables = right(config, head_dim, device)
        dim = blocks.layer_geometry(config, 2)[0] // 4
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        tables["full_attention"] = RotaryEmbedding(inv_freq.numpy(), 1.0, device)
        return tables

    monkeypatch.setitem(blocks.ROTARY, "Gemma4TextRotaryEmbedding", partial)
    assert departs_at(parity(layers_only=True)) == (2, "self_attn")


def test_k_eq_v_value_after_the_k_norm_fails_at_layer_2(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 2 (full, K = V) taking V from the k-normed projection instead of the raw one."""
    import torch.nn.functional as F

    from resin.runners.torch.layers import apply_rotary

    right = blocks.gemma4_text_attention

    def attention(x: Any, w: Any, ctx: Any) -> Any:
        if ctx.index != 2:
            return right(x, w, ctx)
        n, eps, dim = x.shape[0], float(ctx.config.rms_norm_eps), w["q_norm.weight"].shape[0]
        cos, sin = ctx.require_rotary()
        q = F.linear(x, w["q_proj.weight"]).view(n, -1, dim)
        q = apply_rotary(blocks.gemma4_norm(q, w["q_norm.weight"], eps), cos, sin)
        k = F.linear(x, w["k_proj.weight"]).view(n, -1, dim)
        k = blocks.gemma4_norm(k, w["k_norm.weight"], eps)
        cache = ctx.require_attention()
        out = cache(q, apply_rotary(k, cos, sin), blocks.gemma4_norm(k, None, eps), scale=1.0)
        blocks.step_state(ctx)[("kv", 2)] = cache
        return F.linear(out.reshape(n, -1), w["o_proj.weight"])

    monkeypatch.setitem(blocks.BLOCKS, "Gemma4TextAttention", attention)
    assert departs_at(parity(layers_only=True)) == (2, "self_attn")


def test_router_without_per_expert_scale_fails_at_layer_0_experts(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    right = blocks.route
    monkeypatch.setattr(
        blocks,
        "route",
        lambda probs, w, ctx: right(probs, {"per_expert_scale": torch.ones(4)}, ctx),
    )
    assert departs_at(parity(layers_only=True)) == (0, "experts")


def test_experts_summed_in_the_model_dtype_fail_in_bf16(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma4TextExperts' eager forward (index_add_ in bf16, expert by expert) is not what
    transformers runs by default (grouped_mm: fp32 slot sum): bf16 departs at layer 0."""
    from resin.runners.torch import layers

    def eager(x: Any, w: Any, ctx: Any, experts: Any, weights: Any) -> Any:
        fused = {f"experts.{k}": v for k, v in w.items()}
        return layers.routed_experts(x, fused, experts, weights, blocks._gelu_gated)

    monkeypatch.setitem(blocks.BLOCKS, "Gemma4TextExperts", eager)
    report = parity(dtype="bfloat16", layers_only=True)
    first = next(r for r in report.layers if r["max_abs_diff"] > 0)
    assert (first["layer"], first["module"]) == (0, "experts")


def test_layer_scalar_dropped_fails_at_layer_0_output(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    right = blocks.gemma4_text_decoder_layer

    def unscaled(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
        scalar = weights["input_layernorm"]["layer_scalar"]
        return right(hidden, fns, weights, ctx, emit) / scalar

    monkeypatch.setitem(blocks.BLOCKS, "Gemma4TextDecoderLayer", unscaled)
    assert departs_at(parity(layers_only=True)) == (0, "output")


def test_placeholder_ids_embedded_as_themselves_fail_at_embed_tokens(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper embeds its image / video / audio placeholder ids as the pad token; the
    default parity prompts hold some of them (ids 380-382 of 384)."""
    monkeypatch.setattr(blocks, "text_ids", lambda input_ids, config: input_ids)
    report = parity(layers_only=True)
    assert departs_at(report) == (None, "embed_tokens")


# -- variants --------------------------------------------------------------------------------

E2B = {  # per-layer embeddings, K/V sharing, double-wide shared MLPs, no MoE, own V everywhere
    "enable_moe_block": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
    "attention_k_eq_v": False,
    "num_global_key_value_heads": None,
    "layer_types": ["sliding_attention"] * 3
    + ["full_attention"]
    + ["sliding_attention"] * 2
    + ["full_attention"],
}
LARGE = {  # 26B-A4B / 31B: no per-layer embeddings, no K/V sharing, K = V full layers
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "use_bidirectional_attention": "vision",
    "num_key_value_heads": 4,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],  # their 5:1 pattern
}
DENSE = {"enable_moe_block": False, "num_experts": None, "top_k_experts": None}


def test_parity_e2b_layout_every_stage(make_tiny: Any, tmp_path: Path) -> None:
    """Gemma 4 E2B / E4B: the last 3 of 7 layers (two sliding, one full) reuse the K/V of
    layer 2 (the last sliding one before them) and layer 3 (the last full one)."""
    path = make_tiny.write(tmp_path / "e2b", make_tiny.text_config(**E2B), seed=1)
    blocks = import_model_module(MODEL_DIR, "blocks", "gemma4")
    text = blocks.normalise_config(json.loads((path / "config.json").read_text()))
    assert blocks.kv_sources(text) == [None] * 4 + [2, 2, 3]
    report = parity(path)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6


@pytest.mark.parametrize("layout", ["26b_a4b", "31b"])
def test_parity_large_layouts(make_tiny: Any, tmp_path: Path, layout: str) -> None:
    """26B-A4B (MoE branch, K = V full layers with their own KV head count) and 31B (the same,
    dense), both flagged ``use_bidirectional_attention: vision`` (image tokens only)."""
    changes = {**LARGE, **(DENSE if layout == "31b" else {})}
    path = make_tiny.write(tmp_path / layout, make_tiny.text_config(**changes), seed=2)
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6


def test_parity_hub_style_config(make_tiny: Any, tmp_path: Path) -> None:
    """A config.json as the hub's: ``global_head_dim`` / ``num_global_key_value_heads`` and no
    ``per_layer_config`` (HF and normalise_config derive it from the full layers)."""
    path = make_tiny.write(tmp_path / "hub", make_tiny.text_config(**LARGE), seed=3)
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert text.pop("per_layer_config") == {"5": {"head_dim": 24, "num_key_value_heads": 1}}
    text.update(global_head_dim=24, num_global_key_value_heads=1)
    (path / "config.json").write_text(json.dumps(config))
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()


def test_parity_with_full_layers_of_the_sliding_head_dim(make_tiny: Any, tmp_path: Path) -> None:
    """Full layers with the sliding layers' head_dim and no K/V override: save_pretrained
    writes ``per_layer_config: {}``, which HF reads as no overrides (normalise_config once took
    it for a missing value and gave the full layers head_dim 512: a crash at the first one)."""
    changes = {"head_dim": 24, "global_head_dim": 24, "attention_k_eq_v": False}
    path = make_tiny.write(tmp_path / "same", make_tiny.text_config(**changes), seed=4)
    assert json.loads((path / "config.json").read_text())["text_config"]["per_layer_config"] == {}
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()


def test_parity_on_the_text_model_saved_by_gemma4_for_causal_lm(tmp_path: Path) -> None:
    """A text-only checkpoint (``Gemma4ForCausalLM``: config ``gemma4_text``, ``model.*``
    tensors, no placeholder ids); the registry resolves it to this directory by model_type."""
    wrapper = transformers.Gemma4ForConditionalGeneration.from_pretrained(TINY)
    causal = transformers.Gemma4ForCausalLM(wrapper.config.text_config)
    causal.model.load_state_dict(wrapper.model.language_model.state_dict())
    path = tmp_path / "text"
    causal.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / f, path / f)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "gemma4_text" and "image_token_id" not in config
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()
    from resin.registry import ModelRegistry

    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(path).name == "gemma4"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all'"),
        ({"num_kv_shared_layers": 7}, "num_kv_shared_layers 7"),
        ({"num_kv_shared_layers": 5}, "no earlier layer of its type"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_configs_the_blocks_do_not_compute_are_refused(
    blocks: Any, changes: dict[str, Any], words: str
) -> None:
    """Refused by check_config (at load, named), not computed wrongly: 'all' bidirectional
    attention; K/V sharing that leaves a shared layer no earlier layer of its type to read
    (all 7 layers; the last 5, where only layers 0-1, both sliding, keep their own); a
    non-tanh GELU; attention biases."""
    with pytest.raises(ValueError, match=words):
        blocks.check_config({**_tiny_text(blocks), **changes})


def _tiny_text(blocks: Any) -> dict[str, Any]:
    return blocks.normalise_config(json.loads((TINY / "config.json").read_text()))


def test_normalise_config_derives_per_layer_config_as_hf(blocks: Any) -> None:
    """An explicit per_layer_config is kept; none, or the class default the loader fills in
    from architecture.json, is derived from the full layers as Gemma4TextConfig does."""
    hub = {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"] * 2,
        "global_head_dim": 64,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
    }
    derived = {
        "1": {"head_dim": 64, "num_key_value_heads": 2},
        "3": {"head_dim": 64, "num_key_value_heads": 2},
    }
    record = json.loads((MODEL_DIR / "architecture.json").read_text())["config_defaults"]
    for extra in ({}, {"per_layer_config": record["per_layer_config"]}):
        out = blocks.normalise_config({**hub, **extra})
        assert out["per_layer_config"] == derived
        assert out["layer_types"][-1] == "full_attention"  # HF forces the last layer full
        assert out["mlp_layer_types"] == ["dense"] * 4
    assert blocks.normalise_config({**hub, "attention_k_eq_v": False})["per_layer_config"] == {
        "1": {"head_dim": 64},
        "3": {"head_dim": 64},
    }
    explicit = {"per_layer_config": {"3": {"head_dim": 48}}}
    assert blocks.normalise_config({**hub, **explicit})["per_layer_config"] == {
        "3": {"head_dim": 48}
    }


def test_served_chat_renders_the_template_and_answers_as_llm_chat() -> None:
    from tests.test_qwen3_5 import check_served_chat

    check_served_chat(MODEL_DIR)


def test_resin_models_lists_it() -> None:
    from resin.registry import ModelRegistry

    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(TINY)
    assert entry.name == "gemma4"


def test_the_source_config_as_the_runner_reads_it(blocks: Any) -> None:
    """E2B's layout (source/config.json): layers 15-34 reuse layer 13's (sliding) or 14's (full)
    K/V; full layers have head dim 512 (from ``global_head_dim``, no per_layer_config)."""
    source = json.loads((MODEL_DIR / "source" / "config.json").read_text())
    text = blocks.normalise_config(source)
    blocks.check_config(text)
    types = text["layer_types"]
    assert blocks.kv_sources(text) == [None] * 15 + [
        14 if t == "full_attention" else 13 for t in types[15:]
    ]
    assert blocks.layer_geometry(text, 4) == (512, 1) and blocks.layer_geometry(text, 0) == (256, 1)


def test_the_scaffold_reads_a_heterogeneous_config() -> None:
    """transformers raises on ``config.head_dim`` of a config with ``per_layer_config``; the
    scaffold's load_config allows the global read (new-model failed on any Gemma 4 config)."""
    from resin.scaffold.inspect import load_config

    config = load_config(TINY)
    assert config.text_config.is_heterogeneous and config.text_config.head_dim == 16
