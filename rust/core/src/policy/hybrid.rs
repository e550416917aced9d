//! Reuse distance with a capped use count: `reuse`'s ranking (see [`super::ReuseDistance`]), made
//! frequency-aware, with newly loaded adapters protected by recency while the workload shows that
//! evicting them early costs a reload soon after.
//!
//! A candidate's rank is `max(IRR, recency) - WEIGHT * min(F, CAP)`, in `reuse`'s quarter-octave
//! classes: IRR and recency as in LIRS (S. Jiang and X. Zhang, SIGMETRICS 2002), F the number of
//! steps that used the adapter since it entered this tier, capped as in LFU-Aging's `F_max`
//! (M. Arlitt, L. Cherkasova, J. Dilley, R. Friedrich and T. Jin, "Evaluating content management
//! techniques for Web proxy caches", 2000). The largest rank goes first; ties go to the most recently
//! used candidate (so the adapters a cyclic sweep holds stay, as in `reuse`). Each counted use is
//! worth two octaves of distance, so an adapter reused often is kept through one long gap, and the
//! cap lets a formerly hot adapter age out once its recency has grown eight octaves past the others.
//!
//! A newcomer (one use since it entered the tier) has no distance measured inside the tier; `reuse`
//! ranks it by the gap before that use, the longest there is when the adapter was quiet. That is right
//! for a sweep and wrong for the start of a burst. Which one the workload is, the policy learns as ARC
//! learns its target size from ghost hits (N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low
//! Overhead Replacement Cache", FAST 2003): when an adapter that left the tier as a newcomer comes back
//! within `QUICK_RETURN` (64 ticks), newcomers are ranked by recency alone (IRR taken as 0) until
//! `MEMORY` (128) returns in a row are slow; a sweep never returns quickly, so it keeps `reuse`'s order.
//!
//! Victim choice is O(log n): the largest `IRR - WEIGHT * F` comes from one ordered set; the largest
//! `recency - WEIGHT * F` is the oldest use among the candidates of one count, so one ordered set per
//! count (`CAP + 1` of them).

use std::collections::{BTreeMap, BTreeSet};

use super::reuse::class;
use super::{AdapterKey, EvictionPolicy, Usage};

/// The class of a distance nobody has measured yet (a single use): the furthest.
const UNKNOWN: i64 = 1 << 40;
/// Classes (quarter octaves) one counted use is worth.
const WEIGHT: i64 = 8;
/// Classes one octave of bytes is worth (the `size` policy): one octave of distance, so the rank
/// orders the product of distance and bytes.
const SIZE_WEIGHT: i64 = 4;
/// Uses counted at most.
const CAP: u64 = 4;
/// A newcomer's return is quick below this class (a distance of 64 ticks).
const QUICK_RETURN: u32 = 24;
/// Slow returns in a row after which newcomers are ranked by their IRR again.
const MEMORY: u32 = 128;

/// What the policy remembers of an adapter.
#[derive(Debug, Clone, Copy)]
struct History {
    uses: u64,
    last_used: u64,
    irr: i64,
    /// When it entered the tier, and its use count just before the use that loaded it.
    entered: u64,
    uses_before: u64,
    /// `min(F, CAP)`, the octave of its bytes (0 unless sized) and the rank's static part, as
    /// inserted.
    count: usize,
    octave: u32,
    score: i64,
    candidate: bool,
}

/// Largest `max(IRR, recency) - WEIGHT * min(F, CAP)` first; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct Hybrid {
    history: Vec<Option<History>>,
    by_score: BTreeSet<(i64, u64, AdapterKey)>,
    /// Per (count, octave of bytes), the candidates by last use.
    by_recency: BTreeMap<(usize, u32), BTreeSet<(u64, AdapterKey)>>,
    protect_newcomers: u32,
    /// Weighs bytes (the `size` policy): see [`Hybrid::sized`].
    sized: bool,
    now: u64,
    len: usize,
}

impl Hybrid {
    /// The `size` policy: this ranking with each candidate's distance multiplied by its bytes
    /// (`SIZE_WEIGHT` classes, one octave of distance, per octave of bytes), so the victim is the
    /// one whose bytes would sit idle longest: one big cold adapter goes before several small warm
    /// ones. The space-time product of GreedyDual-Size (P. Cao and S. Irani, USITS 1997), for a
    /// device tier in rank pages, where a big adapter's pages make room for several small ones.
    pub fn sized() -> Self {
        Self { sized: true, ..Self::default() }
    }

    /// The octave of `bytes` when sized, else 0 (every candidate one size).
    fn octave(&self, bytes: u64) -> u32 {
        if self.sized {
            63 - bytes.max(1).leading_zeros()
        } else {
            0
        }
    }

    /// Learns from an adapter that left the tier as a newcomer and is back with a new use.
    fn observe_return(&mut self, old: &History, usage: &Usage) {
        let left_as_newcomer = !old.candidate && old.count <= 1 && old.entered != usage.inserted_at;
        if left_as_newcomer && old.uses < usage.uses {
            if class(usage.last_used.saturating_sub(old.last_used)) < QUICK_RETURN {
                self.protect_newcomers = MEMORY;
            } else {
                self.protect_newcomers = self.protect_newcomers.saturating_sub(1);
            }
        }
    }
}

impl EvictionPolicy for Hybrid {
    fn name(&self) -> &'static str {
        if self.sized {
            "size"
        } else {
            "hybrid"
        }
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        if self.history.len() <= key.index() {
            self.history.resize(key.index() + 1, None);
        }
        let old = self.history[key.index()];
        assert!(!old.is_some_and(|h| h.candidate), "{key:?} is already a candidate");
        if let Some(h) = &old {
            self.observe_return(h, usage);
        }
        let irr = match old {
            Some(h) if h.uses < usage.uses => {
                i64::from(class(usage.last_used.saturating_sub(h.last_used) / (usage.uses - h.uses)))
            }
            // Same uses: back from a protection without a new use. Fewer: the key was reused.
            Some(h) if h.uses == usage.uses && h.last_used == usage.last_used => h.irr,
            _ => UNKNOWN,
        };
        let (entered, uses_before) = match old {
            Some(h) if h.entered == usage.inserted_at && h.uses <= usage.uses => (h.entered, h.uses_before),
            _ => (usage.inserted_at, usage.uses.saturating_sub(1)),
        };
        let in_tier = usage.uses - uses_before;
        let count = in_tier.min(CAP) as usize;
        let distance = if in_tier <= 1 && self.protect_newcomers > 0 { 0 } else { irr };
        let octave = self.octave(usage.bytes);
        let score = distance - WEIGHT * count as i64 + SIZE_WEIGHT * i64::from(octave);
        let h = History {
            uses: usage.uses,
            last_used: usage.last_used,
            irr,
            entered,
            uses_before,
            count,
            octave,
            score,
            candidate: true,
        };
        self.history[key.index()] = Some(h);
        self.now = self.now.max(usage.last_used).max(usage.inserted_at);
        self.by_score.insert((score, h.last_used, key));
        self.by_recency.entry((count, octave)).or_default().insert((h.last_used, key));
        self.len += 1;
    }

    fn remove(&mut self, key: AdapterKey) {
        let h = self.history.get(key.index()).copied().flatten().filter(|h| h.candidate);
        let h = h.unwrap_or_else(|| panic!("{key:?} is not a candidate"));
        self.by_score.remove(&(h.score, h.last_used, key));
        let bucket = self.by_recency.get_mut(&(h.count, h.octave)).expect("its bucket");
        bucket.remove(&(h.last_used, key));
        if bucket.is_empty() {
            self.by_recency.remove(&(h.count, h.octave));
        }
        self.history[key.index()] = Some(History { candidate: false, ..h });
        self.len -= 1;
    }

    fn victim(&self) -> Option<AdapterKey> {
        let &(mut best, _, mut victim) = self.by_score.last()?;
        for (&(count, octave), set) in &self.by_recency {
            if let Some(&(last_used, key)) = set.first() {
                let rank = i64::from(class(self.now.saturating_sub(last_used))) - WEIGHT * count as i64
                    + SIZE_WEIGHT * i64::from(octave);
                if rank > best {
                    (best, victim) = (rank, key);
                }
            }
        }
        Some(victim)
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
#[path = "hybrid_tests.rs"]
mod tests;
