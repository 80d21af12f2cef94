//! The pool of equal-size cache pages: refcounts, the free queue, the prefix-cache map.
//!
//! Page 0 is the null page: never handed out, never freed, always zero on the runner's
//! side. Every other page is in exactly one of three states:
//! - *owned*: `ref_count > 0` (held by one or more request page tables);
//! - *cached*: `ref_count == 0` but it carries a block hash, so a prefix hit can revive it;
//! - *free*: `ref_count == 0` and no hash.
//!
//! Cached and free pages sit in one intrusive doubly linked free queue (indices into
//! flat vectors, `NO_LINK` as sentinel). Allocation pops the front. A page that becomes
//! free without a hash goes to the *front* (worthless, reuse first); a cached page goes
//! to the *back* (least recently used is evicted first). Popping a cached page evicts
//! its hash. All operations are O(1) except `reset_prefix_cache` and `check_integrity`
//! (O(num_pages)).

use std::collections::HashMap;

use std::collections::TryReserveError;

use crate::block_hash::{BlockHash, BlockHashBuilder};
use crate::error::CoreError;

/// A page id: an index into the runner's cache buffers.
pub type PageId = u32;
/// The reserved, always-zero page used for padding and skipped window entries.
pub const NULL_PAGE: PageId = 0;
const NO_LINK: u32 = u32::MAX;

/// The hash a cached page is registered under, in one cache group.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct PageHash {
    hash: BlockHash,
    group: u32,
}

pub struct PagePool {
    ref_counts: Vec<u32>,
    hashes: Vec<Option<PageHash>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free_queue: Vec<bool>,
    head: u32,
    tail: u32,
    num_in_free_queue: u32,
    /// Per cache group: block hash -> page.
    cached: Vec<HashMap<BlockHash, PageId, BlockHashBuilder>>,
    /// Per page: the runner's bytes may hold a recurrent state (set when the page is handed
    /// out for a state or checkpoint, cleared once a plan lists it in `zero_pages`).
    holds_state: Vec<bool>,
    /// Per page: handed out for a state or checkpoint (vs. for token K/V), while owned.
    state_use: Vec<bool>,
    /// Pages with `holds_state` handed out for token K/V since the last `take_zero_pages`.
    zero_candidates: Vec<PageId>,
}

impl PagePool {
    /// A pool of `num_pages` pages (page 0 included) serving `num_groups` cache groups.
    /// The free queue starts as `1, 2, ..., num_pages - 1`. Fails (instead of aborting the
    /// process) when the host cannot hold the pool's bookkeeping.
    pub fn new(num_pages: u32, num_groups: usize) -> Result<Self, CoreError> {
        let n = num_pages as usize;
        let too_big =
            |_| CoreError::invalid(format!("num_pages = {num_pages}: not enough host memory for the page pool's bookkeeping"));
        let hashes = filled(n, None).map_err(too_big)?; // the largest: fail before filling the rest
        let mut pool = PagePool {
            ref_counts: filled(n, 0).map_err(too_big)?,
            hashes,
            prev: filled(n, NO_LINK).map_err(too_big)?,
            next: filled(n, NO_LINK).map_err(too_big)?,
            in_free_queue: filled(n, false).map_err(too_big)?,
            head: NO_LINK,
            tail: NO_LINK,
            num_in_free_queue: 0,
            // Grows with the cache; a modest start avoids early rehashing without
            // reserving the whole pool once per group.
            cached: (0..num_groups).map(|_| HashMap::with_capacity_and_hasher(n.min(1 << 16), Default::default())).collect(),
            holds_state: filled(n, false).map_err(too_big)?,
            state_use: filled(n, false).map_err(too_big)?,
            zero_candidates: Vec::new(),
        };
        for page in 1..num_pages {
            pool.push_back(page);
        }
        Ok(pool)
    }

    pub fn num_pages(&self) -> u32 {
        self.ref_counts.len() as u32
    }

    /// Pages that can be handed out now: free plus cached-but-idle.
    pub fn num_free_pages(&self) -> u32 {
        self.num_in_free_queue
    }

    /// Fraction of usable pages (page 0 excluded) that are owned, in [0, 1].
    pub fn usage(&self) -> f64 {
        let usable = self.num_pages() - 1;
        if usable == 0 {
            return 0.0;
        }
        f64::from(usable - self.num_in_free_queue) / f64::from(usable)
    }

    pub fn ref_count(&self, page: PageId) -> u32 {
        self.ref_counts[page as usize]
    }

    pub fn is_cached(&self, page: PageId) -> bool {
        self.hashes[page as usize].is_some()
    }

    /// Hands out one page (refcount 1) for token K/V, evicting its hash if it was cached.
    /// A page that last held a recurrent state becomes a `zero_pages` candidate.
    pub fn allocate(&mut self) -> Option<PageId> {
        let page = self.pop_front()?;
        if self.holds_state[page as usize] {
            self.zero_candidates.push(page);
        }
        self.state_use[page as usize] = false;
        Some(page)
    }

    /// Hands out one page (refcount 1) for a recurrent state or checkpoint.
    pub fn allocate_state(&mut self) -> Option<PageId> {
        let page = self.pop_front()?;
        self.holds_state[page as usize] = true;
        self.state_use[page as usize] = true;
        Some(page)
    }

    fn pop_front(&mut self) -> Option<PageId> {
        let page = self.head;
        if page == NO_LINK {
            return None;
        }
        self.unlink(page);
        if let Some(h) = self.hashes[page as usize].take() {
            self.cached[h.group as usize].remove(&h.hash);
        }
        self.ref_counts[page as usize] = 1;
        Some(page)
    }

    /// Appends to `out` the pages the runner must zero before the next forward: pages that
    /// last held a recurrent state and are now owned for token K/V (each once); they no
    /// longer count as holding state. Candidates freed or reused for a state meanwhile are
    /// dropped (they still hold state and are listed if later handed out for tokens).
    pub fn take_zero_pages(&mut self, out: &mut Vec<PageId>) {
        for page in std::mem::take(&mut self.zero_candidates) {
            let i = page as usize;
            if self.ref_counts[i] > 0 && !self.state_use[i] && self.holds_state[i] {
                self.holds_state[i] = false;
                out.push(page);
            }
        }
    }

    /// Marks `pages` as possibly holding state again (a discarded plan's `zero_pages` may
    /// not have been applied).
    pub fn mark_holding_state(&mut self, pages: &[PageId]) {
        for &p in pages {
            self.holds_state[p as usize] = true;
            if self.ref_counts[p as usize] > 0 && !self.state_use[p as usize] {
                self.zero_candidates.push(p);
            }
        }
    }

    /// Takes one more reference to `page` (a prefix hit); revives it if it was idle.
    pub fn touch(&mut self, page: PageId) {
        debug_assert_ne!(page, NULL_PAGE, "the null page is never referenced");
        if self.ref_counts[page as usize] == 0 {
            self.unlink(page);
        }
        self.ref_counts[page as usize] += 1;
    }

    /// Drops one reference. At zero the page joins the free queue: at the back if it is
    /// cached (LRU), at the front otherwise.
    pub fn release(&mut self, page: PageId) {
        debug_assert_ne!(page, NULL_PAGE, "the null page is never released");
        let rc = &mut self.ref_counts[page as usize];
        debug_assert!(*rc > 0, "release of unowned page {page}");
        *rc -= 1;
        if *rc == 0 {
            if self.hashes[page as usize].is_some() {
                self.push_back(page);
            } else {
                self.push_front(page);
            }
        }
    }

    /// The cached page for `hash` in `group`, if any.
    pub fn lookup(&self, group: usize, hash: BlockHash) -> Option<PageId> {
        self.cached[group].get(&hash).copied()
    }

    /// True if `lookup(group, hash)` would return a page that is idle (in the free queue):
    /// taking it costs one free page.
    pub fn is_idle(&self, page: PageId) -> bool {
        self.in_free_queue[page as usize]
    }

    /// Registers an owned, full, computed `page` under `hash` in `group`. If another page
    /// already holds that hash (two requests computed the same prefix), the map keeps
    /// the first and `page` stays unhashed. Returns whether `page` was registered.
    pub fn cache_page(&mut self, page: PageId, group: usize, hash: BlockHash) -> bool {
        debug_assert!(self.ref_counts[page as usize] > 0);
        if self.hashes[page as usize].is_some() || self.cached[group].contains_key(&hash) {
            return false;
        }
        self.cached[group].insert(hash, page);
        self.hashes[page as usize] = Some(PageHash { hash, group: group as u32 });
        true
    }

    /// Forgets every block hash. Idle cached pages become plain free pages (they keep
    /// their place in the queue); owned pages keep running but are no longer hit.
    pub fn reset_prefix_cache(&mut self) {
        for map in &mut self.cached {
            map.clear();
        }
        for h in &mut self.hashes {
            *h = None;
        }
    }

    /// Number of pages registered in the prefix cache (owned or idle).
    pub fn num_cached_pages(&self) -> usize {
        self.cached.iter().map(HashMap::len).sum()
    }

    /// The free queue front to back (eviction order). O(num free pages); for tests.
    pub fn free_queue(&self) -> Vec<PageId> {
        let mut out = Vec::with_capacity(self.num_in_free_queue as usize);
        let mut p = self.head;
        while p != NO_LINK {
            out.push(p);
            p = self.next[p as usize];
        }
        out
    }

    /// Checks every invariant against `owner_counts[p]` = how many page tables hold `p`:
    /// refcounts equal owners; page 0 unowned and never queued; a page is queued iff its
    /// refcount is 0; the queue links are consistent and its length matches; every map
    /// entry points at a page carrying that hash and vice versa.
    pub fn check_integrity(&self, owner_counts: &[u32]) -> Result<(), String> {
        let n = self.num_pages() as usize;
        if owner_counts.len() != n {
            return Err(format!("owner_counts has {} entries, pool has {n}", owner_counts.len()));
        }
        if self.ref_counts[0] != 0 || self.in_free_queue[0] || owner_counts[0] != 0 || self.hashes[0].is_some() {
            return Err("page 0 (null page) is owned, queued or hashed".into());
        }
        let pages = self.ref_counts.iter().zip(owner_counts).zip(&self.in_free_queue).enumerate().skip(1);
        for (p, ((&refs, &owners), &queued)) in pages {
            if refs != owners {
                return Err(format!("page {p}: refcount {refs} but {owners} owners"));
            }
            if (refs == 0) != queued {
                return Err(format!("page {p}: refcount {refs} but in_free_queue={queued}"));
            }
        }
        let queue = self.free_queue();
        if queue.len() != self.num_in_free_queue as usize {
            return Err(format!("free queue walks {} pages, counter says {}", queue.len(), self.num_in_free_queue));
        }
        let mut prev = NO_LINK;
        for &p in &queue {
            if !self.in_free_queue[p as usize] || self.prev[p as usize] != prev {
                return Err(format!("free queue link broken at page {p}"));
            }
            prev = p;
        }
        if self.tail != prev {
            return Err("free queue tail does not match its last page".into());
        }
        let num_free_unowned = (1..n).filter(|&p| self.ref_counts[p] == 0).count();
        if num_free_unowned != queue.len() {
            return Err("pages free + pages owned != pool size - 1".into());
        }
        for (g, map) in self.cached.iter().enumerate() {
            for (hash, &page) in map {
                if self.hashes[page as usize] != Some(PageHash { hash: *hash, group: g as u32 }) {
                    return Err(format!("group {g}: map entry points at page {page} which has another hash"));
                }
            }
        }
        for (p, h) in self.hashes.iter().enumerate() {
            if let Some(h) = h {
                if self.cached[h.group as usize].get(&h.hash) != Some(&(p as u32)) {
                    return Err(format!("page {p} carries a hash missing from the map"));
                }
            }
        }
        Ok(())
    }

    fn push_back(&mut self, page: PageId) {
        let i = page as usize;
        self.prev[i] = self.tail;
        self.next[i] = NO_LINK;
        if self.tail == NO_LINK {
            self.head = page;
        } else {
            self.next[self.tail as usize] = page;
        }
        self.tail = page;
        self.in_free_queue[i] = true;
        self.num_in_free_queue += 1;
    }

    fn push_front(&mut self, page: PageId) {
        let i = page as usize;
        self.next[i] = self.head;
        self.prev[i] = NO_LINK;
        if self.head == NO_LINK {
            self.tail = page;
        } else {
            self.prev[self.head as usize] = page;
        }
        self.head = page;
        self.in_free_queue[i] = true;
        self.num_in_free_queue += 1;
    }

    fn unlink(&mut self, page: PageId) {
        let i = page as usize;
        debug_assert!(self.in_free_queue[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NO_LINK {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NO_LINK {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NO_LINK;
        self.next[i] = NO_LINK;
        self.in_free_queue[i] = false;
        self.num_in_free_queue -= 1;
    }
}

/// `vec![value; n]`, but an allocation failure is an error rather than an abort.
fn filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>, TryReserveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)?;
    v.resize(n, value);
    Ok(v)
}
