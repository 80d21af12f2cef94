//! `candidates`: a row's n largest logits and their columns, in one read of the row.
//!
//! The torch sampler's candidate search (`resin/sampling_candidates.py`): the values must be
//! exactly `topk(n)`'s, descending (equal values may come from other columns). torch's `topk`
//! costs ~10 ns a value over the row, and the torch tree of block maxima that replaced it costs
//! a max pass plus a `topk` of a few hundred values per level and row. Here one scan keeps
//! every logit above a running threshold in a buffer of 4n; when it fills, the buffer is cut
//! to its n largest and the threshold rises to the n-th. A logit equal to the threshold is not
//! needed (n logits at least as large are held), so the kept values are the n largest exactly.
//! On LLM-like or random logits the threshold settles within the first few thousand, and the
//! rest of the row is a compare each: 16 at a time ([`Vector::above_mask16`]), only the set
//! bits of a block's mask looked at one by one. The buffer holds 2n: a larger one refills
//! less often but takes in more logits the raised threshold would have dropped (on a
//! 32,000-token row of N(0, 2) logits, n = 64, a probe: 4n ~15-17 µs, 2n ~13-16, the scan
//! alone ~5).
//!
//! Order: by an order-preserving key of the float bits (`-inf` lowest); NaN counts as larger
//! than everything, as torch's `topk` takes it. `key` / `from_key` are the crate's one
//! float order (the `nucleus` kernel sorts by them too).

/// A `u32` whose unsigned order is the float order of `x`, NaN above `+inf` (either sign).
pub(crate) fn key(x: f32) -> u32 {
    let bits = x.to_bits();
    let ordered = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
    // A select on the bits, not `is_nan()`'s branch (which made the scan ~6x slower).
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        u32::MAX
    } else {
        ordered
    }
}

use crate::vector::{scan_above, Ahead, Scalar, Vector};

/// The float whose [`key`] is `k` (NaN for `u32::MAX`).
pub(crate) fn from_key(k: u32) -> f32 {
    f32::from_bits(if k >> 31 == 1 { k & 0x7fff_ffff } else { !k })
}

/// Writes the `values.len()` = n largest logits of `row`, descending, into `values` and their
/// columns into `indices` (the values exactly `topk(n)`'s; equal values in any column order).
/// `buffer` is scratch, reused across rows; `ahead` asks for other memory as the row is read
/// (the next row of a batch; [`Ahead::none`] for none). The caller checks
/// `n <= row.len() < 2^32` and `indices.len() == n`.
pub fn largest(row: &[f32], values: &mut [f32], indices: &mut [i64], buffer: &mut Vec<u64>, ahead: &mut Ahead) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { largest_avx2(row, values, indices, buffer, ahead) };
    }
    largest_with::<Scalar>(row, values, indices, buffer, ahead)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn largest_avx2(row: &[f32], values: &mut [f32], indices: &mut [i64], buffer: &mut Vec<u64>, ahead: &mut Ahead) {
    largest_with::<crate::vector::Avx2>(row, values, indices, buffer, ahead)
}

/// [`largest`] with the scan's compares done by `V` (`V`'s features compiled in and present).
#[inline(always)]
fn largest_with<V: Vector>(row: &[f32], values: &mut [f32], indices: &mut [i64], buffer: &mut Vec<u64>, ahead: &mut Ahead) {
    let n = values.len();
    assert!(n <= row.len() && indices.len() == n && row.len() < (1 << 32), "candidates: {n} of a {}-token row", row.len());
    if n == 0 {
        return;
    }
    let capacity = 2 * n.max(16);
    buffer.clear();
    let entry = |column: usize, k: u32| (u64::from(k) << 32) | column as u64;
    buffer.extend(row[..n].iter().enumerate().map(|(column, &x)| entry(column, key(x))));
    let mut threshold = buffer.iter().map(|e| (e >> 32) as u32).min().unwrap_or(0);
    // The scan passes every logit above the threshold's float and NaN; one whose key is above
    // the threshold is taken (-0.0 and 0.0 compare equal; their keys differ).
    scan_above::<V>(&row[n..], n, from_key(threshold), ahead, |column, x| {
        let k = key(x);
        if k > threshold {
            buffer.push(entry(column, k));
            if buffer.len() == capacity {
                threshold = keep_largest(buffer, n);
            }
        }
        Some(from_key(threshold))
    });
    if buffer.len() > n {
        keep_largest(buffer, n);
    }
    buffer.sort_unstable_by(|a, b| b.cmp(a));
    for ((value, index), &e) in values.iter_mut().zip(indices.iter_mut()).zip(buffer.iter()) {
        let column = (e & 0xffff_ffff) as usize;
        *value = row[column];
        *index = column as i64;
    }
}

/// Cuts `buffer` (more than n entries) to its n largest keys; returns the n-th largest key.
fn keep_largest(buffer: &mut Vec<u64>, n: usize) -> u32 {
    buffer.select_nth_unstable_by(n - 1, |a, b| b.cmp(a));
    buffer.truncate(n);
    (buffer[n - 1] >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn by_sort(row: &[f32], n: usize) -> Vec<f32> {
        let mut sorted = row.to_vec();
        sorted.sort_by_key(|x| std::cmp::Reverse(key(*x)));
        sorted.truncate(n);
        sorted
    }

    #[test]
    fn the_largest_values_descending_with_their_columns() {
        let mut state = 7u64;
        let mut buffer = Vec::new();
        for (len, n) in [(100, 1), (5000, 64), (5000, 256), (40000, 128), (300, 300)] {
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 40) % 512) as f32 * 0.25 - 60.0 // many ties
                })
                .collect();
            let (mut values, mut indices) = (vec![0.0; n], vec![0i64; n]);
            let (mut scalar_values, mut scalar_indices) = (vec![0.0; n], vec![0i64; n]);
            largest_with::<Scalar>(&row, &mut scalar_values, &mut scalar_indices, &mut buffer, &mut Ahead::none());
            largest(&row, &mut values, &mut indices, &mut buffer, &mut Ahead::none());
            assert_eq!(values, by_sort(&row, n), "len {len} n {n}");
            assert_eq!(scalar_values, values, "len {len} n {n}: the portable path");
            let mut seen = indices.clone();
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), n, "a column twice");
            for (&v, &i) in values.iter().zip(&indices) {
                assert_eq!(row[i as usize].to_bits(), v.to_bits());
            }
        }
    }

    #[test]
    fn ascending_rows_infinities_and_nan() {
        // An ascending row raises the threshold at every refill; -inf is lowest, NaN highest.
        let mut row: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        row[5] = f32::NEG_INFINITY;
        row[9] = f32::INFINITY;
        row[11] = f32::NAN;
        let (mut values, mut indices) = (vec![0.0; 3], vec![0i64; 3]);
        largest(&row, &mut values, &mut indices, &mut Vec::new(), &mut Ahead::none());
        assert!(values[0].is_nan() && values[1] == f32::INFINITY && values[2] == 2999.0);
        assert_eq!(indices, [11, 9, 2999]);
        // A NaN inside a masked block, past the first n, and in the unmasked tail (columns
        // 2996.. for n = 4, 2988.. for n = 12: blocks of 16 from n).
        row[100] = f32::NAN;
        row[2998] = f32::NAN;
        for n in [4, 12] {
            let (mut values, mut indices) = (vec![0.0; n], vec![0i64; n]);
            largest(&row, &mut values, &mut indices, &mut Vec::new(), &mut Ahead::none());
            let mut nan_columns: Vec<i64> = indices[..3].to_vec();
            nan_columns.sort();
            assert_eq!(nan_columns, [11, 100, 2998], "n {n}");
            assert!(values[..3].iter().all(|v| v.is_nan()) && values[3] == f32::INFINITY, "n {n}");
        }
    }
}
