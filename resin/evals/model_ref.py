"""Model references: what ``resin eval parity MODEL`` and ``resin bench MODEL`` accept as MODEL.

Owns turning one spec string into a :class:`ModelRef` — the checkpoint to run, the registry
entry whose runner runs it (:mod:`resin.registry`), and the model's parity and perf specs — so
every bring-up command resolves a model the same way. A spec is one of:

- an HF checkpoint directory (``config.json`` + safetensors) or its ``config.json`` path: the
  runner the registry picks for its architecture (a built-in family: the torch reference
  runner; a shipped or user model directory: its blocks); the specs of that model directory
  when there is one, else none;
- a model directory made by ``resin new-model`` (holds ``architecture.json``), given as a path
  or as a registered name ``NAME`` (``models_root``, ``--models-dir``, ``$RESIN_MODELS_PATH``,
  ``./models`` or the shipped models): that directory's blocks on the checkpoint named by
  ``parity.toml`` ``[reference] checkpoint`` (relative to the model directory; default
  ``tiny``), with ``parity.toml`` / ``perf.toml`` parsed into ``parity_spec`` / ``perf_spec``
  (``{}`` when a file is absent).

Model directories are not Python packages: :func:`import_model_module` imports
``models/NAME/blocks.py`` as ``resin_models.NAME.blocks`` (so it may import its siblings with
``from .x import ...``). :func:`run_model_parity` runs the parity harness on a reference with
its ``parity.toml`` settings (:func:`parity_settings`). Importing this module is pure stdlib;
torch is imported by ``load_runner`` / ``runner_factory``, the harness by ``run_model_parity``.

>>> ref = resolve_model("tests/fixtures/llama")           # doctest: +SKIP
>>> ref.name, ref.model_dir, ref.parity_spec
('llama', None, {})
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resin.evals.parity_engine import GREEDY_REFERENCE_MODES

RECORD_FILE = "architecture.json"
PARITY_FILE = "parity.toml"
PERF_FILE = "perf.toml"
DEFAULT_CHECKPOINT = "tiny"
_PACKAGE_ROOT = "resin_models"
DTYPES = ("float32", "bfloat16", "float16")


class ModelRefError(ValueError):
    """A model spec names nothing usable: no such directory or name, or a broken spec file."""


@dataclass
class ModelRef:
    """One resolved model. ``model_dir`` is None for a built-in family (torch reference runner).

    ``runner_name`` is ``"torch"`` for a built-in family and ``"model:NAME"`` for a model
    directory.
    """

    name: str
    checkpoint_dir: Path
    model_dir: Path | None = None
    parity_spec: dict[str, Any] = field(default_factory=dict)
    perf_spec: dict[str, Any] = field(default_factory=dict)
    attention_backend: str | None = None

    @property
    def runner_name(self) -> str:
        return "torch" if self.model_dir is None else f"model:{self.name}"

    def entry(self) -> Any:
        """The registry entry of this reference."""
        from resin.registry import BUILTIN_ARCHITECTURES, BUILTIN_NAME, ModelEntry

        if self.model_dir is None:
            return ModelEntry(
                BUILTIN_NAME,
                tuple(BUILTIN_ARCHITECTURES),
                tuple(BUILTIN_ARCHITECTURES.values()),
                "built-in",
            )
        record = read_record(self.model_dir)
        return ModelEntry(
            self.name,
            tuple(record["architectures"]),
            tuple(record.get("model_types", ())),
            "user",
            self.model_dir,
        )

    def load_runner(
        self, device: str = "cpu", dtype: Any = "float32", checkpoint_dir: str | Path | None = None
    ) -> Any:
        """A runner on ``checkpoint_dir`` (default: this reference's); ``dtype`` is a torch
        dtype or its name (``"bfloat16"``)."""
        return self.runner_factory(device, dtype)(str(checkpoint_dir or self.checkpoint_dir))

    def runner_factory(
        self, device: str = "cpu", dtype: Any = "float32", default_backend: str | None = None
    ) -> Any:
        """``factory(checkpoint_dir) -> runner``, the shape ``run_parity(runner_factory=...)`` takes;
        the torch runners' attention backend is ``attention_backend``, else ``default_backend``,
        else the runners' own default."""
        entry = self.entry()
        backend = self.attention_backend or default_backend

        def factory(checkpoint_dir: str) -> Any:
            return entry.load_runner(
                checkpoint_dir, device=device, dtype=dtype, attention_backend=backend
            )

        return factory


def resolve_model(
    spec: str | Path, models_root: str | Path | None = None, models_dirs: Any = ()
) -> ModelRef:
    """Resolve a checkpoint path, a model directory path, or a model name (see module doc);
    ``models_root`` / ``models_dirs`` register more model directories (``--models-dir``)."""
    from resin.registry import ModelRegistry, UnknownArchitectureError

    path = Path(spec)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir() and (path / RECORD_FILE).is_file():
        return _model_ref(path)
    roots = [*([models_root] if models_root is not None else []), *models_dirs]
    registry = ModelRegistry(roots)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            entry = registry.for_checkpoint(path)
        except (UnknownArchitectureError, ValueError) as exc:
            raise ModelRefError(str(exc)) from exc
        if entry.model_dir is None:
            return ModelRef(name=path.resolve().name, checkpoint_dir=path)
        ref = _model_ref(entry.model_dir)
        ref.checkpoint_dir = path
        return ref
    if path.is_dir():
        raise ModelRefError(
            f"{path} is neither a checkpoint (no config.json) nor a model "
            f"directory (no {RECORD_FILE})"
        )
    name = str(spec)
    if "/" in name or "\\" in name or not name:
        raise ModelRefError(f"no such checkpoint or model directory: {spec}")
    named = registry.get(name)
    if named is not None and named.model_dir is not None:
        return _model_ref(named.model_dir)
    known = ", ".join(e.name for e in registry.entries if e.model_dir is not None)
    raise ModelRefError(
        f"unknown model {name!r}: not a directory, and no registered model "
        f"directory has that name (registered: {known or 'none'}; searched "
        f"{', '.join(str(r) for r in registry.user_roots)} and the shipped "
        f"models). Create one with `resin new-model SOURCE --name {name}`"
    )


def read_record(model_dir: Path) -> dict[str, Any]:
    """A model directory's ``architecture.json`` as a dict (ModelRefError when unreadable)."""
    path = model_dir / RECORD_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelRefError(f"cannot read {path}: {exc}") from exc
    if not isinstance(record, dict) or not record.get("architectures"):
        raise ModelRefError(f"{path}: no 'architectures' (regenerate with resin new-model)")
    return record


def import_model_module(model_dir: Path, module: str, name: str | None = None) -> types.ModuleType:
    """Import ``model_dir/<module>.py`` as ``resin_models.<name>.<module>`` (re-imported when the
    directory was registered under the same name from another path)."""
    model_dir = model_dir.resolve()
    package = f"{_PACKAGE_ROOT}.{_identifier(name or model_dir.name)}"
    if _PACKAGE_ROOT not in sys.modules:
        root = types.ModuleType(_PACKAGE_ROOT)
        root.__path__ = []
        sys.modules[_PACKAGE_ROOT] = root
    existing = sys.modules.get(package)
    if existing is None or list(getattr(existing, "__path__", [])) != [str(model_dir)]:
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]
        pkg = types.ModuleType(package)
        pkg.__path__ = [str(model_dir)]
        pkg.__file__ = None
        sys.modules[package] = pkg
    if not (model_dir / f"{module}.py").is_file():
        raise ModelRefError(f"{model_dir} has no {module}.py")
    importlib.invalidate_caches()
    return importlib.import_module(f"{package}.{module}")


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as a dict; ``{}`` when it does not exist; ModelRefError when it does not parse."""
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelRefError(f"cannot read {path}: {exc}") from exc


def _model_ref(model_dir: Path) -> ModelRef:
    parity_spec = read_toml(model_dir / PARITY_FILE)
    perf_spec = read_toml(model_dir / PERF_FILE)
    reference = parity_spec.get("reference", {})
    checkpoint = Path(reference.get("checkpoint", DEFAULT_CHECKPOINT)).expanduser()
    checkpoint_dir = checkpoint if checkpoint.is_absolute() else model_dir / checkpoint
    if not (checkpoint_dir / "config.json").is_file():
        raise ModelRefError(
            f"{model_dir / PARITY_FILE}: [reference] checkpoint = "
            f"{str(checkpoint)!r} -> {checkpoint_dir}, which has no config.json"
        )
    return ModelRef(
        name=model_dir.resolve().name,
        checkpoint_dir=checkpoint_dir,
        model_dir=model_dir,
        parity_spec=parity_spec,
        perf_spec=perf_spec,
    )


def _identifier(name: str) -> str:
    ident = re.sub(r"\W", "_", name)
    return ident if not ident[:1].isdigit() else f"m_{ident}"


def parity_settings(ref: ModelRef) -> dict[str, Any]:
    """``run_parity`` keyword arguments from ``parity.toml``: dtype, device, tolerances
    (top-level keys: for ``[reference] dtype``; ``[tolerances.bfloat16]`` etc.: per dtype;
    dtype defaults for absent keys), max_new_tokens, checks, prompts. Unknown keys raise."""
    spec = ref.parity_spec
    reference, tol, stress = (spec.get(k, {}) for k in ("reference", "tolerances", "stress"))
    tolerance_keys = {"hidden", "logits", "logprobs", "tie_margin"}
    known = {
        "reference": {"checkpoint", "dtype", "device", "greedy"},
        "tolerances": tolerance_keys | set(DTYPES),
        "stress": {"max_new_tokens", "checks", "prompts"},
    }
    for section, keys in known.items():
        unknown = set(spec.get(section, {})) - keys
        for dtype_name in DTYPES:  # [tolerances.bfloat16] ...: per-dtype tables
            unknown |= (
                {f"{dtype_name}.{k}" for k in set(tol.get(dtype_name, {})) - tolerance_keys}
                if section == "tolerances"
                else set()
            )
        if unknown:
            raise ModelRefError(
                f"{ref.model_dir}/{PARITY_FILE}: unknown key(s) in [{section}]: "
                f"{', '.join(sorted(unknown))}; known: {', '.join(sorted(keys))}"
            )
    greedy = reference.get("greedy", "cached")
    if greedy not in GREEDY_REFERENCE_MODES:
        raise ModelRefError(
            f"{ref.model_dir}/{PARITY_FILE}: [reference] greedy = {greedy!r}; expected one of "
            f"{', '.join(GREEDY_REFERENCE_MODES)}"
        )
    settings: dict[str, Any] = {
        "greedy_reference": greedy,
        "dtype": reference.get("dtype", "float32"),
        "device": reference.get("device", "cpu"),
        "tolerances": {k: v for k, v in tol.items() if k not in DTYPES},
        "dtype_tolerances": {d: dict(tol.get(d, {})) for d in DTYPES},
    }
    for key in ("max_new_tokens", "checks", "prompts"):
        if key in stress:
            settings[key] = stress[key]
    return settings


def run_model_parity(
    ref: ModelRef,
    *,
    dtype: str | None = None,
    device: str | None = None,
    max_new_tokens: int | None = None,
    checkpoint: str | Path | None = None,
    checks: tuple[str, ...] | None = None,
) -> Any:
    """``run_parity`` on ``ref``'s checkpoint (or ``checkpoint``: a variant) with its runner and
    parity.toml settings; explicit arguments override the file (``checks``: e.g.
    ``("layers",)`` for the layers and logits stages only). Returns the :class:`ParityReport`."""
    from resin.evals.parity import Tolerances, run_parity
    from resin.runners.torch.attention import PARITY_BACKEND

    settings = parity_settings(ref)
    # parity.toml's top-level tolerances are for its own dtype; another dtype gets that dtype's
    # defaults; a [tolerances.<dtype>] table overrides either for that dtype.
    file_tolerances = settings["tolerances"] if dtype in (None, settings["dtype"]) else {}
    dtype = dtype or settings["dtype"]
    file_tolerances = {**file_tolerances, **settings["dtype_tolerances"].get(dtype, {})}
    device = device or settings["device"]
    tolerances = Tolerances(**{**vars(Tolerances.for_dtype(dtype)), **file_tolerances})
    kwargs: dict[str, Any] = {
        "tolerances": tolerances,
        "dtype": dtype,
        "runner_name": ref.runner_name,
        "runner_factory": ref.runner_factory(device, dtype, default_backend=PARITY_BACKEND),
        "greedy_reference": settings["greedy_reference"],
    }
    kwargs["max_new_tokens"] = max_new_tokens or settings.get("max_new_tokens", 8)
    if checks is not None or "checks" in settings:
        kwargs["checks"] = tuple(checks if checks is not None else settings["checks"])
    if "prompts" in settings:
        kwargs["prompts"] = settings["prompts"]
    return run_parity(checkpoint or ref.checkpoint_dir, **kwargs)
