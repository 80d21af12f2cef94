"""Parse a Hugging Face ``config.json`` into a frozen :class:`ModelConfig`; per-layer cache specs.

This module owns what Resin knows about a checkpoint's architecture before any weight is
read: the shape of every layer, which projections carry a bias, which layers attend through
a sliding window (and how wide, in tokens), which layers are MoE, the RoPE variant, and the
per-layer cache specs the engine groups into cache groups (RoPE itself: :mod:`.rope`;
typed field reads and :class:`ConfigError`: :mod:`.fields`). It reads plain JSON (no
``transformers``, no torch) and follows the semantics of transformers' own config classes
and modeling code (``transformers/models/<arch>/configuration_*.py``, ``modeling_*.py``,
``transformers/modeling_rope_utils.py``), including their defaults for absent keys.

Guarantees: every accepted config is internally consistent (heads divide, ``layer_types``
has one entry per layer, every sliding layer has a window); anything else raises
:class:`ConfigError` naming the field, path, architecture or rope type at fault.

>>> cfg = load_model_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 128,
...     "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
...     "num_attention_heads": 4, "num_key_value_heads": 2})
>>> cfg.head_dim, cfg.rope.rope_type, cfg.layer_types
(16, 'default', ('full_attention', 'full_attention'))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resin._core import LayerCacheSpec
from resin.loading.fields import (
    ConfigError,
    read_dtype_field,
    read_field,
    read_json_object,
    read_positive,
    refuse_bidirectional,
    remap_legacy_layer_types,
)
from resin.loading.rope import RopeConfig, parse_rope_config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Per architecture: model_type and the transformers config-class defaults for keys a
# config.json may omit ("head_dim": None means hidden_size // num_attention_heads,
# "num_key_value_heads": None means num_attention_heads). Shape keys have no default here.
_MISTRAL_DEFAULTS: dict[str, Any] = dict(
    model_type="mistral",
    num_key_value_heads=8,
    head_dim=None,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    bos_token_id=1,
    eos_token_id=2,
    rope_theta=10000.0,
    sliding_window=4096,
)
_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(
        model_type="llama",
        num_key_value_heads=None,
        head_dim=None,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
        sliding_window=None,
    ),
    "MistralForCausalLM": _MISTRAL_DEFAULTS,
    # MinistralConfig(MistralConfig): Mistral's defaults, with a per-layer `layer_types`
    # (all windowed when absent and a window is set); the modeling code is Mistral's math.
    "MinistralForCausalLM": {**_MISTRAL_DEFAULTS, "model_type": "ministral"},
    "Qwen2ForCausalLM": dict(
        model_type="qwen2",
        num_key_value_heads=32,
        head_dim=None,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        rope_theta=10000.0,
        sliding_window=4096,
    ),
    "Qwen3ForCausalLM": dict(
        model_type="qwen3",
        num_key_value_heads=32,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        rope_theta=10000.0,
        sliding_window=4096,
    ),
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe",
        num_key_value_heads=4,
        head_dim=None,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        rope_theta=10000.0,
        sliding_window=4096,
    ),
    "MixtralForCausalLM": dict(
        model_type="mixtral",
        num_key_value_heads=8,
        head_dim=None,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=1e6,
        sliding_window=None,
    ),
    # Config only: the torch reference runner does not run gpt-oss (sinks, clamped SwiGLU
    # experts); models/gpt_oss/ does. Parsed so `resin bench` can cost its steps.
    "GptOssForCausalLM": dict(
        model_type="gpt_oss",
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        bos_token_id=None,
        eos_token_id=None,
        rope_theta=150000.0,
        sliding_window=128,
    ),
}
# GptOssConfig.__post_init__'s rope when a config gives none.
_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
_ARCH_BY_MODEL_TYPE = {spec["model_type"]: arch for arch, spec in _ARCHITECTURES.items()}


@dataclass(frozen=True)
class MoeConfig:
    """Routing of a sparse MLP: softmax over ``num_experts`` router logits, keep the top
    ``num_experts_per_tok``, renormalise them to sum 1 iff ``norm_topk_prob``. Each expert is a
    SwiGLU MLP of width ``moe_intermediate_size``; ``moe_layer_indices`` are the layers whose MLP
    is sparse (the others are dense, width ``ModelConfig.intermediate_size``)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layer_indices: tuple[int, ...]
    num_shared_experts: int = 0  # none of the supported architectures has shared experts


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only checkpoint's architecture, as the HF modeling code builds it.

    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"``; a sliding layer's
    query at position p attends keys in (p - ``sliding_window_tokens``, p]. Biases:
    ``qkv_bias`` on q/k/v_proj, ``o_proj_bias`` on o_proj, ``mlp_bias`` on gate/up/down_proj.
    ``qk_norm``: RMSNorm over ``head_dim`` on each query and key head before RoPE (Qwen3).
    ``eos_token_ids`` is a tuple (config.json may hold an int or a list).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    rope: RopeConfig
    layer_types: tuple[str, ...]
    sliding_window_tokens: int | None
    moe: MoeConfig | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: str | None

    def layer_window_tokens(self, layer_index: int) -> int | None:
        """The sliding window of one layer in tokens, or None for full attention."""
        is_sliding = self.layer_types[layer_index] == SLIDING_ATTENTION
        return self.sliding_window_tokens if is_sliding else None

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.moe is not None and layer_index in self.moe.moe_layer_indices


def load_model_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> ModelConfig:
    """Parse a checkpoint directory, a ``config.json`` path, or an already-loaded dict."""
    if isinstance(source, Mapping):
        return _parse(dict(source))
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config.json not found: {path}")
    return _parse(read_json_object(path))


def layer_cache_specs(config: ModelConfig, kv_dtype_bytes: int) -> list[LayerCacheSpec]:
    """One cache spec per layer: K and V for every KV head, ``kv_dtype_bytes`` per element."""
    is_int = isinstance(kv_dtype_bytes, int) and not isinstance(kv_dtype_bytes, bool)
    if not is_int or kv_dtype_bytes <= 0:
        raise ValueError(f"kv_dtype_bytes must be a positive int, got {kv_dtype_bytes!r}")
    bytes_per_token = 2 * config.num_key_value_heads * config.head_dim * kv_dtype_bytes
    specs = []
    for layer_index in range(config.num_hidden_layers):
        window_tokens = config.layer_window_tokens(layer_index)
        if window_tokens is None:
            specs.append(LayerCacheSpec.full(bytes_per_token))
        else:
            specs.append(LayerCacheSpec.sliding_window(window_tokens, bytes_per_token))
    return specs


def _architecture(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures")
    if architectures:
        if not isinstance(architectures, list):
            architectures = [architectures]
        arch = architectures[0]
        if not isinstance(arch, str) or arch not in _ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = raw.get("model_type")
        named = _ARCH_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
        other = named is not None and named != arch
        if other or (named is None and _transformers_family(model_type)):
            # HF builds the model from model_type, Resin would run architectures[0]: refuse
            # rather than run one family's weights as the other's (a Granite config naming
            # LlamaForCausalLM is Granite to transformers, with its own multipliers). A
            # model_type transformers does not know (a wrapper's own) is no disagreement.
            family = f"({named})" if named else "(a transformers family Resin does not run)"
            raise ConfigError(
                f"config: 'architectures' names {arch} but 'model_type' is {model_type!r} "
                f"{family}; transformers builds the model from model_type, so they must name "
                "the same family"
            )
        return arch
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError("config: missing required field 'architectures' (or 'model_type')")
    if model_type not in _ARCH_BY_MODEL_TYPE:
        raise ConfigError(
            f"unsupported architecture (model_type {model_type!r}); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _ARCH_BY_MODEL_TYPE[model_type]


def _transformers_family(model_type: Any) -> bool:
    """Whether transformers has a model family of this ``model_type`` (a module
    ``transformers.models.<model_type>``); False without transformers installed."""
    if not isinstance(model_type, str) or not model_type.replace("_", "").isalnum():
        return False
    import importlib.util

    try:
        return importlib.util.find_spec(f"transformers.models.{model_type}") is not None
    except (ImportError, ValueError):
        return False


def _parse_layer_types(
    raw: Mapping[str, Any], arch: str, num_layers: int, default_window: int | None
) -> tuple[tuple[str, ...], int | None]:
    if arch == "LlamaForCausalLM":
        return (FULL_ATTENTION,) * num_layers, None
    window = read_field(raw, "sliding_window", (int, type(None)), default_window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        # Qwen configs drop the window unless use_sliding_window is set.
        if not read_field(raw, "use_sliding_window", bool, False):
            window = None
    if window is not None and window <= 0:
        raise ConfigError(f"config: field 'sliding_window' must be positive, got {window}")
    if arch == "GptOssForCausalLM" and raw.get("layer_types") is None:
        # GptOssConfig: sliding on even layers, full on odd ones
        return tuple(
            SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)
        ), window
    # transformers' AutoConfig reads a mistral config that lists `layer_types` as Ministral,
    # which honours the list per layer (configuration_auto.py); MistralConfig itself ignores it.
    mistral_as_ministral = arch == "MinistralForCausalLM" or (
        arch == "MistralForCausalLM" and raw.get("layer_types") is not None
    )
    if (
        arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM")
        and not mistral_as_ministral
    ):
        # Mistral, Mixtral and Qwen3Moe apply the window (if any) to every layer.
        kind = FULL_ATTENTION if window is None else SLIDING_ATTENTION
        return (kind,) * num_layers, window
    layer_types = raw.get("layer_types")
    if layer_types is None:
        max_window_layers = read_field(raw, "max_window_layers", int, 28)
        layer_types = [
            SLIDING_ATTENTION if window is not None and i >= max_window_layers else FULL_ATTENTION
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(
            f"config: field 'layer_types' must list {num_layers} layer types "
            f"(num_hidden_layers), got {layer_types!r}"
        )
    for index, kind in enumerate(layer_types):
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ConfigError(
                f"config: layer_types[{index}] is {kind!r}; supported: "
                f"{FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}"
            )
        if kind == SLIDING_ATTENTION and window is None:
            raise ConfigError(
                f"config: layer_types[{index}] is {SLIDING_ATTENTION!r} but no "
                "sliding window is in effect (sliding_window null or "
                "use_sliding_window false)"
            )
    has_sliding = SLIDING_ATTENTION in layer_types
    return tuple(layer_types), window if has_sliding else None


def _parse_moe(
    raw: Mapping[str, Any], arch: str, num_layers: int, intermediate_size: int
) -> MoeConfig | None:
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"):
        return None
    # Both config classes map num_experts <-> num_local_experts (attribute_map).
    names = [name for name in ("num_experts", "num_local_experts") if name in raw]
    if not names:
        raise ConfigError("config: missing required field 'num_experts' (or 'num_local_experts')")
    num_experts = read_field(raw, names[0], int)
    if len(names) == 2 and raw[names[1]] != num_experts:
        raise ConfigError(
            f"config: 'num_experts' ({num_experts}) and 'num_local_experts' "
            f"({raw[names[1]]}) disagree"
        )
    top_k = read_positive(raw, "num_experts_per_tok")
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        # Every layer is sparse: the router needs at least top_k experts to choose from.
        if num_experts <= 0:
            raise ConfigError(f"config: field {names[0]!r} must be positive, got {num_experts}")
        if top_k > num_experts:
            raise ConfigError(
                f"config: num_experts_per_tok ({top_k}) exceeds {names[0]} ({num_experts})"
            )
    if arch == "MixtralForCausalLM":
        # MixtralTopKRouter always renormalises the top-k; experts use intermediate_size.
        return MoeConfig(num_experts, top_k, intermediate_size, True, tuple(range(num_layers)))
    if arch == "GptOssForCausalLM":
        # GptOssTopKRouter: softmax over the top-k logits (= softmax, top-k, renormalise; its
        # router bias is not modelled here); every layer is sparse, experts use intermediate_size.
        return MoeConfig(num_experts, top_k, intermediate_size, True, tuple(range(num_layers)))
    sparse_step = read_positive(raw, "decoder_sparse_step", 1)
    mlp_only = read_field(raw, "mlp_only_layers", (list, type(None)), None) or []
    moe_layers = tuple(
        i
        for i in range(num_layers)
        if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0
    )
    if moe_layers and top_k > num_experts:
        raise ConfigError(
            f"config: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})"
        )
    return MoeConfig(
        num_experts,
        top_k,
        read_positive(raw, "moe_intermediate_size"),
        read_field(raw, "norm_topk_prob", bool, False),
        moe_layers,
    )


def _parse(raw: dict[str, Any]) -> ModelConfig:
    arch = _architecture(raw)
    refuse_bidirectional(raw)
    raw = remap_legacy_layer_types(raw)
    defaults = _ARCHITECTURES[arch]
    hidden_size = read_positive(raw, "hidden_size")
    num_heads = read_positive(raw, "num_attention_heads")
    num_layers = read_positive(raw, "num_hidden_layers")
    intermediate_size = read_positive(raw, "intermediate_size")
    num_kv_heads = (
        read_field(raw, "num_key_value_heads", (int, type(None)), defaults["num_key_value_heads"])
        or num_heads
    )
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ConfigError(
            f"config: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = read_field(raw, "head_dim", (int, type(None)), defaults["head_dim"])
    if head_dim is None:
        if hidden_size % num_heads:
            raise ConfigError(
                f"config: hidden_size ({hidden_size}) is not a multiple of "
                f"num_attention_heads ({num_heads}) and head_dim is not given"
            )
        head_dim = hidden_size // num_heads
    if head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"config: head_dim must be a positive even number, got {head_dim}")
    max_positions = read_positive(
        raw, "max_position_embeddings", defaults["max_position_embeddings"]
    )
    layer_types, window = _parse_layer_types(raw, arch, num_layers, defaults["sliding_window"])
    eos = read_field(raw, "eos_token_id", (int, list, type(None)), defaults["eos_token_id"])
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise ConfigError(
            f"config: field 'eos_token_id' must be an int or a list of ints, got {eos!r}"
        )
    # Bias per projection, as each modeling file builds its nn.Linear layers.
    attention_bias = read_field(raw, "attention_bias", bool, False)
    qkv_bias, o_proj_bias = {
        "LlamaForCausalLM": (attention_bias, attention_bias),
        "Qwen3ForCausalLM": (attention_bias, attention_bias),
        "Qwen3MoeForCausalLM": (attention_bias, attention_bias),
        "Qwen2ForCausalLM": (True, False),
        "GptOssForCausalLM": (read_field(raw, "attention_bias", bool, True),) * 2,
    }.get(arch, (False, False))
    if arch == "GptOssForCausalLM" and not (raw.get("rope_scaling") or raw.get("rope_parameters")):
        raw = {**raw, "rope_parameters": dict(_GPT_OSS_DEFAULT_ROPE)}
    mlp_bias = read_field(raw, "mlp_bias", bool, False) if arch == "LlamaForCausalLM" else False
    return ModelConfig(
        architecture=arch,
        model_type=defaults["model_type"],
        vocab_size=read_positive(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=read_field(raw, "rms_norm_eps", float, defaults["rms_norm_eps"]),
        hidden_act=read_field(raw, "hidden_act", str, "silu"),
        tie_word_embeddings=read_field(raw, "tie_word_embeddings", bool, False),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        max_position_embeddings=max_positions,
        rope=parse_rope_config(raw, defaults["rope_theta"], max_positions),
        layer_types=layer_types,
        sliding_window_tokens=window,
        moe=_parse_moe(raw, arch, num_layers, intermediate_size),
        bos_token_id=read_field(raw, "bos_token_id", (int, type(None)), defaults["bos_token_id"]),
        eos_token_ids=eos_ids,
        pad_token_id=read_field(raw, "pad_token_id", (int, type(None)), None),
        dtype=read_dtype_field(raw),
    )
