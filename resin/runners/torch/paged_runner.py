"""The shared paged runner: what every torch runner does, for any :class:`ModelDefinition`.

Owns, once for all models (built-in families and generated model directories alike):

- the plan plumbing: plan arrays -> tensors once per step (:class:`~.step_inputs.StepInputs`),
  the attention backend planned once per step (:mod:`.attention`), rotary tables evaluated once
  per step and table;
- the paged caches: ``cache_spec()`` from each layer's :class:`~.model_definition.LayerCache`,
  ``bind_cache(layout)`` allocating each declared buffer as ``[num_pages, entries_per_page,
  *shape]`` (``page_size`` tokens for a token cache; a compressed cache's own entries per
  page) (zeroed: page 0, the null page, reads as zeros);
- the forward: ``embed`` -> ``pre_layers`` -> every decoder layer -> ``post_layers`` ->
  ``final_norm`` -> ``logits`` -> the :class:`resin.sampling.Sampler`;
- parity capture: set ``runner.capture`` to a dict (or a callable ``(name, tensor)``) and each
  forward reports ``model.embed_tokens``, per layer ``model.layers.{i}.<child>`` (what the
  decoder function emits) and ``model.layers.{i}``, ``model.norm`` and ``lm_head`` —
  transformers' module names, each over all of the step's tokens (logits then come for every
  token, not only the sampled ones).

A model never edits this file: a fix here reaches every model. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from resin._core import BatchPlan, CacheLayout, ForwardOutput, LayerCacheSpec
from resin.runners.torch.attention import AttentionBackend, LayerAttention, make_attention_backend
from resin.runners.torch.context import LayerContext
from resin.runners.torch.layers import plan_tensor
from resin.runners.torch.model_definition import LayerCache, ModelDefinition
from resin.runners.torch.model_weights import ModelWeights
from resin.runners.torch.recurrent_state import RecurrentState, apply_copies
from resin.runners.torch.step_inputs import StepInputs
from resin.sampling import Sampler

Capture = Callable[[str, torch.Tensor], None] | dict[str, torch.Tensor]


class PagedRunner:
    """Runs one model for the engine. Subclasses add ``from_pretrained``."""

    def __init__(
        self,
        model: ModelDefinition,
        weights: ModelWeights,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str | AttentionBackend | None = None,
    ):
        self.model = model
        self.config = model.config
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention_backend = make_attention_backend(attention_backend)
        self.child_weights = [
            {child: weights.module(layer.index, child) for child in layer.children}
            for layer in model.layers
        ]
        self.sampler = Sampler(model.vocab_size, self.device)
        self.capture: Capture | None = None
        self.layer_caches: list[dict[str, torch.Tensor]] = []
        self.state_pages: list[torch.Tensor | None] = []
        self.extra_slots: list[dict[str, tuple[int, dict[str, torch.Tensor]]]] = []
        self.pages_per_state: list[int] = []
        self.group_ratios: list[int] = []
        self._state_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bound = False
        self.group_of_layer: list[int] = []
        self.group_windows: list[int | None] = []
        self.group_page_entries: list[int] = []

    # -- cache ---------------------------------------------------------------------------

    def cache_spec(self) -> list[LayerCacheSpec]:
        """One spec per cache of each layer, layer by layer: its main cache, then its extra
        caches (a layer keeping a raw window and compressed entries declares two)."""
        return [cache.spec(self.dtype) for _, _, cache in self._cache_slots()]

    def _cache_slots(self) -> list[tuple[int, str, LayerCache]]:
        """(layer index, cache name — "" for the main one —, cache) in spec order."""
        return [
            (layer.index, name, cache)
            for layer in self.model.layers
            for name, cache in [("", layer.cache), *layer.extra_caches.items()]
        ]

    def bind_cache(self, layout: CacheLayout) -> None:
        """Allocate every declared cache, zeroed: ``[num_pages, page_size, *shape]`` per token
        buffer, ``[num_pages, entries_per_page, *shape]`` per compressed one (its group's
        ``CacheGroup.entries_per_page``); for a recurrent layer one byte buffer ``[num_pages,
        page_bytes]`` holding its requests' states (:mod:`.recurrent_state`)."""
        num_layers = len(self.model.layers)
        self.layer_caches = [{} for _ in range(num_layers)]
        self.state_pages = [None] * num_layers
        self.extra_slots = [{} for _ in range(num_layers)]
        self.group_of_layer = [0] * num_layers
        for spec_index, (index, name, cache) in enumerate(self._cache_slots()):
            group = layout.group_of_layer(spec_index)
            entries_per_page = layout.groups[group].entries_per_page
            if name:
                self.extra_slots[index][name] = (
                    group,
                    self._buffers(cache, layout.num_pages, entries_per_page),
                )
                continue
            self.group_of_layer[index] = group
            if cache.kind == "recurrent":
                page_bytes = layout.page_bytes or cache.state_bytes(self.dtype)
                self.state_pages[index] = torch.zeros(
                    (layout.num_pages, page_bytes), dtype=torch.uint8, device=self.device
                )
            else:
                self.layer_caches[index] = self._buffers(cache, layout.num_pages, entries_per_page)
        self.pages_per_state = [group.pages_per_state for group in layout.groups]
        self.group_windows = [
            group.spec.window if group.spec.kind == "sliding_window" else None
            for group in layout.groups
        ]
        self.group_ratios = [group.spec.ratio or 1 for group in layout.groups]
        # Positions one page holds, per group (a recurrent group's pages hold state bytes).
        self.group_page_entries = [
            group.entries_per_page or layout.page_size for group in layout.groups
        ]
        self.bound = True

    def _buffers(
        self, cache: LayerCache, num_pages: int, entries_per_page: int
    ) -> dict[str, torch.Tensor]:
        return {
            name: torch.zeros(
                (num_pages, entries_per_page, *shape),
                dtype=cache.dtype or self.dtype,
                device=self.device,
            )
            for name, shape in cache.buffers.items()
        }

    # -- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, plan: BatchPlan) -> ForwardOutput:
        if not self.bound:
            raise RuntimeError(
                f"{type(self).__name__}.forward before bind_cache: create the "
                "runner's resin.Engine first (it calls bind_cache)"
            )
        model, globals_ = self.model, self.weights.globals
        self.sampler.begin_step(plan)
        step = StepInputs.from_plan(plan, self.device)
        self.attention_backend.begin_step(
            step, self.group_windows, self.group_page_entries, self.group_ratios
        )
        for pages in self.state_pages:  # copy-on-write from prefix checkpoints, first
            if pages is not None:
                apply_copies(pages, step.copy_pages)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._state_tables = {}
        top = self._context(step, -1)

        hidden = model.embed(step.input_ids, globals_, top)
        self._emit("model.embed_tokens", hidden)
        if model.pre_layers is not None:
            hidden = model.pre_layers(hidden, globals_, top)
        for layer in model.layers:
            ctx = self._context(step, layer.index, tables)
            emit = self._layer_emitter(layer.index)
            hidden = layer.decoder(
                hidden, layer.children, self.child_weights[layer.index], ctx, emit
            )
            self._emit(f"model.layers.{layer.index}", hidden)
        if model.post_layers is not None:
            hidden = model.post_layers(hidden, globals_, top)

        last = step.last_token_indices
        if self.capture is not None:
            normed = self._final_norm(hidden, top)
            self._emit("model.norm", normed)
            all_logits = model.logits(normed, globals_, top)
            self._emit("lm_head", all_logits)
            logits = all_logits[last]
        else:
            logits = model.logits(self._final_norm(hidden[last], top), globals_, top)
        return self.sampler.sample(logits.float(), plan, step.sample_rows)

    def _context(
        self,
        step: StepInputs,
        index: int,
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> LayerContext:
        ctx = LayerContext(
            query_indptr=step.query_indptr,
            index=index,
            config=self.config,
            head_dim=self.model.head_dim,
            dtype=self.dtype,
            input_ids=step.input_ids,
            positions=step.positions,
        )
        if index < 0 or tables is None:
            return ctx
        layer = self.model.layers[index]
        group = self.group_of_layer[index]
        ctx.layer_type, ctx.window = layer.layer_type, layer.window
        ctx.rotary = self.model.rotary_for(layer.layer_type)
        if ctx.rotary is not None:
            key = id(ctx.rotary)  # one evaluation per table per step, shared by its layers
            if key not in tables:
                tables[key] = ctx.rotary.cos_sin(step.positions, self.dtype)
            ctx.cos, ctx.sin = tables[key]
        ctx.caches = self.layer_caches[index]
        pages = self.state_pages[index]
        if pages is not None:
            table, initial = self._state_table(step, group)
            ctx.state = RecurrentState(
                pages, layer.cache.buffers, layer.cache.dtype or self.dtype, table, initial
            )
        if ctx.caches:
            ctx.attention = LayerAttention(
                self.attention_backend, group, step.slot_mappings[group], ctx.caches
            )
        for name, (extra_group, buffers) in self.extra_slots[index].items():
            ctx.extra[name] = LayerAttention(
                self.attention_backend, extra_group, step.slot_mappings[extra_group], buffers
            )
        return ctx

    def _state_table(self, step: StepInputs, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A recurrent group's state pages ``[S, pages_per_state]`` and ``has_initial_state``
        as tensors, once per step and group (its layers share them)."""
        if group not in self._state_tables:
            plan = step.plan
            table = plan_tensor(plan.kv_indices[group], self.device).long()
            table = table.reshape(len(plan.seq_lens), self.pages_per_state[group])
            initial = plan_tensor(plan.has_initial_state[group], self.device).bool()
            self._state_tables[group] = (table, initial)
        return self._state_tables[group]

    def _final_norm(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if self.model.final_norm is None:
            return hidden
        return self.model.final_norm(hidden, self.weights.global_module("norm"), ctx)

    def _layer_emitter(self, index: int) -> Callable[[str, torch.Tensor], None]:
        def emit(child: str, tensor: torch.Tensor) -> None:
            self._emit(f"model.layers.{index}.{child}", tensor)

        return emit

    def _emit(self, name: str, tensor: torch.Tensor) -> None:
        if self.capture is None:
            return
        if isinstance(self.capture, dict):
            self.capture[name] = tensor.detach().clone()
        else:
            self.capture(name, tensor)
