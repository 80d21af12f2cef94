"""resin/models/granite (IBM Granite 3.x dense, GraniteForCausalLM, brought up with
`resin new-model`) passes the parity harness on its committed tiny checkpoint and on variants of
it, refuses what it does not compute, and the harness would catch it if a multiplier were lost.

- The tiny checkpoint (resin/models/granite/NOTES.md) keeps Granite-3.1-8B's four multipliers
  (embedding 12, residual 0.22, attention 1/128, logits scaling 16), none of them a value a
  Llama-shaped runner could assume: the attention scale is neither ``head_dim ** -0.5`` nor
  ``1 / head_dim`` at the tiny's head_dim 16. Tied embeddings, GQA.
- fp32: every stage; bf16: the layers and logits bit-exact.
- Planted bugs — each multiplier dropped, the Llama softmax scale — fail where they should.
- Variants (the tiny's weights, another config.json): Granite-3.1-2B's multipliers in the hub
  spelling (top-level ``rope_theta``), untied ``lm_head``, and no multipliers at all
  (GraniteConfig's 1.0 defaults: Llama).

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from resin.runners.torch.blocks import gqa_attention_block, prenorm_decoder_layer  # noqa: E402
from resin.runners.torch.model_definition import default_logits  # noqa: E402
from tests.model_variants import model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "granite"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "granite")


def granite_31_2b_hub_spelling(config: dict[str, Any]) -> None:
    """granite-3.1-2b-instruct's scalars, spelled as on the hub (rope_theta top level)."""
    config.pop("rope_parameters")
    config.update(
        rope_theta=5_000_000.0,
        rope_scaling=None,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
    )


def no_multipliers(config: dict[str, Any]) -> None:
    """No multiplier keys: GraniteConfig's defaults (1.0 each), i.e. Llama's math except the
    attention scale, which is then 1.0, not ``head_dim ** -0.5``."""
    for key in (*MULTIPLIERS, "logits_scaling"):
        config.pop(key)


def test_tiny_checkpoint_cannot_hide_a_multiplier() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    source = json.loads((MODEL_DIR / "source" / "config.json").read_text())
    assert config["architectures"] == ["GraniteForCausalLM"]
    for key in (*MULTIPLIERS, "logits_scaling"):
        assert config[key] == source[key] and config[key] != 1.0, key
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert config["attention_multiplier"] not in (head_dim**-0.5, 1 / head_dim)
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"]
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(TINY / "model.safetensors"))


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/page_size=16",
        "greedy/page_size=64",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    } <= {s.name for s in report.stages}
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6
    assert not report.stage("layers").metrics["missing"]


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def _unscaled_embedding(hidden: Any, w: Any, ctx: Any) -> Any:
    return hidden


# planted bug -> (what it replaces in blocks.py, by BLOCKS key or hook name; the replacement;
# the first departing checkpoint, or None for the logits stage only)
PLANTS: dict[str, tuple[str, Callable[..., Any], str | None]] = {
    # the input RMSNorm hides a scaled stream; the residual add after attention does not
    "no_embedding_multiplier": (
        "pre_layers",
        _unscaled_embedding,
        "layers.0.post_attention_layernorm",
    ),
    "attention_scale_head_dim_rsqrt": (
        "GraniteAttention",
        gqa_attention_block,
        "layers.0.self_attn",
    ),
    "no_residual_multiplier": (
        "GraniteDecoderLayer",
        prenorm_decoder_layer,
        "layers.0.post_attention_layernorm",
    ),
    "no_logits_scaling": ("logits", default_logits, None),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_fails_where_it_should(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, plant: str
) -> None:
    target, replacement, first_name = PLANTS[plant]
    if target in blocks.BLOCKS:
        monkeypatch.setitem(blocks.BLOCKS, target, replacement)
    else:
        monkeypatch.setattr(blocks, target, replacement)
    report = parity(layers_only=True)
    assert not report.passed
    first = report.first_departure
    if first_name is None:
        assert report.stage("layers").passed, report.summary()
        assert not report.stage("logits").passed
        assert report.stage("logits").metrics["scaled_diff"] > 1.0
    else:
        assert first is not None and first["name"] == first_name, report.summary()
        assert first["scaled_diff"] > 0.01


def test_parity_with_untied_lm_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    def untie(config: dict[str, Any]) -> None:
        config["tie_word_embeddings"] = False

    path = variant(tmp_path, untie)
    tensors = load_file(str(path / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(0)
    lm_head = torch.randn(embed.shape, generator=generator, dtype=embed.dtype) * embed.std()
    save_file({**tensors, "lm_head.weight": lm_head}, str(path / "model.safetensors"))
    report = parity(path)
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    "edit", [granite_31_2b_hub_spelling, no_multipliers], ids=lambda f: f.__name__
)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"attention_bias": True}, "granite: attention_bias true is not supported"),
        ({"mlp_bias": True}, "granite: mlp_bias true is not supported"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "unsupported rope type 'longrope'",
        ),
    ],
)
def test_unsupported_config_is_refused_at_load(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(edit))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=message):
        entry.load_runner(checkpoint)


def test_llm_caps_max_model_len_for_dynamic_rope(tmp_path: Path) -> None:
    import resin
    from resin.loading.fields import ConfigError

    def dynamic(config: dict[str, Any]) -> None:
        config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        config["max_position_embeddings"] = 64

    checkpoint = variant(tmp_path, dynamic)
    assert resin.LLM(checkpoint).engine.config.max_model_len == 64
    with pytest.raises(ConfigError, match=r"max_model_len 65 is past 64: rope type 'dynamic'"):
        resin.LLM(checkpoint, max_model_len=65)
