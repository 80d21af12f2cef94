"""``resin bench MODEL``: the perf harness — step times, tokens/s, engine overhead and the
roofline per shape, written as a report and compared with a baseline.

Owns the command and the run: resolve MODEL (:func:`resin.evals.model_ref.resolve_model`:
a checkpoint directory or a model under ``models/``), settle the settings (command line, then
``--spec`` or else the model's ``perf.toml``, then defaults), load the runner once (``--runner``:
the registry's, or ``mlx`` for the MLX runner), calibrate the device's peaks
(:func:`resin.evals.roofline.calibrate`, or with MLX for ``--runner mlx``), time every shape through a real engine
(:mod:`resin.evals.perf_measure`), write ``report.json`` / ``report.md`` / ``report.png``
(:mod:`resin.evals.perf_report`) into ``evals/perf/reports/<model>-<UTC timestamp>/`` (or
``--out``), and compare with ``--baseline`` (:mod:`resin.evals.perf_compare`).

Exit status: 0 ok; 1 a shape regressed against the baseline (named in the summary and in
``report.json`` ``comparison.regressed``; a flagged shape is re-measured first, see
:func:`run_bench`); 2 bad usage (unknown model, bad shapes, unreadable
baseline); 3 the run itself failed (the runner or engine raised). Importing this module
imports neither torch nor matplotlib.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from resin.evals.perf_compare import DEFAULT_THRESHOLD, compare
from resin.evals.perf_report import SCHEMA, shape_entry, summary, write_report
from resin.evals.perf_shapes import DEFAULT_SHAPES, Shape, load_perf_spec, parse_shapes
from resin.evals.roofline import DTYPE_BYTES, load_dims

DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 2
DEFAULT_REPORTS_DIR = Path("evals/perf/reports")
EXIT_REGRESSION, EXIT_USAGE, EXIT_FAILED = 1, 2, 3
RUNNERS = ("torch", "mlx")


@dataclass
class BenchSettings:
    """Everything one run uses, after the command line, ``perf.toml`` and defaults are merged."""

    shapes: list[Shape]
    repeats: int
    warmup: int
    threshold: float
    device: str
    dtype: str
    num_threads: int | None
    confirm: int = 1  # re-measurements of a flagged shape before it counts as regressed
    runner: str = "torch"  # "torch" (the registry's torch runner) or "mlx"
    speculative_method: str | None = None  # "ngram" or "mtp" (the runner drafts): e2e shapes
    num_speculative_tokens: int = 0  # report acceptance length and tokens per step
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_batch_sizes: list[int] | None = None  # None: the runner's defaults


def run_bench(
    model: str,
    settings: BenchSettings,
    load_runner: Callable[[], Any],
    model_config: Any,
    checkpoint_dir: str,
    command: str,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
) -> dict[str, Any]:
    """Calibrate, measure every shape, compare with ``baseline`` if given, and return the
    report dict (not yet written). Shapes too long for the checkpoint's
    ``max_position_embeddings`` are skipped with a note.

    Confirmation: a shape the comparison flags is measured again, up to ``settings.confirm``
    times, and the run with the lower median is kept (the other's median is listed in the
    shape's ``discarded_medians_s``). Load from other processes only ever adds time, so a burst
    of it does not repeat on demand; a real regression does, and stays flagged."""
    from resin.evals.perf_measure import ShapeRunner

    if settings.runner == "mlx":
        from resin.runners.mlx.calibrate import calibrate_mlx as calibrate
    else:
        import torch

        from resin.evals.roofline import calibrate

        if settings.num_threads is not None and settings.device == "cpu":
            torch.set_num_threads(settings.num_threads)
        if settings.device.startswith("cuda"):
            # Timing events and synchronize() act on the current device: make it the bench's.
            torch.cuda.set_device(torch.device(settings.device))
    notes, shapes = [], []
    max_len = model_config.max_position_embeddings
    for shape in settings.shapes:
        needed = shape.max_len_tokens + settings.warmup + settings.repeats + 2
        if needed > max_len:
            notes.append(
                f"skipped {shape.id}: needs ~{needed} positions, the checkpoint has "
                f"max_position_embeddings {max_len}"
            )
        else:
            shapes.append(shape)
    if not shapes:
        raise ValueError("every shape is longer than the checkpoint allows: " + "; ".join(notes))
    runner = load_runner()
    k = settings.num_speculative_tokens if settings.speculative_method else 0
    if settings.speculative_method == "mtp":
        if not hasattr(runner, "enable_mtp"):
            raise ValueError(f"--speculative-method mtp: {type(runner).__name__} has no MTP")
        runner.enable_mtp(k)
    graph_sizes = _cuda_graph_sizes(runner, settings, shapes)
    peaks = calibrate(settings.device, settings.dtype)
    measurer = ShapeRunner(
        runner,
        model_config,
        settings.device,
        DTYPE_BYTES[settings.dtype],
        num_speculative_tokens=k,
        cuda_graph_batch_sizes=graph_sizes,
    )
    # A throwaway pass of the cheapest shape warms the process (allocator, lazy imports,
    # clocks), so the first measured shape is not the only one paying for it.
    measurer.measure(min(shapes, key=lambda s: s.batch_size * s.max_len_tokens), 2, 0)

    def measured(shape: Shape) -> dict[str, Any]:
        """One shape's report entry, with the CUDA-graph steps its run replayed / ran eager."""
        before = _graph_counts(runner)
        entry = shape_entry(measurer.measure(shape, settings.repeats, settings.warmup), peaks)
        if graph_sizes:
            after = _graph_counts(runner)
            entry["cuda_graph_steps"] = {k: after[k] - before[k] for k in after}
        return entry

    entries = [measured(s) for s in shapes]
    report = {
        "schema": SCHEMA,
        "model": model,
        "checkpoint_dir": checkpoint_dir,
        "device": settings.device,
        "dtype": settings.dtype,
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": _git_commit(),
        "command": command,
        "runner": settings.runner,
        "host": _host(settings),
        "settings": {
            "repeats": settings.repeats,
            "warmup": settings.warmup,
            "threshold": settings.threshold,
            "shapes": " ".join(s.id for s in shapes),
            "speculative_method": settings.speculative_method,
            "num_speculative_tokens": k,
            "enforce_eager": settings.enforce_eager,
            "cuda_graph_batch_sizes": graph_sizes,
        },
        "calibration": peaks.to_dict(),
        "shapes": entries,
        "notes": notes,
        "comparison": None,
    }
    stats = _graph_stats(runner)
    if stats is not None:
        report["cuda_graphs"] = stats
        reasons = ", ".join(f"{r}: {n}" for r, n in stats["eager_reasons"].items())
        notes.append(
            f"CUDA graphs at batch sizes {stats['batch_sizes']}"
            + (f" off ({stats['disabled']})" if stats["disabled"] else "")
            + f": {stats['num_replayed']} steps replayed, {stats['num_eager']} eager"
            + (f" ({reasons})" if reasons else "")
        )
    if baseline is None:
        return report
    comparison = compare(report, baseline, settings.threshold, baseline_name)
    by_id = {shape.id: (shape, index) for index, shape in enumerate(shapes)}
    for _ in range(settings.confirm):
        if not comparison.regressed:
            break
        for shape_id in comparison.regressed:
            shape, index = by_id[shape_id]
            again = shape_entry(measurer.measure(shape, settings.repeats, settings.warmup), peaks)
            first = entries[index]
            kept, dropped = sorted((first, again), key=lambda e: e["time"]["median_s"])
            kept["discarded_medians_s"] = first["discarded_medians_s"] + [
                dropped["time"]["median_s"]
            ]
            entries[index] = kept
            notes.append(
                f"re-measured {shape_id} (flagged): medians "
                f"{first['time']['median_s'] * 1e3:.3f} and "
                f"{again['time']['median_s'] * 1e3:.3f} ms, kept the lower"
            )
        comparison = compare(report, baseline, settings.threshold, baseline_name)
    report["comparison"] = {**comparison.to_dict(), "summary": comparison.summary()}
    return report


def _cuda_graph_sizes(runner: Any, settings: BenchSettings, shapes: list[Shape]) -> list[int]:
    """The decode batch sizes the runner captures for this run (``configure_cuda_graphs``,
    up to the largest shape's batch), for every shape's engine; [] with ``--enforce-eager`` or
    a runner without graphs (an MLX or parallel runner, a CPU or non-graph-safe one)."""
    configure = getattr(runner, "configure_cuda_graphs", None)
    if settings.enforce_eager or configure is None:
        return []
    longest = max(s.max_len_tokens for s in shapes) + settings.warmup + settings.repeats + 2
    sizes = configure(
        settings.cuda_graph_batch_sizes,
        max_num_seqs=max(s.batch_size for s in shapes),
        max_model_len=longest + 64,  # decode shapes add a few tokens past their context
    )
    return [int(b) for b in sizes]


def _graph_stats(runner: Any) -> dict[str, Any] | None:
    stats = getattr(runner, "cuda_graph_stats", None)
    return None if stats is None else stats()


def _graph_counts(runner: Any) -> dict[str, int]:
    stats = _graph_stats(runner) or {}
    return {"replayed": stats.get("num_replayed", 0), "eager": stats.get("num_eager", 0)}


def _host(settings: BenchSettings) -> dict[str, Any]:
    """The software and device the run measured: torch's (threads, CUDA name) or MLX's."""
    host: dict[str, Any] = {"python": platform.python_version()}
    if settings.runner == "mlx":
        from importlib.metadata import version

        import mlx.core as mx

        host.update(mlx=version("mlx"), mlx_device=str(mx.default_device()))
        device_name = platform.processor() or "cpu"
    else:
        import torch

        host.update(torch=torch.__version__, torch_num_threads=torch.get_num_threads())
        device_name = (
            torch.cuda.get_device_name(settings.device)
            if settings.device.startswith("cuda")
            else platform.processor() or "cpu"
        )
    host.update(device_name=device_name, platform=platform.platform())
    return host


def _git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def _first(*values: Any) -> Any:
    """The first value that is not None (command line, then perf.toml, then the default)."""
    return next(v for v in values if v is not None)


def _usage_error(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _machine_device() -> str:
    """``cuda`` when this machine has a CUDA device, else ``cpu``."""
    return "cuda" if _cuda_available() else "cpu"


def _default_out_dir(model: str) -> Path:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out, n = DEFAULT_REPORTS_DIR / f"{model}-{stamp}", 1
    while out.exists():
        n += 1
        out = DEFAULT_REPORTS_DIR / f"{model}-{stamp}-{n}"
    return out


def bench(
    model: Annotated[
        str,
        typer.Argument(
            help="Checkpoint directory, or a model name under models/ (see resin.evals.model_ref)."
        ),
    ],
    baseline: Annotated[
        Path | None,
        typer.Option(help="A previous report.json to compare with; exit 1 on a regression."),
    ] = None,
    spec_path: Annotated[
        Path | None,
        typer.Option(
            "--spec",
            help="A perf.toml to use instead of the model's own (e.g. a suite under "
            "evals/perf/suites/).",
        ),
    ] = None,
    shapes: Annotated[
        str | None,
        typer.Option(
            help="Shapes, e.g. 'decode:1,8,64@128,512 prefill:128,512 e2e:8@64+32'. Default: "
            f"perf.toml's, else {DEFAULT_SHAPES!r}."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Report directory. Default: evals/perf/reports/<model>-<UTC timestamp>/."
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="cpu or cuda[:N]. Default: perf.toml's, else cuda where there is one (cpu for mlx)."
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="float32, bfloat16 or float16. Default: perf.toml's, else float32."),
    ] = None,
    threshold: Annotated[
        float | None,
        typer.Option(
            help=f"Regression threshold, a fraction of the baseline median (default "
            f"{DEFAULT_THRESHOLD}); a regression must also exceed the measured noise."
        ),
    ] = None,
    repeats: Annotated[
        int | None, typer.Option(help=f"Timed repeats per shape (default {DEFAULT_REPEATS}).")
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option(help=f"Untimed repeats per shape first (default {DEFAULT_WARMUP})."),
    ] = None,
    confirm: Annotated[
        int,
        typer.Option(
            help="Re-measure a shape flagged as regressed up to N times and keep its faster run; "
            "a real regression persists, a burst of load from other processes does not."
        ),
    ] = 1,
    num_threads: Annotated[
        int | None,
        typer.Option(
            help="CPU only: torch threads (default: torch's). 1 is steadier on a shared machine."
        ),
    ] = None,
    attention_backend: Annotated[
        str | None,
        typer.Option(help="Attention backend of the torch runners (default: torch)."),
    ] = None,
    runner: Annotated[
        str | None,
        typer.Option(
            help="torch (default: the model registry's torch runner for MODEL) or mlx (the MLX "
            "runner on MODEL's checkpoint; --device cpu or gpu)."
        ),
    ] = None,
    models_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--models-dir",
            help="Directory of model directories to register, or one model directory "
            "(repeatable; also $RESIN_MODELS_PATH).",
        ),
    ] = None,
    speculative_method: Annotated[
        str | None,
        typer.Option(
            help="Speculative decoding in e2e shapes: ngram or mtp; the report adds the mean "
            "acceptance length and tokens per step. Default: off."
        ),
    ] = None,
    num_speculative_tokens: Annotated[
        int, typer.Option(help="Draft tokens per step with --speculative-method.")
    ] = 3,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(min=1, help="Built-in runner on N tensor-parallel ranks (gloo on CPU)."),
    ] = 1,
    expert_parallel_size: Annotated[
        int, typer.Option(min=1, help="A MoE checkpoint's experts dealt over N ranks.")
    ] = 1,
    context_parallel_size: Annotated[
        int, typer.Option(min=1, help="Long prefills split over N ranks (context parallelism).")
    ] = 1,
    data_parallel_size: Annotated[
        int,
        typer.Option(min=1, help="DP attention over N ranks (one engine each; e2e shapes)."),
    ] = 1,
    enforce_eager: Annotated[
        bool,
        typer.Option(
            "--enforce-eager", help="No CUDA graphs: every step eager (no capture, no padding)."
        ),
    ] = False,
    cuda_graph_batch_sizes: Annotated[
        str | None,
        typer.Option(
            help="Decode batch sizes to capture CUDA graphs at, e.g. 1,2,4,8 (default: 1, 2, 4, "
            "every 8 ... up to the largest shape's batch). Only a torch runner on CUDA with a "
            "graph-safe attention backend (triton) captures; the report counts the steps "
            "replayed vs run eager."
        ),
    ] = None,
) -> None:
    """Measure step times, tokens/s, engine overhead and % of roofline; compare with a baseline.

    Exit 0 ok, 1 a shape regressed against --baseline, 2 bad usage, 3 the run failed.
    """
    from resin.evals.model_ref import ModelRefError, resolve_model
    from resin.llm import parse_batch_sizes

    try:
        graph_sizes = parse_batch_sizes(cuda_graph_batch_sizes)
        ref = resolve_model(model, models_dirs=list(models_dir or ()))
        if spec_path is not None and not spec_path.is_file():
            raise ValueError(f"--spec {spec_path}: no such file")
        spec = (
            load_perf_spec(spec_path)
            if spec_path is not None
            else load_perf_spec(ref.perf_spec or None, base_dir=ref.model_dir)
        )
        # A checkpoint named on the command line is the one measured; a model named by its
        # directory or name runs its perf.toml's checkpoint.
        given = Path(model)
        named_checkpoint = (given / "config.json").is_file() and not (
            given / "architecture.json"
        ).is_file()
        checkpoint_dir = (
            ref.checkpoint_dir if named_checkpoint else (spec.checkpoint or ref.checkpoint_dir)
        )
        if not (Path(checkpoint_dir) / "config.json").is_file():
            raise ValueError(
                f"{spec.source or 'perf spec'}: [reference] checkpoint "
                f"{checkpoint_dir} has no config.json"
            )
        chosen = (
            parse_shapes(shapes)
            if shapes is not None
            else (spec.shapes or parse_shapes(DEFAULT_SHAPES))
        )
        model_config, dims_note = load_dims(checkpoint_dir, ref.model_dir)
    except (ModelRefError, ValueError, OSError) as exc:  # ConfigError is a ValueError
        raise _usage_error(str(exc)) from exc
    settings = BenchSettings(
        shapes=chosen,
        repeats=_first(repeats, spec.repeats, DEFAULT_REPEATS),
        warmup=_first(warmup, spec.warmup, DEFAULT_WARMUP),
        threshold=_first(threshold, spec.threshold, DEFAULT_THRESHOLD),
        device=_first(device, spec.device, "cpu" if runner == "mlx" else _machine_device()),
        dtype=_first(dtype, spec.dtype, "float32"),
        num_threads=_first(num_threads, spec.num_threads, 0) or None,
        confirm=confirm,
        runner=runner or "torch",
        speculative_method=speculative_method,
        num_speculative_tokens=num_speculative_tokens,
        enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=graph_sizes,
    )
    if speculative_method not in (None, "ngram", "mtp") or num_speculative_tokens < 1:
        raise _usage_error(
            f"--speculative-method {speculative_method!r} / --num-speculative-tokens "
            f"{num_speculative_tokens}: use ngram or mtp, and at least 1 token"
        )
    if settings.runner not in RUNNERS:
        raise _usage_error(f"--runner {runner!r}: use one of {', '.join(RUNNERS)}")
    if settings.runner == "mlx" and device is None:
        settings.device = "cpu"  # MLX: cpu or gpu (Metal); a perf.toml's cuda is not for it
    if settings.dtype not in DTYPE_BYTES:
        raise _usage_error(f"--dtype {settings.dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    if settings.runner == "mlx":
        if settings.device not in ("cpu", "gpu"):
            raise _usage_error(f"--device {settings.device!r} with --runner mlx: use cpu or gpu")
    elif not (settings.device == "cpu" or settings.device.startswith("cuda")):
        raise _usage_error(f"--device {settings.device!r}: use cpu or cuda[:N]")
    if settings.device.startswith("cuda") and not _cuda_available():
        where = (
            "--device" if device is not None else f"{spec.source or 'perf.toml'} [reference] device"
        )
        raise _usage_error(
            f"{where} = {settings.device!r}, but this machine has no CUDA device: "
            "pass --device cpu (and --dtype float32 for the CPU reference runner)"
        )
    if settings.repeats < 2 or min(settings.warmup, settings.threshold, confirm) < 0:
        raise _usage_error(
            "--repeats must be >= 2 (the noise needs two samples); --warmup, "
            "--threshold and --confirm >= 0"
        )
    base_report = None
    if baseline is not None:
        try:
            base_report = json.loads(baseline.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise _usage_error(f"cannot read baseline {baseline}: {exc}") from exc
        if base_report.get("schema") != SCHEMA:
            raise _usage_error(
                f"{baseline} is not a resin bench report (schema "
                f"{base_report.get('schema')!r}, expected {SCHEMA!r})"
            )
    command = shlex.join(
        [
            "resin",
            "bench",
            model,
            "--shapes",
            " ".join(s.id for s in settings.shapes),
            "--device",
            settings.device,
            "--dtype",
            settings.dtype,
            "--repeats",
            str(settings.repeats),
            "--warmup",
            str(settings.warmup),
        ]
        + ([] if settings.num_threads is None else ["--num-threads", str(settings.num_threads)])
        + ([] if settings.runner == "torch" else ["--runner", settings.runner])
        + (
            []
            if speculative_method is None
            else [
                "--speculative-method",
                speculative_method,
                "--num-speculative-tokens",
                str(num_speculative_tokens),
            ]
        )
        + (["--enforce-eager"] if enforce_eager else [])
        + (
            []
            if graph_sizes is None
            else ["--cuda-graph-batch-sizes", ",".join(map(str, graph_sizes))]
        )
    )
    ref.attention_backend = attention_backend
    started: list[Any] = []
    try:
        if settings.runner == "mlx":
            from resin.registry import resolve_runner

            def factory(path: str) -> Any:
                return resolve_runner(path, "mlx", device=settings.device, dtype=settings.dtype)

        else:
            factory = ref.runner_factory(settings.device, settings.dtype)
        sizes = (tensor_parallel_size, expert_parallel_size, context_parallel_size)
        if max(*sizes, data_parallel_size) > 1:
            factory = _parallel_factory(
                ref,
                tensor_parallel_size,
                expert_parallel_size,
                settings,
                started,
                context_parallel_size,
                data_parallel_size,
            )
            command += (
                f" --tensor-parallel-size {tensor_parallel_size}"
                f" --expert-parallel-size {expert_parallel_size}"
                f" --context-parallel-size {context_parallel_size}"
                f" --data-parallel-size {data_parallel_size}"
            )
        report = run_bench(
            ref.name,
            settings,
            lambda: factory(str(checkpoint_dir)),
            model_config,
            str(checkpoint_dir),
            command,
            base_report,
            str(baseline),
        )
    except ValueError as exc:
        raise _usage_error(str(exc)) from exc
    except RuntimeError as exc:
        typer.echo(f"error: the run failed: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    finally:
        for group in started:  # a parallel runner's workers, stopped after the run
            group.close()
    if dims_note is not None:
        report["notes"].append(dims_note)
    out_dir = out or _default_out_dir(ref.name)
    write_report(report, out_dir)
    typer.echo(summary(report, out_dir))
    if report["comparison"] is not None and not report["comparison"]["passed"]:
        raise typer.Exit(EXIT_REGRESSION)


def _parallel_factory(
    ref: Any,
    tp: int,
    ep: int,
    settings: BenchSettings,
    started: list[Any],
    cp: int = 1,
    dp: int = 1,
) -> Any:
    """``factory(checkpoint) -> runner`` on TP / EP ranks (the built-in families only)."""
    if settings.runner != "torch":
        raise ValueError("the parallel flags run the torch runners, not --runner mlx")
    if cp > 1 and max(tp, ep, dp) > 1:
        raise ValueError("--context-parallel-size runs alone (no TP / EP / DP with it)")
    if dp > 1 and (tp > 1 or ep not in (1, dp)):
        raise ValueError("--data-parallel-size: the experts over the same ranks, no TP")
    ep = dp if dp > 1 else ep
    if tp > 1 and ep > 1 and tp != ep:
        raise ValueError("--expert-parallel-size must equal --tensor-parallel-size, or run alone")

    def factory(checkpoint_dir: str) -> Any:
        from resin.runners.parallel import TensorParallelRunner

        runner = TensorParallelRunner(
            checkpoint_dir,
            max(tp, ep, cp, dp),
            device=settings.device,
            dtype=settings.dtype,
            num_threads=settings.num_threads,
            tensor_parallel=tp > 1,
            expert_parallel=ep > 1,
            context_parallel=cp > 1,
            data_parallel=dp > 1,
            model_directory=ref.model_dir,
        )
        started.append(runner)
        return runner

    return factory
