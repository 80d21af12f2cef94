"""Typed reads from a parsed ``config.json`` dict, and :class:`ConfigError`.

Owns the one error type of :mod:`resin.loading` and the field readers that raise it with the
field's name, so every message says which key is missing or malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A checkpoint config Resin cannot load; the message names what is wrong."""


def read_field(
    raw: Mapping[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any = ...,
    where: str = "config",
) -> Any:
    """``raw[name]`` checked against ``kind``; ``default`` when absent (... = required)."""
    if name not in raw:
        if default is ...:
            raise ConfigError(f"{where}: missing required field {name!r}")
        return default
    value = raw[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None and type(None) in kinds:
        return None
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}: field {name!r} must be {expected}, got {value!r}")
    return value


def read_positive(raw: Mapping[str, Any], name: str, default: Any = ...) -> int:
    """A strictly positive int field (a count or a size)."""
    value: int = read_field(raw, name, int, default)
    if value <= 0:
        raise ConfigError(f"config: field {name!r} must be positive, got {value}")
    return value


# config.json ``dtype`` / ``torch_dtype`` values transformers maps to a torch dtype
# (``getattr(torch, name)``; "auto" means the checkpoint's own): the floating ones, which a
# checkpoint's weights are saved in.
KNOWN_DTYPE_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "half",
    "float",
    "double",
    "float8_e4m3fn",
    "float8_e5m2",
    "auto",
)


def read_dtype_field(raw: Mapping[str, Any], where: str = "config") -> str | None:
    """``dtype`` (transformers 5) or else ``torch_dtype``: None when absent, ConfigError naming
    the field when it is not a string or not a dtype name transformers knows."""
    value = None
    for name in ("dtype", "torch_dtype"):
        found = read_field(raw, name, (str, type(None)), None, where)
        if found is not None and found not in KNOWN_DTYPE_NAMES:
            raise ConfigError(
                f"{where}: field {name!r} is {found!r}, not a dtype name; expected one of "
                f"{', '.join(KNOWN_DTYPE_NAMES)}"
            )
        value = value or found
    return value


def read_json_object(path: Any) -> dict[str, Any]:
    """The JSON object in ``path``; ConfigError naming the file when it cannot be read, is not
    JSON, or is not an object."""
    import json

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


# Layer-type names older configs use, as transformers renames them when it loads a config
# (``configuration_utils._LEGACY_LAYER_TYPE_REMAP``): a checkpoint saying "attention" means
# "full_attention" to HF, so it must to Resin too.
LEGACY_LAYER_TYPES = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}


def remap_legacy_layer_types(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``layer_types`` / ``mtp_layer_types`` under transformers' current names
    (:data:`LEGACY_LAYER_TYPES`); anything else is left as it is, for the caller to check."""
    remapped = dict(values)
    for key in ("layer_types", "mtp_layer_types"):
        types = values.get(key)
        if isinstance(types, list):
            remapped[key] = [
                LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types
            ]
    return remapped


def refuse_bidirectional(values: Mapping[str, Any], where: str = "config") -> None:
    """ConfigError for ``is_causal: false``: transformers then builds a bidirectional mask
    for every decoder (``masking_utils.create_causal_mask``: an encoder made from a decoder,
    as embedding models are), so each position sees later tokens. Resin runs causal decoders
    with a KV cache, which cannot compute that."""
    if values.get("is_causal", True) is False:
        raise ConfigError(
            f"{where}: is_causal false (bidirectional attention: each token attends to later "
            "ones, as in an embedding model made from a decoder) is not supported; Resin runs "
            "causal decoders"
        )
