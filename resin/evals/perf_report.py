"""The ``resin bench`` report: one dict (``report.json``), its markdown (``report.md``), its plot
(``report.png``) and the short summary printed to the terminal.

Owns the report's schema (``SCHEMA``). Per shape (``shapes[i]``), times in seconds:

* ``time``: median / p10 / p90 / min / max / spread (= (p90 - p10) / 2) / noise_frac of the
  runner's step time (``runner.forward``); for ``e2e`` shapes, of the whole run's wall time.
* ``schedule_median_s``, ``update_median_s``, ``step_wall_median_s`` (schedule + forward +
  update) and ``engine_overhead_frac`` = median of (schedule + update) / step wall.
* ``tokens_per_s``: tokens through the engine per second of step wall time — decode: B per
  step; prefill: the chunk; e2e: generated tokens / run wall time.
* ``cost`` (:class:`resin.evals.roofline.StepCost`), ``flops``, ``bytes``,
  ``roofline_s``, ``roofline_pct`` = 100 * roofline_s / time.median_s, ``bound``.

matplotlib is imported inside :func:`write_plot` (Agg backend).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from resin.evals.perf_measure import ShapeTiming, Stats
from resin.evals.roofline import DevicePeaks

SCHEMA = "resin.perf/1"


def shape_entry(timing: ShapeTiming, peaks: DevicePeaks) -> dict[str, Any]:
    """One shape's block of ``report.json`` (module doc)."""
    shape, stats = timing.shape, Stats.of(timing.samples_s)
    wall = np.asarray(timing.step_wall_s)
    overhead = (np.asarray(timing.schedule_s) + np.asarray(timing.update_s)) / wall
    wall_median = float(np.median(wall))
    if shape.kind == "e2e":
        roofline_s = sum(peaks.roofline_s(c) for c in timing.roofline_parts)
        bound = "mixed"
    else:
        roofline_s, bound = peaks.roofline_s(timing.cost), peaks.bound(timing.cost)
    cost = timing.cost
    speculative = None
    if timing.spec_decode is not None:  # one e2e run's counters
        rows = timing.spec_decode["num_drafts"]
        speculative = {
            **timing.spec_decode,
            # vLLM's mean acceptance length: tokens a verify row yields, bonus included
            "mean_acceptance_length": 1 + timing.spec_decode["num_accepted_tokens"] / rows
            if rows
            else 1.0,
            "tokens_per_step": timing.num_generated / timing.num_steps_per_sample,
        }
    return {
        "speculative": speculative,
        "id": shape.id,
        "kind": shape.kind,
        "batch_size": shape.batch_size,
        "context_len": shape.context_len,
        "num_output_tokens": shape.num_output_tokens,
        "num_tokens": timing.num_tokens,
        "num_generated": timing.num_generated,
        "num_steps_per_sample": timing.num_steps_per_sample,
        "mean_context_len": timing.mean_context_len,
        "time": vars(stats),
        "samples_s": timing.samples_s,
        "schedule_median_s": float(np.median(timing.schedule_s)),
        "update_median_s": float(np.median(timing.update_s)),
        "step_wall_median_s": wall_median,
        "engine_overhead_frac": float(np.median(overhead)),
        "tokens_per_s": (timing.num_generated if shape.kind == "e2e" else timing.num_tokens)
        / wall_median,
        "cost": cost.to_dict(),
        "flops": cost.flops,
        "bytes": cost.bytes,
        "arithmetic_intensity": cost.flops / cost.bytes if cost.bytes else 0.0,
        "achieved_flops_per_s": cost.flops / stats.median_s,
        "achieved_bytes_per_s": cost.bytes / stats.median_s,
        "roofline_s": roofline_s,
        "roofline_pct": 100 * roofline_s / stats.median_s,
        "bound": bound,
        "discarded_medians_s": [],  # slower runs of a re-measured shape (resin.evals.perf)
    }


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _table_rows(report: dict[str, Any]) -> list[list[str]]:
    verdicts = {s["id"]: s for s in (report.get("comparison") or {}).get("shapes", [])}
    rows = []
    for s in report["shapes"]:
        t = s["time"]
        v = verdicts.get(s["id"])
        rows.append(
            [
                s["id"],
                _fmt_s(t["median_s"]),
                f"{_fmt_s(t['p10_s'])}–{_fmt_s(t['p90_s'])}",
                f"{t['noise_frac']:.0%}",
                f"{s['tokens_per_s']:,.0f}",
                f"{s['engine_overhead_frac']:.1%}",
                f"{s['flops'] / 1e6:.3g}",
                f"{s['bytes'] / 1e6:.3g}",
                f"{s['roofline_pct']:.2g}%",
                s["bound"],
                "" if v is None else f"x{v['ratio']:.2f} {v['verdict']}",
            ]
        )
    return rows


HEADER = [
    "shape",
    "median ms",
    "p10–p90 ms",
    "noise",
    "tok/s",
    "overhead",
    "MFLOP",
    "MB",
    "roofline",
    "bound",
    "vs baseline",
]


def summary(report: dict[str, Any], out_dir: Path | None = None) -> str:
    """The lines printed after a run: settings, one line per shape, the verdict, the files."""
    p = report["calibration"]
    lines = [
        f"resin bench {report['model']}: {report['device']} {report['dtype']}, "
        f"{len(report['shapes'])} shape(s), repeats {report['settings']['repeats']} "
        f"(warm-up {report['settings']['warmup']}); measured peaks "
        f"{p['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, {p['peak_bytes_per_s'] / 1e9:.1f} GB/s"
    ]
    rows = [HEADER] + _table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in report["shapes"]:
        spec = s.get("speculative")
        if spec:
            lines.append(
                f"speculative {report['settings'].get('speculative_method')} "
                f"k={report['settings'].get('num_speculative_tokens')} {s['id']}: mean "
                f"acceptance length {spec['mean_acceptance_length']:.2f}, "
                f"{spec['tokens_per_step']:.2f} tokens per step "
                f"({spec['num_accepted_tokens']}/{spec['num_draft_tokens']} drafts accepted)"
            )
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    comparison = report.get("comparison")
    if comparison is not None:
        lines.append(comparison["summary"])
    if out_dir is not None:
        lines.append(f"report: {out_dir}/report.json, report.md, report.png")
    lines.append("result: " + ("REGRESSION" if comparison and not comparison["passed"] else "ok"))
    return "\n".join(lines)


def _framework(report: dict[str, Any]) -> str:
    """``torch threads N`` (the torch runners), or ``runner mlx <version>``."""
    host = report["host"]
    if report.get("runner") == "mlx":
        return f"runner mlx {host.get('mlx', '?')} on {host.get('mlx_device', '?')}"
    return f"torch threads {host['torch_num_threads']}"


def markdown(report: dict[str, Any]) -> str:
    p, st = report["calibration"], report["settings"]
    lines = [
        f"# Perf report: {report['model']}",
        "",
        f"- checkpoint: `{report['checkpoint_dir']}`",
        f"- device: {report['device']} ({report['host']['device_name']}), dtype {report['dtype']}, "
        + _framework(report),
        f"- commit: `{report['git_commit']}`, created {report['created_utc']}",
        f"- command: `{report['command']}`",
        f"- repeats {st['repeats']}, warm-up {st['warmup']}, threshold {st['threshold']:.0%}",
        f"- measured peaks: {p['peak_flops_per_s'] / 1e9:.2f} GFLOP/s (matmul {p['matmul_n']}², "
        f"{p['dtype']}), {p['peak_bytes_per_s'] / 1e9:.2f} GB/s (copy of "
        f"{p['copy_bytes'] >> 20} MiB)",
        "",
        "Step time = `runner.forward(plan)` (e2e: whole run wall time); overhead = engine "
        "schedule + update as a fraction of the step's wall time; roofline = "
        "max(FLOPs / peak FLOP/s, bytes / peak bytes/s) as a % of the measured median "
        "(formulas: `resin/evals/roofline.py`).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in _table_rows(report)]
    for note in report.get("notes", []):
        lines += ["", f"Note: {note}"]
    comparison = report.get("comparison")
    if comparison is not None:
        lines += ["", "## Against the baseline", "", "```", comparison["summary"], "```"]
    return "\n".join(lines) + "\n"


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Step time and % of roofline against batch size (decode, one line per context length)
    and chunk size (prefill); e2e shapes are in the JSON and markdown only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for s in report["shapes"]:
        if s["kind"] == "decode":
            series.setdefault(f"decode @ {s['context_len']} ctx", []).append((s["batch_size"], s))
        elif s["kind"] == "prefill":
            series.setdefault("prefill (x = chunk tokens)", []).append((s["num_tokens"], s))
    fig, (ax_time, ax_roof) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in series.items():
        points.sort(key=lambda p: p[0])
        xs = [x for x, _ in points]
        med = np.array([s["time"]["median_s"] * 1e3 for _, s in points])
        lo = med - np.array([s["time"]["p10_s"] * 1e3 for _, s in points])
        hi = np.array([s["time"]["p90_s"] * 1e3 for _, s in points]) - med
        ax_time.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax_roof.plot(xs, [s["roofline_pct"] for _, s in points], marker="o", label=label)
    for ax, ylabel in ((ax_time, "step time, ms (median, p10–p90)"), (ax_roof, "% of roofline")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (decode sequences) / chunk tokens (prefill)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    ax_time.set_yscale("log")
    ax_time.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    fig.suptitle(
        f"{report['model']} — {report['device']} {report['dtype']} ({report['created_utc']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """Write ``report.json``, ``report.md`` and ``report.png`` into ``out_dir`` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(report))
    write_plot(report, out_dir / "report.png")
