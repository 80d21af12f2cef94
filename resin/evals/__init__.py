"""Bring-up evaluations: the parity harness (``resin eval parity``: ``parity.py``,
``parity_engine.py``), the perf harness (``resin bench``: ``perf.py`` with ``perf_shapes``,
``perf_measure``, ``roofline``, ``perf_report``, ``perf_compare``), and model references
(``model_ref.py``: a checkpoint directory or a ``models/NAME`` runner).

Importing this package loads neither torch nor transformers; the commands import them when
they run. See ``docs/parity.md`` and ``docs/benchmarks.md`` for how to read their reports.
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
