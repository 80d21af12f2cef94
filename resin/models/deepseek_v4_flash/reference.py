"""What the parity harness changes in HF's DeepSeek-V4 before comparing: one rule, the
indexer's tie-break (:mod:`resin.evals.reference_ties`).

``DeepseekV4Indexer.forward`` (M:474-597) picks each query's compressed entries with
``index_scores.topk(index_topk)`` over ReLU sums, which tie exactly (every head <= 0 gives 0),
and torch orders ties by the call's size: every compressed entry of the forward's sequence,
past the query included (masked, but counted). The runner gives ties to the earlier entry
(``blocks._indexer_selection``); this makes HF's indexers do the same, and nothing else.
"""

from __future__ import annotations

from typing import Any

from resin.evals.reference_ties import ties_in_index_order

ADJUSTMENT = (
    "indexer top-k ties go to the earlier compressed entry (torch's topk order depends on "
    "the entry count)"
)


def adjust_reference(model: Any) -> list[str]:
    """Every ``DeepseekV4Indexer`` of ``model`` breaks top-k ties toward the earlier entry."""
    return [ADJUSTMENT] if ties_in_index_order(model, "DeepseekV4Indexer") else []
