"""What a model is to the MLX runner: :class:`MlxModel`, its layers, and the per-layer context.

Owns the description a model family hands :class:`~resin.runners.mlx.runner.MlxRunner` (the
built-in families in :mod:`.llama`, gpt-oss in :mod:`.gpt_oss`), the MLX counterpart of the torch
runners' :class:`~resin.runners.torch.model_definition.ModelDefinition`:

- per layer (:class:`MlxLayer`): its sliding window (tokens, or None) and one block function per
  child of a pre-norm residual layer — ``input_layernorm``, ``self_attn``,
  ``post_attention_layernorm``, ``mlp`` (transformers' module names, which parity capture
  reports) — with that child's weights, keyed relative to it (``q_proj.weight``);
- the model's own tensors (``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``), the
  final norm, one rotary table, and the K/V cache shape per token (``num_kv_heads`` x
  ``head_dim``).

A block is ``fn(x [T, hidden], w, ctx) -> [T, hidden]`` with ``ctx`` a :class:`LayerStep`:
the step's rotary tables and the layer's cache through ``ctx.attention(q, k, v, scale=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from resin.runners.mlx.layers import RotaryTable, linear
from resin.runners.mlx.paged_attention import GroupAttention

Weights = dict[str, mx.array]
Block = Callable[..., mx.array]
CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@dataclass
class LayerCaches:
    """A layer's K and V buffers (flat ``[num_pages * page_size, kv_heads, head_dim]``),
    shared with the same layer slot of the other cache groups."""

    k: mx.array
    v: mx.array


@dataclass
class LayerStep:
    """What a block sees for one layer in one step. ``cos`` / ``sin`` [T, rotary_dim];
    ``group`` the layer's cache group's reads and writes; ``config`` the parsed checkpoint
    config (:class:`resin.loading.ModelConfig`); ``extra`` model-specific settings."""

    config: Any
    head_dim: int
    cos: mx.array
    sin: mx.array
    group: GroupAttention
    caches: LayerCaches
    extra: dict[str, Any] = field(default_factory=dict)

    def attention(
        self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, sinks: mx.array | None = None
    ) -> mx.array:
        """Write ``k``/``v`` [T, kv_heads, head_dim] at the plan's slots, then attend ``q``
        [T, heads, head_dim] over each row's cached keys -> [T, heads, head_dim]."""
        self.group.write(self.caches.k, k)
        self.group.write(self.caches.v, v)
        return self.group.attend(q, self.caches.k, self.caches.v, scale=scale, sinks=sinks)


@dataclass
class MlxLayer:
    """One pre-norm decoder layer: ``h += self_attn(input_layernorm(h)); h +=
    mlp(post_attention_layernorm(h))``."""

    index: int
    window: int | None
    blocks: dict[str, Block]
    weights: dict[str, Weights]


@dataclass
class MlxModel:
    """A model's structure, weights and functions (see the module doc)."""

    name: str
    config: Any
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    layers: list[MlxLayer]
    globals: Weights
    rotary: RotaryTable
    final_norm: Block
    extra: dict[str, Any] = field(default_factory=dict)

    def embed(self, input_ids: mx.array) -> mx.array:
        return self.globals["embed_tokens.weight"][input_ids]

    def norm(self, hidden: mx.array, ctx: LayerStep) -> mx.array:
        """The final norm (``model.norm``); ``ctx`` any layer's context of the step."""
        return self.final_norm(hidden, {"weight": self.globals["norm.weight"]}, ctx)

    def logits(self, hidden: mx.array) -> mx.array:
        """``lm_head`` (tied to ``embed_tokens`` when the checkpoint has no ``lm_head.weight``)."""
        head = self.globals.get("lm_head.weight", self.globals["embed_tokens.weight"])
        return linear(hidden, head)


def run_layer(
    layer: MlxLayer,
    hidden: mx.array,
    ctx: LayerStep,
    emit: Callable[[str, mx.array], None],
) -> mx.array:
    """The pre-norm residual layer, reporting each child's output to ``emit``."""
    blocks, weights = layer.blocks, layer.weights
    x = blocks["input_layernorm"](hidden, weights["input_layernorm"], ctx)
    emit("input_layernorm", x)
    x = blocks["self_attn"](x, weights["self_attn"], ctx)
    emit("self_attn", x)
    hidden = hidden + x
    x = blocks["post_attention_layernorm"](hidden, weights["post_attention_layernorm"], ctx)
    emit("post_attention_layernorm", x)
    x = blocks["mlp"](x, weights["mlp"], ctx)
    emit("mlp", x)
    return hidden + x


def split_layer_weights(
    flat: dict[str, mx.array], num_layers: int
) -> tuple[Weights, list[dict[str, Weights]]]:
    """Checkpoint names -> (the model's own tensors without ``model.``, per layer: child ->
    its tensors keyed relative to it). ``model.layers.3.self_attn.q_proj.weight`` lands in
    layer 3's ``self_attn`` as ``q_proj.weight``."""
    globals_: Weights = {}
    layers: list[dict[str, Weights]] = [
        {child: {} for child in CHILDREN} for _ in range(num_layers)
    ]
    for name, array in flat.items():
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            child, rest = parts[2], ".".join(parts[3:])
            layers[int(parts[1])].setdefault(child, {})[rest] = array
        else:
            globals_[".".join(parts)] = array
    return globals_, layers
