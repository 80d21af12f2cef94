"""The building blocks of the MLX runners, in plain ``mlx.core``, one function each.

Owns the math the supported decoder layers share, written op for op like the torch reference
runner (:mod:`resin.runners.torch.layers`) and transformers' modeling code, so fp32 agrees to
rounding: RMSNorm (fp32 normalisation, cast back, then the weight), rotary tables at arbitrary
positions from :func:`resin.loading.rope_inv_freq`'s inverse frequencies (every RoPE variant
``resin.loading`` parses: default, linear, llama3, yarn; no second copy of that parsing), the
half-split rotation, the gated MLP (the config's ``hidden_act``) and top-k softmax-routed MoE
(Qwen3-MoE with and without ``norm_topk_prob``, Mixtral). Arrays are token-major: ``[T, ...]`` with T = tokens in the step.

MoE experts run with :func:`mlx.core.gather_mm` on the experts' stacked weights: each token
multiplies only its k chosen experts' matrices, with no host round trip (the torch reference
loops over experts on the host instead; the sums are the same).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from resin.runners.mlx.torch_topk import torch_cpu_topk

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def mlx_dtype(dtype: object) -> mx.Dtype:
    """``float32`` / ``bfloat16`` / ``float16`` (a name, ``torch.bfloat16``'s spelling, or an
    MLX dtype) -> the MLX dtype; ValueError naming the choices otherwise."""
    if isinstance(dtype, mx.Dtype):
        return dtype
    name = str(dtype).removeprefix("torch.").removeprefix("mlx.core.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} for the MLX runner; use {', '.join(DTYPES)}")
    return DTYPES[name]


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ weight.T + bias`` (``nn.Linear``'s layout: weight [out, in]). The bias joins the
    product before it is rounded (``mx.addmm``), as torch's ``F.linear`` (addmm) does: in
    bf16 a separate ``+ bias`` rounds twice and lands one ulp off on about a third of the
    outputs."""
    if bias is None:
        return x @ weight.T
    return mx.addmm(bias, x, weight.T)


def scale(x: mx.array, factor: float) -> mx.array:
    """``x * factor`` for a Python float, as torch computes a half-precision tensor times a
    scalar: in fp32 with the scalar unrounded, then rounded once. (MLX's ``x * factor`` rounds
    the scalar to ``x``'s dtype first: 1.702 becomes bf16 1.703125.)"""
    if x.dtype == mx.float32:
        return x * factor
    return (x.astype(mx.float32) * factor).astype(x.dtype)


def silu(x: mx.array) -> mx.array:
    """``x * sigmoid(x)`` computed in fp32 and rounded once, as torch's ``F.silu`` does for
    bf16 / fp16 (MLX's half-precision sigmoid rounds differently)."""
    x32 = x.astype(mx.float32)
    return (x32 * mx.sigmoid(x32)).astype(x.dtype)


Activation = Callable[[mx.array], mx.array]


def _in_fp32(fn: Activation) -> Activation:
    """``fn`` computed in fp32 and rounded once to the input's dtype (as torch's ``F.gelu`` and
    ``F.silu`` do for half precision)."""
    return lambda x: fn(x.astype(mx.float32)).astype(x.dtype)


_gelu_tanh = _in_fp32(
    lambda x: 0.5 * x * (1.0 + mx.tanh((2.0 / np.pi) ** 0.5 * (x + 0.044715 * x**3)))
)

# ``hidden_act`` values the gated MLP computes (the torch runner's ``GATE_ACTIVATIONS``, the
# same names), each in fp32 and rounded once. In bf16 / fp16 that is torch's rounding for
# ``gelu``, ``gelu_pytorch_tanh`` and ``silu``; transformers' ``gelu_new`` and ``quick_gelu``
# round after each op in the input dtype instead, so there they can differ by an ulp.
GATE_ACTIVATIONS: dict[str, Activation] = {
    "silu": silu,
    "swish": silu,
    "gelu": _in_fp32(lambda x: 0.5 * x * (1.0 + mx.erf(x * (2.0**-0.5)))),
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "quick_gelu": _in_fp32(lambda x: x * mx.sigmoid(1.702 * x)),
    "relu": lambda x: mx.maximum(x, 0),
}


def sigmoid(x: mx.array) -> mx.array:
    """``sigmoid(x)`` computed in fp32 and rounded once, as torch's."""
    return mx.sigmoid(x.astype(mx.float32)).astype(x.dtype)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm over the last dim in fp32, cast back, then the weight (``LlamaRMSNorm``)."""
    x32 = x.astype(mx.float32)
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


class RotaryTable:
    """cos/sin tables for any positions from inverse frequencies (``rope_inv_freq``).

    transformers keeps ``inv_freq`` in fp32 and multiplies positions in fp32; so does this.
    The tables are the frequencies concatenated twice (HF ``rotate_half`` layout), times
    ``attention_scaling`` (YaRN's mscale; 1 otherwise), cast to the runner's dtype.
    """

    def __init__(self, inv_freq: np.ndarray, attention_scaling: float):
        self.inv_freq = mx.array(np.asarray(inv_freq, dtype=np.float32))
        self.attention_scaling = float(attention_scaling)

    def cos_sin(self, positions: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """``positions`` int[T] -> (cos, sin), each [T, rotary_dim] in ``dtype``."""
        freqs = positions.astype(mx.float32)[:, None] * self.inv_freq[None, :]
        angles = mx.concatenate([freqs, freqs], axis=-1)
        cos = mx.cos(angles) * self.attention_scaling
        sin = mx.sin(angles) * self.attention_scaling
        return cos.astype(dtype), sin.astype(dtype)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate ``x`` [T, heads, head_dim] by per-token angles ``cos``/``sin`` [T, rotary_dim]
    (halves, HF ``rotate_half``); with partial rotary the first ``rotary_dim`` channels rotate
    and the rest pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        part, keep = x[..., :rotary_dim], x[..., rotary_dim:]
        return mx.concatenate([apply_rotary(part, cos, sin), keep], axis=-1)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu_mlp(
    x: mx.array,
    gate_w: mx.array,
    up_w: mx.array,
    down_w: mx.array,
    gate_b: mx.array | None = None,
    up_b: mx.array | None = None,
    down_b: mx.array | None = None,
    activation: Activation = silu,
) -> mx.array:
    """``down(act(gate(x)) * up(x))``, ``act`` SiLU unless given (:data:`GATE_ACTIVATIONS`)."""
    return linear(activation(linear(x, gate_w, gate_b)) * linear(x, up_w, up_b), down_w, down_b)


def top_k_indices(scores: mx.array, k: int) -> mx.array:
    """Indices [T, k] of each row's k largest ``scores`` [T, n]: the ones ``torch.topk`` picks
    on the CPU, in its order, ties included (the MoE routers of HF and the torch runners).

    A row whose k + 1 largest values are all distinct (and has no NaN) has one answer, its
    descending order, taken from ``mx.argsort``. A row with a tie among them (frequent on
    bf16 router logits: 8 significant bits) is ambiguous, and torch's pick follows from the
    swaps of libstdc++'s selection (:mod:`.torch_topk`), not from a rule on indices: those
    rows are redone on the host with :func:`~.torch_topk.torch_cpu_topk`. Telling whether any
    row is ambiguous evaluates the scores (one host sync per MoE layer and step)."""
    n = scores.shape[-1]
    order = mx.argsort(-scores, axis=-1)
    head = order[:, : min(k + 1, n)]
    values = mx.take_along_axis(scores, head, axis=-1)
    ambiguous = mx.any(values[:, 1:] == values[:, :-1], axis=-1) | mx.any(mx.isnan(scores), axis=-1)
    if not bool(mx.any(ambiguous).item()):
        return head[:, :k]
    rows = np.flatnonzero(np.array(ambiguous))
    picked = np.array(head[:, :k]).astype(np.int32)
    host = np.array(scores[mx.array(rows.astype(np.int32))].astype(mx.float32))
    for row, row_scores in zip(rows, host, strict=True):
        picked[row] = torch_cpu_topk(row_scores, k)
    return mx.array(picked)


def gathered_matmul(x: mx.array, weights: mx.array, experts: mx.array) -> mx.array:
    """Per token and chosen expert, ``x @ weights[expert]``: ``x`` [T, 1, 1, K] (the same
    input for every expert) or [T, k, 1, K] (one per expert), ``weights`` [E, K, N], ``experts``
    int [T, k] -> [T, k, 1, N].

    MLX's CPU ``gather_mm`` takes float32 only: on the CPU a bf16 / fp16 product is computed
    in fp32 and rounded once (what a half-precision matmul with fp32 accumulation gives);
    Metal runs it in the dtype itself."""
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        wide = mx.gather_mm(x.astype(mx.float32), weights.astype(mx.float32), rhs_indices=experts)
        return wide.astype(x.dtype)
    return mx.gather_mm(x, weights, rhs_indices=experts)


def moe_mlp(
    x: mx.array,
    router: mx.array,
    gate_up: mx.array,
    down: mx.array,
    num_experts_per_tok: int,
    norm_topk_prob: bool,
    activation: Activation = silu,
) -> mx.array:
    """Top-k routed gated experts (``activation`` SiLU unless given), as
    ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``: softmax over all router logits in fp32, keep the top k, renormalise iff
    ``norm_topk_prob``, cast the weights to ``x``'s dtype, weight each chosen expert's output
    and sum. ``router`` [E, hidden]; ``gate_up`` [E, hidden, 2 * width] (each expert's gate
    then up, transposed to ``x @ w``); ``down`` [E, width, hidden]."""
    probs = mx.softmax(linear(x, router).astype(mx.float32), axis=-1)
    experts = top_k_indices(probs, num_experts_per_tok)
    weights = mx.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / mx.sum(weights, axis=-1, keepdims=True)
    weights = weights.astype(x.dtype)
    h = gathered_matmul(x[:, None, None, :], gate_up, experts)  # [T, k, 1, 2 * width]
    gate, up = mx.split(h, 2, axis=-1)
    y = gathered_matmul(activation(gate) * up, down, experts)[:, :, 0, :]  # [T, k, hidden]
    return mx.sum(y * weights[..., None], axis=1)
