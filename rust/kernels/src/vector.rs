//! The f32 vector primitives the CPU kernels are written in: dot products of one query with
//! four keys at a time, a max, `exp(x - max)` in place with its sum, a weighted sum of four
//! value rows into an accumulator, and which of 16 logits pass a threshold (with `scan_above`,
//! the scan of a running threshold over a row); and [`Ahead`], the prefetches a kernel asks for
//! in step with its reads. Two implementations of [`Vector`]: [`Scalar`] (portable, what the
//! compiler makes of plain loops) and, on x86-64, [`Avx2`] (8-lane AVX2 + FMA
//! intrinsics, and a polynomial `exp` accurate to ~2 ulp over the range a softmax uses).
//!
//! A kernel is written once, generic over `V: Vector`, with every function `#[inline(always)]`,
//! and entered through one `#[target_feature(enable = "avx2,fma")]` function per kernel: the
//! intrinsics inline there (they would be calls anywhere else). Pointers are raw because key
//! rows live in strided cache pages; each function reads `n` contiguous elements behind each
//! one. Key and value rows are f32 or [`Bf16`] ([`Element`]: widened exactly as they load);
//! queries, scores and accumulators are f32.

/// The primitives (module doc).
///
/// # Safety
/// For every function: each pointer must address `n` readable f32s (`acc.len()` for the value
/// rows), and an implementation's CPU features must be present (see [`Avx2`]).
pub trait Vector {
    /// `[q . k0, q . k1, q . k2, q . k3]` over `n` channels, asking for `ahead`'s next bytes
    /// as it reads the keys ([`Ahead`]; [`Ahead::none`] for none).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dot4<E: Element>(q: *const f32, k: [*const E; 4], n: usize, ahead: &mut Ahead) -> [f32; 4];
    /// [`Vector::dot4`] of two queries with the same four keys, each key element loaded (and
    /// widened) once: `[dot4(q[0], k), dot4(q[1], k)]`, bit for bit.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dot4x2<E: Element>(q: [*const f32; 2], k: [*const E; 4], n: usize, ahead: &mut Ahead) -> [[f32; 4]; 2];
    /// `q . k` over `n` channels.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dot<E: Element>(q: *const f32, k: *const E, n: usize) -> f32;
    /// The largest of `x` (`-inf` when empty).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn max(x: &[f32]) -> f32;
    /// `x[i] = exp(x[i] - max)`; returns their sum.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn exp_sum(x: &mut [f32], max: f32) -> f32;
    /// `acc += p[0] * v0 + p[1] * v1 + p[2] * v2 + p[3] * v3` (each `v` `acc.len()` wide).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn axpy4<E: Element>(p: [f32; 4], v: [*const E; 4], acc: &mut [f32]);
    /// [`Vector::axpy4`] of two weightings of the same four rows into two accumulators of one
    /// width, each row element loaded (and widened) once: `axpy4(p[0], v, acc[0]);
    /// axpy4(p[1], v, acc[1])`, bit for bit.
    ///
    /// # Safety
    /// See the trait; `acc[0]` and `acc[1]` have the same length.
    unsafe fn axpy4x2<E: Element>(p: [[f32; 4]; 2], v: [*const E; 4], acc: [&mut [f32]; 2]);
    /// `acc += p * v`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn axpy<E: Element>(p: f32, v: *const E, acc: &mut [f32]);
    /// `x[i] = bf16(x[i] * c)` ([`Bf16::round`] of the f32 product, widened back): a bfloat16
    /// model's rounding of scores or probabilities (`c = 1.0` rounds alone).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn scale_to_bf16(x: &mut [f32], c: f32);
    /// Bit `j` set where `x[j]` is above `below` or NaN (`!(x[j] <= below)`), for the 16
    /// values of `x`: which logits of a block pass a running threshold.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn above_mask16(x: &[f32; 16], below: f32) -> u32;
}

/// An element of a cache row the kernels read: `f32`, or [`Bf16`] (widened to f32 as it loads,
/// exactly: a bfloat16 is the top half of a float32).
pub trait Element: Copy {
    /// The value as f32.
    fn to_f32(self) -> f32;
    /// `x` as this element: itself for f32, rounded to nearest even for [`Bf16`].
    fn from_f32(x: f32) -> Self;
    /// Eight elements from `p`, widened to f32 lanes.
    ///
    /// # Safety
    /// `p` must address 8 readable elements; AVX2 must be present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Eight f32 lanes rounded to this element and widened back (`to_f32(from_f32(x))` a lane:
    /// itself for f32).
    ///
    /// # Safety
    /// AVX2 must be present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn round8(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256;
    /// Eight f32 lanes stored at `p` as this element (`from_f32` a lane).
    ///
    /// # Safety
    /// `p` must address 8 writable elements; AVX2 must be present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256);
}

/// A bfloat16, as its bits (numpy has no bfloat16: torch passes them as int16).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn round8(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
        v
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256) {
        std::arch::x86_64::_mm256_storeu_ps(p, v)
    }
}

impl Bf16 {
    /// `x` rounded to the nearest bfloat16, ties to even (NaN stays NaN), as torch's `.to(bfloat16)`.
    #[inline(always)]
    pub fn round(x: f32) -> Bf16 {
        let bits = x.to_bits();
        let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
        // A select, not an early return: loops over it stay vectorised.
        Bf16(if x.is_nan() { (bits >> 16) as u16 | 0x40 } else { rounded })
    }
}

impl Element for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }

    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        Bf16::round(x)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let halves = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
    }

    /// [`Bf16::round`] a lane: add 0x7fff plus the kept part's lowest bit, keep the top half;
    /// a NaN keeps its top half, made quiet.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn round8(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let bits = _mm256_castps_si256(v);
        let lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lowest_kept));
        let quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
        let nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        let chosen = _mm256_blendv_epi8(rounded, quiet_nan, nan);
        _mm256_castsi256_ps(_mm256_and_si256(chosen, _mm256_set1_epi32(0xffff_0000_u32 as i32)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        let top = _mm256_srli_epi32(_mm256_castps_si256(Self::round8(v)), 16);
        // Each lane is below 2^16, so the unsigned saturating pack only narrows.
        let packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
        _mm_storeu_si128(p as *mut __m128i, packed);
    }
}

/// Memory a loop asks for ahead of its reads, into L2, as fast as it reads: each
/// [`Ahead::step`] of `bytes` prefetches the next `bytes` of `start..start + len` (whole 64-byte
/// cache lines: a step of a multiple of 64 keeps pace, a smaller one still asks for a line),
/// and nothing past its end. A kernel streaming a matrix much larger than the
/// caches (the decode projections' weights) points it a fixed distance past what it reads:
/// spread over the loop, the requests keep the memory busy without the burst of a whole block's
/// prefetches at once, which stalls on the core's few outstanding-miss slots (measured: ~12 GB/s
/// a core in bursts, ~23 in step with the reads, on a 24 GB/s stream). Never faults; a no-op
/// off x86-64 and for [`Ahead::none`].
/// Not `Copy`: a copy would ask for the same lines twice.
#[derive(Debug)]
pub struct Ahead {
    /// The address of the next cache line to ask for.
    next_addr: usize,
    /// One past the last byte to ask for.
    end_addr: usize,
}

impl Default for Ahead {
    /// [`Ahead::none`].
    fn default() -> Ahead {
        Ahead::none()
    }
}

impl Ahead {
    /// Asks for nothing.
    pub fn none() -> Ahead {
        Ahead { next_addr: 0, end_addr: 0 }
    }

    /// The `len` bytes from `start`, in order, from the cache line holding `start`.
    pub fn new(start: *const u8, len: usize) -> Ahead {
        let start = start as usize;
        Ahead { next_addr: start & !63, end_addr: start.saturating_add(len) }
    }

    /// Prefetches the next `bytes` (those left, at the end).
    #[inline(always)]
    pub fn step(&mut self, bytes: usize) {
        let stop = self.next_addr.saturating_add(bytes).min(self.end_addr);
        while self.next_addr < stop {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(self.next_addr as *const i8)
            };
            self.next_addr += 64;
        }
    }
}

/// Calls `visit(column, x)`, in column order, for each logit `x` of `row` above `below` or NaN
/// (`row[i]` is column `start + i`), 16 compared at a time ([`Vector::above_mask16`], the tail
/// one by one): the scan of a running threshold. `visit` returns the threshold from then on
/// (it only rises), or `None` to stop. The candidate search and the greedy pick share it.
/// `ahead` asks for other memory as it goes, a byte for each byte of `row` read (the next
/// row of a batch: its fetch overlaps this row's compares).
#[inline(always)]
pub(crate) fn scan_above<V: Vector>(
    row: &[f32],
    start: usize,
    mut below: f32,
    ahead: &mut Ahead,
    mut visit: impl FnMut(usize, f32) -> Option<f32>,
) {
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    let passes = |x: f32, below: f32| !(x <= below);
    let blocks = row.chunks_exact(16);
    let tail = blocks.remainder();
    let mut column = start;
    for block in blocks {
        ahead.step(64);
        let block: &[f32; 16] = block.try_into().expect("a whole block");
        // SAFETY: the caller compiled `V`'s features in and checked the CPU has them.
        let mut mask = unsafe { V::above_mask16(block, below) };
        while mask != 0 {
            let offset = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            if passes(block[offset], below) {
                match visit(column + offset, block[offset]) {
                    Some(raised) => below = raised,
                    None => return,
                }
            }
        }
        column += 16;
    }
    for (offset, &x) in tail.iter().enumerate() {
        if passes(x, below) {
            match visit(column + offset, x) {
                Some(raised) => below = raised,
                None => return,
            }
        }
    }
}

/// Whether this CPU runs the kernels' vectorised path (x86-64 with AVX2 + FMA); else [`Scalar`].
pub fn vectorised() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has AVX-512F too (x86-64 only): the kernels with a 16-lane path take it.
pub(crate) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        vectorised() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Plain loops, for CPUs without AVX2 + FMA.
pub struct Scalar;

impl Vector for Scalar {
    #[inline(always)]
    unsafe fn dot4<E: Element>(q: *const f32, k: [*const E; 4], n: usize, ahead: &mut Ahead) -> [f32; 4] {
        ahead.step(4 * n * std::mem::size_of::<E>());
        [Self::dot(q, k[0], n), Self::dot(q, k[1], n), Self::dot(q, k[2], n), Self::dot(q, k[3], n)]
    }

    #[inline(always)]
    unsafe fn dot4x2<E: Element>(q: [*const f32; 2], k: [*const E; 4], n: usize, ahead: &mut Ahead) -> [[f32; 4]; 2] {
        [Self::dot4(q[0], k, n, ahead), Self::dot4(q[1], k, n, &mut Ahead::none())]
    }

    #[inline(always)]
    unsafe fn dot<E: Element>(q: *const f32, k: *const E, n: usize) -> f32 {
        // Eight partial sums: the compiler vectorises this where it can.
        let mut acc = [0.0f32; 8];
        let mut c = 0;
        while c + 8 <= n {
            for (l, slot) in acc.iter_mut().enumerate() {
                *slot += *q.add(c + l) * (*k.add(c + l)).to_f32();
            }
            c += 8;
        }
        let mut sum = acc.iter().sum::<f32>();
        while c < n {
            sum += *q.add(c) * (*k.add(c)).to_f32();
            c += 1;
        }
        sum
    }

    #[inline(always)]
    unsafe fn max(x: &[f32]) -> f32 {
        x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    #[inline(always)]
    unsafe fn exp_sum(x: &mut [f32], max: f32) -> f32 {
        let mut sum = 0.0;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        sum
    }

    #[inline(always)]
    unsafe fn axpy4<E: Element>(p: [f32; 4], v: [*const E; 4], acc: &mut [f32]) {
        for (c, slot) in acc.iter_mut().enumerate() {
            let at = |i: usize| (*v[i].add(c)).to_f32();
            *slot += p[0] * at(0) + p[1] * at(1) + p[2] * at(2) + p[3] * at(3);
        }
    }

    #[inline(always)]
    unsafe fn axpy4x2<E: Element>(p: [[f32; 4]; 2], v: [*const E; 4], acc: [&mut [f32]; 2]) {
        let [first, second] = acc;
        Self::axpy4(p[0], v, first);
        Self::axpy4(p[1], v, second);
    }

    #[inline(always)]
    unsafe fn axpy<E: Element>(p: f32, v: *const E, acc: &mut [f32]) {
        for (c, slot) in acc.iter_mut().enumerate() {
            *slot += p * (*v.add(c)).to_f32();
        }
    }

    #[inline(always)]
    unsafe fn scale_to_bf16(x: &mut [f32], c: f32) {
        for v in x.iter_mut() {
            *v = Bf16::round(*v * c).to_f32();
        }
    }

    #[inline(always)]
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    unsafe fn above_mask16(x: &[f32; 16], below: f32) -> u32 {
        x.iter().enumerate().fold(0, |mask, (j, &v)| mask | (u32::from(!(v <= below)) << j))
    }
}

/// AVX2 + FMA, 8 lanes. Only call from a function compiled with those features, on a CPU that
/// has them (`is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
pub struct Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Ahead, Avx2, Bf16, Element, Vector};
    use std::arch::x86_64::*;

    /// The four lanes-sums of `a`..`d`: `[sum(a), sum(b), sum(c), sum(d)]`.
    #[inline(always)]
    unsafe fn sum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let ab = _mm256_hadd_ps(a, b);
        let cd = _mm256_hadd_ps(c, d);
        let abcd = _mm256_hadd_ps(ab, cd);
        _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1))
    }

    #[inline(always)]
    unsafe fn sum(a: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        let x = _mm_add_ss(x, _mm_movehdup_ps(x));
        _mm_cvtss_f32(x)
    }

    /// `exp(x)` per lane: Cephes' range reduction (`x = n ln2 + r`, `|r| <= ln2 / 2`) and
    /// degree-6 polynomial, `2^n` built in the exponent bits. Inputs below -87.3 give ~0
    /// (1e-38), NaN stays NaN.
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        // max/min return their second operand when either is NaN: x goes second.
        let x = _mm256_min_ps(_mm256_set1_ps(88.376_26), _mm256_max_ps(_mm256_set1_ps(-87.336_55), x));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // ln2 split in two so `n * ln2` is exact in the first part.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n))
    }

    impl Vector for Avx2 {
        #[inline(always)]
        unsafe fn dot4<E: Element>(q: *const f32, k: [*const E; 4], n: usize, ahead: &mut Ahead) -> [f32; 4] {
            let (mut a, mut b, mut c, mut d) =
                (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 8 <= n {
                ahead.step(32 * std::mem::size_of::<E>());
                let x = _mm256_loadu_ps(q.add(i));
                a = _mm256_fmadd_ps(x, E::load8(k[0].add(i)), a);
                b = _mm256_fmadd_ps(x, E::load8(k[1].add(i)), b);
                c = _mm256_fmadd_ps(x, E::load8(k[2].add(i)), c);
                d = _mm256_fmadd_ps(x, E::load8(k[3].add(i)), d);
                i += 8;
            }
            let mut out = [0.0f32; 4];
            _mm_storeu_ps(out.as_mut_ptr(), sum4(a, b, c, d));
            while i < n {
                let x = *q.add(i);
                for (o, key) in out.iter_mut().zip(k) {
                    *o += x * (*key.add(i)).to_f32();
                }
                i += 1;
            }
            out
        }

        #[inline(always)]
        unsafe fn dot4x2<E: Element>(q: [*const f32; 2], k: [*const E; 4], n: usize, ahead: &mut Ahead) -> [[f32; 4]; 2] {
            // dot4's operations for each query, in its order: the same lanes, sums and tail.
            let zero = _mm256_setzero_ps();
            let (mut acc0, mut acc1) = ([zero; 4], [zero; 4]);
            let mut i = 0;
            while i + 8 <= n {
                ahead.step(32 * std::mem::size_of::<E>());
                let (x0, x1) = (_mm256_loadu_ps(q[0].add(i)), _mm256_loadu_ps(q[1].add(i)));
                for j in 0..4 {
                    let key = E::load8(k[j].add(i));
                    acc0[j] = _mm256_fmadd_ps(x0, key, acc0[j]);
                    acc1[j] = _mm256_fmadd_ps(x1, key, acc1[j]);
                }
                i += 8;
            }
            let mut out = [[0.0f32; 4]; 2];
            _mm_storeu_ps(out[0].as_mut_ptr(), sum4(acc0[0], acc0[1], acc0[2], acc0[3]));
            _mm_storeu_ps(out[1].as_mut_ptr(), sum4(acc1[0], acc1[1], acc1[2], acc1[3]));
            while i < n {
                for (row, query) in out.iter_mut().zip(q) {
                    let x = *query.add(i);
                    for (o, key) in row.iter_mut().zip(k) {
                        *o += x * (*key.add(i)).to_f32();
                    }
                }
                i += 1;
            }
            out
        }

        #[inline(always)]
        unsafe fn dot<E: Element>(q: *const f32, k: *const E, n: usize) -> f32 {
            let mut a = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= n {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i)), E::load8(k.add(i)), a);
                i += 8;
            }
            let mut out = sum(a);
            while i < n {
                out += *q.add(i) * (*k.add(i)).to_f32();
                i += 1;
            }
            out
        }

        #[inline(always)]
        unsafe fn max(x: &[f32]) -> f32 {
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut chunks = x.chunks_exact(8);
            for c in &mut chunks {
                m = _mm256_max_ps(m, _mm256_loadu_ps(c.as_ptr()));
            }
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), m);
            lanes.into_iter().chain(chunks.remainder().iter().copied()).fold(f32::NEG_INFINITY, f32::max)
        }

        #[inline(always)]
        unsafe fn exp_sum(x: &mut [f32], max: f32) -> f32 {
            let m = _mm256_set1_ps(max);
            let mut s = _mm256_setzero_ps();
            let mut chunks = x.chunks_exact_mut(8);
            for c in &mut chunks {
                let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
                _mm256_storeu_ps(c.as_mut_ptr(), e);
                s = _mm256_add_ps(s, e);
            }
            let mut total = sum(s);
            for v in chunks.into_remainder() {
                *v = (*v - max).exp();
                total += *v;
            }
            total
        }

        #[inline(always)]
        unsafe fn axpy4<E: Element>(p: [f32; 4], v: [*const E; 4], acc: &mut [f32]) {
            let (p0, p1, p2, p3) = (_mm256_set1_ps(p[0]), _mm256_set1_ps(p[1]), _mm256_set1_ps(p[2]), _mm256_set1_ps(p[3]));
            let n = acc.len();
            let out = acc.as_mut_ptr();
            let mut i = 0;
            while i + 8 <= n {
                let mut a = _mm256_loadu_ps(out.add(i));
                a = _mm256_fmadd_ps(p0, E::load8(v[0].add(i)), a);
                a = _mm256_fmadd_ps(p1, E::load8(v[1].add(i)), a);
                a = _mm256_fmadd_ps(p2, E::load8(v[2].add(i)), a);
                a = _mm256_fmadd_ps(p3, E::load8(v[3].add(i)), a);
                _mm256_storeu_ps(out.add(i), a);
                i += 8;
            }
            while i < n {
                let at = |j: usize| (*v[j].add(i)).to_f32();
                *out.add(i) += p[0] * at(0) + p[1] * at(1) + p[2] * at(2) + p[3] * at(3);
                i += 1;
            }
        }

        #[inline(always)]
        unsafe fn axpy4x2<E: Element>(p: [[f32; 4]; 2], v: [*const E; 4], acc: [&mut [f32]; 2]) {
            // axpy4's operations for each accumulator, in its order.
            let weights = |p: [f32; 4]| p.map(|x| _mm256_set1_ps(x));
            let (p0, p1) = (weights(p[0]), weights(p[1]));
            let n = acc[0].len();
            debug_assert_eq!(n, acc[1].len());
            let (out0, out1) = (acc[0].as_mut_ptr(), acc[1].as_mut_ptr());
            let mut i = 0;
            while i + 8 <= n {
                let (mut a, mut b) = (_mm256_loadu_ps(out0.add(i)), _mm256_loadu_ps(out1.add(i)));
                for j in 0..4 {
                    let row = E::load8(v[j].add(i));
                    a = _mm256_fmadd_ps(p0[j], row, a);
                    b = _mm256_fmadd_ps(p1[j], row, b);
                }
                _mm256_storeu_ps(out0.add(i), a);
                _mm256_storeu_ps(out1.add(i), b);
                i += 8;
            }
            while i < n {
                let at = |j: usize| (*v[j].add(i)).to_f32();
                for (out, p) in [(out0, p[0]), (out1, p[1])] {
                    *out.add(i) += p[0] * at(0) + p[1] * at(1) + p[2] * at(2) + p[3] * at(3);
                }
                i += 1;
            }
        }

        #[inline(always)]
        unsafe fn axpy<E: Element>(p: f32, v: *const E, acc: &mut [f32]) {
            let pv = _mm256_set1_ps(p);
            let n = acc.len();
            let out = acc.as_mut_ptr();
            let mut i = 0;
            while i + 8 <= n {
                _mm256_storeu_ps(out.add(i), _mm256_fmadd_ps(pv, E::load8(v.add(i)), _mm256_loadu_ps(out.add(i))));
                i += 8;
            }
            while i < n {
                *out.add(i) += p * (*v.add(i)).to_f32();
                i += 1;
            }
        }

        #[inline(always)]
        unsafe fn scale_to_bf16(x: &mut [f32], c: f32) {
            let c8 = _mm256_set1_ps(c);
            let mut chunks = x.chunks_exact_mut(8);
            for v in &mut chunks {
                _mm256_storeu_ps(v.as_mut_ptr(), Bf16::round8(_mm256_mul_ps(_mm256_loadu_ps(v.as_ptr()), c8)));
            }
            for v in chunks.into_remainder() {
                *v = Bf16::round(*v * c).to_f32();
            }
        }

        #[inline(always)]
        unsafe fn above_mask16(x: &[f32; 16], below: f32) -> u32 {
            // Not-less-or-equal, unordered: true for NaN, as the scalar `!(v <= below)`.
            let b = _mm256_set1_ps(below);
            let low = _mm256_cmp_ps::<_CMP_NLE_UQ>(_mm256_loadu_ps(x.as_ptr()), b);
            let high = _mm256_cmp_ps::<_CMP_NLE_UQ>(_mm256_loadu_ps(x.as_ptr().add(8)), b);
            (_mm256_movemask_ps(low) as u32) | ((_mm256_movemask_ps(high) as u32) << 8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
            })
            .collect()
    }

    /// Both implementations against f64 arithmetic, at widths with and without a tail. Inlined
    /// into its caller, so the AVX2 one compiles with the caller's target features.
    #[inline(always)]
    fn check<V: Vector>() {
        for n in [1usize, 7, 8, 20, 64, 67] {
            let q = data(n, 1);
            let k: Vec<Vec<f32>> = (0..4).map(|i| data(n, 10 + i)).collect();
            let exact = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>();
            let ptrs = [k[0].as_ptr(), k[1].as_ptr(), k[2].as_ptr(), k[3].as_ptr()];
            let got = unsafe { V::dot4(q.as_ptr(), ptrs, n, &mut Ahead::none()) };
            for i in 0..4 {
                assert!((got[i] as f64 - exact(&q, &k[i])).abs() < 1e-4 * n as f64, "dot4 n={n}");
            }
            let q2 = data(n, 2);
            // Asking for memory ahead changes no bits.
            let far = data(4 * n + 64, 3);
            let mut ahead = Ahead::new(far.as_ptr() as *const u8, std::mem::size_of_val(&far[..]));
            let pair = unsafe { V::dot4x2([q.as_ptr(), q2.as_ptr()], ptrs, n, &mut ahead) };
            assert_eq!(pair, [got, unsafe { V::dot4(q2.as_ptr(), ptrs, n, &mut Ahead::none()) }], "dot4x2 n={n}: dot4's bits");
            let one = unsafe { V::dot(q.as_ptr(), k[2].as_ptr(), n) };
            assert!((one as f64 - exact(&q, &k[2])).abs() < 1e-4 * n as f64, "dot n={n}");
            assert_eq!(unsafe { V::max(&q) }, q.iter().copied().fold(f32::NEG_INFINITY, f32::max));

            let mut x: Vec<f32> = q.iter().map(|v| v * 25.0).collect(); // -100..100: past the clamp
            let max = unsafe { V::max(&x) };
            let want: Vec<f64> = x.iter().map(|&v| ((v - max) as f64).exp()).collect();
            let total = unsafe { V::exp_sum(&mut x, max) };
            for (a, b) in x.iter().zip(&want) {
                assert!((*a as f64 - b).abs() <= 4e-7 * b + 1e-37, "exp n={n}: {a} vs {b}");
            }
            assert!((total as f64 - want.iter().sum::<f64>()).abs() < 1e-5 * total as f64);

            let mut acc = data(n, 99);
            let mut want: Vec<f64> = acc.iter().map(|&v| v as f64).collect();
            let p = [0.5f32, -1.25, 2.0, 0.125];
            unsafe { V::axpy4(p, ptrs, &mut acc) };
            unsafe { V::axpy(0.75, q.as_ptr(), &mut acc) };
            for (c, w) in want.iter_mut().enumerate() {
                *w += (0..4).map(|i| p[i] as f64 * k[i][c] as f64).sum::<f64>() + 0.75 * q[c] as f64;
            }
            for (a, b) in acc.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "axpy n={n}");
            }
            // axpy4x2: two axpy4 calls' bits.
            let (mut first, mut second) = (data(n, 98), data(n, 97));
            let (mut want_first, mut want_second) = (first.clone(), second.clone());
            let p2 = [-0.375f32, 1.5, 0.25, -2.0];
            unsafe { V::axpy4x2([p, p2], ptrs, [&mut first, &mut second]) };
            unsafe { V::axpy4(p, ptrs, &mut want_first) };
            unsafe { V::axpy4(p2, ptrs, &mut want_second) };
            assert_eq!((first, second), (want_first, want_second), "axpy4x2 n={n}: axpy4's bits");
            // scale_to_bf16: Bf16::round of each product, NaN and infinities included.
            let mut x: Vec<f32> = data(n, 6).iter().map(|v| v * 3e4).collect();
            x[0] = f32::NAN;
            x[n - 1] = f32::INFINITY;
            let want: Vec<u32> = x.iter().map(|&v| Bf16::round(v * 0.37).to_f32().to_bits()).collect();
            unsafe { V::scale_to_bf16(&mut x, 0.37) };
            assert_eq!(x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "scale_to_bf16 n={n}");
        }
        let mut x: [f32; 16] = data(16, 5).try_into().unwrap();
        x[3] = f32::NAN;
        x[7] = f32::NEG_INFINITY;
        x[12] = f32::INFINITY;
        for below in [f32::NEG_INFINITY, -1.0, 0.0, x[0], 3.9, f32::INFINITY] {
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            let want = (0..16).filter(|&j| !(x[j] <= below)).fold(0u32, |m, j| m | 1 << j);
            assert_eq!(unsafe { V::above_mask16(&x, below) }, want, "above_mask16 below {below}");
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::round(1.0), Bf16(0x3f80));
        assert_eq!(Bf16::round(1.0 + 1.0 / 256.0), Bf16(0x3f80)); // a tie: to the even 1.0
        assert_eq!(Bf16::round(1.0 + 3.0 / 256.0), Bf16(0x3f82)); // a tie: to the even 1.015625
        assert_eq!(Bf16::round(1.0 + 1.5 / 256.0), Bf16(0x3f81)); // above the tie: up
        assert_eq!(Bf16::round(-2.5), Bf16(0xc020));
        assert_eq!(Bf16::round(f32::MAX).to_f32(), f32::INFINITY); // past bfloat16's largest
        assert!(Bf16::round(f32::NAN).to_f32().is_nan());
        assert!(Bf16::round(f32::from_bits(0x7f80_0001)).to_f32().is_nan()); // a NaN near inf
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_round8_and_store8_round_as_round_does() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run(lanes: &[f32; 8]) -> ([f32; 8], [Bf16; 8]) {
            use std::arch::x86_64::*;
            let v = _mm256_loadu_ps(lanes.as_ptr());
            let mut widened = [0.0f32; 8];
            _mm256_storeu_ps(widened.as_mut_ptr(), Bf16::round8(v));
            let mut stored = [Bf16(0); 8];
            Bf16::store8(stored.as_mut_ptr(), v);
            (widened, stored)
        }
        if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")) {
            return;
        }
        let specials = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5, f32::MAX, f32::NAN, f32::from_bits(0x7f80_0001), -0.0, 1e-40];
        let mut blocks = vec![specials];
        for b in 0..64u32 {
            blocks.push(std::array::from_fn(|i| f32::from_bits((b * 8 + i as u32).wrapping_mul(0x9e37_79b9))));
        }
        for lanes in blocks {
            let (widened, stored) = unsafe { run(&lanes) };
            for i in 0..8 {
                let want = Bf16::round(lanes[i]);
                assert_eq!(stored[i], want, "store8 of {:e}", lanes[i]);
                assert_eq!(widened[i].to_bits(), want.to_f32().to_bits(), "round8 of {:e}", lanes[i]);
            }
        }
    }

    #[test]
    fn scalar_matches_f64() {
        check::<Scalar>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_matches_f64() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run() {
            check::<Avx2>();
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            unsafe { run() };
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_exp_keeps_nan() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run() -> Vec<f32> {
            let mut x = vec![0.0f32, f32::NAN, -1.0, -200.0, 1.0, 2.0, 3.0, 4.0];
            Avx2::exp_sum(&mut x, 0.0);
            x
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            let x = unsafe { run() };
            assert!(x[1].is_nan() && x[0] == 1.0 && x[3] < 1e-37 && x[3] >= 0.0, "{x:?}");
        }
    }
}
