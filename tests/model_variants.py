"""Variants of a model directory's committed tiny checkpoint, and its parity run, for the
per-model tests (tests/test_<model>.py): one copy of what each of them used to define.

Imports torch (through the parity harness) only when a function runs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def tiny_variant(
    tiny: Path,
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    tensors: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> Path:
    """A copy of the tiny checkpoint ``tiny`` under ``tmp_path`` (named after its model
    directory) with its config.json edited in place by ``edit`` and, when given, its tensors
    changed by ``tensors(old)`` (in place, or the dict it returns)."""
    path = tmp_path / tiny.parent.name
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        weights = path / "model.safetensors"
        old = load_file(str(weights))
        new = tensors(old)
        save_file(old if new is None else new, str(weights), metadata={"format": "pt"})
    return path


def model_parity(
    model_dir: Path,
    checkpoint: Path | None = None,
    dtype: str = "float32",
    layers_only: bool = False,
    attention_backend: str | None = None,
) -> Any:
    """``resin eval parity`` of ``model_dir`` on its tiny checkpoint (or ``checkpoint``), in
    ``dtype``; ``layers_only``: the layers and logits stages, no greedy ones."""
    from resin.evals.model_ref import resolve_model, run_model_parity

    ref = resolve_model(model_dir)
    if attention_backend is not None:
        ref.attention_backend = attention_backend
    return run_model_parity(
        ref, dtype=dtype, checkpoint=checkpoint, checks=("layers",) if layers_only else None
    )
