"""resin/models/olmoe (AllenAI OLMoE-1B-7B-0924 / -0125: OlmoeForCausalLM, brought up with
`resin new-model`) passes the parity harness on its committed tiny checkpoint and on variants of
it, refuses what it does not compute, and the harness would catch it if OLMoE's math were wrong.

- The tiny checkpoint (resin/models/olmoe/NOTES.md) has MHA (4 heads, as published), q / k
  RMSNorm over the whole projection with randomised weights (they init to 1), ``clip_qkv`` 4
  (the scaffold lowered it from the scaffold config's 8 until it binds), a softmax router over 4
  experts (top 2, ``norm_topk_prob`` false, as published) with random weights, an untied
  ``lm_head``.
- fp32: every stage; bf16 and fp16: the layers and logits bit-exact.
- Variants over the tiny's weights (another config.json): ``norm_topk_prob`` true,
  ``clip_qkv`` null (the published value) and 1 (binding harder), the published config.json's
  spelling (top-level ``rope_theta``, ``rope_scaling`` null, no ``clip_qkv``), a stray
  ``sliding_window`` (transformers' full forward ignores it). New weights: GQA (``k_norm`` then
  narrower than ``q_norm``; every stage), and 16 experts top 8 (OLMoE's 8 routed experts).
- Planted bugs (the tiny must not hide them) fail at the module they break.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module, resolve_model, run_model_parity  # noqa: E402
from tests.model_variants import built_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "olmoe"
TINY = MODEL_DIR / "tiny"
SOURCE = MODEL_DIR / "source"

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REF = resolve_model(MODEL_DIR)
LAYERS = ("layers",)  # the layers and logits stages only


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "olmoe")


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY / "config.json").read_text())


def edited(tmp_path: Path, changes: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint's weights under its config.json with ``changes``, without ``drop``."""
    path = tmp_path / "olmoe"
    shutil.copytree(TINY, path)
    config = {k: v for k, v in {**tiny_config(), **changes}.items() if k not in drop}
    (path / "config.json").write_text(json.dumps(config))
    return path


def written(tmp_path: Path, config: dict[str, Any], seed: int = 1234) -> Path:
    """New weights for ``config`` (a config.json dict, written as given), the tiny's tokenizer
    (:func:`tests.model_variants.built_checkpoint`)."""
    return built_checkpoint(TINY, tmp_path / "built", config, seed)


def published_spelling() -> tuple[dict[str, Any], tuple[str, ...]]:
    """The tiny's widths in the published config.json's spelling (source/config.json): top-level
    ``rope_theta``, ``rope_scaling`` null, ``clip_qkv`` null, no ``rope_parameters``."""
    published = json.loads((SOURCE / "config.json").read_text())
    widths = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "num_experts",
        "num_experts_per_tok",
        "vocab_size",
        "eos_token_id",
    )
    tiny = tiny_config()
    return {**published, **{k: tiny[k] for k in widths}}, ("rope_parameters", "dtype")


def test_tiny_checkpoint_exercises_qk_norm_clip_and_routing() -> None:
    from safetensors import safe_open

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = tiny_config()
    assert config["architectures"] == ["OlmoeForCausalLM"]
    assert config["num_key_value_heads"] == config["num_attention_heads"]  # MHA, as published
    assert config["clip_qkv"] == 4.0  # lowered by the scaffold until it binds (NOTES.md)
    assert config["norm_topk_prob"] is False and not config["tie_word_embeddings"]
    assert 1 < config["num_experts_per_tok"] < config["num_experts"]
    assert "sliding_window" not in config
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    assert q_norm.shape == (config["hidden_size"],)  # the whole projection, not one head
    assert float(q_norm.std()) > 0.1 and float(router.std()) > 0.05  # not HF's 1 / 0 inits
    assert "lm_head.weight" in names
    assert not any("shared_expert" in n or n.endswith(".bias") for n in names)


def test_record_generated_from_the_published_config_plus_clip_qkv() -> None:
    from resin.runners.torch.model_dir import ModelRecord

    published = json.loads((SOURCE / "config.json").read_text())
    scaffold = json.loads((SOURCE / "scaffold_config.json").read_text())
    assert published["clip_qkv"] is None
    assert scaffold == {**published, "clip_qkv": 8.0}
    record = ModelRecord.load(MODEL_DIR)
    # sliding_attention/moe is the scaffold's mirror of the one kind (window_toggled_kinds);
    # normalise_config drops the window keys, so it is never used
    assert set(record.layer_kinds) == {"full_attention/moe", "sliding_attention/moe"}
    kind = record.shape_rules["kinds"]["full_attention/moe"]
    # KV width: not hidden_size (the probe shares KV heads and sets its own head width)
    assert kind["self_attn.k_proj.weight"][0] == "head_dim*num_key_value_heads"
    assert kind["self_attn.q_norm.weight"] == ["hidden_size"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_parity_on_tiny(dtype: str) -> None:
    """fp32: every stage; bf16 / fp16: the layers and logits, bit-exact."""
    half = dtype != "float32"
    report = run_model_parity(REF, dtype=dtype, checks=LAYERS if half else None)
    assert report.passed, report.summary()
    layers = report.stage("layers").metrics["max_scaled_diff"]
    if half:
        assert layers == 0.0 and report.stage("logits").metrics["scaled_diff"] == 0.0
    else:
        assert layers < 1e-5
        assert len(report.stages) == 8 and "greedy/preemption" in {s.name for s in report.stages}


# config.json variants over the tiny's weights: (changes, keys dropped)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "norm_topk_prob": ({"norm_topk_prob": True}, ()),
    "clip_qkv_null": ({"clip_qkv": None}, ()),  # the published value
    "clip_qkv_1": ({"clip_qkv": 1.0}, ()),
    "published_spelling": published_spelling(),
    # OlmoeConfig has no window; HF's full forward ignores a stray one (its cached decode does
    # not: NOTES.md), so only the layers stage compares with HF's definition
    "stray_sliding_window": ({"sliding_window": 16}, ()),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parity_config_variants(tmp_path: Path, name: str) -> None:
    changes, drop = VARIANTS[name]
    report = run_model_parity(REF, checkpoint=edited(tmp_path, changes, drop), checks=LAYERS)
    assert report.passed, report.summary()


# New weights: (config changes over the tiny's, every stage?)
LAYOUTS: dict[str, tuple[dict[str, Any], bool]] = {
    # GQA: k_norm [kv_heads * head_dim] narrower than q_norm [hidden]
    "gqa": ({"num_key_value_heads": 2}, True),
    # OLMoE's 8 routed experts per token, of 16
    "top8_of_16": ({"num_experts": 16, "num_experts_per_tok": 8}, False),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parity_other_layouts(tmp_path: Path, name: str) -> None:
    changes, every_stage = LAYOUTS[name]
    config = {k: v for k, v in {**tiny_config(), **changes}.items() if k != "dtype"}
    report = run_model_parity(
        REF, checkpoint=written(tmp_path, config), checks=None if every_stage else LAYERS
    )
    assert report.passed, report.summary()


@pytest.mark.parametrize("changes", [{}, {"sliding_window": 4096}, {"use_sliding_window": True}])
def test_published_config_layers_are_all_full_attention_moe(
    blocks: Any, tmp_path: Path, changes: dict[str, Any]
) -> None:
    """Every layer of the published config.json is full attention with the MoE, a stray
    window key or not (OlmoeAttention's mask is the full causal one)."""
    from resin.runners.torch.model_dir import ModelArgs, ModelRecord, layer_kinds, load_model_args

    config = {**json.loads((SOURCE / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    record = ModelRecord.load(MODEL_DIR)
    args = ModelArgs(**blocks.normalise_config(load_model_args(tmp_path, record).to_dict()))
    expected = [("full_attention", None, "full_attention/moe")] * 16
    assert layer_kinds(args, record) == expected


def _attention(
    clip_v: bool = True, clip: bool = True, per_head_norm: bool = False
) -> Callable[..., Any]:
    """A planted OlmoeAttention: the shipped math, optionally without the clamp (or without it
    on v), or with q / k normed per head (Qwen3) instead of over the whole projection."""
    from resin.runners.torch.layers import apply_rotary, rms_norm

    linear = torch.nn.functional.linear

    def attention(x: Any, w: dict[str, Any], ctx: Any) -> Any:
        n, head_dim = x.shape[0], ctx.head_dim
        eps = float(ctx.config.rms_norm_eps)
        q, k = linear(x, w["q_proj.weight"]), linear(x, w["k_proj.weight"])
        v = linear(x, w["v_proj.weight"])
        if per_head_norm:
            q_w, k_w = w["q_norm.weight"][:head_dim], w["k_norm.weight"][:head_dim]
            q = rms_norm(q.view(n, -1, head_dim), q_w, eps).view(n, -1)
            k = rms_norm(k.view(n, -1, head_dim), k_w, eps).view(n, -1)
        else:
            q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
        limit = ctx.config.clip_qkv
        if clip and limit is not None:
            q, k = q.clamp(-limit, limit), k.clamp(-limit, limit)
            v = v.clamp(-limit, limit) if clip_v else v
        q, k, v = (t.view(n, -1, head_dim) for t in (q, k, v))
        cos, sin = ctx.require_rotary()
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.require_attention()(q, k, v, scale=head_dim**-0.5)
        return linear(out.reshape(n, -1), w["o_proj.weight"])

    return attention


def _olmo2_placement(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
    """OLMo 2's post-norm wiring with OLMoE's two norms: ``h += norm(attn(h))``, ``h +=
    norm(mlp(h))``."""

    def run(child: str, x: Any) -> Any:
        y = fns[child](x, weights[child], ctx)
        emit(child, y)
        return y

    hidden = hidden + run("input_layernorm", run("self_attn", hidden))
    return hidden + run("post_attention_layernorm", run("mlp", hidden))


@pytest.mark.parametrize(
    "plant, departs",
    [
        ("clip_qkv_ignored", "layers.0.self_attn"),
        ("v_not_clipped", "layers.1.self_attn"),  # the v clamp binds from layer 1
        ("qk_norm_per_head", "layers.0.self_attn"),
        ("topk_renormalised", "layers.0.mlp"),
        ("olmo2_post_norms", "layers.0.input_layernorm"),  # normed attention out
        ("sliding_window_honoured", "layers.0.self_attn"),
    ],
)
def test_planted_bugs_depart_where_they_are(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plant: str, departs: str
) -> None:
    checkpoint = None
    if plant == "clip_qkv_ignored":
        monkeypatch.setitem(blocks.BLOCKS, "OlmoeAttention", _attention(clip=False))
    elif plant == "v_not_clipped":
        monkeypatch.setitem(blocks.BLOCKS, "OlmoeAttention", _attention(clip_v=False))
    elif plant == "qk_norm_per_head":
        monkeypatch.setitem(blocks.BLOCKS, "OlmoeAttention", _attention(per_head_norm=True))
    elif plant == "topk_renormalised":  # norm_topk_prob (false) ignored
        routing = blocks.qwen2_moe_routing
        monkeypatch.setattr(blocks, "qwen2_moe_routing", lambda x, r, k, _: routing(x, r, k, True))
    elif plant == "olmo2_post_norms":
        monkeypatch.setitem(blocks.BLOCKS, "OlmoeDecoderLayer", _olmo2_placement)
    else:  # a stray sliding_window applied (HF's full forward ignores it)
        monkeypatch.setattr(blocks, "normalise_config", lambda config: config)
        checkpoint = edited(tmp_path, {"sliding_window": 16})
    report = run_model_parity(REF, checkpoint=checkpoint, checks=LAYERS)
    assert not report.passed
    assert report.stage("layers").first_mismatch["name"] == departs


def test_olmo2_norm_order_fails_bf16(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMo 2's RMSNorm (weight times the fp32 row, then the cast) for every norm: equal in
    fp32, not in bf16 — OlmoeRMSNorm is Llama's order."""
    from resin.models.olmo2.blocks import olmo2_rms_norm

    monkeypatch.setitem(blocks.BLOCKS, "OlmoeRMSNorm", olmo2_rms_norm)
    assert run_model_parity(REF, checks=LAYERS).passed
    report = run_model_parity(REF, dtype="bfloat16", checks=LAYERS)
    assert not report.passed


def test_check_config_refusals(blocks: Any) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    def args(**changes: Any) -> Any:
        return ModelArgs(**blocks.normalise_config({**tiny_config(), **changes}))

    blocks.check_config(args())
    with pytest.raises(ValueError, match="attention_bias"):
        blocks.check_config(args(attention_bias=True))
