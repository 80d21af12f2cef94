//! `nucleus`: where a row's top-p nucleus ends, found without sorting the row.
//!
//! The torch sampler's rule (`resin/sampling_filters.py`): order a row's tokens by logit,
//! largest first, take the cumulative sum of their probabilities, and cut at the first token
//! whose sum reaches `top_p` (the last token when none does); the row keeps every logit at or
//! above the cut's. torch's CPU `cumsum` of float32 adds in float64, one value after another,
//! and rounds each partial sum to float32, so the sums depend on the order: this kernel adds in
//! the same order (by logit, largest first; equal logits have equal probabilities, so their order
//! changes nothing) in float64 and compares the float32 rounding. The cut is the sort's, bit for
//! bit (the Python tests check it against torch's sort and `cumsum`).
//!
//! What it saves: the sort (or a `topk` of tens of thousands) of a row whose nucleus holds
//! thousands of tokens. A histogram of the logits (bins of 1/128 logit below the row's largest,
//! 32 logits deep, the rest in the last bin) and of their probability mass, summed in column
//! order, says in which bin the running sum crosses `top_p`. Two sums of the same j
//! probabilities in different orders differ by less than j * 2^-50 of the row's mass (the
//! float64 rounding bound, with a margin), so only the bins the crossing may lie in are sorted and added onto the mass above
//! them, and the answer stands where each token's comparison with `top_p` comes out the same
//! at that sum plus and minus the bound: it is then the sort's. Where one does not (a partial
//! sum within ~1e-11 of a float32 rounding edge, for one row in thousands) or the row never
//! reaches `top_p`, the kernel adds in the sort's order after all: bins placed from the top
//! in a counting sort, sorted within each, until the sums reach `top_p` or the row ends. Cost
//! per row: a few reads of the logits and one of the probabilities, whatever the nucleus's
//! size (~0.5 ms at 152k tokens, where a `topk` of the nucleus took 7-15 ms), plus a sort of
//! the nucleus on the rare fallback.

use crate::candidates::{from_key, key, largest};
use crate::vector::Ahead;

/// Bins of the histogram, each [`BINS_PER_LOGIT`]-th of a logit wide, from the row's largest
/// logit down; the last also holds everything deeper (a token 32 logits below the largest has
/// probability under 1e-13).
const NUM_BINS: usize = 4096;

/// Histogram bins per logit below the row's largest.
const BINS_PER_LOGIT: f32 = 128.0;

/// Each logit's bin below the row's largest into `bins`: non-decreasing as the logit falls (a
/// rounded subtraction, a product by a power of two and a truncation are monotone), so bin
/// order is logit order. `-inf`, NaN and anything past the histogram land in the last bin.
/// Vectorised with AVX2 where the CPU has it (the same bins: the arithmetic is exact IEEE
/// either way; ~4x faster than the baseline build's saturating casts).
fn fill_bins(logits: &[f32], bins: &mut Vec<u16>) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { fill_bins_avx2(logits, bins) };
    }
    fill_bins_portable(logits, bins)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fill_bins_avx2(logits: &[f32], bins: &mut Vec<u16>) {
    fill_bins_portable(logits, bins)
}

#[inline(always)]
#[allow(clippy::manual_clamp)]
fn fill_bins_portable(logits: &[f32], bins: &mut Vec<u16>) {
    let top = row_max(logits);
    bins.clear();
    bins.extend(logits.iter().map(|&logit| {
        // `min` and `max` return the number where the other is NaN (`clamp` would keep the
        // NaN), so the value is finite, in 0..=LAST_BIN: the truncating cast cannot overflow.
        let bin = ((top - logit) * BINS_PER_LOGIT).min(LAST_BIN).max(0.0);
        // SAFETY: `bin` is finite and in range (above).
        unsafe { bin.to_int_unchecked::<i32>() as u16 }
    }));
}

/// The bin `fill_bins` gives NaN and what lies past the histogram.
const LAST_BIN: f32 = (NUM_BINS - 1) as f32;

/// The largest non-NaN logit (`-inf` for a row of NaN / `-inf`), with 16 running maxima so the
/// compiler vectorises it.
#[inline(always)]
fn row_max(logits: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = logits.chunks_exact(16);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    lanes.iter().copied().fold(tail, f32::max)
}

/// The reusable buffers of [`nucleus_cut`] (one per batch of rows).
pub struct NucleusScratch {
    counts: Vec<u32>,
    mass: Vec<f64>,
    /// Each token's bin (`fill_bins`).
    bins: Vec<u16>,
    /// The placed tokens as `key << 32 | probability bits`, descending (the probability rides
    /// along so the sums read `order` in sequence, not `probs` at random).
    order: Vec<u64>,
    /// The largest logits' `key << 32 | column`, for `top_indices`.
    top: Vec<u64>,
}

impl Default for NucleusScratch {
    fn default() -> Self {
        Self { counts: vec![0; NUM_BINS], mass: vec![0.0; NUM_BINS], bins: Vec::new(), order: Vec::new(), top: Vec::new() }
    }
}

/// The cut of one row: `logits` (scaled; `-inf` for dropped tokens) and `probs` (their softmax,
/// the same length), `top_p` the mass to reach. Returns the cut's logit (the smallest the row
/// keeps) and writes the row's `top_values.len()` largest logits (descending) and their columns
/// into `top_values` / `top_indices` (equal logits in any column order). The caller checks
/// `logits.len() == probs.len() >= top_values.len() == top_indices.len()`.
pub fn nucleus_cut(
    logits: &[f32],
    probs: &[f32],
    top_p: f32,
    top_values: &mut [f32],
    top_indices: &mut [i64],
    scratch: &mut NucleusScratch,
) -> f32 {
    let tuning = Tuning { margin_per_term: MARGIN_PER_TERM, first_mass: f64::from(top_p) };
    cut_with(logits, probs, top_p, tuning, top_values, top_indices, scratch)
}

/// How far apart two float64 sums of the same j probabilities, added in different orders, can
/// be: at most `j * MARGIN_PER_TERM` times the row's total mass (at least 1). (A sum of j
/// non-negative terms in any order is within (j - 1) u / (1 - (j - 1) u) of their total of the
/// exact one, u = 2^-53, so two sums differ by under 2 j u of the total; this is 8 j u.)
const MARGIN_PER_TERM: f64 = 1.0 / (1u64 << 50) as f64;

/// Whether a running sum reaches `top_p`: torch's test, `!(float32(sum) < top_p)` (the sampler
/// counts the sums below `top_p`), so a NaN `top_p` is reached at once, as there.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn reaches(sum: f64, top_p: f32) -> bool {
    !((sum as f32) < top_p)
}

/// What the tests may change in [`nucleus_cut`]: the margin of the histogram's answer
/// ([`MARGIN_PER_TERM`]; a huge one makes every row take the sort of its nucleus) and the mass
/// the sorted path's first round places bins up to (short of `top_p`, as rounding can leave
/// it, to exercise the later rounds).
#[derive(Clone, Copy)]
struct Tuning {
    margin_per_term: f64,
    first_mass: f64,
}

fn cut_with(
    logits: &[f32],
    probs: &[f32],
    top_p: f32,
    tuning: Tuning,
    top_values: &mut [f32],
    top_indices: &mut [i64],
    scratch: &mut NucleusScratch,
) -> f32 {
    let vocab_size = logits.len();
    assert_eq!(probs.len(), vocab_size, "nucleus: logits and probs lengths differ");
    assert!(vocab_size > 0 && vocab_size < (1 << 32), "nucleus: a row of {vocab_size} tokens");
    let num_top = top_values.len();
    assert!(num_top <= vocab_size && top_indices.len() == num_top, "nucleus: {num_top} top values of a {vocab_size}-token row");
    let NucleusScratch { counts, mass, bins, order, top } = scratch;
    counts.fill(0);
    mass.fill(0.0);
    fill_bins(logits, bins);
    for (&at, &p) in bins.iter().zip(probs) {
        counts[at as usize] += 1;
        mass[at as usize] += f64::from(p);
    }
    largest(logits, top_values, top_indices, top, &mut Ahead::none());
    let histogram = Histogram { logits, probs, bins, counts, mass };
    if let Some(cut) = histogram.bounded_cut(top_p, tuning.margin_per_term, order) {
        return cut;
    }
    histogram.sorted_cut(top_p, tuning.first_mass, order)
}

/// One row's logits, probabilities, bins and histogram.
struct Histogram<'a> {
    logits: &'a [f32],
    probs: &'a [f32],
    bins: &'a [u16],
    counts: &'a [u32],
    mass: &'a [f64],
}

impl Histogram<'_> {
    /// The cut from the histogram and a sort of the bins it may lie in, where the margin
    /// proves it is the sort's: the bins' masses (summed in column order) say where the
    /// running sum crosses `top_p`, to within `margin_per_term` a term; those bins are sorted
    /// and added onto the mass above them, and each token's comparison with `top_p` must come
    /// out the same at the sum plus and minus the margin. None where one does not (a sum
    /// within ~1e-11 of a float32 rounding edge) or the row never reaches `top_p`.
    fn bounded_cut(&self, top_p: f32, margin_per_term: f64, order: &mut Vec<u64>) -> Option<f32> {
        let total: f64 = self.mass.iter().sum();
        let margin = |terms: usize| (terms + 1) as f64 * margin_per_term * total.max(1.0);
        // The first bin whose end may reach top_p, and the mass and count above it.
        let (mut above, mut terms, mut first) = (0.0f64, 0usize, None);
        for (bin, (&m, &n)) in self.mass.iter().zip(self.counts).enumerate() {
            let end = above + m;
            if n > 0 && reaches(end + margin(terms + n as usize), top_p) {
                first = Some(bin);
                break;
            }
            (above, terms) = (end, terms + n as usize);
        }
        let first = first?;
        // The first bin from there whose end surely reaches it.
        let (mut end_mass, mut end_terms, mut last) = (above, terms, None);
        for bin in first..NUM_BINS {
            end_mass += self.mass[bin];
            end_terms += self.counts[bin] as usize;
            if reaches(end_mass - margin(end_terms), top_p) {
                last = Some(bin);
                break;
            }
        }
        order.clear();
        place(self.logits, self.probs, self.bins, first, last? + 1, self.counts, order);
        let (mut sum, mut terms) = (above, terms);
        for &entry in order.iter() {
            sum += f64::from(f32::from_bits(entry as u32));
            terms += 1;
            let (low, high) = (sum - margin(terms), sum + margin(terms));
            if reaches(low, top_p) {
                return Some(from_key((entry >> 32) as u32));
            }
            if reaches(high, top_p) {
                return None; // too close to call
            }
        }
        None
    }

    /// The cut by adding in the sort's order from the top: bins are placed until the
    /// histogram reaches `first_mass`, then, while the exact sums fall short (rounding), each
    /// further round at least doubles the placed tokens (each round a read of the row). The
    /// row's smallest logit when the sums never reach `top_p`.
    fn sorted_cut(&self, top_p: f32, first_mass: f64, order: &mut Vec<u64>) -> f32 {
        order.clear();
        let (mut sum, mut added, mut next_bin, mut estimate) = (0.0f64, 0usize, 0usize, 0.0f64);
        while next_bin < NUM_BINS {
            let first = next_bin;
            let (mut placed, mut end) = (order.len(), first);
            while end < NUM_BINS {
                estimate += self.mass[end];
                placed += self.counts[end] as usize;
                end += 1;
                let enough = if first == 0 { estimate >= first_mass } else { placed >= 2 * order.len() };
                if enough && placed > order.len() {
                    break;
                }
            }
            place(self.logits, self.probs, self.bins, first, end, self.counts, order);
            next_bin = end;
            for &entry in &order[added..] {
                sum += f64::from(f32::from_bits(entry as u32));
                if reaches(sum, top_p) {
                    return from_key((entry >> 32) as u32);
                }
            }
            added = order.len();
        }
        from_key((order[order.len() - 1] >> 32) as u32) // never reached: the smallest logit
    }
}

/// Appends the tokens of bins `first..end` to `order`, bin by bin, each bin sorted by key,
/// descending (a counting sort by bin, then a sort within each).
fn place(logits: &[f32], probs: &[f32], bins: &[u16], first: usize, end: usize, counts: &[u32], order: &mut Vec<u64>) {
    let start = order.len();
    let mut offsets = Vec::with_capacity(end - first); // where bin first + i's tokens go
    let mut at = start;
    for &count in &counts[first..end] {
        offsets.push(at);
        at += count as usize;
    }
    order.resize(at, 0);
    each_in_bins(bins, first, end, |column| {
        let slot = &mut offsets[bins[column] as usize - first];
        order[*slot] = (u64::from(key(logits[column])) << 32) | u64::from(probs[column].to_bits());
        *slot += 1;
    });
    let mut begin = start;
    for &count in &counts[first..end] {
        let stop = begin + count as usize;
        order[begin..stop].sort_unstable_by(|a, b| b.cmp(a));
        begin = stop;
    }
}

/// Calls `visit(column)`, in column order, for each token whose bin is in `first..end`: 16
/// bins compared at a time (AVX2 where the CPU has it), only the matches looked at one by one
/// (a branch a token mispredicted wherever the bins in range are scattered through the row).
fn each_in_bins(bins: &[u16], first: usize, end: usize, visit: impl FnMut(usize)) {
    let (first, end) = (first.min(NUM_BINS) as u16, end.min(NUM_BINS) as u16);
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2.
        return unsafe { each_in_bins_avx2(bins, first, end, visit) };
    }
    each_in_tail(bins, 0, first, end, visit)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn each_in_bins_avx2(bins: &[u16], first: u16, end: u16, mut visit: impl FnMut(usize)) {
    use std::arch::x86_64::*;
    // Bins and bounds are below 2^15, so the signed compares order them.
    let (at_least, below) = (_mm256_set1_epi16(first as i16 - 1), _mm256_set1_epi16(end as i16));
    let mut column = 0;
    for block in bins.chunks_exact(16) {
        let v = _mm256_loadu_si256(block.as_ptr() as *const __m256i);
        let both = _mm256_and_si256(_mm256_cmpgt_epi16(v, at_least), _mm256_cmpgt_epi16(below, v));
        // Each 16-bit answer (0 or -1) narrowed to a byte, in order, then one bit a byte.
        let bytes = _mm_packs_epi16(_mm256_castsi256_si128(both), _mm256_extracti128_si256::<1>(both));
        let mut mask = _mm_movemask_epi8(bytes) as u32;
        while mask != 0 {
            visit(column + mask.trailing_zeros() as usize);
            mask &= mask - 1;
        }
        column += 16;
    }
    each_in_tail(bins, column, first, end, visit)
}

/// [`each_in_bins`] from `column` on, one bin at a time.
#[inline(always)]
fn each_in_tail(bins: &[u16], column: usize, first: u16, end: u16, mut visit: impl FnMut(usize)) {
    for (offset, &bin) in bins[column..].iter().enumerate() {
        if first <= bin && bin < end {
            visit(column + offset);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn bins_fall_with_the_logit_and_agree_on_every_path() {
        let mut row: Vec<f32> = (0..1000).map(|i| ((i * 37) % 997) as f32 * 0.05 - 20.0).collect();
        row[3] = f32::NAN;
        row[10] = f32::NEG_INFINITY;
        row[11] = 30.0; // the largest, 0.2 above the rest's
        let (mut bins, mut portable) = (Vec::new(), Vec::new());
        fill_bins(&row, &mut bins);
        fill_bins_portable(&row, &mut portable);
        assert_eq!(bins, portable);
        let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for (i, &logit) in row.iter().enumerate() {
            let want =
                if logit.is_nan() || (top - logit) * 128.0 >= LAST_BIN { NUM_BINS - 1 } else { ((top - logit) * 128.0) as usize };
            assert_eq!(bins[i] as usize, want, "logit {logit}");
        }
        row[0] = f32::INFINITY; // inf - inf is NaN: the top itself in the last bin, as all else
        fill_bins(&row, &mut bins);
        assert!(bins.iter().all(|&b| b as usize == NUM_BINS - 1));
    }

    /// The rule, by a full sort: (cut logit, the top values).
    fn by_sort(logits: &[f32], probs: &[f32], top_p: f32, num_top: usize) -> (f32, Vec<f32>) {
        let mut columns: Vec<usize> = (0..logits.len()).collect();
        columns.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let mut sum = 0.0f64;
        let mut cut = columns[columns.len() - 1];
        for &c in &columns {
            sum += f64::from(probs[c]);
            if reaches(sum, top_p) {
                cut = c;
                break;
            }
        }
        (logits[cut], columns[..num_top].iter().map(|&c| logits[c]).collect())
    }

    fn softmax(logits: &[f32]) -> Vec<f32> {
        let top = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = logits.iter().map(|&x| (x - top).exp()).collect();
        let total: f32 = e.iter().sum();
        e.iter().map(|&x| x / total).collect()
    }

    /// A deterministic spread of logits (a linear congruential generator's); the crate's
    /// other tests use it too.
    pub(crate) fn logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    #[test]
    fn cuts_where_a_sort_does() {
        let mut scratch = NucleusScratch::default();
        for (seed, scale, top_p) in [(1, 8.0, 0.9), (2, 2.0, 0.95), (3, 30.0, 0.5), (4, 0.01, 0.99), (5, 8.0, 1.0)] {
            let row = logits(5000, seed, scale);
            let probs = softmax(&row);
            let (mut values, mut indices) = (vec![0.0; 64], vec![0i64; 64]);
            let cut = nucleus_cut(&row, &probs, top_p, &mut values, &mut indices, &mut scratch);
            let (expected, top) = by_sort(&row, &probs, top_p, 64);
            assert_eq!(cut.to_bits(), expected.to_bits(), "seed {seed}");
            assert_eq!(values, top);
            for (&v, &i) in values.iter().zip(&indices) {
                assert_eq!(row[i as usize], v);
            }
        }
    }

    #[test]
    fn the_histogram_settles_most_rows_alone() {
        // The bounded path answers (Some) and agrees with the sort; the sorted path is the
        // fallback, not the rule.
        let (mut counts, mut mass, mut bins, mut order) = (vec![0u32; NUM_BINS], vec![0.0; NUM_BINS], Vec::new(), Vec::new());
        let mut settled = 0;
        for seed in 0..20 {
            let row = logits(30000, seed, 4.0 + seed as f32);
            let probs = softmax(&row);
            counts.fill(0);
            mass.fill(0.0);
            fill_bins(&row, &mut bins);
            for (&b, &p) in bins.iter().zip(&probs) {
                counts[b as usize] += 1;
                mass[b as usize] += f64::from(p);
            }
            let histogram = Histogram { logits: &row, probs: &probs, bins: &bins, counts: &counts, mass: &mass };
            for top_p in [0.5f32, 0.9, 0.95] {
                let (expected, _) = by_sort(&row, &probs, top_p, 0);
                if let Some(cut) = histogram.bounded_cut(top_p, MARGIN_PER_TERM, &mut order) {
                    assert_eq!(cut.to_bits(), expected.to_bits(), "seed {seed} top_p {top_p}");
                    settled += 1;
                }
                assert_eq!(histogram.sorted_cut(top_p, f64::from(top_p), &mut order).to_bits(), expected.to_bits());
            }
        }
        assert!(settled >= 55, "the histogram settled {settled} of 60 cuts");
    }

    #[test]
    fn a_sum_on_a_rounding_edge_takes_the_sort() {
        // 0.5 + 2^-25 is the midpoint between two float32s (it rounds to even: 0.5), so the
        // second token does not reach top_p = 0.5 + 2^-24 and the third does; a sum a hair
        // off would cut one token early. The histogram cannot tell: the sort decides.
        let half_ulp = 1.0 / (1u64 << 25) as f32;
        let row = [3.0f32, 2.0, 1.0, 0.5, -1.0];
        let probs = [0.5, half_ulp, half_ulp, 0.25, 0.25 - 2.0 * half_ulp];
        let top_p = 0.5 + 2.0 * half_ulp;
        let (mut counts, mut mass, mut bins, mut order) = (vec![0u32; NUM_BINS], vec![0.0; NUM_BINS], Vec::new(), Vec::new());
        fill_bins(&row, &mut bins);
        for (&b, &p) in bins.iter().zip(&probs) {
            counts[b as usize] += 1;
            mass[b as usize] += f64::from(p);
        }
        let histogram = Histogram { logits: &row, probs: &probs, bins: &bins, counts: &counts, mass: &mass };
        assert_eq!(histogram.bounded_cut(top_p, MARGIN_PER_TERM, &mut order), None);
        let mut scratch = NucleusScratch::default();
        assert_eq!(nucleus_cut(&row, &probs, top_p, &mut [], &mut [], &mut scratch), 1.0);
        assert_eq!(by_sort(&row, &probs, top_p, 0).0, 1.0);
    }

    #[test]
    fn a_short_estimate_takes_more_rounds_and_the_same_cut() {
        let mut scratch = NucleusScratch::default();
        let row = logits(20000, 9, 6.0);
        let probs = softmax(&row);
        for top_p in [0.3f32, 0.9, 0.999] {
            let (mut values, mut indices) = (vec![0.0; 32], vec![0i64; 32]);
            let tuning = Tuning { margin_per_term: 1.0, first_mass: 1e-4 }; // the sorted path
            let cut = cut_with(&row, &probs, top_p, tuning, &mut values, &mut indices, &mut scratch);
            let (expected, top) = by_sort(&row, &probs, top_p, 32);
            assert_eq!(cut.to_bits(), expected.to_bits(), "top_p {top_p}");
            assert_eq!(values, top);
        }
    }

    #[test]
    fn dropped_tokens_and_ties() {
        // -inf (dropped) tokens have probability 0; many equal logits share one bin.
        let mut row = vec![1.0f32; 300];
        row.extend([f32::NEG_INFINITY; 100]);
        row[7] = 3.0;
        let probs = softmax(&row);
        let mut scratch = NucleusScratch::default();
        let (mut values, mut indices) = (vec![0.0; 4], vec![0i64; 4]);
        let cut = nucleus_cut(&row, &probs, 0.5, &mut values, &mut indices, &mut scratch);
        assert_eq!(cut, 1.0);
        assert_eq!(values, [3.0, 1.0, 1.0, 1.0]);
        assert_eq!(indices[0], 7);
        // A mass the sums never reach (rounding): the row's smallest logit.
        let cut = nucleus_cut(&row, &probs, 2.0, &mut values, &mut indices, &mut scratch);
        assert_eq!(cut, f32::NEG_INFINITY);
        // A NaN mass is reached at once (torch counts the sums below it: none).
        assert_eq!(nucleus_cut(&row, &probs, f32::NAN, &mut values, &mut indices, &mut scratch), 3.0);
    }

    #[test]
    fn the_bin_filter_visits_the_columns_in_range_in_order() {
        let bins: Vec<u16> = (0..1000u64).map(|i| ((i * 2654435761) % 4096) as u16).collect();
        for (first, end) in [(0, NUM_BINS), (0, 1), (100, 2000), (4095, 4096), (7, 7)] {
            let mut seen = Vec::new();
            each_in_bins(&bins, first, end, |c| seen.push(c));
            let want: Vec<usize> = (0..bins.len()).filter(|&c| (first..end).contains(&(bins[c] as usize))).collect();
            assert_eq!(seen, want, "{first}..{end}");
            let mut tail = Vec::new();
            each_in_tail(&bins, 0, first as u16, end as u16, |c| tail.push(c));
            assert_eq!(tail, want, "{first}..{end}: one at a time");
        }
    }
}
