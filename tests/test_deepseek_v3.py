"""resin/models/deepseek_v3 (DeepSeek-V3 / R1 / V3.1, Kimi K2, Moonlight: DeepseekV3ForCausalLM,
brought up with `resin new-model`) passes the parity harness on its committed tiny checkpoint and
on variants of it, and refuses what it does not compute.

- The tiny checkpoint (resin/models/deepseek_v3/NOTES.md) has MLA with a low-rank query,
  interleaved YaRN rope whose ``mscale`` and ``mscale_all_dim`` differ (both the cos / sin factor
  and the softmax scale move), ``noaux_tc`` routing over 8 experts in 4 groups (2 kept, 3 experts
  per token, a seeded correction bias), 3 shared experts, one dense layer before three MoE
  layers, and the MTP layer real checkpoints ship (HF builds none; here it loads as the MTP
  drafter's layer, checked in tests/test_deepseek_v3_mtp.py).
- fp32: every stage; bf16 and fp16: the layers stage bit-exact (HF's default ``grouped_mm``
  experts accumulate the top-k slots in fp32, and so does the runner).
- Variants (another config.json, and new weights where shapes change): ``q_lora_rank`` null
  (``q_proj``) with 2 shared experts and plain rope (Moonlight's layout), DeepSeek's own
  config.json spelling (``rope_scaling`` of type yarn, ``mscale`` = ``mscale_all_dim`` = 1, no
  ``head_dim``), plain rope, half-split rope (``rope_interleave`` false), and Kimi K2's routing
  (one group, no renormalisation).
- Planted bugs (the tiny must not hide them) fail at the module they break.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from tests.model_variants import model_parity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "deepseek_v3"
TINY = MODEL_DIR / "tiny"
parity = partial(model_parity, MODEL_DIR)

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # the MTP layer's embedding / head copies every checkpoint here ships: reported unused at
    # each load (tested once below)
    pytest.mark.filterwarnings("ignore:.*the model does not use:UserWarning"),
]


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "deepseek_v3")


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY / "config.json").read_text())


def variant(tmp_path: Path, edit: Callable[[dict[str, Any]], None], rebuild: bool = False) -> Path:
    """The tiny checkpoint with its config.json edited by ``edit``; with ``rebuild`` new weights
    for the edited config (source/make_tiny.py's, MTP layer included)."""
    path = tmp_path / "deepseek_v3"
    config = tiny_config()
    edit(config)
    if rebuild:
        make_tiny = import_model_module(MODEL_DIR / "source", "make_tiny", "deepseek_v3_source")
        make_tiny.write_checkpoint(config, path)
    else:
        shutil.copytree(TINY, path)
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_tiny_checkpoint_exercises_mla_yarn_grouped_routing_and_mtp() -> None:
    from safetensors import safe_open

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = tiny_config()
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["q_lora_rank"] and config["rope_interleave"] is True
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["mscale"] != rope["mscale_all_dim"]
    assert config["n_routed_experts"] // config["n_group"] >= 2
    assert 1 < config["topk_group"] < config["n_group"]
    assert config["num_experts_per_tok"] > config["n_routed_experts"] // config["n_group"]
    assert config["n_shared_experts"] > 1 and config["routed_scaling_factor"] != 1
    assert 0 < config["first_k_dense_replace"] < config["num_hidden_layers"]
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert float(bias.abs().min()) > 0  # seeded: HF initialises it to zeros
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert {mtp + "eh_proj.weight", mtp + "shared_head.head.weight"} <= set(names)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {s.name for s in report.stages} >= {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/page_size=16",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    }
    # YaRN's inverse frequencies: Resin's float64 ones cast to fp32 are one ulp off HF's fp32
    # ones at one pair; everything else is HF's (the plain-rope variant is bit-exact)
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parity_half_precision_layers_bit_exact(dtype: str) -> None:
    report = parity(dtype=dtype, layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def moonlight(config: dict[str, Any]) -> None:
    """Moonlight-16B-A3B's layout: no low-rank query, 2 shared experts, plain rope."""
    config.update(
        q_lora_rank=None,
        n_shared_experts=2,
        moe_intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )


def test_parity_q_lora_rank_null(tmp_path: Path) -> None:
    checkpoint = variant(tmp_path, moonlight, rebuild=True)
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in n for n in names)
    report = parity(checkpoint)
    assert report.passed, report.summary()


def deepseek_spelling(config: dict[str, Any]) -> None:
    """DeepSeek-V3's own config.json: legacy rope_scaling, top-level rope_theta, no head_dim."""
    for key in ("rope_parameters", "head_dim", "qk_head_dim"):
        config.pop(key)
    config["rope_theta"] = 10000
    config["rope_scaling"] = {
        "type": "yarn",
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    }


def plain_rope(config: dict[str, Any]) -> None:
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}


def half_split_rope(config: dict[str, Any]) -> None:
    config["rope_interleave"] = False


def kimi_routing(config: dict[str, Any]) -> None:
    config.update(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.827)


@pytest.mark.parametrize(
    "edit",
    [deepseek_spelling, plain_rope, half_split_rope, kimi_routing],
    ids=lambda edit: edit.__name__,
)
def test_parity_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit))
    assert report.passed, report.summary()


def test_mtp_layer_loads_past_the_stack_and_its_copies_stay_unread() -> None:
    """The checkpoint's next-n layer loads as the MTP drafter's layer past the stack (HF's class
    builds none; tests/test_deepseek_v3_mtp.py checks its drafts); its copies of the target's
    embedding and head are the only tensors left unused."""
    from resin.runners.torch.model_dir import ModelDirRunner

    with pytest.warns(UserWarning, match="the model does not use"):
        runner = ModelDirRunner.from_model_dir(MODEL_DIR, TINY, name="deepseek_v3")
    n = tiny_config()["num_hidden_layers"]
    assert len(runner.model.layers) == n and runner.model.mtp is not None
    assert sorted(runner.weights.unused) == [
        f"model.layers.{n}.embed_tokens.weight",
        f"model.layers.{n}.shared_head.head.weight",
    ]


def test_latent_is_the_only_cache(blocks: Any) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    config = ModelArgs(**blocks.normalise_config(tiny_config()))
    cache = blocks.layer_cache("full_attention", None, config, 8, 4)
    assert cache.kind == "full" and cache.buffers == {"latent": (1, 16 + 8)}


def test_softmax_scale_is_hf_yarn_mscale(blocks: Any) -> None:
    import transformers

    from resin.runners.torch.model_dir import ModelArgs

    for edit in (lambda c: None, deepseek_spelling, plain_rope):
        config = tiny_config()
        edit(config)
        hf = transformers.DeepseekV3Config(**config)
        attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
        expected = attention(hf, 0).scaling
        ours = blocks.softmax_scale(ModelArgs(**blocks.normalise_config(config)))
        assert ours == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "plant, departs",
    [
        ("no_mscale", "layers.0.self_attn"),
        ("half_split_rope", "layers.0.self_attn"),
        ("no_groups", "layers.1.mlp"),
        ("no_correction_bias", "layers.1.mlp"),
    ],
)
def test_planted_bugs_depart_where_they_are(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, plant: str, departs: str
) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    routing = blocks.noaux_tc_routing
    if plant == "no_mscale":
        monkeypatch.setattr(
            blocks,
            "softmax_scale",
            lambda config: float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5,
        )
    elif plant == "half_split_rope":
        rope = blocks.apply_rope
        monkeypatch.setattr(blocks, "apply_rope", lambda x, c, s, interleave: rope(x, c, s, False))
    elif plant == "no_groups":
        monkeypatch.setattr(
            blocks,
            "noaux_tc_routing",
            lambda x, w, cfg: routing(
                x, w, ModelArgs(**{**vars(cfg), "n_group": 1, "topk_group": 1})
            ),
        )
    else:
        monkeypatch.setattr(
            blocks,
            "noaux_tc_routing",
            lambda x, w, cfg: routing(
                x,
                {**w, "gate.e_score_correction_bias": torch.zeros(w["gate.weight"].shape[0])},
                cfg,
            ),
        )
    report = parity(layers_only=True)
    assert not report.passed
    assert report.stage("layers").first_mismatch["name"] == departs


def test_check_config_refusals(blocks: Any) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    def args(**changes: Any) -> Any:
        return ModelArgs(**blocks.normalise_config({**tiny_config(), **changes}))

    blocks.check_config(args())
    for changes, message in [
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 8}, "groups of >= 2"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type"),
    ]:
        with pytest.raises(ValueError, match=message):
            blocks.check_config(args(**changes))
