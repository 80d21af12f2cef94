"""resin/models/gemma2 (Gemma 2 2B / 9B / 27B, brought up with `resin new-model`; Gemma 3's
blocks reused by import) passes the parity harness on its committed tiny checkpoint and on
variants of it, on the parity backend and on the servers' default ``torch`` backend, and the
harness would catch it if it did not.

- The tiny checkpoint cannot hide Gemma 2's differences (resin/models/gemma2/NOTES.md): both
  soft-caps bind (attention 25, final 30), ``query_pre_attn_scalar != head_dim``, sliding and
  full layers with a window narrower than the parity prompts, randomised norm weights (they
  init to zero, hiding ``1 + w``), tied embeddings.
- fp32: every stage, on the reference backend and on both paths of the ``torch`` backend (the
  CPU kernel and the padded batch: a softcap never takes SDPA); bf16: the layers bit-exact.
- A planted bug — no attention soft-cap — fails at layer 0 self_attn.
- Variants (the tiny's weights, another config.json): the hub spelling (no ``layer_types``,
  a top-level ``rope_theta``, here 5e4) and both soft-caps null; without ``layer_types`` the
  layers alternate sliding / full at any depth, as ``Gemma2Config`` derives them.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import dataclasses
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
MODEL_DIR = REPO / "resin" / "models" / "gemma2"
TINY = MODEL_DIR / "tiny"
parity = partial(model_parity, MODEL_DIR)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "gemma2")


def hub_spelling(config: dict[str, Any]) -> None:
    for key in ("layer_types", "rope_parameters", "use_bidirectional_attention"):
        config.pop(key)
    config["rope_theta"] = 50000.0


def no_softcaps(config: dict[str, Any]) -> None:
    config["attn_logit_softcapping"] = None
    config["final_logit_softcapping"] = None


def test_tiny_checkpoint_is_small_and_cannot_hide_gemma2_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] < 70  # longest parity prompt
    assert config["query_pre_attn_scalar"] != config["head_dim"]
    assert config["attn_logit_softcapping"] and config["final_logit_softcapping"]
    assert config["tie_word_embeddings"]
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert norms and all(float(t.abs().max()) > 0.1 for t in norms)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    } <= {s.name for s in report.stages}
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
    assert not report.stage("layers").metrics["missing"]


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def test_no_attention_softcap_fails_at_self_attn(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def uncapped(x: Any, w: Any, ctx: Any) -> Any:
        attend = ctx.require_attention()

        def attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
            return attend(q, k, v, **{**options, "softcap": None})

        return blocks.gemma2_attention(x, w, dataclasses.replace(ctx, attention=attention))

    monkeypatch.setitem(blocks.BLOCKS, "Gemma2Attention", uncapped)
    report = parity(layers_only=True)
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["module"] == "self_attn", report.summary()
    assert first["layer"] == 0 and first["scaled_diff"] > 0.01


@pytest.mark.parametrize("edit", [hub_spelling, no_softcaps], ids=lambda f: f.__name__)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = tmp_path / "gemma2"
    shutil.copytree(TINY, path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize("num_layers", [4, 26, 42, 46])
def test_layer_types_without_a_list_follow_transformers(
    blocks: Any, tmp_path: Path, num_layers: int
) -> None:
    """A hub config.json (no ``layer_types``) at the 2B / 9B / 27B depths: even layers
    sliding, odd full, as Gemma2Config derives them; the record's 26-entry default list fits
    the 2B only."""
    import transformers

    from resin.runners.torch.model_dir import ModelArgs, ModelRecord, layer_kinds, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    hub_spelling(config)
    config["num_hidden_layers"] = num_layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.Gemma2Config.from_dict(config)
    record = ModelRecord.load(MODEL_DIR)
    args = ModelArgs(**blocks.normalise_config(load_model_args(tmp_path, record).to_dict()))
    kinds = layer_kinds(args, record)
    assert [layer_type for layer_type, _, _ in kinds] == list(hf.layer_types)
    assert [window for _, window, _ in kinds] == [
        config["sliding_window"] if t == "sliding_attention" else None for t in hf.layer_types
    ]
