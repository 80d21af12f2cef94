"""The torch reference runner: a Llama-family decoder driven by a ``resin.BatchPlan``.

Owns one model's weights, its paged K/V cache buffers and its :class:`resin.sampling.Sampler`,
and turns each plan into a ``resin.ForwardOutput``: embed the plan's new tokens, run every
decoder layer (K/V written through ``slot_mapping[g]``, read through the page tables of the
layer's cache group ``g``), take the logits of the last token of each sampling row, sample.
Supported: Llama, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm), Qwen3-MoE,
Mixtral. Same code on CPU and CUDA; the device and dtype are chosen at load.

Parity hooks: set ``runner.capture`` to a callable ``(name, tensor)`` or a dict; each forward
then reports, per layer, ``model.layers.{i}.input_layernorm``, ``.self_attn``,
``.post_attention_layernorm``, ``.mlp`` and ``model.layers.{i}`` (the layer output), plus
``model.embed_tokens``, ``model.norm`` and ``lm_head`` — transformers' module names, each
``[T, ...]`` over all of the step's tokens (with capture on, logits are computed for every
token, not only the sampled ones).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resin._core import BatchPlan, CacheLayout, ForwardOutput, LayerCacheSpec
from resin.loading import (
    ModelConfig,
    layer_cache_specs,
    load_model_config,
    rope_inv_freq,
)
from resin.loading.weights import load_weights, moe_expert_names, moe_router_name
from resin.runners.torch.layers import (
    MoeWeights,
    RotaryEmbedding,
    SequenceView,
    apply_rotary,
    build_sequence_views,
    moe_mlp,
    paged_attention,
    plan_tensor,
    rms_norm,
    sampling_rows,
    swiglu_mlp,
    write_kv,
)
from resin.sampling import Sampler

Capture = Callable[[str, torch.Tensor], None] | dict[str, torch.Tensor]


@dataclass
class AttentionWeights:
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None   # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None


@dataclass
class DenseMlpWeights:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


@dataclass
class DecoderLayerWeights:
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    attn: AttentionWeights
    mlp: DenseMlpWeights | MoeWeights


class TorchRunner:
    """Runs a supported HF checkpoint for the engine. Build with :meth:`from_pretrained`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed_tokens)   # tied if absent
        self.final_norm = weights["model.norm.weight"]
        self.layers = [_layer_weights(config, weights, i) for i in range(config.num_hidden_layers)]
        inv_freq, attention_scaling = rope_inv_freq(config.rope, config.head_dim)
        self.rotary = RotaryEmbedding(inv_freq, attention_scaling, device)
        self.sampler = Sampler(config.vocab_size, device)
        self.capture: Capture | None = None
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.group_of_layer: list[int] = []
        self.page_size = 0

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> TorchRunner:
        """Load ``config.json`` and the safetensors weights of ``model_dir`` onto ``device``."""
        config = load_model_config(model_dir)
        device = torch.device(device)
        return cls(config, load_weights(model_dir, config, device=device, dtype=dtype),
                   device, dtype)

    # -- cache ---------------------------------------------------------------------------

    def cache_spec(self) -> list[LayerCacheSpec]:
        """One spec per layer: K and V of every KV head, in the runner's dtype."""
        return layer_cache_specs(self.config, self.dtype.itemsize)

    def bind_cache(self, layout: CacheLayout) -> None:
        """Allocate one K and one V buffer per layer: [num_pages, page_size, kv_heads, head_dim].

        Zero-filled, so page 0 (the null page, never written) reads as zeros.
        """
        shape = (layout.num_pages, layout.page_size, self.config.num_key_value_heads,
                 self.config.head_dim)
        num_layers = self.config.num_hidden_layers
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(num_layers)]
        self.group_of_layer = [layout.group_of_layer(i) for i in range(num_layers)]
        self.page_size = layout.page_size

    # -- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, plan: BatchPlan) -> ForwardOutput:
        if not self.k_caches:
            raise RuntimeError("TorchRunner.forward before bind_cache: create the runner's "
                               "resin.Engine first (it calls bind_cache)")
        self.sampler.begin_step(plan)
        # Plan arrays become tensors with torch.from_numpy (no host copy), moved to the
        # device once per step.
        input_ids = plan_tensor(plan.input_ids, self.device)
        positions = plan_tensor(plan.positions, self.device)
        slot_mappings = [plan_tensor(plan.slot_mapping[g], self.device) for g in range(plan.num_cache_groups)]
        views = self._sequence_views(plan, positions)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)

        hidden = F.embedding(input_ids, self.embed_tokens)
        self._emit("model.embed_tokens", hidden)
        for i, layer in enumerate(self.layers):
            group = self.group_of_layer[i]
            hidden = self._decoder_layer(i, layer, hidden, cos, sin, views[group], slot_mappings[group])

        sample_rows, last_token = sampling_rows(plan)
        if self.capture is not None:
            normed = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
            self._emit("model.norm", normed)
            all_logits = F.linear(normed, self.lm_head)
            self._emit("lm_head", all_logits)
            logits = all_logits[torch.as_tensor(last_token, device=self.device)]
        else:
            last_hidden = hidden[torch.as_tensor(last_token, device=self.device)]
            logits = F.linear(rms_norm(last_hidden, self.final_norm, self.config.rms_norm_eps),
                              self.lm_head)
        return self.sampler.sample(logits.float(), plan, sample_rows)

    def _sequence_views(self, plan: BatchPlan, positions: torch.Tensor) -> list[list[SequenceView]]:
        """Per cache group, each row's readable slots and mask (once per step, not per layer)."""
        views = []
        for group in range(plan.num_cache_groups):
            layer = self.group_of_layer.index(group)
            views.append(build_sequence_views(
                plan.query_indptr, plan.seq_lens, plan.kv_indptr[group], plan.kv_indices[group],
                positions, self.page_size, self.config.layer_window_tokens(layer), self.device))
        return views

    def _decoder_layer(self, index: int, layer: DecoderLayerWeights, hidden: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, views: list[SequenceView],
                       slot_mapping: torch.Tensor) -> torch.Tensor:
        name = f"model.layers.{index}"
        eps = self.config.rms_norm_eps
        x = rms_norm(hidden, layer.input_layernorm, eps)
        self._emit(f"{name}.input_layernorm", x)
        x = self._attention(index, layer.attn, x, cos, sin, views, slot_mapping)
        self._emit(f"{name}.self_attn", x)
        hidden = hidden + x
        x = rms_norm(hidden, layer.post_attention_layernorm, eps)
        self._emit(f"{name}.post_attention_layernorm", x)
        if isinstance(layer.mlp, MoeWeights):
            x = moe_mlp(x, layer.mlp)
        else:
            m = layer.mlp
            x = swiglu_mlp(x, m.gate, m.up, m.down, m.gate_bias, m.up_bias, m.down_bias)
        self._emit(f"{name}.mlp", x)
        hidden = hidden + x
        self._emit(name, hidden)
        return hidden

    def _attention(self, index: int, w: AttentionWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, views: list[SequenceView],
                   slot_mapping: torch.Tensor) -> torch.Tensor:
        num_tokens, head_dim = x.shape[0], self.config.head_dim
        q = F.linear(x, w.q_proj, w.q_bias).view(num_tokens, -1, head_dim)
        k = F.linear(x, w.k_proj, w.k_bias).view(num_tokens, -1, head_dim)
        v = F.linear(x, w.v_proj, w.v_bias).view(num_tokens, -1, head_dim)
        if w.q_norm is not None and w.k_norm is not None:   # Qwen3: per-head RMSNorm before RoPE
            q = rms_norm(q, w.q_norm, self.config.rms_norm_eps)
            k = rms_norm(k, w.k_norm, self.config.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(self.k_caches[index], self.v_caches[index], k, v, slot_mapping)
        out = paged_attention(q, self.k_caches[index], self.v_caches[index], views,
                              head_dim ** -0.5)
        return F.linear(out.reshape(num_tokens, -1), w.o_proj, w.o_bias)

    def _emit(self, name: str, tensor: torch.Tensor) -> None:
        if self.capture is None:
            return
        if isinstance(self.capture, dict):
            self.capture[name] = tensor.detach().clone()
        else:
            self.capture(name, tensor)


def _layer_weights(config: ModelConfig, weights: dict[str, torch.Tensor],
                   index: int) -> DecoderLayerWeights:
    prefix = f"model.layers.{index}"
    attn = f"{prefix}.self_attn"
    attention = AttentionWeights(
        q_proj=weights[f"{attn}.q_proj.weight"], k_proj=weights[f"{attn}.k_proj.weight"],
        v_proj=weights[f"{attn}.v_proj.weight"], o_proj=weights[f"{attn}.o_proj.weight"],
        q_bias=weights.get(f"{attn}.q_proj.bias"), k_bias=weights.get(f"{attn}.k_proj.bias"),
        v_bias=weights.get(f"{attn}.v_proj.bias"), o_bias=weights.get(f"{attn}.o_proj.bias"),
        q_norm=weights.get(f"{attn}.q_norm.weight"), k_norm=weights.get(f"{attn}.k_norm.weight"))
    mlp: DenseMlpWeights | MoeWeights
    if config.is_moe_layer(index):
        assert config.moe is not None
        experts = [moe_expert_names(config, index, e) for e in range(config.moe.num_experts)]
        mlp = MoeWeights(router=weights[moe_router_name(config, index)],
                         gate=[weights[gate] for gate, _, _ in experts],
                         up=[weights[up] for _, up, _ in experts],
                         down=[weights[down] for _, _, down in experts],
                         num_experts_per_tok=config.moe.num_experts_per_tok,
                         norm_topk_prob=config.moe.norm_topk_prob)
    else:
        m = f"{prefix}.mlp"
        mlp = DenseMlpWeights(
            gate=weights[f"{m}.gate_proj.weight"], up=weights[f"{m}.up_proj.weight"],
            down=weights[f"{m}.down_proj.weight"], gate_bias=weights.get(f"{m}.gate_proj.bias"),
            up_bias=weights.get(f"{m}.up_proj.bias"), down_bias=weights.get(f"{m}.down_proj.bias"))
    return DecoderLayerWeights(weights[f"{prefix}.input_layernorm.weight"],
                               weights[f"{prefix}.post_attention_layernorm.weight"],
                               attention, mlp)
