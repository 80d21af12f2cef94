"""``resin new-model SOURCE --name NAME [--out DIR] [--tiny]``: the scaffold generator command.

Owns the command and :func:`new_model`, the same steps from Python: inspect SOURCE's
architecture on the meta device, optionally write a tiny random-weight checkpoint into
``OUT/tiny/`` (with ``OUT/tiny/CHANGES.md``, every change from the source config; the lines go to
the NOTES.md template as ``tiny_changes`` when ``render_model`` takes extra context), and render
the model directory into OUT (default ``models/NAME``: its blocks, layer map, weight map and
specs; the shared runner runs it). The summary's ``warnings`` include one
line per HF module the scaffold does not place (``inspect.unplaced_warnings``). Refuses to
overwrite an existing model directory (``architecture.json``, or an old-layout ``runner.py``)
unless ``--force``. torch and transformers are imported
only when the command runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

TINY_DIR = "tiny"
# Files that mark a generated model directory (the model record; runner.py of the old layout).
MODEL_MARKERS = ("architecture.json", "runner.py")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def new_model(
    source: str | Path, name: str, out: Path | None = None, tiny: bool = False, force: bool = False
) -> dict[str, Any]:
    """Generate ``models/NAME`` (or ``out``); returns a summary (paths, stubs, assumed blocks)."""
    if not _NAME.match(name):
        raise ValueError(
            f"--name {name!r}: use letters, digits and underscores "
            "(it becomes a directory and a Python package name)"
        )
    source_path = Path(source)
    if not (source_path / "config.json").is_file() and not (
        source_path.is_file() and source_path.suffix == ".json"
    ):
        raise FileNotFoundError(f"{source}: expected an HF checkpoint directory or a config.json")
    out_dir = Path(out) if out is not None else Path("models") / name
    for marker in MODEL_MARKERS:
        if (out_dir / marker).exists() and not force:
            raise FileExistsError(f"{out_dir / marker} exists: pass --force to overwrite")

    from resin.scaffold.inspect import inspect_architecture, unplaced_warnings
    from resin.scaffold.render import blocks_of, render_model

    arch = inspect_architecture(source_path)
    checkpoint_dir = source_path if source_path.is_dir() else source_path.parent
    has_weights = any(checkpoint_dir.glob("*.safetensors"))
    tiny_changes: list[str] = []
    if tiny:
        from resin.scaffold.tiny_checkpoint import make_tiny_checkpoint

        # the meta model's config object was mutated by the build (attn implementation):
        # shrink a fresh copy of the source config
        tiny_changes = make_tiny_checkpoint(source_path, out_dir / TINY_DIR).changes
        reference = TINY_DIR
    else:
        reference = str(checkpoint_dir.resolve()) if has_weights else TINY_DIR
    # bench measures the real checkpoint when SOURCE has weights, else the tiny one
    perf = str(checkpoint_dir.resolve()) if has_weights else TINY_DIR
    extra = {"tiny_changes": tiny_changes} if _accepts_extra(render_model) else {}
    probe, probe_warning = _probe_architecture(source_path)
    written = render_model(
        arch, name, out_dir, str(source), tiny, reference, perf, probe=probe, **extra
    )
    blocks = blocks_of(arch)
    warnings = list(unplaced_warnings(arch)) + ([probe_warning] if probe_warning else [])
    if not tiny and not has_weights:
        warnings.append(
            f"{source} has no weights and --tiny was not given: parity.toml points "
            f"at {out_dir / TINY_DIR}, which does not exist (rerun with --tiny, or "
            "set [reference] checkpoint)"
        )
    return {
        "out_dir": out_dir,
        "files": written,
        "architecture": arch.architecture,
        "reference_checkpoint": reference,
        "warnings": warnings,
        "tiny_changes": tiny_changes,
        "stubs": [(b.fn, b.cls_name, b.short_where) for b in blocks if b.stub],
        "assumed": [(b.fn, b.cls_name, b.short_where) for b in blocks if b.assumed],
    }


def _accepts_extra(fn: Any) -> bool:
    """Whether ``fn`` takes ``**kwargs`` (render_model's extra template context)."""
    import inspect

    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()
    )


def new_model_command(
    source: Annotated[Path, typer.Argument(help="HF checkpoint directory or config.json path.")],
    name: Annotated[str, typer.Option("--name", help="Model name: the directory under models/.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Output directory (default models/NAME).")
    ] = None,
    tiny: Annotated[
        bool,
        typer.Option(
            "--tiny",
            help="Also write a tiny random-weight checkpoint "
            "into OUT/tiny/ and use it as the parity reference.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite an existing model directory.")
    ] = False,
) -> None:
    """Generate a model directory for an HF architecture: blocks, layer map, weight map, specs."""
    try:
        summary = new_model(source, name, out, tiny, force)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    typer.echo(
        f"{summary['architecture']} -> {summary['out_dir']}/ "
        f"({', '.join(p.name for p in summary['files'])})"
    )
    if tiny:
        typer.echo(
            f"tiny checkpoint: {summary['out_dir']}/{TINY_DIR}/ "
            f"({len(summary['tiny_changes'])} changes from the source config: "
            f"{summary['out_dir']}/{TINY_DIR}/CHANGES.md)"
        )
    for warning in summary["warnings"]:
        typer.echo(f"warning: {warning}")
    if summary["stubs"] or summary["assumed"]:
        for fn, cls, where in summary["stubs"]:
            typer.echo(f"  STUB     blocks.{fn}  ({cls}, {where})")
        for fn, cls, where in summary["assumed"]:
            typer.echo(f"  ASSUMED  blocks.{fn}  ({cls}, {where})")
        typer.echo("fill these in (see NOTES.md), then run parity:")
    else:
        typer.echo("every block is one Resin has; run parity:")
    typer.echo(f"  resin eval parity {summary['out_dir']} --json /tmp/{name}_parity.json")


def _probe_architecture(source: Path) -> tuple[Any, str | None]:
    """The architecture at the tiny widths: with the source's, it turns every tensor shape into
    a formula of config fields the runner checks at load (``architecture.json`` shape rules).
    A config the shrink cannot build leaves the rules out, with a warning."""
    from resin.scaffold.inspect import inspect_architecture
    from resin.scaffold.tiny_checkpoint import shape_probe_config, tiny_config

    for head_dim in (True, False):  # an explicit head width, then the tiny's
        try:
            probe = shape_probe_config(source, head_dim=head_dim)
            return inspect_architecture(probe, probe_shapes=False), None
        except Exception:  # noqa: BLE001 - a model that refuses the probe's widths: fall back
            pass
    try:
        return inspect_architecture(tiny_config(source), probe_shapes=False), None
    except Exception as exc:  # noqa: BLE001 - the rules are a check, not a requirement
        return None, (
            f"no shape rules in architecture.json (the shrunk probe config does not "
            f"build: {type(exc).__name__}: {exc}); tensor shapes are not checked at load"
        )
