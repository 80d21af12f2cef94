"""The few facts every entry point needs from any checkpoint's ``config.json``.

Owns :class:`CheckpointInfo` and :func:`read_checkpoint_info`: the architecture, model type,
vocabulary size and context length of a checkpoint of *any* architecture (the full parse,
:func:`resin.loading.load_model_config`, knows only the built-in families). Multimodal wrappers
that nest the text model's settings under ``text_config`` are read from there. Pure stdlib.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resin.loading.fields import ConfigError, read_dtype_field

DEFAULT_MAX_POSITION_EMBEDDINGS = 2048


@dataclass(frozen=True)
class CheckpointInfo:
    """``architecture``: ``architectures[0]`` ('' when absent); ``raw``: the whole config.json."""

    path: Path
    architecture: str
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def read_checkpoint_info(checkpoint_dir: str | Path) -> CheckpointInfo:
    """Read ``checkpoint_dir/config.json`` (or a ``config.json`` path); ConfigError naming the
    file and the field when it is unreadable, lacks ``model_type`` / ``vocab_size``, or names a
    ``dtype`` / ``torch_dtype`` that is not a dtype."""
    path = Path(checkpoint_dir)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    nested = raw.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else {}

    def pick(name: str) -> Any:
        return raw.get(name) if raw.get(name) is not None else text.get(name)

    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{path}: no 'model_type'")
    vocab_size = pick("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ConfigError(f"{path}: 'vocab_size' must be a positive integer, got {vocab_size!r}")
    read_dtype_field(raw, where=str(path))  # an unknown dtype name: refused by name
    if isinstance(nested, dict):
        read_dtype_field(nested, where=f"{path} text_config")
    max_positions = pick("max_position_embeddings")
    if not isinstance(max_positions, int) or max_positions <= 0:
        max_positions = DEFAULT_MAX_POSITION_EMBEDDINGS
    return CheckpointInfo(
        path=path.parent,
        architecture=str(architectures[0]) if architectures else "",
        model_type=model_type,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        raw=raw,
    )
