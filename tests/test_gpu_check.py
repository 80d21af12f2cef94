"""The GPU check (benchmarks/gpu_check.sh, gpu_check_bundle.sh, benchmarks/gpu_check/), on CPU.

- Both scripts parse (``bash -n``) and print their usage.
- Without a CUDA device the check stops at its preflight, exit 2, with a message saying so,
  before installing or writing anything but its log.
- The 8B checkpoint maker: its config is Llama-3-8B's shape (8.03e9 parameters by Resin's own
  tensor list); at a tiny scale (``--set``) it writes sharded safetensors with an index that
  Resin's torch runner loads; asking it for CUDA where there is none says so.
- ``summarize.py`` reads the parity reports, the bench reports (the keys ``resin bench``
  writes) and steps.tsv into the headline: decode at batch 1 as % of roofline, tokens/s at
  batch 64.
- The bundle directory and the check's default output are git-ignored.

The bundle itself is built by hand (``bash benchmarks/gpu_check_bundle.sh``: a release build
and ~240 MB of downloads, too slow for a test); docs/benchmarks.md, "GPU check", says so.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "benchmarks" / "gpu_check.sh"
BUNDLE = REPO / "benchmarks" / "gpu_check_bundle.sh"
HELPERS = REPO / "benchmarks" / "gpu_check"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", [CHECK, BUNDLE])
def test_scripts_parse_and_print_their_usage(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    done = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and str(script.relative_to(REPO)) in done.stdout
    bad = subprocess.run(
        ["bash", str(script), "--nope"], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "unknown option --nope" in bad.stderr


def test_without_cuda_it_stops_before_installing(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_ALLOW_CPU")}
    env.update(GPU_CHECK_PYTHON=sys.executable)
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(
        ["bash", str(CHECK), "--out", str(out), "--work", str(work)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_check: no CUDA device (torch.cuda.is_available() is False" in done.stderr
    assert "stopped before installing anything" in done.stderr
    assert (out / "steps.tsv").read_text().startswith("preflight\tno CUDA")
    assert not any(work.iterdir())  # no venv, no checkpoint


def test_the_8b_config_is_llama_3_8b() -> None:
    from resin.loading import load_model_config
    from resin.loading.weights import expected_tensor_shapes

    make = _module("make_checkpoint")
    config = load_model_config(make.LLAMA_8B)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        4096,
        32,
        14336,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.vocab_size == 128256
    params = sum(math.prod(shape) for shape in expected_tensor_shapes(config).values())
    assert 8.0e9 < params < 8.1e9  # Llama-3-8B: 8.03e9


def test_the_8b_maker_at_a_tiny_scale_loads_in_resin(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from resin.runners.torch import TorchRunner

    make = _module("make_checkpoint")
    make.SHARD_BYTES = 200_000  # several shards at this scale, as at the full one
    small = ["num_hidden_layers=2", "hidden_size=128", "intermediate_size=256"]
    small += ["num_attention_heads=4", "num_key_value_heads=2", "head_dim=32", "vocab_size=512"]
    argv = ["llama-8b", str(tmp_path), "--device", "cpu"]
    assert make.main(argv + [arg for s in small for arg in ("--set", s)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["hidden_size"] == 128 and config["rope_theta"] == 500000.0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    runner = TorchRunner.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert runner.weights.globals["embed_tokens.weight"].shape == (512, 128)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            make.main(["llama-8b", str(tmp_path / "gpu"), "--device", "cuda"])


def test_summarize_reads_what_the_steps_write(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    summarize = _module("summarize")
    # The keys summarize reads are the ones resin bench writes (resin/evals/perf_report.py).
    source = (REPO / "resin" / "evals" / "perf_report.py").read_text()
    for key in ('"roofline_pct"', '"tokens_per_s"', '"bound"', '"median_s"', '"id"'):
        assert key in source
    (tmp_path / "steps.tsv").write_text("install\tok\t31\tinstall.log\nunit\tFAILED\t90\texit 1\n")
    (tmp_path / "parity-tiny-llama-torch.json").write_text(
        json.dumps(
            {
                "passed": True,
                "runner": "torch",
                "dtype": "bfloat16",
                "stages": [{"name": "layers", "passed": True}],
            }
        )
    )
    (tmp_path / "parity-tiny-mistral-flashinfer.json").write_text(
        json.dumps({"passed": False, "stages": [{"name": "layers", "passed": False}]})
    )
    bench = tmp_path / "bench-llama-8b"
    bench.mkdir()
    shapes = [
        {"id": "decode:1@512", "time": {"median_s": 0.01}, "tokens_per_s": 100.0,
         "roofline_pct": 71.5, "bound": "memory"},
        {"id": "decode:64@512", "time": {"median_s": 0.02}, "tokens_per_s": 3200.0,
         "roofline_pct": 40.0, "bound": "memory"},
    ]  # fmt: skip
    (bench / "report.json").write_text(json.dumps({"shapes": shapes, "host": {}}))
    assert summarize.main(["summarize", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["headline"] == {
        "decode_batch1_roofline_pct": 71.5,
        "decode_batch1_bound": "memory",
        "decode_batch1_ms": 10.0,
        "decode_batch64_tokens_per_s": 3200.0,
    }
    assert [p["status"] for p in summary["parity"]] == ["PASS", "FAIL"]  # by file name
    assert summary["steps"][1] == {
        "step": "unit",
        "status": "FAILED",
        "seconds": "90",
        "note": "exit 1",
    }
    printed = capsys.readouterr().out
    assert "decode batch 1 = 71.5 % of roofline (memory-bound" in printed
    assert "decode batch 64 = 3200 tokens/s" in printed


def test_bundle_and_results_are_git_ignored() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", ".gpu_bundle/wheels/x.whl", "gpu_check_out/log.txt"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ignored.stdout.split() == [".gpu_bundle/wheels/x.whl", "gpu_check_out/log.txt"]
