"""What a block function receives besides its input and weights: :class:`LayerContext`.

Owns the one context type every model function gets — decoder layers, their children, and the
model-level hooks (embedding, pre-/post-layer streams, final norm, logits) — so a block reaches
everything a step offers without touching the runner: the config, this step's token ids and
positions, the rotary tables of its layer type, and the layer's cache through the attention
backend (``ctx.attention``). Hooks outside the decoder layers get ``index = -1`` and no
attention. Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from resin.runners.torch.attention import LayerAttention
from resin.runners.torch.recurrent_state import RecurrentState


@dataclass
class LayerContext:
    """One layer (or one model-level hook) in one step.

    - ``config``: the checkpoint's config (attribute access: ``ctx.config.rms_norm_eps``);
    - ``input_ids`` int64[T], ``positions`` int64[T]: the step's new tokens (all rows
      concatenated) and their absolute positions (hash-routed MoE reads ``input_ids``);
    - ``cos`` / ``sin`` [T, rotary_dim]: the rotary table of this layer's type at ``positions``
      (None when the model has no rotary embedding); ``rotary`` is the table object itself;
    - ``attention``: the layer's :class:`~.attention.LayerAttention` (``write``, ``attend``, or
      ``ctx.attention(q, k, v, scale=...)``); ``caches`` its declared buffers by name;
    - ``layer_type`` / ``window``: the layer's type (``full_attention``, ``sliding_attention``,
      ...) and sliding window in tokens (None: unbounded);
    - ``query_indptr`` int64[S+1]: row i's tokens are ``[query_indptr[i], query_indptr[i+1])``
      (a recurrence runs row by row);
    - ``state``: a recurrent layer's :class:`~.recurrent_state.RecurrentState` (``load()`` every
      row's state, zeros for a fresh row; ``store(states)``);
    - ``extra``: the layer's extra caches by name (``LayerDefinition.extra_caches``), each a
      :class:`~.attention.LayerAttention` over its own cache group (a compressed group: write
      an entry at its closing token, attend / gather over the entries closed so far).
    """

    index: int
    config: Any
    head_dim: int
    dtype: torch.dtype
    input_ids: torch.Tensor
    positions: torch.Tensor
    layer_type: str = ""
    window: int | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    rotary: Any = None
    attention: LayerAttention | None = None
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    query_indptr: torch.Tensor | None = None
    state: RecurrentState | None = None
    extra: dict[str, LayerAttention] = field(default_factory=dict)

    def require_state(self) -> RecurrentState:
        """``self.state`` (a recurrent layer's per-request state), or a RuntimeError."""
        if self.state is None:
            raise RuntimeError(
                f"layer {self.index} ({self.layer_type or 'no type'}) has no "
                "recurrent state: declare LayerCache('recurrent', ...) in "
                "blocks.layer_cache"
            )
        return self.state

    def require_attention(self) -> LayerAttention:
        """``self.attention``, or a RuntimeError naming the layer when it has no cache."""
        if self.attention is None:
            raise RuntimeError(
                f"layer {self.index} ({self.layer_type or 'no type'}) has no "
                "attention cache: declare one in blocks.layer_cache"
            )
        return self.attention

    def require_rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, or a RuntimeError when the model has no rotary table for this layer."""
        if self.cos is None or self.sin is None:
            raise RuntimeError(
                f"layer {self.index}: no rotary table for layer type "
                f"{self.layer_type!r} (blocks.ROTARY / rotary_tables)"
            )
        return self.cos, self.sin
