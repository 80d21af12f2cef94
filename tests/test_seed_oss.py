"""resin/models/seed_oss (ByteDance Seed-OSS-36B, SeedOssForCausalLM, brought up with
`resin new-model`) passes the parity harness on its committed tiny checkpoint and on variants of
it, refuses what it does not compute, and the harness would catch it if a bias, the head width
or the rope base were wrong.

- The tiny checkpoint (resin/models/seed_oss/NOTES.md) keeps Seed-OSS-36B's layout: q/k/v
  biases (``attention_bias`` true, random, not HF's zeros), no o / MLP biases, GQA (4 heads /
  2 KV heads), untied ``lm_head``, randomised norm weights, ``rope_theta`` 1e7 (not the 1e4 a
  runner could assume).
- fp32: every stage; bf16: the layers and logits bit-exact.
- Variants (another config.json, tensors added or removed): the hub spelling of the released
  config (``rope_scaling`` {"rope_type": "default"} + top-level ``rope_theta``), each bias flag
  flipped (``attention_bias`` false, ``attention_out_bias`` true, ``mlp_bias`` true), and a
  ``head_dim`` unequal to ``hidden / heads`` (as Seed-OSS-36B's 128 vs 5120 / 80; the
  scaffold's tiny has 16 = 64 / 4, so it cannot tell the two apart): new HF weights.
- Planted bugs fail where they should: q/k/v biases dropped, the o bias ignored, the scale
  from ``hidden / heads``, rope theta 1e4.
- Refused at load: rope types Resin does not compute, sliding-window keys (HF's Seed-OSS
  ignores them, the shared runner would not), a q/k/v bias missing.

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
from tests.model_variants import built_checkpoint, model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "seed_oss"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
QKV = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "seed_oss")


def _random_like(reference: Any, shape: tuple[int, ...], seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=reference.dtype) * 0.1


def _layers(config: dict[str, Any]) -> range:
    return range(int(config["num_hidden_layers"]))


def hub_spelling(config: dict[str, Any]) -> None:
    """Seed-OSS-36B-Instruct's config.json spelling: legacy ``rope_scaling`` with the type only,
    ``rope_theta`` at the top level."""
    del config["rope_parameters"]
    config.update(rope_scaling={"rope_type": "default"}, rope_theta=10_000_000.0)


def no_qkv_bias(tmp_path: Path) -> Path:
    def drop(tensors: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in tensors.items() if not k.endswith(tuple(f"{p}.bias" for p in QKV))}

    return variant(tmp_path, lambda config: config.update(attention_bias=False), drop)


def with_o_bias(tmp_path: Path) -> Path:
    config = json.loads((TINY / "config.json").read_text())

    def add(tensors: dict[str, Any]) -> dict[str, Any]:
        out = dict(tensors)
        for i in _layers(config):
            o = tensors[f"model.layers.{i}.self_attn.o_proj.weight"]
            out[f"model.layers.{i}.self_attn.o_proj.bias"] = _random_like(o, o.shape[:1], i)
        return out

    return variant(tmp_path, lambda config: config.update(attention_out_bias=True), add)


def with_mlp_bias(tmp_path: Path) -> Path:
    config = json.loads((TINY / "config.json").read_text())

    def add(tensors: dict[str, Any]) -> dict[str, Any]:
        out = dict(tensors)
        for i in _layers(config):
            for j, name in enumerate(MLP):
                w = tensors[f"model.layers.{i}.mlp.{name}.weight"]
                out[f"model.layers.{i}.mlp.{name}.bias"] = _random_like(w, w.shape[:1], 10 * i + j)
        return out

    return variant(tmp_path, lambda config: config.update(mlp_bias=True), add)


def wide_heads(tmp_path: Path) -> Path:
    """The tiny config with ``head_dim`` 32 (hidden 64 / 4 heads = 16): a new HF model with the
    scaffold's seeded weights, saved as HF saves it, the tiny's tokenizer beside it."""
    config = {**json.loads((TINY / "config.json").read_text()), "head_dim": 32}
    return built_checkpoint(TINY, tmp_path / "seed_oss_head_dim_32", config, as_given=False)


# -- the committed tiny checkpoint -------------------------------------------------------------


def test_tiny_checkpoint_keeps_what_seed_oss_computes() -> None:
    from safetensors.torch import load_file

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    source = json.loads((MODEL_DIR / "source" / "config.json").read_text())
    assert config["architectures"] == source["architectures"] == ["SeedOssForCausalLM"]
    for key in ("attention_bias", "attention_out_bias", "mlp_bias", "tie_word_embeddings"):
        assert config[key] == source[key], key
    assert config["rope_parameters"]["rope_theta"] == source["rope_theta"] == 1e7
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    # Seed-OSS-36B's head is not hidden / heads; the tiny's is (see wide_heads)
    assert source["head_dim"] != source["hidden_size"] // source["num_attention_heads"]
    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" in tensors
    biases = [t for name, t in tensors.items() if name.endswith("_proj.bias")]
    assert len(biases) == 3 * config["num_hidden_layers"]  # q, k, v: no o / MLP biases
    assert all(float(t.abs().max()) > 0.05 for t in biases)  # not HF's zeros
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert norms and all(float((t - 1).abs().max()) > 0.1 for t in norms)  # not HF's ones


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


# -- variants ----------------------------------------------------------------------------------


def test_parity_hub_spelling(tmp_path: Path) -> None:
    report = parity(variant(tmp_path, hub_spelling), layers_only=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize("make", [no_qkv_bias, with_o_bias, with_mlp_bias, wide_heads])
def test_parity_on_variants(tmp_path: Path, make: Callable[[Path], Path]) -> None:
    report = parity(make(tmp_path), layers_only=True)
    assert report.passed, report.summary()


# -- planted bugs ------------------------------------------------------------------------------


def _scale_from_hidden(blocks: Any) -> Callable[..., Any]:
    """The attention with the softmax scale of ``hidden / heads`` instead of ``head_dim``."""

    def attention(x: Any, w: Any, ctx: Any) -> Any:
        config = ctx.config
        wrong = (int(config.hidden_size) // int(config.num_attention_heads)) ** -0.5
        real = ctx.require_attention()

        def attend(q: Any, k: Any, v: Any, scale: float, **kwargs: Any) -> Any:
            return real(q, k, v, scale=wrong, **kwargs)

        ctx.attention = attend
        try:
            return blocks.seed_oss_attention(x, w, ctx)
        finally:
            ctx.attention = real

    return attention


def _theta_1e4(config: Any, head_dim: int, device: Any) -> Any:
    from resin.runners.torch.layers import RotaryEmbedding

    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return RotaryEmbedding(inv_freq.numpy(), 1.0, device)


def test_planted_qkv_bias_dropped(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "attention_bias", lambda config: False)
    _departs(parity(layers_only=True), "layers.0.self_attn")


def test_planted_rope_theta_default(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(blocks.ROTARY, "SeedOssRotaryEmbedding", _theta_1e4)
    _departs(parity(layers_only=True), "layers.0.self_attn")


def test_planted_o_bias_ignored(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    checkpoint = with_o_bias(tmp_path)
    monkeypatch.setattr(blocks, "attention_out_bias", lambda config: False)
    _departs(parity(checkpoint, layers_only=True), "layers.0.self_attn")


def test_planted_scale_from_hidden_needs_wide_heads(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Invisible on the committed tiny (head_dim 16 = 64 / 4), caught on the wide-head variant."""
    monkeypatch.setitem(blocks.BLOCKS, "SeedOssAttention", _scale_from_hidden(blocks))
    assert parity(layers_only=True).passed
    _departs(parity(wide_heads(tmp_path), layers_only=True), "layers.0.self_attn")


def _departs(report: Any, name: str) -> None:
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["name"] == name, report.summary()
    assert first["scaled_diff"] > 0.01, first


# -- load-time checks --------------------------------------------------------------------------


def _load(checkpoint: Path) -> Any:
    from resin.registry import ModelRegistry

    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    return entry.load_runner(checkpoint)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e7}},
            "unsupported rope type 'longrope'",
        ),
        ({"sliding_window": 16}, "seed_oss: sliding-window layers are not supported"),
        (
            {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 16},
            "seed_oss: sliding-window layers are not supported",
        ),
    ],
    ids=["longrope", "sliding_window", "sliding_layer_types"],
)
def test_unsupported_config_is_refused_at_load(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    """HF's Seed-OSS ignores a window in config.json (full causal mask); the shared runner would
    apply it, so it is refused rather than computed differently."""
    with pytest.raises(ValueError, match=message):
        _load(variant(tmp_path, lambda config: config.update(edit)))


def test_window_switched_off_is_accepted(tmp_path: Path) -> None:
    """``sliding_window`` with ``use_sliding_window`` false (Qwen2-style keys): no layer is
    windowed by either side."""
    edit = {"sliding_window": 16, "use_sliding_window": False}
    report = parity(variant(tmp_path, lambda config: config.update(edit)), layers_only=True)
    assert report.passed, report.summary()


def test_missing_qkv_bias_is_refused_at_load(tmp_path: Path) -> None:
    def drop(tensors: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.k_proj.bias"}

    with pytest.raises(Exception, match=r"layer 2 is missing tensor\(s\) .*k_proj\.bias"):
        _load(variant(tmp_path, lambda config: None, drop))
