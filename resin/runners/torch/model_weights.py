"""A model's tensors as the shared paged runner holds them, and the one loader behind them.

Owns :class:`ModelWeights` (non-layer tensors by runner name, per-layer dicts keyed relative to
the layer) and :func:`load_model_weights`, which reads a checkpoint's safetensors for any model:
each checkpoint name is renamed by the model's weight map (a pattern with ``{layer}`` /
``{expert}`` placeholders; names the map does not list keep the checkpoint name minus the
``model.`` prefix), and cast by the dtype rules every runner shares:

- floating tensors go to the runner's dtype, except names matching the model's
  keep-in-fp32 patterns (HF's ``_keep_in_fp32_modules`` for fp16, ``..._strict`` for fp16 and
  bf16: substring match on the checkpoint name, as HF's dtype plan), which load as fp32;
- integer tensors (hash-routing tables, index buffers) keep their dtype: never cast to float;
- a checkpoint whose config.json has a ``quantization_config`` (block-scaled FP8 linears, FP4
  experts: :mod:`resin.loading.quantized_weights`) has each quantised tensor dequantised on
  CPU with its scale (in fp32, then cast as above); scale tensors are consumed, never loaded
  or reported unknown, and shapes are checked on the dequantised tensor. Without one, nothing
  changes.

Guarantees: a missing required tensor, or (with ``expected_shape``) a tensor whose shape is not
what the checkpoint's config implies, raises :class:`resin.loading.weights.WeightsError` naming
it before anything is copied (a built-in family checks shapes against its parsed config in
:mod:`resin.loading.weights`). Imports torch.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from resin.loading.quantized_weights import (
    DequantPlan,
    dequantize,
    plan_dequantisation,
    read_quant_scheme,
)
from resin.loading.weights import (
    SUPPORTED_DTYPES,
    WeightsError,
    check_float_dtype,
    locate_tensors,
    open_safetensors,
    read_tensor,
    tensor_header,
)
from resin.scaffold.layer_map import name_pattern

# Checkpoint tensors that are leftovers, not weights (older checkpoints saved rotary buffers).
IGNORED_SUFFIXES = (".inv_freq", "._float_tensor")
# Integer tensors a model keeps as they are (hash-routing tables, index buffers). Narrower
# integers, bool and fp8 are quantised or foreign data: refused without a quantization_config.
INDEX_HEADER_DTYPES = ("I32", "I64")
# Where a checkpoint keeps its next-n (MTP) layers: prefixes with ``{i}`` (the MTP layer's own
# index, renamed to a layer past the stack: DeepSeek's ``mtp.{i}.``) or ``{layer}`` (already a
# layer past the stack, ``num_hidden_layers + i``: DeepSeek-V3 / GLM's ``model.layers.{layer}.``).
# A model directory names its own in ``weights.MTP_PREFIXES``; this is the default.
DEFAULT_MTP_PREFIXES = ("mtp.{i}.", "model.mtp.{i}.")


def _mtp_pattern(prefix: str) -> re.Pattern[str]:
    escaped = re.escape(prefix).replace(r"\{i\}", r"(?P<i>\d+)")
    return re.compile("^" + escaped.replace(r"\{layer\}", r"(?P<layer>\d+)"))


def mtp_layer_of(
    checkpoint_name: str, num_layers: int, prefixes: Iterable[str] = DEFAULT_MTP_PREFIXES
) -> tuple[int, bool, int] | None:
    """``(i, renamed, end)`` when the name is a tensor of MTP layer ``i`` under one of
    ``prefixes`` (``renamed``: an ``{i}`` prefix, to be placed as a layer; ``end``: where the
    layer-relative rest starts), else None."""
    for prefix in prefixes:
        m = _mtp_pattern(prefix).match(checkpoint_name)
        if m is None:
            continue
        if "i" in m.groupdict():
            return int(m.group("i")), True, m.end()
        i = int(m.group("layer")) - num_layers
        if i >= 0:
            return i, False, m.end()
    return None


def stack_name(
    checkpoint_name: str,
    num_layers: int,
    num_mtp_layers: int,
    prefixes: Iterable[str] = DEFAULT_MTP_PREFIXES,
) -> str:
    """The name a tensor is matched and placed under: an MTP layer's ``mtp.{i}.<rest>`` (i <
    ``num_mtp_layers``) becomes ``layers.{num_layers + i}.<rest>`` — the MTP layers are layers
    past the stack, named by the same patterns as the decoder layers (the model's weight map
    renames them once for both); a ``{layer}`` prefix already names that layer, and any other
    name is unchanged."""
    found = mtp_layer_of(checkpoint_name, num_layers, prefixes)
    if found is None or not found[1] or found[0] >= num_mtp_layers:
        return checkpoint_name
    i, _, end = found
    return f"layers.{num_layers + i}." + checkpoint_name[end:]


@dataclass
class ModelWeights:
    """``globals``: runner name -> tensor outside the decoder layers; ``layers[i]``: name
    relative to layer i (``self_attn.q_proj.weight``) -> tensor; ``unused``: checkpoint names
    not loaded."""

    globals: dict[str, torch.Tensor]
    layers: list[dict[str, torch.Tensor]]
    unused: list[str] = field(default_factory=list)

    def module(self, layer: int, child: str) -> dict[str, torch.Tensor]:
        """One layer child's tensors keyed relative to it (``q_proj.weight``)."""
        return _relative(self.layers[layer], child)

    def global_module(self, name: str) -> dict[str, torch.Tensor]:
        """A non-layer module's tensors keyed relative to it (``norm`` -> ``{"weight": ...}``)."""
        return _relative(self.globals, name)

    @classmethod
    def from_flat(
        cls,
        tensors: Mapping[str, torch.Tensor],
        num_layers: int,
        rename: Callable[[str], str] | None = None,
    ) -> ModelWeights:
        """Group checkpoint-named tensors (``model.layers.3.mlp...``) by layer."""
        out = cls({}, [{} for _ in range(num_layers)])
        for name, tensor in tensors.items():
            out._place(rename(name) if rename else default_runner_name(name), tensor)
        return out

    def _place(self, runner_name: str, tensor: torch.Tensor) -> None:
        if runner_name.startswith("layers."):
            index, rest = runner_name[len("layers.") :].split(".", 1)
            if int(index) >= len(self.layers):
                raise WeightsError(
                    f"tensor {runner_name}: layer {index} is past the "
                    f"{len(self.layers)} layers of config.json"
                )
            self.layers[int(index)][rest] = tensor
        else:
            self.globals[runner_name] = tensor


def _relative(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    start = prefix + "."
    return {k[len(start) :]: v for k, v in tensors.items() if k.startswith(start)}


def default_runner_name(checkpoint_name: str) -> str:
    """The runner's name for a checkpoint tensor no map renames: without the ``model.`` prefix."""
    return (
        checkpoint_name[len("model.") :]
        if checkpoint_name.startswith("model.")
        else checkpoint_name
    )


def _prefix_matcher(prefixes: Iterable[str]) -> Callable[[str], bool]:
    """Whether a checkpoint name starts with one of ``prefixes``, ``{layer}`` in a prefix
    matching any layer index (one regular expression for those)."""
    prefixes = tuple(prefixes)
    plain = tuple(p for p in prefixes if "{layer}" not in p)
    patterned = [p for p in prefixes if "{layer}" in p]
    regex = (
        re.compile("|".join(re.escape(p).replace(r"\{layer\}", r"\d+") for p in patterned))
        if patterned
        else None
    )
    return lambda name: (
        name.startswith(plain) or (regex is not None and regex.match(name) is not None)
    )


def load_model_weights(
    checkpoint_dir: str | Path,
    num_layers: int,
    *,
    weight_map: Mapping[str, str] | None = None,
    known_patterns: Iterable[str] | None = None,
    required: Callable[[int], Iterable[str]] | None = None,
    required_globals: Iterable[str] = (),
    expected_shape: Callable[[str, int | None], list[int | None] | None] | None = None,
    keep_in_fp32: Iterable[str] = (),
    ignored_prefixes: Iterable[str] = (),
    num_mtp_layers: int = 0,
    mtp_prefixes: Iterable[str] = DEFAULT_MTP_PREFIXES,
    shard: Callable[[str, tuple[int, ...]], tuple[tuple[slice, ...], bool] | None] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ModelWeights:
    """Every tensor of the checkpoint the model knows, renamed and cast (see module doc).

    ``known_patterns``: checkpoint name patterns the model has; None loads everything. A
    tensor of a layer past the stack (MTP layers) or a leftover buffer (``inv_freq``) is left
    in ``unused`` with one warning; any other tensor the model does not know is an error (a
    bias or a module this model directory was not generated with would silently be ignored).
    ``required(layer)``: patterns (relative to ``model.layers.{layer}.``, ``{expert}``
    allowed) that layer must have; ``required_globals``: runner names of non-layer tensors
    the checkpoint must have (``norm.weight``, an untied ``lm_head.weight``).
    ``ignored_prefixes``: checkpoint name prefixes of parts the runner does not run (a model
    directory's ``weights.IGNORED_PREFIXES``, e.g. ``model.visual.`` for a text-only runner of
    a multimodal checkpoint; ``{layer}`` stands for any layer index, e.g.
    ``model.layers.{layer}.embed_tokens.`` for an MTP layer's copy of the embedding): their
    tensors are left in ``unused``, not read.
    ``shard(runner_name, shape)``: a tensor-parallel rank's part of a tensor — per-dimension
    slices and whether it is zeros (a row-parallel bias another rank adds), or None for the
    whole tensor — read with ``get_slice``, so a rank never materialises the rest
    (:mod:`resin.runners.parallel.sharding`).
    ``num_mtp_layers``: next-n (MTP) layers to load after the stack, from ``mtp.{i}.*`` or the
    model directory's ``mtp_prefixes`` (:func:`stack_name`): layers ``num_layers ..
    num_layers + num_mtp_layers - 1`` of the result, checked by ``required`` like the others;
    MTP tensors past them (or all of them, with 0) are left in ``unused``.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise WeightsError(
            f"unsupported dtype {dtype}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    directory = Path(checkpoint_dir)
    is_ignored = _prefix_matcher(ignored_prefixes)
    files = locate_tensors(directory)
    mapping = dict(weight_map or {})
    # Names the weight map renames are known too (e.g. a checkpoint in the upstream naming).
    known = None if known_patterns is None else set(known_patterns) | set(mapping)
    total_layers = num_layers + num_mtp_layers
    prefixes = tuple(mtp_prefixes)

    def pattern_of(name: str) -> tuple[str, int | None, int | None]:
        return name_pattern(stack_name(name, num_layers, num_mtp_layers, prefixes))

    plan = _dequant_plan(directory, files, known, pattern_of)
    chosen: dict[str, str] = {}
    unused: list[str] = []
    present: dict[int, set[str]] = {}
    unknown: list[str] = []
    for name in files:
        if plan is not None and name in plan.scales:
            continue  # read with its tensor
        pattern, layer, expert = pattern_of(name)
        if (
            (layer is not None and layer >= total_layers)
            or (layer is None and mtp_layer_of(name, num_layers, prefixes) is not None)
            or name.endswith(IGNORED_SUFFIXES)
            or is_ignored(name)
        ):
            unused.append(name)  # MTP layers past the stack, leftover buffers, ignored parts
            continue
        if known is not None and pattern not in known:
            unknown.append(name)
            continue
        target = mapping.get(pattern)
        chosen[name] = (
            target.format(layer=layer, expert=expert)
            if target
            else default_runner_name(stack_name(name, num_layers, num_mtp_layers, prefixes))
        )
        if layer is not None:
            relative = pattern.split("layers.{layer}.", 1)[1]
            present.setdefault(layer, set()).add(relative)
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise WeightsError(
            f"{directory}: tensor(s) {shown} are not in the model this directory was generated "
            "for (a bias, norm or module its architecture.json does not list): regenerate the "
            "model directory from this checkpoint's config (resin new-model --force)"
        )
    missing_globals = sorted(set(required_globals) - set(chosen.values()))
    if missing_globals:
        raise WeightsError(
            f"{directory}: missing tensor(s) {', '.join(missing_globals)} (runner names; the "
            "model and its config.json need them)"
        )
    if required is not None:
        for layer in range(total_layers):
            missing = sorted(set(required(layer)) - present.get(layer, set()))
            if missing:
                where = (
                    f"model.layers.{layer}."
                    if layer < num_layers
                    else prefixes[0].format(i=layer - num_layers, layer=layer)
                )
                shown = ", ".join(f"{where}{m}" for m in missing[:5])
                what = f"layer {layer}" if layer < num_layers else f"MTP layer {layer - num_layers}"
                raise WeightsError(
                    f"{directory}: {what} is missing tensor(s) {shown} (runner names; its "
                    "layer kind has them: a config flag such as a bias switched off? then "
                    "list the module in weights.py CONFIG_SUBMODULES: docs/bring_up.md)"
                )
    if unused:
        warnings.warn(
            f"{directory}: {len(unused)} checkpoint tensor(s) the model does not use, "
            f"not loaded (first: {sorted(unused)[0]})",
            stacklevel=2,
        )
    fp32_patterns = tuple(keep_in_fp32)
    out = ModelWeights({}, [{} for _ in range(total_layers)], sorted(unused))
    by_file: dict[Path, list[str]] = {}
    for name in chosen:
        by_file.setdefault(files[name], []).append(name)
    logical = {} if plan is None else {n: q.shape for n, q in plan.tensors.items()}
    _check_headers(directory, by_file, expected_shape, logical, pattern_of)
    with _CpuReader(files) as cpu:
        for path, names in by_file.items():
            with open_safetensors(path, device) as handle:
                for name in names:
                    part = None
                    if shard is not None:
                        shape = tuple(tensor_header(handle, name, path, directory).get_shape())
                        part = shard(chosen[name], shape)
                    if plan is not None and name in plan.tensors:
                        if part is not None:
                            raise WeightsError(
                                f"{name}: a quantised tensor cannot be read as a "
                                "tensor-parallel slice (dequantise the checkpoint first)"
                            )
                        spec = plan.tensors[name]
                        tensor = dequantize(spec, cpu.get(name), cpu.get(spec.scale))
                        tensor = tensor.to(device)
                    elif part is not None:  # a rank's slice, read as such (never whole)
                        slices, zero = part
                        try:
                            tensor = handle.get_slice(name)[slices]
                        except Exception as exc:  # safetensors raises its own error types
                            raise WeightsError(
                                f"{path}: cannot read tensor {name} ({exc})"
                            ) from exc
                        if zero:  # a row-parallel bias: added once, by rank 0
                            tensor = torch.zeros_like(tensor)
                    else:
                        tensor = read_tensor(handle, name, path)
                    if tensor.is_floating_point():
                        # HF matches its patterns on in-memory names: try the runner name too.
                        keep = any(p in name or p in chosen[name] for p in fp32_patterns)
                        tensor = tensor.to(dtype=torch.float32 if keep else dtype)
                    out._place(chosen[name], tensor)
    return out


def _dequant_plan(
    directory: Path,
    files: Mapping[str, Path],
    known: set[str] | None,
    pattern_of: Callable[[str], tuple[str, int | None, int | None]] = name_pattern,
) -> DequantPlan | None:
    """None without a ``quantization_config``; otherwise every quantised tensor paired with
    its scale (WeightsError naming what does not fit)."""
    scheme = read_quant_scheme(directory)
    if scheme is None:
        return None
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with open_safetensors(path) as handle:
            for name in names:
                piece = tensor_header(handle, name, path, directory)
                headers[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    try:
        return plan_dequantisation(
            headers,
            scheme,
            is_routed_expert=lambda name: pattern_of(name)[2] is not None,
            is_known=lambda name: known is None or pattern_of(name)[0] in known,
        )
    except WeightsError as exc:
        raise WeightsError(f"{directory}: {exc}") from None


class _CpuReader:
    """Quantised tensors and their scales read on CPU (a scale may sit in another shard);
    one handle per file, closed when the loader's ``with`` ends."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = files
        self.handles: dict[Path, Any] = {}
        self.stack = ExitStack()

    def __enter__(self) -> _CpuReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
        self.handles.clear()

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(open_safetensors(path, "cpu"))
        return read_tensor(self.handles[path], name, path)


def _check_headers(
    directory: Path,
    by_file: Mapping[Path, list[str]],
    expected_shape: Callable[[str, int | None], list[int | None] | None] | None,
    logical: Mapping[str, tuple[int, ...]],
    pattern_of: Callable[[str], tuple[str, int | None, int | None]] = name_pattern,
) -> None:
    """Every tensor to load, from its safetensors header, before any tensor is copied: its
    dtype (a float, cast on load; an int32 / int64 index table, kept — a quantised tensor of
    the dequantisation plan, in ``logical``, is read with its scale instead), and its shape
    (``logical``: the dequantised shape of a quantised one) against what the checkpoint's
    config implies, when ``expected_shape`` is given; WeightsError naming the tensor, the file
    and what was expected."""
    for path, names in by_file.items():
        with open_safetensors(path) as handle:
            for name in names:
                header = tensor_header(handle, name, path, directory)
                if name not in logical:
                    check_float_dtype(name, header.get_dtype(), path, INDEX_HEADER_DTYPES)
                if expected_shape is None:
                    continue
                pattern, layer, _ = pattern_of(name)
                want = expected_shape(pattern, layer)
                if want is None:
                    continue
                got = logical.get(name) or tuple(header.get_shape())
                if len(got) != len(want) or any(
                    w is not None and w != g for w, g in zip(want, got)
                ):
                    shown = tuple("?" if w is None else w for w in want)
                    rule_of = getattr(expected_shape, "rule_of", None)
                    rule = rule_of(pattern, layer) if rule_of is not None else None
                    why = (
                        "config fields (" + ", ".join(e or "?" for e in rule) + ")"
                        if rule
                        else "the model record's shape rules"
                    )
                    raise WeightsError(
                        f"{path.name}: tensor {name} has shape {got}, but {directory}/config.json "
                        f"implies {shown} (from {why})"
                    )
