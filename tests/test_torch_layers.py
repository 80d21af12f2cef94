"""The torch runner's layer functions against the HF modules they restate, bit for bit where
Resin takes a faster path (``_core.rms_norm`` and ``_core.rotary_embedding`` on CPU in fp32 and
bf16)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from resin.runners.torch import layers  # noqa: E402


@pytest.mark.parametrize("hidden", [8, 16, 33, 100, 512, 896, 2056, 5120])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_llama_rms_norm_bit_for_bit(hidden: int, rows: int, dtype) -> None:
    torch.manual_seed(hidden * 100 + rows)
    norm = llama.LlamaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    norm = norm.to(dtype)
    x = (torch.randn(rows, 3, hidden) * 4).to(dtype)
    with torch.no_grad():
        assert torch.equal(layers.rms_norm(x, norm.weight, 1e-6), norm(x))


def test_rms_norm_kernel_takes_the_cpu_rows_it_computes() -> None:
    x, w = torch.randn(3, 64), torch.randn(64)
    takes = layers._rust_norm_takes
    assert takes(x, w, 1e-6)
    assert takes(x.bfloat16(), w.bfloat16(), 1e-6)
    assert takes(torch.randn(64), w, 0.0)  # one row, 1-d
    assert not takes(x, w.bfloat16(), 1e-6)  # mixed dtypes: HF's promotion
    assert not takes(x.double(), w.double(), 1e-6)
    assert not takes(torch.randn(3, 4), torch.randn(4), 1e-6)  # torch sums these another way
    # One row this wide: torch splits its sum over threads (another order).
    assert not takes(torch.randn(1, 40000), torch.randn(40000), 1e-6)
    assert not takes(torch.randn(64, 3).t(), torch.randn(64), 1e-6)  # x not contiguous
    assert not takes(x, torch.randn(128)[::2], 1e-6)  # weight not contiguous
    for eps in (-1e-6, 1e300, float("nan"), float("inf")):  # not a float32 >= 0: torch's lines
        assert not takes(x, w, eps)
    assert not takes(x.requires_grad_(), w, 1e-6)


def _left_to_right_kernel(x, weight, eps, out) -> None:
    """``_core.rms_norm``'s floats but for the mean, summed left to right (another order)."""
    import numpy as np

    squares = x * x
    mean = np.cumsum(squares, axis=1, dtype=np.float32)[:, -1] / np.float32(x.shape[1])
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps), dtype=np.float32)
    out[:] = weight * (x * scale[:, None])


@pytest.mark.parametrize("width", [64, 512, 4096])
def test_rms_norm_probe_tells_a_sum_in_another_order(monkeypatch, width: int) -> None:
    """The probe is what stands between a torch that sums another way and wrong floats: it
    must reject a kernel whose only difference is the order of the mean's additions."""
    from resin import _core

    assert layers._probe_agrees(width)
    monkeypatch.setattr(_core, "rms_norm", _left_to_right_kernel)
    assert not layers._probe_agrees(width)


def test_rms_norm_width_that_disagrees_with_torch_falls_back(monkeypatch) -> None:
    """A torch whose sum adds in another order: the width's probe sees the kernel's floats
    differ, warns, and the width keeps the torch lines' floats from then on."""
    from resin import _core

    width = 72
    monkeypatch.setattr(layers, "_norm_width_agrees", {})
    monkeypatch.setattr(_core, "rms_norm", _left_to_right_kernel)
    x, w = torch.randn(4, width), torch.randn(width)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with pytest.warns(RuntimeWarning, match="width 72"):
        assert torch.equal(layers.rms_norm(x, w, 1e-6), want)
    assert layers._norm_width_agrees == {width: False}
    assert not layers._rust_norm_takes(x, w, 1e-6)
    assert torch.equal(layers.rms_norm(x, w, 1e-6), want)


def test_rms_norm_weight_cache_adds_nothing_to_the_tensor() -> None:
    """The weights' numpy views are kept beside the tensors, not on them: a weight saved after
    a norm still loads with ``weights_only``."""
    import io

    w = torch.randn(64)
    layers.rms_norm(torch.randn(2, 64), w, 1e-6)
    assert not w.__dict__
    buffer = io.BytesIO()
    torch.save(w, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True), w)
    entries = len(layers._weight_arrays)
    del w  # its entry goes with it
    assert len(layers._weight_arrays) == entries - 1


def test_rms_norm_kernel_sums_as_torch_under_every_cpu_capability() -> None:
    """torch picks its kernels by CPU capability (AVX512, AVX2, plain); its float sum uses
    eight lanes under each, which the kernel restates. Checked with the plain one forced."""
    import os
    import subprocess
    import sys

    script = (
        "import torch; from resin.runners.torch import layers\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'\n"
        "torch.manual_seed(0)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for width in (8, 33, 512, 2056, 5120):\n"
        "        x = (torch.randn(9, width) * 4).to(dtype); w = torch.randn(width).to(dtype)\n"
        "        x32 = x.float(); want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)\n"
        "        assert layers._probe_agrees(width), width\n"
        "        assert torch.equal(layers._kernel_rms_norm(x, w, 1e-6), want), (dtype, width)\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_rms_norm_kernel_reads_a_weight_replaced_in_place() -> None:
    """The kernel keeps a view of each weight's memory: an in-place update shows in it, and new
    memory behind the tensor (``.data =``) is seen too."""
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16()

    def hf(weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()

    assert torch.equal(layers.rms_norm(x, w, 1e-6), hf(w))
    w.mul_(2)
    assert torch.equal(layers.rms_norm(x, w, 1e-6), hf(w))
    w.data = torch.randn(64).bfloat16()
    assert torch.equal(layers.rms_norm(x, w, 1e-6), hf(w))
    w.data = torch.randn(128).bfloat16()[:64]  # a view into a larger tensor
    assert torch.equal(layers.rms_norm(x, w, 1e-6), hf(w))


def test_rms_norm_kernel_refuses_bad_arrays() -> None:
    from resin import _core

    x, w, out = torch.randn(3, 16), torch.randn(16), torch.empty(3, 16)
    with pytest.raises(ValueError, match="do not agree"):
        _core.rms_norm(x.numpy(), torch.randn(8).numpy(), 1e-6, out.numpy())
    with pytest.raises(ValueError, match="at least 8"):
        _core.rms_norm(
            x[:, :4].contiguous().numpy(), w[:4].numpy(), 1e-6, out[:, :4].contiguous().numpy()
        )
    with pytest.raises(ValueError, match="weight must be a float32"):
        _core.rms_norm(x.numpy(), w.bfloat16().view(torch.int16).numpy(), 1e-6, out.numpy())
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.rms_norm(torch.randn(16, 3).t().numpy(), w.numpy(), 1e-6, out.numpy())
    with pytest.raises(ValueError, match="overlap"):
        _core.rms_norm(x.numpy(), w.numpy(), 1e-6, x.numpy())
    with pytest.raises(ValueError, match="eps"):
        _core.rms_norm(x.numpy(), w.numpy(), float("nan"), out.numpy())
    with pytest.raises(ValueError, match="2-d float32"):
        _core.rms_norm(x.double().numpy(), w.double().numpy(), 1e-6, out.double().numpy())


def test_rms_norm_keeps_hf_order_for_a_weight_of_another_dtype() -> None:
    """fp32 input with a bf16 weight is not the fast path's case: HF's order (cast back, then
    multiply by the weight) decides the dtype and the rounding."""
    x, weight = torch.randn(4, 64), torch.randn(64).to(torch.bfloat16)
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = layers.rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype and torch.equal(got, want)


def _hf_rotated(x, cos, sin):
    """HF's ``apply_rotary_pos_emb`` on Resin's token-major layout ([T, H, D], tables [T, D])."""
    q, _ = llama.apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None]
    )
    return q[0].transpose(0, 1)


@pytest.mark.parametrize("head_dim", [2, 16, 24, 64, 128])
@pytest.mark.parametrize("tokens,heads", [(1, 1), (1, 8), (7, 3), (64, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_is_hf_rotary_bit_for_bit(
    head_dim: int, tokens: int, heads: int, dtype
) -> None:
    torch.manual_seed(head_dim + tokens + heads)
    x = (torch.randn(tokens, heads, head_dim) * 3).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    assert layers._rust_rotary_takes(x, cos, sin)
    before = x.clone()
    got = layers.apply_rotary(x, cos, sin)
    assert torch.equal(got, _hf_rotated(x, cos, sin))
    assert torch.equal(x, before)  # a new tensor: the input is left as it was


def test_apply_rotary_falls_back_to_torch_where_the_kernel_does_not_take_it() -> None:
    x = torch.randn(5, 2, 16)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    strided = torch.randn(5, 4, 16)[:, ::2]  # non-contiguous heads
    for args in ((strided, cos, sin), (x.double(), cos.double(), sin.double())):
        assert not layers._rust_rotary_takes(*args)
        assert torch.equal(layers.apply_rotary(*args), _hf_rotated(*args))
    # Partial rotary rotates the first 8 channels (a strided slice: the torch lines), keeps the rest.
    part = layers.apply_rotary(x, cos[:, :8], sin[:, :8])
    assert torch.equal(part[..., 8:], x[..., 8:])
    assert torch.equal(part[..., :8], _hf_rotated(x[..., :8].contiguous(), cos[:, :8], sin[:, :8]))


def test_rotary_kernel_refuses_bad_shapes() -> None:
    from resin import _core

    x, out = torch.randn(3, 2, 8), torch.empty(3, 2, 8)
    with pytest.raises(ValueError, match="do not agree"):
        _core.rotary_embedding(
            x.numpy(), torch.randn(2, 8).numpy(), torch.randn(2, 8).numpy(), out.numpy()
        )
    with pytest.raises(ValueError, match="even"):
        odd = torch.randn(3, 2, 7)
        t = torch.randn(3, 7).numpy()
        _core.rotary_embedding(odd.numpy(), t, t, torch.empty(3, 2, 7).numpy())


def test_one_call_paths_off_takes_the_torch_lines_with_the_same_floats(monkeypatch) -> None:
    x, weight = torch.randn(6, 4, 32), torch.randn(32)
    cos, sin = torch.randn(6, 32), torch.randn(6, 32)
    fast = layers.rms_norm(x, weight, 1e-6), layers.apply_rotary(x, cos, sin)
    monkeypatch.setattr(layers, "one_call_paths", False)
    assert not layers._rust_rotary_takes(x, cos, sin)
    calls = []
    monkeypatch.setattr(layers.F, "rms_norm", lambda *a, **k: calls.append(a))
    lines = layers.rms_norm(x, weight, 1e-6), layers.apply_rotary(x, cos, sin)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(fast, lines))


def test_rotary_kernel_refuses_fortran_order_and_an_aliased_out() -> None:
    """numpy's ``as_slice`` takes Fortran order too (the wrong elements would be read), and two
    ``.numpy()`` views of one tensor pass numpy's borrow checker: the binding checks both."""
    import numpy as np

    from resin import _core

    x, t = torch.randn(3, 2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.rotary_embedding(
            np.asfortranarray(x.numpy()), t.numpy(), t.numpy(), torch.empty(3, 2, 8).numpy()
        )
    with pytest.raises(ValueError, match="must not overlap"):
        _core.rotary_embedding(x.numpy(), t.numpy(), t.numpy(), x.numpy())
    buf = torch.randn(40)  # sin is floats 0-23 of it, out floats 16-39: 8 shared
    with pytest.raises(ValueError, match="must not overlap"):
        _core.rotary_embedding(
            torch.randn(3, 1, 8).numpy(),
            t.numpy(),
            buf[:24].view(3, 8).numpy(),
            buf[16:].view(3, 1, 8).numpy(),
        )
    pair = torch.randn(48)  # sin floats 0-23, out floats 24-47: adjacent, not overlapping
    _core.rotary_embedding(
        torch.randn(3, 1, 8).numpy(),
        t.numpy(),
        pair[:24].view(3, 8).numpy(),
        pair[24:].view(3, 1, 8).numpy(),
    )
