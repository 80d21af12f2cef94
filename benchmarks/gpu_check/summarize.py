"""The GPU check's last table: ``python summarize.py OUT_DIR`` (benchmarks/gpu_check.sh).

Reads what the steps left in OUT_DIR — ``steps.tsv`` (step, status, seconds, note: one line
per step, written by the script), ``parity-*.json`` (``resin eval parity --json``),
``bench-*/report.json`` (``resin bench --out``) — prints one table and writes
``summary.json``. For the 8B bench it picks out what the check is for: decode at batch 1 as a
percentage of the roofline (memory-bound there: the weights are read once per step) and
decode tokens/s at batch 64. For the CUDA-graph pair it prints the replayed / eager step
counts the runner reported (``cuda_graphs`` in report.json, when the build has them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def parity_rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(out.glob("parity-*.json")):
        report = _load(path)
        if report is None:
            rows.append({"name": path.stem, "status": "no report"})
            continue
        failed = [s.get("name", "?") for s in report.get("stages", []) if not s.get("passed")]
        note = report.get("detail") or (f"failed: {', '.join(failed)}" if failed else "")
        rows.append(
            {
                "name": path.stem,
                "status": "PASS" if report.get("passed") else "FAIL",
                "runner": report.get("runner"),
                "dtype": report.get("dtype"),
                "stages": len(report.get("stages", [])),
                "note": note,
            }
        )
    return rows


def bench_rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(out.glob("bench-*/report.json")):
        report = _load(path)
        if report is None:
            continue
        graphs = report.get("cuda_graphs")
        for shape in report.get("shapes", []):
            rows.append(
                {
                    "bench": path.parent.name,
                    "shape": shape.get("id"),
                    "median_ms": 1e3 * float(shape.get("time", {}).get("median_s", float("nan"))),
                    "tokens_per_s": shape.get("tokens_per_s"),
                    "roofline_pct": shape.get("roofline_pct"),
                    "bound": shape.get("bound"),
                    "cuda_graph_steps": shape.get("cuda_graph_steps"),
                    "graphs": None
                    if graphs is None
                    else {k: graphs.get(k) for k in ("num_replayed", "num_eager", "disabled")},
                    "device_name": report.get("host", {}).get("device_name"),
                }
            )
    return rows


def headline(benches: list[dict[str, Any]]) -> dict[str, Any]:
    """The 8B numbers the check reports (None when the step did not run)."""
    by_shape = {r["shape"]: r for r in benches if r["bench"] == "bench-llama-8b"}
    one = next((r for s, r in by_shape.items() if str(s).startswith("decode:1@")), None)
    wide = next((r for s, r in by_shape.items() if str(s).startswith("decode:64@")), None)
    return {
        "decode_batch1_roofline_pct": None if one is None else one["roofline_pct"],
        "decode_batch1_bound": None if one is None else one["bound"],
        "decode_batch1_ms": None if one is None else one["median_ms"],
        "decode_batch64_tokens_per_s": None if wide is None else wide["tokens_per_s"],
    }


def steps(out: Path) -> list[dict[str, str]]:
    path = out / "steps.tsv"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, status, seconds, note = (line.split("\t") + ["", "", "", ""])[:4]
        rows.append({"step": name, "status": status, "seconds": seconds, "note": note})
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else ".")
    summary = {
        "steps": steps(out),
        "parity": parity_rows(out),
        "bench": bench_rows(out),
    }
    summary["headline"] = headline(summary["bench"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'step':<34} {'status':<8} {'s':>5}  note")
    for row in summary["steps"]:
        print(f"{row['step']:<34} {row['status']:<8} {row['seconds']:>5}  {row['note']}")
    if summary["parity"]:
        print()
        for row in summary["parity"]:
            print(f"{row['name']:<34} {row['status']:<8} {row.get('note', '')}")
    if summary["bench"]:
        print(f"\n{'bench':<24} {'shape':<16} {'ms':>9} {'tok/s':>10} {'roof %':>7}  graphs")
        for row in summary["bench"]:
            print(
                f"{row['bench']:<24} {str(row['shape']):<16} {_fmt(row['median_ms'], '9.3f')} "
                f"{_fmt(row['tokens_per_s'], '10.1f')} {_fmt(row['roofline_pct'], '7.1f')}  "
                f"{row['cuda_graph_steps'] or row['graphs'] or ''}"
            )
    head = summary["headline"]
    print(
        "\n8B (random bf16 weights): decode batch 1 = "
        f"{_fmt(head['decode_batch1_roofline_pct'], '.1f')} % of roofline "
        f"({head['decode_batch1_bound'] or '-'}-bound, {_fmt(head['decode_batch1_ms'], '.2f')} ms"
        f"/step); decode batch 64 = {_fmt(head['decode_batch64_tokens_per_s'], '.0f')} tokens/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
