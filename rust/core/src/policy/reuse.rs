//! Reuse distance: evict the candidate whose next use is predicted furthest away, predicting from
//! how long the adapter went between its last two uses (its inter-reference recency, IRR) and how
//! long it has gone unused since (its recency), whichever is larger.
//!
//! This is the quantity LIRS ranks blocks by (S. Jiang and X. Zhang, "LIRS: An Efficient Low
//! Inter-reference Recency Set Replacement Policy to Improve Buffer Cache Performance", SIGMETRICS
//! 2002): an adapter reused at short distances is kept however recently another was loaded, so a
//! cyclic sweep longer than the tier (which makes LRU and FIFO miss every time) keeps the adapters it
//! holds instead of churning, and a newly loaded adapter with no reuse history is the first to go,
//! so one-off requests never push out the hot set. Recency ages the estimate: an adapter whose burst
//! ended, or whose popularity drifted away, stops being protected once it has gone unused for longer
//! than the other candidates' reuse distances.
//!
//! Compared with LIRS itself this keeps no stack and no ghost list: the policy remembers, per
//! adapter it has ever held, the time and count of its last use (the registry's logical clock and
//! use counter, so uses that happen while another policy instance holds the adapter are still seen),
//! and ranks candidates by `max(IRR, recency)` in quarter-octave classes (distances within ~19% of
//! each other tie), ties going to the most recently used candidate — the one LIRS would hold as a
//! high-IRR "resident HIR" block. The largest `max(IRR, recency)` is attained either by the largest
//! IRR or by the oldest use, so two ordered sets give the victim in O(log n).

use std::collections::BTreeSet;

use super::{AdapterKey, EvictionPolicy, Usage};

/// The class of a distance nobody has measured yet (a single use): the furthest.
const UNKNOWN: u32 = u32::MAX;

/// `floor(4 * log2(d))` for `d >= 1` (0 for 0): distances in quarter-octave classes.
pub(super) fn class(d: u64) -> u32 {
    if d == 0 {
        return 0;
    }
    let octave = 63 - d.leading_zeros();
    let quarter = if octave >= 2 { (d >> (octave - 2)) & 3 } else { (d << (2 - octave)) & 3 };
    octave * 4 + quarter as u32
}

/// What the policy remembers of an adapter.
#[derive(Debug, Clone, Copy)]
struct History {
    uses: u64,
    last_used: u64,
    irr: u32,
    candidate: bool,
}

/// Largest `max(IRR, recency)` first; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct ReuseDistance {
    history: Vec<Option<History>>,
    by_irr: BTreeSet<(u32, u64, AdapterKey)>,
    by_recency: BTreeSet<(u64, AdapterKey)>,
    now: u64,
}

impl ReuseDistance {
    fn entry(&self, key: AdapterKey) -> History {
        self.history[key.index()].expect("a known key")
    }

    fn rank(&self, h: &History) -> u32 {
        h.irr.max(class(self.now.saturating_sub(h.last_used)))
    }
}

impl EvictionPolicy for ReuseDistance {
    fn name(&self) -> &'static str {
        "reuse"
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        if self.history.len() <= key.index() {
            self.history.resize(key.index() + 1, None);
        }
        let irr = match self.history[key.index()] {
            Some(h) if h.uses < usage.uses => {
                class(usage.last_used.saturating_sub(h.last_used) / (usage.uses - h.uses))
            }
            // Same uses: back from a protection without a new use. Fewer: the key was reused.
            Some(h) if h.uses == usage.uses && h.last_used == usage.last_used => h.irr,
            _ => UNKNOWN,
        };
        let h = History { uses: usage.uses, last_used: usage.last_used, irr, candidate: true };
        assert!(
            !self.history[key.index()].is_some_and(|old| old.candidate),
            "{key:?} is already a candidate"
        );
        self.history[key.index()] = Some(h);
        self.now = self.now.max(usage.last_used).max(usage.inserted_at);
        self.by_irr.insert((irr, h.last_used, key));
        self.by_recency.insert((h.last_used, key));
    }

    fn remove(&mut self, key: AdapterKey) {
        let h = self.history.get(key.index()).copied().flatten().filter(|h| h.candidate);
        let h = h.unwrap_or_else(|| panic!("{key:?} is not a candidate"));
        self.by_irr.remove(&(h.irr, h.last_used, key));
        self.by_recency.remove(&(h.last_used, key));
        self.history[key.index()] = Some(History { candidate: false, ..h });
    }

    fn victim(&self) -> Option<AdapterKey> {
        let &(_, _, by_irr) = self.by_irr.last()?;
        let &(_, oldest) = self.by_recency.first()?;
        let (a, b) = (self.entry(by_irr), self.entry(oldest));
        Some(if self.rank(&b) > self.rank(&a) { oldest } else { by_irr })
    }

    fn len(&self) -> usize {
        self.by_recency.len()
    }
}

#[cfg(test)]
#[path = "reuse_tests.rs"]
mod tests;
