//! The registry's invariants, checked from scratch: for tests and fuzzing.

use super::tiers::DeviceCandidate;
use super::Registry;
use crate::policy::AdapterKey;

impl Registry {
    /// Checks every internal invariant; `Err` describes the first broken one. For tests.
    pub fn audit(&self) -> std::result::Result<(), String> {
        let mut count = 0;
        let mut bytes = 0;
        let (mut fetching, mut reserved) = (0, 0);
        let mut pinned = 0;
        let (mut host_cands, mut idle, mut queued) = (0, 0, 0);
        let mut registered = (0u64, 0u64);
        for (index, a) in self.adapters.iter().enumerate() {
            let Some(a) = a else { continue };
            let name = &a.identity.spec.lora_name;
            registered =
                (registered.0 + a.identity.size.host_bytes, registered.1 + a.identity.size.device_bytes);
            if a.residency.fetching {
                // Fetching: outside both tiers, its bytes reserved once, and nothing else to do
                // with it until the read is reported (an unload cancels the fetch at once).
                fetching += 1;
                reserved += a.identity.size.host_bytes;
                if a.residency.host_since.is_some() {
                    return Err(format!("{name:?} is being fetched and resident in the host tier"));
                }
                if a.protection.draining || a.protection.loading.is_some() {
                    return Err(format!("{name:?} is being fetched while being unloaded or loaded"));
                }
            }
            if a.residency.host_since.is_some() {
                count += 1;
                bytes += a.identity.size.host_bytes;
            } else if a.residency.slot.is_some() {
                return Err(format!("{name:?} is in slot {:?} but not in the host tier", a.residency.slot));
            }
            if let Some(slot) = a.residency.slot {
                if self.device.slots.get(slot as usize) != Some(&Some(AdapterKey(index as u32))) {
                    return Err(format!("{name:?} says slot {slot} but the slot says otherwise"));
                }
            }
            if a.protection.pinned {
                pinned += 1;
                if a.protection.draining {
                    return Err(format!("{name:?} is pinned while being unloaded"));
                }
            }
            let protected = a.protection.shields();
            if a.residency.host_candidate
                != (a.residency.host_since.is_some() && !protected && a.protection.in_flight == 0)
            {
                return Err(format!("{name:?} has the wrong host candidacy"));
            }
            host_cands += usize::from(a.residency.host_candidate);
            match a.residency.device_candidate {
                DeviceCandidate::Idle => idle += 1,
                DeviceCandidate::Queued => queued += 1,
                DeviceCandidate::No => {}
            }
            if (a.residency.device_candidate != DeviceCandidate::No)
                != (a.residency.slot.is_some() && !protected)
            {
                return Err(format!("{name:?} has the wrong device candidacy"));
            }
            if a.protection.step_holds > a.protection.in_flight {
                return Err(format!("{name:?} has more step holds than requests in flight"));
            }
            if a.protection.step_holds > 0 && !self.step_holds(AdapterKey(index as u32)) {
                return Err(format!("{name:?} has step holds but no open step holds it"));
            }
            if a.protection.in_step != self.step.contains(&AdapterKey(index as u32)) {
                return Err(format!("{name:?} disagrees with the step list"));
            }
            let fresh_listed = self.fresh.iter().filter(|&&k| k == AdapterKey(index as u32)).count();
            if usize::from(a.protection.fresh) != fresh_listed {
                return Err(format!("{name:?} disagrees with the fresh list"));
            }
            if a.protection.fresh && a.residency.host_since.is_none() {
                return Err(format!("{name:?} is fresh but not in the host tier"));
            }
        }
        if registered != self.bytes_registered {
            return Err(format!(
                "registered adapters hold {registered:?} (host, device) bytes, the total says {:?}",
                self.bytes_registered
            ));
        }
        for (slot, key) in self.device.slots.iter().enumerate() {
            let occupied_ok = match key {
                Some(k) => {
                    self.adapters.get(k.index()).and_then(Option::as_ref).and_then(|a| a.residency.slot)
                        == Some(slot as u32)
                }
                None => self.device.free.contains(&(slot as u32)),
            };
            if !occupied_ok {
                return Err(format!("slot {slot} and its adapter disagree"));
            }
        }
        if self.device.free.len() + self.device.slots.iter().flatten().count() != self.device.slots.len() {
            return Err("free slots and occupied slots do not add up".into());
        }
        if (fetching, reserved) != (self.host.reserved_count, self.host.reserved_bytes) {
            return Err(format!(
                "host tier reserves {} / {} bytes, fetching adapters say {fetching} / {reserved}",
                self.host.reserved_count, self.host.reserved_bytes
            ));
        }
        // The room used is the resident adapters plus the reservations, each counted once.
        let (count, bytes) = (count + fetching, bytes + reserved);
        if count != self.host.count || bytes != self.host.bytes {
            return Err(format!(
                "host tier says {} / {} bytes used, adapters and reservations say {count} / {bytes}",
                self.host.count, self.host.bytes
            ));
        }
        // Reservations evict nobody, so only the resident adapters are bounded by the capacity.
        let (resident, resident_bytes) = (count - fetching, bytes - reserved);
        if self.host.max_count.is_some_and(|m| resident > m)
            || self.host.max_bytes.is_some_and(|m| resident_bytes > m)
        {
            return Err(format!("host tier over capacity: {resident} adapters, {resident_bytes} bytes"));
        }
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
        if (host_cands, idle, queued)
            != (self.host.candidates.len(), self.device.idle.len(), self.device.queued.len())
        {
            return Err("candidate sets and adapters disagree".into());
        }
        let overdue = self
            .adapters
            .iter()
            .flatten()
            .filter(|a| a.residency.deferred_plans >= crate::limits::OVERDUE_AFTER)
            .count();
        if overdue != self.overdue {
            return Err(format!("{overdue} overdue adapters, counter {}", self.overdue));
        }
        Ok(())
    }
}
