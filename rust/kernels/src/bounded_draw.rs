//! `bounded_draw`: a whole-row inverse-CDF draw decided from cheap exponentials and an error
//! bound, giving the token torch's softmax + `cumsum` + `searchsorted` gives, or saying it
//! cannot tell (then the caller runs the exact draw, [`crate::softmax`] + [`crate::draw`]).
//!
//! The exact draw (`resin/sampling_draw.py`'s `inverse_cdf` over `softmax(x / T)`) needs
//! SLEEF's `expf` bits of every token (27 vector operations per 8 values, most of a 32,000-token
//! row's cost), the float32 sum in torch's lane order, the probabilities written out, and a
//! chain of float64 additions. But its token depends on those bits only through comparisons
//! of the cumulative sums with the target, and those are nearly always decided by a wide
//! margin. Torch's token is the first column j with `cdf[j] > target`, where (module doc of
//! [`crate::draw`]) `cdf[j]` is the float32 rounding of the float64 running sum of `p_i =
//! fl(e_i * fl(1 / S))`, `target = min(fl(u * cdf[V-1]), one ulp below it)` and `e_i` SLEEF's
//! `exp(x_i - max)`. The common factor `fl(1 / S)` cancels between `cdf[j]` and the target, so
//! with `E_j = sum_{i <= j} e_i`:
//!
//! `cdf[j] / cdf[V-1] = (E_j / E_{V-1}) (1 ± ρ)`, `ρ` a few float32 roundings (`p_i`, the
//! rounded sums, the target) plus float64 additions: taken here as `6 · 2^-24 + V · 2^-52`.
//!
//! This computes `Ê_j`, the sums of [`cheap_exp`]'s terms (within [`Terms::error`] of each
//! exact term: a cheaper `exp`, `x · fl(1/T)` for `x / T`; no scaled row written out), in
//! float32 lanes over blocks of [`BLOCK`] columns (each block sum within [`BLOCK_SUM_ERROR`] of
//! its terms' sum) and float64 across them, finds the first column whose `Ê_j` passes
//! `u · Ê_{V-1}`, and keeps it only when both comparisons torch makes there hold with the
//! bound, taken twice over: `cdf[j] > target` and `cdf[j-1] <= target`. The terms' cutoff and
//! float32 underflow are an absolute slack of `V ·` [`TERM_SLACK`] against
//! `E_{V-1} >= 1` (the largest value's own term is 1). A uniform within `2^-20` of 1 (where
//! the target's one-ulp clamp could bind) is left to the exact draw, as is a row whose largest
//! scaled value is not finite. The undecided band at each edge is ~2e-5 · u of the row's
//! mass (~1e-4 at T != 1 and logits of magnitude ~100), far below a token's share on LLM-like (peaked) rows, which nearly always decide; on a
//! flat row of 32,000 tokens (shares ~3e-5) about half the draws are left to the exact draw.
//! The tests place uniforms on the exact sums' edges, where a decided token must still be
//! torch's.

use crate::cheap_exp::{self, Terms, BLOCK, BLOCK_SUM_ERROR, MAX_TERM_ERROR, TERM_SLACK};
use crate::softmax::{row_max, Scaling};
use crate::vector::Ahead;

/// Scratch reused across rows.
#[derive(Default)]
pub struct BoundedScratch {
    block_sums: Vec<f64>,
    /// The terms of the block the token lies in.
    terms: Vec<f32>,
}

/// The draw's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Torch's token, for certain.
    Token(usize),
    /// The bound cannot tell (or the row is out of reach): run the exact draw.
    Undecided,
}

/// The token of `row` scaled and kept by `scaling`, drawn with `uniform`, if the bound decides
/// it (module doc).
/// `ahead` asks for other memory while the exponentials are summed (see
/// [`crate::softmax::exp_sum`]).
pub fn draw(row: &[f32], scaling: Scaling, uniform: f32, scratch: &mut BoundedScratch, ahead: &mut Ahead) -> Outcome {
    let width = row.len();
    if width == 0 || !(0.0..1.0 - 1.0 / 1_048_576.0).contains(&uniform) {
        return Outcome::Undecided;
    }
    // The scaled row's largest value: dividing by T > 0 and rounding keep the order (NaN
    // stays NaN, or -inf below a threshold: either way not finite, left to the exact draw).
    let max = scaling.apply(row_max(row));
    if !max.is_finite() {
        return Outcome::Undecided;
    }
    let terms = Terms::new(scaling, max);
    if terms.error() > MAX_TERM_ERROR {
        return Outcome::Undecided; // a tiny temperature's huge scaled values
    }
    scratch.block_sums.resize(width.div_ceil(BLOCK), 0.0);
    cheap_exp::block_sums(row, terms, &mut scratch.block_sums, ahead);
    let total: f64 = scratch.block_sums.iter().sum();
    let n = width as f64;
    let delta = terms.error() + BLOCK_SUM_ERROR + n * 2f64.powi(-52);
    let rho = 6.0 * 2f64.powi(-24) + n * 2f64.powi(-52);
    let kappa = 2.0 * (2.0 * delta + rho);
    let slack = n * TERM_SLACK;
    let u = f64::from(uniform);
    let target = u * total;
    // The first block whose end passes the target, then the column inside it.
    let mut before = 0.0f64;
    let mut block = None;
    for (b, &sum) in scratch.block_sums.iter().enumerate() {
        if before + sum > target {
            block = Some(b);
            break;
        }
        before += sum;
    }
    let Some(block) = block else { return Outcome::Undecided };
    let columns = block * BLOCK..((block + 1) * BLOCK).min(width);
    scratch.terms.resize(columns.len(), 0.0);
    cheap_exp::terms_into(&row[columns.clone()], terms, &mut scratch.terms);
    let mut previous = before;
    for (offset, &term) in scratch.terms.iter().enumerate() {
        let sum = previous + f64::from(term);
        if sum > target {
            let j = columns.start + offset;
            // cdf[j] > target for certain, and cdf[j-1] <= target for certain (none before 0).
            let passes = sum * (1.0 - kappa) - slack > u * total * (1.0 + kappa) + slack;
            let below = j == 0 || previous * (1.0 + kappa) + slack < u * total * (1.0 - kappa) - slack;
            return if passes && below { Outcome::Token(j) } else { Outcome::Undecided };
        }
        previous = sum;
    }
    Outcome::Undecided // the block's sum and its terms' disagree by a rounding: let exact decide
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draw::draw_rows;
    use crate::nucleus::tests::logits as data;
    use crate::softmax::{scale_into, softmax_in_place, Lanes};

    fn exact(row: &[f32], scaling: Scaling, uniform: f32) -> Option<usize> {
        let mut probs = vec![0.0; row.len()];
        let max = scale_into(row, scaling, &mut probs);
        softmax_in_place(&mut probs, max, Lanes::new(8).unwrap());
        draw_rows(&probs, row.len(), &[uniform], &mut Vec::new())[0]
    }

    /// Every decided token is the exact draw's; random uniforms are nearly all decided, and
    /// uniforms placed on the exact cumulative sums' edges are left undecided or right.
    #[test]
    fn decided_tokens_are_the_exact_draws() {
        let mut scratch = BoundedScratch::default();
        let mut state = 11u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let (mut decided, mut total, mut decided_peaked, mut total_peaked) = (0, 0, 0, 0);
        let rows = [
            (1u64, 7usize, 3.0f32),
            (2, 300, 12.0),
            (3, 5000, 4.0),
            (4, 32000, 4.0),
            (5, 40001, 30.0),
            (6, 32000, 0.0),
            (7, 151_936, 0.0),
        ];
        for (seed, width, spread) in rows {
            // spread 0: LLM-like (a bulk of 4 logits' spread, 8 tokens 10-16 above it)
            let llm = spread == 0.0;
            let mut row = data(width, seed, if llm { 4.0 } else { spread });
            if llm {
                for t in 0..8 {
                    row[(t * 7919 + seed as usize) % width] = 12.0 + t as f32 * 0.8;
                }
            } else if width > 100 {
                for v in row.iter_mut().step_by(7) {
                    *v = f32::NEG_INFINITY;
                }
            }
            for scaling in [
                Scaling::NONE,
                Scaling { temperature: 0.7, keep_from: f32::NEG_INFINITY },
                Scaling { temperature: 1.3, keep_from: 0.5 },
            ] {
                for _ in 0..40 {
                    let u = next();
                    total += 1;
                    total_peaked += usize::from(llm);
                    if let Outcome::Token(t) = draw(&row, scaling, u, &mut scratch, &mut Ahead::none()) {
                        decided += 1;
                        decided_peaked += usize::from(llm);
                        assert_eq!(Some(t), exact(&row, scaling, u), "width {width} u {u}");
                    }
                }
                // Uniforms on the edges: the exact cumsums' own values (and their neighbours).
                let mut probs = vec![0.0; width];
                let max = scale_into(&row, scaling, &mut probs);
                softmax_in_place(&mut probs, max, Lanes::new(8).unwrap());
                let mut sum = 0.0f64;
                let cdf: Vec<f32> = probs
                    .iter()
                    .map(|&p| {
                        sum += f64::from(p);
                        sum as f32
                    })
                    .collect();
                let last = cdf[width - 1];
                for j in (0..width).step_by((width / 13).max(1)) {
                    let edge = cdf[j] / last;
                    for u in [edge, f32::from_bits(edge.to_bits().saturating_sub(1)), f32::from_bits(edge.to_bits() + 1)] {
                        if let Outcome::Token(t) = draw(&row, scaling, u, &mut scratch, &mut Ahead::none()) {
                            assert_eq!(Some(t), exact(&row, scaling, u), "edge width {width} u {u}");
                        }
                    }
                }
            }
        }
        // LLM-like rows decide nearly always; flat ones (a token's share ~1e-4) most of the time.
        assert!(decided_peaked * 100 >= total_peaked * 97, "LLM-like: {decided_peaked} of {total_peaked}");
        assert!(decided * 10 >= total * 7, "decided {decided} of {total}");
        let row = data(1000, 9, 5.0);
        assert_eq!(draw(&row, Scaling::NONE, 0.999_999_9, &mut scratch, &mut Ahead::none()), Outcome::Undecided);
        let mut nan = row.clone();
        nan[3] = f32::NAN;
        assert_eq!(draw(&nan, Scaling::NONE, 0.5, &mut scratch, &mut Ahead::none()), Outcome::Undecided);
    }
}
