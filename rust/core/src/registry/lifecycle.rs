//! An adapter's life under one name: its weights replaced in place ([`Registry::replace`]), and where
//! every adapter is at one instant ([`Registry::placement`]).
//!
//! A replacement keeps the registration (name, id, serial, pin, requests in flight, slot) and swaps
//! what the registry knows of its weights (rank, bytes, scaling). The caller holds the new weights in
//! host memory already, so the adapter ends in the host tier whatever tier it was in:
//! - resident in the host tier: it stays, its bytes resized (room made for what it grows by);
//! - being fetched: the fetch is over (its reservation becomes the new weights' place, resized; its
//!   read's report is refused, as for a fetch taken over by a blocking read) and it is *fresh*, so the
//!   requests that waited for the fetch run on the new weights;
//! - neither (evicted): it enters the host tier, room made as for a registration.
//!
//! A slot it holds stays its own: the caller refreshes the slot's contents before the next step that
//! uses it (a step open now keeps reading the old contents). In paged mode a rank that changes its
//! page count gives the slot up instead: the adapter is loaded into new pages on its next use.

use std::sync::Arc;

use super::adapter::AdapterSize;
use super::tiers::Tier;
use super::{check_size, Registry};
use crate::error::{Error, Result};

/// Where one adapter is: [`Registry::placement`].
#[derive(Debug, Clone, PartialEq)]
pub struct Place {
    /// The adapter's name.
    pub name: Arc<str>,
    /// Its id.
    pub id: Arc<str>,
    /// Its registration serial.
    pub serial: u64,
    /// Its device slot, if it holds one (then it is in the host tier too).
    pub slot: Option<u32>,
    /// Whether it is in the host tier.
    pub host: bool,
    /// Whether a background read of it is in flight (then it is in neither tier).
    pub fetching: bool,
    /// Pinned (never evicted).
    pub pinned: bool,
    /// Requests acquired and not yet released.
    pub in_flight: u64,
    /// Being unloaded: it takes no new requests.
    pub draining: bool,
    /// Bytes its weights take in host memory.
    pub host_bytes: u64,
}

/// Every adapter's [`Place`] and the tiers' room, taken at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Every registered adapter (and every one being unloaded), sorted by name.
    pub adapters: Vec<Place>,
    /// Device slots in all (pages, in paged mode).
    pub slots: usize,
    /// Device slots holding no adapter (free pages, in paged mode).
    pub free_slots: usize,
    /// Bytes of the adapters in the host tier.
    pub host_bytes: u64,
    /// Bytes reserved in the host tier for adapters being fetched.
    pub reserved_bytes: u64,
    /// The host tier's capacity in bytes; `None` is unbounded.
    pub max_host_bytes: Option<u64>,
}

impl Registry {
    /// Replaces the weights of `name`, registered as `serial`, by new ones of `size` that the caller
    /// holds in host memory (see the module's docs for each tier). Returns the adapters evicted from
    /// the host tier to make room (free their tensors).
    ///
    /// Errors: [`Error::AdapterNotFound`] when `name` is not registered (or is being unloaded, or was
    /// registered again since: another serial); [`Error::Capacity`] when the host tier cannot make
    /// room, the pinned adapters would overflow it, or a registered adapter (this one or another)
    /// would no longer fit in it beside the pinned ones (the rule [`Registry::pin`] keeps);
    /// [`Error::Spec`] for a rank of 0, a non-finite scaling or byte totals past 2^64. Nothing
    /// changes on an error.
    pub fn replace(&mut self, name: &str, serial: u64, size: AdapterSize) -> Result<Vec<String>> {
        let key = self.lookup(name, false)?;
        let a = self.get(key);
        if a.identity.serial != serial {
            return Err(Error::AdapterNotFound {
                name: format!("{name} (registration {serial}: registered again since)"),
                registered: self.not_found_list(),
            });
        }
        check_size(&a.identity.spec, size)?;
        let old = a.identity.size;
        let (host_total, device_total) = self.bytes_registered;
        let totals = (host_total - old.host_bytes)
            .checked_add(size.host_bytes)
            .zip((device_total - old.device_bytes).checked_add(size.device_bytes))
            .ok_or_else(|| {
                Error::Spec(format!(
                    "cannot replace adapter {name:?}: host_bytes={} or device_bytes={} would take the \
                     registered adapters' total past 2^64 bytes",
                    size.host_bytes, size.device_bytes
                ))
            })?;
        let pinned = a.protection.pinned;
        let pinned_bytes = self.pinned_host_bytes - if pinned { old.host_bytes } else { 0 };
        let what = || format!("replace adapter {name:?} by {} host bytes", size.host_bytes);
        if pinned {
            self.check_pin_room(what, pinned_bytes + size.host_bytes, None, Some(key))?;
        } else {
            self.check_pin_room(what, pinned_bytes, Some((name, size.host_bytes)), Some(key))?;
        }
        let (old_pages, pages) = (self.pages_of(old), self.pages_of(size));
        let pinned_pages = self.device.pinned_pages - if pinned { old_pages } else { 0 };
        if pinned {
            self.check_pin_pages(name, pages, pinned_pages + pages, Some(key))?;
        } else {
            let what = || format!("replace adapter {name:?} by rank {}", size.rank);
            self.check_unpinned_pages(what, pages, pinned_pages)?;
        }
        let a = self.get(key);
        let (was_host, was_fetching) = (a.tenancy.host_since.is_some(), a.tenancy.fetching);
        // Out of the candidate sets while the room is made (it must not evict itself), and its old
        // bytes out of the ledger, as if it had left.
        let borrowed = !a.protection.in_step;
        self.get_mut(key).protection.in_step = true;
        self.refresh(key);
        self.leave_ledger(old.host_bytes, was_host, was_fetching);
        if !self.host.room_possible(size.host_bytes) {
            let why = self.host.shortage(size.host_bytes);
            self.enter_ledger(old.host_bytes, was_host, was_fetching);
            if borrowed {
                self.get_mut(key).protection.in_step = false;
            }
            self.refresh(key);
            self.host.counters.refusals += 1;
            return Err(Error::Capacity(format!("cannot replace adapter {name:?}: {why}")));
        }
        let mut evicted = Vec::new();
        self.make_host_room(size.host_bytes, &mut evicted);
        self.bytes_registered = totals;
        if pinned {
            self.pinned_host_bytes = pinned_bytes + size.host_bytes;
            self.device.pinned_pages = pinned_pages + pages;
        }
        if pages != old_pages && self.get(key).tenancy.slot.is_some() {
            // Its page table no longer fits its rank: it is loaded again, into new pages, on its next
            // use (a step open now keeps reading the old pages, which no plan hands out before it ends).
            self.free_slot(key);
        }
        self.host.count += 1;
        self.host.bytes += size.host_bytes;
        let now = self.tick();
        let a = self.get_mut(key);
        a.identity.size = size;
        a.tenancy.fetching = false;
        if !was_host {
            a.tenancy.host_since = Some(now);
        }
        if was_fetching {
            a.protection.fresh = true;
            self.fresh.push(key);
        }
        if !was_host {
            self.host.counters.loads += 1;
        }
        if borrowed {
            self.get_mut(key).protection.in_step = false;
        }
        self.refresh(key);
        Ok(evicted.into_iter().filter(|e| e.tier == Tier::Host).map(|e| e.name.to_string()).collect())
    }

    /// Takes an adapter's `bytes` out of the host ledger: its residency, or its fetch's reservation.
    fn leave_ledger(&mut self, bytes: u64, host: bool, fetching: bool) {
        if host || fetching {
            self.host.count -= 1;
            self.host.bytes -= bytes;
        }
        if fetching {
            self.host.reserved_count -= 1;
            self.host.reserved_bytes -= bytes;
        }
    }

    /// Undoes [`Registry::leave_ledger`].
    fn enter_ledger(&mut self, bytes: u64, host: bool, fetching: bool) {
        if host || fetching {
            self.host.count += 1;
            self.host.bytes += bytes;
        }
        if fetching {
            self.host.reserved_count += 1;
            self.host.reserved_bytes += bytes;
        }
    }

    /// Where every adapter is, with the tiers' room, all at one instant. O(adapters).
    pub fn placement(&self) -> Placement {
        let mut adapters: Vec<Place> = self
            .adapters
            .iter()
            .flatten()
            .map(|a| Place {
                name: Arc::clone(&a.identity.name),
                id: Arc::clone(&a.identity.id),
                serial: a.identity.serial,
                slot: a.tenancy.slot,
                host: a.tenancy.host_since.is_some(),
                fetching: a.tenancy.fetching,
                pinned: a.protection.pinned,
                in_flight: a.protection.in_flight,
                draining: a.protection.draining,
                host_bytes: a.identity.size.host_bytes,
            })
            .collect();
        adapters.sort_unstable_by(|x, y| x.name.cmp(&y.name));
        Placement {
            adapters,
            slots: self.total_pages(),
            free_slots: self.device.pages.free_count(),
            host_bytes: self.host.bytes - self.host.reserved_bytes,
            reserved_bytes: self.host.reserved_bytes,
            max_host_bytes: self.host.max_bytes,
        }
    }
}

#[cfg(test)]
#[path = "lifecycle_tests.rs"]
mod tests;
