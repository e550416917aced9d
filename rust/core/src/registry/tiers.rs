//! The two tiers' own bookkeeping: the host ledger (counts and bytes of host memory, bounded by
//! count and bytes) and the device slot table, each with its eviction candidates. They know keys,
//! not adapters: moving adapters between them is `moves`'s job.

use std::sync::Arc;

use super::pages::PagePool;
use crate::policy::{AdapterKey, EvictionPolicy};

/// A tier's running counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Planned uses that found the adapter resident (host: device misses served from host memory).
    pub hits: u64,
    /// Planned uses that had to load it (host: reads from disk).
    pub misses: u64,
    /// Adapters brought in (host: registrations and disk reads; device: slot loads).
    pub loads: u64,
    /// Adapters evicted to make room.
    pub evictions: u64,
    /// Times the tier refused room: deferred adapters in a plan, refused registrations and pins.
    pub refusals: u64,
}

/// Which tier an eviction left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Host memory.
    Host,
    /// A device slot.
    Device,
}

impl Tier {
    /// `"host"` or `"device"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Device => "device",
        }
    }
}

/// An adapter that left a tier to make room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    /// The adapter's name (shared with the registry: no copy per eviction).
    pub name: Arc<str>,
    /// The tier it left.
    pub tier: Tier,
    /// The slot it left (device evictions only).
    pub slot: Option<u32>,
}

/// Which device candidate set an adapter is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceCandidate {
    /// Not a candidate.
    No,
    /// No request in flight: evicted first.
    Idle,
    /// Requests in flight but not in the step: evicted only when no idle candidate is left.
    Queued,
}

/// Which host candidate set an adapter is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostCandidate {
    /// Not a candidate.
    No,
    /// No request of the latest plan named it: any claim evicts it first.
    Idle,
    /// A request of the latest fetch-mode plan named it: its requests wait or run, so a fetch
    /// never evicts it (but one for an overdue adapter named before it, youngest first), and other
    /// claims only once no idle candidate is left, in policy order.
    Named,
}

/// Host candidates a claim may evict, counted and in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Evictable {
    pub(crate) count: usize,
    pub(crate) bytes: u64,
}

/// Host memory: what it holds, counted (the tensors themselves live in Python). `count` and
/// `bytes` are the claimed room: resident adapters plus the reservations of those being fetched.
/// The resident adapters alone never exceed the capacity. A reservation evicts nobody: a fetch
/// starts when the protected adapters and the other reservations leave it room (so every read in
/// flight could enter at once, were the unprotected adapters gone), and the room a finished
/// fetch needs is made when it is done, so a read that fails has evicted no one.
#[derive(Debug)]
pub(crate) struct HostLedger {
    pub(crate) max_count: Option<usize>,
    pub(crate) max_bytes: Option<u64>,
    pub(crate) count: usize,
    pub(crate) bytes: u64,
    /// Of `count`, adapters being fetched.
    pub(crate) reserved_count: usize,
    /// Of `bytes`, the bytes reserved for adapters being fetched.
    pub(crate) reserved_bytes: u64,
    /// Unprotected adapters no request of the latest plan named, in policy order.
    pub(super) candidates: Box<dyn EvictionPolicy>,
    pub(super) candidate_bytes: u64,
    /// Unprotected adapters the latest fetch-mode plan's requests named, in policy order.
    pub(super) named: Box<dyn EvictionPolicy>,
    pub(super) named_bytes: u64,
    pub(crate) counters: TierCounters,
}

impl HostLedger {
    pub(crate) fn new(
        max_count: Option<usize>,
        max_bytes: Option<u64>,
        policy: Box<dyn EvictionPolicy>,
        named_policy: Box<dyn EvictionPolicy>,
    ) -> Self {
        Self {
            max_count,
            max_bytes,
            count: 0,
            bytes: 0,
            reserved_count: 0,
            reserved_bytes: 0,
            candidates: policy,
            candidate_bytes: 0,
            named: named_policy,
            named_bytes: 0,
            counters: TierCounters::default(),
        }
    }

    /// Whether one more resident adapter of `bytes` fits beside the resident ones now
    /// (reservations aside: they are room promised, not room held).
    pub(super) fn has_room(&self, bytes: u64) -> bool {
        self.max_count.is_none_or(|m| self.count - self.reserved_count < m)
            && self.max_bytes.is_none_or(|m| self.bytes - self.reserved_bytes + bytes <= m)
    }

    /// Every candidate: what a claim other than a fetch may evict.
    pub(crate) fn every_candidate(&self) -> Evictable {
        Evictable {
            count: self.candidates.len() + self.named.len(),
            bytes: self.candidate_bytes + self.named_bytes,
        }
    }

    /// The candidates no request of the latest plan named: what any fetch may evict.
    pub(crate) fn idle_candidates(&self) -> Evictable {
        Evictable { count: self.candidates.len(), bytes: self.candidate_bytes }
    }

    /// Whether one more resident adapter of `bytes` would fit after evicting `evictable`: beside the
    /// resident ones (a finished fetch entering), or beside them and every reservation
    /// (`reservations_held`: a new claim).
    pub(crate) fn fits(&self, bytes: u64, evictable: Evictable, reservations_held: bool) -> bool {
        let (held_count, held_bytes) =
            if reservations_held { (0, 0) } else { (self.reserved_count, self.reserved_bytes) };
        let count = self.count - held_count - evictable.count;
        let used = self.bytes - held_bytes - evictable.bytes;
        self.max_count.is_none_or(|m| count < m) && self.max_bytes.is_none_or(|m| used + bytes <= m)
    }

    /// Whether one more adapter of `bytes` would fit after evicting every candidate, counting every
    /// reservation as held: the check for a new claim (a registration, a blocking read).
    pub(crate) fn room_possible(&self, bytes: u64) -> bool {
        self.fits(bytes, self.every_candidate(), true)
    }

    /// Why [`HostLedger::room_possible`] is false, with the numbers.
    pub(crate) fn shortage(&self, bytes: u64) -> String {
        let every = self.every_candidate();
        let protected = self.count - every.count;
        let mut why = format!(
            "the host tier holds {} adapter(s) ({} bytes), {protected} of them protected (pinned, in flight, \
             loading, being fetched or in the current step)",
            self.count, self.bytes
        );
        if let Some(m) = self.max_count {
            why.push_str(&format!("; max_loaded_loras={m}"));
        }
        if let Some(m) = self.max_bytes {
            why.push_str(&format!(
                "; max_host_bytes={m}, of which protected adapters take {} and this one needs {bytes}",
                self.bytes - every.bytes
            ));
        }
        why
    }
}

/// Device slots: one per page (see `pages`; in slot mode a page is a slot), an adapter's slot
/// being its first page.
#[derive(Debug)]
pub(crate) struct DeviceTier {
    pub(crate) slots: Vec<Option<AdapterKey>>,
    /// Bumped whenever a slot's occupant changes, so a plan can be checked against later changes.
    pub(crate) epochs: Vec<u64>,
    /// Free pages and each resident adapter's page table.
    pub(crate) pages: PagePool,
    pub(super) idle: Box<dyn EvictionPolicy>,
    pub(super) queued: Box<dyn EvictionPolicy>,
    /// The pages of the idle and queued candidates: what evictions can free.
    pub(super) candidate_pages: usize,
    /// The pages every pinned adapter takes, resident or not: set aside from each step's budget.
    pub(crate) pinned_pages: usize,
    pub(crate) counters: TierCounters,
}

impl DeviceTier {
    pub(crate) fn new(pages: u32, idle: Box<dyn EvictionPolicy>, queued: Box<dyn EvictionPolicy>) -> Self {
        Self {
            slots: vec![None; pages as usize],
            epochs: vec![0; pages as usize],
            pages: PagePool::new(pages),
            idle,
            queued,
            candidate_pages: 0,
            pinned_pages: 0,
            counters: TierCounters::default(),
        }
    }

    /// Whether `pages` pages are free or can be freed by evictions.
    pub(crate) fn pages_possible(&self, pages: usize) -> bool {
        self.pages.free_count() + self.candidate_pages >= pages
    }
}
