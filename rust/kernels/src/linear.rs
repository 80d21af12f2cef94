//! `linear`: `out = x @ w.T (+ bias)` for the few rows of a decode step, each weight row read
//! from memory once.
//!
//! At one to a few rows a projection is a matrix-vector product bound by reading the weights:
//! a decode step of the benchmark Llama reads ~160 MB of float32 weights (~80 MB in bfloat16)
//! to produce one token. torch's CPU GEMM (MKL's, oneDNN's for bfloat16) reads cold weights at
//! 1 row at a third to a half of this machine's streaming bandwidth (docs/benchmarks.md, "The
//! decode projections in Rust"); here the weight rows are split over the threads in contiguous
//! blocks, and each block of four weight rows is dotted with every input row while it is in L1,
//! two input rows a pass ([`Vector::dot4x2`]: each weight vector loaded, and widened, once).
//! The weights `PREFETCH_DISTANCE_BYTES` on are asked for in step with the reads ([`Ahead`]):
//! over a prefetch of a whole block at once, that took one bfloat16 row from ~10 to ~24 GB/s,
//! and a float32 one from 82% to 91% of the machine's stream (docs/benchmarks.md, "The weights
//! asked for in step with the reads").
//!
//! Floats: each output is one float32 dot product over `in_features` (8-lane fused
//! multiply-adds, the lanes summed in a fixed order: [`Vector::dot4`], or [`Vector::dot`] for
//! the last `out_features % 4` columns), plus the bias, rounded
//! once to the element type. That is the same math as torch's GEMM, in another summation
//! order: results agree to float32 rounding, not bit for bit. A row's outputs depend only on
//! its own input and the weights, never on the other rows or the thread count.

#[cfg(target_arch = "x86_64")]
use crate::vector::Avx2;
use crate::vector::{Ahead, Element, Scalar, Vector};

/// Below this many weight bytes one thread does the whole product: waking the team costs a
/// few microseconds, about what reading 64 KB takes.
const MIN_PARALLEL_BYTES: usize = 64 * 1024;

/// How far past the block it sums `columns` asks for the weights, in bytes (rounded up to whole
/// blocks of four rows, at least one: 22 KB for bfloat16 rows of 1,376): measured on bfloat16
/// rows of 512 and 1,376, 8-44 KB all read at ~23 GB/s a core, one block (4 KB) ~17-20.
const PREFETCH_DISTANCE_BYTES: usize = 16 * 1024;

/// The cores this process may run on, looked up once: `available_parallelism` reads the
/// cgroup's quota files on Linux, tens of microseconds a call, which on every projection made
/// a bfloat16 decode step ~25% slower.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A raw output pointer the threads share; each writes its own columns only.
struct Out<E>(*mut E);
// SAFETY: each thread writes only its own columns (`linear` splits the blocks of four weight
// rows into disjoint runs), and the caller's `&mut` keeps the buffer alive and unaliased.
unsafe impl<E> Sync for Out<E> {}

/// `out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n])`: `x` [rows, in_features], `w`
/// [out_features, in_features], `bias` `[out_features]`, `out` [rows, out_features], all
/// row-major and contiguous, on up to `threads` threads (torch's OpenMP team when there is
/// one). Panics unless the lengths agree: `x.len()` and `w.len()` multiples of a non-zero
/// `in_features`, `out.len() == rows * out_features`.
pub fn linear<E: Element + Send + Sync>(x: &[E], w: &[E], bias: Option<&[E]>, out: &mut [E], in_features: usize, threads: usize) {
    assert!(in_features > 0, "linear: in_features must be positive");
    assert!(x.len().is_multiple_of(in_features), "linear: x is not [rows, {in_features}]");
    assert!(w.len().is_multiple_of(in_features), "linear: w is not [out_features, {in_features}]");
    let rows = x.len() / in_features;
    let out_features = w.len() / in_features;
    assert_eq!(out.len(), rows * out_features, "linear: out is not [rows, out_features]");
    if let Some(b) = bias {
        assert_eq!(b.len(), out_features, "linear: bias is not [out_features]");
    }
    if rows == 0 || out_features == 0 {
        return;
    }
    // The inputs widened once (a bfloat16 widens exactly); the weights widen as they load.
    let x32: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let product = Product { x: &x32, w, bias, out: Out(out.as_mut_ptr()), rows, in_features, out_features };
    let bytes = std::mem::size_of_val(w);
    // Blocks of four weight rows, split into contiguous runs, one a thread.
    let blocks = out_features.div_ceil(4);
    let threads = if bytes < MIN_PARALLEL_BYTES { 1 } else { threads.clamp(1, blocks.min(cores())) };
    let ok = crate::openmp_team::run_parallel(threads, &|index, size| {
        let (start, end) = (blocks * index / size * 4, (blocks * (index + 1) / size * 4).min(out_features));
        product.columns(start, end);
    });
    assert!(ok, "linear panicked on an OpenMP thread");
}

/// One call's operands (`linear`'s, the inputs widened to f32).
struct Product<'a, E> {
    x: &'a [f32],
    w: &'a [E],
    bias: Option<&'a [E]>,
    out: Out<E>,
    rows: usize,
    in_features: usize,
    out_features: usize,
}

impl<E: Element> Product<'_, E> {
    /// Every row's outputs `start..end`.
    fn columns(&self, start: usize, end: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::vector::vectorised() {
                // SAFETY: the CPU has the features.
                unsafe { self.columns_avx2(start, end) };
                return;
            }
        }
        self.columns_with::<Scalar>(start, end)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn columns_avx2(&self, start: usize, end: usize) {
        self.columns_with::<Avx2>(start, end)
    }

    #[inline(always)]
    fn columns_with<V: Vector>(&self, start: usize, end: usize) {
        let k = self.in_features;
        let w_row = |n: usize| self.w[n * k..].as_ptr();
        let bias = |n: usize| self.bias.map_or(0.0, |b| b[n].to_f32());
        let block_bytes = 4 * k * std::mem::size_of::<E>();
        let distance_rows = PREFETCH_DISTANCE_BYTES.div_ceil(block_bytes).max(1) * 4;
        let mut n = start;
        while n < end {
            let width = (end - n).min(4);
            // The hardware prefetcher trains on each row's stream too late for rows of a few
            // cache lines (half the bandwidth without this): the block `distance_rows` on is
            // asked for while this one is summed, in step with its reads ([`Ahead`]).
            let mut ahead = match n + distance_rows {
                at if at < end => Ahead::new(w_row(at) as *const u8, (end - at).min(4) * k * std::mem::size_of::<E>()),
                _ => Ahead::none(),
            };
            let x = |r: usize| self.x[r * k..(r + 1) * k].as_ptr();
            let store = |r: usize, sums: &[f32; 4]| {
                for (j, s) in sums.iter().take(width).enumerate() {
                    let at = r * self.out_features + n + j;
                    debug_assert!(at < self.rows * self.out_features);
                    // SAFETY: `at` is inside `out` and in this thread's columns.
                    unsafe { *self.out.0.add(at) = E::from_f32(s + bias(n + j)) };
                }
            };
            // SAFETY (each V call): the x rows and the weight rows n..n + width hold k
            // elements each (lengths checked in `linear`).
            if width == 4 {
                let block = [w_row(n), w_row(n + 1), w_row(n + 2), w_row(n + 3)];
                // Two input rows a pass: each weight vector loaded (bfloat16: widened) once for
                // both, the same floats as one row at a time.
                let mut r = 0;
                while r + 2 <= self.rows {
                    let [a, b] = unsafe { V::dot4x2([x(r), x(r + 1)], block, k, &mut ahead) };
                    store(r, &a);
                    store(r + 1, &b);
                    r += 2;
                }
                if r < self.rows {
                    store(r, &unsafe { V::dot4(x(r), block, k, &mut ahead) });
                }
            } else {
                for r in 0..self.rows {
                    let mut sums = [0.0f32; 4];
                    for (j, s) in sums.iter_mut().take(width).enumerate() {
                        *s = unsafe { V::dot(x(r), w_row(n + j), k) };
                    }
                    store(r, &sums);
                }
            }
            n += width;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vector::Bf16;

    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize) -> Vec<f64> {
        let (rows, n) = (x.len() / k, w.len() / k);
        let mut out = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let dot: f64 = (0..k).map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i])).sum();
                out[r * n + j] = dot + bias.map_or(0.0, |b| f64::from(b[j]));
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
            .collect()
    }

    /// Within float32 rounding of the f64 product, at widths with and without tails (k % 8,
    /// out_features % 4), on one thread and several.
    #[test]
    fn agrees_with_the_f64_product() {
        for &(rows, k, n) in &[(1, 512, 256), (3, 37, 10), (2, 8, 3), (5, 1376, 33), (1, 64, 4096)] {
            let (x, w, b) = (values(rows * k, 1), values(n * k, 2), values(n, 3));
            let want = reference(&x, &w, Some(&b), k);
            for threads in [1, 3] {
                let mut out = vec![0.0f32; rows * n];
                linear(&x, &w, Some(&b), &mut out, k, threads);
                for (got, want) in out.iter().zip(&want) {
                    assert!((f64::from(*got) - want).abs() <= 1e-5 * (k as f64).sqrt(), "{rows}x{k}x{n}: {got} vs {want}");
                }
            }
        }
    }

    /// A row's outputs are the same whatever else is in the call and however many threads.
    #[test]
    fn a_rows_outputs_do_not_depend_on_the_batch() {
        let (k, n) = (96, 4099);
        let (x, w) = (values(4 * k, 5), values(n * k, 6));
        let mut alone = vec![0.0f32; n];
        linear(&x[2 * k..3 * k], &w, None, &mut alone, k, 1);
        let mut batch = vec![0.0f32; 4 * n];
        linear(&x, &w, None, &mut batch, k, 4);
        assert_eq!(alone, batch[2 * n..3 * n]);
    }

    /// bfloat16 operands widen exactly and the float32 sum rounds once to bfloat16.
    #[test]
    fn bfloat16_rounds_the_float32_product_once() {
        let (rows, k, n) = (2, 200, 9);
        let to_bf16 = |v: Vec<f32>| v.into_iter().map(Bf16::round).collect::<Vec<_>>();
        let (x, w, b) = (to_bf16(values(rows * k, 7)), to_bf16(values(n * k, 8)), to_bf16(values(n, 9)));
        let mut out = vec![Bf16(0); rows * n];
        linear(&x, &w, Some(&b), &mut out, k, 2);
        let widen = |v: &[Bf16]| v.iter().map(|e| e.to_f32()).collect::<Vec<_>>();
        let mut want = vec![0.0f32; rows * n];
        linear(&widen(&x), &widen(&w), Some(&widen(&b)), &mut want, k, 1);
        assert_eq!(out, want.into_iter().map(Bf16::round).collect::<Vec<_>>());
    }

    #[test]
    #[should_panic(expected = "out is not")]
    fn refuses_a_short_output() {
        linear(&[1.0f32; 8], &[1.0f32; 16], None, &mut [0.0; 1], 8, 1);
    }
}
