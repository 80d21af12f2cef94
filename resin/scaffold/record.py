"""The model record (``architecture.json``) a generated model directory carries.

Owns :func:`model_record`: from an :class:`~resin.scaffold.inspect.Architecture` (the meta-model
walk, run once at generation time) to the :class:`resin.runners.torch.model_dir.ModelRecord` the
shared runner reads at run time instead of importing ``transformers``: the config class's
defaults (for a multimodal wrapper: its text config class's, with the wrapper's own
``tie_word_embeddings``), each layer kind's HF classes and tensor patterns (as the checkpoint
names them: ``model.language_model.*`` for GLM-5.3-Flash's wrapper), the final-norm and rotary
classes,
every checkpoint tensor pattern of the model, and HF's keep-in-fp32 module patterns per dtype.
Where only ``sliding_window`` makes the layers slide, both kinds are recorded
(:func:`window_toggled_kinds`).
Imports transformers (for the config class defaults and the model class's fp32 attributes).
"""

from __future__ import annotations

import json
from typing import Any

from resin.scaffold.inspect import Architecture
from resin.scaffold.layer_map import (
    FULL,
    SLIDING,
    mlp_types_from_config,
    name_pattern,
    pattern_shapes,
)
from resin.scaffold.shape_rules import shape_rules

# HF config keys that say nothing about the model's math.
BOOKKEEPING_KEYS = (
    "architectures",
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "id2label",
    "label2id",
    "problem_type",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "use_cache",
    "output_router_logits",
    "router_aux_loss_coef",
    "initializer_range",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "cross_attention_hidden_size",
    "add_cross_attention",
    "tf_legacy_loss",
    "pruned_heads",
    "torchscript",
    "use_bfloat16",
)


def model_record(
    arch: Architecture, name: str, source: str, probe: Architecture | None = None
) -> Any:
    """The record of ``arch`` (see module doc); raises ValueError when two layers of one kind
    use different classes (the kind rule cannot tell them apart). ``probe``: the same model at
    other widths (the tiny config), from which each tensor's shape becomes a formula of config
    fields (:mod:`resin.scaffold.shape_rules`; none without a probe)."""
    from resin.runners.torch.model_dir import ModelRecord

    mlp_types = mlp_types_from_config(arch.config)
    kinds: dict[str, dict[str, Any]] = {}
    layer_patterns = _layer_patterns(arch)
    for layer, mlp_type in zip(arch.layers, mlp_types):
        kind = f"{layer.layer_type}/{mlp_type}"
        entry = {
            "decoder": layer.decoder.cls_name,
            "children": {child: info.cls_name for child, info in layer.children.items()},
            "tensors": sorted(layer_patterns.get(layer.index, set())),
        }
        known = kinds.setdefault(kind, entry)
        if known["decoder"] != entry["decoder"] or known["children"] != entry["children"]:
            raise ValueError(
                f"layers of kind {kind!r} use different classes ({known} vs "
                f"{entry} at layer {layer.index}): the scaffold cannot tell them "
                "apart from the config"
            )
    mirrored = window_toggled_kinds(arch.config, kinds)
    for kind, source_kind in mirrored.items():
        kinds[kind] = kinds[source_kind]
    rules = shape_rules(arch, probe) if probe is not None else {}
    for kind, source_kind in mirrored.items():
        if source_kind in rules.get("kinds", {}):
            rules["kinds"][kind] = rules["kinds"][source_kind]
    windowed = {layer.layer_type for layer in arch.layers if layer.window}
    if any(kind.startswith(f"{SLIDING}/") for kind in mirrored):
        windowed.add(SLIDING)
    # lm_head is known even where tied: some tied checkpoints store it anyway.
    heads = {"lm_head.weight", *arch.checkpoint_names.get("lm_head.weight", [])}
    patterns = sorted({name_pattern(n)[0] for n in arch.checkpoint_shapes} | heads)
    defaults = config_defaults(arch.config)
    if arch.wrapper_config is not None:
        # HF ties a wrapper's lm_head by the outer config (Mistral-3: True over its text
        # config's False); the generated normalise_config keeps the top-level value.
        outer = config_defaults(arch.wrapper_config)
        if "tie_word_embeddings" in outer:
            defaults["tie_word_embeddings"] = outer["tie_word_embeddings"]
    return ModelRecord(
        name=name,
        architectures=[arch.architecture],
        model_types=[arch.model_type],
        config_defaults=defaults,
        layer_kinds=kinds,
        norm=arch.norm.cls_name if arch.norm else None,
        rotary=arch.rotary.cls_name if arch.rotary else None,
        checkpoint_patterns=patterns,
        source_shapes=source_shapes(arch),
        shape_rules=rules,
        windowed_layer_types=sorted(windowed),
        keep_in_fp32=keep_in_fp32_patterns(arch.architecture),
        generated_from=source,
    )


def window_toggled_kinds(config: Any, kinds: dict[str, Any]) -> dict[str, str]:
    """{kind the source lacks: recorded kind with the same modules} for a config whose layers
    are all one type only by its ``sliding_window`` (no ``layer_types``, no sliding-window
    pattern: Phi-3, Mistral): every layer is ``sliding_attention`` when it is set and
    ``full_attention`` when it is null (Phi-4 vs Phi-3.5), so a checkpoint of either kind
    runs whichever the source had. Likewise for a config class with a ``use_sliding_window``
    switch (Qwen2, Qwen2-MoE, Qwen3, SmolLM3), whose ``layer_types`` it derives from the switch:
    a source with the switch off has full layers only, a checkpoint with it on slides some of
    the same modules."""
    switched = hasattr(config, "use_sliding_window")
    if not switched and (
        getattr(config, "layer_types", None)
        or any(
            getattr(config, key, None) is not None
            for key in ("sliding_window_pattern", "_sliding_window_pattern")
        )
    ):
        return {}
    if {kind.split("/", 1)[0] for kind in kinds} not in ({FULL}, {SLIDING}):
        return {}
    other = {FULL: SLIDING, SLIDING: FULL}
    out = {}
    for kind in kinds:
        layer_type, mlp = kind.split("/", 1)
        out[f"{other[layer_type]}/{mlp}"] = kind
    return out


def source_shapes(arch: Architecture) -> dict[str, list[list[Any]]]:
    """Checkpoint name pattern -> ``[[shape, [layers having it]], ...]`` of the model the record
    was generated from (layer -1: not a layer tensor), so a real checkpoint's safetensors
    headers can be checked against it without loading anything."""
    return {
        pattern: [[list(shape), layers] for shape, layers in by_shape.items()]
        for pattern, by_shape in pattern_shapes(arch.checkpoint_shapes).items()
    }


def config_defaults(config: Any) -> dict[str, Any]:
    """The config class's own defaults (what ``save_pretrained`` leaves out of config.json),
    JSON-serialisable values only."""
    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a config class that needs arguments: keep none
        defaults = {}
    for key in BOOKKEEPING_KEYS:
        defaults.pop(key, None)
    return {k: v for k, v in defaults.items() if _is_json(v)}


def keep_in_fp32_patterns(architecture: str) -> dict[str, list[str]]:
    """HF's dtype plan for the model class: names kept in fp32 when loading in fp16 / bf16
    (``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict`` for both)."""
    import transformers

    model_cls = getattr(transformers, architecture, None)
    loose = sorted(getattr(model_cls, "_keep_in_fp32_modules", None) or ())
    strict = sorted(getattr(model_cls, "_keep_in_fp32_modules_strict", None) or ())
    return {"float16": sorted(set(loose) | set(strict)), "bfloat16": strict}


def _layer_patterns(arch: Architecture) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for checkpoint_name in arch.checkpoint_shapes:
        pattern, layer, _ = name_pattern(checkpoint_name)
        if layer is not None and "layers.{layer}." in pattern:
            out.setdefault(layer, set()).add(pattern.split("layers.{layer}.", 1)[1])
    return out


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
