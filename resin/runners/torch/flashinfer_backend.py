"""The ``flashinfer`` attention backend: FlashInfer's paged wrappers reading Resin's cache in place.

Once per step and cache group, :func:`build_page_table` turns the plan's page table into
FlashInfer's CSR form — ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``,
int32 on the host (FlashInfer's ``plan()`` reads the indptrs there and copies the rest to the
GPU). The first layer that attends in a group plans a wrapper for it; every later layer of the
group only calls ``run()``:

- every row has one query (a decode step): ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores
  when more than :data:`TENSOR_CORE_GROUP` query heads share a KV head, vLLM's rule);
- otherwise (prefill chunks, mixed steps, draft verification): ``BatchPrefillWithPagedKVCacheWrapper``
  with ``causal=True``, whose mask is bottom-right aligned: query ``i`` of a row with ``q``
  queries and ``kv_len`` listed keys sits at key index ``kv_len - q + i``;
- with attention sinks: ``BatchAttentionWithAttentionSinkWrapper`` for both (when the installed
  FlashInfer has it).

**What FlashInfer computes is what the reference backend computes** when a row's new tokens
are its last ones — the query at ``positions[t]`` is the row's key ``seq_len - q + i`` — which
:func:`build_page_table`'s caller checks against the plan's positions (a step where it fails
runs on the torch backend). A sliding-window group lists only the pages intersecting the
window, always through the row's last page (docs/batch_plan.md), so FlashInfer's key index is
the logical position less ``first_listed_page * page_size``: relative distances, hence the
causal mask and the window (``window_left = window - 1``: keys in ``[p - window_left, p]``,
Resin's ``(p - window, p]``), are unchanged. Logit softcap is FlashInfer's ``logits_soft_cap``
(``cap * tanh(q.k * scale / cap)``, the reference's order); GQA / MQA are its
``num_qo_heads / num_kv_heads`` (query head ``h`` reads KV head ``h // group``, as the
reference's ``repeat_interleave``).

**The cache, in place.** A layer's ``k`` and ``v`` buffers are ``[num_pages, page_size,
kv_heads, head_dim]`` views carved from its layer slot's uint8 page rows (``PagedRunner``): the
page stride is the slot's ``page_bytes / element size`` (the row may hold other buffers after
them), the rest contiguous, and K and V have the same strides. They are handed to ``run()`` as
the tuple ``(k_cache, v_cache)``: FlashInfer's NHD layout with its own strides (its kernels read
``stride(0)``, ``stride(1)``, ``stride(2)`` and require K's and V's to match), so no byte is
copied. When a slot holds only K and V, each page row is exactly FlashInfer's single-tensor NHD
``[num_pages, 2, page_size, kv_heads, head_dim]`` page.

**Falls back to the torch backend** (:class:`~.torch_backend.TorchBackend`, the same
semantics, batched in plain torch) per call, with the reason counted in ``fallback_reasons``,
for what FlashInfer's paged wrappers do not take (:func:`unsupported_reason`): a shared K = V
cache (MLA latent, a single K = V head: the wrappers take separate K and V of one width), a
value width other than the key width, a compressed group (entries, not tokens), dtypes other
than fp16 / bf16 or K / V of another dtype than q, head dims outside
:data:`SUPPORTED_HEAD_DIMS`, strides FlashInfer cannot read, sinks without the sink wrapper
(or with a softcap, which its sink variant has not), and tensors off CUDA. ``gather``
(compressed / indexed attention) is the reference backend's.

``plan()`` runs on the host, so a step through this backend cannot be captured in a CUDA
graph as it stands (FlashInfer's ``use_cuda_graph`` wrappers with fixed buffers would be the
way). Building the backend needs CUDA and the ``flashinfer-python`` package; the module itself
imports neither, so the page-table code runs (and is tested) anywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from resin.runners.torch.attention import head_layout
from resin.runners.torch.torch_backend import TorchBackend

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace, one per backend
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # FlashInfer's FA2 / FA3 head dims (prefill and decode)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
TENSOR_CORE_GROUP = 4  # decode on tensor cores above this many query heads per KV head
ALIGN_BYTES = 16  # FlashInfer loads K / V 16 bytes at a time (cp.async)


@dataclass(frozen=True)
class PageTable:
    """One cache group's FlashInfer page table for a step (module doc); int32 on the host.

    ``qo_indptr`` [S+1] (row i's queries are the step's tokens ``[qo_indptr[i],
    qo_indptr[i+1])``), ``kv_indptr`` [S+1] / ``kv_indices`` [nnz] (the pages it lists, in
    position order), ``kv_last_page_len`` [S] (entries used in its last listed page, 1..page
    size; 0 when it lists none), ``kv_lens`` [S] (its listed keys: ``(pages - 1) * page_size +
    last``), ``seq_lens`` [S]; ``window_left`` is FlashInfer's (``window - 1``, -1 for none).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    window_left: int

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def qo_lens(self) -> torch.Tensor:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]

    @property
    def decode_only(self) -> bool:
        """Every row has exactly one query (FlashInfer's decode wrapper then applies)."""
        return self.num_rows > 0 and bool((self.qo_lens == 1).all())


def _int64(array: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array).astype(np.int64))


def build_page_table(
    query_indptr: Any,
    seq_lens: Any,
    kv_indptr: Any,
    kv_indices: Any,
    page_size: int,
    window: int | None,
) -> PageTable:
    """FlashInfer's CSR page table for one token group from the plan's arrays (uint32 numpy,
    or anything ``np.asarray`` takes). The pages are the plan's own (no copy of the cache, no
    re-listing): the last page's length follows from ``seq_len``, since the plan lists every
    row through its last page. ValueError when a row's listed keys cannot hold its queries."""
    qo_indptr, seq = _int64(query_indptr), _int64(seq_lens)
    indptr, indices = _int64(kv_indptr), _int64(kv_indices)
    num_listed = indptr[1:] - indptr[:-1]
    num_pages = (seq + page_size - 1) // page_size
    last = torch.where(num_listed > 0, seq - (num_pages - 1) * page_size, 0)
    kv_lens = torch.where(num_listed > 0, (num_listed - 1) * page_size + last, 0)
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    bad = (num_listed > num_pages) | (qo_lens > kv_lens)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"row {row}: {int(num_listed[row])} listed pages of {page_size} hold "
            f"{int(kv_lens[row])} keys for seq_len {int(seq[row])} and {int(qo_lens[row])} "
            "queries: the plan must list every row's pages through its last one"
        )
    return PageTable(
        qo_indptr=qo_indptr.to(torch.int32),
        kv_indptr=indptr.to(torch.int32),
        kv_indices=indices.to(torch.int32),
        kv_last_page_len=last.to(torch.int32),
        kv_lens=kv_lens.to(torch.int32),
        seq_lens=seq.to(torch.int32),
        page_size=page_size,
        window_left=-1 if window is None else int(window) - 1,
    )


def trailing_positions(table: PageTable) -> torch.Tensor:
    """int64 [T]: the position FlashInfer assumes for each query — row i's are its last ``q``
    tokens, ``seq_len - q .. seq_len - 1``."""
    qo_lens = table.qo_lens.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(table.num_rows), qo_lens)
    offsets = torch.arange(int(qo_lens.sum())) - table.qo_indptr.to(torch.int64)[rows]
    return (table.seq_lens.to(torch.int64) - qo_lens)[rows] + offsets


def table_views(table: PageTable) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per row, what FlashInfer's kernels read from ``table``: ``(query slice, slots int64
    [kv_len], mask bool [q, kv_len])`` — key j of the listed pages lives at slot ``page *
    page_size + offset``; query i sees key j iff ``j <= kv_len - q + i`` (bottom-right causal)
    and, with a window, ``j >= kv_len - q + i - window_left``. For tests and for reading: the
    contract the backend relies on, in plain torch."""
    views = []
    ps, offsets = table.page_size, torch.arange(table.page_size)
    for row in range(table.num_rows):
        start, stop = int(table.kv_indptr[row]), int(table.kv_indptr[row + 1])
        pages = table.kv_indices[start:stop].to(torch.int64)
        kv_len = int(table.kv_lens[row])
        slots = (pages[:, None] * ps + offsets[None, :]).reshape(-1)[:kv_len]
        q0, q1 = int(table.qo_indptr[row]), int(table.qo_indptr[row + 1])
        query_at = kv_len - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        keys = torch.arange(kv_len)[None, :]
        mask = keys <= query_at
        if table.window_left >= 0:
            mask &= keys >= query_at - table.window_left
        views.append((slice(q0, q1), slots, mask))
    return views


def unsupported_reason(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    *,
    value_dim: int | None,
    ratio: int,
    sinks: torch.Tensor | None,
    softcap: float | None,
    has_sink_wrapper: bool,
    require_cuda: bool = True,
) -> str | None:
    """Why FlashInfer's paged wrappers cannot run this ``attend`` call, or None (module doc)."""
    if ratio > 1:
        return "compressed group (entries, not tokens)"
    if v_cache is None:
        return "shared K = V cache (MLA latent / one K = V head)"
    head_dim = q.shape[-1]
    if k_cache.shape[-1] != head_dim or v_cache.shape[-1] != head_dim:
        return "key / value width other than the query's"
    if value_dim is not None and value_dim != head_dim:
        return "value width other than the key width"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (FlashInfer: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(q.dtype).removeprefix('torch.')} (FlashInfer: float16, bfloat16)"
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return "K / V cache dtype other than the query's"
    if require_cuda and not (q.is_cuda and k_cache.is_cuda and v_cache.is_cuda):
        return "tensors not on a CUDA device"
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        return "K / V strides FlashInfer cannot read (they must match, last dim contiguous)"
    item = k_cache.element_size()
    if any((s * item) % ALIGN_BYTES for s in k_cache.stride()[:-1]) or any(
        t.data_ptr() % ALIGN_BYTES for t in (k_cache, v_cache)
    ):
        return f"K / V pages not {ALIGN_BYTES}-byte aligned"
    if sinks is not None and not has_sink_wrapper:
        return "attention sinks (this FlashInfer has no BatchAttentionWithAttentionSinkWrapper)"
    if sinks is not None and softcap is not None:
        return "attention sinks with a logit softcap (FlashInfer's sink variant has no softcap)"
    return None


def load_flashinfer() -> Any:
    """The ``flashinfer`` module; RuntimeError naming whatever is missing (CUDA, the package)."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("flashinfer") is None:
        missing.append("the 'flashinfer-python' package (pip install flashinfer-python)")
    if missing:
        raise RuntimeError(
            "the flashinfer attention backend needs "
            + " and ".join(missing)
            + "; --attention-backend torch runs the same attention in plain torch"
        )
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:  # installed, but a dependency of it is not
        raise RuntimeError(
            f"the flashinfer attention backend: import flashinfer failed: {exc}"
        ) from exc


class FlashInferBackend(TorchBackend):
    """FlashInfer's paged decode / prefill wrappers behind the seam (module doc).

    ``flashinfer``: the module to use (default: import it, which needs CUDA); a stand-in
    object with the same wrapper classes runs the backend's own logic anywhere (tests).
    ``kernel_backend``: FlashInfer's ``backend=`` for the wrappers (``auto``: its choice, FA3
    on Hopper where it has one; ``fa2`` pins the FA2 kernels)."""

    name = "flashinfer"

    def __init__(self, flashinfer: Any = None, kernel_backend: str = "auto") -> None:
        self.require_cuda = flashinfer is None
        self.flashinfer = load_flashinfer() if flashinfer is None else flashinfer
        super().__init__()
        self.kernel_backend = kernel_backend
        self.workspace: torch.Tensor | None = None
        self.wrappers: dict[tuple[Any, ...], Any] = {}  # kept across steps, planned per step
        self.planned: set[tuple[Any, ...]] = set()
        self.tables: dict[int, PageTable | str] = {}  # per group: the table, or why not
        self.fallback_reasons: Counter[str] = Counter()
        self.num_runs = 0

    @property
    def has_sink_wrapper(self) -> bool:
        return hasattr(self.flashinfer, "BatchAttentionWithAttentionSinkWrapper")

    def begin_step(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().begin_step(*args, **kwargs)
        self.planned = set()
        self.tables = {}

    def _table(self, group: int) -> PageTable | str:
        """The group's page table for this step (once), or why FlashInfer cannot read it."""
        table = self.tables.get(group)
        if table is not None:
            return table
        assert self._step is not None, "begin_step first"
        step, windows, page_entries, _ = self._step
        plan = step.plan
        result: PageTable | str
        try:
            result = build_page_table(
                plan.query_indptr,
                plan.seq_lens,
                plan.kv_indptr[group],
                plan.kv_indices[group],
                int(page_entries[group]),
                windows[group],
            )
        except ValueError as exc:
            result = f"page table: {exc}"
        else:
            given = getattr(plan, "positions", None)
            positions = step.positions.cpu() if given is None else _int64(given)
            if not torch.equal(positions.to(torch.int64), trailing_positions(result)):
                result = "positions other than each row's trailing tokens"
        self.tables[group] = result
        return result

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
        head_layout(q, k_cache, v_cache, value_dim)  # the seam's one shape check
        assert self._step is not None, "begin_step first"
        reason = unsupported_reason(
            q,
            k_cache,
            v_cache,
            value_dim=value_dim,
            ratio=int(self._step[3][group]),
            sinks=sinks,
            softcap=softcap,
            has_sink_wrapper=self.has_sink_wrapper,
            require_cuda=self.require_cuda,
        )
        table = self._table(group) if reason is None else reason
        if isinstance(table, str) or v_cache is None:  # v_cache None: a reason already
            self.fallback_reasons[str(table)] += 1
            return super().attend(
                q,
                k_cache,
                v_cache,
                group,
                scale=scale,
                value_dim=value_dim,
                sinks=sinks,
                softcap=softcap,
            )
        if q.shape[0] == 0:
            return q.new_empty(q.shape)
        wrapper = self._planned(group, table, q, k_cache, scale, softcap, sinks is not None)
        query = q if q.stride(-1) == 1 else q.contiguous()
        self.num_runs += 1
        if sinks is not None:
            sink = sinks.to(device=q.device, dtype=torch.float32).contiguous()
            return wrapper.run(query, (k_cache, v_cache), sink, float(scale))
        return wrapper.run(query, (k_cache, v_cache))

    def _planned(
        self,
        group: int,
        table: PageTable,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        scale: float,
        softcap: float | None,
        has_sinks: bool,
    ) -> Any:
        """The wrapper for this call's kind and options, planned once this step."""
        num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
        kind = "sink" if has_sinks else ("decode" if table.decode_only else "prefill")
        tensor_cores = num_heads // num_kv_heads > TENSOR_CORE_GROUP
        key: tuple[Any, ...] = (group, kind, num_heads, num_kv_heads, head_dim, q.dtype)
        key += (float(scale), softcap, table.window_left, tensor_cores)
        wrapper = self.wrappers.get(key)
        if wrapper is None:
            wrapper = self.wrappers[key] = self._make_wrapper(
                kind, q, head_dim, table, tensor_cores
            )
        if key in self.planned:
            return wrapper
        common = dict(
            window_left=table.window_left,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
        )
        pages = (table.kv_indptr, table.kv_indices, table.kv_last_page_len)
        heads = (num_heads, num_kv_heads, head_dim, table.page_size)
        if kind == "decode":
            wrapper.plan(
                *pages,
                *heads,
                pos_encoding_mode="NONE",
                logits_soft_cap=softcap,
                sm_scale=float(scale),
                **common,
            )
        elif kind == "prefill":
            wrapper.plan(
                table.qo_indptr,
                *pages,
                *heads,
                causal=True,
                pos_encoding_mode="NONE",
                logits_soft_cap=softcap,
                sm_scale=float(scale),
                **common,
            )
        else:  # the sink variant takes its scale at run()
            wrapper.plan(table.qo_indptr, *pages, *heads, causal=True, **common)
        self.planned.add(key)
        return wrapper

    def _make_wrapper(
        self, kind: str, q: torch.Tensor, head_dim: int, table: PageTable, tensor_cores: bool
    ) -> Any:
        if self.workspace is None or self.workspace.device != q.device:
            # Zeroed before its first use, as FlashInfer requires; shared by every wrapper
            # (they run one after another on one stream, as vLLM shares its).
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
        fi, options = self.flashinfer, {}
        if self.kernel_backend != "auto":
            options["backend"] = self.kernel_backend
        if kind == "decode":
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores, **options
            )
        if kind == "prefill":
            return fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", **options)
        return fi.BatchAttentionWithAttentionSinkWrapper(
            self.workspace,
            kv_layout="NHD",
            backend=self.kernel_backend,
            q_data_type=q.dtype,
            kv_data_type=q.dtype,
            head_dim_qk=head_dim,
            head_dim_vo=head_dim,
            window_left=table.window_left,
        )
