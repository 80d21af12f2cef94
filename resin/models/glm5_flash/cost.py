"""GLM-5.3-Flash's FLOP / byte model for ``resin bench`` (the roofline's per-model hook).

The generic roofline counts standard attention over every raw token and a plain MLP. GLM-5.3-Flash
computes something else, counted here per step from the checkpoint's ``config.json`` (flat or
the ``text_config`` of a wrapper) and each row's new / cached token counts. Notation: ``h``
hidden, ``V`` vocab, ``m`` hyper-connection streams (``hc_mult``), ``mix = (2 + m) * m``;
KDA: ``H`` heads of ``d`` (q, k, v alike), conv kernel ``K``; MLA: ``n`` heads, ``d_n`` /
``d_r`` / ``d_v`` nope / rope / value head dims, ``r_q`` / ``r_kv`` LoRA ranks; indexer:
``n_i`` heads of ``d_i``, pools of ``p`` tokens (``index_kpool``), top ``k_i`` tokens =
``k_i / p`` pools; MoE: ``E`` experts, top ``k``, ``s`` shared, width ``I`` (dense MLPs ``I_d``).

Matmul FLOPs per new token (2 per multiply-add), from the weight shapes of HF's modules:
  * KDA (``linear_attention``): q / k / v ``3*h*H*d``, forget gate ``h*d + d*H*d``, output gate
    ``h*d + d*H*d``, beta ``h*H``, output ``H*d*h``;
  * MLA (``indexed_attention``), absorbed as decode kernels run it (the cache holds the latent
    only): ``h*r_q + r_q*n*(d_n + d_r)`` (q), ``h*(r_kv + d_r)`` (latent), ``r_kv*n*(d_n + d_v)``
    (``kv_b_proj``, applied once per token: queries into latent space, the attended latent back
    to values), ``n*d_v*h`` (output); a ``full``-indexer layer adds ``r_q*n_i*d_i`` (indexer
    queries), ``h*d_i`` (key), ``h*d_i`` (pool gate), ``h*n_i`` (head weights); a ``shared``
    layer reuses the previous layer's selection and adds nothing;
  * MLP: ``dense`` ``3*h*I_d``; ``sparse`` router ``h*E`` + ``(k + s)*3*h*I``;
  * hyper-connections, per site (two a layer): the mixing projection ``mix*m*h``, the collapse
    ``m*h`` and the write-back ``m*h + m*m*h`` (post and comb);
  * LM head ``h*V`` per sampled row (the head's stream mean is not a matmul).
Token-mixer FLOPs (``attention_flops``):
  * KDA per token: the short conv ``2*3*H*d*K``; the gated delta rule on the ``[d, d]`` state
    of each head, ``7*H*d*d`` (decay ``d*d``, ``k^T S``, the rank-1 update and ``q^T S`` ``2*d*d``
    each);
  * MLA per (query, selected token): ``2*n*(r_kv + d_r)`` scores + ``2*n*r_kv`` values. A query
    at position ``t`` selects ``p * min(k_i / p, (t + 1) // p)`` pooled tokens plus its open
    tail ``(t + 1) % p`` (with ``index_kpool_always_select_tail``): every visible token until
    the top-k binds, then a constant;
  * indexer (``full`` layers) per (query, closed pool it sees, ``(t + 1) // p``):
    ``2*n_i*d_i + 2*n_i`` (head scores, their weighted sum); per pool closed this step
    ``2*p*d_i`` (the gate-weighted sum of its keys). The top-k itself is comparisons, not FLOPs.
Bytes (lower bound: every tensor read or written once per step, element size ``e``):
  * weights: every parameter once per step; routed experts: the expected number ``T`` tokens
    touch, ``E*(1 - (1 - k/E)^T)``; the fp32-kept ones (router weight and bias, KDA conv,
    ``A_log``, ``dt_bias``, hyper-connection ``base`` / ``scale``) at 4 bytes; embedding rows
    ``T*h``;
  * cache: KDA reads and writes each row's fp32 state once per step, ``2 * 4 * (3*H*d*(K - 1)
    + H*d*d)`` bytes per row and layer, whatever the row's length; MLA writes ``r_kv + d_r``
    per new token and reads, per row, the latent of the tokens its queries select (at most
    the row's length); a ``full``-indexer layer writes ``2*d_i`` (key, gate) per new token and
    ``d_i`` per pool closed, reads ``2*p*d_i`` per pool closed (its window) and every closed
    pool's key of the row, ``(seq // p) * d_i``;
  * activations: each projection's input and output, the conv and the delta rule's inputs and
    outputs, the MoE's per-expert ``2*h + 3*I``, the ``m`` residual streams read and written
    around both sub-layers, the indexer's scores (written, read by the top-k).

numpy; :func:`load_dims` reads the config through the model directory's
``blocks.normalise_config`` (which imports torch) over ``architecture.json``'s defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from resin.evals.roofline import StepCost

LINEAR = "linear_attention"
INDEXED = "indexed_attention"
FP32_BYTES = 4


@dataclass(frozen=True)
class Glm5FlashDims:
    """The config fields the cost model reads (plus the roofline's ModelDims attributes)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    hc_mult: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    moe: Any = None  # the generic roofline's MoE field (unused: step_cost is the model's own)

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def layer_window_tokens(self, layer_index: int) -> int | None:
        return None

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.mlp_layer_types[layer_index] != "dense"

    def runs_indexer(self, layer_index: int) -> bool:
        return (
            self.layer_types[layer_index] == INDEXED and self.indexer_types[layer_index] != "shared"
        )

    # -- parameters ---------------------------------------------------------------------------

    def _mixer_linears(self, layer_index: int) -> dict[str, int]:
        h = self.hidden_size
        if self.layer_types[layer_index] == LINEAR:
            nh, d = self.linear_num_heads, self.linear_head_dim
            return {
                "qkv": 3 * h * nh * d,
                "forget_gate": h * d + d * nh * d,
                "output_gate": h * d + d * nh * d,
                "beta": h * nh,
                "o_proj": nh * d * h,
            }
        n, dn, dr, dv = (
            self.num_attention_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        rq, rkv = self.q_lora_rank, self.kv_lora_rank
        parts = {
            "q": h * rq + rq * n * (dn + dr),
            "latent": h * (rkv + dr),
            "kv_b": rkv * n * (dn + dv),
            "o_proj": n * dv * h,
            "indexer": 0,
        }
        if self.runs_indexer(layer_index):
            ni, di = self.index_n_heads, self.index_head_dim
            parts["indexer"] = rq * ni * di + 2 * h * di + h * ni
        return parts

    def _mlp_linears(self, layer_index: int) -> dict[str, int]:
        h = self.hidden_size
        if not self.is_moe_layer(layer_index):
            return {"mlp": 3 * h * self.intermediate_size}
        expert = 3 * h * self.moe_intermediate_size
        return {
            "router": h * self.n_routed_experts,
            "experts": self.n_routed_experts * expert,
            "shared_experts": self.n_shared_experts * expert,
        }

    def _small_params(self, layer_index: int) -> tuple[int, int]:
        """(parameters at the runner's dtype, fp32-kept parameters) that are not matmuls:
        norms, the KDA conv and decay, the indexer's norm and pool position table, the router
        bias, the hyper-connection base / scale."""
        h, m = self.hidden_size, self.hc_mult
        mix = (2 + m) * m
        plain = 2 * h  # input / post-attention norms
        fp32 = 2 * (mix + 3)  # two hyper-connection sites: base [mix], scale [3]
        if self.layer_types[layer_index] == LINEAR:
            nh, d, k = self.linear_num_heads, self.linear_head_dim, self.linear_conv_kernel_dim
            plain += d  # o_norm
            fp32 += 3 * nh * d * k + nh + nh * d  # conv, A_log, dt_bias
        else:
            plain += self.q_lora_rank + self.kv_lora_rank  # q_a / kv_a layernorms
            if self.runs_indexer(layer_index):
                plain += 2 * self.index_head_dim + self.index_kpool * self.index_head_dim
        if self.is_moe_layer(layer_index):
            fp32 += self.n_routed_experts  # e_score_correction_bias
        return plain, fp32

    def linear_params(self, layer_index: int) -> dict[str, int]:
        """Every parameter of one layer, by part (every routed expert counted)."""
        h, m = self.hidden_size, self.hc_mult
        plain, fp32 = self._small_params(layer_index)
        return {
            **self._mixer_linears(layer_index),
            **self._mlp_linears(layer_index),
            "hyper_connections": 2 * (2 + m) * m * m * h,
            "small": plain + fp32,
        }

    # -- one step -----------------------------------------------------------------------------

    def step_cost(
        self,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        num_sampled: int,
        dtype_bytes: int,
    ) -> StepCost:
        """FLOPs and bytes of one step (module doc)."""
        q_lens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        seq = ctx + q_lens
        tokens = float(q_lens.sum())
        num_rows = int((q_lens > 0).sum())
        e = dtype_bytes
        h, m, V = self.hidden_size, self.hc_mult, self.vocab_size
        mix = (2 + m) * m
        E, k, s, inter = (
            self.n_routed_experts,
            self.num_experts_per_tok,
            self.n_shared_experts,
            self.moe_intermediate_size,
        )
        touched = E * (1 - (1 - k / E) ** tokens) if tokens else 0.0
        selected = _selected_tokens(ctx, q_lens, self.index_kpool, self._pools_kept(), self._tail())
        seen_pools = _pools_seen(ctx, q_lens, self.index_kpool)
        closed_pools = float((seq // self.index_kpool - ctx // self.index_kpool).sum())
        matmul = attention = weights = kv = acts = 0.0
        for layer in range(self.num_hidden_layers):
            mixer = self._mixer_linears(layer)
            mlp = self._mlp_linears(layer)
            plain, fp32 = self._small_params(layer)
            hc_site = mix * m * h + m * h + m * h + m * m * h
            active_mlp = mlp["mlp"] if "mlp" in mlp else mlp["router"] + (k + s) * 3 * h * inter
            matmul += 2 * tokens * (sum(mixer.values()) + active_mlp + 2 * hc_site)
            hc_weights = 2 * mix * m * h
            if "mlp" in mlp:
                mlp_weight_bytes = float(mlp["mlp"] * e)
                mlp_act = 2 * h + 3 * self.intermediate_size
            else:
                expert = 3 * h * inter
                mlp_weight_bytes = mlp["router"] * FP32_BYTES + (touched + s) * expert * e
                mlp_act = h + E + (k + s) * (2 * h + 3 * inter)
            weights += (sum(mixer.values()) + hc_weights + plain) * e + fp32 * FP32_BYTES
            weights += mlp_weight_bytes
            # residual streams read / written around both sub-layers, the mixing logits, norms
            layer_act = 2 * 2 * m * h + 2 * mix + 2 * 2 * h + mlp_act
            if self.layer_types[layer] == LINEAR:
                nh, d, kk = self.linear_num_heads, self.linear_head_dim, self.linear_conv_kernel_dim
                attention += tokens * (2 * 3 * nh * d * kk + 7 * nh * d * d)
                state = 3 * nh * d * (kk - 1) + nh * d * d
                kv += 2 * num_rows * state * FP32_BYTES
                # projections out (qkv, gates, beta), conv in / out, delta rule out, norm, o_proj
                layer_act += h + 3 * nh * d + 2 * 3 * nh * d + 2 * d + 2 * nh * d + nh
                layer_act += nh * d + 2 * nh * d + nh * d + h
            else:
                n, rkv, dr = self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim
                attention += (2 * n * (rkv + dr) + 2 * n * rkv) * float(_row_sums(selected).sum())
                latent = rkv + dr
                kv += tokens * latent * e
                kv += float(np.minimum(seq, _row_sums(selected)).sum()) * latent * e
                rq, dn, dv = self.q_lora_rank, self.qk_nope_head_dim, self.v_head_dim
                layer_act += h + rq + n * (dn + dr) + latent + 2 * n * (rkv + dr) + n * dv + h
                if self.runs_indexer(layer):
                    ni, di, p = self.index_n_heads, self.index_head_dim, self.index_kpool
                    attention += (2 * ni * di + 2 * ni) * seen_pools + 2 * p * di * closed_pools
                    kv += (tokens * 2 * di + closed_pools * di) * e
                    kv += (closed_pools * 2 * p * di + float((seq // p).sum()) * di) * e
                    layer_act += ni * di + 2 * di + ni
                    acts += 2 * seen_pools * FP32_BYTES  # scores written, read by the top-k
            acts += tokens * layer_act * e
        matmul += 2 * num_sampled * h * V
        weights += (h * V + h) * e + tokens * h * e  # LM head, final norm, embedding rows
        acts += num_sampled * (m * h + h + V) * e
        return StepCost(matmul, attention, weights, kv, acts)

    def _pools_kept(self) -> int:
        return self.index_topk // self.index_kpool

    def _tail(self) -> bool:
        return bool(self.index_kpool_always_select_tail) and self.index_kpool > 1


def _positions(context_lens: np.ndarray, query_lens: np.ndarray) -> list[np.ndarray]:
    return [
        np.arange(start, start + length, dtype=np.int64)
        for start, length in zip(context_lens.tolist(), query_lens.tolist(), strict=True)
    ]


def _selected_tokens(
    context_lens: np.ndarray, query_lens: np.ndarray, kpool: int, pools_kept: int, tail: bool
) -> list[np.ndarray]:
    """Per row, the tokens each new query attends (module doc): the top pools' tokens plus its
    open tail."""
    out = []
    for t in _positions(context_lens, query_lens):
        closed = (t + 1) // kpool
        chosen = kpool * np.minimum(pools_kept, closed)
        out.append(chosen + ((t + 1) % kpool if tail else 0))
    return out


def _row_sums(selected: list[np.ndarray]) -> np.ndarray:
    return np.array([float(s.sum()) for s in selected], dtype=np.float64)


def _pools_seen(context_lens: np.ndarray, query_lens: np.ndarray, kpool: int) -> float:
    """Sum over every new query of the closed pools it sees, ``(t + 1) // kpool``."""
    return float(sum(((t + 1) // kpool).sum() for t in _positions(context_lens, query_lens)))


def load_dims(raw: Mapping[str, Any]) -> Glm5FlashDims:
    """The cost model's dims from a checkpoint's ``config.json`` (flat, or a wrapper's
    ``text_config``) over the config class's defaults (``architecture.json``: a config.json
    omits keys equal to them), with the per-layer lists the config class derives when absent
    (the model directory's ``blocks.normalise_config``)."""
    import json

    from resin.evals.model_ref import import_model_module

    here = _here()
    defaults = json.loads((here / "architecture.json").read_text())["config_defaults"]
    blocks = import_model_module(here, "blocks", "glm5_flash")
    cfg = blocks.normalise_config({**defaults, **dict(raw)})
    layers = int(cfg["num_hidden_layers"])

    def per_layer(key: str) -> tuple[str, ...]:
        values = tuple(str(v) for v in cfg[key])
        if len(values) != layers:
            raise ValueError(f"config.json: {key} lists {len(values)} layers, expected {layers}")
        return values

    return Glm5FlashDims(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(cfg["num_attention_heads"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        n_routed_experts=int(cfg["n_routed_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        n_shared_experts=int(cfg.get("n_shared_experts", 0) or 0),
        q_lora_rank=int(cfg["q_lora_rank"]),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 0) or 0),
        v_head_dim=int(cfg["v_head_dim"]),
        index_n_heads=int(cfg["index_n_heads"]),
        index_head_dim=int(cfg["index_head_dim"]),
        index_topk=int(cfg["index_topk"]),
        index_kpool=int(cfg["index_kpool"]),
        index_kpool_always_select_tail=bool(cfg.get("index_kpool_always_select_tail", True)),
        linear_num_heads=int(cfg["linear_num_heads"]),
        linear_head_dim=int(cfg["linear_head_dim"]),
        linear_conv_kernel_dim=int(cfg["linear_conv_kernel_dim"]),
        hc_mult=int(cfg.get("hc_mult", 1)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=per_layer("layer_types"),
        mlp_layer_types=per_layer("mlp_layer_types"),
        indexer_types=per_layer("indexer_types"),
    )


def _here() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parent
