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

import numpy as np
import torch

from resin.loading.rope import (
    RopeConfig,
    llama3_frequencies,
    rope_attention_scaling,
    yarn_ramp_bounds,
)


def hf_rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_scaling)`` as :func:`resin.loading.rope_inv_freq` returns them,
    ``inv_freq`` float32 with transformers' bits (module doc)."""
    scaling = rope_attention_scaling(rope)  # checks the rope type (ConfigError)
    dim = int(head_dim * rope.partial_rotary_factor)
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    if rope.rope_type == "yarn":
        assert rope.factor is not None  # required by the parser
        low, high = yarn_ramp_bounds(rope, dim)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        interpolation = 1.0 / (rope.factor * pos_freqs)
        inv_freq = interpolation * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
        return inv_freq.numpy(), scaling
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        assert rope.factor is not None  # required by the parser
        inv_freq /= rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = llama3_frequencies(rope, inv_freq, torch.where)
    return inv_freq.numpy(), scaling
