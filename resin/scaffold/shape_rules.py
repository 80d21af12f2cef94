"""Tensor shapes as formulas of config fields, so a loaded checkpoint's shapes can be checked
without transformers.

Owns :func:`shape_rules`: from the meta models of two configs of one architecture (the source
and its shrunk tiny variant, whose widths differ), each tensor dimension becomes the config
expression that gives it in *both* — one field (``hidden_size``), a product of two
(``num_attention_heads*head_dim``), a constant, or ``None`` when nothing explains it (left
unchecked). Rules are keyed by checkpoint name pattern for non-layer tensors and by layer kind
(``layer_type/mlp_type``) + pattern for layer tensors, so a dense layer and a MoE layer, or a
sliding and a compressed one, each keep their own. Only a dimension that scales between the
two configs and has exactly one explanation gets a rule: a wrong rule would reject a good
checkpoint, a missing one only leaves that dimension to the blocks. :func:`evaluate` turns a rule back into a
shape for a checkpoint's config (``resin.runners.torch.model_dir`` checks every tensor against
it before anything is copied). Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resin.scaffold.layer_map import mlp_types_from_config, name_pattern

Rule = list[str | None]
# Config fields that are ids or flags, not widths: never used to explain a dimension.
NOT_WIDTHS = ("token_id", "_id", "seed", "max_position_embeddings", "version")
# Layer counts: they can size a tensor (per-layer embeddings), but lose a tie with a width.
DEPTH_FIELDS = {"num_hidden_layers", "num_layers", "n_layers", "num_decoder_layers"}


def shape_rules(source: Any, probe: Any) -> dict[str, Any]:
    """``{"global": {pattern: rule}, "kinds": {kind: {relative pattern: rule}}}`` from two
    :class:`~resin.scaffold.inspect.Architecture` s of one model (``source`` and a ``probe`` of
    other widths)."""
    src_fields, probe_fields = _widths(source.config), _widths(probe.config)
    src_shapes, probe_shapes = _by_kind(source), _by_kind(probe)
    out: dict[str, Any] = {"global": {}, "kinds": {}}
    for kind, tensors in src_shapes.items():
        other = probe_shapes.get(kind, {})
        rules = {
            pattern: _rule(shape, other[pattern], src_fields, probe_fields)
            for pattern, shape in tensors.items()
            if pattern in other
        }
        if kind == "":
            out["global"] = rules
        else:
            out["kinds"][kind] = rules
    return out


def evaluate(rule: Rule, config: Mapping[str, Any]) -> list[int | None]:
    """The dims a rule gives for ``config`` (None: unchecked, or a field the config lacks)."""
    dims: list[int | None] = []
    for expr in rule:
        if expr is None:
            dims.append(None)
            continue
        value = 1
        for factor in expr.split("*"):
            if factor.isdigit():
                value *= int(factor)
                continue
            field = config.get(factor)
            if not isinstance(field, int) or isinstance(field, bool):
                value = -1
                break
            value *= field
        dims.append(value if value >= 0 else None)
    return dims


def _rule(
    shape: tuple[int, ...],
    other: tuple[int, ...],
    fields: dict[str, int],
    other_fields: dict[str, int],
) -> Rule:
    if len(shape) != len(other):
        return [None] * len(shape)
    return [_expression(a, b, fields, other_fields) for a, b in zip(shape, other)]


def _expression(
    dim: int, other: int, fields: dict[str, int], other_fields: dict[str, int]
) -> str | None:
    """The one config expression that gives ``dim`` in the source and ``other`` in the probe.
    A dimension equal in both (it did not scale, so any field of that value would fit) or one
    that several expressions explain is left unchecked (None): a wrong rule would reject a
    good checkpoint."""
    if dim == other:
        return None
    names = sorted(set(fields) & set(other_fields))
    tiers = [
        {f for f in names if fields[f] == dim and other_fields[f] == other},
        {
            f"{a}*{b}"
            for i, a in enumerate(names)
            for b in names[i + 1 :]  # no field squared: no weight is head_dim x head_dim wide
            if fields[a] * fields[b] == dim and other_fields[a] * other_fields[b] == other
        },
        {
            f"{k}*{f}"
            for f in names
            for k in (2, 3, 4)  # e.g. 2 * intermediate for gate_up
            if fields[f] * k == dim and other_fields[f] * k == other
        },
    ]
    for candidates in tiers:  # the simplest explanation wins, if it is the only one of its kind
        if len(candidates) > 1:
            # A layer count equal to a width in both configs (32 layers of 32 heads, a tiny of
            # 4 and 4) ties with it: a depth explains a width only if nothing else does.
            widths = {c for c in candidates if not set(c.split("*")) & DEPTH_FIELDS}
            candidates = widths if len(widths) == 1 else candidates
        if candidates:
            return candidates.pop() if len(candidates) == 1 else None
    return None


def with_derived_widths(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with ``head_dim`` = ``hidden_size // num_attention_heads`` where it has none (as
    HF's ``getattr(config, "head_dim", hidden_size // num_attention_heads)``): rules use it
    for sources that derive it, and a checkpoint's config is read the same way at load."""
    out = dict(raw)
    hidden, heads = out.get("hidden_size"), out.get("num_attention_heads")
    if out.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int):
        if heads > 0 and not isinstance(heads, bool):
            out["head_dim"] = hidden // heads
    return out


def _widths(config: Any) -> dict[str, int]:
    raw = with_derived_widths(config.to_dict() if hasattr(config, "to_dict") else dict(config))
    return {
        k: v
        for k, v in raw.items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v > 1
        and not any(marker in k for marker in NOT_WIDTHS)
    }


def _by_kind(arch: Any) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{"": {pattern: shape}}`` for non-layer tensors, ``{kind: {relative: shape}}`` from the
    first layer of each kind."""
    kinds = {
        layer.index: f"{layer.layer_type}/{mlp}"
        for layer, mlp in zip(arch.layers, mlp_types_from_config(arch.config))
    }
    out: dict[str, dict[str, tuple[int, ...]]] = {"": {}}
    seen: dict[str, int] = {}
    for name, shape in arch.checkpoint_shapes.items():
        pattern, layer, _ = name_pattern(name)
        if layer is None or "layers.{layer}." not in pattern:
            out[""].setdefault(pattern, tuple(shape))
            continue
        kind = kinds.get(layer)
        if kind is None:
            continue
        if seen.setdefault(kind, layer) != layer:
            continue  # the first layer of each kind speaks for the kind
        relative = pattern.split("layers.{layer}.", 1)[1]
        out.setdefault(kind, {}).setdefault(relative, tuple(shape))
    return out
