"""Rotary position embeddings: :class:`RopeConfig` parsed from either config spelling, and
:func:`rope_inv_freq`, the inverse frequencies of transformers' RoPE init functions.

Owns the RoPE semantics of ``transformers/modeling_rope_utils.py`` (``ROPE_INIT_FUNCTIONS``,
``RotaryEmbeddingConfigMixin.standardize_rope_params``) for the rope types Resin supports:
``default``, ``linear``, ``llama3``, ``yarn`` and ``dynamic``. numpy only; computed in float64.

``dynamic`` (NTK): transformers keeps the default frequencies while a forward's largest
position is inside ``max_position_embeddings``, and past it recomputes them from that length
for every position of the sequence at once (``dynamic_rope_update``), so a key cached at
position p would be rotated again at each longer step. A KV cache cannot follow that, so
Resin runs ``dynamic`` exactly as transformers does inside the pretrained length and refuses
a ``max_model_len`` past it (:func:`check_rope_length`).
Both spellings — top-level ``rope_theta`` + ``rope_scaling`` (legacy key ``type`` allowed)
and transformers 5's ``rope_parameters`` — normalise to the same :class:`RopeConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from resin.loading.fields import ConfigError, read_field

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised: fields a rope type does not use are None.

    ``theta`` is the base wavelength; ``factor`` the context-extension factor (linear, llama3,
    yarn); ``original_max_position_embeddings`` the pretraining length in tokens (llama3,
    yarn); ``low_freq_factor``/``high_freq_factor`` llama3's band edges; ``beta_fast``/
    ``beta_slow`` yarn's ramp bounds in rotations; ``attention_factor`` yarn's explicit cos/sin
    scale (None = derived from ``factor``, ``mscale``, ``mscale_all_dim``); ``truncate`` yarn's
    floor/ceil of the correction range; ``partial_rotary_factor`` the rotated fraction of a head.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    partial_rotary_factor: float = 1.0


def parse_rope_tables(
    raw: Mapping[str, Any], default_theta: float, max_position_embeddings: int
) -> dict[str, RopeConfig]:
    """Every rotary table a config defines, for model directories: ``rope_parameters`` nested
    by table name (Gemma 3's ``{"full_attention": ..., "sliding_attention": ...}``,
    DeepSeek-V4's ``{"main": ..., "compress": ...}``) gives one :class:`RopeConfig` per name;
    a flat one gives ``{"*": ...}``. Partial rotary is allowed (``rope_inv_freq`` sizes the
    table by ``partial_rotary_factor``; which dims rotate is the model's)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if (
        isinstance(params, Mapping)
        and params
        and all(isinstance(v, Mapping) for v in params.values())
    ):
        shared = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_parameters")}
        return {
            name: parse_rope_config(
                {**shared, "rope_parameters": dict(table)},
                default_theta,
                max_position_embeddings,
                allow_partial=True,
            )
            for name, table in params.items()
        }
    return {"*": parse_rope_config(raw, default_theta, max_position_embeddings, allow_partial=True)}


def parse_rope_config(
    raw: Mapping[str, Any],
    default_theta: float,
    max_position_embeddings: int,
    allow_partial: bool = False,
) -> RopeConfig:
    """The RoPE of a whole config dict ``raw``; ``default_theta`` is the architecture's
    ``RotaryEmbeddingConfigMixin.default_theta``, used when no ``rope_theta`` is given.
    ``allow_partial``: accept ``partial_rotary_factor`` < 1. Without it (the built-in
    families, which rotate the whole head) the default rope ignores the factor, as their
    modeling files do, and any other rope type refuses it, as HF fails on it."""
    # transformers' convert_rope_params_to_dict + standardize_rope_params: the legacy
    # `rope_scaling` dict wins over `rope_parameters`; top-level `rope_theta` and
    # `partial_rotary_factor` fill in keys the dict lacks; `rope_type` wins over legacy `type`.
    where = "rope parameters"
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}: expected a dict, got {params!r}")
    if any(key in _LAYER_TYPE_KEYS or isinstance(value, Mapping) for key, value in params.items()):
        raise ConfigError(
            f"{where}: per-layer-type rope parameters (keys {sorted(params)}) "
            "need a table per type: parse_rope_tables"
        )
    params = dict(params)
    params.setdefault("rope_theta", read_field(raw, "rope_theta", float, default_theta))
    if "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(_unsupported_rope(rope_type))
    theta = read_field(params, "rope_theta", float, where=where)
    if theta is None or theta <= 1.0:
        raise ConfigError(f"{where}: field 'rope_theta' must be > 1, got {theta!r}")
    partial = read_field(params, "partial_rotary_factor", (float, type(None)), None, where) or 1.0
    if partial != 1.0 and not allow_partial and rope_type == "default":
        # The built-in families' default rope (compute_default_rope_parameters in each
        # modeling file) never reads the factor: HF rotates the whole head, and so does Resin.
        partial = 1.0
    if partial != 1.0 and not allow_partial:
        # The other rope types size inv_freq by the factor while the built-in modeling files
        # rotate the whole head: HF fails on the shape mismatch.
        raise ConfigError(
            f"{where}: partial_rotary_factor {partial} is not supported for this "
            "architecture (it rotates the whole head)"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type in ("linear", "dynamic"):  # dynamic's limit: the pretrained length
        return RopeConfig(
            rope_type,
            theta,
            factor=_positive(read_field(params, "factor", float, where=where), "factor", rope_type),
            original_max_position_embeddings=(
                max_position_embeddings if rope_type == "dynamic" else None
            ),
            partial_rotary_factor=partial,
        )
    # llama3 / yarn read the pretraining length; a top-level original_max_position_embeddings
    # overrides the dict's (standardize_rope_params, re-run inside each init function).
    orig_len = read_field(
        params, "original_max_position_embeddings", int, max_position_embeddings, where
    )
    orig_len = read_field(raw, "original_max_position_embeddings", int, orig_len)
    _positive(orig_len, "original_max_position_embeddings", rope_type)
    if rope_type == "llama3":
        low = _positive(
            read_field(params, "low_freq_factor", float, where=where), "low_freq_factor", rope_type
        )
        high = _positive(
            read_field(params, "high_freq_factor", float, where=where),
            "high_freq_factor",
            rope_type,
        )
        if low == high:  # the smoothing between the band edges divides by their difference
            raise ConfigError(
                f"{where}: llama3 fields 'low_freq_factor' and 'high_freq_factor' are both "
                f"{low}; they must differ (high_freq_factor > low_freq_factor)"
            )
        return RopeConfig(
            "llama3",
            theta,
            factor=_positive(read_field(params, "factor", float, where=where), "factor", rope_type),
            original_max_position_embeddings=orig_len,
            low_freq_factor=low,
            high_freq_factor=high,
            partial_rotary_factor=partial,
        )
    factor = read_field(params, "factor", (float, type(None)), None, where)
    if factor is None:  # DeepSeek-V3 style: the extension ratio is implied by the lengths
        factor = max_position_embeddings / orig_len
    _positive(factor, "factor", rope_type)
    optional = {
        name: read_field(params, name, (float, type(None)), None, where)
        for name in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    }
    return RopeConfig(
        "yarn",
        theta,
        factor=factor,
        original_max_position_embeddings=orig_len,
        beta_fast=optional["beta_fast"] or 32.0,
        beta_slow=optional["beta_slow"] or 1.0,
        attention_factor=optional["attention_factor"],
        mscale=optional["mscale"],
        mscale_all_dim=optional["mscale_all_dim"],
        truncate=read_field(params, "truncate", bool, True, where),
        partial_rotary_factor=partial,
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies and the cos/sin scale, as transformers' RoPE init functions.

    Returns ``(inv_freq, attention_scaling)``: ``inv_freq`` is float64, shape
    ``[int(head_dim * partial_rotary_factor) // 2]`` (radians per token); multiply positions
    by it, take cos/sin, and scale both by ``attention_scaling``. transformers computes the
    same formulas in torch float32; this array cast to float32 is within an ulp of it (about
    a third of the frequencies an ulp off). The torch runner and the model directories take
    transformers' bits from ``resin.runners.torch.rope_frequencies.hf_rope_inv_freq``, which
    shares :func:`llama3_frequencies`, :func:`yarn_ramp_bounds` and
    :func:`rope_attention_scaling` with this one; this one serves runners without torch (MLX).
    """
    scaling = rope_attention_scaling(rope)
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope.rope_type in ("default", "dynamic"):  # dynamic: inside the pretrained length
        return inv_freq, scaling
    factor = float(_need(rope.factor, "factor"))
    if rope.rope_type == "linear":
        return inv_freq / factor, scaling
    if rope.rope_type == "llama3":
        return llama3_frequencies(rope, inv_freq, np.where), scaling
    # yarn: blend interpolated (1/factor) and extrapolated frequencies with a linear ramp
    low, high = yarn_ramp_bounds(rope, dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return inv_freq / factor * (1 - extrapolation_weight) + inv_freq * extrapolation_weight, scaling


def rope_attention_scaling(rope: RopeConfig) -> float:
    """The cos/sin scale of ``rope`` (1 but for yarn's attention factor); ConfigError for a
    rope type Resin does not compute."""
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(_unsupported_rope(rope.rope_type))
    if rope.rope_type != "yarn":
        return 1.0
    factor = float(_need(rope.factor, "factor"))
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
    return _yarn_mscale(factor)


def llama3_frequencies(rope: RopeConfig, inv_freq: Any, where: Any) -> Any:
    """transformers' ``_compute_llama3_parameters`` on the default frequencies ``inv_freq``
    (a numpy or a torch array; ``where``: its module's ``where``, so the operations run in the
    array's own dtype): wavelengths shorter than the high-frequency edge stay, longer than the
    low-frequency edge are divided by the factor, those in between interpolated."""
    factor = float(_need(rope.factor, "factor"))
    low = float(_need(rope.low_freq_factor, "low_freq_factor"))
    high = float(_need(rope.high_freq_factor, "high_freq_factor"))
    old_context_len = float(
        _need(rope.original_max_position_embeddings, "original_max_position_embeddings")
    )
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return where(is_medium, smoothed, scaled)


def yarn_ramp_bounds(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """The dimensions (of ``dim // 2``) between which transformers' ``_compute_yarn_parameters``
    ramps from extrapolated to interpolated frequencies: those making ``beta_fast`` and
    ``beta_slow`` rotations in the pretraining context, floored / ceiled unless ``truncate`` is
    false, clamped to the table, never zero-width."""
    base = rope.theta
    orig_len = _need(rope.original_max_position_embeddings, "original_max_position_embeddings")

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate is None or rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    return low, high


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_length_limit(rope: RopeConfig) -> tuple[int, str] | None:
    """(longest sequence in tokens, why) where Resin gives transformers' frequencies for
    ``rope``: ``dynamic`` only inside ``max_position_embeddings`` (module doc); None: no limit."""
    limit = rope.original_max_position_embeddings
    if rope.rope_type != "dynamic" or limit is None:
        return None
    return limit, (
        f"rope type 'dynamic' past max_position_embeddings {limit}: transformers recomputes "
        "the rotary frequencies of every position from the sequence's length at each step, "
        "which a KV cache cannot follow"
    )


def check_rope_length(rope: RopeConfig, max_model_len: int) -> None:
    """ConfigError when sequences of ``max_model_len`` tokens would take ``rope`` where Resin
    cannot give transformers' frequencies (:func:`rope_length_limit`)."""
    limit = rope_length_limit(rope)
    if limit is not None and max_model_len > limit[0]:
        raise ConfigError(
            f"rope type 'dynamic': max_model_len {max_model_len} is past "
            f"max_position_embeddings {limit[0]}; past it transformers recomputes the rotary "
            "frequencies of every position from the sequence's length at each step, which a "
            f"KV cache cannot follow. Serve with max_model_len <= {limit[0]}"
        )


def dynamic_rope_limit(raw: Mapping[str, Any]) -> tuple[int, str] | None:
    """(longest max_model_len, why) for a config whose rotary tables include a ``dynamic``
    one (:func:`check_rope_length`'s rule, for every table :func:`parse_rope_tables` reads);
    None when none is dynamic or the tables are not ones Resin parses (the model's own rope
    then says its limits)."""
    raw = {k: v for k, v in raw.items() if v is not None}
    try:
        tables = parse_rope_tables(
            raw,
            float(raw.get("rope_theta", 10000.0)),
            int(raw.get("max_position_embeddings", 2048)),
        )
    except (ConfigError, TypeError, ValueError):
        return None
    limits = [
        rope.original_max_position_embeddings
        for rope in tables.values()
        if rope.rope_type == "dynamic" and rope.original_max_position_embeddings is not None
    ]
    if not limits:
        return None
    return min(limits), (
        "rope type 'dynamic' past max_position_embeddings: transformers recomputes the rotary "
        "frequencies of every position from the sequence's length at each step, which a KV "
        "cache cannot follow"
    )


def _positive(value: Any, name: str, rope_type: str) -> Any:
    """``value`` when it is > 0; ConfigError naming the field otherwise (a zero or negative
    scaling factor or length divides by zero or flips the frequencies)."""
    if value is not None and value <= 0:
        raise ConfigError(
            f"rope parameters: {rope_type} field {name!r} must be positive, got {value!r}"
        )
    return value


def _need(value: Any, name: str) -> Any:
    if value is None:
        raise ConfigError(f"rope parameters: missing required field {name!r}")
    return value


def _unsupported_rope(rope_type: object) -> str:
    return f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
