//! The registry's invariants, checked from scratch: for tests and fuzzing.

use super::adapter::{Adapter, NOT_NAMED};
use super::tiers::{DeviceCandidate, HostCandidate};
use super::Registry;
use crate::policy::AdapterKey;

type Audit = std::result::Result<(), String>;

/// What the adapters say, summed, to compare with the registry's own counters.
#[derive(Default)]
struct Tally {
    /// Resident in the host tier: adapters, bytes.
    resident: (usize, u64),
    /// Being fetched: adapters, bytes reserved.
    fetching: (usize, u64),
    pinned: usize,
    /// Host candidates (no request named them), idle device candidates, queued device candidates.
    candidates: (usize, usize, usize),
    /// Named host candidates: adapters, bytes.
    named: (usize, u64),
    /// Every registered adapter's (host, device) bytes.
    registered: (u64, u64),
}

impl Registry {
    /// Checks every internal invariant; `Err` describes the first broken one. For tests.
    pub fn audit(&self) -> Audit {
        let mut tally = Tally::default();
        for (index, a) in self.adapters.iter().enumerate() {
            if let Some(a) = a {
                self.audit_adapter(AdapterKey(index as u32), a, &mut tally)?;
            }
        }
        if tally.registered != self.bytes_registered {
            return Err(format!(
                "registered adapters hold {:?} (host, device) bytes, the total says {:?}",
                tally.registered, self.bytes_registered
            ));
        }
        self.audit_slots()?;
        self.audit_host(&tally)?;
        self.audit_counters(&tally)
    }

    /// One adapter's own invariants (tiers, protections, candidacy), added to `tally`.
    fn audit_adapter(&self, key: AdapterKey, a: &Adapter, tally: &mut Tally) -> Audit {
        let name = &a.identity.spec.lora_name;
        let (t, p, size) = (&a.tenancy, &a.protection, &a.identity.size);
        tally.registered = (tally.registered.0 + size.host_bytes, tally.registered.1 + size.device_bytes);
        if t.fetching {
            // Fetching: outside both tiers, its bytes reserved once, and nothing else to do
            // with it until the read is reported (an unload cancels the fetch at once).
            tally.fetching = (tally.fetching.0 + 1, tally.fetching.1 + size.host_bytes);
            if t.host_since.is_some() {
                return Err(format!("{name:?} is being fetched and resident in the host tier"));
            }
            if p.draining || p.loading.is_some() {
                return Err(format!("{name:?} is being fetched while being unloaded or loaded"));
            }
        }
        if t.host_since.is_some() {
            tally.resident = (tally.resident.0 + 1, tally.resident.1 + size.host_bytes);
        } else if t.slot.is_some() {
            return Err(format!("{name:?} is in slot {:?} but not in the host tier", t.slot));
        }
        if let Some(slot) = t.slot {
            if self.device.slots.get(slot as usize) != Some(&Some(key)) {
                return Err(format!("{name:?} says slot {slot} but the slot says otherwise"));
            }
        }
        if p.pinned {
            tally.pinned += 1;
            if p.draining {
                return Err(format!("{name:?} is pinned while being unloaded"));
            }
        }
        let protected = p.shields();
        let host_candidate = match t.named_at {
            _ if t.host_since.is_none() || protected || p.in_flight > 0 => HostCandidate::No,
            NOT_NAMED => HostCandidate::Idle,
            _ => HostCandidate::Named,
        };
        if t.host_candidate != host_candidate {
            return Err(format!("{name:?} has the wrong host candidacy"));
        }
        match host_candidate {
            HostCandidate::Idle => tally.candidates.0 += 1,
            HostCandidate::Named => {
                tally.named = (tally.named.0 + 1, tally.named.1 + size.host_bytes);
            }
            HostCandidate::No => {}
        }
        if (t.named_at != NOT_NAMED) != self.named.contains(&key) {
            return Err(format!("{name:?} disagrees with the named list"));
        }
        match t.device_candidate {
            DeviceCandidate::Idle => tally.candidates.1 += 1,
            DeviceCandidate::Queued => tally.candidates.2 += 1,
            DeviceCandidate::No => {}
        }
        if (t.device_candidate != DeviceCandidate::No) != (t.slot.is_some() && !protected) {
            return Err(format!("{name:?} has the wrong device candidacy"));
        }
        if p.step_holds > p.in_flight {
            return Err(format!("{name:?} has more step holds than requests in flight"));
        }
        if p.step_holds > 0 && !self.step_holds(key) {
            return Err(format!("{name:?} has step holds but no open step holds it"));
        }
        if p.in_step != self.step.contains(&key) {
            return Err(format!("{name:?} disagrees with the step list"));
        }
        let fresh_listed = self.fresh.iter().filter(|&&k| k == key).count();
        if usize::from(p.fresh) != fresh_listed {
            return Err(format!("{name:?} disagrees with the fresh list"));
        }
        if p.fresh && t.host_since.is_none() {
            return Err(format!("{name:?} is fresh but not in the host tier"));
        }
        Ok(())
    }

    /// The slot table agrees with its occupants, each occupant holds the pages it needs (none shared,
    /// none leaked: see `pages::PagePool::check`), and the candidates' and pinned pages add up.
    fn audit_slots(&self) -> Audit {
        let mut occupied = Vec::new();
        let (mut candidate_pages, mut pinned_pages) = (0, 0);
        for (slot, key) in self.device.slots.iter().enumerate() {
            if let Some(k) = key {
                let a = self.adapters.get(k.index()).and_then(Option::as_ref);
                if a.and_then(|a| a.tenancy.slot) != Some(slot as u32) {
                    return Err(format!("slot {slot} and its adapter disagree"));
                }
                occupied.push((slot as u32, self.key_pages(*k)));
            }
        }
        self.device.pages.check(occupied.into_iter())?;
        for a in self.adapters.iter().flatten() {
            let pages = self.pages_of(a.identity.size);
            if a.tenancy.device_candidate != DeviceCandidate::No {
                candidate_pages += pages;
            }
            if a.protection.pinned {
                pinned_pages += pages;
            }
        }
        if (candidate_pages, pinned_pages) != (self.device.candidate_pages, self.device.pinned_pages) {
            return Err(format!(
                "device candidates and pinned adapters take {candidate_pages} and {pinned_pages} pages, the \
                 tier says {} and {}",
                self.device.candidate_pages, self.device.pinned_pages
            ));
        }
        if pinned_pages > 0 && pinned_pages >= self.total_pages() {
            return Err(format!("pinned adapters take {pinned_pages} of {} pages", self.total_pages()));
        }
        Ok(())
    }

    /// The host ledger agrees with the resident and fetching adapters, within its capacity.
    fn audit_host(&self, tally: &Tally) -> Audit {
        let (fetching, reserved) = tally.fetching;
        if (fetching, reserved) != (self.host.reserved_count, self.host.reserved_bytes) {
            return Err(format!(
                "host tier reserves {} / {} bytes, fetching adapters say {fetching} / {reserved}",
                self.host.reserved_count, self.host.reserved_bytes
            ));
        }
        // The room used is the resident adapters plus the reservations, each counted once.
        let (resident, resident_bytes) = tally.resident;
        let (count, bytes) = (resident + fetching, resident_bytes + reserved);
        if count != self.host.count || bytes != self.host.bytes {
            return Err(format!(
                "host tier says {} / {} bytes used, adapters and reservations say {count} / {bytes}",
                self.host.count, self.host.bytes
            ));
        }
        // Reservations evict nobody, so only the resident adapters are bounded by the capacity.
        if self.host.max_count.is_some_and(|m| resident > m)
            || self.host.max_bytes.is_some_and(|m| resident_bytes > m)
        {
            return Err(format!("host tier over capacity: {resident} adapters, {resident_bytes} bytes"));
        }
        Ok(())
    }

    /// The pin, candidate and overdue counters agree with the adapters.
    fn audit_counters(&self, tally: &Tally) -> Audit {
        let pinned = tally.pinned;
        if pinned != self.pinned || pinned >= self.config.slots {
            return Err(format!(
                "{pinned} pinned adapters (counter {}) for {} slots",
                self.pinned, self.config.slots
            ));
        }
        if let (Some(max), Some((name, needs))) = (self.host.max_bytes, self.largest_unpinned(None)) {
            if self.pinned_host_bytes + needs > max {
                return Err(format!(
                    "{name:?} ({needs} host bytes) cannot fit beside the pinned adapters ({} of {max} bytes)",
                    self.pinned_host_bytes
                ));
            }
        }
        if tally.candidates != (self.host.candidates.len(), self.device.idle.len(), self.device.queued.len())
            || tally.named != (self.host.named.len(), self.host.named_bytes)
        {
            return Err("candidate sets and adapters disagree".into());
        }
        let overdue = self
            .adapters
            .iter()
            .flatten()
            .filter(|a| a.tenancy.deferred_plans >= crate::limits::OVERDUE_AFTER)
            .count();
        if overdue != self.overdue {
            return Err(format!("{overdue} overdue adapters, counter {}", self.overdue));
        }
        Ok(())
    }
}
