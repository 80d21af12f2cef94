"""The draw of the torch sampler: one token per row from its logits, settings and uniform
number, all rows at once (:func:`sample_tokens`, :func:`draw_tokens`; no Python loop over rows).

Owns the mapping from a uniform number to a token, inverse-CDF sampling: a row's token is the
first kept token, in token-id order, whose cumulative probability (softmax over the kept
tokens) exceeds ``u`` times the total. The kept tokens are those at or above the row's
threshold (:func:`resin.sampling_filters.filter_thresholds`). Where the draw runs:

- a row without a filter: over the whole row (its softmax and cumulative sum);
- a row whose kept set lies inside its C = :data:`~resin.sampling_filters.CANDIDATES` (256)
  largest logits: over a vector of C values, the kept ones first in token-id order, then
  ``-inf`` (adding nothing to the sums);
- a row whose kept set reaches past them: over the whole row, the dropped tokens ``-inf``.

A filtered row's candidates are searched for first among its 64 largest logits (128 or 256
when its top-k asks; :func:`draw_groups`), which settle most rows (LLM-like logits keep a
handful of tokens); a row they do not settle is drawn again from all C (:func:`_draw_filtered`).

Guarantee: a row's token depends only on its logits, its settings and its uniform, never on
the rest of the batch; and every path computes the same float32 values in the same order as
the draw before the tree search, the narrow first search and the reused buffers (9c242cf:
``topk(256)`` over the whole row, the softmax and cumulative sum of the same vectors, a sort
for a nucleus past the candidates; on the CPU the whole-row cumulative sum is formed in Rust,
torch's additions in torch's order: rust/kernels/src/draw.rs), so a seeded request keeps its
tokens. Rows are divided by their temperature only where the whole row is read; elsewhere
only the candidates are (a division is elementwise: the same bits).

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

from typing import Any

import torch

from resin import _core
from resin.sampling_candidates import top_candidates
from resin.sampling_filters import CANDIDATES, filter_thresholds, is_filtered
from resin.sampling_rows import ScaledRows, keep_from_, padded, row_span, softmax_into
from resin.sampling_workspace import Workspace


def sample_tokens(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row of ``scaled`` float32 [S, V] (logits / temperature), all rows at once.

    ``top_k`` int64 [S] (0 = off), ``top_p`` / ``min_p`` / ``uniforms`` float32 [S] (the
    uniforms in [0, 1)). The row keeps the tokens at or above
    :func:`~resin.sampling_filters.filter_thresholds`; its token is the first kept one, in
    token-id order, whose cumulative probability (softmax over the kept tokens) exceeds its
    uniform: inverse-CDF sampling, so the token depends only on the row's logits, settings and
    uniform. Returns int64 [S].
    """
    workspace = Workspace(scaled.device)
    return draw_tokens(scaled, None, top_k, top_p, min_p, uniforms, workspace)


def draw_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    workspace: Workspace,
    owned: bool = False,
) -> torch.Tensor:
    """:func:`sample_tokens` of ``logits / temperature[:, None]`` (``temperature`` float32 [S];
    None: ``logits`` are already scaled), reading ``logits`` [S, V] and writing scratch into
    ``workspace``; ``owned``: ``logits`` may be divided in place. Returns int64 [S].

    The rows go in groups (:func:`draw_groups`), one batched draw each; a group of
    consecutive rows is read in place (the Sampler orders its copy so), others copied."""
    group = draw_groups(top_k, top_p, min_p, logits.shape[1])
    kinds = group.unique().tolist()
    if len(kinds) == 1:
        return _draw_group(
            logits, kinds[0], temperature, top_k, top_p, min_p, uniforms, workspace, owned
        )
    tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    for kind in kinds:
        at = (group == kind).nonzero()[:, 0]
        span = row_span(at)
        tokens[at] = _draw_group(
            logits.index_select(0, at) if span is None else logits[span[0] : span[1]],
            kind,
            None if temperature is None else temperature[at],
            top_k[at],
            top_p[at],
            min_p[at],
            uniforms[at],
            workspace,
            owned or span is None,
        )
    return tokens


FIRST_CANDIDATES = 64
"""How many candidates the first search of a filtered row finds (128 or 256 for a top-k past
63 or 127): rows whose kept set they settle draw at once; the others search again for all
:data:`~resin.sampling_filters.CANDIDATES`. (The search costs about its width; most rows keep
far fewer than 64 tokens.)"""


def draw_groups(top_k: Any, top_p: Any, min_p: Any, vocab_size: int) -> Any:
    """Per row (numpy or torch, [S]): 0 for a row without a filter (drawn over the whole row),
    else the width of its first candidate search; one batched draw per value."""
    num_candidates = min(CANDIDATES, vocab_size)
    filtered = is_filtered(top_k, top_p, min_p, vocab_size)
    if vocab_size < 16 * num_candidates:  # one topk of all C is as cheap
        return filtered * num_candidates
    k = top_k * ((top_k > 0) & (top_k <= num_candidates))
    return filtered * FIRST_CANDIDATES * (1 + (k >= 64)) * (1 + (k >= 128))


def _draw_group(
    logits: torch.Tensor,
    width: int,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    workspace: Workspace,
    owned: bool,
) -> torch.Tensor:
    """The draw of rows of one :func:`draw_groups` value ``width``."""
    if width == 0:  # no filter: the whole row's softmax
        if temperature is None:
            scaled = logits
        elif owned:
            scaled = logits.div_(temperature[:, None])
        else:
            scaled = workspace.get("rows", tuple(logits.shape), logits.dtype)
            torch.div(logits, temperature[:, None], out=scaled)
        return inverse_cdf(scaled, uniforms, workspace)[:, 0]
    num_candidates = min(CANDIDATES, logits.shape[1])
    return _draw_filtered(
        logits, temperature, top_k, top_p, min_p, uniforms, workspace, owned, width, num_candidates
    )


def _draw_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    workspace: Workspace,
    owned: bool,
    num: int,
    num_candidates: int,
) -> torch.Tensor:
    """The tokens of rows that all have a filter, from their ``num`` largest logits where
    those decide the kept set as the C = ``num_candidates`` largest would (a row keeping fewer
    tokens than ``num`` whose threshold they settle), else from all C (the rows left over,
    again) — the same tokens either way: a row's draw reads its C candidates only through its
    kept ones, padded with ``-inf`` to width C."""
    num_rows, vocab_size = logits.shape
    rows = ScaledRows(logits, temperature, workspace, owned)
    values, indices = top_candidates(logits, num, workspace)
    values = rows.scale(values)
    found = filter_thresholds(rows, values, indices, top_k, top_p, min_p, num_candidates)
    threshold = found.value
    own = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    own[found.own_rows] = True
    if num_candidates < vocab_size:
        inside = threshold > values[:, -1]
    else:  # the candidates are the whole vocabulary
        inside = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    inside &= ~own & ~found.undecided
    if num >= num_candidates:
        outside, again = ~inside & ~own, found.undecided
    else:  # past our candidates, C might still hold the kept set: ask C
        outside, again = torch.zeros_like(inside), ~inside & ~own
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    at = inside.nonzero()[:, 0]
    if len(at):
        tokens[at] = _draw_among(
            values.index_select(0, at),
            indices.index_select(0, at),
            threshold[at],
            uniforms[at],
            num_candidates,
            vocab_size,
        )
    if len(found.own_rows):
        at = found.own_rows
        among = threshold[at] > found.own_values[:, -1]
        if bool(among.any()):
            tokens[at[among]] = _draw_among(
                found.own_values[among],
                found.own_indices[among],
                threshold[at[among]],
                uniforms[at[among]],
                num_candidates,
                vocab_size,
            )
        outside[at[~among]] = True
    at = outside.nonzero()[:, 0]
    if len(at):
        v = rows.take(at, "rows", last=True)
        if bool(threshold[at].isfinite().any()):
            keep_from_(v, threshold[at])
        tokens[at] = inverse_cdf(v, uniforms[at], workspace)[:, 0]
    at = again.nonzero()[:, 0]
    if len(at):
        again_rows = workspace.get("draw.again_rows", (len(at), vocab_size), logits.dtype)
        torch.index_select(logits, 0, at, out=again_rows)
        tokens[at] = _draw_filtered(
            again_rows,  # rows divided in place come with temperature 1
            None if rows.temperature is None else rows.temperature[at],
            top_k[at],
            top_p[at],
            min_p[at],
            uniforms[at],
            workspace,
            True,
            num_candidates,
            num_candidates,
        )
    return tokens


def _draw_among(
    values: torch.Tensor,
    indices: torch.Tensor,
    threshold: torch.Tensor,
    uniforms: torch.Tensor,
    width: int,
    vocab_size: int,
) -> torch.Tensor:
    """int64 [n]: the draw among candidates ``values`` / ``indices`` [n, m] (scaled,
    descending) of rows keeping those >= ``threshold`` [n]: the kept ones first in token-id
    order, then ``-inf`` up to ``width`` columns, the vector the C candidates would give."""
    kept = values >= threshold[:, None]
    order, perm = torch.where(kept, indices, vocab_size).sort(dim=-1)
    v = values.gather(1, perm).masked_fill(order == vocab_size, -torch.inf)
    v, order = padded(v, width, -torch.inf), padded(order, width, vocab_size)
    return order.gather(1, inverse_cdf(v, uniforms))[:, 0]


def inverse_cdf(
    logits: torch.Tensor, uniforms: torch.Tensor, workspace: Workspace | None = None
) -> torch.Tensor:
    """int64 [n, 1]: per row of ``logits`` [n, m], the first column whose cumulative softmax
    exceeds ``uniforms`` [n] times the total (never a column of probability 0). With a
    ``workspace``, the softmax and the cumulative sum are written into its buffers, or, for
    float32 CPU rows (:data:`draw_kernel`), the sums are formed in ``_core.inverse_cdf`` and
    not written: the same tokens."""
    if workspace is None:
        probs = logits.softmax(dim=-1)
    else:
        probs = softmax_into(logits, workspace, "probs")
        if draw_kernel and probs.dtype is torch.float32 and probs.is_cpu:
            return _kernel_inverse_cdf(probs, uniforms)
    return _search_cdf(probs, uniforms, workspace)


draw_kernel = True
"""Whether :func:`inverse_cdf` with a workspace draws float32 CPU rows in ``_core.inverse_cdf``
(the cumulative sums of four rows at once, in Rust, none written out) rather than torch's
``cumsum`` and ``searchsorted``: the same tokens, bit for bit (rust/kernels/src/draw.rs).
False takes torch's everywhere (for A/B runs and the tests)."""


def _search_cdf(
    probs: torch.Tensor, uniforms: torch.Tensor, workspace: Workspace | None
) -> torch.Tensor:
    """int64 [n, 1]: :func:`inverse_cdf` of the probabilities ``probs`` [n, m], in torch."""
    if workspace is None:
        cdf = probs.cumsum(dim=-1)
    else:
        cdf = workspace.get("cdf", tuple(probs.shape), probs.dtype)
        torch.cumsum(probs, dim=-1, out=cdf)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, cdf.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def _kernel_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`_search_cdf`'s tokens from ``_core.inverse_cdf``; rows it leaves (a total that is
    not positive and finite: NaN or infinite logits) go to torch."""
    tokens = torch.empty((len(probs), 1), dtype=torch.int64)
    _core.inverse_cdf(
        probs.numpy(), uniforms.to(torch.float32).contiguous().numpy(), tokens[:, 0].numpy()
    )
    left = (tokens[:, 0] < 0).nonzero()[:, 0]
    if len(left):
        tokens[left] = _search_cdf(probs[left], uniforms[left], None)
    return tokens
