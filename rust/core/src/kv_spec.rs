//! Per-layer cache specs and their grouping into cache groups.
//!
//! A runner states, per layer, what it keeps in the cache ([`KvCacheSpec`]). Layers
//! with equal specs form [`CacheGroup`]s (token / recurrent ones split into groups of
//! `num_layer_slots` layers): a group shares one page table per request.
//! All groups draw pages from one pool of equal-size pages ([`crate::PagePool`]), so
//! a page id is owned by exactly one group at a time.

use crate::error::CoreError;

/// What one layer keeps per request.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheSpec {
    /// Full attention: every token's K/V, `bytes_per_token` per token.
    Full { bytes_per_token: u64 },
    /// Sliding-window attention: a query at position `p` reads keys in `(p - window, p]`;
    /// pages wholly before that are returned to the pool every step.
    SlidingWindow { window: u32, bytes_per_token: u64 },
    /// Recurrent state (Mamba, gated delta net, ...): one fixed-size state of
    /// `state_bytes` per request (per layer), held in `pages_per_state` pages of the pool
    /// (see [`CacheLayout::page_bytes`]); with prefix caching, checkpoints of it at page
    /// boundaries are cached too.
    Recurrent { state_bytes: u64 },
    /// Compressed attention (DeepSeek-V4 CSA / HCA): one entry of `bytes_per_entry` per
    /// `ratio` source tokens. Entry `e` covers tokens `[e*ratio, (e+1)*ratio)` and is
    /// *closed* (written) by its last token. A page covers the same span of source tokens
    /// as the token groups' pages, or the smallest multiple of it that holds whole entries:
    /// `span = lcm(page_size, ratio)` tokens, `entries_per_page = span / ratio` entries (so
    /// `page_size / ratio` when the ratio divides the page size, 1 when the page size
    /// divides the ratio). Page-table index `j` holds entries `[j*E, (j+1)*E)` (E =
    /// entries per page) = tokens `[j*span, (j+1)*span)`. The engine stores no carry (the
    /// not-yet-compressed tail, or an overlapping window's previous half): the runner
    /// reads it from a sliding-window group of the same layer whose window is at least
    /// `(1 + overlap) * ratio` tokens (see docs/architecture.md, "Cache groups").
    Compressed { ratio: u32, bytes_per_entry: u64 },
}

impl KvCacheSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            KvCacheSpec::Full { .. } => "full",
            KvCacheSpec::SlidingWindow { .. } => "sliding_window",
            KvCacheSpec::Recurrent { .. } => "recurrent",
            KvCacheSpec::Compressed { .. } => "compressed",
        }
    }

    /// Source tokens per entry, for compressed specs.
    pub fn ratio(&self) -> Option<u32> {
        match self {
            KvCacheSpec::Compressed { ratio, .. } => Some(*ratio),
            _ => None,
        }
    }

    /// Entries closed once `num_tokens` tokens are computed: `num_tokens / ratio` for a
    /// compressed spec, `num_tokens` for a token (full / sliding-window) spec.
    pub fn num_entries(&self, num_tokens: u32) -> u32 {
        match self {
            KvCacheSpec::Compressed { ratio, .. } => num_tokens / (*ratio).max(1),
            _ => num_tokens,
        }
    }

    /// Entries one page holds: `page_size` positions for a token (full / sliding-window)
    /// spec; `lcm(page_size, ratio) / ratio` entries for a compressed spec (a page spans
    /// `lcm(page_size, ratio)` source tokens, a whole number of token pages); 0 for a
    /// recurrent spec (its pages hold state bytes).
    pub fn entries_per_page(&self, page_size: u32) -> u32 {
        match self {
            KvCacheSpec::Compressed { ratio, .. } => lcm(page_size, *ratio) / ratio,
            KvCacheSpec::Recurrent { .. } => 0,
            _ => page_size,
        }
    }

    /// Token pages (of `page_size` tokens) one page of this spec spans: 1 for a token spec,
    /// `lcm(page_size, ratio) / page_size` for a compressed spec, 0 for a recurrent spec.
    /// A compressed page is full (and can be cached) once its last token page is.
    pub fn token_pages_per_page(&self, page_size: u32) -> u32 {
        match self {
            KvCacheSpec::Compressed { ratio, .. } => lcm(page_size, *ratio) / page_size,
            KvCacheSpec::Recurrent { .. } => 0,
            _ => 1,
        }
    }

    /// Bytes one page of this spec holds in one layer's buffer: `entries_per_page *
    /// bytes_per_token` (or `bytes_per_entry`); 0 for a recurrent spec (its states are laid
    /// out in pages of [`CacheLayout::page_bytes`]).
    pub fn page_bytes(&self, page_size: u32) -> u64 {
        let per_entry = match self {
            KvCacheSpec::Full { bytes_per_token } | KvCacheSpec::SlidingWindow { bytes_per_token, .. } => *bytes_per_token,
            KvCacheSpec::Compressed { bytes_per_entry, .. } => *bytes_per_entry,
            KvCacheSpec::Recurrent { .. } => 0,
        };
        per_entry.saturating_mul(u64::from(self.entries_per_page(page_size)))
    }

    /// The window in tokens, for sliding-window specs.
    pub fn window(&self) -> Option<u32> {
        match self {
            KvCacheSpec::SlidingWindow { window, .. } => Some(*window),
            _ => None,
        }
    }

    /// Most pages one request can hold at once in a group of this spec (for a recurrent
    /// group: one state, `pages_per_state` pages; see [`CacheGroup::max_pages_per_request`]).
    pub fn max_pages_per_request(&self, max_model_len: u32, max_num_batched_tokens: u32, page_size: u32) -> u32 {
        let full = max_model_len.div_ceil(page_size);
        match self {
            KvCacheSpec::Full { .. } => full,
            // The window behind the first new token plus the largest chunk, on unaligned
            // pages (in u64: window + budget can pass u32::MAX).
            KvCacheSpec::SlidingWindow { window, .. } => {
                let tokens = u64::from(*window) - 1 + u64::from(max_num_batched_tokens);
                let pages = tokens.div_ceil(u64::from(page_size)) + 1;
                full.min(u32::try_from(pages).unwrap_or(u32::MAX))
            }
            KvCacheSpec::Recurrent { .. } => 1,
            KvCacheSpec::Compressed { .. } => self.num_entries(max_model_len).div_ceil(self.entries_per_page(page_size)),
        }
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Least common multiple of two positive numbers (saturating at `u32::MAX`).
fn lcm(a: u32, b: u32) -> u32 {
    let (a, b) = (a.max(1), b.max(1));
    u32::try_from(u64::from(a / gcd(a, b)) * u64::from(b)).unwrap_or(u32::MAX)
}

/// Layers that share one page table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheGroup {
    pub spec: KvCacheSpec,
    /// Indices into the runner's `cache_spec()` list, ascending.
    pub layer_indices: Vec<u32>,
    /// Pages one recurrent state occupies: `max(1, ceil(state_bytes / page_bytes))`
    /// (1 when `page_bytes` is 0); 0 for a token (full / sliding-window) group.
    pub pages_per_state: u32,
}

impl CacheGroup {
    pub fn is_recurrent(&self) -> bool {
        self.pages_per_state > 0
    }

    /// Most pages one request can hold at once in this group. A recurrent group holds one
    /// state, plus one checkpoint in flight when prefix caching is on.
    pub fn max_pages_per_request(
        &self,
        max_model_len: u32,
        max_num_batched_tokens: u32,
        page_size: u32,
        prefix_caching: bool,
    ) -> u32 {
        if self.is_recurrent() {
            self.pages_per_state.saturating_mul(1 + u32::from(prefix_caching))
        } else {
            self.spec.max_pages_per_request(max_model_len, max_num_batched_tokens, page_size)
        }
    }
}

/// How the cache is laid out: handed to the runner's `bind_cache` once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// Pages in the pool, page 0 (the null page) included.
    pub num_pages: u32,
    /// Tokens per page of a token group. Every group's page spans a whole number of
    /// `page_size`-token pages (a compressed group's page `lcm(page_size, ratio)` tokens,
    /// [`KvCacheSpec::entries_per_page`]).
    pub page_size: u32,
    /// Bytes one page holds in one layer's buffer of a token group: the largest
    /// `page_size * bytes_per_token` over the token (full / sliding-window) layers; 0 if
    /// there are none or they keep no bytes. A compressed layer's pages have their own size,
    /// [`KvCacheSpec::page_bytes`] (`entries_per_page * bytes_per_entry`). A recurrent state
    /// of `state_bytes` spans `ceil(state_bytes / page_bytes)` pages (the last one padded);
    /// the runner sizes each recurrent layer's buffer as `num_pages` pages of `page_bytes`
    /// (or of `state_bytes` when `page_bytes` is 0).
    pub page_bytes: u64,
    /// Layers in the largest token / recurrent group: a runner may share one buffer of
    /// `num_pages` pages of `page_bytes` per *layer slot* across those groups (the k-th
    /// layer of every group views slot k), since a page id belongs to one group at a time.
    /// Compressed groups are not counted (their pages have their own size).
    pub num_layer_slots: u32,
    pub groups: Vec<CacheGroup>,
}

/// Splits same-spec token / recurrent buckets into groups of `G` layers (vLLM's rule, so
/// that shared layer-slot buffers are used by every group alike): `G` is the smallest
/// bucket, or the largest when every bucket is within 1.5x of the smallest; a bucket that
/// is not a multiple of `G` ends in a shorter group. Compressed buckets stay whole (their
/// pages have their own size and are not shared). Groups come in order of first layer.
fn split_into_layer_slots(buckets: Vec<CacheGroup>) -> Vec<CacheGroup> {
    let sizes: Vec<usize> = buckets.iter().filter(|g| g.spec.ratio().is_none()).map(|g| g.layer_indices.len()).collect();
    let (Some(&min), Some(&max)) = (sizes.iter().min(), sizes.iter().max()) else {
        return buckets;
    };
    let size = if 2 * max < 3 * min { max } else { min };
    let mut groups: Vec<CacheGroup> = Vec::new();
    for bucket in buckets {
        if bucket.spec.ratio().is_some() {
            groups.push(bucket);
            continue;
        }
        for chunk in bucket.layer_indices.chunks(size) {
            groups.push(CacheGroup { spec: bucket.spec, layer_indices: chunk.to_vec(), pages_per_state: 0 });
        }
    }
    groups.sort_by_key(|g| g.layer_indices[0]);
    groups
}

impl CacheLayout {
    /// Groups `layer_specs` (layers with equal specs share a group, token / recurrent
    /// buckets split into groups of `num_layer_slots` layers, in order of first layer).
    /// An empty list means one full-attention group with no bytes (a
    /// runner that keeps no cache still gets page tables).
    pub fn from_layer_specs(layer_specs: &[KvCacheSpec], num_pages: u32, page_size: u32) -> Result<Self, CoreError> {
        if page_size == 0 {
            return Err(CoreError::invalid("page_size must be >= 1"));
        }
        if num_pages < 2 {
            return Err(CoreError::invalid(format!(
                "num_pages must be >= 2 (page 0 is the reserved null page), got {num_pages}"
            )));
        }
        let default = [KvCacheSpec::Full { bytes_per_token: 0 }];
        let specs = if layer_specs.is_empty() { &default[..] } else { layer_specs };
        let mut groups: Vec<CacheGroup> = Vec::new();
        for (layer, spec) in specs.iter().enumerate() {
            match spec {
                KvCacheSpec::SlidingWindow { window: 0, .. } => {
                    return Err(CoreError::invalid(format!("layer {layer}: sliding window must be >= 1 token")))
                }
                KvCacheSpec::Recurrent { state_bytes: 0 } => {
                    return Err(CoreError::invalid(format!("layer {layer}: recurrent state_bytes must be >= 1")))
                }
                KvCacheSpec::Compressed { ratio: 0, .. } => {
                    return Err(CoreError::invalid(format!("layer {layer}: compressed ratio must be >= 1 token")))
                }
                _ => {}
            }
            match groups.iter_mut().find(|g| g.spec == *spec) {
                Some(g) => g.layer_indices.push(layer as u32),
                None => groups.push(CacheGroup { spec: *spec, layer_indices: vec![layer as u32], pages_per_state: 0 }),
            }
        }
        let mut groups = split_into_layer_slots(groups);
        let page_bytes = groups
            .iter()
            .filter(|g| matches!(g.spec, KvCacheSpec::Full { .. } | KvCacheSpec::SlidingWindow { .. }))
            .map(|g| g.spec.page_bytes(page_size))
            .max()
            .unwrap_or(0);
        for g in &mut groups {
            if let KvCacheSpec::Recurrent { state_bytes } = g.spec {
                let pages = if page_bytes == 0 { 1 } else { state_bytes.div_ceil(page_bytes).max(1) };
                g.pages_per_state = u32::try_from(pages).map_err(|_| {
                    CoreError::invalid(format!(
                        "recurrent state_bytes = {state_bytes} spans too many pages of {page_bytes} bytes"
                    ))
                })?;
            }
        }
        let num_layer_slots =
            groups.iter().filter(|g| g.spec.ratio().is_none()).map(|g| g.layer_indices.len()).max().unwrap_or(0);
        Ok(CacheLayout { num_pages, page_size, page_bytes, num_layer_slots: num_layer_slots as u32, groups })
    }

    /// Most pages one request of `max_model_len` tokens holds at once, over all groups (its
    /// states included, plus a checkpoint in flight per recurrent group with prefix caching,
    /// plus a spare state per recurrent group with `speculative` decoding).
    pub fn pages_per_request(
        &self,
        max_model_len: u32,
        max_num_batched_tokens: u32,
        prefix_caching: bool,
        speculative: bool,
    ) -> u32 {
        self.groups
            .iter()
            .map(|g| {
                g.max_pages_per_request(max_model_len, max_num_batched_tokens, self.page_size, prefix_caching)
                    + if speculative { g.pages_per_state } else { 0 }
            })
            .fold(0u32, u32::saturating_add)
    }

    /// Whether any group is recurrent.
    pub fn has_recurrent(&self) -> bool {
        self.groups.iter().any(CacheGroup::is_recurrent)
    }

    /// The group index holding `layer`.
    pub fn group_of_layer(&self, layer: u32) -> Option<usize> {
        self.groups.iter().position(|g| g.layer_indices.contains(&layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_layers_by_spec_in_order_of_first_appearance() {
        let full = KvCacheSpec::Full { bytes_per_token: 64 };
        let swa = KvCacheSpec::SlidingWindow { window: 8, bytes_per_token: 64 };
        let layout = CacheLayout::from_layer_specs(&[swa, full, swa, full], 10, 4).unwrap();
        assert_eq!(layout.groups.len(), 2);
        assert_eq!(layout.groups[0].spec, swa);
        assert_eq!(layout.groups[0].layer_indices, vec![0, 2]);
        assert_eq!(layout.groups[1].layer_indices, vec![1, 3]);
        assert_eq!(layout.group_of_layer(3), Some(1));
    }

    #[test]
    fn recurrent_states_span_whole_pages() {
        let full = KvCacheSpec::Full { bytes_per_token: 8 };
        let rec = KvCacheSpec::Recurrent { state_bytes: 100 };
        // page_bytes = 4 tokens * 8 bytes = 32: a 100-byte state takes 4 pages (28 bytes padding).
        let layout = CacheLayout::from_layer_specs(&[full, rec, rec, full], 10, 4).unwrap();
        assert_eq!(layout.page_bytes, 32);
        assert_eq!((layout.groups[0].pages_per_state, layout.groups[1].pages_per_state), (0, 4));
        assert_eq!(layout.groups[1].layer_indices, vec![1, 2]);
        assert_eq!(layout.groups[1].max_pages_per_request(100, 10, 4, true), 8);
        // No per-token bytes: one page per state.
        let only = CacheLayout::from_layer_specs(&[rec], 10, 4).unwrap();
        assert_eq!((only.page_bytes, only.groups[0].pages_per_state), (0, 1));
        assert!(CacheLayout::from_layer_specs(&[KvCacheSpec::Recurrent { state_bytes: 0 }], 10, 4).is_err());
    }

    #[test]
    fn buckets_split_into_groups_of_the_smallest_bucket() {
        let full = KvCacheSpec::Full { bytes_per_token: 8 };
        let rec = KvCacheSpec::Recurrent { state_bytes: 100 };
        let csa = KvCacheSpec::Compressed { ratio: 4, bytes_per_entry: 8 };
        // Qwen3-Next's pattern (3 recurrent layers per full one): 2 full, 6 recurrent ->
        // G = 2, three recurrent groups of 2, in order of their first layer.
        let specs = [rec, rec, rec, full, rec, rec, rec, full];
        let layout = CacheLayout::from_layer_specs(&specs, 10, 4).unwrap();
        let groups: Vec<Vec<u32>> = layout.groups.iter().map(|g| g.layer_indices.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![2, 4], vec![3, 7], vec![5, 6]]);
        assert_eq!(layout.num_layer_slots, 2);
        // Within 1.5x: no split (3 and 4 layers -> G = 4, the 3-layer group is one short).
        let layout = CacheLayout::from_layer_specs(&[full, full, full, rec, rec, rec, rec], 10, 4).unwrap();
        assert_eq!((layout.groups.len(), layout.num_layer_slots), (2, 4));
        // A bucket not a multiple of G ends short; compressed buckets stay whole and do not
        // count towards the slots.
        let layout = CacheLayout::from_layer_specs(&[full, full, rec, rec, rec, rec, rec, csa, csa, csa], 10, 4).unwrap();
        let groups: Vec<Vec<u32>> = layout.groups.iter().map(|g| g.layer_indices.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6], vec![7, 8, 9]]);
        assert_eq!(layout.num_layer_slots, 2);
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(CacheLayout::from_layer_specs(&[], 1, 4).is_err());
        assert!(CacheLayout::from_layer_specs(&[], 10, 0).is_err());
        let l = CacheLayout::from_layer_specs(&[], 10, 4).unwrap();
        assert_eq!(l.groups[0].spec, KvCacheSpec::Full { bytes_per_token: 0 });
    }

    #[test]
    fn compressed_pages_span_whole_token_pages() {
        let swa = KvCacheSpec::SlidingWindow { window: 8, bytes_per_token: 8 };
        let csa = KvCacheSpec::Compressed { ratio: 4, bytes_per_entry: 16 };
        let layout = CacheLayout::from_layer_specs(&[swa, csa], 10, 8).unwrap();
        assert_eq!(layout.page_bytes, 64, "token pages only: 8 tokens of 8 bytes");
        assert_eq!((layout.groups[1].spec.ratio(), layout.groups[1].pages_per_state), (Some(4), 0));
        assert_eq!(csa.num_entries(11), 2);
        // page_size 8, ratio 4: a page spans 8 tokens = 2 entries of 16 bytes.
        assert_eq!((csa.entries_per_page(8), csa.token_pages_per_page(8), csa.page_bytes(8)), (2, 1, 32));
        // page_size 2, ratio 4: one entry per page, spanning 2 token pages.
        assert_eq!((csa.entries_per_page(2), csa.token_pages_per_page(2)), (1, 2));
        // page_size 6, ratio 4: a page spans lcm = 12 tokens = 3 entries = 2 token pages.
        assert_eq!((csa.entries_per_page(6), csa.token_pages_per_page(6)), (3, 2));
        // 100 tokens close 25 entries: 13 pages of 2 at page_size 8.
        assert_eq!(csa.max_pages_per_request(100, 16, 8), 13);
        assert_eq!((swa.entries_per_page(8), swa.token_pages_per_page(8)), (8, 1));
        assert!(CacheLayout::from_layer_specs(&[KvCacheSpec::Compressed { ratio: 0, bytes_per_entry: 1 }], 10, 4).is_err());
    }

    #[test]
    fn sliding_window_page_cap() {
        let swa = KvCacheSpec::SlidingWindow { window: 8, bytes_per_token: 1 };
        // (8 - 1 + 4) / 4 rounded up = 3, + 1 for an unaligned window start.
        assert_eq!(swa.max_pages_per_request(1000, 4, 4), 4);
        assert_eq!(swa.max_pages_per_request(8, 4, 4), 2);
        // window + budget past u32::MAX must not wrap to a small bound.
        let wide = KvCacheSpec::SlidingWindow { window: 4096, bytes_per_token: 1 };
        assert_eq!(wide.max_pages_per_request(8192, u32::MAX, 16), 512);
    }
}
