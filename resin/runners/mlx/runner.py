"""The MLX runner: one model run on ``mlx.core`` for the engine, from the same BatchPlan.

Owns :class:`MlxRunner`, the MLX counterpart of the torch runners' shared paged runner
(:mod:`resin.runners.torch.paged_runner`), with the same contract:

- ``cache_spec()``: one K/V spec per layer (full, or sliding window for a windowed layer), in
  the runner's dtype; ``bind_cache(layout)`` allocates the caches zeroed (page 0, the null
  page, reads as zeros) as the torch runners lay them out: ``layout.num_layer_slots`` K and V
  buffers of ``num_pages * page_size`` rows, the k-th layer of every cache group on slot k (a
  page id belongs to one group at a time), so the engine's pool sizing (``resin.LLM``) holds
  for both runners;
- ``forward(plan)``: the sampler's lifecycle diff, per cache group the page-table reads and
  slot-mapping writes once (:class:`~.paged_attention.GroupAttention`), the rotary table once,
  embed -> every layer -> final norm -> logits of the sampled tokens -> :class:`~.sampler.MlxSampler`;
  chunked prefill, prefix hits, preemption and verify rows need nothing more (the plan says
  which pages each row reads and which slots its tokens write);
- parity capture: set ``runner.capture`` to a dict (or a callable ``(name, array)``) and each
  forward reports ``model.embed_tokens``, per layer ``model.layers.{i}.<child>`` and
  ``model.layers.{i}``, ``model.norm`` and ``lm_head`` (logits of every token) — transformers'
  module names, as the torch runners. A dict gets float32 numpy copies (the parity harness
  takes them as they are); the runner never imports torch.

Families (:meth:`MlxRunner.from_pretrained`, by ``config.json``'s architecture): the built-in
Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral (:mod:`.llama`) and gpt-oss (:mod:`.gpt_oss`).
Devices: ``cpu`` (``mx.cpu``), ``gpu`` / ``metal`` / ``mps`` (``mx.gpu``, Apple silicon), or
``default`` (MLX's default device); the forward runs on that device's stream.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from resin._core import BatchPlan, CacheLayout, ForwardOutput, LayerCacheSpec
from resin.loading import load_model_config
from resin.runners import prompt_logprobs
from resin.runners.mlx.gpt_oss import ARCHITECTURE as GPT_OSS
from resin.runners.mlx.gpt_oss import gpt_oss_model
from resin.runners.mlx.layers import mlx_dtype
from resin.runners.mlx.llama import llama_family_model
from resin.runners.mlx.model import LayerCaches, LayerStep, MlxModel, run_layer
from resin.runners.mlx.paged_attention import GroupAttention
from resin.runners.mlx.sampler import MlxSampler
from resin.sampling_state import sampling_rows

Capture = Callable[[str, Any], None] | dict[str, Any]
DEVICES = {"cpu": "cpu", "gpu": "gpu", "metal": "gpu", "mps": "gpu"}


def mlx_device(device: object) -> mx.Device:
    """``cpu`` / ``gpu`` (``metal``, ``mps``) / ``default`` or None -> the MLX device."""
    if device is None or str(device) == "default":
        return mx.default_device()
    name = DEVICES.get(str(device).split(":")[0])
    if name is None:
        raise ValueError(f"device {device!r} for the MLX runner: use cpu, gpu (Metal) or default")
    return mx.Device(mx.cpu if name == "cpu" else mx.gpu)


class MlxRunner:
    """Runs one model on MLX for the engine. Build with :meth:`from_pretrained`."""

    def __init__(self, model: MlxModel, dtype: mx.Dtype, device: mx.Device | None = None):
        self.model = model
        self.config = model.config
        self.dtype = dtype
        self.device = device if device is not None else mx.default_device()
        self.sampler = MlxSampler(model.vocab_size)
        self.capture: Capture | None = None
        self.slot_caches: list[LayerCaches] = []
        self.layer_caches: list[LayerCaches] = []
        self.group_of_layer: list[int] = []
        self.group_windows: list[int | None] = []
        self.page_size = 0
        self.bound = False

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str],
        device: object = "cpu",
        dtype: object = "float32",
    ) -> MlxRunner:
        """Load ``config.json`` and the safetensors of ``model_dir`` in ``dtype`` (float32,
        bfloat16 or float16; a torch dtype's name is accepted)."""
        config = load_model_config(model_dir)
        mx_dtype = mlx_dtype(dtype)
        mx_device = mlx_device(device)
        with mx.stream(mx_device):
            if config.architecture == GPT_OSS:
                model = gpt_oss_model(Path(model_dir), config, mx_dtype)
            else:
                model = llama_family_model(Path(model_dir), config, mx_dtype)
            # Evaluate every weight now: MLX binds a lazy array to the stream of the thread
            # that built it, and the forward may run on another one (resin serve's engine
            # thread), which has no such stream.
            mx.eval(
                list(model.globals.values())
                + [a for layer in model.layers for w in layer.weights.values() for a in w.values()]
            )
        return cls(model, mx_dtype, mx_device)

    # -- cache ---------------------------------------------------------------------------

    def bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.model.num_kv_heads * self.model.head_dim * self.dtype.size

    def cache_spec(self) -> list[LayerCacheSpec]:
        specs = []
        for layer in self.model.layers:
            if layer.window:
                specs.append(LayerCacheSpec.sliding_window(layer.window, self.bytes_per_token()))
            else:
                specs.append(LayerCacheSpec.full(self.bytes_per_token()))
        return specs

    def bind_cache(self, layout: CacheLayout) -> None:
        """Allocate the K/V buffers, zeroed: one pair per layer slot, shared across groups."""
        rows = layout.num_pages * layout.page_size
        shape = (rows, self.model.num_kv_heads, self.model.head_dim)
        with mx.stream(self.device):
            self.slot_caches = [
                LayerCaches(mx.zeros(shape, dtype=self.dtype), mx.zeros(shape, dtype=self.dtype))
                for _ in range(layout.num_layer_slots)
            ]
            mx.eval([c.k for c in self.slot_caches] + [c.v for c in self.slot_caches])
        groups = layout.groups
        self.group_of_layer = [layout.group_of_layer(i) for i in range(len(self.model.layers))]
        self.layer_caches = [
            self.slot_caches[groups[g].layer_indices.index(i)]
            for i, g in enumerate(self.group_of_layer)
        ]
        self.group_windows = [
            group.spec.window if group.spec.kind == "sliding_window" else None for group in groups
        ]
        self.page_size = layout.page_size
        self.bound = True

    # -- forward -------------------------------------------------------------------------

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        if not self.bound:
            raise RuntimeError(
                "MlxRunner.forward before bind_cache: create the runner's resin.Engine first "
                "(it calls bind_cache)"
            )
        if len(plan.copy_pages):
            raise RuntimeError("the MLX runner has no recurrent groups, yet the plan copies pages")
        with mx.stream(self.device):
            return self._forward(plan)

    def _forward(self, plan: BatchPlan) -> ForwardOutput:
        model = self.model
        self.sampler.begin_step(plan)
        rows, last = sampling_rows(plan)
        groups = [
            GroupAttention.from_plan(plan, g, self.page_size, window)
            for g, window in enumerate(self.group_windows)
        ]
        positions = mx.array(np.asarray(plan.positions))
        cos, sin = model.rotary.cos_sin(positions, self.dtype)
        hidden = model.embed(mx.array(plan.input_ids.astype(np.int32)))
        self._emit("model.embed_tokens", hidden)
        for layer in model.layers:
            ctx = LayerStep(
                config=self.config,
                head_dim=model.head_dim,
                cos=cos,
                sin=sin,
                group=groups[self.group_of_layer[layer.index]],
                caches=self.layer_caches[layer.index],
                extra=model.extra,
            )
            hidden = run_layer(layer, hidden, ctx, self._emitter(layer.index))
            self._emit(f"model.layers.{layer.index}", hidden)
        last_tokens = mx.array(last.astype(np.int32))
        if self.capture is not None:
            normed = model.norm(hidden, ctx)
            self._emit("model.norm", normed)
            all_logits = model.logits(normed)
            self._emit("lm_head", all_logits)
            logits = all_logits[last_tokens]
        else:
            normed = model.norm(hidden[last_tokens], ctx)
            logits = model.logits(normed)
        logits = logits.astype(mx.float32)
        mx.eval(logits, [c.k for c in self.slot_caches], [c.v for c in self.slot_caches])
        out = self.sampler.sample(logits, plan, rows)
        asked = prompt_logprobs.asked(plan)
        if asked is not None:
            out = self._prompt_logprobs(asked, hidden, ctx, out)
        return out

    def _prompt_logprobs(
        self,
        asked: prompt_logprobs.PromptLogprobsAsked,
        hidden: mx.array,
        ctx: LayerStep,
        out: ForwardOutput,
    ) -> ForwardOutput:
        """``out`` with the logprobs of the plan's prompt logprob targets (and the top k),
        from the final norm and logits of their tokens, a chunk at a time."""
        logprobs, top_ids, top_logprobs = [], [], []
        for part in asked.chunks():
            rows = mx.array(asked.token_indices[part].astype(np.int32))
            logits = self.model.logits(self.model.norm(hidden[rows], ctx)).astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets = mx.array(asked.target_ids[part].astype(np.int32))
            logprobs.append(np.array(mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]))
            if asked.num_top:
                order = mx.argsort(-logp, axis=-1)[:, : asked.num_top]
                top_ids.append(np.array(order).astype(np.uint32))
                top_logprobs.append(np.array(mx.take_along_axis(logp, order, axis=-1)))
        return prompt_logprobs.with_prompt_logprobs(
            out,
            np.concatenate(logprobs),
            np.concatenate(top_ids) if top_ids else None,
            np.concatenate(top_logprobs) if top_logprobs else None,
        )

    def _emitter(self, index: int) -> Callable[[str, mx.array], None]:
        def emit(child: str, array: mx.array) -> None:
            self._emit(f"model.layers.{index}.{child}", array)

        return emit

    def _emit(self, name: str, array: mx.array) -> None:
        if self.capture is None:
            return
        if isinstance(self.capture, dict):
            self.capture[name] = host_copy(array)
        else:
            self.capture(name, array)


def host_copy(array: mx.array) -> np.ndarray:
    """A float32 numpy copy of ``array`` (the parity harness takes numpy captures)."""
    return np.array(array.astype(mx.float32))
