"""resin/models/granitemoe (IBM Granite 3.x MoE: GraniteMoeForCausalLM, granite-3.x-1b-a400m /
3b-a800m, brought up with `resin new-model`) passes the parity harness on its committed tiny
checkpoint and on variants of it, refuses what it does not compute, and the harness would catch
it if the routing or a multiplier were wrong.

- The tiny checkpoint (resin/models/granitemoe/NOTES.md) keeps granite-3.1-3b-a800m's four
  multipliers (embedding 12, residual 0.22, attention 1/64, logits scaling 6), none a value a
  Llama / Mixtral-shaped runner could assume (the attention scale is neither
  ``head_dim ** -0.5`` nor ``1 / head_dim`` at the tiny's head_dim 16); GQA; top 2 of 4 experts
  stored as the hub's fused ``input_linear`` / ``output_linear`` / ``router.layer`` tensors.
- fp32: every stage; bf16: the layers and logits bit-exact.
- The router (top-k logits, then softmax over those k) is checked op for op against HF's
  ``GraniteMoeTopKRouter``; Mixtral's / Qwen2-MoE's order (softmax over all experts, top-k) is
  the same weights once renormalised, and a planted bug without the renormalisation fails.
- Planted bugs — the router not renormalised, gate / up swapped, each multiplier dropped, the
  Llama softmax scale — fail where they should.
- Variants: no multiplier keys (GraniteMoeConfig's 1.0s), granite-3.0's hub spelling
  (top-level ``rope_theta``), untied ``lm_head``, top 3 (bf16 bit-exact only when the expert
  outputs are summed as transformers' default experts dispatch sums them), and new weights in
  granite-3.1-3b-a800m's routing shape (top 8, 3:1 GQA), every stage.

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

from resin.evals.model_ref import import_model_module, resolve_model  # noqa: E402
from resin.runners.torch.blocks import gqa_attention_block, prenorm_decoder_layer  # noqa: E402
from resin.runners.torch.layers import routed_experts  # noqa: E402
from resin.runners.torch.model_definition import default_logits  # noqa: E402
from tests.model_variants import built_checkpoint, model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "granitemoe"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")
ALL_STAGES = {
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

REF = resolve_model(MODEL_DIR)


def _blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "granitemoe")


@pytest.fixture
def blocks() -> Any:
    return _blocks()


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY / "config.json").read_text())


def written(tmp_path: Path, config: dict[str, Any], seed: int = 1234) -> Path:
    """New weights for ``config`` (a config.json dict, written as given), the tiny's tokenizer
    (:func:`tests.model_variants.built_checkpoint`)."""
    return built_checkpoint(TINY, tmp_path / "built", config, seed)


def no_multipliers(config: dict[str, Any]) -> None:
    """No multiplier keys: GraniteMoeConfig's defaults (1.0 each), i.e. Mixtral's math except
    the attention scale, which is then 1.0, not ``head_dim ** -0.5``."""
    for key in (*MULTIPLIERS, "logits_scaling"):
        config.pop(key)


def granite_30_hub_spelling(config: dict[str, Any]) -> None:
    """granite-3.0-{1b-a400m,3b-a800m}'s rope as the hub spells it: top-level ``rope_theta``
    1e4, ``rope_scaling`` null, 4096 positions."""
    config.pop("rope_parameters")
    config.update(rope_theta=10_000.0, rope_scaling=None, max_position_embeddings=4096)


def mlp_bias(config: dict[str, Any]) -> None:
    """``mlp_bias`` true: not a GraniteMoeConfig key (dense Granite's), ignored by HF's experts
    and so by these blocks (granite's load-time refusal of it is not applied)."""
    config["mlp_bias"] = True


def top_k(k: int) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config["num_experts_per_tok"] = k

    edit.__name__ = f"top_{k}"
    return edit


# -- the tiny checkpoint ------------------------------------------------------------------------


def test_tiny_checkpoint_cannot_hide_a_multiplier_or_the_routing() -> None:
    from safetensors import safe_open

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = tiny_config()
    source = json.loads((MODEL_DIR / "source" / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeForCausalLM"]
    for key in (*MULTIPLIERS, "logits_scaling"):
        assert config[key] == source[key] and config[key] != 1.0, key
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert config["attention_multiplier"] not in (head_dim**-0.5, 1 / head_dim)
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    # top k of more experts, k > 1: the weights' normalisation and the expert choice both count
    assert 1 < config["num_experts_per_tok"] < config["num_local_experts"]
    assert config["tie_word_embeddings"]
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names
    # the hub's names, which weights.py maps to the in-memory ones
    prefix = "model.layers.0.block_sparse_moe."
    assert {prefix + n for n in ("input_linear.weight", "output_linear.weight")} <= names
    assert prefix + "router.layer.weight" in names


def test_record_has_no_false_kv_width_rule() -> None:
    """architecture.json is generated from ``source/scaffold_config.json`` (the published config
    with ``intermediate_size`` 1024): from the published one, where the K / V width
    (8 KV heads x 64) equals ``intermediate_size`` (512) in the source and in the shrunk probe,
    the shape rules read K / V's width as ``intermediate_size`` and refused every checkpoint
    where the two differ (NOTES.md)."""
    record = json.loads((MODEL_DIR / "architecture.json").read_text())
    assert record["generated_from"].endswith("source/scaffold_config.json")
    rules = record["shape_rules"]["kinds"]["full_attention/moe"]
    for proj in ("k_proj", "v_proj"):
        assert rules[f"self_attn.{proj}.weight"] == [None, "hidden_size"]
    assert rules["block_sparse_moe.input_linear.weight"] == [
        "num_local_experts",
        "2*intermediate_size",
        "hidden_size",
    ]
    published = json.loads((MODEL_DIR / "source" / "config.json").read_text())
    scaffold = json.loads((MODEL_DIR / "source" / "scaffold_config.json").read_text())
    assert {k: v for k, v in scaffold.items() if published.get(k) != v} == {
        "intermediate_size": 1024
    }


def test_router_is_hf_op_for_op(blocks: Any) -> None:
    from transformers import GraniteMoeConfig
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter

    config = GraniteMoeConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=3)
    router = GraniteMoeTopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            router.weight.copy_(torch.randn(8, 64, generator=generator))
        x = torch.randn(11, 64, generator=generator).to(dtype)
        module = router.to(dtype)
        with torch.no_grad():
            _, hf_weights, hf_experts = module(x)
        experts, weights = blocks.granite_moe_routing(x, module.weight, 3)
        assert torch.equal(experts, hf_experts)
        assert weights.dtype == dtype and torch.equal(weights, hf_weights)
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(11), atol=1e-2, rtol=0)


# -- parity on the tiny checkpoint --------------------------------------------------------------


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert ALL_STAGES <= {s.name for s in report.stages}
    layers = report.stage("layers")
    assert layers.metrics["max_scaled_diff"] < 1e-6
    # the MoE output is compared too (HF's ``block_sparse_moe``, filed as ``mlp``)
    assert not layers.metrics["missing"]
    assert layers.metrics["num_checkpoints"] == 22


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


# -- planted bugs -------------------------------------------------------------------------------


def _softmax_over_all_experts(x: Any, w: Any, ctx: Any) -> Any:
    """Mixtral / Qwen2-MoE's order, *without* the renormalisation GraniteMoe's order implies."""
    from resin.models.qwen2_moe.blocks import qwen2_moe_routing

    k = int(ctx.config.num_experts_per_tok)
    experts, weights = qwen2_moe_routing(x, w["router.weight"], k, norm_topk_prob=False)
    return routed_experts(x, w, experts, weights, lambda g, u: torch.nn.functional.silu(g) * u)


def _gate_up_swapped(x: Any, w: Any, ctx: Any) -> Any:
    fused = w["experts.gate_up_proj"]
    swapped = torch.cat(fused.chunk(2, dim=1)[::-1], dim=1)
    return _blocks().granite_moe_sparse_moe(x, {**w, "experts.gate_up_proj": swapped}, ctx)


def _no_residual_multiplier(hidden: Any, fns: Any, weights: Any, ctx: Any, emit: Any) -> Any:
    """The scaffold's shared pre-norm layer (no ``residual_multiplier``) on GraniteMoe's
    children."""
    as_mlp = _blocks()._as_mlp
    return prenorm_decoder_layer(hidden, as_mlp(fns), as_mlp(weights), ctx, emit)


def _unscaled_embedding(hidden: Any, w: Any, ctx: Any) -> Any:
    return hidden


# planted bug -> (what it replaces in blocks.py, by BLOCKS key or hook name; the replacement;
# the first departing checkpoint, or None for the logits stage only)
PLANTS: dict[str, tuple[str, Callable[..., Any], str | None]] = {
    "router_not_renormalised": ("GraniteMoeMoE", _softmax_over_all_experts, "layers.0.mlp"),
    "gate_up_swapped": ("GraniteMoeMoE", _gate_up_swapped, "layers.0.mlp"),
    # the input RMSNorm hides a scaled stream; the residual add after attention does not
    "no_embedding_multiplier": (
        "pre_layers",
        _unscaled_embedding,
        "layers.0.post_attention_layernorm",
    ),
    "attention_scale_head_dim_rsqrt": (
        "GraniteMoeAttention",
        gqa_attention_block,
        "layers.0.self_attn",
    ),
    "no_residual_multiplier": (
        "GraniteMoeDecoderLayer",
        _no_residual_multiplier,
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


def test_softmax_over_all_then_renormalised_is_the_same_router(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a bug: softmax over all experts, top k, renormalised gives GraniteMoe's weights (the
    same experts, weights equal up to rounding)."""
    from resin.models.qwen2_moe.blocks import qwen2_moe_routing

    def renormalised(x: Any, w: Any, ctx: Any) -> Any:
        k = int(ctx.config.num_experts_per_tok)
        experts, weights = qwen2_moe_routing(x, w["router.weight"], k, norm_topk_prob=True)
        return routed_experts(x, w, experts, weights, lambda g, u: torch.nn.functional.silu(g) * u)

    monkeypatch.setitem(blocks.BLOCKS, "GraniteMoeMoE", renormalised)
    report = parity(layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6


# -- variants -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [no_multipliers, granite_30_hub_spelling, mlp_bias, top_k(1)],
    ids=lambda f: f.__name__,
)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


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
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()


def test_bf16_top3_sums_expert_outputs_as_transformers(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With 3 slots a token's expert outputs round differently summed once in fp32 (the default
    ``grouped_mm`` experts dispatch, :func:`routed_experts` ``slot_sum``) than added one by one
    in bf16 (the experts class's eager ``forward``); with 2 (the tiny) they cannot differ."""
    checkpoint = variant(tmp_path, top_k(3))
    report = parity(checkpoint, dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0

    def index_add(x: Any, w: Any, ctx: Any) -> Any:
        experts, weights = blocks.granite_moe_routing(x, w["router.weight"], 3)
        return routed_experts(x, w, experts, weights, lambda g, u: torch.nn.functional.silu(g) * u)

    monkeypatch.setitem(blocks.BLOCKS, "GraniteMoeMoE", index_add)
    report = parity(checkpoint, dtype="bfloat16", layers_only=True)
    assert report.stage("layers").metrics["max_scaled_diff"] > 0.0


def test_parity_granite_31_3b_a800m_routing_shape(tmp_path: Path) -> None:
    """New weights with granite-3.1-3b-a800m's routing (top 8; 40 experts -> 10) and GQA ratio
    (24 / 8 heads -> 6 / 2), every stage."""
    config = {
        **tiny_config(),
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_local_experts": 10,
        "num_experts_per_tok": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
    }
    report = parity(written(tmp_path, config))
    assert report.passed, report.summary()
    assert ALL_STAGES <= {s.name for s in report.stages}


# -- refusals -----------------------------------------------------------------------------------


def test_attention_bias_is_refused_at_load(tmp_path: Path) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(attention_bias=True))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="granitemoe: attention_bias true is not supported"):
        entry.load_runner(checkpoint)
