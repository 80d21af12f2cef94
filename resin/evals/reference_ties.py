"""HF modules whose ``topk`` must break ties in index order, for a model directory's
``reference.py`` (:func:`resin.evals.parity.adjust_reference`).

torch's CPU ``topk`` orders tied values by where its partition lands, which depends on how
many candidates the call holds. A sparse-attention indexer (GLM-5.3-Flash's pools,
DeepSeek-V4's compressed entries) scores candidates with sums of ReLUs, which tie exactly, and
holds every candidate of the forward's sequence: so HF's one-shot forward picks other entries
for a query when the sequence runs on past it, and its prefill + decode picks others again.
The runners break such ties toward the earlier candidate (a stable descending sort), which is
causal and does not depend on the chunking; :func:`ties_in_index_order` makes the HF modules
do the same, and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def stable_topk(
    values: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> Any:
    """``torch.topk`` with tied values in index order (the earlier first)."""
    order = values.sort(dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((values.gather(dim, order), order))


@contextlib.contextmanager
def _topk_in_index_order() -> Iterator[None]:
    original = torch.Tensor.topk
    torch.Tensor.topk = stable_topk  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


def ties_in_index_order(model: Any, class_name: str) -> bool:
    """Make every ``class_name`` module of ``model`` run its forward with ``Tensor.topk`` ties
    in index order (idempotent); whether ``model`` has one."""
    found = False
    for module in model.modules():
        if type(module).__name__ != class_name:
            continue
        found = True
        if getattr(module, "_resin_ties_in_index_order", False):
            continue
        forward = module.forward

        def stable_forward(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with _topk_in_index_order():
                return _forward(*args, **kwargs)

        module.forward = stable_forward
        module._resin_ties_in_index_order = True
    return found
