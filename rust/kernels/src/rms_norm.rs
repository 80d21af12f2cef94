//! `rms_norm`: HF's RMSNorm (`LlamaRMSNorm`) of a step's rows in one pass, torch's floats bit
//! for bit.
//!
//! For each row x of `dim` elements and the weight w (both of one element type E):
//! `out = w * E(x32 * rsqrt(mean(x32²) + eps))`, x32 = x widened to f32, each product rounded
//! to E (for bfloat16: the norm rounded, then the product with the weight rounded again), as
//! torch evaluates `weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(E)`.
//!
//! The mean is the one subtle part: torch's `sum` on a CPU (ATen's `cascade_sum`, which `mean`
//! calls before dividing by `dim`) adds a contiguous row in a fixed order that is not left to
//! right, and float addition does not associate. [`torch_row_sum`] restates that order: eight
//! lanes (ATen's 256-bit `Vectorized<float>`, which its sum kernel uses under every x86 CPU
//! capability: measured under AVX-512 and the plain one), four lane groups interleaved (its
//! `ilp_factor`), the groups' partial sums carried up levels of 16 (or more) additions, then
//! the tail one by one and the lanes in order. That is torch's order for a row of 8 to 32,767
//! elements; torch splits one wider row alone in its call over threads. The Python side
//! checks each width on a fixed probe against torch before trusting the kernel. NaN outputs
//! are NaN where torch's are, perhaps with another payload. One thread: a decode step's rows
//! are a few thousand floats.

use crate::vector::Element;

/// Lanes of ATen's vectorised float sum.
const LANES: usize = 8;
/// Lane groups the sum keeps apart (ATen's `ilp_factor`).
const GROUPS: usize = 4;
/// Levels of the cascade (ATen's `num_levels`).
const LEVELS: usize = 4;

type Lanes = [f32; LANES];

#[inline(always)]
fn add(a: &mut Lanes, b: &Lanes) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

/// ATen's `multi_row_sum` over `size` steps of `GROUPS` lane groups, step i's group k being
/// `load(i * GROUPS + k)`: per group, additions in levels of `2^level_power`, each level's sum
/// carried into the next when the step count crosses its boundary.
#[inline(always)]
fn multi_group_sum(size: usize, load: impl Fn(usize) -> Lanes) -> [Lanes; GROUPS] {
    // (ATen's CeilLog2 gives 1 at size <= 2; the max with 4 below makes the two agree.)
    let ceil_log2 = if size <= 1 { 0 } else { usize::BITS - (size - 1).leading_zeros() } as usize;
    let level_power = (ceil_log2 / LEVELS).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0.0f32; LANES]; GROUPS]; LEVELS];
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            for (k, group) in acc[0].iter_mut().enumerate() {
                add(group, &load(i * GROUPS + k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let (below, above) = acc.split_at_mut(j);
            for (lower, upper) in below[j - 1].iter_mut().zip(above[0].iter_mut()) {
                add(upper, lower);
                *lower = [0.0; LANES];
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        for (k, group) in acc[0].iter_mut().enumerate() {
            add(group, &load(i * GROUPS + k));
        }
        i += 1;
    }
    let [mut total, upper @ ..] = acc;
    for level in &upper {
        for (group, sum) in total.iter_mut().zip(level) {
            add(group, sum);
        }
    }
    total
}

/// `values.sum()` as torch adds a contiguous float32 row of at least 8 elements
/// (ATen's `vectorized_inner_sum` of `row_sum` over eight-lane vectors).
#[inline(always)]
pub fn torch_row_sum(values: &[f32]) -> f32 {
    assert!(values.len() >= LANES, "torch_row_sum: rows shorter than {LANES} take another path in torch");
    let num_vectors = values.len() / LANES;
    let vector = |v: usize| -> Lanes { values[v * LANES..(v + 1) * LANES].try_into().expect("eight lanes") };
    let num_steps = num_vectors / GROUPS;
    let mut groups = multi_group_sum(num_steps, vector);
    for v in num_steps * GROUPS..num_vectors {
        add(&mut groups[0], &vector(v));
    }
    let [mut total, rest @ ..] = groups;
    for group in &rest {
        add(&mut total, group);
    }
    let mut sum = 0.0f32;
    for &x in &values[num_vectors * LANES..] {
        sum += x;
    }
    for lane in total {
        sum += lane;
    }
    sum
}

/// Normalises each `dim`-wide row of `x` into `out` and scales it by `weight`. The caller checks
/// the lengths: `x.len() == out.len()`, a multiple of `dim`; `weight.len() == dim >= 8`.
pub fn rms_norm<E: Element>(x: &[E], weight: &[E], eps: f32, out: &mut [E]) {
    let dim = weight.len();
    assert!(dim >= LANES, "rms_norm: rows of {dim} < {LANES} elements take another path in torch");
    assert_eq!(x.len(), out.len(), "rms_norm: x and out lengths differ");
    assert!(x.len().is_multiple_of(dim), "rms_norm: x is not [rows, {dim}]");
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA (FMA is never used: Rust does not contract a * b + c).
        return unsafe { rms_norm_avx2(x, weight, eps, out) };
    }
    rms_norm_rows(x, weight, eps, out);
}

/// [`rms_norm_rows`] with the squares and the scaling eight lanes at a time (same floats: each
/// lane rounds as the plain loop does; the sum is the same code, compiled for AVX2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_norm_avx2<E: Element>(x: &[E], weight: &[E], eps: f32, out: &mut [E]) {
    use std::arch::x86_64::*;
    let dim = weight.len();
    let body = dim - dim % 8;
    let mut squares = vec![0.0f32; dim];
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        for i in (0..body).step_by(8) {
            let v = E::load8(row.as_ptr().add(i));
            _mm256_storeu_ps(squares.as_mut_ptr().add(i), _mm256_mul_ps(v, v));
        }
        for i in body..dim {
            let v = row[i].to_f32();
            squares[i] = v * v;
        }
        let mean = torch_row_sum(&squares) / dim as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        let scale8 = _mm256_set1_ps(scale);
        for i in (0..body).step_by(8) {
            let normed = E::round8(_mm256_mul_ps(E::load8(row.as_ptr().add(i)), scale8));
            E::store8(out_row.as_mut_ptr().add(i), _mm256_mul_ps(E::load8(weight.as_ptr().add(i)), normed));
        }
        for i in body..dim {
            let normed = E::from_f32(row[i].to_f32() * scale);
            out_row[i] = E::from_f32(weight[i].to_f32() * normed.to_f32());
        }
    }
}

#[inline(always)]
fn rms_norm_rows<E: Element>(x: &[E], weight: &[E], eps: f32, out: &mut [E]) {
    let dim = weight.len();
    let mut squares = vec![0.0f32; dim];
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        for (s, &v) in squares.iter_mut().zip(row) {
            let v = v.to_f32();
            *s = v * v;
        }
        let mean = torch_row_sum(&squares) / dim as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            let normed = E::from_f32(v.to_f32() * scale);
            *o = E::from_f32(w.to_f32() * normed.to_f32());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vector::Bf16;

    #[test]
    fn a_row_sums_in_torch_order_not_left_to_right() {
        // 40 values: one large in lane 0 of the first vector, small ones elsewhere. Left to
        // right every small value is lost against the large one; torch's order adds each
        // lane's five small values first (vectors 1..4 and the leftover vector 4 into group 0),
        // so they survive.
        let small = 4.0e-8f32;
        let mut values = vec![small; 40];
        values[0] = 1.0;
        let left_to_right = values.iter().fold(0.0f32, |a, &b| a + b);
        assert_eq!(left_to_right, 1.0);
        // Group 0 lane l: v0 + v4, then + group 1, 2, 3 (vectors 1, 2, 3).
        let lane0 = (((1.0f32 + small) + small) + small) + small;
        let other = (((small + small) + small) + small) + small;
        let mut want = 0.0f32 + lane0;
        for _ in 1..8 {
            want += other;
        }
        assert_eq!(torch_row_sum(&values), want);
        assert!(want > 1.0);
    }

    #[test]
    fn normalises_each_row_and_scales_by_the_weight() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let weight: Vec<f32> = (0..16).map(|i| 0.5 + i as f32 * 0.1).collect();
        let mut out = vec![0.0; 32];
        rms_norm(&x, &weight, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * 16..(r + 1) * 16];
            let rms = (row.iter().map(|v| v * v).sum::<f32>() / 16.0 + 1e-6).sqrt();
            for i in 0..16 {
                assert!((out[r * 16 + i] - weight[i] * row[i] / rms).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn bfloat16_rounds_the_norm_then_the_product() {
        let x: Vec<Bf16> = (0..8).map(|i| Bf16::round(1.0 + i as f32 / 3.0)).collect();
        let weight = vec![Bf16::round(1.1); 8];
        let mut out = vec![Bf16(0); 8];
        rms_norm(&x, &weight, 1e-6, &mut out);
        let squares: Vec<f32> = x.iter().map(|v| v.to_f32() * v.to_f32()).collect();
        let scale = 1.0 / (torch_row_sum(&squares) / 8.0 + 1e-6).sqrt();
        for i in 0..8 {
            let normed = Bf16::round(x[i].to_f32() * scale);
            assert_eq!(out[i], Bf16::round(weight[i].to_f32() * normed.to_f32()));
        }
    }

    #[test]
    #[should_panic(expected = "take another path")]
    fn refuses_rows_shorter_than_the_lanes() {
        rms_norm(&[0.0f32; 4], &[1.0; 4], 1e-6, &mut [0.0; 4]);
    }
}
