"""The roofline: FLOPs and bytes moved by one engine step, and the device peaks they are held to.

Owns the cost model ``resin bench`` reports against, computed from the model config
(:class:`resin.loading.ModelConfig`; for an architecture ``resin.loading`` does not parse,
:class:`GenericDims` from the common ``config.json`` keys) and a step's plan arrays, not from
the runner, so a
faster runner is measured against the same work. Per step with ``T`` new tokens, ``S`` rows,
``R`` sampled rows, in the runner's element size ``e`` bytes (``h`` hidden, ``d`` head_dim,
``nq``/``nkv`` query/KV heads, ``I`` MLP width, ``V`` vocab, ``L`` layers):

FLOPs (multiply-add = 2)
  * matmuls: ``2 * T * P_active`` with ``P_active`` = per-layer q/k/v/o projections
    ``h*d*(2*nq + 2*nkv)`` + MLP ``3*h*I`` (MoE: router ``h*E`` + ``(top_k + shared) * 3*h*I_moe``),
    summed over layers; plus the LM head ``2 * R * h * V`` (logits only for sampled rows).
  * attention: ``4 * nq * d`` per (query token, attended key) pair per layer (QK^T and PV);
    a query at position ``p`` attends ``min(p + 1, window)`` keys (causal; counted exactly,
    the masked half of a prefill chunk is not work).

Bytes (lower bound on traffic to device memory, every tensor read or written once)
  * weights: every projection, norm and the LM head once per step; MoE experts: the
    expected number touched by ``T`` tokens, ``E * (1 - (1 - top_k/E)^T)``; embedding rows ``T*h``.
  * KV cache: read each row's visible context once per layer (``min(seq_len, window)`` tokens
    of ``2*nkv*d*e`` bytes), write ``T`` new tokens per layer.
  * activations: each linear reads its input and writes its output, each norm and residual
    add reads and writes ``h``, attention reads q and writes its output (per token per layer).

A model directory whose math this generic model does not describe (compressed attention,
hyper-connections, low-rank projections) ships a ``cost.py`` with ``load_dims(raw_config) ->``
an object with the :class:`ModelDims` attributes and ``step_cost(query_lens, context_lens,
num_sampled, dtype_bytes) -> StepCost``; :func:`load_dims` picks it up and :func:`plan_cost`
uses it (``models/deepseek_v4_flash/cost.py``).

Roofline time = ``max(flops / peak_flops_per_s, bytes / peak_bytes_per_s)``; ``% of roofline``
= roofline time / measured time. The peaks come from :func:`calibrate`: the best of a few
large matmuls (FLOP/s, in the runner's dtype) and large tensor copies (bytes/s counts the read
and the write). They are what torch reaches on this device, not the datasheet.

Only :func:`calibrate` imports torch (inside the function).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from resin.loading import ConfigError, load_model_config
from resin.loading.config import MoeConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StepCost:
    """Work of one step (or the sum over several): FLOPs and bytes moved, split by source."""

    matmul_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "flops": self.flops, "bytes": self.bytes}


ZERO_COST = StepCost(0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class DevicePeaks:
    """What :func:`calibrate` measured: ``peak_flops_per_s`` (matmul, ``dtype``) and
    ``peak_bytes_per_s`` (copy; read + write bytes)."""

    device: str
    dtype: str
    peak_flops_per_s: float
    peak_bytes_per_s: float
    matmul_n: int
    copy_bytes: int
    calibration_s: float

    def roofline_s(self, cost: StepCost) -> float:
        return max(cost.flops / self.peak_flops_per_s, cost.bytes / self.peak_bytes_per_s)

    def bound(self, cost: StepCost) -> str:
        """ "compute" or "memory": which roof the step sits under."""
        compute_s = cost.flops / self.peak_flops_per_s
        return "compute" if compute_s >= cost.bytes / self.peak_bytes_per_s else "memory"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _attended_keys(num_tokens: np.ndarray, window: int | None) -> np.ndarray:
    """``sum_{j=1..n} min(j, window)`` for each n: keys attended by positions 0..n-1."""
    n = num_tokens.astype(np.float64)
    if window is None:
        return n * (n + 1) / 2
    w = float(window)
    return np.where(n <= w, n * (n + 1) / 2, w * (w + 1) / 2 + (n - w) * w)


class ModelDims(Protocol):
    """What :func:`step_cost` reads: satisfied by :class:`resin.loading.ModelConfig` and by
    :class:`GenericDims`."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def moe(self) -> MoeConfig | None: ...

    def layer_window_tokens(self, layer_index: int) -> int | None: ...
    def is_moe_layer(self, layer_index: int) -> bool: ...


@dataclass(frozen=True)
class GenericDims:
    """Shapes read from any HF ``config.json`` by the common key names, for an architecture
    :func:`resin.loading.load_model_config` does not parse (a model being brought up). An
    approximation: every layer is a standard attention block (q/k/v/o) plus a SwiGLU MLP or
    routed experts; MLA, linear attention and other layer kinds are costed as standard ones."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    window_of_layer: tuple[int | None, ...]
    moe: MoeConfig | None

    def layer_window_tokens(self, layer_index: int) -> int | None:
        return self.window_of_layer[layer_index]

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.moe is not None and layer_index in self.moe.moe_layer_indices


def generic_dims(raw: Mapping[str, Any]) -> GenericDims:
    """:class:`GenericDims` from a parsed ``config.json`` (its ``text_config`` if it has one).
    Keys: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads (default: heads), head_dim (default hidden/heads), vocab_size,
    max_position_embeddings (default 4096), sliding_window + layer_types ("sliding_attention"),
    num_experts | num_local_experts | n_routed_experts, num_experts_per_tok,
    moe_intermediate_size, n_shared_experts, and which layers are sparse: first_k_dense_replace,
    mlp_only_layers, decoder_sparse_step. ValueError names a missing key."""
    cfg = raw.get("text_config") or raw

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"config.json: '{key}' must be a positive integer for the roofline, got {value!r}"
            )
        return value

    h, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        windows = tuple(window if k == "sliding_attention" else None for k in kinds)
    else:
        windows = (window,) * layers
    num_experts = next(
        (
            cfg[k]
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if isinstance(cfg.get(k), int) and cfg[k] > 0
        ),
        None,
    )
    moe = None
    if num_experts is not None:
        first_dense = cfg.get("first_k_dense_replace") or 0
        dense = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step") or 1
        moe = MoeConfig(
            num_experts=num_experts,
            num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=cfg.get("moe_intermediate_size") or need("intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layer_indices=tuple(
                i for i in range(first_dense, layers) if i not in dense and (i + 1) % step == 0
            ),
            num_shared_experts=cfg.get("n_shared_experts") or 0,
        )
    intermediate = cfg.get("intermediate_size") or (moe.moe_intermediate_size if moe else None)
    if not isinstance(intermediate, int) or intermediate <= 0:
        raise ValueError(
            "config.json: 'intermediate_size' must be a positive integer for the "
            f"roofline, got {intermediate!r}"
        )
    return GenericDims(
        architecture=str((raw.get("architectures") or ["unknown"])[0]),
        vocab_size=need("vocab_size"),
        hidden_size=h,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or h // heads,
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
        window_of_layer=windows,
        moe=moe,
    )


def load_dims(
    checkpoint_dir: str | Path, model_dir: str | Path | None = None
) -> tuple[ModelDims, str | None]:
    """The model's dims for the roofline and the engine sizing: the model directory's own cost
    model (``model_dir/cost.py``) when it has one; else :class:`ModelConfig` when
    ``resin.loading`` parses the architecture, else :class:`GenericDims` and a note saying so."""
    if model_dir is not None and (Path(model_dir) / "cost.py").is_file():
        from resin.evals.model_ref import import_model_module

        module = import_model_module(Path(model_dir), "cost", Path(model_dir).name)
        raw = json.loads((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8"))
        return module.load_dims(raw), (
            f"FLOPs and bytes from {Path(model_dir).name}/cost.py (the model's own cost model)"
        )
    try:
        return load_model_config(checkpoint_dir), None
    except ConfigError as exc:
        if "unsupported architecture" not in str(exc):
            raise
    raw = json.loads((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8"))
    dims = generic_dims(raw)
    return dims, (
        f"{dims.architecture} is not parsed by resin.loading: FLOPs and bytes come from "
        "generic config.json keys (standard attention + MLP/experts per layer), an "
        "approximation"
    )


def step_cost(
    config: ModelDims,
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    num_sampled: int,
    dtype_bytes: int,
) -> StepCost:
    """FLOPs and bytes of one step (module doc). ``query_lens`` int[S]: new tokens per row;
    ``context_lens`` int[S]: tokens already cached per row; ``num_sampled``: rows that sample
    (the LM head runs only for those); ``dtype_bytes``: element size of weights, KV and
    activations."""
    c = config
    query_lens = np.asarray(query_lens, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    seq_lens = context_lens + query_lens
    num_tokens = float(query_lens.sum())
    h, d, nq, nkv, e = (
        c.hidden_size,
        c.head_dim,
        c.num_attention_heads,
        c.num_key_value_heads,
        dtype_bytes,
    )
    attn_params = h * d * (2 * nq + 2 * nkv)
    kv_token_bytes = 2 * nkv * d * e
    matmul_flops = attention_flops = weight_bytes = kv_bytes = activation_bytes = 0.0
    for layer in range(c.num_hidden_layers):
        window = c.layer_window_tokens(layer)
        if c.is_moe_layer(layer):
            assert c.moe is not None
            m = c.moe
            expert_params = 3 * h * m.moe_intermediate_size
            shared_params = m.num_shared_experts * expert_params  # run for every token
            active_params = (
                h * m.num_experts + m.num_experts_per_tok * expert_params + shared_params
            )
            touched = m.num_experts * (
                1 - (1 - m.num_experts_per_tok / m.num_experts) ** num_tokens
            )
            mlp_weight_params = h * m.num_experts + touched * expert_params + shared_params
            mlp_act = (
                h
                + m.num_experts
                + (m.num_experts_per_tok + m.num_shared_experts)
                * (h + 3 * m.moe_intermediate_size + h)
            )
        else:
            active_params = mlp_weight_params = 3 * h * c.intermediate_size
            mlp_act = h + 3 * c.intermediate_size + h  # gate/up in, 2I out, act I, down -> h
        matmul_flops += 2 * num_tokens * (attn_params + active_params)
        pairs = float(
            (_attended_keys(seq_lens, window) - _attended_keys(context_lens, window)).sum()
        )
        attention_flops += 4 * nq * d * pairs
        weight_bytes += (attn_params + mlp_weight_params + 2 * h) * e  # + two norm weights
        visible = seq_lens if window is None else np.minimum(seq_lens, window)
        kv_bytes += float(visible.sum()) * kv_token_bytes + num_tokens * kv_token_bytes
        per_token = (
            h
            + (nq + 2 * nkv) * d  # qkv projection in, out
            + 2 * nq * d  # attention reads q, writes its output
            + nq * d
            + h  # o projection in, out
            + 2 * 2 * h
            + 2 * 3 * h  # two norms (in, out), two residual adds
            + mlp_act
        )
        activation_bytes += num_tokens * per_token * e
    matmul_flops += 2 * num_sampled * h * c.vocab_size
    weight_bytes += (h * c.vocab_size + h) * e + num_tokens * h * e  # LM head, final norm, embed
    activation_bytes += num_sampled * (h + c.vocab_size) * e
    return StepCost(matmul_flops, attention_flops, weight_bytes, kv_bytes, activation_bytes)


def plan_cost(config: ModelDims, plan: Any, dtype_bytes: int) -> StepCost:
    """:func:`step_cost` of a :class:`resin.BatchPlan` (its rows' query and context lengths),
    or the model's own ``step_cost`` when its dims carry one (a model directory's ``cost.py``)."""
    own = getattr(config, "step_cost", None)
    if own is not None:
        return own(
            np.diff(plan.query_indptr.astype(np.int64)),
            plan.num_computed_tokens,
            int(plan.sample_indptr[-1]),
            dtype_bytes,
        )
    return step_cost(
        config,
        np.diff(plan.query_indptr.astype(np.int64)),
        plan.num_computed_tokens,
        int(plan.sample_indptr[-1]),
        dtype_bytes,
    )


def calibrate(device: str, dtype: str, repeats: int = 5) -> DevicePeaks:
    """Measure the device's matmul FLOP/s and copy bytes/s (best of ``repeats`` after one
    warm-up). Sizes: 1024^2 matmul and 64 MiB copy on CPU; 8192^2 and 1 GiB on CUDA."""
    import torch

    started = time.perf_counter()
    torch_device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    cuda = torch_device.type == "cuda"
    n = 8192 if cuda else 1024
    copy_bytes = (1 << 30) if cuda else (64 << 20)

    def best_time(fn: Any) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(torch_device)
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        return best

    with torch.inference_mode():
        a = torch.randn(n, n, device=torch_device).to(torch_dtype)
        b = torch.randn(n, n, device=torch_device).to(torch_dtype)
        out = torch.empty(n, n, device=torch_device, dtype=torch_dtype)
        matmul_s = best_time(lambda: torch.matmul(a, b, out=out))
        a = b = out = torch.empty(0)  # free the matrices before the copy buffers
        src = torch.ones(copy_bytes // 4, device=torch_device, dtype=torch.float32)
        dst = torch.empty_like(src)
        copy_s = best_time(lambda: dst.copy_(src))
    return DevicePeaks(
        device=str(torch_device),
        dtype=dtype,
        peak_flops_per_s=2 * n**3 / matmul_s,
        peak_bytes_per_s=2 * copy_bytes / copy_s,
        matmul_n=n,
        copy_bytes=copy_bytes,
        calibration_s=time.perf_counter() - started,
    )
