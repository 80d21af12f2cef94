"""The cache declarations of the layer types Resin knows beyond plain K / V attention.

A layer's :class:`~.model_definition.LayerCache` says what it keeps between steps. Full and
sliding-window attention keep K and V per token (:func:`~.model_definition.attention_cache`);
this module owns the declarations of the other known types, which ``resin new-model`` maps
layer types to (:func:`resin.scaffold.layer_map.cache_kind`) and model directories get from
:func:`resin.runners.torch.model_dir.default_layer_cache` unless their ``blocks.layer_cache``
says otherwise:

- :func:`gated_delta_net_cache` — ``linear_attention`` layers of the gated-delta-net family
  (Qwen3-Next, Qwen3.5): one recurrent state per request;
- :func:`kimi_delta_attention_cache` — ``linear_attention`` layers of the Kimi-delta-attention
  family (GLM-5.3-Flash's KDA): one recurrent state per request;
- :func:`indexed_attention_cache` — GLM-5.3-Flash's ``indexed_attention`` (MLA + a k-pool DSA
  indexer): the KV latent per token and, on layers that run their own indexer
  (:func:`~resin.scaffold.layer_map.runs_own_indexer`: ``indexer_types`` is not ``shared``),
  the indexer's key / pool-gate window and its pooled keys;
- :func:`compressed_attention_cache` — DeepSeek-V4's ``compressed_sparse_attention`` (CSA) and
  ``heavily_compressed_attention`` (HCA): a raw sliding window plus compressed entries.

Imports torch (for the state dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from resin.runners.torch.model_definition import LayerCache
from resin.scaffold.layer_map import (
    COMPRESSED_TYPES,
    CSA,
    is_gated_delta_net,
    is_indexed_attention,
    is_kimi_delta_attention,
    runs_own_indexer,
)

__all__ = [
    "compressed_attention_cache",
    "compressed_window",
    "compression_ratio",
    "gated_delta_net_cache",
    "gated_delta_net_dims",
    "indexed_attention_cache",
    "is_gated_delta_net",
    "is_indexed_attention",
    "is_kimi_delta_attention",
    "kimi_delta_attention_cache",
    "kimi_delta_attention_dims",
    "runs_own_indexer",
]


def gated_delta_net_dims(config: Any) -> dict[str, int]:
    """Head counts and widths of a gated delta net (HF ``Qwen3NextGatedDeltaNet``):
    ``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim`` channels go through the
    depthwise causal conv of ``kernel`` taps."""
    nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    return {
        "nk": nk,
        "nv": nv,
        "dk": dk,
        "dv": dv,
        "key_dim": nk * dk,
        "value_dim": nv * dv,
        "conv_dim": 2 * nk * dk + nv * dv,
        "kernel": int(config.linear_conv_kernel_dim),
    }


def gated_delta_net_cache(config: Any) -> LayerCache:
    """A recurrent state per request, fp32: ``conv`` ``[conv_dim, kernel - 1]`` (the previous
    ``kernel - 1`` inputs of the depthwise causal conv; HF's cache keeps ``kernel`` of them, of
    which the conv reads the last ``kernel - 1`` with the new token) and ``ssm`` ``[v_heads,
    k_head_dim, v_head_dim]`` (HF's ``recurrent_states``, ``[B, v_heads, k_dim, v_dim]``)."""
    d = gated_delta_net_dims(config)
    return LayerCache(
        "recurrent",
        {"conv": (d["conv_dim"], d["kernel"] - 1), "ssm": (d["nv"], d["dk"], d["dv"])},
        dtype=torch.float32,
    )


def kimi_delta_attention_dims(config: Any) -> dict[str, int]:
    """Widths of a Kimi delta attention (HF ``Glm5NextTextLinearAttention``): ``heads`` heads of
    ``dim`` for q, k and v alike; the depthwise causal conv runs over ``conv_dim = 3 * heads *
    dim`` channels with ``kernel`` taps."""
    heads, dim = int(config.linear_num_heads), int(config.linear_head_dim)
    return {
        "heads": heads,
        "dim": dim,
        "conv_dim": 3 * heads * dim,
        "kernel": int(config.linear_conv_kernel_dim),
    }


def kimi_delta_attention_cache(config: Any) -> LayerCache:
    """A recurrent state per request, fp32: ``conv`` ``[3 * heads * dim, kernel - 1]`` (the
    previous ``kernel - 1`` conv inputs; HF's cache keeps ``kernel``) and ``ssm`` ``[heads, dim,
    dim]`` (HF's recurrent state; the forget gate decays it per key channel)."""
    d = kimi_delta_attention_dims(config)
    return LayerCache(
        "recurrent",
        {"conv": (d["conv_dim"], d["kernel"] - 1), "ssm": (d["heads"], d["dim"], d["dim"])},
        dtype=torch.float32,
    )


def indexed_attention_cache(
    config: Any, with_indexer: bool = True
) -> LayerCache | tuple[LayerCache, dict[str, LayerCache]]:
    """GLM-5.3-Flash ``indexed_attention`` (HF ``Glm5NextTextAttention`` + ``Glm5NextTextIndexer``,
    MLA with a k-pool DSA indexer). Main: a full per-token cache of the normed KV latent
    ``latent`` ``[kv_lora_rank]`` (K and V are ``kv_b_proj`` of it; NoPE, no rope part). With
    the indexer, two extra caches: ``window``, a ``sliding_window(index_kpool)`` of its
    LayerNormed key ``index_k`` and pool gate logits ``index_gate`` ``[index_head_dim]`` (what
    the open pool and the raw tail read), and ``pools``, ``compressed(ratio index_kpool)``
    entries ``key`` ``[index_head_dim]``: the softmax(gate + ape)-weighted sum of a pool's keys,
    written at its last token (vLLM / SGLang keep the same: a pool cache plus a tail ring).
    A ``shared``-indexer layer (``with_indexer=False``) reuses the previous layer's selection and
    keeps the latent only."""
    main = LayerCache("full", {"latent": (int(config.kv_lora_rank),)})
    if not with_indexer:
        return main
    di, kpool = int(config.index_head_dim), int(config.index_kpool)
    return main, {
        "window": LayerCache("sliding_window", {"index_k": (di,), "index_gate": (di,)}, kpool),
        "pools": LayerCache("compressed", {"key": (di,)}, ratio=kpool),
    }


def compression_ratio(layer_type: str, config: Any) -> int:
    """Source tokens per compressed entry: ``config.compress_rates[layer_type]``."""
    rates = getattr(config, "compress_rates", None) or {}
    if layer_type not in rates:
        raise ValueError(
            f"layer type {layer_type!r} is compressed but config.compress_rates has no entry "
            f"for it (has {sorted(rates)})"
        )
    return int(rates[layer_type])


def compressed_window(layer_type: str, config: Any) -> int:
    """The raw window a compressed layer keeps: ``max(sliding_window, (1 + overlap) *
    ratio)``. The attention's own sliding branch reads ``sliding_window`` tokens; an entry pools
    the ``(1 + overlap) * ratio`` raw tokens up to its closing token (CSA's windows overlap the
    previous one, HCA's do not), so with this window the not-yet-compressed carry is always in
    the raw cache and the engine keeps no carry state (docs/batch_plan.md)."""
    overlap = 1 if layer_type == CSA else 0
    ratio = compression_ratio(layer_type, config)
    return max(int(config.sliding_window), (1 + overlap) * ratio)


def compressed_attention_cache(
    layer_type: str, config: Any, head_dim: int
) -> tuple[LayerCache, dict[str, LayerCache]]:
    """DeepSeek-V4 CSA / HCA (HF ``DeepseekV4Attention`` with its compressor): the main cache
    is a raw sliding window of :func:`compressed_window` tokens holding, per token, ``kv`` (K =
    V, post-norm, post-rope) and the compressor's raw inputs ``comp_kv`` / ``comp_gate``
    ``[c * head_dim]`` (c = 2 for CSA's two overlapping series, 1 for HCA; CSA also the
    indexer's ``index_kv`` / ``index_gate`` ``[2 * index_head_dim]``); the extra cache
    ``entries`` (compressed, one per ratio tokens, written at the closing token) holds the
    entry ``kv`` ``[head_dim]`` (K = V, normed, roped) and, for CSA, the indexer key
    ``index_k`` ``[index_head_dim]``. Blocks read the extra one as ``ctx.extra["entries"]``."""
    if layer_type not in COMPRESSED_TYPES:
        raise ValueError(f"{layer_type!r} is not a compressed layer type {COMPRESSED_TYPES}")
    d = head_dim
    c = 2 if layer_type == CSA else 1
    raw: dict[str, tuple[int, ...]] = {"kv": (1, d), "comp_kv": (c * d,), "comp_gate": (c * d,)}
    entry: dict[str, tuple[int, ...]] = {"kv": (d,)}
    if layer_type == CSA:
        di = int(config.index_head_dim)
        raw.update(index_kv=(2 * di,), index_gate=(2 * di,))
        entry["index_k"] = (di,)
    main = LayerCache("sliding_window", raw, compressed_window(layer_type, config))
    ratio = compression_ratio(layer_type, config)
    return main, {"entries": LayerCache("compressed", entry, ratio=ratio)}
