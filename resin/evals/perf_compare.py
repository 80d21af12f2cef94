"""Regression check of one ``resin bench`` report against a baseline report.

Owns the rule that decides "regressed". Shapes are matched by id (``decode:8@128``...). For
each shape in both reports, with ``m`` the median and ``s`` the spread (half the p10–p90 range)
of the timed samples (the runner's step time; e2e: the run's wall time):

    regressed  iff  m_new > m_base * (1 + threshold)  and  m_new - m_base > s_new + s_base
    improved   iff  m_new < m_base * (1 - threshold)  and  m_base - m_new > s_new + s_base

i.e. slower by more than the threshold *and* by more than the measured noise: the two runs'
p10–p90 bands, centred on their medians, do not overlap. A shape in only one report is
listed under ``missing_in_baseline`` / ``missing_in_new`` and is never a regression. A
different model, device or dtype is reported as a warning (the comparison still runs).
Pure Python: works on the ``report.json`` dictionaries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_THRESHOLD = 0.05


@dataclass
class ShapeComparison:
    """One shape in both reports; times in seconds; ``ratio`` = new median / baseline median."""

    id: str
    baseline_median_s: float
    new_median_s: float
    baseline_spread_s: float
    new_spread_s: float
    ratio: float
    verdict: str  # "regressed", "improved" or "same"


@dataclass
class Comparison:
    """The result of :func:`compare`; ``passed`` is False iff any shape regressed."""

    baseline: str
    threshold: float
    shapes: list[ShapeComparison] = field(default_factory=list)
    regressed: list[str] = field(default_factory=list)
    improved: list[str] = field(default_factory=list)
    missing_in_baseline: list[str] = field(default_factory=list)
    missing_in_new: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.regressed

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def summary(self) -> str:
        head = f"compare vs {self.baseline} (threshold {self.threshold:.0%}, beyond noise): "
        if self.regressed:
            worst = {s.id: s.ratio for s in self.shapes}
            detail = ", ".join(f"{i} x{worst[i]:.2f}" for i in self.regressed)
            head += f"REGRESSED {len(self.regressed)} shape(s): {detail}"
        else:
            head += f"no regression in {len(self.shapes)} shape(s)"
        if self.improved:
            head += f"; improved: {', '.join(self.improved)}"
        lines = [head]
        if self.missing_in_baseline:
            lines.append(f"  not in baseline (not compared): {', '.join(self.missing_in_baseline)}")
        if self.missing_in_new:
            lines.append(f"  in baseline only (not measured now): {', '.join(self.missing_in_new)}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def compare(
    new: dict[str, Any],
    baseline: dict[str, Any],
    threshold: float = DEFAULT_THRESHOLD,
    baseline_name: str = "baseline",
) -> Comparison:
    """Compare two ``report.json`` dicts (module doc for the rule)."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    result = Comparison(baseline=baseline_name, threshold=threshold)
    for key in ("model", "device", "dtype"):
        if new.get(key) != baseline.get(key):
            result.warnings.append(
                f"{key} differs: baseline {baseline.get(key)!r}, new {new.get(key)!r}"
            )
    base_shapes = {s["id"]: s for s in baseline.get("shapes", [])}
    new_ids = [s["id"] for s in new.get("shapes", [])]
    for shape in new.get("shapes", []):
        base = base_shapes.get(shape["id"])
        if base is None:
            result.missing_in_baseline.append(shape["id"])
            continue
        m_new, m_base = shape["time"]["median_s"], base["time"]["median_s"]
        s_new, s_base = shape["time"]["spread_s"], base["time"]["spread_s"]
        noise = s_new + s_base
        verdict = "same"
        if m_new > m_base * (1 + threshold) and m_new - m_base > noise:
            verdict = "regressed"
            result.regressed.append(shape["id"])
        elif m_new < m_base * (1 - threshold) and m_base - m_new > noise:
            verdict = "improved"
            result.improved.append(shape["id"])
        result.shapes.append(
            ShapeComparison(
                shape["id"],
                m_base,
                m_new,
                s_base,
                s_new,
                m_new / m_base if m_base > 0 else float("inf"),
                verdict,
            )
        )
    result.missing_in_new = [i for i in base_shapes if i not in new_ids]
    return result
