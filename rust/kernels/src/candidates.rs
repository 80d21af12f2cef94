//! `candidates`: a row's n largest logits and their columns, in one read of the row.
//!
//! The torch sampler's candidate search (`resin/sampling_candidates.py`): the values must be
//! exactly `topk(n)`'s, descending (equal values may come from other columns). torch's `topk`
//! costs ~10 ns a value over the row, and the torch tree of block maxima that replaced it costs
//! a max pass plus a `topk` of a few hundred values per level and row. Here one scan keeps
//! every logit above a running threshold in a buffer of 2n; when it fills, the buffer is cut
//! to its n largest and the threshold rises to the n-th. A logit equal to the threshold is not
//! needed (n logits at least as large are held), so the kept values are the n largest exactly.
//!
//! The threshold starts high: on a row of 32 n or more, at the 4th largest of a sample of
//! ~len / n logits ([`sampled_threshold`]), which ~4n of the row pass; a row where fewer than
//! n pass it (~2% of random rows) is scanned again from its first n. Started from the first
//! n, a row in random order has n (1 + ln(len / n)) logits pass at the least (~460 for
//! n = 64 of 32,000), more with the threshold raised only at each cut. The
//! scan compares 16 at a time; on AVX-512F the passing logits and their columns are packed
//! into a staging area without a branch ([`packed`]), elsewhere the set bits of a block's mask
//! are looked at one by one ([`Vector::above_mask16`]). On rows of 32,000 N(0, 2) logits with
//! 8 lifted, not in the cache (`examples/candidate_search.rs`, an AVX-512 Xeon): n = 64
//! 15.2 -> 8.2 µs a row, n = 128 21.0 -> 9.2, n = 256 29.8 -> 11.5; the greedy pick 4.8.
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
        // SAFETY: the CPU has AVX2 + FMA (and AVX-512F where the scan asks).
        return unsafe { largest_avx2(row, values, indices, buffer, ahead, crate::vector::avx512()) };
    }
    largest_with::<Scalar>(row, values, indices, buffer, ahead, false)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn largest_avx2(
    row: &[f32],
    values: &mut [f32],
    indices: &mut [i64],
    buffer: &mut Vec<u64>,
    ahead: &mut Ahead,
    packed: bool,
) {
    largest_with::<crate::vector::Avx2>(row, values, indices, buffer, ahead, packed)
}

/// A row this many times n long or more starts from a sampled threshold.
const SAMPLED_FROM: usize = 32;

/// [`largest`] with the scan's compares done by `V` (`V`'s features compiled in and present),
/// or by the AVX-512 packed scan when `packed` (the CPU has AVX-512F).
#[inline(always)]
fn largest_with<V: Vector>(
    row: &[f32],
    values: &mut [f32],
    indices: &mut [i64],
    buffer: &mut Vec<u64>,
    ahead: &mut Ahead,
    packed: bool,
) {
    let n = values.len();
    assert!(n <= row.len() && indices.len() == n && row.len() < (1 << 32), "candidates: {n} of a {}-token row", row.len());
    if n == 0 {
        return;
    }
    let capacity = 2 * n.max(16);
    let mut scan = |start: usize, threshold: u32, buffer: &mut Vec<u64>| {
        #[cfg(target_arch = "x86_64")]
        if packed {
            // SAFETY: the caller saw AVX-512F.
            return unsafe { packed::scan(&row[start..], start, threshold, buffer, n, capacity, ahead) };
        }
        let _ = packed;
        scan_branching::<V>(&row[start..], start, threshold, buffer, n, capacity, ahead);
    };
    buffer.clear();
    if row.len() >= SAMPLED_FROM * n {
        scan(0, sampled_threshold(row, n), buffer);
        if buffer.len() >= n {
            return finish(row, values, indices, buffer);
        }
        buffer.clear(); // fewer than n above the sample's threshold: from the row's first n
    }
    buffer.extend(row[..n].iter().enumerate().map(|(column, &x)| entry(column, key(x))));
    let threshold = buffer.iter().map(|e| (e >> 32) as u32).min().unwrap_or(0);
    scan(n, threshold, buffer);
    finish(row, values, indices, buffer);
}

/// A buffer entry: the key above the column, so entries order as their logits.
#[inline(always)]
fn entry(column: usize, k: u32) -> u64 {
    (u64::from(k) << 32) | column as u64
}

/// A key that n logits of `row` pass with high probability, well above most: the 4th largest
/// of ~len / n of its logits, blocks of 16 spread evenly over the row (one cache line each,
/// not a line a logit). On a row in no particular order ~4n of its logits are above it, and
/// fewer than n about 2% of the time: then the caller starts over from the row's first n.
fn sampled_threshold(row: &[f32], n: usize) -> u32 {
    let num_blocks = (row.len() / (16 * n)).max(1);
    let spacing = row.len() / num_blocks / 16 * 16;
    // All the blocks asked for at once: their reads, each a cache miss on a row not in the
    // cache, overlap (the loop below would take them one after another).
    for b in 0..num_blocks {
        Ahead::new(row[b * spacing..].as_ptr() as *const u8, 64).step(128); // one or two lines
    }
    let mut top = [0u32; 4];
    let mut lowest = 0; // where `top`'s smallest is
    for b in 0..num_blocks {
        for &x in &row[b * spacing..(b * spacing + 16).min(row.len())] {
            let k = key(x);
            if k > top[lowest] {
                top[lowest] = k;
                lowest = (0..4).min_by_key(|&i| top[i]).unwrap_or(0);
            }
        }
    }
    top[lowest]
}

/// Pushes an entry for every logit of `row` (column `start + i`) whose key is above the
/// running threshold (`threshold` at first), cutting `buffer` to its n largest, and raising
/// the threshold to the n-th, whenever it reaches `capacity` ([`scan_above`]: a compare of 16
/// at a time, the set bits of a block's mask one by one).
#[inline(always)]
fn scan_branching<V: Vector>(
    row: &[f32],
    start: usize,
    mut threshold: u32,
    buffer: &mut Vec<u64>,
    n: usize,
    capacity: usize,
    ahead: &mut Ahead,
) {
    // The scan passes every logit above the threshold's float and NaN; one whose key is above
    // the threshold is taken (-0.0 and 0.0 compare equal; their keys differ).
    scan_above::<V>(row, start, from_key(threshold), ahead, |column, x| {
        let k = key(x);
        if k > threshold {
            buffer.push(entry(column, k));
            if buffer.len() >= capacity {
                threshold = keep_largest(buffer, n);
            }
        }
        Some(from_key(threshold))
    });
}

/// The n largest entries of `buffer` (at least n), descending, as values and columns.
fn finish(row: &[f32], values: &mut [f32], indices: &mut [i64], buffer: &mut Vec<u64>) {
    let n = values.len();
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

/// The scan on AVX-512F without a branch a logit: each block of 16 writes the logits above
/// the threshold, and their columns, packed to the end of a staging area (`vcompressps` /
/// `vpcompressd` in registers, then a whole store), whatever their number; when the area
/// is nearly full its entries go to the buffer (and the buffer is cut, the threshold raised).
/// The branching scan mispredicts at every block holding a passing logit, ~4n of them a row.
#[cfg(target_arch = "x86_64")]
mod packed {
    use super::{entry, from_key, keep_largest, key};
    use crate::vector::Ahead;
    use std::arch::x86_64::*;

    /// Logits held before they go to the buffer (a block more may be written past them).
    const STAGE: usize = 256;

    /// [`super::scan_branching`]'s result (module doc).
    #[target_feature(enable = "avx512f,popcnt")]
    pub(super) unsafe fn scan(
        row: &[f32],
        start: usize,
        mut threshold: u32,
        buffer: &mut Vec<u64>,
        n: usize,
        capacity: usize,
        ahead: &mut Ahead,
    ) {
        let mut values = [0.0f32; STAGE + 16];
        let mut columns = [0u32; STAGE + 16];
        let mut held = 0; // in a register: the next block's stores are addressed by it
        let mut below = _mm512_set1_ps(from_key(threshold));
        let mut column = _mm512_add_epi32(
            _mm512_set1_epi32(start as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let sixteen = _mm512_set1_epi32(16);
        // Packs the `lanes` of `x` above `below` (or NaN) after the `held` ones, with their
        // columns; returns how many. Not-less-or-equal, unordered: NaN passes, as the branching
        // scan's `!(x <= below)`.
        let take = |x: __m512,
                    lanes: __mmask16,
                    below: __m512,
                    column: __m512i,
                    held: usize,
                    values: &mut [f32; STAGE + 16],
                    columns: &mut [u32; STAGE + 16]| {
            let pass = _mm512_mask_cmp_ps_mask::<_CMP_NLE_UQ>(lanes, x, below);
            _mm512_storeu_ps(values.as_mut_ptr().add(held), _mm512_maskz_compress_ps(pass, x));
            _mm512_storeu_si512(columns.as_mut_ptr().add(held) as *mut _, _mm512_maskz_compress_epi32(pass, column));
            pass.count_ones() as usize
        };
        let blocks = row.chunks_exact(16);
        let tail = blocks.remainder();
        for block in blocks {
            ahead.step(64);
            held += take(_mm512_loadu_ps(block.as_ptr()), 0xffff, below, column, held, &mut values, &mut columns);
            column = _mm512_add_epi32(column, sixteen);
            if held > STAGE - 16 {
                if flush(&values[..held], &columns[..held], &mut threshold, buffer, n, capacity) {
                    below = _mm512_set1_ps(from_key(threshold));
                }
                held = 0;
            }
        }
        let lanes = ((1u32 << tail.len()) - 1) as __mmask16;
        held += take(_mm512_maskz_loadu_ps(lanes, tail.as_ptr()), lanes, below, column, held, &mut values, &mut columns);
        flush(&values[..held], &columns[..held], &mut threshold, buffer, n, capacity);
    }

    /// Moves the held logits whose key is above `threshold` to the buffer, and cuts it
    /// (raising the threshold: true) if it reached `capacity`.
    #[inline(always)]
    fn flush(values: &[f32], columns: &[u32], threshold: &mut u32, buffer: &mut Vec<u64>, n: usize, capacity: usize) -> bool {
        let t = *threshold;
        buffer.extend(
            values.iter().zip(columns).map(|(&x, &c)| (key(x), c)).filter(|&(k, _)| k > t).map(|(k, c)| entry(c as usize, k)),
        );
        if buffer.len() < capacity {
            return false;
        }
        *threshold = keep_largest(buffer, n);
        true
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

    /// One path's search: values, columns, buffer.
    type Search<'a> = &'a dyn Fn(&mut [f32], &mut [i64], &mut Vec<u64>);

    /// Each path's values and columns on this CPU: the portable one, and the AVX2 branching
    /// and AVX-512 packed scans where present.
    fn each_path(row: &[f32], n: usize) -> Vec<(&'static str, Vec<f32>, Vec<i64>)> {
        let mut out = Vec::new();
        let mut run = |name, path: Search| {
            let (mut values, mut indices, mut buffer) = (vec![0.0; n], vec![0i64; n], Vec::new());
            path(&mut values, &mut indices, &mut buffer);
            out.push((name, values, indices));
        };
        run("portable", &|v, i, b| largest_with::<Scalar>(row, v, i, b, &mut Ahead::none(), false));
        #[cfg(target_arch = "x86_64")]
        if crate::vector::vectorised() {
            // SAFETY: checked just above.
            run("branching", &|v, i, b| unsafe { largest_avx2(row, v, i, b, &mut Ahead::none(), false) });
            if crate::vector::avx512() {
                run("packed", &|v, i, b| unsafe { largest_avx2(row, v, i, b, &mut Ahead::none(), true) });
            }
        }
        run("dispatched", &|v, i, b| largest(row, v, i, b, &mut Ahead::none()));
        out
    }

    fn check(row: &[f32], n: usize, label: &str) {
        let expected = by_sort(row, n);
        for (path, values, indices) in each_path(row, n) {
            assert_eq!(values, expected, "{label}: the {path} path");
            let mut seen = indices.clone();
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), n, "{label}: the {path} path took a column twice");
            for (&v, &i) in values.iter().zip(&indices) {
                assert_eq!(row[i as usize].to_bits(), v.to_bits(), "{label}: the {path} path");
            }
        }
    }

    #[test]
    fn the_largest_values_descending_with_their_columns() {
        let mut state = 7u64;
        for (len, n) in [(100, 1), (5000, 64), (5000, 256), (40000, 128), (300, 300), (2047, 64), (32017, 64)] {
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 40) % 512) as f32 * 0.25 - 60.0 // many ties
                })
                .collect();
            check(&row, n, &format!("len {len} n {n}"));
        }
    }

    #[test]
    fn a_sample_that_holds_the_largest_logits_falls_back_to_the_first_n() {
        // The first block of 16 is always sampled. Holding the row's 16 largest, its 4th
        // largest has 3 above it; then the sample's four largest 90..93 and n - 4 larger values
        // outside it: n - 1 above.
        for n in [4, 64] {
            let mut row: Vec<f32> = (0..40 * n).map(|i| (i % 7) as f32).collect();
            for (j, x) in row[..16].iter_mut().enumerate() {
                *x = 100.0 + j as f32;
            }
            assert!(sampled_threshold(&row, n) == key(112.0));
            check(&row, n, &format!("n {n}, a sample of the largest"));
            let mut row: Vec<f32> = vec![0.0; 40 * n];
            for (j, x) in row[..4].iter_mut().enumerate() {
                *x = 90.0 + j as f32;
            }
            for j in 0..n - 4 {
                row[16 + j] = 100.0 + j as f32;
            }
            assert!(sampled_threshold(&row, n) == key(90.0));
            check(&row, n, &format!("n {n}, n - 1 above the sample"));
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
