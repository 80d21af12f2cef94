//! `rotary`: the half-split rotary position embedding (HF `rotate_half`) of a step's q or k
//! rows, in one pass.
//!
//! For each token t, head h and channel i of a `head_dim`-wide row x (half = head_dim / 2):
//! `out[i] = x[i] * cos[t][i] + (-x[i + half]) * sin[t][i]` for i < half and
//! `out[i] = x[i] * cos[t][i] + x[i - half] * sin[t][i]` above. Each product is rounded, then
//! the sum, exactly as torch evaluates `x * cos + rotate_half(x) * sin` (no fused
//! multiply-add: Rust never contracts `a * b + c`), so the floats are torch's bit for bit. In
//! bfloat16 each of the three results rounds to bfloat16 as torch's three ops do (a product
//! of two bfloat16 is exact in f32, so it rounds once; the sum rounds in f32, then to
//! bfloat16, as torch's add does; a NaN may carry another payload than torch's).
//! Replaces ~9 torch ops a call (two slices, a negation, a cat, two broadcasts, two multiplies
//! and an add). One thread: a decode step's rows are a few thousand floats.

use crate::vector::Element;

/// Rotates `x` [tokens, heads, head_dim] (contiguous) by the per-token tables `cos` / `sin`
/// [tokens, head_dim] into `out` (same shape as `x`), all of element type E. The caller checks
/// the lengths: `x.len() == out.len() == tokens * heads * head_dim`, `cos.len() == sin.len() ==
/// tokens * head_dim`, `head_dim` even and non-zero.
pub fn rotate_half_split<E: Element>(x: &[E], cos: &[E], sin: &[E], out: &mut [E], head_dim: usize) {
    assert!(head_dim.is_multiple_of(2) && head_dim > 0, "rotary: head_dim {head_dim} must be even");
    assert!(cos.len().is_multiple_of(head_dim), "rotary: cos is not [tokens, head_dim]");
    let tokens = cos.len() / head_dim;
    assert_eq!(cos.len(), sin.len(), "rotary: cos and sin lengths differ");
    assert_eq!(x.len(), out.len(), "rotary: x and out lengths differ");
    assert!(tokens > 0 && x.len().is_multiple_of(tokens * head_dim), "rotary: x is not [tokens, heads, head_dim]");
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA (FMA is never used: Rust does not contract a * b + c).
        return unsafe { rotate_avx2(x, cos, sin, out, head_dim) };
    }
    rotate_rows(x, cos, sin, out, head_dim);
}

/// [`rotate_half_split`] eight channels at a time (same floats: each lane rounds as
/// [`rotate_rows`] does); a half not a multiple of 8 takes the plain loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rotate_avx2<E: Element>(x: &[E], cos: &[E], sin: &[E], out: &mut [E], head_dim: usize) {
    use std::arch::x86_64::*;
    let half = head_dim / 2;
    if !half.is_multiple_of(8) {
        return rotate_rows(x, cos, sin, out, head_dim);
    }
    let tokens = cos.len() / head_dim;
    let heads = x.len() / (tokens * head_dim);
    let sign = _mm256_set1_ps(-0.0);
    for t in 0..tokens {
        let (c, s) = (cos.as_ptr().add(t * head_dim), sin.as_ptr().add(t * head_dim));
        for h in 0..heads {
            let row = (t * heads + h) * head_dim;
            let (xr, or) = (x.as_ptr().add(row), out.as_mut_ptr().add(row));
            for i in (0..half).step_by(8) {
                let (x1, x2) = (E::load8(xr.add(i)), E::load8(xr.add(i + half)));
                let mul = |a, b| E::round8(_mm256_mul_ps(a, b));
                let first = _mm256_add_ps(mul(x1, E::load8(c.add(i))), mul(_mm256_xor_ps(x2, sign), E::load8(s.add(i))));
                let second = _mm256_add_ps(mul(x2, E::load8(c.add(i + half))), mul(x1, E::load8(s.add(i + half))));
                E::store8(or.add(i), first);
                E::store8(or.add(i + half), second);
            }
        }
    }
}

#[inline(always)]
fn rotate_rows<E: Element>(x: &[E], cos: &[E], sin: &[E], out: &mut [E], head_dim: usize) {
    let half = head_dim / 2;
    let tokens = cos.len() / head_dim;
    let row_len = x.len() / tokens; // heads * head_dim

    // E(a * b) for the products, E(a + b) for the sum: identities in f32.
    #[inline(always)]
    fn mul<E: Element>(a: E, b: E) -> f32 {
        E::from_f32(a.to_f32() * b.to_f32()).to_f32()
    }
    for t in 0..tokens {
        let (c, s) = (&cos[t * head_dim..(t + 1) * head_dim], &sin[t * head_dim..(t + 1) * head_dim]);
        let x_rows = &x[t * row_len..(t + 1) * row_len];
        let out_rows = &mut out[t * row_len..(t + 1) * row_len];
        let (c1, c2) = c.split_at(half);
        let (s1, s2) = s.split_at(half);
        for (xh, oh) in x_rows.chunks_exact(head_dim).zip(out_rows.chunks_exact_mut(head_dim)) {
            let (x1, x2) = xh.split_at(half);
            let (o1, o2) = oh.split_at_mut(half);
            for i in 0..half {
                let minus_x2 = E::from_f32(-x2[i].to_f32()); // exact: a sign flip
                o1[i] = E::from_f32(mul(x1[i], c1[i]) + mul(minus_x2, s1[i]));
                o2[i] = E::from_f32(mul(x2[i], c2[i]) + mul(x1[i], s2[i]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_each_head_by_its_tokens_angles() {
        // 2 tokens, 2 heads, head_dim 4: rotation by angle a maps (x1, x2) to
        // (x1 cos a - x2 sin a, x2 cos a + x1 sin a) per pair (i, i + half).
        let head_dim = 4;
        let angles = [[0.0f32, 0.5], [1.0, -2.0]];
        // Tables are [tokens, head_dim], the pair angles repeated (HF's cat((freqs, freqs))).
        let table =
            |f: fn(f32) -> f32| -> Vec<f32> { angles.iter().flat_map(|a| [f(a[0]), f(a[1]), f(a[0]), f(a[1])]).collect() };
        let (cos, sin) = (table(f32::cos), table(f32::sin));
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut out = vec![0.0; 16];
        rotate_half_split(&x, &cos, &sin, &mut out, head_dim);
        for (t, pair_angles) in angles.iter().enumerate() {
            for h in 0..2 {
                let base = t * 8 + h * 4;
                for (i, &a) in pair_angles.iter().enumerate() {
                    let (x1, x2) = (x[base + i], x[base + i + 2]);
                    assert_eq!(out[base + i], x1 * a.cos() + (-x2) * a.sin());
                    assert_eq!(out[base + i + 2], x2 * a.cos() + x1 * a.sin());
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "must be even")]
    fn refuses_an_odd_head_dim() {
        rotate_half_split(&[0.0; 3], &[0.0; 3], &[0.0; 3], &mut [0.0; 3], 3);
    }
}
