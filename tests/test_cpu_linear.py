"""The CPU decode linear (resin.kernels.cpu_linear, rust/kernels/src/linear.rs).

What it must do: give ``F.linear``'s values to float32 rounding (bfloat16: to the one rounding
of the float32 product) for the rows it takes, be ``F.linear`` itself for everything else, give
a row the same outputs whatever else is in the call, and refuse bad arrays with a ValueError.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from resin import _core
from resin.kernels import cpu_linear as cl
from resin.kernels.numpy_view import numpy_view

pytestmark = pytest.mark.skipif(not cl.enabled, reason="the CPU linear is off on this machine")


@pytest.fixture(autouse=True)
def float32_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's own behaviour is tested on every machine: float32 calls of up to 32 rows
    go to it here even where torch runs AVX-512 and the kernel is off for float32 (the rule:
    test_the_float32_limit_follows_torchs_cpu_capability)."""
    monkeypatch.setitem(cl.MAX_ROWS, torch.float32, 32)


def _operands(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("shape", [(1, 512, 256), (3, 37, 10), (16, 64, 33), (2, 1376, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_agrees_with_torch_to_rounding(
    shape: tuple[int, int, int], with_bias: bool
) -> None:
    rows, k, n = shape
    x, w, b = _operands(rows, k, n, torch.float32)
    bias = b if with_bias else None
    assert cl.takes(x, w, bias)
    got = cl.cpu_linear(x, w, bias)
    want = (x.double() @ w.double().T + (0 if bias is None else bias.double())).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_bfloat16_rounds_the_float32_product_once(rows: int) -> None:
    x, w, b = _operands(rows, 512, 1024, torch.bfloat16)
    assert cl.takes(x, w, b)
    got = cl.cpu_linear(x, w, b)
    assert got.dtype is torch.bfloat16
    exact = x.double() @ w.double().T + b.double()
    # One rounding of a float32 sum: within half a bfloat16 ulp of the exact value, plus the
    # float32 sum's own error; and equal to torch's (oneDNN's float32 sum, rounded once) nearly
    # everywhere (the summation orders differ).
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-30)
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-4).all()
    assert (got == F.linear(x, w, b)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_outputs_do_not_depend_on_the_rest_of_the_call(dtype: torch.dtype) -> None:
    # 4,099 weight rows of 96: several blocks' prefetch distance, a tail of three rows.
    x, w, _ = _operands(5, 96, 4099, dtype)
    alone = cl.cpu_linear(x[3:4].contiguous(), w)
    assert torch.equal(cl.cpu_linear(x, w)[3:4], alone)
    with_one_thread = torch.empty_like(alone)
    row = x[3:4].contiguous()
    _core.linear(numpy_view(row), numpy_view(w), None, numpy_view(with_one_thread), threads=1)
    assert torch.equal(with_one_thread, alone)


@pytest.mark.parametrize(
    "case",
    [
        "too_many_rows",
        "strided_x",
        "transposed_weight",
        "float16",
        "grad",
        "mixed_dtypes",
        "broadcast_bias",
        "misaligned_x",
        "sparse_weight",
        "off",
    ],
)
def test_what_it_does_not_take_is_f_linear_itself(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w, b = _operands(4, 64, 48, torch.float32)
    if case == "too_many_rows":
        x = torch.randn(cl.MAX_ROWS[torch.float32] + 1, 64)
    elif case == "strided_x":
        x = torch.randn(4, 128)[:, ::2]
    elif case == "transposed_weight":
        w = torch.randn(64, 48).T
    elif case == "float16":
        x, w, b = x.half(), w.half(), b.half()
    elif case == "grad":
        w.requires_grad_(True)
    elif case == "mixed_dtypes":
        b = b.double()
    elif case == "broadcast_bias":  # F.linear broadcasts it; the kernel adds [out] only
        b = b[:1].clone()
    elif case == "misaligned_x":  # float32 elements two bytes into a buffer
        x = torch.frombuffer(bytearray(4 * 64 * 4 + 2), dtype=torch.float32, offset=2, count=256)
        x = x.view(4, 64).copy_(torch.randn(4, 64))
    elif case == "sparse_weight":
        w = w.to_sparse()
    elif case == "off":
        monkeypatch.setattr(cl, "enabled", False)
    assert not cl.takes(x, w, b)
    if case in ("mixed_dtypes", "sparse_weight"):  # F.linear refuses these itself
        with pytest.raises(RuntimeError):  # torch's own error, not a silent cast
            F.linear(x, w, b)
        with pytest.raises(RuntimeError):
            cl.cpu_linear(x, w, b)
        return
    got = cl.cpu_linear(x, w, b)
    assert torch.equal(got.detach(), F.linear(x, w, b).detach())
    if case == "grad":
        got.sum().backward()
        assert w.grad is not None


def test_bfloat16_past_its_rows_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cl.MAX_ROWS, torch.bfloat16, 8)  # the limit where oneDNN has bfloat16
    x, w, b = _operands(9, 64, 48, torch.bfloat16)
    assert not cl.takes(x, w, b)
    assert torch.equal(cl.cpu_linear(x, w, b), F.linear(x, w, b))


def test_long_inputs_go_in_slices_with_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cl.MAX_ROWS, torch.bfloat16, 1 << 30)
    x, w, b = _operands(11, 64, 48, torch.bfloat16)
    whole = cl.cpu_linear(x, w, b)
    monkeypatch.setattr(cl, "ROWS_PER_CALL", 3)
    assert torch.equal(cl.cpu_linear(x, w, b), whole)
    torch.testing.assert_close(whole.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("supported,limit", [(True, 8), (False, 1 << 30)])
def test_the_bfloat16_limit_follows_onednns_bfloat16_gemm(
    supported: bool, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: supported)
    assert cl._bfloat16_rows() == limit
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert cl._bfloat16_rows() == 1 << 30  # a torch without oneDNN: no such GEMM either


def test_a_torch_without_the_query_keeps_the_tuned_bfloat16_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing() -> bool:
        raise RuntimeError("No such operator mkldnn::_is_mkldnn_bf16_supported")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert cl._bfloat16_rows() == 8


def test_the_binding_refuses_bad_arrays() -> None:
    x = np.ones((2, 8), np.float32)
    w = np.ones((4, 8), np.float32)
    out = np.zeros((2, 4), np.float32)
    _core.linear(x, w, None, out)
    assert (out == 8).all()
    shared = torch.ones(16)
    refusals = {
        "do not agree": (x, np.ones((4, 7), np.float32), None, out),
        "out .* do not agree": (x, w, None, np.zeros((2, 5), np.float32)),
        "bias is": (x, w, np.ones(3, np.float32), out),
        "must be a float32 array": (x, w.astype(np.int16), None, out),
        "C-contiguous": (x, np.asfortranarray(w), None, out),
        # Two .numpy() views of one tensor pass numpy's borrow check; the kernel's catches it.
        "must not overlap": (shared.view(2, 8).numpy(), w, None, shared[:8].view(2, 4).numpy()),
        "2-d float32 array or int16": (x.astype(np.float64), w, None, out),
    }
    for message, args in refusals.items():
        with pytest.raises(ValueError, match=message):
            _core.linear(*args)
    raw = np.zeros(2 * 8 * 4 + 1, np.uint8)
    misaligned = np.frombuffer(raw.data, dtype=np.float32, count=16, offset=1).reshape(2, 8)
    with pytest.raises(ValueError, match="aligned"):
        _core.linear(misaligned, w, None, out)


@pytest.mark.parametrize(
    "capability,limit", [("AVX2", 32), ("AVX512", 0), ("AVX512_BF16", 0), ("DEFAULT", 32)]
)
def test_the_float32_limit_follows_torchs_cpu_capability(
    capability: str, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert cl._float32_rows() == limit
