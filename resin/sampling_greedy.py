"""The greedy pick of the torch sampler: each row's first largest logit (:func:`greedy_tokens`).

Owns the rule greedy rows follow, ``torch.argmax``'s: the first column of the row's largest
value, a NaN counting as the largest. On the CPU, float32 rows go to ``_core.argmax``
(:data:`argmax_kernel`): one vectorised scan against the running maximum, in Rust
(rust/kernels/src/argmax.rs), the same columns. torch's CPU ``argmax`` tracks an index with
every compare and is not vectorised: ~35 µs a 32,000-token row, 1.7-2.4 ms of a 64-row decode
step, against a few µs here (docs/benchmarks.md, "The greedy pick, the draw's sums and the
top logprobs in Rust"), the rows split over torch's threads. Other devices and dtypes, and
strided rows, take ``argmax``.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

import numpy as np
import torch

from resin import _core
from resin.kernels.cpu_threads import kernel_threads

argmax_kernel = True
"""Whether float32 CPU rows are picked by ``_core.argmax`` rather than ``torch.argmax`` (the
same columns). False takes torch's everywhere (for A/B runs and the tests)."""


def greedy_tokens(logits: torch.Tensor, rows: np.ndarray | None = None) -> torch.Tensor:
    """int64 [S]: ``logits.argmax(dim=-1)`` of ``logits`` [S, V], column for column; with
    ``rows`` (int64 [n]), of ``logits[rows]`` (read in place on the CPU kernel's path)."""
    if (
        argmax_kernel
        and logits.dtype is torch.float32
        and logits.is_cpu
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.is_contiguous()
    ):
        n = logits.shape[0] if rows is None else len(rows)
        tokens = torch.empty(n, dtype=torch.int64)
        picked = None if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
        _core.argmax(logits.detach().numpy(), tokens.numpy(), rows=picked, threads=kernel_threads())
        return tokens
    if rows is not None:
        logits = logits.index_select(
            0, torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
        )
    return logits.argmax(dim=-1)
