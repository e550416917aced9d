//! Moving adapters between the tiers: entering and leaving host memory, taking and freeing slots,
//! evicting, and keeping each tier's eviction candidates exact after every change ([`Registry::refresh`]).
//! A tier never holds more than its capacity, not even briefly: victims leave before anything enters,
//! and an adapter is in the device tier only if it is in the host tier.

use std::sync::Arc;

use super::adapter::NOT_NAMED;
use super::pages::pages_for;
use super::tiers::{DeviceCandidate, Eviction, HostCandidate, Tier};
use super::Registry;
use crate::policy::{AdapterKey, Usage};

impl Registry {
    /// Puts `key` into exactly the candidate sets its tenancy and protections call for.
    pub(crate) fn refresh(&mut self, key: AdapterKey) {
        let paging = self.config.paging;
        let a = self.adapters[key.index()].as_mut().expect("a live adapter key");
        let protected = a.protection.shields();
        let host_wanted = match a.tenancy.named_at {
            _ if a.tenancy.host_since.is_none() || protected || a.protection.in_flight > 0 => {
                HostCandidate::No
            }
            NOT_NAMED => HostCandidate::Idle,
            _ => HostCandidate::Named,
        };
        let device_wanted = match (a.tenancy.slot, protected, a.protection.in_flight) {
            (Some(_), false, 0) => DeviceCandidate::Idle,
            (Some(_), false, _) => DeviceCandidate::Queued,
            _ => DeviceCandidate::No,
        };
        let usage = |inserted_at: u64, bytes: u64| Usage {
            inserted_at,
            last_used: a.tenancy.last_used,
            uses: a.tenancy.uses,
            bytes,
            rank: a.identity.size.rank,
        };
        if a.tenancy.host_candidate != host_wanted {
            let bytes = a.identity.size.host_bytes;
            match a.tenancy.host_candidate {
                HostCandidate::Idle => {
                    self.host.candidates.remove(key);
                    self.host.candidate_bytes -= bytes;
                }
                HostCandidate::Named => {
                    self.host.named.remove(key);
                    self.host.named_bytes -= bytes;
                }
                HostCandidate::No => {}
            }
            let u = usage(a.tenancy.host_since.unwrap_or_default(), bytes);
            match host_wanted {
                HostCandidate::Idle => {
                    self.host.candidates.insert(key, &u);
                    self.host.candidate_bytes += bytes;
                }
                HostCandidate::Named => {
                    self.host.named.insert(key, &u);
                    self.host.named_bytes += bytes;
                }
                HostCandidate::No => {}
            }
            a.tenancy.host_candidate = host_wanted;
        }
        if a.tenancy.device_candidate != device_wanted {
            let pages = pages_for(paging, a.identity.size.rank);
            match a.tenancy.device_candidate {
                DeviceCandidate::Idle => self.device.idle.remove(key),
                DeviceCandidate::Queued => self.device.queued.remove(key),
                DeviceCandidate::No => self.device.candidate_pages += pages,
            }
            let u = usage(a.tenancy.device_since, a.identity.size.device_bytes);
            match device_wanted {
                DeviceCandidate::Idle => self.device.idle.insert(key, &u),
                DeviceCandidate::Queued => self.device.queued.insert(key, &u),
                DeviceCandidate::No => self.device.candidate_pages -= pages,
            }
            a.tenancy.device_candidate = device_wanted;
        }
    }

    /// Evicts host candidates until an adapter of `bytes` fits: those no waiting request names,
    /// then named ones, each in policy order. The caller has checked
    /// [`super::tiers::HostLedger::room_possible`].
    pub(crate) fn make_host_room(&mut self, bytes: u64, evicted: &mut Vec<Eviction>) {
        while !self.host.has_room(bytes) {
            let victim = self.host.candidates.victim().or_else(|| self.host.named.victim());
            self.evict_host(victim.expect("room_possible promised a host victim"), evicted);
        }
    }

    /// Evicts host candidates until an adapter of `bytes` fits: those no waiting request names in
    /// policy order, then the named ones whose first request is at `first_evictable` or later,
    /// youngest first. The caller has checked that they leave the room.
    pub(crate) fn make_fetch_room(&mut self, bytes: u64, first_evictable: u32, evicted: &mut Vec<Eviction>) {
        while !self.host.has_room(bytes) {
            let victim = self.host.candidates.victim().or_else(|| self.youngest_named(first_evictable));
            self.evict_host(victim.expect("the fetch's room check promised a host victim"), evicted);
        }
    }

    /// The named host candidate whose first request is the latest, if at `first_evictable` or later
    /// (a scan of the named adapters: only an overdue adapter's fetch asks).
    fn youngest_named(&self, first_evictable: u32) -> Option<AdapterKey> {
        self.named
            .iter()
            .copied()
            .filter(|&k| self.get(k).tenancy.host_candidate == HostCandidate::Named)
            .filter(|&k| self.get(k).tenancy.named_at >= first_evictable)
            .max_by_key(|&k| self.get(k).tenancy.named_at)
    }

    /// Evicts `victim`, a host candidate, from both tiers.
    fn evict_host(&mut self, victim: AdapterKey, evicted: &mut Vec<Eviction>) {
        if self.get(victim).tenancy.slot.is_some() {
            self.evict_device(victim, evicted);
        }
        let name = Arc::clone(&self.get(victim).identity.name);
        self.leave_host(victim);
        self.refresh(victim);
        self.host.counters.evictions += 1;
        evicted.push(Eviction { name, tier: Tier::Host, slot: None });
    }

    /// A slot holding `pages` free pages (the adapter's page table), evicting device candidates (idle
    /// ones first, each in policy order) until that many are free. The caller has checked
    /// [`super::tiers::DeviceTier::pages_possible`].
    pub(crate) fn take_pages(&mut self, pages: usize, evicted: &mut Vec<Eviction>) -> u32 {
        while self.device.pages.free_count() < pages {
            let victim = self.device.idle.victim().or_else(|| self.device.queued.victim());
            self.evict_device(victim.expect("pages_possible promised a device victim"), evicted);
        }
        self.device.pages.alloc(pages).expect("the pages were made free")
    }

    /// Puts `key` into `slot` (its pages taken with [`Registry::take_pages`]).
    pub(crate) fn occupy_slot(&mut self, key: AdapterKey, slot: u32) {
        debug_assert!(self.device.slots[slot as usize].is_none());
        let now = self.tick();
        self.device.slots[slot as usize] = Some(key);
        self.device.epochs[slot as usize] += 1;
        let a = self.get_mut(key);
        a.tenancy.slot = Some(slot);
        a.tenancy.device_since = now;
        self.refresh(key);
    }

    /// Enters `key` into the host tier (room was made).
    pub(crate) fn enter_host(&mut self, key: AdapterKey) {
        let now = self.tick();
        let a = self.get_mut(key);
        a.tenancy.host_since = Some(now);
        let bytes = a.identity.size.host_bytes;
        self.host.count += 1;
        self.host.bytes += bytes;
        self.refresh(key);
    }

    fn evict_device(&mut self, key: AdapterKey, evicted: &mut Vec<Eviction>) -> u32 {
        let slot = self.free_slot(key);
        self.device.counters.evictions += 1;
        evicted.push(Eviction {
            name: Arc::clone(&self.get(key).identity.name),
            tier: Tier::Device,
            slot: Some(slot),
        });
        slot
    }

    /// Takes `key` out of its slot (its pages become free) and returns the slot.
    pub(crate) fn free_slot(&mut self, key: AdapterKey) -> u32 {
        let slot = self.get_mut(key).tenancy.slot.take().expect("the adapter has a slot");
        self.device.slots[slot as usize] = None;
        self.device.epochs[slot as usize] += 1;
        self.device.pages.release(slot);
        self.refresh(key);
        slot
    }

    /// Takes `key` out of the host tier (it must have left the device tier already); it is fresh no
    /// more (a failed read of a fresh adapter's weights takes it out).
    pub(crate) fn leave_host(&mut self, key: AdapterKey) {
        let a = self.get_mut(key);
        debug_assert!(a.tenancy.slot.is_none(), "an adapter leaves the device tier before the host tier");
        a.tenancy.host_since = None;
        if std::mem::take(&mut a.protection.fresh) {
            self.fresh.retain(|&k| k != key);
        }
        let a = self.get_mut(key);
        let bytes = a.identity.size.host_bytes;
        self.host.count -= 1;
        self.host.bytes -= bytes;
        self.refresh(key);
    }
}
