//! Attention of a step's queries over the paged KV cache, reading K and V in place.
//!
//! The torch backend's batched path gathers every row's pages into a padded batch before
//! `scaled_dot_product_attention`: on a decode step that copy is as large as the attention's
//! own reads. This kernel walks each row's pages through the plan's CSR page table instead
//! (docs/batch_plan.md): row `s` lists pages `kv_indices[kv_indptr[s]..kv_indptr[s + 1]]`,
//! listed key `j` lives in page `j / E`, entry `j % E` (`E` entries per page), and is the row's
//! entry `first_page * E + j` with `first_page = ceil(units / E) - num_listed` (a sliding-window
//! group lists only the pages intersecting the window). `units` is the row's tokens, or its
//! closed entries `seq_len / ratio` in a compressed group, whose entry `e` has key position
//! `(e + 1) * ratio - 1`. A query at position `p` sees the written keys at positions `<= p`
//! (and `> p - window`); keys past the row's end are never read.
//!
//! Per (row, KV head) work item: the row's key and value row pointers listed once (and the next
//! item's first keys asked for: `AHEAD_KEYS`), then for each of the row's queries and each
//! query head sharing the KV head (the item's keys stay in L1/L2 across them), the scores four
//! keys at a time, for two of the heads sharing a KV head at a time (each key element widened
//! once for both; the keys `AHEAD_KEYS` on and these four's values asked for), a softmax in
//! f32 in place with an optional logit softcap (`tanh(s / c) * c`) and per-head sink logit (it
//! joins the softmax and is dropped after it), then the values' weighted sum, four value rows
//! at a time into two heads at a time. Items are split over `threads` by cost (queries times
//! keys), run on torch's OpenMP team when the process has one ([`crate::openmp_team`]), else
//! on scoped threads. Queries, scores and outputs are f32; the cache is f32 or bfloat16 ([`crate::vector::Bf16`], widened to f32 exactly as
//! each row loads). Written once over [`crate::vector::Vector`]: AVX2 + FMA (and a vectorised
//! `exp`) when the CPU has them.

use std::fmt;

#[cfg(target_arch = "x86_64")]
use crate::vector::Avx2;
use crate::vector::{Ahead, Bf16, Element, Scalar, Vector};

/// One layer's attention over one cache group, for one step (module doc). Plan arrays are the
/// `BatchPlan`'s; `positions` are the step's token positions.
pub struct PagedAttention<'a> {
    pub query_indptr: &'a [u32],
    pub seq_lens: &'a [u32],
    pub kv_indptr: &'a [u32],
    pub kv_indices: &'a [u32],
    pub positions: &'a [i64],
    /// Entries per page (`page_size` for a token group).
    pub page_entries: usize,
    /// Sliding window in tokens, or `None`.
    pub window: Option<i64>,
    /// Source tokens per entry: 1 for a token group.
    pub ratio: i64,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Channels of a value (the first `value_dim` of the value rows).
    pub value_dim: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    /// One logit per query head, or `None`.
    pub sinks: Option<&'a [f32]>,
    /// Round as a bfloat16 model's eager attention does (HF: `q @ k.T` rounded, times the scale
    /// rounded, softmax in f32, the probabilities rounded before `@ v`), so a bfloat16 runner
    /// departs from HF's greedy tokens no more than its SDPA path did; false: f32 throughout.
    pub bf16_rounding: bool,
}

/// How many keys past the four it scores the kernel asks for (and the next item's first as many):
/// a key row is a few cache lines at a large stride, which the hardware prefetcher does not
/// follow across pages, so a cold cache was read at a third of the rate of a warm one.
const AHEAD_KEYS: usize = 16;

/// `x` rounded to the nearest bfloat16, as an f32.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    Bf16::round(x).to_f32()
}

/// Where the arrays live: base pointers and element strides (the innermost stride is 1).
/// `q` is `[num_tokens, num_heads, head_dim]`, `k` and `v` are `[num_pages, page_entries,
/// num_kv_heads, dim]` (`v` may alias `k`) of `E` (f32 or bf16), `out` is `[num_tokens,
/// num_heads, value_dim]`.
#[derive(Clone, Copy)]
pub struct Buffers<E: Element = f32> {
    pub q: *const f32,
    pub q_strides: [isize; 2],
    pub k: *const E,
    pub k_strides: [isize; 3],
    pub v: *const E,
    pub v_strides: [isize; 3],
    pub out: *mut f32,
    pub out_strides: [isize; 2],
    pub num_tokens: usize,
    pub num_pages: usize,
}

// The pointers are only dereferenced inside `PagedAttention::run`'s scoped threads, which write
// disjoint output rows (one work item per row and KV head).
#[cfg(test)]
impl<E: Element> Buffers<E> {
    /// The same buffers with K / V pointers of another element type (the caller then sets them).
    fn cast<F: Element>(self) -> Buffers<F> {
        Buffers {
            q: self.q,
            q_strides: self.q_strides,
            k: std::ptr::null(),
            k_strides: self.k_strides,
            v: std::ptr::null(),
            v_strides: self.v_strides,
            out: self.out,
            out_strides: self.out_strides,
            num_tokens: self.num_tokens,
            num_pages: self.num_pages,
        }
    }
}

unsafe impl<E: Element> Send for Buffers<E> {}
unsafe impl<E: Element> Sync for Buffers<E> {}

/// A plan or shape the kernel refuses, before touching memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidArgument(pub String);

impl fmt::Display for InvalidArgument {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidArgument {}

fn invalid<T>(message: String) -> Result<T, InvalidArgument> {
    Err(InvalidArgument(message))
}

/// One unit of work: a row's queries for the KV heads `kv_heads.0..kv_heads.1`.
#[derive(Clone, Copy)]
struct Item {
    row: usize,
    kv_heads: (usize, usize),
}

/// A row's geometry in the group.
#[derive(Clone, Copy)]
struct Row {
    queries: (usize, usize),
    pages: (usize, usize),
    /// Entry index of listed key 0.
    first_entry: i64,
    /// Written keys among the listed ones.
    num_keys: usize,
}

impl PagedAttention<'_> {
    fn num_rows(&self) -> usize {
        self.seq_lens.len()
    }

    fn row(&self, s: usize) -> Row {
        let listed = (self.kv_indptr[s + 1] - self.kv_indptr[s]) as i64;
        let e = self.page_entries as i64;
        let seq_len = self.seq_lens[s] as i64;
        let units = if self.ratio > 1 { seq_len / self.ratio } else { seq_len };
        let first_page = (units + e - 1) / e - listed;
        let num_keys = (units - first_page * e).clamp(0, listed * e) as usize;
        Row {
            queries: (self.query_indptr[s] as usize, self.query_indptr[s + 1] as usize),
            pages: (self.kv_indptr[s] as usize, self.kv_indptr[s + 1] as usize),
            first_entry: first_page * e,
            num_keys,
        }
    }

    /// Checks every index the kernel will follow (the arrays' own extents are the caller's).
    pub fn check<E: Element>(&self, b: &Buffers<E>) -> Result<(), InvalidArgument> {
        let s = self.num_rows();
        if self.query_indptr.len() != s + 1 || self.kv_indptr.len() != s + 1 {
            return invalid(format!(
                "{s} rows need query_indptr and kv_indptr of length {}, got {} and {}",
                s + 1,
                self.query_indptr.len(),
                self.kv_indptr.len()
            ));
        }
        if self.page_entries == 0 || self.ratio < 1 {
            return invalid(format!("page_entries must be >= 1 and ratio >= 1, got {} and {}", self.page_entries, self.ratio));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return invalid(format!("{} query heads do not share {} KV heads evenly", self.num_heads, self.num_kv_heads));
        }
        if let Some(sinks) = self.sinks {
            if sinks.len() != self.num_heads {
                return invalid(format!("{} sinks for {} heads", sinks.len(), self.num_heads));
            }
        }
        if self.positions.len() < b.num_tokens {
            return invalid(format!("{} positions for {} tokens", self.positions.len(), b.num_tokens));
        }
        for w in self.query_indptr.windows(2).chain(self.kv_indptr.windows(2)) {
            if w[1] < w[0] {
                return invalid("query_indptr and kv_indptr must not decrease".into());
            }
        }
        if self.query_indptr[s] as usize > b.num_tokens {
            return invalid(format!("query_indptr ends at {} past {} tokens", self.query_indptr[s], b.num_tokens));
        }
        if self.kv_indptr[s] as usize > self.kv_indices.len() {
            return invalid(format!("kv_indptr ends at {} past {} kv_indices", self.kv_indptr[s], self.kv_indices.len()));
        }
        if let Some(&page) = self.kv_indices.iter().find(|&&p| p as usize >= b.num_pages) {
            return invalid(format!("kv_indices holds page {page} of a {}-page cache", b.num_pages));
        }
        for row in 0..s {
            let listed = (self.kv_indptr[row + 1] - self.kv_indptr[row]) as i64;
            let r = self.row(row);
            if r.first_entry < 0 {
                return invalid(format!(
                    "row {row} lists {listed} pages, more than its {} entries fill",
                    self.seq_lens[row] as i64 / self.ratio.max(1)
                ));
            }
        }
        Ok(())
    }

    /// Checks the plan (see [`check`](Self::check)), then writes `out` for every query of the
    /// step.
    ///
    /// # Safety
    /// Every pointer in `b` must address an array of the documented shape with the given
    /// strides, live and unaliased by `out` for the call.
    pub unsafe fn run<E: Element>(&self, b: &Buffers<E>, threads: usize) -> Result<(), InvalidArgument> {
        self.check(b)?;
        let rows: Vec<Row> = (0..self.num_rows()).map(|s| self.row(s)).collect();
        let items = self.work_items(&rows, threads);
        let cost = |item: &Item| {
            let r = &rows[item.row];
            ((r.queries.1 - r.queries.0) * (r.num_keys + 1) * (item.kv_heads.1 - item.kv_heads.0)) as u64
        };
        let total: u64 = items.iter().map(cost).sum();
        let threads = threads.clamp(1, items.len().max(1));
        // Below this much work a parallel region costs more than it saves: starting scoped
        // threads takes tens of microseconds, waking a spinning OpenMP team a few.
        let min_parallel_cost = if crate::openmp_team::available() { 512 } else { 4096 };
        if threads == 1 || total < min_parallel_cost {
            self.run_items(b, &rows, &items);
            return Ok(());
        }
        // Contiguous chunks of about equal cost.
        let mut chunks: Vec<&[Item]> = Vec::with_capacity(threads);
        let (mut start, mut acc) = (0, 0u64);
        for (i, item) in items.iter().enumerate() {
            acc += cost(item);
            if acc * threads as u64 >= total * (chunks.len() as u64 + 1) && chunks.len() + 1 < threads {
                chunks.push(&items[start..=i]);
                start = i + 1;
            }
        }
        chunks.push(&items[start..]);
        // On torch's OpenMP team when there is one (crate::openmp_team: its workers spin
        // between ops, and threads of our own would fight them for the cores).
        let rows = &rows;
        let chunks = &chunks;
        let ok = crate::openmp_team::run_parallel(threads, &|index, size| {
            for chunk in chunks.iter().skip(index).step_by(size) {
                self.run_items(b, rows, chunk);
            }
        });
        if !ok {
            return invalid("paged_attention panicked on an OpenMP thread".into());
        }
        Ok(())
    }

    /// One item per row (all its KV heads: each key row is read whole, in page order), or, with
    /// fewer than two rows per thread, each row's KV heads split into as many parts as spread
    /// the work over `threads`.
    fn work_items(&self, rows: &[Row], threads: usize) -> Vec<Item> {
        let heads = self.num_kv_heads;
        let parts = if rows.len() >= 2 * threads { 1 } else { (2 * threads).div_ceil(rows.len().max(1)).min(heads) };
        let step = heads.div_ceil(parts.max(1));
        (0..rows.len())
            .flat_map(|row| (0..heads).step_by(step).map(move |g| Item { row, kv_heads: (g, (g + step).min(heads)) }))
            .collect()
    }

    fn run_items<E: Element>(&self, b: &Buffers<E>, rows: &[Row], items: &[Item]) {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::vector::vectorised() {
                // SAFETY: the CPU has the features; the caller upholds `run`'s contract.
                unsafe { self.items_avx2(b, rows, items) };
                return;
            }
        }
        // SAFETY: `run`'s contract.
        unsafe { self.items::<Scalar, E>(b, rows, items) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn items_avx2<E: Element>(&self, b: &Buffers<E>, rows: &[Row], items: &[Item]) {
        self.items::<Avx2, E>(b, rows, items)
    }

    /// The portable path whatever the CPU (tests: both paths agree with the naive reference).
    #[cfg(test)]
    unsafe fn run_scalar<E: Element>(&self, b: &Buffers<E>) -> Result<(), InvalidArgument> {
        self.check(b)?;
        let rows: Vec<Row> = (0..self.num_rows()).map(|s| self.row(s)).collect();
        self.items::<Scalar, E>(b, &rows, &self.work_items(&rows, 1));
        Ok(())
    }

    /// Every query of the work items (module doc). Per item the row's key and value entry
    /// pointers are listed once (page by page: no division per key); per query, the scores of
    /// every head of the item four keys at a time (each group of four key rows read across
    /// all the item's heads while it is in cache), each head's softmax in place, then the value
    /// rows four at a time into the heads' accumulators, in the same order.
    #[inline(always)]
    unsafe fn items<V: Vector, E: Element>(&self, b: &Buffers<E>, rows: &[Row], items: &[Item]) {
        let repeat = self.num_heads / self.num_kv_heads;
        let (d, dv, e) = (self.head_dim, self.value_dim, self.page_entries);
        let mut scores: Vec<f32> = Vec::new();
        let mut acc: Vec<f32> = Vec::new();
        let mut keys: Vec<*const E> = Vec::new();
        let mut values: Vec<*const E> = Vec::new();
        let mut sums: Vec<f32> = Vec::new(); // each head's softmax normaliser
        let element = std::mem::size_of::<E>();
        for (index, item) in items.iter().enumerate() {
            let row = rows[item.row];
            let (g0, g1) = item.kv_heads;
            // Asks for KV heads `heads` of the key or value entry at `p` (their `dim` channels
            // each; a negative head stride puts the last head lowest). Addresses only
            // (`wrapping_offset`): nothing is read.
            let ask = |p: *const E, heads: (usize, usize), strides: &[isize; 3], dim: usize| {
                let first = p.wrapping_offset(heads.0 as isize * strides[2]);
                let across = (heads.1 - heads.0 - 1) as isize * strides[2]; // first to last head
                let low = if across < 0 { first.wrapping_offset(across) } else { first };
                let bytes = (across.unsigned_abs() + dim) * element;
                Ahead::new(low as *const u8, bytes).step(bytes);
            };
            let heads = (g1 - g0) * repeat; // the item's query heads: g0 * repeat ..
            let pages = &self.kv_indices[row.pages.0..row.pages.1];
            let list = |out: &mut Vec<*const E>, base: *const E, strides: &[isize; 3]| {
                out.clear();
                for (p, &page) in pages.iter().enumerate() {
                    let first = base.offset(page as isize * strides[0]);
                    let count = e.min(row.num_keys.saturating_sub(p * e));
                    out.extend((0..count).map(|entry| first.offset(entry as isize * strides[1])));
                }
            };
            list(&mut keys, b.k, &b.k_strides);
            list(&mut values, b.v, &b.v_strides);
            // The next item's first keys, asked for now: this item's work hides their latency.
            if let Some(next) = items.get(index + 1) {
                let next_row = rows[next.row];
                if next_row.pages.1 > next_row.pages.0 && next_row.num_keys > 0 {
                    let page = self.kv_indices[next_row.pages.0] as isize;
                    let first = b.k.wrapping_offset(page * b.k_strides[0]);
                    for entry in 0..AHEAD_KEYS.min(e).min(next_row.num_keys) {
                        ask(first.wrapping_offset(entry as isize * b.k_strides[1]), next.kv_heads, &b.k_strides, d);
                    }
                }
            }
            // Listed keys (values) below these were asked for already.
            let (mut asked_keys, mut asked_values) = (0usize, 0usize);
            for t in row.queries.0..row.queries.1 {
                let (lo, hi) = self.visible(row, self.positions[t]);
                let n = hi - lo;
                let (k, v) = (&keys[lo..hi], &values[lo..hi]);
                let query = |h: usize| b.q.offset(t as isize * b.q_strides[0] + (g0 * repeat + h) as isize * b.q_strides[1]);
                scores.resize(heads * n, 0.0);
                let mut j = 0;
                while j + 4 <= n {
                    // Keys AHEAD_KEYS on, and these keys' values (read after the softmax), each
                    // once an item: a row's later queries find what its first ones asked for.
                    let key_end = lo + (j + 4 + AHEAD_KEYS).min(n);
                    for &key in &keys[asked_keys.max(lo + j + AHEAD_KEYS).min(key_end)..key_end] {
                        ask(key, (g0, g1), &b.k_strides, d);
                    }
                    asked_keys = asked_keys.max(key_end);
                    for &value in &values[asked_values.max(lo + j).min(lo + j + 4)..lo + j + 4] {
                        ask(value, (g0, g1), &b.v_strides, dv);
                    }
                    asked_values = asked_values.max(lo + j + 4);
                    for g in 0..g1 - g0 {
                        let at = |p: *const E| p.offset((g0 + g) as isize * b.k_strides[2]);
                        let four = [at(k[j]), at(k[j + 1]), at(k[j + 2]), at(k[j + 3])];
                        // Query heads sharing the KV head two at a time: each key element
                        // loaded (and widened) once for both.
                        for i in (0..repeat).step_by(2) {
                            let h = g * repeat + i;
                            if i + 1 < repeat {
                                let [a, c] = V::dot4x2([query(h), query(h + 1)], four, d, &mut Ahead::none());
                                scores[h * n + j..h * n + j + 4].copy_from_slice(&a);
                                scores[(h + 1) * n + j..(h + 1) * n + j + 4].copy_from_slice(&c);
                            } else {
                                scores[h * n + j..h * n + j + 4].copy_from_slice(&V::dot4(query(h), four, d, &mut Ahead::none()));
                            }
                        }
                    }
                    j += 4;
                }
                for j in j..n {
                    for h in 0..heads {
                        scores[h * n + j] = V::dot(query(h), k[j].offset((g0 + h / repeat) as isize * b.k_strides[2]), d);
                    }
                }
                sums.clear();
                sums.resize(heads, 0.0);
                for (h, sum) in sums.iter_mut().enumerate() {
                    let x = &mut scores[h * n..(h + 1) * n];
                    if self.bf16_rounding {
                        V::scale_to_bf16(x, 1.0); // q @ k.T, rounded
                        V::scale_to_bf16(x, self.scale);
                        if let Some(c) = self.softcap {
                            let r = round_bf16;
                            for s in x.iter_mut() {
                                *s = r(r(r(*s / c).tanh()) * c);
                            }
                        }
                    } else {
                        for s in x.iter_mut() {
                            *s *= self.scale;
                            if let Some(c) = self.softcap {
                                *s = (*s / c).tanh() * c;
                            }
                        }
                    }
                    let sink = self.sinks.map(|sinks| sinks[g0 * repeat + h]);
                    let max = V::max(x).max(sink.unwrap_or(f32::NEG_INFINITY));
                    *sum = V::exp_sum(x, max) + sink.map_or(0.0, |s| (s - max).exp());
                    if self.bf16_rounding {
                        // The probabilities themselves, rounded; nothing left to divide by.
                        let inverse = 1.0 / *sum; // torch's softmax multiplies by it too
                        V::scale_to_bf16(x, inverse);
                        *sum = 1.0;
                    }
                }
                acc.clear();
                acc.resize(heads * dv, 0.0);
                let mut j = 0;
                while j + 4 <= n {
                    for g in 0..g1 - g0 {
                        let at = |p: *const E| p.offset((g0 + g) as isize * b.v_strides[2]);
                        let four = [at(v[j]), at(v[j + 1]), at(v[j + 2]), at(v[j + 3])];
                        let weights =
                            |h: usize| [scores[h * n + j], scores[h * n + j + 1], scores[h * n + j + 2], scores[h * n + j + 3]];
                        for i in (0..repeat).step_by(2) {
                            let h = g * repeat + i;
                            if i + 1 < repeat {
                                let (first, second) = acc[h * dv..(h + 2) * dv].split_at_mut(dv);
                                V::axpy4x2([weights(h), weights(h + 1)], four, [first, second]);
                            } else {
                                V::axpy4(weights(h), four, &mut acc[h * dv..(h + 1) * dv]);
                            }
                        }
                    }
                    j += 4;
                }
                for j in j..n {
                    for h in 0..heads {
                        let value = v[j].offset((g0 + h / repeat) as isize * b.v_strides[2]);
                        V::axpy(scores[h * n + j], value, &mut acc[h * dv..(h + 1) * dv]);
                    }
                }
                for (h, &sum) in sums.iter().enumerate() {
                    // No visible key and no sink: an empty softmax, NaN as in torch.
                    let norm = if n > 0 || self.sinks.is_some() { 1.0 / sum } else { f32::NAN };
                    let out = b.out.offset(t as isize * b.out_strides[0] + (g0 * repeat + h) as isize * b.out_strides[1]);
                    for (c, &a) in acc[h * dv..(h + 1) * dv].iter().enumerate() {
                        *out.add(c) = a * norm;
                    }
                }
            }
        }
    }

    /// The listed keys `[lo, hi)` a query at `position` sees (module doc): key positions are
    /// increasing in `j`, so the causal and window bounds are a range.
    fn visible(&self, row: Row, position: i64) -> (usize, usize) {
        let r = self.ratio;
        // entry x has key position (x + 1) * r - 1 <= p  <=>  x < floor((p + 1) / r)
        let hi = (position + 1).div_euclid(r) - row.first_entry;
        let hi = hi.clamp(0, row.num_keys as i64);
        let lo = match self.window {
            // (x + 1) * r - 1 > p - w  <=>  x >= floor((p - w + 1) / r)
            Some(w) => ((position - w + 1).div_euclid(r) - row.first_entry).clamp(0, hi),
            None => 0,
        };
        (lo as usize, hi as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A naive reference: every key's position and visibility worked out directly.
    #[allow(clippy::too_many_arguments)]
    fn naive(att: &PagedAttention, q: &[f32], k: &[f32], v: &[f32], num_tokens: usize) -> Vec<f32> {
        let (h, hkv, d, dv, e) = (att.num_heads, att.num_kv_heads, att.head_dim, att.value_dim, att.page_entries);
        let mut out = vec![0.0f32; num_tokens * h * dv];
        for s in 0..att.seq_lens.len() {
            let pages = &att.kv_indices[att.kv_indptr[s] as usize..att.kv_indptr[s + 1] as usize];
            let units = att.seq_lens[s] as i64 / att.ratio;
            let first = (units + e as i64 - 1) / e as i64 - pages.len() as i64;
            for t in att.query_indptr[s] as usize..att.query_indptr[s + 1] as usize {
                let p = att.positions[t];
                for head in 0..h {
                    let g = head / (h / hkv);
                    let mut logits = vec![];
                    let mut values = vec![];
                    for (pi, &page) in pages.iter().enumerate() {
                        for off in 0..e {
                            let x = (first + pi as i64) * e as i64 + off as i64;
                            let pos = (x + 1) * att.ratio - 1;
                            if x >= units || pos > p || att.window.is_some_and(|w| pos <= p - w) {
                                continue;
                            }
                            let base = ((page as usize * e + off) * hkv + g) * d;
                            let mut sc: f32 = (0..d).map(|c| q[(t * h + head) * d + c] * k[base + c]).sum();
                            sc *= att.scale;
                            if let Some(c) = att.softcap {
                                sc = (sc / c).tanh() * c;
                            }
                            logits.push(sc);
                            values.push(&v[base..base + dv]);
                        }
                    }
                    let sink = att.sinks.map(|x| x[head]);
                    let max = logits.iter().copied().fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
                    let sum: f32 = logits.iter().map(|x| (x - max).exp()).sum::<f32>() + sink.map_or(0.0, |x| (x - max).exp());
                    for (l, val) in logits.iter().zip(&values) {
                        for c in 0..dv {
                            out[(t * h + head) * dv + c] += (l - max).exp() / sum * val[c];
                        }
                    }
                }
            }
        }
        out
    }

    struct Case {
        rows: Vec<(u32, u32)>, // (cached, new)
        window: Option<i64>,
        ratio: i64,
        heads: (usize, usize),
        sinks: bool,
        softcap: Option<f32>,
        threads: usize,
    }

    fn check_case(case: Case) {
        let (e, d) = (4usize, 24usize);
        let (h, hkv) = case.heads;
        let mut query_indptr = vec![0u32];
        let mut seq_lens = vec![];
        let mut kv_indptr = vec![0u32];
        let mut kv_indices = vec![];
        let mut positions = vec![];
        let mut next_page = 1u32;
        for &(cached, new) in &case.rows {
            let seq = cached + new;
            let units = seq as i64 / case.ratio;
            let total_pages = (units as u32).div_ceil(e as u32);
            let pages: Vec<u32> = (next_page..next_page + total_pages).rev().collect(); // any order
            next_page += total_pages;
            let skip = match case.window {
                Some(w) => ((cached as i64 - w + 1).max(0) / case.ratio / e as i64) as usize,
                None => 0,
            };
            kv_indices.extend(&pages[skip.min(pages.len())..]);
            kv_indptr.push(kv_indices.len() as u32);
            seq_lens.push(seq);
            positions.extend((cached..seq).map(i64::from));
            query_indptr.push(positions.len() as u32);
        }
        let t = positions.len();
        let num_pages = next_page as usize;
        let mut state = 12345u64;
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let q = rand(t * h * d);
        let k = rand(num_pages * e * hkv * d);
        let v = rand(num_pages * e * hkv * d);
        let sinks = rand(h);
        let att = PagedAttention {
            query_indptr: &query_indptr,
            seq_lens: &seq_lens,
            kv_indptr: &kv_indptr,
            kv_indices: &kv_indices,
            positions: &positions,
            page_entries: e,
            window: case.window,
            ratio: case.ratio,
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
            value_dim: d - 4,
            scale: 0.3,
            softcap: case.softcap,
            sinks: case.sinks.then_some(&sinks[..]),
            bf16_rounding: false,
        };
        let dv = d - 4;
        let mut out = vec![f32::NAN; t * h * dv];
        let buffers = Buffers {
            q: q.as_ptr(),
            q_strides: [(h * d) as isize, d as isize],
            k: k.as_ptr(),
            k_strides: [(e * hkv * d) as isize, (hkv * d) as isize, d as isize],
            v: v.as_ptr(),
            v_strides: [(e * hkv * d) as isize, (hkv * d) as isize, d as isize],
            out: out.as_mut_ptr(),
            out_strides: [(h * dv) as isize, dv as isize],
            num_tokens: t,
            num_pages,
        };
        let want = naive(&att, &q, &k, &v, t);
        agrees(&att, buffers, case.threads, &mut out, &want, "f32");
        // A bfloat16 cache: the same keys and values rounded to bfloat16 (nearest even), read
        // as the f32s they widen to.
        let to_bf16 = |x: &[f32]| -> Vec<Bf16> { x.iter().map(|&v| Bf16::round(v)).collect() };
        let (k16, v16) = (to_bf16(&k), to_bf16(&v));
        let widen = |x: &[Bf16]| -> Vec<f32> { x.iter().map(|b| b.to_f32()).collect() };
        let want16 = naive(&att, &q, &widen(&k16), &widen(&v16), t);
        assert!(want16.iter().zip(&want).any(|(a, b)| a != b), "bf16 rounding changed nothing");
        let buffers = Buffers { k: k16.as_ptr(), v: v16.as_ptr(), ..buffers.cast::<Bf16>() };
        agrees(&att, buffers, case.threads, &mut out, &want16, "bf16");
    }

    /// Both paths (the vectorised one on `threads`, the scalar one) write `want` into `out`.
    fn agrees<E: Element>(att: &PagedAttention, buffers: Buffers<E>, threads: usize, out: &mut [f32], want: &[f32], label: &str) {
        for scalar in [false, true] {
            out.iter_mut().for_each(|x| *x = f32::NAN);
            let buffers = Buffers { out: out.as_mut_ptr(), ..buffers };
            if scalar {
                unsafe { att.run_scalar(&buffers).unwrap() };
            } else {
                unsafe { att.run(&buffers, threads).unwrap() };
            }
            for (i, (a, b)) in out.iter().zip(want).enumerate() {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{label} scalar={scalar} element {i}: {a} vs {b}");
            }
        }
    }

    const ROWS: [(u32, u32); 5] = [(9, 1), (0, 7), (21, 1), (5, 6), (2, 1)];

    #[test]
    fn full_attention_gqa_any_page_order() {
        for threads in [1, 3] {
            check_case(Case { rows: ROWS.to_vec(), window: None, ratio: 1, heads: (4, 2), sinks: false, softcap: None, threads });
            // Three query heads a KV head: a pair, then one alone.
            check_case(Case { rows: ROWS.to_vec(), window: None, ratio: 1, heads: (6, 2), sinks: true, softcap: None, threads });
        }
    }

    #[test]
    fn sliding_window_mqa() {
        check_case(Case {
            rows: ROWS.to_vec(),
            window: Some(6),
            ratio: 1,
            heads: (4, 1),
            sinks: false,
            softcap: None,
            threads: 2,
        });
    }

    #[test]
    fn sinks_and_softcap() {
        check_case(Case {
            rows: ROWS.to_vec(),
            window: Some(5),
            ratio: 1,
            heads: (4, 4),
            sinks: true,
            softcap: Some(7.0),
            threads: 2,
        });
    }

    #[test]
    fn compressed_entries() {
        let rows = vec![(17, 1), (3, 13), (40, 4)];
        check_case(Case { rows, window: None, ratio: 4, heads: (2, 1), sinks: true, softcap: None, threads: 1 });
    }

    #[test]
    fn refuses_out_of_range_pages_and_bad_indptr() {
        let (q, k) = (vec![0.0f32; 8], vec![0.0f32; 32]);
        let mut out = vec![0.0f32; 8];
        let buffers = Buffers {
            q: q.as_ptr(),
            q_strides: [8, 8],
            k: k.as_ptr(),
            k_strides: [8, 8, 8],
            v: k.as_ptr(),
            v_strides: [8, 8, 8],
            out: out.as_mut_ptr(),
            out_strides: [8, 8],
            num_tokens: 1,
            num_pages: 2,
        };
        let mut att = PagedAttention {
            query_indptr: &[0, 1],
            seq_lens: &[1],
            kv_indptr: &[0, 1],
            kv_indices: &[5],
            positions: &[0],
            page_entries: 2,
            window: None,
            ratio: 1,
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 8,
            value_dim: 8,
            scale: 1.0,
            softcap: None,
            sinks: None,
            bf16_rounding: false,
        };
        let err = unsafe { att.run(&buffers, 1) }.unwrap_err();
        assert!(err.0.contains("page 5"), "{err}");
        att.kv_indices = &[1];
        att.query_indptr = &[0, 2];
        let err = unsafe { att.run(&buffers, 1) }.unwrap_err();
        assert!(err.0.contains("past 1 tokens"), "{err}");
        att.query_indptr = &[0, 1];
        att.kv_indptr = &[0, 1];
        att.seq_lens = &[0];
        let err = unsafe { att.run(&buffers, 1) }.unwrap_err();
        assert!(err.0.contains("lists 1 pages"), "{err}");
    }
}
