"""The attention-backend seam: every model reaches paged attention through one interface.

Owns :class:`AttentionBackend` (the interface), :class:`ReferenceBackend` (the readable
per-sequence implementation every faster backend is checked against), the registry of backends
selected by name at runner construction (``--attention-backend``), and :class:`LayerAttention`,
the per-layer handle a block receives as ``ctx.attention``.

A backend is planned once per step and run once per layer, as FlashInfer's ``plan()`` /
``run()``:

- :meth:`AttentionBackend.begin_step` gets the step's :class:`~.step_inputs.StepInputs` and,
  per cache group, its window (tokens, or None): a backend builds whatever per-group metadata
  its kernels need (the reference backend: each row's readable slots and mask).
- :meth:`AttentionBackend.write` stores new per-token values (K, V, a latent, indexer keys...)
  through the group's ``slot_mapping`` (slot -1: not written).
- :meth:`AttentionBackend.gather` hands each row its readable cache entries with their
  positions, for attention kinds a softmax call cannot express (compressed / indexed
  attention kept on a plain cache);
- :meth:`AttentionBackend.attend` computes softmax attention of ``q`` [T, heads, head_dim] over
  each row's cached keys in the group -> [T, heads, value_dim], with the options models need:
  ``scale``, per-head ``sinks`` (gpt-oss), logit ``softcap`` (Gemma 2), shared K = V caches
  (MQA / MLA latent: ``v_cache=None`` reads values from the key cache, first ``value_dim``
  channels), grouped KV heads (GQA/MQA: ``heads`` a multiple of the cache's KV heads).

Caches are ``[num_pages, page_entries, kv_heads, dim]`` tensors (``page_entries`` = page_size
for a token group, ``entries_per_page`` for a compressed one); slot = page * page_entries +
offset. A cache may be a strided view into a buffer shared across cache groups (one page row
holds every buffer of the layer), so slots are read and written through
:func:`~.layers.read_slots` / :func:`~.layers.write_slots`, never a flat ``view``.
Models never call a kernel directly, so a new backend needs no model edit. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from resin.runners.torch.layers import (
    SequenceView,
    build_sequence_views,
    read_slots,
    slot_rows,
    write_slots,
)
from resin.runners.torch.step_inputs import StepInputs


def head_layout(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, value_dim: int | None
) -> tuple[int, int, int]:
    """``(query heads, query heads per KV head, value width)`` of one ``attend`` call, checked
    the same way by every backend: the query heads must be a multiple of the cache's KV heads;
    the value width is ``value_dim``, else the value cache's (the key cache's for K = V)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads"
        )
    values = v_cache if v_cache is not None else k_cache
    return (
        num_heads,
        num_heads // num_kv_heads,
        value_dim if value_dim is not None else values.shape[-1],
    )


def masked_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    softcap: float | None,
    query_dtype: torch.dtype,
    value_dtype: torch.dtype,
) -> torch.Tensor:
    """Attention probabilities from scaled ``scores`` [..., K], every backend's one rule:
    soft-capping (``tanh(scores / softcap) * softcap``) before the ``mask`` (False: -inf);
    without ``sinks`` an fp32 softmax cast to the query dtype; with ``sinks`` (broadcastable
    to ``scores.shape[:-1] + (1,)``) the sink logit joins every row's softmax and is dropped
    after it — the row max, sink included, subtracted first, in the promoted dtype (an fp32
    sink makes it fp32, as torch.cat's promotion does in HF) — cast to the value dtype."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query_dtype)
    dtype = torch.promote_types(scores.dtype, sinks.dtype)
    sink = sinks.to(dtype).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores.to(dtype), sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(value_dtype)


class AttentionBackend:
    """The interface. Subclasses implement :meth:`begin_step` and :meth:`attend`."""

    name = "base"
    # (slot_mapping, keep mask or None when every token is written, kept slots int64, row
    # indices of those slots per (page_entries, rows_per_page) of a strided cache): :meth:`write`
    _write_memo: (
        tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[tuple[int, int], torch.Tensor]]
        | None
    ) = None

    def begin_step(
        self,
        step: StepInputs,
        group_windows: Sequence[int | None],
        group_page_entries: Sequence[int],
        group_ratios: Sequence[int] | None = None,
    ) -> None:
        """Plan the step: called once per forward, before any layer. Per cache group:
        ``group_windows`` (sliding window in tokens, or None), ``group_page_entries`` (positions
        one page holds: ``page_size`` for a token group, ``CacheGroup.entries_per_page`` for
        a compressed one) and ``group_ratios`` (source tokens per entry: 1 for token groups;
        a compressed group's entry e is visible to a query at position p iff its closing
        position (e + 1) * ratio - 1 <= p)."""
        raise NotImplementedError

    def write(
        self,
        caches: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store each ``values[i]`` [T, kv_heads, dim] into ``caches[i]`` at ``slot_mapping``
        (int64[T]); skip slot -1 (one mask for all the buffers).

        -1 must never be used as an index (it would address the pool's last slot). Every layer
        of a group passes the same ``slot_mapping``: the mask and the kept slots are worked out
        for its first write in the step and reused (no per-layer masking when every token is
        written); ``begin_step`` forgets them.
        """
        memo = self._write_memo
        if memo is None or memo[0] is not slot_mapping:
            keep = slot_mapping >= 0
            every = bool(keep.all())
            kept = (slot_mapping if every else slot_mapping[keep]).long()
            memo = (slot_mapping, None if every else keep, kept, {})
            self._write_memo = memo
        _, kept_mask, slots, row_indices = memo
        for cache, tensor in zip(caches, values):
            rows = None
            strided = None if cache.is_contiguous() else slot_rows(cache)
            if strided is not None:
                # A view into shared page rows: one index_copy_ into its row view, with the
                # row indices worked out once per step and layout (not per layer).
                view, rows_per_page = strided
                key = (cache.shape[1], rows_per_page)
                index = row_indices.get(key)
                if index is None:
                    per_page = cache.shape[1]
                    index = row_indices[key] = slots // per_page * rows_per_page + slots % per_page
                rows = (view, index)
            write_slots(cache, slots, tensor if kept_mask is None else tensor[kept_mask], rows)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        group: int,
        *,
        scale: float,
        value_dim: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def gather(self, cache: torch.Tensor, group: int) -> list[RowHistory]:
        """Per plan row, what it may read of ``cache`` in ``group`` (this step's tokens
        included): for attention a softmax kernel cannot express (compressed or indexed
        attention on a plain cache). Readable, not fast."""
        raise NotImplementedError(f"the {self.name} backend has no gather")


@dataclass
class RowHistory:
    """One plan row's readable cache entries: ``query`` slices the step's tokens;
    ``positions`` int64[K] and ``values`` [K, ...] are its cached tokens in position order
    (causality and the group's window applied at the row's last token); ``mask``
    bool[query_len, K] says which keys each of its queries may see."""

    query: slice
    positions: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


class GroupArrays(NamedTuple):
    """One cache group's page table for this step (the plan's CSR arrays, the step's token
    positions) and how to read it: entries per page, sliding window, tokens per entry."""

    query_indptr: np.ndarray
    seq_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    positions: torch.Tensor
    page_entries: int
    window: int | None
    ratio: int


class ReferenceBackend(AttentionBackend):
    """Per-sequence attention in plain torch: gather each row's slots, mask, softmax in fp32.

    With ``sinks`` the sink logit joins every query's softmax and is dropped after it (the row
    max, sink included, is subtracted first and the softmax runs in the query dtype, as HF's
    gpt-oss eager attention). ``softcap``: ``tanh(scores / softcap) * softcap`` before masking.
    """

    name = "reference"

    def __init__(self) -> None:
        # Per group, built on first use in a step: a group no layer attends (a recurrent
        # state group) costs nothing.
        self.views: list[list[SequenceView] | None] = []
        self._step: tuple[StepInputs, Sequence[int | None], list[int], list[int]] | None = None

    def begin_step(
        self,
        step: StepInputs,
        group_windows: Sequence[int | None],
        group_page_entries: Sequence[int],
        group_ratios: Sequence[int] | None = None,
    ) -> None:
        ratios = list(group_ratios or [1] * len(group_windows))
        self._step = (step, group_windows, list(group_page_entries), ratios)
        self.views = [None] * len(group_windows)
        # A step may reuse last step's slot_mapping tensor with new contents (static buffers).
        self._write_memo = None

    def group_arrays(self, group: int) -> GroupArrays:
        """This step's page table of ``group`` and how to read it."""
        assert self._step is not None, "begin_step first"
        step, windows, page_entries, ratios = self._step
        plan = step.plan
        return GroupArrays(
            plan.query_indptr,
            plan.seq_lens,
            plan.kv_indptr[group],
            plan.kv_indices[group],
            step.positions,
            page_entries[group],
            windows[group],
            ratios[group],
        )

    def _views(self, group: int) -> list[SequenceView]:
        """Each row's readable slots and mask in ``group`` (once per step and group)."""
        views = self.views[group]
        if views is None:
            t = self.group_arrays(group)
            views = build_sequence_views(
                t.query_indptr,
                t.seq_lens,
                t.kv_indptr,
                t.kv_indices,
                t.positions,
                t.page_entries,
                t.window,
                t.positions.device,
                ratio=t.ratio,
            )
            self.views[group] = views
        return views

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        group: int,
        *,
        scale: float,
        value_dim: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_heads, repeat, dim_v = head_layout(q, k_cache, v_cache, value_dim)
        out = q.new_empty(q.shape[0], num_heads, dim_v)
        for view in self._views(group):
            k_rows = read_slots(k_cache, view.slots)
            v_rows = k_rows if v_cache is None else read_slots(v_cache, view.slots)
            k = k_rows.repeat_interleave(repeat, dim=1)  # [K, H, D]
            v = v_rows[..., :dim_v].repeat_interleave(repeat, dim=1)  # [K, H, Dv]
            scores = torch.einsum("qhd,khd->hqk", q[view.query], k) * scale
            sink = None if sinks is None else sinks.reshape(-1, 1, 1)
            probs = masked_softmax(scores, view.mask[None], sink, softcap, q.dtype, v.dtype)
            out[view.query] = torch.einsum("hqk,khd->qhd", probs, v)
        return out

    def gather(self, cache: torch.Tensor, group: int) -> list[RowHistory]:
        out = []
        for view in self._views(group):
            assert view.key_positions is not None
            readable = view.mask.any(dim=0)
            out.append(
                RowHistory(
                    view.query,
                    view.key_positions[readable],
                    read_slots(cache, view.slots[readable]),
                    view.mask[:, readable],
                )
            )
        return out


def _torch_backend() -> AttentionBackend:
    from resin.runners.torch.torch_backend import TorchBackend  # it subclasses ReferenceBackend

    return TorchBackend()


def _triton_backend() -> AttentionBackend:
    from resin.runners.torch.triton_backend import TritonBackend  # it subclasses ReferenceBackend

    return TritonBackend()


def _flashinfer_backend() -> AttentionBackend:
    # It subclasses TorchBackend (its fallback); building it needs CUDA and flashinfer-python.
    from resin.runners.torch.flashinfer_backend import FlashInferBackend

    return FlashInferBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "reference": ReferenceBackend,
    "torch": _torch_backend,  # every row in one batched call per layer (torch_backend.py)
    "triton": _triton_backend,  # a paged-attention kernel on the page table (triton_backend.py)
    "flashinfer": _flashinfer_backend,  # FlashInfer's paged wrappers (flashinfer_backend.py)
}
# What a server and resin.LLM run (fast); the parity harness defaults to the per-row reference
# backend instead (PARITY_BACKEND: the closest to HF eager attention, bit-exact in bf16).
DEFAULT_BACKEND = "torch"
PARITY_BACKEND = "reference"


def make_attention_backend(name: str | AttentionBackend | None = None) -> AttentionBackend:
    """A backend by name (default :data:`DEFAULT_BACKEND`), or the object itself."""
    if isinstance(name, AttentionBackend):
        return name
    key = name or DEFAULT_BACKEND
    if key not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {key!r}; available: {', '.join(sorted(BACKENDS))}"
        )
    return BACKENDS[key]()


@dataclass
class LayerAttention:
    """``ctx.attention`` for one layer: its cache buffers, its group, the step's backend.

    ``caches`` maps the names the layer declared (``k``, ``v``; or e.g. ``kv`` for a shared
    K = V cache) to ``[num_pages, page_size, heads, dim]`` buffers.
    """

    backend: AttentionBackend
    group: int
    slot_mapping: torch.Tensor
    caches: dict[str, torch.Tensor]

    def write(self, **values: torch.Tensor) -> None:
        """Store this step's per-token tensors, e.g. ``write(k=k, v=v)`` ([T, heads, dim])."""
        self.backend.write(
            [self._cache(name) for name in values], list(values.values()), self.slot_mapping
        )

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
        """Attention of ``q`` [T, heads, dim] over the cached ``keys`` / ``values`` buffers
        (``values=None``: values are the keys' first ``value_dim`` channels)."""
        v_cache = None if values is None or values == keys else self._cache(values)
        return self.backend.attend(
            q,
            self._cache(keys),
            v_cache,
            self.group,
            scale=scale,
            value_dim=value_dim,
            sinks=sinks,
            softcap=softcap,
        )

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
        """Write ``k``/``v`` then attend: the common GQA case in one call."""
        self.write(k=k, v=v)
        return self.attend(q, scale=scale, sinks=sinks, softcap=softcap)

    def gather(self, name: str) -> list[RowHistory]:
        """Per plan row, the cached entries of buffer ``name`` it may read (see
        :meth:`AttentionBackend.gather`)."""
        return self.backend.gather(self._cache(name), self.group)

    def _cache(self, name: str) -> torch.Tensor:
        if name not in self.caches:
            raise KeyError(
                f"layer cache has no buffer {name!r}; declared: {', '.join(self.caches) or 'none'}"
            )
        return self.caches[name]
