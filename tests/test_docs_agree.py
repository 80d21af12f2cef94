"""docs/batch_plan.md documents every BatchPlan, SamplingArrays and ForwardOutput field the
compiled module exposes (and so, by stubtest, every field in resin/_core.pyi)."""

import re
import subprocess
import sys
from pathlib import Path

import resin

DOC = (Path(__file__).resolve().parent.parent / "docs" / "batch_plan.md").read_text()


def documented(name: str) -> bool:
    return re.search(rf"`(plan\.)?{re.escape(name)}(\[g\])?`", DOC) is not None


def test_every_plan_and_output_field_is_documented() -> None:
    fields = {
        "BatchPlan": [
            n for n, v in vars(resin.BatchPlan).items() if not n.startswith("_") and not callable(v)
        ],
        "SamplingArrays": [
            n
            for n, v in vars(resin.SamplingArrays).items()
            if not n.startswith("_") and not callable(v)
        ],
        "ForwardOutput": [
            n
            for n, v in vars(resin.ForwardOutput).items()
            if not n.startswith("_") and not callable(v)
        ],
    }
    assert "input_ids" in fields["BatchPlan"] and "temperature" in fields["SamplingArrays"]
    missing = [
        f"{cls}.{name}" for cls, names in fields.items() for name in names if not documented(name)
    ]
    assert missing == [], f"fields missing from docs/batch_plan.md: {missing}"


def test_readme_example_runs_as_written() -> None:
    """The README's runner example is executed verbatim (doc snippets are tests)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "class Runner" in b]
    assert len(blocks) == 1, "README has one runner example"
    result = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "r1 [0, 0, 0, 0, 0, 0, 0, 0] length"
    assert 'resin:request_success_total{finished_reason="length"} 1' in result.stdout
