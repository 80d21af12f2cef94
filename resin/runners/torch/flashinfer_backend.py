"""The ``flashinfer`` attention backend: FlashInfer's paged wrappers reading Resin's cache in place.

Once per step and cache group, :func:`~.flashinfer_page_table.build_page_table` turns the plan's page table into
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

Counters: per backend ``num_runs`` (FlashInfer calls) and ``fallback_reasons``; per process
:data:`STATS` (the same, summed over backends), written as JSON at exit to the path in
``$RESIN_FLASHINFER_STATS`` when set — how the GPU check proves a parity run went through
FlashInfer and not only through the fallback.

``plan()`` runs on the host, so a step through this backend cannot be captured in a CUDA
graph as it stands (FlashInfer's ``use_cuda_graph`` wrappers with fixed buffers would be the
way). Building the backend needs CUDA and the ``flashinfer-python`` package; the module itself
imports neither, so the page-table code runs (and is tested) anywhere.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
from collections import Counter
from typing import Any

import torch

from resin.runners.torch.attention import head_layout
from resin.runners.torch.flashinfer_page_table import (
    PageTable,
    build_page_table,
    host_int64,
    trailing_positions,
)
from resin.runners.torch.torch_backend import TorchBackend

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace, one per backend
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # FlashInfer's FA2 / FA3 head dims (prefill and decode)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
TENSOR_CORE_GROUP = 4  # decode on tensor cores above this many query heads per KV head
ALIGN_BYTES = 16  # FlashInfer loads K / V 16 bytes at a time (cp.async)
STATS_ENV = "RESIN_FLASHINFER_STATS"
STATS: Counter[str] = Counter()  # "flashinfer" runs and "fallback: <reason>" calls, per process


def _write_stats(path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(dict(STATS), handle, indent=2, sort_keys=True)


if os.environ.get(STATS_ENV):
    atexit.register(_write_stats, os.environ[STATS_ENV])


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
            positions = step.positions.cpu() if given is None else host_int64(given)
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
            STATS[f"fallback: {table}"] += 1
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
        STATS["flashinfer"] += 1
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
