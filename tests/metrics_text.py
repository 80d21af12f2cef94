"""A strict parser for the Prometheus text exposition format 0.0.4, for the metrics tests.

``parse_metrics`` asserts the format while parsing: HELP/TYPE lines before their samples,
one TYPE per family, every sample belonging to a declared family (histograms via
``_bucket`` / ``_sum`` / ``_count``), well-formed labels and values, counters named
``*_total``, histograms with cumulative buckets ending in ``le="+Inf"`` equal to
``_count``, every name prefixed ``resin:``, and a final newline.
"""

from __future__ import annotations

import math
import re
from typing import Any

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"^({NAME})(?:\{{(.*)\}})? (\S+)(?: (-?\d+))?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    rest = text.rstrip(",")
    while rest:
        m = LABEL.match(rest)
        assert m, f"bad labels: {{{text}}}"
        assert m.group(1) not in labels, f"duplicate label in {{{text}}}"
        labels[m.group(1)] = m.group(2)
        rest = rest[m.end() :]
        assert rest == "" or rest.startswith(","), f"bad labels: {{{text}}}"
        rest = rest[1:]
    return labels


def parse_value(text: str) -> float:
    if text in ("+Inf", "-Inf", "NaN"):
        return float(text.replace("Inf", "inf"))
    assert re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text), f"bad value {text!r}"
    return float(text)


def family_of(name: str, types: dict[str, str]) -> str | None:
    if name in types:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and types.get(base) in ("histogram", "summary"):
            if suffix != "_bucket" or types[base] == "histogram":
                return base
    return None


def parse_metrics(text: str) -> dict[str, Any]:
    """Returns {"types": {family: type}, "samples": [(name, labels, value)]}."""
    assert text.endswith("\n"), "exposition must end with a newline"
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    seen_samples: set[str] = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# TYPE "):
            parts = line.split(" ")
            assert len(parts) == 4 and re.fullmatch(NAME, parts[2]), line
            name, kind = parts[2], parts[3]
            assert kind in TYPES and name not in types, line
            assert name not in seen_samples, f"TYPE after samples: {line}"
            types[name] = kind
        elif line.startswith("# HELP "):
            assert re.fullmatch(NAME, line.split(" ")[2]), line
        elif line.startswith("#"):
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"bad sample line: {line!r}"
            name, labels, value = (
                m.group(1),
                parse_labels(m.group(2) or ""),
                parse_value(m.group(3)),
            )
            family = family_of(name, types)
            assert family is not None, f"sample {name} has no # TYPE"
            seen_samples.add(family)
            samples.append((name, labels, value))
    for family, kind in types.items():
        assert family.startswith("resin:"), family
        if kind == "counter":
            assert family.endswith("_total"), family
        if kind == "histogram":
            check_histogram(family, samples)
    assert samples, "no samples"
    return {"types": types, "samples": samples}


def check_histogram(family: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for name, labels, value in samples:
        if name not in (family + "_bucket", family + "_sum", family + "_count"):
            continue
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        entry = series.setdefault(key, {"buckets": [], "sum": None, "count": None})
        if name.endswith("_bucket"):
            entry["buckets"].append((parse_value(labels["le"]), value))
        else:
            entry[name.rsplit("_", 1)[1]] = value
    if not series:
        return  # a family with no samples yet is valid
    for entry in series.values():
        buckets = entry["buckets"]
        assert buckets and buckets[-1][0] == math.inf, f'{family}: no le="+Inf" bucket'
        bounds = [b for b, _ in buckets]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), family
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), f"{family}: buckets not cumulative"
        assert entry["sum"] is not None and entry["count"] == counts[-1], family


def sample_value(metrics: dict[str, Any], name: str, **labels: str) -> float:
    """The value of the one sample ``name`` whose labels include ``labels``."""
    values = [
        v
        for n, ls, v in metrics["samples"]
        if n == name and all(ls.get(k) == want for k, want in labels.items())
    ]
    assert len(values) == 1, f"{name}{labels}: {len(values)} samples"
    return values[0]
