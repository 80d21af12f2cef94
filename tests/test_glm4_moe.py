"""resin/models/glm4_moe (GLM-4.5 / GLM-4.5-Air / GLM-4.6: Glm4MoeForCausalLM, brought up with
`resin new-model`) passes the parity harness on its committed tiny checkpoint and on variants of
it, and refuses what it does not compute.

- The tiny checkpoint (resin/models/glm4_moe/NOTES.md) has GQA (4 query heads, 2 KV heads) with
  q / k / v biases and q / k norms, ``head_dim`` 32 (not ``hidden_size / heads``), partial
  rotary 0.5 (the first 16 channels rotate, half-split), ``noaux_tc`` routing over 8 experts in
  4 groups (2 kept, 3 experts per token, a seeded correction bias, ``routed_scaling_factor``
  2.5), 3 shared experts, one dense layer before three MoE layers, and the MTP layer real
  checkpoints ship (HF builds none; here it loads as the MTP drafter's layer, checked in
  tests/test_glm4_moe_mtp.py).
- fp32: every stage; bf16 and fp16: the layers stage bit-exact.
- Variants (another config.json, and new weights where shapes change): GLM-4.5's own
  config.json spelling (top-level ``rope_theta`` / ``partial_rotary_factor``), no
  ``partial_rotary_factor`` at all (HF's default 0.5), a whole-head factor in the rope dict over
  a top-level 0.5 (the dict's wins), ``norm_topk_prob`` false, YaRN on the partial rotary, q / k
  norm tensors in a checkpoint whose config turns them off (HF ignores them), and GLM-4.5-Air's
  layout (no q / k norms, 12 query heads on one KV head, 16 experts in one group, top 8, one
  shared expert, scale 1; every stage).
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

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "glm4_moe"
TINY = MODEL_DIR / "tiny"

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # the MTP layer's embedding / head copies every checkpoint here ships: reported unused at
    # each load (tested once below)
    pytest.mark.filterwarnings("ignore:.*the model does not use:UserWarning"),
]


REF = resolve_model(MODEL_DIR)
LAYERS = ("layers",)  # the layers and logits stages only


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "glm4_moe")


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY / "config.json").read_text())


def edited_config(changes: dict[str, Any], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The tiny's config.json with ``changes`` and without ``drop``: a fresh copy (HF's config
    classes write defaults into the rope dict they are given)."""
    config = {k: v for k, v in {**tiny_config(), **changes}.items() if k not in drop}
    return json.loads(json.dumps(config))


def edited(tmp_path: Path, changes: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint's weights under :func:`edited_config`."""
    path = tmp_path / "glm4_moe"
    shutil.copytree(TINY, path)
    (path / "config.json").write_text(json.dumps(edited_config(changes, drop)))
    return path


def test_tiny_checkpoint_exercises_partial_rope_qk_norms_grouped_routing_and_mtp() -> None:
    from safetensors import safe_open

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = tiny_config()
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["use_qk_norm"] is True and config["attention_bias"] is True
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert 1 < config["topk_group"] < config["n_group"] <= config["n_routed_experts"] // 2
    assert config["num_experts_per_tok"] > config["n_routed_experts"] // config["n_group"]
    assert config["n_shared_experts"] > 1 and config["routed_scaling_factor"] != 1
    assert 0 < config["first_k_dense_replace"] < config["num_hidden_layers"]
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
    assert float(bias.abs().min()) > 0  # seeded: HF initialises it to zeros
    assert float((q_norm - 1).abs().max()) > 0.1  # HF initialises it to ones
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert {mtp + "eh_proj.weight", mtp + "shared_head.head.weight"} <= set(names)


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
    # GLM-4.5's own spelling: top-level rope_theta / partial_rotary_factor, rope_scaling null
    "glm_spelling": (
        {"rope_theta": 1e6, "partial_rotary_factor": 0.5, "rope_scaling": None},
        ("rope_parameters",),
    ),
    # no factor anywhere: Glm4MoeConfig's default 0.5 (not the usual 1.0)
    "no_partial_factor": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, ()),
    # rope_parameters' factor wins over the top-level one (HF's standardize_rope_params)
    "whole_head_in_rope_dict": (
        {
            "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 1.0,
            },
        },
        (),
    ),
    "no_topk_renormalisation": ({"norm_topk_prob": False}, ()),
    "yarn_partial": (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "partial_rotary_factor": 0.5,
            }
        },
        (),
    ),
    # q / k norm tensors in the checkpoint, use_qk_norm false: HF builds no norm, ignores them
    "qk_norms_off": ({"use_qk_norm": False}, ()),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parity_config_variants(tmp_path: Path, name: str) -> None:
    changes, drop = VARIANTS[name]
    report = run_model_parity(REF, checkpoint=edited(tmp_path, changes, drop), checks=LAYERS)
    assert report.passed, report.summary()


# GLM-4.5-Air's layout, shrunk: no q / k norms, 12 query heads per KV head (96 / 8), one
# expert group, top 8 of 16 experts, one shared expert, routed_scaling_factor 1
AIR = {
    "use_qk_norm": False,
    "num_attention_heads": 12,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "intermediate_size": 96,
}


def test_parity_glm45_air_layout_every_stage(tmp_path: Path) -> None:
    """New weights (source/make_tiny.py's, MTP layer included): no q / k norm tensors."""
    from safetensors import safe_open

    make_tiny = import_model_module(MODEL_DIR / "source", "make_tiny", "glm4_moe_source")
    checkpoint = tmp_path / "air"
    make_tiny.write_glm_checkpoint({**tiny_config(), **AIR}, checkpoint)
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert not any("q_norm" in name for name in f.keys())
    report = run_model_parity(REF, checkpoint=checkpoint)
    assert report.passed, report.summary()


def test_mtp_layer_loads_past_the_stack_and_its_copies_stay_unread() -> None:
    """The checkpoint's next-n layer loads as the MTP drafter's layer past the stack (HF's class
    builds none; tests/test_glm4_moe_mtp.py checks its drafts); its copies of the target's
    embedding and head are the only tensors left unused."""
    from resin.runners.torch.model_dir import ModelDirRunner

    with pytest.warns(UserWarning, match="the model does not use"):
        runner = ModelDirRunner.from_model_dir(MODEL_DIR, TINY, name="glm4_moe")
    n = tiny_config()["num_hidden_layers"]
    assert len(runner.model.layers) == n and runner.model.mtp is not None
    assert sorted(runner.weights.unused) == [
        f"model.layers.{n}.embed_tokens.weight",
        f"model.layers.{n}.shared_head.head.weight",
    ]


def test_rotary_table_is_hf_partial_width(blocks: Any) -> None:
    """Half the head rotates whether the factor is given or defaulted, as Glm4MoeConfig."""
    import transformers

    from resin.runners.torch.model_dir import ModelArgs

    for changes, drop in ({}, ()), VARIANTS["glm_spelling"], VARIANTS["no_partial_factor"]:
        config = edited_config(changes, drop)
        hf = transformers.Glm4MoeConfig(**edited_config(changes, drop))
        rotary = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeRotaryEmbedding(hf)
        positions = torch.arange(7)
        hf_cos, hf_sin = rotary(torch.zeros(1, 7, 1), positions[None])
        args = ModelArgs(**blocks.normalise_config(config))
        table = blocks.glm4_moe_rotary_embedding(args, 32, torch.device("cpu"))["*"]
        cos, sin = table.cos_sin(positions, torch.float32)
        assert cos.shape == (7, 16)
        torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)


def _without(*parts: str) -> Callable[..., Any]:
    """A planted attention: the shared block given the weights less those naming ``parts``."""

    def attention(x: Any, w: dict[str, Any], ctx: Any) -> Any:
        from resin.runners.torch.blocks import gqa_attention_block

        return gqa_attention_block(x, {k: v for k, v in w.items() if not k.startswith(parts)}, ctx)

    return attention


@pytest.mark.parametrize(
    "plant, departs",
    [
        ("no_qk_norms", "layers.0.self_attn"),
        ("no_qkv_biases", "layers.0.self_attn"),
        ("whole_head_rotary", "layers.0.self_attn"),
        ("rotary_factor_default_1", "layers.0.self_attn"),
    ],
)
def test_planted_bugs_depart_where_they_are(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plant: str, departs: str
) -> None:
    checkpoint = None
    if plant == "no_qk_norms":
        monkeypatch.setitem(blocks.BLOCKS, "Glm4MoeAttention", _without("q_norm.", "k_norm."))
    elif plant == "no_qkv_biases":
        monkeypatch.setitem(blocks.BLOCKS, "Glm4MoeAttention", _without("q_proj.b", "k_proj.b"))
    elif plant == "whole_head_rotary":
        rotary = blocks.glm4_moe_rotary_embedding

        def whole(config: Any, head_dim: int, device: Any) -> Any:
            values = config.to_dict()
            values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": 1}
            return rotary(values, head_dim, device)

        monkeypatch.setitem(blocks.ROTARY, "Glm4MoeRotaryEmbedding", whole)
    else:  # the factor left out of config.json read as 1.0, the usual default
        monkeypatch.setattr(blocks, "normalise_config", lambda values: values)
        checkpoint = edited(tmp_path, *VARIANTS["no_partial_factor"])
    report = run_model_parity(REF, checkpoint=checkpoint, checks=LAYERS)
    assert not report.passed
    assert report.stage("layers").first_mismatch["name"] == departs


def test_check_config_refusals(blocks: Any) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    def args(**changes: Any) -> Any:
        return ModelArgs(**blocks.normalise_config({**tiny_config(), **changes}))

    blocks.check_config(args())
    refused: list[tuple[dict[str, Any], str]] = [
        ({"attention_bias": False}, "attention_bias"),
        ({"n_group": 8}, "groups of >= 2"),
        ({"n_group": 3}, "groups of >= 2"),
    ]
    for changes, message in refused:
        with pytest.raises(ValueError, match=message):
            blocks.check_config(args(**changes))
