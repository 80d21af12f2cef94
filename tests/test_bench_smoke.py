"""Smoke test of benchmarks/engine_overhead.py: it runs and writes well-formed JSON.

No timing thresholds: CI machines are noisy. The numbers must only exist and be positive.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_overhead.py"
STAT_KEYS = {"total_us", "schedule_us", "forward_us", "update_us", "drop_us"}
SUMMARY_KEYS = {"mean", "p50", "p99", "max"}


def test_engine_overhead_quick(tmp_path: Path) -> None:
    output = tmp_path / "engine_overhead.json"
    command = [
        sys.executable,
        str(SCRIPT),
        "--quick",
        "--batch-sizes",
        "4",
        "--prompt-len",
        "32",
        "--output-len",
        "8",
        "--output",
        str(output),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert "| B | runner |" in completed.stdout

    result = json.loads(output.read_text())
    assert result["config"]["batch_sizes"] == [4]
    assert result["config"]["prompt_len"] == 32
    assert result["config"]["output_len"] == 8
    runs = result["runs"]
    assert [(run["batch_size"], run["runner"]) for run in runs] == [(4, "null"), (4, "touch")]
    for run in runs:
        assert run["num_steps"] > 0 and run["wall_s"] > 0
        assert run["num_preemptions"] in (None, 0)
        # 4 x 32 prompt tokens fit one 2048-token step; then 7 decode steps at full batch.
        assert run["prefill"]["num_steps"] >= 1
        assert run["decode"]["num_steps"] == 7
        assert run["decode_full"]["num_steps"] == 7
        assert run["decode_full"]["mean_num_sequences"] == 4
        for key in ("decode", "decode_full", "prefill"):
            stats = run[key]
            assert STAT_KEYS <= stats.keys()
            for stat in STAT_KEYS:
                assert SUMMARY_KEYS <= stats[stat].keys()
                assert all(stats[stat][k] > 0 for k in SUMMARY_KEYS), (key, stat, stats[stat])
            assert stats["total_us"]["p99"] >= stats["total_us"]["p50"]
            for stat in ("steps_per_s", "us_per_sequence", "us_per_token"):
                assert stats[stat] > 0
