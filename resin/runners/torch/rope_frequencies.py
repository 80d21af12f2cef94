"""RoPE inverse frequencies computed as transformers computes them: the same torch float32
operations in the same order (``modeling_rope_utils``'s ``_compute_*_parameters`` and the
models' ``compute_default_rope_parameters``), so the tables hold transformers' very bits.

:func:`resin.loading.rope_inv_freq` (numpy, float64, for runners without torch) rounds to
float32 within an ulp of these; an ulp on a frequency grows with the position (a cos / sin
1.8e-7 off at position 12 on OLMo 2's 128-wide heads) and reaches bf16 / fp16 q and k, so the
torch runner and the model directories take these. Owns :func:`hf_rope_inv_freq` for the rope
types Resin supports (``default``, ``dynamic`` inside the pretrained length, ``linear``,
``llama3``, ``yarn``); the attention scaling is the shared parser's (plain float arithmetic,
the same in both).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from resin.loading.rope import RopeConfig, rope_inv_freq


def hf_rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_scaling)`` as :func:`resin.loading.rope_inv_freq` returns them,
    ``inv_freq`` float32 with transformers' bits (module doc)."""
    # The shared function checks the type and its parameters (ConfigError) and gives the scale.
    _, attention_scaling = rope_inv_freq(rope, head_dim)
    dim = int(head_dim * rope.partial_rotary_factor)
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    if rope.rope_type == "yarn":
        return _yarn(rope, base, dim, base**exponents).numpy(), attention_scaling
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "linear":
        assert rope.factor is not None  # required by the parser
        inv_freq /= rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(rope, inv_freq)
    return inv_freq.numpy(), attention_scaling


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """``_compute_llama3_parameters`` after the default frequencies."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    assert factor is not None and low is not None and high is not None
    assert old_context_len is not None  # the parser requires them (rope_inv_freq ran first)
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def _yarn(rope: RopeConfig, base: float, dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    """``_compute_yarn_parameters``'s frequencies: interpolated and extrapolated ones blended
    by a float32 ramp over the dimensions between ``beta_fast`` and ``beta_slow`` rotations."""
    factor, orig_len = rope.factor, rope.original_max_position_embeddings
    assert factor is not None and orig_len is not None  # required by the parser
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate is None or rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
