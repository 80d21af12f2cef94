"""Render ``templates/model/*.j2`` for one :class:`~resin.scaffold.inspect.Architecture`.

Owns the step from "what the meta-model walk found" to files: which block functions
``blocks.py`` gets (one per distinct HF class: implemented when :mod:`.layer_map` knows the
class and its settings are ones Resin's layers reproduce, otherwise a stub whose
NotImplementedError names the class, its source file:line and its shapes), the weight map,
the NOTES.md tables, the parity / perf specs, and writing them into the output directory.
Rendering is deterministic: the same architecture gives byte-identical files.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from resin.scaffold.inspect import Architecture, BlockInfo, LayerInfo
from resin.scaffold.layer_map import (
    PRENORM_CHILDREN,
    block_kind,
    cache_kind,
    compressed_cache_text,
    function_name,
    has_cache_declaration,
    is_gated_delta_net,
    is_indexed_attention,
    is_kimi_delta_attention,
    moe_expert_names,
    moe_renormalises,
    name_pattern,
    pattern_shapes,
    runs_own_indexer,
    weight_map,
)

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates" / "model"
FILES = {
    "blocks.py": "blocks.py.j2",
    "weights.py": "weights.py.j2",
    "parity.toml": "parity.toml.j2",
    "perf.toml": "perf.toml.j2",
    "NOTES.md": "NOTES.md.j2",
    "test_parity.py": "test_parity.py.j2",
}
RECORD_FILE = "architecture.json"
# Files of the previous layout that a regeneration removes (the runner is shared now).
OBSOLETE_FILES = ("runner.py",)
BLOCK_FUNCTIONS = {
    "rms_norm": "rms_norm_block",
    "rotary": "rope_from_config",
    "gqa_attention": "gqa_attention_block",
    "swiglu_mlp": "swiglu_mlp_block",
    "topk_moe": "topk_moe_block",
    "prenorm_decoder_layer": "prenorm_decoder_layer",
}
CONTEXT_LENS = (128, 1024, 4096, 16384, 32768)
CHUNK_SIZES = (128, 512, 2048, 8192)
# A tiny checkpoint is a CPU smoke run of the harness: short contexts keep 256-row batches small.
TINY_CONTEXT_LENS = (128, 512)
TINY_CHUNK_SIZES = (128, 512)
MAX_LISTED = 12


@dataclass
class Block:
    """One function of the generated ``blocks.py``."""

    fn: str
    cls_name: str
    role: str  # "module" (norm / attention / mlp), "decoder" or "rotary"
    kind: str | None  # layer_map kind when implemented; None for a stub
    where: str
    short_where: str
    shapes: str
    weights: str
    message: str = ""
    message_lines: list[str] = field(default_factory=list)  # repr'd chunks of message
    kind_doc: str = ""
    assumed: bool = False
    rotary_key: str = ""
    partial_rotary: bool = False  # the rotary reads partial_rotary_factor (rope_from_config)
    expert_names: tuple[str, ...] = ()
    renormalise: str = "False"
    notes: list[str] = field(default_factory=list)

    @property
    def stub(self) -> bool:
        return self.kind is None


def blocks_of(arch: Architecture) -> list[Block]:
    """Every block function, in first-use order: rotary, decoder layers, their children, norm."""
    seen: dict[str, Block] = {}
    hidden = arch.config.hidden_size
    rotary = arch.rotary
    rotary_block = _rotary_block(arch, rotary)
    seen[rotary_block.cls_name or "<rotary>"] = rotary_block
    for layer in arch.layers:
        if layer.decoder.cls_name not in seen:
            seen[layer.decoder.cls_name] = _decoder_block(arch, layer)
        for info in layer.children.values():
            if info.cls_name not in seen:
                seen[info.cls_name] = _module_block(arch, info, f"x [T, {hidden}] -> [T, {hidden}]")
    if arch.norm is not None and arch.norm.cls_name not in seen:
        seen[arch.norm.cls_name] = _module_block(
            arch, arch.norm, f"x [T, {hidden}] -> [T, {hidden}]"
        )
    return list(seen.values())


def render_model(
    arch: Architecture,
    name: str,
    out_dir: Path,
    source: str,
    tiny: bool,
    reference_checkpoint: str,
    perf_checkpoint: str | None = None,
    probe: Architecture | None = None,
    **extra: Any,
) -> list[Path]:
    """Write every file of :data:`FILES` (``weights.py`` only when some checkpoint name needs
    renaming) and the model record into ``out_dir``; returns the paths written. ``probe``: the
    architecture at other widths, for the record's shape rules. ``extra`` joins the template
    context (e.g. ``tiny_changes``)."""
    from resin.scaffold.record import model_record

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    context = model_context(
        arch, name, source, tiny, reference_checkpoint, perf_checkpoint or reference_checkpoint
    )
    context.update(extra)
    context.setdefault("tiny_changes", [])
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, template in FILES.items():
        path = out_dir / filename
        if filename == "weights.py" and not (
            context["renamed_weights"] or context["ignored_parts"] or context["config_submodules"]
        ):
            path.unlink(missing_ok=True)
            continue
        path.write_text(env.get_template(template).render(**context), encoding="utf-8")
        written.append(path)
    record_path = out_dir / RECORD_FILE
    record_path.write_text(model_record(arch, name, source, probe).to_json(), encoding="utf-8")
    written.append(record_path)
    for obsolete in OBSOLETE_FILES:
        (out_dir / obsolete).unlink(missing_ok=True)
    return written


def model_context(
    arch: Architecture,
    name: str,
    source: str,
    tiny: bool,
    reference_checkpoint: str,
    perf_checkpoint: str,
) -> dict[str, Any]:
    import transformers

    config = arch.config
    blocks = blocks_of(arch)
    used = {b.kind for b in blocks if b.kind in BLOCK_FUNCTIONS}
    # With stubs left, every shared block is imported: the stubs' authors start from them.
    block_imports = sorted(
        BLOCK_FUNCTIONS.values()
        if any(b.stub for b in blocks)
        else (BLOCK_FUNCTIONS[k] for k in used)
    )
    max_positions = int(getattr(config, "max_position_embeddings", 0) or 0) or max(CONTEXT_LENS)
    return {
        "name": name,
        "architecture": arch.architecture,
        "model_type": arch.model_type,
        "source": source,
        "tiny": tiny,
        "transformers_version": transformers.__version__,
        "blocks": blocks,
        "stubs": [b for b in blocks if b.stub],
        "assumed": [b for b in blocks if b.assumed],
        "weight_map": weight_map(arch.checkpoint_names, arch.runner_view),
        "renamed_weights": renamed_weights(weight_map(arch.checkpoint_names, arch.runner_view)),
        "block_imports": block_imports,
        "default_theta": 10000.0,
        "extra_modules": extra_module_lines(arch),
        "uncached_types": sorted(
            {
                layer.layer_type
                for layer in arch.layers
                if not has_cache_declaration(layer.layer_type, layer.window, config)
            }
        ),
        "source_shapes": pattern_shapes(arch.checkpoint_shapes),
        "reference_checkpoint": reference_checkpoint,
        "perf_checkpoint": perf_checkpoint,
        "context_lens": _capped(
            TINY_CONTEXT_LENS if perf_checkpoint == "tiny" else CONTEXT_LENS, max_positions
        ),
        "chunk_sizes": _capped(
            TINY_CHUNK_SIZES if perf_checkpoint == "tiny" else CHUNK_SIZES, max_positions
        ),
        "num_layers": arch.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "vocab_size": config.vocab_size,
        "max_positions": max_positions,
        "tied": arch.tied or bool(getattr(config, "tie_word_embeddings", False)),
        "ignored_parts": arch.ignored_parts,
        "config_submodules": arch.config_submodules,
        "ignored_prefixes": _tuple_text(arch.ignored_prefixes),
        "wrapper": _wrapper_context(arch),
        "layer_type_summary": _type_summary(arch.layers),
        "layer_rows": _layer_rows(arch.layers, config),
        "rope_text": ", ".join(f"{k}={v}" for k, v in sorted(arch.rope.items())) or "none",
        "moe_text": ", ".join(f"{k}={v}" for k, v in arch.moe.items()) or "none",
        "mtp_text": (
            ", ".join(f"{k}={v}" for k, v in arch.mtp.items())
            + " (the HF class builds no MTP layers: their checkpoint tensors load as "
            "unused; speculative decoding is not wired)"
        )
        if arch.mtp
        else "none",
        "meta_forward_text": (
            "ran; stub messages carry its shapes"
            if arch.meta_forward_error is None
            else f"failed ({arch.meta_forward_error[:120]}); stub messages "
            "give the runner-side shapes only"
        ),
        "warnings": generator_warnings(arch),
    }


def _wrapper_context(arch: Architecture) -> dict[str, Any] | None:
    """What the generated ``normalise_config`` of a multimodal wrapper needs: the key of its
    text sub-config, every sub-config key, and the text config class's default depth."""
    outer = arch.wrapper_config
    if outer is None:
        return None
    keys = sorted(getattr(outer, "sub_configs", None) or {})
    text_key = next((k for k in keys if getattr(outer, k, None) is arch.config), "text_config")
    try:
        default_layers = type(arch.config)().num_hidden_layers
    except Exception:  # noqa: BLE001 - a config class that needs arguments
        default_layers = None
    return {
        "text_key": text_key,
        "sub_config_keys": _tuple_text(keys or [text_key]),
        "other_keys": [k for k in keys if k != text_key],
        "default_num_layers": default_layers,
    }


def _tuple_text(items: Any) -> str:
    """A tuple of strings as Python source: ``("a", "b")``, ``("a",)``."""
    quoted = [f'"{item}"' for item in items]
    return "(" + ", ".join(quoted) + ("," if len(quoted) == 1 else "") + ")"


def renamed_weights(mapping: dict[str, str]) -> dict[str, str]:
    """The weight-map entries whose runner name is not the checkpoint name minus ``model.``."""

    def default(pattern: str) -> str:
        return pattern[len("model.") :] if pattern.startswith("model.") else pattern

    return {k: v for k, v in mapping.items() if v != default(k)}


def extra_module_lines(arch: Architecture) -> list[str]:
    """One line per HF module the scaffold does not place (``Architecture.extra_modules``)."""
    extra = getattr(arch, "extra_modules", None) or []
    return [f"{m.path}: {m.cls_name} ({m.short_where})" for m in extra]


def generator_warnings(arch: Architecture) -> list[str]:
    from resin.scaffold import inspect as inspect_module

    unplaced = getattr(inspect_module, "unplaced_warnings", None)
    out = list(unplaced(arch)) if unplaced is not None else []
    for layer in arch.layers:
        kind = cache_kind(layer.layer_type, layer.window)
        if has_cache_declaration(layer.layer_type, layer.window, arch.config):
            continue
        if kind == "recurrent":
            out.append(
                f"layer {layer.index} is {layer.layer_type!r}: a recurrent state — declare it "
                "in blocks.layer_cache (LayerCache('recurrent', {buffer: shape})) and read / "
                "write it through ctx.state"
            )
            break
        if kind == "indexed":
            out.append(
                f"layer {layer.index} is {layer.layer_type!r} without "
                "kv_lora_rank / index_head_dim / index_kpool in its config: declare its "
                "caches in blocks.layer_cache"
            )
            break
        if kind == "unknown":
            out.append(
                f"layer {layer.index} has type {layer.layer_type!r}, which Resin has no "
                "cache spec for: cache_spec() will raise until blocks.py handles it"
            )
            break
    if arch.mtp:
        out.append(f"MTP settings {arch.mtp}: MTP heads are not loaded or run")
    return out


def _rotary_block(arch: Architecture, info: BlockInfo | None) -> Block:
    rotary_dim = int(arch.head_dim * float(arch.rope.get("partial_rotary_factor") or 1.0))
    shapes = f"positions int64[T] -> (cos, sin), each [T, {rotary_dim}]"
    if info is None:
        return _stub(
            "rotary_embedding",
            "(no model.rotary_emb)",
            "?",
            "?",
            "rotary",
            shapes,
            "",
            "the model has no top-level rotary_emb: positions are encoded elsewhere "
            "(per layer, or no RoPE); return an object whose cos_sin gives what the "
            "attention blocks need",
            rotary_key="",
        )
    block = _base(info, "rotary", shapes)
    block.rotary_key = info.cls_name
    if block_kind(info.cls_name) != "rotary":
        return _as_stub(block)
    problem = _rope_problem(arch)
    if problem:
        return _as_stub(block, f"rope parameters Resin does not implement: {problem}")
    block.kind = "rotary"
    block.kind_doc = f"RoPE {arch.rope.get('rope_type', 'default')} (resin RotaryEmbedding)"
    # HF's rotary reads partial_rotary_factor when its cos is narrower than the head (its
    # meta-forward output; the factor itself when the probe did not reach it).
    width = info.output[-1] if info.output else rotary_dim
    block.partial_rotary = rotary_dim < arch.head_dim and width < arch.head_dim
    return block


def _decoder_block(arch: Architecture, layer: LayerInfo) -> Block:
    hidden = arch.config.hidden_size
    block = _base(
        layer.decoder, "decoder", f"hidden [T, {hidden}] -> [T, {hidden}]", with_weights=False
    )
    known = block_kind(layer.decoder.cls_name) == "prenorm_decoder_layer"
    if set(layer.children) == set(PRENORM_CHILDREN):
        block.kind, block.assumed = "prenorm_decoder_layer", not known
        block.kind_doc = "pre-norm residual decoder layer"
        return block
    return _as_stub(
        block,
        f"children {list(layer.children)} are not Llama's pre-norm layout {list(PRENORM_CHILDREN)}",
    )


def _module_block(arch: Architecture, info: BlockInfo, shapes: str) -> Block:
    # as `w` holds them: the runner's names, whatever prefix a wrapper's checkpoint uses
    by_runner_name = {arch.runner_view(n): s for n, s in arch.checkpoint_shapes.items()}
    block = _base(info, "module", shapes, checkpoint_shapes=by_runner_name)
    kind = block_kind(info.cls_name)
    config = arch.config
    if kind == "rms_norm":
        block.kind, block.kind_doc = kind, "RMSNorm (resin rms_norm)"
    elif kind == "identity":
        block.kind, block.kind_doc = kind, f"{info.cls_name}: a no-op at inference"
    elif kind == "gqa_attention":
        traits = [
            t
            for t, on in (
                ("sliding window", any(layer.window for layer in arch.layers)),
                ("qkv bias", "q_proj.bias" in info.params),
                ("o bias", "o_proj.bias" in info.params),
                ("q/k RMSNorm", "q_norm.weight" in info.params),
            )
            if on
        ]
        block.kind = kind
        block.kind_doc = "GQA paged attention" + "".join(f", {t}" for t in traits)
    elif kind == "swiglu_mlp":
        act = _hidden_act(config)
        if act not in _gate_activations():
            return _as_stub(block, f"hidden_act {act!r}: not one Resin's gated MLP computes")
        block.kind = kind
        block.kind_doc = "SwiGLU MLP" if act in ("silu", "swish") else f"gated MLP ({act})"
    elif kind == "topk_moe":
        names = moe_expert_names(info.cls_name)
        if names is None or _hidden_act(config) not in _gate_activations():
            return _as_stub(block, "expert layout or activation Resin's moe_mlp does not cover")
        renorm = moe_renormalises(info.cls_name, config)
        block.kind, block.expert_names = kind, names
        block.renormalise = "True" if info.cls_name == "MixtralSparseMoeBlock" else "None"
        block.kind_doc = (
            f"top-k MoE (softmax router, top {getattr(config, 'num_experts_per_tok', '?')}, "
            f"renormalise: {renorm})"
        )
    else:
        return _as_stub(block)
    return block


def _base(
    info: BlockInfo,
    role: str,
    shapes: str,
    with_weights: bool = True,
    checkpoint_shapes: dict[str, tuple[int, ...]] | None = None,
) -> Block:
    """One block's description. ``checkpoint_shapes``: the whole model's checkpoint tensors;
    the block's weights are listed under their checkpoint names (what ``w`` holds), which
    differ from HF's in-memory names where HF fuses tensors on load (MoE experts)."""
    hf_shapes = ""
    if role != "rotary":
        shapes = _runner_shapes(info, shapes)
    if info.output is not None:
        ins = info.input_text or ", ".join(str(s) for s in info.inputs) or "none"
        outs = info.output_text or str(info.output)
        hf_shapes = f" (HF meta forward, batch 1, T=5: in {ins} -> out {outs})"
        if outs.startswith("("):
            hf_shapes += (
                "; HF returns a tuple: return what your decoder-layer function uses "
                "(a shared decoder layer expects only the first tensor)"
            )
    params = _checkpoint_params(info, checkpoint_shapes) or info.params
    weights = ", ".join(f"{n} {s}" for n, s in list(params.items())[:MAX_LISTED])
    if len(params) > MAX_LISTED:
        weights += f", ... {len(params) - MAX_LISTED} more"
    if params is not info.params and set(params) != set(info.params):
        weights += " (checkpoint names, as `w` holds them; HF fuses some of them on load)"
    block = Block(
        fn=function_name(info.cls_name),
        cls_name=info.cls_name,
        role=role,
        kind=None,
        where=info.where,
        short_where=info.short_where,
        shapes=shapes + hf_shapes,
        weights=weights if with_weights else "",
    )
    subs = [f"{n} {c} ({w})" for n, c, w in info.submodules[:MAX_LISTED]]
    if subs and role != "decoder":
        block.notes.append("submodules: " + "; ".join(subs))
    return block


def _checkpoint_params(
    info: BlockInfo, checkpoint_shapes: dict[str, tuple[int, ...]] | None
) -> dict[str, tuple[int, ...]]:
    """The block's checkpoint tensors relative to it, expert indices folded (``{expert}``)."""
    if not checkpoint_shapes or not info.path:
        return {}
    prefix = info.path + "."
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in checkpoint_shapes.items():
        if name.startswith(prefix):
            out.setdefault(name_pattern(name[len(prefix) - 1 :])[0].lstrip("."), tuple(shape))
    return out


def _runner_shapes(info: BlockInfo, default: str) -> str:
    """The block's shapes as the runner calls it — HF's first input and first output with the
    batch dimension dropped (T tokens) — when the meta forward saw them, else ``default``
    (e.g. ``x [T, hidden] -> [T, hidden]``). A hyper-connection layer then reads
    ``[T, hc, hidden]``, not an invented ``[T, hidden]``."""
    if not info.inputs or info.output is None or len(info.output) < 2 or len(info.inputs[0]) < 2:
        return default
    label = default.split(" ", 1)[0]

    def runner(shape: tuple[int, ...]) -> str:
        return "[" + ", ".join(["T", *(str(d) for d in shape[2:])]) + "]"

    return f"{label} {runner(info.inputs[0])} -> {runner(info.output)}"


def _hidden_act(config: Any) -> str:
    """The config's ``hidden_act`` (SiLU when it has none, as the shared blocks read it)."""
    return getattr(config, "hidden_act", None) or "silu"


def _gate_activations() -> tuple[str, ...]:
    """The ``hidden_act`` values the shared gated MLP computes (imported when a block asks:
    the runner's layers import torch)."""
    from resin.runners.torch.layers import GATE_ACTIVATIONS

    return tuple(GATE_ACTIVATIONS)


def _as_stub(block: Block, reason: str = "") -> Block:
    block.kind = None
    block.assumed = False
    parts = [
        f"{block.cls_name} is not implemented in Resin: write blocks.{block.fn} "
        f"(port {block.cls_name}.forward from {block.where})"
    ]
    if reason:
        parts.append(reason)
    parts.append(f"shapes: {block.shapes}")
    if block.weights:
        parts.append(f"weights: {block.weights}")
    parts += block.notes
    block.message = ". ".join(parts)
    chunks = textwrap.wrap(block.message, 80, drop_whitespace=False, break_on_hyphens=False)
    block.message_lines = [repr(chunk) for chunk in chunks]
    return block


def _stub(
    fn: str,
    cls_name: str,
    where: str,
    short_where: str,
    role: str,
    shapes: str,
    weights: str,
    reason: str,
    rotary_key: str = "",
) -> Block:
    block = Block(
        fn=fn,
        cls_name=cls_name,
        role=role,
        kind=None,
        where=where,
        short_where=short_where,
        shapes=shapes,
        weights=weights,
        rotary_key=rotary_key,
    )
    return _as_stub(block, reason)


def _rope_problem(arch: Architecture) -> str | None:
    from resin.loading.fields import ConfigError
    from resin.loading.rope import parse_rope_config

    raw = {k: v for k, v in arch.config.to_dict().items() if v is not None}
    try:
        parse_rope_config(raw, 10000.0, int(raw.get("max_position_embeddings", 2048)))
    except ConfigError as exc:
        return str(exc)
    return None


def _capped(values: tuple[int, ...], max_positions: int) -> list[int]:
    return [n for n in values if n <= max_positions] or [max_positions]


def _type_summary(layers: list[LayerInfo]) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.layer_type] = counts.get(layer.layer_type, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in counts.items())


def _layer_rows(layers: list[LayerInfo], config: Any) -> list[dict[str, str]]:
    """Layers with the same type, window and classes share one table row."""
    rows: dict[tuple[str, ...], list[int]] = {}
    for layer in layers:
        kind = cache_kind(layer.layer_type, layer.window)
        cache = {
            "full": "full",
            "sliding_window": f"sliding_window({layer.window})",
            "compressed": compressed_cache_text(layer.layer_type, config),
            "recurrent": "recurrent (gated delta net state)"
            if is_gated_delta_net(layer.layer_type, config)
            else "recurrent (Kimi delta attention state)"
            if is_kimi_delta_attention(layer.layer_type, config)
            else "recurrent (stub)",
            "indexed": _indexed_cache_text(layer.index, config)
            if is_indexed_attention(layer.layer_type, config)
            else "indexed (stub)",
        }.get(kind, "unknown (stub)")
        key = (
            layer.layer_type,
            str(layer.window or "-"),
            cache,
            layer.decoder.cls_name,
            ", ".join(f"{n}: {i.cls_name}" for n, i in layer.children.items()),
        )
        rows.setdefault(key, []).append(layer.index)
    names = ("layer_type", "window", "cache", "decoder", "children")
    return [
        {"layers": compact_indices(indices), **dict(zip(names, key))}
        for key, indices in rows.items()
    ]


def _indexed_cache_text(index: int, config: Any) -> str:
    """``full`` latent, plus the indexer's window and pools on a layer running its own."""
    if not runs_own_indexer(config, index):
        return "full (latent; shared indexer)"
    kpool = getattr(config, "index_kpool", None)
    return f"full (latent) + sliding_window({kpool}) + compressed(ratio {kpool})"


def compact_indices(indices: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3"; [0, 2, 4] -> "0-4 step 2"; otherwise a comma list."""
    if len(indices) == 1:
        return str(indices[0])
    steps = {b - a for a, b in zip(indices, indices[1:])}
    if len(steps) == 1:
        step = steps.pop()
        return f"{indices[0]}-{indices[-1]}" + ("" if step == 1 else f" step {step}")
    return ", ".join(map(str, indices))
