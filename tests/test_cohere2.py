"""resin/models/cohere2 (Cohere Command R7B / Command A, brought up with `resin new-model`) passes
the parity harness on its committed tiny checkpoint and on variants of it, and the harness
would catch it if it did not.

- The tiny checkpoint cannot hide Cohere 2's differences (resin/models/cohere2/NOTES.md): three
  sliding layers and one full (NoPE) layer, a window narrower than the parity prompts,
  ``logit_scale`` 0.25 (neither 1 nor the config default 0.0625), ``rope_theta`` 5e4 (not the
  default 1e4), randomised LayerNorm weights (they init to ones), GQA, tied embeddings.
- fp32: every stage, on the parity backend and on both paths of the servers' ``torch``
  backend; bf16: the layers and logits bit-exact (the fp32 rotary and the fp32 norm weight are
  what make them so).
- Planted bugs each fail where they should: rotary on the full-attention layer too (NoPE
  ignored) at that layer's self_attn; half-split (Llama) rotary pairs instead of Cohere's
  interleaved ones at layer 0 self_attn; a sequential block (the MLP reading the norm of
  ``h + attn``) at layer 0 mlp.
- Variants (the tiny's weights, another config.json): the hub spelling (no ``layer_types``,
  ``sliding_window_pattern`` 2, top-level ``rope_theta``); a ``logit_scale`` that is not a
  power of two, bf16 bit-exact; without ``layer_types`` the layers follow ``Cohere2Config``
  (pattern default 4) at R7B / Command A depths.
- What the blocks do not compute is refused at load: ``attention_bias``, ``dynamic`` rope.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import dataclasses
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
MODEL_DIR = REPO / "resin" / "models" / "cohere2"
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

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "cohere2")


def hub_spelling(config: dict[str, Any]) -> None:
    """As c4ai-command-r7b-12-2024's config.json spells it (here with pattern 2)."""
    config.pop("layer_types")
    config.pop("rope_parameters")
    config.update(rope_theta=50000, rope_scaling=None, sliding_window_pattern=2)


def test_tiny_checkpoint_is_small_and_cannot_hide_cohere2_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Cohere2ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["sliding_window"] < 70  # the longest parity prompt
    assert config["logit_scale"] not in (1.0, 0.0625)  # 0.0625: Cohere2Config's default
    assert config["rope_parameters"]["rope_theta"] != 10000.0
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"]
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    assert not any(name.endswith(".bias") for name in tensors)
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert len(norms) == 5 and all(float((t - 1).abs().max()) > 0.1 for t in norms)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert EVERY_STAGE <= {s.name for s in report.stages}
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
    assert not report.stage("layers").metrics["missing"]


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["sdpa", "cpu-kernel"])
def test_parity_fp32_on_the_torch_backend(
    cpu_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The servers' default backend, both paths (tests/test_torch_backend.py's check)."""
    monkeypatch.setenv("RESIN_TORCH_CPU_KERNEL", "1" if cpu_kernel else "0")
    report = parity(attention_backend="torch")
    assert report.passed, report.summary()
    assert EVERY_STAGE <= {s.name for s in report.stages}


def _rotary_on_full_layers(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NoPE ignored: the full-attention layer rotates too (the one table serves every type)."""
    attention = blocks.cohere2_attention

    def rotated_everywhere(x: Any, w: Any, ctx: Any) -> Any:
        return attention(x, w, dataclasses.replace(ctx, window=ctx.window or 1 << 30))

    monkeypatch.setitem(blocks.BLOCKS, "Cohere2Attention", rotated_everywhere)


def _half_split_rotary(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's layout on the same angles: ``cat(freqs, freqs)``, ``rotate_half`` over halves."""
    from resin.runners.torch.layers import apply_rotary

    def half_split(x: Any, cos: Any, sin: Any) -> Any:
        cos, sin = (torch.cat((t[:, ::2], t[:, ::2]), -1) for t in (cos, sin))
        return apply_rotary(x, cos, sin)

    monkeypatch.setattr(blocks, "apply_interleaved_rotary", half_split)


def _sequential_block(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not parallel: the MLP reads the norm of ``h + attn`` (one norm, as there is only one)."""

    def sequential(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
        norm = fns["input_layernorm"]
        x = norm(hidden, weights["input_layernorm"], ctx)
        emit("input_layernorm", x)
        attn = fns["self_attn"](x, weights["self_attn"], ctx)
        emit("self_attn", attn)
        hidden = hidden + attn
        mlp = fns["mlp"](norm(hidden, weights["input_layernorm"], ctx), weights["mlp"], ctx)
        emit("mlp", mlp)
        return hidden + mlp

    monkeypatch.setitem(blocks.BLOCKS, "Cohere2DecoderLayer", sequential)


@pytest.mark.parametrize(
    ("plant", "departure"),
    [
        (_rotary_on_full_layers, "layers.3.self_attn"),
        (_half_split_rotary, "layers.0.self_attn"),
        (_sequential_block, "layers.0.mlp"),
    ],
    ids=["rotary_on_full_layers", "half_split_rotary", "sequential_block"],
)
def test_planted_bug_fails_where_it_is(
    blocks: Any,
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[Any, pytest.MonkeyPatch], None],
    departure: str,
) -> None:
    plant(blocks, monkeypatch)
    report = parity(layers_only=True)
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["name"] == departure, report.summary()
    assert first["scaled_diff"] > 0.1


def test_parity_on_the_hub_spelling(tmp_path: Path) -> None:
    """No ``layer_types``: pattern 2 makes layers 1 and 3 full (NoPE), a top-level
    ``rope_theta`` 5e4 (the default would be 1e4)."""
    report = parity(variant(tmp_path, hub_spelling), layers_only=True)
    assert report.passed, report.summary()


def test_parity_bf16_bit_exact_with_a_logit_scale_not_a_power_of_two(tmp_path: Path) -> None:
    report = parity(
        variant(tmp_path, lambda config: config.update(logit_scale=0.3)),
        dtype="bfloat16",
        layers_only=True,
    )
    assert report.passed, report.summary()
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


@pytest.mark.parametrize(
    ("num_layers", "pattern"),
    [(4, None), (6, 2), (6, 3), (32, 4), (40, None), (64, None), (64, 4)],
)
def test_layer_types_without_a_list_follow_transformers(
    blocks: Any, tmp_path: Path, num_layers: int, pattern: int | None
) -> None:
    """A hub config.json (no ``layer_types``) with or without ``sliding_window_pattern``, at
    tiny, R7B (32) and Command A (64) depths: layer i full iff (i + 1) % pattern == 0, the
    pattern defaulting to 4, as Cohere2Config derives them."""
    import transformers

    from resin.runners.torch.model_dir import ModelArgs, ModelRecord, layer_kinds, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    hub_spelling(config)
    config.pop("sliding_window_pattern")
    if pattern is not None:
        config["sliding_window_pattern"] = pattern
    config["num_hidden_layers"] = num_layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.Cohere2Config.from_dict(config)
    record = ModelRecord.load(MODEL_DIR)
    args = ModelArgs(**blocks.normalise_config(load_model_args(tmp_path, record).to_dict()))
    kinds = layer_kinds(args, record)
    hf_types = list(hf.layer_types or [])
    assert len(hf_types) == num_layers
    assert [layer_type for layer_type, _, _ in kinds] == hf_types
    assert [window for _, window, _ in kinds] == [
        config["sliding_window"] if t == "sliding_attention" else None for t in hf_types
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"attention_bias": True}, "attention_bias True is not supported"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e4}},
            "rope type 'dynamic' is not supported",
        ),
    ],
    ids=["attention_bias", "dynamic_rope"],
)
def test_unsupported_config_is_refused_at_load(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(edit))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=f"cohere2: {message}"):
        entry.load_runner(checkpoint)
