"""The built-in families on MLX: Llama, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k
norm), Qwen3-MoE and Mixtral (top-k MoE), from the checkpoint's config as :mod:`resin.loading`
parses it — the same families, config and tensor checks as the torch reference runner
(:mod:`resin.runners.torch.runner`), with the math of :mod:`.layers`.

Owns the blocks (``fn(x, w, ctx)``, as :mod:`.model` describes) and :func:`llama_family_model`,
which loads the weights (names and shapes checked by
:func:`resin.loading.weights.expected_tensor_shapes`) and stacks each MoE layer's experts for
:func:`~.layers.moe_mlp` (gate and up side by side, transposed to ``x @ w``).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from resin.loading import ModelConfig, rope_inv_freq
from resin.loading.weights import expected_tensor_shapes, moe_expert_names, moe_router_name
from resin.runners import gate_activations
from resin.runners.mlx.layers import (
    GATE_ACTIVATIONS,
    Activation,
    RotaryTable,
    apply_rotary,
    linear,
    moe_mlp,
    rms_norm,
    swiglu_mlp,
)
from resin.runners.mlx.model import (
    LayerStep,
    MlxLayer,
    MlxModel,
    Weights,
    split_layer_weights,
)
from resin.runners.mlx.weights import load_tensors


def rms_norm_block(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """``LlamaRMSNorm``: fp32 normalisation, cast back, then the weight."""
    return rms_norm(x, w["weight"], float(ctx.config.rms_norm_eps))


def gqa_attention_block(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """q/k/v projections (optional biases), optional per-head q/k RMSNorm before RoPE (Qwen3),
    RoPE, K/V written and attended through the layer's paged cache, o projection."""
    num_tokens, head_dim = x.shape[0], ctx.head_dim
    q = linear(x, w["q_proj.weight"], w.get("q_proj.bias")).reshape(num_tokens, -1, head_dim)
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias")).reshape(num_tokens, -1, head_dim)
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias")).reshape(num_tokens, -1, head_dim)
    if "q_norm.weight" in w:
        eps = float(ctx.config.rms_norm_eps)
        q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
    q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
    out = ctx.attention(q, k, v, scale=head_dim**-0.5)
    return linear(out.reshape(num_tokens, -1), w["o_proj.weight"], w.get("o_proj.bias"))


def gate_activation(hidden_act: str) -> Activation:
    """The gated MLP's activation for ``hidden_act``; ``ValueError`` naming the supported ones
    for any other."""
    return gate_activations.gate_activation(hidden_act, GATE_ACTIVATIONS)


def swiglu_mlp_block(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """``down(act(gate(x)) * up(x))`` with optional biases; ``act`` the config's ``hidden_act``."""
    return swiglu_mlp(
        x,
        w["gate_proj.weight"],
        w["up_proj.weight"],
        w["down_proj.weight"],
        w.get("gate_proj.bias"),
        w.get("up_proj.bias"),
        w.get("down_proj.bias"),
        activation=gate_activation(ctx.config.hidden_act),
    )


def topk_moe_block(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """Top-k softmax-routed SwiGLU experts on the stacked weights (``router`` [E, hidden],
    ``gate_up`` [E, hidden, 2 * width], ``down`` [E, width, hidden])."""
    moe = ctx.config.moe
    return moe_mlp(
        x,
        w["router"],
        w["gate_up"],
        w["down"],
        moe.num_experts_per_tok,
        moe.norm_topk_prob,
        activation=gate_activation(ctx.config.hidden_act),
    )


def llama_family_model(model_dir: str | Path, config: ModelConfig, dtype: mx.Dtype) -> MlxModel:
    """Load a built-in-family checkpoint as an :class:`MlxModel` in ``dtype``. A
    ``hidden_act`` the gated MLP does not compute is refused here, at load."""
    gate_activation(config.hidden_act)
    expected = expected_tensor_shapes(config)
    flat = load_tensors(
        model_dir,
        expected,
        dtype,
        optional=("lm_head.weight",) if config.tie_word_embeddings else (),
    )
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            _stack_experts(flat, config, i)
    globals_, layer_weights = split_layer_weights(flat, config.num_hidden_layers)
    layers = []
    for i in range(config.num_hidden_layers):
        layers.append(
            MlxLayer(
                index=i,
                window=config.layer_window_tokens(i),
                blocks={
                    "input_layernorm": rms_norm_block,
                    "self_attn": gqa_attention_block,
                    "post_attention_layernorm": rms_norm_block,
                    "mlp": topk_moe_block if config.is_moe_layer(i) else swiglu_mlp_block,
                },
                weights=layer_weights[i],
            )
        )
    inv_freq, attention_scaling = rope_inv_freq(config.rope, config.head_dim)
    return MlxModel(
        name=config.model_type,
        config=config,
        vocab_size=config.vocab_size,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        layers=layers,
        globals=globals_,
        rotary=RotaryTable(inv_freq, attention_scaling),
        final_norm=rms_norm_block,
    )


def _stack_experts(flat: dict[str, mx.array], config: ModelConfig, layer: int) -> None:
    """Replace layer ``layer``'s per-expert tensors (Mixtral's ``block_sparse_moe`` w1/w3/w2
    included) by ``model.layers.{layer}.mlp.{router, gate_up, down}``."""
    assert config.moe is not None
    gate_up, down = [], []
    for expert in range(config.moe.num_experts):
        gate, up, down_name = moe_expert_names(config, layer, expert)
        gate_up.append(mx.concatenate([flat.pop(gate), flat.pop(up)], axis=0).T)
        down.append(flat.pop(down_name).T)
    prefix = f"model.layers.{layer}.mlp"
    flat[f"{prefix}.router"] = flat.pop(moe_router_name(config, layer))
    flat[f"{prefix}.gate_up"] = mx.stack(gate_up)
    flat[f"{prefix}.down"] = mx.stack(down)
