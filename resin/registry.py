"""The model registry: one place that maps a checkpoint to the runner that runs it.

Owns :class:`ModelRegistry` and :func:`resolve_runner`, which every entry point goes through
(``resin.LLM``, ``resin generate``, ``resin serve``, ``resin eval parity``, ``resin bench``).
Entries, highest precedence first:

1. **user model directories** — each directory given with ``--models-dir`` / ``models_dirs=``,
   then each of ``$RESIN_MODELS_PATH`` (``os.pathsep``-separated), then ``./models``: a
   directory that holds ``architecture.json`` is one model; any other directory is scanned for
   model directories one level down (so ``resin new-model --out ~/my_models/x`` is usable at
   once with ``--models-dir ~/my_models``);
2. **shipped models** — the model directories inside the package (``resin/models/NAME``:
   gpt_oss, ...), package data of the wheel;
3. **built-in families** — Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral: the torch
   reference runner (:class:`resin.runners.torch.TorchRunner`), registered as ``torch``.

A checkpoint resolves by ``architectures[0]``, else by ``model_type``; the first entry that
claims it wins (two user directories claiming one architecture at the same level: the earlier
one, with a warning naming both). An unknown architecture raises
:class:`UnknownArchitectureError` listing what is registered and how to add a model
(``resin new-model``). A checkpoint whose ``architectures[0]`` and ``model_type`` name two
different registered families (transformers builds it from ``model_type``), or whose
``generation_config.json`` has a malformed sampling field, raises ``ConfigError`` naming the
field. An explicit runner (``--runner NAME``) overrides the lookup: ``torch``,
``mlx`` (the MLX runner, :mod:`resin.runners.mlx`: the built-in families and gpt-oss on Apple's
MLX; without MLX installed, an error naming the package to install), ``null`` (no model: cycles
ordinary tokens, for measuring the server), a registered model name, a model directory path, or
``module:Class``. ``torch`` and ``mlx`` always mean those runners, whatever a user directory is
called.

Importing this module is pure stdlib (records are JSON files); torch (or MLX) loads when a
runner is built.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resin.loading.checkpoint_info import CheckpointInfo, read_checkpoint_info
from resin.loading.fields import ConfigError
from resin.loading.generation_config import check_generation_config

RECORD_FILE = "architecture.json"
MODELS_PATH_ENV = "RESIN_MODELS_PATH"
SHIPPED_MODELS_DIR = Path(__file__).resolve().parent / "models"
BUILTIN_NAME = "torch"
MLX_RUNNER = "mlx"
NULL_RUNNER = "null"
NULL_RUNNER_TEXT = " the quick brown fox jumps over the lazy dog and"
# The built-in families (resin.loading parses these and the torch reference runner runs them).
BUILTIN_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


class UnknownArchitectureError(ValueError):
    """No registered model runs this checkpoint's architecture."""


@dataclass(frozen=True)
class ModelEntry:
    """One registered model. ``model_dir`` is None for the built-in families."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    origin: str  # "user", "shipped" or "built-in"
    model_dir: Path | None = None

    def claims(self, info: CheckpointInfo) -> bool:
        """By ``architectures[0]``, else by ``model_type`` (what transformers builds from): a
        text-only checkpoint of a multimodal family (``Qwen3_5ForCausalLM``, model_type
        ``qwen3_5_text``) runs on the wrapper's model directory, whose text model it is."""
        if info.architecture and info.architecture in self.architectures:
            return True
        return info.model_type in self.model_types

    def load_runner(
        self,
        checkpoint_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: Any = "float32",
        attention_backend: Any = None,
    ) -> Any:
        """Build this model's runner on ``checkpoint_dir`` (imports torch)."""
        torch_dtype = _torch_dtype(dtype)
        if self.model_dir is None:
            from resin.runners.torch import TorchRunner

            return TorchRunner.from_pretrained(
                checkpoint_dir,
                device=device,
                dtype=torch_dtype,
                attention_backend=attention_backend,
            )
        from resin.runners.torch.model_dir import ModelDirRunner

        return ModelDirRunner.from_model_dir(
            self.model_dir,
            checkpoint_dir,
            name=self.name,
            device=device,
            dtype=torch_dtype,
            attention_backend=attention_backend,
        )

    def describe(self) -> str:
        where = f" ({self.model_dir})" if self.model_dir is not None else ""
        return f"{self.name} [{self.origin}]{where}: {', '.join(self.architectures)}"


class ModelRegistry:
    """Every registered model (see the module doc), scanned once at construction."""

    def __init__(
        self, models_dirs: Iterable[str | Path] = (), *, use_env: bool = True, use_cwd: bool = True
    ) -> None:
        roots: list[Path] = [Path(d).expanduser() for d in models_dirs]
        for root in roots:  # an explicit directory that is not there is a typo, say so
            if not root.is_dir():
                warnings.warn(f"--models-dir {root}: no such directory", stacklevel=2)
        if use_env:
            roots += [
                Path(p).expanduser()
                for p in os.environ.get(MODELS_PATH_ENV, "").split(os.pathsep)
                if p
            ]
        if use_cwd:
            roots.append(Path.cwd() / "models")
        self.user_roots = roots
        self.skipped: list[str] = []  # model directories whose record could not be read
        entries: list[ModelEntry] = []
        seen: set[Path] = set()
        for origin, root_list in (("user", roots), ("shipped", [SHIPPED_MODELS_DIR])):
            for root in root_list:
                for model_dir in _model_dirs(root):
                    resolved = model_dir.resolve()
                    if resolved in seen:
                        continue
                    seen.add(resolved)
                    is_shipped = resolved.is_relative_to(SHIPPED_MODELS_DIR.resolve())
                    try:
                        entries.append(_entry_of(model_dir, "shipped" if is_shipped else origin))
                    except ValueError as exc:  # one broken directory must not stop the rest
                        warnings.warn(f"model directory skipped: {exc}", stacklevel=2)
                        self.skipped.append(str(exc))
        entries.sort(key=lambda e: ("user", "shipped").index(e.origin))
        entries.append(
            ModelEntry(
                BUILTIN_NAME,
                tuple(BUILTIN_ARCHITECTURES),
                tuple(BUILTIN_ARCHITECTURES.values()),
                "built-in",
            )
        )
        self.entries = entries

    def get(self, name: str) -> ModelEntry | None:
        """The entry registered under ``name`` (a model directory's name, or ``torch``)."""
        return next((e for e in self.entries if e.name == name), None)

    def for_checkpoint(self, checkpoint_dir: str | Path) -> ModelEntry:
        """The entry that runs ``checkpoint_dir`` (UnknownArchitectureError when none);
        ConfigError when its ``architectures`` and ``model_type`` name two different families
        or its ``generation_config.json`` is malformed."""
        info = read_checkpoint_info(checkpoint_dir)
        claiming = [e for e in self.entries if e.claims(info)]
        if not claiming:
            raise UnknownArchitectureError(self.unknown_message(info))
        first = claiming[0]
        self._check_family_agrees(info, first)
        # Its sampling fields become every request's defaults: refuse a malformed one at load
        # rather than fail each request (resin.loading.generation_config).
        check_generation_config(info.path)
        rivals = [e for e in claiming[1:] if e.origin == first.origin]
        if rivals:
            warnings.warn(
                f"{info.architecture or info.model_type} is claimed by "
                f"{first.describe()} and {rivals[0].describe()}; using the first "
                "(pass --runner NAME to choose)",
                stacklevel=2,
            )
        return first

    def _check_family_agrees(self, info: CheckpointInfo, entry: ModelEntry) -> None:
        """ConfigError when ``architectures[0]`` and ``model_type`` name two different known
        families (transformers builds the model from ``model_type``, Resin would run the
        ``architectures`` one). A checkpoint with only one of them, or a ``model_type`` no
        entry knows (a wrapper's own), resolves as before."""
        if not info.architecture or not info.model_type:
            return
        if entry.model_dir is None:  # the built-in families: one model_type per architecture
            own = BUILTIN_ARCHITECTURES.get(info.architecture)
            agrees = own is None or own == info.model_type
        else:
            agrees = info.model_type in entry.model_types
        if agrees:
            return
        others = [
            e
            for e in self.entries
            if e is not entry and info.model_type in e.model_types and e.model_dir is not None
        ]
        named_builtin = info.model_type in BUILTIN_ARCHITECTURES.values()
        if others or named_builtin:
            family = others[0].name if others else info.model_type
            raise ConfigError(
                f"{info.path}/config.json: 'architectures' names {info.architecture} but "
                f"'model_type' is {info.model_type!r} (the {family} family); transformers "
                "builds the model from model_type, so they must name the same family"
            )

    def unknown_message(self, info: CheckpointInfo) -> str:
        what = (
            f"architecture {info.architecture!r}"
            if info.architecture
            else f"model_type {info.model_type!r}"
        )
        registered = "; ".join(e.describe() for e in self.entries)
        return (
            f"{info.path}: no registered model runs {what}. Registered: {registered}. "
            f"To add one: `resin new-model {info.path} --name NAME --out DIR` (see "
            "skills/add-model/SKILL.md), then pass --models-dir (or set "
            f"{MODELS_PATH_ENV}) to the directory holding DIR."
        )

    def describe(self) -> list[str]:
        return [e.describe() for e in self.entries]


def resolve_runner(
    checkpoint_dir: str | Path,
    runner: Any = None,
    *,
    registry: ModelRegistry | None = None,
    device: str = "cpu",
    dtype: Any = "float32",
    attention_backend: Any = None,
) -> Any:
    """The runner object for ``checkpoint_dir``: ``runner`` None looks the checkpoint up in the
    registry; a string is an explicit choice (see the module doc); any other object is used
    as it is."""
    if runner is not None and not isinstance(runner, str):
        return runner
    registry = registry if registry is not None else ModelRegistry()
    if runner is None:
        return registry.for_checkpoint(checkpoint_dir).load_runner(
            checkpoint_dir, device=device, dtype=dtype, attention_backend=attention_backend
        )
    # An explicit runner skips the lookup (for_checkpoint), not the generation-config check.
    check_generation_config(checkpoint_dir)
    if runner == NULL_RUNNER:
        return _null_runner(checkpoint_dir)
    if runner == MLX_RUNNER:
        return _mlx_runner(checkpoint_dir, device, dtype, attention_backend)
    # "torch" always means the built-in families, whatever a user directory is called
    entry = registry.entries[-1] if runner == BUILTIN_NAME else registry.get(runner)
    if entry is None and Path(runner).is_dir() and (Path(runner) / RECORD_FILE).is_file():
        entry = _entry_of(Path(runner), "user")
    if entry is None and Path(runner).is_dir() and (Path(runner) / "config.json").is_file():
        raise ValueError(
            f"--runner {runner}: that is a checkpoint, not a runner; pass it as the model and "
            "name a runner (torch, a registered model, a model directory) or none"
        )
    if entry is not None:
        return entry.load_runner(
            checkpoint_dir, device=device, dtype=dtype, attention_backend=attention_backend
        )
    if ":" in runner:
        module_name, _, class_name = runner.partition(":")
        runner_class = getattr(importlib.import_module(module_name), class_name)
        if hasattr(runner_class, "from_pretrained"):
            return runner_class.from_pretrained(
                checkpoint_dir, device=device, dtype=_torch_dtype(dtype)
            )
        return runner_class()
    names = ", ".join(sorted({e.name for e in registry.entries}))
    raise ValueError(
        f"unknown runner {runner!r}: use {MLX_RUNNER}, {NULL_RUNNER}, a registered model "
        f"({names}), a model directory, or module:Class"
    )


def _mlx_runner(checkpoint_dir: str | Path, device: str, dtype: Any, attention_backend: Any) -> Any:
    """The MLX runner on ``checkpoint_dir`` (MlxNotInstalledError, a ValueError naming the
    package to install, when MLX is missing)."""
    from resin.runners.mlx import require_mlx

    if attention_backend is not None:
        raise ValueError(
            f"--attention-backend {attention_backend} is for the torch runners; the MLX runner "
            "has one attention implementation (resin/runners/mlx/paged_attention.py)"
        )
    require_mlx()
    from resin.runners.mlx.runner import MlxRunner

    return MlxRunner.from_pretrained(checkpoint_dir, device=device, dtype=dtype)


def _null_runner(checkpoint_dir: str | Path) -> Any:
    from resin.runners.scripted import CyclingRunner
    from resin.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(checkpoint_dir)
    token_ids = [
        t
        for t in tokenizer.encode(NULL_RUNNER_TEXT, add_special_tokens=False)
        if t not in tokenizer.eos_token_ids
    ]
    return CyclingRunner(token_ids)


def _model_dirs(root: Path) -> list[Path]:
    if (root / RECORD_FILE).is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / RECORD_FILE).is_file())


def claimed_model_types(model_types: Iterable[str], config_defaults: Any) -> tuple[str, ...]:
    """A model directory's recorded ``model_types`` and its text model's own
    (``config_defaults["model_type"]``: a multimodal wrapper's text config, whose text-only
    checkpoints the directory runs)."""
    claimed = tuple(model_types)
    text_type = config_defaults.get("model_type")
    if isinstance(text_type, str) and text_type not in claimed:
        claimed += (text_type,)
    return claimed


def _entry_of(model_dir: Path, origin: str) -> ModelEntry:
    path = model_dir / RECORD_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        architectures = tuple(record["architectures"])
        model_types = claimed_model_types(
            record.get("model_types", ()), record.get("config_defaults") or {}
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path}: not a model record ({exc}); regenerate it with resin new-model --force"
        ) from exc
    return ModelEntry(model_dir.resolve().name, architectures, model_types, origin, model_dir)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved
