"""resin/models/olmo2 (OLMo 2 1B / 7B / 13B / 32B, brought up with `resin new-model`) passes the
parity harness on its committed tiny checkpoint and on variants of it, and the harness would
catch it if OLMo 2's math were wrong.

- The tiny checkpoint (resin/models/olmo2/NOTES.md; made from OLMo-2-0325-32B's config) has GQA
  (4 query / 2 KV heads), so ``q_norm`` (64 wide) and ``k_norm`` (32 wide) are two different
  whole-projection widths; randomised norm weights (they init to 1); an untied ``lm_head``;
  ``rope_theta`` 5e5 and ``rms_norm_eps`` 1e-6, neither the config class's default.
- fp32: every stage; bf16: the layers bit-exact (fp32 cos/sin tables and weight-first norms,
  as HF computes them).
- Planted bugs: q/k RMSNorm per head instead of over the whole projection, and Llama's pre-norm
  placement instead of OLMo 2's post-norms, each fail at layer 0 self_attn; rope tables cast to
  the model dtype (Llama's rotary) are no longer bit-exact in bf16.
- Variants (another config.json, the tiny's weights or some of them redrawn): the hub spelling
  (top-level ``rope_theta``, ``rope_scaling`` null), the 1B / 7B / 13B shape (as many KV heads
  as query heads), and a stray ``sliding_window`` (transformers' full forward ignores it).

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
MODEL_DIR = REPO / "resin" / "models" / "olmo2"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "olmo2")


def assert_departs_at_layer0_self_attn(report: Any) -> None:
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "self_attn"), (
        report.summary()
    )
    assert first["scaled_diff"] > 0.01


def test_tiny_checkpoint_is_small_and_cannot_hide_olmo2_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Olmo2ForCausalLM"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    assert 1 < kv_heads < heads  # GQA: q_norm and k_norm have different widths
    assert config["rms_norm_eps"] != 1e-5 and config["rope_parameters"]["rope_theta"] != 1e4
    assert not config["tie_word_embeddings"] and "sliding_window" not in config
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" in tensors
    layer = "model.layers.0."
    assert "input_layernorm.weight" not in {k.removeprefix(layer) for k in tensors}
    assert tensors[layer + "self_attn.q_norm.weight"].shape == (heads * head_dim,)
    assert tensors[layer + "self_attn.k_norm.weight"].shape == (kv_heads * head_dim,)
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert norms and all(float((t - 1).abs().max()) > 0.1 for t in norms)


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
    # every child of the HF layer is compared, the two post-norms included
    names = {c["name"] for c in report.layers}
    assert {"layers.0.post_attention_layernorm", "layers.0.post_feedforward_layernorm"} <= names


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def test_per_head_qk_norm_fails_at_self_attn(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k RMSNorm per head (Qwen3's) instead of over the whole projection (OLMo 2's)."""
    full_width = blocks.rms_norm_weight_first

    def per_head(x: Any, weight: Any, eps: float) -> Any:
        head_dim = 16  # the tiny's hidden_size / num_attention_heads
        heads = x.unflatten(-1, (-1, head_dim))
        return full_width(heads, weight.view(-1, head_dim), eps).flatten(-2)

    def post_norm(x: Any, w: Any, ctx: Any) -> Any:  # the layers' own norms stay right
        return full_width(x, w["weight"], float(ctx.config.rms_norm_eps))

    monkeypatch.setattr(blocks, "rms_norm_weight_first", per_head)
    monkeypatch.setitem(blocks.BLOCKS, "Olmo2RMSNorm", post_norm)
    assert_departs_at_layer0_self_attn(parity(layers_only=True))


def test_prenorm_placement_fails_at_self_attn(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's placement: each norm before its sub-layer instead of on its output."""

    def prenorm(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
        def run(child: str, x: Any) -> Any:
            y = fns[child](x, weights[child], ctx)
            emit(child, y)
            return y

        hidden = hidden + run("self_attn", run("post_attention_layernorm", hidden))
        return hidden + run("mlp", run("post_feedforward_layernorm", hidden))

    monkeypatch.setitem(blocks.BLOCKS, "Olmo2DecoderLayer", prenorm)
    assert_departs_at_layer0_self_attn(parity(layers_only=True))


def test_rope_tables_in_the_model_dtype_are_not_bit_exact_in_bf16(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama's rotary (cos/sin cast to bf16, q/k rotated in bf16) instead of OLMo 2's fp32
    rotation: within bf16's tolerances (a rounding-order bug, as a non-bit-exact kernel's), but
    no longer HF's floats — the layers and logits bit-exactness
    (``test_parity_bf16_layers_bit_exact``) is what catches it."""

    def model_dtype_tables(config: Any, head_dim: int, device: Any) -> Any:
        return blocks.olmo2_rotary_embedding(config, head_dim, device).table

    monkeypatch.setitem(blocks.ROTARY, "Olmo2RotaryEmbedding", model_dtype_tables)
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.stage("layers").metrics["max_scaled_diff"] > 0.0
    assert report.stage("logits").metrics["scaled_diff"] > 0.0


def hub_spelling(config: dict[str, Any]) -> None:
    """How OLMo 2's hub config.json files spell the rope (transformers 4.4x)."""
    config.pop("rope_parameters")
    config.update(rope_theta=500000, rope_scaling=None)


def stray_sliding_window(config: dict[str, Any]) -> None:
    """A ``sliding_window`` narrower than the parity prompts: Olmo2Config does not read it and
    HF's full forward attends over everything (``normalise_config`` drops it; without it every
    layer would slide). HF's own cached decode honours it (DynamicCache slides on any config's
    ``sliding_window``), so only the layers stage compares with HF's definition."""
    config["sliding_window"] = 8


@pytest.mark.parametrize("edit", [hub_spelling, stray_sliding_window], ids=lambda f: f.__name__)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


def test_parity_with_as_many_kv_heads_as_query_heads(tmp_path: Path) -> None:
    """OLMo-2 1B / 7B / 13B: no GQA, so ``k_norm`` is as wide as ``q_norm``; the tiny's K / V
    projections and ``k_norm`` redrawn at 4 KV heads (the shape rules leave their rows free)."""
    from safetensors.torch import load_file, save_file

    def mha(config: dict[str, Any]) -> None:
        config["num_key_value_heads"] = config["num_attention_heads"]

    path = variant(tmp_path, mha)
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_norm.weight")):
            old = tensors[name]
            rows = 2 * old.shape[0]
            new = torch.randn((rows, *old.shape[1:]), generator=generator) * float(old.std())
            tensors[name] = new + 1.0 if name.endswith("k_norm.weight") else new
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    report = parity(path)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6


def test_attention_bias_is_refused_at_load(tmp_path: Path) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(attention_bias=True))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="olmo2: attention_bias true is not supported"):
        entry.load_runner(checkpoint)


def test_dynamic_rope_caps_max_model_len(tmp_path: Path) -> None:
    """The shared runner's cap (a model directory without its own limit): ``dynamic`` rope
    only up to ``max_position_embeddings``; the default rope has no limit."""
    from resin.registry import ModelRegistry

    registry = ModelRegistry(use_cwd=False, use_env=False)
    assert registry.for_checkpoint(TINY).load_runner(TINY).max_model_len_limit is None
    dynamic = {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}
    checkpoint = variant(tmp_path, lambda config: config.update(rope_parameters=dynamic))
    runner = registry.for_checkpoint(checkpoint).load_runner(checkpoint)
    longest, why = runner.max_model_len_limit
    config = json.loads((TINY / "config.json").read_text())
    assert longest == config["max_position_embeddings"] and "dynamic" in why
