//! `cheap_exp`: a row's softmax terms `exp(x / T - max)` to a stated error bound, cheaper than
//! SLEEF's bits, summed in blocks: what the bounded decisions add up ([`crate::bounded_draw`]'s
//! whole-row draw, the top-p normaliser of [`crate::sampling`]). Those need the exact path's
//! sums only to within a known distance, and fall back to the exact path when it is too close.
//!
//! A term ([`Terms`]) differs from the exact path's in three ways, each bounded by
//! [`Terms::error`] against that term (SLEEF's `exp(fl(x / T) - max)`, torch's):
//! - `exp` is a degree-6 polynomial after a range reduction by `ln 2`, no other range checks
//!   ([`exp_term`]): within [`EXP_ERROR`] of the true exponential, so within `EXP_ERROR +
//!   2^-23` of SLEEF's 1-ulp one;
//! - `x / T` is `x · fl(1 / T)` (a division a value costs ~a cycle on AVX-512, a multiply a
//!   fraction of one): `|x · fl(1/T) - x / T| <= 2^-22 |x / T|`, three roundings, and `|x / T|
//!   <= |max| + 87` for a term above the cutoff; the subtractions of `max` then round by up to
//!   half an ulp of 87 each (`2^-17` together). The exponent's error `Δ` is at most
//!   `2^-22 (|max| + 87) + 2^-17`, a relative error of at most `1.01 Δ` (none at `T = 1`, where
//!   the arguments are the same floats);
//! - terms below `max - 87` count as `e^-87` (SLEEF's reach down to `e^-104`, then 0): an
//!   absolute slack under `2^-120` a term against a sum of at least 1 (the largest value's
//!   own term). A `-inf` logit's term is 0, as the exact path's.
//!
//! The exact path's keep rule (`fl(x / T) >= keep_from`) is kept exactly: it is `x >= x*` for
//! the smallest such logit `x*`, found once a row ([`Terms::new`]). Where the bound passes
//! [`MAX_TERM_ERROR`] (scaled values of magnitude ~4,000: a tiny temperature) no bounded
//! decision is tried.

use crate::softmax::Scaling;
use crate::vector::Ahead;

/// Columns per block sum.
pub const BLOCK: usize = 256;

/// Bound on `|exp_term(x) / exp(x) - 1|` for `-87 <= x <= 0` (measured: under 4e-7; the
/// test checks a third of this).
pub const EXP_ERROR: f64 = 1.5e-6;

/// Bound on a block sum's relative error against its terms' float64 sum: each of the lane
/// sums adds at most 8 terms (32 lanes of AVX2, 64 of AVX-512), then float64 (a few float64
/// additions: `~2^-50`).
pub const BLOCK_SUM_ERROR: f64 = 10.0 / 16_777_216.0;

/// Absolute slack a term: what the cutoff drops (`e^-87 < 2^-125`) and float32 underflow.
pub const TERM_SLACK: f64 = 1.0 / (1u128 << 120) as f64;

/// Past this bound on a term's error ([`Terms::error`]; scaled values of magnitude ~4,000,
/// a tiny temperature) the bounded decisions are not tried: the linear `1.01 Δ` step of the
/// exponent's error needs `Δ` small, and the cheap exponent can leave its range.
pub const MAX_TERM_ERROR: f64 = 1e-3;

/// Below this (relative to the row's largest scaled value) a term is counted as `exp(CUTOFF)`.
const CUTOFF: f32 = -87.0;

/// How a row's terms are computed: `exp_term(x · reciprocal - max)` for `x >= smallest_kept`,
/// else 0 (module doc).
#[derive(Clone, Copy, Debug)]
pub struct Terms {
    /// `fl(1 / T)`, or exactly 1 at `T = 1` (no multiply then).
    reciprocal: f32,
    divided: bool,
    /// `x*`: the smallest logit the exact path keeps, at least the smallest finite float (a
    /// `-inf` logit's term is 0).
    smallest_kept: f32,
    max: f32,
}

impl Terms {
    /// The terms of a row read through `scaling`, whose largest scaled value is `max`
    /// (finite: the caller checks).
    pub fn new(scaling: Scaling, max: f32) -> Terms {
        let t = scaling.temperature;
        let divided = t != 1.0;
        let smallest_kept = smallest_kept(scaling).max(f32::MIN);
        Terms { reciprocal: if divided { 1.0 / t } else { 1.0 }, divided, smallest_kept, max }
    }

    /// Bound on `|term / exact term - 1|` for a term above the cutoff (module doc).
    pub fn error(self) -> f64 {
        let sleef = EXP_ERROR + 2f64.powi(-23);
        if !self.divided {
            return sleef;
        }
        let exponent = 2f64.powi(-22) * (f64::from(self.max.abs()) + 87.0) + 2f64.powi(-17);
        sleef + 1.01 * exponent * (1.0 + sleef)
    }

    /// One term, as the vector paths compute it.
    pub fn term(self, x: f32) -> f32 {
        if x.is_nan() || x < self.smallest_kept {
            return 0.0; // below the threshold, and NaN
        }
        let s = if self.divided { x * self.reciprocal } else { x };
        exp_term(s - self.max)
    }
}

/// The smallest float `x` with `scaling.apply(x)` kept (`fl(x / T) >= keep_from`): `fl(x / T)`
/// rises with `x`, so one step of ulps from `keep_from · T` either way finds it.
fn smallest_kept(scaling: Scaling) -> f32 {
    let (t, from) = (scaling.temperature, scaling.keep_from);
    if from == f32::NEG_INFINITY || t == 1.0 {
        return from;
    }
    let kept = |x: f32| x / t >= from;
    let mut x = from * t;
    if !x.is_finite() {
        return x; // beyond the floats: nothing (+inf) or everything finite (-inf) kept
    }
    while kept(x.next_down()) {
        x = x.next_down();
    }
    while !kept(x) {
        x = x.next_up();
    }
    x
}

/// `exp(x)` to [`EXP_ERROR`] for `CUTOFF <= x <= 0`; below, `exp(CUTOFF)` (`< 2^-125`,
/// within [`TERM_SLACK`] of anything smaller).
#[inline(always)]
pub fn exp_term(x: f32) -> f32 {
    let x = x.max(CUTOFF);
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let f = k.mul_add(-LN2_HIGH, x);
    let f = k.mul_add(-LN2_LOW, f);
    let p = poly(f);
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

const LN2_HIGH: f32 = 0.693_145_75;
#[allow(clippy::excessive_precision)]
const LN2_LOW: f32 = 1.428_606_765_330_187e-6;
/// e^f for |f| <= ln 2 / 2: Taylor to degree 6 (remainder under 1.2e-7).
const C: [f32; 7] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

#[inline(always)]
fn poly(f: f32) -> f32 {
    let mut p = C[0];
    for &c in &C[1..] {
        p = p.mul_add(f, c);
    }
    p
}

/// Each [`BLOCK`] of `row`'s sum of its terms (float32 lanes, then float64) into `out`
/// (`row.len().div_ceil(BLOCK)` of them). `ahead` asks for other memory as the row is read.
pub fn block_sums(row: &[f32], terms: Terms, out: &mut [f64], ahead: &mut Ahead) {
    assert_eq!(out.len(), row.len().div_ceil(BLOCK), "cheap_exp: block_sums shapes");
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512::block_sums(row, terms, out, ahead) };
    } else if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { avx2::block_sums(row, terms, out, ahead) };
    }
    portable_block_sums(row, terms, out, ahead);
}

/// [`block_sums`] without vectors (32 float32 lane sums a block, as the AVX2 path keeps).
fn portable_block_sums(row: &[f32], terms: Terms, out: &mut [f64], ahead: &mut Ahead) {
    for (chunk, o) in row.chunks(BLOCK).zip(out.iter_mut()) {
        ahead.step(4 * chunk.len());
        let mut lanes = [0.0f32; 32];
        for (i, &x) in chunk.iter().enumerate() {
            lanes[i % 32] += terms.term(x);
        }
        *o = lanes.iter().map(|&v| f64::from(v)).sum();
    }
}

/// An interval holding the inverse torch's softmax of `row` (scaled and kept by `scaling`, its
/// largest scaled value `max`, finite) multiplies by: `fl(1 / S)`, `S` the float32 sum of
/// SLEEF's terms in `lanes` lanes ([`crate::softmax::exp_sum`]'s). From the block sums of the
/// terms here (`sums` is scratch): their sum `Ŝ` is within [`BLOCK_SUM_ERROR`] of the terms'
/// float64 sum, which is within [`Terms::error`] (and the cutoff's slack) of the sum of SLEEF's
/// terms; torch's float32 sum of those is within `γ = 1.01 k 2^-24` of it (all terms positive;
/// `k`, the additions on the way to any lane's result: `len / lanes + 1` a lane, then
/// `log2 lanes` folds). Rounded outward to float32, then `fl(1 / ·)` of each end (a correctly
/// rounded division keeps the order). `None` if the lower end is not positive.
pub fn inverse_bounds(
    row: &[f32],
    scaling: Scaling,
    max: f32,
    lanes: usize,
    sums: &mut Vec<f64>,
    ahead: &mut Ahead,
) -> Option<(f32, f32)> {
    let terms = Terms::new(scaling, max);
    let term = terms.error();
    if term > MAX_TERM_ERROR {
        return None; // a tiny temperature's huge scaled values: the exact sum decides
    }
    sums.resize(row.len().div_ceil(BLOCK), 0.0);
    block_sums(row, terms, sums, ahead);
    let estimate: f64 = sums.iter().sum();
    let n = row.len() as f64;
    let blocks = BLOCK_SUM_ERROR + n * 2f64.powi(-52);
    // A row shorter than the lanes is added left to right.
    let lanes = lanes.max(1);
    let additions = if row.len() < lanes {
        row.len().saturating_sub(1) as f64
    } else {
        (row.len() / lanes) as f64 + 1.0 + f64::from(lanes.ilog2())
    };
    let torch = 1.01 * additions * 2f64.powi(-24);
    let slack = n * TERM_SLACK;
    // Then a margin for this float64 arithmetic itself.
    let low = (estimate / (1.0 + blocks) - slack) / (1.0 + term) * (1.0 - torch) * (1.0 - 1e-12);
    let high = (estimate / (1.0 - blocks) + slack) / (1.0 - term) * (1.0 + torch) * (1.0 + 1e-12);
    let mut low32 = low as f32;
    if f64::from(low32) > low {
        low32 = low32.next_down();
    }
    let mut high32 = high as f32;
    if f64::from(high32) < high {
        high32 = high32.next_up();
    }
    (low32 > 0.0 && high32.is_finite()).then(|| (1.0 / high32, 1.0 / low32))
}

/// The terms of `row` into `out` (the same length): a block's columns one by one.
pub fn terms_into(row: &[f32], terms: Terms, out: &mut [f32]) {
    assert_eq!(row.len(), out.len(), "cheap_exp: terms_into shapes");
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA; equal lengths checked.
        return unsafe { avx2::terms_into(row, terms, out) };
    }
    for (o, &x) in out.iter_mut().zip(row) {
        *o = terms.term(x);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Ahead, Terms, BLOCK, C, CUTOFF, LN2_HIGH, LN2_LOW};
    use std::arch::x86_64::*;

    /// [`Terms::term`] on 8 lanes (the same operations).
    #[inline(always)]
    unsafe fn term8(x: __m256, t: Terms) -> __m256 {
        let kept = _mm256_cmp_ps(x, _mm256_set1_ps(t.smallest_kept), _CMP_GE_OQ);
        let s = if t.divided { _mm256_mul_ps(x, _mm256_set1_ps(t.reciprocal)) } else { x };
        let d = _mm256_max_ps(_mm256_sub_ps(s, _mm256_set1_ps(t.max)), _mm256_set1_ps(CUTOFF));
        let k = _mm256_round_ps(
            _mm256_mul_ps(d, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let f = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_HIGH), d);
        let f = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_LOW), f);
        let mut p = _mm256_set1_ps(C[0]);
        for &c in &C[1..] {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        let scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        _mm256_and_ps(kept, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_sums(row: &[f32], t: Terms, out: &mut [f64], ahead: &mut Ahead) {
        for (chunk, o) in row.chunks(BLOCK).zip(out.iter_mut()) {
            let mut acc = [_mm256_setzero_ps(); 4];
            let full = chunk.len() / 32 * 32;
            for i in (0..full).step_by(32) {
                ahead.step(128);
                for (a, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_add_ps(*acc, term8(_mm256_loadu_ps(chunk.as_ptr().add(i + 8 * a)), t));
                }
            }
            // The 32 lanes widened to float64 and added four at a time (a chain of scalar
            // additions here cost as much as the block's terms).
            let mut wide = _mm256_setzero_pd();
            for acc in acc {
                wide = _mm256_add_pd(wide, _mm256_cvtps_pd(_mm256_castps256_ps128(acc)));
                wide = _mm256_add_pd(wide, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(acc)));
            }
            let mut four = [0.0f64; 4];
            _mm256_storeu_pd(four.as_mut_ptr(), wide);
            let mut sum: f64 = four.iter().sum();
            for &x in &chunk[full..] {
                sum += f64::from(t.term(x));
            }
            *o = sum;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn terms_into(row: &[f32], t: Terms, out: &mut [f32]) {
        let full = row.len() / 8 * 8;
        for i in (0..full).step_by(8) {
            _mm256_storeu_ps(out.as_mut_ptr().add(i), term8(_mm256_loadu_ps(row.as_ptr().add(i)), t));
        }
        for i in full..row.len() {
            out[i] = t.term(row[i]);
        }
    }
}

/// [`avx2`]'s block sums on 16 lanes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Ahead, Terms, BLOCK, C, CUTOFF, LN2_HIGH, LN2_LOW};
    use std::arch::x86_64::*;

    /// [`Terms::term`] on 16 lanes: the same operations but `2^k` applied by `vscalefps` (the
    /// same product: `k` is an integer, the power exact).
    #[inline(always)]
    unsafe fn term16(x: __m512, t: Terms) -> __m512 {
        let kept = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(t.smallest_kept));
        let s = if t.divided { _mm512_mul_ps(x, _mm512_set1_ps(t.reciprocal)) } else { x };
        let d = _mm512_max_ps(_mm512_sub_ps(s, _mm512_set1_ps(t.max)), _mm512_set1_ps(CUTOFF));
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            d,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let f = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_HIGH), d);
        let f = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_LOW), f);
        let mut p = _mm512_set1_ps(C[0]);
        for &c in &C[1..] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_maskz_scalef_ps(kept, p, k)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_sums(row: &[f32], t: Terms, out: &mut [f64], ahead: &mut Ahead) {
        for (chunk, o) in row.chunks(BLOCK).zip(out.iter_mut()) {
            let mut acc = [_mm512_setzero_ps(); 4];
            let full = chunk.len() / 64 * 64;
            for i in (0..full).step_by(64) {
                ahead.step(256);
                for (a, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_add_ps(*acc, term16(_mm512_loadu_ps(chunk.as_ptr().add(i + 16 * a)), t));
                }
            }
            // The 64 lanes widened to float64 and added eight at a time.
            let mut wide = _mm512_setzero_pd();
            for acc in acc {
                let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
                wide = _mm512_add_pd(wide, _mm512_cvtps_pd(_mm512_castps512_ps256(acc)));
                wide = _mm512_add_pd(wide, _mm512_cvtps_pd(high));
            }
            let mut sum = _mm512_reduce_add_pd(wide);
            for &x in &chunk[full..] {
                sum += f64::from(t.term(x));
            }
            *o = sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nucleus::tests::logits as data;
    use crate::softmax::{exp, scale_into};

    #[test]
    fn the_cheap_exp_is_within_its_bound() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = f64::from(exp_term(x));
            let want = f64::from(x).exp();
            worst = worst.max((got / want - 1.0).abs());
            x += 1.3e-4;
        }
        assert!(worst < EXP_ERROR / 3.0, "worst relative error {worst}");
        assert_eq!(exp_term(0.0), 1.0);
        assert!(exp_term(f32::NEG_INFINITY) == exp_term(-87.0) && exp_term(-87.0) < 2e-38);
        let terms = Terms::new(Scaling::NONE, 0.0);
        assert_eq!(terms.term(f32::NEG_INFINITY), 0.0);
        assert_eq!(terms.term(f32::NAN), 0.0);
    }

    /// Every term within [`Terms::error`] of the exact path's (SLEEF's exp of the divided,
    /// kept row), on each path, and the block sums within theirs of the terms' sum.
    #[test]
    fn terms_are_within_their_bound_of_the_exact_ones() {
        for (seed, scale) in [(1u64, 4.0f32), (2, 30.0), (3, 200.0)] {
            let mut row = data(4099, seed, scale);
            for x in row.iter_mut().step_by(97) {
                *x = f32::NEG_INFINITY; // banned tokens
            }
            for (temperature, keep_from) in
                [(1.0f32, f32::NEG_INFINITY), (0.7, f32::NEG_INFINITY), (1.3, 0.5), (0.37, -3.25), (1.0, 1.5)]
            {
                let scaling = Scaling { temperature, keep_from };
                let mut scaled = vec![0.0; row.len()];
                let max = scale_into(&row, scaling, &mut scaled);
                let terms = Terms::new(scaling, max);
                let bound = terms.error();
                let mut vector = vec![0.0; row.len()];
                terms_into(&row, terms, &mut vector);
                for ((&x, &s), &v) in row.iter().zip(&scaled).zip(&vector) {
                    let exact = f64::from(exp(s - max));
                    let scalar = f64::from(terms.term(x));
                    assert_eq!(scalar.to_bits(), f64::from(v).to_bits(), "the vector term of {x}");
                    if s == f32::NEG_INFINITY || s - max < CUTOFF + 1.0 {
                        assert!(scalar == 0.0 || (s != f32::NEG_INFINITY && scalar < 1e-37), "{x} T {temperature}");
                        continue;
                    }
                    assert!((scalar / exact - 1.0).abs() <= bound, "{x} T {temperature}: {scalar} vs {exact}");
                }
                // Each path's block sums within their bound of the terms' own.
                for (path, sums) in each_block_sums(&row, terms) {
                    for (b, &sum) in sums.iter().enumerate() {
                        let block = &vector[b * BLOCK..((b + 1) * BLOCK).min(row.len())];
                        let want: f64 = block.iter().map(|&v| f64::from(v)).sum();
                        assert!((sum - want).abs() <= BLOCK_SUM_ERROR * want + 1e-30, "{path}: block {b}, T {temperature}");
                    }
                }
            }
        }
    }

    /// The exact path's inverse (`fl(1 / exp_sum)`, torch's lane order, 8 and 16 lanes) lies
    /// inside [`inverse_bounds`]' interval, which is narrow (a few 1e-4 relative at most).
    #[test]
    fn the_exact_inverse_lies_inside_the_bounds() {
        use crate::softmax::{exp_sum, Lanes};
        let mut sums = Vec::new();
        for (seed, width, scale) in [(1u64, 7usize, 3.0f32), (2, 300, 12.0), (3, 5003, 4.0), (4, 32000, 2.0), (5, 40001, 40.0)] {
            let mut row = data(width, seed, scale);
            for x in row.iter_mut().step_by(11) {
                *x = f32::NEG_INFINITY;
            }
            for (temperature, keep_from) in [(1.0f32, f32::NEG_INFINITY), (0.7, f32::NEG_INFINITY), (1.3, 0.5), (0.6, -1.0)] {
                let scaling = Scaling { temperature, keep_from };
                let mut scaled = vec![0.0; width];
                let max = scale_into(&row, scaling, &mut scaled);
                if !max.is_finite() {
                    continue;
                }
                let (low, high) = inverse_bounds(&row, scaling, max, 16, &mut sums, &mut Ahead::none()).expect("bounds");
                assert!(low <= high && f64::from(high) / f64::from(low) - 1.0 < 1e-3, "{width} T {temperature}: {low} {high}");
                for lanes in [8, 16] {
                    let (low, high) = inverse_bounds(&row, scaling, max, lanes, &mut sums, &mut Ahead::none()).unwrap();
                    let exact = 1.0 / exp_sum(&row, scaling, max, Lanes::new(lanes).unwrap(), &mut Ahead::none());
                    assert!(
                        low <= exact && exact <= high,
                        "{width} T {temperature} lanes {lanes}: {exact} not in [{low}, {high}]"
                    );
                }
            }
        }
    }

    /// A tiny temperature (scaled values ~1.5e8: `x * fl(1/T)` 16 above `fl(x / T)`, the
    /// cheap term e^16 where the exact one is 1) is left to the exact path, bounds and draw.
    #[test]
    fn huge_scaled_values_are_left_to_the_exact_path() {
        let mut row = vec![0.0f32; 32000];
        row[0] = 46.18884;
        let scaling = Scaling { temperature: 3e-7, keep_from: f32::NEG_INFINITY };
        let max = scaling.apply(row[0]);
        assert!(Terms::new(scaling, max).error() > MAX_TERM_ERROR);
        assert_eq!(inverse_bounds(&row, scaling, max, 16, &mut Vec::new(), &mut Ahead::none()), None);
        let mut scratch = crate::bounded_draw::BoundedScratch::default();
        let drawn = crate::bounded_draw::draw(&row, scaling, 0.5, &mut scratch, &mut Ahead::none());
        assert_eq!(drawn, crate::bounded_draw::Outcome::Undecided);
    }

    /// The block sums of every path this CPU has: portable, AVX2, AVX-512.
    fn each_block_sums(row: &[f32], terms: Terms) -> Vec<(&'static str, Vec<f64>)> {
        let fresh = || vec![0.0; row.len().div_ceil(BLOCK)];
        let mut out = vec![("portable", fresh())];
        portable_block_sums(row, terms, &mut out[0].1, &mut Ahead::none());
        #[cfg(target_arch = "x86_64")]
        {
            if crate::vector::vectorised() {
                let mut sums = fresh();
                // SAFETY: the CPU has AVX2 + FMA.
                unsafe { avx2::block_sums(row, terms, &mut sums, &mut Ahead::none()) };
                out.push(("avx2", sums));
            }
            if crate::vector::avx512() {
                let mut sums = fresh();
                // SAFETY: the CPU has AVX-512F.
                unsafe { avx512::block_sums(row, terms, &mut sums, &mut Ahead::none()) };
                out.push(("avx512", sums));
            }
        }
        out
    }

    #[test]
    fn the_smallest_kept_logit_is_the_keep_rules_edge() {
        for (t, from) in [(0.7f32, 0.5f32), (1.3, -2.0), (0.37, 3.1), (3.0, 1e-3), (1.0, 0.25)] {
            let scaling = Scaling { temperature: t, keep_from: from };
            let x = smallest_kept(scaling);
            assert!(scaling.apply(x) >= from && scaling.apply(x.next_down()) < from, "T {t} from {from}: {x}");
        }
        assert_eq!(smallest_kept(Scaling { temperature: 0.5, keep_from: f32::NEG_INFINITY }), f32::NEG_INFINITY);
    }
}
