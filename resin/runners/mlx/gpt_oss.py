"""gpt-oss (``GptOssForCausalLM``) on MLX: the blocks of ``resin/models/gpt_oss/blocks.py``
(the torch model directory) written in ``mlx.core``, op for op as transformers'
``modeling_gpt_oss.py``:

- RMSNorm that multiplies by its weight in fp32 *before* casting back (Llama casts first);
- attention with one learned **sink** logit per head, joined to every query's softmax and
  dropped after it, on alternating sliding-window / full layers (each its own cache group);
  q/k/v/o biases; YaRN RoPE (``resin.loading``'s parsing and inverse frequencies);
- the sparse MLP: router with bias, top-k of the logits then a softmax over the k kept; experts
  with a fused, interleaved ``gate_up_proj`` [E, hidden, 2 * width] (gate in even columns, up in
  odd) and biases, the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(gate, limit)``, run on each token's k experts with ``gather_mm``.

The config is parsed by :func:`resin.loading.load_model_config` (which knows gpt-oss);
``swiglu_alpha`` / ``swiglu_limit`` come from ``config.json`` (defaults 1.702 / 7.0). The
keep-in-fp32 patterns per dtype are the shipped model directory's ``architecture.json`` (HF's
``_keep_in_fp32_modules``), so fp16 keeps the norms in fp32 as HF does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from resin.loading import ModelConfig, rope_inv_freq
from resin.runners.mlx.layers import (
    RotaryTable,
    apply_rotary,
    gathered_matmul,
    linear,
    scale,
    sigmoid,
    top_k_indices,
)
from resin.runners.mlx.model import LayerStep, MlxLayer, MlxModel, Weights, split_layer_weights
from resin.runners.mlx.weights import load_tensors

ARCHITECTURE = "GptOssForCausalLM"
SHIPPED_RECORD = Path(__file__).resolve().parents[2] / "models" / "gpt_oss" / "architecture.json"
ATTENTION_TENSORS = ("q_proj", "k_proj", "v_proj", "o_proj")


def gpt_oss_rms_norm(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """GptOssRMSNorm: RMSNorm in fp32, the weight applied before the cast back."""
    x32 = x.astype(mx.float32)
    x32 = x32 * mx.rsqrt(
        mx.mean(x32 * x32, axis=-1, keepdims=True) + float(ctx.config.rms_norm_eps)
    )
    return (w["weight"] * x32).astype(x.dtype)


def gpt_oss_attention(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """GptOssAttention: biased q/k/v, RoPE, paged K/V, attention with per-head sinks over the
    layer's cache group (the window is the group's), biased o_proj."""
    num_tokens, head_dim = x.shape[0], ctx.head_dim
    q = linear(x, w["q_proj.weight"], w["q_proj.bias"]).reshape(num_tokens, -1, head_dim)
    k = linear(x, w["k_proj.weight"], w["k_proj.bias"]).reshape(num_tokens, -1, head_dim)
    v = linear(x, w["v_proj.weight"], w["v_proj.bias"]).reshape(num_tokens, -1, head_dim)
    q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
    out = ctx.attention(q, k, v, scale=head_dim**-0.5, sinks=w["sinks"])
    return linear(out.reshape(num_tokens, -1), w["o_proj.weight"], w["o_proj.bias"])


def clamped_swiglu(gate_up: mx.array, alpha: float, limit: float) -> mx.array:
    """GptOssExperts._apply_gate: gate / up interleaved on the last dim; gate clamped above at
    ``limit``, up to [-limit, limit]; ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1) * (gate * sigmoid(scale(gate, alpha)))


def gpt_oss_mlp(x: mx.array, w: Weights, ctx: LayerStep) -> mx.array:
    """GptOssMLP = GptOssTopKRouter + GptOssExperts: top-k of the biased router logits, softmax
    over the k kept (in the logits' dtype), each chosen expert's
    ``clamped_swiglu(x @ gate_up + b) @ down + b`` weighted by its score and summed."""
    top_k = int(ctx.config.moe.num_experts_per_tok)
    logits = linear(x, w["router.weight"], w["router.bias"])
    experts = top_k_indices(logits, top_k)
    scores = mx.softmax(mx.take_along_axis(logits, experts, axis=-1), axis=-1, precise=True)
    h = gathered_matmul(x[:, None, None, :], w["experts.gate_up_proj"], experts)[:, :, 0, :]
    h = h + w["experts.gate_up_proj_bias"][experts]
    act = clamped_swiglu(h, ctx.extra["swiglu_alpha"], ctx.extra["swiglu_limit"])
    y = gathered_matmul(act[:, :, None, :], w["experts.down_proj"], experts)[:, :, 0, :]
    y = y + w["experts.down_proj_bias"][experts]
    return mx.sum((y * scores[..., None]).astype(x.dtype), axis=1)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor gpt-oss needs (what HF's GptOss modules hold)."""
    assert config.moe is not None
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    experts, width = config.moe.num_experts, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        sizes = {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden)}
        sizes |= {"v_proj": (kv_size, hidden), "o_proj": (hidden, q_size)}
        for name in ATTENTION_TENSORS:
            shapes[f"{p}.self_attn.{name}.weight"] = sizes[name]
            shapes[f"{p}.self_attn.{name}.bias"] = (sizes[name][0],)
        shapes[f"{p}.self_attn.sinks"] = (config.num_attention_heads,)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.router.weight"] = (experts, hidden)
        shapes[f"{p}.mlp.router.bias"] = (experts,)
        shapes[f"{p}.mlp.experts.gate_up_proj"] = (experts, hidden, 2 * width)
        shapes[f"{p}.mlp.experts.gate_up_proj_bias"] = (experts, 2 * width)
        shapes[f"{p}.mlp.experts.down_proj"] = (experts, width, hidden)
        shapes[f"{p}.mlp.experts.down_proj_bias"] = (experts, hidden)
    return shapes


def keep_in_fp32_patterns(dtype: mx.Dtype) -> tuple[str, ...]:
    """The shipped gpt_oss record's keep-in-fp32 patterns for ``dtype`` (none for fp32)."""
    name = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype)
    if name is None or not SHIPPED_RECORD.is_file():
        return ()
    record = json.loads(SHIPPED_RECORD.read_text(encoding="utf-8"))
    return tuple(record.get("keep_in_fp32", {}).get(name, ()))


def gpt_oss_model(model_dir: str | Path, config: ModelConfig, dtype: mx.Dtype) -> MlxModel:
    """Load a gpt-oss checkpoint as an :class:`MlxModel` in ``dtype``."""
    raw: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    flat = load_tensors(
        model_dir,
        expected_shapes(config),
        dtype,
        optional=("lm_head.weight",) if config.tie_word_embeddings else (),
        keep_in_fp32=keep_in_fp32_patterns(dtype),
    )
    globals_, layer_weights = split_layer_weights(flat, config.num_hidden_layers)
    layers = [
        MlxLayer(
            index=i,
            window=config.layer_window_tokens(i),
            blocks={
                "input_layernorm": gpt_oss_rms_norm,
                "self_attn": gpt_oss_attention,
                "post_attention_layernorm": gpt_oss_rms_norm,
                "mlp": gpt_oss_mlp,
            },
            weights=layer_weights[i],
        )
        for i in range(config.num_hidden_layers)
    ]
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
        final_norm=gpt_oss_rms_norm,
        extra={
            "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
        },
    )
