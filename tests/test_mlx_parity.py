"""The MLX runner passes the parity harness against HF transformers, and the harness catches
it when it is wrong.

- fp32, default tolerances (scaled error 1e-4): every stage (layers, logits, the six greedy
  stress stages: page sizes 1/16/64, chunked prefill, prefix-cache hits, preemption) on the
  Llama, Qwen3, Qwen3-MoE and Mistral fixtures (Mistral's 32-token window is narrower than the
  longer prompts), and ``resin eval parity gpt_oss --runner mlx`` (the CLI, with gpt_oss's
  parity.toml: sinks, its MoE, alternating 8-token windows).
- bf16 on the same four fixtures and gpt-oss, at :data:`MLX_BF16` (why below); fp16 on Llama
  and gpt-oss at :data:`MLX_FP16`. gpt-oss's router picks the top 2 of 4 experts from bf16
  logits, which tie on the tiny checkpoint (layer 0, token 42 of the longest prompt:
  ``[0.197, -1.23, 0.197, 1.227]``); it passes because the MLX router keeps the expert
  ``torch.topk`` keeps (libstdc++'s selection, not the lowest index: tests/test_mlx_numerics.py)
  and its biased linears and ``alpha * gate`` round where torch's do. With MLX's own tie order,
  or lowest-index-first, layer 0 ``mlp`` departs (scaled 0.15) and log-probs move by 5.4.
- planted bugs: a sliding window ignored and a wrong RoPE base are caught at layer 0
  ``self_attn``.
- captures are numpy arrays, which the harness takes (``as_float_tensor``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from resin.cli import app  # noqa: E402
from resin.evals.parity import Tolerances, run_parity  # noqa: E402
from resin.evals.parity_engine import GREEDY_STAGES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
ARCHS = ("llama", "qwen3", "qwen3_moe", "mistral")
# As tests/test_parity.py: a 1-token prompt, prompts over several 16-token pages, one longer
# than a 64-token page (and than Mistral's 32-token window), a prefix shared in the batch.
QUICK_PROMPTS = [
    [5],
    list(range(3, 12)),
    [(7 * i) % 120 for i in range(20)],
    [(11 * i + 3) % 120 for i in range(66)],
    [(11 * i + 3) % 120 for i in range(32)] + [1, 2, 3, 4, 5],
]
# bf16: the fixtures' logits reach |90|, where one bf16 ulp is 0.5. MLX's bf16 ops round where
# torch's do (a biased linear rounds once, as addmm; a scalar product in fp32), so the Llama and
# Qwen3-MoE hidden states are HF's bit for bit; what is left is a few elements one ulp apart
# where an op's fp32 internals land an fp32 ulp away from torch's (gpt-oss: RMSNorm's mean,
# summed in another order than torch's vectorised CPU kernel, whose order depends on the CPU's
# vector width) and the bf16 rounding follows. One ulp of a logit
# moves a log-prob by up to 0.5 (0.499 measured on Qwen3 and gpt-oss): log-probs within 1.0
# (two ulps). Hidden states and logits keep the bf16 defaults (5e-2 scaled), greedy
# near-ties 0.1.
MLX_BF16 = Tolerances(hidden=5e-2, logits=5e-2, logprobs=1.0, tie_margin=1e-1)
# fp16, the same reason at fp16's resolution: an ulp of a |90| logit is 0.0625; log-probs
# moved by up to 0.094 (Llama, Qwen3-MoE, gpt-oss) against the fp16 default of 0.02: within
# 0.25 (four ulps).
MLX_FP16 = Tolerances(hidden=1e-2, logits=1e-2, logprobs=0.25, tie_margin=2e-2)
STAGES = ["layers", "logits", *GREEDY_STAGES]
GPT_OSS_TINY = REPO / "resin" / "models" / "gpt_oss" / "tiny"


def _mlx(dtype: str = "float32", patch: Any = None) -> Any:
    def factory(model_dir: str) -> Any:
        from resin.runners.mlx import MlxRunner

        runner = MlxRunner.from_pretrained(model_dir, dtype=dtype)
        if patch is not None:
            patch(runner)
        return runner

    return factory


@pytest.mark.parametrize("arch", ARCHS)
def test_every_stage_passes_in_fp32(arch: str) -> None:
    report = run_parity(
        FIXTURES / arch, _mlx(), prompts=QUICK_PROMPTS, max_new_tokens=4, runner_name="mlx"
    )
    assert report.passed, report.summary()
    assert [s.name for s in report.stages] == STAGES
    assert report.stage("layers").metrics["missing"] == []
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5  # fp32 rounding, no more
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    assert report.stage("greedy/preemption").metrics["num_preemptions"] > 0
    if arch == "mistral":
        config = json.loads((FIXTURES / arch / "config.json").read_text())
        assert config["sliding_window"] < max(len(p) for p in QUICK_PROMPTS)


@pytest.mark.parametrize("checkpoint", [*ARCHS, "gpt_oss"])
def test_every_stage_passes_in_bf16(checkpoint: str) -> None:
    report = run_parity(
        GPT_OSS_TINY if checkpoint == "gpt_oss" else FIXTURES / checkpoint,
        _mlx("bfloat16"),
        prompts=QUICK_PROMPTS,
        max_new_tokens=4,
        runner_name="mlx",
        dtype="bfloat16",
        tolerances=MLX_BF16,
    )
    assert report.passed, report.summary()
    assert [s.name for s in report.stages] == STAGES


@pytest.mark.parametrize("checkpoint", [FIXTURES / "llama", GPT_OSS_TINY], ids=["llama", "gpt_oss"])
def test_every_stage_passes_in_fp16(checkpoint: Path) -> None:
    """fp16 keeps gpt-oss's norms in fp32 (its architecture.json); with 10 mantissa bits the
    router picks HF's experts on the tiny checkpoint, so gpt-oss passes here too."""
    report = run_parity(
        checkpoint,
        _mlx("float16"),
        prompts=QUICK_PROMPTS,
        max_new_tokens=4,
        runner_name="mlx",
        dtype="float16",
        tolerances=MLX_FP16,
    )
    assert report.passed, report.summary()
    assert [s.name for s in report.stages] == STAGES


def test_cli_gpt_oss_passes_every_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # `gpt_oss` resolves ./models/gpt_oss and its parity.toml
    out = tmp_path / "parity.json"
    result = CliRunner().invoke(
        app, ["eval", "parity", "gpt_oss", "--runner", "mlx", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["runner"] == "mlx"
    assert [s["name"] for s in report["stages"]] == STAGES
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["greedy/preemption"]["metrics"]["num_preemptions"] > 0
    assert stages["greedy/prefix_cache"]["metrics"]["num_cached_tokens"] > 0


def _ignore_windows(runner: Any) -> None:
    original = runner.bind_cache

    def bind_cache(layout: Any) -> None:
        original(layout)
        runner.group_windows = [None] * len(runner.group_windows)

    runner.bind_cache = bind_cache


def _wrong_rope_base(runner: Any) -> None:
    import mlx.core as mx

    head_dim = runner.model.head_dim
    runner.model.rotary.inv_freq = 1.0 / (1e6 ** (mx.arange(0, head_dim, 2) / head_dim))


@pytest.mark.parametrize("arch,patch", [("mistral", _ignore_windows), ("llama", _wrong_rope_base)])
def test_planted_bugs_are_caught_at_attention(arch: str, patch: Any) -> None:
    report = run_parity(
        FIXTURES / arch, _mlx(patch=patch), prompts=QUICK_PROMPTS, checks=("layers",)
    )
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "self_attn")


def test_captures_are_numpy_arrays_the_harness_compares() -> None:
    """The MLX runner hands parity numpy arrays (torch loaded or not); the harness converts."""
    import numpy as np

    from resin.evals.parity import as_float_tensor
    from resin.evals.parity_engine import runner_capture_prefill
    from resin.runners.mlx import MlxRunner

    runner = MlxRunner.from_pretrained(FIXTURES / "llama")
    vocab = json.loads((FIXTURES / "llama" / "config.json").read_text())["vocab_size"]
    acts, _, _ = runner_capture_prefill(runner, QUICK_PROMPTS[1], vocab)
    assert acts is not None and "layers.0.self_attn" in acts and "logits" in acts
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in acts.values())
    logits = as_float_tensor(acts["logits"])
    assert logits.shape == (len(QUICK_PROMPTS[1]), vocab) and str(logits.dtype) == "torch.float32"
