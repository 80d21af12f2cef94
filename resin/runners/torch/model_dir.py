"""Model directories made by ``resin new-model``, run on the shared paged runner.

Owns turning a model directory into a :class:`~.model_definition.ModelDefinition` and a
runner, with no ``transformers`` at run time. A model directory holds only what is
model-specific:

- ``architecture.json`` — what the meta-model walk found when the directory was generated
  (:class:`ModelRecord`): the architectures and model types it serves, the HF config class's
  defaults (``config.json`` files omit keys equal to them), which HF class each child of a
  layer of each kind uses, the final norm and rotary classes, the tensor name patterns of each
  layer kind, and HF's keep-in-fp32 module patterns;
- ``blocks.py`` — the model's math: ``BLOCKS`` (HF class -> function), ``ROTARY`` (HF class ->
  table factory, returning one table or a dict by layer type), and optional hooks ``embed``,
  ``pre_layers``, ``post_layers``, ``final_norm``, ``logits``, ``layer_cache`` (one
  ``LayerCache``, or ``(main, {name: extra LayerCache})``; given the layer's index as the
  keyword ``layer_index`` when its signature takes one), ``head_dim``
  (see :mod:`.model_definition`) and ``normalise_config(dict) -> dict`` (what the HF config
  class derives from older keys, applied to the checkpoint's config before anything reads it);
- ``weights.py`` (only where checkpoint names need renaming) — ``WEIGHT_MAP``; optionally
  ``CONFIG_SUBMODULES`` / ``CONFIG_GLOBALS``: which recorded modules a checkpoint has by its
  config (:func:`layer_tensors`, :func:`_required_globals`);
- ``parity.toml``, ``perf.toml``, ``NOTES.md``, tests, ``tiny/``.

A layer's *kind* is ``"{layer_type}/{mlp_type}"``, computed from the checkpoint's own config
by :mod:`resin.scaffold.layer_map` (pure Python), so a tiny checkpoint and the real one both
find their layers' classes. A kind the record lacks is composed from the kinds it has (its
layer type from one, its MLP type from another: :func:`kind_classes`, :func:`kind_tensors`),
so a checkpoint may pair them as its source model did not; a layer type or MLP type the record
has nowhere is refused by name. Imports torch.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from resin.loading.fields import remap_legacy_layer_types
from resin.loading.rope import dynamic_rope_limit
from resin.registry import claimed_model_types
from resin.runners.torch import layer_caches
from resin.runners.torch.attention import AttentionBackend
from resin.runners.torch.model_definition import (
    LayerCache,
    LayerDefinition,
    ModelDefinition,
    MtpDefinition,
    attention_cache,
    default_embed,
    default_logits,
)
from resin.runners.torch.model_weights import load_model_weights
from resin.runners.torch.paged_runner import PagedRunner
from resin.scaffold.layer_map import cache_kind, layer_types_from_config, mlp_types_from_config

ARCHITECTURE_FILE = "architecture.json"
RECORD_FORMAT = 1
# Config keys HF derives in the config class from older spellings: a default of the derived key
# is dropped when the checkpoint gives one of its sources.
DERIVED_CONFIG_KEYS = {
    "rope_parameters": ("rope_theta", "rope_scaling", "rope_type"),
    "layer_types": ("sliding_window_pattern", "compress_ratios", "no_rope_layer_interval"),
    "mlp_layer_types": ("num_hash_layers",),
    "partial_rotary_factor": ("qk_rope_head_dim",),
    "no_rope_layers": ("no_rope_layer_interval",),  # SmolLM3
}


class ModelArgs(types.SimpleNamespace):
    """A checkpoint's ``config.json`` over its config class's recorded defaults, with attribute
    access (``args.rms_norm_eps``) and ``to_dict()`` / ``get()`` like an HF config."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def get(self, name: str, default: Any = None) -> Any:
        return vars(self).get(name, default)


@dataclass
class ModelRecord:
    """``architecture.json``: see the module doc. ``layer_kinds`` maps a layer kind to
    ``{"decoder": class, "children": {name: class}, "tensors": [relative patterns]}``."""

    name: str
    architectures: list[str]
    model_types: list[str]
    config_defaults: dict[str, Any]
    layer_kinds: dict[str, dict[str, Any]]
    norm: str | None
    rotary: str | None
    checkpoint_patterns: list[str]
    windowed_layer_types: list[str] = field(default_factory=list)
    source_shapes: dict[str, list[list[Any]]] = field(default_factory=dict)
    shape_rules: dict[str, Any] = field(default_factory=dict)
    keep_in_fp32: dict[str, list[str]] = field(default_factory=dict)
    generated_from: str = ""

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelRecord:
        path = Path(model_dir) / ARCHITECTURE_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot read {path}: {exc} (regenerate it with resin new-model)"
            ) from exc
        if raw.get("format") != RECORD_FORMAT:
            raise ValueError(
                f"{path}: format {raw.get('format')!r}, this Resin reads format "
                f"{RECORD_FORMAT} (regenerate it with resin new-model --force)"
            )
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**fields)

    def to_json(self) -> str:
        """Readable, deterministic JSON: one key per line, lists of plain values on one line."""
        data = {"format": RECORD_FORMAT, **{k: getattr(self, k) for k in self.__dataclass_fields__}}
        return _json_lines(data, 0) + "\n"


def _json_lines(value: Any, depth: int) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(str(k))}: {_json_lines(v, depth + 1)}" for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if (
        isinstance(value, list)
        and any(isinstance(v, (dict, list)) for v in value)
        and not all(isinstance(v, list) and not any(isinstance(x, dict) for x in v) for v in value)
    ):
        items = [f"{inner}{_json_lines(v, depth + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value)


def check_source_shapes(record: ModelRecord, checkpoint_dir: str | Path) -> list[str]:
    """Problems (empty if none) between a checkpoint's safetensors headers and the shapes of the
    model the record was generated from — e.g. to check a downloaded real checkpoint before
    loading it. Reads headers only."""
    from resin.loading.weights import locate_tensors, open_safetensors
    from resin.scaffold.layer_map import name_pattern

    problems: list[str] = []
    files = locate_tensors(Path(checkpoint_dir))
    for path in sorted(set(files.values())):
        with open_safetensors(path) as handle:
            for tensor_name in handle.keys():
                pattern, layer, _ = name_pattern(tensor_name)
                shape = list(handle.get_slice(tensor_name).get_shape())
                known = record.source_shapes.get(pattern)
                index = -1 if layer is None else layer
                if known is None:
                    problems.append(f"{tensor_name}: not in the source model")
                elif not any(shape == s and index in layers for s, layers in known):
                    problems.append(
                        f"{tensor_name}: shape {tuple(shape)}, source model has "
                        + ", ".join(f"{tuple(s)} (layers {layers})" for s, layers in known)
                    )
    return problems


def load_model_args(checkpoint_dir: str | Path, record: ModelRecord) -> ModelArgs:
    """The checkpoint's config.json over the record's defaults. A per-layer default list whose
    length does not match the checkpoint's layer count is dropped (it was derived for the
    default depth), so derived lists come from the checkpoint or the layer_map rules."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object")
    values = remap_legacy_layer_types(values)  # "attention" -> "full_attention", as HF reads it
    num_layers = values.get("num_hidden_layers", record.config_defaults.get("num_hidden_layers"))
    default_layers = record.config_defaults.get("num_hidden_layers")
    defaults = {
        k: v
        for k, v in record.config_defaults.items()
        if not (isinstance(v, list) and len(v) == default_layers != num_layers)
    }
    for derived, sources in DERIVED_CONFIG_KEYS.items():
        # A checkpoint that spells a setting the legacy way (rope_theta, a window pattern)
        # must not get the default's derived form of it.
        if derived not in values and any(k in values for k in sources):
            defaults.pop(derived, None)
    return ModelArgs(**{**defaults, **values})


def layer_kinds(args: Any, record: ModelRecord) -> list[tuple[str, int | None, str]]:
    """(layer type, window, kind) of each layer of a checkpoint's config: a layer gets
    ``config.sliding_window`` iff its type was windowed in the model the record was made from."""
    types_ = layer_types_from_config(args)
    mlps = mlp_types_from_config(args)
    window = getattr(args, "sliding_window", None)
    return [
        (
            layer_type,
            window if layer_type in record.windowed_layer_types else None,
            f"{layer_type}/{mlp}",
        )
        for (layer_type, _), mlp in zip(types_, mlps)
    ]


def head_dim_of(args: Any) -> int:
    return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)


def num_kv_heads_of(args: Any) -> int:
    return int(getattr(args, "num_key_value_heads", None) or args.num_attention_heads)


def default_layer_cache(
    layer_type: str,
    window: int | None,
    args: Any,
    head_dim: int,
    num_kv_heads: int,
    layer_index: int | None = None,
) -> LayerCache | tuple[LayerCache, dict[str, LayerCache]]:
    """K and V per token for full and sliding layers; the known recurrent, compressed and
    indexed types' declarations (:mod:`.layer_caches`: gated-delta-net and Kimi-delta-attention
    ``linear_attention``, DeepSeek-V4 CSA / HCA, GLM-5.3-Flash ``indexed_attention`` — whose
    indexer caches only layers that run their own indexer, known from ``layer_index``: without
    it every indexed layer declares them); anything else must be declared in
    ``blocks.layer_cache``."""
    kind = cache_kind(layer_type, window)
    if kind in ("full", "sliding_window"):
        return attention_cache(num_kv_heads, head_dim, window if kind == "sliding_window" else None)
    if kind == "compressed":
        return layer_caches.compressed_attention_cache(layer_type, args, head_dim)
    if kind == "recurrent" and layer_caches.is_gated_delta_net(layer_type, args):
        return layer_caches.gated_delta_net_cache(args)
    if kind == "recurrent" and layer_caches.is_kimi_delta_attention(layer_type, args):
        return layer_caches.kimi_delta_attention_cache(args)
    if kind == "indexed" and layer_caches.is_indexed_attention(layer_type, args):
        return layer_caches.indexed_attention_cache(
            args, with_indexer=layer_caches.runs_own_indexer(args, layer_index)
        )
    raise NotImplementedError(
        f"layer type {layer_type!r} has no default cache ({kind}): write "
        "blocks.layer_cache(layer_type, window, config, head_dim, num_kv_heads) returning a "
        "resin.runners.torch.LayerCache (its per-token buffers, or a recurrent state)"
    )


def declare_layer_cache(
    hook: Callable[..., Any],
    layer_index: int,
    layer_type: str,
    window: int | None,
    args: Any,
    head_dim: int,
    num_kv_heads: int,
) -> LayerCache | tuple[LayerCache, dict[str, LayerCache]]:
    """Call a layer-cache declaration (``blocks.layer_cache`` or :func:`default_layer_cache`)
    for one layer, passing ``layer_index`` when the hook accepts it (a keyword parameter of that
    name or ``**kwargs``; older hooks take the five positional arguments only)."""
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = ()  # type: ignore[assignment]
    takes_index = any(
        p.name == "layer_index" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
    )
    if takes_index:
        return hook(layer_type, window, args, head_dim, num_kv_heads, layer_index=layer_index)
    return hook(layer_type, window, args, head_dim, num_kv_heads)


def _split_layer_cache(
    declared: LayerCache | tuple[LayerCache, dict[str, LayerCache]],
) -> tuple[LayerCache, dict[str, LayerCache]]:
    """``blocks.layer_cache`` returns the layer's main cache, or ``(main, {name: extra})``: more
    cache groups of the same layer (``LayerDefinition.extra_caches``, read as
    ``ctx.extra[name]``; DeepSeek-V4: a raw sliding window plus compressed entries)."""
    if isinstance(declared, tuple):
        main, extra = declared
        return main, dict(extra)
    return declared, {}


def mtp_kind(blocks: Any, args: Any) -> str | None:
    """The layer kind of the model's next-n (MTP) layers — ``"{layer_type}/{mlp_type}"`` from
    ``blocks.mtp_layer_type(config)`` / ``blocks.mtp_mlp_type(config)`` — or None when the
    model directory defines no MTP (``mtp_input`` / ``mtp_output`` hooks)."""
    hooks = ("mtp_layer_type", "mtp_mlp_type", "mtp_input", "mtp_output", "mtp_hidden_shape")
    if not all(hasattr(blocks, hook) for hook in hooks):
        return None
    return f"{blocks.mtp_layer_type(args)}/{blocks.mtp_mlp_type(args)}"


def _kind_parts(
    record: ModelRecord, kind: str, what: str = "a layer"
) -> tuple[list[str], list[str]]:
    """The recorded kinds sharing ``kind``'s layer type, and those sharing its MLP type;
    ``ValueError`` naming ``what`` has the kind when either is empty (no layer to take that
    part from)."""
    layer_type, mlp_type = kind.split("/", 1)
    of_type, of_mlp = (
        _kinds_sharing(record, kind, mlp=False),
        _kinds_sharing(record, kind, mlp=True),
    )
    if not of_type or not of_mlp:
        missing = f"layer type {layer_type!r}" if not of_type else f"{mlp_type!r} MLP"
        raise ValueError(
            f"{record.name}: {what} is of kind {kind!r} and needs a {missing}, which "
            f"{ARCHITECTURE_FILE} does not know (known kinds: {', '.join(record.layer_kinds)}); "
            "regenerate with resin new-model from a config that has this layer kind"
        )
    return of_type, of_mlp


# A layer's MLP sub-module, by its first name component (HF child or checkpoint prefix):
# a tensor under one of these belongs to the layer's MLP type, any other to its layer type.
MLP_CHILDREN = ("mlp", "block_sparse_moe", "ffn", "feed_forward")


def _is_mlp_tensor(relative: str) -> bool:
    return relative.split(".", 1)[0] in MLP_CHILDREN


def kind_tensors(record: ModelRecord, kind: str, own: tuple[str, ...] = ()) -> list[str]:
    """Tensor patterns (relative to the layer) a layer of ``kind`` must have. A kind the record
    has lists its own. Another is composed from the record (a checkpoint that pairs a layer
    type and an MLP type its source model never paired, as DeepSeek-V4's MTP layer does —
    sliding-window with a top-k MoE — or a config with other ``mlp_layer_types``): the
    tensors outside the MLP that every kind of its layer type has, and the MLP's that every
    kind of its MLP type has; and the layer's ``own`` tensors."""
    if kind in record.layer_kinds:
        return sorted(set(record.layer_kinds[kind].get("tensors", [])) | set(own))
    of_type, of_mlp = _kind_parts(record, kind)

    def common(kinds: list[str], mlp: bool) -> set[str]:
        parts = [
            {t for t in record.layer_kinds[k].get("tensors", []) if _is_mlp_tensor(t) == mlp}
            for k in kinds
        ]
        return set.intersection(*parts)

    return sorted(common(of_type, mlp=False) | common(of_mlp, mlp=True) | set(own))


def _low_rank_query(config: Any, index: int) -> bool:
    """Whether an MLA layer (DeepSeek-V2 / V3 family: ``kv_lora_rank`` set) has the low-rank
    query ``q_a_proj -> q_a_layernorm -> q_b_proj``: iff ``q_lora_rank`` is set (null: one
    ``q_proj``, as Moonlight); always for any other layer."""
    return getattr(config, "kv_lora_rank", None) is None or (
        getattr(config, "q_lora_rank", None) is not None
    )


def _qk_norm(config: Any, index: int) -> bool:
    """Whether attention has per-head ``q_norm`` / ``k_norm``: not when the config's
    ``use_qk_norm`` is false (GLM-4.5-Air, Cohere: HF builds neither); else as the layer's
    kind says."""
    value = getattr(config, "use_qk_norm", None)
    return value is None or bool(value)


# Sub-modules a layer has or lacks by its config rather than by its kind: prefix (relative to
# the layer) -> whether layer ``index`` of ``config`` has it. GLM-5.3-Flash's indexer: a
# ``shared`` entry of ``indexer_types`` reuses the previous layer's selection and has none.
# MLA's low-rank query: absent with ``q_lora_rank`` null (the model directory's weight map
# then names ``q_proj``, which the record made from a low-rank source lacks). q / k norms:
# absent with ``use_qk_norm`` false (a record made from GLM-4.5, which has them, runs Air).
CONFIG_SUBMODULES: dict[str, Callable[[Any, int], bool]] = {
    "self_attn.indexer.": lambda config, index: layer_caches.runs_own_indexer(config, index),
    "self_attn.q_a_proj.": _low_rank_query,
    "self_attn.q_a_layernorm.": _low_rank_query,
    "self_attn.q_b_proj.": _low_rank_query,
    "self_attn.q_norm.": _qk_norm,
    "self_attn.k_norm.": _qk_norm,
}


def layer_tensors(
    record: ModelRecord,
    args: Any,
    index: int,
    kind: str,
    own: tuple[str, ...] = (),
    submodules: dict[str, Callable[[Any, int], bool]] | None = None,
) -> list[str]:
    """Tensor patterns layer ``index`` (of ``kind``; an MTP layer's index is past the stack) of
    checkpoint ``args`` must have: its kind's (:func:`kind_tensors`, with ``own``), less a
    :data:`CONFIG_SUBMODULES` sub-module (or one of the model directory's own ``submodules``:
    its ``weights.CONFIG_SUBMODULES``) its config says it lacks, plus one it says it has that
    its kind lacks (taken from the recorded kinds of its layer type: a checkpoint may give a
    layer an indexer where the source model's layer of that kind had none)."""
    tensors = set(kind_tensors(record, kind, own))
    for prefix, has in {**CONFIG_SUBMODULES, **(submodules or {})}.items():
        if not has(args, index):
            tensors = {t for t in tensors if not t.startswith(prefix)}
        elif not any(t.startswith(prefix) for t in tensors):
            for other in _kinds_sharing(record, kind, mlp=False):
                entry = record.layer_kinds[other]
                tensors |= {t for t in entry.get("tensors", []) if t.startswith(prefix)}
    return sorted(tensors)


def _kinds_sharing(record: ModelRecord, kind: str, mlp: bool) -> list[str]:
    """The recorded kinds with ``kind``'s MLP type (``mlp``) or its layer type (none when the
    record has that part nowhere)."""
    part = int(mlp)
    return [k for k in record.layer_kinds if k.split("/", 1)[part] == kind.split("/", 1)[part]]


def kind_classes(record: ModelRecord, kind: str, what: str = "a layer") -> dict[str, Any]:
    """Decoder and child classes of a layer of ``kind``: its own record entry, else composed
    (:func:`kind_tensors`): those of a layer of the same layer type, the MLP child from one of
    the same MLP type."""
    if kind in record.layer_kinds:
        return record.layer_kinds[kind]
    of_type, of_mlp = _kind_parts(record, kind, what)
    base, mlp = record.layer_kinds[of_type[0]], record.layer_kinds[of_mlp[0]]
    children = {c: cls for c, cls in base["children"].items() if c not in MLP_CHILDREN}
    children.update({c: cls for c, cls in mlp["children"].items() if c in MLP_CHILDREN})
    return {"decoder": base["decoder"], "children": children}


def _kind_shape_rule(record: ModelRecord, kind: str, relative: str) -> Any:
    """The shape rule of tensor ``relative`` in a layer of ``kind``: its own kind's, else that of
    a recorded kind sharing the part the tensor belongs to (its MLP type for an MLP tensor,
    else its layer type): for a composed kind, and for a sub-module the config gives a layer
    whose kind lacks it (:data:`CONFIG_SUBMODULES`)."""
    rules = record.shape_rules.get("kinds", {})
    if relative in rules.get(kind, {}):
        return rules[kind][relative]
    sources = _kinds_sharing(record, kind, mlp=_is_mlp_tensor(relative))
    return next((rules[k][relative] for k in sources if relative in rules.get(k, {})), None)


def model_definition(
    name: str,
    record: ModelRecord,
    blocks: Any,
    args: ModelArgs,
    device: torch.device,
    num_mtp_layers: int = 0,
) -> ModelDefinition:
    """The definition of one checkpoint (``args``) of a model directory (``record`` +
    ``blocks``), with its first ``num_mtp_layers`` next-n (MTP) layers when asked."""
    head_dim = int(blocks.head_dim(args)) if hasattr(blocks, "head_dim") else head_dim_of(args)
    num_kv_heads = num_kv_heads_of(args)
    layer_cache = getattr(blocks, "layer_cache", default_layer_cache)
    layers = []
    for index, (layer_type, window, kind) in enumerate(layer_kinds(args, record)):
        classes = kind_classes(record, kind, f"layer {index}")
        cache, extra = _split_layer_cache(
            declare_layer_cache(
                layer_cache, index, layer_type, window, args, head_dim, num_kv_heads
            )
        )
        layers.append(
            LayerDefinition(
                index=index,
                layer_type=layer_type,
                window=window,
                decoder=_block(blocks, classes["decoder"], name),
                children={
                    child: _block(blocks, cls, name) for child, cls in classes["children"].items()
                },
                cache=cache,
                extra_caches=extra,
            )
        )
    rotary: dict[str, Any] = {}
    if record.rotary is not None:
        factories = getattr(blocks, "ROTARY", {})
        if record.rotary not in factories:
            raise KeyError(f"{name}: blocks.ROTARY has no entry for {record.rotary!r}")
        tables = factories[record.rotary](args, head_dim, device)
        rotary = dict(tables) if isinstance(tables, dict) else {"*": tables}
    final_norm = getattr(blocks, "final_norm", None)
    if final_norm is None and record.norm is not None:
        final_norm = _block(blocks, record.norm, name)
    mtp = None
    next_n_kind = mtp_kind(blocks, args) if num_mtp_layers else None
    if next_n_kind is not None:
        classes = kind_classes(record, next_n_kind, "the MTP layer")
        layer_type = next_n_kind.split("/", 1)[0]
        window = getattr(args, "sliding_window", None)
        window = window if layer_type in record.windowed_layer_types else None
        mtp_layers = []
        for i in range(num_mtp_layers):
            cache, extra = _split_layer_cache(
                declare_layer_cache(
                    layer_cache, len(layers) + i, layer_type, window, args, head_dim, num_kv_heads
                )
            )
            mtp_layers.append(
                LayerDefinition(
                    index=len(layers) + i,
                    layer_type=layer_type,
                    window=window,
                    # A next-n layer may not be one of the stack's decoder layers (GLM's has
                    # no hyper-connections): ``blocks.MTP_DECODER`` names its own.
                    decoder=_block(
                        blocks, getattr(blocks, "MTP_DECODER", classes["decoder"]), name
                    ),
                    children={
                        child: _block(blocks, cls, name)
                        for child, cls in classes["children"].items()
                    },
                    cache=cache,
                    extra_caches=extra,
                )
            )
        mtp = MtpDefinition(
            layers=mtp_layers,
            input=blocks.mtp_input,
            output=blocks.mtp_output,
            hidden_shape=tuple(blocks.mtp_hidden_shape(args)),
            target=getattr(blocks, "mtp_target", None),
        )
    return ModelDefinition(
        name=name,
        architecture=record.architectures[0],
        config=args,
        vocab_size=int(args.vocab_size),
        head_dim=head_dim,
        layers=layers,
        rotary=rotary,
        embed=getattr(blocks, "embed", default_embed),
        pre_layers=getattr(blocks, "pre_layers", None),
        post_layers=getattr(blocks, "post_layers", None),
        final_norm=final_norm,
        logits=getattr(blocks, "logits", default_logits),
        mtp=mtp,
    )


def check_config(blocks: Any, args: ModelArgs, name: str) -> None:
    """Refuse at load, with a ``ValueError`` naming the field, a checkpoint config the model's
    blocks would refuse at their first forward: the ``hidden_act`` when the blocks compute it
    with the shared lookup (``config_activation``), then the blocks' own ``check_config(config)``
    hook (raising ``ValueError`` or ``NotImplementedError``), if they define one. Before
    those, what every attention model needs (:class:`ConfigError`): causal attention (not
    ``is_causal: false``, in the config or its ``text_config``), and ``num_attention_heads`` a
    multiple of ``num_key_value_heads`` when the config gives both."""
    from resin.loading.fields import ConfigError, refuse_bidirectional

    for part in (args, getattr(args, "text_config", None)):
        if isinstance(part, dict):
            refuse_bidirectional(part, f"{name}: config.json")
        elif part is not None:
            refuse_bidirectional(vars(part), f"{name}: config.json")
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads > 0:
        if kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"{name}: config.json num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads}): each KV head serves a whole group of query "
                "heads"
            )
    try:
        if hasattr(blocks, "config_activation"):
            blocks.config_activation(args)
        own = getattr(blocks, "check_config", None)
        if own is not None:
            own(args)
    except (ValueError, NotImplementedError) as error:
        raise ValueError(f"{name}: {error}") from None


def checkpoint_mtp_layers(
    blocks: Any,
    args: Any,
    checkpoint_dir: str | Path,
    prefixes: tuple[str, ...] | None = None,
) -> int:
    """Next-n (MTP) layers to load: the config's ``num_nextn_predict_layers`` when the model
    directory defines an MTP (:func:`mtp_kind`) and the checkpoint ships them (tensors under
    ``prefixes``, the model directory's ``weights.MTP_PREFIXES``: by default ``mtp.{i}.*``, as
    DeepSeek does; GLM keeps them as ``model.layers.{num_hidden_layers + i}.*``;
    ``save_pretrained`` drops them); else 0."""
    from resin.runners.torch.model_weights import DEFAULT_MTP_PREFIXES, mtp_layer_of

    wanted = int(getattr(args, "num_nextn_predict_layers", 0) or 0)
    if not wanted or mtp_kind(blocks, args) is None:
        return 0
    from resin.loading.weights import locate_tensors

    num_layers = int(args.num_hidden_layers)
    names = locate_tensors(Path(checkpoint_dir))
    found = (mtp_layer_of(n, num_layers, prefixes or DEFAULT_MTP_PREFIXES) for n in names)
    shipped = {f[0] for f in found if f is not None}
    return sum(1 for i in range(wanted) if i in shipped)


def _block(blocks: Any, cls_name: str, name: str) -> Any:
    table = getattr(blocks, "BLOCKS", {})
    if cls_name not in table:
        raise KeyError(
            f"{name}: no block function for HF class {cls_name!r} in blocks.py; "
            f"known: {', '.join(table)} (add one to BLOCKS)"
        )
    return table[cls_name]


class ModelDirRunner(PagedRunner):
    """A model directory's runner: the shared paged runner on its blocks and record."""

    model_dir: Path
    # (longest sequence, why) the blocks compute as transformers does, from the optional
    # ``blocks.max_model_len_limit(config)`` hook (Phi-3 longrope: the original length), else
    # the shared rope's (``dynamic``: max_position_embeddings); None: no limit. ``resin.LLM`` caps its default max_model_len at it and refuses a longer one.
    max_model_len_limit: tuple[int, str] | None = None

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        checkpoint_dir: str | os.PathLike[str],
        *,
        name: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | AttentionBackend | None = None,
        parallel: tuple[int, int, Any, bool, bool, bool] | None = None,
    ) -> ModelDirRunner:
        """Load ``checkpoint_dir`` with the model directory ``model_dir``'s blocks.
        ``parallel``: (rank, world size, process group, tensor parallel, expert parallel, DP
        attention) — this rank's shard by the directory's ``weights.TENSOR_PARALLEL`` /
        ``EXPERT_PARALLEL`` rules (:mod:`resin.runners.parallel.sharding`), read as slices,
        with the collectives."""
        from resin.evals.model_ref import import_model_module

        model_dir = Path(model_dir)
        name = name or model_dir.resolve().name
        record = ModelRecord.load(model_dir)
        blocks = import_model_module(model_dir, "blocks", name)
        checkpoint_dir = Path(checkpoint_dir)
        args = load_model_args(checkpoint_dir, record)
        if hasattr(blocks, "normalise_config"):
            # What the HF config class derives in __init__ from older keys (DeepSeek-V4:
            # compress_ratios -> layer_types), written by the model since no transformers here.
            args = ModelArgs(**blocks.normalise_config(args.to_dict()))
        architecture = (getattr(args, "architectures", None) or [None])[0]
        model_types = claimed_model_types(record.model_types, record.config_defaults)
        if (
            architecture not in record.architectures
            and getattr(args, "model_type", None) not in model_types
        ):
            raise ValueError(
                f"{checkpoint_dir} is a {architecture or args.model_type} "
                f"checkpoint; {model_dir} runs {', '.join(record.architectures)}"
            )
        check_config(blocks, args, name)
        weight_map: dict[str, str] = {}
        ignored: tuple[str, ...] = ()
        mtp_prefixes: tuple[str, ...] | None = None
        weights_module: Any = None
        if (model_dir / "weights.py").is_file():
            weights_module = import_model_module(model_dir, "weights", name)
            weight_map = dict(getattr(weights_module, "WEIGHT_MAP", {}))
            # Checkpoint parts this runner does not run (a vision tower of a multimodal
            # checkpoint served text-only): left unused, not refused as unknown.
            ignored = tuple(getattr(weights_module, "IGNORED_PREFIXES", ()))
            # Where the checkpoint keeps its next-n layers, when not DeepSeek's ``mtp.{i}.``.
            mtp_prefixes = getattr(weights_module, "MTP_PREFIXES", None)
        device = torch.device(device)
        shard_part, shard = None, None
        full_args = args  # the checkpoint's shapes are checked against the whole model
        if parallel is not None:
            args, shard, shard_part = _tensor_parallel_args(args, weights_module, parallel, name)
        num_mtp = checkpoint_mtp_layers(blocks, args, checkpoint_dir, mtp_prefixes)
        num_mtp = 0 if parallel is not None else num_mtp  # (MTP does not shard yet)
        definition = model_definition(name, record, blocks, args, device, num_mtp)
        if parallel is not None:
            from resin.runners.parallel.tensor_parallel import tensor_parallel_definition

            assert shard is not None
            moe_types = tuple(getattr(weights_module, "MOE_MLP_TYPES", ("moe",)))
            moe = [
                bool(shard.expert_parallel) and kind.split("/", 1)[1] in moe_types
                for _, _, kind in layer_kinds(args, record)
            ]
            definition = tensor_parallel_definition(
                definition, shard, parallel[2], moe, data_parallel=parallel[5]
            )
        kinds = [kind for _, _, kind in layer_kinds(args, record)]
        # Sub-modules the model's layers have or lack by their config (Gemma 4: a layer reusing
        # another's K/V has no k_proj), and non-layer modules likewise (runner-name prefix ->
        # whether the config has it), from the model directory's weights.py.
        own_submodules = dict(getattr(weights_module, "CONFIG_SUBMODULES", None) or {})
        own_globals = dict(getattr(weights_module, "CONFIG_GLOBALS", None) or {})
        required = [
            layer_tensors(record, args, i, k, submodules=own_submodules)
            for i, k in enumerate(kinds)
        ]
        if num_mtp:
            kind = mtp_kind(blocks, args)
            assert kind is not None
            own = tuple(getattr(blocks, "MTP_TENSORS", ()))
            absent = tuple(getattr(blocks, "MTP_ABSENT_TENSORS", ()))
            first = len(required)  # the MTP layers' indices, past the stack's
            required += [
                [
                    t
                    for t in layer_tensors(record, args, first + i, kind, own, own_submodules)
                    if t not in absent
                ]
                for i in range(num_mtp)
            ]
            kinds += [kind] * num_mtp
        dtype_name = str(dtype).removeprefix("torch.")
        weights = load_model_weights(
            checkpoint_dir,
            len(definition.layers),
            weight_map=weight_map,
            known_patterns=record.checkpoint_patterns,
            required=lambda i: required[i],
            required_globals=_required_globals(record, args, weight_map, own_globals),
            expected_shape=_shape_checker(
                record,
                full_args,
                kinds,
                confirmed_standard_rules(model_dir, record, blocks),
                standard_shape_fields(blocks, full_args),
                int(full_args.num_hidden_layers),
            ),
            keep_in_fp32=record.keep_in_fp32.get(dtype_name, []),
            ignored_prefixes=ignored,
            num_mtp_layers=num_mtp,
            **({"mtp_prefixes": mtp_prefixes} if mtp_prefixes else {}),
            shard=shard_part,
            device=device,
            dtype=dtype,
        )
        runner = cls(definition, weights, device, dtype, attention_backend)
        runner.model_dir = model_dir
        if hasattr(blocks, "max_model_len_limit"):
            runner.max_model_len_limit = blocks.max_model_len_limit(full_args)
        else:  # the shared rope's own limit (``dynamic`` past max_position_embeddings)
            raw = full_args if isinstance(full_args, dict) else full_args.to_dict()
            runner.max_model_len_limit = dynamic_rope_limit(raw)
        if shard is not None:
            runner.shard = shard  # type: ignore[attr-defined]
            runner.data_parallel = parallel is not None and parallel[5]  # type: ignore[attr-defined]
            runner.moe_layer_indices = {  # type: ignore[attr-defined]
                i for i, is_moe in enumerate(moe) if is_moe
            }
        return runner


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _tensor_parallel_args(
    args: ModelArgs, weights_module: Any, parallel: tuple[Any, ...], name: str
) -> tuple[ModelArgs, Any, Any]:
    """(the config with this rank's head counts — its caches hold its KV heads — and first
    expert, its shard, and the loader's ``shard(runner_name, shape)`` callback from the model's
    rules: keyed by the runner name relative to the layer, or a global runner name; a tensor
    no rule names is replicated)."""
    from resin.runners.parallel.sharding import TensorParallelShard, rule_part

    rank, world, _, tp, ep, _dp = parallel
    rules = getattr(weights_module, "TENSOR_PARALLEL", None) if tp else {}
    expert_rules = getattr(weights_module, "EXPERT_PARALLEL", None) if ep else {}
    if rules is None or expert_rules is None:
        what = "TENSOR_PARALLEL" if rules is None else "EXPERT_PARALLEL"
        raise NotImplementedError(
            f"{name}: its weights.py declares no {what} rules, so it does not shard that way "
            "(model directories with rules: gpt_oss)"
        )
    head_dim = head_dim_of(args)
    heads, kv_heads = int(args.num_attention_heads), num_kv_heads_of(args)
    num_experts = int(getattr(args, getattr(weights_module, "NUM_EXPERTS", ""), 0) or 0)
    if tp:
        TensorParallelShard.of_counts(rank, world, heads, kv_heads, int(args.vocab_size))
    if ep and (not num_experts or num_experts % world):
        raise ValueError(f"{name}: {num_experts} experts do not split over {world} ranks")
    shard = TensorParallelShard(
        rank, world, heads, kv_heads, int(args.vocab_size), tp, ep, num_experts
    )
    local = args.to_dict()
    if local.get("head_dim") is None:  # (derived from the full head count: keep it)
        local["head_dim"] = head_dim
    if tp:
        local.update(
            num_attention_heads=shard.local_heads, num_key_value_heads=shard.local_kv_heads
        )
        # Other per-rank counts the blocks read from the config (DeepSeek-V4's o_groups).
        for key, how in getattr(weights_module, "TENSOR_PARALLEL_CONFIG", {}).items():
            value = int(local[key])
            if how != "split" or value % world:
                raise ValueError(f"{name}: config {key} = {value} does not split over {world}")
            local[key] = value // world
    if ep:
        local["expert_parallel_first_expert"] = shard.local_experts.start
    experts = shard.local_experts

    shared_once = set(getattr(weights_module, "EXPERT_PARALLEL_ONCE", ())) if ep and not tp else ()

    def part(runner_name: str, shape: tuple[int, ...]) -> Any:
        key = runner_name.split(".", 2)[2] if runner_name.startswith("layers.") else runner_name
        index = _EXPERT_INDEX.search(key)
        key = _EXPERT_INDEX.sub(".experts.{expert}.", key)  # one rule for every expert
        if key in expert_rules:
            rule = expert_rules[key]
            slices = [slice(0, n) for n in shape]
            if isinstance(rule, int):  # a fused tensor: this rank's block of experts
                slices[rule] = slice(experts.start, experts.stop)
            elif index is None or int(index.group(1)) not in experts:
                slices[rule[1]] = slice(0, 0)  # another rank's expert: zero width, no bytes
            return tuple(slices), False
        if key in shared_once:  # EP alone: a replicated MLP inside the MoE block, added once
            return tuple(slice(0, n) for n in shape), rank != 0
        rule = rules.get(key)
        return None if rule is None else rule_part(shard, rule, shape, head_dim)

    return ModelArgs(**local), shard, part


# Standard tensor names whose shape follows from the config the same way wherever a model has
# them (Llama-style attention and MLP, token embedding and head), over the fields of
# :func:`standard_shape_fields`. They fill the dimensions a record's own rules leave unchecked
# (the scaffold leaves a dimension unchecked when two config expressions explain it, as
# q_proj's rows in a model whose heads * head_dim equals another width), but only those the
# model directory's own tiny checkpoint confirms: a model that reuses a standard name for
# something else (a gated q_proj twice as wide, another head count) keeps its record's rules.
STANDARD_LAYER_SHAPES: dict[str, list[str]] = {
    "self_attn.q_proj.weight": ["num_attention_heads*head_dim", "hidden_size"],
    "self_attn.k_proj.weight": ["num_key_value_heads*head_dim", "hidden_size"],
    "self_attn.v_proj.weight": ["num_key_value_heads*head_dim", "hidden_size"],
    "self_attn.o_proj.weight": ["hidden_size", "num_attention_heads*head_dim"],
    "self_attn.q_norm.weight": ["head_dim"],
    "self_attn.k_norm.weight": ["head_dim"],
    "mlp.gate_proj.weight": ["intermediate_size", "hidden_size"],
    "mlp.up_proj.weight": ["intermediate_size", "hidden_size"],
    "mlp.down_proj.weight": ["hidden_size", "intermediate_size"],
}
STANDARD_GLOBAL_SHAPES: dict[str, list[str]] = {
    "model.embed_tokens.weight": ["vocab_size", "hidden_size"],
    "lm_head.weight": ["vocab_size", "hidden_size"],
}
# Where a model directory keeps the checkpoint its standard shapes are confirmed on.
TINY_CHECKPOINT = "tiny"
GLOBAL = ""  # the "kind" of a non-layer tensor in the confirmed standard rules


def standard_shape_fields(blocks: Any, args: Any) -> dict[str, int]:
    """The config fields the standard shapes use, as the runner derives them: head_dim from
    ``blocks.head_dim`` or the config (:func:`head_dim_of`), the KV head count defaulting to
    the head count. A field the config lacks (or that is not an int) is left out, and the
    dimensions using it go unchecked."""
    fields = {
        name: getattr(args, name, None)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    }
    try:
        fields["num_key_value_heads"] = num_kv_heads_of(args)
        fields["head_dim"] = (
            int(blocks.head_dim(args)) if hasattr(blocks, "head_dim") else head_dim_of(args)
        )
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        pass
    return {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool)}


def confirmed_standard_rules(
    model_dir: Path, record: ModelRecord, blocks: Any
) -> dict[str, dict[str, list[str | None]]]:
    """``{kind: {relative pattern: rule}}`` (kind ``""``: non-layer tensors) of the standard
    shapes that hold on the model directory's tiny checkpoint, dimension by dimension (a
    dimension that does not hold on every layer of that kind is None). Empty without one."""
    from resin.loading.weights import locate_tensors, open_safetensors
    from resin.scaffold.layer_map import name_pattern
    from resin.scaffold.shape_rules import evaluate

    tiny = model_dir / TINY_CHECKPOINT
    if not (tiny / "config.json").is_file():
        return {}
    try:
        args = load_model_args(tiny, record)
        if hasattr(blocks, "normalise_config"):
            args = ModelArgs(**blocks.normalise_config(args.to_dict()))
        kinds = [kind for _, _, kind in layer_kinds(args, record)]
        fields = standard_shape_fields(blocks, args)
        files = locate_tensors(tiny)
        confirmed: dict[str, dict[str, list[str | None]]] = {}
        for path in sorted(set(files.values())):
            with open_safetensors(path) as handle:
                for tensor_name in handle.keys():
                    pattern, layer, _ = name_pattern(tensor_name)
                    if layer is None:
                        kind, relative, table = GLOBAL, pattern, STANDARD_GLOBAL_SHAPES
                    elif layer < len(kinds):
                        kind = kinds[layer]
                        relative = pattern.split("layers.{layer}.", 1)[-1]
                        table = STANDARD_LAYER_SHAPES
                    else:
                        continue  # a next-n (MTP) layer: checked by the record's rules only
                    if relative not in table:
                        continue
                    shape = handle.get_slice(tensor_name).get_shape()
                    want = evaluate(list(table[relative]), fields)
                    rule = confirmed.setdefault(kind, {}).setdefault(
                        relative, list(table[relative])
                    )
                    for dim in range(len(rule)):  # once refuted on one layer, None for all
                        if len(shape) != len(want) or want[dim] != shape[dim]:
                            rule[dim] = None
        return confirmed
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return {}  # an unreadable tiny checkpoint confirms nothing (WeightsError: a ValueError)


def _shape_checker(
    record: ModelRecord,
    args: ModelArgs,
    kinds: list[str],
    standard: dict[str, dict[str, list[str | None]]] | None = None,
    fields: dict[str, int] | None = None,
    num_layers: int | None = None,
) -> Any:
    """``expected(pattern, layer) -> dims or None`` from the record's shape rules evaluated on
    the checkpoint's config (None entries: unchecked dims), with the ``standard`` rules
    (:func:`confirmed_standard_rules`, evaluated on ``fields``) filling dimensions the record
    leaves unchecked, for the stack's ``num_layers`` layers and the non-layer tensors.
    ``expected.rule_of(pattern, layer)`` gives the expressions, for error messages."""
    from resin.scaffold.shape_rules import evaluate, with_derived_widths

    rules = record.shape_rules
    standard = standard or {}
    if not rules and not standard:
        return None
    config = with_derived_widths(args.to_dict())  # head_dim as HF derives it, as the rules do
    fields = fields or {}

    def rules_of(pattern: str, layer: int | None) -> tuple[Any, Any]:
        """(the record's rule, the confirmed standard one) of a tensor; either may be None."""
        if layer is None:
            own = rules.get("global", {}).get(pattern)
            extra = standard.get(GLOBAL, {}).get(pattern)
        else:
            relative = pattern.split("layers.{layer}.", 1)[-1]
            own = _kind_shape_rule(record, kinds[layer], relative) if rules else None
            in_stack = num_layers is None or layer < num_layers
            extra = standard.get(kinds[layer], {}).get(relative) if in_stack else None
        if extra is not None and own is not None and len(own) != len(extra):
            extra = None
        return own, extra

    def rule_of(pattern: str, layer: int | None) -> list[str | None] | None:
        own, extra = rules_of(pattern, layer)
        if own is None or extra is None:
            return own or extra
        return [o if o is not None else e for o, e in zip(own, extra)]

    def expected(pattern: str, layer: int | None) -> list[int | None] | None:
        # The record's expressions read the config as written, the standard ones the fields
        # as the runner derives them (standard_shape_fields): each dimension by its own.
        own, extra = rules_of(pattern, layer)
        own_dims = None if own is None else evaluate(own, config)
        extra_dims = None if extra is None else evaluate(extra, fields)
        if own_dims is None or extra_dims is None:
            return own_dims or extra_dims
        return [o if r is not None else e for o, e, r in zip(own_dims, extra_dims, own)]

    expected.rule_of = rule_of  # type: ignore[attr-defined]
    return expected


def _required_globals(
    record: ModelRecord,
    args: ModelArgs,
    weight_map: dict[str, str],
    config_globals: dict[str, Callable[[Any], bool]] | None = None,
) -> set[str]:
    """Runner names of the non-layer tensors the source model had (its embedding, final norm,
    an untied lm_head...), less ``lm_head.weight`` when this checkpoint ties it, and less those
    under a prefix of ``config_globals`` (the model directory's ``weights.CONFIG_GLOBALS``:
    runner-name prefix -> whether this config has that module; Gemma 4's per-layer
    embeddings) that this checkpoint's config lacks."""
    from resin.runners.torch.model_weights import default_runner_name

    names = set()
    for pattern, entries in record.source_shapes.items():
        if any(-1 in layers for _, layers in entries):
            target = weight_map.get(pattern)
            names.add(target if target else default_runner_name(pattern))
    if getattr(args, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    for prefix, has in (config_globals or {}).items():
        if not has(args):
            names = {n for n in names if not n.startswith(prefix)}
    return names
