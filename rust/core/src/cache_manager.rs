//! A request's pages in every cache group: allocation, prefix hits, caching full pages,
//! sliding-window release, recurrent states and their checkpoints, and freeing.
//!
//! Page tables of token groups are position-indexed: entry `j` of group `g` holds positions
//! `[j*page_size, (j+1)*page_size)`. A full-attention group keeps every entry; a
//! sliding-window group replaces entries wholly before the window with `NULL_PAGE` and
//! returns those pages to the pool. A compressed group's table is entry-indexed: a page
//! holds `E = entries_per_page` entries spanning `k = token_pages_per_page` token pages
//! (`lcm(page_size, ratio)` tokens: `E = page_size / ratio`, `k = 1` when the ratio divides
//! the page size), so entry `j` holds entries `[j*E, (j+1)*E)`; it grows as entries close
//! (`ceil(floor(n / ratio) / E)` pages for `n` computed tokens) and, like a full-attention
//! table, keeps every page. Its full page `j` is registered in the prefix cache under the
//! hash of the last token page it covers, `H_{(j+1)*k - 1}` (the chain makes that a key for
//! the whole prefix), so a compressed group serves hits of whole multiples of
//! `lcm(page_size, ratio)` tokens. A
//! recurrent group's "table" is the request's own state: `pages_per_state` pages,
//! allocated at admission and kept until the request leaves.
//!
//! With prefix caching, a recurrent group caches *checkpoints*: copies of a request's
//! state at a page boundary (`k * page_size` tokens), made by a `copy_pages` op the runner
//! applies before the next forward, registered under the derived hashes
//! [`checkpoint_hash`]`(H_{k-1}, p)` (one per state page `p`) once the plan carrying the
//! copy is committed, then released to the LRU queue like any cached page. A hit restores
//! a state by copy-on-write from a checkpoint into the request's own pages. The scheduler
//! asks this manager for pages; nothing else touches the pool.

use crate::block_hash::BlockHash;
use crate::error::CoreError;
use crate::kv_spec::{CacheLayout, KvCacheSpec};
use crate::page_pool::{PageId, PagePool, NULL_PAGE};
use crate::request::Request;

/// A prefix-cache hit: the first `num_tokens` tokens are already in cached pages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub num_tokens: u32,
    /// Per group, the position-indexed pages covering the hit (`NULL_PAGE` before a window).
    pub pages: Vec<Vec<PageId>>,
    /// Pages of the hit that are idle in the free queue: taking them uses free pages.
    pub num_idle_pages: u32,
}

pub struct KvCacheManager {
    pub pool: PagePool,
    pub layout: CacheLayout,
    pub enable_prefix_caching: bool,
    /// Prefix caching with recurrent groups: prefill chunks are cut on page boundaries
    /// and states are checkpointed there.
    pub checkpointing: bool,
    /// Tokens between recurrent checkpoints (a multiple of the page size; see
    /// [`KvCacheManager::checkpoint_due`]).
    pub checkpoint_interval: u32,
    /// Speculative decoding with recurrent groups: each request also holds a spare state per
    /// recurrent group (its table's second `pages_per_state` pages), the state before its
    /// last verify row, restored when a draft is rejected.
    pub spare_states: bool,
    /// `copy_pages` pairs (src, dst, src, dst, ...) for the plan being built.
    pub pending_copies: Vec<u32>,
    /// Checkpoints whose copy rides on the plan being built or the pending plan: owned
    /// (refcount 1) until that plan is committed (registered, then released) or discarded.
    pub in_flight_checkpoints: Vec<Checkpoint>,
}

/// A checkpoint being made: group `group`'s state at the end of the page hashed `hash`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub group: usize,
    pub hash: BlockHash,
    pub pages: Vec<PageId>,
}

/// The prefix-map key of page `p` of a recurrent checkpoint taken at the end of the block
/// hashed `block`. Each state page is registered (and can be evicted) separately; a
/// checkpoint is usable only while all its pages are cached.
pub fn checkpoint_hash(block: BlockHash, p: u32) -> BlockHash {
    BlockHash::chain(Some(block), &[p], 1)
}

/// The token page (index into `block_hashes`) whose hash keys table page `j` of `spec`:
/// `j` for a token group, the last token page it covers for a compressed group.
fn keying_block(spec: &KvCacheSpec, page_size: u32, j: u32) -> u32 {
    (j + 1) * spec.token_pages_per_page(page_size) - 1
}

/// First position a query at `num_computed` (and later) still reads, for `spec`.
fn first_needed_position(spec: &KvCacheSpec, num_computed: u32) -> u32 {
    match spec {
        KvCacheSpec::SlidingWindow { window, .. } => (num_computed + 1).saturating_sub(*window),
        _ => 0,
    }
}

impl KvCacheManager {
    pub fn new(layout: CacheLayout, enable_prefix_caching: bool) -> Result<Self, CoreError> {
        let pool = PagePool::new(layout.num_pages, layout.groups.len())?;
        let layout_page_size = layout.page_size;
        let checkpointing = enable_prefix_caching && layout.has_recurrent();
        Ok(KvCacheManager {
            pool,
            layout,
            enable_prefix_caching,
            checkpointing,
            checkpoint_interval: layout_page_size,
            spare_states: false,
            pending_copies: Vec::new(),
            in_flight_checkpoints: Vec::new(),
        })
    }

    /// Pages a request holds in recurrent group `g`: its state, plus the spare with
    /// speculative decoding.
    pub fn state_pages(&self, g: usize) -> u32 {
        self.layout.groups[g].pages_per_state * (1 + u32::from(self.spare_states))
    }

    /// `copy_pages` between `req`'s states and their spares, in every recurrent group: state
    /// -> spare before a verify row (`save`: read before the forward advances the state over
    /// the drafts), spare -> state after a rejected draft (`!save`).
    pub fn copy_spare_states(&mut self, req: &Request, save: bool) {
        for (g, group) in self.layout.groups.iter().enumerate() {
            let n = group.pages_per_state as usize;
            if n > 0 && req.pages[g].len() == 2 * n {
                for p in 0..n {
                    let (state, spare) = (req.pages[g][p], req.pages[g][n + p]);
                    let pair = if save { [state, spare] } else { [spare, state] };
                    self.pending_copies.extend_from_slice(&pair);
                }
            }
        }
    }

    pub fn page_size(&self) -> u32 {
        self.layout.page_size
    }

    pub fn num_groups(&self) -> usize {
        self.layout.groups.len()
    }

    /// Table length of token or compressed group `g` once `num_tokens` tokens are
    /// computed: pages holding positions (entries, for a compressed group) so far.
    fn num_table_pages(&self, g: usize, num_tokens: u32) -> u32 {
        let spec = &self.layout.groups[g].spec;
        spec.num_entries(num_tokens).div_ceil(spec.entries_per_page(self.page_size()))
    }

    /// Token pages one table page of group `g` spans (1 for a token group).
    fn token_pages_per_page(&self, g: usize) -> u32 {
        self.layout.groups[g].spec.token_pages_per_page(self.page_size()).max(1)
    }

    /// Full table pages of token or compressed group `g` of `req` that can be hashed now.
    fn num_hashable_pages(&self, req: &Request, g: usize) -> u32 {
        let blocks = (req.num_computed_tokens / self.page_size()).min(req.block_hashes.len() as u32);
        blocks / self.token_pages_per_page(g)
    }

    /// The longest cached prefix every group can serve, capped at `num_tokens - 1` so the
    /// last token is recomputed to produce logits. Groups reconcile by a fixed point:
    /// start from the longest full-attention and compressed chains (a compressed chain of
    /// `c` pages serves `c * k` token pages, `k` = token pages per compressed page) and
    /// shorten until each sliding-window group holds every page its window needs at that
    /// length, each recurrent group holds a checkpoint at exactly that length and the
    /// length is a whole number of compressed pages (`lcm(page_size, ratio)` tokens) for
    /// each compressed group. For a
    /// recurrent group the hit's pages are the checkpoint's (the copy-on-write sources),
    /// not pages the request will own.
    pub fn find_prefix_hit(&self, req: &Request) -> PrefixHit {
        let num_groups = self.num_groups();
        let miss = PrefixHit { pages: vec![Vec::new(); num_groups], ..PrefixHit::default() };
        if !self.enable_prefix_caching || req.wants_prompt_logprobs() {
            // (Prompt logprobs need every prompt position's logits: nothing may be skipped.)
            return miss;
        }
        let ps = self.page_size();
        let max_pages = ((req.num_tokens() - 1) / ps).min(req.block_hashes.len() as u32);
        let mut num_pages = max_pages;
        for (g, group) in self.layout.groups.iter().enumerate() {
            match group.spec {
                KvCacheSpec::Full { .. } => {
                    let chain = (0..num_pages)
                        .take_while(|&j| self.pool.lookup(g, req.block_hashes[j as usize]).is_some())
                        .count() as u32;
                    num_pages = num_pages.min(chain);
                }
                KvCacheSpec::Compressed { .. } => {
                    let k = self.token_pages_per_page(g);
                    let chain = (0..num_pages / k)
                        .take_while(|&j| {
                            self.pool.lookup(g, req.block_hashes[keying_block(&group.spec, ps, j) as usize]).is_some()
                        })
                        .count() as u32;
                    num_pages = num_pages.min(chain * k);
                }
                _ => {}
            }
        }
        let whole_entry_pages = |n: u32| (0..num_groups).all(|g| n.is_multiple_of(self.token_pages_per_page(g)));
        while num_pages > 0
            && !(whole_entry_pages(num_pages) && self.windows_cached(req, num_pages) && self.checkpoints_cached(req, num_pages))
        {
            num_pages -= 1;
        }
        if num_pages == 0 {
            return miss;
        }
        let num_tokens = num_pages * ps;
        let mut hit = PrefixHit { num_tokens, pages: Vec::with_capacity(num_groups), num_idle_pages: 0 };
        for (g, group) in self.layout.groups.iter().enumerate() {
            if group.is_recurrent() {
                let block = req.block_hashes[num_pages as usize - 1];
                let pages = (0..group.pages_per_state).map(|p| self.pool.lookup(g, checkpoint_hash(block, p)).unwrap());
                hit.pages.push(pages.collect());
                continue;
            }
            let first = first_needed_position(&group.spec, num_tokens) / ps;
            let pages: Vec<PageId> = (0..self.num_table_pages(g, num_tokens))
                .map(|j| {
                    if j < first {
                        NULL_PAGE
                    } else {
                        self.pool.lookup(g, req.block_hashes[keying_block(&group.spec, ps, j) as usize]).unwrap()
                    }
                })
                .collect();
            hit.num_idle_pages += pages.iter().filter(|&&p| p != NULL_PAGE && self.pool.is_idle(p)).count() as u32;
            hit.pages.push(pages);
        }
        hit
    }

    /// Whether every sliding-window group holds the pages a query at `num_pages * page_size` reads.
    fn windows_cached(&self, req: &Request, num_pages: u32) -> bool {
        let ps = self.page_size();
        self.layout.groups.iter().enumerate().all(|(g, group)| match group.spec {
            KvCacheSpec::SlidingWindow { .. } => {
                let first = first_needed_position(&group.spec, num_pages * ps) / ps;
                (first..num_pages).all(|j| self.pool.lookup(g, req.block_hashes[j as usize]).is_some())
            }
            _ => true,
        })
    }

    /// Whether every recurrent group holds a whole checkpoint at `num_pages * page_size` tokens.
    fn checkpoints_cached(&self, req: &Request, num_pages: u32) -> bool {
        let block = req.block_hashes[num_pages as usize - 1];
        self.layout
            .groups
            .iter()
            .enumerate()
            .all(|(g, group)| (0..group.pages_per_state).all(|p| self.pool.lookup(g, checkpoint_hash(block, p)).is_some()))
    }

    /// New pages `req` needs so its tables cover `num_computed + num_new_tokens` tokens
    /// (starting from `hit` if it is being admitted with one), its own states included.
    pub fn num_pages_to_allocate(&self, req: &Request, hit: Option<&PrefixHit>, num_new_tokens: u32) -> u32 {
        let base = hit.map_or(req.num_computed_tokens, |h| h.num_tokens);
        (0..self.num_groups())
            .map(|g| {
                let group = &self.layout.groups[g];
                if group.is_recurrent() {
                    return if req.pages[g].is_empty() { self.state_pages(g) } else { 0 };
                }
                let have = hit.map_or(req.pages[g].len(), |h| h.pages[g].len()) as u32;
                self.num_table_pages(g, base + num_new_tokens).saturating_sub(have)
            })
            .sum()
    }

    /// Whether a recurrent checkpoint is due when `req` has computed `num_tokens`: at a
    /// multiple of the checkpoint interval, and at the page boundary just before its prompt's
    /// last token (`floor((num_prompt_tokens - 1) / page_size) * page_size`, the longest hit
    /// a repeated or extended prompt can take).
    pub fn checkpoint_due(&self, req: &Request, num_tokens: u32) -> bool {
        let ps = self.page_size();
        num_tokens > 0
            && num_tokens.is_multiple_of(ps)
            && (num_tokens.is_multiple_of(self.checkpoint_interval)
                || num_tokens == req.num_prompt_tokens.saturating_sub(1) / ps * ps)
    }

    /// The chunk length to schedule for `req` from `start` when `num_new` tokens fit. With
    /// checkpointing, a chunk is cut back to end on the last boundary inside it where a
    /// checkpoint is due ([`Self::checkpoint_due`]), if there is one and the chunk does not
    /// already end on one; a last chunk that crosses `floor((num_tokens - 1) / page_size) *
    /// page_size` is cut there when that boundary is due.
    pub fn cut_chunk(&self, req: &Request, start: u32, num_new: u32) -> u32 {
        if !self.checkpointing {
            return num_new;
        }
        let ps = self.page_size();
        let end = start + num_new;
        if end < req.num_tokens() && self.checkpoint_due(req, end) {
            return num_new;
        }
        // The last page boundary strictly inside the chunk, down to the first due one.
        let last = if end < req.num_tokens() { (end - 1) / ps * ps } else { (req.num_tokens() - 1) / ps * ps };
        let mut boundary = last;
        while boundary > start && !self.checkpoint_due(req, boundary) {
            boundary -= ps;
        }
        if boundary > start && boundary < end {
            boundary - start
        } else {
            num_new
        }
    }

    /// Admits a waiting request: takes the pages of `hit` (if any) and allocates pages for
    /// `num_new_tokens` more. All or nothing: returns false and changes nothing if the
    /// pool is short.
    pub fn admit(&mut self, req: &mut Request, hit: PrefixHit, num_new_tokens: u32) -> bool {
        let needed = self.num_pages_to_allocate(req, Some(&hit), num_new_tokens);
        if needed + hit.num_idle_pages > self.pool.num_free_pages() {
            return false;
        }
        let ps = self.page_size();
        let mut sources: Vec<(usize, Vec<PageId>)> = Vec::new();
        for (g, pages) in hit.pages.into_iter().enumerate() {
            let group = &self.layout.groups[g];
            if group.is_recurrent() {
                if !pages.is_empty() {
                    sources.push((g, pages));
                }
                continue;
            }
            for &p in &pages {
                if p != NULL_PAGE {
                    self.pool.touch(p);
                }
            }
            req.num_released_pages[g] = first_needed_position(&group.spec, hit.num_tokens) / ps;
            req.num_hashed_pages[g] = pages.len() as u32;
            req.pages[g] = pages;
        }
        req.num_computed_tokens = hit.num_tokens;
        let allocated = self.allocate(req, num_new_tokens);
        debug_assert!(allocated, "free pages were counted");
        // Copy-on-write: the request's own state starts as the checkpoint (has_initial_state = 1).
        // The checkpoint pages are not referenced: the copy runs before the forward, and all
        // sources of a plan's copies are read before anything is written.
        for (g, src) in sources {
            for (&s, &d) in src.iter().zip(&req.pages[g]) {
                self.pending_copies.extend_from_slice(&[s, d]);
            }
        }
        allocated
    }

    /// Grows `req`'s tables to cover `num_computed + num_new_tokens` tokens. All or
    /// nothing: returns false and changes nothing if the pool is short.
    pub fn allocate(&mut self, req: &mut Request, num_new_tokens: u32) -> bool {
        if self.num_pages_to_allocate(req, None, num_new_tokens) > self.pool.num_free_pages() {
            return false;
        }
        let seq_len = req.num_computed_tokens + num_new_tokens;
        for (g, (pages, group)) in req.pages.iter_mut().zip(&self.layout.groups).enumerate() {
            if group.is_recurrent() {
                if pages.is_empty() {
                    for _ in 0..group.pages_per_state * (1 + u32::from(self.spare_states)) {
                        pages.push(self.pool.allocate_state().expect("free pages were counted"));
                    }
                }
                continue;
            }
            let target = self.num_table_pages(g, seq_len) as usize;
            while pages.len() < target {
                pages.push(self.pool.allocate().expect("free pages were counted"));
            }
        }
        true
    }

    /// Starts a checkpoint of `req`'s states after `num_blocks` full pages (its
    /// `num_computed_tokens`), in every recurrent group that has none there yet: allocates
    /// the checkpoint pages (skipping a group if the pool is short) and queues the copies
    /// own state -> checkpoint for the plan being built.
    pub fn start_checkpoint(&mut self, req: &Request, num_blocks: u32) {
        let block = req.block_hashes[num_blocks as usize - 1];
        for (g, group) in self.layout.groups.iter().enumerate() {
            let n = group.pages_per_state;
            if n == 0 || n > self.pool.num_free_pages() {
                continue;
            }
            if (0..n).all(|p| self.pool.lookup(g, checkpoint_hash(block, p)).is_some()) {
                continue; // already cached
            }
            let pages: Vec<PageId> = (0..n).map(|_| self.pool.allocate_state().expect("counted")).collect();
            for (&s, &d) in req.pages[g].iter().zip(&pages) {
                self.pending_copies.extend_from_slice(&[s, d]);
            }
            self.in_flight_checkpoints.push(Checkpoint { group: g, hash: block, pages });
        }
    }

    /// The plan that carried the in-flight checkpoints' copies was committed: registers
    /// each page under its checkpoint hash and releases it (cached pages go to the LRU end).
    pub fn commit_checkpoints(&mut self) {
        for ck in std::mem::take(&mut self.in_flight_checkpoints) {
            for (p, &page) in ck.pages.iter().enumerate() {
                if self.enable_prefix_caching {
                    self.pool.cache_page(page, ck.group, checkpoint_hash(ck.hash, p as u32));
                }
                self.pool.release(page);
            }
        }
    }

    /// The plan that carried the in-flight checkpoints' copies was discarded: frees their
    /// pages unregistered (the copies may not have run).
    pub fn drop_checkpoints(&mut self) {
        for ck in std::mem::take(&mut self.in_flight_checkpoints) {
            for &page in ck.pages.iter().rev() {
                self.pool.release(page);
            }
        }
    }

    /// Offers every newly computed full page to the prefix cache.
    pub fn cache_full_pages(&mut self, req: &mut Request) {
        if !self.enable_prefix_caching {
            return;
        }
        let blocks = (req.num_computed_tokens / self.page_size()).min(req.block_hashes.len() as u32);
        if req.num_hashed_pages.iter().all(|&n| n >= blocks) {
            return; // the common decode step: no page filled up (a compressed group has fewer)
        }
        let ps = self.page_size();
        for g in 0..self.num_groups() {
            let group = &self.layout.groups[g];
            if group.is_recurrent() {
                continue; // own states are never cached; checkpoints are (start_checkpoint)
            }
            let upto = self.num_hashable_pages(req, g);
            for j in req.num_hashed_pages[g]..upto {
                let page = req.pages[g][j as usize];
                if page != NULL_PAGE {
                    self.pool.cache_page(page, g, req.block_hashes[keying_block(&group.spec, ps, j) as usize]);
                }
            }
            req.num_hashed_pages[g] = req.num_hashed_pages[g].max(upto);
        }
    }

    /// Returns sliding-window pages no future query of `req` reads to the pool.
    pub fn release_out_of_window(&mut self, req: &mut Request) {
        let ps = self.page_size();
        for (g, group) in self.layout.groups.iter().enumerate() {
            if group.spec.window().is_none() {
                continue;
            }
            let first = first_needed_position(&group.spec, req.num_computed_tokens) / ps;
            let pages = &mut req.pages[g];
            for j in req.num_released_pages[g]..first.min(pages.len() as u32) {
                let page = std::mem::replace(&mut pages[j as usize], NULL_PAGE);
                if page != NULL_PAGE {
                    self.pool.release(page);
                }
            }
            req.num_released_pages[g] = req.num_released_pages[g].max(first);
        }
    }

    /// Frees all of `req`'s pages, last position first across groups, so the pool evicts
    /// a request's tail before its prefix (a compressed page goes with the last token page
    /// it covers, a recurrent state with the first).
    pub fn free(&mut self, req: &mut Request) {
        let spans: Vec<usize> = (0..self.num_groups()).map(|g| self.token_pages_per_page(g) as usize).collect();
        let longest = req.pages.iter().zip(&spans).map(|(p, &k)| p.len() * k).max().unwrap_or(0);
        for b in (0..longest).rev() {
            for (g, pages) in req.pages.iter().enumerate() {
                let r = spans[g];
                if !(b + 1).is_multiple_of(r) {
                    continue;
                }
                if let Some(&page) = pages.get((b + 1) / r - 1) {
                    if page != NULL_PAGE {
                        self.pool.release(page);
                    }
                }
            }
        }
        for g in 0..req.pages.len() {
            req.pages[g].clear();
            req.num_released_pages[g] = 0;
            req.num_hashed_pages[g] = 0;
        }
    }

    /// Pages of `req` in group `g` a step over `[num_computed, seq_len)` reads:
    /// (index of the first listed page, the listed pages). A recurrent group lists the
    /// request's state pages; a compressed group every page holding an entry closed by
    /// `seq_len` (none before the first entry closes).
    pub fn listed_pages<'r>(&self, req: &'r Request, g: usize, num_computed: u32, seq_len: u32) -> (u32, &'r [PageId]) {
        if self.layout.groups[g].is_recurrent() {
            return (0, &req.pages[g][..self.layout.groups[g].pages_per_state as usize]);
        }
        let ps = self.page_size();
        let first = first_needed_position(&self.layout.groups[g].spec, num_computed) / ps;
        let end = self.num_table_pages(g, seq_len);
        (first, &req.pages[g][first as usize..end as usize])
    }
}
