//! Admission without a registry: which waiting requests an engine that keeps its own adapter slots
//! (vLLM's `--max-loras`) may offer a step, and in what order. One pure function over ids and counts,
//! so a scheduler outside lora_pin admits by the core's rule instead of a copy of it.
//!
//! The order is the core's ranking ([`rank`], which [`crate::Registry::offer_order`] ranks our own
//! engine's requests by): requests that waited [`Waiting::waited`] steps or more than the age bound
//! (*aged*; oldest first), then those of pinned adapters, then those that need no new slot (the base
//! model's, a running adapter's), then the rest; each rank in the given order.
//!
//! Which ones fit, walking that order ([`admit_waiting`]):
//! - every slot a pin holds is reserved for it, whether its adapter has requests or not;
//! - the adapters of running requests keep their slots;
//! - the slots left go to new adapters, first come in the order;
//! - once an aged request finds no slot, the engine *drains*: later requests are offered only when
//!   they take no slot the step does not already give (the base model's, a pinned adapter's, an
//!   adapter given a slot earlier in this same call); a running adapter's are held too, so the running
//!   requests finish, their slots free up, and the aged request gets one.
//!
//! So no request waits forever: once it is aged and no request older than it is waiting, it is
//! offered within the longest running request's remaining steps plus one (`admission_tests.rs`
//! checks this bound against a plain model).
//!
//! [`admit_rotating`] is the opt-in sibling that *rotates* instead of draining: running requests
//! take part too, and an aged request takes the slot of a running adapter, whose running requests
//! are suspended (they sit steps out, their state kept) until they are aged in turn.
//!
//! Our own engine admits through the registry (`Registry::begin_step`, which counts each adapter's
//! deferrals itself) and holds back with [`crate::StepPlan::startable`]: the ranking is shared, the
//! draining differs (see docs/architecture.md, "Admission").

use std::collections::HashSet;

use crate::error::{Error, Result};

/// What a waiting request costs a step's adapter slots, for [`rank`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Its adapter is pinned: its slot is reserved.
    Pinned,
    /// No new slot: the base model, or an adapter already in a slot.
    Free,
    /// A slot its adapter does not hold yet.
    Slot,
}

/// The rank of a waiting request in the order a step is offered requests, lowest first: aged
/// (`overdue`) before everything, then pinned, then free, then those needing a slot. Ties keep the
/// caller's order. The rule both [`admit_waiting`] and [`crate::Registry::offer_order`] rank by.
pub fn rank(overdue: bool, need: Need) -> u8 {
    if overdue {
        return 0;
    }
    match need {
        Need::Pinned => 1,
        Need::Free => 2,
        Need::Slot => 3,
    }
}

/// One waiting request, for [`admit_waiting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Its adapter's id (`None`: the base model).
    pub adapter: Option<u64>,
    /// How many steps it has waited.
    pub waited: u64,
}

/// The engine's adapter slots as a step begins, for [`admit_waiting`].
#[derive(Debug, Clone, Copy)]
pub struct Slots<'a> {
    /// How many adapters a step may hold at once.
    pub slots: usize,
    /// The adapters of the running requests (each keeps its slot; repeats count once).
    pub running: &'a [u64],
    /// The pinned adapters (each holds a slot, running or not; repeats count once).
    pub pinned: &'a [u64],
    /// After how many steps of waiting a request is aged (at least 1).
    pub age_bound: u64,
}

/// What [`admit_waiting`] decided: indices into the waiting requests, each in exactly one list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Admission {
    /// The requests to offer the step, in the order to offer them.
    pub offered: Vec<u32>,
    /// The requests that wait, in the same order (the first to offer once they fit first).
    pub held: Vec<u32>,
}

/// Which `waiting` requests to offer a step now, in order, and which to hold (module docs). Changes
/// nothing; `O(n log n)` in the waiting requests.
///
/// Errors: [`Error::Usage`] when `age_bound` is 0, the pins leave no slot for other adapters
/// (`pinned` has `slots` distinct ids or more), or there are more than `u32::MAX` requests. Running
/// adapters that already fill the slots are not an error: no new adapter is admitted until they
/// finish.
pub fn admit_waiting(waiting: &[Waiting], slots: &Slots<'_>) -> Result<Admission> {
    if slots.age_bound == 0 {
        return Err(Error::Usage("admit_waiting: the age bound must be at least 1 step (got 0)".into()));
    }
    let pinned: HashSet<u64> = slots.pinned.iter().copied().collect();
    if pinned.len() >= slots.slots {
        return Err(Error::Usage(format!(
            "admit_waiting: {} pinned adapters leave no slot for other adapters (slots: {})",
            pinned.len(),
            slots.slots
        )));
    }
    let count = u32::try_from(waiting.len())
        .map_err(|_| Error::Usage(format!("admit_waiting: {} requests (at most 2^32 - 1)", waiting.len())))?;
    let running: HashSet<u64> = slots.running.iter().copied().filter(|a| !pinned.contains(a)).collect();
    let free = slots.slots - pinned.len() - running.len().min(slots.slots - pinned.len());
    let aged = |w: &Waiting| w.waited >= slots.age_bound;
    let need = |w: &Waiting| match w.adapter {
        Some(a) if pinned.contains(&a) => Need::Pinned,
        Some(a) if !running.contains(&a) => Need::Slot,
        _ => Need::Free,
    };
    let mut order: Vec<u32> = (0..count).collect();
    // Stable, so equal keys keep the given order; aged ones oldest first.
    order.sort_by_key(|&i| {
        let w = &waiting[i as usize];
        let overdue = aged(w);
        (rank(overdue, need(w)), if overdue { u64::MAX - w.waited } else { 0 })
    });
    let mut admission = Admission::default();
    let mut new: HashSet<u64> = HashSet::new();
    let mut draining = false;
    for i in order {
        let w = &waiting[i as usize];
        let fits = match w.adapter {
            None => true,
            Some(a) if pinned.contains(&a) || new.contains(&a) => true,
            Some(_) if draining => false,
            Some(a) if running.contains(&a) => true,
            Some(a) => new.len() < free && new.insert(a),
        };
        if fits {
            admission.offered.push(i);
        } else {
            admission.held.push(i);
            draining |= aged(w);
        }
    }
    Ok(admission)
}

/// One request, running or waiting, for [`admit_rotating`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Its adapter's id (`None`: the base model).
    pub adapter: Option<u64>,
    /// A waiting request: how many steps it has waited. A running one: how many steps since it was
    /// last scheduled (0: scheduled in the previous step).
    pub waited: u64,
    /// Whether it is running (started, holding its KV blocks) rather than waiting.
    pub running: bool,
}

/// The engine's adapter slots, for [`admit_rotating`].
#[derive(Debug, Clone, Copy)]
pub struct Rotating<'a> {
    /// How many adapters a step may hold at once.
    pub slots: usize,
    /// The pinned adapters (each holds a slot, with requests or not; repeats count once).
    pub pinned: &'a [u64],
    /// After how many steps of waiting (or of sitting out) a request is aged (at least 1).
    pub age_bound: u64,
}

/// What [`admit_rotating`] decided: indices into the candidates, each in exactly one list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rotation {
    /// The requests, running or waiting, the step may schedule, in rank order.
    pub offered: Vec<u32>,
    /// The waiting requests whose adapter finds no slot: they keep waiting, in rank order.
    pub held: Vec<u32>,
    /// The running requests whose adapter finds no slot: they sit this step out (their KV blocks
    /// stay), in rank order.
    pub suspended: Vec<u32>,
}

/// Admission with rotation: which requests, running ones included, a step may schedule, so that an
/// adapter that waited past the age bound takes the slot of a running one. Changes nothing;
/// `O(n log n)` in the candidates.
///
/// Every candidate is ranked by [`rank`]: aged (waited `age_bound` steps or more, running or
/// waiting; oldest first), then pinned adapters', then those needing no new slot (the base model's,
/// and those of an adapter *in a slot*: one with a running request scheduled in the previous step,
/// `waited == 0`), then the rest; ties in the given order. Walking that order, a candidate's adapter
/// fits if it is the base model, pinned, already given a slot in this call, or if fewer than
/// `slots - pins` unpinned adapters have been given one; the running ones that do not fit are
/// suspended, the waiting ones held.
///
/// Guarantees (checked against a plain model in `admission_rotating_tests.rs`):
/// - a pinned adapter's requests and the base model's are always offered;
/// - the offered requests use at most `slots - pins` distinct unpinned adapters;
/// - with no aged candidate, every running request scheduled in the previous step is offered (no
///   churn), as long as their unpinned adapters fit in `slots - pins` (they do unless a pin was
///   added while they ran);
/// - *bound*: if each offered request is scheduled in its step, no candidate of an unpinned adapter
///   waits more than `age_bound + d / (slots - pins)` steps (integer division), where `d` counts the
///   other unpinned adapters with candidates in flight when it ages: each step that passes an aged
///   candidate over gives every free slot to an adapter with a candidate ranked ahead of it (older,
///   or as old and given first), that adapter's candidates are all offered in that step (an adapter
///   given a slot takes all of them), and their waits then restart below its own, so each of the
///   `d` adapters passes it at most once.
///
/// Errors: [`Error::Usage`] when `age_bound` is 0, the pins leave no slot for other adapters
/// (`pinned` has `slots` distinct ids or more), or there are more than `u32::MAX` candidates.
pub fn admit_rotating(candidates: &[Candidate], slots: &Rotating<'_>) -> Result<Rotation> {
    if slots.age_bound == 0 {
        return Err(Error::Usage("admit_rotating: the age bound must be at least 1 step (got 0)".into()));
    }
    let pinned: HashSet<u64> = slots.pinned.iter().copied().collect();
    if pinned.len() >= slots.slots {
        return Err(Error::Usage(format!(
            "admit_rotating: {} pinned adapters leave no slot for other adapters (slots: {})",
            pinned.len(),
            slots.slots
        )));
    }
    let count = u32::try_from(candidates.len()).map_err(|_| {
        Error::Usage(format!("admit_rotating: {} requests (at most 2^32 - 1)", candidates.len()))
    })?;
    let free = slots.slots - pinned.len();
    // Adapters in a slot: scheduled in the previous step through one of their running requests.
    let in_slot: HashSet<u64> = candidates
        .iter()
        .filter(|c| c.running && c.waited == 0)
        .filter_map(|c| c.adapter)
        .filter(|a| !pinned.contains(a))
        .collect();
    let aged = |c: &Candidate| c.waited >= slots.age_bound;
    let need = |c: &Candidate| match c.adapter {
        Some(a) if pinned.contains(&a) => Need::Pinned,
        Some(a) if !in_slot.contains(&a) => Need::Slot,
        _ => Need::Free,
    };
    let mut order: Vec<u32> = (0..count).collect();
    // Stable, so equal keys keep the given order; aged ones oldest first.
    order.sort_by_key(|&i| {
        let c = &candidates[i as usize];
        let overdue = aged(c);
        (rank(overdue, need(c)), if overdue { u64::MAX - c.waited } else { 0 })
    });
    let mut rotation = Rotation::default();
    let mut given: HashSet<u64> = HashSet::new();
    for i in order {
        let c = &candidates[i as usize];
        let fits = match c.adapter {
            None => true,
            Some(a) if pinned.contains(&a) || given.contains(&a) => true,
            Some(a) => given.len() < free && given.insert(a),
        };
        match (fits, c.running) {
            (true, _) => rotation.offered.push(i),
            (false, true) => rotation.suspended.push(i),
            (false, false) => rotation.held.push(i),
        }
    }
    Ok(rotation)
}

#[cfg(test)]
#[path = "admission_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "admission_rotating_tests.rs"]
mod rotating_tests;
