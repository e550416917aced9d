//! Eviction policies: which eviction candidate of a tier goes first.
//!
//! A tier hands its policy only the adapters that may be evicted right now (resident and in no
//! protection class); the policy orders them. Protection changes remove an adapter and insert it
//! again, so a candidate's [`Usage`] never changes while the policy holds it, and a policy may
//! compute whatever score it likes once, at insertion. A new policy is one file: implement
//! [`EvictionPolicy`] (usually over [`Ranked`]) and add it to [`PolicyKind`].

mod fifo;
mod hybrid;
mod lru;
mod reuse;

use std::collections::BTreeSet;
use std::fmt;

pub use fifo::Fifo;
pub use hybrid::Hybrid;
pub use lru::Lru;
pub use reuse::ReuseDistance;

use crate::error::{Error, Result};

/// An adapter's handle inside one registry (an index; reused after the adapter is forgotten).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AdapterKey(pub u32);

impl AdapterKey {
    /// The key as an index into the registry's adapter table.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a policy may know about a candidate in one tier: its size and its access history.
///
/// Times are the registry's logical clock (one tick per insertion or use), never wall-clock time,
/// so a trace simulator replays a run exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// When the adapter entered this tier.
    pub inserted_at: u64,
    /// When a planned step last used it (its registration time if never used).
    pub last_used: u64,
    /// How many planned steps used it since it was registered.
    pub uses: u64,
    /// Bytes it occupies in this tier.
    pub bytes: u64,
    /// Its LoRA rank.
    pub rank: u32,
}

/// Orders one tier's eviction candidates. Every operation is O(log n) or better.
pub trait EvictionPolicy: Send + Sync + fmt::Debug {
    /// The policy's name, as [`PolicyKind::parse`] accepts it.
    fn name(&self) -> &'static str;
    /// `key` became a candidate. It is not a candidate already.
    fn insert(&mut self, key: AdapterKey, usage: &Usage);
    /// `key` stopped being a candidate (evicted, used, pinned, ...). It is a candidate.
    fn remove(&mut self, key: AdapterKey);
    /// The candidate to evict first, if any.
    fn victim(&self) -> Option<AdapterKey>;
    /// The number of candidates.
    fn len(&self) -> usize;
    /// Whether there is no candidate.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An eviction policy by kind: parsed once from its name, then built per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used first.
    Lru,
    /// First in, first out.
    Fifo,
    /// Reuse distance, after LIRS ([`ReuseDistance`]).
    Reuse,
    /// Reuse distance tempered by a capped use count ([`Hybrid`]).
    Hybrid,
    /// [`Hybrid`] weighing each candidate by its bytes ([`Hybrid::sized`]): for a device tier in
    /// rank pages.
    Size,
}

impl PolicyKind {
    /// Every kind, in the order [`POLICY_NAMES`] lists their names.
    pub const ALL: [PolicyKind; 5] =
        [PolicyKind::Lru, PolicyKind::Fifo, PolicyKind::Reuse, PolicyKind::Hybrid, PolicyKind::Size];

    /// The kind's name: what [`PolicyKind::parse`] accepts.
    pub const fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Reuse => "reuse",
            PolicyKind::Hybrid => "hybrid",
            PolicyKind::Size => "size",
        }
    }

    /// The kind named `name`; `what` names the setting in the error.
    ///
    /// Errors: [`Error::Spec`] naming the value and the choices.
    pub fn parse(what: &str, name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name).ok_or_else(|| {
            Error::Spec(format!(
                "{what}={name:?} is not an eviction policy; choose one of {}",
                POLICY_NAMES.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// A fresh, empty policy of this kind.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Fifo => Box::new(Fifo::default()),
            PolicyKind::Reuse => Box::new(ReuseDistance::default()),
            PolicyKind::Hybrid => Box::new(Hybrid::default()),
            PolicyKind::Size => Box::new(Hybrid::sized()),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The names [`PolicyKind::parse`] accepts: the one list Python's choices come from, derived from
/// [`PolicyKind::ALL`] and [`PolicyKind::name`].
pub const POLICY_NAMES: &[&str] = &NAMES;

const NAMES: [&str; PolicyKind::ALL.len()] = {
    let mut names = [""; PolicyKind::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = PolicyKind::ALL[i].name();
        i += 1;
    }
    names
};

/// Candidates ordered by a score, smallest first (ties broken by key): the building block of
/// score-based policies. O(log n) insert, remove and victim.
#[derive(Debug, Default, Clone)]
pub struct Ranked {
    order: BTreeSet<(u64, AdapterKey)>,
    score: Vec<Option<u64>>,
}

impl Ranked {
    /// Adds `key` with `score`.
    ///
    /// Panics if `key` is already present (a registry bug).
    pub fn insert(&mut self, key: AdapterKey, score: u64) {
        if self.score.len() <= key.index() {
            self.score.resize(key.index() + 1, None);
        }
        assert!(self.score[key.index()].is_none(), "{key:?} is already a candidate");
        self.score[key.index()] = Some(score);
        self.order.insert((score, key));
    }

    /// Removes `key`.
    ///
    /// Panics if `key` is absent (a registry bug).
    pub fn remove(&mut self, key: AdapterKey) {
        let score = self.score.get_mut(key.index()).and_then(Option::take);
        let score = score.unwrap_or_else(|| panic!("{key:?} is not a candidate"));
        self.order.remove(&(score, key));
    }

    /// The key with the smallest score.
    pub fn first(&self) -> Option<AdapterKey> {
        self.order.first().map(|&(_, key)| key)
    }

    /// The number of keys.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether there is no key.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
