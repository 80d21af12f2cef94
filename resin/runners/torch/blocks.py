"""Block functions Resin already has, in the shape models call them: ``fn(x, w, ctx)``.

Owns the Llama-family blocks the built-in families run on and generated ``blocks.py`` files
delegate to (so a fix here reaches every model that uses them): RMSNorm, GQA attention through
the attention backend (optional q/k/v/o biases, optional q/k RMSNorm before RoPE, per head or
over the whole projection), the SwiGLU MLP, top-k softmax-routed MoE, DeepSeek-V3's
``noaux_tc`` routing from a config, the pre-norm residual decoder layer, and rotary tables from
a config's rope parameters. ``w`` is the module's own tensors keyed relative to it
(``q_proj.weight``); ``ctx`` a :class:`~.context.LayerContext`. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from resin import kernels
from resin.loading.rope import parse_rope_config, parse_rope_tables
from resin.runners.torch.context import LayerContext
from resin.runners.torch.layers import (
    MoeWeights,
    RotaryEmbedding,
    apply_rotary,
    gate_activation,
    grouped_topk_routing,
    moe_mlp,
    rms_norm,
    swiglu_mlp,
)
from resin.runners.torch.rope_frequencies import hf_rope_inv_freq

Weights = dict[str, torch.Tensor]
Block = Callable[..., torch.Tensor]
# The direct children of a pre-norm residual decoder layer (Llama's layout), in call order.
PRENORM_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` for an HF config, a :class:`resin.loading.ModelConfig` or a dict;
    ``default`` when it is absent or None (HF writes unset fields as None)."""
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def config_activation(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated MLP's activation for ``config``'s ``hidden_act`` (SiLU when it has none);
    ``ValueError`` for one Resin does not compute (:func:`.layers.gate_activation`)."""
    return gate_activation(config_value(config, "hidden_act", "silu"))


def rms_norm_block(x: torch.Tensor, w: Weights, ctx: LayerContext) -> torch.Tensor:
    """``LlamaRMSNorm``: fp32 normalisation, cast back, then the weight."""
    return rms_norm(x, w["weight"], float(config_value(ctx.config, "rms_norm_eps")))


def qk_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of q or k ``[T, heads, head_dim]`` before RoPE: per head when ``weight`` is
    ``head_dim`` wide (Qwen3), else over the whole projection, every head's channels at once
    (``weight`` ``[heads * head_dim]``: MiniMax-M2's ``qk_norm_type`` ``per_layer``)."""
    if weight.shape[-1] == x.shape[-1]:
        return rms_norm(x, weight, eps)
    return rms_norm(x.flatten(-2), weight, eps).view_as(x)


def gqa_attention_block(x: torch.Tensor, w: Weights, ctx: LayerContext) -> torch.Tensor:
    """q/k/v projections (optional biases), optional q/k RMSNorm before RoPE (per head as Qwen3,
    or over the whole projection as MiniMax-M2: :func:`qk_rms_norm`, by the norm's width),
    RoPE, K/V written and attended through ``ctx.attention`` (the window is the layer's cache
    group's), o projection."""
    num_tokens, head_dim = x.shape[0], ctx.head_dim
    linear = kernels.linear  # F.linear, or the CPU decode kernel (resin.kernels)
    q = linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(num_tokens, -1, head_dim)
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias")).view(num_tokens, -1, head_dim)
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias")).view(num_tokens, -1, head_dim)
    if "q_norm.weight" in w:
        eps = float(config_value(ctx.config, "rms_norm_eps"))
        q, k = qk_rms_norm(q, w["q_norm.weight"], eps), qk_rms_norm(k, w["k_norm.weight"], eps)
    cos, sin = ctx.require_rotary()
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = ctx.require_attention()(q, k, v, scale=head_dim**-0.5)
    return linear(out.reshape(num_tokens, -1), w["o_proj.weight"], w.get("o_proj.bias"))


def swiglu_mlp_block(x: torch.Tensor, w: Weights, ctx: LayerContext) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with optional biases; ``act`` from the config's
    ``hidden_act`` (default SiLU)."""
    return swiglu_mlp(
        x,
        w["gate_proj.weight"],
        w["up_proj.weight"],
        w["down_proj.weight"],
        w.get("gate_proj.bias"),
        w.get("up_proj.bias"),
        w.get("down_proj.bias"),
        activation=config_activation(ctx.config),
    )


def topk_moe_block(
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    renormalise: bool | None = None,
    router: str = "gate",
    num_experts_per_tok: int | None = None,
) -> Block:
    """A top-k MoE block (``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``): router
    ``{router}.weight``, experts ``experts.{e}.{gate,up,down}.weight`` under ``expert_names``;
    renormalise the kept weights iff ``renormalise`` (None: ``config.norm_topk_prob``); keep
    ``num_experts_per_tok`` experts (None: the config's)."""
    gate_name, up_name, down_name = expert_names

    def moe_block(x: torch.Tensor, w: Weights, ctx: LayerContext) -> torch.Tensor:
        num_experts = sum(
            1 for k in w if k.startswith("experts.") and k.endswith(f".{gate_name}.weight")
        )
        norm = (
            bool(config_value(ctx.config, "norm_topk_prob", False))
            if renormalise is None
            else renormalise
        )
        moe = MoeWeights(
            router=w[f"{router}.weight"],
            gate=[w[f"experts.{e}.{gate_name}.weight"] for e in range(num_experts)],
            up=[w[f"experts.{e}.{up_name}.weight"] for e in range(num_experts)],
            down=[w[f"experts.{e}.{down_name}.weight"] for e in range(num_experts)],
            num_experts_per_tok=num_experts_per_tok
            or int(config_value(ctx.config, "num_experts_per_tok")),
            norm_topk_prob=norm,
            activation=config_activation(ctx.config),
        )
        return moe_mlp(x, moe)

    return moe_block


def noaux_tc_routing(x: torch.Tensor, w: Weights, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A DeepSeek-V3-style MoE module's routing (``DeepseekV3TopkRouter``, GLM-5's): its
    ``gate.weight`` and ``gate.e_score_correction_bias`` with the config's
    ``num_experts_per_tok``, ``n_group`` / ``topk_group`` (default 1), ``norm_topk_prob``
    (default true) and ``routed_scaling_factor`` -> ``(experts, weights)`` [T, top_k]
    (:func:`.layers.grouped_topk_routing`)."""
    return grouped_topk_routing(
        x,
        w["gate.weight"],
        w["gate.e_score_correction_bias"],
        int(config_value(config, "num_experts_per_tok")),
        int(config_value(config, "n_group", 1)),
        int(config_value(config, "topk_group", 1)),
        bool(config_value(config, "norm_topk_prob", True)),
        float(config_value(config, "routed_scaling_factor", 1.0)),
    )


def prenorm_decoder_layer(
    hidden: torch.Tensor,
    fns: dict[str, Block],
    weights: dict[str, Weights],
    ctx: LayerContext,
    emit: Callable[[str, torch.Tensor], None],
) -> torch.Tensor:
    """``h += self_attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``."""
    x = fns["input_layernorm"](hidden, weights["input_layernorm"], ctx)
    emit("input_layernorm", x)
    x = fns["self_attn"](x, weights["self_attn"], ctx)
    emit("self_attn", x)
    hidden = hidden + x
    x = fns["post_attention_layernorm"](hidden, weights["post_attention_layernorm"], ctx)
    emit("post_attention_layernorm", x)
    x = fns["mlp"](x, weights["mlp"], ctx)
    emit("mlp", x)
    return hidden + x


def rope_from_config(
    config: Any,
    head_dim: int,
    device: torch.device,
    default_theta: float = 10000.0,
    partial: bool = False,
) -> RotaryEmbedding:
    """cos/sin tables from a config's rope parameters (default, linear, llama3, yarn; both the
    ``rope_parameters`` and the ``rope_theta`` + ``rope_scaling`` spellings). ``partial``: the
    model's rotary embedding reads ``partial_rotary_factor`` (Phi, StableLM, GPT-NeoX: the
    tables cover ``head_dim * factor`` channels); without it a default rope rotates the whole
    head whatever the config says, as the Llama-style modeling files do (``resin new-model``
    sets it from the HF rotary's own output width)."""
    raw = config if isinstance(config, dict) else config.to_dict()
    raw = {k: v for k, v in raw.items() if v is not None}
    max_len = int(raw.get("max_position_embeddings", 2048))
    rope = parse_rope_config(raw, default_theta, max_len, allow_partial=partial)
    inv_freq, attention_scaling = hf_rope_inv_freq(rope, head_dim)
    return RotaryEmbedding(inv_freq, attention_scaling, device)


def rope_tables_from_config(
    config: Any,
    head_dim: int,
    device: torch.device,
    default_theta: float = 10000.0,
    interleaved: bool = False,
) -> dict[str, RotaryEmbedding]:
    """One table per name of a nested ``rope_parameters`` (by layer type, or any names the
    model's layers pick from, e.g. DeepSeek-V4's ``main`` / ``compress``), or ``{"*": table}``
    for a flat one; partial rotary sizes each table (``partial_rotary_factor``)."""
    raw = config if isinstance(config, dict) else config.to_dict()
    raw = {k: v for k, v in raw.items() if v is not None}
    tables = parse_rope_tables(raw, default_theta, int(raw.get("max_position_embeddings", 2048)))
    out = {}
    for name, rope in tables.items():
        inv_freq, attention_scaling = hf_rope_inv_freq(rope, head_dim)
        out[name] = RotaryEmbedding(inv_freq, attention_scaling, device, interleaved)
    return out
