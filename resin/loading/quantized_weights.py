"""Quantised checkpoints as shipped: the ``quantization_config`` of ``config.json``, each
quantised tensor paired with its scale, and dequantisation on CPU to the runner dtype.

Owns :class:`QuantScheme` (a parsed ``quantization_config``; :func:`read_quant_scheme`),
:func:`plan_dequantisation` (which checkpoint tensors are quantised, with which scale, and
which names are scales) and the dequantisation arithmetic (:func:`dequantize_fp8_blocks`,
:func:`unpack_fp4_e2m1`, :func:`dequantize_fp4`, :func:`ue8m0_to_float`). The one loader,
:func:`resin.runners.torch.model_weights.load_model_weights`, calls it when a checkpoint has a
``quantization_config``; without one nothing here runs.

The format (transformers' ``FineGrainedFP8Config``; DeepSeek-V3 / V3.1 / V4):

- ``quant_method`` ``fp8``, ``fmt`` ``e4m3`` (default; MiniMax-M2 writes ``float8_e4m3fn``),
  ``activation_scheme`` ``dynamic`` (default), ``weight_block_size`` ``[bi, bj]`` (required:
  per-tensor FP8 is another format).
- FP8 linears: ``X.weight`` in ``float8_e4m3fn`` ``[..., R, C]`` with a scale named
  ``X.weight_scale_inv`` (DeepSeek-V3) or ``X.scale`` (DeepSeek-V4-Flash) of shape
  ``[..., ceil(R / bi), ceil(C / bj)]``: ``w[i, j] = q[i, j] * s[i // bi, j // bj]`` (the
  last row / column of blocks may be partial).
- ``expert_dtype`` ``fp4`` (in the quantization config, or top-level as V4 shipped it; V4.1
  moved it in): routed experts are FP4 e2m1, packed two per byte (``int8`` / ``uint8`` /
  ``float4_e2m1fn_x2``, last dim halved; element ``2k`` is the low nibble, ``2k + 1`` the
  high one), with one scale per 1 x 32 block (``[..., R, ceil(C / 32)]``).
- ``scale_fmt`` ``float`` (scales are float values) or ``ue8m0`` (scales may also be stored
  as ``float8_e8m0fnu`` or raw ``uint8`` exponent bytes: ``2 ** (byte - 127)``; fp32 scales
  are accepted too, as DeepSeek-V3.1 ships them).

Which tensors are quantised is read from the checkpoint (dtype + scale), not from
``modules_to_not_convert`` (kept as metadata). Every inconsistency raises
:class:`resin.loading.weights.WeightsError` naming the tensor: an unknown ``quant_method`` or
key, a quantised tensor without its scale, a scale without its tensor, a scale whose shape
does not cover the tensor's blocks, a storage the config does not announce. Weights are
dequantised in fp32 on CPU and then cast; GPU kernels that keep them quantised (FP8 / FP4
GEMMs reading the scales) are not implemented here. Imports torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from resin.loading.weights import WeightsError

SUPPORTED_METHODS = ("fp8",)
# Keys of a FineGrainedFP8Config; anything else is metadata this loader does not understand.
KNOWN_KEYS = {
    "quant_method",
    "fmt",
    "weight_block_size",
    "scale_fmt",
    "activation_scheme",
    "expert_dtype",
    "modules_to_not_convert",
    "ignored_layers",
    "modules_to_convert",
    "dequantize",
}
FP4_BLOCK = (1, 32)  # one scale per 32 consecutive input values (transformers' FP8Experts)
# e2m1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0.
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_VALUES: tuple[float, ...] = _FP4_MAGNITUDES + tuple(-v for v in _FP4_MAGNITUDES)
FP8_DTYPES = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}
PACKED_FP4_DTYPES = ("I8", "U8", "F4")
FLOAT_SCALE_DTYPES = ("F32", "BF16", "F16")
UE8M0_SCALE_DTYPES = ("F8_E8M0", "U8")
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's parsed ``quantization_config``."""

    method: str
    fmt: str
    block: tuple[int, int]
    scale_fmt: str
    expert_dtype: str
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "config.json") -> QuantScheme:
        """Parse ``config["quantization_config"]`` (a top-level ``expert_dtype`` is folded in,
        as transformers does for V4); WeightsError for anything it does not support."""
        raw = config.get("quantization_config")
        if not isinstance(raw, dict):
            raise WeightsError(f"{where}: quantization_config must be an object, got {raw!r}")
        method = raw.get("quant_method")
        if method not in SUPPORTED_METHODS:
            raise WeightsError(
                f"{where}: quantization_config.quant_method {method!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_METHODS)}: block-scaled FP8, FP4 experts)"
            )
        unknown = sorted(set(raw) - KNOWN_KEYS)
        if unknown:
            raise WeightsError(
                f"{where}: quantization_config has key(s) {', '.join(unknown)} this loader does "
                "not understand; dequantising without them could be silently wrong"
            )
        fmt = raw.get("fmt", "e4m3")
        if fmt == "float8_e4m3fn":  # MiniMax-M2 writes torch's dtype name
            fmt = "e4m3"
        if fmt != "e4m3":
            raise WeightsError(
                f"{where}: quantization_config.fmt {fmt!r}: only 'e4m3' is supported"
            )
        activation = str(raw.get("activation_scheme", "dynamic")).lower()
        if activation != "dynamic":
            raise WeightsError(
                f"{where}: quantization_config.activation_scheme {activation!r}: only 'dynamic' "
                "(no activation scales) is supported"
            )
        block = raw.get("weight_block_size")
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise WeightsError(
                f"{where}: quantization_config.weight_block_size must be two positive integers "
                f"[rows, cols], got {block!r} (per-tensor FP8 is not supported)"
            )
        scale_fmt = raw.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise WeightsError(
                f"{where}: quantization_config.scale_fmt {scale_fmt!r}: expected 'float' or 'ue8m0'"
            )
        top, inner = config.get("expert_dtype"), raw.get("expert_dtype")
        if top is not None and inner is not None and top != inner:
            raise WeightsError(
                f"{where}: expert_dtype {top!r} and quantization_config.expert_dtype {inner!r} "
                "disagree"
            )
        expert_dtype = inner or top or "fp8"
        if expert_dtype not in ("fp8", "fp4"):
            raise WeightsError(f"{where}: expert_dtype {expert_dtype!r}: expected 'fp8' or 'fp4'")
        skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
        return cls(
            method, fmt, (block[0], block[1]), scale_fmt, expert_dtype, tuple(str(s) for s in skip)
        )


def read_quant_scheme(checkpoint_dir: str | Path) -> QuantScheme | None:
    """The scheme of ``checkpoint_dir/config.json``, or None when it has no
    ``quantization_config`` (or no readable config.json: the caller reports that)."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("quantization_config") is None:
        return None
    return QuantScheme.from_config(config, str(path))


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantised checkpoint tensor: ``kind`` ``fp8`` or ``fp4``, its scale's name, the
    block one scale covers, and the dequantised (logical) shape."""

    name: str
    scale: str
    kind: str
    block: tuple[int, int]
    shape: tuple[int, ...]


@dataclass
class DequantPlan:
    """``tensors``: weight name -> how to dequantise it; ``scales``: names consumed as scales
    (never loaded on their own, never "unknown")."""

    tensors: dict[str, QuantizedTensor] = field(default_factory=dict)
    scales: set[str] = field(default_factory=set)


def plan_dequantisation(
    headers: Mapping[str, tuple[str, tuple[int, ...]]],
    scheme: QuantScheme,
    *,
    is_routed_expert: Callable[[str], bool] = lambda name: False,
    is_known: Callable[[str], bool] = lambda name: False,
) -> DequantPlan:
    """Pair every quantised tensor of ``headers`` (name -> (safetensors dtype, shape)) with
    its scale and check both (module doc); WeightsError naming the tensor otherwise.

    ``.weight_scale_inv`` is always a scale; ``X.scale`` is one when ``X.weight`` exists (a
    lone ``.scale`` the model knows, a hyper-connection scale say, is an ordinary tensor).
    ``is_routed_expert(name)``: the tensor is a routed expert's (FP4 when ``expert_dtype``
    is fp4)."""
    plan = DequantPlan()
    scale_of: dict[str, str] = {}
    for name in headers:
        for suffix in SCALE_SUFFIXES:
            if not name.endswith(suffix):
                continue
            weight = name[: -len(suffix)] + ".weight"
            if weight not in headers:
                if suffix == ".scale" and is_known(name):
                    break  # an ordinary tensor that happens to be called scale
                raise WeightsError(
                    f"scale tensor {name} has no quantised tensor {weight} in the checkpoint"
                )
            if weight in scale_of:
                raise WeightsError(f"tensor {weight} has two scales, {scale_of[weight]} and {name}")
            scale_of[weight] = name
            break
    scale_names = set(scale_of.values())
    for name, (dtype, shape) in headers.items():
        if name in scale_names:
            continue
        scale = scale_of.get(name)
        expert = is_routed_expert(name)
        if dtype in FP8_DTYPES:
            if FP8_DTYPES[dtype] != scheme.fmt:
                raise WeightsError(
                    f"tensor {name} is FP8 {FP8_DTYPES[dtype]}, but quantization_config.fmt "
                    f"is {scheme.fmt!r}"
                )
            if scale is None:
                raise WeightsError(
                    f"quantised tensor {name} ({dtype}) has no scale "
                    f"({name.removesuffix('.weight')}.weight_scale_inv or .scale)"
                )
            if expert and scheme.expert_dtype == "fp4":
                raise WeightsError(
                    f"routed expert tensor {name} is FP8, but quantization_config says "
                    "expert_dtype 'fp4'"
                )
            kind, block, logical = "fp8", scheme.block, tuple(shape)
        elif dtype in PACKED_FP4_DTYPES and (
            scale is not None or dtype == "F4" or (expert and scheme.expert_dtype == "fp4")
        ):
            if scale is None:
                raise WeightsError(f"packed FP4 tensor {name} ({dtype}) has no scale")
            if scheme.expert_dtype != "fp4":
                raise WeightsError(
                    f"tensor {name} is stored as {dtype} with a scale (packed FP4), but "
                    "quantization_config has no expert_dtype 'fp4'"
                )
            if not shape:
                raise WeightsError(f"packed FP4 tensor {name} is a scalar")
            kind, block = "fp4", FP4_BLOCK
            logical = (*shape[:-1], 2 * shape[-1])
        else:
            if scale is not None:
                raise WeightsError(
                    f"tensor {name} has a scale ({scale}) but is stored as {dtype}, not FP8 / "
                    "packed FP4"
                )
            continue
        if len(logical) < 2:
            raise WeightsError(f"quantised tensor {name} has shape {tuple(shape)}: not a matrix")
        assert scale is not None
        _check_scale(name, logical, block, scale, headers[scale], scheme)
        plan.tensors[name] = QuantizedTensor(name, scale, kind, block, logical)
        plan.scales.add(scale)
    return plan


def _check_scale(
    name: str,
    shape: tuple[int, ...],
    block: tuple[int, int],
    scale: str,
    header: tuple[str, tuple[int, ...]],
    scheme: QuantScheme,
) -> None:
    dtype, got = header
    want = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    if tuple(got) != want:
        raise WeightsError(
            f"scale {scale} of tensor {name} has shape {tuple(got)}; {shape} in blocks of "
            f"{block[0]} x {block[1]} needs {want}"
        )
    if dtype in UE8M0_SCALE_DTYPES:
        if scheme.scale_fmt != "ue8m0":
            raise WeightsError(
                f"scale {scale} of tensor {name} is stored as {dtype} (ue8m0 exponents), but "
                f"quantization_config.scale_fmt is {scheme.scale_fmt!r}"
            )
    elif dtype not in FLOAT_SCALE_DTYPES:
        raise WeightsError(f"scale {scale} of tensor {name} has dtype {dtype}, not a scale dtype")


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Unsigned e8m0 exponents (``float8_e8m0fnu`` or ``uint8`` bytes) -> fp32
    ``2 ** (byte - 127)``; byte 255 is NaN."""
    raw = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    out = torch.exp2(raw.to(torch.float32) - 127.0)
    return torch.where(raw == 255, torch.full_like(out, float("nan")), out)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale tensor as fp32 multipliers (float scales as they are, e8m0 / uint8 as
    powers of two)."""
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return ue8m0_to_float(scale)
    return scale.to(torch.float32)


def dequantize_blocks(
    values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``values[..., i, j] * scale[..., i // bi, j // bj]`` in fp32 (``values`` already
    decoded; the last blocks may be partial)."""
    rows, cols = values.shape[-2:]
    expanded = scale_values(scale).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(block[1], dim=-1)[..., :cols]
    return values.to(torch.float32) * expanded


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """A block-scaled FP8 tensor -> fp32."""
    return dequantize_blocks(weight.to(torch.float32), scale, block)


def unpack_fp4_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values per byte -> fp32, last dim doubled: byte k holds element ``2k`` in its
    low nibble and ``2k + 1`` in its high nibble."""
    raw = packed.contiguous().view(torch.uint8)
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    low, high = table[(raw & 0xF).long()], table[(raw >> 4).long()]
    return torch.stack([low, high], dim=-1).reshape(*raw.shape[:-1], 2 * raw.shape[-1])


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A packed FP4 tensor with one scale per 1 x 32 block -> fp32."""
    return dequantize_blocks(unpack_fp4_e2m1(packed), scale, FP4_BLOCK)


def dequantize(spec: QuantizedTensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One planned tensor, read from the checkpoint with its scale, as fp32 on CPU."""
    weight, scale = weight.cpu(), scale.cpu()
    if spec.kind == "fp4":
        return dequantize_fp4(weight, scale)
    return dequantize_fp8_blocks(weight, scale, spec.block)


def checkpoint_plan(
    directory: Path, file_of_tensor: Mapping[str, Path], is_known: Callable[[str], bool]
) -> DequantPlan | None:
    """The dequantisation plan of a checkpoint the built-in loaders read (every tensor's
    header, paired with its scale), or None without a ``quantization_config``."""
    from resin.loading.weights import open_safetensors

    scheme = read_quant_scheme(directory)
    if scheme is None:
        return None
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in file_of_tensor.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with open_safetensors(path, "cpu") as handle:
            for name in names:
                view = handle.get_slice(name)
                headers[name] = (view.get_dtype(), tuple(view.get_shape()))
    plan = plan_dequantisation(headers, scheme, is_known=is_known)
    if not plan.tensors:
        raise WeightsError(
            f"{directory}/config.json has a quantization_config ({scheme.method}), but no "
            "tensor of the checkpoint is quantised (none is FP8 with a scale): the config and "
            "the weights do not match"
        )
    return plan


def read_dequantized(spec: QuantizedTensor, file_of_tensor: Mapping[str, Path]) -> torch.Tensor:
    """One planned tensor read with its scale (either may sit in any shard), dequantised to
    fp32 on CPU."""
    from resin.loading.weights import open_safetensors, read_tensor

    parts = []
    for name in (spec.name, spec.scale):
        path = file_of_tensor[name]
        with open_safetensors(path, "cpu") as handle:
            parts.append(read_tensor(handle, name, path))
    return dequantize(spec, parts[0], parts[1])
