"""The ``resin`` command line (typer). Later issues add serve, generate, new-model, eval, bench."""

from __future__ import annotations

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
