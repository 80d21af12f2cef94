"""What each piece of an HF architecture becomes in Resin: cache specs, blocks, weight names.

Owns three mappings the scaffold generator and generated runners share:

- layer types -> cache: :func:`layer_types_from_config` gives each decoder layer's type and
  window from an HF config (``config.layer_types`` when present; else, with a window, every
  ``sliding_window_pattern``-th layer full and the rest sliding — Gemma 2/3, whose default
  pattern a record keeps as ``_sliding_window_pattern``; else every layer sliding iff a
  ``sliding_window`` is set and not switched off by ``use_sliding_window``; else full), and
  :func:`cache_kind` says which ``resin.LayerCacheSpec`` a type needs: ``full``,
  ``sliding_window``, ``recurrent`` (linear attention / SSM: per-request state pages),
  ``compressed`` (DeepSeek-V4 CSA / HCA: a raw window plus compressed entries), ``indexed``
  (GLM-5.3-Flash's ``indexed_attention``: a per-token latent plus, on layers that run their own
  indexer, the indexer's key window and pools) or ``unknown`` (the declarations of the known
  recurrent, compressed and indexed types: ``resin.runners.torch.layer_caches``);
- windows: a layer gets ``config.sliding_window`` iff its type is in :data:`WINDOWED_LAYER_TYPES`
  — the types whose HF attention is built with the raw ``config.sliding_window`` (read from the
  modeling code, transformers 5.x): ``sliding_attention`` (Gemma 2/3, gpt-oss, Mistral, Qwen2,
  Cohere2, ...: ``sliding_window if layer_type == "sliding_attention" else None`` and a
  ``create_sliding_window_causal_mask`` for that type only), ``hybrid_sliding`` (Zaya, Inkling),
  and DeepSeek-V4's ``compressed_sparse_attention`` / ``heavily_compressed_attention`` (every V4
  attention keeps a sliding-window branch: ``self.sliding_window = config.sliding_window`` for
  all layer types, one sliding mask for all). ``full_attention``, ``chunked_attention``
  (``attention_chunk_size``, not a window), ``indexed_attention`` and the recurrent types never
  get one. A type in none of these lists gets no window here; ``resin.scaffold.inspect`` gives it
  the window when the built HF attention module's ``sliding_window`` attribute holds
  ``config.sliding_window`` (the pure-Python table cannot see modules);
- MLP types: :func:`mlp_types_from_config` gives each layer's MLP kind: ``config.mlp_layer_types``
  verbatim when present (DeepSeek-V4 ``hash_moe`` / ``moe``, GLM ``dense`` / ``sparse``), else
  derived, ``dense`` or ``moe``: no expert count (``num_experts`` / ``num_local_experts`` /
  ``n_routed_experts`` missing or 0) -> all ``dense``; else a layer is ``dense`` when it is in
  ``mlp_only_layers``, below ``first_k_dense_replace``, off the ``decoder_sparse_step`` grid
  (Qwen-MoE: MoE iff ``(i + 1) % step == 0``), off the ``moe_layer_freq`` grid (an int: MoE iff
  ``i % freq == 0``; a list: its per-layer flags), or absent from an explicit ``moe_layers``
  list; otherwise ``moe``. :func:`is_moe_type` says whether a type routes to experts;
- HF classes -> blocks: :data:`KNOWN_BLOCKS` lists the HF classes whose math
  ``resin.runners.torch.layers`` already implements (RMSNorm, rotary embeddings, GQA paged
  attention with or without window / qkv bias / q-k norm, SwiGLU MLP, top-k MoE, the pre-norm
  decoder layer); every other class becomes a stub;
- checkpoint names -> runner names: :func:`runner_name` (the in-memory module path without the
  ``model.`` prefix, with a checkpoint's per-expert tail kept), and :func:`name_pattern`, which
  folds layer and expert indices into ``{layer}`` / ``{expert}`` placeholders.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
# Layer types whose HF attention uses the raw config.sliding_window (see the module doc).
WINDOWED_LAYER_TYPES = (
    SLIDING,
    "hybrid_sliding",
    "compressed_sparse_attention",  # = CSA below
    "heavily_compressed_attention",  # = HCA below
)
DENSE_MLP = "dense"
MOE_MLP = "moe"
# Values of config.mlp_layer_types that mean "no experts" (HF's canonical "dense").
DENSE_MLP_TYPES = (DENSE_MLP, "mlp")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# DeepSeek-V4's compressed attention types: a raw sliding window plus one compressed entry
# per config.compress_rates[type] tokens (resin.runners.torch.layer_caches).
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
COMPRESSED_TYPES = (CSA, HCA)
# GLM-5.3-Flash's MLA + k-pool DSA indexer attention (resin.runners.torch.layer_caches).
INDEXED = "indexed_attention"
RECURRENT_TYPES = (
    "linear_attention",
    "mamba",
    "mamba2",
    "recurrent",
    "ssm",
    "gated_deltanet",
    "lightning_attention",
    "conv",
)

# HF class -> block kind. A class is "known" only when Resin's torch layers reproduce it op for
# op (checked by parity against the fixtures); a look-alike from another family is NOT listed,
# so its differences (sinks, clamps, offsets) cannot slip through unnoticed.
KNOWN_BLOCKS: dict[str, str] = {
    # torch's own: a no-op at inference (dropout is off in eval mode)
    "Dropout": "identity",
    "Identity": "identity",
    **{
        f"{p}RMSNorm": "rms_norm"
        for p in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Mixtral")
    },
    **{
        f"{p}RotaryEmbedding": "rotary"
        for p in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Mixtral")
    },
    **{
        f"{p}Attention": "gqa_attention"
        for p in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Mixtral")
    },
    **{f"{p}MLP": "swiglu_mlp" for p in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe")},
    "Qwen3MoeSparseMoeBlock": "topk_moe",
    "MixtralSparseMoeBlock": "topk_moe",
    **{
        f"{p}DecoderLayer": "prenorm_decoder_layer"
        for p in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Mixtral")
    },
    "Embedding": "embedding",
    "Linear": "linear",
}
# The direct children a pre-norm residual decoder layer has (Llama's layout).
PRENORM_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# Expert weight names (gate, up, down) per MoE block class, relative to the block.
MOE_EXPERT_NAMES = {
    "Qwen3MoeSparseMoeBlock": ("gate_proj", "up_proj", "down_proj"),
    "MixtralSparseMoeBlock": ("w1", "w3", "w2"),
}
_MOE_RENORMALISES = {"MixtralSparseMoeBlock": True}  # others read config.norm_topk_prob


def text_part(config: Any) -> Any:
    """The decoder's config: a multimodal wrapper's ``text_config`` (an HF config's
    ``get_text_config(decoder=True)``, or a ``text_config`` mapping of a plain config object)
    when the top level has no ``num_hidden_layers``; else ``config`` itself."""
    if getattr(config, "num_hidden_layers", None) is not None:
        return config
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:  # older transformers: no decoder keyword
            return getter()
    text = getattr(config, "text_config", None)
    if isinstance(text, dict):
        from types import SimpleNamespace

        return SimpleNamespace(**text)
    return text if text is not None else config


def layer_types_from_config(config: Any) -> list[tuple[str, int | None]]:
    """(layer type, window in tokens or None) for each of ``config.num_hidden_layers`` layers
    (of the text config, for a multimodal wrapper: :func:`text_part`)."""
    config = text_part(config)
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) < num_layers:
            raise ValueError(
                f"config.layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}"
            )
        return [
            (t, window if (t in WINDOWED_LAYER_TYPES and window) else None)
            for t in list(types)[:num_layers]
        ]
    pattern = getattr(config, "sliding_window_pattern", None)
    if pattern is None:
        # Gemma 3's config class keeps its default pattern (6) as `_sliding_window_pattern`,
        # which a model record's defaults carry: a config.json with neither layer_types nor a
        # pattern gets it, as transformers derives layer_types from it.
        pattern = getattr(config, "_sliding_window_pattern", None)
    if window and isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        # Older Gemma 2/3 configs: every pattern-th layer is global (transformers derives
        # layer_types the same way when a config.json has only the pattern).
        return [
            (FULL, None) if (i + 1) % pattern == 0 else (SLIDING, window) for i in range(num_layers)
        ]
    kind = SLIDING if window else FULL
    return [(kind, window if window else None)] * num_layers


def mlp_types_from_config(config: Any) -> list[str]:
    """The MLP kind of each of ``config.num_hidden_layers`` layers (rules in the module doc;
    the text config's, for a multimodal wrapper: :func:`text_part`)."""
    config = text_part(config)
    num_layers = int(config.num_hidden_layers)
    types = getattr(config, "mlp_layer_types", None)
    if types:
        if len(types) < num_layers:
            raise ValueError(
                f"config.mlp_layer_types lists {len(types)} layers, "
                f"num_hidden_layers is {num_layers}"
            )
        return [str(t) for t in list(types)[:num_layers]]
    experts = max(
        (
            int(v)
            for v in (getattr(config, k, None) for k in EXPERT_COUNT_FIELDS)
            if isinstance(v, int) and not isinstance(v, bool)
        ),
        default=0,
    )
    if experts <= 0:
        return [DENSE_MLP] * num_layers
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    first_dense = getattr(config, "first_k_dense_replace", None)
    step = getattr(config, "decoder_sparse_step", None)
    freq = getattr(config, "moe_layer_freq", None)
    moe_layers = getattr(config, "moe_layers", None)
    out = []
    for i in range(num_layers):
        dense = i in mlp_only
        dense |= isinstance(first_dense, int) and i < first_dense
        dense |= isinstance(step, int) and step > 1 and (i + 1) % step != 0
        if isinstance(freq, int) and not isinstance(freq, bool) and freq > 1:
            dense |= i % freq != 0
        elif isinstance(freq, (list, tuple)) and i < len(freq):
            dense |= not freq[i]
        dense |= isinstance(moe_layers, (list, tuple)) and i not in moe_layers
        out.append(DENSE_MLP if dense else MOE_MLP)
    return out


def is_moe_type(mlp_type: str) -> bool:
    """Whether an MLP type (from :func:`mlp_types_from_config`) routes tokens to experts."""
    return mlp_type not in DENSE_MLP_TYPES


GATED_DELTA_NET_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def is_gated_delta_net(layer_type: str, config: Any) -> bool:
    """A ``linear_attention`` layer whose config carries the gated-delta-net dimensions
    (Qwen3-Next, Qwen3.5): its state is declared by ``layer_caches.gated_delta_net_cache``."""
    return layer_type == "linear_attention" and all(
        getattr(config, name, None) is not None for name in GATED_DELTA_NET_FIELDS
    )


KIMI_DELTA_ATTENTION_FIELDS = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")


def is_kimi_delta_attention(layer_type: str, config: Any) -> bool:
    """A ``linear_attention`` layer of the Kimi-delta-attention family (GLM-5.3-Flash's KDA:
    ``linear_num_heads`` heads of ``linear_head_dim`` for q, k and v alike, no key / value head
    split): its state is declared by ``layer_caches.kimi_delta_attention_cache``."""
    return (
        layer_type == "linear_attention"
        and not is_gated_delta_net(layer_type, config)
        and all(getattr(config, name, None) is not None for name in KIMI_DELTA_ATTENTION_FIELDS)
    )


INDEXED_ATTENTION_FIELDS = ("kv_lora_rank", "index_head_dim", "index_kpool")


def is_indexed_attention(layer_type: str, config: Any) -> bool:
    """An ``indexed_attention`` layer whose config carries the latent and indexer widths
    (GLM-5.3-Flash): its caches are declared by ``layer_caches.indexed_attention_cache``."""
    return layer_type == INDEXED and all(
        getattr(config, name, None) is not None for name in INDEXED_ATTENTION_FIELDS
    )


def runs_own_indexer(config: Any, layer_index: int | None) -> bool:
    """Whether layer ``layer_index`` computes its own top-k selection: ``config.indexer_types``
    says ``full`` (or nothing) there. A ``shared`` layer reuses the previous layer's selection
    and keeps no indexer cache. Unknown (``layer_index`` None): True, the safe over-declaration."""
    types = getattr(config, "indexer_types", None)
    if layer_index is None or not types or layer_index >= len(types):
        return True
    return str(types[layer_index]) != "shared"


def has_cache_declaration(layer_type: str, window: int | None, config: Any) -> bool:
    """Whether Resin declares this layer type's cache itself (plain attention, a gated delta
    net or a Kimi delta attention, DeepSeek-V4 CSA / HCA, GLM-5.3-Flash indexed attention);
    otherwise the model's ``blocks.layer_cache`` must."""
    kind = cache_kind(layer_type, window)
    return (
        kind in ("full", "sliding_window", "compressed")
        or (
            kind == "recurrent"
            and (
                is_gated_delta_net(layer_type, config)
                or is_kimi_delta_attention(layer_type, config)
            )
        )
        or (kind == "indexed" and is_indexed_attention(layer_type, config))
    )


def compressed_cache_text(layer_type: str, config: Any) -> str:
    """``compressed(ratio R) + sliding_window(W)``: a compressed layer's two caches."""
    ratio = int((getattr(config, "compress_rates", None) or {}).get(layer_type, 0))
    overlap = 1 if layer_type == CSA else 0
    window = max(int(getattr(config, "sliding_window", 0) or 0), (1 + overlap) * ratio)
    return f"sliding_window({window}) + compressed(ratio {ratio})"


def cache_kind(layer_type: str, window: int | None) -> str:
    """``full`` / ``sliding_window`` / ``recurrent`` / ``compressed`` / ``indexed`` /
    ``unknown`` for one layer type."""
    if layer_type == FULL:
        return "full"
    if layer_type in COMPRESSED_TYPES:
        return "compressed"
    if layer_type == INDEXED:
        return "indexed"
    if layer_type == SLIDING:
        if not window:
            raise ValueError("a sliding_attention layer without a sliding_window")
        return "sliding_window"
    if layer_type in RECURRENT_TYPES or "linear" in layer_type or "mamba" in layer_type:
        return "recurrent"
    return "unknown"


def block_kind(cls_name: str) -> str | None:
    """The Resin block kind implementing an HF class, or None (the block is a stub)."""
    return KNOWN_BLOCKS.get(cls_name)


def moe_expert_names(cls_name: str) -> tuple[str, str, str] | None:
    return MOE_EXPERT_NAMES.get(cls_name)


def moe_renormalises(cls_name: str, config: Any) -> bool:
    return _MOE_RENORMALISES.get(cls_name, bool(getattr(config, "norm_topk_prob", False)))


def function_name(cls_name: str) -> str:
    """``GptOssAttention`` -> ``gpt_oss_attention``; ``Qwen3MoeMLP`` -> ``qwen3_moe_mlp``."""
    s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", cls_name)
    s = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s)
    return re.sub(r"\W", "_", s).lower()


def runner_name(param_name: str, checkpoint_name: str, num_checkpoint_names: int) -> str:
    """The runner's name for one checkpoint tensor of in-memory parameter ``param_name``.

    One-to-one (possibly renamed, e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``): the in-memory
    name. One-to-many (fused experts saved per expert): the in-memory module path plus the
    checkpoint's tail after that module's last component (``mlp.experts`` + ``0.w1.weight``).
    The ``model.`` prefix is dropped.
    """

    def strip(name: str) -> str:
        return name[len("model.") :] if name.startswith("model.") else name

    if num_checkpoint_names == 1:
        return strip(param_name)
    module = param_name.rsplit(".", 1)[0]
    anchor = "." + module.rsplit(".", 1)[-1] + "."
    if anchor in checkpoint_name:
        return strip(module) + "." + checkpoint_name.split(anchor, 1)[1]
    return strip(checkpoint_name)


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def name_pattern(name: str) -> tuple[str, int | None, int | None]:
    """Fold indices: ``model.layers.3.mlp.experts.7.w1.weight`` ->
    (``model.layers.{layer}.mlp.experts.{expert}.w1.weight``, 3, 7)."""
    layer = expert = None
    m = _LAYER.search(name)
    if m:
        layer = int(m.group(2))
        name = name[: m.start()] + f"{m.group(1)}layers.{{layer}}." + name[m.end() :]
    m = _EXPERT.search(name)
    if m:
        expert = int(m.group(1))
        name = name[: m.start()] + ".experts.{expert}." + name[m.end() :]
    return name, layer, expert


def weight_map(
    checkpoint_names: dict[str, list[str]], view: Callable[[str], str] | None = None
) -> dict[str, str]:
    """Checkpoint name pattern -> runner name pattern, over every parameter of the model.
    ``view``: a checkpoint name as a causal LM's checkpoint would spell it (a multimodal
    wrapper's ``model.language_model.`` -> ``model.``; ``Architecture.runner_view``), which
    :func:`runner_name` falls back to where a fused tensor's pieces are not named after it."""
    out: dict[str, str] = {}
    for param, names in checkpoint_names.items():
        for name in names:
            pattern, _, _ = name_pattern(name)
            as_causal = view(name) if view is not None else name
            out.setdefault(pattern, name_pattern(runner_name(param, as_causal, len(names)))[0])
    return out


def pattern_shapes(
    checkpoint_shapes: dict[str, tuple[int, ...]],
) -> dict[str, dict[tuple[int, ...], list[int]]]:
    """Checkpoint name pattern -> {shape: layers having it} (layer -1 for non-layer tensors)."""
    out: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for name, shape in checkpoint_shapes.items():
        pattern, layer, _ = name_pattern(name)
        layers = out.setdefault(pattern, {}).setdefault(tuple(shape), [])
        index = -1 if layer is None else layer
        if index not in layers:
            layers.append(index)
    return out
