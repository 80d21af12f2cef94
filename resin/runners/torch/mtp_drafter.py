"""The MTP drafter: a model's next-n layer proposing speculative tokens (DeepSeek's MTP).

Owns :class:`MtpDrafter`, run by :class:`~.paged_runner.PagedRunner` after each sampled step
when ``enable_mtp(k)`` was called, and :class:`DraftAttention`, the ``ctx.attention`` of its
draft steps. The proposals go back to the engine in ``ForwardOutput.draft_token_ids`` /
``draft_indptr``; the engine verifies them in the next plan like any drafter's (greedy:
identical output; sampling: rejection sampling against the proposal, a point mass — the
drafts are the MTP head's argmax).

The MTP layer keeps a sequence of its own, one entry per token: the entry at position ``s``
is the MTP layer's input ``(h[s-1], token[s])`` — the target's hidden state at the previous
position and this position's token — so, like every cache, it depends only on tokens up to
``s`` (prefix caching can share it). Two caches hold it, both in the engine's pool:

- the MTP layer's own attention cache (its layer type's, e.g. a sliding window), written for
  every token of every step (prompt chunks included) by the **cache pass**;
- ``target_hidden``: the target's hidden state per token, a window of 2 tokens, so a row
  starting at ``a`` finds ``h[a-1]`` from the previous step (or a prefix-cache hit).

Position 0 has no previous token: its entry is written from a zero input (hidden and
embedding) so that every cache stays position-complete, but it is **no entry of the MTP
sequence**: vLLM's entry ``p`` is ``(h[p], token[p+1])`` — Resin's entry ``p + 1``, RoPE being
relative —, SGLang's and the DeepSeek-V3 paper's likewise, so theirs starts at Resin's position
1 and a draft query never attends position 0 (:class:`DraftAttention`; in every cache of the
layer whose entries are tokens — main, extras, windows; a compressed entry, closed at a position
``>= ratio - 1``, stays visible with whatever it pooled of position 0). vLLM also zeroes the
embedding of its first entry ("masking inputs at position 0"): a model directory does that at
Resin's position 1 in ``mtp_input``. The cache pass needs no such mask: its output is
discarded (one MTP layer, chained for every draft step: only the caches it writes are read), and
what it writes is computed from the layer's input — a token's own, or a pool's tokens' — never
from an attention output.

After sampling, each row that sampled drafts ``k`` tokens by the **draft chain**: step 1 is
the entry after the row's last accepted token — the target's hidden there and the token the
engine commits after it (the bonus) — then each step feeds the layer's own output hidden and
the previous draft. Draft steps read the cached entries up to the last accepted position (a
verify row's rejected positions were cached too, but are never read: the next step rewrites
them) plus the draft steps' own keys, held in :class:`DraftAttention`, never in the pool:
a draft step's position may not have a page yet. With ``num_nextn_predict_layers`` > 1 the
first layer is chained (vLLM's choice for DeepSeek). Imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from resin._core import ForwardOutput
from resin.runners.forward_outputs import output_with
from resin.runners.torch.attention import RowHistory, masked_softmax
from resin.runners.torch.context import LayerContext
from resin.runners.torch.layers import read_slots
from resin.runners.torch.model_definition import LayerCache, MtpDefinition
from resin.runners.torch.step_inputs import StepInputs
from resin.sampling_greedy import greedy_tokens

if TYPE_CHECKING:
    from resin.runners.torch.paged_runner import PagedRunner

TARGET_HIDDEN = "target_hidden"  # the MTP layer's extra cache of the target's hidden states


def target_hidden_cache(definition: MtpDefinition) -> LayerCache:
    """The per-token window of the target's hidden states the cache pass reads back one
    position later (2 tokens: the previous one and the current)."""
    return LayerCache("sliding_window", {"hidden": definition.hidden_shape}, window=2)


class MtpDrafter:
    """Runs one model's MTP layer for its runner (see the module doc)."""

    def __init__(self, runner: PagedRunner, definition: MtpDefinition, num_tokens: int):
        if num_tokens < 1:
            raise ValueError("the MTP drafter needs num_speculative_tokens >= 1")
        self.runner = runner
        self.definition = definition
        self.layer = definition.layers[0]
        self.num_tokens = num_tokens

    def run(
        self,
        step: StepInputs,
        hidden: torch.Tensor,
        out: ForwardOutput,
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> ForwardOutput:
        """The cache pass over the step's tokens, then ``num_tokens`` drafts per sampled row;
        ``hidden`` is the target's last-layer hidden state [T, *hidden_shape]."""
        runner, layer = self.runner, self.layer
        ctx = runner._context(step, layer.index, tables)
        ctx.caches = runner.layer_caches[layer.index]
        w = runner.child_weights[layer.index]["mtp"]
        if self.definition.target is not None:  # what the MTP layer reads of the target
            top = runner._context(step, -1)
            hidden = self.definition.target(hidden, runner.weights.globals, top)
        prev = self._previous_hidden(step, hidden, ctx)
        ctx.extra[TARGET_HIDDEN].write(hidden=hidden)
        embeds = runner.model.embed(step.input_ids, runner.weights.globals, ctx)
        first = step.positions == 0  # no previous position: a zero input (no draft sees it)
        if bool(first.any()):
            prev = prev.masked_fill(first.view(-1, *[1] * (prev.dim() - 1)), 0)
            embeds = embeds.masked_fill(first[:, None], 0)
        x = self.definition.input(prev, embeds, w, ctx)
        layer.decoder(x, layer.children, runner.child_weights[layer.index], ctx, _no_emit)
        rows, last, bonus = _accepted(step, out)
        if not rows.size:
            return out
        drafts = self._chain(step, ctx, hidden[last], bonus, rows, last)
        counts = np.zeros(len(step.plan.seq_lens), dtype=np.int64)
        counts[rows] = self.num_tokens
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
        return output_with(
            out, draft_token_ids=drafts.reshape(-1).astype(np.uint32), draft_indptr=indptr
        )

    def _previous_hidden(
        self, step: StepInputs, hidden: torch.Tensor, ctx: LayerContext
    ) -> torch.Tensor:
        """Per token, the target's hidden state one position back: this step's previous token
        within a row; for a row's first token, ``target_hidden`` at that position (zeros at
        position 0)."""
        prev = torch.zeros_like(hidden)
        prev[1:] = hidden[:-1]
        plan = step.plan
        group = ctx.extra[TARGET_HIDDEN].group
        cache = ctx.extra[TARGET_HIDDEN].caches["hidden"]
        page_size = self.runner.group_page_entries[group]
        starts = plan.query_indptr[:-1].astype(np.int64)
        rows = np.flatnonzero(plan.query_indptr[1:].astype(np.int64) > starts)
        first = starts[rows]  # each row's first token, then the position before it
        position = plan.positions[first].astype(np.int64) - 1
        prev[torch.as_tensor(first[position < 0], device=prev.device)] = 0
        rows, first, position = rows[position >= 0], first[position >= 0], position[position >= 0]
        if not len(rows):
            return prev
        # One read for every row (the window group lists pages from the window's first).
        pointers = plan.kv_indptr[group].astype(np.int64)
        listed = pointers[rows + 1] - pointers[rows]
        first_page = -(-plan.seq_lens[rows].astype(np.int64) // page_size) - listed
        index = position // page_size - first_page
        lost = (index < 0) | (index >= listed)
        if lost.any():
            raise RuntimeError(
                f"MTP: the target's hidden state at position {int(position[lost][0])} left the "
                f"pool (row {int(rows[lost][0])}); the engine must keep the {TARGET_HIDDEN} window"
            )
        pages = plan.kv_indices[group].astype(np.int64)[pointers[rows] + index]
        slots = torch.as_tensor(pages * page_size + position % page_size, device=cache.device)
        prev[torch.as_tensor(first, device=prev.device)] = read_slots(cache, slots).to(prev.dtype)
        return prev

    def _chain(
        self,
        step: StepInputs,
        cached: LayerContext,
        hidden: torch.Tensor,
        bonus: np.ndarray,
        rows: np.ndarray,
        last: np.ndarray,
    ) -> np.ndarray:
        """``num_tokens`` greedy drafts per sampled row [R, k]: the draft chain (module doc)."""
        runner, layer, definition = self.runner, self.layer, self.definition
        device = hidden.device
        next_position = step.positions[torch.as_tensor(last, device=device)] + 1

        def draft(view: Any) -> DraftAttention:  # one per cache the layer declared
            window, ratio = runner.group_windows[view.group], runner.group_ratios[view.group]
            return DraftAttention(view, rows, next_position, window, ratio)

        attention = draft(cached.require_attention())
        extra = {name: draft(v) for name, v in cached.extra.items() if name != TARGET_HIDDEN}
        rotary = runner.model.rotary_for(layer.layer_type)
        w = runner.child_weights[layer.index]["mtp"]
        tokens = torch.as_tensor(bonus, device=device, dtype=torch.long)
        out = np.zeros((len(rows), self.num_tokens), dtype=np.int64)
        for i in range(self.num_tokens):
            positions = next_position + i
            ctx = LayerContext(
                index=layer.index,
                config=runner.config,
                head_dim=runner.model.head_dim,
                dtype=runner.dtype,
                input_ids=tokens,
                positions=positions,
                layer_type=layer.layer_type,
                window=layer.window,
                rotary=rotary,
                attention=attention,  # type: ignore[arg-type]
                query_indptr=torch.arange(len(rows) + 1, device=device),
                extra=extra,  # type: ignore[arg-type]
            )
            if rotary is not None:
                ctx.cos, ctx.sin = rotary.cos_sin(positions, runner.dtype)
            embeds = runner.model.embed(tokens, runner.weights.globals, ctx)
            x = definition.input(hidden, embeds, w, ctx)
            hidden = layer.decoder(
                x, layer.children, runner.child_weights[layer.index], ctx, _no_emit
            )
            normed = definition.output(hidden, w, ctx)
            logits = runner.model.logits(normed, runner.weights.globals, ctx)
            tokens = greedy_tokens(logits.float())
            out[:, i] = tokens.cpu().numpy()
            for view in (attention, *extra.values()):
                view.next_step()
        return out


def _accepted(step: StepInputs, out: ForwardOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row that sampled: the row, the step index of its last accepted token (its last
    committed input, or the last draft the model agreed with) and the token the engine commits
    after it (the bonus) — the engine's own acceptance rule (engine.rs ``commit_row``)."""
    plan = step.plan
    token_ids = np.asarray(out.token_ids, dtype=np.int64)
    indptr = np.asarray(out.token_indptr, dtype=np.int64)
    ends = plan.query_indptr[1:].astype(np.int64)
    num_drafts = plan.num_draft_tokens.astype(np.int64)
    input_ids = plan.input_ids
    rows, last, bonus = [], [], []
    # (A row that does not sample returns one ignored 0: go by the plan's sample_indptr.)
    for row in np.flatnonzero(np.diff(plan.sample_indptr.astype(np.int64)) > 0):
        sampled = token_ids[indptr[row] : indptr[row + 1]]
        k = int(num_drafts[row])
        drafts = input_ids[ends[row] - k : ends[row]]
        j = 0
        while j < min(k, len(sampled) - 1) and sampled[j] == drafts[j]:
            j += 1
        rows.append(row)
        last.append(ends[row] - 1 - k + j)
        bonus.append(sampled[j])
    return np.asarray(rows, dtype=np.int64), np.asarray(last, dtype=np.int64), np.asarray(bonus)


def _no_emit(child: str, tensor: torch.Tensor) -> None:
    """Parity capture covers the target model, not the drafter."""


class DraftAttention:
    """``ctx.attention`` (and each ``ctx.extra[name]``) of the draft steps: one query per
    drafting row, over one of the MTP layer's caches — its cached entries up to the row's last
    accepted position and the entries the draft steps wrote so far (held here, never in the
    pool). ``window`` / ``ratio`` are the cache group's: an entry is visible to the query at
    ``p`` when its position (a compressed entry's: the token that closes it) is ``<= p``, is
    not 0 (position 0's zero-input entry is no entry of the MTP sequence: module doc) and, with
    a window, is ``> p - window``; a compressed group keeps a draft step's written entry only
    when that step closes one (``(p + 1) % ratio == 0``), as the pool's slot mapping would.
    ``attend`` is softmax attention as :class:`~.attention.ReferenceBackend` computes it (sinks,
    soft-capping, GQA, K = V); ``gather`` gives the same entries as one
    :class:`~.attention.RowHistory` per drafting row (query ``r``), for layers that read their
    caches themselves (compressed or indexed attention)."""

    def __init__(
        self,
        cached: Any,
        rows: np.ndarray,
        first_position: torch.Tensor,
        window: int | None,
        ratio: int = 1,
    ):
        self.cached = cached  # the cache pass's view of this cache (a LayerAttention)
        self.rows = rows
        self.first_position = first_position  # the first draft step's position, per row
        self.window = window
        self.ratio = ratio
        self.step = 0
        self.history: dict[str, list[RowHistory]] = {}
        self.written: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def next_step(self) -> None:
        self.step += 1

    def write(self, **values: torch.Tensor) -> None:
        """This draft step's entries [R, ...] (one per drafting row)."""
        position = self.first_position + self.step
        keep = (position + 1) % self.ratio == 0  # a compressed group: closing steps only
        for name, tensor in values.items():
            log = self.written.setdefault(name, [])
            del log[self.step :]  # a layer writing twice in one step keeps the last
            log.append((tensor, keep))

    def _rows(self, name: str) -> list[RowHistory]:
        """Per drafting row: positions, values and the visibility mask [1, K] of buffer
        ``name`` for this draft step's query (cached entries, then the draft steps' own)."""
        if name not in self.history:
            self.history[name] = self.cached.gather(name)
        position = self.first_position + self.step  # this step's query position, per row
        own = self.written.get(name, [])[: self.step + 1]
        out = []
        for r, row in enumerate(self.rows):
            hist = self.history[name][int(row)]
            accepted = hist.positions < self.first_position[r]  # up to the last accepted
            positions, values = hist.positions[accepted], hist.values[accepted]
            mine = [(i, t[r]) for i, (t, keep) in enumerate(own) if bool(keep[r])]
            if mine:
                steps = torch.tensor([i for i, _ in mine], device=positions.device)
                positions = torch.cat([positions, self.first_position[r] + steps])
                values = torch.cat([values, torch.stack([t for _, t in mine]).to(values.dtype)])
            # Position 0's entry (a zero input: no h[-1]) is in every cache but is no entry of
            # the MTP sequence vLLM / SGLang / DeepSeek run (theirs starts at (h[0], t[1]),
            # Resin's position 1): no draft query sees it. (A compressed entry's position is
            # the token closing it, > 0 whenever ratio > 1: those stay visible.)
            visible = (positions <= position[r]) & (positions > 0)
            if self.window is not None:
                visible &= positions > position[r] - self.window
            out.append(RowHistory(slice(r, r + 1), positions, values, visible[None, :]))
        return out

    def gather(self, name: str) -> list[RowHistory]:
        return self._rows(name)

    def _keys(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, K, kv_heads, dim]`` keys of buffer ``name`` for this draft step and their mask
        ``[R, K]`` (rows padded to the longest)."""
        rows = self._rows(name)
        width = max((len(h.positions) for h in rows), default=0)
        sample = rows[0].values
        keys = sample.new_zeros((len(rows), width, *sample.shape[1:]))
        mask = torch.zeros((len(rows), width), dtype=torch.bool, device=sample.device)
        for r, hist in enumerate(rows):
            n = len(hist.positions)
            keys[r, :n] = hist.values
            mask[r, :n] = hist.mask[0]
        return keys, mask

    def attend(
        self,
        q: torch.Tensor,
        *,
        scale: float,
        keys: str = "k",
        values: str | None = "v",
        value_dim: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        k, mask = self._keys(keys)
        v = k if values is None or values == keys else self._keys(values)[0]
        num_heads, num_kv_heads = q.shape[1], k.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads, {num_kv_heads} KV heads")
        repeat = num_heads // num_kv_heads
        dim_v = value_dim if value_dim is not None else v.shape[-1]
        k = k.repeat_interleave(repeat, dim=2)  # [R, K, H, D]
        v = v[..., :dim_v].repeat_interleave(repeat, dim=2)
        scores = torch.einsum("rhd,rkhd->rhk", q, k) * scale
        sink = None if sinks is None else sinks.reshape(1, -1, 1)
        probs = masked_softmax(scores, mask[:, None, :], sink, softcap, q.dtype, v.dtype)
        return torch.einsum("rhk,rkhd->rhd", probs, v)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` then attend, as ``LayerAttention`` does: the one call the shared
        GQA attention block makes (an MTP layer built from the stack's blocks, GLM-4.5's)."""
        self.write(k=k, v=v)
        return self.attend(q, scale=scale, sinks=sinks, softcap=softcap)
