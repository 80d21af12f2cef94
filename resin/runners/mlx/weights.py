"""Checkpoint weights as MLX arrays, read from the same safetensors the torch runners read.

Owns :func:`load_tensors`: the tensors a model needs, located with
:func:`resin.loading.weights.locate_tensors` (``model.safetensors`` or the shards of its index),
every name and shape checked before anything is converted (a :class:`WeightsError` naming the
file, the tensor and both shapes), read with ``mx.load`` (bf16 / fp16 / fp32 natively, no torch)
and cast to the runner's dtype — except tensors matching a keep-in-fp32 pattern (HF's
``_keep_in_fp32_modules``: substring match on the checkpoint name, as the torch loader) and
integer tensors, which are never cast. Quantised checkpoints (a ``quantization_config``) are
refused: the MLX runner reads unquantised weights only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import mlx.core as mx

from resin.loading.weights import WeightsError, locate_tensors


def load_tensors(
    model_dir: str | Path,
    expected: Mapping[str, tuple[int, ...]],
    dtype: mx.Dtype,
    *,
    optional: Iterable[str] = (),
    keep_in_fp32: Iterable[str] = (),
) -> dict[str, mx.array]:
    """Checkpoint name -> array for every name of ``expected`` (name -> shape); names in
    ``optional`` may be absent (tied ``lm_head.weight``). Raises :class:`WeightsError`."""
    directory = Path(model_dir)
    _refuse_quantized(directory)
    file_of_tensor = locate_tensors(directory)
    optional = set(optional)
    missing = [n for n in expected if n not in file_of_tensor and n not in optional]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise WeightsError(f"{directory}: missing tensor(s) {shown} (required by its config.json)")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name in file_of_tensor:
            by_file.setdefault(file_of_tensor[name], []).append(name)
    patterns = tuple(keep_in_fp32)
    out: dict[str, mx.array] = {}
    for path, names in by_file.items():
        try:
            arrays = mx.load(str(path))
        except Exception as exc:  # mlx raises its own error types
            raise WeightsError(f"cannot open {path}: {exc}") from exc
        assert isinstance(arrays, dict)
        for name in names:  # every shape first: nothing is converted from a bad file
            if tuple(arrays[name].shape) != tuple(expected[name]):
                raise WeightsError(
                    f"{path.name}: tensor {name} has shape {tuple(arrays[name].shape)}, but "
                    f"config.json implies {tuple(expected[name])}"
                )
        for name in names:
            array = arrays[name]
            if not mx.issubdtype(array.dtype, mx.floating):
                out[name] = array
            elif any(p in name for p in patterns):
                out[name] = array.astype(mx.float32)
            else:
                out[name] = array.astype(dtype)
        del arrays
    return out


def _refuse_quantized(directory: Path) -> None:
    config_path = directory / "config.json"
    if not config_path.is_file():
        return
    quantization = json.loads(config_path.read_text(encoding="utf-8")).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise WeightsError(
            f"{directory}: config.json has a quantization_config (quant_method {method!r}); the "
            "MLX runner loads unquantised (bf16 / fp16 / fp32) checkpoints only"
        )
