"""DeepSeek-V4's FLOP / byte model for ``resin bench`` (the roofline's per-model hook).

The generic roofline counts standard attention (q/k/v/o of ``num_heads x head_dim``) over every
raw token and a plain MLP. DeepSeek-V4 computes something else, counted here per step from the
config (``config.json`` of the checkpoint benched) and each row's new / cached token counts.
Notation per layer: ``h`` hidden, ``n`` query heads, ``d`` head dim, ``r_q`` / ``r_o``
q / output LoRA ranks, ``g`` output groups, ``W`` sliding window, ``R`` the layer's compression
ratio, ``c`` compressor series (2 for CSA's overlapping windows, 1 for HCA), ``n_i`` / ``d_i``
indexer heads / dim, ``k_i`` indexer top-k, ``m`` hyper-connection streams (``hc_mult``).

Matmul FLOPs per new token (2 per multiply-add), from the weight shapes of
``DeepseekV4Attention`` / ``DeepseekV4Compressor`` / ``DeepseekV4Indexer`` / the MoE:
  * low-rank q: ``h*r_q + r_q*n*d``; MQA K = V: ``h*d``; grouped low-rank output:
    ``n*d*r_o`` (``g`` groups of ``n*d/g -> r_o``) ``+ g*r_o*h``;
  * compressor (CSA / HCA layers): K = V and gate projections ``2*h*c*d``; CSA's indexer: its
    own compressor ``2*h*c*d_i``, queries ``r_q*n_i*d_i``, head weights ``h*n_i``;
  * MoE: router ``h*E`` plus ``(top_k + shared) * 3*h*I``; hyper-connections: the two mixing
    projections ``2 * (2 + m)*m * m*h`` (attention and MLP sides), the head's ``m*h*m``;
  * LM head ``h*V`` per sampled row.
Attention FLOPs per query at position ``p`` (``4*n*d`` per attended key, QK and PV): the raw
window ``min(p + 1, W)`` plus the compressed entries it sees — CSA the indexer's top
``min(k_i, (p + 1) // R)``, HCA all ``(p + 1) // R`` — and for CSA the indexer's scoring of every
visible entry (``2*n_i*d_i`` each).
Bytes: every weight once per step (routed experts: the expected number ``T`` tokens touch);
cache reads of the window's K = V (``d`` values per key), the entries attended (``d``) and, for
CSA, every visible indexer key (``d_i``); cache writes of each new token's raw row (K = V and
the compressor's ``2*c*d`` inputs, CSA also the indexer's ``2*2*d_i``) and of each entry closed
(``d``, CSA ``+ d_i``); activations as each projection's input and output plus the ``m``
residual streams read and written around both sub-layers.

Pure Python + numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resin.evals.roofline import StepCost, _attended_keys

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


@dataclass(frozen=True)
class DeepseekV4Dims:
    """The config fields the cost model reads (plus the roofline's ModelDims attributes)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: Mapping[str, int] = field(default_factory=dict)
    moe: Any = None  # the generic roofline's MoE field (unused: step_cost is the model's own)

    @property
    def intermediate_size(self) -> int:
        return self.moe_intermediate_size

    def layer_window_tokens(self, layer_index: int) -> int | None:
        return self.sliding_window

    def is_moe_layer(self, layer_index: int) -> bool:
        return True

    def linear_params(self, layer_type: str) -> dict[str, int]:
        """Weights of one layer's linear maps, by part (every routed expert counted)."""
        h, n, d = self.hidden_size, self.num_attention_heads, self.head_dim
        rq, ro, g, m = self.q_lora_rank, self.o_lora_rank, self.o_groups, self.hc_mult
        ni, di = self.index_n_heads, self.index_head_dim
        parts = {
            "attention": h * rq + rq * n * d + h * d + n * d * ro + g * ro * h,
            "compressor": 0,
            "indexer": 0,
            "router": h * self.n_routed_experts,
            "experts": self.n_routed_experts * 3 * h * self.moe_intermediate_size,
            "shared_experts": self.n_shared_experts * 3 * h * self.moe_intermediate_size,
            "hyper_connections": 2 * (2 + m) * m * m * h,
        }
        if layer_type in (CSA, HCA):
            c = 2 if layer_type == CSA else 1
            parts["compressor"] = 2 * h * c * d
            if layer_type == CSA:
                parts["indexer"] = 2 * h * c * di + rq * ni * di + h * ni
        return parts

    def step_cost(
        self,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        num_sampled: int,
        dtype_bytes: int,
    ) -> StepCost:
        """FLOPs and bytes of one step (module doc)."""
        q_lens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        seq = ctx + q_lens
        tokens = float(q_lens.sum())
        e = dtype_bytes
        h, n, d = self.hidden_size, self.num_attention_heads, self.head_dim
        rq, ro, g, m = self.q_lora_rank, self.o_lora_rank, self.o_groups, self.hc_mult
        ni, di, ki = self.index_n_heads, self.index_head_dim, self.index_topk
        E, k, s, inter = (
            self.n_routed_experts,
            self.num_experts_per_tok,
            self.n_shared_experts,
            self.moe_intermediate_size,
        )
        expert = 3 * h * inter
        touched = E * (1 - (1 - k / E) ** tokens) if tokens else 0.0
        mix = (2 + m) * m
        matmul = attention = weights = kv = acts = 0.0
        for layer_type in self.layer_types[: self.num_hidden_layers]:
            attn = h * rq + rq * n * d + h * d + n * d * ro + g * ro * h
            act = rq + n * d + d + 2 * n * d + g * ro + h  # q path, kv, attention in/out, o
            raw_row, entry_row, c = d, 0, 0
            if layer_type in (CSA, HCA):
                c = 2 if layer_type == CSA else 1
                attn += 2 * h * c * d
                act += 2 * c * d
                raw_row += 2 * c * d
                entry_row = d
                if layer_type == CSA:
                    attn += 2 * h * c * di + rq * ni * di + h * ni
                    act += 2 * c * di + ni * di + ni
                    raw_row += 2 * 2 * di
                    entry_row += di
            mlp = h * E + (k + s) * expert
            hc = 2 * mix * m * h
            matmul += 2 * tokens * (attn + mlp + hc)
            weights += (attn + h * E + touched * expert + s * expert + hc + 4 * h) * e
            acts += tokens * (act + (k + s) * (2 * h + 3 * inter) + 2 * 2 * m * h + mix * 2) * e
            # Attention: the raw window, then the compressed entries each query sees.
            window_pairs = float(
                (
                    _attended_keys(seq, self.sliding_window)
                    - _attended_keys(ctx, self.sliding_window)
                ).sum()
            )
            attention += 4 * n * d * window_pairs
            visible_keys = np.minimum(seq, self.sliding_window)
            kv += float(visible_keys.sum()) * d * e + tokens * raw_row * e
            if layer_type in (CSA, HCA):
                ratio = int(self.compress_rates[layer_type])
                entries_seen = _entries_seen(ctx, q_lens, ratio)  # sum over queries
                if layer_type == CSA:
                    attended = _entries_seen(ctx, q_lens, ratio, cap=ki)
                    attention += 2 * ni * di * entries_seen + 4 * n * d * attended
                    visible = float((seq // ratio).sum())
                    kv += (visible * di + min(visible, ki * len(seq)) * d) * e
                else:
                    attention += 4 * n * d * entries_seen
                    kv += float((seq // ratio).sum()) * d * e
                closed = float((seq // ratio - ctx // ratio).sum())
                kv += closed * entry_row * e
        matmul += 2 * num_sampled * (h * self.vocab_size + m * h * m)
        weights += (h * self.vocab_size + h + m * h * m) * e + tokens * h * e
        acts += num_sampled * (m * h + h + self.vocab_size) * e
        return StepCost(matmul, attention, weights, kv, acts)


def _entries_seen(
    context_lens: np.ndarray, query_lens: np.ndarray, ratio: int, cap: int | None = None
) -> float:
    """Sum over every new query (positions ``context .. context + query - 1`` of each row) of
    the compressed entries it sees, ``(p + 1) // ratio``, capped at ``cap`` when given."""
    total = 0.0
    for start, length in zip(context_lens.tolist(), query_lens.tolist(), strict=True):
        seen = (np.arange(start, start + length, dtype=np.int64) + 1) // ratio
        if cap is not None:
            seen = np.minimum(seen, cap)
        total += float(seen.sum())
    return total


def load_dims(raw: Mapping[str, Any]) -> DeepseekV4Dims:
    """The cost model's dims from a checkpoint's ``config.json``."""
    layers = int(raw["num_hidden_layers"])
    rates = dict(raw.get("compress_rates") or {})
    return DeepseekV4Dims(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw.get("num_key_value_heads", 1)),
        head_dim=int(raw["head_dim"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        q_lora_rank=int(raw["q_lora_rank"]),
        o_lora_rank=int(raw["o_lora_rank"]),
        o_groups=int(raw["o_groups"]),
        sliding_window=int(raw["sliding_window"]),
        index_n_heads=int(raw["index_n_heads"]),
        index_head_dim=int(raw["index_head_dim"]),
        index_topk=int(raw["index_topk"]),
        hc_mult=int(raw.get("hc_mult", 1)),
        n_routed_experts=int(raw["n_routed_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        n_shared_experts=int(raw.get("n_shared_experts", 0)),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        layer_types=tuple(raw.get("layer_types") or [SLIDING] * layers),
        mlp_layer_types=tuple(raw.get("mlp_layer_types") or ["moe"] * layers),
        compress_rates=rates,
    )
