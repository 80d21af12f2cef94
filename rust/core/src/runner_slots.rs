//! Runner slots: the stable row each running request's per-request runner state lives in,
//! and the lifecycle diff (`new_request_slots`, `finished_request_slots`) that tells the
//! runner when a slot starts or stops serving a request.
//!
//! ```text
//!   free ──assign()──► assigned ──release()──► free
//!            │                      │
//!            ▼                      ▼
//!      `new` notices        `finished` notices   ──take_diff()──► in flight (one plan)
//!                                                  ├─commit()──────────────► delivered
//!                                                  └─resend_after_discard()─► queued again
//! ```
//!
//! A notice is delivered once a plan carrying it is committed. A plan that is discarded
//! may or may not have reached the runner, so its notices are queued again, and a slot it
//! announced counts as known to the runner: if that slot is released before a committed
//! plan announces it again, its release is still reported. A slot assigned and released
//! before any plan announced it produces no notice at all.

/// The slot table of one scheduler and the lifecycle notices not yet delivered.
#[derive(Clone, Debug)]
pub struct RunnerSlots {
    /// Unused slots; popped from the back, so the lowest slot is handed out first.
    free: Vec<u32>,
    /// Per slot: serving a request now.
    assigned: Vec<bool>,
    /// Slots assigned and not yet announced by a taken diff, in assignment order.
    new: Vec<u32>,
    /// Slots released and not yet reported by a taken diff, in release order.
    released: Vec<u32>,
    /// Per slot: a discarded plan announced it, so the runner may hold state for it.
    announced: Vec<bool>,
    /// The diff riding on the pending plan, until it is committed or discarded.
    in_flight: Option<SlotDiff>,
}

/// One plan's lifecycle notices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotDiff {
    /// Slots that start serving a request with this plan.
    pub new: Vec<u32>,
    /// Slots whose request finished, was aborted or preempted (apply before `new`).
    pub finished: Vec<u32>,
}

impl RunnerSlots {
    /// `num_slots` free slots, `0..num_slots`.
    pub fn new(num_slots: u32) -> Self {
        RunnerSlots {
            free: (0..num_slots).rev().collect(),
            assigned: vec![false; num_slots as usize],
            new: Vec::new(),
            released: Vec::new(),
            announced: vec![false; num_slots as usize],
            in_flight: None,
        }
    }

    pub fn num_slots(&self) -> usize {
        self.assigned.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Whether `slot` serves a request now.
    pub fn is_assigned(&self, slot: u32) -> bool {
        self.assigned.get(slot as usize).copied().unwrap_or(false)
    }

    /// Takes the lowest free slot for a new request; `None` when every slot is in use.
    pub fn assign(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        self.assigned[slot as usize] = true;
        self.new.push(slot);
        Some(slot)
    }

    /// Frees `slot` (its request finished, was aborted or preempted). Its release is
    /// reported unless no plan ever announced it.
    pub fn release(&mut self, slot: u32) {
        let s = slot as usize;
        if !self.assigned[s] {
            debug_assert!(false, "runner slot {slot} released twice");
            return;
        }
        self.assigned[s] = false;
        let announced = std::mem::replace(&mut self.announced[s], false);
        match self.new.iter().position(|&n| n == slot) {
            // Never announced: the runner need not hear of it.
            Some(pos) if !announced => {
                self.new.remove(pos);
            }
            Some(pos) => {
                self.new.remove(pos);
                self.queue_release(slot);
            }
            None => self.queue_release(slot),
        }
        self.free.push(slot);
    }

    /// Queues `slot`'s release notice, once: a release still queued (a discarded plan's,
    /// re-sent) already tells the runner to drop the slot's state, and it applies before any
    /// `new` notice of the same plan.
    fn queue_release(&mut self, slot: u32) {
        if !self.released.contains(&slot) {
            self.released.push(slot);
        }
    }

    /// The notices for the plan being built; they are in flight until `commit` or
    /// `resend_after_discard`. Only plans that reach a runner (plans with rows) take them.
    pub fn take_diff(&mut self) -> SlotDiff {
        debug_assert!(self.in_flight.is_none(), "one plan in flight at a time");
        let diff = SlotDiff { new: std::mem::take(&mut self.new), finished: std::mem::take(&mut self.released) };
        self.in_flight = Some(diff.clone());
        diff
    }

    /// The plan carrying the in-flight diff was committed: the runner has seen it for good.
    /// A no-op when no diff is in flight (an empty plan was committed).
    pub fn commit(&mut self) {
        if let Some(diff) = self.in_flight.take() {
            for &slot in &diff.new {
                self.announced[slot as usize] = false;
            }
        }
    }

    /// The plan carrying the in-flight diff was discarded: queue its notices again, ahead
    /// of newer ones. Its new slots that still serve their request count as announced;
    /// those released meanwhile already have their release queued.
    pub fn resend_after_discard(&mut self) {
        let Some(diff) = self.in_flight.take() else { return };
        let mut new: Vec<u32> = diff.new.into_iter().filter(|&s| self.assigned[s as usize]).collect();
        for &slot in &new {
            self.announced[slot as usize] = true;
        }
        new.append(&mut self.new);
        self.new = new;
        let queued = std::mem::replace(&mut self.released, diff.finished);
        for slot in queued {
            self.queue_release(slot);
        }
    }

    /// `held` (the slots running requests hold) must be exactly the assigned slots, each once.
    pub fn check_integrity(&self, held: &[u32]) -> Result<(), String> {
        let mut seen = vec![false; self.num_slots()];
        for &slot in held {
            let s = slot as usize;
            if s >= seen.len() || seen[s] || !self.assigned[s] {
                return Err(format!("runner slot {slot} is shared, out of range or not assigned"));
            }
            seen[s] = true;
        }
        let num_assigned = self.assigned.iter().filter(|&&a| a).count();
        if num_assigned != held.len() || num_assigned + self.free.len() != self.num_slots() {
            return Err(format!(
                "runner slots are lost: {} held, {num_assigned} assigned, {} free of {}",
                held.len(),
                self.free.len(),
                self.num_slots()
            ));
        }
        if self.free.iter().any(|&s| self.assigned[s as usize]) {
            return Err("a free runner slot is also assigned".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diff(new: &[u32], finished: &[u32]) -> SlotDiff {
        SlotDiff { new: new.to_vec(), finished: finished.to_vec() }
    }

    #[test]
    fn slots_are_handed_out_lowest_first_and_reused() {
        let mut slots = RunnerSlots::new(3);
        assert_eq!((slots.assign(), slots.assign()), (Some(0), Some(1)));
        assert_eq!(slots.take_diff(), diff(&[0, 1], &[]));
        slots.commit();
        slots.release(0);
        assert_eq!(slots.assign(), Some(0), "a released slot is reused first");
        assert_eq!(slots.assign(), Some(2));
        assert_eq!(slots.assign(), None, "all three in use");
        assert_eq!(slots.take_diff(), diff(&[0, 2], &[0]), "finished notices apply before new ones");
        slots.commit();
        slots.check_integrity(&[0, 1, 2]).unwrap();
        assert_eq!(slots.num_free(), 0);
    }

    #[test]
    fn a_slot_released_before_any_plan_announced_it_gives_no_notice() {
        let mut slots = RunnerSlots::new(2);
        let s = slots.assign().unwrap();
        slots.release(s);
        assert_eq!(slots.take_diff(), SlotDiff::default());
        slots.commit();
        slots.check_integrity(&[]).unwrap();
    }

    #[test]
    fn a_discarded_plan_re_sends_its_notices_first() {
        let mut slots = RunnerSlots::new(4);
        let a = slots.assign().unwrap();
        let b = slots.assign().unwrap();
        slots.take_diff();
        slots.commit();
        slots.release(a);
        let c = slots.assign().unwrap();
        assert_eq!(slots.take_diff(), diff(&[c], &[a]));
        slots.resend_after_discard();
        let d = slots.assign().unwrap();
        slots.release(b);
        assert_eq!(slots.take_diff(), diff(&[c, d], &[a, b]), "re-sent notices come first");
        slots.commit();
        slots.check_integrity(&[c, d]).unwrap();
    }

    #[test]
    fn a_slot_announced_by_a_discarded_plan_reports_its_release() {
        let mut slots = RunnerSlots::new(2);
        let s = slots.assign().unwrap();
        assert_eq!(slots.take_diff(), diff(&[s], &[]));
        slots.resend_after_discard(); // the runner may have seen slot s
        slots.release(s);
        assert_eq!(slots.take_diff(), diff(&[], &[s]));
        slots.commit();
        // Once a committed plan announced it, a later release is an ordinary one.
        let s = slots.assign().unwrap();
        slots.take_diff();
        slots.resend_after_discard();
        assert_eq!(slots.take_diff(), diff(&[s], &[]));
        slots.commit();
        slots.release(s);
        assert_eq!(slots.take_diff(), diff(&[], &[s]));
        slots.commit();
    }

    #[test]
    fn a_slot_released_while_its_plan_is_in_flight_is_reported_not_re_announced() {
        let mut slots = RunnerSlots::new(2);
        let s = slots.assign().unwrap();
        slots.take_diff();
        slots.release(s); // abort while the plan is pending
        slots.resend_after_discard();
        assert_eq!(slots.take_diff(), diff(&[], &[s]));
        slots.commit();
        slots.check_integrity(&[]).unwrap();
    }

    #[test]
    fn committing_with_no_diff_in_flight_keeps_queued_notices() {
        let mut slots = RunnerSlots::new(2);
        let s = slots.assign().unwrap();
        slots.take_diff();
        slots.resend_after_discard();
        slots.commit(); // an empty plan: nothing was in flight
        slots.resend_after_discard(); // likewise a no-op
        slots.release(s);
        assert_eq!(slots.take_diff(), diff(&[], &[s]), "still counts as announced");
    }

    #[test]
    fn discarding_twice_announces_once() {
        let mut slots = RunnerSlots::new(2);
        let s = slots.assign().unwrap();
        for _ in 0..2 {
            assert_eq!(slots.take_diff(), diff(&[s], &[]));
            slots.resend_after_discard();
        }
        slots.release(s);
        assert_eq!(slots.take_diff(), diff(&[], &[s]));
        slots.commit();
        let t = slots.assign().unwrap();
        assert_eq!(t, s);
        slots.release(t);
        assert_eq!(slots.take_diff(), SlotDiff::default(), "the reused slot was never announced");
    }

    #[test]
    fn a_slot_restarted_by_every_discard_is_released_once() {
        // A recurrent-cache engine restarts a discarded plan's requests: the slot is released
        // and taken again before each retry, which must not pile up release notices.
        let mut slots = RunnerSlots::new(2);
        assert_eq!(slots.assign(), Some(0));
        slots.take_diff();
        slots.commit();
        for _ in 0..4 {
            slots.take_diff();
            slots.resend_after_discard();
            slots.release(0);
            assert_eq!(slots.assign(), Some(0));
        }
        assert_eq!(slots.take_diff(), diff(&[0], &[0]), "one release, then the slot anew");
    }

    #[test]
    fn integrity_catches_shared_and_lost_slots() {
        let mut slots = RunnerSlots::new(3);
        let a = slots.assign().unwrap();
        let b = slots.assign().unwrap();
        assert!(slots.check_integrity(&[a, a]).is_err(), "shared");
        assert!(slots.check_integrity(&[a]).is_err(), "b is lost");
        assert!(slots.check_integrity(&[a, 2]).is_err(), "2 is not assigned");
        assert!(slots.check_integrity(&[a, 7]).is_err(), "out of range");
        slots.check_integrity(&[b, a]).unwrap();
    }
}
