"""The MLX runner as the engine and the entry points use it (parity is tests/test_mlx_parity.py,
sampling tests/test_mlx_sampler.py).

- It is MLX, not torch: ``resin.LLM(..., runner="mlx")`` generating loads no torch module, and
  importing ``resin.runners.mlx`` loads no MLX until a runner is built.
- Without MLX, ``--runner mlx`` says which package to install (``resin generate`` exits 1 with
  it, ``resolve_runner`` raises a ``ValueError``).
- Caches: one K/V pair per layer slot, shared by the cache groups (gpt-oss's sliding and full
  layers), in the runner's dtype — the torch runners' layout, so ``resin.LLM`` sizes the pool
  alike for both.
- Speculative decoding (verify rows of 1 + k tokens) leaves greedy outputs unchanged.
- ``resin bench --runner mlx`` writes a report of the MLX run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QWEN3 = REPO / "tests" / "fixtures" / "qwen3"
GPT_OSS = REPO / "resin" / "models" / "gpt_oss" / "tiny"
# A meta-path finder that makes `import mlx` fail, as on a machine without MLX.
NO_MLX = """
import sys
class NoMlx:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith("mlx."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NoMlx())
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_generating_with_mlx_loads_no_torch() -> None:
    code = (
        "import sys, resin.runners.mlx\n"
        "assert not any(m.split('.')[0] == 'mlx' for m in sys.modules), 'mlx at import'\n"
        "import resin\n"
        "from resin.llm import LLM\n"
        f"llm = LLM({str(QWEN3)!r}, runner='mlx', max_num_seqs=2, max_model_len=128)\n"
        "out = llm.generate('Hello there', resin.SamplingParams(max_tokens=6, temperature=0))\n"
        "assert len(out[0].token_ids) == 6\n"
        "print(type(llm.runner).__name__)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["MlxRunner", "[]"]


def test_without_mlx_the_error_names_the_package() -> None:
    code = NO_MLX + (
        "from resin.registry import resolve_runner\n"
        "try:\n"
        f"    resolve_runner({str(QWEN3)!r}, 'mlx')\n"
        "except ValueError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("MlxNotInstalledError")
    assert 'pip install "mlx[cpu]"' in done.stdout  # Linux; macOS is told `pip install mlx`
    cli = NO_MLX + (
        "import sys\n"
        "from resin.cli import app\n"
        f"sys.argv = ['resin', 'generate', {str(QWEN3)!r}, '-p', 'hi', '--runner', 'mlx']\n"
        "app()\n"
    )
    done = _python(cli)
    assert done.returncode == 1
    assert 'error: the MLX runner needs MLX, which is not installed: pip install "mlx[cpu]"' in (
        done.stderr
    )


def test_caches_share_layer_slots_across_groups() -> None:
    from resin.runners.mlx import MlxRunner

    runner = MlxRunner.from_pretrained(GPT_OSS, dtype="bfloat16")
    specs = runner.cache_spec()
    assert [s.kind for s in specs] == ["sliding_window", "full"] * 2
    assert {s.bytes_per_token for s in specs} == {2 * 2 * 16 * 2}  # K+V, 2 heads x 16, bf16
    layout = resin.CacheLayout.from_specs(specs, 16)
    runner.bind_cache(layout)
    assert len(layout.groups) == 2 and len(runner.slot_caches) == layout.num_layer_slots == 2
    # layer 0 (sliding) and layer 1 (full) are the first layer of their groups: one buffer
    assert runner.layer_caches[0] is runner.layer_caches[1]
    assert runner.layer_caches[0] is not runner.layer_caches[2]
    k = runner.slot_caches[0].k
    assert k.shape == (layout.num_pages * 16, 2, 16) and str(k.dtype) == "mlx.core.bfloat16"


def test_attention_backend_is_refused() -> None:
    from resin.registry import resolve_runner

    with pytest.raises(ValueError, match="attention-backend triton is for the torch runners"):
        resolve_runner(QWEN3, "mlx", attention_backend="triton")


def test_speculative_decoding_keeps_greedy_outputs() -> None:
    prompt = "one two three one two three one two three one two"
    params = resin.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(QWEN3, runner="mlx", max_num_seqs=2, max_model_len=128)
    spec = LLM(QWEN3, runner="mlx", max_num_seqs=2, max_model_len=128, num_speculative_tokens=3)
    expected = plain.generate(prompt, params)[0].token_ids
    assert spec.generate(prompt, params)[0].token_ids == expected
    metrics = spec.engine.metrics_text()
    drafts = [
        line for line in metrics.splitlines() if line.startswith("resin:spec_decode_num_drafts")
    ]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0, "no verify row was run"


def test_bench_runs_the_mlx_runner(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from resin.cli import app

    out = tmp_path / "report"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(QWEN3),
            "--runner",
            "mlx",
            "--shapes",
            "decode:2@16 prefill:16",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["runner"] == "mlx" and "mlx" in report["host"]
    assert report["calibration"]["device"] == "mlx:cpu"
    assert "--runner mlx" in report["command"]
    assert [s["id"] for s in report["shapes"]] == ["decode:2@16", "prefill:16"]
    assert all(s["time"]["median_s"] > 0 for s in report["shapes"])
