"""Walk an HF model built on the ``meta`` device: the facts the scaffold is generated from.

Owns :func:`inspect_architecture`: read a config (checkpoint directory, ``config.json`` path, or
a ``transformers.PretrainedConfig``), build ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")`` (no weights, no memory) and record, as an :class:`Architecture`:

- every parameter's in-memory name and shape, and the checkpoint (on-disk) names each one is
  saved as (transformers' own ``revert_weight_conversion``: fused MoE experts are saved per
  expert, Mixtral's ``mlp`` is saved as ``block_sparse_moe``);
- per decoder layer: its class and the class of each direct child (``input_layernorm``,
  ``self_attn``, ...), each with source file and line (``inspect.getsourcefile`` /
  ``getsourcelines``), and the layer's type (``full_attention``, ``sliding_attention``, ...)
  and window;
- the embedding, final norm and rotary classes; MoE, MTP and rope settings;
- best-effort input/output shapes of every module from one meta forward of a 5-token probe
  (empty when the HF code cannot run on meta tensors, e.g. masks built with ``.item()``).

Generated runners call this at load time too (on their own checkpoint's config), so shape
checks and per-layer block choice always follow the checkpoint actually loaded.
Imports torch and transformers.
"""

from __future__ import annotations

import inspect as pyinspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from resin.scaffold.layer_map import layer_types_from_config

PROBE_TOKENS = 5
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules",
              "mtp_num_layers")
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
              "moe_intermediate_size", "norm_topk_prob", "n_shared_experts",
              "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
              "first_k_dense_replace", "routed_scaling_factor", "scoring_func", "topk_method")


@dataclass
class BlockInfo:
    """One HF module class as found in the tree: where its code lives and what it holds."""

    path: str            # module path in the HF model, e.g. "model.layers.0.self_attn"
    cls_name: str
    module: str          # python module of the class
    source_file: str     # absolute path, or "?" when unknown
    source_line: int
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # relative name -> shape
    inputs: list[tuple[int, ...]] = field(default_factory=list)       # meta-forward shapes
    output: tuple[int, ...] | None = None
    submodules: list[tuple[str, str, str]] = field(default_factory=list)  # (name, class, where)

    @property
    def where(self) -> str:
        return f"{self.source_file}:{self.source_line}"

    @property
    def short_where(self) -> str:
        return f"{_short(self.source_file)}:{self.source_line}"


@dataclass
class LayerInfo:
    index: int
    layer_type: str            # config.layer_types entry, or derived (see layer_map)
    window: int | None         # sliding window in tokens for sliding layers
    decoder: BlockInfo
    children: dict[str, BlockInfo]


@dataclass
class Architecture:
    """Everything :func:`inspect_architecture` learned; ``config`` is the HF config object."""

    architecture: str
    model_type: str
    config: Any
    layers: list[LayerInfo]
    embed: BlockInfo
    norm: BlockInfo | None
    rotary: BlockInfo | None
    lm_head: BlockInfo | None
    param_shapes: dict[str, tuple[int, ...]]           # in-memory name -> shape
    checkpoint_names: dict[str, list[str]]             # in-memory name -> on-disk names
    checkpoint_shapes: dict[str, tuple[int, ...]]      # on-disk name -> shape
    moe: dict[str, Any]
    mtp: dict[str, Any]
    rope: dict[str, Any]
    meta_forward_error: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def dim(self, name: str, default: Any = None) -> Any:
        return getattr(self.config, name, default)

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.config, "head_dim", None)
        return int(head_dim or self.config.hidden_size // self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        kv = getattr(self.config, "num_key_value_heads", None)
        return int(kv or self.config.num_attention_heads)


def load_config(source: str | Path | Any) -> Any:
    """An HF config from a checkpoint dir, a ``config.json`` path, or a config object."""
    if isinstance(source, transformers.PretrainedConfig):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    raw = json.loads(path.read_text(encoding="utf-8"))
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path}: no 'model_type'; transformers cannot pick a config class")
    return transformers.AutoConfig.for_model(model_type, **raw)


def build_meta_model(config: Any) -> Any:
    """``AutoModelForCausalLM.from_config`` on the meta device, eager attention, eval mode."""
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()


def inspect_architecture(source: str | Path | Any, probe_shapes: bool = True) -> Architecture:
    """Build the meta model for ``source``'s config and record its tree (see module doc)."""
    config = load_config(source)
    model = build_meta_model(config)
    io_shapes, forward_error = _probe_shapes(model) if probe_shapes else ({}, None)
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise ValueError(f"{type(model).__name__}: expected the Llama-style layout "
                         "model.model.embed_tokens / model.model.layers (the scaffold and the "
                         "parity harness hook those); this model has top-level children "
                         f"{[n for n, _ in model.named_children()]}")
    layers = []
    layer_types = layer_types_from_config(config)
    for index, layer in enumerate(inner.layers):
        path = f"model.layers.{index}"
        children = {name: _block(f"{path}.{name}", child, io_shapes)
                    for name, child in layer.named_children()}
        layer_type, window = layer_types[index]
        layers.append(LayerInfo(index, layer_type, window, _block(path, layer, io_shapes),
                                children))
    param_shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    checkpoint_names = _checkpoint_names(model)
    checkpoint_shapes = _checkpoint_shapes(model)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    return Architecture(
        architecture=architectures[0], model_type=config.model_type, config=config,
        layers=layers, embed=_block("model.embed_tokens", inner.embed_tokens, io_shapes),
        norm=_optional_block("model.norm", getattr(inner, "norm", None), io_shapes),
        rotary=_optional_block("model.rotary_emb", getattr(inner, "rotary_emb", None), io_shapes),
        lm_head=_optional_block("lm_head", getattr(model, "lm_head", None), io_shapes),
        param_shapes=param_shapes, checkpoint_names=checkpoint_names,
        checkpoint_shapes=checkpoint_shapes,
        moe={k: getattr(config, k) for k in MOE_FIELDS if getattr(config, k, None) is not None},
        mtp={k: getattr(config, k) for k in MTP_FIELDS if getattr(config, k, None)},
        rope=dict(getattr(config, "rope_parameters", None) or {}),
        meta_forward_error=forward_error)


def source_location(cls: type) -> tuple[str, int]:
    """(absolute source file, first line) of a class; ("?", 0) when Python cannot tell."""
    try:
        return pyinspect.getsourcefile(cls) or "?", pyinspect.getsourcelines(cls)[1]
    except (TypeError, OSError):
        return "?", 0


def _block(path: str, module: Any, io_shapes: dict[str, Any]) -> BlockInfo:
    cls = type(module)
    source_file, line = source_location(cls)
    inputs, output = io_shapes.get(path, ([], None))
    params = {name: tuple(p.shape) for name, p in module.named_parameters()}
    submodules = []
    for name, sub in module.named_modules():
        if name and type(sub).__module__.startswith("transformers."):
            sub_file, sub_line = source_location(type(sub))
            submodules.append((name, type(sub).__name__, f"{_short(sub_file)}:{sub_line}"))
    return BlockInfo(path, cls.__name__, cls.__module__, source_file, line, params, inputs, output,
                     submodules)


def _short(source_file: str) -> str:
    marker = "site-packages/"
    return source_file.split(marker, 1)[1] if marker in source_file else source_file


def _optional_block(path: str, module: Any, io_shapes: dict[str, Any]) -> BlockInfo | None:
    return None if module is None else _block(path, module, io_shapes)


def _checkpoint_names(model: Any) -> dict[str, list[str]]:
    """In-memory parameter name -> the checkpoint names ``save_pretrained`` writes it as."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:   # older transformers: names on disk are the in-memory names
        return {name: [name] for name in model.state_dict()}
    out: dict[str, list[str]] = {}
    for name, tensor in model.state_dict().items():
        try:
            out[name] = list(revert_weight_conversion(model, {name: tensor}))
        except Exception:  # noqa: BLE001 - a converter that needs its siblings: keep the name
            out[name] = [name]
    return out


def _checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    state = dict(model.state_dict())
    try:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except Exception:  # noqa: BLE001 - fall back to in-memory names (see _checkpoint_names)
        pass
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in state.items()}


def _probe_shapes(model: Any) -> tuple[dict[str, Any], str | None]:
    """Module path -> (input tensor shapes, output shape) from one meta forward."""
    shapes: dict[str, Any] = {}
    handles = []

    def hook(name: str) -> Any:
        def fn(_module: Any, args: Any, kwargs: Any, out: Any) -> None:
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            first = out[0] if isinstance(out, tuple) else out
            shapes[name] = ([tuple(t.shape) for t in tensors],
                            tuple(first.shape) if isinstance(first, torch.Tensor) else None)
        return fn

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    try:
        with torch.no_grad():
            # An explicit attention mask skips transformers' packed-sequence check, which
            # calls .item() (impossible on meta tensors).
            model(input_ids=torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device="meta"),
                  attention_mask=torch.ones(1, PROBE_TOKENS, dtype=torch.long, device="meta"),
                  use_cache=False)
        error = None
    except Exception as exc:  # noqa: BLE001 - best effort; callers fall back to role shapes
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for h in handles:
            h.remove()
    return shapes, error
