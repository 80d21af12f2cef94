"""The arrays ``resin._core``'s CPU kernels take, from torch tensors.

Owns :func:`numpy_view`, the one conversion every kernel caller uses (the decode linear, the
paged-attention backend, the norm and rotary paths of the torch layers).
"""

from __future__ import annotations

import numpy as np
import torch


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as numpy, no copy: itself for float32, its bits as int16 for bfloat16
    (numpy has no bfloat16; the kernels read the bits)."""
    return t.view(torch.int16).numpy() if t.dtype is torch.bfloat16 else t.numpy()
