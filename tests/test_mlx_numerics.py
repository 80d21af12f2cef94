"""The MLX runner's half-precision ops round where torch's do, and its MoE routers keep the
experts ``torch.topk`` keeps, ties included (what makes gpt-oss pass parity in bf16).

- :func:`resin.runners.mlx.torch_topk.torch_cpu_topk` returns ``torch.topk``'s CPU indices,
  in order, on rows full of ties: both of torch's branches (``nth_element`` + ``sort`` of the
  first k - 1, and ``partial_sort`` when ``k * 64 <= n``), sorts of more than 16 kept values
  (introsort's threshold), NaN (torch puts it first), fp32 and bf16. torch's rule is not
  "lowest index first": four equal values give ``[2, 3]`` for k = 2.
- :func:`resin.runners.mlx.layers.top_k_indices` (on MLX arrays) returns exactly
  ``torch.topk(x, k).indices`` for bf16 router-like rows, tied and untied.
- ``linear`` with a bias rounds once, as ``F.linear``; ``scale`` multiplies by a Python float
  as torch does (fp32, the scalar unrounded): both bit for bit in bf16 and fp16.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

from resin.runners.mlx.layers import linear, scale, top_k_indices  # noqa: E402
from resin.runners.mlx.torch_topk import torch_cpu_topk  # noqa: E402

MX_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _tied_rows(rng: np.random.Generator, rows: int, n: int, levels: int) -> np.ndarray:
    """Rows drawn from ``levels`` distinct values: ties everywhere when ``levels`` is small."""
    return rng.integers(0, levels, size=(rows, n)).astype(np.float32) * 0.25 - 1.0


@pytest.mark.parametrize(
    "n,k",
    [(4, 2), (4, 1), (4, 4), (5, 3), (8, 2), (32, 4), (64, 1), (128, 2), (128, 4), (40, 20)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_cpu_topk_is_torch_topk_on_ties(n: int, k: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(n * 100 + k)
    rows = np.concatenate([_tied_rows(rng, 300, n, levels) for levels in (1, 2, 3, n)])
    rows[::11, rng.integers(0, n)] = np.nan
    t = torch.from_numpy(rows).to(dtype)
    expected = torch.topk(t, k).indices.numpy()
    values = t.float().numpy()
    got = np.stack([torch_cpu_topk(row, k) for row in values])
    mismatched = np.flatnonzero((got != expected).any(axis=1))
    assert len(mismatched) == 0, (values[mismatched[0]], got[mismatched[0]])


def test_torch_ties_are_not_lowest_index_first() -> None:
    equal = np.ones(4, dtype=np.float32)
    assert torch.topk(torch.from_numpy(equal), 2).indices.tolist() == [2, 3]
    assert torch_cpu_topk(equal, 2).tolist() == [2, 3]
    row = np.array([0.197265625, -1.234375, 0.197265625, 1.2265625], dtype=np.float32)
    assert torch.topk(torch.from_numpy(row), 2).indices.tolist() == [3, 2]
    assert torch_cpu_topk(row, 2).tolist() == [3, 2]


@pytest.mark.parametrize("n,k", [(4, 2), (32, 4), (128, 8)])
def test_mlx_router_top_k_picks_torch_experts(n: int, k: int) -> None:
    rng = np.random.default_rng(n)
    tied = _tied_rows(rng, 64, n, 3)
    untied = rng.standard_normal((64, n)).astype(np.float32)
    for rows in (tied, untied, np.concatenate([untied, tied])):
        t = torch.from_numpy(rows).to(torch.bfloat16)
        expected = torch.topk(t, k).indices.numpy()
        got = np.array(top_k_indices(mx.array(t.float().numpy()).astype(mx.bfloat16), k))
        np.testing.assert_array_equal(got, expected)


def _mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.float().numpy()).astype(getattr(mx, MX_DTYPES[t.dtype]))


def _torch(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_and_scalar_products_round_as_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(66, 64, generator=g).to(dtype)
    w = (torch.randn(48, 64, generator=g) * 0.1).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    expected = torch.nn.functional.linear(x, w, b).float()
    assert torch.equal(_torch(linear(_mx(x), _mx(w), _mx(b))), expected)
    for factor in (1.702, 128**-0.5, 0.25):
        assert torch.equal(_torch(scale(_mx(x), factor)), (x * factor).float())
    # Without a bias: the float32 accumulation rounded once, which is torch's `x @ w.T` where
    # torch's CPU GEMM for this dtype rounds that way. Some CPUs' do not for float16 (an AVX-512
    # machine with AVX512-BF16 here: 1 ulp off on some outputs, while its addmm above agrees).
    accumulated = (x.float() @ w.float().T).to(dtype).float()
    assert torch.equal(_torch(linear(_mx(x), _mx(w))), accumulated)
    if not torch.equal((x @ w.T).float(), accumulated):
        pytest.skip(
            f"torch's {dtype} CPU matmul here is not the float32 accumulation rounded once "
            "(everything else checked): MLX's is, so its bias-free products can differ from "
            "torch's by an ulp on this CPU"
        )
    assert torch.equal(_torch(linear(_mx(x), _mx(w))), (x @ w.T).float())
