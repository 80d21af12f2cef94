"""docs/batch_plan.md documents every BatchPlan, SamplingArrays and ForwardOutput field the
compiled module exposes (and so, by stubtest, every field in resin/_core.pyi)."""

import re
from pathlib import Path

import resin

DOC = (Path(__file__).resolve().parent.parent / "docs" / "batch_plan.md").read_text()


def documented(name: str) -> bool:
    return re.search(rf"`(plan\.)?{re.escape(name)}(\[g\])?`", DOC) is not None


def test_every_plan_and_output_field_is_documented() -> None:
    fields = {
        "BatchPlan": [n for n, v in vars(resin.BatchPlan).items() if not n.startswith("_") and not callable(v)],
        "SamplingArrays": [n for n, v in vars(resin.SamplingArrays).items() if not n.startswith("_") and not callable(v)],
        "ForwardOutput": [n for n, v in vars(resin.ForwardOutput).items() if not n.startswith("_") and not callable(v)],
    }
    assert "input_ids" in fields["BatchPlan"] and "temperature" in fields["SamplingArrays"]
    missing = [f"{cls}.{name}" for cls, names in fields.items() for name in names if not documented(name)]
    assert missing == [], f"fields missing from docs/batch_plan.md: {missing}"
