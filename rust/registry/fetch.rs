//! Background reads: the **fetching** state. An adapter outside the host tier whose weights a
//! background reader is reading is *fetching*: its host bytes are reserved in the host ledger
//! (room is made once, when the fetch starts, evicting unprotected adapters), it is in no slot,
//! takes no requests and is no eviction candidate. [`Registry::fetch_done`] turns the reservation
//! into residency; [`Registry::fetch_failed`] and an unload release it. A fetch is named by the
//! adapter's name and registration serial, so a report for a fetch that was cancelled (or for an
//! earlier registration of the name) is refused and the caller drops the bytes it read.
//!
//! Fetches start in a step (`begin_step` in fetch mode defers a request whose adapter is not in
//! the host tier and starts its fetch) or ahead of any step ([`Registry::prefetch`]). Both start
//! them in request order, which is the order of the caller's queue; nothing here reads a clock.
//! A finished fetch leaves the adapter *fresh*, protected until a plan admits it or leaves it
//! out, so that no fetch is undone before the requests that waited for it run.

use std::sync::Arc;

use super::tiers::{Eviction, Tier};
use super::Registry;
use crate::error::{Error, Result};
use crate::policy::AdapterKey;

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
    /// Adapters evicted from the host tier (and from their slots) to make room: free their tensors.
    pub evicted: Vec<Arc<str>>,
    /// Adapters that need a fetch but the host tier cannot make room for now (it is full of
    /// protected adapters); in the order of the names given.
    pub skipped: Vec<Arc<str>>,
}

impl Registry {
    /// Starts fetching `key` (outside the host tier, not fetching) if the host tier can make room:
    /// evicts unprotected adapters into `evicted` and reserves its bytes. Returns whether it started.
    pub(crate) fn start_fetch(&mut self, key: AdapterKey, evicted: &mut Vec<Eviction>) -> bool {
        let a = self.get(key);
        debug_assert!(a.residency.host_since.is_none() && !a.residency.fetching);
        let bytes = a.identity.size.host_bytes;
        if !self.host.room_possible(bytes) {
            self.host.counters.refusals += 1;
            return false;
        }
        self.make_host_room(bytes, evicted);
        self.get_mut(key).residency.fetching = true;
        self.host.count += 1;
        self.host.bytes += bytes;
        self.host.reserved_count += 1;
        self.host.reserved_bytes += bytes;
        self.host.counters.misses += 1;
        true
    }

    /// Ends the fetch of `key`: its reservation is released (`into_host`: false) or becomes its
    /// place in the host tier (`into_host`: true; no room to make, it was made at the start).
    pub(crate) fn end_fetch(&mut self, key: AdapterKey, into_host: bool) {
        let a = self.get_mut(key);
        debug_assert!(a.residency.fetching);
        a.residency.fetching = false;
        let bytes = a.identity.size.host_bytes;
        self.host.reserved_count -= 1;
        self.host.reserved_bytes -= bytes;
        if into_host {
            let now = self.tick();
            self.get_mut(key).residency.host_since = Some(now);
            self.host.counters.loads += 1;
        } else {
            self.host.count -= 1;
            self.host.bytes -= bytes;
        }
        self.refresh(key);
    }

    /// Starts fetching the adapters named in `names` that are neither in the host tier nor being
    /// fetched, in order (`None` entries and repeats are skipped): a scheduler's waiting queue, so
    /// their reads run before any step needs them. Room is made by evicting unprotected adapters,
    /// never those named earlier in `names` (the queue's head keeps what it will need); an adapter
    /// the tier cannot make room for is skipped. Needs no step, and may run while one is open.
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name not registered (or being unloaded); nothing
    /// is started then.
    pub fn prefetch(&mut self, names: &[Option<&str>]) -> Result<FetchPlan> {
        let keys = names.iter().flatten().map(|n| self.lookup(n, false)).collect::<Result<Vec<_>>>()?;
        let mut plan = FetchPlan::default();
        let mut evictions = Vec::new();
        self.fetch_in_order(&keys, false, &mut evictions, &mut plan.to_fetch, &mut plan.skipped);
        plan.evicted = evictions.into_iter().filter(|e| e.tier == Tier::Host).map(|e| e.name).collect();
        Ok(plan)
    }

    /// Starts the fetches `keys` need, in order (repeats skipped): started ones go to `to_fetch`,
    /// ones the host tier cannot make room for to `skipped`. The resident adapters among `keys` are
    /// shielded from the evictions: those named before the one being fetched, or all of them
    /// (`shield_all`, for a batch that must run whole).
    pub(crate) fn fetch_in_order(
        &mut self,
        keys: &[AdapterKey],
        shield_all: bool,
        evictions: &mut Vec<Eviction>,
        to_fetch: &mut Vec<Fetch>,
        skipped: &mut Vec<Arc<str>>,
    ) {
        // `in_step` is the protection that costs nothing to lift, and only the open step (or the
        // latest plan) owns it, so the ones borrowed here are exactly those that lacked it.
        let mut shielded: Vec<AdapterKey> = Vec::new();
        let mut shield = |reg: &mut Self, key: AdapterKey| {
            let a = reg.get_mut(key);
            if a.residency.host_since.is_some() && !a.protection.in_step {
                a.protection.in_step = true;
                reg.refresh(key);
                shielded.push(key);
            }
        };
        if shield_all {
            for &key in keys {
                shield(self, key);
            }
        }
        let mut seen = vec![false; self.adapters.len()];
        for &key in keys {
            if std::mem::replace(&mut seen[key.index()], true) {
                continue;
            }
            let a = self.get(key);
            if a.residency.fetching {
                continue;
            }
            if a.residency.host_since.is_some() {
                shield(self, key);
                continue;
            }
            if self.start_fetch(key, evictions) {
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

    /// The fetch of `name` for registration `serial` finished: the adapter enters the host tier
    /// (its bytes were reserved when the fetch started, so nothing is evicted now), *fresh*: never
    /// evicted until a plan admits it, or plans a step without it (its requests are gone).
    ///
    /// Errors: [`Error::AdapterNotFound`] when `name` is not registered under `serial` any more
    /// (unloaded, or registered again); [`Error::Usage`] when it is not being fetched (the fetch
    /// was cancelled, taken over by a blocking read, or reported already). The caller then drops
    /// the bytes it read; nothing changes.
    pub fn fetch_done(&mut self, name: &str, serial: u64) -> Result<()> {
        let key = self.fetching(name, serial)?;
        self.end_fetch(key, true);
        self.get_mut(key).protection.fresh = true;
        self.fresh.push(key);
        self.refresh(key);
        Ok(())
    }

    /// The fetch of `name` for registration `serial` failed: its reservation is released and the
    /// adapter stays outside the host tier (a later request fetches it again).
    ///
    /// Errors: as [`Registry::fetch_done`].
    pub fn fetch_failed(&mut self, name: &str, serial: u64) -> Result<()> {
        let key = self.fetching(name, serial)?;
        self.end_fetch(key, false);
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
        if !self.get(key).residency.fetching {
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
