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


def built_checkpoint(
    tiny: Path, path: Path, config: dict[str, Any], seed: int = 1234, as_given: bool = True
) -> Path:
    """New weights for ``config`` (a config.json dict with its ``model_type``) at ``path``:
    transformers' own model class for it with the scaffold's seeded weight scales
    (``reinit_weights``), saved by ``save_pretrained`` (its tensor names), the tokenizer and
    generation config of the tiny checkpoint ``tiny`` beside it. ``as_given``: config.json
    is ``config`` as written, not the one HF writes back."""
    import torch
    import transformers

    from resin.scaffold.tiny_checkpoint import reinit_weights

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        reinit_weights(model, seed)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny / name).is_file():
            shutil.copyfile(tiny / name, path / name)
    if as_given:
        (path / "config.json").write_text(json.dumps(config))
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
