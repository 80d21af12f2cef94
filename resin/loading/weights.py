"""Load a Hugging Face checkpoint's safetensors weights, checked against its :class:`ModelConfig`.

This module owns three things: which tensors a supported architecture must have and with
which shapes (:func:`expected_tensor_shapes`, named as HF checkpoints name them), finding them
in ``model.safetensors`` or in the shards a ``model.safetensors.index.json`` lists, and
reading them memory-mapped (``safetensors.safe_open``) straight to the target device and
dtype (bf16, fp16 or fp32). Tensors the config does not imply (rotary ``inv_freq`` buffers,
MTP heads) are ignored. Tied embeddings: ``lm_head.weight`` may be absent, and is then
not returned (the runner uses ``model.embed_tokens.weight``).

Guarantees: every problem raises :class:`WeightsError` (a ``ValueError``) naming the file, the
tensor and, for a shape mismatch, both shapes and the config fields that imply the expected
one — before any tensor is copied.

Imports torch only to read tensors (:func:`load_weights`): the names, shapes and files
(:func:`expected_tensor_shapes`, :func:`locate_tensors`) are torch-free, so the MLX runner checks
a checkpoint with them without torch. ``import resin`` does not import this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from resin.loading.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# safetensors header dtypes of floating tensors, cast to the runner's dtype on load. Anything
# else (int8 / fp8 codes, bool) is a quantised or foreign tensor: refused, never cast, unless
# the quantization_config pairs it with a scale (resin.loading.quantized_weights).
CASTABLE_HEADER_DTYPES = ("F16", "BF16", "F32", "F64")
# Architectures resin.loading parses (for the engine and `resin bench`) whose weights the torch
# reference runner cannot use: their own runner lives under models/.
CONFIG_ONLY_ARCHITECTURES = {"GptOssForCausalLM": "models/gpt_oss (resin eval parity gpt_oss)"}


class WeightsError(ValueError):
    """A checkpoint's weights are missing, unreadable or do not match its config."""


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor the runner needs.

    ``lm_head.weight`` is listed even with tied embeddings; :func:`load_weights` then
    accepts its absence.
    """
    if config.architecture in CONFIG_ONLY_ARCHITECTURES:
        raise WeightsError(
            f"{config.architecture}: the torch reference runner does not run this "
            f"architecture; its runner is {CONFIG_ONLY_ARCHITECTURES[config.architecture]}"
        )
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        attn = f"{layer}.self_attn"
        for name, out_size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            shapes[f"{attn}.{name}.weight"] = (out_size, hidden)
            if config.qkv_bias:
                shapes[f"{attn}.{name}.bias"] = (out_size,)
        shapes[f"{attn}.o_proj.weight"] = (hidden, q_size)
        if config.o_proj_bias:
            shapes[f"{attn}.o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes[f"{attn}.q_norm.weight"] = (head_dim,)
            shapes[f"{attn}.k_norm.weight"] = (head_dim,)
        if config.is_moe_layer(i):
            shapes.update(_moe_shapes(config, i))
        else:
            shapes.update(
                _mlp_shapes(f"{layer}.mlp", hidden, config.intermediate_size, config.mlp_bias)
            )
    return shapes


def moe_expert_names(
    config: ModelConfig, layer_index: int, expert_index: int
) -> tuple[str, str, str]:
    """Checkpoint names of one expert's (gate, up, down) weights. Mixtral calls them w1, w3, w2."""
    if config.architecture == "MixtralForCausalLM":
        prefix = f"model.layers.{layer_index}.block_sparse_moe.experts.{expert_index}"
        return f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight"
    prefix = f"model.layers.{layer_index}.mlp.experts.{expert_index}"
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


def moe_router_name(config: ModelConfig, layer_index: int) -> str:
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer_index}.{block}.gate.weight"


def load_weights(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of :func:`expected_tensor_shapes`, on ``device`` in ``dtype``.

    Reads ``model.safetensors`` or the shards of ``model.safetensors.index.json`` in
    ``model_dir``, memory-mapped; each tensor is read once and converted on the way. A
    checkpoint with a ``quantization_config`` (block-scaled FP8, as Qwen3-*-FP8 and DeepSeek
    ship) has each quantised tensor dequantised with its scale
    (:mod:`resin.loading.quantized_weights`; an unsupported scheme is refused, naming it).
    """
    import torch

    from resin.loading.quantized_weights import checkpoint_plan, read_dequantized

    dtype = torch.float32 if dtype is None else dtype
    supported = tuple(getattr(torch, n) for n in SUPPORTED_DTYPE_NAMES)
    if dtype not in supported:
        raise WeightsError(
            f"unsupported dtype {dtype}; supported: {', '.join(str(d) for d in supported)}"
        )
    directory = Path(model_dir)
    file_of_tensor = locate_tensors(directory)
    expected = expected_tensor_shapes(config)
    if config.tie_word_embeddings and "lm_head.weight" not in file_of_tensor:
        del expected["lm_head.weight"]
    _check_present(expected, file_of_tensor, directory)
    plan = checkpoint_plan(directory, file_of_tensor, is_known=expected.__contains__)
    quantised = {} if plan is None else plan.tensors

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(file_of_tensor[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with open_safetensors(path, device) as handle:
            for name in names:  # check every tensor before copying anything from this file
                header = tensor_header(handle, name, path, directory)
                _check_shape(name, list(header.get_shape()), expected[name], path, config)
                if name not in quantised:
                    check_float_dtype(name, header.get_dtype(), path)
            for name in names:
                if name in quantised:
                    full = read_dequantized(quantised[name], file_of_tensor)
                    weights[name] = full.to(device=device, dtype=dtype)
                else:
                    weights[name] = read_tensor(handle, name, path).to(dtype=dtype)
    return weights


def check_float_dtype(
    name: str, header_dtype: str, path: Path, allowed: tuple[str, ...] = ()
) -> None:
    """WeightsError unless tensor ``name``'s safetensors dtype is a float the loader may cast
    (:data:`CASTABLE_HEADER_DTYPES`) or one of ``allowed``: an int8 / fp8 / bool tensor in an
    unquantised checkpoint would otherwise be cast to float as if it held real values."""
    if header_dtype in CASTABLE_HEADER_DTYPES or header_dtype in allowed:
        return
    kinds = f"a float tensor ({', '.join(CASTABLE_HEADER_DTYPES)})"
    if allowed:
        kinds += f" or an index table ({', '.join(allowed)})"
    raise WeightsError(
        f"{path.name}: tensor {name} has dtype {header_dtype}; expected {kinds}. A quantised "
        "checkpoint needs its quantization_config in config.json (block-scaled FP8 is "
        "dequantised on load, each tensor with its scale); otherwise dequantise it first"
    )


def read_tensor(handle: Any, name: str, path: Path) -> torch.Tensor:
    """``handle.get_tensor(name)``; WeightsError naming the file and the tensor when its bytes
    cannot be read (a truncated shard)."""
    try:
        return handle.get_tensor(name)
    except Exception as exc:  # safetensors raises its own error types
        raise WeightsError(f"{path}: cannot read tensor {name} ({exc})") from exc


def tensor_header(handle: Any, name: str, path: Path, directory: Path) -> Any:
    """The safetensors slice (dtype, shape) of ``name`` in ``path``; WeightsError naming the
    index, the shard and the tensor when the index points the tensor at a shard without it."""
    try:
        return handle.get_slice(name)
    except Exception as exc:  # safetensors raises its own error types
        if (directory / INDEX_FILE).is_file():
            raise WeightsError(
                f"{directory / INDEX_FILE}: its weight_map puts tensor {name} in shard "
                f"{path.name}, which does not hold it"
            ) from exc
        raise WeightsError(f"{path}: cannot read tensor {name} ({exc})") from exc


def locate_tensors(directory: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it: the file config.json's ``transformers_weights``
    names (a ``.safetensors`` file or a ``.safetensors.index.json``, as transformers loads it),
    else ``model.safetensors.index.json``'s shards, else ``model.safetensors``; WeightsError
    naming what is missing or unreadable."""
    if not directory.is_dir():
        raise WeightsError(f"checkpoint directory not found: {directory}")
    named = _named_weights_file(directory)
    if named is not None:
        if named.name.endswith(".safetensors.index.json"):
            return _shard_files(named, directory)
        return _tensors_in(named)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        return _shard_files(index_path, directory)
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise WeightsError(f"no weights in {directory}: expected {SINGLE_FILE} or {INDEX_FILE}")
    return _tensors_in(single)


def _named_weights_file(directory: Path) -> Path | None:
    """The weights file config.json names in ``transformers_weights`` (transformers 5 loads
    exactly that file, before any default name), or None; WeightsError when the name is not a
    safetensors file or index inside the directory, or the file is missing."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        return None
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the config reader reports a broken config.json, naming it
    name = raw.get("transformers_weights") if isinstance(raw, dict) else None
    if name is None:
        return None
    path = directory / name if isinstance(name, str) and name else None
    inside = path is not None and path.resolve().is_relative_to(directory.resolve())
    if path is None or not inside or not name.endswith((".safetensors", ".safetensors.index.json")):
        raise WeightsError(
            f"{config_path}: 'transformers_weights' must name a .safetensors file or a "
            f".safetensors.index.json inside the checkpoint directory, got {name!r}"
        )
    if not path.is_file():
        raise WeightsError(
            f"{config_path}: 'transformers_weights' names {name}, which is missing from {directory}"
        )
    return path


def _shard_files(index_path: Path, directory: Path) -> dict[str, Path]:
    """Tensor name -> shard, from an index's ``weight_map``; every shard must exist."""
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"{index_path}: cannot read its 'weight_map' ({exc})") from exc
    files = {name: directory / shard for name, shard in _checked_weight_map(weight_map, index_path)}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise WeightsError(
                f"{index_path} lists shard {shard.name}, which is missing from {directory}"
            )
    return files


def _tensors_in(path: Path) -> dict[str, Path]:
    """Tensor name -> ``path``, for every tensor of one safetensors file (names only: no
    torch needed)."""
    with open_safetensors(path, "cpu", framework="numpy") as handle:
        return {name: path for name in handle.keys()}


def _checked_weight_map(weight_map: Any, index_path: Path) -> list[tuple[str, str]]:
    """The index's ``weight_map`` as (tensor name, shard file name) pairs; WeightsError naming
    the index and the bad entry unless it maps names to plain file names in the directory."""
    if not isinstance(weight_map, dict):
        raise WeightsError(
            f"{index_path}: 'weight_map' must be an object mapping tensor names to shard "
            f"files, got {type(weight_map).__name__}"
        )
    pairs = []
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard == "..":
            raise WeightsError(
                f"{index_path}: weight_map entry {name!r} must name a shard file in the "
                f"checkpoint directory, got {shard!r}"
            )
        pairs.append((name, shard))
    return pairs


def __getattr__(name: str) -> Any:
    """``SUPPORTED_DTYPES`` (torch dtypes) is built on first use, so importing this module
    does not import torch."""
    if name == "SUPPORTED_DTYPES":
        import torch

        return tuple(getattr(torch, n) for n in SUPPORTED_DTYPE_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_safetensors(path: Path, device: str | torch.device = "cpu", framework: str = "pt"):  # type: ignore[no-untyped-def]
    """``safe_open`` with WeightsError naming the file when it is not a readable safetensors
    file (truncated header, not safetensors at all)."""
    try:
        return safe_open(str(path), framework=framework, device=str(device))
    except Exception as exc:  # safetensors raises its own error types
        raise WeightsError(
            f"cannot open {path}: {exc} (truncated, or not a safetensors file)"
        ) from exc


def _check_present(
    expected: dict[str, tuple[int, ...]], file_of_tensor: dict[str, Path], directory: Path
) -> None:
    missing = [name for name in expected if name not in file_of_tensor]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise WeightsError(f"{directory}: missing tensor(s) {shown} (required by its config.json)")


def _check_shape(
    name: str, actual: list[int], expected: tuple[int, ...], path: Path, config: ModelConfig
) -> None:
    if tuple(actual) != expected:
        raise WeightsError(
            f"{path.name}: tensor {name} has shape {tuple(actual)}, but config.json implies "
            f"{expected} (hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, "
            f"num_attention_heads={config.num_attention_heads}, "
            f"num_key_value_heads={config.num_key_value_heads}, head_dim={config.head_dim}, "
            f"intermediate_size={config.intermediate_size})"
        )


def _mlp_shapes(prefix: str, hidden: int, width: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }
    if bias:
        shapes.update(
            {
                f"{prefix}.gate_proj.bias": (width,),
                f"{prefix}.up_proj.bias": (width,),
                f"{prefix}.down_proj.bias": (hidden,),
            }
        )
    return shapes


def _moe_shapes(config: ModelConfig, layer_index: int) -> dict[str, tuple[int, ...]]:
    assert config.moe is not None
    hidden, width = config.hidden_size, config.moe.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        moe_router_name(config, layer_index): (config.moe.num_experts, hidden)
    }
    for expert in range(config.moe.num_experts):
        gate, up, down = moe_expert_names(config, layer_index, expert)
        shapes.update({gate: (width, hidden), up: (width, hidden), down: (hidden, width)})
    return shapes
