"""``resin.loading.rope``: RoPE config from both spellings, and ``rope_inv_freq``.

The inverse frequencies are checked three ways: against formulas written here (default,
linear), against hand-checkable properties (llama3 bands, the YaRN ramp and attention
factor), and against transformers' own ``modeling_rope_utils`` functions run on a float32
numpy stand-in for torch. A last test compares with the real ``ROPE_INIT_FUNCTIONS`` and is
skipped unless torch is importable.
"""

from __future__ import annotations

import copy
import math
import types
from typing import Any

import numpy as np
import pytest
import transformers  # noqa: E402  (test dependency, installed by make; fail loudly if missing)
from hf_configs import LLAMA31_8B, MIXTRAL_8X7B, QWEN25_7B

from resin.loading import RopeConfig, load_model_config, rope_inv_freq
from resin.loading.rope import parse_rope_config

ROPE_SPELLINGS = [
    ({"rope_type": "linear", "factor": 2.0}, RopeConfig("linear", 10000.0, factor=2.0)),
    ({"type": "linear", "factor": 2.0}, RopeConfig("linear", 10000.0, factor=2.0)),
    (LLAMA31_8B["rope_scaling"], None),
    (QWEN25_7B["rope_scaling"], None),
    (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        None,
    ),
]


@pytest.mark.parametrize("scaling,expected", ROPE_SPELLINGS)
def test_both_rope_spellings_give_the_same_rope_config(
    scaling: dict[str, Any], expected: RopeConfig | None
) -> None:
    base = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    legacy = load_model_config({**base, "rope_theta": 10000.0, "rope_scaling": scaling}).rope
    v5 = load_model_config({**base, "rope_parameters": {**scaling, "rope_theta": 10000.0}}).rope
    via_hf = load_model_config(
        transformers.LlamaConfig(
            **copy.deepcopy({**base, "rope_theta": 10000.0, "rope_scaling": scaling})
        ).to_dict()
    ).rope
    assert legacy == v5 == via_hf
    if expected is not None:
        assert legacy == expected


def test_rope_precedence_follows_transformers() -> None:
    base = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    # The dict's own rope_theta wins over the top-level key; rope_type wins over legacy type.
    rope = load_model_config(
        {
            **base,
            "rope_theta": 9.0,
            "rope_parameters": {
                "rope_theta": 7.0,
                "rope_type": "linear",
                "type": "yarn",
                "factor": 2.0,
            },
        }
    ).rope
    assert rope == RopeConfig("linear", 7.0, factor=2.0)
    # No rope keys at all: the architecture's default theta (Mixtral's is 1e6).
    assert load_model_config(base).rope == RopeConfig(theta=10000.0)
    mixtral = {k: v for k, v in MIXTRAL_8X7B.items() if k != "rope_theta"}
    assert load_model_config(mixtral).rope.theta == 1e6
    # yarn without factor: max_position_embeddings / original (modeling_rope_utils).
    yarn = load_model_config(
        {
            **QWEN25_7B,
            "max_position_embeddings": 131072,
            "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32768},
        }
    ).rope
    assert yarn.factor == 4.0


def reference_default(theta: float, dim: int) -> np.ndarray:
    return np.array([theta ** (-(2.0 * i) / dim) for i in range(dim // 2)])


def test_rope_default_and_linear_match_the_formula() -> None:
    inv_freq, scale = rope_inv_freq(RopeConfig(theta=500000.0), head_dim=128)
    assert inv_freq.dtype == np.float64 and inv_freq.shape == (64,) and scale == 1.0
    np.testing.assert_allclose(inv_freq, reference_default(500000.0, 128), rtol=1e-14)
    linear, scale = rope_inv_freq(RopeConfig("linear", 10000.0, factor=4.0), head_dim=64)
    np.testing.assert_allclose(linear, reference_default(10000.0, 64) / 4.0, rtol=1e-14)
    assert scale == 1.0


def test_rope_llama3_bands() -> None:
    rope = load_model_config(LLAMA31_8B).rope
    inv_freq, scale = rope_inv_freq(rope, head_dim=128)
    base = reference_default(500000.0, 128)
    wavelen_tokens = 2 * math.pi / base
    high = wavelen_tokens < 8192 / 4.0  # short wavelengths: untouched
    low = wavelen_tokens > 8192 / 1.0  # long wavelengths: divided by factor 8
    mid = ~high & ~low
    assert scale == 1.0 and high.sum() > 0 and low.sum() > 0 and mid.sum() > 0
    np.testing.assert_allclose(inv_freq[high], base[high], rtol=1e-14)
    np.testing.assert_allclose(inv_freq[low], base[low] / 8.0, rtol=1e-14)
    ratio = base[mid] / inv_freq[mid]
    assert np.all((ratio > 1.0) & (ratio < 8.0)) and np.all(np.diff(ratio) > 0)
    # In the band: smooth = (8192 / wavelen - 1) / (4 - 1); f = (1 - smooth) f / 8 + smooth f.
    smooth = (8192 / wavelen_tokens[mid] - 1.0) / 3.0
    np.testing.assert_allclose(inv_freq[mid], base[mid] * ((1 - smooth) / 8.0 + smooth), rtol=1e-14)


def test_rope_yarn_ramp_and_attention_factor() -> None:
    rope = load_model_config(QWEN25_7B).rope
    inv_freq, scale = rope_inv_freq(rope, head_dim=128)
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-15)
    base = reference_default(1e6, 128)

    def correction_dim(num_rotations: float) -> float:
        return 128 * math.log(32768 / (num_rotations * 2 * math.pi)) / (2 * math.log(1e6))

    low, high = math.floor(correction_dim(32)), math.ceil(correction_dim(1))
    assert (low, high) == (23, 40)
    ratio = base / inv_freq
    np.testing.assert_allclose(ratio[: low + 1], 1.0, rtol=1e-14)  # fast dims extrapolate
    np.testing.assert_allclose(ratio[high:], 4.0, rtol=1e-14)  # slow dims interpolate
    assert np.all(np.diff(ratio[low : high + 1]) > 0)
    ramp = (np.arange(64) - low) / (high - low)
    i = 30
    assert inv_freq[i] == pytest.approx(base[i] / 4 * ramp[i] + base[i] * (1 - ramp[i]), rel=1e-14)
    # DeepSeek style mscale == mscale_all_dim: the attention factor cancels to 1.
    deepseek = RopeConfig(
        "yarn",
        10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert rope_inv_freq(deepseek, 64)[1] == 1.0
    explicit = RopeConfig(
        "yarn", 10000.0, factor=4.0, original_max_position_embeddings=4096, attention_factor=0.5
    )
    assert rope_inv_freq(explicit, 64)[1] == 0.5


class _FakeTensor(np.ndarray):
    """Just enough of ``torch.Tensor`` for modeling_rope_utils' numpy-expressible functions."""

    def to(self, device: Any = None, dtype: Any = None) -> _FakeTensor:
        return self if dtype is None else self.astype(dtype).view(_FakeTensor)


def _fake_torch() -> types.SimpleNamespace:
    def arange(*args: Any, dtype: Any = None) -> _FakeTensor:
        return np.arange(*args, dtype=dtype or np.int64).view(_FakeTensor)

    def clamp(x: np.ndarray, low: float, high: float) -> _FakeTensor:
        return np.clip(x, low, high).view(_FakeTensor)

    return types.SimpleNamespace(
        arange=arange,
        clamp=clamp,
        where=np.where,
        float=np.float32,
        float32=np.float32,
        int64=np.int64,
    )


HF_ROPE_CASES = [
    (
        "dynamic",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "dynamic", "factor": 4.0},
            "max_position_embeddings": 4096,
        },
    ),
    ("linear", {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    (
        "llama3",
        {
            "rope_theta": LLAMA31_8B["rope_theta"],
            "rope_scaling": LLAMA31_8B["rope_scaling"],
            "max_position_embeddings": 131072,
        },
    ),
    (
        "yarn",
        {
            "rope_theta": 1e6,
            "rope_scaling": QWEN25_7B["rope_scaling"],
            "max_position_embeddings": 32768,
        },
    ),
    (
        "yarn",
        {
            "rope_theta": 10000.0,
            "max_position_embeddings": 163840,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
        },
    ),
]


def _hf_case(extra: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    kwargs = dict(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        **extra,
    )
    raw = copy.deepcopy({**LLAMA31_8B, **kwargs})
    return transformers.LlamaConfig(**copy.deepcopy(kwargs)), raw


@pytest.mark.parametrize("rope_type,extra", HF_ROPE_CASES)
def test_rope_matches_transformers_source_on_numpy(
    monkeypatch: pytest.MonkeyPatch, rope_type: str, extra: dict[str, Any]
) -> None:
    """Runs transformers' own init function, with a float32 numpy stand-in for torch."""
    from transformers import modeling_rope_utils as mru

    monkeypatch.setattr(mru, "torch", _fake_torch(), raising=False)
    hf, raw = _hf_case(extra)
    theirs, their_scale = mru.ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    cfg = load_model_config(raw)
    ours, our_scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    assert cfg.rope.rope_type == rope_type and theirs.dtype == np.float32
    np.testing.assert_allclose(ours.astype(np.float32), np.asarray(theirs), rtol=1e-6, atol=0)
    assert our_scale == their_scale


@pytest.mark.parametrize("rope_type,extra", HF_ROPE_CASES)
def test_rope_matches_transformers_with_torch(rope_type: str, extra: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, raw = _hf_case(extra)
    theirs, their_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    cfg = load_model_config(raw)
    ours, our_scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    # float32 pow on CPU may differ from the float64 result rounded to float32 by an ulp or two.
    np.testing.assert_allclose(ours.astype(np.float32), theirs.numpy(), rtol=1e-6, atol=0)
    assert our_scale == their_scale


def test_dynamic_rope_is_refused_past_the_pretrained_length() -> None:
    """Inside ``max_position_embeddings`` transformers' dynamic NTK rope is the default one;
    past it transformers re-rotates every position at each step, which a KV cache cannot:
    such a ``max_model_len`` is refused, naming the limit."""
    from resin.loading import ConfigError
    from resin.loading.rope import check_rope_length

    base = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    rope = load_model_config(
        {**base, "max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2}}
    ).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == (
        "dynamic",
        2.0,
        2048,
    )
    default = RopeConfig(theta=rope.theta)
    np.testing.assert_array_equal(rope_inv_freq(rope, 128)[0], rope_inv_freq(default, 128)[0])
    check_rope_length(rope, 2048)
    with pytest.raises(
        ConfigError, match="max_model_len 2049 is past max_position_embeddings 2048"
    ):
        check_rope_length(rope, 2049)
    check_rope_length(default, 10**6)  # the others are not limited here


HF_DEFAULT_CASES = [
    ("default", {"rope_theta": theta}) for theta in (10000.0, 500000.0, 1000000.0, 150000.0)
]


# Head widths; a partial rotary factor where the init honours it (Llama's default does not).
TORCH_ROPE_CASES = [
    (rope_type, extra, head_dim, partial)
    for rope_type, extra in HF_ROPE_CASES + HF_DEFAULT_CASES
    for head_dim, partial in [(64, 1.0), (80, 1.0), (128, 1.0), (256, 0.5)]
    if not (rope_type == "default" and partial != 1.0)
]


@pytest.mark.parametrize("rope_type,extra,head_dim,partial", TORCH_ROPE_CASES)
def test_the_torch_runners_frequencies_are_transformers_bits(
    rope_type: str, extra: dict[str, Any], head_dim: int, partial: float
) -> None:
    """``hf_rope_inv_freq`` (the torch runner's and the model directories' tables) equals
    transformers' init functions bit for bit, where the numpy float64 one is an ulp off."""
    torch = pytest.importorskip("torch")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from resin.runners.torch.rope_frequencies import hf_rope_inv_freq

    extra = copy.deepcopy(extra)
    if partial != 1.0:
        extra["rope_scaling"]["partial_rotary_factor"] = partial
    hf, raw = _hf_case({**extra, "head_dim": head_dim})
    if rope_type == "default":
        theirs, their_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    # The model directories' parser (partial rotary allowed; the Llama loader refuses it).
    rope = parse_rope_config(hf.to_dict(), 10000.0, hf.max_position_embeddings, allow_partial=True)
    ours, our_scale = hf_rope_inv_freq(rope, head_dim)
    assert rope.rope_type == rope_type and ours.dtype == np.float32
    assert torch.equal(torch.from_numpy(ours), theirs), ours - theirs.numpy()
    assert our_scale == their_scale


def test_rope_from_config_partial_gives_phis_tables() -> None:
    """``partial=True`` for a rotary that reads ``partial_rotary_factor`` (Phi's): HF's cos,
    bit for bit, over ``head_dim * factor`` channels; without it, the whole head (what the
    Llama-style modeling files rotate)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

    from resin.runners.torch.blocks import rope_from_config

    config = transformers.PhiConfig(
        hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.4
    )
    positions = torch.arange(9)
    hf_cos, hf_sin = PhiRotaryEmbedding(config)(torch.zeros(1, 9, 64), positions[None])
    cos, sin = rope_from_config(config, 16, torch.device("cpu"), partial=True).cos_sin(
        positions, torch.float32
    )
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    whole, _ = rope_from_config(config, 16, torch.device("cpu")).cos_sin(positions, torch.float32)
    assert whole.shape == (9, 16)
