"""``resin eval ...``: the typer sub-app the main CLI registers under ``eval``.

``resin eval parity MODEL [--runner torch|model|mlx] [--json PATH]`` runs the parity harness
(:func:`resin.evals.parity.run_parity`), prints its summary, optionally writes the JSON
report, and exits 0 only when every stage passes (1 on a parity failure, or a runner that
cannot be built — a stub raising NotImplementedError, a checkpoint it rejects; 2 on bad usage).
MODEL is resolved by :func:`resin.evals.model_ref.resolve_model`: an HF checkpoint directory
runs the torch reference runner; a model directory or a name under ``models/`` (made by
``resin new-model``) runs the shared runner on that model's blocks, with the checkpoint,
tolerances and stress settings of its ``parity.toml``
(command-line options override the file). ``--runner mlx`` runs the MLX runner
(:mod:`resin.runners.mlx`) on the same checkpoint, with the same ``parity.toml`` settings when
MODEL is a model directory (gpt_oss). ``--checkpoint DIR`` runs the same runner and settings
on another HF checkpoint (e.g. the real weights instead of ``tiny/``) without editing
``parity.toml``. An HF reference that cannot load or run is a failed stage (``reference`` /
``reference crashed: ...``), exit 1, never a traceback. torch and transformers are imported
only when the command runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from resin.evals.model_ref import ModelRef

eval_app = typer.Typer(
    name="eval",
    help="Evaluate a runner: parity with HF transformers.",
    no_args_is_help=True,
    add_completion=False,
)

RUNNERS = ("torch", "model", "mlx")
DTYPES = ("float32", "bfloat16", "float16")


@eval_app.callback()
def _group() -> None:
    """Evaluate a runner (a callback keeps ``parity`` a sub-command even while it is the only one)."""


def _runner_factory(
    runner: str, dtype: str, device: str, attention_backend: str | None = None
) -> Any:
    if runner == "mlx":

        def mlx_factory(model_dir: str) -> Any:
            from resin.registry import resolve_runner

            return resolve_runner(
                model_dir, "mlx", device=device, dtype=dtype, attention_backend=attention_backend
            )

        return mlx_factory
    if runner != "torch":
        raise typer.BadParameter(
            f"unknown runner {runner!r}; known: {', '.join(RUNNERS)}", param_hint="--runner"
        )

    def factory(model_dir: str) -> Any:
        import torch

        from resin.runners.torch import TorchRunner

        return TorchRunner.from_pretrained(
            model_dir,
            device=device,
            dtype=getattr(torch, dtype),
            attention_backend=attention_backend,
        )

    return factory


@eval_app.command()
def parity(
    model: Annotated[
        str,
        typer.Argument(
            help="HF checkpoint directory, a models/NAME directory, or a model NAME under models/."
        ),
    ],
    runner: Annotated[
        str | None,
        typer.Option(
            help="torch (the built-in reference runner), model (MODEL's own model directory), "
            "mlx (the MLX runner), or another registered model name or model directory to run "
            "MODEL's checkpoint with. Default: the model registry's choice for the checkpoint."
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the JSON report here.")
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help="Greedy tokens per prompt in the engine stages (default: parity.toml, else 8)."
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Runner dtype: float32, bfloat16 or float16 (default: parity.toml, else float32)."
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="Runner device; the HF reference stays on CPU (default: parity.toml, else cpu)."
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="Check this HF checkpoint directory (config.json + safetensors) "
            "instead of parity.toml's [reference] checkpoint; needs a model NAME or directory.",
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
    attention_backend: Annotated[
        str | None,
        typer.Option(help="Attention backend of the torch runners (default: reference)."),
    ] = None,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            min=1, help="Run the built-in runner on N tensor-parallel ranks (gloo on CPU)."
        ),
    ] = 1,
    expert_parallel_size: Annotated[
        int,
        typer.Option(min=1, help="Deal a MoE checkpoint's experts over N ranks."),
    ] = 1,
    context_parallel_size: Annotated[
        int,
        typer.Option(min=1, help="Split long prefills over N ranks (context parallelism)."),
    ] = 1,
    data_parallel_size: Annotated[
        int,
        typer.Option(min=1, help="DP attention over N ranks (one engine each, MoE shared)."),
    ] = 1,
) -> None:
    """Check a runner against HF transformers: per-layer diffs, logits, greedy tokens under stress."""
    from resin.evals.model_ref import ModelRefError, resolve_model

    if dtype is not None and dtype not in DTYPES:
        raise typer.BadParameter(f"unsupported dtype {dtype!r}", param_hint="--dtype")
    dirs = list(models_dir or ())
    try:
        ref = resolve_model(model, models_dirs=dirs)
        if runner is not None and runner not in RUNNERS:
            # another model's blocks (and its parity.toml) on MODEL's checkpoint
            other = resolve_model(runner, models_dirs=dirs)
            if other.model_dir is None:
                raise ModelRefError(f"--runner {runner}: not a model directory or name")
            ref = dataclasses.replace(other, checkpoint_dir=ref.checkpoint_dir)
    except ModelRefError as exc:
        raise typer.BadParameter(str(exc), param_hint="MODEL / --runner") from exc
    ref.attention_backend = attention_backend
    if runner == "model" and ref.model_dir is None:
        raise typer.BadParameter(
            f"{model} is a checkpoint, not a models/NAME directory: it has "
            "no model directory (use --runner torch)",
            param_hint="--runner",
        )
    if checkpoint is not None:
        ref = _with_checkpoint(ref, model, checkpoint)
    parallel = (
        tensor_parallel_size,
        expert_parallel_size,
        context_parallel_size,
        data_parallel_size,
    )
    try:
        if max(parallel) > 1:
            report = _run_parallel(ref, parallel, dtype, device, max_new_tokens)
        else:
            report = _run(ref, runner, dtype, device, max_new_tokens, attention_backend)
    except (NotImplementedError, ValueError) as exc:
        # The runner could not be built: a stub in models/NAME/blocks.py hit while loading, or
        # a checkpoint it rejects (ConfigError / WeightsError are ValueErrors). run_parity
        # itself reports parity failures in the report, never as exceptions.
        error = (
            "runner not finished"
            if isinstance(exc, NotImplementedError)
            else "runner failed to load"
        )
        typer.echo(f"parity FAIL: {error}: {exc}", err=True)
        if json_path is not None:
            runner_name = runner if runner in ("torch", "mlx") else ref.runner_name
            json_path.write_text(
                json.dumps(
                    {
                        "model_dir": str(ref.checkpoint_dir),
                        "runner": runner_name,
                        "passed": False,
                        "error": error,
                        "detail": str(exc),
                    },
                    indent=2,
                )
                + "\n"
            )
        raise typer.Exit(1) from exc
    typer.echo(report.summary())
    if json_path is not None:
        json_path.write_text(report.to_json() + "\n")
        typer.echo(f"report written to {json_path}")
    raise typer.Exit(0 if report.passed else 1)


def _with_checkpoint(ref: Any, model: str, checkpoint: Path) -> Any:
    """``ref`` with its checkpoint replaced by ``checkpoint`` (``--checkpoint``)."""
    if ref.model_dir is None:
        raise typer.BadParameter(
            f"{model} is itself a checkpoint; --checkpoint needs a model "
            "NAME or directory (pass the checkpoint as MODEL instead)",
            param_hint="--checkpoint",
        )
    path = checkpoint.expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise typer.BadParameter(
            f"{checkpoint}: not an HF checkpoint directory (no config.json)",
            param_hint="--checkpoint",
        )
    if dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        return dataclasses.replace(ref, checkpoint_dir=path)
    ref.checkpoint_dir = path
    return ref


def _run_parallel(
    ref: Any,
    sizes: tuple[int, int, int, int],
    dtype: str | None,
    device: str | None,
    max_new_tokens: int | None,
) -> Any:
    """Parity of the built-in runner on TP / EP ranks: one group for every stage (a process
    holds one), rank 0 capturing for the layers stage."""
    from resin.evals.parity import run_parity
    from resin.runners.parallel import TensorParallelRunner

    tp, ep, cp, dp = sizes
    if cp > 1 and max(tp, ep, dp) > 1:
        raise ValueError("--context-parallel-size runs alone (no TP / EP / DP with it)")
    if dp > 1 and (tp > 1 or ep not in (1, dp)):
        raise ValueError("--data-parallel-size: the experts over the same ranks, no TP")
    ep = dp if dp > 1 else ep
    if tp > 1 and ep > 1 and tp != ep:
        raise ValueError("--expert-parallel-size must equal --tensor-parallel-size, or run alone")
    group: dict[str, Any] = {}

    def factory(model_dir: str) -> Any:
        if model_dir not in group:
            for old in group.values():
                old.close()
            group.clear()
            group[model_dir] = TensorParallelRunner(
                model_dir,
                max(tp, ep, cp, dp),
                device=device or "cpu",
                dtype=dtype or "float32",
                tensor_parallel=tp > 1,
                expert_parallel=ep > 1,
                context_parallel=cp > 1,
                data_parallel=dp > 1,
                model_directory=ref.model_dir,
            )
        return group[model_dir]

    try:
        return run_parity(
            ref.checkpoint_dir,
            runner_factory=factory,
            max_new_tokens=max_new_tokens or 8,
            runner_name=f"torch tp{tp} ep{ep} cp{cp} dp{dp}",
            dtype=dtype or "float32",
        )
    finally:
        for runner in group.values():
            runner.close()


def _run(
    ref: Any,
    runner: str | None,
    dtype: str | None,
    device: str | None,
    max_new_tokens: int | None,
    attention_backend: str | None = None,
) -> Any:
    from resin.evals.model_ref import run_model_parity
    from resin.evals.parity import run_parity
    from resin.runners.torch.attention import PARITY_BACKEND

    if ref.model_dir is not None and runner == "mlx":
        # the model directory's parity.toml settings, the MLX runner on its checkpoint
        fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref)}
        return run_model_parity(
            _MlxModelRef(**fields), dtype=dtype, device=device, max_new_tokens=max_new_tokens
        )
    if ref.model_dir is not None and runner != "torch":
        return run_model_parity(ref, dtype=dtype, device=device, max_new_tokens=max_new_tokens)
    dtype = dtype or "float32"
    framework = "mlx" if runner == "mlx" else "torch"
    return run_parity(
        ref.checkpoint_dir,
        runner_factory=_runner_factory(
            framework,
            dtype,
            device or "cpu",
            attention_backend or (PARITY_BACKEND if framework == "torch" else None),
        ),
        max_new_tokens=max_new_tokens or 8,
        runner_name=framework,
        dtype=dtype,
    )


@dataclasses.dataclass
class _MlxModelRef(ModelRef):
    """A model directory's reference (its checkpoint and parity.toml) run by the MLX runner
    instead of the directory's torch blocks."""

    @property
    def runner_name(self) -> str:
        return "mlx"

    def runner_factory(
        self, device: str = "cpu", dtype: Any = "float32", default_backend: str | None = None
    ) -> Any:
        return _runner_factory("mlx", str(dtype), device, self.attention_backend)
