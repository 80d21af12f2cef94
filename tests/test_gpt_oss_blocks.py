"""models/gpt_oss/blocks.py against transformers' own gpt-oss modules, on random inputs.

Each block function is called exactly as the shared paged runner calls it (``fn(x, w, ctx)`` with
a :class:`resin.runners.torch.LayerContext`) and compared with the HF module holding the same
weights: RMSNorm (fp32, and bit-exact in bf16), YaRN rotary tables, the router, the clamped
SwiGLU, the whole sparse MLP (HF eager and grouped_mm experts), and attention with sinks read
back through a shuffled paged cache (one prefill, and a chunk whose earlier tokens are already
cached; sliding-window and full layers; page sizes 1, 4, 16). Every test also checks that a
plausible wrong version (Llama's norm order, no sinks, the other layer's window, softmax over
all experts, concatenated gate/up, no expert bias) is *not* within tolerance, so the
tolerances cannot hide a real difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.gpt_oss import modeling_gpt_oss as hf  # noqa: E402

from resin.evals.model_ref import import_model_module  # noqa: E402
from resin.runners.torch.attention import LayerAttention, ReferenceBackend  # noqa: E402
from resin.runners.torch.context import LayerContext  # noqa: E402
from resin.runners.torch.layers import build_sequence_views  # noqa: E402
from resin.runners.torch.layers import rms_norm as llama_rms_norm  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "gpt_oss"
blocks: Any = import_model_module(MODEL_DIR, "blocks", "gpt_oss")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, WINDOW = 32, 4, 2, 8, 4, 2, 8
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config() -> Any:
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rope_parameters=dict(ROPE),
    )
    config._attn_implementation = "eager"
    return config


def _ctx(config: Any, **kwargs: Any) -> LayerContext:
    tokens = torch.zeros(1, dtype=torch.long)
    return LayerContext(
        index=0,
        config=config,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        input_ids=tokens,
        positions=tokens,
        **kwargs,
    )


def _randomise(module: Any, seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)


def _close(got: Any, want: Any) -> bool:
    return bool(torch.allclose(got, want, atol=1e-5, rtol=1e-5))


def _module_weights(module: Any) -> dict[str, Any]:
    return dict(module.named_parameters())


def test_rms_norm_matches_hf() -> None:
    config = _config()
    norm = hf.GptOssRMSNorm(HIDDEN, eps=config.rms_norm_eps)
    _randomise(norm, 1)
    x = torch.randn(9, HIDDEN) * 3
    with torch.no_grad():
        assert _close(blocks.gpt_oss_rms_norm(x, {"weight": norm.weight}, _ctx(config)), norm(x))
        # bf16: the weight multiplies in fp32 before the cast — bit-exact with HF, which
        # Llama's order (cast, then multiply in bf16) is not.
        norm16, x16 = norm.to(torch.bfloat16), x.to(torch.bfloat16)
        got = blocks.gpt_oss_rms_norm(x16, {"weight": norm16.weight}, _ctx(config))
        assert torch.equal(got, norm16(x16))
        assert not torch.equal(llama_rms_norm(x16, norm16.weight, config.rms_norm_eps), norm16(x16))


def test_yarn_rotary_matches_hf() -> None:
    """The block's YaRN tables + Resin's rotate_half rotation == HF's half-split rotation."""
    config = _config()
    rotary = hf.GptOssRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 17, 100, 300])
    cos_hf, sin_hf = rotary(torch.zeros(1), positions[None])
    ours = blocks.gpt_oss_rotary_embedding(config, HEAD_DIM, torch.device("cpu"))
    assert ours.attention_scaling == pytest.approx(rotary.attention_scaling)
    assert ours.attention_scaling > 1.3  # YaRN's mscale is really applied
    cos, sin = ours.cos_sin(positions, torch.float32)
    q = torch.randn(len(positions), HEADS, HEAD_DIM)
    want, _ = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos_hf, sin_hf
    )
    from resin.runners.torch.layers import apply_rotary

    assert _close(apply_rotary(q, cos, sin), want[0].transpose(0, 1))


def test_router_matches_hf() -> None:
    config = _config()
    router = hf.GptOssTopKRouter(config)
    _randomise(router, 2)
    x = torch.randn(11, HIDDEN)
    with torch.no_grad():
        _, hf_scores, hf_experts = router(x)
        scores, experts = blocks.route(x, router.weight, router.bias, TOP_K)
        assert torch.equal(experts, hf_experts)
        assert _close(scores, hf_scores)
        # Without the router bias the choice or the scores change.
        no_bias, no_bias_experts = blocks.route(x, router.weight, torch.zeros(EXPERTS), TOP_K)
        assert not (torch.equal(no_bias_experts, hf_experts) and _close(no_bias, hf_scores))


def test_clamped_swiglu_matches_hf_and_clamps() -> None:
    config = _config()
    experts = hf.GptOssExperts(config)
    gate_up = torch.randn(7, 48) * 6  # large enough that both clamps are active
    assert (gate_up.abs() > config.swiglu_limit).any()
    want = experts._apply_gate(gate_up)
    got = blocks.clamped_swiglu(gate_up, config.swiglu_alpha, config.swiglu_limit)
    assert _close(got, want)
    # Reading the same columns as [gate; up] halves (not interleaved) is a different answer.
    halves = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1)
    assert not _close(blocks.clamped_swiglu(halves, config.swiglu_alpha, config.swiglu_limit), want)
    assert not _close(blocks.clamped_swiglu(gate_up, config.swiglu_alpha, 1e9), want)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_moe_mlp_matches_hf(implementation: str) -> None:
    config = _config()
    config._experts_implementation = implementation
    mlp = hf.GptOssMLP(config)
    _randomise(mlp, 3)
    x = torch.randn(13, HIDDEN)
    with torch.no_grad():
        want, _ = mlp(x[None])
        got = blocks.gpt_oss_mlp(x, _module_weights(mlp), _ctx(config))
        assert _close(got, want[0])
        mlp.experts.down_proj_bias.zero_()  # the expert biases matter
        assert not _close(blocks.gpt_oss_mlp(x, _module_weights(mlp), _ctx(config)), want[0])


def _hf_mask(positions: Any, window: int | None) -> Any:
    """Additive [1, 1, Q, K] mask for queries at ``positions`` over keys 0..max."""
    keys = torch.arange(int(positions.max()) + 1)
    allowed = keys[None, :] <= positions[:, None]
    if window is not None:
        allowed &= keys[None, :] > positions[:, None] - window
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def _paged(
    attn: Any, config: Any, x: Any, window: int | None, cached: int, page_size: int, sinks: Any
) -> Any:
    """``blocks.gpt_oss_attention`` over a shuffled paged cache: tokens [0, cached) in a first
    step (a prefix already cached when the second starts), the rest in a second step, whose
    output is returned."""
    num_tokens = x.shape[0]
    num_pages = -(-num_tokens // page_size)
    pages = np.random.default_rng(0).permutation(np.arange(1, 3 * num_pages + 1))[:num_pages]
    k_cache = torch.zeros(3 * num_pages + 1, page_size, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(num_tokens)
    slots = torch.as_tensor(
        pages[positions.numpy() // page_size] * page_size + positions.numpy() % page_size
    )
    rotary = blocks.gpt_oss_rotary_embedding(config, HEAD_DIM, torch.device("cpu"))
    weights = {**_module_weights(attn), "sinks": sinks}
    out = None
    for chunk in (slice(0, cached), slice(cached, num_tokens)):
        if chunk.stop == chunk.start:
            continue
        chunk_positions = positions[chunk]
        cos, sin = rotary.cos_sin(chunk_positions, torch.float32)
        views = build_sequence_views(
            np.array([0, chunk.stop - chunk.start]),
            np.array([chunk.stop]),
            np.array([0, -(-chunk.stop // page_size)]),
            pages[: -(-chunk.stop // page_size)].astype(np.uint32),
            chunk_positions,
            page_size,
            window,
            torch.device("cpu"),
        )
        backend = ReferenceBackend()
        backend.views = [views]  # what begin_step builds from a plan, for this one row
        attention = LayerAttention(backend, 0, slots[chunk], {"k": k_cache, "v": v_cache})
        ctx = _ctx(config, window=window, cos=cos, sin=sin, attention=attention)
        out = blocks.gpt_oss_attention(x[chunk], weights, ctx)
    return out


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("cached,page_size", [(0, 4), (11, 4), (0, 1), (19, 16)])
def test_attention_with_sinks_matches_hf(layer: int, cached: int, page_size: int) -> None:
    config = _config()
    attn = hf.GptOssAttention(config, layer)
    _randomise(attn, 4 + layer, scale=0.2)
    with torch.no_grad():  # sinks of the size trained ones have: they take real mass
        attn.sinks.copy_(torch.linspace(-1.0, 3.0, HEADS))
    window = WINDOW if config.layer_types[layer] == "sliding_attention" else None
    assert attn.sliding_window == window
    num_tokens = 23
    x = torch.randn(num_tokens, HIDDEN)
    positions = torch.arange(num_tokens)
    cos_hf, sin_hf = hf.GptOssRotaryEmbedding(config)(x, positions[None])
    with torch.no_grad():
        want, _ = attn(x[None], (cos_hf, sin_hf), _hf_mask(positions, window))
        want = want[0, cached:]
        assert _close(_paged(attn, config, x, window, cached, page_size, attn.sinks), want)
        # No sinks (a plain softmax), or the other layer type's window: not equal.
        no_sink = torch.full_like(attn.sinks, -1e9)
        assert not _close(_paged(attn, config, x, window, cached, page_size, no_sink), want)
        other = None if window is not None else WINDOW
        assert not _close(_paged(attn, config, x, other, cached, page_size, attn.sinks), want)
