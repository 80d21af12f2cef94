//! `softmax`: torch's CPU `softmax(dim=-1)` of a float32 row, bit for bit, and the pieces of
//! it the sampler reads without writing a whole row out (a sum of exponentials, one
//! probability).
//!
//! What torch computes (ATen's `_vec_softmax_lastdim` for float): `max = reduce_all(maximum,
//! row)`, `e = exp(x - max)` per element, `sum = reduce_all(+, e)`, then `e * (1 / sum)`.
//! `exp` is SLEEF's `expf` of 1-ulp accuracy (`Sleef_expf8_u10` under the AVX2 capability):
//! a range reduction by `ln 2` in two parts, a degree-5 polynomial, `2^q` applied in two
//! halves, all with fused multiply-adds ([`exp`]; the same ops lane for lane in its AVX2 `exp8`).
//! `reduce_all` keeps one vector of L lanes (8 under AVX2, 16 under AVX-512): the first L
//! values, then one lane-wise add per further L, a shorter tail added into its first lanes
//! only, and the lanes folded in halves (lane i with lane i + L/2, ..., down to one); a row
//! of fewer than L values is added left to right. Float addition does not associate, so
//! that order is the sum's bits: [`lane_sum`] restates it for either L.
//!
//! The caller says L ([`Lanes`]) and checks once that the bits agree with torch's on its
//! machine (`resin/sampling_kernel.py` probes it): another capability (the plain one uses
//! the C library's `expf`) or another torch gives other bits.

use crate::vector::Ahead;

/// The lanes of torch's float vector: 8 under the AVX2 capability, 16 under AVX-512.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lanes(usize);

impl Lanes {
    /// `Some` for 8 or 16.
    pub fn new(lanes: usize) -> Option<Lanes> {
        matches!(lanes, 8 | 16).then_some(Lanes(lanes))
    }

    pub fn get(self) -> usize {
        self.0
    }
}

// SLEEF's constants as it writes them (each rounds to the float32 it uses).
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts: `q * LN2_HIGH` is exact for the q an `expf` argument gives.
#[allow(clippy::excessive_precision)]
const LN2_HIGH: f32 = 0.693145751953125;
#[allow(clippy::excessive_precision)]
const LN2_LOW: f32 = 1.428606765330187045e-06;
/// The polynomial's coefficients, highest degree first.
#[allow(clippy::excessive_precision)]
const POLY: [f32; 6] = [
    0.000198527617612853646278381,
    0.00139304355252534151077271,
    0.00833336077630519866943359,
    0.0416664853692054748535156,
    0.166666671633720397949219,
    0.5,
];

/// SLEEF's `expf` (1 ulp), torch's float `exp` inside `softmax`: 0 below -104, `+inf` above
/// 100, NaN for NaN.
pub fn exp(d: f32) -> f32 {
    if d.is_nan() {
        return d;
    }
    if d < -104.0 {
        return 0.0;
    }
    if d > 100.0 {
        return f32::INFINITY;
    }
    let q = (d * LOG2_E).round_ties_even() as i32;
    let qf = q as f32;
    let s = qf.mul_add(-LN2_HIGH, d);
    let s = qf.mul_add(-LN2_LOW, s);
    let mut u = POLY[0];
    for c in &POLY[1..] {
        u = u.mul_add(s, *c);
    }
    let u = 1.0 + (s * s).mul_add(u, s);
    let half = q >> 1;
    u * pow2(half) * pow2(q - half)
}

/// `2^e` for `-127 < e < 128` as SLEEF builds it (the exponent bits).
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// torch's `maximum`: NaN when either is NaN.
pub(crate) fn maximum(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// torch's `reduce_all(+, values)` with `lanes` lanes (module doc): the sum's bits.
pub fn lane_sum(values: &[f32], lanes: Lanes) -> f32 {
    let l = lanes.get();
    if values.len() < l {
        return values.iter().copied().reduce(|a, b| a + b).unwrap_or(0.0);
    }
    let mut acc = [0.0f32; 16];
    acc[..l].copy_from_slice(&values[..l]);
    let mut chunks = values[l..].chunks_exact(l);
    for chunk in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += x;
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += x;
    }
    fold_halves(&mut acc[..l])
}

/// Lane i + width/2 added into lane i, halving the width down to one: torch's
/// `vec_reduce_all` of a sum.
fn fold_halves(acc: &mut [f32]) -> f32 {
    let mut width = acc.len();
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}

/// The largest of `values` (NaN if any is NaN; `-inf` for none): torch's `reduce_all` of
/// `maximum` (a maximum does not depend on the order).
pub fn row_max(values: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { avx2::row_max(values) };
    }
    values.iter().copied().fold(f32::NEG_INFINITY, maximum)
}

/// How a row is read: `x / temperature` (no division at 1), and below `keep_from` (the
/// threshold, `-inf` for none) `-inf`, as `ScaledRows` and `keep_from_` make it in torch for a
/// row without NaN (with a threshold, a NaN becomes `-inf` here; the sampler leaves such rows
/// before, and without one a NaN stays, for the caller's max to see).
#[derive(Clone, Copy, Debug)]
pub struct Scaling {
    pub temperature: f32,
    pub keep_from: f32,
}

impl Scaling {
    pub const NONE: Scaling = Scaling { temperature: 1.0, keep_from: f32::NEG_INFINITY };

    /// One value as the scaled, kept row holds it: `-inf` below a threshold (and NaN then).
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        let s = if self.temperature == 1.0 { x } else { x / self.temperature };
        // No threshold keeps a NaN too (the caller's max then says the row has one).
        if self.keep_from == f32::NEG_INFINITY || s >= self.keep_from {
            s
        } else {
            f32::NEG_INFINITY
        }
    }
}

/// Writes `row` scaled and kept (`scaling`) into `out` and returns its largest value (NaN if
/// any is NaN).
pub fn scale_into(row: &[f32], scaling: Scaling, out: &mut [f32]) -> f32 {
    assert_eq!(row.len(), out.len(), "softmax: scale_into shapes");
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA; equal lengths checked.
        return unsafe { avx2::scale_into(row, scaling, out) };
    }
    let mut max = f32::NEG_INFINITY;
    for (o, &x) in out.iter_mut().zip(row) {
        *o = scaling.apply(x);
        max = maximum(max, *o);
    }
    max
}

/// torch's softmax of `values` in place (the scaled row [`scale_into`] wrote, its largest value
/// `max`), with `lanes`: `exp(x - max)`, their [`lane_sum`], then each times `1 / sum`.
/// Returns the sum.
pub fn softmax_in_place(values: &mut [f32], max: f32, lanes: Lanes) -> f32 {
    let (len, p) = (values.len(), values.as_mut_ptr());
    // SAFETY: `p` addresses `len` values, read and written in place.
    unsafe { softmax_from(p, p, len, max, lanes) }
}

/// [`softmax_in_place`] of `src` written into `dst` (the same length), `src` unchanged.
pub fn softmax_into(src: &[f32], max: f32, lanes: Lanes, dst: &mut [f32]) -> f32 {
    assert_eq!(src.len(), dst.len(), "softmax: softmax_into shapes");
    // SAFETY: two distinct slices of `src.len()` values each.
    unsafe { softmax_from(src.as_ptr(), dst.as_mut_ptr(), src.len(), max, lanes) }
}

/// The softmax of the `len` values at `src` into `dst` (`src == dst` for in place).
///
/// # Safety
/// `src` and `dst` must address `len` values each, the same ones or disjoint ones.
unsafe fn softmax_from(src: *const f32, dst: *mut f32, len: usize, max: f32, lanes: Lanes) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if lanes.get() == 16 && crate::vector::avx512() {
        // SAFETY: the CPU has AVX-512F; the pointers as the caller promised.
        return unsafe { avx512::softmax_from(src, dst, len, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA; the pointers as the caller promised.
        return unsafe { avx2::softmax_from(src, dst, len, max, lanes) };
    }
    for i in 0..len {
        // SAFETY: `i < len` (caller's promise); each value read before it is written.
        unsafe { *dst.add(i) = exp(*src.add(i) - max) };
    }
    // SAFETY: `dst` addresses `len` values, written above.
    let values = unsafe { std::slice::from_raw_parts_mut(dst, len) };
    let sum = lane_sum(values, lanes);
    let inverse = 1.0 / sum;
    values.iter_mut().for_each(|v| *v *= inverse);
    sum
}

/// [`exp`] of each of `values`, in place (its bits, on 8 lanes where the CPU has AVX2 + FMA).
pub fn exp_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { avx2::exp_in_place(values) };
    }
    for v in values {
        *v = exp(*v);
    }
}

/// The sum torch's softmax of `row` scaled and kept (`scaling`) divides by, its largest value
/// being `max`, in one read of `row` and without writing it out: the [`lane_sum`] of
/// `exp(scaled - max)`. `ahead` asks for other memory as it goes, a byte for each byte of
/// `row` read (the sampler's next row, fetched while this arithmetic-bound pass runs;
/// [`Ahead::none`] for none).
pub fn exp_sum(row: &[f32], scaling: Scaling, max: f32, lanes: Lanes, ahead: &mut Ahead) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if lanes.get() == 16 && crate::vector::avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512::exp_sum(row, scaling, max, ahead) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { avx2::exp_sum(row, scaling, max, lanes, ahead) };
    }
    let e: Vec<f32> = row.iter().map(|&x| exp(scaling.apply(x) - max)).collect();
    lane_sum(&e, lanes)
}

/// torch's softmax of `row` (a whole row, as `softmax(dim=-1)`), into `out`.
pub fn softmax(row: &[f32], lanes: Lanes, out: &mut [f32]) {
    let max = scale_into(row, Scaling::NONE, out);
    softmax_in_place(out, max, lanes);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Lanes, Scaling, LN2_HIGH, LN2_LOW, LOG2_E, POLY};
    use crate::vector::Ahead;
    use std::arch::x86_64::*;

    /// [`super::exp`] on 8 lanes: the same operations, so the same bits.
    #[inline(always)]
    pub(super) unsafe fn exp8(d: __m256) -> __m256 {
        let q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(LOG2_E)));
        let qf = _mm256_cvtepi32_ps(q);
        let s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-LN2_HIGH), d);
        let s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-LN2_LOW), s);
        let mut u = _mm256_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(*c));
        }
        let u = _mm256_add_ps(_mm256_set1_ps(1.0), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
        let half = _mm256_srai_epi32(q, 1);
        let pow2 = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
        let u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half)), pow2(_mm256_sub_epi32(q, half)));
        let u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0), _CMP_LT_OQ), u);
        let u = _mm256_blendv_ps(u, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0), d, _CMP_LT_OQ));
        // NaN in, NaN out (the lanes above give a number for it).
        _mm256_blendv_ps(u, d, _mm256_cmp_ps(d, d, _CMP_UNORD_Q))
    }

    /// torch's `maximum` on 8 lanes: NaN when either is NaN.
    #[inline(always)]
    unsafe fn maximum8(a: __m256, b: __m256) -> __m256 {
        _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q))
    }

    #[inline(always)]
    unsafe fn scale8(x: __m256, scaling: Scaling) -> __m256 {
        let s = if scaling.temperature == 1.0 { x } else { _mm256_div_ps(x, _mm256_set1_ps(scaling.temperature)) };
        if scaling.keep_from == f32::NEG_INFINITY {
            return s;
        }
        let keep = _mm256_cmp_ps(s, _mm256_set1_ps(scaling.keep_from), _CMP_GE_OQ);
        _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), s, keep)
    }

    fn fold(lanes: [f32; 8], max: f32) -> f32 {
        lanes.into_iter().fold(max, super::maximum)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_max(values: &[f32]) -> f32 {
        // Four running maxima (one waited on each max's latency): a maximum does not depend
        // on the order, NaN included.
        let mut ms = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        let mut blocks = values.chunks_exact(32);
        for b in &mut blocks {
            for (j, m) in ms.iter_mut().enumerate() {
                *m = maximum8(*m, _mm256_loadu_ps(b.as_ptr().add(8 * j)));
            }
        }
        let mut m = maximum8(maximum8(ms[0], ms[1]), maximum8(ms[2], ms[3]));
        let mut chunks = blocks.remainder().chunks_exact(8);
        for c in &mut chunks {
            m = maximum8(m, _mm256_loadu_ps(c.as_ptr()));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        fold(lanes, chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, super::maximum))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_into(row: &[f32], scaling: Scaling, out: &mut [f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let n = row.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let s = scale8(_mm256_loadu_ps(row.as_ptr().add(i)), scaling);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), s);
            m = maximum8(m, s);
        }
        let mut tail = f32::NEG_INFINITY;
        for i in n..row.len() {
            out[i] = scaling.apply(row[i]);
            tail = super::maximum(tail, out[i]);
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        fold(lanes, tail)
    }

    /// The lane sums of `f(chunk)` over `values` as torch's `reduce_all` keeps them (module
    /// doc), `f` applied to each 8 values (a shorter tail padded, its pad lanes unused).
    #[inline(always)]
    unsafe fn lane_sums(len: usize, lanes: Lanes, mut f: impl FnMut(usize, usize) -> __m256) -> f32 {
        let l = lanes.get();
        if len < l {
            let mut vals = [0.0f32; 16];
            for i in (0..len).step_by(8) {
                _mm256_storeu_ps(vals.as_mut_ptr().add(i), f(i, (len - i).min(8)));
            }
            return vals[..len].iter().copied().reduce(|a, b| a + b).unwrap_or(0.0);
        }
        // Accumulators for lanes 0-7 and (L = 16) 8-15, seeded with the first L values.
        let mut acc = [f(0, 8), if l == 16 { f(8, 8) } else { _mm256_setzero_ps() }];
        let full = len / l * l;
        let mut d = l;
        while d < full {
            acc[0] = _mm256_add_ps(acc[0], f(d, 8));
            if l == 16 {
                acc[1] = _mm256_add_ps(acc[1], f(d + 8, 8));
            }
            d += l;
        }
        let mut sums = [0.0f32; 16];
        _mm256_storeu_ps(sums.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(sums.as_mut_ptr().add(8), acc[1]);
        // The tail: its first lanes only.
        let mut tail = [0.0f32; 16];
        for i in (0..len - full).step_by(8) {
            _mm256_storeu_ps(tail.as_mut_ptr().add(i), f(full + i, (len - full - i).min(8)));
        }
        for i in 0..len - full {
            sums[i] += tail[i];
        }
        super::fold_halves(&mut sums[..l])
    }

    /// 8 values from `p` (`count` < 8 of them zero-padded, as torch's partial `loadu`).
    #[inline(always)]
    unsafe fn load(p: *const f32, count: usize) -> __m256 {
        if count == 8 {
            return _mm256_loadu_ps(p);
        }
        let mut pad = [0.0f32; 8];
        std::ptr::copy_nonoverlapping(p, pad.as_mut_ptr(), count);
        _mm256_loadu_ps(pad.as_ptr())
    }

    /// `super::softmax_from`; the pointers as it says.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_from(src: *const f32, p: *mut f32, len: usize, max: f32, lanes: Lanes) -> f32 {
        let m = _mm256_set1_ps(max);
        let sum = lane_sums(len, lanes, |i, count| {
            let e = exp8(_mm256_sub_ps(load(src.add(i), count), m));
            if count == 8 {
                _mm256_storeu_ps(p.add(i), e);
            } else {
                let mut out = [0.0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), e);
                std::ptr::copy_nonoverlapping(out.as_ptr(), p.add(i), count);
            }
            e
        });
        let inverse = _mm256_set1_ps(1.0 / sum);
        let n = len / 8 * 8;
        for i in (0..n).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inverse));
        }
        let inverse = 1.0 / sum;
        for i in n..len {
            *p.add(i) *= inverse;
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_in_place(values: &mut [f32]) {
        let mut chunks = values.chunks_exact_mut(8);
        for c in &mut chunks {
            _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr())));
        }
        let tail = chunks.into_remainder();
        let mut lanes = [0.0f32; 8];
        lanes[..tail.len()].copy_from_slice(tail);
        _mm256_storeu_ps(lanes.as_mut_ptr(), exp8(_mm256_loadu_ps(lanes.as_ptr())));
        tail.copy_from_slice(&lanes[..tail.len()]);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(row: &[f32], scaling: Scaling, max: f32, lanes: Lanes, ahead: &mut Ahead) -> f32 {
        let m = _mm256_set1_ps(max);
        let p = row.as_ptr();
        lane_sums(row.len(), lanes, |i, count| {
            ahead.step(32);
            let x = scale8(load(p.add(i), count), scaling);
            exp8(_mm256_sub_ps(x, m))
        })
    }
}

/// The 16-lane sums ([`Lanes`] 16) on AVX-512F: [`avx2`]'s operations, one `__m512` for the
/// two `__m256` halves, masked loads and stores for a short tail. An AVX-512 torch's softmax
/// (`Sleef_expf16_u10`) makes the same operations lane for lane as the AVX2 one, so these give
/// the AVX2 path's bits at twice the width (tests: each against the other and against the
/// scalar model).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Scaling, LN2_HIGH, LN2_LOW, LOG2_E, POLY};
    use crate::vector::Ahead;
    use std::arch::x86_64::*;

    /// [`super::exp`] on 16 lanes: the same operations, so the same bits.
    #[inline(always)]
    pub(super) unsafe fn exp16(d: __m512) -> __m512 {
        let q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(LOG2_E)));
        let qf = _mm512_cvtepi32_ps(q);
        let s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-LN2_HIGH), d);
        let s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-LN2_LOW), s);
        let mut u = _mm512_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(*c));
        }
        let u = _mm512_add_ps(_mm512_set1_ps(1.0), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
        let half = _mm512_srai_epi32::<1>(q);
        let pow2 = |e: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(e, _mm512_set1_epi32(127))));
        let u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(half)), pow2(_mm512_sub_epi32(q, half)));
        let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(d, _mm512_set1_ps(-104.0));
        let u = _mm512_maskz_mov_ps(!underflow, u);
        let overflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_set1_ps(100.0), d);
        let u = _mm512_mask_mov_ps(u, overflow, _mm512_set1_ps(f32::INFINITY));
        // NaN in, NaN out.
        _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(d, d), d)
    }

    #[inline(always)]
    unsafe fn scale16(x: __m512, scaling: Scaling) -> __m512 {
        let s = if scaling.temperature == 1.0 { x } else { _mm512_div_ps(x, _mm512_set1_ps(scaling.temperature)) };
        if scaling.keep_from == f32::NEG_INFINITY {
            return s;
        }
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(s, _mm512_set1_ps(scaling.keep_from));
        _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), keep, s)
    }

    /// The lanes of the first `count` (<= 16) values from `p`.
    #[inline(always)]
    fn first(count: usize) -> __mmask16 {
        if count >= 16 {
            0xffff
        } else {
            ((1u32 << count) - 1) as __mmask16
        }
    }

    /// [`super::avx2`]'s `lane_sums` for 16 lanes: `f(i, count)` gives the 16 lanes of values
    /// `i..i + count` (pad lanes unused).
    #[inline(always)]
    unsafe fn lane_sums(len: usize, mut f: impl FnMut(usize, usize) -> __m512) -> f32 {
        let mut sums = [0.0f32; 16];
        if len < 16 {
            _mm512_storeu_ps(sums.as_mut_ptr(), f(0, len));
            return sums[..len].iter().copied().reduce(|a, b| a + b).unwrap_or(0.0);
        }
        let mut acc = f(0, 16);
        let full = len / 16 * 16;
        let mut d = 16;
        while d < full {
            acc = _mm512_add_ps(acc, f(d, 16));
            d += 16;
        }
        _mm512_storeu_ps(sums.as_mut_ptr(), acc);
        if full < len {
            let mut tail = [0.0f32; 16];
            _mm512_storeu_ps(tail.as_mut_ptr(), f(full, len - full));
            for i in 0..len - full {
                sums[i] += tail[i];
            }
        }
        super::fold_halves(&mut sums)
    }

    /// `super::softmax_from`; the pointers as it says.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_from(src: *const f32, p: *mut f32, len: usize, max: f32) -> f32 {
        let m = _mm512_set1_ps(max);
        let sum = lane_sums(len, |i, count| {
            let lanes = first(count);
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, src.add(i)), m));
            _mm512_mask_storeu_ps(p.add(i), lanes, e);
            e
        });
        let inverse = _mm512_set1_ps(1.0 / sum);
        for i in (0..len).step_by(16) {
            let lanes = first(len - i);
            let v = _mm512_maskz_loadu_ps(lanes, p.add(i));
            _mm512_mask_storeu_ps(p.add(i), lanes, _mm512_mul_ps(v, inverse));
        }
        sum
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_sum(row: &[f32], scaling: Scaling, max: f32, ahead: &mut Ahead) -> f32 {
        let m = _mm512_set1_ps(max);
        let p = row.as_ptr();
        lane_sums(row.len(), |i, count| {
            ahead.step(64);
            let x = scale16(_mm512_maskz_loadu_ps(first(count), p.add(i)), scaling);
            exp16(_mm512_sub_ps(x, m))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nucleus::tests::logits as data;

    #[test]
    fn the_vector_exp_is_the_scalar_one_bit_for_bit() {
        if !crate::vector::vectorised() {
            return;
        }
        let mut xs = data(80_000, 3, 240.0);
        xs.extend([0.0, -0.0, -104.0, -103.99, 100.0, 100.01, f32::NEG_INFINITY, f32::INFINITY, f32::NAN, -87.5, -1e-30]);
        while !xs.len().is_multiple_of(8) {
            xs.push(-1.0);
        }
        for chunk in xs.chunks_exact(8) {
            let mut got = [0.0f32; 8];
            // SAFETY: the CPU has AVX2 + FMA (checked above).
            unsafe {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn run(x: &[f32], out: &mut [f32; 8]) {
                    use std::arch::x86_64::*;
                    _mm256_storeu_ps(out.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(x.as_ptr())));
                }
                run(chunk, &mut got);
            }
            for (x, g) in chunk.iter().zip(got) {
                let want = exp(*x);
                assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "exp({x}): {g} vs {want}");
            }
        }
        // In place over a slice with a tail.
        let mut got = xs[..83].to_vec();
        exp_in_place(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            let want = exp(*x);
            assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "exp_in_place({x})");
        }
    }

    #[test]
    fn exp_is_within_an_ulp_or_two_of_f64() {
        for x in data(10_000, 9, 200.0) {
            let got = exp(x);
            let want = f64::from(x).exp();
            if !(1e-37..=1e38).contains(&want) {
                continue;
            }
            assert!(((f64::from(got) - want) / want).abs() < 2.5e-7, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp(-105.0), 0.0);
        assert_eq!(exp(101.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    /// torch's reduce order spelled out with one accumulator per lane.
    fn model_sum(values: &[f32], l: usize) -> f32 {
        if values.len() < l {
            return values.iter().copied().reduce(|a, b| a + b).unwrap_or(0.0);
        }
        let mut acc: Vec<f32> = values[..l].to_vec();
        let full = values.len() / l * l;
        for chunk in values[l..full].chunks(l) {
            for (a, x) in acc.iter_mut().zip(chunk) {
                *a += x;
            }
        }
        for (a, x) in acc.iter_mut().zip(&values[full..]) {
            *a += x;
        }
        while acc.len() > 1 {
            let half = acc.len() / 2;
            acc = (0..half).map(|i| acc[i] + acc[i + half]).collect();
        }
        acc[0]
    }

    #[test]
    fn every_path_sums_in_torchs_order() {
        for lanes in [8, 16] {
            let l = Lanes::new(lanes).unwrap();
            for n in [1usize, 5, 7, 8, 9, 15, 16, 17, 31, 100, 256, 1000, 4099] {
                let row = data(n, n as u64, 12.0);
                let max = row_max(&row);
                let e: Vec<f32> = row.iter().map(|&x| exp(x - max)).collect();
                let want = model_sum(&e, lanes);
                assert_eq!(lane_sum(&e, l).to_bits(), want.to_bits(), "lane_sum {n} x {lanes}");
                assert_eq!(
                    exp_sum(&row, Scaling::NONE, max, l, &mut Ahead::none()).to_bits(),
                    want.to_bits(),
                    "exp_sum {n} x {lanes}"
                );
                let mut out = vec![0.0; n];
                softmax(&row, l, &mut out);
                let inverse = 1.0 / want;
                for (o, x) in out.iter().zip(&e) {
                    assert_eq!(o.to_bits(), (x * inverse).to_bits(), "softmax {n} x {lanes}");
                }
                let mut into = vec![f32::NAN; n];
                assert_eq!(softmax_into(&row, max, l, &mut into).to_bits(), want.to_bits(), "softmax_into {n} x {lanes}");
                assert!(into.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()), "softmax_into {n} x {lanes}");
            }
        }
    }

    #[test]
    fn scaling_divides_and_keeps_from_the_threshold() {
        let row = data(1003, 4, 10.0);
        let scaling = Scaling { temperature: 0.7, keep_from: 1.5 };
        let mut out = vec![0.0; row.len()];
        let max = scale_into(&row, scaling, &mut out);
        let want: Vec<f32> = row.iter().map(|&x| if x / 0.7 >= 1.5 { x / 0.7 } else { f32::NEG_INFINITY }).collect();
        assert_eq!(out, want);
        assert_eq!(max, want.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let l = Lanes::new(8).unwrap();
        let e: Vec<f32> = want.iter().map(|&x| exp(x - max)).collect();
        assert_eq!(exp_sum(&row, scaling, max, l, &mut Ahead::none()).to_bits(), lane_sum(&e, l).to_bits());
        assert!(row_max(&[1.0, f32::NAN, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]).is_nan());
    }

    #[test]
    fn the_avx512_sums_are_the_avx2_ones_bit_for_bit() {
        if !crate::vector::avx512() {
            return;
        }
        let l = Lanes::new(16).unwrap();
        let mut specials = data(4000, 11, 240.0);
        specials.extend([0.0, -0.0, -104.0, -103.99, 100.0, 100.01, f32::NEG_INFINITY, f32::INFINITY, f32::NAN, -1e-30]);
        // The exponential alone, then whole rows: widths around 16, scaled and kept, -inf entries.
        for (x, chunk) in specials.chunks(16).enumerate() {
            let mut row = chunk.to_vec();
            row.resize(16, -1.0);
            let mut out = [0.0f32; 16];
            // SAFETY: AVX-512F checked above.
            unsafe {
                #[target_feature(enable = "avx512f")]
                unsafe fn run(x: &[f32], out: &mut [f32; 16]) {
                    use std::arch::x86_64::*;
                    _mm512_storeu_ps(out.as_mut_ptr(), avx512::exp16(_mm512_loadu_ps(x.as_ptr())));
                }
                run(&row, &mut out);
            }
            for (v, g) in row.iter().zip(out) {
                let want = exp(*v);
                assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "chunk {x}: exp({v}) {g} vs {want}");
            }
        }
        for n in [1usize, 7, 15, 16, 17, 31, 32, 33, 100, 4099, 32000] {
            let mut row = data(n, 3 * n as u64, 9.0);
            for i in (0..n).step_by(13) {
                row[i] = f32::NEG_INFINITY;
            }
            let max = row_max(&row);
            for scaling in [Scaling::NONE, Scaling { temperature: 0.7, keep_from: 0.5 }] {
                let max = if scaling.temperature == 1.0 { max } else { max / 0.7 };
                // SAFETY: AVX2 + FMA and AVX-512F checked above.
                let (wide, narrow) = unsafe {
                    (
                        avx512::exp_sum(&row, scaling, max, &mut Ahead::none()),
                        avx2::exp_sum(&row, scaling, max, l, &mut Ahead::none()),
                    )
                };
                assert_eq!(wide.to_bits(), narrow.to_bits(), "exp_sum {n}, {scaling:?}");
            }
            let (mut wide, mut narrow) = (row.clone(), row.clone());
            // SAFETY: as above.
            let sums = unsafe {
                let (w, n) = (wide.as_mut_ptr(), narrow.as_mut_ptr());
                (avx512::softmax_from(w, w, wide.len(), max), avx2::softmax_from(n, n, narrow.len(), max, l))
            };
            assert_eq!(sums.0.to_bits(), sums.1.to_bits(), "softmax sum {n}");
            assert!(wide.iter().zip(&narrow).all(|(a, b)| a.to_bits() == b.to_bits()), "softmax {n}");
        }
    }
}
