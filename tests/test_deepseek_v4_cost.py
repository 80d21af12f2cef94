"""models/deepseek_v4_flash/cost.py: the FLOP / byte model ``resin bench`` uses for DeepSeek-V4.

Its weight counts match the tiny checkpoint's tensors layer by layer (low-rank q / output,
MQA K = V, compressors, the indexer, routed and shared experts, hyper-connection mixing), the
roofline picks it up for the model directory, and the attention work follows the compressed
design: a query reads its window plus the entries it sees (CSA: the indexer's top-k), so a long
context costs far less than full attention over every raw token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from resin.evals.model_ref import import_model_module
from resin.evals.roofline import load_dims, plan_cost

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "deepseek_v4_flash"
TINY = MODEL_DIR / "tiny"


@pytest.fixture(scope="module")
def dims():  # type: ignore[no-untyped-def]
    cost = import_model_module(MODEL_DIR, "cost", "deepseek_v4_flash")
    return cost.load_dims(json.loads((TINY / "config.json").read_text()))


def test_linear_weights_match_the_checkpoint_layer_by_layer(dims) -> None:  # type: ignore[no-untyped-def]
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(TINY / "model.safetensors"), "np") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    skip = re.compile(r"(norm|ape|attn_sink|tid2eid|hc_\w+_(base|scale))")
    for layer, layer_type in enumerate(dims.layer_types):
        prefix = f"model.layers.{layer}."
        in_checkpoint = sum(
            int(np.prod(shape))
            for name, shape in shapes.items()
            if name.startswith(prefix) and len(shape) == 2 and not skip.search(name)
        )
        assert sum(dims.linear_params(layer_type).values()) == in_checkpoint, (layer, layer_type)


def test_the_roofline_uses_the_model_cost(dims) -> None:  # type: ignore[no-untyped-def]
    loaded, note = load_dims(TINY, MODEL_DIR)
    assert note is not None and "cost.py" in note
    assert type(loaded).__name__ == "DeepseekV4Dims"
    generic, _ = load_dims(TINY)  # no model directory: the generic approximation
    assert type(generic).__name__ != "DeepseekV4Dims"

    class Plan:  # the plan fields plan_cost reads: one decode row at context 40
        query_indptr = np.array([0, 1], np.uint32)
        num_computed_tokens = np.array([40], np.uint32)
        sample_indptr = np.array([0, 1], np.uint32)

    assert plan_cost(loaded, Plan(), 2) == loaded.step_cost(np.array([1]), np.array([40]), 1, 2)


def test_attention_follows_the_compressed_design(dims) -> None:  # type: ignore[no-untyped-def]
    n, d = dims.num_attention_heads, dims.head_dim
    # One decode query at position p = 63 (context 63): window 8 keys on every layer; CSA
    # (ratio 4) attends min(top-k 3, 16) entries and scores all 16; HCA (ratio 8) reads all 8.
    cost = dims.step_cost(np.array([1]), np.array([63]), 1, 4)
    window, csa_scored, csa_attended, hca = 8, 16, 3, 8
    ni, di = dims.index_n_heads, dims.index_head_dim
    kinds = list(dims.layer_types)
    expected = (
        4 * n * d * window * len(kinds)
        + kinds.count("compressed_sparse_attention")
        * (4 * n * d * csa_attended + 2 * ni * di * csa_scored)
        + kinds.count("heavily_compressed_attention") * 4 * n * d * hca
    )
    assert cost.attention_flops == expected
    # A long context: the compressed layers' work grows with entries, not raw tokens, so it is
    # a small fraction of full attention's over every token.
    long = dims.step_cost(np.array([1]), np.array([100_000]), 1, 2)
    full_attention = 4 * n * d * 100_001 * len(kinds)  # every raw token on every layer
    assert long.attention_flops < 0.2 * full_attention
    # More context only adds entries (HCA reads all, CSA scores all): monotone, sub-linear in
    # raw tokens on the compressed layers.
    longer = dims.step_cost(np.array([1]), np.array([200_000]), 1, 2)
    assert long.attention_flops < longer.attention_flops < 2 * long.attention_flops
