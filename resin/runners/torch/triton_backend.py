"""The ``triton`` attention backend: a paged-attention Triton kernel reading the page table.

No K / V gather and no padded batch: the kernel reads each row's pages straight from the
cache through the plan's FlashInfer-style CSR page table (``kv_indptr[g]`` / ``kv_indices[g]``,
docs/batch_plan.md). One program per (plan row, head group, query block): its tile is the
block's queries times the query heads sharing a KV head (GQA / MQA: ``BLOCK_Q * BLOCK_H`` rows,
so K and V are loaded once for them; ``heads_per_program`` heads at most, a larger group split
over programs), and it walks the row's listed keys ``BLOCK_N`` at a time
with an online softmax in fp32. A listed key ``j`` lives in page ``kv_indices[kv_indptr[row] +
j // page_size]`` at offset ``j % page_size``; its position is ``first_page * page_size + j``
with ``first_page = ceil(seq_len / page_size) - num_listed`` (a sliding-window group lists only
the pages intersecting the window). A query at position ``p`` (the step's ``positions``) sees
the keys at positions ``<= p`` (causal) and ``> p - window`` (sliding window), never past the
row's ``seq_len`` (the last page's tail is not even loaded: in a shared buffer it may hold
another group's bytes). The key loop only visits the listed keys the block's queries can see.

Options as the reference backend's: ``scale``, logit ``softcap`` (``tanh(s / c) * c``),
per-head ``sinks`` (an fp32 logit that joins every query's softmax: the running max and sum
start at it), a shared K = V cache (``v_cache=None``: values are the key cache's first
``value_dim`` channels). Caches may be strided views into a shared byte buffer: the kernel gets
every stride of q, K, V and the output. Prefill chunks and decode rows go through the same
kernel (query blocks are a grid axis; blocks past a row's query length do nothing). ``gather``
(compressed / indexed attention) is the reference backend's.

K / V writes go through a small kernel that skips slot -1 (no host sync), and the backend is
``graph_safe`` for CUDA graphs (:mod:`.cuda_graphs`): both live in :mod:`.triton_static`.

Triton runs on a CUDA (or ROCm) GPU, or on CPU through its interpreter (``TRITON_INTERPRET=1``:
slow, for tests). The setting must hold both when triton is first imported in the process (its
library functions are decorated then) and when the first backend is built (the kernel is
decorated then); building the backend checks they agree. The module imports without triton;
building the backend needs it (a clear error otherwise, and on CPU without the interpreter).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from resin.runners.torch.attention import ReferenceBackend, head_layout
from resin.runners.torch.layers import plan_tensor
from resin.runners.torch.triton_static import GraphSafeTables, GroupTable

try:
    import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:  # the backend says so when built
    triton = None
    tl = None

BLOCK_N = 32  # keys per iteration of the key loop on a GPU (a guess: not tuned, no GPU here)
INTERPRETED_BLOCK_N = 64  # under the interpreter: fewer, larger numpy steps
MAX_BLOCK_M = 64  # query rows (queries x heads sharing a KV head) per program
HEADS_PER_PROGRAM = 16  # at most this many of the query heads sharing a KV head per program
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs


def _paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    sinks_ptr,
    positions_ptr,
    query_indptr_ptr,
    seq_lens_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_ke,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_ve,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    scale,
    softcap,
    window,
    ratio,
    group_size,
    head_dim,
    value_dim,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head_program = tl.program_id(1).to(tl.int64)
    q_block = tl.program_id(2).to(tl.int64)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    # Which KV head, and which BLOCK_H of the group_size query heads sharing it.
    head_chunks = (group_size + BLOCK_H - 1) // BLOCK_H
    kv_head = head_program // head_chunks
    first_hh = (head_program % head_chunks) * BLOCK_H

    # The tile's rows: query token qi of the block, query head kv_head * group_size + hh.
    # int64 index math: no overflow on large caches (and no overflow checks in the interpreter)
    m = tl.arange(0, BLOCK_M).to(tl.int64)
    qi = m // BLOCK_H
    hh = first_hh + m % BLOCK_H
    q_start = tl.load(query_indptr_ptr + row)
    q_len = tl.load(query_indptr_ptr + row + 1) - q_start
    tok = q_block * BLOCK_Q + qi
    m_valid = (tok < q_len) & (hh < group_size)
    token = q_start + tok
    head = kv_head * group_size + hh
    q_pos = tl.load(positions_ptr + token, mask=m_valid, other=0)

    d = tl.arange(0, BLOCK_D).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=m_valid[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )

    # The row's listed keys: j in [0, num_listed * PAGE_SIZE), unit u = first_page * P + j
    # (a token, or a compressed entry closing at position (u + 1) * ratio - 1).
    seq_len = tl.load(seq_lens_ptr + row)
    units = seq_len // ratio
    kv_start = tl.load(kv_indptr_ptr + row)
    num_listed = tl.load(kv_indptr_ptr + row + 1) - kv_start
    first_unit = ((units + PAGE_SIZE - 1) // PAGE_SIZE - num_listed) * PAGE_SIZE
    # Only the keys some query of the block can see: u < (max position + 1) // ratio (and
    # written: u < units); with a window, u past min position - window.
    hi_pos = tl.max(tl.where(m_valid, q_pos, -1), axis=0)
    j_hi = tl.minimum(tl.minimum(units, (hi_pos + 1) // ratio) - first_unit, num_listed * PAGE_SIZE)
    j_lo = 0
    if HAS_WINDOW:
        lo_pos = tl.min(tl.where(m_valid, q_pos, hi_pos), axis=0)
        j_lo = tl.maximum((lo_pos - window + 1) // ratio - 1 - first_unit, 0)

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=m_valid, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N).to(tl.int64)

    for start in range(j_lo, j_hi, BLOCK_N):
        j = start + n
        j_valid = j < j_hi
        page = tl.load(kv_indices_ptr + kv_start + j // PAGE_SIZE, mask=j_valid, other=0)
        offset = j % PAGE_SIZE
        k_pos = (first_unit + j + 1) * ratio - 1
        k = tl.load(
            k_ptr
            + page[:, None] * stride_kp
            + offset[:, None] * stride_ke
            + kv_head * stride_kh
            + d[None, :] * stride_kd,
            mask=j_valid[:, None] & (d[None, :] < head_dim),
            other=0.0,
        )
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * scale
        if HAS_SOFTCAP:
            s = (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0) * softcap  # tanh(s / c) * c
        visible = j_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr
            + page[:, None] * stride_vp
            + offset[:, None] * stride_ve
            + kv_head * stride_vh
            + dv[None, :] * stride_vd,
            mask=j_valid[:, None] & (dv[None, :] < value_dim),
            other=0.0,
        )
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=m_valid[:, None] & (dv[None, :] < value_dim),
    )


_KERNELS: dict[bool, Any] = {}


def _interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET``).

    The setting counts twice: when triton is first imported (its library functions, e.g.
    ``tl.sum``, are decorated then) and when the kernel is (the backend's construction); they
    must agree, else the interpreter meets compiled library functions (or the reverse)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4 parses the environment there
    now = (
        bool(knobs.runtime.interpret)
        if knobs is not None
        else os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    )
    at_import = type(tl.sum).__name__ == "InterpretedFunction"
    if now != at_import:
        raise RuntimeError(
            f"TRITON_INTERPRET is {'set' if now else 'unset'} now but was "
            f"{'set' if at_import else 'unset'} when triton was first imported in this process: "
            "set TRITON_INTERPRET=1 before the first `import triton` (or not at all)"
        )
    return now


def _kernel(interpret: bool) -> Any:
    kernel = _KERNELS.get(interpret)
    if kernel is None:
        kernel = _KERNELS[interpret] = triton.jit(_paged_attention)
    return kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class TritonBackend(GraphSafeTables, ReferenceBackend):
    """Paged attention in one Triton kernel per layer (module doc); K / V writes and the
    CUDA-graph static tables from :class:`~.triton_static.GraphSafeTables`."""

    name = "triton"

    def __init__(self) -> None:
        if triton is None:
            raise ImportError(
                "the triton attention backend needs the 'triton' package (pip install triton)"
            )
        self.interpret = _interpreting()
        if not self.interpret and not torch.cuda.is_available():
            raise RuntimeError(
                "the triton attention backend needs a CUDA or ROCm GPU; on CPU set "
                "TRITON_INTERPRET=1 (Triton's interpreter: slow, for tests) before building it"
            )
        super().__init__()
        self.kernel = _kernel(self.interpret)
        self.block_n = INTERPRETED_BLOCK_N if self.interpret else BLOCK_N  # keys per iteration
        self.heads_per_program = HEADS_PER_PROGRAM  # a power of two
        self.tables: dict[int, GroupTable] = {}
        self.init_graph_safe()

    def begin_step(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().begin_step(*args, **kwargs)
        self.tables = {}

    def _table(self, group: int) -> GroupTable:
        table = self.tables.get(group)
        if table is not None:
            return table
        assert self._step is not None, "begin_step first"
        step = self._step[0]
        plan, device = step.plan, step.device

        def int64(array: Any) -> torch.Tensor:
            tensor = plan_tensor(array, device).to(torch.int64)
            # An empty array still gets a valid pointer (never read).
            return tensor if tensor.numel() else torch.zeros(1, dtype=torch.int64, device=device)

        query_indptr = plan.query_indptr
        max_query_len = int((query_indptr[1:] - query_indptr[:-1]).max(initial=0))
        table = GroupTable(
            int64(query_indptr),
            int64(plan.seq_lens),
            int64(plan.kv_indptr[group]),
            int64(plan.kv_indices[group]),
            max_query_len,
        )
        self.tables[group] = table
        return table

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
        num_heads, group_size, dim_v = head_layout(q, k_cache, v_cache, value_dim)
        num_kv_heads = num_heads // group_size
        if not self.interpret and q.device.type != "cuda":
            raise RuntimeError(
                f"the triton attention backend runs on a GPU: q is on {q.device} "
                "(set TRITON_INTERPRET=1 to run on CPU through Triton's interpreter)"
            )
        values = v_cache if v_cache is not None else k_cache
        head_dim = q.shape[-1]
        out = q.new_empty(q.shape[0], num_heads, dim_v)
        assert self._step is not None, "begin_step first"
        step, windows, page_entries, ratios = self._step
        table = self._table(group)
        num_rows = int(table.query_indptr.numel()) - 1
        if q.shape[0] == 0 or num_rows <= 0:
            return out
        window = windows[group]
        block_h = min(_next_pow2(group_size), self.heads_per_program)
        head_chunks = -(-group_size // block_h)
        block_q = max(1, min(_next_pow2(table.max_query_len), MAX_BLOCK_M // block_h))
        block_q = max(block_q, MIN_DOT // block_h)
        grid = (num_rows, num_kv_heads * head_chunks, -(-table.max_query_len // block_q))
        sink = (
            sinks.to(device=q.device, dtype=torch.float32).contiguous()
            if sinks is not None
            else out  # a valid pointer, never read
        )
        self.kernel[grid](
            q,
            k_cache,
            values,
            out,
            sink,
            step.positions,
            table.query_indptr,
            table.seq_lens,
            table.kv_indptr,
            table.kv_indices,
            *q.stride(),
            *k_cache.stride(),
            *values.stride(),
            *out.stride(),
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            int(window) if window is not None else 0,
            int(ratios[group]),
            group_size,
            head_dim,
            dim_v,
            PAGE_SIZE=int(page_entries[group]),
            BLOCK_Q=block_q,
            BLOCK_H=block_h,
            BLOCK_N=self.block_n,
            BLOCK_D=max(MIN_DOT, _next_pow2(head_dim)),
            BLOCK_DV=max(MIN_DOT, _next_pow2(dim_v)),
            HAS_SINKS=sinks is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_WINDOW=window is not None,
            # fp32 products (not TF32) for fp32; the interpreter's bf16 / fp16 dot is wrong
            DOT_F32=q.dtype == torch.float32 or self.interpret,
        )
        return out
