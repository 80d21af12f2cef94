"""Tiny checkpoints that cannot hide bugs (resin.scaffold.tiny_checkpoint): defaults a runner
could assume are perturbed, routing buffers randomised, thresholds lowered until they bind, and
every change written to CHANGES.md. Source configs are transformers' own (gemma3_text,
deepseek_v4, gpt_oss, qwen3_moe); each tiny checkpoint builds in a few seconds on one core.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.scaffold.tiny_checkpoint import (  # noqa: E402
    CHANGES_FILE,
    SIZE_BUDGET_BYTES,
    make_tiny_checkpoint,
    reinit_routing_buffers,
)


def _make(src: Any, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    tiny = make_tiny_checkpoint(src, tmp_path / "tiny")
    assert sum(f.stat().st_size for f in tiny.path.iterdir()) < SIZE_BUDGET_BYTES
    changes = (tiny.path / CHANGES_FILE).read_text()
    assert all(f"- {line}" in changes for line in tiny.changes)
    return tiny, json.loads((tiny.path / "config.json").read_text())


@torch.no_grad()
def _logits(path: Path, **overrides: Any) -> Any:
    """HF logits of the saved tiny checkpoint, optionally with config fields overridden."""
    config = transformers.AutoConfig.from_pretrained(path, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, attn_implementation="eager"
    ).eval()
    ids = torch.randint(4, 384, (1, 40), generator=torch.Generator().manual_seed(7))
    return model(ids).logits[0]


def test_gemma3_scale_and_rope_bases_are_perturbed(tmp_path: Path) -> None:
    # Gemma 3: query_pre_attn_scalar == head_dim (256) by default; make both rope bases equal
    src = transformers.Gemma3TextConfig(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    )
    tiny, cfg = _make(src, tmp_path)
    # head_dim (16 = hidden / heads in the tiny) is perturbed too: 20, and the scale is neither
    assert cfg["head_dim"] == 20 and cfg["query_pre_attn_scalar"] not in (16, 20, 256)
    thetas = {k: v["rope_theta"] for k, v in cfg["rope_parameters"].items()}
    assert thetas["sliding_attention"] != thetas["full_attention"]
    assert cfg["tie_word_embeddings"] is True  # kept: the real layout
    text = "\n".join(tiny.changes)
    assert "perturbed: query_pre_attn_scalar 16 -> 24" in text
    assert (
        "perturbed: head_dim 16 -> 20" in text
        and "perturbed: rms_norm_eps 1e-06 -> 0.03125" in text
    )
    assert "perturbed: rope_parameters.full_attention.rope_theta 10000 -> 40000" in text
    assert "full_attention" in cfg["layer_types"] and "sliding_attention" in cfg["layer_types"]


def test_deepseek_v4_routing_tables_and_limit(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tiny, cfg = _make(transformers.DeepseekV4Config(), tmp_path)
    weights = load_file(tiny.path / "model.safetensors")
    tables = {k: v for k, v in weights.items() if k.endswith("tid2eid")}
    assert len(tables) == 3  # the three hash_moe layers
    for table in tables.values():
        assert table.min() >= 0 and table.max() < cfg["n_routed_experts"]
        assert len(set(table.flatten().tolist())) > 1
        assert bool((table[:, 0] != table[:, 1]).all())  # distinct experts per token
    biases = [v for k, v in weights.items() if k.endswith("gate.bias")]
    assert biases and all(float(b.abs().max()) > 0 for b in biases)
    assert cfg["swiglu_limit"] < 10.0
    assert cfg["compress_rates"]["heavily_compressed_attention"] <= 8 and cfg["index_topk"] <= 4
    # the lowered limit binds: removing it changes HF's own logits
    assert float((_logits(tiny.path) - _logits(tiny.path, swiglu_limit=1e9)).abs().max()) > 1e-3
    text = "\n".join(tiny.changes)
    assert "buffer: model.layers.0.mlp.gate.tid2eid" in text and "swiglu_limit 10 ->" in text
    # enough rotated dims to tell rope layouts apart
    assert cfg["partial_rotary_factor"] * cfg["head_dim"] >= 8


def test_gpt_oss_swiglu_limit_binds(tmp_path: Path) -> None:
    tiny, cfg = _make(transformers.GptOssConfig(), tmp_path)
    assert cfg["swiglu_limit"] < 7.0
    assert float((_logits(tiny.path) - _logits(tiny.path, swiglu_limit=1e9)).abs().max()) > 1e-3
    assert any(line.startswith("threshold: swiglu_limit 7 ->") for line in tiny.changes)


def test_qwen3_moe_is_seeded_and_shrunk_with_its_eps_trap(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(transformers.Qwen3MoeConfig(), tmp_path / "a")
    b = make_tiny_checkpoint(transformers.Qwen3MoeConfig(), tmp_path / "b")
    assert (a.path / "model.safetensors").read_bytes() == (
        b.path / "model.safetensors"
    ).read_bytes()
    assert a.changes == b.changes and a.changes
    # Shrunk, and the one trap its config has: rms_norm_eps 1e-6 (a runner hard-coding it
    # would pass); its head width is derived (no head_dim field), so nothing to perturb there.
    perturbed = [line for line in a.changes if not line.startswith("shrunk: ")]
    assert [line.split(" (")[0] for line in perturbed] == [
        "perturbed: rms_norm_eps 1e-06 -> 0.03125"
    ], perturbed
    # kept because it moves HF's own logits: undone, they differ
    assert float((_logits(a.path) - _logits(a.path, rms_norm_eps=1e-6)).abs().max()) > 1e-4


def test_an_explicit_head_dim_equal_to_the_derived_one_is_perturbed(tmp_path: Path) -> None:
    tiny, cfg = _make(transformers.Qwen3Config(num_hidden_layers=2), tmp_path)
    assert cfg["head_dim"] == 20 and cfg["hidden_size"] // cfg["num_attention_heads"] == 16
    assert any(line.startswith("perturbed: head_dim 16 -> 20") for line in tiny.changes)
    # MLA's head_dim is the rope part: left alone
    tiny, cfg = _make(transformers.DeepseekV3Config(num_hidden_layers=2), tmp_path / "mla")
    assert not any("head_dim 16 -> 20" in line for line in tiny.changes)


def test_unit_scales_and_a_perturbation_without_effect(tmp_path: Path) -> None:
    tiny, cfg = _make(transformers.GraniteConfig(num_hidden_layers=2), tmp_path / "granite")
    for key in (
        "attention_multiplier",
        "embedding_multiplier",
        "residual_multiplier",
        "logits_scaling",
    ):
        assert cfg[key] != 1.0, key
    # Llama ignores partial_rotary_factor: the perturbation changes nothing, so it is reverted
    tiny, cfg = _make(
        transformers.LlamaConfig(num_hidden_layers=2, partial_rotary_factor=1.0), tmp_path / "llama"
    )
    assert any(line.startswith("not perturbed: partial_rotary_factor") for line in tiny.changes)


def test_constant_buffers_outside_routing_are_reported() -> None:
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_hidden_layers=1,
            vocab_size=384,
        )
    )
    model.model.register_buffer("scale_table", torch.zeros(4))
    model.model.layers[0].mlp.register_buffer("router_bias", torch.zeros(4))
    originals: dict[str, Any] = {}
    lines = reinit_routing_buffers(model, seed=0, originals=originals)
    assert any(line.startswith("kept: buffer model.scale_table") for line in lines)
    assert set(originals) == {"model.layers.0.mlp.router_bias"}
    assert float(model.model.layers[0].mlp.router_bias.abs().max()) > 0
    assert float(model.model.scale_table.abs().max()) == 0


def test_new_model_records_tiny_changes(tmp_path: Path) -> None:
    from resin.scaffold.cli import new_model

    raw = transformers.GptOssConfig(num_hidden_layers=4).to_dict()
    raw["architectures"] = ["GptOssForCausalLM"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    summary = new_model(tmp_path / "src", "oss", out=tmp_path / "oss", tiny=True)
    assert any("swiglu_limit" in line for line in summary["tiny_changes"])
    assert "swiglu_limit" in (tmp_path / "oss" / "tiny" / CHANGES_FILE).read_text()
    notes = (tmp_path / "oss" / "NOTES.md").read_text()
    assert "## Tiny checkpoint: what differs from the source" in notes
    assert summary["tiny_changes"][-1] in notes


def test_shipped_tiny_tokenizer_is_the_fixtures_tokenizer() -> None:
    """resin/scaffold/tiny_tokenizer (package data, for installed wheels) is the tokenizer
    scripts/make_fixtures.py writes into tests/fixtures: the two must not drift."""
    from resin.scaffold.tiny_checkpoint import TINY_TOKENIZER

    fixture = Path(__file__).resolve().parent / "fixtures" / "llama"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (TINY_TOKENIZER / name).read_bytes() == (fixture / name).read_bytes(), name
