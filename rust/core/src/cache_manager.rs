//! A request's pages in every cache group: allocation, prefix hits, caching full pages,
//! sliding-window release and freeing.
//!
//! Page tables are position-indexed: entry `j` of group `g` holds positions
//! `[j*page_size, (j+1)*page_size)`. A full-attention group keeps every entry; a
//! sliding-window group replaces entries wholly before the window with `NULL_PAGE` and
//! returns those pages to the pool. The scheduler asks this manager for pages; nothing
//! else touches the pool.

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
        Ok(KvCacheManager { pool, layout, enable_prefix_caching })
    }

    pub fn page_size(&self) -> u32 {
        self.layout.page_size
    }

    pub fn num_groups(&self) -> usize {
        self.layout.groups.len()
    }

    /// The longest cached prefix every group can serve, capped at `num_tokens - 1` so the
    /// last token is recomputed to produce logits. Groups reconcile by a fixed point:
    /// start from the longest full-attention chain and shorten until each sliding-window
    /// group holds every page its window needs at that length.
    pub fn find_prefix_hit(&self, req: &Request) -> PrefixHit {
        let num_groups = self.num_groups();
        let miss = PrefixHit { pages: vec![Vec::new(); num_groups], ..PrefixHit::default() };
        if !self.enable_prefix_caching {
            return miss;
        }
        let ps = self.page_size();
        let max_pages = ((req.num_tokens() - 1) / ps).min(req.block_hashes.len() as u32);
        let mut num_pages = max_pages;
        for (g, group) in self.layout.groups.iter().enumerate() {
            if let KvCacheSpec::Full { .. } = group.spec {
                let chain =
                    (0..num_pages).take_while(|&j| self.pool.lookup(g, req.block_hashes[j as usize]).is_some()).count() as u32;
                num_pages = num_pages.min(chain);
            }
        }
        while num_pages > 0 && !self.windows_cached(req, num_pages) {
            num_pages -= 1;
        }
        if num_pages == 0 {
            return miss;
        }
        let num_tokens = num_pages * ps;
        let mut hit = PrefixHit { num_tokens, pages: Vec::with_capacity(num_groups), num_idle_pages: 0 };
        for (g, group) in self.layout.groups.iter().enumerate() {
            let first = first_needed_position(&group.spec, num_tokens) / ps;
            let pages: Vec<PageId> = (0..num_pages)
                .map(|j| if j < first { NULL_PAGE } else { self.pool.lookup(g, req.block_hashes[j as usize]).unwrap() })
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

    /// New pages `req` needs so its tables cover `num_computed + num_new_tokens` tokens
    /// (starting from `hit` if it is being admitted with one).
    pub fn num_pages_to_allocate(&self, req: &Request, hit: Option<&PrefixHit>, num_new_tokens: u32) -> u32 {
        let base = hit.map_or(req.num_computed_tokens, |h| h.num_tokens);
        let target = (base + num_new_tokens).div_ceil(self.page_size());
        (0..self.num_groups())
            .map(|g| {
                let have = hit.map_or(req.pages[g].len(), |h| h.pages[g].len()) as u32;
                target.saturating_sub(have)
            })
            .sum()
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
        for (g, pages) in hit.pages.into_iter().enumerate() {
            for &p in &pages {
                if p != NULL_PAGE {
                    self.pool.touch(p);
                }
            }
            let group = &self.layout.groups[g];
            req.num_released_pages[g] = first_needed_position(&group.spec, hit.num_tokens) / ps;
            req.num_hashed_pages[g] = pages.len() as u32;
            req.pages[g] = pages;
        }
        req.num_computed_tokens = hit.num_tokens;
        self.allocate(req, num_new_tokens)
    }

    /// Grows `req`'s tables to cover `num_computed + num_new_tokens` tokens. All or
    /// nothing: returns false and changes nothing if the pool is short.
    pub fn allocate(&mut self, req: &mut Request, num_new_tokens: u32) -> bool {
        if self.num_pages_to_allocate(req, None, num_new_tokens) > self.pool.num_free_pages() {
            return false;
        }
        let target = (req.num_computed_tokens + num_new_tokens).div_ceil(self.page_size()) as usize;
        for pages in &mut req.pages {
            while pages.len() < target {
                pages.push(self.pool.allocate().expect("free pages were counted"));
            }
        }
        true
    }

    /// Offers every newly computed full page to the prefix cache.
    pub fn cache_full_pages(&mut self, req: &mut Request) {
        if !self.enable_prefix_caching {
            return;
        }
        let upto = (req.num_computed_tokens / self.page_size()).min(req.block_hashes.len() as u32);
        if req.num_hashed_pages.iter().all(|&n| n >= upto) {
            return; // the common decode step: no page filled up
        }
        for g in 0..self.num_groups() {
            for j in req.num_hashed_pages[g]..upto {
                let page = req.pages[g][j as usize];
                if page != NULL_PAGE {
                    self.pool.cache_page(page, g, req.block_hashes[j as usize]);
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
    /// a request's tail before its prefix.
    pub fn free(&mut self, req: &mut Request) {
        let longest = req.pages.iter().map(Vec::len).max().unwrap_or(0);
        for j in (0..longest).rev() {
            for pages in &req.pages {
                if let Some(&page) = pages.get(j) {
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
    /// (index of the first listed page, the listed pages).
    pub fn listed_pages<'r>(&self, req: &'r Request, g: usize, num_computed: u32, seq_len: u32) -> (u32, &'r [PageId]) {
        let ps = self.page_size();
        let first = first_needed_position(&self.layout.groups[g].spec, num_computed) / ps;
        let end = seq_len.div_ceil(ps);
        (first, &req.pages[g][first as usize..end as usize])
    }
}
