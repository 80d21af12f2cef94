"""resin/models/qwen3_5_moe (Qwen3.5-MoE: Qwen3.5's hybrid with Qwen3-Next's MoE + shared expert in
every layer, shipped as Qwen3_5MoeForConditionalGeneration; every block imported from
resin/models/qwen3_5 and resin/models/qwen3_next) passes the parity harness on its committed
tiny checkpoint and on variants, and the harness would catch a router that does not renormalise.

- The tiny is a wrapper checkpoint as the hub ships them (``model.language_model.*`` with
  experts one by one, ``model.visual.*``), untied, 4 experts top-2 with a shared expert.
- fp32 every stage; bf16 layers bit-exact; fp16 layers within the measured tolerance.
- ``Qwen3_5MoeTopKRouter`` always renormalises the top-k weights (its config has no
  ``norm_topk_prob``; HF ignores one in config.json): a router that does not fails at layer 0
  ``mlp``, and a config.json saying ``norm_topk_prob: false`` still matches HF.
- Other widths (key head dim != value head dim, 3 value heads per key head, expert and shared
  widths apart, tied embeddings) pass: the shape rules of architecture.json accept them.

- Served (the registry picks this directory for the tiny): a chat request through the tiny's
  ChatML template answers as ``LLM.chat``; hub ``mtp.*`` tensors are left unused.
torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from tests.test_qwen3_5 import (  # noqa: E402
    check_mtp_head_left_unused,
    check_served_chat,
    fresh_wrapper_checkpoint,
    parity,
)

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "qwen3_5_moe"
TINY = MODEL_DIR / "tiny"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tiny_is_a_wrapper_moe_checkpoint() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["num_experts_per_tok"] < text["num_experts"]
    assert not config["tie_word_embeddings"]
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" in tensors and any(n.startswith("model.visual.") for n in tensors)
    prefix = "model.language_model.layers.0.mlp."
    assert {f"{prefix}experts.3.down_proj.weight", f"{prefix}shared_expert_gate.weight"} <= set(
        tensors
    )


def test_parity_fp32_every_stage() -> None:
    report = parity(model_dir=MODEL_DIR)
    assert report.passed, report.summary()
    layers = report.stage("layers")
    assert not layers.metrics["missing"] and layers.metrics["num_checkpoints"] == 22
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    assert report.stage("greedy/preemption").metrics["num_preemptions"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parity_half_layers(dtype: str) -> None:
    report = parity(dtype=dtype, layers_only=True, model_dir=MODEL_DIR)
    assert report.passed, report.summary()
    if dtype == "bfloat16":
        assert report.stage("layers").metrics["max_scaled_diff"] == 0.0


def test_router_without_renormalisation_fails_at_layer0_mlp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = import_model_module(MODEL_DIR, "blocks", "qwen3_5_moe")
    right = blocks.normalise_config
    monkeypatch.setattr(
        blocks, "normalise_config", lambda values: {**right(values), "norm_topk_prob": False}
    )
    report = parity(layers_only=True, model_dir=MODEL_DIR)
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "mlp"), report.summary()


def test_norm_topk_prob_false_in_config_json_is_ignored_as_hf_does(tmp_path: Path) -> None:
    path = tmp_path / "moe"
    shutil.copytree(TINY, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = False
    (path / "config.json").write_text(json.dumps(config))
    report = parity(path, layers_only=True, model_dir=MODEL_DIR)
    assert report.passed, report.summary()


def test_parity_on_other_widths(tmp_path: Path) -> None:
    path = fresh_wrapper_checkpoint(
        tmp_path / "moe",
        tiny=TINY,
        tied=True,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_value_heads=6,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    )
    report = parity(path, layers_only=True, model_dir=MODEL_DIR)
    assert report.passed, report.summary()


def test_blocks_are_imported_not_copied() -> None:
    blocks: Any = import_model_module(MODEL_DIR, "blocks", "qwen3_5_moe")
    from resin.models.qwen3_5 import blocks as dense
    from resin.models.qwen3_next import blocks as qwen3_next

    assert blocks.BLOCKS["Qwen3_5MoeGatedDeltaNet"] is dense.qwen3_5_gated_delta_net
    assert blocks.BLOCKS["Qwen3_5MoeSparseMoeBlock"] is qwen3_next.qwen3_next_sparse_moe_block


def test_a_checkpoint_with_the_mtp_head_loads_it_unused(tmp_path: Path) -> None:
    check_mtp_head_left_unused(TINY, tmp_path)


def test_served_chat_renders_the_template_and_answers_as_llm_chat() -> None:
    check_served_chat(MODEL_DIR)
