"""The parity harness (``resin.evals.parity``, ``resin eval parity``): passes on correct
runners, and catches deliberately broken ones, naming the right layer / sub-module or stage.

Checkpoints are tiny random HF models built here with ``save_pretrained`` (seeded; weights
scaled up so greedy choices are not near ties). Broken runners are the torch reference
runner with one bug planted: a wrong RoPE theta, two RMSNorm weights swapped, an off-by-one
in the page table, wrong MoE routing. Also runs the harness on ``tests/fixtures/<arch>/``
checkpoints when they exist.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.evals.parity import (  # noqa: E402
    ParityReport,
    StageResult,
    Tolerances,
    compare_layers,
    run_parity,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Shorter than the harness defaults (keeps the suite fast) but still: a 1-token prompt, prompts
# spanning several 16-token pages, one longer than a 64-token page, and a shared prefix.
QUICK_PROMPTS = [
    [5],
    list(range(3, 12)),
    [(7 * i) % 120 for i in range(20)],
    [(11 * i + 3) % 120 for i in range(66)],
    [(11 * i + 3) % 120 for i in range(32)] + [1, 2, 3, 4, 5],
]


def _save_tiny(kind: str, out: Path) -> Path:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_theta=10000.0)
        )
    else:
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **common,
                head_dim=8,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
            )
        )
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
            else:
                param.uniform_(0.5, 1.5)  # norms: distinct, far from 1
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_qwen3_moe"))


def _torch_runner(model_dir: str) -> Any:
    from resin.runners.torch import TorchRunner

    return TorchRunner.from_pretrained(model_dir, device="cpu", dtype=torch.float32)


def _patched(patch: Callable[[Any], None]) -> Callable[[str], Any]:
    def factory(model_dir: str) -> Any:
        runner = _torch_runner(model_dir)
        patch(runner)
        return runner

    return factory


def _shifted_page_table_runner(decode_only: bool) -> Callable[[str], Any]:
    """The reference runner reading K/V through ``kv_indices`` shifted by one entry (every row
    reads its neighbour's pages); with ``decode_only``, only decode rows do. Planted in an
    attention backend, through the seam models use."""
    from resin.runners.torch import TorchRunner
    from resin.runners.torch.attention import ReferenceBackend
    from resin.runners.torch.layers import build_sequence_views

    class ShiftedPageTable(ReferenceBackend):
        def begin_step(
            self, step: Any, group_windows: Any, group_page_entries: Any, group_ratios: Any = None
        ) -> None:
            plan = step.plan
            self.views = []
            for group, window in enumerate(group_windows):
                indices = np.asarray(plan.kv_indices[group], dtype=np.uint32)
                end = (
                    int(plan.kv_indptr[group][plan.num_decode_sequences])
                    if decode_only
                    else len(indices)
                )
                shifted = indices.copy()
                shifted[:end] = np.append(indices, np.uint32(0))[1 : end + 1]
                self.views.append(
                    build_sequence_views(
                        plan.query_indptr,
                        plan.seq_lens,
                        plan.kv_indptr[group],
                        shifted,
                        step.positions,
                        group_page_entries[group],
                        window,
                        step.device,
                    )
                )

    return lambda model_dir: TorchRunner.from_pretrained(
        model_dir, device="cpu", dtype=torch.float32, attention_backend=ShiftedPageTable()
    )


def _wrong_rope_theta(runner: Any) -> None:
    head_dim = runner.model.head_dim
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    runner.model.rotary["*"].inv_freq = 1.0 / (1e6**exponents)  # the checkpoint says 1e4


def _swap_layer1_norms(runner: Any) -> None:
    weights = runner.child_weights[1]
    weights["input_layernorm"], weights["post_attention_layernorm"] = (
        weights["post_attention_layernorm"],
        weights["input_layernorm"],
    )


def _moe_patch(field: str, value: Any) -> Callable[[Any], None]:
    """Route with one setting wrong: ``norm_topk_prob`` or ``num_experts_per_tok``."""

    def patch(runner: Any) -> None:
        from resin.runners.torch.blocks import topk_moe_block

        settings = {"norm_topk_prob": True, "num_experts_per_tok": 2, field: value}
        wrong = topk_moe_block(
            renormalise=settings["norm_topk_prob"],
            num_experts_per_tok=settings["num_experts_per_tok"],
        )
        for layer in runner.model.layers:
            if "gate.weight" in runner.child_weights[layer.index]["mlp"]:
                layer.children["mlp"] = wrong

    return patch


# -- report logic, no model ---------------------------------------------------------------


def test_compare_layers_names_first_departure_and_report_serialises() -> None:
    hf = {
        name: torch.ones(3, 4)
        for name in [
            "embed_tokens",
            "layers.0.input_layernorm",
            "layers.0.self_attn",
            "layers.0.post_attention_layernorm",
            "layers.0.mlp",
            "layers.0",
            "norm",
        ]
    }
    runner = {k: v.clone() for k, v in hf.items()}
    runner["layers.0.self_attn"] = runner["layers.0.self_attn"] + 1e-3
    runner["layers.0.mlp"] = runner["layers.0.mlp"] * 2
    rows, stage = compare_layers(hf, runner, 1, Tolerances())
    assert not stage.passed and stage.first_mismatch is not None
    assert (stage.first_mismatch["layer"], stage.first_mismatch["module"]) == (0, "self_attn")
    assert [r["passed"] for r in rows] == [True, True, False, True, False, True, True]
    report = ParityReport(
        "m",
        "fake",
        "float32",
        Tolerances(),
        rows,
        [stage, StageResult("greedy/page_size=1", True, "ok")],
    )
    data = json.loads(report.to_json())
    assert data["passed"] is False and data["first_departure"]["name"] == "layers.0.self_attn"
    assert "FAIL" in report.summary() and "layer 0 self_attn" in report.summary()
    # fp32 rounding on large activations is not a departure (error is scaled by magnitude)
    big = {k: v * 1e4 for k, v in hf.items()}
    _, ok = compare_layers(big, {k: v + 1e-2 for k, v in big.items()}, 1, Tolerances())
    assert ok.passed


# -- correct runners pass ------------------------------------------------------------------


def test_harness_passes_on_tiny_llama(llama_dir: Path) -> None:
    report = run_parity(llama_dir, _torch_runner)
    assert report.passed, report.summary()
    names = [s.name for s in report.stages]
    assert names == [
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/page_size=16",
        "greedy/page_size=64",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    ]
    assert len(report.layers) == 1 + 2 * 5 + 1
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    assert report.stage("greedy/preemption").metrics["num_preemptions"] > 0
    assert report.stage("logits").metrics["top1_agreement"] == 1.0


def test_cli_writes_json_and_exits_zero(llama_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from resin.evals.cli import eval_app

    out = tmp_path / "parity.json"
    result = CliRunner().invoke(
        eval_app, ["parity", str(llama_dir), "--json", str(out), "--max-new-tokens", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "parity PASS" in result.output
    assert json.loads(out.read_text())["passed"] is True
    bad = CliRunner().invoke(eval_app, ["parity", str(tmp_path)])
    assert bad.exit_code == 2


def test_cli_exits_one_on_a_parity_failure(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from resin.evals import cli

    monkeypatch.setattr(
        cli,
        "_runner_factory",
        lambda runner, dtype, device, backend=None: _patched(_swap_layer1_norms),
    )
    out = tmp_path / "parity.json"
    result = CliRunner().invoke(
        cli.eval_app, ["parity", str(llama_dir), "--json", str(out), "--max-new-tokens", "4"]
    )
    assert result.exit_code == 1, result.output
    assert "parity FAIL" in result.output and "layer 1 input_layernorm" in result.output
    data = json.loads(out.read_text())
    assert data["passed"] is False and data["first_departure"]["name"] == "layers.1.input_layernorm"


def test_importing_the_harness_loads_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, resin.evals, resin.evals.cli, resin.evals.parity; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "arch", sorted(p.name for p in FIXTURES.glob("*") if (p / "config.json").is_file())
)
def test_harness_passes_on_fixture(arch: str) -> None:
    report = run_parity(FIXTURES / arch, _torch_runner, prompts=QUICK_PROMPTS, max_new_tokens=4)
    assert report.passed, report.summary()


# -- broken runners are caught and localised -------------------------------------------------


def test_catches_wrong_rope_theta(llama_dir: Path) -> None:
    report = run_parity(llama_dir, _patched(_wrong_rope_theta), checks=("layers",))
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "self_attn")
    assert not report.stage("logits").passed


def test_catches_swapped_norms(llama_dir: Path) -> None:
    report = run_parity(llama_dir, _patched(_swap_layer1_norms), checks=("layers",))
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (1, "input_layernorm")
    assert all(r["passed"] for r in report.layers if r["layer"] == 0)  # layer 0 is fine


def test_catches_page_table_off_by_one(llama_dir: Path) -> None:
    report = run_parity(
        llama_dir,
        _shifted_page_table_runner(decode_only=False),
        prompts=QUICK_PROMPTS,
        max_new_tokens=4,
    )
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "self_attn")
    assert not report.stage("greedy/page_size=16").passed


def test_catches_decode_only_page_table_bug_in_engine_stages(llama_dir: Path) -> None:
    """A bug the one-prefill stages cannot see is caught by the engine stages, at the first
    token a decode-shaped row produced (output position >= 1, or 0 for a 1-token prompt,
    whose prefill row is decode-shaped), with the request named."""
    report = run_parity(
        llama_dir,
        _shifted_page_table_runner(decode_only=True),
        prompts=QUICK_PROMPTS,
        max_new_tokens=4,
    )
    assert report.stage("layers").passed and report.stage("logits").passed
    assert not report.passed
    stage = report.stage("greedy/page_size=16")
    assert not stage.passed and stage.first_mismatch is not None
    mismatch = stage.first_mismatch
    assert mismatch["position"] >= 1 or mismatch["prompt_len"] == 1
    assert {"request", "position", "expected", "got"} <= set(stage.first_mismatch)


def test_harness_passes_on_tiny_moe(moe_dir: Path) -> None:
    report = run_parity(moe_dir, _torch_runner, prompts=QUICK_PROMPTS, max_new_tokens=4)
    assert report.passed, report.summary()


@pytest.mark.parametrize("field,value", [("norm_topk_prob", False), ("num_experts_per_tok", 1)])
def test_catches_wrong_moe_routing(moe_dir: Path, field: str, value: Any) -> None:
    report = run_parity(moe_dir, _patched(_moe_patch(field, value)), checks=("layers",))
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "mlp")
    mismatch = report.stage("layers").first_mismatch
    assert mismatch is not None and mismatch["module"] == "mlp"


def test_fp32_log_probs_may_move_as_far_as_their_logits_do() -> None:
    """At logits of ~130, a logits difference within the fp32 limit (1.2e-5 scaled: HF's
    chunked gated-delta rule against the recurrent one, a Qwen3-Next checkpoint) moves the
    log-probs by ~3e-3, past the fixed 1e-3: the logits' limit judges that part. A logit moved
    far at small logits still fails (the bf16 test below)."""
    from resin.evals.parity import Tolerances, compare_logits

    gen = torch.Generator().manual_seed(0)
    hf = torch.randn(4, 64, generator=gen) * 30
    hf[:, 7] = 130.0
    noise = torch.sign(torch.randn(4, 64, generator=gen)) * 1.2e-5 * 130
    stage = compare_logits(hf, hf + noise, None, None, Tolerances.for_dtype("float32"))
    assert stage.passed, stage
    assert stage.metrics["topk_logprob_max_diff"] > 1e-3  # the fixed limit alone would fail
    # bf16's logits limit is loose (0.05 scaled): no such allowance there. A logit 1.9 off
    # at 40 (~8 spacings) moves a log-prob by 1.9, past the floor of 1.25, and fails.
    hf = torch.full((1, 64), -5.0)
    hf[0, 0], hf[0, 1] = 40.0, 30.0
    got = hf.clone()
    got[0, 1] += 1.9
    assert not compare_logits(hf, got, None, None, Tolerances.for_dtype("bfloat16")).passed


def test_low_precision_limits_follow_the_logits_magnitude() -> None:
    """In bf16 a logit of 40 is one spacing (0.25) from its neighbours: a one-spacing
    difference there is within the log-prob limit and makes a top-1 flip a near-tie; a larger
    move at logits of magnitude 5 is not, and float32 keeps its fixed limits."""
    from resin.evals.parity import Tolerances, compare_logits
    from resin.evals.parity_engine import GreedyReference

    hf = torch.zeros(2, 16)
    hf[0, 3], hf[0, 5] = 40.0, 39.875  # a gap of half a bf16 spacing at 40
    hf[1, 3], hf[1, 5] = 5.0, 4.0
    got = hf.clone()
    got[0, 5] += 0.25  # one spacing: the top-1 flips and its log-prob moves ~0.25
    bf16 = Tolerances.for_dtype("bfloat16")
    assert bf16.logprob_limit(40.0) == pytest.approx(1.25) and bf16.logprob_limit(5.0) == 0.15625
    assert compare_logits(hf, got, None, None, bf16).passed
    wrong = hf.clone()
    wrong[1, 5] -= 1.0  # the second logit: within the scaled check (1 / 40), past the limit at 5
    assert not compare_logits(hf, wrong, None, None, bf16).passed
    assert not compare_logits(hf, got, None, None, Tolerances.for_dtype("float32")).passed
    ref = GreedyReference([[1]], [[3, 3]], [[0.125, 0.125]], 2, "cached", [[1.25, 0.0]])
    assert ref.near_tie(0, 0, 0.1) and not ref.near_tie(0, 1, 0.1)
    assert GreedyReference([[1]], [[3]], [[0.05]], 1).near_tie(0, 0, 0.1)  # no floors
