"""resin/models/glm4 (GLM-4-9B-0414 / GLM-4-32B-0414 / GLM-Z1, brought up with `resin new-model`)
passes the parity harness on its committed tiny checkpoint and on variants of it, and the
harness would catch it if GLM-4's math were wrong.

- The tiny checkpoint (resin/models/glm4/NOTES.md; made from GLM-4-9B-0414's config) has GQA
  (4 query / 2 KV heads of 16), partial rotary (8 of 16 channels), random q / k / v biases,
  randomised weights on all four norms of each layer (they init to 1), an untied ``lm_head``
  and ``rms_norm_eps`` 1e-5 (Glm4Config's default is 1.5625e-7). Its ``rope_theta`` (1e4) and
  ``partial_rotary_factor`` (0.5) equal Glm4Config's defaults: the rope variants below change
  both.
- fp32: every stage; bf16: the layers bit-exact.
- Planted bugs: a sandwich norm dropped (``post_self_attn_layernorm`` or ``post_mlp_layernorm``),
  Gemma's reading of the norm names (``post_attention_layernorm`` on the attention output), the
  whole head rotated instead of its first half, halves rotated (glm4_moe's ``rotate_half``)
  instead of GLM-4's adjacent pairs, gate / up swapped: each departs at layer 0, at the module
  it corrupts first.
- Variants (another config.json over the tiny's weights): the hub spelling (top-level
  ``rope_theta`` / ``partial_rotary_factor``, GLM-4-9B-0414's), no factor at all (Glm4Config
  fills in 0.5), another theta and factor (compared bit for bit in fp32: HF's fp32 inverse
  frequencies), YaRN in ``rope_scaling`` (the long-context setting GLM-4-32B-0414's card
  gives), and ``attention_bias`` false refused at load.

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
from tests.model_variants import model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "glm4"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
NORMS = (
    "input_layernorm",
    "post_self_attn_layernorm",
    "post_attention_layernorm",
    "post_mlp_layernorm",
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "glm4")


def assert_departs_at(report: Any, module: str) -> None:
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, module), report.summary()
    assert first["scaled_diff"] > 0.01


def test_tiny_checkpoint_is_small_and_cannot_hide_glm4_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Glm4ForCausalLM"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    assert 1 < kv_heads < heads  # GQA
    assert config["attention_bias"] and not config["tie_word_embeddings"]
    assert config["rms_norm_eps"] != 1.5625e-07  # Glm4Config's default
    assert 0 < config["rope_parameters"]["partial_rotary_factor"] < 1
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    layer = "model.layers.0."
    assert "lm_head.weight" in tensors
    assert tensors[layer + "mlp.gate_up_proj.weight"].shape == (
        2 * config["intermediate_size"],
        config["hidden_size"],
    )
    for name in ("q_proj", "k_proj", "v_proj"):
        assert float(tensors[f"{layer}self_attn.{name}.bias"].abs().max()) > 0.1
    assert f"{layer}self_attn.o_proj.bias" not in tensors
    assert tensors[layer + "self_attn.k_proj.weight"].shape[0] == kv_heads * head_dim
    norms = [tensors[f"{layer}{norm}.weight"] for norm in NORMS]
    assert all(float((t - 1).abs().max()) > 0.1 for t in norms)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    } <= {s.name for s in report.stages}
    layers = report.stage("layers").metrics
    assert layers["max_scaled_diff"] < 1e-6 and not layers["missing"]
    # all four norms of every layer are compared, in HF's call order
    names = [c["name"] for c in report.layers]
    layer0 = [n.removeprefix("layers.0.") for n in names if n.startswith("layers.0.")]
    assert layer0 == [
        "input_layernorm",
        "self_attn",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "mlp",
        "post_mlp_layernorm",
    ]


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


# -- planted bugs -------------------------------------------------------------------------------


def layer_with(order: tuple[str, str, str, str], skip: str | None = None) -> Callable[..., Any]:
    """A decoder layer running the four norms in ``order`` (pre-attention, post-attention,
    pre-MLP, post-MLP) and leaving ``skip`` out of the residual (its output still emitted)."""
    pre_attn, post_attn, pre_mlp, post_mlp = order

    def layer(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
        def run(child: str, x: Any) -> Any:
            y = fns[child](x, weights[child], ctx)
            emit(child, y)
            return y

        x = run("self_attn", run(pre_attn, hidden))
        normed = run(post_attn, x)
        hidden = hidden + (x if skip == post_attn else normed)
        x = run("mlp", run(pre_mlp, hidden))
        normed = run(post_mlp, x)
        return hidden + (x if skip == post_mlp else normed)

    return layer


@pytest.mark.parametrize(
    ("order", "skip", "module"),
    [
        # the attention output's norm dropped: the pre-MLP norm is the first to see it
        (NORMS, "post_self_attn_layernorm", "post_attention_layernorm"),
        # the MLP output's norm dropped: only the layer's output differs
        (NORMS, "post_mlp_layernorm", "output"),
        # Gemma's names: post_attention_layernorm on the attention output
        (
            (
                "input_layernorm",
                "post_attention_layernorm",
                "post_self_attn_layernorm",
                "post_mlp_layernorm",
            ),
            None,
            "post_self_attn_layernorm",
        ),
    ],
    ids=["no_post_self_attn_norm", "no_post_mlp_norm", "gemma_norm_names"],
)
def test_sandwich_norm_plants_fail(
    blocks: Any,
    monkeypatch: pytest.MonkeyPatch,
    order: tuple[str, str, str, str],
    skip: str | None,
    module: str,
) -> None:
    monkeypatch.setitem(blocks.BLOCKS, "Glm4DecoderLayer", layer_with(order, skip))
    assert_departs_at(parity(layers_only=True), module)


def test_full_rotary_fails_at_self_attn(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole head rotated (``partial_rotary_factor`` read as 1) instead of its first half."""
    rotary = blocks.glm4_rotary_embedding

    def full(config: Any, head_dim: int, device: Any) -> Any:
        raw = dict(config) if isinstance(config, dict) else config.to_dict()
        params = {**(raw.get("rope_parameters") or {}), "partial_rotary_factor": 1.0}
        return rotary(
            {**raw, "partial_rotary_factor": 1.0, "rope_parameters": params}, head_dim, device
        )

    monkeypatch.setitem(blocks.ROTARY, "Glm4RotaryEmbedding", full)
    assert_departs_at(parity(layers_only=True), "self_attn")


def test_half_split_rotary_fails_at_self_attn(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """glm4_moe's layout (``rotate_half`` over halves, ``cat(freqs, freqs)``) instead of
    GLM-4's adjacent pairs: the table and the rotation both switched."""
    monkeypatch.setattr(blocks, "INTERLEAVED", False)
    assert_departs_at(parity(layers_only=True), "self_attn")


def test_gate_up_swapped_fails_at_mlp(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp = blocks.BLOCKS["Glm4MLP"]

    def swapped(x: Any, w: Any, ctx: Any) -> Any:
        gate, up = w["gate_up_proj.weight"].chunk(2)
        return mlp(x, {**w, "gate_up_proj.weight": torch.cat([up, gate])}, ctx)

    monkeypatch.setitem(blocks.BLOCKS, "Glm4MLP", swapped)
    assert_departs_at(parity(layers_only=True), "mlp")


# -- config variants ----------------------------------------------------------------------------


def hub_spelling(config: dict[str, Any]) -> None:
    """GLM-4-9B-0414's config.json spelling (transformers 4.5x): top-level rope keys."""
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0, partial_rotary_factor=0.5)


def no_factor(config: dict[str, Any]) -> None:
    """No ``partial_rotary_factor`` anywhere: Glm4Config.__post_init__ fills in 0.5."""
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0)


def yarn(config: dict[str, Any]) -> None:
    """GLM-4-32B-0414's long-context setting (its model card: ``rope_scaling`` yarn, factor 4),
    in the hub spelling, with a pretraining length short enough that the tiny's low
    frequencies are interpolated."""
    config.pop("rope_parameters")
    config.update(
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=256,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )


@pytest.mark.parametrize("edit", [hub_spelling, no_factor, yarn], ids=lambda f: f.__name__)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


def test_missing_factor_needs_the_default(
    tmp_path: Path, blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``normalise_config`` (glm4_moe's hook) a config with no factor rotates the whole
    head, where HF rotates half."""
    monkeypatch.delattr(blocks, "normalise_config")
    assert_departs_at(parity(variant(tmp_path, no_factor), layers_only=True), "self_attn")


def test_other_theta_and_factor_bit_exact_in_fp32(
    tmp_path: Path, blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rope_theta`` 1e6 and factor 0.75 (neither a default: the config is read) match HF bit
    for bit in fp32 with HF's fp32 inverse frequencies, this directory's and the shared
    tables' (``hf_rope_inv_freq``) alike; the numpy float64 ones are an ulp off (NOTES.md: at
    GLM-4-9B's width, 1 bf16 ulp in ~0.9% of cos / sin entries over 32K)."""

    def edit(config: dict[str, Any]) -> None:
        config["rope_parameters"].update(rope_theta=1e6, partial_rotary_factor=0.75)

    path = variant(tmp_path, edit)
    report = parity(path, layers_only=True)
    assert report.passed and report.stage("layers").metrics["max_scaled_diff"] == 0.0

    def shared(config: Any, head_dim: int, device: Any) -> Any:
        return blocks.rope_tables_from_config(config, head_dim, device, 1e4, interleaved=True)

    monkeypatch.setitem(blocks.ROTARY, "Glm4RotaryEmbedding", shared)
    assert parity(path, layers_only=True).stage("layers").metrics["max_scaled_diff"] == 0.0

    from resin.loading.rope import parse_rope_tables, rope_inv_freq
    from resin.runners.torch.layers import RotaryEmbedding

    def float64(config: Any, head_dim: int, device: Any) -> Any:
        raw = {k: v for k, v in config.to_dict().items() if v is not None}
        tables = parse_rope_tables(raw, 1e4, int(raw.get("max_position_embeddings", 2048)))
        return {
            name: RotaryEmbedding(*rope_inv_freq(rope, head_dim), device, interleaved=True)
            for name, rope in tables.items()
        }

    monkeypatch.setitem(blocks.ROTARY, "Glm4RotaryEmbedding", float64)
    assert parity(path, layers_only=True).stage("layers").metrics["max_scaled_diff"] > 0.0


def test_attention_bias_false_is_refused_at_load(tmp_path: Path) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(attention_bias=False))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="glm4: attention_bias false is not supported"):
        entry.load_runner(checkpoint)
