//! Chained block hashes: the prefix-cache key of a full page.
//!
//! `H_i = xxh3_128(H_{i-1} || extra || tokens of page i)`, with `H_{-1} = 0`. The
//! chain makes a page's hash depend on every token before it, so equal hashes mean
//! equal prefixes. 128 bits make an accidental collision negligible (~2^-64 at 2^32
//! cached pages), which is why a hit needs no token-by-token check.

use std::hash::{BuildHasherDefault, Hash, Hasher};

use xxhash_rust::xxh3::Xxh3;

/// A 128-bit chained hash of one full page of tokens and everything before it.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Hash of the page holding `tokens`, chained on `parent` (None for the first page).
    /// `extra` separates otherwise equal prefixes (e.g. a cache salt); 0 for none.
    pub fn chain(parent: Option<BlockHash>, tokens: &[u32], extra: u64) -> BlockHash {
        let mut hasher = Xxh3::new();
        hasher.update(&parent.map_or(0u128, |h| h.0).to_le_bytes());
        hasher.update(&extra.to_le_bytes());
        let mut bytes = [0u8; 256];
        for chunk in tokens.chunks(bytes.len() / 4) {
            for (dst, t) in bytes.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            hasher.update(&bytes[..chunk.len() * 4]);
        }
        BlockHash(hasher.digest128())
    }
}

impl Hash for BlockHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already uniformly distributed: hand the low 64 bits straight to the map.
        state.write_u64(self.0 as u64);
    }
}

/// A hasher that passes a `BlockHash`'s bits through (no second hashing).
#[derive(Default)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type BlockHashBuilder = BuildHasherDefault<PassThroughHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_parent_tokens_and_extra() {
        let a = BlockHash::chain(None, &[1, 2, 3, 4], 0);
        assert_eq!(a, BlockHash::chain(None, &[1, 2, 3, 4], 0));
        assert_ne!(a, BlockHash::chain(None, &[1, 2, 3, 5], 0));
        assert_ne!(a, BlockHash::chain(None, &[1, 2, 3, 4], 7));
        let b = BlockHash::chain(Some(a), &[5, 6, 7, 8], 0);
        assert_ne!(b, BlockHash::chain(None, &[5, 6, 7, 8], 0));
        // Long pages hash across the internal buffer boundary.
        let long: Vec<u32> = (0..1000).collect();
        let mut other = long.clone();
        other[999] = 0;
        assert_ne!(BlockHash::chain(None, &long, 0), BlockHash::chain(None, &other, 0));
    }
}
