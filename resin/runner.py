"""The runner protocol: the Python side of the engine ↔ runner contract.

The engine owns every page id; the runner owns every byte. Each step the engine hands
the runner one immutable :class:`resin.BatchPlan` and gets back a
:class:`resin.ForwardOutput`. ``cache_spec`` and ``bind_cache`` are optional: a runner
without them gets one full-attention cache group; ``begin_forward`` / ``finish_forward``
(:class:`SplitForwardRunner`) let ``Engine.step()`` overlap (see ``docs/runners.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from resin._core import BatchPlan, CacheLayout, ForwardOutput, LayerCacheSpec


@runtime_checkable
class Runner(Protocol):
    """Anything with ``forward(plan) -> ForwardOutput`` is a runner."""

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        """Run one step. Row i of the result holds the tokens sampled for plan row i."""
        ...


@runtime_checkable
class CacheAwareRunner(Runner, Protocol):
    """A runner that keeps a paged cache: it says what each layer needs and is told the layout."""

    def cache_spec(self) -> list[LayerCacheSpec]:
        """One spec per layer, in layer order."""
        ...

    def bind_cache(self, layout: CacheLayout) -> None:
        """Allocate cache buffers for ``layout.num_pages`` pages of ``layout.page_size`` tokens."""
        ...


@runtime_checkable
class SplitForwardRunner(Runner, Protocol):
    """A runner whose forward comes in two halves, for overlapped scheduling
    (``EngineConfig.async_scheduling``: ``docs/runners.md``): ``begin_forward(plan)`` then
    ``finish_forward()`` equals ``forward(plan)``, with no host synchronisation in the first."""

    def begin_forward(self, plan: BatchPlan) -> None:
        """Start the plan's model work (kernels launched; the host does not wait for them)."""
        ...

    def finish_forward(self) -> ForwardOutput:
        """The begun plan's output: sample (the host waits for the device here)."""
        ...
