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
- speculative decoding with the checkpoint's MTP layer: ``enable_mtp(k)`` before the engine
  adds its caches and runs :class:`~.mtp_drafter.MtpDrafter` after each sampled step;
- CUDA graphs: ``configure_cuda_graphs(...)`` before the engine picks the decode batch sizes
  (the engine's ``cuda_graph_batch_sizes``); ``bind_cache`` then captures them and pure-decode
  steps replay (:mod:`.cuda_graphs`; eager otherwise, and always on CPU);
- parity capture: set ``runner.capture`` to a dict (or a callable ``(name, tensor)``) and each
  forward reports ``model.embed_tokens``, per layer ``model.layers.{i}.<child>`` (what the
  decoder function emits) and ``model.layers.{i}``, ``model.norm`` and ``lm_head`` —
  transformers' module names, each over all of the step's tokens (logits then come for every
  token, not only the sampled ones).

A model never edits this file: a fix here reaches every model. Imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resin._core import BatchPlan, CacheGroup, CacheLayout, ForwardOutput, LayerCacheSpec
from resin.runners import prompt_logprobs
from resin.runners.torch.attention import AttentionBackend, LayerAttention, make_attention_backend
from resin.runners.torch.context import LayerContext
from resin.runners.torch.layers import plan_tensor
from resin.runners.torch.model_definition import LayerCache, LayerDefinition, ModelDefinition
from resin.runners.torch.model_weights import ModelWeights
from resin.runners.torch.mtp_drafter import TARGET_HIDDEN, MtpDrafter, target_hidden_cache
from resin.runners.torch.recurrent_state import RecurrentState, apply_copies
from resin.runners.torch.step_inputs import StepInputs
from resin.sampling import Sampler

if TYPE_CHECKING:
    from resin.runners.torch.cuda_graphs import CudaGraphs

Capture = Callable[[str, torch.Tensor], None] | dict[str, torch.Tensor]


@dataclass
class BegunStep:
    """A plan :meth:`PagedRunner.begin_forward` started: its logits at the sampled tokens and
    their plan rows; for an eager step its tensors (step, context, rotary tables, the last
    layer's and the final hidden states) for the drafter and prompt logprobs; ``output`` when
    the whole forward already ran (a subclass with its own ``forward``)."""

    plan: BatchPlan
    logits: torch.Tensor | None = None
    rows: np.ndarray | None = None
    eager: tuple[StepInputs, LayerContext, dict[int, Any], torch.Tensor, torch.Tensor] | None = None
    output: ForwardOutput | None = None


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
        self.drafter: MtpDrafter | None = None
        self.cuda_graphs: CudaGraphs | None = None
        self._begun: BegunStep | None = None  # begin_forward's plan, until finish_forward

    # -- CUDA graphs ---------------------------------------------------------------------

    def configure_cuda_graphs(
        self,
        batch_sizes: Sequence[int] | None = None,
        *,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool | None = None,
    ) -> list[int]:
        """Choose the decode batch sizes to capture (None: vLLM's default sizes up to
        ``max_num_seqs``; sizes above it are dropped) and return them: the list to give the
        engine as ``EngineConfig.cuda_graph_batch_sizes``. Empty, with the reason logged once,
        when this runner cannot capture (not on CUDA, a backend without static metadata, MTP,
        recurrent or compressed caches: :func:`.cuda_graphs.ineligible_reason`). Call before
        the engine is built; ``bind_cache`` captures. ``capture``: None captures (CUDA only:
        elsewhere no graphs); False runs the same padded static-buffer path eagerly on any
        device (how tests check it on CPU)."""
        from resin.runners.torch.cuda_graphs import configure

        if self.bound:
            raise RuntimeError(
                "configure_cuda_graphs after bind_cache: configure before the engine"
            )
        self.cuda_graphs = configure(self, batch_sizes, max_num_seqs, max_model_len, capture)
        return [] if self.cuda_graphs is None else list(self.cuda_graphs.batch_sizes)

    def cuda_graph_stats(self) -> dict[str, Any] | None:
        """Steps replayed vs run eager, and why (:meth:`.cuda_graphs.CudaGraphs.stats`); None
        without graphs."""
        return None if self.cuda_graphs is None else self.cuda_graphs.stats()

    # -- speculative decoding ----------------------------------------------------------

    def enable_mtp(self, num_speculative_tokens: int) -> None:
        """Draft ``num_speculative_tokens`` tokens per sampled row with the checkpoint's MTP
        layer (:mod:`.mtp_drafter`): its caches join ``cache_spec``, so call this before
        the engine is built. ValueError when the model or checkpoint has no MTP layer."""
        mtp = self.model.mtp
        if mtp is None:
            raise ValueError(
                f"{self.model.name}: no MTP layer to draft with (the model directory "
                "defines none, or the checkpoint ships no mtp.* tensors: "
                "num_nextn_predict_layers / save_pretrained drop them); use "
                "--speculative-method ngram"
            )
        if self.bound:
            raise RuntimeError("enable_mtp after bind_cache: enable it before the engine")
        for layer in mtp.layers:
            layer.extra_caches.setdefault(TARGET_HIDDEN, target_hidden_cache(mtp))
            self.child_weights.append(
                {
                    child: self.weights.module(layer.index, child)
                    for child in [*layer.children, "mtp"]
                }
            )
        self.drafter = MtpDrafter(self, mtp, num_speculative_tokens)

    def _layers(self) -> list[LayerDefinition]:
        """The decoder layers, then the MTP layers when drafting with them."""
        if self.drafter is None or self.model.mtp is None:
            return self.model.layers
        return [*self.model.layers, *self.model.mtp.layers]

    # -- cache ---------------------------------------------------------------------------

    def cache_spec(self) -> list[LayerCacheSpec]:
        """One spec per cache of each layer, layer by layer: its main cache, then its extra
        caches (a layer keeping a raw window and compressed entries declares two)."""
        return [cache.spec(self.dtype) for _, _, cache in self._cache_slots()]

    def _cache_slots(self) -> list[tuple[int, str, LayerCache]]:
        """(layer index, cache name — "" for the main one —, cache) in spec order."""
        return [
            (layer.index, name, cache)
            for layer in self._layers()
            for name, cache in [("", layer.cache), *layer.extra_caches.items()]
        ]

    def bind_cache(self, layout: CacheLayout) -> None:
        """Allocate the caches, zeroed (page 0, the null page, reads as zeros).

        Token and recurrent groups share memory: one byte buffer of ``num_pages`` pages of
        ``page_bytes`` per *layer slot* (``layout.num_layer_slots``), and the k-th cache of
        every such group views slot k — a page id belongs to one group at a time, so a page
        holds whichever group owns it (the engine's one pool; vLLM's layout). A token cache's
        buffers are ``[num_pages, page_size, *shape]`` views carved one after another from the
        page row; a recurrent state spans ``pages_per_state`` rows (:mod:`.recurrent_state`).
        A compressed cache has buffers of its own, ``[num_pages, entries_per_page, *shape]``
        (its pages are smaller). A cache whose buffers do not fit or align in a page row gets
        its own buffers too (``self.unshared`` names them).
        """
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()  # graphs read the old buffers: drop them first
        num_layers = len(self._layers())
        self.layer_caches = [{} for _ in range(num_layers)]
        self.state_pages = [None] * num_layers
        self.extra_slots = [{} for _ in range(num_layers)]
        self.group_of_layer = [0] * num_layers
        self.unshared: list[str] = []
        self.slot_buffers = [
            torch.zeros(
                (layout.num_pages, layout.page_bytes), dtype=torch.uint8, device=self.device
            )
            for _ in range(layout.num_layer_slots if layout.page_bytes else 0)
        ]
        groups = layout.groups
        for spec_index, (index, name, cache) in enumerate(self._cache_slots()):
            group = layout.group_of_layer(spec_index)
            buffers = self._bind_one(cache, groups[group], spec_index, layout)
            if not isinstance(buffers, dict):  # a recurrent state's byte pages
                self.state_pages[index] = buffers
                self.group_of_layer[index] = group
            elif name:
                self.extra_slots[index][name] = (group, buffers)
            else:
                self.group_of_layer[index] = group
                self.layer_caches[index] = buffers
        self.pages_per_state = [group.pages_per_state for group in groups]
        self.group_windows = [
            group.spec.window if group.spec.kind == "sliding_window" else None for group in groups
        ]
        self.group_ratios = [group.spec.ratio or 1 for group in groups]
        # Positions one page holds, per group (a recurrent group's pages hold state bytes).
        self.group_page_entries = [group.entries_per_page or layout.page_size for group in groups]
        self.bound = True
        if self.cuda_graphs is not None:
            self.cuda_graphs.bind(layout)  # capture over these buffers

    def _bind_one(
        self, cache: LayerCache, group: CacheGroup, spec_index: int, layout: CacheLayout
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """One cache's buffers: views into its layer slot's shared page rows where they fit,
        else buffers of its own."""
        slot = group.layer_indices.index(spec_index)
        shared = (
            self.slot_buffers[slot]
            if group.spec.kind != "compressed" and self.slot_buffers
            else None
        )
        if cache.kind == "recurrent":
            if shared is not None:
                return shared
            return torch.zeros(
                (layout.num_pages, cache.state_bytes(self.dtype)),
                dtype=torch.uint8,
                device=self.device,
            )
        entries = group.entries_per_page
        if shared is not None:
            views = _carve(shared, entries, cache.buffers, cache.dtype or self.dtype)
            if views is not None:
                return views
            self.unshared.append(f"cache spec {spec_index}")
        return {
            name: torch.zeros(
                (layout.num_pages, entries, *shape),
                dtype=cache.dtype or self.dtype,
                device=self.device,
            )
            for name, shape in cache.buffers.items()
        }

    # -- forward -------------------------------------------------------------------------

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        self._begin_forward(plan)
        return self._finish_forward()

    def begin_forward(self, plan: BatchPlan) -> None:
        """Starts ``plan``'s model work: the layer stack and the logits at the sampled tokens
        (a CUDA graph's replay, or eager kernels), with no host synchronisation on a GPU;
        :meth:`finish_forward` samples. ``Engine.step()`` with ``async_scheduling`` calls the
        two apart, so the device computes while the caller processes the last step's outputs
        (docs/architecture.md, "Overlapped scheduling"). A subclass with its own ``forward``
        runs it whole here."""
        if type(self).forward is PagedRunner.forward:
            self._begin_forward(plan)
        else:
            self._begun = None
            self._begun = BegunStep(plan, output=self.forward(plan))

    def finish_forward(self) -> ForwardOutput:
        """The output of the plan :meth:`begin_forward` started: its tokens sampled (the host
        waits for the device here), then the drafter's proposals and prompt logprobs."""
        return self._finish_forward()

    @torch.inference_mode()
    def _begin_forward(self, plan: BatchPlan) -> None:
        if not self.bound:
            raise RuntimeError(
                f"{type(self).__name__}.forward before bind_cache: create the "
                "runner's resin.Engine first (it calls bind_cache)"
            )
        self._begun = None
        self.sampler.begin_step(plan)
        if self.cuda_graphs is not None:
            logits = self.cuda_graphs.replay(plan)  # None: this plan runs eager
            if logits is not None:
                self._begun = BegunStep(plan, logits, np.arange(plan.num_sequences))
                return
        step, top, tables = self._begin(plan)
        last_layer_hidden, hidden = self._run_stack(step, top, tables)
        logits = self._logits(step, hidden, top)
        self._begun = BegunStep(
            plan, logits, step.sample_rows, (step, top, tables, last_layer_hidden, hidden)
        )

    @torch.inference_mode()
    def _finish_forward(self) -> ForwardOutput:
        begun, self._begun = self._begun, None
        if begun is None:
            raise RuntimeError(f"{type(self).__name__}.finish_forward without begin_forward")
        if begun.output is not None:
            return begun.output
        assert begun.logits is not None and begun.rows is not None
        out = self.sampler.sample(begun.logits, begun.plan, begun.rows)
        if begun.eager is None:  # a graph's replay
            return out
        step, top, tables, last_layer_hidden, hidden = begun.eager
        if self.drafter is not None:
            out = self.drafter.run(step, last_layer_hidden, out, tables)
        asked = prompt_logprobs.asked(begun.plan)
        if asked is not None:
            out = self._prompt_logprobs(asked, hidden, top, out)
        return out

    def _begin(self, plan: Any) -> tuple[StepInputs, LayerContext, dict[int, Any]]:
        """The step's tensors, the backend planned, the plan's cache ops applied."""
        step = StepInputs.from_plan(plan, self.device)
        self.attention_backend.begin_step(
            step, self.group_windows, self.group_page_entries, self.group_ratios
        )
        # Cache ops first: copy-on-write of recurrent states, then zeroing pages that held a
        # state and now hold tokens (stale state bytes could read as NaN keys).
        for pages in self._state_buffers():
            apply_copies(pages, step.copy_pages)
        if step.zero_pages.numel():
            for pages in self.slot_buffers:
                pages[step.zero_pages] = 0
        self._state_tables = {}
        return step, self._context(step, -1), {}

    def _run_stack(
        self, step: StepInputs, top: LayerContext, tables: dict[int, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, pre_layers, every decoder layer, post_layers -> (the last layer's
        output, the hidden state the final norm reads)."""
        model, globals_ = self.model, self.weights.globals
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
        last_layer_hidden = hidden
        if model.post_layers is not None:
            hidden = model.post_layers(hidden, globals_, top)
        return last_layer_hidden, hidden

    def _sample(
        self, plan: Any, step: StepInputs, hidden: torch.Tensor, top: LayerContext
    ) -> ForwardOutput:
        """:meth:`_logits`, then the sampler."""
        return self.sampler.sample(self._logits(step, hidden, top), plan, step.sample_rows)

    def _logits(self, step: StepInputs, hidden: torch.Tensor, top: LayerContext) -> torch.Tensor:
        """Final norm and float32 logits at the sampled tokens (every token's with capture on)."""
        model, globals_ = self.model, self.weights.globals
        last = step.last_token_indices
        if self.capture is not None:
            normed = self._final_norm(hidden, top)
            self._emit("model.norm", normed)
            all_logits = model.logits(normed, globals_, top)
            self._emit("lm_head", all_logits)
            logits = all_logits[last]
        else:
            logits = model.logits(self._final_norm(hidden[last], top), globals_, top)
        return logits.float()

    def _prompt_logprobs(
        self,
        asked: prompt_logprobs.PromptLogprobsAsked,
        hidden: torch.Tensor,
        top: LayerContext,
        out: ForwardOutput,
    ) -> ForwardOutput:
        """``out`` with the logprobs of the plan's prompt logprob targets (and the top k),
        from the final norm and logits of their tokens, a chunk at a time. A tensor-parallel
        rank other than 0 (``out`` None: it does not sample) computes the logits too, for
        their collectives, and returns None."""
        model, globals_ = self.model, self.weights.globals
        indices = torch.from_numpy(asked.token_indices).to(hidden.device)
        targets = torch.from_numpy(asked.target_ids).to(hidden.device)
        logprobs, top_ids, top_logprobs = [], [], []
        for part in asked.chunks():
            normed = self._final_norm(hidden[indices[part]], top)
            logits = model.logits(normed, globals_, top)
            if out is None:
                continue
            logp = torch.log_softmax(logits.float(), dim=-1)
            logprobs.append(logp.gather(1, targets[part, None]).squeeze(1).cpu())
            if asked.num_top:
                values, ids = logp.topk(asked.num_top, dim=-1)
                top_logprobs.append(values.cpu())
                top_ids.append(ids.cpu())
        if out is None:
            return out
        return prompt_logprobs.with_prompt_logprobs(
            out,
            torch.cat(logprobs).numpy(),
            torch.cat(top_ids).numpy() if top_ids else None,
            torch.cat(top_logprobs).numpy() if top_logprobs else None,
        )

    def _state_buffers(self) -> list[torch.Tensor]:
        """The distinct byte buffers recurrent states live in (shared slots, or their own)."""
        if self.slot_buffers:
            return self.slot_buffers
        return [pages for pages in self.state_pages if pages is not None]

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
        layer = self._layers()[index]
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


def _carve(
    pages: torch.Tensor, entries: int, buffers: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, torch.Tensor] | None:
    """``[num_pages, entries, *shape]`` views of ``dtype`` laid one after another in each page
    row of the uint8 ``pages`` ``[num_pages, page_bytes]`` (offsets aligned to the element
    size); None if they do not fit in a row or the row size does not align."""
    item = torch.empty((), dtype=dtype).element_size()
    num_pages, page_bytes = pages.shape
    if page_bytes % item:
        return None
    views, offset = {}, 0
    for name, shape in buffers.items():
        offset = -(-offset // item) * item
        size = entries * math.prod(shape) * item
        if offset + size > page_bytes:
            return None
        row = pages[:, offset : offset + size].view(dtype)
        views[name] = row.view(num_pages, entries, *shape)
        offset += size
    return views
