"""The opt-in CUTLASS DSL GEMM (resin/kernels/): the hook, its fallback, the kernel.

Anywhere:

- :data:`resin.kernels.linear` is not the CUTLASS GEMM unless ``RESIN_CUTLASS_GEMM=1`` (the CPU
  decode linear, or ``F.linear`` itself with ``RESIN_CPU_LINEAR=0``); opting
  in without CUDA or the package is a RuntimeError naming what is missing (what
  ``resin.kernels`` raises at import then);
- :func:`cutlass_linear` off CUDA is ``F.linear`` exactly, with the reason counted;
- the shared SwiGLU block computes what :func:`swiglu_mlp` computes through the hook.

With ``nvidia-cutlass-dsl`` installed (skipped otherwise): the kernel compiles for sm_90a
(tiles of 64 and 128 rows, bf16 and fp16) — on a CPU-only machine too, through
``CUTE_DSL_ARCH``. On CUDA: the kernel against ``torch.matmul`` (M not a multiple of the tile,
M = 1, both tiles, both dtypes, output poisoned first), ``cutlass_linear`` with a bias, and
the SwiGLU block under ``RESIN_CUTLASS_GEMM=1`` against ``F.linear``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from resin import kernels  # noqa: E402
from resin.kernels import cpu_linear, cutlass_gemm  # noqa: E402

CUDA = torch.cuda.is_available()
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
REPO = Path(__file__).resolve().parents[1]


def test_linear_is_not_cutlass_unless_opted_in() -> None:
    # Without the opt-in: the CPU decode linear where it is on, else F.linear itself (not even
    # a wrapper call); never the CUTLASS GEMM.
    default = cpu_linear.cpu_linear if cpu_linear.enabled or cpu_linear.packing else F.linear
    assert kernels.select_linear({}) is default
    assert kernels.select_linear({"RESIN_CUTLASS_GEMM": "0"}) is default
    assert kernels.select_linear({"RESIN_CPU_LINEAR": "0"}) is F.linear
    if not cutlass_gemm.enabled():
        assert kernels.linear is default


@pytest.mark.skipif(CUDA and HAS_CUTLASS, reason="the kernel can run here")
def test_opting_in_where_it_cannot_run_names_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="RESIN_CUTLASS_GEMM=1: the CUTLASS GEMM needs") as err:
        kernels.select_linear({"RESIN_CUTLASS_GEMM": "1"})
    assert ("a CUDA GPU" in str(err.value)) == (not CUDA)
    assert ("nvidia-cutlass-dsl" in str(err.value)) == (not HAS_CUTLASS)


def test_off_cuda_cutlass_linear_is_f_linear() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 64), torch.randn(128, 64), torch.randn(128)
    before = cutlass_gemm.FALLBACKS["not on CUDA"]
    assert torch.equal(cutlass_gemm.cutlass_linear(x, w, b), F.linear(x, w, b))
    assert cutlass_gemm.FALLBACKS["not on CUDA"] == before + 1


def test_swiglu_block_through_the_hook_is_swiglu_mlp() -> None:
    from resin.runners.torch.blocks import swiglu_mlp_block
    from resin.runners.torch.layers import swiglu_mlp

    torch.manual_seed(0)
    x = torch.randn(5, 32)
    w = {
        "gate_proj.weight": torch.randn(48, 32),
        "up_proj.weight": torch.randn(48, 32),
        "down_proj.weight": torch.randn(32, 48),
        "up_proj.bias": torch.randn(48),
    }
    expected = swiglu_mlp(
        x,
        w["gate_proj.weight"],
        w["up_proj.weight"],
        w["down_proj.weight"],
        None,
        w["up_proj.bias"],
    )
    ctx = SimpleNamespace(config={})  # no hidden_act: SiLU, as swiglu_mlp's default
    assert torch.equal(swiglu_mlp_block(x, w, ctx), expected)  # type: ignore[arg-type]


@pytest.mark.skipif(not HAS_CUTLASS, reason="needs nvidia-cutlass-dsl")
def test_the_kernel_compiles_for_hopper() -> None:
    """Tracing, layout algebra, lowering to PTX and ptxas: all on the host (no GPU needed)."""
    code = (
        "import torch\n"
        "from resin.kernels.cutlass_gemm import compile_gemm\n"
        "for dtype, n, k, tile_m in [(torch.bfloat16, 512, 1024, 64), "
        "(torch.float16, 256, 128, 128), (torch.bfloat16, 14336, 4096, 128)]:\n"
        "    assert compile_gemm(dtype, n, k, tile_m) is not None\n"
        "print('compiled')\n"
    )
    env = dict(os.environ)
    if not CUDA:
        env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


gpu = pytest.mark.skipif(
    not (CUDA and HAS_CUTLASS), reason="needs a CUDA GPU and nvidia-cutlass-dsl"
)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 128, 64), (7, 256, 1024), (64, 512, 256), (65, 128, 512), (300, 384, 192)]
)
def test_the_kernel_matches_torch_matmul(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    torch.manual_seed(m * n + k)
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype)
    assert cutlass_gemm.unsupported_reason(a, b) is None
    out = cutlass_gemm.cutlass_gemm(a, b)
    torch.cuda.synchronize()
    expected = cutlass_gemm.gemm_reference(a.double(), b.double())
    assert out.shape == (m, n) and out.dtype == dtype and torch.isfinite(out).all()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


@gpu
def test_every_output_element_is_written() -> None:
    torch.manual_seed(3)
    a = torch.randn(128, 256, device="cuda").bfloat16()
    b = torch.randn(256, 256, device="cuda").bfloat16()
    out = torch.full((128, 256), float("nan"), device="cuda").bfloat16()
    compiled = cutlass_gemm.compile_gemm(torch.bfloat16, 256, 256, 128)
    runtime = pytest.importorskip("cutlass.cute.runtime")
    driver = pytest.importorskip("cuda.bindings.driver")

    def dynamic(t: torch.Tensor) -> object:
        return runtime.from_dlpack(t, assumed_align=16).mark_compact_shape_dynamic(
            mode=0, stride_order=(0, 1), divisibility=128
        )

    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled(dynamic(a), runtime.from_dlpack(b, assumed_align=16), dynamic(out), stream)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), (a.float() @ b.float().t()), rtol=2e-2, atol=1e-1)


@gpu
def test_cutlass_linear_with_bias_and_leading_dims() -> None:
    torch.manual_seed(4)
    x = torch.randn(2, 3, 512, device="cuda").bfloat16()
    w = torch.randn(1024, 512, device="cuda").bfloat16()
    bias = torch.randn(1024, device="cuda").bfloat16()
    ours = cutlass_gemm.cutlass_linear(x, w, bias)
    torch.testing.assert_close(ours.float(), F.linear(x, w, bias).float(), rtol=2e-2, atol=2e-1)
    odd = torch.randn(100, 512, device="cuda").bfloat16()  # N = 100: not a multiple of 128
    before = sum(cutlass_gemm.FALLBACKS.values())
    cutlass_gemm.cutlass_linear(x, odd)
    assert sum(cutlass_gemm.FALLBACKS.values()) == before + 1


@gpu
def test_swiglu_block_opted_in_runs_the_kernel() -> None:
    code = (
        "import torch, torch.nn.functional as F\n"
        "from resin import kernels\n"
        "from resin.kernels.cutlass_gemm import cutlass_linear\n"
        "from resin.runners.torch.blocks import swiglu_mlp_block\n"
        "assert kernels.linear is cutlass_linear\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(9, 256, device='cuda').bfloat16()\n"
        "w = {n: (torch.randn(s, device='cuda') / s[1] ** 0.5).bfloat16() for n, s in [\n"
        "    ('gate_proj.weight', (512, 256)), ('up_proj.weight', (512, 256)),\n"
        "    ('down_proj.weight', (256, 512))]}\n"
        "ours = swiglu_mlp_block(x, w, None).float()\n"
        "g, u = F.linear(x, w['gate_proj.weight']), F.linear(x, w['up_proj.weight'])\n"
        "ref = F.linear(F.silu(g) * u, w['down_proj.weight']).float()\n"
        "err = ((ours - ref).norm() / ref.norm()).item()\n"
        "assert err < 2e-2, err\n"
        "print('ok', err)\n"
    )
    env = {**os.environ, "RESIN_CUTLASS_GEMM": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
