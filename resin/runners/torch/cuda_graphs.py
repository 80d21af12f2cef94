"""CUDA graphs for the paged runner's decode steps: captured at the engine's padded batch
sizes, replayed when a plan fits, eager otherwise.

Owns :class:`CudaGraphs`, what :class:`~.paged_runner.PagedRunner` uses once
``configure_cuda_graphs`` has chosen batch sizes (``resin.LLM`` does; ``--enforce-eager``
turns it off):

- **Static buffers** for the largest batch size B: ``input_ids``, ``positions`` and each
  cache group's ``slot_mapping`` (int64[B]; a host staging twin in pinned memory, one
  non-blocking copy each per step), and the attention backend's per-step metadata, which the
  backend keeps in static buffers of its own (the hook below) with a fixed page-table width
  per row (``ceil(max_model_len / page entries) + 1`` pages). Every batch size's graph reads
  the first ``b`` rows of the same buffers.
- **Capture** (CUDA only), at ``bind_cache`` time, largest batch size first, every graph in
  one memory pool (``torch.cuda.graph_pool_handle()``; the graphs never run concurrently and
  each step's logits are read before the next replay): a warm-up on a side stream (Triton
  compiles, cuBLAS initialises), then ``torch.cuda.graph`` over the layer stack, the final
  norm and the logits of all ``b`` rows (fp32). Sampling stays eager. The buffers hold
  padding rows only while capturing, so warm-up and capture write nothing to the cache.
- **Replay** when the plan is pure decode (every row a one-token decode row), its
  ``padded_num_sequences`` is a captured batch size, it carries no cache ops, parity capture
  is off and every row's page list fits the static width; the S real rows are copied into the
  static buffers, rows ``[S, b)`` are padding rows (token 0 at position 0, ``seq_len`` 1, page
  list = the null page 0, slot -1: they read one zero key and write nothing;
  docs/batch_plan.md, "CUDA-graph padding"), the graph replays, and the sampler reads logits
  rows ``[0, S)``. Any other plan runs eager, counted with its reason.
- With ``capture=False`` the same static-buffer path runs eagerly instead of replaying (any
  device): how the padding path is checked on CPU (tests/test_cuda_graphs.py).

Which runners qualify (:func:`ineligible_reason`): a CUDA device; an attention backend whose
per-step metadata lives in static buffers (``graph_safe``, the hook below: the ``triton``
backend; the ``reference`` and ``torch`` backends build per-row Python views or a per-step
padded gather and do not); full and sliding-window caches only (recurrent states and
compressed entries go through per-row paths); no MTP drafter; the runner's own ``forward``
(context parallelism overrides it). A model whose blocks synchronise with the host (``.item()``,
data-dependent shapes, e.g. the loop-over-experts MoE) fails to capture: graphs are then off
for that runner, logged with the error, and every step runs eager.

The backend hook (duck-typed; a backend without ``graph_safe = True`` never qualifies)::

    graph_safe: bool = True
    def prepare_static(self, max_rows: int, max_pages: Sequence[int], device) -> None:
        # static metadata for up to max_rows one-token rows; row i of group g lists at most
        # max_pages[g] pages; every row starts as a padding row (seq_len 1, the null page)
    def update_static(self, plan, num_rows: int) -> bool:
        # the plan's S rows, then padding rows up to num_rows; False (nothing changed that a
        # graph reads) when a row lists more pages than prepared
    def begin_static_step(self, step, num_rows, group_windows, group_page_entries,
                          group_ratios) -> None:
        # begin_step for a step whose tensors are the static buffers' first num_rows rows:
        # attend / write read the static metadata, no host sync, no allocation from the plan

``write`` must not synchronise either (no boolean-mask indexing of the slots: the triton
backend writes through a kernel that skips slot -1). Counters: ``num_replayed``,
``num_eager`` and ``eager_reasons`` (``PagedRunner.cuda_graph_stats()``; ``resin bench``
reports them). Imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resin._core import BatchPlan, CacheLayout
from resin.runners.torch.step_inputs import StepInputs

if TYPE_CHECKING:
    from resin.runners.torch.paged_runner import PagedRunner

log = logging.getLogger("resin.cuda_graphs")

GRAPH_CACHE_KINDS = ("full", "sliding_window")
NUM_WARMUP_RUNS = 2  # eager runs of each batch size before its capture


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes up to ``max_num_seqs`` — 1, 2, 4, then every 8 to 256, every 16 to
    512 — plus ``max_num_seqs`` itself, so every decode batch the engine can schedule has one."""
    sizes = [b for b in (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)) if b <= max_num_seqs]
    if max_num_seqs >= 1 and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def capture_batch_sizes(requested: Sequence[int] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: ``requested`` (None: :func:`default_batch_sizes`), sorted,
    without duplicates, those above ``max_num_seqs`` dropped (a batch never gets that large).
    ValueError for a size below 1."""
    if requested is None:
        return default_batch_sizes(max_num_seqs)
    sizes = sorted({int(b) for b in requested})
    if sizes and sizes[0] < 1:
        raise ValueError(f"cuda_graph_batch_sizes must be >= 1, got {list(requested)}")
    dropped = [b for b in sizes if b > max_num_seqs]
    if dropped:
        log.info(
            "CUDA graphs: batch sizes %s are above max_num_seqs %d: not captured",
            dropped,
            max_num_seqs,
        )
    return [b for b in sizes if b <= max_num_seqs]


def ineligible_reason(runner: PagedRunner, capture: bool) -> str | None:
    """Why ``runner`` cannot run decode steps through static buffers (None: it can);
    ``capture`` also asks for a CUDA device."""
    from resin.runners.torch.paged_runner import PagedRunner

    if capture and runner.device.type != "cuda":
        return f"the runner is on {runner.device}, not a CUDA device"
    backend = runner.attention_backend
    if not getattr(backend, "graph_safe", False):
        return (
            f"the {backend.name!r} attention backend keeps no static per-step metadata "
            "(graph_safe is not set; the triton backend has it)"
        )
    if runner.drafter is not None:
        return "MTP drafting runs after each step (its draft steps are eager)"
    kinds = sorted({cache.kind for _, _, cache in runner._cache_slots()} - set(GRAPH_CACHE_KINDS))
    if kinds:
        return f"cache kinds {kinds}: only full and sliding-window attention caches are captured"
    if type(runner).forward is not PagedRunner.forward:
        return f"{type(runner).__name__} overrides forward"
    return None


def configure(
    runner: PagedRunner,
    batch_sizes: Sequence[int] | None,
    max_num_seqs: int,
    max_model_len: int,
    capture: bool | None,
) -> CudaGraphs | None:
    """``PagedRunner.configure_cuda_graphs``: the runner's :class:`CudaGraphs` (not bound
    yet), or None with the reason logged once. ``capture`` None: capture, which needs a CUDA
    device (so on CPU every step is eager); False: the static-buffer path, run eagerly."""
    reason = ineligible_reason(runner, capture is not False)
    capture = capture is not False
    sizes = [] if reason is not None else capture_batch_sizes(batch_sizes, max_num_seqs)
    if reason is None and not sizes:
        reason = f"no batch size is at most max_num_seqs {max_num_seqs}"
    if reason is not None:
        log.info("CUDA graphs off for %s: %s; every step runs eager", runner.model.name, reason)
        return None
    return CudaGraphs(runner, sizes, max_model_len, capture)


class StagedBuffer:
    """A static device tensor and its host twin (pinned on CUDA): the host side is written
    with numpy, then copied in one non-blocking copy. On CPU both are the same tensor."""

    def __init__(self, values: torch.Tensor, device: torch.device) -> None:
        self.device = values.to(device)
        if device.type == "cuda":
            self.host = values.clone().pin_memory()
        else:
            self.host = self.device
        self.np: np.ndarray = self.host.numpy()

    def upload(self, n: int) -> None:
        """Copy the first ``n`` entries to the device (nothing on CPU)."""
        if self.host is not self.device and n:
            self.device[:n].copy_(self.host[:n], non_blocking=True)


class CudaGraphs:
    """Decode steps through static buffers at ``batch_sizes``: captured and replayed on CUDA
    (``capture``), run eagerly otherwise (module doc)."""

    def __init__(
        self, runner: PagedRunner, batch_sizes: Sequence[int], max_model_len: int, capture: bool
    ) -> None:
        if not batch_sizes:
            raise ValueError("CudaGraphs needs at least one batch size")
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len = max_model_len
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.steps: dict[int, StepInputs] = {}
        self.num_replayed = 0
        self.num_eager = 0
        self.eager_reasons: Counter[str] = Counter()
        self.disabled: str | None = None
        self.max_pages: list[int] = []
        self._uploaded: torch.cuda.Event | None = None

    # -- binding and capture -----------------------------------------------------------

    def release(self) -> None:
        """Drop the graphs, their pool and the static buffers (before the caches change)."""
        self.graphs, self.logits, self.steps = {}, {}, {}
        self._uploaded = None

    def bind(self, layout: CacheLayout) -> None:
        """After the runner allocated its caches for ``layout``: static buffers, the
        backend's static metadata, then a warm-up and (``capture``) every batch size captured.
        A failure turns graphs off for this runner (logged); every step then runs eager."""
        self.release()
        runner, device = self.runner, self.runner.device
        self.disabled = ineligible_reason(runner, self.capture)  # MTP may be on since
        if self.disabled is not None:
            log.info("CUDA graphs off for %s: %s", runner.model.name, self.disabled)
            return
        n = self.batch_sizes[-1]
        num_groups = len(layout.groups)
        self.max_pages = [
            math.ceil(self.max_model_len / runner.group_page_entries[g]) + 1
            for g in range(num_groups)
        ]
        with torch.inference_mode():
            int64 = torch.int64
            self.input_ids = StagedBuffer(torch.zeros(n, dtype=int64), device)
            self.positions = StagedBuffer(torch.zeros(n, dtype=int64), device)
            self.slot_mappings = [
                StagedBuffer(torch.full((n,), -1, dtype=int64), device) for _ in range(num_groups)
            ]
            query_indptr = torch.arange(n + 1, dtype=int64, device=device)
            empty = torch.zeros(0, dtype=int64, device=device)
            for b in self.batch_sizes:
                self.steps[b] = StepInputs(
                    plan=None,  # type: ignore[arg-type]  # a graph reads no plan
                    device=device,
                    input_ids=self.input_ids.device[:b],
                    positions=self.positions.device[:b],
                    query_indptr=query_indptr[: b + 1],
                    slot_mappings=[s.device[:b] for s in self.slot_mappings],
                    copy_pages=empty.reshape(0, 2),
                    zero_pages=empty,
                    sample_rows=np.arange(b),
                    last_token_indices=query_indptr[:b],
                )
            runner.attention_backend.prepare_static(n, self.max_pages, device)  # type: ignore[attr-defined]
            b = n
            stream = torch.cuda.current_stream(device) if self.capture else None
            try:
                if not self.capture:
                    self._run_static(n)  # the padding path runs once (errors surface here)
                else:
                    pool = torch.cuda.graph_pool_handle()
                    for b in reversed(self.batch_sizes):
                        self._capture(b, pool)
                    torch.cuda.synchronize(device)
            except Exception as exc:  # noqa: BLE001 - any failure means: run eager
                if stream is not None:  # an older torch may leave its capture stream current
                    torch.cuda.set_stream(stream)
                    with contextlib.suppress(Exception):
                        torch.cuda.synchronize(device)
                self.release()
                what = "capture" if self.capture else "the static-buffer path"
                self.disabled = f"{what} failed at batch size {b}: {type(exc).__name__}: {exc}"
                log.warning("CUDA graphs off for %s: %s", type(runner).__name__, self.disabled)
                return
        if self.capture:
            log.info("CUDA graphs: captured decode batch sizes %s", self.batch_sizes)

    def _capture(self, b: int, pool: Any) -> None:
        device = self.runner.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(NUM_WARMUP_RUNS):
                self._run_static(b)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._run_static(b)
        self.graphs[b], self.logits[b] = graph, logits

    def _run_static(self, b: int) -> torch.Tensor:
        """The captured work for batch size ``b``: the layer stack over the static buffers'
        first ``b`` rows, the final norm and every row's logits (fp32, [b, vocab])."""
        runner = self.runner
        step = self.steps[b]
        runner.attention_backend.begin_static_step(  # type: ignore[attr-defined]
            step, b, runner.group_windows, runner.group_page_entries, runner.group_ratios
        )
        runner._state_tables = {}
        top = runner._context(step, -1)
        _, hidden = runner._run_stack(step, top, {})
        normed = runner._final_norm(hidden, top)
        return runner.model.logits(normed, runner.weights.globals, top).float()

    # -- steps -------------------------------------------------------------------------

    def eager_reason(self, plan: BatchPlan) -> str | None:
        """Why ``plan`` runs eager (None: it goes through a graph)."""
        if self.disabled is not None:
            return "graphs are off (" + self.disabled.split(":", 1)[0] + ")"
        s, b = plan.num_sequences, plan.padded_num_sequences
        if s == 0 or plan.num_decode_sequences != s:
            return "not a pure-decode step"
        if b not in self.steps:
            return f"padded_num_sequences {b} is not a captured batch size"
        if self.runner.capture is not None:
            return "parity capture is on"
        if plan.copy_pages.size or plan.zero_pages.size:
            return "the plan carries cache ops"
        if plan.num_cache_groups != len(self.max_pages):
            return "the plan's cache groups are not the bound layout's"
        return None

    def replay(self, plan: BatchPlan) -> torch.Tensor | None:
        """Run ``plan`` through its graph: the logits of its ``num_sequences`` rows (float32, on
        the device, the replay not waited for; the caller samples them); None when it must run
        eager (counted with the reason)."""
        reason = self.eager_reason(plan)
        if reason is None and not self._stage(plan):
            reason = "a row's page list is wider than the static page table"
        if reason is not None:
            self.num_eager += 1
            if reason not in self.eager_reasons:
                log.debug("CUDA graphs: step %d runs eager: %s", plan.step, reason)
            self.eager_reasons[reason] += 1
            return None
        b, s = plan.padded_num_sequences, plan.num_sequences
        if self.capture:
            self.graphs[b].replay()
            logits = self.logits[b]
        else:
            logits = self._run_static(b)
        self.num_replayed += 1
        return logits[:s]

    def _stage(self, plan: BatchPlan) -> bool:
        """The plan's rows into the static buffers, padding rows after them; False (nothing
        written that a graph reads) when the backend's page table cannot hold a row."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last step's copies have left the host buffers
        b, s = plan.padded_num_sequences, plan.num_sequences
        if not self.runner.attention_backend.update_static(plan, b):  # type: ignore[attr-defined]
            return False
        slot_mapping = plan.slot_mapping
        for buffer, values, pad in (
            (self.input_ids, plan.input_ids, 0),
            (self.positions, plan.positions, 0),
            *((sm, slot_mapping[g], -1) for g, sm in enumerate(self.slot_mappings)),
        ):
            buffer.np[:s] = values
            buffer.np[s:b] = pad
            buffer.upload(b)
        if self.runner.device.type == "cuda":  # the copies read pinned host memory
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return True

    def stats(self) -> dict[str, Any]:
        """``batch_sizes``, whether graphs are ``captured`` (replayed) or the static path runs
        eagerly, ``disabled`` (why graphs are off, or None), ``num_replayed`` / ``num_eager``
        steps and ``eager_reasons`` (reason -> steps)."""
        return {
            "batch_sizes": list(self.batch_sizes),
            "captured": self.capture and bool(self.graphs),
            "disabled": self.disabled,
            "num_replayed": self.num_replayed,
            "num_eager": self.num_eager,
            "eager_reasons": dict(self.eager_reasons),
        }
