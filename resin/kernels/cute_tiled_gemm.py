"""A tiled bf16 / fp16 tensor-core GEMM in the CUTLASS Python DSL (CuTe): ``C = A @ B^T``.

``A`` [M, K] and ``B`` [N, K] are row-major (both K-major: ``x`` and a linear layer's weight as
torch stores them), ``C`` [M, N] row-major, accumulated in fp32 and written in the inputs' dtype.
One CTA of 128 threads (2 x 2 warps) computes one ``tile_m x tile_n`` tile of C, walking K in
``tile_k`` steps:

1. the A and B tiles go global -> shared memory by ``cp.async`` (16 bytes per thread per copy),
   into a swizzled K-major layout (8-row atoms, ``Swizzle(3, 3, 3)`` for 64-element rows) so
   the next step's ``ldmatrix`` reads hit distinct banks; wait, then barrier;
2. per 16-wide k-block, ``ldmatrix.x4`` moves each warp's A / B fragments shared -> registers
   and ``mma.sync.m16n8k16`` (bf16 / fp16 in, fp32 accumulate) adds into the accumulators;
3. a barrier before the next tile overwrites shared memory.

The epilogue converts the fp32 accumulators to the output dtype and stores them straight from
registers. One shared-memory stage, no software pipelining, the Ampere ``mma.sync`` path rather
than Hopper's ``wgmma`` / TMA: simple enough to read in one sitting, correct before fast
(copies and math do not overlap). No predication: the caller guarantees ``M % tile_m == 0``,
``N % tile_n == 0``, ``K % tile_k == 0`` and 16-byte aligned rows (:mod:`.cutlass_gemm` pads M
and falls back to torch otherwise).

Imports ``cutlass`` (``nvidia-cutlass-dsl``) at module import: load it only through
:mod:`resin.kernels.cutlass_gemm`, which checks it is installed first.
"""

# mypy: ignore-errors
# (DSL code: cute.jit traces and rewrites these functions; their values are IR handles, not the
# Python types their annotations name, and the package may be absent where mypy runs.)

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils

MMA_SHAPE = (16, 8, 16)  # mma.sync.m16n8k16
WARPS_MN = (2, 2)
NUM_THREADS = 32 * WARPS_MN[0] * WARPS_MN[1]
COPY_BITS = 128  # one cp.async per 16 bytes


class TiledGemmTN:
    """``C[M, N] = A[M, K] @ B[N, K]^T`` for one CTA tile shape (module doc)."""

    def __init__(self, tile_m: int = 128, tile_n: int = 128, tile_k: int = 64) -> None:
        if tile_m % (WARPS_MN[0] * MMA_SHAPE[0]) or tile_n % (WARPS_MN[1] * 2 * MMA_SHAPE[1]):
            raise ValueError(f"tile {tile_m}x{tile_n} does not divide into the warps' MMAs")
        if tile_k != 64:
            raise ValueError("tile_k must be 64 (one 128-byte swizzled row of bf16 / fp16)")
        self.tile = (tile_m, tile_n, tile_k)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        dtype = mA.element_type
        tile_m, tile_n, tile_k = self.tile
        sA_layout = self._smem_layout(tile_m, tile_k)
        sB_layout = self._smem_layout(tile_n, tile_k)

        # Global -> shared: each thread copies 8 contiguous elements of a row per cp.async;
        # a row of the K tile takes tile_k / 8 threads, so 128 threads cover 16 rows per pass.
        g2s = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            dtype,
            num_bits_per_copy=COPY_BITS,
        )
        per_copy = COPY_BITS // dtype.width
        lanes_k = tile_k // per_copy
        threads = cute.make_layout((NUM_THREADS // lanes_k, lanes_k), stride=(lanes_k, 1))
        values = cute.make_layout((1, per_copy))
        copy_a = cute.make_tiled_copy_tv(g2s, threads, values)
        copy_b = cute.make_tiled_copy_tv(g2s, threads, values)

        # 2 x 2 warps of m16n8k16; N permuted to 16 per warp so one ldmatrix.x4 loads B.
        mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, MMA_SHAPE),
            cute.make_layout((WARPS_MN[0], WARPS_MN[1], 1)),
            permutation_mnk=(
                WARPS_MN[0] * MMA_SHAPE[0],
                WARPS_MN[1] * MMA_SHAPE[1] * 2,
                MMA_SHAPE[2],
            ),
        )
        smem_bytes = cute.size_in_bytes(dtype, sA_layout) + cute.size_in_bytes(dtype, sB_layout)
        grid_m = cute.ceil_div(cute.size(mC, mode=[0]), tile_m)
        grid_n = cute.ceil_div(cute.size(mC, mode=[1]), tile_n)
        self.kernel(mA, mB, mC, sA_layout, sB_layout, copy_a, copy_b, mma).launch(
            grid=[grid_m, grid_n, 1],
            block=[NUM_THREADS, 1, 1],
            smem=smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        mma: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        coord = (bidx, bidy, None)
        gA = cute.local_tile(mA, tiler=self.tile, coord=coord, proj=(1, None, 1))  # (m, k, kt)
        gB = cute.local_tile(mB, tiler=self.tile, coord=coord, proj=(None, 1, 1))  # (n, k, kt)
        gC = cute.local_tile(mC, tiler=self.tile, coord=coord, proj=(1, 1, None))  # (m, n)

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(mA.element_type, sA_layout, 16)
        sB = smem.allocate_tensor(mB.element_type, sB_layout, 16)

        thr_a = copy_a.get_slice(tidx)
        thr_b = copy_b.get_slice(tidx)
        tAgA, tAsA = thr_a.partition_S(gA), thr_a.partition_D(sA)
        tBgB, tBsB = thr_b.partition_S(gB), thr_b.partition_D(sB)

        thr_mma = mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCgC = thr_mma.partition_C(gC)
        tCrA = mma.make_fragment_A(tCsA)
        tCrB = mma.make_fragment_B(tCsB)
        acc = mma.make_fragment_C(tCgC)
        acc.fill(0.0)

        # Shared -> registers in the MMA's thread-value layout (both operands K-major: no
        # transpose).
        ldmatrix = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), mA.element_type)
        s2r_a = cute.make_tiled_copy_A(ldmatrix, mma)
        s2r_b = cute.make_tiled_copy_B(ldmatrix, mma)
        thr_s2r_a = s2r_a.get_slice(tidx)
        thr_s2r_b = s2r_b.get_slice(tidx)
        tXsA, tXrA = thr_s2r_a.partition_S(sA), thr_s2r_a.retile(tCrA)
        tXsB, tXrB = thr_s2r_b.partition_S(sB), thr_s2r_b.retile(tCrB)

        num_k_blocks = cute.size(tCrA, mode=[2])
        for k_tile in range(cute.size(gA, mode=[2])):
            cute.copy(copy_a, tAgA[None, None, None, k_tile], tAsA)
            cute.copy(copy_b, tBgB[None, None, None, k_tile], tBsB)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            for k_block in cutlass.range_constexpr(num_k_blocks):
                cute.copy(s2r_a, tXsA[None, None, k_block], tXrA[None, None, k_block])
                cute.copy(s2r_b, tXsB[None, None, k_block], tXrB[None, None, k_block])
                cute.gemm(mma, acc, tCrA[None, None, k_block], tCrB[None, None, k_block], acc)
            cute.arch.sync_threads()  # every warp is done with this tile before the next copy

        out = cute.make_fragment_like(acc, mC.element_type)
        out.store(acc.load().to(mC.element_type))
        cute.autovec_copy(out, tCgC)

    def _smem_layout(self, rows: int, tile_k: int):
        """(rows, tile_k) K-major with 8-row swizzled atoms: 64 elements = 128 bytes a row, so
        Swizzle(3, 3, 3) spreads each 8x8 ldmatrix block over all 32 banks."""
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, tile_k), stride=(tile_k, 1))
        )
        return cute.tile_to_shape(atom, (rows, tile_k), (0, 1))
