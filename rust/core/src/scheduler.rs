//! The scheduler: which requests compute how many tokens this step.
//!
//! One rule, no phases: every request has `num_computed_tokens` and `num_tokens()`,
//! and each step hands out a token budget (`max_num_batched_tokens`) so the former
//! catches up with the latter. Running requests are served first, in order (decodes
//! and unfinished prefill chunks alike), then waiting requests are admitted while
//! budget, `max_num_seqs` and free pages allow; a long prompt gets a chunk of what is
//! left (chunked prefill).
//!
//! When a running request cannot get pages, the scheduler preempts by recompute: the
//! newest running request (FCFS) or the lowest-priority one (priority policy) loses
//! its pages (tail first, so its cached prefix survives) and goes back to waiting. No
//! waiting request is admitted in a step that preempted. Under FCFS the oldest request
//! is never the victim while another runs, so every request finishes: nothing starves.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::cache_manager::KvCacheManager;
use crate::metrics::Metrics;
use crate::plan::ScheduledRow;
use crate::request::{Request, RequestStatus};
use crate::runner_slots::RunnerSlots;

/// Which request goes first.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served; the newest running request is preempted first.
    Fcfs,
    /// Lowest `priority` value first (ties by arrival); the highest value is preempted first.
    Priority,
}

/// Limits the scheduler works under.
#[derive(Clone, Debug)]
pub struct SchedulerLimits {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub policy: SchedulingPolicy,
}

pub struct Scheduler {
    pub limits: SchedulerLimits,
    pub kv: KvCacheManager,
    /// Request table; `None` entries are free indices.
    pub requests: Vec<Option<Request>>,
    free_indices: Vec<usize>,
    pub index_of: HashMap<String, usize>,
    /// Waiting requests in service order.
    pub waiting: VecDeque<usize>,
    /// Running requests in admission order.
    pub running: Vec<usize>,
    /// Runner slots and their lifecycle notices (assigned on admission, released when a
    /// request leaves `running`).
    pub slots: RunnerSlots,
    /// Checkpoints due (prefix caching with recurrent groups): (request index, its
    /// `arrival_seq`, full pages computed) for requests whose last committed chunk ended on
    /// a page boundary. Started by the next `schedule` with rows.
    pub checkpoints_due: Vec<(usize, u64, u32)>,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits, kv: KvCacheManager) -> Self {
        // A running request holds at least one page of its own (a compressed-only engine's
        // until its first entry closes excepted), so no more than num_pages - 1 run at once
        // whatever max_num_seqs says: that bounds the slot table (and admission).
        let num_slots = limits.max_num_seqs.min(kv.pool.num_pages() - 1);
        Scheduler {
            slots: RunnerSlots::new(num_slots),
            limits,
            kv,
            requests: Vec::new(),
            free_indices: Vec::new(),
            index_of: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            checkpoints_due: Vec::new(),
        }
    }

    pub fn request(&self, idx: usize) -> &Request {
        self.requests[idx].as_ref().expect("live request index")
    }

    pub fn request_mut(&mut self, idx: usize) -> &mut Request {
        self.requests[idx].as_mut().expect("live request index")
    }

    /// Stores a new request and queues it.
    pub fn add(&mut self, req: Request) {
        let id = req.id().to_string();
        let idx = match self.free_indices.pop() {
            Some(i) => {
                self.requests[i] = Some(req);
                i
            }
            None => {
                self.requests.push(Some(req));
                self.requests.len() - 1
            }
        };
        self.index_of.insert(id, idx);
        self.enqueue_waiting(idx, false);
    }

    /// Removes a request (finished or aborted): frees its pages and slot.
    pub fn remove(&mut self, idx: usize) -> Request {
        match self.request(idx).status {
            RequestStatus::Waiting => self.waiting.retain(|&i| i != idx),
            RequestStatus::Running => self.running.retain(|&i| i != idx),
        }
        self.release_resources(idx);
        let req = self.requests[idx].take().expect("live request index");
        self.index_of.remove(req.id());
        self.free_indices.push(idx);
        req
    }

    fn release_resources(&mut self, idx: usize) {
        let req = self.requests[idx].as_mut().expect("live request index");
        self.kv.free(req);
        if let Some(slot) = req.slot.take() {
            self.slots.release(slot);
        }
    }

    fn enqueue_waiting(&mut self, idx: usize, preempted: bool) {
        match self.limits.policy {
            SchedulingPolicy::Fcfs if preempted => self.waiting.push_front(idx),
            SchedulingPolicy::Fcfs => self.waiting.push_back(idx),
            SchedulingPolicy::Priority => {
                let key = self.priority_key(idx);
                let pos = self.waiting.partition_point(|&i| self.priority_key(i) < key);
                self.waiting.insert(pos, idx);
            }
        }
    }

    fn priority_key(&self, idx: usize) -> (i32, u64) {
        let r = self.request(idx);
        (r.params.priority, r.arrival_seq)
    }

    /// Index into `running` of the request to preempt next.
    fn pick_victim(&self) -> usize {
        match self.limits.policy {
            SchedulingPolicy::Fcfs => self.running.len() - 1,
            SchedulingPolicy::Priority => {
                (0..self.running.len()).max_by_key(|&i| self.priority_key(self.running[i])).expect("running is not empty")
            }
        }
    }

    /// Preempts `running[pos]` by recompute.
    fn preempt(&mut self, pos: usize, metrics: &mut Metrics) {
        self.requeue(pos);
        metrics.num_preemptions += 1;
    }

    /// Frees `running[pos]`'s pages and slot and puts it back to waiting, to recompute.
    fn requeue(&mut self, pos: usize) {
        let idx = self.running.remove(pos);
        self.release_resources(idx);
        let req = self.request_mut(idx);
        req.num_computed_tokens = 0;
        req.drafts.clear();
        req.restore_states = false;
        req.status = RequestStatus::Waiting;
        self.enqueue_waiting(idx, true);
    }

    /// Sends running request `idx` back to recompute (not counted as a preemption): after a
    /// discarded plan, whose forward may have advanced its recurrent state in place.
    pub fn restart(&mut self, idx: usize) {
        if let Some(pos) = self.running.iter().position(|&i| i == idx) {
            self.requeue(pos);
        }
    }

    /// Picks this step's rows, decode rows first. Returns (rows, number of decode rows).
    pub fn schedule(&mut self, now: Instant, metrics: &mut Metrics) -> (Vec<ScheduledRow>, u32) {
        let mut budget = self.limits.max_num_batched_tokens;
        let mut rows: Vec<ScheduledRow> = Vec::with_capacity(self.running.len());
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let idx = self.running[i];
            let req = self.requests[idx].as_mut().expect("live request index");
            let num_new = (req.num_tokens() - req.num_computed_tokens).min(budget);
            let num_new = self.kv.cut_chunk(req, req.num_computed_tokens, num_new);
            // A decoding request with drafts verifies them in the same row, as far as the
            // budget allows (the one rule: its 1 + k tokens count like any others).
            let decoding = req.num_computed_tokens + 1 == req.num_tokens();
            let mut num_drafts = if decoding { (req.drafts.len() as u32).min(budget - num_new) } else { 0 };
            // Short of pages for the drafts: decode without them before preempting anyone.
            if num_drafts > 0 && !self.kv.allocate(req, num_new + num_drafts) {
                num_drafts = 0;
            }
            if num_drafts > 0 || self.kv.allocate(req, num_new) {
                if req.restore_states {
                    req.restore_states = false;
                    self.kv.copy_spare_states(req, false);
                }
                if num_drafts > 0 && self.kv.spare_states {
                    self.kv.copy_spare_states(req, true);
                }
                rows.push(ScheduledRow { req: idx, num_new_tokens: num_new + num_drafts, num_drafts });
                budget -= num_new + num_drafts;
                i += 1;
                continue;
            }
            let victim = self.pick_victim();
            let victim_idx = self.running[victim];
            if victim < i {
                // Already scheduled this step (priority policy): give its tokens back.
                let row = rows.iter().position(|r| r.req == victim_idx).expect("scheduled victim has a row");
                budget += rows.remove(row).num_new_tokens;
                i -= 1;
            }
            self.preempt(victim, metrics);
            preempted = true;
        }

        // The slot table bounds running requests too: in an engine of compressed groups only,
        // a request holds no page until its first entry closes.
        let max_running = self.slots.num_slots();
        while !preempted && budget > 0 && self.running.len() < max_running {
            let Some(&idx) = self.waiting.front() else { break };
            let req = self.requests[idx].as_mut().expect("live request index");
            let hit = self.kv.find_prefix_hit(req);
            let num_hit = hit.num_tokens;
            let num_new = self.kv.cut_chunk(req, num_hit, (req.num_tokens() - num_hit).min(budget));
            if !self.kv.admit(req, hit, num_new) {
                break;
            }
            if !req.prefix_queried {
                req.prefix_queried = true;
                req.num_cached_tokens = num_hit;
                if self.kv.enable_prefix_caching {
                    metrics.prefix_cache_queries_tokens += u64::from(req.num_tokens());
                    metrics.prefix_cache_hits_tokens += u64::from(num_hit);
                }
            }
            if req.first_scheduled_time.is_none() {
                req.first_scheduled_time = Some(now);
                metrics.request_queue_time_s.observe(now.duration_since(req.arrival_time).as_secs_f64());
            }
            let slot = self.slots.assign().expect("max_num_seqs bounds running requests");
            req.slot = Some(slot);
            // The slot's announcement (`new_request_token_ids`) carries every token so far.
            req.num_tokens_shown = req.num_tokens();
            req.status = RequestStatus::Running;
            self.waiting.pop_front();
            self.running.push(idx);
            rows.push(ScheduledRow { req: idx, num_new_tokens: num_new, num_drafts: 0 });
            budget -= num_new;
        }

        if !rows.is_empty() && !self.checkpoints_due.is_empty() {
            self.start_checkpoints();
        }

        // Decode rows (one new token that is sampled) first, each part in schedule order.
        let is_decode = |r: &ScheduledRow| {
            let req = self.request(r.req);
            r.num_new_tokens == 1 && req.num_computed_tokens + 1 == req.num_tokens()
        };
        // A stable sort on one flag per row: each request is looked at once.
        let mut keyed: Vec<(bool, ScheduledRow)> = rows.into_iter().map(|r| (!is_decode(&r), r)).collect();
        keyed.sort_by_key(|&(is_prefill, _)| is_prefill);
        let num_decode = keyed.iter().take_while(|(is_prefill, _)| !is_prefill).count() as u32;
        (keyed.into_iter().map(|(_, r)| r).collect(), num_decode)
    }

    /// Starts the due checkpoints with the pages left after this step's rows (a checkpoint
    /// never takes pages a row needs). Skipped for a request preempted since (its state is
    /// gone) or that finished.
    fn start_checkpoints(&mut self) {
        let ps = self.kv.page_size();
        for (idx, arrival_seq, num_blocks) in std::mem::take(&mut self.checkpoints_due) {
            let Some(Some(req)) = self.requests.get(idx) else { continue };
            let same = req.arrival_seq == arrival_seq
                && req.status == RequestStatus::Running
                && req.num_computed_tokens == num_blocks * ps;
            if same {
                self.kv.start_checkpoint(req, num_blocks);
            }
        }
    }

    /// Page owners per page id (for integrity checks): how many page-table entries (and
    /// in-flight checkpoints) hold each page.
    pub fn page_owner_counts(&self) -> Vec<u32> {
        self.page_owners().map(|(counts, _)| counts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// (owner counts, owning group per page); fails if a page is owned by two groups.
    fn page_owners(&self) -> Result<(Vec<u32>, Vec<u32>), String> {
        let n = self.kv.pool.num_pages() as usize;
        let mut counts = vec![0u32; n];
        let mut group_of = vec![u32::MAX; n];
        let mut own = |p: u32, g: usize| -> Result<(), String> {
            if p == 0 {
                return Ok(());
            }
            counts[p as usize] += 1;
            let slot = &mut group_of[p as usize];
            if *slot != u32::MAX && *slot != g as u32 {
                return Err(format!("page {p} is owned by groups {} and {g}", *slot));
            }
            *slot = g as u32;
            Ok(())
        };
        for req in self.requests.iter().flatten() {
            for (g, pages) in req.pages.iter().enumerate() {
                for &p in pages {
                    own(p, g)?;
                }
            }
        }
        for ck in &self.kv.in_flight_checkpoints {
            for &p in &ck.pages {
                own(p, ck.group)?;
            }
        }
        Ok((counts, group_of))
    }

    /// Scheduler-level invariants on top of the pool's own.
    pub fn check_integrity(&self) -> Result<(), String> {
        let (counts, _) = self.page_owners()?;
        self.kv.pool.check_integrity(&counts)?;
        let num_live = self.requests.iter().flatten().count();
        if num_live != self.waiting.len() + self.running.len() || num_live != self.index_of.len() {
            return Err(format!(
                "{num_live} live requests but {} waiting + {} running, {} ids",
                self.waiting.len(),
                self.running.len(),
                self.index_of.len()
            ));
        }
        let mut slots_in_use: Vec<u32> = Vec::with_capacity(self.running.len());
        for &idx in &self.running {
            let r = self.request(idx);
            let slot = r.slot.ok_or_else(|| format!("running request {} has no slot", r.id()))?;
            slots_in_use.push(slot);
            let ps = self.kv.page_size();
            for (g, pages) in r.pages.iter().enumerate() {
                let group = &self.kv.layout.groups[g];
                if group.is_recurrent() {
                    if pages.len() as u32 != self.kv.state_pages(g) || pages.contains(&0) {
                        return Err(format!("request {}: group {g} does not hold exactly one state", r.id()));
                    }
                    continue;
                }
                if (pages.len() as u32) < group.spec.num_entries(r.num_computed_tokens).div_ceil(group.spec.entries_per_page(ps))
                {
                    return Err(format!("request {}: group {g} has too few pages for its computed tokens", r.id()));
                }
                if pages[r.num_released_pages[g] as usize..].contains(&0) {
                    return Err(format!("request {}: group {g} holds the null page inside its window", r.id()));
                }
            }
        }
        for &idx in &self.waiting {
            let r = self.request(idx);
            if r.slot.is_some() || r.pages.iter().any(|p| !p.is_empty()) || r.num_computed_tokens != 0 {
                return Err(format!("waiting request {} holds a slot, pages or computed tokens", r.id()));
            }
        }
        self.slots.check_integrity(&slots_in_use)
    }
}
