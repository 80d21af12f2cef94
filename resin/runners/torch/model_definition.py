"""What a model is to the shared paged runner: :class:`ModelDefinition` and its parts.

Owns the description every torch model hands :class:`~.paged_runner.PagedRunner` — built-in
families (:mod:`.llama_family`) and generated model directories (:mod:`.model_dir`) alike:

- per layer (:class:`LayerDefinition`): its type and window, the decoder-layer function and
  one function per child module, and what it caches (:class:`LayerCache`);
- the rotary tables by layer type (several bases, partial rotary: each table is an object with
  ``cos_sin(positions, dtype)``; key ``"*"`` serves every type not listed);
- the model-level hooks, each ``fn(x, w, ctx)`` with ``w`` the checkpoint's non-layer tensors
  (runner names: ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``, ...):
  ``embed(input_ids, w, ctx) -> hidden`` (scale, extra embeddings), ``pre_layers`` /
  ``post_layers(hidden, w, ctx) -> hidden`` (e.g. hyper-connection streams ``[T, hc, D]`` in and
  out), ``final_norm(hidden, w, ctx)``, ``logits(hidden, w, ctx) -> [T, vocab]`` (soft-capping).

Decoder-layer functions are ``fn(hidden, fns, weights, ctx, emit) -> hidden``: ``hidden`` is
token-major (``[T, D]``, or ``[T, hc, D]`` with hyper-connections); ``fns`` / ``weights`` are
per child module name; ``emit(child, tensor)`` reports a parity checkpoint. Imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from resin import kernels
from resin._core import LayerCacheSpec

Weights = dict[str, torch.Tensor]
Hook = Callable[..., torch.Tensor]
CACHE_KINDS = ("full", "sliding_window", "recurrent", "compressed")


@dataclass
class LayerCache:
    """What one layer keeps, and the engine spec for it.

    ``buffers``: name -> shape. For ``full`` / ``sliding_window`` (``window`` tokens) layers the
    shape is per token (e.g. ``{"k": (kv_heads, head_dim), "v": (...)}``, or ``{"kv": (1,
    head_dim)}`` for a shared K = V cache, plus any extra per-token projections); each becomes a
    ``[num_pages, page_size, *shape]`` tensor of ``dtype`` (default: the runner's). For a
    ``recurrent`` layer (linear attention, SSM) the shape is per request — the whole state, e.g.
    ``{"conv": (channels, kernel - 1), "ssm": (heads, k_dim, v_dim)}`` — held in the engine's
    state pages (``state_bytes`` is their total size; blocks read and write them through
    ``ctx.state``). For a ``compressed`` layer (DeepSeek-V4 CSA / HCA) the shape is per entry,
    one entry per ``ratio`` source tokens, written when its closing token arrives (the plan's
    slot mapping is -1 for the others) and attended with the causal rule on closing positions;
    its buffers are ``[num_pages, entries_per_page, *shape]`` (a page spans ``lcm(page_size,
    ratio)`` tokens: ``CacheGroup.entries_per_page``).
    """

    kind: str = "full"
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    window: int | None = None
    dtype: torch.dtype | None = None
    ratio: int = 1  # compressed: source tokens per entry

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache kind {self.kind!r}; known: {', '.join(CACHE_KINDS)}")
        if self.kind == "sliding_window" and not self.window:
            raise ValueError("a sliding_window cache needs a window (tokens)")
        if not self.buffers:
            raise ValueError(f"a {self.kind} cache declares no buffers")
        if self.kind == "compressed" and self.ratio < 2:
            raise ValueError("a compressed cache needs a ratio >= 2 (source tokens per entry)")

    def bytes_per_token(self, runner_dtype: torch.dtype) -> int:
        itemsize = (self.dtype or runner_dtype).itemsize
        return sum(math.prod(shape) for shape in self.buffers.values()) * itemsize

    def state_bytes(self, runner_dtype: torch.dtype) -> int:
        """A recurrent layer's state size in bytes (every buffer, one request)."""
        return self.bytes_per_token(runner_dtype)

    def spec(self, runner_dtype: torch.dtype) -> LayerCacheSpec:
        if self.kind == "recurrent":
            return LayerCacheSpec.recurrent(self.state_bytes(runner_dtype))
        if self.kind == "compressed":  # buffers' shapes are per entry
            return LayerCacheSpec.compressed(self.ratio, self.bytes_per_token(runner_dtype))
        per_token = self.bytes_per_token(runner_dtype)
        if self.kind == "sliding_window":
            assert self.window is not None
            return LayerCacheSpec.sliding_window(self.window, per_token)
        return LayerCacheSpec.full(per_token)


def attention_cache(num_kv_heads: int, head_dim: int, window: int | None = None) -> LayerCache:
    """The usual K and V cache of a (GQA) attention layer, windowed when ``window`` is set."""
    buffers: dict[str, tuple[int, ...]] = {
        "k": (num_kv_heads, head_dim),
        "v": (num_kv_heads, head_dim),
    }
    if window:
        return LayerCache("sliding_window", buffers, window)
    return LayerCache("full", buffers)


@dataclass
class LayerDefinition:
    """One decoder layer. ``cache`` is its main cache (``ctx.attention`` / ``ctx.state``);
    ``extra_caches`` are more cache groups the same layer keeps (DeepSeek-V4: a raw sliding
    window plus compressed entries), reached as ``ctx.extra[name]``."""

    index: int
    layer_type: str
    window: int | None
    decoder: Hook
    children: dict[str, Hook]
    cache: LayerCache
    extra_caches: dict[str, LayerCache] = field(default_factory=dict)


def default_embed(input_ids: torch.Tensor, w: Weights, ctx: Any) -> torch.Tensor:
    """``embed_tokens`` lookup."""
    return F.embedding(input_ids, w["embed_tokens.weight"])


def default_logits(hidden: torch.Tensor, w: Weights, ctx: Any) -> torch.Tensor:
    """``lm_head`` (tied to ``embed_tokens`` when the checkpoint has no ``lm_head.weight``),
    with its ``lm_head.bias`` when the checkpoint has one (Phi-2's head)."""
    weight = w["lm_head.weight"] if "lm_head.weight" in w else w["embed_tokens.weight"]
    return kernels.linear(hidden, weight, w.get("lm_head.bias"))


@dataclass
class MtpDefinition:
    """A model's next-n (MTP) layers, run as the drafter of speculative decoding
    (:mod:`.mtp_drafter`): each is a decoder layer (``layers``, indices after the stack, with
    their own caches) fed by ``input(prev_hidden, embeds, w, ctx) -> hidden`` — the previous
    position's hidden state (the target's ``pre_layers``..last-layer stream, shape
    ``hidden_shape`` per token, e.g. ``(hc, D)``; or the MTP layer's own output when chained)
    mixed with the embedding of the token at this position (DeepSeek: ``e_proj(enorm(e)) +
    h_proj(hnorm(h))``) — and read out by ``output(hidden, w, ctx) -> [T, D]`` (its own norm /
    hyper-head) before the model's shared ``logits``. ``w`` is the layer's ``mtp`` module
    (``layers.{i}.mtp.*`` runner names). ``target(hidden, globals, ctx)``, when set, makes the
    target's last-layer output into what the MTP layer reads (GLM: the model's final hidden
    state, ``norm(mean(streams))``, as vLLM hands it to its MTP); None: the output itself."""

    layers: list[LayerDefinition]
    input: Hook
    output: Hook
    hidden_shape: tuple[int, ...]
    target: Hook | None = None


@dataclass
class ModelDefinition:
    """A model's functions and structure (see module doc). ``config`` is what blocks see as
    ``ctx.config``; ``vocab_size`` sizes the sampler."""

    name: str
    architecture: str
    config: Any
    vocab_size: int
    head_dim: int
    layers: list[LayerDefinition]
    rotary: dict[str, Any] = field(default_factory=dict)
    embed: Hook = default_embed
    pre_layers: Hook | None = None
    post_layers: Hook | None = None
    final_norm: Hook | None = None
    logits: Hook = default_logits
    mtp: MtpDefinition | None = None  # next-n layers the checkpoint ships (None: none)

    def rotary_for(self, layer_type: str) -> Any:
        """The rotary table object of one layer type (None: the model has none)."""
        return self.rotary.get(layer_type, self.rotary.get("*"))
