"""The packed bfloat16 weights of the CPU linear (resin.kernels.cpu_linear.packed_weight).

What they must do: give ``F.linear``'s values bit for bit (the same oneDNN GEMM, the weight's
layout reordered once), be made only for a weight seen alive twice (never for a view, a float32
weight, a tensor made for one call or one that needs a gradient), be dropped with their weight,
stop at their memory budget, take over from the Rust kernel past its bfloat16 rows, and be off
with the switch.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.weak import WeakIdKeyDictionary

from resin import kernels
from resin.kernels import cpu_linear as cl

pytestmark = pytest.mark.skipif(
    not cl.packing, reason="no oneDNN bfloat16 GEMM with packed weights on this machine"
)


def _operands(rows: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def _is_packed(w: torch.Tensor) -> bool:
    entry = cl._packs.get(w)
    return entry is not None and entry.tensor is not None


@pytest.mark.parametrize("rows", [9, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_calls_are_bit_equal_to_torch(rows: int, with_bias: bool) -> None:
    x, w, b = _operands(rows, 96, 200)
    bias = b if with_bias else None
    first = cl.cpu_linear(x, w, bias)  # seen once: torch's own call
    assert not _is_packed(w)
    second = cl.cpu_linear(x, w, bias)
    assert _is_packed(w)
    want = F.linear(x, w, bias)
    assert torch.equal(first, want) and torch.equal(second, want)
    # Any row count runs on the one pack, a batch of sequences too.
    more = torch.cat([x, x])
    assert torch.equal(cl.cpu_linear(more, w, bias), F.linear(more, w, bias))
    x3 = x[:4].reshape(2, 2, 96)  # 3-D: never the kernel's, whatever its rows
    assert torch.equal(cl.cpu_linear(x3, w, bias), F.linear(x3, w, bias))


@pytest.mark.skipif(not cl.enabled, reason="the Rust kernel is off on this machine")
def test_the_rust_kernel_keeps_the_few_rows() -> None:
    limit = cl.MAX_ROWS[torch.bfloat16]
    assert limit == cl._bfloat16_rows() == 8
    x, w, b = _operands(limit, 64, 48)
    assert cl.takes(x, w, b)
    x, w, b = _operands(limit + 1, 64, 48)
    assert not cl.takes(x, w, b)


def test_a_pack_is_dropped_with_its_weight() -> None:
    x, w, _ = _operands(16, 32, 16)
    cl.cpu_linear(x, w)
    cl.cpu_linear(x, w)
    key = id(w)
    assert _is_packed(w)
    del w
    gc.collect()
    assert key not in cl._packs


def test_a_weight_loaded_from_safetensors_is_packed(tmp_path: Path) -> None:
    # A bfloat16 checkpoint loaded as bfloat16 hands out views of the file's buffer.
    x, w, b = _operands(16, 64, 48)
    save_file({"w": w, "b": b}, str(tmp_path / "model.safetensors"))
    loaded = load_file(str(tmp_path / "model.safetensors"))
    w, b = loaded["w"], loaded["b"]
    for _ in range(2):
        got = cl.cpu_linear(x, w, b)
    assert _is_packed(w)
    assert torch.equal(got, F.linear(x, w, b))


def test_packs_stop_at_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    x, first, _ = _operands(16, 64, 32, seed=1)  # 4 KiB of bfloat16 each
    second = _operands(16, 64, 32, seed=2)[1]
    monkeypatch.setattr(cl, "_packs", WeakIdKeyDictionary())  # no other test's packs
    monkeypatch.setattr(cl, "_pack_budget_bytes", 6 * 1024)  # room for one
    for _ in range(2):
        cl.cpu_linear(x, first)
    assert _is_packed(first) and cl.packed_bytes() == 4096
    with pytest.warns(RuntimeWarning, match="packed bfloat16 weights stop at"):
        for _ in range(2):
            got = cl.cpu_linear(x, second)
    assert not _is_packed(second) and cl._packs[second].refused
    assert torch.equal(got, F.linear(x, second))  # torch's own call, every time after
    assert torch.equal(cl.cpu_linear(x, second), F.linear(x, second))
    del first
    gc.collect()
    assert cl.packed_bytes() == 0  # a pack's bytes go with its weight


def test_the_budget_follows_a_cgroup_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("268435456\n")
    assert cl._cgroup_room(str(tmp_path)) == 768 << 20
    (tmp_path / "memory.max").write_text("max\n")
    assert cl._cgroup_room(str(tmp_path)) is None
    assert cl._cgroup_room(str(tmp_path / "absent")) is None


def test_the_budget_is_a_share_of_the_memory_free_at_the_first_pack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cl._available_bytes() > 0  # /proc/meminfo's MemAvailable here
    monkeypatch.setattr(cl, "_pack_budget_bytes", None)
    monkeypatch.setattr(cl, "_available_bytes", lambda: 10 << 20)
    x, w, _ = _operands(16, 32, 24)
    for _ in range(2):
        cl.cpu_linear(x, w)
    assert _is_packed(w) and cl._pack_budget_bytes == int((10 << 20) * cl.PACK_MEMORY_SHARE)


def test_per_call_views_fresh_tensors_float32_and_gradients_are_never_packed() -> None:
    x, w, b = _operands(16, 32, 24)
    before = len(cl._packs)
    for _ in range(3):
        view = w[:16]  # remade each call
        assert torch.equal(cl.cpu_linear(x, view), F.linear(x, view))
        assert not _is_packed(view)
        assert cl.packed_weight(x, w.t().contiguous().t()) is None  # a strided view
        strided_x = torch.cat([x, x], dim=1)[:, :32]
        assert torch.equal(cl.cpu_linear(strided_x, w), F.linear(strided_x, w))
        fresh = torch.cat([w, w])  # a tensor made for one call dies with it
        bias = torch.cat([b, b])
        assert torch.equal(cl.cpu_linear(x, fresh, bias), F.linear(x, fresh, bias))
        assert not _is_packed(fresh)
    del fresh, view
    gc.collect()
    assert len(cl._packs) == before
    x32, w32, _ = _operands(8, 32, 24, torch.float32)
    for _ in range(2):
        cl.cpu_linear(x32, w32)
    assert w32 not in cl._packs
    trained = w.clone().requires_grad_()
    for _ in range(2):
        out = cl.cpu_linear(x, trained)
    out.float().sum().backward()
    assert trained.grad is not None and not _is_packed(trained)


def test_a_mismatched_call_fails_as_torch_does() -> None:
    x, w, _ = _operands(16, 32, 24)
    for _ in range(2):
        cl.cpu_linear(x, w)
    with pytest.raises(RuntimeError):
        cl.cpu_linear(x[:, :31], w)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cl, "packing", False)
    x, w, _ = _operands(16, 32, 24)
    for _ in range(2):
        assert torch.equal(cl.cpu_linear(x, w), F.linear(x, w))
    assert not _is_packed(w)
    # Either half on keeps cpu_linear as the shared linear; both off is F.linear itself.
    monkeypatch.setattr(cl, "enabled", False)
    assert kernels.select_linear({}) is F.linear
    monkeypatch.setattr(cl, "packing", True)
    assert kernels.select_linear({}) is cl.cpu_linear
    assert kernels.select_linear({cl.ENV_VAR: "0"}) is F.linear
    assert kernels.select_linear({cl.PACKED_ENV_VAR: "0"}) is F.linear
