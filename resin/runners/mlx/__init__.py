"""MLX runners: the same :class:`resin.BatchPlan` run on Apple's MLX (``mlx.core``).

Metal on Apple silicon is what users run it on; the Linux CPU wheels (``mlx[cpu]``) run the same
code, and CI tests it there. Owns:

- :class:`~resin.runners.mlx.runner.MlxRunner` (:mod:`.runner`): one model for the engine —
  paged K/V caches as MLX arrays (shared per layer slot across cache groups, as the torch
  runners share theirs), the forward, parity capture, sampling;
- the model math (:mod:`.layers`: RMSNorm, RoPE tables, SwiGLU, top-k MoE; :mod:`.llama`: the
  built-in families Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral; :mod:`.gpt_oss`: gpt-oss);
- paged attention on the plan's page tables and slot mapping (:mod:`.paged_attention`);
- ``torch.topk``'s CPU choice among tied values, in numpy (:mod:`.torch_topk`), which the MoE
  routers follow so they pick HF's experts;
- the MLX sampler (:mod:`.sampler`) on the framework-neutral :mod:`resin.sampling_state`;
- weights from the checkpoint's safetensors (:mod:`.weights`).

Importing this package does not import MLX; :func:`require_mlx` says what to install when it is
missing, and :class:`MlxRunner` (imported on first use) needs it. ``import resin`` imports neither.
"""

from __future__ import annotations

import platform
from importlib.util import find_spec
from typing import Any


class MlxNotInstalledError(ImportError, ValueError):
    """MLX is not installed. A ``ValueError`` too, so the CLIs report it as a usage error."""


def install_hint() -> str:
    """What to install on this machine: ``mlx`` on macOS (Metal), ``mlx[cpu]`` elsewhere."""
    return "pip install mlx" if platform.system() == "Darwin" else 'pip install "mlx[cpu]"'


def require_mlx() -> None:
    """Raise :class:`MlxNotInstalledError` naming the package to install unless ``mlx.core``
    can be imported."""
    try:
        found = find_spec("mlx") is not None and find_spec("mlx.core") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MlxNotInstalledError(
            f"the MLX runner needs MLX, which is not installed: {install_hint()} "
            "(Linux runs MLX on the CPU; macOS on Apple silicon runs it on Metal)"
        )


def __getattr__(name: str) -> Any:
    if name == "MlxRunner":
        require_mlx()
        from resin.runners.mlx.runner import MlxRunner

        return MlxRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MlxNotInstalledError", "MlxRunner", "install_hint", "require_mlx"]
