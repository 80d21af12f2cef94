"""Bring-up evaluations: the parity harness (``resin eval parity``).

Importing this package loads neither torch nor transformers; :func:`run_parity` imports
them when it runs. See ``docs/parity.md`` for how to read a report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resin.evals.parity import ParityReport, StageResult, Tolerances, run_parity

__all__ = ["ParityReport", "StageResult", "Tolerances", "run_parity"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from resin.evals import parity

        return getattr(parity, name)
    raise AttributeError(f"module 'resin.evals' has no attribute {name!r}")
