"""The building blocks of the torch reference runner, in plain torch, one function each.

Owns the math of the supported decoder layers, written to match transformers' modeling code
op for op (so fp32 results agree to rounding): RMSNorm, rotary embeddings at arbitrary
positions, the gated (SwiGLU) MLP with the config's ``hidden_act``, top-k MoE routing
(Qwen3-MoE with and without ``norm_topk_prob``, Mixtral), DeepSeek-V3's grouped ``noaux_tc``
routing and its fused-expert loop (DeepSeek-V3, GLM-5), and each row's readable cache slots
and mask (:func:`build_sequence_views`); paged attention itself is the attention backend's
(:mod:`.attention`). Tensors are token-major: ``[T, ...]`` with T = tokens in the step.

Readability beats speed here: MoE loops over experts. Faster runners are checked against
these functions. Two hot paths take one call where the floats stay torch's: on CPU in fp32 or
bf16, :func:`rms_norm` is ``resin._core.rms_norm`` (the torch lines in one pass, the mean
summed in the order torch's CPU ``sum`` adds a row) and :func:`apply_rotary` is
``resin._core.rotary_embedding`` (torch's expression in torch's order, rounding where torch's
ops round); tests/test_torch_layers.py holds both to HF bit for bit (NaN payloads aside), and
the norm checks each row width on a fixed probe against the torch lines in the process itself.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from resin import _core, kernels
from resin.kernels.numpy_view import numpy_view
from resin.page_views import readable_keys
from resin.runners import gate_activations

# Re-exported: it lives in resin.sampling_state (numpy, shared with the MLX runner).
from resin.sampling_state import sampling_rows as sampling_rows

# False: rms_norm and apply_rotary take their torch lines everywhere (module doc), e.g. for an
# A/B in one process (benchmarks/layer_ops.py). Read on every call.
one_call_paths = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in fp32, as ``LlamaRMSNorm``: ``weight * (x32 *
    rsqrt(mean(x32²) + eps)).to(x.dtype)``.

    On CPU with input and weight both fp32 or both bf16, ``_core.rms_norm``: the same floats in
    one call instead of ~9 ops (docs/benchmarks.md; NaN payloads aside). Its mean restates the
    order in which torch's CPU ``sum`` adds a row (float addition does not associate), so
    before the kernel's first use at a row width a fixed probe (:func:`_probe_agrees`) is
    normalised both ways; a width where the floats differ (a torch that sums another way)
    keeps the torch lines, with a warning."""
    if one_call_paths and _rust_norm_takes(x, weight, eps):
        return _kernel_rms_norm(x, weight, eps)
    return _torch_rms_norm(x, weight, eps)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# The dtypes the one-call paths (_core.rms_norm, _core.rotary_embedding) compute in.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# torch's reductions split one output's elements over threads from this many on (ATen's
# GRAIN_SIZE: `two_pass_reduction`), which sums in another order; a row this wide, alone in
# its call, would differ, so rows this wide take the torch lines.
_TORCH_SPLIT_REDUCTION_ELEMENTS = 32768
_LARGEST_F32 = 3.4028234663852886e38
# Row width -> whether ``_core.rms_norm`` gave the torch lines' floats on the probe.
_norm_width_agrees: dict[int, bool] = {}


def _rust_norm_takes(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """CPU, x and weight one dtype (fp32 or bf16), weight [D] with 8 <= D < 32768 (shorter
    rows take another path in torch's sum, longer ones may be split over threads), eps a
    finite float32 >= 0, x contiguous and not empty, nothing needing grad, and the width's
    probe agreeing with torch."""
    dtype = x.dtype
    return (  # cheapest tests first: this runs twice a layer
        weight.dtype is dtype
        and dtype in _KERNEL_DTYPES
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 1
        and x.dim() >= 1
        and 8 <= weight.shape[0] == x.shape[-1] < _TORCH_SPLIT_REDUCTION_ELEMENTS
        and 0.0 <= eps <= _LARGEST_F32
        and x.numel() > 0
        and not (x.requires_grad or weight.requires_grad)
        and x.is_contiguous()
        and weight.is_contiguous()
        and _width_agrees(weight.shape[0])
    )


def _width_agrees(width: int) -> bool:
    agrees = _norm_width_agrees.get(width)
    if agrees is None:
        agrees = _norm_width_agrees[width] = _probe_agrees(width)
        if not agrees:
            warnings.warn(
                f"resin._core.rms_norm differs from torch {torch.__version__}'s RMSNorm at "
                f"width {width} (its sum adds in another order); using the torch lines",
                RuntimeWarning,
                stacklevel=4,
            )
    return agrees


def _probe_agrees(width: int) -> bool:
    """Whether the kernel and the torch lines give the same floats on a fixed fp32 probe of
    256 rows at ``width``: mixed magnitudes (a few large values among small ones, so that
    another order of additions rounds the mean differently in most rows), weight 1, eps 0.
    One ulp of a row's mean moves about half its outputs' roundings out of reach, so a sum in
    another order changes some output of 256 rows all but surely. The bf16 roundings around
    the sum are the unit tests' (tests/test_torch_layers.py); the sum is the same code."""
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(256, width, generator=gen)
    scales = torch.tensor([1e-3, 1.0, 30.0])[torch.randint(0, 3, (256, width), generator=gen)]
    probe = (rows * scales).contiguous()
    weight = torch.ones(width)
    out = torch.empty_like(probe)
    _core.rms_norm(probe.numpy(), weight.numpy(), 0.0, out.numpy())
    return torch.equal(out, _torch_rms_norm(probe, weight, 0.0))


# id(weight) -> (a weak reference to it, (address, elements, dtype), its numpy view): a norm's
# weight is read twice a layer every step. Kept beside the tensors, not on them (pickles,
# deepcopies); an entry goes when its tensor does.
_weight_arrays: dict[
    int, tuple[weakref.ref[torch.Tensor], tuple[int, int, torch.dtype], np.ndarray]
] = {}


def _weight_array(weight: torch.Tensor) -> np.ndarray:
    """:func:`numpy_view` of a weight, kept while the tensor lives. A view of its memory: in-place
    updates show; new memory behind the tensor (``weight.data = ...``) makes a new view."""
    key = (weight.data_ptr(), weight.numel(), weight.dtype)
    entry = _weight_arrays.get(id(weight))
    if entry is None or entry[0]() is not weight or entry[1] != key:
        wid = id(weight)
        ref = weakref.ref(weight, lambda _, wid=wid: _weight_arrays.pop(wid, None))  # type: ignore[misc]
        entry = _weight_arrays[wid] = (ref, key, numpy_view(weight))
    return entry[2]


def _kernel_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = weight.shape[0]
    out = torch.empty_like(x)
    rows, out_rows = (x, out) if x.dim() == 2 else (x.view(-1, width), out.view(-1, width))
    _core.rms_norm(numpy_view(rows), _weight_array(weight), eps, numpy_view(out_rows))
    return out


class RotaryEmbedding:
    """cos/sin tables for any positions, from ``rope_inv_freq``'s inverse frequencies.

    ``interleaved``: tables for rotating adjacent pairs (GPT-J / DeepSeek style: each frequency
    repeated twice in place) instead of halves (HF ``rotate_half``: frequencies concatenated).
    """

    def __init__(
        self,
        inv_freq: np.ndarray,
        attention_scaling: float,
        device: torch.device,
        interleaved: bool = False,
    ):
        # transformers keeps inv_freq in fp32 and multiplies positions in fp32; so do we.
        self.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
        self.attention_scaling = attention_scaling
        self.interleaved = interleaved

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64[T] -> (cos, sin), each [T, rotary_dim] in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = (
            freqs.repeat_interleave(2, dim=-1)
            if self.interleaved
            else torch.cat((freqs, freqs), dim=-1)
        )
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    trailing: bool = False,
) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by the per-token angles of ``cos``/``sin``
    [T, rotary_dim]: halves (HF ``rotate_half``) or, with ``interleaved``, adjacent pairs.
    Partial rotary (``rotary_dim < head_dim``): the first ``rotary_dim`` channels rotate (the
    last with ``trailing``), the rest pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        if trailing:
            keep, part = x[..., :-rotary_dim], x[..., -rotary_dim:]
            return torch.cat((keep, apply_rotary(part, cos, sin, interleaved=interleaved)), -1)
        part, keep = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((apply_rotary(part, cos, sin, interleaved=interleaved), keep), -1)
    if not interleaved and _rust_rotary_takes(x, cos, sin):
        out = torch.empty_like(x)
        _core.rotary_embedding(numpy_view(x), numpy_view(cos), numpy_view(sin), numpy_view(out))
        return out
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rust_rotary_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``_core.rotary_embedding`` computes this rotation: CPU, all fp32 or all bf16,
    ``x`` [T, H, D] and tables [T, D], all contiguous, D even. It evaluates torch's expression
    in torch's order, rounding where torch's ops round (same floats, one call instead of ~9
    ops: docs/benchmarks.md); anything else takes the torch lines."""
    dtype = x.dtype
    return (  # cheapest tests first: this runs twice a layer (~2 us)
        one_call_paths
        and cos.dtype is dtype
        and sin.dtype is dtype
        and dtype in _KERNEL_DTYPES
        and x.is_cpu
        and cos.is_cpu
        and sin.is_cpu
        and x.dim() == 3
        and cos.shape == sin.shape == (x.shape[0], x.shape[2])
        and x.shape[2] % 2 == 0
        and x.numel() > 0
        and not (x.requires_grad or cos.requires_grad or sin.requires_grad)
        and x.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (GPT-2's tanh approximation), its ops in its order."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``QuickGELUActivation``: ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


# ``hidden_act`` values (transformers' ``ACT2FN`` names) the gated MLP computes, each as
# transformers does; any other is refused by name (:func:`gate_activation`).
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


def gate_activation(hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated MLP's activation for a config's ``hidden_act``; ``ValueError`` naming the
    value and the supported ones for any other (never a silent SiLU)."""
    return gate_activations.gate_activation(hidden_act, GATE_ACTIVATIONS)


def swiglu_mlp(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    gate_b: torch.Tensor | None = None,
    up_b: torch.Tensor | None = None,
    down_b: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` (``act`` SiLU unless the config's ``hidden_act`` says
    otherwise: :func:`gate_activation`), each projection through :data:`resin.kernels.linear`
    (on CPU the Rust decode linear for a few rows, else ``F.linear``; the CUTLASS GEMM when
    ``RESIN_CUTLASS_GEMM=1`` opts in)."""
    linear = kernels.linear
    return linear(activation(linear(x, gate_w, gate_b)) * linear(x, up_w, up_b), down_w, down_b)


@dataclass
class MoeWeights:
    """One sparse MLP: router [E, hidden]; per expert gate/up [width, hidden], down [hidden, width]."""

    router: torch.Tensor
    gate: list[torch.Tensor]
    up: list[torch.Tensor]
    down: list[torch.Tensor]
    num_experts_per_tok: int
    norm_topk_prob: bool
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu


def moe_mlp(x: torch.Tensor, moe: MoeWeights) -> torch.Tensor:
    """Top-k routed SwiGLU experts, as ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``.

    Softmax over all experts in fp32, keep the top k, renormalise iff ``norm_topk_prob``
    (always for Mixtral), weight each chosen expert's output and sum the k slots at once
    (``[T, k, D].sum(dim=1)``): transformers' default ``grouped_mm`` experts dispatch (adding
    them one by one in the model dtype, the eager loop's order, is an ulp off in bf16).
    """
    router_logits = F.linear(x, moe.router)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top_weights, top_experts = torch.topk(probs, moe.num_experts_per_tok, dim=-1)
    if moe.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    top_weights = top_weights.to(x.dtype)
    slots = x.new_zeros(x.shape[0], moe.num_experts_per_tok, x.shape[1])
    for expert in range(len(moe.gate)):
        token_index, slot = torch.where(top_experts == expert)
        if token_index.numel() == 0:
            continue
        y = swiglu_mlp(
            x[token_index],
            moe.gate[expert],
            moe.up[expert],
            moe.down[expert],
            activation=moe.activation,
        )
        slots[token_index, slot] = y * top_weights[token_index, slot, None]
    return slots.sum(dim=1)


@dataclass
class SequenceView:
    """What one sequence (plan row) reads in one cache group this step.

    ``query``: slice of the step's tokens; ``slots``: int64[K] cache slots (page * page_size +
    offset) of the K keys it may read, in position order; ``mask``: bool[query_len, K], True
    where the query may attend the key (causal, inside the sliding window, not past seq_len);
    ``key_positions``: int64[K] the absolute position of each slot's token.
    """

    query: slice
    slots: torch.Tensor
    mask: torch.Tensor
    key_positions: torch.Tensor | None = None


def clamped_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """SwiGLU with the gate clamped from above and the up projection to ``[-limit, limit]``
    (DeepSeek-V4, GLM-5.3-Flash); ``activation`` the config's ``hidden_act``
    (:func:`gate_activation`), SiLU by default."""
    return activation(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def grouped_topk_routing(
    x: torch.Tensor,
    router: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    fp32_logits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's ``noaux_tc`` router (HF ``DeepseekV3TopkRouter``; GLM-5's
    ``Glm5NextTextTopkRouter`` is the same), op for op: fp32 sigmoid scores of ``x @ router.T``
    (computed in fp32; without ``fp32_logits`` in the router weight's dtype, ``x`` cast to it,
    and widened after, as MiniMax-M2's ``MiniMaxM2TopKRouter``);
    choice = scores + ``correction_bias``; the ``num_groups`` expert groups ranked by the sum of
    their top-2 choices, the best ``topk_group`` kept; the ``top_k`` best choices in them. Returns
    ``(experts int64 [T, top_k], weights fp32 [T, top_k])``: the un-biased scores of the chosen
    experts, renormalised iff ``norm_topk_prob`` (+1e-20), times ``scaling``."""
    num_experts = router.shape[0]
    if fp32_logits:
        scores = F.linear(x.float(), router.float()).sigmoid()
    else:
        scores = F.linear(x.to(router.dtype), router).float().sigmoid()
    choice = scores + correction_bias.float()
    per_group = num_experts // num_groups
    group_scores = choice.view(-1, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(-1, num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * scaling


def fused_expert_weights(
    w: dict[str, torch.Tensor], e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s gate [I, D], up [I, D], down [D, I] from a MoE module's tensors: per expert
    as checkpoints store them (``experts.{e}.{gate,up,down}_proj.weight``), or HF's fused
    ``experts.gate_up_proj`` [E, 2I, D] (gate first) / ``experts.down_proj`` [E, D, I]."""
    if "experts.gate_up_proj" in w:
        gate_w, up_w = w["experts.gate_up_proj"][e].chunk(2, dim=0)
        return gate_w, up_w, w["experts.down_proj"][e]
    p = f"experts.{e}."
    return w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"]


def routed_experts(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    experts: torch.Tensor,
    weights: torch.Tensor,
    gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    slot_sum: bool = False,
) -> torch.Tensor:
    """The routed experts of a DeepSeek-V3-style MoE (HF ``DeepseekV3Experts``, GLM-5's): for
    each chosen expert in index order, its tokens slot-major (HF's ``torch.where`` on the
    ``[top_k, T]`` mask), one fused ``gate | up`` matmul, ``down(gated(gate, up))`` times the
    token's routing weight. ``experts`` / ``weights`` [T, k] (:func:`grouped_topk_routing`);
    expert tensors by :func:`fused_expert_weights`. The fused matmul is HF's: in bf16 a GEMM's
    rounding follows its operands' layout. Accumulated as the experts class's eager
    ``forward`` does (``index_add_`` in the model dtype, expert by expert), or with
    ``slot_sum`` as transformers' ``grouped_mm`` / ``batched_mm`` dispatch (its default for a
    causal LM) does: each (token, slot) output times its fp32 weight kept in fp32, the
    ``top_k`` slots summed once, cast back."""
    top_k = experts.shape[1]
    out = (
        x.new_zeros(x.shape[0], top_k, x.shape[1], dtype=torch.float32)
        if slot_sum
        else torch.zeros_like(x)
    )
    for e in torch.unique(experts).tolist():
        slot, token = torch.where(experts.t() == e)
        gate_w, up_w, down_w = fused_expert_weights(w, e)
        gate, up = F.linear(x[token], torch.cat([gate_w, up_w], dim=0)).chunk(2, dim=-1)
        y = F.linear(gated(gate, up), down_w) * weights[token, slot, None]
        if slot_sum:
            out[token, slot] = y.float()
        else:
            out.index_add_(0, token, y.to(out.dtype))
    return out.sum(dim=1).to(x.dtype) if slot_sum else out


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` (``page * page_entries + offset``) of a ``[num_pages, page_entries, ...]``
    cache: a flat index when the cache is contiguous, else (a view into a page row shared
    with other buffers) a page and an offset index."""
    if cache.is_contiguous():
        return cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    per_page = cache.shape[1]
    return cache[slots // per_page, slots % per_page]


def slot_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``cache`` [num_pages, page_entries, ...] as one row per entry, ``(rows, rows_per_page)``,
    when its entries are evenly strided within and across pages (contiguous, or a view into
    page rows shared with other buffers): slot ``page * page_entries + offset`` is row
    ``page * rows_per_page + offset`` of ``rows`` (a strided view over the same memory; rows
    between pages belong to the other buffers and are never addressed). None otherwise."""
    if cache.dim() < 2 or cache.stride(1) <= 0 or cache.stride(0) % cache.stride(1):
        return None
    entry_stride = cache.stride(1)
    rows_per_page = cache.stride(0) // entry_stride
    num_rows = (cache.shape[0] - 1) * rows_per_page + cache.shape[1]
    rows = cache.as_strided(
        (num_rows, *cache.shape[2:]), (entry_stride, *cache.stride()[2:]), cache.storage_offset()
    )
    return rows, rows_per_page


def write_slots(
    cache: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store ``values`` [K, ...] at rows ``slots`` of the cache (see :func:`read_slots`).
    ``rows``: this cache's :func:`slot_rows` view and the slots' row indices in it, when the
    caller has them (worked out once per step for every layer alike)."""
    values = values.to(cache.dtype)
    # index_copy_, not ``flat[slots] = values``: on CPU the indexed assignment is hundreds of
    # times slower (slots are distinct, so the two agree).
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, values)
        return
    if rows is not None:
        rows[0].index_copy_(0, rows[1], values)
        return
    per_page = cache.shape[1]
    cache[slots // per_page, slots % per_page] = values


def build_sequence_views(
    query_indptr: np.ndarray,
    seq_lens: np.ndarray,
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    positions: torch.Tensor,
    page_size: int,
    window_tokens: int | None,
    device: torch.device,
    ratio: int = 1,
) -> list[SequenceView]:
    """Per row: the cache slots its listed pages cover and its attention mask.

    A sliding-window group lists only the pages that intersect the window, so the first
    listed page is logical page ``ceil(seq_len / page_size) - num_listed``
    (docs/batch_plan.md, "Sliding-window group"). A compressed group (``ratio`` > 1) lists the
    pages of its closed entries from entry 0, ``page_size`` (its ``entries_per_page``)
    entries per page; an entry's key position is the position of the token that closes it,
    ``(e + 1) * ratio - 1``, so the causal mask is the visibility rule. The slots and key
    positions are :func:`resin.page_views.readable_keys`' (numpy, shared with the MLX runner),
    moved to ``device``. Built once per step and cache group.
    """
    views = []
    for row in range(len(seq_lens)):
        pages = kv_indices[kv_indptr[row] : kv_indptr[row + 1]]
        host_slots, host_keys = readable_keys(pages, int(seq_lens[row]), page_size, ratio)
        slots = torch.as_tensor(host_slots, device=device)
        key_positions = torch.as_tensor(host_keys, device=device)
        query = slice(int(query_indptr[row]), int(query_indptr[row + 1]))
        query_positions = positions[query][:, None]
        mask = key_positions[None, :] <= query_positions
        if window_tokens is not None:
            mask &= key_positions[None, :] > query_positions - window_tokens
        views.append(SequenceView(query, slots, mask, key_positions))
    return views


def plan_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A plan array as a tensor on ``device`` without a host copy: ``torch.from_numpy`` over the
    Rust-owned memory (uint32 arrays viewed as int32, same bits for values < 2**31). The plan
    is read-only and so are these tensors: torch's "not writable" warning is expected and
    silenced here, and the runner never writes them."""
    if array.dtype == np.uint32:
        array = array.view(np.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).to(device)
