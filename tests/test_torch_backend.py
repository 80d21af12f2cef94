"""The ``torch`` attention backend (resin/runners/torch/torch_backend.py): every row of a step in
one batched call per layer, with the reference backend's semantics.

- Against the reference backend on random caches and a step mixing decode rows and prefill
  chunks of different lengths: full and sliding-window groups, GQA, a shared K = V cache with a
  narrower value, attention sinks, a logit softcap — equal to rounding.
- Every model in CI passes the parity harness on it (layers and every greedy stage): the
  built-in Llama fixture, gpt-oss (sinks, sliding window), Gemma 3 (softcap-free sliding / full),
  Qwen3-Next (recurrent + full), DeepSeek-V4 (shared K = V, sinks, compressed ``gather``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from resin.runners.torch.attention import ReferenceBackend, make_attention_backend  # noqa: E402
from resin.runners.torch.torch_backend import TorchBackend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGE = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Plan:
    """The plan fields the backends read, for rows given as (cached tokens, new tokens)."""

    def __init__(self, rows: list[tuple[int, int]], window: int | None) -> None:
        self.query_indptr = np.cumsum([0] + [n for _, n in rows]).astype(np.uint32)
        self.seq_lens = np.array([c + n for c, n in rows], np.uint32)
        indptr, indices, next_page = [0], [], 1
        for cached, new in rows:
            seq = cached + new
            first = 0 if window is None else max(0, cached - window + 1) // PAGE
            pages = list(range(next_page, next_page + -(-seq // PAGE)))
            next_page += len(pages)
            indices += pages[first:]
            indptr.append(len(indices))
        self.kv_indptr = [np.array(indptr, np.uint32)]
        self.kv_indices = [np.array(indices, np.uint32)]
        self.num_pages = next_page


class _Step:
    def __init__(self, plan: _Plan, rows: list[tuple[int, int]]) -> None:
        self.plan = plan
        self.device = torch.device("cpu")
        self.positions = torch.tensor(
            [p for cached, new in rows for p in range(cached, cached + new)], dtype=torch.int64
        )


ROWS = [(9, 1), (0, 7), (21, 1), (5, 6), (2, 1)]  # decode rows and prefill chunks


class _CountingBackend(TorchBackend):
    """The torch backend, counting the layers the CPU kernel ran (so a test of the kernel path
    cannot pass on the SDPA path)."""

    kernel_calls = 0

    def _kernel_attend(self, *args: Any, **kwargs: Any) -> Any:
        self.kernel_calls += 1
        return super()._kernel_attend(*args, **kwargs)


def _torch_backend(cpu_kernel: bool) -> _CountingBackend:
    """The torch backend on its padded SDPA batch, or with the CPU paged-attention kernel
    (``resin._core.paged_attention``) wherever :func:`kernel_pays` (float32 on CPU)."""
    backend = _CountingBackend()
    backend.use_cpu_kernel = cpu_kernel
    return backend


@pytest.mark.parametrize(
    ("window", "heads", "kv_heads", "shared", "sinks", "softcap"),
    [
        (None, 4, 2, False, False, None),
        (6, 4, 1, False, False, None),
        (None, 4, 4, False, True, None),
        (5, 4, 2, False, True, None),
        (None, 4, 2, False, False, 7.0),
        (None, 4, 1, True, True, None),
        (None, 6, 2, False, True, None),  # three query heads a KV head: a pair, then one
    ],
)
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["sdpa", "cpu-kernel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_the_reference_backend(
    window: int | None,
    heads: int,
    kv_heads: int,
    shared: bool,
    sinks: bool,
    softcap: float | None,
    cpu_kernel: bool,
    dtype: str,
) -> None:
    """Against the reference backend in float32 on the same values: float32 to rounding; a
    bfloat16 step (queries and caches rounded to bfloat16) to bfloat16's precision (the
    kernel rounds scores and probabilities as a bfloat16 model's eager attention does, SDPA
    computes in bfloat16)."""
    gen = torch.Generator().manual_seed(0)
    plan = _Plan(ROWS, window)
    step: Any = _Step(plan, ROWS)
    dim, dim_v = 8, 6 if shared else 8
    like = getattr(torch, dtype)
    k_cache = torch.randn(plan.num_pages, PAGE, kv_heads, dim, generator=gen).to(like)
    v_cache = None if shared else torch.randn(plan.num_pages, PAGE, kv_heads, dim, generator=gen)
    v_cache = None if v_cache is None else v_cache.to(like)
    q = torch.randn(len(step.positions), heads, dim, generator=gen).to(like)
    sink = torch.randn(heads, generator=gen) if sinks else None
    outs = []
    for backend, cast in ((ReferenceBackend(), torch.float32), (_torch_backend(cpu_kernel), like)):
        backend.begin_step(step, [window], [PAGE], [1])
        outs.append(
            backend.attend(
                q.to(cast),
                k_cache.to(cast),
                None if v_cache is None else v_cache.to(cast),
                0,
                scale=dim**-0.5,
                value_dim=dim_v if shared else None,
                sinks=sink,
                softcap=softcap,
            )
        )
    assert outs[1].shape == outs[0].shape and outs[1].dtype is like
    tolerance = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    torch.testing.assert_close(outs[1].float(), outs[0], rtol=tolerance, atol=tolerance)
    assert backend.kernel_calls == (1 if cpu_kernel else 0)


def test_is_registered() -> None:
    assert make_attention_backend("torch").name == "torch"


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["sdpa", "cpu-kernel"])
@pytest.mark.parametrize(
    "model",
    [
        "tests/fixtures/llama",
        "resin/models/gpt_oss",
        "resin/models/gemma3",
        "resin/models/gemma2",  # attention soft-capping: the padded batch's masked softmax
        "resin/models/phi3",
        "resin/models/qwen3_next",
        "resin/models/deepseek_v4_flash",
    ],
)
def test_every_model_passes_parity_on_it(
    model: str, cpu_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths of the backend: the CPU kernel (the default on CPU in float32 and bfloat16) and the padded
    SDPA batch (``RESIN_TORCH_CPU_KERNEL=0``); a counter proves which one ran."""
    pytest.importorskip("transformers")
    from resin.evals.model_ref import resolve_model, run_model_parity
    from resin.runners.torch import torch_backend

    calls = []
    real = torch_backend.TorchBackend._kernel_attend

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setenv("RESIN_TORCH_CPU_KERNEL", "1" if cpu_kernel else "0")
    monkeypatch.setattr(torch_backend.TorchBackend, "_kernel_attend", counted)
    ref = resolve_model(REPO / model)
    ref.attention_backend = "torch"
    report = run_model_parity(ref)
    assert report.passed, report.summary()
    assert any(stage.name.startswith("greedy/") for stage in report.stages)
    assert bool(calls) == cpu_kernel, f"{len(calls)} kernel calls"


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["sdpa", "cpu-kernel"])
@pytest.mark.parametrize("window", [None, 6])
def test_garbage_past_a_rows_end_never_reaches_the_output(
    window: int | None, cpu_kernel: bool
) -> None:
    """The torch backend gathers whole pages, so it reads the unwritten tail of each row's
    last page and (padding a row with a partial only page) the null page. In a shared buffer
    those bytes may be another group's, e.g. NaN: they must be zeroed, not just masked
    (0 * NaN is NaN)."""
    gen = torch.Generator().manual_seed(1)
    rows = [(9, 1), (0, 3), (21, 1), (2, 1)]  # row 1 and row 3: one partial page each
    plan = _Plan(rows, window)
    step: Any = _Step(plan, rows)
    k_cache = torch.full((plan.num_pages, PAGE, 2, 8), float("nan"))
    v_cache = torch.full((plan.num_pages, PAGE, 2, 8), float("nan"))
    for row, (cached, new) in enumerate(rows):  # fill only the written slots
        pages = plan.kv_indices[0][plan.kv_indptr[0][row] : plan.kv_indptr[0][row + 1]]
        first = -(-(cached + new) // PAGE) - len(pages)
        for i, page in enumerate(pages):
            written = min(PAGE, cached + new - (first + i) * PAGE)
            k_cache[page, :written] = torch.randn(written, 2, 8, generator=gen)
            v_cache[page, :written] = torch.randn(written, 2, 8, generator=gen)
    q = torch.randn(len(step.positions), 4, 8, generator=gen)
    outs = []
    for backend in (ReferenceBackend(), _torch_backend(cpu_kernel)):
        backend.begin_step(step, [window], [PAGE], [1])
        outs.append(backend.attend(q, k_cache, v_cache, 0, scale=8**-0.5))
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert backend.kernel_calls == (1 if cpu_kernel else 0)


def test_the_cpu_kernel_decides_by_padding() -> None:
    from resin.runners.torch.torch_backend import kernel_pays

    assert kernel_pays(np.array([0, 1, 2, 3]), np.array([40, 9, 100]))  # decode rows
    assert not kernel_pays(np.array([0, 64]), np.array([64]))  # one prefill chunk: SDPA
    # a long chunk with many decode rows: SDPA would pad every row to the chunk
    assert kernel_pays(np.array([0, 512, *range(513, 576)]), np.array([512] + [300] * 63))


def test_the_cpu_kernel_refuses_bad_arguments_with_value_errors() -> None:
    from resin import _core

    q = np.zeros((2, 2, 8), np.float32)
    cache = np.zeros((3, PAGE, 1, 8), np.float32)
    out = np.zeros((2, 2, 8), np.float32)
    table = dict(
        query_indptr=np.array([0, 2], np.uint32),
        seq_lens=np.array([2], np.uint32),
        kv_indptr=np.array([0, 1], np.uint32),
        kv_indices=np.array([1], np.uint32),
        positions=np.array([0, 1], np.int64),
    )

    def call(**changes: Any) -> None:
        args: dict[str, Any] = dict(q=q, k_cache=cache, v_cache=None, out=out, **table)
        args.update(changes)
        _core.paged_attention(**args, scale=1.0, value_dim=8)

    call()  # well formed
    with pytest.raises(ValueError, match="page 7"):
        call(kv_indices=np.array([7], np.uint32))
    with pytest.raises(ValueError, match="past 2 tokens"):
        call(query_indptr=np.array([0, 3], np.uint32))
    with pytest.raises(ValueError, match="lists 1 pages"):
        call(seq_lens=np.array([0], np.uint32))
    with pytest.raises(ValueError, match="out is"):
        call(out=np.zeros((2, 2, 4), np.float32))
    with pytest.raises(ValueError, match="contiguous last axis"):
        call(k_cache=np.zeros((3, PAGE, 1, 16), np.float32)[..., ::2])
    with pytest.raises(TypeError):
        call(q=q.astype(np.float64))
    with pytest.raises(ValueError, match="float32 array or int16"):
        call(k_cache=cache.astype(np.float64))
    with pytest.raises(ValueError, match="k_cache's dtype"):  # K as bfloat16 bits, V float32
        call(k_cache=np.zeros((3, PAGE, 1, 8), np.int16), v_cache=cache)
    call(k_cache=np.zeros((3, PAGE, 1, 8), np.int16))  # a bfloat16 cache, well formed
    raw = bytearray(2 * 3 * PAGE * 8 + 2)
    unaligned = np.frombuffer(raw, np.int16, count=3 * PAGE * 8, offset=1)  # an odd address
    with pytest.raises(ValueError, match="aligned"):
        call(k_cache=unaligned.reshape(3, PAGE, 1, 8))
    # An out sharing bytes with an input: two .numpy() views of one torch tensor pass numpy's
    # borrow checker (each has its own base), so the binding compares address ranges.
    tq = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="must not overlap"):
        call(q=tq.numpy(), out=tq.numpy())
    big = torch.zeros(3 * PAGE * 8 + 32)
    with pytest.raises(ValueError, match="must not overlap"):
        call(k_cache=big[:-32].view(3, PAGE, 1, 8).numpy(), out=big[-40:-8].view(2, 2, 8).numpy())


@pytest.mark.parametrize("row_floats", [2 * PAGE * 2 * 8, 2 * PAGE * 2 * 8 + 5])
def test_writes_into_shared_page_rows_land_on_their_slots_only(row_floats: int) -> None:
    """K and V as views into one buffer's page rows (as ``PagedRunner`` carves them; a row
    whose size is not a multiple of an entry takes the indexed-assignment path): each token's
    values land at its slot, a slot of -1 writes nothing, and no other byte of the row
    changes."""
    from resin.runners.torch.layers import slot_rows

    pages, kv_heads, dim = 5, 2, 8
    buffer = torch.arange(pages * row_floats, dtype=torch.float32).view(pages, row_floats)
    size = PAGE * kv_heads * dim
    k_cache = buffer[:, :size].view(pages, PAGE, kv_heads, dim)
    v_cache = buffer[:, size : 2 * size].view(pages, PAGE, kv_heads, dim)
    assert (slot_rows(k_cache) is None) == (row_floats % (kv_heads * dim) != 0)
    before = buffer.clone()
    slot_mapping = torch.tensor([6, -1, 13, 0, 19], dtype=torch.int32)
    k_new = torch.randn(5, kv_heads, dim)
    v_new = torch.randn(5, kv_heads, dim)
    ReferenceBackend().write([k_cache, v_cache], [k_new, v_new], slot_mapping)
    expected = before.clone()
    exp_k = expected[:, :size].view(pages, PAGE, kv_heads, dim)
    exp_v = expected[:, size : 2 * size].view(pages, PAGE, kv_heads, dim)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            exp_k[slot // PAGE, slot % PAGE] = k_new[token]
            exp_v[slot // PAGE, slot % PAGE] = v_new[token]
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("setting", "vectorised", "on"),
    [(None, True, True), (None, False, False), ("0", True, False), ("1", False, True)],
)
def test_the_cpu_kernel_is_on_by_default_only_where_it_is_vectorised(
    setting: str | None, vectorised: bool, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its scalar fallback loses to SDPA, so without AVX2 + FMA only
    ``RESIN_TORCH_CPU_KERNEL=1`` turns it on; ``=0`` turns it off everywhere."""
    from resin.runners.torch import torch_backend

    monkeypatch.setattr(torch_backend._core, "kernels_vectorised", lambda: vectorised)
    if setting is None:
        monkeypatch.delenv("RESIN_TORCH_CPU_KERNEL", raising=False)
    else:
        monkeypatch.setenv("RESIN_TORCH_CPU_KERNEL", setting)
    assert TorchBackend().use_cpu_kernel is on


def test_a_slot_mapping_buffer_refilled_for_the_next_step_writes_its_new_slots() -> None:
    """A runner may reuse one slot_mapping tensor across steps (static buffers, rewritten in
    place): the write memo is the step's, so step 2 writes where step 2 says."""
    pages, kv_heads, dim = 4, 1, 4
    buffer = torch.zeros(pages, 2 * PAGE * kv_heads * dim)
    cache = buffer[:, : PAGE * kv_heads * dim].view(pages, PAGE, kv_heads, dim)  # shared rows
    backend = ReferenceBackend()
    rows = [(0, 2)]
    step = _Step(_Plan(rows, None), rows)
    slot_mapping = torch.tensor([4, 5], dtype=torch.int32)
    for slots, value in (([4, 5], 1.0), ([9, 10], 2.0)):
        slot_mapping.copy_(torch.tensor(slots, dtype=torch.int32))  # same tensor, new contents
        backend.begin_step(step, [None], [PAGE], [1])
        backend.write([cache], [torch.full((2, kv_heads, dim), value)], slot_mapping)
    flat = cache.reshape(pages * PAGE, -1)
    assert flat[[4, 5]].eq(1.0).all() and flat[[9, 10]].eq(2.0).all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the team is found on Linux")
def test_the_cpu_kernel_splits_its_work_over_torchs_openmp_team() -> None:
    """With torch loaded the kernel finds torch's OpenMP runtime, and a step split over two
    threads of its team (64 rows x 4 KV heads x 40 keys: past the size that goes parallel, and
    rows of different lengths, so the chunks differ) gives the very floats of one thread."""
    from resin import _core

    assert _core.openmp_team_available()
    rng = np.random.default_rng(0)
    rows, heads, kv_heads, dim = 64, 8, 4, 32
    seq_lens = rng.integers(20, 60, rows).astype(np.uint32)
    pages_per_row = -(-seq_lens.astype(np.int64) // PAGE)
    kv_indices = (rng.permutation(int(pages_per_row.sum())) + 1).astype(np.uint32)
    cache = rng.standard_normal((len(kv_indices) + 1, PAGE, kv_heads, 2 * dim), np.float32)
    args = dict(
        q=rng.standard_normal((rows, heads, dim), np.float32),
        k_cache=cache[..., :dim],  # strided views of one buffer
        v_cache=cache[..., dim:],
        query_indptr=np.arange(rows + 1, dtype=np.uint32),
        seq_lens=seq_lens,
        kv_indptr=np.concatenate([[0], np.cumsum(pages_per_row)]).astype(np.uint32),
        kv_indices=kv_indices,
        positions=seq_lens.astype(np.int64) - 1,
    )
    outs = []
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads in (1, 2):
            out = np.full((rows, heads, dim), np.nan, np.float32)
            _core.paged_attention(**args, out=out, scale=0.2, value_dim=dim, threads=threads)
            outs.append(out)
    finally:
        torch.set_num_threads(previous)
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_the_cpu_kernel_reads_caches_with_reversed_heads_and_prefill_rows() -> None:
    """Cache views whose KV heads run backwards (a negative head stride: the kernel's
    prefetches span the heads from the lowest address) and rows of many queries (prefill, the
    later queries seeing more keys) give the floats of the same cache laid out forwards."""
    from resin import _core

    rng = np.random.default_rng(1)
    rows, heads, kv_heads, dim = 6, 8, 4, 16
    seq_lens = rng.integers(30, 90, rows).astype(np.uint32)
    new = np.array([1, 17, 1, 40, 3, 1], np.uint32)  # queries per row
    pages_per_row = -(-seq_lens.astype(np.int64) // PAGE)
    kv_indices = (rng.permutation(int(pages_per_row.sum())) + 1).astype(np.uint32)
    forward = rng.standard_normal((len(kv_indices) + 1, PAGE, kv_heads, 2 * dim), np.float32)
    reversed_heads = np.ascontiguousarray(forward[:, :, ::-1])[:, :, ::-1]  # same values
    assert reversed_heads.strides[2] < 0
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, new)])
    args = dict(
        q=rng.standard_normal((int(new.sum()), heads, dim), np.float32),
        query_indptr=np.concatenate([[0], np.cumsum(new)]).astype(np.uint32),
        seq_lens=seq_lens,
        kv_indptr=np.concatenate([[0], np.cumsum(pages_per_row)]).astype(np.uint32),
        kv_indices=kv_indices,
        positions=positions.astype(np.int64),
    )
    outs = []
    for cache in (forward, reversed_heads):
        out = np.full((int(new.sum()), heads, dim), np.nan, np.float32)
        _core.paged_attention(
            **args, k_cache=cache[..., :dim], v_cache=cache[..., dim:], out=out, scale=0.25,
            value_dim=dim, threads=1,
        )  # fmt: skip
        outs.append(out)
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_the_bfloat16_kernel_rounds_as_eager_bfloat16_attention() -> None:
    """A bfloat16 model's eager attention (HF: ``q @ k.T`` rounded, times the scale rounded, the
    softmax in float32, its probabilities rounded before ``@ v``): the kernel's roundings are
    those, so it lands within an ulp of it, and nearer than float32 math on the same values."""
    gen = torch.Generator().manual_seed(3)
    rows = [(37, 1), (12, 1), (50, 1)]
    plan = _Plan(rows, None)
    step: Any = _Step(plan, rows)
    heads, dim = 4, 16
    k_cache = torch.randn(plan.num_pages, PAGE, 1, dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(plan.num_pages, PAGE, 1, dim, generator=gen).to(torch.bfloat16)
    q = (torch.randn(len(rows), heads, dim, generator=gen) * 2).to(torch.bfloat16)
    backend = _torch_backend(True)
    backend.begin_step(step, [None], [PAGE], [1])
    got = backend.attend(q, k_cache, v_cache, 0, scale=dim**-0.5).float()
    assert backend.kernel_calls == 1
    eager, exact = [], []
    for r, (cached, _) in enumerate(rows):
        pages = plan.kv_indices[0][plan.kv_indptr[0][r] : plan.kv_indptr[0][r + 1]]
        keys = k_cache[torch.from_numpy(pages.astype(np.int64))].reshape(-1, dim)[: cached + 1]
        values = v_cache[torch.from_numpy(pages.astype(np.int64))].reshape(-1, dim)[: cached + 1]
        scores = (q[r] @ keys.T) * dim**-0.5  # bfloat16: each rounded
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(torch.bfloat16)
        eager.append((probs @ values).float())
        f32 = (q[r].float() @ keys.float().T * dim**-0.5).softmax(dim=-1) @ values.float()
        exact.append(f32)
    eager_t, exact_t = torch.stack(eager), torch.stack(exact)
    torch.testing.assert_close(got, eager_t, rtol=2**-7, atol=2**-9)
    assert (got - eager_t).abs().sum() < (exact_t.to(torch.bfloat16).float() - eager_t).abs().sum()
