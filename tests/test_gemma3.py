"""resin/models/gemma3 (Gemma 3 text, brought up with `resin new-model`) passes the parity
harness on its committed tiny checkpoint, and the harness would catch it if it did not.

- The tiny checkpoint cannot hide Gemma's differences (resin/models/gemma3/NOTES.md): local and
  global rope bases differ, ``query_pre_attn_scalar != head_dim``, soft-capping that the logits
  reach, sliding and full layers with a window narrower than the parity prompts, randomised
  norm weights (they init to zero, hiding ``1 + w``), tied embeddings, ``sqrt(hidden)`` not
  exact in bf16.
- fp32: the layers stage (per-layer diffs + logits) and the engine's greedy stages pass.
- bf16: bit-exact in the layers stage (HF's op order is ported), which the bf16 default
  tolerance (5e-2) would not demand; a tighter bound is asserted here.
- A planted bug — the rotary bases swapped between layer types — fails at layer 0 self_attn.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module, resolve_model, run_model_parity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "gemma3"
TINY = MODEL_DIR / "tiny"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "gemma3")


def test_tiny_checkpoint_is_small_and_cannot_hide_gemma_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["sliding_window"] < 70  # longest parity prompt
    rope = config["rope_parameters"]
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert config["query_pre_attn_scalar"] != config["head_dim"]
    assert config["final_logit_softcapping"] and config["tie_word_embeddings"]
    assert (
        float(torch.tensor(config["hidden_size"] ** 0.5).to(torch.bfloat16))
        != config["hidden_size"] ** 0.5
    )
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert norms and all(float(t.abs().max()) > 0.1 for t in norms)


def test_parity_fp32_layers_and_greedy() -> None:
    report = run_model_parity(resolve_model(MODEL_DIR), dtype="float32")
    assert report.passed, report.summary()
    names = {s.name for s in report.stages}
    assert {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    } <= names
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
    assert not report.stage("layers").metrics["missing"]


def test_parity_bf16_layers_is_tight() -> None:
    ref = resolve_model(MODEL_DIR)
    ref.parity_spec = {
        **ref.parity_spec,
        "stress": {**ref.parity_spec.get("stress", {}), "checks": ["layers"]},
    }
    report = run_model_parity(ref, dtype="bfloat16")
    assert report.passed, report.summary()
    # The Llama-style norm cast, an fp32 embed scale or exact GELU give >= 1.4e-2 here
    # (NOTES.md), inside the 5e-2 default; the faithful port is bit-exact.
    assert report.stage("layers").metrics["max_scaled_diff"] < 2e-3
    assert report.stage("logits").metrics["scaled_diff"] < 2e-3


def test_swapped_rotary_bases_fail_at_self_attn(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    right = blocks.rope_parameters_by_type

    def swapped(config: Any) -> dict[str, dict[str, Any]]:
        params = right(config)
        return {
            "sliding_attention": params["full_attention"],
            "full_attention": params["sliding_attention"],
        }

    monkeypatch.setattr(blocks, "rope_parameters_by_type", swapped)
    ref = resolve_model(MODEL_DIR)
    ref.parity_spec = {
        **ref.parity_spec,
        "stress": {**ref.parity_spec.get("stress", {}), "checks": ["layers"]},
    }
    report = run_model_parity(ref, dtype="float32")
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["module"] == "self_attn", report.summary()
    assert first["layer"] == 0 and first["scaled_diff"] > 0.1


@pytest.mark.parametrize("num_layers", [4, 6, 13, 26, 30])
@pytest.mark.parametrize("pattern", [None, 2])
def test_layer_types_without_a_list_follow_transformers_default_pattern(
    tmp_path: Path, num_layers: int, pattern: int | None
) -> None:
    """A config.json with no ``layer_types``: every 6th layer is full (Gemma3TextConfig's
    default ``sliding_window_pattern``) unless the config gives a pattern, for any depth — the
    record's 26-layer default list cannot be used past its own depth."""
    import transformers

    from resin.runners.torch.model_dir import ModelRecord, layer_kinds, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    for key in ("layer_types", "_sliding_window_pattern"):
        config.pop(key)
    config["num_hidden_layers"] = num_layers
    if pattern is not None:
        config["sliding_window_pattern"] = pattern
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.Gemma3TextConfig.from_dict(config)
    record = ModelRecord.load(MODEL_DIR)
    kinds = layer_kinds(load_model_args(tmp_path, record), record)
    assert [layer_type for layer_type, _, _ in kinds] == list(hf.layer_types)
    assert "full_attention" in hf.layer_types or num_layers < (pattern or 6)
    windows = [window for _, window, _ in kinds]
    assert windows == [
        config["sliding_window"] if t == "sliding_attention" else None for t in hf.layer_types
    ]


def test_bidirectional_attention_is_refused_at_load(tmp_path: Path) -> None:
    """EmbeddingGemma-style ``use_bidirectional_attention``: HF attends to later tokens, which
    these causal blocks do not; refused when the runner is built, naming the field."""
    import shutil

    from resin.registry import ModelRegistry

    changed = tmp_path / "gemma3"
    shutil.copytree(TINY, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(
        json.dumps({**config, "use_bidirectional_attention": True})
    )
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    with pytest.raises(
        ValueError, match="gemma3: use_bidirectional_attention True is not supported"
    ):
        entry.load_runner(changed)
