"""The ``flashinfer`` attention backend (resin/runners/torch/flashinfer_backend.py) and its page
table (flashinfer_page_table.py).

On CPU (no CUDA, no flashinfer needed):

- :func:`build_page_table` from a plan's arrays: what FlashInfer reads through it
  (:func:`table_views`: slots, bottom-right causal mask, ``window_left``) is exactly each row's
  readable slots and mask in the reference backend (:func:`build_sequence_views`), for decode
  rows and prefill chunks, full and sliding-window groups, page sizes 1 / 4 / 16, pages in a
  scrambled order; a listing too short for its queries is a ValueError naming the row.
- The backend's own logic against a stand-in ``flashinfer`` module whose wrappers compute
  FlashInfer's documented semantics in plain torch from what ``plan()`` / ``run()`` receive:
  one plan per step and cache group whatever the number of layers, the decode wrapper for
  one-query steps and the prefill one otherwise, the sink wrapper for sinks, the cache views
  passed in place (no copy), and the results equal to the reference backend's (GQA, a
  window, a softcap, sinks, K / V carved from one page buffer).
- What it hands to the torch backend, and why: a shared K = V cache, a compressed group, fp32,
  a head dim FlashInfer has no kernel for, positions other than the rows' trailing tokens,
  sinks without the sink wrapper.
- Selecting it without CUDA: a RuntimeError naming what is missing.

On CUDA with flashinfer installed (skipped otherwise): the real wrappers against the reference
backend on random caches, and the parity harness on a tiny Llama with head_dim 128.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from resin.runners.torch.attention import (  # noqa: E402
    ReferenceBackend,
    make_attention_backend,
)
from resin.runners.torch.flashinfer_backend import (  # noqa: E402
    STATS,
    FlashInferBackend,
    unsupported_reason,
)
from resin.runners.torch.flashinfer_page_table import (  # noqa: E402
    build_page_table,
    table_views,
    trailing_positions,
)
from resin.runners.torch.layers import build_sequence_views  # noqa: E402

CUDA = torch.cuda.is_available()
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (cached tokens, new tokens): decode rows and prefill chunks, one starting from nothing.
ROWS = [(9, 1), (0, 7), (21, 1), (5, 12), (2, 1), (3, 11)]
DECODE_ROWS = [(9, 1), (21, 1), (2, 1), (40, 1)]


class _Plan:
    """The plan fields the backends read, for rows given as (cached tokens, new tokens); the
    pages a sliding window has dropped are not listed (docs/batch_plan.md)."""

    def __init__(self, rows: list[tuple[int, int]], window: int | None, page: int) -> None:
        self.query_indptr = np.cumsum([0] + [n for _, n in rows]).astype(np.uint32)
        self.seq_lens = np.array([c + n for c, n in rows], np.uint32)
        self.positions = np.array([p for c, n in rows for p in range(c, c + n)], np.int64)
        indptr, indices, next_page = [0], [], 1
        for cached, new in rows:
            seq = cached + new
            first = 0 if window is None else max(0, cached - window + 1) // page
            pages = list(range(next_page, next_page + -(-seq // page)))
            next_page += len(pages)
            indices += pages[first:]
            indptr.append(len(indices))
        perm = np.random.default_rng(0).permutation(next_page - 1) + 1  # scrambled page ids
        self.kv_indptr = [np.array(indptr, np.uint32)]
        self.kv_indices = [perm[np.array(indices, np.int64) - 1].astype(np.uint32)]
        self.num_pages = next_page


def _step(plan: _Plan, device: Any = "cpu") -> Any:
    return SimpleNamespace(
        plan=plan, device=torch.device(device), positions=torch.as_tensor(plan.positions)
    )


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("rows", [ROWS, DECODE_ROWS])
def test_page_table_reads_what_the_reference_reads(
    page: int, window: int | None, rows: list[tuple[int, int]]
) -> None:
    plan = _Plan(rows, window, page)
    table = build_page_table(
        plan.query_indptr, plan.seq_lens, plan.kv_indptr[0], plan.kv_indices[0], page, window
    )
    assert table.qo_indptr.dtype == table.kv_indices.dtype == torch.int32
    assert table.decode_only == (rows is DECODE_ROWS)
    assert table.window_left == (-1 if window is None else window - 1)
    # FlashInfer's last-page length is the plan's kv_last_page_len formula.
    ceil = -(-plan.seq_lens.astype(np.int64) // page)
    assert table.kv_last_page_len.tolist() == (plan.seq_lens - (ceil - 1) * page).tolist()
    assert torch.equal(trailing_positions(table), torch.as_tensor(plan.positions))
    reference = build_sequence_views(
        plan.query_indptr,
        plan.seq_lens,
        plan.kv_indptr[0],
        plan.kv_indices[0],
        torch.as_tensor(plan.positions),
        page,
        window,
        torch.device("cpu"),
    )
    ours = table_views(table)
    assert len(ours) == len(reference) == len(rows)
    for (query, slots, mask), view in zip(ours, reference):
        assert query == view.query
        assert torch.equal(slots, view.slots)
        assert torch.equal(mask, view.mask)


def test_a_listing_too_short_for_its_queries_names_the_row() -> None:
    plan = _Plan([(3, 1), (0, 9)], None, 4)
    indptr = np.array([0, 1, 2], np.uint32)  # row 1 needs 3 pages, lists 1
    with pytest.raises(ValueError, match="row 1: 1 listed pages"):
        build_page_table(plan.query_indptr, plan.seq_lens, indptr, plan.kv_indices[0][:2], 4, None)


# -- the backend's logic, against a stand-in flashinfer ------------------------------------------


class _FakeWrapper:
    """FlashInfer's paged semantics in plain torch, from exactly what plan() / run() receive
    (NHD caches, bottom-right causal, window_left, logits_soft_cap, per-head sinks)."""

    log: list[tuple[str, Any]]

    def __init__(self, kind: str, log: list[tuple[str, Any]], **options: Any) -> None:
        self.kind, self.log, self.options, self.planned = kind, log, options, None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        if self.kind == "decode":
            indptr, indices, last, heads, kv_heads, dim, page = args
            qo = torch.arange(len(indptr), dtype=torch.int32)
        else:
            qo, indptr, indices, last, heads, kv_heads, dim, page = args
            assert kwargs.pop("causal") is True
        self.planned = SimpleNamespace(
            qo=qo, indptr=indptr, indices=indices, last=last, page=page, **kwargs
        )
        self.log.append(("plan", self.kind))

    def run(self, q: Any, caches: Any, *args: Any) -> Any:
        k_cache, v_cache = caches
        p = self.planned
        assert p is not None
        sinks, scale = args if self.kind == "sink" else (None, p.sm_scale)
        self.log.append(("run", (k_cache.data_ptr(), v_cache.data_ptr())))
        group = q.shape[1] // k_cache.shape[2]
        out = torch.empty_like(q)
        for row in range(len(p.indptr) - 1):
            pages = p.indices[p.indptr[row] : p.indptr[row + 1]].long()
            n = len(pages)
            kv_len = (n - 1) * p.page + int(p.last[row]) if n else 0
            k = k_cache[pages].flatten(0, 1)[:kv_len].float()  # [kv_len, Hkv, D]
            v = v_cache[pages].flatten(0, 1)[:kv_len].float()
            q0, q1 = int(p.qo[row]), int(p.qo[row + 1])
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k.repeat_interleave(group, 1))
            s = s * scale
            cap = getattr(p, "logits_soft_cap", None)
            if cap:
                s = cap * torch.tanh(s / cap)
            at = kv_len - (q1 - q0) + torch.arange(q1 - q0)[:, None]
            keys = torch.arange(kv_len)[None, :]
            mask = keys <= at
            if p.window_left >= 0:
                mask &= keys >= at - p.window_left
            s = s.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.float()[:, None, None].expand(-1, q1 - q0, 1)], -1)
            probs = torch.softmax(s, -1)[..., :kv_len]
            out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, 1))
        return out


def _fake_flashinfer(log: list[tuple[str, Any]], sinks: bool = True) -> Any:
    def maker(kind: str) -> Any:
        return lambda *args, **kwargs: _FakeWrapper(kind, log, args=args, **kwargs)

    module = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=maker("decode"),
        BatchPrefillWithPagedKVCacheWrapper=maker("prefill"),
    )
    if sinks:
        module.BatchAttentionWithAttentionSinkWrapper = maker("sink")
    return module


def _carve(num_pages: int, page: int, kv_heads: int, dim: int, dtype: Any) -> tuple[Any, Any]:
    """K and V as views laid one after the other in each row of a uint8 page buffer with
    slack after them (as PagedRunner carves a layer slot's pages)."""
    item = torch.empty((), dtype=dtype).element_size()
    size = page * kv_heads * dim * item
    pages = torch.zeros((num_pages, 2 * size + 64), dtype=torch.uint8)
    k, v = (
        pages[:, offset : offset + size].view(dtype).view(num_pages, page, kv_heads, dim)
        for offset in (0, size)
    )
    k.copy_(torch.randn(k.shape).to(dtype))
    v.copy_(torch.randn(v.shape).to(dtype))
    assert not k.is_contiguous() and k.stride() == v.stride()
    return k, v


@pytest.mark.parametrize(
    ("rows", "window", "heads", "kv_heads", "sinks", "softcap", "kind"),
    [
        (ROWS, None, 8, 2, False, None, "prefill"),
        (DECODE_ROWS, None, 8, 2, False, None, "decode"),
        (ROWS, 6, 4, 1, False, 30.0, "prefill"),  # MQA, sliding window, softcap
        (DECODE_ROWS, 6, 4, 4, False, None, "decode"),
        (ROWS, 6, 8, 2, True, None, "sink"),
        (DECODE_ROWS, None, 8, 2, True, None, "sink"),
    ],
)
def test_backend_plans_once_and_runs_in_place(
    rows: list[tuple[int, int]],
    window: int | None,
    heads: int,
    kv_heads: int,
    sinks: bool,
    softcap: float | None,
    kind: str,
) -> None:
    torch.manual_seed(0)
    page, dim, dtype = 4, 64, torch.bfloat16
    plan = _Plan(rows, window, page)
    log: list[tuple[str, Any]] = []
    backend = FlashInferBackend(_fake_flashinfer(log))
    reference = ReferenceBackend()
    step = _step(plan)
    num_layers = 3
    caches = [_carve(plan.num_pages, page, kv_heads, dim, dtype) for _ in range(num_layers)]
    q = torch.randn(len(plan.positions), heads, dim).to(dtype)
    sink = torch.randn(heads) if sinks else None
    for b in (backend, reference):
        b.begin_step(step, [window], [page], [1])
    for k_cache, v_cache in caches:
        ours = backend.attend(q, k_cache, v_cache, 0, scale=dim**-0.5, sinks=sink, softcap=softcap)
        ref = reference.attend(q, k_cache, v_cache, 0, scale=dim**-0.5, sinks=sink, softcap=softcap)
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert log.count(("plan", kind)) == 1 and sum(e[0] == "plan" for e in log) == 1
    runs = [ptrs for event, ptrs in log if event == "run"]
    assert runs == [(k.data_ptr(), v.data_ptr()) for k, v in caches]  # the views themselves
    assert backend.num_runs == num_layers and not backend.fallback_reasons
    assert STATS["flashinfer"] >= num_layers  # the per-process count the GPU check reads
    backend.begin_step(step, [window], [page], [1])  # a new step plans again
    backend.attend(q, *caches[0], 0, scale=dim**-0.5, sinks=sink, softcap=softcap)
    assert sum(e[0] == "plan" for e in log) == 2


def _reason(**overrides: Any) -> str | None:
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(5, 4, 2, 64, dtype=torch.bfloat16)
    args: dict[str, Any] = dict(
        q=q,
        k_cache=k,
        v_cache=k.clone(),
        value_dim=None,
        ratio=1,
        sinks=None,
        softcap=None,
        has_sink_wrapper=True,
        require_cuda=False,
    )
    args.update(overrides)
    return unsupported_reason(**args)


def test_what_goes_to_the_torch_backend_and_why() -> None:
    half = torch.zeros(5, 4, 2, 64, dtype=torch.float16)
    assert _reason() is None
    assert "shared K = V" in str(_reason(v_cache=None))
    assert "compressed" in str(_reason(ratio=4))
    assert "dtype float32" in str(
        _reason(
            q=torch.zeros(3, 4, 64),
            k_cache=torch.zeros(5, 4, 2, 64),
            v_cache=torch.zeros(5, 4, 2, 64),
        )
    )
    assert "head_dim 16" in str(
        _reason(
            q=torch.zeros(3, 4, 16, dtype=torch.bfloat16),
            k_cache=torch.zeros(5, 4, 2, 16, dtype=torch.bfloat16),
            v_cache=torch.zeros(5, 4, 2, 16, dtype=torch.bfloat16),
        )
    )
    assert "cache dtype" in str(_reason(v_cache=half))
    assert "value width" in str(_reason(value_dim=32))
    assert "no BatchAttentionWithAttentionSinkWrapper" in str(
        _reason(sinks=torch.zeros(4), has_sink_wrapper=False)
    )
    assert "softcap" in str(_reason(sinks=torch.zeros(4), softcap=5.0))
    assert "CUDA" in str(_reason(require_cuda=True))
    k = torch.zeros(5, 4, 2, 64, dtype=torch.bfloat16)
    assert "strides" in str(
        _reason(k_cache=k, v_cache=k.transpose(1, 2).contiguous().transpose(1, 2))
    )


def test_fallbacks_give_the_reference_results() -> None:
    """head_dim 16 in fp32 (the CPU fixtures'), a shared K = V cache, positions that are not
    the rows' trailing tokens: the torch backend runs them, and the reason is counted."""
    torch.manual_seed(1)
    page = 4
    plan = _Plan(ROWS, None, page)
    log: list[tuple[str, Any]] = []
    backend, reference = FlashInferBackend(_fake_flashinfer(log)), ReferenceBackend()
    k = torch.randn(plan.num_pages, page, 2, 16)
    v = torch.randn(plan.num_pages, page, 2, 16)
    q = torch.randn(len(plan.positions), 4, 16)
    for b in (backend, reference):
        b.begin_step(_step(plan), [None], [page], [1])
    for v_cache in (v, None):
        torch.testing.assert_close(
            backend.attend(q, k, v_cache, 0, scale=0.25, value_dim=12 if v_cache is None else None),
            reference.attend(
                q, k, v_cache, 0, scale=0.25, value_dim=12 if v_cache is None else None
            ),
        )
    assert not log
    assert set(backend.fallback_reasons) == {
        "head_dim 16 (FlashInfer: 64, 128, 256)",
        "shared K = V cache (MLA latent / one K = V head)",
    }
    shifted = _Plan(ROWS, None, page)
    shifted.positions = shifted.positions + 1  # not the trailing tokens FlashInfer assumes
    kb, vb = _carve(plan.num_pages, page, 2, 64, torch.bfloat16)
    qb = torch.randn(len(plan.positions), 4, 64).to(torch.bfloat16)
    backend.begin_step(_step(shifted), [None], [page], [1])
    backend.attend(qb, kb, vb, 0, scale=0.125)
    assert not log
    assert backend.fallback_reasons["positions other than each row's trailing tokens"] == 1


def test_sinks_without_the_sink_wrapper_fall_back() -> None:
    page = 4
    plan = _Plan(DECODE_ROWS, None, page)
    log: list[tuple[str, Any]] = []
    backend = FlashInferBackend(_fake_flashinfer(log, sinks=False))
    k, v = _carve(plan.num_pages, page, 2, 64, torch.bfloat16)
    q = torch.randn(len(plan.positions), 4, 64).to(torch.bfloat16)
    backend.begin_step(_step(plan), [None], [page], [1])
    backend.attend(q, k, v, 0, scale=0.125, sinks=torch.zeros(4))
    assert not log and len(backend.fallback_reasons) == 1


@pytest.mark.skipif(CUDA, reason="a GPU is present: the backend builds")
def test_selecting_it_without_cuda_names_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="the flashinfer attention backend needs a CUDA GPU"):
        make_attention_backend("flashinfer")
    try:
        make_attention_backend("flashinfer")
    except RuntimeError as exc:
        assert ("flashinfer-python" in str(exc)) == (not HAS_FLASHINFER)
        assert "--attention-backend torch" in str(exc)


# -- on CUDA with flashinfer ---------------------------------------------------------------------

gpu = pytest.mark.skipif(
    not (CUDA and HAS_FLASHINFER), reason="needs a CUDA GPU and flashinfer-python"
)


@gpu
@pytest.mark.parametrize(
    ("rows", "page", "window", "heads", "kv_heads", "sinks", "softcap"),
    [
        (ROWS, 16, None, 32, 8, False, None),
        (DECODE_ROWS, 16, None, 32, 8, False, None),
        (DECODE_ROWS, 1, None, 8, 1, False, None),
        (ROWS, 4, 6, 8, 2, False, 30.0),
        (DECODE_ROWS, 4, 6, 8, 2, False, None),
        (ROWS, 16, 6, 8, 2, True, None),
        (DECODE_ROWS, 16, None, 8, 2, True, None),
    ],
)
def test_flashinfer_matches_the_reference_backend(
    rows: list[tuple[int, int]],
    page: int,
    window: int | None,
    heads: int,
    kv_heads: int,
    sinks: bool,
    softcap: float | None,
) -> None:
    torch.manual_seed(0)
    dim, dtype = 128, torch.bfloat16
    plan = _Plan(rows, window, page)
    k, v = (t.cuda() for t in _carve(plan.num_pages, page, kv_heads, dim, dtype))
    q = torch.randn(len(plan.positions), heads, dim).to("cuda", dtype)
    sink = torch.randn(heads, device="cuda") if sinks else None
    step = _step(plan, "cuda")
    step.positions = step.positions.cuda()
    backend, reference = FlashInferBackend(), ReferenceBackend()
    outs = []
    for b in (backend, reference):
        b.begin_step(step, [window], [page], [1])
        outs.append(b.attend(q, k, v, 0, scale=dim**-0.5, sinks=sink, softcap=softcap))
    assert backend.num_runs == 1, dict(backend.fallback_reasons)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2e-2, atol=2e-2)


@gpu
def test_parity_on_a_tiny_llama_with_head_dim_128(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from resin.evals.parity import run_parity
    from resin.runners.torch import TorchRunner

    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    backends: list[Any] = []

    def factory(model_dir: str) -> Any:
        runner = TorchRunner.from_pretrained(
            model_dir, device="cuda", dtype=torch.bfloat16, attention_backend="flashinfer"
        )
        backends.append(runner.attention_backend)
        return runner

    report = run_parity(tmp_path, runner_factory=factory, max_new_tokens=4, dtype="bfloat16")
    assert report.passed, report.summary()
    assert sum(b.num_runs for b in backends) > 0  # FlashInfer ran, not only the fallback
