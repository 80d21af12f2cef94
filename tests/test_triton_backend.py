"""The ``triton`` attention backend (resin/runners/torch/triton_backend.py): a paged-attention
Triton kernel reading the page table, with the reference backend's semantics. Runs on CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set per test before the backend is built: the
kernel is decorated then, so an earlier ``import triton`` in the session does not matter).

- Against the reference backend on random caches and a step mixing decode rows and prefill
  chunks of different lengths (several query blocks, several key blocks): full and
  sliding-window groups, GQA (groups of 2 and 3) and MQA (a group split over programs too), attention sinks, a logit softcap, a
  shared K = V cache with a narrower value, page sizes 1 / 4 / 16, K and V as non-contiguous
  views carved from one uint8 page buffer (as PagedRunner does), bf16.
- Built on CPU without the interpreter, or with TRITON_INTERPRET changed after triton was
  imported: a clear error.
- The built-in Llama fixture and gpt-oss (sinks, sliding window) pass the parity harness on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

GPU = torch.cuda.is_available()  # then the kernel runs natively, on CUDA tensors
DEVICE = torch.device("cuda" if GPU else "cpu")
# On CPU, triton must be imported under TRITON_INTERPRET=1 (its library functions are decorated
# at import): set it for the import only, and per test (fixture) for building the backend. If
# an earlier test imported triton without it, these tests run in a fresh interpreter instead.
STALE = (
    not GPU
    and "triton.language" in sys.modules
    and type(sys.modules["triton.language"].sum).__name__ != "InterpretedFunction"
)
if not GPU and "triton.language" not in sys.modules:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton.language")
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous
else:
    pytest.importorskip("triton.language")

from resin.runners.torch.attention import ReferenceBackend, make_attention_backend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
in_process = pytest.mark.skipif(
    STALE, reason="triton was imported without TRITON_INTERPRET=1: see test_in_a_fresh_process"
)


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.skipif(not STALE, reason="the tests run in this process")
def test_in_a_fresh_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


class _Plan:
    """The plan fields the backends read, for rows given as (cached tokens, new tokens)."""

    def __init__(self, rows: list[tuple[int, int]], window: int | None, page: int) -> None:
        self.query_indptr = np.cumsum([0] + [n for _, n in rows]).astype(np.uint32)
        self.seq_lens = np.array([c + n for c, n in rows], np.uint32)
        indptr, indices, next_page = [0], [], 1
        for cached, new in rows:
            seq = cached + new
            first = 0 if window is None else max(0, cached - window + 1) // page
            pages = list(range(next_page, next_page + -(-seq // page)))
            next_page += len(pages)
            indices += pages[first:]
            indptr.append(len(indices))
        # Pages in a scrambled order: the kernel must follow the table, not assume it sorted.
        perm = np.random.default_rng(0).permutation(next_page - 1) + 1
        self.kv_indptr = [np.array(indptr, np.uint32)]
        self.kv_indices = [perm[np.array(indices, np.int64) - 1].astype(np.uint32)]
        self.num_pages = next_page


class _Step:
    def __init__(self, plan: _Plan, rows: list[tuple[int, int]]) -> None:
        self.plan = plan
        self.device = DEVICE
        self.positions = torch.tensor(
            [p for cached, new in rows for p in range(cached, cached + new)], dtype=torch.int64
        ).to(DEVICE)


def _poison_tails(plan: _Plan, page: int, caches: list[Any]) -> None:
    """NaN in each row's last page past its end: never written, never to be read (in a shared
    buffer those bytes may be another group's)."""
    for row, seq_len in enumerate(plan.seq_lens):
        last = int(plan.kv_indices[0][plan.kv_indptr[0][row + 1] - 1])
        for cache in caches:
            cache[last, int(seq_len - 1) % page + 1 :] = float("nan")


# Decode rows and prefill chunks; (3, 11) needs two query blocks with 8 heads per KV head,
# (21, 1) / (5, 12) two key blocks.
ROWS = [(9, 1), (0, 7), (21, 1), (5, 12), (2, 1), (3, 11)]


def _carve(num_pages: int, page: int, kv_heads: int, dims: tuple[int, int], dtype: Any) -> Any:
    """K and V as views laid one after the other in each row of a uint8 page buffer (as
    PagedRunner._carve), filled with random values; the buffer's slack is NaN."""
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [page * kv_heads * d * item for d in dims]
    buffer = torch.full((num_pages, sum(sizes) + 3 * item), float("nan"), dtype=dtype)
    buffer = buffer.to(DEVICE)
    pages = buffer.view(torch.uint8).view(num_pages, -1)
    views, offset = [], 0
    for d, size in zip(dims, sizes):
        view = pages[:, offset : offset + size].view(dtype).view(num_pages, page, kv_heads, d)
        view.copy_(torch.randn(view.shape, dtype=torch.float32).to(dtype))  # on the CPU RNG
        views.append(view)
        offset += size
    assert not views[0].is_contiguous()
    return views


@in_process
@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(
    ("page", "window", "heads", "kv_heads", "shared", "sinks", "softcap", "carved", "split"),
    [
        (4, None, 4, 2, False, False, None, False, None),
        (4, 6, 8, 1, False, False, None, False, None),  # MQA, sliding window, two query blocks
        (1, None, 4, 4, False, True, None, False, None),
        (16, 5, 6, 2, False, True, None, False, None),  # groups of 3 query heads
        (4, None, 4, 2, False, False, 7.0, True, None),  # softcap, carved views
        (1, 3, 4, 1, True, True, None, False, None),  # shared K = V, narrower value
        (16, None, 4, 1, True, True, 5.0, True, None),
        (4, 6, 8, 1, False, True, None, False, 2),  # 8 heads per KV head over 4 programs
        (4, None, 6, 1, True, False, None, True, 4),  # 6 over 2 programs (4 + 2)
    ],
)
def test_matches_the_reference_backend(
    page: int,
    window: int | None,
    heads: int,
    kv_heads: int,
    shared: bool,
    sinks: bool,
    softcap: float | None,
    carved: bool,
    split: int | None,
) -> None:
    from resin.runners.torch.triton_backend import TritonBackend

    torch.manual_seed(0)
    plan = _Plan(ROWS, window, page)
    step: Any = _Step(plan, ROWS)
    dim, dim_v = 8, 6 if shared else 8
    shape = (plan.num_pages, page, kv_heads, dim)
    if carved:
        k_cache, v_cache = _carve(plan.num_pages, page, kv_heads, (dim, dim), torch.float32)
        if shared:
            v_cache = None
    else:
        k_cache = torch.randn(shape).to(DEVICE)
        v_cache = None if shared else torch.randn(shape).to(DEVICE)
    _poison_tails(plan, page, [k_cache] + ([] if v_cache is None else [v_cache]))
    q = torch.randn(len(step.positions), heads, dim).to(DEVICE)
    sink = torch.randn(heads).to(DEVICE) if sinks else None
    triton_backend = TritonBackend()
    triton_backend.block_n = 16  # several key blocks per row
    if split is not None:
        triton_backend.heads_per_program = split
    outs = []
    for backend in (ReferenceBackend(), triton_backend):
        backend.begin_step(step, [window], [page], [1])
        outs.append(
            backend.attend(
                q,
                k_cache,
                v_cache,
                0,
                scale=dim**-0.5,
                value_dim=dim_v if shared else None,
                sinks=sink,
                softcap=softcap,
            )
        )
    assert outs[1].shape == outs[0].shape
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.usefixtures("interpret")
def test_bf16_matches_the_reference_backend() -> None:
    from resin.runners.torch.triton_backend import TritonBackend

    torch.manual_seed(1)
    plan = _Plan(ROWS, 6, 4)
    step: Any = _Step(plan, ROWS)
    k_cache, v_cache = _carve(plan.num_pages, 4, 2, (16, 16), torch.bfloat16)
    _poison_tails(plan, 4, [k_cache, v_cache])
    q = torch.randn(len(step.positions), 4, 16).to(DEVICE, torch.bfloat16)
    sink = torch.randn(4).to(DEVICE)
    outs = []
    for backend in (ReferenceBackend(), TritonBackend()):
        backend.begin_step(step, [6], [4], [1])
        outs.append(backend.attend(q, k_cache, v_cache, 0, scale=0.25, sinks=sink))
    assert outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)


@in_process
def test_is_registered(interpret: None) -> None:
    assert make_attention_backend("triton").name == "triton"


@in_process
def test_interpreter_set_after_importing_triton_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import triton.language as tl

    imported_interpreted = type(tl.sum).__name__ == "InterpretedFunction"
    monkeypatch.setenv("TRITON_INTERPRET", "0" if imported_interpreted else "1")
    with pytest.raises(RuntimeError, match="when triton was first imported"):
        make_attention_backend("triton")


@pytest.mark.skipif(GPU, reason="a GPU is present: the backend builds")
def test_cpu_without_the_interpreter_is_a_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from resin.runners.torch.attention import make_attention_backend as m; m('triton')"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode != 0
    assert "needs a CUDA or ROCm GPU; on CPU set TRITON_INTERPRET=1" in done.stderr


@in_process
@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("model", ["tests/fixtures/llama", "resin/models/gpt_oss"])
def test_models_pass_parity_on_it(model: str) -> None:
    pytest.importorskip("transformers")
    from resin.evals.model_ref import resolve_model, run_model_parity

    ref = resolve_model(REPO / model)
    ref.attention_backend = "triton"
    report = run_model_parity(ref, max_new_tokens=2)  # interpreted Triton is slow
    assert report.passed, report.summary()
    assert any(stage.name.startswith("greedy/") for stage in report.stages)
