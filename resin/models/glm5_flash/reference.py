"""What the parity harness changes in HF's GLM-5.3-Flash before comparing: one rule, the
indexer's tie-break (:mod:`resin.evals.reference_ties`).

``Glm5NextTextIndexer.forward`` (M:811-914) picks each query's pools with
``index_scores.topk(select_k)`` over ReLU sums, which tie exactly (every head <= 0 gives 0),
and torch orders ties by the call's size: the pools of the forward's whole sequence, past the
query included. On the tiny checkpoint HF's one-shot forward and its prefill + decode parted
at the 140-token prompt's position 102; with ``index_topk`` 4, at 55 of 70. The runner gives
ties to the earlier pool (``blocks.glm5_next_text_indexer``); this makes HF's indexers do the
same, and nothing else.
"""

from __future__ import annotations

from typing import Any

from resin.evals.reference_ties import ties_in_index_order

ADJUSTMENT = (
    "indexer top-k ties go to the earlier pool (torch's topk order depends on the pool count)"
)


def adjust_reference(model: Any) -> list[str]:
    """Every ``Glm5NextTextIndexer`` of ``model`` breaks top-k ties toward the earlier pool."""
    return [ADJUSTMENT] if ties_in_index_order(model, "Glm5NextTextIndexer") else []
