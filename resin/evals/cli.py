"""``resin eval ...``: the typer sub-app the main CLI registers under ``eval``.

``resin eval parity MODEL_DIR [--runner torch] [--json PATH]`` runs the parity harness
(:func:`resin.evals.parity.run_parity`), prints its summary, optionally writes the JSON
report, and exits 0 only when every stage passes (1 on a parity failure, 2 on bad usage).
torch and transformers are imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

eval_app = typer.Typer(name="eval", help="Evaluate a runner: parity with HF transformers.",
                       no_args_is_help=True, add_completion=False)

RUNNERS = ("torch",)


@eval_app.callback()
def _group() -> None:
    """Evaluate a runner (a callback keeps ``parity`` a sub-command even while it is the only one)."""


def _runner_factory(runner: str, dtype: str, device: str) -> Any:
    if runner != "torch":
        raise typer.BadParameter(f"unknown runner {runner!r}; known: {', '.join(RUNNERS)}",
                                 param_hint="--runner")

    def factory(model_dir: str) -> Any:
        import torch

        from resin.runners.torch import TorchRunner

        return TorchRunner.from_pretrained(model_dir, device=device,
                                           dtype=getattr(torch, dtype))

    return factory


@eval_app.command()
def parity(
    model_dir: Annotated[Path, typer.Argument(help="HF checkpoint directory (config.json + safetensors).")],
    runner: Annotated[str, typer.Option(help="Runner to check against HF transformers.")] = "torch",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the JSON report here.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt in the engine stages.")] = 8,
    dtype: Annotated[str, typer.Option(help="Runner dtype: float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="Runner device (the HF reference stays on CPU).")] = "cpu",
) -> None:
    """Check a runner against HF transformers: per-layer diffs, logits, greedy tokens under stress."""
    if not (model_dir / "config.json").is_file():
        raise typer.BadParameter(f"{model_dir} has no config.json", param_hint="MODEL_DIR")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise typer.BadParameter(f"unsupported dtype {dtype!r}", param_hint="--dtype")
    from resin.evals.parity import run_parity

    report = run_parity(model_dir, runner_factory=_runner_factory(runner, dtype, device),
                        max_new_tokens=max_new_tokens, runner_name=runner, dtype=dtype)
    typer.echo(report.summary())
    if json_path is not None:
        json_path.write_text(report.to_json() + "\n")
        typer.echo(f"report written to {json_path}")
    raise typer.Exit(0 if report.passed else 1)
