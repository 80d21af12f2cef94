"""resin/models/qwen2_moe (Qwen1.5-MoE-A2.7B / Qwen2-57B-A14B: Qwen2MoeForCausalLM, brought up
with `resin new-model`) passes the parity harness on its committed tiny checkpoint and on variants
of it, and refuses what it does not compute.

- The tiny checkpoint (resin/models/qwen2_moe/NOTES.md) has GQA (4 query heads, 2 KV heads)
  with q / k / v biases, a softmax router over 4 experts (top 2, ``norm_topk_prob`` false, as
  published), a shared expert scaled by ``sigmoid(shared_expert_gate(x))``, a dense-MLP layer
  (``mlp_only_layers`` [1]) among MoE layers, and a sliding-window layer (window 32, narrower
  than the parity prompts) chosen by ``use_sliding_window`` / ``max_window_layers``.
- fp32: every stage; bf16 and fp16: the layers stage bit-exact.
- Variants over the tiny's weights (another config.json): ``norm_topk_prob`` true, the
  published layout (no sliding, no ``layer_types``: every layer full attention), the top-level
  ``rope_theta`` spelling of the published config.json, YaRN (Qwen2-57B-A14B-Instruct's
  ``rope_scaling`` advice), ``layer_types`` derived from
  ``max_window_layers`` as ``Qwen2MoeConfig`` does. New weights: ``decoder_sparse_step`` 2
  (dense and MoE layers alternate) and Qwen2-57B-A14B's layout shrunk (7 query heads per KV
  head, top 4 of 8 experts, every stage), Qwen1.5-MoE-A2.7B's (MHA, top 4 of 6).
- ``layer_types`` is derived as transformers derives it from the published config.json (24
  layers, where the record's default list would otherwise leak in).
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
MODEL_DIR = REPO / "resin" / "models" / "qwen2_moe"
TINY = MODEL_DIR / "tiny"
SOURCE = MODEL_DIR / "source"

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REF = resolve_model(MODEL_DIR)
LAYERS = ("layers",)  # the layers and logits stages only


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "qwen2_moe")


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY / "config.json").read_text())


def edited(tmp_path: Path, changes: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint's weights under its config.json with ``changes``, without ``drop``."""
    path = tmp_path / "qwen2_moe"
    shutil.copytree(TINY, path)
    config = {k: v for k, v in {**tiny_config(), **changes}.items() if k not in drop}
    (path / "config.json").write_text(json.dumps(config))
    return path


def written(tmp_path: Path, config: dict[str, Any], seed: int = 1234) -> Path:
    """New weights for ``config`` (a config.json dict, written as given), the tiny's tokenizer
    (:func:`tests.model_variants.built_checkpoint`)."""
    return built_checkpoint(TINY, tmp_path / "built", config, seed)


def published_layout(**changes: Any) -> dict[str, Any]:
    """The tiny's widths in the published config.json's spelling: top-level ``rope_theta``, no
    ``layer_types`` / ``mlp_only_layers``, no sliding window."""
    config = {
        k: v
        for k, v in tiny_config().items()
        if k not in ("layer_types", "mlp_only_layers", "rope_parameters")
    }
    config.update(rope_theta=1e6, use_sliding_window=False, max_window_layers=21)
    config.update(sliding_window=32768)
    return {**config, **changes}


def test_tiny_checkpoint_exercises_dense_and_moe_layers_sliding_and_shared_gate() -> None:
    from safetensors import safe_open

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = tiny_config()
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["norm_topk_prob"] is False and config["qkv_bias"] is True
    assert 1 < config["num_experts_per_tok"] < config["num_experts"]
    assert config["use_sliding_window"] is True and config["sliding_window"] < 70
    # max_window_layers binds: without it layer 2 (even) would slide too
    assert config["layer_types"] == ["sliding_attention"] + ["full_attention"] * 3
    assert config["max_window_layers"] == 2 and config["num_hidden_layers"] == 4
    assert config["mlp_only_layers"] == [1] and config["decoder_sparse_step"] == 1
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        gate = f.get_tensor("model.layers.0.mlp.shared_expert_gate.weight")
    assert "model.layers.1.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" not in names
    for layer in (0, 2, 3):
        assert f"model.layers.{layer}.mlp.experts.3.down_proj.weight" in names
        assert f"model.layers.{layer}.mlp.shared_expert_gate.weight" in names
    assert float(gate.std()) > 0.05  # sigmoid(gate . x) varies per token, not ~0.5


def test_record_knows_every_layer_kind_and_no_false_kv_width() -> None:
    """architecture.json was generated from source/scaffold_config.json: the published
    config.json plus the keys that make every layer kind appear (NOTES.md)."""
    from resin.runners.torch.model_dir import ModelRecord

    published = json.loads((SOURCE / "config.json").read_text())
    scaffold = json.loads((SOURCE / "scaffold_config.json").read_text())
    extra = {"num_key_value_heads": 4, "use_sliding_window": True, "max_window_layers": 2}
    assert scaffold == {**published, **extra, "mlp_only_layers": [1]}
    record = ModelRecord.load(MODEL_DIR)
    assert set(record.layer_kinds) == {
        "sliding_attention/moe",
        "full_attention/moe",
        "full_attention/dense",
    }
    assert record.windowed_layer_types == ["sliding_attention"]
    for kind in record.shape_rules["kinds"].values():
        # KV width: not hidden_size (the probe shares KV heads and sets its own head width;
        # 4 KV heads tie with top-4 routing in both configs, so it is left unchecked)
        assert kind["self_attn.k_proj.weight"][0] is None
        assert kind["self_attn.q_proj.weight"][0] == "head_dim*num_attention_heads"


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
    # as published: no sliding window; layer_types derived (all full), not listed
    "no_sliding_window": ({"use_sliding_window": False}, ("layer_types",)),
    # the published spelling: top-level rope_theta
    "rope_theta_spelling": ({"rope_theta": 1e6}, ("rope_parameters",)),
    # Qwen2-57B-A14B-Instruct's long-context advice, in the legacy spelling: YaRN x4 over 32k
    "yarn_rope_scaling": (
        {
            "rope_theta": 1e6,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
            "max_position_embeddings": 131072,
        },
        ("rope_parameters",),
    ),
    # layer_types left to Qwen2MoeConfig's rule: even layers below max_window_layers slide
    "derived_sliding_layers": ({"max_window_layers": 4}, ("layer_types",)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parity_config_variants(tmp_path: Path, name: str) -> None:
    changes, drop = VARIANTS[name]
    report = run_model_parity(REF, checkpoint=edited(tmp_path, changes, drop), checks=LAYERS)
    assert report.passed, report.summary()


# New weights: (config.json, every stage?)
LAYOUTS: dict[str, tuple[dict[str, Any], bool]] = {
    # dense and MoE layers alternate: MoE iff (i + 1) % 2 == 0
    "decoder_sparse_step_2": (published_layout(decoder_sparse_step=2), False),
    # Qwen2-57B-A14B shrunk: 28 / 4 heads -> 7 / 1, top 8 of 64 experts -> top 4 of 8, shared
    # expert 8 experts wide
    "qwen2_57b_a14b": (
        published_layout(
            hidden_size=112,
            num_attention_heads=7,
            num_key_value_heads=1,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=128,
            intermediate_size=96,
        ),
        True,
    ),
    # Qwen1.5-MoE-A2.7B shrunk: MHA, top 4 of 60 -> of 6
    "qwen15_moe_a27b": (
        published_layout(num_key_value_heads=4, num_experts=6, num_experts_per_tok=4),
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parity_other_layouts(tmp_path: Path, name: str) -> None:
    config, every_stage = LAYOUTS[name]
    report = run_model_parity(
        REF, checkpoint=written(tmp_path, config), checks=None if every_stage else LAYERS
    )
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"use_sliding_window": True},
        {"use_sliding_window": True, "max_window_layers": 24},
        {"use_sliding_window": True, "max_window_layers": 0},
        {"use_sliding_window": True, "num_hidden_layers": 5},
        {"decoder_sparse_step": 3, "mlp_only_layers": [0, 5]},
    ],
)
def test_layer_kinds_are_hf_from_the_published_config(
    blocks: Any, tmp_path: Path, changes: dict[str, Any]
) -> None:
    """Each layer's type, window and MLP as ``Qwen2MoeDecoderLayer`` gets them, from the
    published config.json (no ``layer_types``: the record's 24-layer default must not leak)."""
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import (
        Qwen2MoeDecoderLayer,
        Qwen2MoeSparseMoeBlock,
    )

    from resin.runners.torch.model_dir import ModelArgs, ModelRecord, layer_kinds, load_model_args

    config = {**json.loads((SOURCE / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    record = ModelRecord.load(MODEL_DIR)
    args = ModelArgs(**blocks.normalise_config(load_model_args(tmp_path, record).to_dict()))
    hf = transformers.Qwen2MoeConfig(**config)
    types = list(hf.layer_types or [])
    expected = []
    with torch.device("meta"):
        for i in range(int(config["num_hidden_layers"])):
            layer = Qwen2MoeDecoderLayer(hf, i)
            mlp = "moe" if isinstance(layer.mlp, Qwen2MoeSparseMoeBlock) else "dense"
            window = getattr(layer.self_attn, "sliding_window", None)
            expected.append((types[i], window, f"{types[i]}/{mlp}"))
    assert layer_kinds(args, record) == expected


def _moe(shared_gate: bool = True, renormalise: bool | None = None) -> Callable[..., Any]:
    """A planted MoE block: the shipped one's parts, optionally without the shared expert's
    sigmoid gate or with the router's renormalisation forced."""
    mod = import_model_module(MODEL_DIR, "blocks", "qwen2_moe")

    def block(x: Any, w: dict[str, Any], ctx: Any) -> Any:
        cfg = ctx.config
        norm = bool(cfg.norm_topk_prob) if renormalise is None else renormalise
        experts, weights = mod.qwen2_moe_routing(
            x, w["gate.weight"], int(cfg.num_experts_per_tok), norm
        )
        act = mod.config_activation(cfg)
        out = mod.routed_experts(x, w, experts, weights, lambda g, u: act(g) * u, slot_sum=True)
        shared_w = {
            k.removeprefix("shared_expert."): v for k, v in w.items() if "shared_expert." in k
        }
        shared = mod.swiglu_mlp_block(x, shared_w, ctx)
        if shared_gate:
            shared = (
                torch.sigmoid(torch.nn.functional.linear(x, w["shared_expert_gate.weight"]))
                * shared
            )
        return out + shared

    return block


def _no_biases(x: Any, w: dict[str, Any], ctx: Any) -> Any:
    from resin.runners.torch.blocks import gqa_attention_block

    return gqa_attention_block(x, {k: v for k, v in w.items() if not k.endswith(".bias")}, ctx)


@pytest.mark.parametrize(
    "plant, departs",
    [
        ("shared_expert_gate_dropped", "layers.0.mlp"),
        ("topk_renormalised", "layers.0.mlp"),
        ("no_qkv_biases", "layers.0.self_attn"),
        ("no_sliding_window", "layers.0.self_attn"),
        ("qwen2_dense_sliding_rule", "layers.0.self_attn"),
    ],
)
def test_planted_bugs_depart_where_they_are(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plant: str, departs: str
) -> None:
    checkpoint = None
    if plant == "shared_expert_gate_dropped":
        monkeypatch.setitem(blocks.BLOCKS, "Qwen2MoeSparseMoeBlock", _moe(shared_gate=False))
    elif plant == "topk_renormalised":  # norm_topk_prob (false) ignored
        monkeypatch.setitem(blocks.BLOCKS, "Qwen2MoeSparseMoeBlock", _moe(renormalise=True))
    elif plant == "no_qkv_biases":
        monkeypatch.setitem(blocks.BLOCKS, "Qwen2MoeAttention", _no_biases)
    elif plant == "no_sliding_window":
        normalise = blocks.normalise_config

        def all_full(values: dict[str, Any]) -> dict[str, Any]:
            out = normalise(values)
            return {**out, "layer_types": ["full_attention"] * len(out["layer_types"])}

        monkeypatch.setattr(blocks, "normalise_config", all_full)
    else:  # Qwen2's dense rule: the layers from max_window_layers on slide (not HF's here)
        monkeypatch.setattr(
            blocks,
            "hf_layer_types",
            lambda v: [
                "sliding_attention" if i >= v["max_window_layers"] else "full_attention"
                for i in range(v["num_hidden_layers"])
            ],
        )
        checkpoint = edited(tmp_path, {"max_window_layers": 1}, ("layer_types",))
    report = run_model_parity(REF, checkpoint=checkpoint, checks=LAYERS)
    assert not report.passed
    assert report.stage("layers").first_mismatch["name"] == departs


def test_check_config_refusals(blocks: Any) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    def args(**changes: Any) -> Any:
        return ModelArgs(**blocks.normalise_config({**tiny_config(), **changes}))

    blocks.check_config(args())
    refused: list[tuple[dict[str, Any], str]] = [
        ({"qkv_bias": False}, "qkv_bias"),
        ({"use_sliding_window": False}, "use_sliding_window is false"),
        ({"sliding_window": None}, "a window > 0"),
    ]
    for changes, message in refused:
        with pytest.raises(ValueError, match=message):
            blocks.check_config(args(**changes))
