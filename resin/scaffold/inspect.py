"""Walk an HF model built on the ``meta`` device: the facts the scaffold is generated from.

Owns :func:`inspect_architecture`: read a config (checkpoint directory, ``config.json`` path, or
a ``transformers.PretrainedConfig``), build its language model under ``torch.device("meta")``
(no weights, no memory; the class :mod:`resin.scaffold.hf_model` picks:
``AutoModelForCausalLM``, else ``AutoModelForImageTextToText`` for a multimodal wrapper) and
record, as an :class:`Architecture`:

- for a multimodal wrapper (GLM-5.3-Flash's ``Glm5NextForConditionalGeneration``, Mistral-3,
  Gemma-3, Qwen-VL, ...): the text model only, found at its decoder stack
  (:func:`resin.scaffold.hf_model.decoder_stack`, e.g. ``model.language_model``) and named
  below as a causal LM's (``model.layers.0...``: the runner's view, ``Architecture.config`` the
  text config), while the checkpoint names are the wrapper's own (``model.language_model.*``,
  ``language_model.model.*``, ... as its ``save_pretrained`` writes them); every other child
  on the way to the stack (a vision / audio tower, a projector) is a part the text runner does
  not run: ``Architecture.ignored_prefixes`` holds their checkpoint-name prefixes
  (``model.visual.``), which the generated ``weights.py`` lists as ``IGNORED_PREFIXES``;

- every parameter's in-memory name and shape, and the checkpoint (on-disk) names each one is
  saved as (transformers' own ``revert_weight_conversion``: fused MoE experts are saved per
  expert, Mixtral's ``mlp`` is saved as ``block_sparse_moe``);
- per decoder layer: its class and the class of each direct child (``input_layernorm``,
  ``self_attn``, ...), each with source file and line (``inspect.getsourcefile`` /
  ``getsourcelines``), the layer's type (``full_attention``, ``sliding_attention``, ...) and
  window (``layer_map`` rules; a type ``layer_map`` does not know gets ``config.sliding_window``
  when its built attention module holds exactly that in ``.sliding_window``), and its MLP type
  (:func:`resin.scaffold.layer_map.mlp_types_from_config`: ``dense`` / ``moe`` / the config's
  own ``mlp_layer_types`` value);
- the embedding, final norm and rotary classes; MoE, MTP and rope settings;
- every other module of the tree the scaffold does not place (``Architecture.extra_modules``:
  direct children of the HF model and of its ``model`` besides ``embed_tokens`` / ``layers`` /
  ``norm`` / ``rotary_emb`` / ``lm_head``, decoder layers past ``num_hidden_layers``, and
  parameters held directly by those two modules, e.g. DeepSeek-V4's ``model.hc_head``);
  :func:`unplaced_warnings` words one warning per entry;
- best-effort input/output shapes of every module from one meta forward of a 5-token probe:
  ``BlockInfo.inputs`` / ``output`` (the first output tensor's shape) and the readable full
  structures ``input_text`` / ``output_text`` (``(Tensor[1,5,64], None)``). transformers'
  data-dependent mask shortcuts (``.item()`` on a mask) cannot run on meta tensors, so a failed
  first attempt is retried with transformers' ``is_tracing`` answering True for meta tensors
  (the branch HF itself takes under torch.compile: same shapes, no ``.item()``); shapes stay
  empty when that fails too (``meta_forward_error``).

Generated runners call this at load time too (on their own checkpoint's config), so shape
checks and per-layer block choice always follow the checkpoint actually loaded.
Imports torch and transformers.
"""

from __future__ import annotations

import ast
import functools
import inspect as pyinspect
import json
import linecache
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from resin.scaffold import hf_model
from resin.scaffold.layer_map import (
    FULL,
    RECURRENT_TYPES,
    WINDOWED_LAYER_TYPES,
    layer_types_from_config,
    mlp_types_from_config,
)

PROBE_TOKENS = 5
# Children of the HF model / its ``model`` that the scaffold places (everything else is extra).
PLACED_TOP = ("model", "lm_head")
PLACED_INNER = ("embed_tokens", "layers", "norm", "rotary_emb")
HOOKS = "pre_layers / post_layers / embed / logits"
MTP_FIELDS = (
    "num_nextn_predict_layers",
    "mtp_num_hidden_layers",
    "num_mtp_modules",
    "mtp_num_layers",
)
MOE_FIELDS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "n_shared_experts",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
)


@dataclass
class BlockInfo:
    """One HF module class as found in the tree: where its code lives and what it holds."""

    path: str  # module path in the HF model, e.g. "model.layers.0.self_attn"
    cls_name: str
    module: str  # python module of the class
    source_file: str  # absolute path, or "?" when unknown
    source_line: int
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # relative name -> shape
    inputs: list[tuple[int, ...]] = field(default_factory=list)  # meta-forward shapes
    output: tuple[int, ...] | None = None  # shape of the first output tensor only
    submodules: list[tuple[str, str, str]] = field(default_factory=list)  # (name, class, where)
    # The whole meta-forward call, readable: "hidden_states=Tensor[1,5,64], attention_mask=None"
    # and "(Tensor[1,5,64], None)"; "" when the meta forward did not reach this module.
    input_text: str = ""
    output_text: str = ""
    # True: the meta forward called it; False: the forward ran to the end without calling it
    # (dead weight in HF's forward, e.g. MTP heads); None: unknown (no probe, or it failed).
    called: bool | None = None
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # persistent buffers

    @property
    def where(self) -> str:
        return f"{self.source_file}:{self.source_line}"

    @property
    def short_where(self) -> str:
        return f"{_short(self.source_file)}:{self.source_line}"


@dataclass
class LayerInfo:
    index: int
    layer_type: str  # config.layer_types entry, or derived (see layer_map)
    window: int | None  # sliding window in tokens for layer types that have one
    decoder: BlockInfo
    children: dict[str, BlockInfo]
    # config.mlp_layer_types entry (e.g. "hash_moe"), or derived "dense" / "moe" (layer_map)
    mlp_type: str = "dense"


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
    param_shapes: dict[str, tuple[int, ...]]  # in-memory name -> shape
    checkpoint_names: dict[str, list[str]]  # in-memory name -> on-disk names
    checkpoint_shapes: dict[str, tuple[int, ...]]  # on-disk name -> shape
    moe: dict[str, Any]
    mtp: dict[str, Any]
    rope: dict[str, Any]
    meta_forward_error: str | None = None
    # Modules of the HF tree the scaffold does not place (see the module doc), in tree order.
    extra_modules: list[BlockInfo] = field(default_factory=list)
    # A multimodal wrapper's outer config (None for a causal LM; ``config`` is its text config).
    wrapper_config: Any = None
    # In-memory path of the decoder stack: "model", or "model.language_model" in a wrapper.
    stack_path: str = "model"
    # Checkpoint-name prefix of the stack's tensors ("model.", "model.language_model.", ...).
    checkpoint_prefix: str = "model."
    # Checkpoint-name prefixes of the parts the text runner does not run (a wrapper's vision /
    # audio towers and projectors), with the module each one is: [(prefix, "path (Class)")].
    ignored_parts: list[tuple[str, str]] = field(default_factory=list)
    # Whether lm_head shares the embedding's weight in the built model (HF decides this from
    # the outer config's tie_word_embeddings for a wrapper, not the text config's).
    tied: bool = False
    # Layer tensors (relative to the layer, e.g. "self_attn.q_proj.bias") a True boolean of
    # the source config creates -> that flag: a checkpoint with the flag false has none
    # (weights.CONFIG_SUBMODULES, written by the scaffold).
    config_submodules: dict[str, str] = field(default_factory=dict)

    @property
    def ignored_prefixes(self) -> tuple[str, ...]:
        return tuple(prefix for prefix, _ in self.ignored_parts)

    def runner_view(self, checkpoint_name: str) -> str:
        """A checkpoint name with the stack's prefix written as a causal LM's (``model.``)."""
        if self.checkpoint_prefix != "model." and checkpoint_name.startswith(
            self.checkpoint_prefix
        ):
            rest = checkpoint_name[len(self.checkpoint_prefix) :]
            head, dot, tail = rest.partition(".")
            return "model." + hf_model.STACK_ALIASES.get(head, head) + dot + tail
        return checkpoint_name

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
    """An HF config from a checkpoint dir, a ``config.json`` path, or a config object.

    A heterogeneous config (transformers' ``per_layer_config``: Gemma 4's full-attention layers
    have their own ``head_dim``) raises on a read of a per-layer field at the top level; the
    scaffold reads the global value there (the built modules' shapes are per layer anyway), so
    such reads are allowed on it and on its sub-configs."""
    if isinstance(source, transformers.PretrainedConfig):
        return _allow_global_reads(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    raw = json.loads(path.read_text(encoding="utf-8"))
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path}: no 'model_type'; transformers cannot pick a config class")
    return _allow_global_reads(transformers.AutoConfig.for_model(model_type, **raw))


def _allow_global_reads(config: Any) -> Any:
    subs = [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}]
    for part in (config, *subs):
        if getattr(part, "is_heterogeneous", False):
            part.allow_global_per_layer_attribute_access = True
    return config


def build_meta_model(config: Any) -> Any:
    """The config's language model (:func:`resin.scaffold.hf_model.from_config`:
    ``AutoModelForCausalLM``, else the image-text-to-text wrapper) on the meta device, eager
    attention, eval mode."""
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = hf_model.from_config(config)
    return model.eval()


def inspect_architecture(source: str | Path | Any, probe_shapes: bool = True) -> Architecture:
    """Build the meta model for ``source``'s config and record its tree (see module doc)."""
    outer = load_config(source)
    model = build_meta_model(outer)
    try:
        inner, stack_path = hf_model.decoder_stack(model)
    except ValueError as exc:
        raise ValueError(
            f"{type(model).__name__}: expected the Llama-style layout "
            "model.model.embed_tokens / model.model.layers, or a multimodal wrapper's "
            "model.model.language_model (the scaffold and the parity harness hook those): "
            f"{exc}"
        ) from exc
    wrapper = stack_path not in hf_model.CAUSAL_STACKS
    config = hf_model.text_config(outer) if wrapper else outer
    towers = _towers(model, stack_path)
    view = _RunnerView(stack_path, [path for path, _ in towers])
    io_shapes: dict[str, Any] = {}
    forward_error = None
    if probe_shapes:
        raw_shapes, forward_error = _probe_shapes(model)
        io_shapes = {view.name(k): v for k, v in raw_shapes.items() if view.is_text(k)}
        io_shapes["__complete__"] = forward_error is None
    layers = []
    layer_types = layer_types_from_config(config)
    mlp_types = mlp_types_from_config(config)
    extra: list[BlockInfo] = []
    for index, layer in enumerate(inner.layers):
        path = f"model.layers.{index}"
        if index >= len(layer_types):  # built past num_hidden_layers (MTP layers, usually)
            extra.append(_block(path, layer, io_shapes))
            continue
        children = {
            name: _block(f"{path}.{name}", child, io_shapes)
            for name, child in layer.named_children()
        }
        layer_type, window = layer_types[index]
        if window is None:
            window = _module_window(config, layer_type, layer)
        layers.append(
            LayerInfo(
                index,
                layer_type,
                window,
                _block(path, layer, io_shapes),
                children,
                mlp_types[index],
            )
        )
    extra = _extra_modules(model, inner, io_shapes, [p for p, _ in towers], stack_path) + extra
    state = {k: v for k, v in model.state_dict().items() if view.is_text(k)}
    param_shapes = {view.name(name): tuple(p.shape) for name, p in state.items()}
    checkpoint_names = {view.name(k): v for k, v in _checkpoint_names(model, state).items()}
    tied = _is_tied(model, inner)
    checkpoint_shapes = _checkpoint_shapes(model, state, checkpoint_names if tied else None)
    architectures = getattr(outer, "architectures", None) or [type(model).__name__]
    embed_names = checkpoint_names.get("model.embed_tokens.weight", [])
    return Architecture(
        architecture=architectures[0],
        model_type=outer.model_type,
        config=config,
        layers=layers,
        embed=_block("model.embed_tokens", hf_model.stack_part(inner, "embed_tokens"), io_shapes),
        norm=_optional_block("model.norm", hf_model.stack_part(inner, "norm"), io_shapes),
        rotary=_optional_block("model.rotary_emb", getattr(inner, "rotary_emb", None), io_shapes),
        lm_head=_optional_block("lm_head", getattr(model, "lm_head", None), io_shapes),
        param_shapes=param_shapes,
        checkpoint_names=checkpoint_names,
        checkpoint_shapes=checkpoint_shapes,
        moe={k: getattr(config, k) for k in MOE_FIELDS if getattr(config, k, None) is not None},
        mtp={k: getattr(config, k) for k in MTP_FIELDS if getattr(config, k, None)},
        rope=dict(getattr(config, "rope_parameters", None) or {}),
        meta_forward_error=forward_error,
        extra_modules=extra,
        wrapper_config=outer if wrapper else None,
        stack_path=stack_path,
        checkpoint_prefix=(
            embed_names[0][: -len("embed_tokens.weight")]
            if len(embed_names) == 1 and embed_names[0].endswith("embed_tokens.weight")
            else _layer_prefix(checkpoint_names)
        ),
        ignored_parts=_ignored_parts(model, towers),
        tied=tied,
        config_submodules=_config_submodules(outer, inner),
    )


def _layer_tensor_names(inner: Any) -> set[str]:
    """Every layer's parameter names relative to its layer (``self_attn.q_proj.bias``)."""
    return {name for layer in inner.layers for name, _ in layer.named_parameters()}


def _config_submodules(outer: Any, inner: Any) -> dict[str, str]:
    """For each boolean of the decoder's config that is true, the layer tensors the model
    loses when it is false (one meta build per flag): ``attention_bias`` -> the q/k/v/o
    biases, ``qk_layernorm`` -> the q/k norms, ``use_parallel_residual`` -> a norm. A flag
    whose flipped config does not build is skipped."""
    import copy

    present = _layer_tensor_names(inner)
    text = hf_model.text_config(outer)
    out: dict[str, str] = {}
    for flag, value in sorted(text.to_dict().items()):
        if value is not True or flag.startswith(("use_return", "return_", "output_")):
            continue
        flipped = copy.deepcopy(outer)
        setattr(hf_model.text_config(flipped), flag, False)
        try:
            lost = present - _layer_tensor_names(
                hf_model.decoder_stack(build_meta_model(flipped))[0]
            )
        except Exception:  # noqa: BLE001 - a config the class refuses: nothing to learn
            continue
        for name in sorted(_widest_prefixes(lost, present)):
            out.setdefault(name, flag)
    return out


def _widest_prefixes(lost: set[str], present: set[str]) -> set[str]:
    """``lost`` tensor names folded into the widest module prefixes (``a.b.``) whose every
    tensor is lost: StableLM's per-head ``q_layernorm.norms.{h}.weight`` become one
    ``self_attn.q_layernorm.``, whatever a checkpoint's head count."""
    out = set()
    for name in lost:
        parts = name.split(".")
        best = name
        for depth in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:depth]) + "."
            if all(t in lost for t in present if t.startswith(prefix)):
                best = prefix
        out.add(best)
    return out


def _layer_prefix(checkpoint_names: dict[str, list[str]]) -> str:
    """The checkpoint prefix of the stack's layers (``gpt_neox.`` for ``gpt_neox.layers.0.*``);
    ``model.`` when no layer tensor says otherwise."""
    for in_memory, names in checkpoint_names.items():
        if in_memory.startswith("model.layers.0.") and len(names) == 1 and "layers.0." in names[0]:
            return names[0][: names[0].index("layers.0.")]
    return "model."


class _RunnerView:
    """In-memory names of a wrapper's text model written as a causal LM's: the stack path
    (``model.language_model``) becomes ``model``; ``lm_head`` stays. Names inside a tower
    (:func:`_towers`) or naming a module on the way to the stack are not text
    (:meth:`is_text`)."""

    def __init__(self, stack_path: str, towers: list[str]) -> None:
        self.stack = stack_path
        parts = stack_path.split(".")
        self.ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
        self.towers = towers

    def is_text(self, name: str) -> bool:
        if self.stack == "model" or name == "":
            return True
        if name == self.stack or name.startswith(self.stack + "."):
            return True
        if name in self.ancestors:
            return False
        return not any(name == t or name.startswith(t + ".") for t in self.towers)

    def name(self, name: str) -> str:
        if name == self.stack:
            return "model"
        if name.startswith(self.stack + "."):
            rest = name[len(self.stack) + 1 :]
            head, dot, tail = rest.partition(".")
            return "model." + hf_model.STACK_ALIASES.get(head, head) + dot + tail
        return name


def _towers(model: Any, stack_path: str) -> list[tuple[str, Any]]:
    """``(path, module)`` of each child of the modules on the way to a wrapper's decoder stack
    that is neither on that way nor ``lm_head``: the parts a text runner does not run (vision /
    audio towers, projectors). [] for a causal LM."""
    if stack_path == "model":
        return []
    out = []
    parts = stack_path.split(".")
    owner = model
    for depth, step in enumerate(parts):
        here = ".".join(parts[:depth])
        for name, child in owner.named_children():
            if name != step and not (depth == 0 and name == "lm_head"):
                out.append((f"{here}.{name}" if here else name, child))
        owner = getattr(owner, step)
    return out


def _ignored_parts(model: Any, towers: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """``(checkpoint prefix, "path (Class)")`` per tower holding tensors. The prefix is where
    ``save_pretrained`` puts them (transformers' own reverse conversion: in-memory
    ``model.vision_tower.*`` is saved as ``vision_tower.*`` by Mistral-3 and Gemma-3,
    ``model.visual.*`` as itself by GLM-5.3-Flash)."""
    out: list[tuple[str, str]] = []
    for path, child in towers:
        state = {f"{path}.{k}": v for k, v in child.state_dict().items()}
        prefixes = set()
        for in_memory, names in _checkpoint_names(model, state).items():
            rest = in_memory[len(path) :]  # ".blocks.0.attn.qkv.weight"
            for saved in names:
                prefixes.add(saved[: saved.index(rest) + 1] if rest in saved else path + ".")
        out += [(prefix, f"{path} ({type(child).__name__})") for prefix in sorted(prefixes)]
    return out


def _is_tied(model: Any, inner: Any) -> bool:
    head = getattr(model, "lm_head", None)
    embed = hf_model.stack_part(inner, "embed_tokens")
    return head is not None and embed is not None and head.weight is embed.weight


PLAIN_EMBEDDINGS = ("Embedding",)
# Config keys that say logits are transformed somewhere outside the blocks the scaffold knows.
LOGIT_HOOK_KEYS = re.compile(r"softcap|logit_scale|logits_scaling|output_multiplier")
# Config scalars that scale activations where no module of their own does (muP-style: Granite's
# embedding / residual / attention multipliers, MiniCPM's scale_emb / scale_depth): the HF
# forward multiplies by them inline, so no unplaced module or block class shows them.
SCALAR_HOOK_KEYS = re.compile(r"multiplier|^scale_emb$|^scale_depth$")


# torch modules that compute nothing in eval mode: never worth a hook.
INFERENCE_NO_OPS = ("Dropout", "Identity")


def unplaced_warnings(arch: Architecture) -> list[str]:
    """One loud line per module in ``arch.extra_modules`` (the scaffold does not run it), per
    non-plain embedding (a scale or extra inputs live in it), and per config key that
    transforms logits (soft-capping, scaling)."""
    out = []
    for info in arch.extra_modules:
        if info.cls_name in INFERENCE_NO_OPS:
            continue  # dropout: nothing to place at inference
        what = f"module {info.path or '<root>'} ({info.cls_name}, {info.short_where})"
        if info.path in ("model", ""):
            names = ", ".join(sorted({**info.params, **info.buffers})) or "none"
            out.append(
                f"{what} holds tensors directly ({names}) that the scaffold does not "
                f"place: load and use them in a hook in blocks.py ({HOOKS})"
            )
            continue
        line = f"{what} is not placed by the scaffold: write it as a hook in blocks.py ({HOOKS})"
        if info.called is False:
            line += (
                "; HF's forward never calls it (its weights load but nothing runs them, "
                "e.g. MTP): say so in NOTES.md if the runner skips it too"
            )
        elif info.output_text:
            line += f"; HF meta forward: in {info.input_text or 'none'} -> out {info.output_text}"
        out.append(line)
    embed_cls = arch.embed.cls_name
    if embed_cls not in PLAIN_EMBEDDINGS:
        out.append(
            f"model.embed_tokens is {embed_cls} ({arch.embed.short_where}), not a plain "
            "nn.Embedding: it computes something (a scale, extra inputs) — write the "
            "embed hook in blocks.py"
        )
    raw = arch.config.to_dict()
    for key in sorted(
        k for k, v in raw.items() if v not in (None, False, 0) and LOGIT_HOOK_KEYS.search(k)
    ):
        out.append(
            f"config.{key} = {getattr(arch.config, key)!r}: the CausalLM head or the "
            "attention may transform logits (soft-capping, scaling) — check the HF "
            "forward and write the logits hook / pass it to ctx.attention"
        )
    for key in sorted(
        k
        for k, v in raw.items()
        if isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v != 1
        and SCALAR_HOOK_KEYS.search(k)
        and not LOGIT_HOOK_KEYS.search(k)
    ):
        out.append(
            f"config.{key} = {raw[key]!r}: a scalar the HF forward multiplies activations by "
            "inline (an embedding, a residual branch, the attention scale) — no module shows "
            "it, and a block the scaffold delegates to a shared one leaves it out: find where "
            "the HF forward reads it and write it into that block or a hook (pre_layers for "
            "a scale after the embedding)"
        )
    return out


def describe(value: Any, limit: int = 240) -> str:
    """A readable one-line structure of a forward's value: ``(Tensor[1,5,64], None)``."""
    return _truncate(_describe(value, 0), limit)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(value: Any, depth: int) -> str:
    if isinstance(value, torch.Tensor):
        shape = ",".join(str(int(d)) for d in value.shape)
        kind = str(value.dtype).replace("torch.", "")
        dtype = "" if value.dtype.is_floating_point else f":{kind}"
        return f"Tensor[{shape}]{dtype}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value) if not isinstance(value, str) or len(value) < 24 else "str"
    if depth >= 3:
        return type(value).__name__
    if isinstance(value, dict):  # ModelOutput included (an OrderedDict of the set fields)
        fields = ", ".join(f"{k}={_describe(v, depth + 1)}" for k, v in value.items())
        name = "" if type(value) is dict else type(value).__name__
        return f"{name}({fields})" if name else f"{{{fields}}}"
    if isinstance(value, (tuple, list)):
        items = [_describe(v, depth + 1) for v in value[:8]]
        if len(value) > 8:
            items.append(f"... {len(value)} items")
        inner = ", ".join(items) + ("," if isinstance(value, tuple) and len(value) == 1 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return type(value).__name__


def _module_window(config: Any, layer_type: str, layer: Any) -> int | None:
    """``config.sliding_window`` for a layer type ``layer_map`` does not list, when the built
    attention module keeps exactly that window (see the module doc); else None."""
    window = getattr(config, "sliding_window", None)
    if (
        not isinstance(window, int)
        or isinstance(window, bool)
        or window <= 0
        or getattr(config, "use_sliding_window", True) is False
        or layer_type == FULL
        or layer_type in WINDOWED_LAYER_TYPES
        or layer_type in RECURRENT_TYPES
    ):
        return None
    for _name, child in layer.named_children():
        held = getattr(child, "sliding_window", None)
        if isinstance(held, int) and not isinstance(held, bool) and held == window:
            return window
    return None


def _extra_modules(
    model: Any,
    inner: Any,
    io_shapes: dict[str, Any],
    towers: list[str] | None = None,
    stack_path: str = "model",
) -> list[BlockInfo]:
    """Children of the HF model and of its decoder stack (``inner``, at ``stack_path``) that
    the scaffold does not place, and a pseudo-entry per module holding unplaced tensors of
    its own. A wrapper's towers beside the stack are not listed: they are ignored parts
    (:func:`_ignored_parts`). Paths are the runner's view (``model.`` for the stack)."""
    out = []
    placed_top: tuple[str, ...] = PLACED_TOP
    if stack_path != "model":
        placed_top = ("lm_head", stack_path.split(".")[0], *(towers or []))
    owners = ((model, "", placed_top), (inner, "model.", PLACED_INNER))
    for owner, prefix, placed in owners:
        own = {n: tuple(p.shape) for n, p in owner.named_parameters(recurse=False)}
        own_buffers = {
            n: tuple(b.shape)
            for n, b in owner.named_buffers(recurse=False)
            if n not in owner._non_persistent_buffers_set
        }
        if own or own_buffers:
            info = _block(prefix.rstrip(".") or "", owner, io_shapes)
            info.params, info.buffers, info.submodules = own, own_buffers, []
            out.append(info)
        for name, child in owner.named_children():
            if name not in placed and not (
                owner is inner and hf_model.STACK_ALIASES.get(name) in PLACED_INNER
            ):
                out.append(_block(prefix + name, child, io_shapes))
    return out


@functools.cache
def source_location(cls: type) -> tuple[str, int]:
    """(absolute source file, first line) of a class; ("?", 0) when Python cannot tell.

    The line ``inspect.getsourcelines`` gives (the first decorator's, else the ``class``
    statement's), from one parse per file instead of one per class."""
    try:
        source_file = pyinspect.getsourcefile(cls)
    except TypeError:
        return "?", 0
    if not source_file:
        return "?", 0
    line = _class_lines(source_file).get(cls.__qualname__)
    if line is not None:
        return source_file, line
    try:
        return source_file, pyinspect.getsourcelines(cls)[1]
    except (TypeError, OSError):
        return source_file, 0


@functools.lru_cache(maxsize=64)
def _class_lines(source_file: str) -> dict[str, int]:
    """Qualified class name -> first line of its first definition in ``source_file``."""
    try:
        tree = ast.parse("".join(linecache.getlines(source_file)))
    except (SyntaxError, ValueError):
        return {}
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                line = child.decorator_list[0].lineno if child.decorator_list else child.lineno
                out.setdefault(name, line)
                visit(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, prefix + child.name + ".<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _block(path: str, module: Any, io_shapes: dict[str, Any]) -> BlockInfo:
    cls = type(module)
    source_file, line = source_location(cls)  # type: ignore[arg-type]
    inputs, output, input_text, output_text = io_shapes.get(path, ([], None, "", ""))
    params = {name: tuple(p.shape) for name, p in module.named_parameters()}
    buffers = {name: tuple(b.shape) for name, b in persistent_buffers(module)}
    submodules = []
    for name, sub in module.named_modules():
        if name and type(sub).__module__.startswith("transformers."):
            sub_file, sub_line = source_location(type(sub))  # type: ignore[arg-type]
            submodules.append((name, type(sub).__name__, f"{_short(sub_file)}:{sub_line}"))
    called = True if path in io_shapes else (False if io_shapes.get("__complete__") else None)
    return BlockInfo(
        path,
        cls.__name__,
        cls.__module__,
        source_file,
        line,
        params,
        inputs,
        output,
        submodules,
        input_text,
        output_text,
        called,
        buffers,
    )


def persistent_buffers(module: Any) -> list[tuple[str, Any]]:
    """``(name, buffer)`` for every buffer ``state_dict`` saves (non-persistent ones skipped)."""
    out = []
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def _short(source_file: str) -> str:
    marker = "site-packages/"
    return source_file.split(marker, 1)[1] if marker in source_file else source_file


def _optional_block(path: str, module: Any, io_shapes: dict[str, Any]) -> BlockInfo | None:
    return None if module is None else _block(path, module, io_shapes)


def _checkpoint_names(model: Any, state: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """In-memory name -> the checkpoint names ``save_pretrained`` writes it as, for every
    tensor of ``state`` (default: the model's whole ``state_dict``)."""
    state = dict(model.state_dict()) if state is None else state
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: names on disk are the in-memory names
        return {name: [name] for name in state}
    out: dict[str, list[str]] = {}
    for name, tensor in state.items():
        try:
            out[name] = list(revert_weight_conversion(model, {name: tensor}))
        except Exception:  # noqa: BLE001 - a converter that needs its siblings: keep the name
            out[name] = [name]
    return out


def _checkpoint_shapes(
    model: Any, state: dict[str, Any] | None = None, tied_names: dict[str, list[str]] | None = None
) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor of ``state`` (default: the whole model) as
    saved; with ``tied_names`` (in-memory -> checkpoint names, given when lm_head is tied),
    lm_head's names are left out (a tied checkpoint does not store it)."""
    state = dict(model.state_dict()) if state is None else dict(state)
    try:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except Exception:  # noqa: BLE001 - fall back to in-memory names (see _checkpoint_names)
        pass
    if tied_names is not None:
        for name in ("lm_head.weight", *tied_names.get("lm_head.weight", [])):
            state.pop(name, None)
    elif getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in state.items()}


def _probe_shapes(model: Any) -> tuple[dict[str, Any], str | None]:
    """Module path -> (input tensor shapes, first output shape, input text, output text) from
    one meta forward; a failed first attempt is retried with ``is_tracing`` patched (module
    doc). The shapes of the attempt that got furthest are kept when both fail."""
    shapes, error = _meta_forward(model)
    if error is None:
        return shapes, None
    with _meta_is_tracing():
        retry, retry_error = _meta_forward(model)
    if retry_error is None or len(retry) > len(shapes):
        return retry, retry_error
    return shapes, error


def _meta_forward(model: Any) -> tuple[dict[str, Any], str | None]:
    shapes: dict[str, Any] = {}
    handles = []

    def hook(name: str) -> Any:
        def fn(_module: Any, args: Any, kwargs: Any, out: Any) -> None:
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            args_text = [describe(a, 120) for a in args] + [
                f"{k}={describe(v, 120)}" for k, v in kwargs.items() if v is not None
            ]
            shapes[name] = (
                [tuple(t.shape) for t in tensors],
                tuple(first.shape) if isinstance(first, torch.Tensor) else None,
                _truncate(", ".join(args_text), 400),
                describe(out),
            )

        return fn

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    try:
        with torch.no_grad():
            # An explicit attention mask skips transformers' packed-sequence check, which
            # calls .item() (impossible on meta tensors).
            model(
                input_ids=torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device="meta"),
                attention_mask=torch.ones(1, PROBE_TOKENS, dtype=torch.long, device="meta"),
                use_cache=False,
            )
        error = None
    except Exception as exc:  # noqa: BLE001 - best effort; callers fall back to role shapes
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for h in handles:
            h.remove()
    return shapes, error


class _meta_is_tracing:
    """Context: every loaded ``transformers`` module's ``is_tracing`` answers True for meta
    tensors (restored on exit)."""

    def __enter__(self) -> None:
        import sys

        from transformers.utils import import_utils

        original = import_utils.is_tracing

        def is_tracing(tensor: Any = None) -> bool:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return True
            return original(tensor)

        self.patched = [
            (mod, original)
            for name, mod in list(sys.modules.items())
            if name.startswith("transformers") and getattr(mod, "is_tracing", None) is original
        ]
        for mod, _ in self.patched:
            setattr(mod, "is_tracing", is_tracing)  # noqa: B010 - a module attribute mypy cannot see

    def __exit__(self, *exc: Any) -> None:
        for mod, original in self.patched:
            setattr(mod, "is_tracing", original)  # noqa: B010
