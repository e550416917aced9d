//! Background reads: the **fetching** state. An adapter outside the host tier whose weights a
//! background reader is reading is *fetching*: its host bytes are reserved in the host ledger, it
//! is in no slot, takes no requests and is no eviction candidate. A reservation evicts nobody: a
//! fetch starts only when the protected adapters and the other reservations leave it room, and
//! [`Registry::fetch_done`] makes the room (evicting unprotected adapters) once the read has
//! succeeded, so a read that fails or is abandoned leaves every other adapter where it was;
//! [`Registry::fetch_failed`] and an unload release the reservation. A fetch is named by the
//! adapter's name and registration serial, so a report for a fetch that was cancelled (or for an
//! earlier registration of the name) is refused and the caller drops the bytes it read.
//!
//! Fetches start in a step (`begin_step` in fetch mode defers a request whose adapter is not in
//! the host tier and starts its fetch) or ahead of any step ([`Registry::prefetch`]). Both start
//! them in request order, which is the order of the caller's queue; nothing here reads a clock.
//! A finished fetch leaves the adapter *fresh*, protected until a plan admits it or leaves it
//! out, so that no fetch is undone before the requests that waited for it run.
//!
//! The fetch policy. A fetch-mode plan *names* the adapters its requests use, each at its first
//! request: those of waiting requests, and those of running ones, which an engine offers again
//! every step but which no step protects between its steps. A fetch, its reservation as its room
//! when done, takes only host places no request names: a read never evicts an adapter a request
//! is about to need, which would be read again. The one exception keeps the queue fair: a fetch
//! for an overdue adapter (deferred [`OVERDUE_AFTER`] plans) may also take the places of adapters
//! named only by younger requests, youngest first. And a plan starts fetches in queue order only
//! while fewer unpinned adapters than one step may admit are *ready* (deferred in the host tier,
//! or being fetched): reading further ahead only holds host room the next steps cannot use.
//! Pinned adapters (they take no slot budget) and overdue ones fetch whatever the budget.

use std::sync::Arc;

use super::adapter::NOT_NAMED;
use super::tiers::{Evictable, Eviction, HostCandidate, Tier};
use super::Registry;
use crate::error::{Error, Result};
use crate::limits::OVERDUE_AFTER;
use crate::policy::AdapterKey;

/// How an adapter entering the host tier may make its room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// A background read: only from adapters no waiting request needs (see
    /// [`Registry::fetch_evictable`]).
    Fetch,
    /// A read a step or caller waits for: from any candidate.
    Read,
}

/// A fetch the caller must run: read the adapter's weights, then report
/// [`Registry::fetch_done`] or [`Registry::fetch_failed`] with this name and serial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    /// The adapter's name (shared with the registry).
    pub name: Arc<str>,
    /// The registration it is for.
    pub serial: u64,
}

/// What [`Registry::prefetch`] started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchPlan {
    /// Fetches started, in the order of the names given.
    pub to_fetch: Vec<Fetch>,
    /// Adapters that need a fetch but the host tier cannot make room for now (it is full of
    /// protected adapters); in the order of the names given.
    pub skipped: Vec<Arc<str>>,
}

impl Registry {
    /// Starts fetching `key` (outside the host tier, not fetching) if the host tier could make room
    /// for it beside the protected adapters, the other reservations and the adapters waiting requests
    /// need ([`Registry::fetch_evictable`]): reserves its bytes, evicting nobody. Returns whether it
    /// started.
    pub(crate) fn start_fetch(&mut self, key: AdapterKey) -> bool {
        let a = self.get(key);
        debug_assert!(a.tenancy.host_since.is_none() && !a.tenancy.fetching);
        let bytes = a.identity.size.host_bytes;
        if !self.host.fits(bytes, self.fetch_evictable(key).0, true) {
            self.host.counters.refusals += 1;
            return false;
        }
        self.get_mut(key).tenancy.fetching = true;
        self.host.count += 1;
        self.host.bytes += bytes;
        self.host.reserved_count += 1;
        self.host.reserved_bytes += bytes;
        self.host.counters.misses += 1;
        true
    }

    /// What a fetch of `key` may evict, and the first request index from which named adapters are
    /// among it: the candidates no request of the latest plan named; and when `key` is overdue, also
    /// those whose requests all come after its first (the oldest waiting request is not held back
    /// by younger ones), never those of its elders or of running requests (offered first).
    pub(crate) fn fetch_evictable(&self, key: AdapterKey) -> (Evictable, u32) {
        let t = &self.get(key).tenancy;
        let mut evictable = self.host.idle_candidates();
        if t.deferred_plans < OVERDUE_AFTER || t.named_at == NOT_NAMED {
            return (evictable, NOT_NAMED);
        }
        let first = t.named_at + 1;
        for &k in &self.named {
            let other = self.get(k);
            if other.tenancy.host_candidate == HostCandidate::Named && other.tenancy.named_at >= first {
                evictable.count += 1;
                evictable.bytes += other.identity.size.host_bytes;
            }
        }
        (evictable, first)
    }

    /// Whether `key`, being fetched, could enter the host tier now, making room as `claim` may:
    /// [`Registry::end_fetch`] into the host tier may be called.
    pub(crate) fn fetch_fits(&self, key: AdapterKey, claim: Claim) -> bool {
        let evictable = match claim {
            Claim::Fetch => self.fetch_evictable(key).0,
            Claim::Read => self.host.every_candidate(),
        };
        self.host.fits(self.get(key).identity.size.host_bytes, evictable, false)
    }

    /// Ends the fetch of `key`: its reservation is released (`into_host`: None) or becomes its
    /// place in the host tier (after [`Registry::fetch_fits`] with that claim), candidates leaving
    /// first to make the room as the claim may, into `evicted`.
    pub(crate) fn end_fetch(
        &mut self,
        key: AdapterKey,
        into_host: Option<Claim>,
        evicted: &mut Vec<Eviction>,
    ) {
        // Computed before the reservation ends: the bound depends on the adapter alone.
        let first_evictable = self.fetch_evictable(key).1;
        let a = self.get_mut(key);
        debug_assert!(a.tenancy.fetching);
        a.tenancy.fetching = false;
        let bytes = a.identity.size.host_bytes;
        self.host.reserved_count -= 1;
        self.host.reserved_bytes -= bytes;
        self.host.count -= 1;
        self.host.bytes -= bytes;
        if let Some(claim) = into_host {
            match claim {
                Claim::Fetch => self.make_fetch_room(bytes, first_evictable, evicted),
                Claim::Read => self.make_host_room(bytes, evicted),
            }
            self.host.count += 1;
            self.host.bytes += bytes;
            let now = self.tick();
            self.get_mut(key).tenancy.host_since = Some(now);
            self.host.counters.loads += 1;
        }
        self.refresh(key);
    }

    /// Records which adapters this plan's requests name (`adapters`, in the caller's queue order),
    /// each at its first request: the *named* adapters, whose host places no fetch takes (see
    /// [`Registry::fetch_evictable`]) until a later plan names them no more. A plan outside fetch
    /// mode (`fetch` false) names none: its caller keeps no queue across steps.
    pub(crate) fn name_requests(&mut self, adapters: &[Option<AdapterKey>], fetch: bool) {
        if !fetch && self.named.is_empty() {
            return;
        }
        self.namings += 1;
        let naming = self.namings;
        let previous = std::mem::take(&mut self.named);
        if fetch {
            for (i, &request) in adapters.iter().enumerate() {
                let Some(key) = request else { continue };
                let t = &mut self.get_mut(key).tenancy;
                if t.named_in == naming {
                    continue;
                }
                t.named_in = naming;
                // The index only orders an overdue fetch's victims (found by a scan): only a change
                // of candidate set needs a refresh.
                let newly = t.named_at == NOT_NAMED;
                t.named_at = i as u32;
                self.named.push(key);
                if newly {
                    self.refresh(key);
                }
            }
        }
        for key in previous {
            let t = &mut self.get_mut(key).tenancy;
            if t.named_in != naming {
                t.named_at = NOT_NAMED;
                self.refresh(key);
            }
        }
    }

    /// Starts fetching the adapters named in `names` that are neither in the host tier nor being
    /// fetched, in order (`None` entries and repeats are skipped): a scheduler's waiting queue, so
    /// their reads run before any step needs them. A fetch starts only if it could fit beside the
    /// protected adapters, the other reservations and the resident adapters named earlier in
    /// `names` (the queue's head keeps what it will need); an adapter the tier has no such room for
    /// is skipped. Evicts nobody. Needs no step, and may run while one is open.
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name not registered (or being unloaded); nothing
    /// is started then.
    pub fn prefetch(&mut self, names: &[Option<&str>]) -> Result<FetchPlan> {
        let keys = names.iter().flatten().map(|n| self.lookup(n, false)).collect::<Result<Vec<_>>>()?;
        let mut plan = FetchPlan::default();
        self.fetch_in_order(&keys, false, &mut plan.to_fetch, &mut plan.skipped);
        Ok(plan)
    }

    /// Starts the fetches `keys` need, in order (repeats skipped): started ones go to `to_fetch`,
    /// ones the host tier cannot make room for to `skipped`. The resident adapters among `keys`
    /// count as protected in that room: those named before the one being fetched, or all of them
    /// (`shield_all`, for a batch that must run whole). A batch that must run whole also keeps its
    /// resident adapters: they become *fresh* (until the batch's next plan admits them), so the
    /// room its fetches make when they are done is never taken from the batch itself.
    pub(crate) fn fetch_in_order(
        &mut self,
        keys: &[AdapterKey],
        shield_all: bool,
        to_fetch: &mut Vec<Fetch>,
        skipped: &mut Vec<Arc<str>>,
    ) {
        // `in_step` is the protection that costs nothing to lift, and only the open step (or the
        // latest plan) owns it, so the ones borrowed here are exactly those that lacked it.
        let mut shielded: Vec<AdapterKey> = Vec::new();
        let mut shield = |reg: &mut Self, key: AdapterKey| {
            let a = reg.get_mut(key);
            if a.tenancy.host_since.is_some() && !a.protection.in_step {
                a.protection.in_step = true;
                reg.refresh(key);
                shielded.push(key);
            }
        };
        if shield_all {
            for &key in keys {
                let a = self.get_mut(key);
                if a.tenancy.host_since.is_some() && !a.protection.fresh {
                    a.protection.fresh = true;
                    self.fresh.push(key);
                    self.refresh(key);
                }
            }
        }
        let mut seen = vec![false; self.adapters.len()];
        for &key in keys {
            if std::mem::replace(&mut seen[key.index()], true) {
                continue;
            }
            let a = self.get(key);
            if a.tenancy.fetching {
                continue;
            }
            if a.tenancy.host_since.is_some() {
                shield(self, key);
                continue;
            }
            if self.start_fetch(key) {
                let a = self.get(key);
                to_fetch.push(Fetch { name: Arc::clone(&a.identity.name), serial: a.identity.serial });
            } else {
                skipped.push(Arc::clone(&self.get(key).identity.name));
            }
        }
        for key in shielded {
            self.get_mut(key).protection.in_step = false;
            self.refresh(key);
        }
    }

    /// The fetch of `name` for registration `serial` read its adapter: the adapter enters the host
    /// tier, unprotected adapters leaving to make its room (returned, in order: the caller frees
    /// them), *fresh*: never evicted until a plan admits it, or plans a step without it (its
    /// requests are gone).
    ///
    /// Errors: [`Error::AdapterNotFound`] when `name` is not registered under `serial` any more
    /// (unloaded, or registered again); [`Error::Usage`] when it is not being fetched (the fetch
    /// was cancelled, taken over by a blocking read, or reported already): the caller then drops
    /// the bytes it read. [`Error::Capacity`] when the adapters protected now (pinned, in a step,
    /// in flight, fresh) leave it no room: the fetch goes on, its bytes kept by the caller, who
    /// reports it again later (once a step has ended). Nothing changes on an error.
    pub fn fetch_done(&mut self, name: &str, serial: u64) -> Result<Vec<Arc<str>>> {
        let key = self.fetching(name, serial)?;
        if !self.fetch_fits(key, Claim::Fetch) {
            let bytes = self.get(key).identity.size.host_bytes;
            return Err(Error::Capacity(format!(
                "adapter {name:?} was read but cannot enter the host tier yet: {}",
                self.host.shortage(bytes)
            )));
        }
        let mut evicted = Vec::new();
        self.end_fetch(key, Some(Claim::Fetch), &mut evicted);
        self.get_mut(key).protection.fresh = true;
        self.fresh.push(key);
        self.refresh(key);
        Ok(evicted.into_iter().filter(|e| e.tier == Tier::Host).map(|e| e.name).collect())
    }

    /// The fetch of `name` for registration `serial` failed: its reservation is released and the
    /// adapter stays outside the host tier (a later request fetches it again).
    ///
    /// Errors: as [`Registry::fetch_done`].
    pub fn fetch_failed(&mut self, name: &str, serial: u64) -> Result<()> {
        let key = self.fetching(name, serial)?;
        self.end_fetch(key, None, &mut Vec::new());
        Ok(())
    }

    /// The key of `name` if it is being fetched for registration `serial`.
    fn fetching(&self, name: &str, serial: u64) -> Result<AdapterKey> {
        let key = self.by_name.get(name).copied().filter(|&k| self.get(k).identity.serial == serial);
        let Some(key) = key else {
            return Err(Error::AdapterNotFound {
                name: format!("{name} (registration {serial}: unloaded or registered again since)"),
                registered: self.not_found_list(),
            });
        };
        if !self.get(key).tenancy.fetching {
            return Err(Error::Usage(format!(
                "adapter {name:?} (registration {serial}) is not being fetched: its fetch was cancelled, \
                 taken over by a blocking read, or reported already"
            )));
        }
        Ok(key)
    }
}

#[cfg(test)]
#[path = "fetch_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "fetch_policy_tests.rs"]
mod policy_tests;
