"""The ``resin`` command line (typer): ``version``, ``info``, ``models``, ``generate``, ``serve``,
``new-model``, ``bench`` and the ``eval`` group.

Importing this module (and ``import resin``) never imports torch: commands that need it import
what they use inside the command function. Every command that runs a model resolves its runner
through the model registry (:mod:`resin.registry`). The ``eval`` sub-commands live in
``resin.evals.cli`` (a typer app named ``eval_app``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

app = typer.Typer(
    name="resin",
    help="Resin: bring up LLMs on new hardware — engine, runners, parity and perf harnesses.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print the Resin version."""
    import resin

    typer.echo(resin.__version__)


@app.command()
def info() -> None:
    """Print what this install provides (engine core build, Python, numpy)."""
    import platform

    import numpy as np

    import resin

    typer.echo(f"resin {resin.__version__}")
    typer.echo(f"python {platform.python_version()}  numpy {np.__version__}")
    typer.echo(f"engine core: {resin._core.__file__}")


@app.command()
def models(
    models_dir: list[Path] | None = typer.Option(
        None, "--models-dir", help="Directory of model directories to register (repeatable)."
    ),
) -> None:
    """List the registered models (user directories, shipped models, built-in families) and the
    architectures each one runs, in lookup order."""
    from resin.registry import ModelRegistry

    try:
        registry = ModelRegistry(models_dir or ())
    except ValueError as exc:  # a broken architecture.json
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    for line in registry.describe():
        typer.echo(line)


@app.command()
def generate(
    model: Path = typer.Argument(
        ..., help="Checkpoint directory (config.json, safetensors, tokenizer.json)."
    ),
    prompt: str = typer.Option(
        ..., "--prompt", "-p", help="Prompt text (or the user message with --chat)."
    ),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=1, help="Tokens to generate."),
    temperature: float | None = typer.Option(
        None,
        "--temperature",
        "-t",
        min=0.0,
        help="Sampling temperature; 0 = greedy. Default: the checkpoint's generation config.",
    ),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed (reproducible output)."),
    chat: bool = typer.Option(
        False, "--chat", help="Wrap the prompt as a user message with the chat template."
    ),
    device: str = typer.Option(
        "cpu", "--device", help="Device: cpu or cuda (torch runners); cpu or gpu (--runner mlx)."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    runner: str | None = typer.Option(
        None,
        "--runner",
        help="Runner (default: the model "
        "registry's for the checkpoint's architecture): torch, "
        'mlx (Apple\'s MLX; pip install mlx, or "mlx[cpu]" on Linux), '
        "a registered model name, a model directory, or "
        "module:Class.",
    ),
    models_dir: list[Path] | None = typer.Option(
        None, "--models-dir", help="Directory of model directories to register (repeatable)."
    ),
    attention_backend: str | None = typer.Option(
        None,
        "--attention-backend",
        help="Attention backend of the torch runners (default: torch).",
    ),
) -> None:
    """Generate text from MODEL for one prompt and print it."""
    import resin
    from resin.llm import LLM

    try:
        llm = LLM(
            model,
            device=device,
            dtype=dtype,
            max_num_seqs=1,
            runner=runner,
            models_dirs=models_dir or (),
            attention_backend=attention_backend,
        )
    except (FileNotFoundError, ValueError, KeyError, NotImplementedError) as exc:
        # missing files, an architecture no registered model runs, an unfinished model
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from exc
    settings: dict[str, Any] = {**llm.tokenizer.sampling_defaults, "max_tokens": max_tokens}
    if temperature is not None:
        settings["temperature"] = temperature
    if seed is not None:
        settings["seed"] = seed
    try:
        params = resin.SamplingParams(**settings)
        if chat:
            output = llm.chat([{"role": "user", "content": prompt}], params)[0]
        else:
            output = llm.generate(prompt, params)[0]
    except ValueError as exc:  # bad sampling values, a prompt longer than max_model_len
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from exc
    typer.echo(output.text)


def _register_eval_commands() -> None:
    """Add ``resin eval ...`` from ``resin.evals.cli`` when it is installed (it may not exist yet)."""
    try:
        from resin.evals.cli import eval_app
    except ImportError:
        return
    app.add_typer(eval_app, name="eval", help="Evaluations: parity against HF transformers.")


_register_eval_commands()


def _register_new_model_command() -> None:
    """Add ``resin new-model`` (the scaffold generator) from ``resin.scaffold.cli``."""
    try:
        from resin.scaffold.cli import new_model_command
    except ImportError:
        return
    app.command(name="new-model")(new_model_command)


_register_new_model_command()


def _register_bench_command() -> None:
    """Add ``resin bench`` from ``resin.evals.perf`` when it is installed (torch and matplotlib
    are imported only when the command runs)."""
    try:
        from resin.evals.perf import bench
    except ImportError:
        return
    app.command("bench")(bench)


_register_bench_command()


def _register_serve_command() -> None:
    """Add ``resin serve`` from ``resin.server.cli`` (FastAPI and uvicorn load when it runs)."""
    from resin.server.cli import serve

    app.command("serve")(serve)


_register_serve_command()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
