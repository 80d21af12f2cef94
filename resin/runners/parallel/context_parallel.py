"""Context parallelism for long prefills: one plan's long rows split over the ranks, each rank
computing its share of the queries through every layer.

Owns :func:`split_plan` (which tokens each rank computes: a zigzag split of every row with at
least ``2·N`` new tokens — rank r takes chunks r and 2N-1-r of 2N, so causal attention's cost
balances — while shorter rows, decode rows included, stay whole on rank 0) and
:class:`ContextParallelRunner`, a built-in-family runner on that split:

- every rank holds the whole model and a whole KV cache (the cache is replicated, not split:
  CP here saves compute and time on long prompts, not memory);
- per layer, each rank computes q / k / v for its tokens; the K / V of the step's tokens are
  all-gathered and every rank writes all of them through the full plan's slot mapping, so a
  rank's queries read every earlier key of their row, its own and the other ranks' (the
  "KV all-gather" CP, not a ring);
- a rank's chunk is a plan row of its own (``seq_len`` = the chunk's end, the row's pages up
  to it), so the attention backends run unchanged;
- after the stack the final hidden states are all-gathered into the plan's token order and
  rank 0 samples the full plan;
- a plan with no long row (decode steps) runs whole on every rank, with no collective: the
  replicated caches stay equal.

Full-attention and sliding-window caches (every rank writes every key, so a chunk's window
is in its cache; its page list is the row's, cut at the chunk's end). A recurrent state or a
compressed group would need a sequential scan or ratio-aligned splits (docs/parallelism.md):
a plan with such a group is refused. Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from resin.runners import prompt_logprobs
from resin.runners.torch.attention import LayerAttention
from resin.runners.torch.context import LayerContext
from resin.runners.torch.paged_runner import PagedRunner
from resin.runners.torch.runner import TorchRunner
from resin.runners.torch.step_inputs import StepInputs


def _no_emit(child: str, tensor: torch.Tensor) -> None:
    """Parity capture does not run under CP."""


@dataclass
class SubRow:
    """One plan row's (or chunk's) tokens a rank computes: ``row`` of the full plan, its
    tokens ``[start, stop)`` in the step's flat order."""

    row: int
    start: int
    stop: int


def split_plan(plan: Any, world_size: int) -> list[list[SubRow]]:
    """Per rank, the sub-rows it computes (module doc): every token goes to exactly one rank,
    in the plan's row order within each rank."""
    out: list[list[SubRow]] = [[] for _ in range(world_size)]
    indptr = plan.query_indptr.astype(np.int64)
    chunks = 2 * world_size
    for row in range(len(indptr) - 1):
        start, stop = int(indptr[row]), int(indptr[row + 1])
        if stop - start < chunks:
            out[0].append(SubRow(row, start, stop))
            continue
        bounds = np.linspace(start, stop, chunks + 1).round().astype(np.int64)
        for rank in range(world_size):
            for chunk in (rank, chunks - 1 - rank):
                out[rank].append(SubRow(row, int(bounds[chunk]), int(bounds[chunk + 1])))
    for rows in out:
        rows.sort(key=lambda s: s.start)
    return out


class _SubPlan:
    """One rank's share of a plan, with a plan's attributes (what the runner reads): each
    sub-row a row whose ``seq_len`` ends at its last token, the row's pages up to there, and
    no sampling (rank 0 samples the full plan)."""

    def __init__(
        self,
        plan: Any,
        rows: list[SubRow],
        page_entries: list[int],
        ratios: list[int],
        recurrent: list[bool],
    ):
        tokens = np.concatenate(
            [np.arange(s.start, s.stop) for s in rows] or [np.zeros(0, np.int64)]
        ).astype(np.int64)
        self.token_index = tokens  # into the full plan's flat token order
        self.input_ids = plan.input_ids[tokens]
        self.positions = plan.positions[tokens]
        lengths = [s.stop - s.start for s in rows]
        self.query_indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        ends = [int(plan.positions[s.stop - 1]) + 1 for s in rows]
        self.seq_lens = np.asarray(ends, dtype=np.uint32)
        self.num_computed_tokens = np.asarray(
            [int(plan.positions[s.start]) for s in rows], dtype=np.uint32
        )
        self.num_sequences = len(rows)
        self.num_tokens = len(tokens)
        self.num_cache_groups = plan.num_cache_groups
        self.sample_indptr = np.zeros(len(rows) + 1, dtype=np.uint32)
        self.num_draft_tokens = np.zeros(len(rows), dtype=np.uint32)
        self.copy_pages, self.zero_pages = plan.copy_pages, plan.zero_pages
        kv_indptr, kv_indices, slots = [], [], []
        seq_lens = plan.seq_lens.astype(np.int64)
        for g in range(plan.num_cache_groups):
            pointers, pages = plan.kv_indptr[g], plan.kv_indices[g]
            listed = []
            per_page, ratio = page_entries[g], ratios[g]
            for sub, end in zip(rows, ends):
                start, stop = int(pointers[sub.row]), int(pointers[sub.row + 1])
                if recurrent[g]:  # (recurrent layers run on the whole plan: unused here)
                    listed.append(pages[start:stop])
                    continue
                # The row lists logical pages [first, ceil(units / per_page)) of its units —
                # tokens, or a compressed group's closed entries (first = 0 for full attention
                # and entries; a sliding window lists from its first query's window): the
                # chunk keeps them up to its own end, so its window is inside them.
                units, row_units = end // ratio, int(seq_lens[sub.row]) // ratio
                first = -(-row_units // per_page) - (stop - start)
                listed.append(pages[start : start + -(-units // per_page) - first])
            kv_indices.append(
                np.concatenate(listed).astype(np.uint32) if listed else np.zeros(0, np.uint32)
            )
            kv_indptr.append(
                np.concatenate([[0], np.cumsum([len(x) for x in listed])]).astype(np.uint32)
            )
            slots.append(plan.slot_mapping[g][tokens])
        self.kv_indptr, self.kv_indices, self.slot_mapping = (
            tuple(kv_indptr),
            tuple(kv_indices),
            tuple(slots),
        )
        self.has_initial_state = tuple(np.zeros(0, np.uint8) for _ in kv_indptr)


class _GatheredWrites(LayerAttention):
    """``ctx.attention`` under CP: ``write`` all-gathers every rank's K / V and stores the
    step's in the plan's token order through the full slot mapping; ``attend`` reads this
    rank's sub-rows (the backend was planned with them)."""

    runner: ContextParallelMixin | None = None

    def write(self, **values: torch.Tensor) -> None:
        assert self.runner is not None
        full = {name: self.runner._gather_tokens(v) for name, v in values.items()}
        self.backend.write(
            [self._cache(name) for name in full],
            list(full.values()),
            self.runner._full_slots[self.group],
        )


class ContextParallelMixin(PagedRunner):
    """Context parallelism over a paged runner (module doc): mixed into the built-in runner
    (:class:`ContextParallelRunner`) and the model-directory one
    (:class:`ContextParallelModelDirRunner`). ``cp = (rank, world_size, group)``."""

    cp: tuple[int, int, Any]
    _splits: list[list[SubRow]]
    _full_slots: list[torch.Tensor]

    @torch.inference_mode()
    def forward(self, plan: Any) -> Any:
        rank, world, _ = self.cp
        self._splits = split_plan(plan, world)
        # No long row (decode), or parity capture on (its checkpoints are whole-step tensors):
        # every rank runs the plan whole.
        if not all(self._splits) or self.capture is not None:
            out = super().forward(plan)
            # No collective ran: wait for every rank before rank 0 lets the engine write the
            # next plan over the shared memory this one is read from.
            dist.barrier(group=self.cp[2])
            return out
        self.sampler.begin_step(plan)
        kinds = self._group_kinds()
        recurrent = [kind == "recurrent" for kind in kinds]
        sub = _SubPlan(
            plan, self._splits[rank], self.group_page_entries, self.group_ratios, recurrent
        )
        self._full_slots = [
            torch.as_tensor(plan.slot_mapping[g].astype(np.int64), device=self.device)
            for g in range(plan.num_cache_groups)
        ]
        # Recurrent layers are not split (a state is sequential): they run on the whole plan,
        # on every rank alike (their states are replicated), between the split layers.
        self._full_step = StepInputs.from_plan(plan, self.device)
        self._own_tokens = torch.as_tensor(sub.token_index, device=self.device)
        self._splitting = True
        try:
            step, top, tables = self._begin(sub)
            _, hidden = self._run_stack(step, top, tables)
        finally:
            self._splitting = False
        full_hidden = self._gather_tokens(hidden)
        out = self._sample(plan, self._full_step, full_hidden, top)
        asked = prompt_logprobs.asked(plan)
        if asked is not None:
            out = self._prompt_logprobs(asked, full_hidden, top, out)
        return out

    def _run_stack(
        self, step: StepInputs, top: LayerContext, tables: dict[int, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not getattr(self, "_splitting", False) or not any(
            layer.cache.kind == "recurrent" for layer in self.model.layers
        ):
            return super()._run_stack(step, top, tables)
        model, globals_ = self.model, self.weights.globals
        hidden = model.embed(step.input_ids, globals_, top)
        if model.pre_layers is not None:
            hidden = model.pre_layers(hidden, globals_, top)
        full_tables: dict[int, Any] = {}
        for layer in model.layers:
            weights = self.child_weights[layer.index]
            if layer.cache.kind == "recurrent":
                whole = self._gather_tokens(hidden)
                self._splitting = False  # (this layer's context: the whole plan's)
                try:
                    ctx = self._context(self._full_step, layer.index, full_tables)
                    whole = layer.decoder(whole, layer.children, weights, ctx, _no_emit)
                finally:
                    self._splitting = True
                hidden = whole[self._own_tokens]
            else:
                ctx = self._context(step, layer.index, tables)
                hidden = layer.decoder(hidden, layer.children, weights, ctx, _no_emit)
        last_layer_hidden = hidden
        if model.post_layers is not None:
            hidden = model.post_layers(hidden, globals_, top)
        return last_layer_hidden, hidden

    def _context(self, step: StepInputs, index: int, tables: Any = None) -> LayerContext:
        ctx = super()._context(step, index, tables)
        if not getattr(self, "_splitting", False):
            return ctx
        if ctx.attention is not None:
            ctx.attention = self._gathered(ctx.attention)
        # Extra caches too (DeepSeek-V4's compressed entries: each rank closes the entries its
        # tokens end, and every rank needs all of them).
        ctx.extra = {name: self._gathered(extra) for name, extra in ctx.extra.items()}
        return ctx

    def _gathered(self, attention: LayerAttention) -> LayerAttention:
        out = _GatheredWrites(
            attention.backend, attention.group, attention.slot_mapping, attention.caches
        )
        out.runner = self
        return out

    def bind_cache(self, layout: Any) -> None:
        super().bind_cache(layout)
        self._kinds = [str(group.spec.kind) for group in layout.groups]  # per cache group

    def _group_kinds(self) -> list[str]:
        return self._kinds

    def _gather_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``values`` (this rank's tokens, in its sub-plan order) put
        back in the full plan's token order, on every rank."""
        rank, world, group = self.cp
        indices = [
            np.concatenate([np.arange(s.start, s.stop) for s in rows] or [np.zeros(0, np.int64)])
            for rows in self._splits
        ]
        longest = max(len(i) for i in indices)
        padded = values.new_zeros((longest, *values.shape[1:]))
        padded[: values.shape[0]] = values
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        total = sum(len(i) for i in indices)
        out = values.new_empty((total, *values.shape[1:]))
        for part, index in zip(parts, indices):
            out[torch.as_tensor(index.astype(np.int64), device=out.device)] = part[: len(index)]
        return out


class ContextParallelRunner(ContextParallelMixin, TorchRunner):
    """A built-in family under context parallelism."""


def context_parallel_model_dir_runner() -> Any:
    """The model-directory runner under context parallelism (imported lazily: model_dir
    imports the scaffold)."""
    from resin.runners.torch.model_dir import ModelDirRunner

    class ContextParallelModelDirRunner(ContextParallelMixin, ModelDirRunner):
        """A model directory under context parallelism."""

    return ContextParallelModelDirRunner
