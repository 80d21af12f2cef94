//! `sampling`: the torch sampler's draw of whole rows in one call (temperature, top-k, top-p,
//! min-p and the inverse-CDF draw), reading each row where it lies and writing nothing but
//! the tokens: the very tokens `resin/sampling_draw.py`'s `draw_tokens` gives, bit for bit.
//!
//! The rules and the floats are the Python sampler's (its module docs are the spec); this is
//! the same arithmetic in the same order, with torch's softmax from [`crate::softmax`] and its
//! cumulative sums from [`crate::draw`]:
//!
//! - a row without a filter is drawn over the whole row: `softmax(x / T)`, the cumulative sum;
//! - a filtered row's kept set is decided from its n largest logits (n = 64, or 128 / 256 for a
//!   top-k past 63 / 127; all C when the vocabulary is under 16 C; [`candidates::largest`],
//!   scaled after): the k-th for top-k; for
//!   top-p either the softmax of its C = 256 candidates (a top-k inside them) or the whole
//!   row's softmax read at the candidates ([`softmax::exp_sum`]: the sum without writing the
//!   row; first from bounds of that sum, [`cheap_exp::inverse_bounds`], where they decide), a
//!   nucleus past them cut by [`nucleus::nucleus_cut`]; `max + log(min_p)` for min-p;
//!   a row the n do not settle searches again with C, as the Python draw does;
//! - a kept set inside the candidates is drawn over a vector of C values (the kept ones in
//!   token order, then `-inf`), one past them over the whole row with the rest `-inf`.
//!
//! Whole-row draws go four rows at a time through [`draw::draw_rows`] (their chains of
//! additions overlap). A row this does not take is left to the caller (`None`): a temperature
//! that is not a positive finite number, a NaN top-p or min-p, a top-k past C, a row holding
//! NaN or `+inf` (or nothing but `-inf`), scaled logits that overflow, an empty kept set (a
//! min-p above 1), a total that is not positive and finite.

use crate::bounded_draw::{self, BoundedScratch, Outcome};
use crate::candidates;
use crate::cheap_exp;
use crate::draw;
use crate::nucleus::{self, NucleusScratch};
use crate::softmax::{self, maximum, Lanes, Scaling};
use crate::vector::Ahead;

/// How many of a row's largest logits decide its kept set (the Python `CANDIDATES`).
pub const CANDIDATES: usize = 256;

/// One row's sampling settings (the plan's, as float32 / int64 as the Python sampler holds
/// them). `log_min_p` is torch's `log(clamp(min_p, 0))` (`-inf` for 0), computed by the caller.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub temperature: f32,
    pub top_k: i64,
    pub top_p: f32,
    pub min_p: f32,
    pub log_min_p: f32,
    pub uniform: f32,
}

impl Settings {
    /// Whether top-k is on for a row of `vocab_size` tokens (0 and k >= V: off).
    fn top_k_on(&self, vocab_size: usize) -> bool {
        self.top_k > 0 && (self.top_k as u64) < vocab_size as u64
    }
}

/// The buffers one batch reuses across its rows.
#[derive(Default)]
pub struct SamplingScratch {
    values: Vec<f32>,
    indices: Vec<i64>,
    buffer: Vec<u64>,
    own_values: Vec<f32>,
    own_indices: Vec<i64>,
    nucleus: NucleusScratch,
    /// One scaled row and its softmax (a nucleus past the candidates).
    row: Vec<f32>,
    probs: Vec<f32>,
    /// Four rows' probabilities for the whole-row draw.
    block: Vec<f32>,
    sums: Vec<f64>,
    /// The C-wide vector of a top-p over the candidates.
    vector: Vec<f32>,
    /// The candidates' exponentials (a top-p cut over the whole row's softmax).
    exps: Vec<f32>,
    among: Among,
    bounded: BoundedScratch,
    /// The prefetches of the row after the one being decided.
    next: Ahead,
}

/// The buffers of [`draw_among`].
#[derive(Default)]
struct Among {
    kept: Vec<(i64, f32)>,
    vector: Vec<f32>,
    sums: Vec<f64>,
}

/// What a row's filters decided.
enum Decision {
    Token(usize),
    /// Drawn over the whole row, scaled and kept from the threshold.
    WholeRow(Scaling),
    /// The first search did not settle it: search again with all C.
    Again,
    Left,
}

/// The token of each row: `row(i)` is row i's logits (all of one width V), `settings[i]` its
/// settings; `None` for a row left to the caller (module doc). `lanes`: torch's float vector
/// width, for its softmax's sums. `bounded`: a whole-row draw is first tried by
/// [`bounded_draw`], and a top-p cut over the whole row's softmax by the bounds of its sum
/// ([`cheap_exp::inverse_bounds`]) — the same tokens when they decide; off for A/B runs.
pub fn sample_rows<'a>(
    row: impl Fn(usize) -> &'a [f32],
    settings: &[Settings],
    lanes: Lanes,
    scratch: &mut SamplingScratch,
    bounded: bool,
) -> Vec<Option<usize>> {
    let mut tokens = vec![None; settings.len()];
    let mut whole: Vec<(usize, Scaling)> = Vec::new();
    for (i, s) in settings.iter().enumerate() {
        // The next row is asked for while this one's arithmetic-bound passes run (a row
        // without one leaves the next to be read when its turn comes).
        scratch.next = match settings.get(i + 1) {
            Some(_) => {
                let next = row(i + 1);
                Ahead::new(next.as_ptr() as *const u8, std::mem::size_of_val(next))
            }
            None => Ahead::none(),
        };
        match decide(row(i), s, lanes, bounded, scratch) {
            Decision::Token(t) => tokens[i] = Some(t),
            Decision::WholeRow(scaling) => {
                if bounded {
                    let outcome = bounded_draw::draw(row(i), scaling, s.uniform, &mut scratch.bounded, &mut scratch.next);
                    if let Outcome::Token(t) = outcome {
                        tokens[i] = Some(t);
                        continue;
                    }
                }
                whole.push((i, scaling))
            }
            Decision::Again | Decision::Left => {}
        }
    }
    for group in whole.chunks(4) {
        let width = row(group[0].0).len();
        scratch.block.resize(group.len() * width, 0.0);
        let uniforms: Vec<f32> = group.iter().map(|&(i, _)| settings[i].uniform).collect();
        // A lane whose scaled row's largest value is NaN or infinite is left (None).
        let mut finite = [false; 4];
        for (lane, &(i, scaling)) in group.iter().enumerate() {
            let out = &mut scratch.block[lane * width..(lane + 1) * width];
            let max = softmax::scale_into(row(i), scaling, out);
            finite[lane] = max.is_finite();
            if finite[lane] {
                softmax::softmax_in_place(out, max, lanes);
            }
        }
        if finite[..group.len()].iter().all(|&f| f) {
            let drawn = draw::draw_rows(&scratch.block, width, &uniforms, &mut scratch.sums);
            for (&(i, _), token) in group.iter().zip(drawn) {
                tokens[i] = token;
            }
            continue;
        }
        for (lane, &(i, _)) in group.iter().enumerate().filter(|&(lane, _)| finite[lane]) {
            let probs = &scratch.block[lane * width..(lane + 1) * width];
            tokens[i] = draw::draw_rows(probs, width, &uniforms[lane..lane + 1], &mut scratch.sums)[0];
        }
    }
    tokens
}

fn decide(row: &[f32], s: &Settings, lanes: Lanes, bounded: bool, scratch: &mut SamplingScratch) -> Decision {
    let vocab_size = row.len();
    let temperature = s.temperature;
    if !(temperature > 0.0 && temperature.is_finite()) || s.top_p.is_nan() || s.min_p.is_nan() || vocab_size == 0 {
        return Decision::Left;
    }
    let top_k_on = s.top_k_on(vocab_size);
    if !(top_k_on || s.top_p < 1.0 || s.min_p > 0.0) {
        return Decision::WholeRow(Scaling { temperature, keep_from: f32::NEG_INFINITY });
    }
    let num_candidates = CANDIDATES.min(vocab_size);
    if top_k_on && s.top_k as usize > num_candidates {
        return Decision::Left; // a top-k past the candidates: a topk of its own
    }
    // The first search's width (the Python `draw_groups`).
    let first = if vocab_size < 16 * num_candidates {
        num_candidates
    } else {
        let k = if top_k_on { s.top_k as usize } else { 0 };
        64 * (1 + usize::from(k >= 64)) * (1 + usize::from(k >= 128))
    };
    match filtered(row, s, first, num_candidates, lanes, bounded, scratch) {
        Decision::Again => filtered(row, s, num_candidates, num_candidates, lanes, bounded, scratch),
        decision => decision,
    }
}

/// A filtered row's decision from its `num` largest logits (`resin/sampling_draw.py`'s
/// `_draw_filtered`, one row).
fn filtered(
    row: &[f32],
    s: &Settings,
    num: usize,
    num_candidates: usize,
    lanes: Lanes,
    bounded: bool,
    sc: &mut SamplingScratch,
) -> Decision {
    let vocab_size = row.len();
    let scaling = Scaling { temperature: s.temperature, keep_from: f32::NEG_INFINITY };
    sc.values.resize(num, 0.0);
    sc.indices.resize(num, 0);
    candidates::largest(row, &mut sc.values, &mut sc.indices, &mut sc.buffer, &mut sc.next);
    if !sc.values[0].is_finite() {
        return Decision::Left; // NaN (the largest there is), +inf, or a row of -inf
    }
    for v in sc.values.iter_mut() {
        *v = scaling.apply(*v);
    }
    let (values, last) = (&sc.values, sc.values[num - 1]);
    let max = values[0];
    if !max.is_finite() {
        return Decision::Left; // a tiny temperature overflowed
    }
    let whole_vocabulary = num_candidates == vocab_size;
    let top_k_on = s.top_k_on(vocab_size);
    // top-k: the k-th largest; past our `num` (and inside C): ask C.
    let kth = if !top_k_on {
        f32::NEG_INFINITY
    } else if s.top_k as usize <= num {
        values[s.top_k as usize - 1]
    } else {
        return Decision::Again;
    };
    let mut threshold = kth;
    let mut own = false;
    if s.top_p < 1.0 {
        let small = whole_vocabulary || kth > last;
        if !small && top_k_on && num < num_candidates {
            return Decision::Again; // a tie with the last value: C might call it small
        }
        let cut = if small {
            // The distribution is the candidates': C values, those below kth -inf.
            sc.vector.clear();
            sc.vector.extend(values.iter().map(|&v| if v < kth { f32::NEG_INFINITY } else { v }));
            sc.vector.resize(num_candidates, f32::NEG_INFINITY);
            let m = softmax::row_max(&sc.vector);
            softmax::softmax_in_place(&mut sc.vector, m, lanes);
            let first = first_reaching(sc.vector.iter().copied(), s.top_p, num_candidates);
            if first < num {
                values[first]
            } else {
                f32::NEG_INFINITY
            }
        } else {
            // The whole row's softmax (kept from kth), read at the candidates: the first
            // candidate whose cumulative probability reaches top-p, and whether they all fall
            // short of it (the nucleus reaches past them). Both only rise with the inverse of
            // the softmax's sum, so where the bounds of that inverse give one answer it is the
            // exact sum's ([`cheap_exp::inverse_bounds`]); else the exact sum.
            let kept = Scaling { temperature: s.temperature, keep_from: kth };
            // The values are scaled already: kept from kth only.
            let keep = Scaling { temperature: 1.0, keep_from: kth };
            sc.exps.clear();
            sc.exps.extend(values.iter().map(|&v| keep.apply(v) - max));
            softmax::exp_in_place(&mut sc.exps);
            let exps = &sc.exps;
            let cut = |inverse: f32| {
                let probs = exps.iter().map(|&e| e * inverse);
                let first = first_reaching(probs.clone(), s.top_p, num);
                (first, (probs.fold(0.0f64, |acc, p| acc + f64::from(p)) as f32) < s.top_p)
            };
            let bounds =
                if bounded { cheap_exp::inverse_bounds(row, kept, max, lanes.get(), &mut sc.sums, &mut sc.next) } else { None };
            let decided = bounds.map(|(low, high)| (cut(low), cut(high))).filter(|(a, b)| a == b);
            let (first, past) = match decided {
                Some((cut, _)) => cut,
                None => cut(1.0 / softmax::exp_sum(row, kept, max, lanes, &mut sc.next)),
            };
            if past {
                // The nucleus reaches past the candidates: cut over the row (scaled and kept
                // into a copy unless that would change nothing).
                let scaled: &[f32] = if kept.temperature == 1.0 && kept.keep_from == f32::NEG_INFINITY {
                    row
                } else {
                    sc.row.resize(vocab_size, 0.0);
                    softmax::scale_into(row, kept, &mut sc.row);
                    &sc.row
                };
                sc.probs.resize(vocab_size, 0.0);
                softmax::softmax_into(scaled, max, lanes, &mut sc.probs);
                sc.own_values.resize(num_candidates, 0.0);
                sc.own_indices.resize(num_candidates, 0);
                own = true;
                nucleus::nucleus_cut(scaled, &sc.probs, s.top_p, &mut sc.own_values, &mut sc.own_indices, &mut sc.nucleus)
            } else {
                values[first]
            }
        };
        threshold = maximum(threshold, cut);
    }
    threshold = maximum(threshold, max + s.log_min_p);
    let kept = Scaling { temperature: s.temperature, keep_from: threshold };
    let among = |values: &[f32], indices: &[i64], buffers: &mut Among| {
        draw_among(values, indices, threshold, s.uniform, num_candidates, lanes, buffers)
    };
    if own {
        if threshold > sc.own_values[num_candidates - 1] {
            return among(&sc.own_values, &sc.own_indices, &mut sc.among);
        }
        return Decision::WholeRow(kept);
    }
    if whole_vocabulary || threshold > last {
        return among(&sc.values, &sc.indices, &mut sc.among);
    }
    if num < num_candidates {
        return Decision::Again;
    }
    Decision::WholeRow(kept)
}

/// The first of `width` cumulative sums of `probs` (float64 running sums rounded to float32,
/// torch's `cumsum`) that reaches `top_p`, counted as the sampler does (the sums below it),
/// the last column when none does.
fn first_reaching(probs: impl Iterator<Item = f32>, top_p: f32, width: usize) -> usize {
    let mut sum = 0.0f64;
    let mut below = 0;
    for p in probs.take(width) {
        sum += f64::from(p);
        if (sum as f32) < top_p {
            below += 1;
        }
    }
    below.min(width - 1)
}

/// The draw among candidates `values` / `indices` (scaled, descending) of a row keeping those
/// `>= threshold`: the kept ones in token order, then `-inf` to `width` columns, its softmax's
/// inverse-CDF column (`_draw_among`).
fn draw_among(
    values: &[f32],
    indices: &[i64],
    threshold: f32,
    uniform: f32,
    width: usize,
    lanes: Lanes,
    b: &mut Among,
) -> Decision {
    b.kept.clear();
    b.kept.extend(indices.iter().zip(values).filter(|(_, &v)| v >= threshold).map(|(&i, &v)| (i, v)));
    b.kept.sort_unstable_by_key(|&(i, _)| i);
    b.vector.clear();
    b.vector.extend(b.kept.iter().map(|&(_, v)| v));
    b.vector.resize(width, f32::NEG_INFINITY);
    let max = softmax::row_max(&b.vector);
    if !max.is_finite() {
        return Decision::Left;
    }
    softmax::softmax_in_place(&mut b.vector, max, lanes);
    match draw::draw_rows(&b.vector, width, &[uniform], &mut b.sums)[0] {
        Some(column) if column < b.kept.len() => Decision::Token(b.kept[column].0 as usize),
        _ => Decision::Left,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(temperature: f32, top_k: i64, top_p: f32, min_p: f32, uniform: f32) -> Settings {
        let log_min_p = if min_p > 0.0 { min_p.ln() } else { f32::NEG_INFINITY };
        Settings { temperature, top_k, top_p, min_p, log_min_p, uniform }
    }

    /// Rows with one clear maximum (and ties elsewhere): the filters that keep only it must
    /// give it for any uniform; the rows out of the kernel's reach come back `None`.
    #[test]
    fn filters_that_keep_one_token_give_it_and_the_rest_is_left() {
        let vocab_size = 5000;
        let rows: Vec<Vec<f32>> = (0..6)
            .map(|r| {
                let mut row: Vec<f32> = (0..vocab_size).map(|i| ((i * 7 + r) % 13) as f32 * 0.1).collect();
                row[(r * 811) % vocab_size] = 9.0;
                row
            })
            .collect();
        let best = |r: usize| (r * 811) % vocab_size;
        let lanes = Lanes::new(8).unwrap();
        let mut scratch = SamplingScratch::default();
        for uniform in [0.0, 0.3, 0.999_999_9] {
            let cases = [
                settings(0.7, 1, 1.0, 0.0, uniform),  // top-k 1
                settings(1.0, 0, 1.0, 0.9, uniform),  // min-p keeps the top one alone
                settings(0.5, 0, 0.01, 0.0, uniform), // a tiny nucleus
                settings(1.3, 1, 0.5, 0.0, uniform),  // top-k 1 and top-p
            ];
            for (r, row) in rows.iter().enumerate() {
                let got = sample_rows(|_| row, &cases, lanes, &mut scratch, true);
                assert!(got.iter().all(|&t| t == Some(best(r))), "row {r}, u {uniform}: {got:?}");
            }
        }
        let left = [
            settings(0.0, 0, 1.0, 0.0, 0.5),
            settings(f32::NAN, 0, 1.0, 0.0, 0.5),
            settings(1.0, 0, f32::NAN, 0.0, 0.5),
            settings(1.0, 300, 1.0, 0.0, 0.5),
        ];
        assert_eq!(sample_rows(|_| &rows[0], &left, lanes, &mut scratch, true), vec![None; 4]);
        // A row without a filter draws over the whole row: with a uniform of 0, the first
        // token of positive probability (token 0 here).
        let whole = sample_rows(|_| &rows[1], &[settings(1.0, 0, 1.0, 0.0, 0.0)], lanes, &mut scratch, true);
        assert_eq!(whole, vec![Some(0)]);
    }
}
