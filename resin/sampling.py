"""Token sampling for torch runners: :class:`Sampler` turns each sampling row's logits into a token.

Owns the per-request sampler state (the token history penalties need, keyed by
``plan.request_slots``; grammar matchers) and one step's order of work:

1. ``logit_bias``, penalties on the raw logits, then ``banned_token_ids``
   (:mod:`resin.sampling_penalties`: repetition, frequency, presence; the per-slot counts
   kept across steps);
2. grammar masks (structured outputs, below);
3. temperature 0 = greedy (argmax of the penalised logits, :mod:`resin.sampling_greedy`; a
   step whose rows are all greedy does nothing else); otherwise divide by the temperature,
   keep the tokens top-k, top-p and min-p leave (:mod:`resin.sampling_filters`,
   transformers' order) and draw (:mod:`resin.sampling_draw`: inverse-CDF sampling from the
   sample's uniform number).

On a CPU with float32 logits in one contiguous block, and no grammar matcher in the sampler,
nothing is copied: the entries a bias, penalty or ban changes are written into ``logits`` in
place for the step's pick and their raw values written back right after (``Sampler._patched``),
the greedy rows are picked where they lie (``_core.argmax`` over the rows named), and the
drawn rows go through one Rust call (:mod:`resin.sampling_kernel`: the same filters and draw,
the same tokens bit for bit), which reads each row where it lies; a row it leaves (e.g. a
top-k past 256) takes the torch path below from a copy of its row. Otherwise,
the greedy rows and the drawn rows are each copied once into a reused buffer
(:mod:`resin.sampling_workspace`), the drawn ones in the blocks the draw reads in place
(:func:`~resin.sampling_draw.draw_groups`: without a filter, then by the width of their
candidate search), and each block is one batched call; a step of one kind copies nothing
unless a penalty, ban or grammar changes its logits. ``sample`` returns with ``logits`` as it
found them.

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
ask only; the top ones are ``topk``'s values (on the CPU from
:func:`~resin.sampling_candidates.top_candidates`, one scan in Rust, ~8x torch's ``topk``
there; tokens of equal logprobs in any order). ``top_logprob_ids`` has ``k = max
num_logprobs`` of the batch columns; rows asking fewer just carry extra columns, rows not
asking zeros (the engine reads neither).

Structured outputs (:mod:`resin.structured_output`): ``sampler.grammars`` is a
:class:`~resin.structured_output.GrammarRegistry` the server fills (request id -> compiled
grammar). A slot whose request has a grammar when it is (re)created gets a matcher, advanced
over the outputs it already has; each row's ``committed_token_ids`` advance it further (never
the sampled tokens, so a discarded plan replays exactly). In :meth:`Sampler.sample` the grammar
rows' logits are masked (disallowed tokens ``-inf``, after penalties and bans, before greedy /
temperature), one bitmask for the batch; rows without a grammar are untouched. A grammar row
whose bans leave no allowed token falls back to the grammar mask alone.

The filters and the draw are re-exported here (``CANDIDATES``, :func:`sample_tokens`,
:func:`apply_top_k`, :func:`apply_top_p`, :func:`apply_min_p`, :func:`filter_thresholds`).

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from resin import sampling_kernel
from resin._core import BatchPlan, ForwardOutput
from resin.sampling_candidates import top_candidates
from resin.sampling_draw import draw_groups, draw_tokens, sample_tokens
from resin.sampling_filters import (
    CANDIDATES,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    filter_thresholds,
)
from resin.sampling_greedy import greedy_tokens
from resin.sampling_penalties import Penalties
from resin.sampling_state import (
    SlotHistory,
    max_num_logprobs,
    offsets_in_row,
    pack_output,
    sample_uniforms,
)
from resin.sampling_workspace import Workspace
from resin.structured_output import GrammarRegistry, GrammarSlot, MaskBuffer, apply_grammar_masks

__all__ = [
    "CANDIDATES",
    "Sampler",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "filter_thresholds",
    "sample_tokens",
]


class Sampler(SlotHistory):
    """Samples one token per sampling row; keeps per-request state across plans (the token
    history of :class:`~resin.sampling_state.SlotHistory`, the penalties' counts, grammar
    matchers) and the scratch buffers a step reuses."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.grammars = GrammarRegistry()
        self.grammar_slots: dict[int, GrammarSlot] = {}
        self._mask_buffer = MaskBuffer(vocab_size)
        self.penalties = Penalties(vocab_size, self.device)
        self.workspace = Workspace(self.device)

    def begin_step(self, plan: BatchPlan) -> list[int]:
        """Apply the plan's lifecycle diff: drop finished slots, start new ones from their
        request's tokens, and append each row's ``committed_token_ids``.

        Call once per plan, before :meth:`sample`. Idempotent for a re-sent diff (the plan
        after a discarded one): a slot reset twice starts from the same
        ``new_request_token_ids``, and committed tokens land at their output index.
        """
        for slot in plan.finished_request_slots.tolist():
            self.grammar_slots.pop(slot, None)
            self.penalties.drop(slot)
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
            request_id = request_ids[row]
            grammar = self.grammars.get(request_id)
            if grammar is not None:
                reporter = self.grammars.failure_reporter(request_id)
                self.grammar_slots[slot] = GrammarSlot(grammar, reporter)

    def sample(self, logits: torch.Tensor, plan: BatchPlan, rows: np.ndarray) -> ForwardOutput:
        """Sample ``logits`` float32[len(rows), vocab]: one entry per sample of the step, ``rows``
        its plan row (``sampling_rows``; a row verifying k drafts has 1 + k consecutive
        entries, the j-th predicting output token ``num_output_tokens + j``).

        Returns, per plan row, its samples' tokens (one 0 for a row that does not sample, which
        the engine ignores), with logprobs when any sampling row asks for them. A seeded row's
        j-th sample draws with the uniform of output index ``num_output_tokens + j``: the same
        tokens with and without speculative decoding. ``logits`` are left as found (penalties
        patched in place on the CPU path are written back before it returns).
        """
        sampling = plan.sampling
        slots = plan.request_slots[rows].tolist()
        offsets = offsets_in_row(rows)
        if self.grammar_slots and len(rows) != len(set(rows.tolist())):
            verifying = {slots[r] for r in np.flatnonzero(offsets > 0).tolist()}
            if verifying & set(self.grammar_slots):
                raise NotImplementedError(
                    "a grammar-constrained request in a verify row (speculative decoding): "
                    "submit it with SamplingParams(speculate=False), as the server does"
                )
        greedy = np.asarray(sampling.temperature[rows]) == 0
        top_k = np.asarray(sampling.top_k[rows])
        top_p = np.asarray(sampling.top_p[rows])
        kind = draw_groups(top_k, top_p, np.asarray(sampling.min_p[rows]), self.vocab_size)
        # Greedy rows, then the drawn ones copied once, in the blocks the draw reads them in
        # (draw_groups: unfiltered rows, then by the width of the candidate search), top-p
        # rows without a top-k first in theirs (they read the whole row too), and within
        # those the rows at temperature 1 first (nothing to divide). No copy for a step of
        # one kind with nothing to change.
        top_k_on = (top_k > 0) & (top_k < self.vocab_size)
        divided = np.asarray(sampling.temperature[rows]) != 1
        order = 4 * kind + 2 * ~((top_p < 1) & ~top_k_on) + divided
        drawn = np.flatnonzero(~greedy)
        drawn = drawn[np.argsort(order[drawn], kind="stable")]
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        in_place = self._patchable(logits)
        for group, part in enumerate((np.flatnonzero(greedy), drawn)):
            if len(part) == 0:
                continue
            whole = len(part) == len(rows) and bool((part[1:] > part[:-1]).all())
            if group == 0 and in_place:
                with self._patched(logits, plan, rows, slots, part):
                    group_tokens = greedy_tokens(logits, None if whole else part)
            elif group == 1 and in_place and sampling_kernel.takes(logits):
                with self._patched(logits, plan, rows, slots, part):
                    group_tokens = self._draw_in_kernel(logits, plan, rows, offsets, part)
            else:
                processed, owned = self._processed(
                    logits, plan, rows, slots, None if whole else part
                )
                if group == 0:  # the greedy fast path: no filters, no softmax, no sort
                    group_tokens = greedy_tokens(processed)
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
        one :func:`~resin.sampling_draw.draw_tokens` call."""
        chosen = rows[part]
        sampling = plan.sampling
        return draw_tokens(
            processed,
            self._tensor(sampling.temperature[chosen], np.float32),
            self._tensor(sampling.top_k[chosen], np.int64),
            self._tensor(sampling.top_p[chosen], np.float32),
            self._tensor(sampling.min_p[chosen], np.float32),
            self._part_uniforms(plan, rows, offsets, part),
            self.workspace,
            owned=owned,
        )

    def _part_uniforms(
        self, plan: BatchPlan, rows: np.ndarray, offsets: np.ndarray, part: np.ndarray
    ) -> torch.Tensor:
        """float32 [n]: the uniforms of the samples ``part`` (indices into ``rows``), one
        :meth:`_uniforms` call in ``part``'s order (the j-th sample of a row at output index
        ``num_output_tokens + j``)."""
        chosen = rows[part]
        output_indices = plan.num_output_tokens[chosen].astype(np.int64) + offsets[part]
        return self._uniforms(
            np.asarray(plan.sampling.seed[chosen], dtype=np.int64), output_indices
        )

    def _patchable(self, logits: torch.Tensor) -> bool:
        """Whether this step may change ``logits`` in place for its draws and restore them
        (:meth:`_patched`): float32 CPU rows in one contiguous block no autograd tracks, and
        no grammar matcher (grammar rows are masked in a copy)."""
        return (
            not self.grammar_slots
            and self.device.type == "cpu"
            and logits.is_cpu
            and logits.dtype is torch.float32
            and logits.dim() == 2
            and logits.is_contiguous()
            and not logits.requires_grad
        )

    @contextmanager
    def _patched(
        self,
        logits: torch.Tensor,
        plan: BatchPlan,
        rows: np.ndarray,
        slots: list[int],
        part: np.ndarray,
    ) -> Iterator[None]:
        """``logits`` with the biases, penalties and bans of the samples ``part`` (indices into
        ``rows``; sample i's logits are row ``part[i]``) written at the entries they change,
        and those entries' raw values written back on exit, whatever happens inside: the rows
        are read where they lie instead of copied (a copy of a penalised 152k row costs more
        than the draw from it), and the caller sees its logits unchanged. The values are the
        ones :meth:`_processed` writes into its copy, bit for bit."""
        chosen = rows[part]
        step = self.penalties.plan(plan, chosen)
        if not step.changes_logits:
            yield
            return
        part_slots = [slots[i] for i in part.tolist()]
        rules = self.penalties.rules(step, plan, part_slots, self.slots, part)
        flat = logits.view(-1)
        values = flat.numpy()  # float32 CPU (``_patchable``): numpy's indexing, ~10x torch's here
        touched = np.concatenate([rule.at.numpy() for rule in rules])  # repeats: same raw value
        raw = values[touched]
        self.penalties.apply(flat, rules)
        try:
            yield
        finally:
            values[touched] = raw

    def _draw_in_kernel(
        self,
        logits: torch.Tensor,
        plan: BatchPlan,
        rows: np.ndarray,
        offsets: np.ndarray,
        part: np.ndarray,
    ) -> torch.Tensor:
        """:meth:`_draw`'s tokens for the samples ``part`` from ``_core.sample_rows``
        (:mod:`resin.sampling_kernel`), each read where it lies in ``logits`` (the caller has
        patched its penalties in, :meth:`_patched`); the uniforms drawn once, in ``part``'s
        order, as :meth:`_draw` draws them; a sample the kernel leaves goes to
        :func:`~resin.sampling_draw.draw_tokens` from a copy of its row."""
        chosen = rows[part]
        sampling = plan.sampling
        uniforms = self._part_uniforms(plan, rows, offsets, part).numpy()
        temperature = np.asarray(sampling.temperature[chosen], dtype=np.float32)
        top_k = np.asarray(sampling.top_k[chosen], dtype=np.int64)
        top_p = np.asarray(sampling.top_p[chosen], dtype=np.float32)
        min_p = np.asarray(sampling.min_p[chosen], dtype=np.float32)
        tokens = sampling_kernel.kernel_tokens(
            logits, part, temperature, top_k, top_p, min_p, uniforms
        )
        left = np.flatnonzero(tokens < 0)
        if len(left):  # the torch path for what the kernel leaves, its rows copied once
            tokens[left] = draw_tokens(
                logits.index_select(0, torch.as_tensor(part[left], dtype=torch.int64)),
                torch.as_tensor(temperature[left]),
                torch.as_tensor(top_k[left]),
                torch.as_tensor(top_p[left]),
                torch.as_tensor(min_p[left]),
                torch.as_tensor(uniforms[left]),
                self.workspace,
                owned=True,
            ).numpy()
        return torch.as_tensor(tokens, device=self.device)

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
        whether the tensor is this call's to change: ``part``'s rows copied into the workspace,
        or all of them when any has a penalty, a ban or a grammar; else ``logits`` itself."""
        if part is not None:
            rows, slots = rows[part], [slots[i] for i in part.tolist()]
        step = self.penalties.plan(plan, rows)
        if part is None and not (step.changes_logits or self.grammar_slots):
            return logits, False
        processed = self.workspace.get(
            "sampler.processed", (len(rows), logits.shape[1]), logits.dtype
        )
        if part is not None:
            torch.index_select(logits, 0, self._tensor(part, np.int64), out=processed)
        else:
            processed.copy_(logits)
        self.penalties.apply(
            processed.view(-1), self.penalties.rules(step, plan, slots, self.slots)
        )
        if self.grammar_slots:
            banned_rows = np.flatnonzero(step.num_banned)
            self._mask(processed, logits, slots, banned_rows.tolist(), part)
        return processed, True

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
        raw = (logits if len(asking) == len(rows) else logits.index_select(0, at)).float()
        # log_softmax's own kernel (the same bits), written into a reused buffer.
        logprobs = self.workspace.get("sampler.logprobs", tuple(raw.shape), raw.dtype)
        torch.ops.aten._log_softmax.out(raw, -1, False, out=logprobs)
        # topk's values; on the CPU from top_candidates' kernel (equal ones may come from
        # other columns), elsewhere one topk call (the tree there is several launches).
        if logprobs.is_cpu:
            top_values, top_ids = top_candidates(logprobs, k, self.workspace)
        else:
            top_values, top_ids = torch.topk(logprobs, k, dim=-1)
        sampled = np.zeros(len(rows), dtype=np.float32)
        all_top_ids = np.zeros((len(rows), k), dtype=np.int64)
        all_top_values = np.zeros((len(rows), k), dtype=np.float32)
        sampled[asking] = logprobs.gather(1, tokens[at][:, None])[:, 0].cpu().numpy()
        all_top_ids[asking] = top_ids.cpu().numpy()
        all_top_values[asking] = top_values.cpu().numpy()
        return pack_output(plan, rows, offsets, token_ids, sampled, all_top_ids, all_top_values)
