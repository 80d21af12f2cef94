"""Which ``transformers`` class is a config's language model, and where its decoder stack is.

Owns the one place the scaffold (:mod:`resin.scaffold.inspect`, the tiny maker) and the parity
harness (:mod:`resin.evals.parity`) decide how to build the HF reference of a checkpoint:

- the class: ``AutoModelForCausalLM`` when transformers maps the config there; else
  ``AutoModelForImageTextToText`` (a multimodal wrapper such as GLM-5.3-Flash's
  ``Glm5NextForConditionalGeneration``, whose ``glm5_next`` config has ``text_config`` +
  ``vision_config`` and no causal-LM entry; or Qwen3.5's ``qwen3_5``, whose causal-LM entry
  builds the text model alone). Its text-only forward (``input_ids`` in, logits
  out) is what Resin runs; the vision tower is built but never called;
- the text config: :func:`text_config` (``config.get_text_config(decoder=True)``, the config
  itself for a plain causal LM), where a wrapper keeps ``vocab_size``, ``num_hidden_layers``,
  ``layer_types``, ...;
- the decoder stack: :func:`decoder_stack`, the module holding ``embed_tokens`` / ``layers`` /
  ``norm`` (``model.model`` for Llama-style causal LMs, ``model.model.language_model`` for the
  wrappers), and its path, so hooks and names find the same blocks in both layouts;
- loading a wrapper (:func:`from_pretrained`): tensors saved under the causal-LM names
  (``model.layers.*``: a text-only checkpoint whose config still names the wrapper, as
  GLM-5.3-Flash's flat config does) are mapped onto the wrapper's stack
  (``model.language_model.layers.*``); the towers Resin never runs (every sub-config but the
  text one: the vision tower) are built one block deep, since their weights play no part in a
  text-only forward and a full default tower costs gigabytes; the experts run HF's eager
  per-expert loop (``experts_implementation="eager"``, applied to the sub-configs too: a text
  sub-config would otherwise pick ``grouped_mm``, the same math with other bf16 rounding).

Imports transformers inside the functions only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Where a decoder stack sits in the classes transformers builds, tried in order.
STACK_PATHS = ("model", "model.language_model", "language_model", "model.text_model", "gpt_neox")
# Stack paths of plain causal LMs (the rest are multimodal wrappers' text models).
CAUSAL_STACKS = ("model", "gpt_neox")
# Other names decoder stacks give their embedding and final norm (GPT-NeoX: embed_in,
# final_layer_norm; Phi: final_layernorm) -> the Llama name the runner and the record use.
STACK_ALIASES = {"embed_in": "embed_tokens", "final_layer_norm": "norm", "final_layernorm": "norm"}


def stack_part(inner: Any, name: str) -> Any:
    """The decoder stack's ``embed_tokens`` / ``norm`` under its Llama name or an alias
    (:data:`STACK_ALIASES`); None when it has neither."""
    found = getattr(inner, name, None)
    if found is not None:
        return found
    for alias, target in STACK_ALIASES.items():
        if target == name and getattr(inner, alias, None) is not None:
            return getattr(inner, alias)
    return None


def _auto_classes() -> list[Any]:
    import transformers

    classes = [transformers.AutoModelForCausalLM]
    wrapper = getattr(transformers, "AutoModelForImageTextToText", None)
    if wrapper is not None:
        classes.append(wrapper)
    return classes


def lm_auto_class(config: Any) -> Any:
    """The auto class that maps ``config``'s class: ``AutoModelForCausalLM``, else
    ``AutoModelForImageTextToText``. ValueError names the config class when neither does.

    A wrapper config whose causal-LM entry is built from its text sub-config alone
    (transformers' "VLM compatibility" entries, e.g. ``qwen3_5`` -> ``Qwen3_5ForCausalLM`` on
    ``text_config``) takes the wrapper class when there is one: it is the class of the
    checkpoints (its tensor names, its towers), as for a wrapper with no causal-LM entry."""
    classes = _auto_classes()
    for i, auto in enumerate(classes):
        if type(config) not in auto._model_mapping:
            continue
        if _builds_text_part_only(auto, config) and any(
            type(config) in later._model_mapping for later in classes[i + 1 :]
        ):
            continue  # the wrapper class, next
        return auto
    raise ValueError(
        f"transformers maps {type(config).__name__} (model_type "
        f"{getattr(config, 'model_type', '?')!r}) to no language-model class: neither "
        f"{' nor '.join(a.__name__ for a in classes)} has it (a text sub-config such as "
        "glm5_next_text needs its wrapper's model_type, e.g. glm5_next)"
    )


def _builds_text_part_only(auto: Any, config: Any) -> bool:
    """Whether ``auto`` builds ``config``'s model from its ``text_config`` alone (the class it
    maps to is configured by the text sub-config's class, so transformers swaps the config)."""
    text_class = (getattr(config, "sub_configs", None) or {}).get("text_config")
    model_class = auto._model_mapping[type(config)]
    return text_class is not None and getattr(model_class, "config_class", None) is text_class


def from_config(config: Any) -> Any:
    """The model of :func:`lm_auto_class`, built from ``config`` (``from_config``)."""
    return lm_auto_class(config).from_config(config)


def from_pretrained(path: str | Path, **kwargs: Any) -> Any:
    """The model of :func:`lm_auto_class` for the checkpoint at ``path`` (``from_pretrained``
    with ``kwargs``); a wrapper is loaded as the module doc says."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path))
    auto = lm_auto_class(config)
    if auto is transformers.AutoModelForCausalLM:
        return auto.from_pretrained(str(path), **kwargs)
    shallow_towers(config)
    kwargs.setdefault("experts_implementation", "eager")
    if _saved_as_causal_lm(Path(path)):
        kwargs.setdefault("key_mapping", {CAUSAL_LM_STACK: WRAPPER_STACK})
    return auto.from_pretrained(str(path), config=config, **kwargs)


# A causal LM's stack prefix, and where a wrapper keeps it (key_mapping regex -> replacement).
CAUSAL_LM_STACK = r"^model\.(?!language_model\.|visual\.)"
WRAPPER_STACK = "model.language_model."
DEPTH_FIELDS = ("depth", "num_hidden_layers", "num_layers")


def shallow_towers(config: Any) -> list[str]:
    """Every sub-config of a wrapper but the text one built one block deep (its depth fields,
    :data:`DEPTH_FIELDS`, set to 1); returns ``name.field`` of each change."""
    text = text_config(config)
    changed = []
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is None or sub is text:
            continue
        for field in DEPTH_FIELDS:
            value = getattr(sub, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                setattr(sub, field, 1)
                changed.append(f"{name}.{field}")
    return changed


def _saved_as_causal_lm(path: Path) -> bool:
    """Whether the checkpoint's tensors carry causal-LM names (``model.layers.*``) and none of
    the wrapper's (``model.language_model.*``)."""
    names = checkpoint_tensor_names(path)
    return any(n.startswith("model.layers.") for n in names) and not any(
        n.startswith(WRAPPER_STACK) for n in names
    )


def checkpoint_tensor_names(path: Path) -> list[str]:
    """Tensor names of a safetensors checkpoint (one file or an index); [] when none."""
    import json

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
    single = path / "model.safetensors"
    if not single.is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(single), "np") as f:
        return list(f.keys())


def text_config(config: Any) -> Any:
    """The decoder's config: ``config.get_text_config(decoder=True)`` (a wrapper's
    ``text_config``), or ``config`` itself."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:  # older transformers: no decoder keyword
        return getter()


def decoder_stack(model: Any) -> tuple[Any, str]:
    """``(module, path)`` of the module holding ``embed_tokens`` and ``layers`` (see the module
    doc). ValueError lists the model's top-level children when none is found."""
    for path in STACK_PATHS:
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if (
            module is not None
            and hasattr(module, "layers")
            and stack_part(module, "embed_tokens") is not None
        ):
            return module, path
    raise ValueError(
        f"{type(model).__name__}: no decoder stack (a module with embed_tokens and layers) at "
        f"{', '.join(STACK_PATHS)}; top-level children: "
        f"{[name for name, _ in model.named_children()]}"
    )
