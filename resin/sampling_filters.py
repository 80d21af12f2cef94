"""Which tokens a sampling row keeps: top-k, top-p and min-p for the torch sampler, in
transformers' order, each reduced to one threshold logit per row.

Owns :data:`CANDIDATES`, :func:`filter_thresholds` (the thresholds of a batch from its rows'
largest logits, :mod:`resin.sampling_candidates`, and the whole rows where a filter needs
them, :mod:`resin.sampling_rows`) and the mask functions :func:`apply_top_k`,
:func:`apply_top_p`, :func:`apply_min_p`. The rules:

- top-k (0 = off): the k-th largest logit; ties with it are kept.
- top-p (1 = off): the smallest set of most likely tokens whose probability reaches ``top_p``,
  over the top-k survivors (always the most likely one; ties with the last one are kept).
- min-p (0 = off): tokens whose probability is at least ``min_p`` times the top one's.

Guarantee: a row's threshold depends only on its logits and settings, never on the rest of the
batch or on how its candidates were found. :func:`top_candidates` returns exactly the values
``logits.topk(n)`` would (the indices may order equal values differently, which nothing
reads); the thresholds are computed from the same vectors as with C = 256 candidates found by
``topk`` (a narrower search answers only what it settles: :func:`filter_thresholds`); and a
top-p nucleus past the candidates is found among the row's largest logits, widened until the
nucleus fits, with the cumulative sums a sort of the row gives (a prefix of a cumulative sum
is the cumulative sum of the prefix; ordered by logit, as within the candidates).

Cost: the candidate search (:mod:`resin.sampling_candidates`) and, for top-p without a
top-k, one more read of the row (its softmax: the normaliser needs every token); a nucleus of
m tokens past the candidates costs a search of ~m log m in torch, or on the CPU (float32,
:data:`nucleus_kernel`) a few reads of the row whatever m, in ``_core.nucleus_cut`` (a
histogram says where the sums cross ``top_p``, to within a float64 rounding bound; only
there is the row sorted; the same cut bit for bit: rust/kernels/src/nucleus.rs).

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from resin import _core
from resin.sampling_candidates import top_candidates
from resin.sampling_rows import ScaledRows, keep_from_, padded, softmax_into
from resin.sampling_workspace import Workspace

CANDIDATES = 256
"""How many of a row's largest logits the filters and the draw look at first (fixed, so a
row's token never depends on the rest of the batch): a row whose kept set lies inside them
draws among them; one without filters, or whose kept set reaches past them (a wide top-p or
top-k), draws over the whole vocabulary."""


def is_filtered(top_k: Any, top_p: Any, min_p: Any, vocab_size: int) -> Any:
    """Which rows have a filter (top-k, top-p or min-p on): numpy or torch, [S] bool."""
    return ((top_k > 0) & (top_k < vocab_size)) | (top_p < 1) | (min_p > 0)


@dataclass
class Thresholds:
    """What the filters decided for each row of a batch (:func:`filter_thresholds`)."""

    value: torch.Tensor
    """float32 [S]: the smallest scaled logit the row keeps (``-inf``: all)."""
    undecided: torch.Tensor
    """bool [S]: rows that ``num < C`` candidates could not decide (ask again with C)."""
    own_rows: torch.Tensor
    """int64 [n]: rows whose C candidates came from their nucleus search (a nucleus past the
    candidates), in ``own_values`` / ``own_indices`` [n, C] (scaled, descending)."""
    own_values: torch.Tensor
    own_indices: torch.Tensor


def filter_thresholds(
    rows: ScaledRows,
    values: torch.Tensor,
    indices: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    num_candidates: int,
) -> Thresholds:
    """Per row, the smallest scaled logit it keeps after top-k, then top-p (over the top-k
    survivors), then min-p (the module doc's rules), as the C = ``num_candidates`` largest
    logits decide it. ``values`` / ``indices`` [S, num] are the row's ``num <= C`` largest
    scaled logits, descending, and their columns (:func:`top_candidates`; scaling keeps the
    order).

    With ``num < C`` a row is decided only where the first ``num`` of the C candidates settle
    every comparison C would make (``undecided`` marks the others: a top-k past ``num``, a tie
    with the ``num``-th value, a small top-p that would read past it). A top-p nucleus that
    the candidates do not hold is found over the row (:func:`_wide_nucleus_thresholds`), which
    also gives the row its C candidates."""
    threshold, undecided = top_k_thresholds(rows, values, top_k, num_candidates)
    own_rows = torch.zeros(0, dtype=torch.int64, device=values.device)
    own_values = values.new_zeros((0, num_candidates))
    own_indices = indices.new_zeros((0, num_candidates))
    nucleus = ((top_p < 1) & ~undecided).nonzero()[:, 0]
    if len(nucleus):
        top_p_threshold, open_, own = _top_p_thresholds(
            rows, values, indices, threshold, top_k, top_p, nucleus, num_candidates
        )
        threshold[nucleus] = torch.maximum(threshold[nucleus], top_p_threshold)
        undecided[nucleus[open_]] = True
        if own is not None:
            own_rows, own_values, own_indices = nucleus[own[0]], own[1], own[2]
    min_p_threshold = values[:, 0] + torch.log(min_p.clamp(min=0).to(values.dtype))
    threshold = torch.maximum(threshold, min_p_threshold)
    return Thresholds(threshold, undecided, own_rows, own_values, own_indices)


def top_k_thresholds(
    rows: ScaledRows, values: torch.Tensor, top_k: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [S]: each row's k-th largest scaled logit (``-inf`` where top-k is off: 0 or
    >= V), and bool [S]: the rows whose k lies between ``values``' width and the C =
    ``num_candidates`` candidates (undecided: their threshold is ``-inf`` here)."""
    vocab_size, num = rows.vocab_size, values.shape[1]
    top_k = top_k.to(torch.int64)
    active = (top_k > 0) & (top_k < vocab_size)
    threshold = values.gather(1, (top_k.clamp(1, num) - 1)[:, None])[:, 0]
    threshold = threshold.masked_fill(~active | (top_k > num), -torch.inf)
    undecided = active & (top_k > num) & (top_k <= num_candidates)
    wide = (active & (top_k > num_candidates)).nonzero()[:, 0]
    if len(wide):  # k past the candidates: a topk of its own
        k = top_k[wide]
        wide_rows = rows.take(wide, "rows", writable=False)
        wide_values = wide_rows.topk(int(k.max()), dim=-1).values
        threshold[wide] = wide_values.gather(1, (k - 1)[:, None])[:, 0]
    return threshold, undecided


def _top_p_thresholds(
    rows: ScaledRows,
    values: torch.Tensor,
    indices: torch.Tensor,
    top_k_threshold: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    nucleus: torch.Tensor,
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """For each row in ``nucleus`` int64 [n]: the smallest scaled logit of its nucleus over
    its top-k survivors (logits >= ``top_k_threshold``), float32 [n]; whether ``values``
    could not decide it, bool [n]; and for the rows whose nucleus was searched over the row,
    (their positions in ``nucleus``, their C values, their C indices). The other arguments as
    :func:`filter_thresholds`'s."""
    vocab_size, num = rows.vocab_size, values.shape[1]
    complete = num >= num_candidates
    device = values.device
    threshold = torch.empty(len(nucleus), dtype=values.dtype, device=device)
    kth, mass = top_k_threshold[nucleus], top_p[nucleus]
    undecided = torch.zeros(len(nucleus), dtype=torch.bool, device=device)
    # A top-k inside the candidates: the distribution is theirs; else the whole row's.
    if num_candidates < vocab_size:
        small = kth > values[nucleus, -1]
        if not complete:  # a tie with the last value: C might still call it small
            k = top_k[nucleus]
            undecided = ~small & (k > 0) & (k <= num)
    else:  # the candidates are the whole vocabulary
        small = torch.ones(len(nucleus), dtype=torch.bool, device=device)
    at = small.nonzero()[:, 0]
    if len(at):  # the C values masked below kth are our values and -inf (kth > values[-1])
        v = padded(values.index_select(0, nucleus[at]), num_candidates, -torch.inf)
        probs = v.masked_fill(v < kth[at, None], -torch.inf).softmax(dim=-1)
        first = _first_reaching(probs.cumsum(dim=-1), mass[at])
        # A cut past our values (the sums fall short of top_p by rounding) is below kth,
        # whatever C would read there: the threshold is kth either way.
        threshold[at] = v.gather(1, first)[:, 0]
    at = (~small & ~undecided).nonzero()[:, 0]
    own = None
    if len(at):
        masked = bool(kth[at].isfinite().any())
        row = rows.take(nucleus[at], "rows", writable=masked)
        if masked:
            keep_from_(row, kth[at])
        probs = softmax_into(row, rows.workspace, "probs")
        cumulative = probs.gather(1, indices.index_select(0, nucleus[at])).cumsum(dim=-1)
        first = _first_reaching(cumulative, mass[at])
        threshold[at] = values.index_select(0, nucleus[at]).gather(1, first)[:, 0]
        beyond = (cumulative[:, -1] < mass[at]).nonzero()[:, 0]
        if len(beyond):  # the nucleus reaches past the candidates
            wide, own_values, own_indices = _wide_nucleus_thresholds(
                row,
                probs,
                beyond,
                cumulative.index_select(0, beyond),
                values.index_select(0, nucleus[at[beyond]])[:, -1],
                mass[at][beyond],
                rows.workspace,
                num_candidates,
            )
            threshold[at[beyond]] = wide
            own = (at[beyond], own_values, own_indices)
    return threshold, undecided, own


def _wide_nucleus_thresholds(
    row: torch.Tensor,
    probs: torch.Tensor,
    beyond: torch.Tensor,
    cumulative: torch.Tensor,
    last: torch.Tensor,
    mass: torch.Tensor,
    workspace: Workspace,
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the rows ``beyond`` int64 [n] of ``row`` [N, V] (scaled logits) and ``probs``
    [N, V] (their softmax), where the candidates (``cumulative`` [n, m], their cumulative
    probabilities; ``last`` [n], the m-th's logit) fall short of ``mass`` [n]: the logit of
    the token whose cumulative probability, in descending order, first reaches ``mass``,
    float32 [n], and each row's C = ``num_candidates`` largest logits and their columns,
    [n, C] each.

    Looked for among each row's ``num`` largest logits (:func:`top_candidates`), rows of the
    same ``num`` together: ``num`` is first :func:`_sampled_nucleus_sizes` (an estimate from
    every 8th token), then, for the rows it does not cover, :func:`_nucleus_sizes` of what the
    search saw (at least 4x more), up to a sort of the row. The order is the logits' (the
    candidates' order), and the cumulative sums are a sort's: the first ``num`` of them are
    the prefix's own. (The estimates decide only the cost; the search checks what it finds.)
    On the CPU (float32) :data:`nucleus_kernel` gives the same answer from one Rust call."""
    if nucleus_kernel and _kernel_takes(row, probs, mass):
        return _kernel_nucleus_thresholds(row, probs, beyond, mass, num_candidates)
    vocab_size = row.shape[1]
    least = max(num_candidates, 2 * cumulative.shape[1])
    nums = _sampled_nucleus_sizes(row, probs, beyond, cumulative, last, mass, least)
    threshold = torch.empty(len(beyond), dtype=row.dtype, device=row.device)
    own_values = row.new_empty((len(beyond), num_candidates))
    own_indices = torch.empty((len(beyond), num_candidates), dtype=torch.int64, device=row.device)
    pending: dict[int, list[int]] = {}
    for i, num in enumerate(nums):
        pending.setdefault(num, []).append(i)
    while pending:
        num = min(pending)
        todo = torch.tensor(pending.pop(num), dtype=torch.int64, device=row.device)
        at = beyond[todo]
        if len(at) == len(row):  # every row, in order: no copy
            r = row
        else:
            r = workspace.get("filters.wide_rows", (len(at), vocab_size), row.dtype)
            torch.index_select(row, 0, at, out=r)
        if num >= vocab_size:  # every logit: a sort (a topk of all of them, cheaper than none)
            top, ids = r.sort(dim=-1, descending=True)
        else:
            top, ids = top_candidates(r, num, workspace)
        # The probabilities at those columns, in the logits' order (no copy of the rows).
        flat = (ids + (at * vocab_size)[:, None]).view(-1)
        cumulative = probs.view(-1).index_select(0, flat).view(ids.shape).cumsum(dim=-1)
        m = mass[todo]
        fits = (cumulative[:, -1] >= m) | (ids.shape[1] == vocab_size)
        done = fits.nonzero()[:, 0]
        if len(done) == len(todo):  # all of them: no copies
            top_done, ids_done, cumulative_done = top, ids, cumulative
        else:
            top_done, ids_done = top.index_select(0, done), ids.index_select(0, done)
            cumulative_done = cumulative.index_select(0, done)
        if len(done):
            first = _first_reaching(cumulative_done, m[done])
            threshold[todo[done]] = top_done.gather(1, first)[:, 0]
            own_values[todo[done]] = top_done[:, :num_candidates]
            own_indices[todo[done]] = ids_done[:, :num_candidates]
        short = (~fits).nonzero()[:, 0]
        if len(short):  # a new bound from what this search saw
            larger = _nucleus_sizes(
                cumulative.index_select(0, short), m[short], 4 * num, vocab_size
            )
            for i, size in zip(todo[short].tolist(), larger):
                pending.setdefault(size, []).append(i)
    return threshold, own_values, own_indices


nucleus_kernel = True
"""Whether a wide nucleus on the CPU (float32 rows) is cut by ``_core.nucleus_cut`` (a
histogram and a sort of the nucleus's buckets, in Rust) rather than the torch search below
(``topk`` of up to the whole row): the same thresholds and candidates. False takes the torch
search everywhere (for A/B runs and the tests)."""


def _kernel_takes(row: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor) -> bool:
    # float32 masses only: the torch search compares float32 sums with a float64 mass in float64.
    return (
        row.dtype is torch.float32
        and probs.dtype is torch.float32
        and mass.dtype is torch.float32
        and row.is_cpu
        and probs.is_cpu
        and row.shape[1] < 1 << 32
    )


def _kernel_nucleus_thresholds(
    row: torch.Tensor,
    probs: torch.Tensor,
    beyond: torch.Tensor,
    mass: torch.Tensor,
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_wide_nucleus_thresholds`'s answer from ``_core.nucleus_cut`` (its arguments)."""
    n = len(beyond)
    threshold = row.new_empty(n)
    own_values = row.new_empty((n, num_candidates))
    own_indices = torch.empty((n, num_candidates), dtype=torch.int64)
    _core.nucleus_cut(
        row.contiguous().numpy(),
        probs.contiguous().numpy(),
        beyond.to(torch.int64).contiguous().numpy(),
        mass.contiguous().numpy(),
        threshold.numpy(),
        own_values.numpy(),
        own_indices.numpy(),
    )
    return threshold, own_values, own_indices


SAMPLE_STRIDE = 8
""":func:`_sampled_nucleus_sizes` reads every 8th token of a row."""


def _sampled_nucleus_sizes(
    row: torch.Tensor,
    probs: torch.Tensor,
    beyond: torch.Tensor,
    cumulative: torch.Tensor,
    last: torch.Tensor,
    mass: torch.Tensor,
    least: int,
) -> list[int]:
    """How many of each row's largest logits to search for a nucleus of ``mass`` [n] past its
    m candidates (the arguments as :func:`_wide_nucleus_thresholds`'): a histogram of every
    ``SAMPLE_STRIDE``-th token below the m-th logit (quarter-logit bins, 16 logits deep) gives
    the mass and the number of tokens above each bin; the size is 1.25x the count where the
    mass reaches ``mass`` (one bin further), rounded up to a quarter octave, >= ``least``; a
    nucleus deeper than the histogram gets the whole vocabulary."""
    vocab_size, stride, bins = row.shape[1], SAMPLE_STRIDE, 64
    tokens = row[:, ::stride].index_select(0, beyond)
    weights = probs[:, ::stride].index_select(0, beyond)
    depth = (last[:, None] - tokens).mul_(4)  # in quarter logits below the m-th
    below = depth > 0  # the candidates (and the m-th's ties) are counted exactly already
    weights.masked_fill_(~below, 0)
    at = depth.clamp_(0, bins - 1).to(torch.int64)
    bin_mass = weights.new_zeros((len(beyond), bins)).scatter_add_(1, at, weights)
    bin_count = weights.new_zeros((len(beyond), bins)).scatter_add_(1, at, below.to(weights.dtype))
    reached = cumulative[:, -1:] + stride * bin_mass.cumsum(dim=1)
    counts = cumulative.shape[1] + stride * bin_count.cumsum(dim=1)
    reach = ((reached < mass[:, None]).sum(dim=1) + 1).clamp_(max=bins - 1)
    sizes = counts.gather(1, reach[:, None])[:, 0].mul_(1.25).add_(64)
    sizes[reach == bins - 1] = vocab_size  # past the histogram: it may be anything
    return [min(vocab_size, max(least, _quarter_octave(int(size)))) for size in sizes.tolist()]


def _quarter_octave(size: int) -> int:
    """The smallest of 2^(k/4), rounded up to a multiple of 64, that is >= ``size``."""
    top = 1 << max(size - 1, 1).bit_length()
    for quarter in (0.5946, 0.7071, 0.8409, 1.0):  # 2^(-3/4) .. 2^0
        step = -(-int(top * quarter) // 64) * 64
        if step >= size:
            return step
    return top


def _nucleus_sizes(
    cumulative: torch.Tensor, mass: torch.Tensor, least: int, vocab_size: int
) -> list[int]:
    """How many of each row's largest probabilities to search next for a nucleus of ``mass``
    [n] that its first m (``cumulative`` [n, m], their cumulative sums) do not reach: a power of
    two >= ``least`` and >= 4x a lower bound on the nucleus (a token past the m has at most the
    m-th one's probability; on LLM-like logits the nucleus is 1-7x the bound)."""
    num_seen = cumulative.shape[1]
    last = cumulative[:, -1] - cumulative[:, -2] if num_seen > 1 else cumulative[:, -1]
    bound = num_seen + ((mass - cumulative[:, -1]) / last).nan_to_num(posinf=vocab_size)
    return [
        min(vocab_size, max(least, 1 << (int(4 * b) - 1).bit_length()))
        for b in bound.clamp(max=vocab_size).tolist()
    ]


def _first_reaching(cumulative: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """int64 [n, 1]: the first column where ``cumulative`` [n, m] reaches ``mass`` [n] (the
    last column when none does)."""
    first = (cumulative < mass[:, None]).sum(dim=-1, keepdim=True)
    return first.clamp_(max=cumulative.shape[1] - 1)


def _keep_from(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(logits < threshold[:, None], -torch.inf)


def _unscaled(logits: torch.Tensor) -> tuple[ScaledRows, torch.Tensor, torch.Tensor]:
    workspace = Workspace(logits.device)
    values, indices = top_candidates(logits, CANDIDATES, workspace)
    return ScaledRows(logits, None, workspace), values, indices


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] with each row's logits below its ``top_k`` largest set to ``-inf``
    (ties at the k-th kept); 0 = keep all."""
    rows, values, _ = _unscaled(logits)
    return _keep_from(logits, top_k_thresholds(rows, values, top_k, values.shape[1])[0])


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] keeping each row's smallest set of most likely tokens whose probability
    reaches ``top_p`` (the most likely always; ties with the last kept); 1 = keep all."""
    rows, values, indices = _unscaled(logits)
    off = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    threshold = logits.new_full((logits.shape[0],), -torch.inf)
    nucleus = (top_p < 1).nonzero()[:, 0]
    threshold[nucleus] = _top_p_thresholds(
        rows, values, indices, threshold.clone(), off, top_p, nucleus, values.shape[1]
    )[0]
    return _keep_from(logits, threshold)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] dropping tokens whose probability is below ``min_p`` times the row's
    top probability; 0 = keep all."""
    top = logits.max(dim=-1).values
    return _keep_from(logits, top + torch.log(min_p.clamp(min=0).to(logits.dtype)))
