"""resin/models/exaone4 (LG AI EXAONE 4.0 32B / 1.2B, brought up with `resin new-model`) passes
the parity harness on its committed tiny checkpoint and on variants of it, and the harness would
catch it if EXAONE 4's math were wrong.

- The tiny checkpoint (resin/models/exaone4/NOTES.md; made from EXAONE-4.0-32B's config) has
  three sliding layers and one full (NoPE) layer, a window (32) narrower than the longest
  parity prompt (70), llama3-scaled rope at ``rope_theta`` 1e6 (not the default 1e4), per-head
  q/k norms, no input norm (post-norms only), randomised norm weights (they init to ones),
  GQA, an untied ``lm_head``.
- fp32: every stage; bf16: the layers and logits bit-exact.
- Planted bugs each fail where they should: RoPE on the full layer too (NoPE ignored) at that
  layer's self_attn; Llama's pre-norm placement, q/k RMSNorm over the whole projection
  (OLMo 2's), the norms at the config class's default eps (the tiny's ``rms_norm_eps`` is
  1e-2) and a sliding window one token too wide, each at layer 0 self_attn.
- The 1.2B shape (``sliding_window`` null, full attention only, tied embeddings, no
  ``lm_head.weight``) rotates every layer: every stage passes, and the 32B rule (NoPE on full
  layers) applied there fails at layer 0 self_attn.
- Variants: an int ``sliding_window_pattern`` without ``layer_types`` and the hub's top-level
  ``rope_theta`` / ``rope_scaling``; layer types without a list follow ``Exaone4Config``.
- What transformers would not compute as these blocks do is refused at load: a string
  pattern without ``layer_types``, a window with no sliding layer.

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
MODEL_DIR = REPO / "resin" / "models" / "exaone4"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
EVERY_STAGE = {
    "layers",
    "logits",
    "greedy/page_size=1",
    "greedy/page_size=16",
    "greedy/page_size=64",
    "greedy/chunked_prefill",
    "greedy/prefix_cache",
    "greedy/preemption",
}
LONGEST_PARITY_PROMPT = 70  # resin.evals.parity.DEFAULT_PROMPT_LENS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "exaone4")


def assert_departs_at(report: Any, name: str) -> None:
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["name"] == name, report.summary()
    assert first["scaled_diff"] > 1e-3


def small_model(config: dict[str, Any]) -> None:
    """EXAONE-4.0-1.2B's shape: no window, full attention only, tied embeddings."""
    config.update(
        sliding_window=None,
        sliding_window_pattern=None,
        layer_types=["full_attention"] * config["num_hidden_layers"],
        tie_word_embeddings=True,
    )


def hub_int_pattern(config: dict[str, Any]) -> None:
    """No ``layer_types``, an int pattern (2: layers 1 and 3 full), and the rope spelled as
    the hub's config.json files spell it (top-level ``rope_theta`` + ``rope_scaling``)."""
    config.pop("layer_types")
    rope = dict(config.pop("rope_parameters"))
    config.update(sliding_window_pattern=2, rope_theta=rope.pop("rope_theta"), rope_scaling=rope)


def test_tiny_checkpoint_is_small_and_cannot_hide_exaone4_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Exaone4ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["sliding_window"] < LONGEST_PARITY_PROMPT
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] != 10000.0
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert 1 < kv_heads < heads and not config["tie_word_embeddings"]
    assert config["rms_norm_eps"] != 1e-5  # Exaone4Config's default (perturbed by hand)
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" in tensors
    layer = "model.layers.0."
    assert "input_layernorm.weight" not in {k.removeprefix(layer) for k in tensors}
    head_dim = config["head_dim"]
    assert tensors[layer + "self_attn.q_norm.weight"].shape == (head_dim,)
    assert tensors[layer + "self_attn.k_norm.weight"].shape == (head_dim,)
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert len(norms) == 17 and all(float((t - 1).abs().max()) > 0.1 for t in norms)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert EVERY_STAGE <= {s.name for s in report.stages}
    layers = report.stage("layers").metrics
    assert layers["max_scaled_diff"] < 1e-5 and not layers["missing"]
    names = {c["name"] for c in report.layers}
    assert {"layers.3.post_attention_layernorm", "layers.3.post_feedforward_layernorm"} <= names


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def _rope_on_full_layers(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NoPE ignored: the 32B's full-attention layer rotates too."""
    monkeypatch.setattr(blocks, "rotates", lambda ctx: True)


def _prenorm_placement(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's placement: each norm before its sub-layer instead of on its output."""

    def prenorm(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
        def run(child: str, x: Any) -> Any:
            y = fns[child](x, weights[child], ctx)
            emit(child, y)
            return y

        hidden = hidden + run("self_attn", run("post_attention_layernorm", hidden))
        return hidden + run("mlp", run("post_feedforward_layernorm", hidden))

    monkeypatch.setitem(blocks.BLOCKS, "Exaone4DecoderLayer", prenorm)


def _qk_norm_over_the_whole_projection(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMo 2's q/k norm: one RMS across every head's channels (the per-head weight tiled)."""
    from resin.runners.torch.layers import rms_norm

    def whole(x: Any, weight: Any, eps: float) -> Any:
        return rms_norm(x.flatten(-2), weight.repeat(x.shape[-2]), eps).view_as(x)

    monkeypatch.setattr(blocks, "qk_rms_norm", whole)


def _config_eps_ignored(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RMSNorm at Exaone4Config's default eps (1e-5) instead of the config's
    ``rms_norm_eps`` (the tiny's 1e-2): the q/k norms inside self_attn show it first."""
    from resin.runners.torch.layers import rms_norm

    qk_rms_norm = blocks.qk_rms_norm
    monkeypatch.setattr(blocks, "qk_rms_norm", lambda x, weight, eps: qk_rms_norm(x, weight, 1e-5))
    monkeypatch.setitem(
        blocks.BLOCKS, "Exaone4RMSNorm", lambda x, w, ctx: rms_norm(x, w["weight"], 1e-5)
    )


def _window_one_too_wide(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sliding layers' cache window one token wider than the config's (HF attends over
    (p - window, p]): the window binds on the parity prompts."""
    from resin.runners.torch import model_dir

    layer_kinds = model_dir.layer_kinds

    def wider(args: Any, record: Any) -> Any:
        return [(t, w + 1 if w else w, k) for t, w, k in layer_kinds(args, record)]

    monkeypatch.setattr(model_dir, "layer_kinds", wider)


@pytest.mark.parametrize(
    ("plant", "departure"),
    [
        (_rope_on_full_layers, "layers.3.self_attn"),
        (_prenorm_placement, "layers.0.self_attn"),
        (_qk_norm_over_the_whole_projection, "layers.0.self_attn"),
        (_config_eps_ignored, "layers.0.self_attn"),
        (_window_one_too_wide, "layers.0.self_attn"),
    ],
    ids=[
        "rope_on_full_layers",
        "prenorm",
        "qk_norm_whole_projection",
        "eps_ignored",
        "window_too_wide",
    ],
)
def test_planted_bug_fails_where_it_is(
    blocks: Any,
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[Any, pytest.MonkeyPatch], None],
    departure: str,
) -> None:
    plant(blocks, monkeypatch)
    assert_departs_at(parity(layers_only=True), departure)


def test_small_model_rotates_every_layer_every_stage(
    blocks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EXAONE-4.0-1.2B's shape (tied, no window, full layers only): HF rotates every layer
    (``sliding_window is None``). Every stage passes; the 32B rule (rotate sliding layers only)
    would leave this model without positions and fails at the first layer."""
    path = variant(
        tmp_path, small_model, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}
    )
    report = parity(path)
    assert report.passed, report.summary()
    assert EVERY_STAGE <= {s.name for s in report.stages}
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5

    monkeypatch.setattr(blocks, "rotates", lambda ctx: ctx.layer_type == "sliding_attention")
    assert_departs_at(parity(path, layers_only=True), "layers.0.self_attn")


def test_parity_with_an_int_pattern_and_the_hub_rope_spelling(tmp_path: Path) -> None:
    report = parity(variant(tmp_path, hub_int_pattern), layers_only=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    ("num_layers", "pattern"), [(4, None), (6, 2), (6, 3), (30, None), (64, 4)]
)
def test_layer_types_without_a_list_follow_transformers(
    tmp_path: Path, num_layers: int, pattern: int | None
) -> None:
    """A config.json without ``layer_types``: layer i full iff (i + 1) % pattern == 0, the
    pattern defaulting to 4, as ``Exaone4Config.__post_init__`` derives them; the sliding
    layers get the config's window."""
    import transformers

    from resin.runners.torch.model_dir import ModelRecord, layer_kinds, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    config.pop("layer_types")
    config.pop("sliding_window_pattern")
    if pattern is not None:
        config["sliding_window_pattern"] = pattern
    config["num_hidden_layers"] = num_layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_types = list(transformers.Exaone4Config.from_dict(config).layer_types or [])
    record = ModelRecord.load(MODEL_DIR)
    kinds = layer_kinds(load_model_args(tmp_path, record), record)
    assert len(hf_types) == num_layers
    assert [layer_type for layer_type, _, _ in kinds] == hf_types
    assert [window for _, window, _ in kinds] == [
        config["sliding_window"] if t == "sliding_attention" else None for t in hf_types
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("layer_types"), "sliding_window_pattern 'LLLG' without layer_types"),
        (
            lambda c: c.update(layer_types=["full_attention"] * 4),
            "sliding_window 32 with no sliding_attention layer",
        ),
    ],
    ids=["string_pattern_without_layer_types", "window_without_sliding_layers"],
)
def test_configs_transformers_computes_otherwise_are_refused_at_load(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, edit)
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=f"exaone4: {message}"):
        entry.load_runner(checkpoint)
