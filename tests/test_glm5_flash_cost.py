"""resin/models/glm5_flash/cost.py: the FLOP / byte model ``resin bench`` uses for GLM-5.3-Flash.

Checked against numbers worked out by hand from the tiny checkpoint (config in comments), not
by calling the model's own arithmetic: every layer's parameter count equals its tensors in
``model.safetensors``; a decode step's matmul FLOPs follow the checkpoint's weight shapes with
``top_k`` of the routed experts; the token mixers' FLOPs and cache bytes follow the design —
KDA reads and writes a fixed state per row whatever the context, MLA attends the indexer's
top pools plus the open tail, the indexer scores every closed pool, a ``shared`` layer
(layer 3) runs no indexer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from resin.evals.model_ref import import_model_module
from resin.evals.roofline import load_dims, plan_cost

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "glm5_flash"
TINY = MODEL_DIR / "tiny"

# Tiny config: h 64, V 384, hc_mult 4; KDA layers 0, 1, 4: 4 heads of 8, conv kernel 4; indexed
# layers 2 (full indexer) and 3 (shared): 4 heads, kv_lora_rank 32, NoPE (rope dim 0), indexer
# 4 heads of 16, pools of 4 tokens, top-k 8 tokens = 2 pools, tail always selected; MoE on
# layers 1, 2, 4: 8 experts (top 2, 1 shared) of width 32.


@pytest.fixture(scope="module")
def dims():  # type: ignore[no-untyped-def]
    cost = import_model_module(MODEL_DIR, "cost", "glm5_flash")
    return cost.load_dims(json.loads((TINY / "config.json").read_text()))


@pytest.fixture(scope="module")
def shapes() -> dict[str, list[int]]:
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(TINY / "model.safetensors"), "np") as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}


def _layer(shapes: dict[str, list[int]], layer: int) -> dict[str, list[int]]:
    prefix = f"model.layers.{layer}."
    return {n[len(prefix) :]: s for n, s in shapes.items() if n.startswith(prefix)}


def test_parameters_match_the_checkpoint_layer_by_layer(dims, shapes) -> None:  # type: ignore[no-untyped-def]
    for layer in range(5):
        in_checkpoint = sum(int(np.prod(s)) for s in _layer(shapes, layer).values())
        assert sum(dims.linear_params(layer).values()) == in_checkpoint, layer
    assert dims.linear_params(3)["indexer"] == 0 < dims.linear_params(2)["indexer"]


def test_the_roofline_uses_the_model_cost(dims) -> None:  # type: ignore[no-untyped-def]
    loaded, note = load_dims(TINY, MODEL_DIR)
    assert note is not None and "glm5_flash/cost.py" in note
    assert type(loaded).__name__ == "Glm5FlashDims"
    generic, generic_note = load_dims(TINY)  # no model directory: the generic approximation
    assert type(generic).__name__ != "Glm5FlashDims" and "approximation" in (generic_note or "")

    class Plan:  # the plan fields plan_cost reads: one decode row at context 40
        query_indptr = np.array([0, 1], np.uint32)
        num_computed_tokens = np.array([40], np.uint32)
        sample_indptr = np.array([0, 1], np.uint32)

    assert plan_cost(loaded, Plan(), 4) == loaded.step_cost(np.array([1]), np.array([40]), 1, 4)


def test_decode_matmul_flops_follow_the_weights_and_top_k(dims, shapes) -> None:  # type: ignore[no-untyped-def]
    m, h = 4, 64
    expected = 0
    for layer in range(5):
        tensors = _layer(shapes, layer)
        linear = sum(
            int(np.prod(s))
            for n, s in tensors.items()
            if len(s) == 2 and ".experts." not in n and "compress_ape" not in n
        )
        expert = sum(int(np.prod(s)) for n, s in tensors.items() if ".experts.0." in n)
        # the two hyper-connection sites' non-weight products: collapse m*h, post m*h, comb m*m*h
        expected += linear + 2 * expert + 2 * (2 * m * h + m * m * h)
    expected += 384 * 64  # lm_head, one sampled row
    cost = dims.step_cost(np.array([1]), np.array([40]), 1, 4)
    assert cost.matmul_flops == 2 * expected


def test_decode_mixer_flops_and_cache_bytes_by_hand(dims) -> None:  # type: ignore[no-untyped-def]
    # Decode at position 40: 41 tokens; 10 closed pools (none closes now), 2 kept -> 8 tokens,
    # plus the open tail 41 % 4 = 1 -> 9 selected tokens per indexed layer.
    cost = dims.step_cost(np.array([1]), np.array([40]), 1, 4)
    kda = 2 * 3 * 32 * 4 + 7 * 4 * 8 * 8  # conv over 3*4*8 channels, 4 taps; delta rule
    mla = (2 * 4 * 32 + 2 * 4 * 32) * 9  # latent scores + values per selected token
    indexer = (2 * 4 * 16 + 2 * 4) * 10  # layer 2 only: every closed pool scored
    assert cost.attention_flops == 3 * kda + 2 * mla + indexer
    state = 2 * 4 * (3 * 32 * 3 + 4 * 8 * 8)  # fp32 conv (K - 1 = 3) + delta state, read + write
    latent = 4 * (32 + 9 * 32)  # write the new latent, read 9 selected ones
    indexer_bytes = 4 * (2 * 16 + 10 * 16)  # write key + gate, read the 10 pooled keys
    assert cost.kv_bytes == 3 * state + 2 * latent + indexer_bytes

    # Position 43 closes pool 10: 11 closed, 2 kept, empty tail -> 8 tokens; the closing pool
    # is pooled (2*4*16 FLOPs) from its window (2*4*16 values read) and written (16).
    closing = dims.step_cost(np.array([1]), np.array([43]), 1, 4)
    assert closing.attention_flops == (
        3 * kda + 2 * (2 * 4 * 32 + 2 * 4 * 32) * 8 + (2 * 4 * 16 + 2 * 4) * 11 + 2 * 4 * 16
    )
    assert closing.kv_bytes == 3 * state + 2 * 4 * (32 + 8 * 32) + 4 * (
        2 * 16 + 16 + 2 * 4 * 16 + 11 * 16
    )


def test_long_context_costs_grow_only_in_the_indexer(dims) -> None:  # type: ignore[no-untyped-def]
    """KDA work and state traffic are the same at any context; MLA attends a constant top-k;
    only the indexer's pool scoring and key reads grow (1/4 of the tokens), so a long context
    costs a small fraction of full attention over every token."""
    short = dims.step_cost(np.array([1]), np.array([1_000]), 1, 2)
    long = dims.step_cost(np.array([1]), np.array([100_000]), 1, 2)
    pools_delta = 100_001 // 4 - 1_001 // 4
    assert long.attention_flops - short.attention_flops == (2 * 4 * 16 + 2 * 4) * pools_delta
    assert long.kv_bytes - short.kv_bytes == 2 * 16 * pools_delta  # bf16 pooled keys read
    full_attention = 4 * 4 * 16 * 100_001 * 5  # every raw token on every layer
    assert long.attention_flops < 0.2 * full_attention
    # Two decode rows: the fixed KDA state traffic doubles, it does not follow the context.
    two = dims.step_cost(np.array([1, 1]), np.array([1_000, 1_000]), 2, 2)
    state = 2 * 4 * (3 * 32 * 3 + 4 * 8 * 8)
    one_row_other = short.kv_bytes - 3 * state
    assert two.kv_bytes == 2 * 3 * state + 2 * one_row_other
