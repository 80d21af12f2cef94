"""The perf harness (``resin bench``): shapes, the roofline cost model, the regression rule, the
command end to end on ``tests/fixtures/llama``, a deliberately slowed runner caught against a
baseline, and the commands of ``skills/optimize-perf/SKILL.md`` run as written.

Timing tests never assert on absolute times. The slowed runner is 8x slower on exactly the
decode steps with >= 8 sequences (it sleeps 7x the measured forward) and the runs compare with
a 150% threshold and one torch thread: on the shared 2-core machine whole runs drift by up to
~1.6x within minutes (other tenants), so a tighter threshold would flag clean reruns, while 8x
stays far above it. The 5% default rule itself is tested on synthetic reports.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resin.evals.perf_compare import compare
from resin.evals.perf_shapes import Shape, load_perf_spec, parse_shapes
from resin.evals.roofline import step_cost
from resin.loading import load_model_config

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "tests" / "fixtures" / "llama"
SKILL = REPO / "skills" / "optimize-perf" / "SKILL.md"
SHAPES = "decode:1,8,16@16 prefill:16 e2e:4@16+4"
SLOWED = ["decode:8@16", "decode:16@16"]  # decode steps of >= 8 sequences
# A slowed forward sleeps this long on top of its own time (~3 ms for these shapes: >10x).
# A constant, not a multiple of the forward's time: a multiple also multiplied the machine's
# hiccups, and in one CI run a slowed shape's p10-p90 spread (30-113 ms) swallowed the
# slowdown under the noise rule.
SLOW_DELAY_S = 0.04
TEST_THRESHOLD = "1.5"  # regressed = more than 2.5x slower (and beyond the measured noise)


# -- shapes and perf.toml ------------------------------------------------------------------


def test_parse_shapes_ids_round_trip() -> None:
    shapes = parse_shapes("decode:1,8@128,512 prefill:64 e2e:2@16+4 decode:1@128")
    assert [s.id for s in shapes] == [
        "decode:1@128",
        "decode:1@512",
        "decode:8@128",
        "decode:8@512",
        "prefill:64",
        "e2e:2@16+4",
    ]
    assert parse_shapes(" ".join(s.id for s in shapes)) == shapes
    assert shapes[-1] == Shape("e2e", batch_size=2, context_len=16, num_output_tokens=4)


@pytest.mark.parametrize(
    "bad", ["decode:8", "decode:0@16", "prefill:16@4", "warp:1@2", "e2e:2@16", "decode:a@16", ""]
)
def test_parse_shapes_rejects_bad_specs(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_shapes(bad)


def test_perf_toml(tmp_path: Path) -> None:
    (tmp_path / "perf.toml").write_text(
        'shapes = "decode:2@8 prefill:8"\nrepeats = 3\nthreshold = 0.1\n'
    )
    spec = load_perf_spec(tmp_path)
    assert [s.id for s in spec.shapes] == ["decode:2@8", "prefill:8"]
    assert (spec.repeats, spec.threshold, spec.warmup) == (3, 0.1, None)
    with pytest.raises(ValueError, match="unknown key"):
        load_perf_spec({"shape": "decode:1@8"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['batch_size'\] in \[decode\]"):
        load_perf_spec({"decode": {"batch_size": [1], "context_lens": [8]}})
    with pytest.raises(ValueError, match="chunk_sizes"):
        load_perf_spec({"prefill": {"chunk_sizes": []}})
    assert load_perf_spec(tmp_path / "absent").shapes == []


def test_perf_toml_tables(tmp_path: Path) -> None:
    """The table layout ``resin new-model`` renders: [reference], [decode], [prefill], [model]."""
    (tmp_path / "perf.toml").write_text(
        'shapes = "e2e:2@8+4"\n[reference]\ncheckpoint = "ckpt"\ndtype = "bfloat16"\n'
        'device = "cuda"\n[decode]\nbatch_sizes = [1, 4]\ncontext_lens = [16]\n'
        "[prefill]\nchunk_sizes = [32]\n[model]\nnum_layers = 2\nhidden_size = 64\n"
    )
    spec = load_perf_spec(tmp_path / "perf.toml")
    assert [s.id for s in spec.shapes] == ["e2e:2@8+4", "decode:1@16", "decode:4@16", "prefill:32"]
    assert (spec.dtype, spec.device, spec.checkpoint) == ("bfloat16", "cuda", tmp_path / "ckpt")


# -- the cost model ------------------------------------------------------------------------


def test_step_cost_decode_by_hand() -> None:
    c = load_model_config(LLAMA)  # h 64, I 128, 4 layers, 4 q / 2 kv heads of 16, vocab 384
    cost = step_cost(c, np.ones(8), np.full(8, 128), num_sampled=8, dtype_bytes=4)
    params_per_layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    assert cost.matmul_flops == 2 * 8 * 4 * params_per_layer + 2 * 8 * 64 * 384
    assert cost.attention_flops == 4 * 4 * 16 * (8 * 129) * 4  # each row attends 129 keys
    kv_token = 2 * 2 * 16 * 4
    assert cost.kv_bytes == 4 * (8 * 129 + 8) * kv_token  # read context, write 8
    assert cost.weight_bytes == 4 * (4 * (params_per_layer + 2 * 64) + 64 * 384 + 64 + 8 * 64)


def test_step_cost_sliding_window_and_moe() -> None:
    mistral = load_model_config(REPO / "tests" / "fixtures" / "mistral")  # window 32
    assert mistral.sliding_window_tokens == 32
    cost = step_cost(mistral, np.array([40]), np.array([0]), num_sampled=1, dtype_bytes=2)
    pairs = 32 * 33 // 2 + 8 * 32  # keys attended by positions 0..39, window 32
    assert cost.attention_flops == 4 * 4 * 16 * pairs * 3
    moe = load_model_config(REPO / "tests" / "fixtures" / "qwen3_moe")
    assert moe.moe is not None
    one = step_cost(moe, np.ones(1), np.zeros(1), 1, 2)
    many = step_cost(moe, np.ones(4096), np.zeros(4096), 1, 2)
    m, h = moe.moe, moe.hidden_size
    expert_bytes = 3 * h * m.moe_intermediate_size * 2 * len(m.moe_layer_indices)
    # One token reads exactly top_k experts per MoE layer; 4096 tokens read all of them.
    assert many.weight_bytes - one.weight_bytes == pytest.approx(
        (m.num_experts - m.num_experts_per_tok) * expert_bytes + 4095 * h * 2, rel=1e-6
    )


def test_generic_dims_match_the_parsed_config(tmp_path: Path) -> None:
    """For an architecture resin.loading does not parse, the roofline reads the common
    config.json keys; on supported checkpoints that reading gives the same cost."""
    from resin.evals.roofline import generic_dims, load_dims

    queries, contexts = np.array([1, 1, 7]), np.array([40, 3, 0])
    for name in ("llama", "qwen3_moe", "mistral"):
        raw = json.loads((REPO / "tests" / "fixtures" / name / "config.json").read_text())
        parsed = load_model_config(REPO / "tests" / "fixtures" / name)
        assert step_cost(generic_dims(raw), queries, contexts, 3, 2) == step_cost(
            parsed, queries, contexts, 3, 2
        ), name
    raw = json.loads((LLAMA / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["FancyLM"]}))
    dims, note = load_dims(tmp_path)
    assert note is not None and "FancyLM is not parsed by resin.loading" in note
    assert dims.num_hidden_layers == 4 and dims.head_dim == 16
    assert load_dims(LLAMA)[1] is None


# -- the regression rule -------------------------------------------------------------------


def _report(times: dict[str, tuple[float, float]], **top: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "device": "cpu",
        "dtype": "float32",
        **top,
        "shapes": [
            {"id": i, "time": {"median_s": m, "spread_s": s}} for i, (m, s) in times.items()
        ],
    }


def test_compare_needs_threshold_and_noise() -> None:
    base = _report(
        {"a": (1.0, 0.01), "b": (1.0, 0.01), "c": (1.0, 0.2), "d": (1.0, 0.01), "gone": (1.0, 0.0)}
    )
    new = _report(
        {
            "a": (1.04, 0.01),
            "b": (1.08, 0.01),
            "c": (1.3, 0.2),
            "d": (0.5, 0.01),
            "new": (1.0, 0.0),
        },
        dtype="bfloat16",
    )
    result = compare(new, base)  # default threshold 5%
    # a: within 5%; b: 8% slower, beyond noise; c: 30% slower but inside the 0.4 s noise band.
    assert result.regressed == ["b"] and result.improved == ["d"] and not result.passed
    assert result.missing_in_baseline == ["new"] and result.missing_in_new == ["gone"]
    assert any("dtype differs" in w for w in result.warnings)
    assert "REGRESSED 1 shape(s): b x1.08" in result.summary()
    assert compare(new, base, threshold=0.1).regressed == []


# -- the command ---------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``resin ...`` in-process (so a test can monkeypatch the runner); restores torch's
    thread count, which ``--num-threads`` changes."""
    torch = pytest.importorskip("torch")
    from typer.testing import CliRunner

    from resin.cli import app

    threads = torch.get_num_threads()
    monkeypatch.chdir(REPO)

    def run(*args: str) -> Any:
        return CliRunner().invoke(app, list(args))

    yield run
    torch.set_num_threads(threads)


def _bench(cli: Any, out: Path, *extra: str) -> tuple[Any, dict[str, Any]]:
    result = cli(
        "bench",
        str(LLAMA),
        "--shapes",
        SHAPES,
        "--repeats",
        "12",
        "--warmup",
        "2",
        "--num-threads",
        "1",
        "--out",
        str(out),
        *extra,
    )
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return result, report


def test_bench_writes_report(cli: Any, tmp_path: Path) -> None:
    result, report = _bench(cli, tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "r").iterdir()} == {
        "report.json",
        "report.md",
        "report.png",
    }
    assert (tmp_path / "r" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert [s["id"] for s in report["shapes"]] == [s.id for s in parse_shapes(SHAPES)]
    assert report["model"] == "llama" and report["device"] == "cpu" and report["comparison"] is None
    assert report["calibration"]["peak_flops_per_s"] > 0 < report["calibration"]["peak_bytes_per_s"]
    for shape in report["shapes"]:
        t = shape["time"]
        assert t["num_samples"] == 12 and len(shape["samples_s"]) == 12
        assert 0 < t["min_s"] <= t["p10_s"] <= t["median_s"] <= t["p90_s"] <= t["max_s"]
        assert 0 <= shape["engine_overhead_frac"] < 1 and shape["tokens_per_s"] > 0
        assert shape["flops"] > 0 and shape["bytes"] > 0 and shape["roofline_pct"] > 0
    decode8 = next(s for s in report["shapes"] if s["id"] == "decode:8@16")
    assert decode8["num_tokens"] == 8 and decode8["mean_context_len"] >= 16
    e2e = next(s for s in report["shapes"] if s["id"] == "e2e:4@16+4")
    assert e2e["num_generated"] == 16 and e2e["num_steps_per_sample"] >= 4
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| decode:16@16 |" in md and "result: ok" in result.output
    assert "decode:1@16" in result.output.splitlines()[2]


def test_bench_reports_speculative_acceptance(cli: Any, tmp_path: Path) -> None:
    """--speculative-method: e2e shapes carry the engine's draft counters for one run, the mean
    acceptance length (1 + accepted / verify rows) and tokens per step; off, none."""
    result = cli(
        "bench", str(LLAMA), "--shapes", "e2e:2@24+12 decode:2@16", "--repeats", "2",
        "--warmup", "0", "--num-threads", "1", "--out", str(tmp_path / "s"),
        "--speculative-method", "ngram", "--num-speculative-tokens", "3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert report["settings"]["speculative_method"] == "ngram"
    assert "--speculative-method ngram --num-speculative-tokens 3" in report["command"]
    e2e, decode = report["shapes"]
    spec = e2e["speculative"]
    assert decode["speculative"] is None
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    assert spec["tokens_per_step"] == e2e["num_generated"] / e2e["num_steps_per_sample"]
    assert "mean acceptance length" in result.output
    result = cli("bench", str(LLAMA), "--speculative-method", "eagle", "--out", str(tmp_path))
    assert result.exit_code == 2 and "use ngram or mtp" in result.output


def test_bench_catches_injected_slowdown(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from resin.runners.torch import TorchRunner

    result, _ = _bench(cli, tmp_path / "base")
    assert result.exit_code == 0, result.output
    baseline = str(tmp_path / "base" / "report.json")

    original = TorchRunner.forward

    def slow_forward(self: Any, plan: Any) -> Any:
        output = original(self, plan)
        if plan.num_decode_sequences >= 8:  # slower decode steps of >= 8 sequences
            time.sleep(SLOW_DELAY_S)
        return output

    monkeypatch.setattr(TorchRunner, "forward", slow_forward)
    result, report = _bench(
        cli, tmp_path / "slow", "--baseline", baseline, "--threshold", TEST_THRESHOLD
    )
    assert result.exit_code == 1, result.output
    assert report["comparison"]["regressed"] == SLOWED, result.output
    assert f"REGRESSED 2 shape(s): {SLOWED[0]} x" in result.output
    assert "result: REGRESSION" in result.output

    # Confirmed: each slowed shape was measured twice (kept the faster), still regressed.
    assert [len(s["discarded_medians_s"]) for s in report["shapes"]] == [0, 1, 1, 0, 0]

    monkeypatch.setattr(TorchRunner, "forward", original)
    result, report = _bench(
        cli, tmp_path / "clean", "--baseline", baseline, "--threshold", TEST_THRESHOLD
    )
    assert result.exit_code == 0, result.output
    assert report["comparison"]["passed"] and report["comparison"]["regressed"] == []


def test_bench_confirmation_drops_a_transient_slowdown(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slowdown during only the first measurement of decode:8@16 (a burst of load) is flagged
    with --confirm 0 and cleared by the default re-measurement."""
    from resin.evals.perf_measure import ShapeRunner
    from resin.runners.torch import TorchRunner

    result, _ = _bench(cli, tmp_path / "base")
    assert result.exit_code == 0, result.output
    baseline = str(tmp_path / "base" / "report.json")
    original_forward, original_measure = TorchRunner.forward, ShapeRunner.measure
    state = {"slow": False, "calls": 0}

    def forward(self: Any, plan: Any) -> Any:
        output = original_forward(self, plan)
        if state["slow"]:
            time.sleep(SLOW_DELAY_S)
        return output

    def measure(self: Any, shape: Shape, repeats: int, warmup: int) -> Any:
        if shape.id == "decode:8@16":
            state["calls"] += 1
        state["slow"] = shape.id == "decode:8@16" and state["calls"] == 1
        try:
            return original_measure(self, shape, repeats, warmup)
        finally:
            state["slow"] = False

    monkeypatch.setattr(TorchRunner, "forward", forward)
    monkeypatch.setattr(ShapeRunner, "measure", measure)
    result, report = _bench(
        cli,
        tmp_path / "once",
        "--baseline",
        baseline,
        "--threshold",
        TEST_THRESHOLD,
        "--confirm",
        "0",
    )
    # Without confirmation the burst is reported (another shape may be too, on a busy machine).
    assert result.exit_code == 1 and "decode:8@16" in report["comparison"]["regressed"], (
        result.output
    )
    state["calls"] = 0
    result, report = _bench(
        cli, tmp_path / "confirmed", "--baseline", baseline, "--threshold", TEST_THRESHOLD
    )
    assert result.exit_code == 0, result.output
    assert state["calls"] == 2 and "re-measured decode:8@16" in result.output
    decode8 = next(s for s in report["shapes"] if s["id"] == "decode:8@16")
    assert len(decode8["discarded_medians_s"]) == 1
    assert decode8["discarded_medians_s"][0] > decode8["time"]["median_s"]


def test_bench_usage_errors(cli: Any, tmp_path: Path) -> None:
    assert cli("bench", str(tmp_path / "nope")).exit_code == 2
    assert cli("bench", str(LLAMA), "--shapes", "decode:8").exit_code == 2
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    result = cli("bench", str(LLAMA), "--baseline", str(tmp_path / "bad.json"))
    assert result.exit_code == 2 and "not a resin bench report" in result.output
    # Every shape longer than max_position_embeddings (512): a usage error, nothing measured.
    assert (
        cli("bench", str(LLAMA), "--shapes", "prefill:600", "--out", str(tmp_path / "x")).exit_code
        == 2
    )
    assert not (tmp_path / "x").exists()


def _generated(out: Path) -> Path:
    """A model directory for the Llama fixture, as ``resin new-model`` writes it."""
    pytest.importorskip("transformers")
    from resin.scaffold.cli import new_model

    new_model(LLAMA, out.name, out=out)
    return out


def test_bench_reads_model_perf_toml(cli: Any, tmp_path: Path) -> None:
    """A model directory (``models/NAME`` layout): shapes and repeats come from its perf.toml."""
    model = _generated(tmp_path / "tiny_llama")
    (model / "parity.toml").write_text(f'[reference]\ncheckpoint = "{LLAMA}"\n')
    (model / "perf.toml").write_text(
        "repeats = 3\n[decode]\nbatch_sizes = [2]\n"
        "context_lens = [8]\n[prefill]\nchunk_sizes = [8]\n"
    )
    result = cli("bench", str(model), "--out", str(tmp_path / "r"), "--warmup", "0")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["model"] == "tiny_llama"
    assert [s["id"] for s in report["shapes"]] == ["decode:2@8", "prefill:8"]
    assert all(s["time"]["num_samples"] == 3 for s in report["shapes"])


def test_bench_an_architecture_resin_loading_does_not_parse(cli: Any, tmp_path: Path) -> None:
    """A model directory whose checkpoint names an unknown architecture (its own runner runs
    it): bench measures it and says the roofline is approximate."""
    model = _generated(tmp_path / "fancy")
    checkpoint = model / "tiny"
    shutil.copytree(LLAMA, checkpoint)
    raw = json.loads((LLAMA / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**raw, "architectures": ["FancyLM"]}))
    record = json.loads((model / "architecture.json").read_text())
    (model / "architecture.json").write_text(json.dumps({**record, "architectures": ["FancyLM"]}))
    for spec in ("parity.toml", "perf.toml"):
        (model / spec).write_text('[reference]\ncheckpoint = "tiny"\ndtype = "float32"\n')
    result = cli(
        "bench",
        str(tmp_path / "fancy"),
        "--shapes",
        "decode:2@8",
        "--repeats",
        "2",
        "--out",
        str(tmp_path / "r"),
    )
    assert result.exit_code == 0, result.output
    assert "FancyLM is not parsed by resin.loading" in result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["shapes"][0]["flops"] > 0 and any("FancyLM" in n for n in report["notes"])


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_bench_cuda(cli: Any, tmp_path: Path) -> None:
    result = cli(
        "bench",
        str(LLAMA),
        "--device",
        "cuda",
        "--shapes",
        "decode:1,8@16 prefill:16",
        "--repeats",
        "5",
        "--out",
        str(tmp_path / "r"),
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["device"] == "cuda" and report["calibration"]["matmul_n"] == 8192
    assert all(s["time"]["median_s"] > 0 for s in report["shapes"])


def test_import_perf_loads_no_torch_or_matplotlib() -> None:
    code = (
        "import sys, resin.cli, resin.evals.perf; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- skills/optimize-perf/SKILL.md: every command in it runs -------------------------------

# Appended to each `resin bench` / `resin eval parity` line of the skill so the skill test stays
# near a minute (click keeps the last value of a repeated option): the commands, their files
# and their exit codes are exercised as written, on smaller shapes and fewer greedy tokens.
SKILL_BENCH_SHRINK = " --shapes 'decode:1,8@16 prefill:16' --repeats 3 --warmup 1 --num-threads 1"
SKILL_PARITY_SHRINK = " --max-new-tokens 2"


def skill_steps(text: str) -> list[tuple[str, str, str]]:
    """The skill's ```bash lines (backslash continuations joined) as ("run", command, "") and
    its ```python blocks as ("save", file name, code); a python block must be preceded by
    ``<!-- save as FILE -->`` (the skill tells the reader to save and run it)."""
    steps: list[tuple[str, str, str]] = []
    block = re.compile(r"(?:<!-- save as (\S+) -->\n)?```(bash|python)\n(.*?)```", re.S)
    for match in block.finditer(text):
        save_as, language, body = match.groups()
        if language == "python":
            assert save_as, f"python block without a save-as marker: {body[:80]!r}"
            steps.append(("save", save_as, body))
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                steps.append(("run", line.strip(), ""))
    return steps


def test_skill_front_matter_and_commands() -> None:
    text = SKILL.read_text()
    front = re.match(r"---\nname: (.+)\ndescription: (.+?)\n---\n", text, re.S)
    assert front and front.group(1) == "optimize-perf" and len(front.group(2)) > 80
    commands = [c for kind, c, _ in skill_steps(text) if kind == "run"]
    assert commands[0] == "resin eval parity tests/fixtures/llama"
    assert "TRITON_INTERPRET=1 python rms_norm_triton.py" in commands
    assert "python profile_step.py" in commands
    bench = [c for c in commands if c.startswith("resin bench")]
    assert len(bench) == 3 and sum("--baseline" in c for c in bench) == 2


def test_skill_commands_run(tmp_path: Path) -> None:
    """Runs every command of the skill in order, in a scratch workspace that sees the repo's
    fixtures, suites, baselines and virtualenv; reports land in the scratch evals/perf/reports."""
    for rel in ("tests", ".venv", "evals/perf/suites", "evals/perf/baselines"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).symlink_to(REPO / rel)
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TRITON_INTERPRET", None)
    done_commands: set[str] = set()
    for kind, command, code in skill_steps(SKILL.read_text()):
        if kind == "save":
            (tmp_path / command).write_text(code)
            continue
        if command in done_commands:  # parity is shown twice (before and after changes)
            continue
        done_commands.add(command)
        line = command + (
            SKILL_BENCH_SHRINK
            if command.startswith("resin bench")
            else SKILL_PARITY_SHRINK
            if command.startswith("resin eval parity")
            else ""
        )
        result = subprocess.run(
            ["bash", "-c", line],
            cwd=tmp_path,
            env=env,
            text=True,
            capture_output=True,
            timeout=600,
            check=False,
        )
        output = result.stdout + result.stderr
        if command.startswith("resin bench") and "--baseline" in command:
            # Exit 1 is a legitimate verdict on a noisy machine; it must agree with the JSON.
            out_dir = tmp_path / shlex.split(command)[shlex.split(command).index("--out") + 1]
            comparison = json.loads((out_dir / "report.json").read_text())["comparison"]
            assert result.returncode == (1 if comparison["regressed"] else 0), output
            assert f"result: {'REGRESSION' if comparison['regressed'] else 'ok'}" in output
        else:
            assert result.returncode == 0, f"{command}\n{output}"
        if command.startswith("resin bench"):
            assert "report:" in output and "result:" in output
    reports = tmp_path / "evals" / "perf" / "reports"
    assert {"llama-before", "llama-after", "llama-vs-committed", "llama-trace.json"} <= {
        p.name for p in reports.iterdir()
    }
