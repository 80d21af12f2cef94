"""A tiny random-weight checkpoint of an architecture: parity on a CPU in seconds.

Owns :func:`tiny_config` (the source config shrunk — hidden 64, 4 heads of 16, 4 experts,
vocab 384, few layers — keeping what makes the architecture itself: the layer-type pattern
(enough layers that every attention and MLP type and the dense/MoE split appear), MoE and MTP
settings, rope type, tied embeddings, biases, special flags) and :func:`make_tiny_checkpoint`
(:func:`write_tiny_checkpoint` returns just its path): the HF model built from it with seeded,
rescaled random weights (as ``scripts/make_fixtures.py``: logits spread over several units so
greedy tokens are not near ties), saved with ``save_pretrained`` (so tensor names are exactly
what HF writes), plus ``generation_config.json``, the byte-level BPE tokenizer of
``tests/fixtures`` (vocab 384; ids 0-3 are ``<|bos|>``, ``<|eos|>``, ``<|im_start|>``,
``<|im_end|>``) and ``CHANGES.md``. Everything is seeded: the same config gives the same files.

A multimodal wrapper config (``text_config`` + a vision / audio tower, built as
:mod:`resin.scaffold.hf_model` builds it) gives a text-serving wrapper checkpoint: its text
config is shrunk and perturbed as below (the lines say ``text_config.<key>``), each tower is
made one block deep and narrow (:func:`_shrink_towers`: the text runner and HF's text-only
forward never run it, its tensors only have to exist under the wrapper's names), and the
model is saved by the wrapper class, so names are the wrapper's own.

A tiny checkpoint must not hide bugs, so beyond shrinking it (every change is one line of
``TinyCheckpoint.changes`` and of ``CHANGES.md``):

- **Defaults the code could silently assume** (:data:`UNIT_SCALES`, :func:`_default_traps`):
  ``query_pre_attn_scalar`` scales with ``head_dim`` and, when it equals ``head_dim`` (the
  plain ``1/sqrt(head_dim)`` scale), becomes 1.5 x ``head_dim``; a multiplier / scaling factor
  listed in :data:`UNIT_SCALES` or named ``*_multiplier`` that is exactly 1 becomes
  :data:`UNIT_SCALE_VALUE`; a present ``partial_rotary_factor`` of 1 becomes 0.5, and one that
  leaves fewer than :data:`MIN_ROTARY_DIMS` rotated dims is raised to that many (top level and
  inside ``rope_parameters``); rope bases (``rope_theta`` of each per-layer-type
  ``rope_parameters`` entry, or top-level ``*rope_theta`` / ``*base_freq`` fields) that are
  equal are made distinct (x4); an explicit ``head_dim`` equal to ``hidden_size /
  num_attention_heads`` becomes :data:`HEAD_DIM_VALUE` (not MLA's); each norm epsilon
  (:data:`NORM_EPS_FIELD`) becomes its own of :data:`NORM_EPS_VALUES`; a shared-expert count
  ``n_shared_experts`` of 1 becomes
  :data:`SHARED_EXPERTS_VALUE` (the shape rules cannot see a factor of 1, so the source's
  shared width would pass for ``moe_intermediate_size`` alone). Each such change is kept only
  if it changes HF's logits on the tiny model (else it is reverted and says so).
  ``tie_word_embeddings`` is kept as the source has it: flipping it would test a layout the
  real checkpoint does not have, and with random weights either value already fails loudly
  when ignored (a tied checkpoint has no ``lm_head.weight``; an untied one departs at
  ``logits``).
- **Per-pair rope lists** (longrope's ``short_factor`` / ``long_factor``): resampled evenly
  to the tiny head's ``rotary_dim // 2`` entries (:func:`_fit_rope_factor_lists`).
- **Lengths** (:data:`LENGTH_LIMITS`): sequence-length thresholds the parity prompts (<= 78
  tokens) must cross: ``sliding_window`` <= 32, ``attention_chunk_size`` <= 16, indexer
  ``index_topk`` <= 4, ``compress_rates`` <= 8 (DeepSeek-V4 HCA compresses every 128 tokens),
  Llama-4's ``floor_scale`` <= 16.
- **Routing buffers** (:func:`reinit_routing_buffers`): persistent buffers HF initialises to
  zeros / one value that feed expert routing (names in :data:`ROUTING_BUFFER_MARKERS`, e.g.
  DeepSeek-V4's ``tid2eid`` hash table, ``e_score_correction_bias``) get seeded random values
  (integer tables: distinct valid expert ids per row); other constant buffers are reported.
- **Thresholds** (:data:`THRESHOLD_PATTERN`: ``swiglu_limit``, ``clip_qkv``, ``*softcap*``,
  ``*_limit``, ``*clamp*``): a positive threshold is halved until removing it (x1e6) changes
  HF's logits on a 48-token probe by more than :data:`BIND_DIFF` (scaled), i.e. until the tiny
  activations exceed it; one that never binds down to 1/64 of its value is restored and
  reported.
Imports torch and transformers.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from resin.scaffold import hf_model
from resin.scaffold.inspect import build_meta_model, load_config, persistent_buffers
from resin.scaffold.layer_map import EXPERT_COUNT_FIELDS, mlp_types_from_config

VOCAB_SIZE = 384
BOS_ID, EOS_ID, IM_END_ID = 0, 1, 3
MAX_TINY_LAYERS = 8
TINY_WINDOW = 32
SIZE_BUDGET_BYTES = 2_000_000
CHANGES_FILE = "CHANGES.md"
# The byte-level BPE tokenizer of tests/fixtures (scripts/make_fixtures.py trains it), shipped as
# package data so `resin new-model --tiny` works from an installed wheel.
TINY_TOKENIZER = Path(__file__).resolve().parent / "tiny_tokenizer"
# Width fields shrunk when present (value for the tiny model).
TINY_WIDTHS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "o_lora_rank": 16,
    "index_n_heads": 4,
    "index_head_dim": 16,
}
# Widths the source derives from others (MLA: head_dim is the rope part, qk_head_dim the sum):
# recomputed from the shrunk parts when the source's value is that sum.
DERIVED_WIDTHS = {
    "head_dim": ("qk_rope_head_dim",),
    "qk_head_dim": ("qk_nope_head_dim", "qk_rope_head_dim"),
}
# Fields capped (never raised) at the value given: group counts that must divide 4 heads.
TINY_CAPS = {"o_groups": 2, "n_group": 1, "topk_group": 1}
# Sequence-length thresholds the parity prompts must cross (module doc); dict values capped too.
LENGTH_LIMITS = {
    "sliding_window": TINY_WINDOW,
    "attention_chunk_size": 16,
    "index_topk": 4,
    "compress_rates": 8,
    "floor_scale": 16,
}
# Scale fields a runner could hard-code as 1 (perturbed when exactly 1), besides *_multiplier.
UNIT_SCALES = (
    "routed_scaling_factor",
    "router_scaling_factor",
    "route_scale",
    "logits_scaling",
    "attention_multiplier",
    "embedding_multiplier",
    "residual_multiplier",
    "logit_scale",
    "attn_scale",
    "embedding_scale",
    "residual_scale",
)
UNIT_SCALE_VALUE = 0.75
# A DeepSeek-style shared-expert count of 1 becomes this (the shared MLP is
# moe_intermediate_size * n_shared_experts wide): odd, so no product of the tiny's power-of-two
# widths explains the shared width by accident in the shape rules (2 gave DeepSeek-V3's
# 4*kv_lora_rank).
SHARED_EXPERTS_VALUE = 3
MIN_ROTARY_DIMS = 8
# An explicit head_dim equal to hidden_size / heads (16 in the tiny) becomes this: 4 heads of
# 20 are 80 wide, no multiple of hidden 64 (a shape rule cannot bind the q / o widths to
# hidden_size), and distinct from query_pre_attn_scalar's trap value (1.5 x 16).
HEAD_DIM_VALUE = 20
# Norm epsilons (rms_norm_eps, layer_norm_eps, norm_epsilon, ...) become these, one each:
# large enough to move the tiny's logits, distinct so two fields cannot stand in for each other.
NORM_EPS_FIELD = re.compile(r"norm_eps(ilon)?$")
NORM_EPS_VALUES = (1 / 32, 1 / 16, 1 / 8)
ROPE_THETA_FIELD = re.compile(r"(^|_)rope_theta$|base_freq$")
THRESHOLD_PATTERN = re.compile(r"limit$|clamp|clip_qkv|softcap|soft_cap")
ROUTING_BUFFER_MARKERS = (
    "tid2eid",
    "correction_bias",
    "expert_bias",
    "router",
    "gate",
    "routing",
    "expert",
)
BIND_DIFF = 1e-2  # scaled logits change that counts as "binds" / "has an effect"
NO_EFFECT = 1e-6
PROBE_LEN = 48
# A multimodal wrapper's towers (never run by the text runner) at these widths when present.
TOWER_WIDTHS = {
    "hidden_size": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "projection_intermediate_size": 64,
    "num_heads": 2,
    "num_attention_heads": 2,
    "head_dim": 16,
}
THRESHOLD_HALVINGS = 6


@dataclass
class TinyCheckpoint:
    """What :func:`make_tiny_checkpoint` wrote: the directory and every change, one line each."""

    path: Path
    changes: list[str] = field(default_factory=list)


@dataclass
class _Change:
    """One perturbation of the raw config dict: ``edits`` = [(key path, old, new)]."""

    what: str
    edits: list[tuple[tuple[str, ...], Any, Any]]


def tiny_config(source: str | Path | Any, seed_layers: int = 4) -> Any:
    """The source config shrunk to a CPU-sized model of the same architecture, perturbed as the
    module doc says (unverified: :func:`make_tiny_checkpoint` reverts perturbations without
    effect and tunes thresholds)."""
    raw, _lines, _traps = _tiny_raw(source, seed_layers)
    return _config_from_raw(raw)


def shape_probe_config(source: str | Path | Any, head_dim: bool = True) -> Any:
    """:func:`tiny_config` for the shape rules (``resin.scaffold.shape_rules``), never saved:
    where the source gives each query head its own KV head, the probe shares them (4 query
    heads, 2 KV heads). With as many KV heads as query heads in both configs, a k / v width
    equals ``hidden_size`` in both, the simplest explanation wins, and the record would refuse
    every grouped-query checkpoint of the architecture (OLMo 2 7B's directory refused the 32B's
    weights so). A model that ignores ``num_key_value_heads`` keeps its widths, and its rule.

    Two more coincidences are broken the same way. A grouped source whose KV head count the
    tiny keeps (2) gets 1 here: else ``2 * intermediate_size`` and ``intermediate_size *
    num_key_value_heads`` tie in both (GLM-4's record took the second and refused every
    checkpoint with another KV count). And the head width is :data:`HEAD_DIM_VALUE`, given
    explicitly even where the source derives it (not MLA's): a model whose HF code reads
    ``head_dim`` then shows q / o widths of ``num_attention_heads * head_dim``, one that does
    not keeps ``hidden_size``; with both equal the record bound them to ``hidden_size`` and
    refused checkpoints whose ``head_dim`` differs (the shape rules derive ``head_dim`` where a
    config lacks it, as HF's ``getattr`` default does). ``head_dim=False``: not that one (for a
    model whose HF code refuses the width)."""
    raw, _lines, _traps = _tiny_raw(source)
    source_config = load_config(source)
    text_key = _text_key(source_config)
    text = raw if text_key is None else raw[text_key]
    source_text = hf_model.text_config(source_config)
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if isinstance(heads, int) and heads == kv_heads and heads % 2 == 0:
        text["num_key_value_heads"] = heads // 2
    elif isinstance(kv_heads, int) and kv_heads == getattr(source_text, "num_key_value_heads", 0):
        if kv_heads == 2 and isinstance(heads, int) and heads > 2:
            text["num_key_value_heads"] = 1
    if head_dim and not _is_mla(text) and isinstance(heads, int):
        text["head_dim"] = HEAD_DIM_VALUE
    return _config_from_raw(raw)


def _tiny_raw(
    source: str | Path | Any, seed_layers: int = 4
) -> tuple[dict[str, Any], list[str], list[_Change]]:
    """(tiny raw config dict, shrink lines, default traps applied to it). A multimodal
    wrapper's text sub-config is shrunk as a causal LM's config is; its towers as
    :func:`_shrink_towers` says."""
    config = load_config(source)
    raw = config.to_dict()
    text_key = _text_key(config)
    if text_key is None:
        tiny, lines = _shrink_text(raw, seed_layers)
        traps = _default_traps(tiny)
    else:
        tiny = copy.deepcopy(raw)
        tiny[text_key], lines = _shrink_text(raw[text_key], seed_layers, f"{text_key}.")
        if "dtype" in tiny:
            tiny["dtype"] = "float32"
        for key in ("torch_dtype", "transformers_version", "_name_or_path"):
            tiny.pop(key, None)
        lines += _shrink_towers(tiny, text_key)
        traps = [
            _Change(c.what, [((text_key, *path), old, new) for path, old, new in c.edits])
            for c in _default_traps(tiny[text_key])
        ]
    for change in traps:
        _apply(tiny, change, new=True)
    lines += _fit_rope_factor_lists(tiny)
    return tiny, lines, traps


def _fit_rope_factor_lists(raw: dict[str, Any], explicit_head_dim: bool = True) -> list[str]:
    """Per-frequency rope lists (longrope's ``short_factor`` / ``long_factor``: one value per
    rotated dim pair) resampled in place, evenly, to the tiny model's ``rotary_dim // 2``
    entries — first and last kept — in ``raw`` and in any sub-config dict of it (a wrapper's
    ``text_config``); HF refuses a list sized for the source's head. One line per list.
    ``explicit_head_dim=False``: sized by ``hidden_size / num_attention_heads`` even where
    ``head_dim`` is given (Phi-3's config checks them so)."""
    lines = []
    for where, text in [("", raw)] + [
        (f"{k}.", v) for k, v in raw.items() if isinstance(v, dict) and "rope_parameters" in v
    ]:
        rope = text.get("rope_parameters")
        if not isinstance(rope, dict):
            continue
        tables = [("", rope)] + [(f"{k}.", v) for k, v in rope.items() if isinstance(v, dict)]
        heads = text.get("num_attention_heads")
        head_dim = (text.get("head_dim") if explicit_head_dim else None) or (
            int(text["hidden_size"]) // int(heads) if heads and text.get("hidden_size") else None
        )
        for name, table in tables:
            partial = table.get("partial_rotary_factor", text.get("partial_rotary_factor")) or 1.0
            pairs = int(int(head_dim) * float(partial)) // 2 if head_dim else 0
            for key in ("short_factor", "long_factor"):
                old = table.get(key)
                if not isinstance(old, list) or not old or not pairs or len(old) == pairs:
                    continue
                step = (len(old) - 1) / max(pairs - 1, 1)
                table[key] = [old[round(i * step)] for i in range(pairs)]
                lines.append(
                    f"shrunk: {where}rope_parameters.{name}{key} {len(old)} -> {pairs} items "
                    "(one per rotated dim pair; resampled evenly, first and last kept)"
                )
    return lines


def _text_key(config: Any) -> str | None:
    """The key of a multimodal wrapper's text sub-config (``text_config``); None for a config
    whose decoder is its top level (:func:`resin.scaffold.hf_model.text_config`)."""
    text = hf_model.text_config(config)
    if text is config:
        return None
    for key in getattr(config, "sub_configs", None) or {}:
        if getattr(config, key, None) is text:
            return str(key)
    raise ValueError(
        f"{type(config).__name__}: the text config is not one of its sub-configs "
        f"{sorted(getattr(config, 'sub_configs', None) or {})}; the tiny maker cannot shrink it"
    )


def _text_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The part of a raw config dict that holds the decoder's settings (see :func:`_text_key`)."""
    key = (
        _text_key(_config_from_raw(raw)) if any(isinstance(v, dict) for v in raw.values()) else None
    )
    return raw if key is None else raw[key]


def _shrink_towers(tiny: dict[str, Any], text_key: str) -> list[str]:
    """Every sub-config of a wrapper but the text one (vision / audio towers) made one block
    deep (:data:`resin.scaffold.hf_model.DEPTH_FIELDS`) and narrow (:data:`TOWER_WIDTHS`;
    ``out_hidden_size`` = the text hidden size), in ``tiny``. The text runner never runs a
    tower and HF's text-only forward never calls one: its tensors only have to exist under
    the wrapper's names. Narrowing is undone (depth 1 kept) when the wrapper then does not
    build. Returns one line per tower."""
    lines = []
    hidden = tiny[text_key].get("hidden_size")
    for key, sub in sorted(tiny.items()):
        if key == text_key or not isinstance(sub, dict) or "model_type" not in sub:
            continue
        before = copy.deepcopy(sub)
        for field_name in hf_model.DEPTH_FIELDS:
            if isinstance(sub.get(field_name), int) and sub[field_name] > 1:
                sub[field_name] = 1
        deep_only = copy.deepcopy(sub)
        widths = {**TOWER_WIDTHS, "out_hidden_size": hidden}
        for field_name, value in widths.items():
            if isinstance(sub.get(field_name), int) and not isinstance(sub[field_name], bool):
                sub[field_name] = value
        try:
            build_meta_model(_config_from_raw(tiny))
            how = ""
        except Exception as exc:  # noqa: BLE001 - keep the tower's widths, say why
            tiny[key] = sub = deep_only
            how = f" (narrowing it broke the wrapper's build: {type(exc).__name__}; widths kept)"
        changed = [
            f"{name} {_fmt(before[name])} -> {_fmt(sub[name])}"
            for name in sorted(sub)
            if name in before and before[name] != sub[name]
        ]
        lines.append(
            f"tower: {key} ({sub['model_type']}) {', '.join(changed) or 'unchanged'}{how}: the "
            "text runner never runs it, its tensors are only saved under the wrapper's names"
        )
    return lines


def _shrink_text(
    raw: dict[str, Any], seed_layers: int, where: str = ""
) -> tuple[dict[str, Any], list[str]]:
    """(a causal LM's raw config dict shrunk as the module doc says, one line per change;
    ``where`` prefixes each key in the lines, e.g. ``text_config.``)."""
    num_layers = int(raw["num_hidden_layers"])
    n = _tiny_num_layers(raw, num_layers, seed_layers)
    tiny = copy.deepcopy(raw)
    for key, width in TINY_WIDTHS.items():
        if isinstance(raw.get(key), int) and not isinstance(raw.get(key), bool) and raw[key] > 0:
            tiny[key] = width
    for key, parts in DERIVED_WIDTHS.items():  # keep sums / aliases of shrunk widths exact
        if (
            isinstance(raw.get(key), int)
            and all(isinstance(raw.get(k), int) for k in parts)
            and raw[key] == sum(raw[k] for k in parts)
        ):
            tiny[key] = sum(tiny[k] for k in parts)
    for key, cap in TINY_CAPS.items():
        if isinstance(raw.get(key), int) and raw[key] > cap:
            tiny[key] = cap
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    tiny["num_attention_heads"] = 4  # with hidden 64: head_dim 16 when it is derived
    if "num_key_value_heads" in raw:
        tiny["num_key_value_heads"] = 4 if kv_heads == heads else (1 if kv_heads == 1 else 2)
    has_experts = False
    for key in EXPERT_COUNT_FIELDS:
        if isinstance(raw.get(key), int) and raw[key] > 0:
            tiny[key], has_experts = 4, True
    if has_experts:
        tiny["num_experts_per_tok"] = min(int(raw.get("num_experts_per_tok") or 2), 2)
        if "moe_intermediate_size" not in raw:
            tiny["intermediate_size"] = 32  # experts use intermediate_size (Mixtral, GptOss)
    for key in ("n_shared_experts", "num_shared_experts"):
        if isinstance(raw.get(key), int) and raw[key] > 1:
            tiny[key] = 1
    if isinstance(raw.get("first_k_dense_replace"), int):
        tiny["first_k_dense_replace"] = min(raw["first_k_dense_replace"], 1)
    if isinstance(raw.get("mlp_only_layers"), list):
        tiny["mlp_only_layers"] = [i for i in raw["mlp_only_layers"] if i < n]
    for key, value in raw.items():  # per-layer lists (layer_types, ...) keep their first n
        if isinstance(value, list) and len(value) == num_layers and key != "architectures":
            tiny[key] = value[:n]
    for key, limit in LENGTH_LIMITS.items():
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            tiny[key] = limit
        elif isinstance(value, dict):
            tiny[key] = {
                k: (min(v, limit) if isinstance(v, int) and not isinstance(v, bool) else v)
                for k, v in value.items()
            }
    if (
        isinstance(tiny.get("query_pre_attn_scalar"), (int, float))
        and isinstance(raw.get("head_dim"), int)
        and raw["head_dim"] > 0
        and isinstance(tiny.get("head_dim"), int)
    ):
        # it scales with head_dim: keep the source's ratio (the trap below handles ratio 1)
        ratio = float(raw["query_pre_attn_scalar"]) / raw["head_dim"]
        scaled = ratio * tiny["head_dim"]
        tiny["query_pre_attn_scalar"] = (
            int(scaled)
            if isinstance(raw["query_pre_attn_scalar"], int) and scaled == int(scaled)
            else scaled
        )
    tiny.update(
        num_hidden_layers=n,
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        dtype="float32",
    )
    for key in ("torch_dtype", "transformers_version", "_name_or_path"):
        tiny.pop(key, None)
    lines = [
        f"shrunk: {where}{key} {_fmt(raw.get(key))} -> {_fmt(tiny[key])}"
        for key in sorted(tiny)
        if key in raw and raw[key] != tiny[key] and key not in ("dtype",)
    ]
    return tiny, lines


def _default_traps(tiny: dict[str, Any]) -> list[_Change]:
    """Perturbations of values equal to a default a runner could assume (module doc)."""
    out: list[_Change] = []
    head_dim = tiny.get("head_dim") if isinstance(tiny.get("head_dim"), int) else None
    if head_dim is None and isinstance(tiny.get("hidden_size"), int):
        head_dim = tiny["hidden_size"] // int(tiny["num_attention_heads"])
    qpas = tiny.get("query_pre_attn_scalar")
    if (
        isinstance(qpas, (int, float))
        and not isinstance(qpas, bool)
        and head_dim
        and float(qpas) == float(head_dim)
    ):
        new = int(head_dim * 3 // 2) if isinstance(qpas, int) else head_dim * 1.5
        out.append(
            _Change(
                f"query_pre_attn_scalar {qpas} -> {new} (it equalled head_dim "
                f"{head_dim}: the default 1/sqrt(head_dim) scale would pass)",
                [(("query_pre_attn_scalar",), qpas, new)],
            )
        )
    for key, value in sorted(tiny.items()):
        if (
            (key in UNIT_SCALES or key.endswith("_multiplier"))
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value == 1
        ):
            out.append(
                _Change(
                    f"{key} {value} -> {UNIT_SCALE_VALUE} (it was 1: a runner "
                    "that ignores it would pass)",
                    [((key,), value, UNIT_SCALE_VALUE)],
                )
            )
    shared = tiny.get("n_shared_experts")
    if isinstance(shared, int) and not isinstance(shared, bool) and shared == 1:
        out.append(
            _Change(
                f"n_shared_experts 1 -> {SHARED_EXPERTS_VALUE} (it was 1: shared experts sized "
                "by moe_intermediate_size alone would pass, and a factor of 1 is invisible to "
                "architecture.json's shape rules)",
                [(("n_shared_experts",), 1, SHARED_EXPERTS_VALUE)],
            )
        )
    out += _rotary_traps(tiny, head_dim)
    out += _rope_theta_traps(tiny)
    out += _head_dim_traps(tiny)
    out += _norm_eps_traps(tiny)
    return out


def _head_dim_traps(tiny: dict[str, Any]) -> list[_Change]:
    """An explicit ``head_dim`` equal to ``hidden_size / num_attention_heads`` becomes
    :data:`HEAD_DIM_VALUE` (not MLA's, where ``head_dim`` is the rope part)."""
    value, hidden, heads = (tiny.get(k) for k in ("head_dim", "hidden_size", "num_attention_heads"))
    if not (isinstance(value, int) and isinstance(hidden, int) and isinstance(heads, int)):
        return []
    if heads <= 0 or _is_mla(tiny):
        return []
    if isinstance(value, bool) or value != hidden // heads:
        return []
    return [
        _Change(
            f"head_dim {value} -> {HEAD_DIM_VALUE} (it equalled hidden_size / "
            f"num_attention_heads: a runner, or a shape rule, that derives the head width "
            "from hidden_size would pass)",
            [(("head_dim",), value, HEAD_DIM_VALUE)],
        )
    ]


def _is_mla(config: dict[str, Any]) -> bool:
    """Multi-head latent attention: its ``head_dim`` is the rope part, not the head's width."""
    return "qk_rope_head_dim" in config or "kv_lora_rank" in config


def _norm_eps_traps(tiny: dict[str, Any]) -> list[_Change]:
    """Each norm epsilon (:data:`NORM_EPS_FIELD`) set to its own of :data:`NORM_EPS_VALUES`."""
    keys = [
        key
        for key, value in sorted(tiny.items())
        if NORM_EPS_FIELD.search(key)
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ]
    return [
        _Change(
            f"{key} {_fmt(tiny[key])} -> {new} (a runner that hard-codes a norm's epsilon, "
            "or reads another field's, would pass at the usual 1e-5 / 1e-6)",
            [((key,), tiny[key], new)],
        )
        for key, new in zip(keys, NORM_EPS_VALUES)
        if tiny[key] != new
    ]


def _rotary_traps(tiny: dict[str, Any], head_dim: int | None) -> list[_Change]:
    places: list[tuple[str, ...]] = []
    if isinstance(tiny.get("partial_rotary_factor"), (int, float)):
        places.append(("partial_rotary_factor",))
    rope = tiny.get("rope_parameters")
    if isinstance(rope, dict):
        if isinstance(rope.get("partial_rotary_factor"), (int, float)):
            places.append(("rope_parameters", "partial_rotary_factor"))
        for name, sub in rope.items():
            if isinstance(sub, dict) and isinstance(sub.get("partial_rotary_factor"), (int, float)):
                places.append(("rope_parameters", name, "partial_rotary_factor"))
    if not places or not head_dim:
        return []
    edits = []
    for path in places:
        old = float(_get(tiny, path))
        new = old
        if old == 1.0:
            new = 0.5
        elif head_dim * old < MIN_ROTARY_DIMS <= head_dim:
            new = MIN_ROTARY_DIMS / head_dim
        if new != old:
            edits.append((path, _get(tiny, path), new))
    if not edits:
        return []
    olds = sorted({_fmt(e[1]) for e in edits})
    new = edits[0][2]
    why = (
        "it was 1: a runner that rotates every dim would pass"
        if olds == ["1.0"] or olds == ["1"]
        else f"{', '.join(olds)} x head_dim {head_dim} left fewer than "
        f"{MIN_ROTARY_DIMS} rotated dims, too few to tell rope layouts apart"
    )
    return [
        _Change(
            f"partial_rotary_factor {', '.join(olds)} -> {new} ({why}; at "
            f"{', '.join('.'.join(e[0]) for e in edits)})",
            edits,
        )
    ]


def _rope_theta_traps(tiny: dict[str, Any]) -> list[_Change]:
    """Equal rope bases across layer types made distinct (x4 per repeat)."""
    rope = tiny.get("rope_parameters")
    paths: list[tuple[str, ...]] = []
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):
        paths = [
            ("rope_parameters", name, "rope_theta")
            for name, sub in rope.items()
            if isinstance(sub, dict) and isinstance(sub.get("rope_theta"), (int, float))
        ]
    else:
        paths = [
            (key,)
            for key, value in sorted(tiny.items())
            if ROPE_THETA_FIELD.search(key)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ]
    out = []
    seen: dict[float, int] = {}
    for path in paths:
        value = _get(tiny, path)
        repeats = seen.get(float(value), 0)
        seen[float(value)] = repeats + 1
        if repeats:
            new = float(value) * 4**repeats
            while float(new) in seen:
                new *= 4
            seen[float(new)] = 1
            out.append(
                _Change(
                    f"{'.'.join(path)} {_fmt(value)} -> {_fmt(new)} (equal to "
                    "another layer type's rope base: a runner using one base for "
                    "every layer would pass)",
                    [(path, value, new)],
                )
            )
    return out


def make_tiny_checkpoint(
    source: str | Path | Any, out_dir: Path, seed: int = 1234
) -> TinyCheckpoint:
    """Save the tiny model, generation config, tokenizer and ``CHANGES.md`` into ``out_dir``."""
    raw, lines, traps = _tiny_raw(source)
    config = _config_from_raw(raw)
    # raises here, naming the config, if the shrink broke it
    build_meta_model(copy.deepcopy(config))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _build(config)
    reinit_weights(model, seed)
    originals: dict[str, Any] = {}
    buffer_lines = reinit_routing_buffers(model, seed, originals)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    probe = torch.randint(
        4, VOCAB_SIZE, (1, PROBE_LEN), generator=torch.Generator().manual_seed(seed)
    )
    lines += _buffer_effects(raw, state, probe, originals, buffer_lines)
    lines += _verify_traps(raw, traps, state, probe)
    lines += _tune_thresholds(raw, state, probe)
    final = _build(_config_from_raw(raw))
    final.load_state_dict(state)
    final.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=EOS_ID
    )
    final.save_pretrained(out_dir, safe_serialization=True)
    _write_tokenizer(out_dir)
    write_changes(out_dir / CHANGES_FILE, lines)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    if size > SIZE_BUDGET_BYTES:
        raise ValueError(
            f"tiny checkpoint is {size / 1e6:.2f} MB (> {SIZE_BUDGET_BYTES / 1e6} "
            f"MB): shrink more fields in resin.scaffold.tiny_checkpoint.TINY_WIDTHS"
        )
    return TinyCheckpoint(out_dir, lines)


def write_tiny_checkpoint(source: str | Path | Any, out_dir: Path, seed: int = 1234) -> Path:
    """:func:`make_tiny_checkpoint`, returning only the directory."""
    return make_tiny_checkpoint(source, out_dir, seed).path


def write_changes(path: Path, lines: list[str]) -> None:
    """``CHANGES.md``: every change from the source config and HF's init, one bullet each."""
    text = [
        "# Tiny checkpoint: what differs from the source",
        "",
        "Written by `resin new-model --tiny` (resin/scaffold/tiny_checkpoint.py). Shrunk "
        "fields make it CPU-sized; perturbed ones keep defaults a runner could assume from "
        "passing by accident; thresholds are lowered until the tiny activations cross them.",
        "",
    ]
    text += [f"- {line}" for line in lines] or ["- nothing"]
    path.write_text("\n".join(text) + "\n", encoding="utf-8")


@torch.no_grad()
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded values at scales that keep logits apart (as scripts/make_fixtures.py)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = int(hf_model.text_config(model.config).hidden_size)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name and name.endswith("weight"):
            values = 0.5 + torch.rand(param.shape, generator=gen)
        elif "embed_tokens" in name:
            values = torch.randn(param.shape, generator=gen)
        elif name.startswith("lm_head"):
            values = torch.randn(param.shape, generator=gen) * (16.0 / math.sqrt(hidden))
        elif name.endswith("bias") or param.dim() == 1:
            values = torch.randn(param.shape, generator=gen) * (
                0.1 if name.endswith("bias") else 0.5
            )
        elif param.dim() == 2:  # nn.Linear [out, in]
            values = torch.randn(param.shape, generator=gen) / math.sqrt(int(param.shape[-1]))
        else:  # fused experts: which of the last two dims is fan-in varies by model
            values = (
                torch.randn(param.shape, generator=gen)
                / (int(param.shape[-1]) * int(param.shape[-2])) ** 0.25
            )
        param.copy_(values.to(param.dtype))


@torch.no_grad()
def reinit_routing_buffers(
    model: torch.nn.Module, seed: int, originals: dict[str, Any] | None = None
) -> list[str]:
    """Seeded values for constant persistent buffers that feed routing (module doc); returns
    one line per buffer changed, and per constant buffer left alone. ``originals``, when given,
    receives each changed buffer's previous value (state-dict name -> tensor)."""
    gen = torch.Generator().manual_seed(seed + 1)
    config = hf_model.text_config(model.config)
    experts = max(
        (
            int(getattr(config, k))
            for k in EXPERT_COUNT_FIELDS
            if isinstance(getattr(config, k, None), int)
        ),
        default=0,
    )
    lines = []
    for name, buf in persistent_buffers(model):
        if buf.numel() < 2 or buf.is_meta:
            continue
        flat = buf.flatten()
        if not bool((flat == flat[0]).all()):
            continue
        value = flat[0].item()
        shape = "x".join(str(d) for d in buf.shape)
        routing = any(marker in name for marker in ROUTING_BUFFER_MARKERS)
        if not routing:
            lines.append(
                f"kept: buffer {name} [{shape}] is all {_fmt(value)} but does not look "
                "like routing (not in ROUTING_BUFFER_MARKERS)"
            )
            continue
        if originals is not None and (buf.dtype.is_floating_point or experts > 0):
            originals[name] = buf.detach().clone()
        if buf.dtype.is_floating_point:
            new = value + 0.2 * torch.randn(buf.shape, generator=gen)
            buf.copy_(new.to(buf.dtype))
            lines.append(
                f"buffer: {name} [{shape}] was all {_fmt(value)} (HF's init; routing "
                "would not depend on it) -> seeded N(value, 0.2)"
            )
        elif experts > 0:
            rows = buf.reshape(-1, buf.shape[-1]) if buf.dim() > 1 else buf.reshape(1, -1)
            k = rows.shape[-1]
            if k <= experts:
                table = torch.stack(
                    [torch.randperm(experts, generator=gen)[:k] for _ in range(rows.shape[0])]
                )
            else:
                table = torch.randint(0, experts, tuple(rows.shape), generator=gen)
            buf.copy_(table.reshape(buf.shape).to(buf.dtype))
            lines.append(
                f"buffer: {name} [{shape}] was all {_fmt(value)} (every token routed to "
                f"the same experts) -> seeded random expert ids in [0, {experts})"
                + (", distinct per row" if k <= experts else "")
            )
        else:
            lines.append(
                f"kept: integer buffer {name} [{shape}] is all {_fmt(value)} and feeds "
                "routing, but the config names no expert count: set it by hand"
            )
    return lines


def _verify_traps(
    raw: dict[str, Any], traps: list[_Change], state: dict[str, Any], probe: Any
) -> list[str]:
    """Keep a perturbation only if HF runs with it and undoing it changes HF's logits; the
    others are reverted in ``raw``."""
    lines = []
    for change in traps:
        with_it = _logits(raw, state, probe)
        undone = copy.deepcopy(raw)
        _apply(undone, change, new=False)
        without = _logits(undone, state, probe)
        name = change.what.split(" (")[0]
        if with_it is None and without is not None:
            _apply(raw, change, new=False)
            lines.append(
                f"not perturbed: {name} made HF's forward fail on the tiny model, so "
                "it was reverted"
            )
        elif with_it is None or without is None:
            lines.append(
                f"perturbed: {change.what} (effect not checked: the tiny HF model did not run)"
            )
        elif _scaled_diff(with_it, without) <= NO_EFFECT:
            _apply(raw, change, new=False)
            lines.append(f"not perturbed: {name} had no effect on HF's logits, so it was reverted")
        else:
            lines.append(
                f"perturbed: {change.what}; HF's logits move by "
                f"{_scaled_diff(with_it, without):.3g} (scaled)"
            )
    return lines


def _buffer_effects(
    raw: dict[str, Any],
    state: dict[str, Any],
    probe: Any,
    originals: dict[str, Any],
    lines: list[str],
) -> list[str]:
    """Each ``buffer:`` line with how far HF's logits move when that buffer is put back."""
    base = _logits(raw, state, probe) if originals else None
    out = []
    for line in lines:
        name = line.split(" ", 2)[1] if line.startswith("buffer: ") else None
        if base is None or name not in originals:
            out.append(line)
            continue
        other = _logits(raw, {**state, name: originals[name]}, probe)
        diff = None if other is None else _scaled_diff(base, other)
        out.append(
            line
            + (
                ""
                if diff is None
                else f"; HF's logits move by {diff:.3g} (scaled)"
                + (" - no visible effect on the probe" if diff <= NO_EFFECT else "")
            )
        )
    return out


def _tune_thresholds(raw: dict[str, Any], state: dict[str, Any], probe: Any) -> list[str]:
    """Halve each positive threshold until the tiny activations cross it (module doc)."""
    lines = []
    text = _text_of(raw)  # the decoder's settings: raw itself, or a wrapper's text_config
    where = "" if text is raw else next(f"{k}." for k, v in raw.items() if v is text)
    for key in sorted(text):
        value = text[key]
        if (
            not THRESHOLD_PATTERN.search(key)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value <= 0
        ):
            continue
        original = value
        bound = first = None
        for step in range(THRESHOLD_HALVINGS + 1):
            on = _logits(raw, state, probe)
            off = _logits(_with(raw, text, key, _scaled_value(text[key], 1e6)), state, probe)
            if on is None or off is None:
                break
            diff = _scaled_diff(on, off)
            first = diff if first is None else first
            if diff > BIND_DIFF:
                bound = diff
                break
            lower = _scaled_value(text[key], 0.5)
            if step == THRESHOLD_HALVINGS or lower == text[key]:
                break
            text[key] = lower
        if bound is None:
            tried = text[key]
            text[key] = original
            lines.append(
                f"threshold: {where}{key} = {_fmt(original)} kept: the tiny model's "
                f"activations never cross it, even at {_fmt(tried)} (or HF did not "
                "run): parity cannot check it, test it by hand"
            )
        elif text[key] != original:
            how = "never reach it" if not first else "barely cross it"
            lines.append(
                f"threshold: {where}{key} {_fmt(original)} -> {_fmt(text[key])} (at "
                f"{_fmt(original)} the tiny activations {how}: removing it moves HF's "
                f"logits by {first:.3g} scaled; at {_fmt(text[key])} by {bound:.3g})"
            )
        else:
            lines.append(
                f"threshold: {where}{key} = {_fmt(original)} kept: it already binds "
                f"(removing it moves HF's logits by {bound:.3g} scaled)"
            )
    return lines


def _with(raw: dict[str, Any], text: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``raw`` with ``text[key]`` (``text``: ``raw`` or its text sub-config) set."""
    if text is raw:
        return {**raw, key: value}
    out = copy.deepcopy(raw)
    _text_of(out)[key] = value
    return out


def _scaled_value(value: Any, factor: float) -> Any:
    if isinstance(value, int):
        return max(1, int(value * factor))
    return float(value) * factor


def _scaled_diff(a: Any, b: Any) -> float:
    diff = float((a - b).abs().max())
    if math.isnan(diff):
        return math.inf
    return diff / max(1.0, float(a.abs().max()))


@torch.no_grad()
def _logits(raw: dict[str, Any], state: dict[str, Any], probe: Any) -> Any:
    """HF logits of the tiny model for ``raw`` with weights ``state``; None if it cannot run."""
    try:
        model = _build(_config_from_raw(raw))
        model.load_state_dict(state)
        return model(probe, use_cache=False).logits[0].float()
    except Exception:  # noqa: BLE001 - unverifiable; the caller says so
        return None


def _build(config: Any) -> Any:
    """The config's language model (:func:`resin.scaffold.hf_model.from_config`: a causal
    LM, or a multimodal wrapper whose text-only forward the probes run), eager, eval mode."""
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    return hf_model.from_config(config).eval()


def _config_from_raw(raw: dict[str, Any]) -> Any:
    model_type = raw["model_type"]
    for explicit_head_dim in (True, False):
        fitted = copy.deepcopy(raw)
        # a reverted partial_rotary_factor trap changes the size; a class may size the lists
        # by head_dim or by hidden_size / heads
        _fit_rope_factor_lists(fitted, explicit_head_dim)
        fitted.pop("model_type")
        try:
            return transformers.AutoConfig.for_model(model_type, **fitted)
        except Exception:  # noqa: BLE001 - retried with the derived width, then raised
            if not explicit_head_dim:
                raise
    raise AssertionError("unreachable")


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        d = d[key]
    return d


def _apply(d: dict[str, Any], change: _Change, new: bool) -> None:
    for path, old, value in change.edits:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value if new else old


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list) and len(value) > 6:
        return f"[{', '.join(map(str, value[:4]))}, ... {len(value)} items]"
    return str(value)


def _tiny_num_layers(raw: dict[str, Any], num_layers: int, seed_layers: int) -> int:
    """At least ``seed_layers``; enough that each layer type and a MoE layer appear once."""
    n = min(num_layers, seed_layers)
    types = list(raw.get("layer_types") or [])
    try:
        mlp_types = mlp_types_from_config(SimpleNamespace(**raw))
    except (ValueError, TypeError):
        mlp_types = []
    for kinds in (types, mlp_types):
        for kind in dict.fromkeys(kinds):
            n = max(n, kinds.index(kind) + 1)
    if isinstance(raw.get("first_k_dense_replace"), int):
        n = max(n, min(raw["first_k_dense_replace"], 1) + 1)
    return min(n, max(MAX_TINY_LAYERS, seed_layers), num_layers)


def _write_tokenizer(out_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY_TOKENIZER / name, out_dir / name)
