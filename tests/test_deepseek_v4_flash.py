"""resin/models/deepseek_v4_flash (DeepSeek-V4, brought up with `resin new-model`) matches HF
transformers layer by layer on its committed tiny checkpoint, and the harness would catch it if
it did not. Fast: the ``layers`` stage only (per-layer diffs + logits, fp32); the engine's greedy
stress stages run in ``resin eval parity deepseek_v4_flash`` (NOTES.md has their results).

- The tiny checkpoint exercises what is V4-specific (resin/models/deepseek_v4_flash/NOTES.md):
  every attention kind (sliding, CSA, HCA) with windows and compression rates a 70-token prompt
  crosses, hash-routed and top-k MoE layers, hyper-connection streams (hc_mult > 1), and the
  parameters HF initialises degenerately randomised (tid2eid, sinks, biases).
- fp32 layers stage: every checkpoint within rounding (< 1e-5 scaled).
- Cache layout: CSA / HCA keep a raw sliding window plus a compressed extra cache (one entry
  per ratio tokens); the sliding layer a window of ``kv``.
- Planted bugs fail where they should: hash routing that ignores ``input_ids`` at layer 0
  ``mlp`` (the first hash_moe layer); the CSA indexer's top-k ignored at layer 1 ``self_attn``
  (the first CSA layer); HCA reading none of its cached compressed entries at layer 2
  ``self_attn``.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module, resolve_model, run_model_parity  # noqa: E402
from resin.evals.parity import run_parity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "deepseek_v4_flash"
TINY = MODEL_DIR / "tiny"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "deepseek_v4_flash")


def _layers_report() -> Any:
    ref = resolve_model(MODEL_DIR)
    return run_parity(
        ref.checkpoint_dir,
        runner_factory=ref.runner_factory("cpu", "float32"),
        runner_name=ref.runner_name,
        checks=("layers",),
    )


def _first_departure() -> str:
    report = _layers_report()
    assert not report.passed
    return report.first_departure["name"]


def test_tiny_checkpoint_is_small_and_exercises_v4() -> None:
    from safetensors.torch import load_file

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert set(config["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(config["mlp_layer_types"]) == {"hash_moe", "moe"}
    assert config["mlp_layer_types"][0] == "hash_moe"
    assert config["hc_mult"] > 1
    # a 70-token prompt crosses the window and closes several windows of each compressor,
    # and the indexer keeps fewer entries than there are (sparsity active)
    rates = config["compress_rates"]
    assert config["sliding_window"] < 70
    assert 70 // rates["compressed_sparse_attention"] > config["index_topk"]
    assert 70 // rates["heavily_compressed_attention"] >= 4
    assert (config["index_n_heads"], config["index_head_dim"]) == (8, 16)  # no top-k ties
    tensors = load_file(str(TINY / "model.safetensors"))
    tid2eid = tensors["model.layers.0.ffn.gate.tid2eid"]
    assert tid2eid.dtype == torch.int64 and len(set(tid2eid.flatten().tolist())) > 1
    assert all(len(set(row)) == len(row) for row in tid2eid.tolist())  # distinct per token
    for name in (
        "model.layers.1.attn.attn_sink",
        "model.layers.1.attn.compressor.ape",
        "model.layers.2.ffn.gate.bias",
        "model.layers.0.hc_attn_base",
    ):
        assert tensors[name].abs().min() > 0, name


def test_layers_stage_passes_in_fp32() -> None:
    report = _layers_report()
    assert report.passed, report.summary()
    assert len(report.layers) == 22 and report.first_departure is None
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
    assert report.stage("logits").metrics["top1_agreement"] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_parity_stage_against_hf_full_forward(dtype: str) -> None:
    """Every stage (layers, logits, page sizes 1/16/64, chunked prefill with 13-token chunks not
    aligned to the ratios, prefix-cache pass, preemption) on the compressed caches, against HF's
    full (no-cache) forward per step (parity.toml: greedy = "full_forward"); the harness also
    checks HF's cached decode against it and notes the result."""
    report = run_model_parity(resolve_model(MODEL_DIR), dtype=dtype)
    assert report.passed, report.summary()
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    (finding,) = report.reference_findings
    assert "argmax_disagreements" in finding and "max_abs_logit_diff" in finding


def test_top3_experts_in_bf16_sum_their_slots_as_transformers(tmp_path: Path) -> None:
    """Three experts a token, bf16: the slots' weighted outputs are summed once in fp32 (what
    transformers' default ``grouped_mm`` experts dispatch does for a causal LM), so the layers
    are bit-exact; adding them one by one in bf16 (the eager loop's order, which top-2 cannot
    tell apart) was an ulp off, and a router near-tie took that to 0.35 (checkpoint fuzzing)."""
    from tests.model_variants import built_checkpoint, model_parity

    config = {**json.loads((TINY / "config.json").read_text()), "num_experts_per_tok": 3}
    path = built_checkpoint(TINY, tmp_path / "top3", config)
    report = model_parity(MODEL_DIR, path, dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0


def test_csa_and_hca_keep_a_raw_window_and_compressed_entries() -> None:
    """Sliding layers: a window of kv. CSA / HCA: a raw window W >= (1 + overlap) * ratio as the
    main cache plus one compressed entry per ratio tokens (K = V entry; CSA + indexer key)."""
    from resin import LayerCacheSpec

    ref = resolve_model(MODEL_DIR)
    runner = ref.runner_factory("cpu", "float32")(ref.checkpoint_dir)
    d, di, f32 = 16, 16, 4
    csa = [
        LayerCacheSpec.sliding_window(8, (d + 4 * d + 4 * di) * f32),
        LayerCacheSpec.compressed(4, (d + di) * f32),
    ]
    hca = [
        LayerCacheSpec.sliding_window(8, 3 * d * f32),
        LayerCacheSpec.compressed(8, d * f32),
    ]
    expected = [LayerCacheSpec.sliding_window(8, d * f32), *csa, *hca, *csa]
    assert [repr(s) for s in runner.cache_spec()] == [repr(s) for s in expected]
    assert all(not layer.extra_caches for layer in runner.model.layers[:1])


def test_parity_catches_hash_routing_that_ignores_input_ids(
    monkeypatch: pytest.MonkeyPatch, blocks: Any
) -> None:
    real = blocks.BLOCKS["DeepseekV4SparseMoeBlock"]

    def by_token_zero(x: Any, w: Any, ctx: Any) -> Any:
        return real(x, w, dataclasses.replace(ctx, input_ids=torch.zeros_like(ctx.input_ids)))

    monkeypatch.setitem(blocks.BLOCKS, "DeepseekV4SparseMoeBlock", by_token_zero)
    assert _first_departure() == "layers.0.mlp"


def test_parity_catches_csa_without_the_indexer_top_k(
    monkeypatch: pytest.MonkeyPatch, blocks: Any
) -> None:
    monkeypatch.setattr(blocks, "_indexer_selection", lambda *args: args[4])  # all visible
    assert _first_departure() == "layers.1.self_attn"


def test_parity_catches_hca_without_compressed_entries(
    monkeypatch: pytest.MonkeyPatch, blocks: Any
) -> None:
    # HCA attends its raw window only: none of its cached compressed entries are read.
    real = blocks._read_entries

    def no_hca(ctx: Any, name: str) -> Any:
        rows = real(ctx, name)
        if ctx.layer_type != blocks.HCA:
            return rows
        return [
            dataclasses.replace(
                r, positions=r.positions[:0], values=r.values[:0], mask=r.mask[:, :0]
            )
            for r in rows
        ]

    monkeypatch.setattr(blocks, "_read_entries", no_hca)
    assert _first_departure() == "layers.2.self_attn"
