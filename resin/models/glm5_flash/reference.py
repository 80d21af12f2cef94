"""What the parity harness changes in HF's GLM-5.3-Flash before comparing: one rule, the
indexer's tie-break.

``Glm5NextTextIndexer.forward`` (M:811-914) picks each query's pools with
``index_scores.topk(select_k)``. The scores are sums of ReLUs, so exact ties are common (every
head's score <= 0 gives 0), and torch's CPU ``topk`` orders tied values by where its
partition lands, which depends on how many candidates the call holds: the number of pools in
the forward's whole sequence, past the query included. So the same query picks another pool
when the forward holds more tokens after it: HF's one-shot forward of a sequence and its
prefill + decode, or a forward of a prefix, part at the first tied query (on the tiny
checkpoint: the 140-token prompt at position 102; with ``index_topk`` 4, at 55 of 70).
The runner breaks ties toward the earlier pool (``blocks.glm5_next_text_indexer``: a stable
descending sort), which is causal and independent of chunking; :func:`adjust_reference`
makes HF's indexers do the same, and nothing else. The harness applies it to every HF
reference it builds for this model directory and says so in its report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

ADJUSTMENT = (
    "indexer top-k ties go to the earlier pool (torch's topk order depends on the pool count)"
)


def stable_topk(
    values: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> Any:
    """``torch.topk`` with ties in index order (the earlier first)."""
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


def adjust_reference(model: Any) -> list[str]:
    """Make every ``Glm5NextTextIndexer`` of ``model`` break top-k ties toward the earlier pool
    (idempotent); the adjustments made, as text (empty when the model has no indexer)."""
    found = False
    for module in model.modules():
        if type(module).__name__ != "Glm5NextTextIndexer":
            continue
        found = True
        if getattr(module, "_resin_stable_topk", False):
            continue
        forward = module.forward

        def stable_forward(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with _topk_in_index_order():
                return _forward(*args, **kwargs)

        module.forward = stable_forward
        module._resin_stable_topk = True
    return [ADJUSTMENT] if found else []
