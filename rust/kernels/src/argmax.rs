//! `argmax`: a row's greedy token, the first column of its largest logit (torch's `argmax`).
//!
//! torch's CPU `argmax` of float32 tracks an index with every compare and is not vectorised:
//! ~35 µs a 32,000-token row, about seven times a vectorised max over the same row, so at 64
//! decode rows 1.7-2.4 ms of a step. Here one scan compares 16 logits at a time with the
//! running maximum ([`Vector::above_mask16`]); only a block holding a larger logit or a NaN is
//! looked at one by one, and on LLM-like or random logits the maximum settles early.
//!
//! The answer is torch's, column for column: the first column of the largest value (a later
//! equal value, `-0.0` and `0.0` included, does not replace it), a NaN counting as larger than
//! everything (the first NaN's column), and 0 for a row of `-inf`.

use crate::vector::{scan_above, Ahead, Scalar, Vector};

/// The column of the first largest logit of `row`, a NaN the largest (module doc); 0 when
/// `row` is empty. `ahead` asks for other memory as the row is read (the next row of a batch;
/// [`Ahead::none`] for none).
pub fn argmax(row: &[f32], ahead: &mut Ahead) -> usize {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::vectorised() {
        // SAFETY: the CPU has AVX2 + FMA.
        return unsafe { argmax_avx2(row, ahead) };
    }
    argmax_with::<Scalar>(row, ahead)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn argmax_avx2(row: &[f32], ahead: &mut Ahead) -> usize {
    argmax_with::<crate::vector::Avx2>(row, ahead)
}

/// [`argmax`] with the block compares done by `V` (`V`'s features compiled in and present).
#[inline(always)]
fn argmax_with<V: Vector>(row: &[f32], ahead: &mut Ahead) -> usize {
    // The scan passes only a logit above the largest so far (an equal one stays behind the
    // first) or a NaN, which wins and ends it.
    let mut best_column = 0;
    scan_above::<V>(row, 0, f32::NEG_INFINITY, ahead, |column, x| {
        best_column = column;
        (!x.is_nan()).then_some(x)
    });
    best_column
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch's rule, one logit at a time.
    fn first_largest(row: &[f32]) -> usize {
        if let Some(nan) = row.iter().position(|x| x.is_nan()) {
            return nan;
        }
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best
    }

    #[test]
    fn the_first_largest_column_nan_first() {
        let mut state = 11u64;
        let mut rows: Vec<Vec<f32>> = [1usize, 15, 16, 17, 100, 5000]
            .iter()
            .map(|&len| {
                (0..len)
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((state >> 40) % 64) as f32 * 0.5 - 16.0 // many ties of the largest
                    })
                    .collect()
            })
            .collect();
        let ascending: Vec<f32> = (0..300).map(|i| i as f32).collect();
        rows.push(ascending.clone()); // a new maximum in every block
        rows.push(vec![f32::NEG_INFINITY; 40]);
        rows.push(vec![-0.0, 0.0, -0.0, 0.0]); // equal: the first
        let mut with_nan = ascending.clone();
        with_nan[37] = f32::NAN;
        with_nan[200] = f32::NAN;
        rows.push(with_nan);
        let mut nan_in_tail = ascending.clone();
        nan_in_tail[298] = f32::NAN;
        rows.push(nan_in_tail);
        let mut with_inf = ascending;
        with_inf[5] = f32::INFINITY;
        with_inf[250] = f32::INFINITY;
        rows.push(with_inf);
        for row in &rows {
            let want = first_largest(row);
            assert_eq!(argmax(row, &mut Ahead::none()), want, "a row of {}", row.len());
            assert_eq!(argmax_with::<Scalar>(row, &mut Ahead::none()), want, "a row of {}: the portable path", row.len());
        }
        assert_eq!(argmax(&[], &mut Ahead::none()), 0);
    }
}
