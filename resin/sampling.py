"""Token sampling for torch runners: :class:`Sampler` turns each sampling row's logits into a token.

Owns the per-request sampler state (the token history penalties need, keyed by
``plan.request_slots``) and the sampling semantics, applied in this order:

1. penalties on the raw logits — repetition (prompt + output tokens, HF/vLLM: a positive
   logit is divided by the penalty, a negative one multiplied), then frequency and presence
   (output tokens only, OpenAI/vLLM: ``logit -= frequency * count + presence * (count > 0)``);
2. ``banned_token_ids`` set to ``-inf`` (stop tokens before ``min_tokens``);
3. temperature 0 = greedy (argmax of the penalised logits; a step whose rows are all greedy
   does nothing else); otherwise divide by the temperature, then top-k (0 = off; ties with the
   k-th kept), top-p (the most likely tokens whose probability reaches ``top_p``, over the
   top-k survivors; ties with the last kept), min-p (probability >= ``min_p`` times the top
   one's), in transformers' order, and draw.

The draw is one batched pass for every row (:func:`sample_tokens`, no Python loop over rows):
each row's filters reduce to one threshold logit, found among its ``CANDIDATES`` (256) largest
logits when it can be, else over the whole row, and the token is the first kept token in
token-id order whose cumulative probability exceeds the sample's uniform number in [0, 1)
(inverse-CDF sampling). The rows go in three groups (greedy, drawn without a filter, drawn
with one), each copied once and handled by one batched call; a step of one group copies nothing
unless a penalty, ban or grammar changes its logits. Penalties and bans change only the entries
they touch (one scatter each for the batch).

The history comes from the engine's lifecycle diff alone, never from ``input_ids``: a slot in
``new_request_slots`` starts from ``new_request_token_ids`` (prompt, then any outputs it
already has), and each row then appends ``committed_token_ids`` (the outputs the engine
committed since the runner last saw the request) at their place, output tokens
``num_output_tokens - n ..``, so a plan re-sent after a discarded one changes nothing. That
history, the per-sample seeds and the output layout are framework-neutral and shared with the
MLX sampler (:mod:`resin.sampling_state`).

Seeds: a sample's uniform number is :func:`~resin.sampling_state.sample_uniforms` of
``(seed, output index)`` — splitmix64 of :func:`~resin.sampling_state.sample_seed`, in numpy,
for the whole step at once — where the j-th sample of a row has output index
``plan.num_output_tokens[row] + j``. A row's token depends only on its logits, its settings and
that number, so a seeded request yields the same tokens whatever else is in the batch, again
after preemption, and with speculative decoding on. Unseeded samples take their numbers from
the sampler's ``generator`` (one ``torch.rand`` call per step). The numbers depend on nothing
else, so another framework's sampler making the same draw from them gets the same tokens from
the same logits, up to float rounding at a cumulative-probability edge (the MLX sampler does
not yet: it keys ``mx.random`` with ``sample_seed``).

Logprobs (``num_logprobs >= 0``) are ``log_softmax`` of the raw model logits (before penalties,
bans and temperature; vLLM's default "raw" mode), in float32, computed for the samples that
ask only. ``top_logprob_ids`` has ``k = max num_logprobs`` of the batch columns; rows asking
fewer just carry extra columns, rows not asking zeros (the engine reads neither).

Structured outputs (:mod:`resin.structured_output`): ``sampler.grammars`` is a
:class:`~resin.structured_output.GrammarRegistry` the server fills (request id -> compiled
grammar). A slot whose request has a grammar when it is (re)created gets a matcher, advanced
over the outputs it already has; each row's ``committed_token_ids`` advance it further (never
the sampled tokens, so a discarded plan replays exactly). In :meth:`Sampler.sample` the grammar
rows' logits are masked (disallowed tokens ``-inf``, after penalties and bans, before greedy /
temperature), one bitmask for the batch; rows without a grammar are untouched. A grammar row
whose bans leave no allowed token falls back to the grammar mask alone.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import torch

from resin._core import BatchPlan, ForwardOutput
from resin.sampling_state import (
    SlotHistory,
    max_num_logprobs,
    offsets_in_row,
    pack_output,
    sample_uniforms,
)
from resin.structured_output import GrammarRegistry, GrammarSlot, MaskBuffer, apply_grammar_masks


class Sampler(SlotHistory):
    """Samples one token per sampling row; keeps per-request state across plans (the token
    history of :class:`~resin.sampling_state.SlotHistory`, plus grammar matchers)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.grammars = GrammarRegistry()
        self.grammar_slots: dict[int, GrammarSlot] = {}
        self._mask_buffer = MaskBuffer(vocab_size)

    def begin_step(self, plan: BatchPlan) -> list[int]:
        """Apply the plan's lifecycle diff: drop finished slots, start new ones from their
        request's tokens, and append each row's ``committed_token_ids``.

        Call once per plan, before :meth:`sample`. Idempotent for a re-sent diff (the plan
        after a discarded one): a slot reset twice starts from the same
        ``new_request_token_ids``, and committed tokens land at their output index.
        """
        for slot in plan.finished_request_slots.tolist():
            self.grammar_slots.pop(slot, None)
        new_slots = super().begin_step(plan)  # the token history
        if new_slots and (self.grammars.active or self.grammar_slots):
            self._start_grammars(plan, new_slots)
        for slot, grammar in self.grammar_slots.items():
            state = self.slots.get(slot)
            if state is not None:
                grammar.sync(state.token_ids, state.num_prompt_tokens)
        return new_slots

    def _start_grammars(self, plan: BatchPlan, new_slots: list[int]) -> None:
        """A (re)created slot drops its old matcher; one whose request has a grammar gets a
        new one (:meth:`begin_step` then advances it over the outputs the request has)."""
        row_of = {slot: row for row, slot in enumerate(plan.request_slots.tolist())}
        request_ids = plan.request_ids if self.grammars.active else []
        for slot in new_slots:
            self.grammar_slots.pop(slot, None)
            row = row_of.get(slot)
            if row is None or not request_ids:
                continue
            grammar = self.grammars.get(request_ids[row])
            if grammar is not None:
                self.grammar_slots[slot] = GrammarSlot(grammar)

    def sample(self, logits: torch.Tensor, plan: BatchPlan, rows: np.ndarray) -> ForwardOutput:
        """Sample ``logits`` float32[len(rows), vocab]: one entry per sample of the step, ``rows``
        its plan row (``sampling_rows``; a row verifying k drafts has 1 + k consecutive
        entries, the j-th predicting output token ``num_output_tokens + j``).

        Returns, per plan row, its samples' tokens (one 0 for a row that does not sample, which
        the engine ignores), with logprobs when any sampling row asks for them. A seeded row's
        j-th sample draws with the uniform of output index ``num_output_tokens + j``: the same
        tokens with and without speculative decoding.
        """
        sampling = plan.sampling
        slots = plan.request_slots[rows].tolist()
        offsets = offsets_in_row(rows)
        if self.grammar_slots and len(rows) != len(set(rows.tolist())):
            verifying = {slots[r] for r in np.flatnonzero(offsets > 0).tolist()}
            if verifying & set(self.grammar_slots):
                raise NotImplementedError(
                    "a grammar-constrained request in a verify row (speculative decoding): "
                    "structured outputs need num_speculative_tokens = 0"
                )
        greedy = np.asarray(sampling.temperature[rows]) == 0
        filtered = _filtered(
            np.asarray(sampling.top_k[rows]),
            np.asarray(sampling.top_p[rows]),
            np.asarray(sampling.min_p[rows]),
            self.vocab_size,
        )
        # Greedy, drawn unfiltered, drawn filtered: each group's rows copied once (none when
        # there is one group and nothing to change), then one batched call per group.
        groups = [np.flatnonzero(greedy), np.flatnonzero(~greedy & ~filtered)]
        groups.append(np.flatnonzero(~greedy & filtered))
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        for group, part in enumerate(groups):
            if len(part) == 0:
                continue
            whole = len(part) == len(rows)
            processed, owned = self._processed(logits, plan, rows, slots, None if whole else part)
            if group == 0:  # the greedy fast path: no filters, no softmax, no sort
                group_tokens = processed.argmax(dim=-1)
            else:
                group_tokens = self._draw(processed, owned, plan, rows, offsets, part)
            if whole:
                tokens = group_tokens
            else:
                tokens[self._tensor(part, np.int64)] = group_tokens
        return self._output(plan, rows, offsets, tokens, logits)

    def _draw(
        self,
        processed: torch.Tensor,
        owned: bool,
        plan: BatchPlan,
        rows: np.ndarray,
        offsets: np.ndarray,
        part: np.ndarray,
    ) -> torch.Tensor:
        """Tokens int64 [n] for the samples ``part`` (indices into ``rows``), whose processed
        logits are ``processed`` [n, V] (divided by the temperature in place when ``owned``):
        one :func:`sample_tokens` call."""
        chosen = rows[part]
        output_indices = plan.num_output_tokens[chosen].astype(np.int64) + offsets[part]
        sampling = plan.sampling
        temperature = self._tensor(sampling.temperature[chosen], np.float32)[:, None]
        return sample_tokens(
            processed.div_(temperature) if owned else processed / temperature,
            self._tensor(sampling.top_k[chosen], np.int64),
            self._tensor(sampling.top_p[chosen], np.float32),
            self._tensor(sampling.min_p[chosen], np.float32),
            self._uniforms(np.asarray(sampling.seed[chosen], dtype=np.int64), output_indices),
        )

    def _tensor(self, values: np.ndarray, dtype: type[np.generic]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=dtype), device=self.device)

    def _processed(
        self,
        logits: torch.Tensor,
        plan: BatchPlan,
        rows: np.ndarray,
        slots: list[int],
        part: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """The logits of the samples ``part`` (indices into ``rows``; all of them when None)
        after penalties, bans and grammar masks, changed at the affected entries only, and
        whether the tensor is a copy of this call's: ``part``'s rows (``index_select``), or
        all of them when any has a penalty, a ban or a grammar; else ``logits`` itself."""
        if part is not None:
            rows, slots = rows[part], [slots[i] for i in part.tolist()]
        sampling = plan.sampling
        repetition = np.asarray(sampling.repetition_penalty[rows], dtype=np.float32)
        frequency = np.asarray(sampling.frequency_penalty[rows], dtype=np.float32)
        presence = np.asarray(sampling.presence_penalty[rows], dtype=np.float32)
        indptr = plan.banned_token_indptr.astype(np.int64)
        num_banned = indptr[rows + 1] - indptr[rows]
        repeating = np.flatnonzero(repetition != 1.0)
        counting = np.flatnonzero((frequency != 0.0) | (presence != 0.0))
        changed = len(repeating) or len(counting) or num_banned.any() or self.grammar_slots
        if part is not None:
            processed = logits.index_select(0, self._tensor(part, np.int64))
        elif changed:
            processed = logits.clone(memory_format=torch.contiguous_format)
        else:
            return logits, False
        flat = processed.view(-1)  # entry (r, t) at r * vocab_size + t
        if len(repeating):  # prompt + output tokens: positive / penalty, negative * penalty
            at, r, _ = self._history_entries(repeating, slots, outputs_only=False)
            values = flat.index_select(0, at)
            penalty = torch.as_tensor(repetition, device=self.device)[r]
            flat.index_copy_(0, at, torch.where(values > 0, values / penalty, values * penalty))
        if len(counting):  # output tokens: logit -= frequency * count + presence * (count > 0)
            at, r, counts = self._history_entries(counting, slots, outputs_only=True)
            f = torch.as_tensor(frequency, device=self.device)[r]
            p = torch.as_tensor(presence, device=self.device)[r]
            counts = counts.to(processed.dtype)
            penalty = f * counts + p * (counts > 0).to(counts.dtype)
            flat.index_copy_(0, at, flat.index_select(0, at) - penalty)
        banned_rows = np.flatnonzero(num_banned)
        if len(banned_rows):
            first = np.repeat(np.cumsum(num_banned) - num_banned, num_banned)
            ids = np.repeat(indptr[rows], num_banned) + np.arange(int(num_banned.sum())) - first
            sample = np.repeat(np.arange(len(rows), dtype=np.int64), num_banned)
            banned = sample * self.vocab_size + plan.banned_token_ids[ids].astype(np.int64)
            flat.index_fill_(0, self._tensor(banned, np.int64), -torch.inf)
        if self.grammar_slots:
            self._mask(processed, logits, slots, banned_rows.tolist(), part)
        return processed, True

    def _history_entries(
        self, samples: np.ndarray, slots: list[int], outputs_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distinct (sample, token) pairs of the ``samples``' histories (prompt + output
        tokens, or output tokens only) as flat indices ``sample * vocab_size + token``, their
        samples, and how often each token occurs: three int64 [n]."""
        histories = []
        for r in samples.tolist():
            state = self.slots[slots[r]]
            histories.append(state.output_token_ids if outputs_only else state.token_ids)
        lengths = np.array([len(h) for h in histories], dtype=np.int64)
        tokens = np.fromiter(chain.from_iterable(histories), np.int64, int(lengths.sum()))
        keys = np.repeat(samples.astype(np.int64), lengths) * self.vocab_size + tokens
        keys, counts = np.unique(
            keys[(tokens >= 0) & (tokens < self.vocab_size)], return_counts=True
        )
        return (
            self._tensor(keys, np.int64),
            self._tensor(keys // self.vocab_size, np.int64),
            self._tensor(counts, np.int64),
        )

    def _uniforms(self, seeds: np.ndarray, output_indices: np.ndarray) -> torch.Tensor:
        """float32 [n]: a seeded sample's :func:`~resin.sampling_state.sample_uniforms`
        number, an unseeded one's from the sampler's generator (one call for all of them)."""
        uniforms = torch.as_tensor(
            sample_uniforms(np.maximum(seeds, 0), output_indices), device=self.device
        )
        unseeded = np.flatnonzero(seeds < 0)
        if len(unseeded):
            uniforms[torch.as_tensor(unseeded, device=self.device)] = torch.rand(
                len(unseeded), generator=self.generator, device=self.device
            )
        return uniforms

    def _mask(
        self,
        processed: torch.Tensor,
        logits: torch.Tensor,
        slots: list[int],
        banned: list[int],
        part: np.ndarray | None,
    ) -> None:
        """Apply the grammar rows' token masks to ``processed`` in place (its row r is row
        ``part[r]`` of ``logits``, r when ``part`` is None); a row of ``banned`` (rows with
        banned tokens) left with no allowed token gets the grammar mask alone."""
        indices, grammars = [], []
        for r, slot in enumerate(slots):
            grammar = self.grammar_slots.get(slot)
            if grammar is not None and grammar.constrains:
                indices.append(r)
                grammars.append(grammar)
        if not grammars:
            return
        apply_grammar_masks(processed, indices, grammars, self._mask_buffer)
        for r in set(banned).intersection(indices):
            if bool(torch.isneginf(processed[r]).all()):  # the bans left nothing: grammar wins
                processed[r] = logits[r if part is None else int(part[r])]
                apply_grammar_masks(
                    processed, [r], [self.grammar_slots[slots[r]]], self._mask_buffer
                )

    def _output(
        self,
        plan: BatchPlan,
        rows: np.ndarray,
        offsets: np.ndarray,
        tokens: torch.Tensor,
        logits: torch.Tensor,
    ) -> ForwardOutput:
        """Pack the tokens, with logprobs (of the raw ``logits``) computed for the samples that
        ask for them only; the other samples' entries are zeros the engine does not read."""
        k = max_num_logprobs(plan, rows)
        token_ids = tokens.cpu().numpy()
        if k < 0:
            return pack_output(plan, rows, offsets, token_ids)
        asking = np.flatnonzero(plan.sampling.num_logprobs[rows] >= 0)
        at = torch.as_tensor(asking, device=self.device)
        logprobs = torch.log_softmax(logits.index_select(0, at).float(), dim=-1)
        top_values, top_ids = torch.topk(logprobs, k, dim=-1)
        sampled = np.zeros(len(rows), dtype=np.float32)
        all_top_ids = np.zeros((len(rows), k), dtype=np.int64)
        all_top_values = np.zeros((len(rows), k), dtype=np.float32)
        sampled[asking] = logprobs.gather(1, tokens[at][:, None])[:, 0].cpu().numpy()
        all_top_ids[asking] = top_ids.cpu().numpy()
        all_top_values[asking] = top_values.cpu().numpy()
        return pack_output(plan, rows, offsets, token_ids, sampled, all_top_ids, all_top_values)


CANDIDATES = 256
"""How many of a row's largest logits the filters and the draw look at first (fixed, so a
row's token never depends on the rest of the batch): a row whose kept set lies inside them
draws among them; one without filters, or whose kept set reaches past them (a wide top-p or
top-k), draws over the whole vocabulary — the same token either way, more work."""


def sample_tokens(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row of ``scaled`` float32 [S, V] (logits / temperature), all rows at once.

    ``top_k`` int64 [S] (0 = off), ``top_p`` / ``min_p`` / ``uniforms`` float32 [S] (the
    uniforms in [0, 1)). The row keeps the tokens at or above :func:`filter_thresholds`; its
    token is the first kept one, in token-id order, whose cumulative probability (softmax over
    the kept tokens) exceeds its uniform: inverse-CDF sampling, so the token depends only on
    the row's logits, settings and uniform. Returns int64 [S].
    """
    num_rows, vocab_size = scaled.shape
    filtered = _filtered(top_k, top_p, min_p, vocab_size)
    if not bool(filtered.all()):  # no filter: the whole row's softmax
        if not bool(filtered.any()):
            return _inverse_cdf(scaled, uniforms)[:, 0]
        tokens = torch.empty(num_rows, dtype=torch.int64, device=scaled.device)
        at = (~filtered).nonzero()[:, 0]
        tokens[at] = _inverse_cdf(scaled.index_select(0, at), uniforms[at])[:, 0]
        at = filtered.nonzero()[:, 0]
        tokens[at] = sample_tokens(
            scaled.index_select(0, at), top_k[at], top_p[at], min_p[at], uniforms[at]
        )
        return tokens
    values, indices = scaled.topk(min(CANDIDATES, vocab_size), dim=-1)
    threshold = filter_thresholds(scaled, values, indices, top_k, top_p, min_p)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=scaled.device)
    if values.shape[1] < vocab_size:
        inside = threshold > values[:, -1]
    else:  # the candidates are the whole vocabulary
        inside = torch.ones(num_rows, dtype=torch.bool, device=scaled.device)
    at = inside.nonzero()[:, 0]
    if len(at):  # kept tokens first, in token-id order; the other candidates after them
        v = values.index_select(0, at)
        kept = v >= threshold[at, None]
        order, perm = torch.where(kept, indices.index_select(0, at), vocab_size).sort(dim=-1)
        v = v.gather(1, perm).masked_fill(order == vocab_size, -torch.inf)
        tokens[at] = order.gather(1, _inverse_cdf(v, uniforms[at]))[:, 0]
    at = (~inside).nonzero()[:, 0]
    if len(at):
        v = scaled.index_select(0, at)
        if bool(threshold[at].isfinite().any()):
            v.masked_fill_(v < threshold[at, None], -torch.inf)
        tokens[at] = _inverse_cdf(v, uniforms[at])[:, 0]
    return tokens


def _filtered(top_k: Any, top_p: Any, min_p: Any, vocab_size: int) -> Any:
    """Which rows have a filter (top-k, top-p or min-p on): numpy or torch, [S] bool."""
    return ((top_k > 0) & (top_k < vocab_size)) | (top_p < 1) | (min_p > 0)


def _inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 [n, 1]: per row of ``logits`` [n, m], the first column whose cumulative softmax
    exceeds ``uniforms`` [n] times the total (never a column of probability 0)."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, cdf.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def filter_thresholds(
    logits: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """float32 [S]: per row of ``logits`` [S, V], the smallest logit it keeps after top-k,
    then top-p (over the top-k survivors), then min-p, in transformers' order; ``values`` /
    ``indices`` [S, C] are the row's C largest logits, descending (``logits.topk(C)``).

    - top-k (0 = off): the k-th largest logit; ties with it are kept.
    - top-p (1 = off): the smallest set of most likely tokens whose probability reaches
      ``top_p`` (always the most likely one; ties with the last one are kept). Found among the
      C candidates when their probability reaches ``top_p``, else by a sort of the row.
    - min-p (0 = off): tokens whose probability is at least ``min_p`` times the top one's,
      i.e. logits >= max + log(min_p).
    """
    threshold = top_k_thresholds(logits, values, top_k)
    nucleus = (top_p < 1).nonzero()[:, 0]
    if len(nucleus):
        top_p_threshold = _top_p_thresholds(logits, values, indices, threshold, top_p, nucleus)
        threshold[nucleus] = torch.maximum(threshold[nucleus], top_p_threshold)
    min_p_threshold = values[:, 0] + torch.log(min_p.clamp(min=0).to(values.dtype))
    return torch.maximum(threshold, min_p_threshold)


def top_k_thresholds(
    logits: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """float32 [S]: each row's k-th largest logit (``-inf`` where top-k is off: 0 or >= V)."""
    vocab_size, num_candidates = logits.shape[1], values.shape[1]
    top_k = top_k.to(torch.int64)
    active = (top_k > 0) & (top_k < vocab_size)
    threshold = values.gather(1, (top_k.clamp(1, num_candidates) - 1)[:, None])[:, 0]
    threshold = threshold.masked_fill(~active | (top_k > num_candidates), -torch.inf)
    wide = (active & (top_k > num_candidates)).nonzero()[:, 0]
    if len(wide):  # k past the candidates: a topk of its own
        k = top_k[wide]
        wide_values = logits.index_select(0, wide).topk(int(k.max()), dim=-1).values
        threshold[wide] = wide_values.gather(1, (k - 1)[:, None])[:, 0]
    return threshold


def _top_p_thresholds(
    logits: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    top_k_threshold: torch.Tensor,
    top_p: torch.Tensor,
    nucleus: torch.Tensor,
) -> torch.Tensor:
    """float32 [n]: the smallest logit of the nucleus of each row in ``nucleus`` int64 [n],
    over its top-k survivors (logits >= ``top_k_threshold``); the other arguments as
    :func:`filter_thresholds`'s."""
    vocab_size = logits.shape[1]
    threshold = torch.empty(len(nucleus), dtype=values.dtype, device=values.device)
    kth, mass = top_k_threshold[nucleus], top_p[nucleus]
    # A top-k inside the candidates: the distribution is theirs; else the whole row's.
    if values.shape[1] < vocab_size:
        small = kth > values[nucleus, -1]
    else:  # the candidates are the whole vocabulary
        small = torch.ones(len(nucleus), dtype=torch.bool, device=values.device)
    at = small.nonzero()[:, 0]
    if len(at):
        v = values.index_select(0, nucleus[at])
        probs = v.masked_fill(v < kth[at, None], -torch.inf).softmax(dim=-1)
        threshold[at] = v.gather(1, _first_reaching(probs.cumsum(dim=-1), mass[at]))[:, 0]
    at = (~small).nonzero()[:, 0]
    if len(at):
        row = logits.index_select(0, nucleus[at])
        if bool(kth[at].isfinite().any()):
            row.masked_fill_(row < kth[at, None], -torch.inf)
        probs = row.softmax(dim=-1)
        cumulative = probs.gather(1, indices.index_select(0, nucleus[at])).cumsum(dim=-1)
        first = _first_reaching(cumulative, mass[at])
        threshold[at] = values.index_select(0, nucleus[at]).gather(1, first)[:, 0]
        beyond = (cumulative[:, -1] < mass[at]).nonzero()[:, 0]
        if len(beyond):  # the nucleus reaches past the candidates: sort those rows
            probs = probs.index_select(0, beyond)
            order = probs.argsort(dim=-1, descending=True)
            cumulative = probs.gather(1, order).cumsum(dim=-1)
            first = order.gather(1, _first_reaching(cumulative, mass[at][beyond]))
            threshold[at[beyond]] = row.index_select(0, beyond).gather(1, first)[:, 0]
    return threshold


def _first_reaching(cumulative: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """int64 [n, 1]: the first column where ``cumulative`` [n, m] reaches ``mass`` [n] (the
    last column when none does)."""
    first = (cumulative < mass[:, None]).sum(dim=-1, keepdim=True)
    return first.clamp_(max=cumulative.shape[1] - 1)


def _keep_from(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(logits < threshold[:, None], -torch.inf)


def _candidates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = logits.topk(min(CANDIDATES, logits.shape[1]), dim=-1)
    return values, indices


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] with each row's logits below its ``top_k`` largest set to ``-inf``
    (ties at the k-th kept); 0 = keep all."""
    return _keep_from(logits, top_k_thresholds(logits, _candidates(logits)[0], top_k))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] keeping each row's smallest set of most likely tokens whose probability
    reaches ``top_p`` (the most likely always; ties with the last kept); 1 = keep all."""
    threshold = logits.new_full((logits.shape[0],), -torch.inf)
    values, indices = _candidates(logits)
    nucleus = (top_p < 1).nonzero()[:, 0]
    threshold[nucleus] = _top_p_thresholds(
        logits, values, indices, threshold.clone(), top_p, nucleus
    )
    return _keep_from(logits, threshold)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] dropping tokens whose probability is below ``min_p`` times the row's
    top probability; 0 = keep all."""
    top = logits.max(dim=-1).values
    return _keep_from(logits, top + torch.log(min_p.clamp(min=0).to(logits.dtype)))
