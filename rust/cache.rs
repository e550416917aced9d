//! The two tiers: host memory (bounded by count and bytes) and device slots. An adapter is in the
//! device tier only if it is in the host tier, and a tier never holds more than its capacity, not
//! even briefly: victims leave before anything enters.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::policy::{AdapterKey, EvictionPolicy, Usage};
use crate::registry::Registry;

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

/// Host memory.
#[derive(Debug)]
pub(crate) struct HostTier {
    pub(crate) max_count: Option<usize>,
    pub(crate) max_bytes: Option<u64>,
    pub(crate) count: usize,
    pub(crate) bytes: u64,
    candidates: Box<dyn EvictionPolicy>,
    candidate_bytes: u64,
    pub(crate) counters: TierCounters,
}

impl HostTier {
    pub(crate) fn new(
        max_count: Option<usize>,
        max_bytes: Option<u64>,
        policy: Box<dyn EvictionPolicy>,
    ) -> Self {
        Self {
            max_count,
            max_bytes,
            count: 0,
            bytes: 0,
            candidates: policy,
            candidate_bytes: 0,
            counters: TierCounters::default(),
        }
    }

    /// Whether one more adapter of `bytes` fits now.
    fn has_room(&self, bytes: u64) -> bool {
        self.max_count.is_none_or(|m| self.count < m)
            && self.max_bytes.is_none_or(|m| self.bytes + bytes <= m)
    }

    /// Whether one more adapter of `bytes` would fit after evicting every candidate.
    pub(crate) fn room_possible(&self, bytes: u64) -> bool {
        let count = self.count - self.candidates.len();
        let used = self.bytes - self.candidate_bytes;
        self.max_count.is_none_or(|m| count < m) && self.max_bytes.is_none_or(|m| used + bytes <= m)
    }

    /// Why [`HostTier::room_possible`] is false, with the numbers.
    pub(crate) fn shortage(&self, bytes: u64) -> String {
        let protected = self.count - self.candidates.len();
        let mut why = format!(
            "the host tier holds {} adapter(s) ({} bytes), {protected} of them protected (pinned, in flight, \
             loading or in the current step)",
            self.count, self.bytes
        );
        if let Some(m) = self.max_count {
            why.push_str(&format!("; max_loaded_loras={m}"));
        }
        if let Some(m) = self.max_bytes {
            why.push_str(&format!(
                "; max_host_bytes={m}, of which protected adapters take {} and this one needs {bytes}",
                self.bytes - self.candidate_bytes
            ));
        }
        why
    }
}

/// Device slots.
#[derive(Debug)]
pub(crate) struct DeviceTier {
    pub(crate) slots: Vec<Option<AdapterKey>>,
    /// Bumped whenever a slot's occupant changes, so a plan can be checked against later changes.
    pub(crate) generations: Vec<u64>,
    free: BTreeSet<u32>,
    idle: Box<dyn EvictionPolicy>,
    queued: Box<dyn EvictionPolicy>,
    pub(crate) counters: TierCounters,
}

impl DeviceTier {
    pub(crate) fn new(slots: u32, idle: Box<dyn EvictionPolicy>, queued: Box<dyn EvictionPolicy>) -> Self {
        Self {
            slots: vec![None; slots as usize],
            generations: vec![0; slots as usize],
            free: (0..slots).collect(),
            idle,
            queued,
            counters: TierCounters::default(),
        }
    }

    /// Whether a slot is free or can be freed by an eviction.
    pub(crate) fn slot_possible(&self) -> bool {
        !self.free.is_empty() || !self.idle.is_empty() || !self.queued.is_empty()
    }
}

impl Registry {
    /// Puts `key` into exactly the candidate sets its residency and protections call for.
    pub(crate) fn refresh(&mut self, key: AdapterKey) {
        let a = self.adapters[key.index()].as_mut().expect("a live adapter key");
        let protected = a.r.pinned || a.loading.is_some() || a.in_step;
        let host_wanted = a.host_since.is_some() && !protected && a.in_flight == 0;
        let device_wanted = match (a.slot, protected, a.in_flight) {
            (Some(_), false, 0) => DeviceCandidate::Idle,
            (Some(_), false, _) => DeviceCandidate::Queued,
            _ => DeviceCandidate::No,
        };
        let usage = |inserted_at: u64, bytes: u64| Usage {
            inserted_at,
            last_used: a.last_used,
            uses: a.uses,
            bytes,
            rank: a.size.rank,
        };
        if a.host_candidate != host_wanted {
            if host_wanted {
                let u = usage(a.host_since.unwrap_or_default(), a.size.host_bytes);
                self.host.candidates.insert(key, &u);
                self.host.candidate_bytes += a.size.host_bytes;
            } else {
                self.host.candidates.remove(key);
                self.host.candidate_bytes -= a.size.host_bytes;
            }
            a.host_candidate = host_wanted;
        }
        if a.device_candidate != device_wanted {
            match a.device_candidate {
                DeviceCandidate::Idle => self.device.idle.remove(key),
                DeviceCandidate::Queued => self.device.queued.remove(key),
                DeviceCandidate::No => {}
            }
            let u = usage(a.device_since, a.size.device_bytes);
            match device_wanted {
                DeviceCandidate::Idle => self.device.idle.insert(key, &u),
                DeviceCandidate::Queued => self.device.queued.insert(key, &u),
                DeviceCandidate::No => {}
            }
            a.device_candidate = device_wanted;
        }
    }

    /// Evicts host candidates, in policy order, until an adapter of `bytes` fits. The caller has
    /// checked [`HostTier::room_possible`].
    pub(crate) fn make_host_room(&mut self, bytes: u64, evicted: &mut Vec<Eviction>) {
        while !self.host.has_room(bytes) {
            let victim = self.host.candidates.victim().expect("room_possible promised a host victim");
            if self.get(victim).slot.is_some() {
                self.evict_device(victim, evicted);
            }
            let name = Arc::clone(&self.get(victim).name);
            self.leave_host(victim);
            self.refresh(victim);
            self.host.counters.evictions += 1;
            evicted.push(Eviction { name, tier: Tier::Host, slot: None });
        }
    }

    /// A free slot, evicting a device candidate (idle ones first) when none is free. The caller has
    /// checked [`DeviceTier::slot_possible`].
    pub(crate) fn take_slot(&mut self, evicted: &mut Vec<Eviction>) -> u32 {
        if let Some(slot) = self.device.free.pop_first() {
            return slot;
        }
        let victim = self.device.idle.victim().or_else(|| self.device.queued.victim());
        let slot = self.evict_device(victim.expect("slot_possible promised a device victim"), evicted);
        self.device.free.remove(&slot);
        slot
    }

    /// Puts `key` into `slot` (free, taken with [`Registry::take_slot`]).
    pub(crate) fn occupy_slot(&mut self, key: AdapterKey, slot: u32) {
        debug_assert!(self.device.slots[slot as usize].is_none());
        let now = self.tick();
        self.device.slots[slot as usize] = Some(key);
        self.device.generations[slot as usize] += 1;
        let a = self.get_mut(key);
        a.slot = Some(slot);
        a.device_since = now;
        self.refresh(key);
    }

    /// Enters `key` into the host tier (room was made).
    pub(crate) fn enter_host(&mut self, key: AdapterKey) {
        let now = self.tick();
        let a = self.get_mut(key);
        a.host_since = Some(now);
        let bytes = a.size.host_bytes;
        self.host.count += 1;
        self.host.bytes += bytes;
        self.refresh(key);
    }

    fn evict_device(&mut self, key: AdapterKey, evicted: &mut Vec<Eviction>) -> u32 {
        let slot = self.free_slot(key);
        self.device.counters.evictions += 1;
        evicted.push(Eviction {
            name: Arc::clone(&self.get(key).name),
            tier: Tier::Device,
            slot: Some(slot),
        });
        slot
    }

    /// Takes `key` out of its slot (which becomes free) and returns the slot.
    pub(crate) fn free_slot(&mut self, key: AdapterKey) -> u32 {
        let slot = self.get_mut(key).slot.take().expect("the adapter has a slot");
        self.device.slots[slot as usize] = None;
        self.device.generations[slot as usize] += 1;
        self.device.free.insert(slot);
        self.refresh(key);
        slot
    }

    /// Takes `key` out of the host tier (it must have left the device tier already).
    pub(crate) fn leave_host(&mut self, key: AdapterKey) {
        let a = self.get_mut(key);
        debug_assert!(a.slot.is_none(), "an adapter leaves the device tier before the host tier");
        a.host_since = None;
        let bytes = a.size.host_bytes;
        self.host.count -= 1;
        self.host.bytes -= bytes;
        self.refresh(key);
    }

    /// Checks every internal invariant; `Err` describes the first broken one. For tests.
    pub fn audit(&self) -> std::result::Result<(), String> {
        let mut count = 0;
        let mut bytes = 0;
        let mut pinned = 0;
        let (mut host_cands, mut idle, mut queued) = (0, 0, 0);
        let mut registered = (0u64, 0u64);
        for (index, a) in self.adapters.iter().enumerate() {
            let Some(a) = a else { continue };
            let name = &a.r.lora_name;
            registered = (registered.0 + a.size.host_bytes, registered.1 + a.size.device_bytes);
            if a.host_since.is_some() {
                count += 1;
                bytes += a.size.host_bytes;
            } else if a.slot.is_some() {
                return Err(format!("{name:?} is in slot {:?} but not in the host tier", a.slot));
            }
            if let Some(slot) = a.slot {
                if self.device.slots.get(slot as usize) != Some(&Some(AdapterKey(index as u32))) {
                    return Err(format!("{name:?} says slot {slot} but the slot says otherwise"));
                }
            }
            if a.r.pinned {
                pinned += 1;
                if a.draining {
                    return Err(format!("{name:?} is pinned while being unloaded"));
                }
            }
            let protected = a.r.pinned || a.loading.is_some() || a.in_step;
            if a.host_candidate != (a.host_since.is_some() && !protected && a.in_flight == 0) {
                return Err(format!("{name:?} has the wrong host candidacy"));
            }
            host_cands += usize::from(a.host_candidate);
            match a.device_candidate {
                DeviceCandidate::Idle => idle += 1,
                DeviceCandidate::Queued => queued += 1,
                DeviceCandidate::No => {}
            }
            if (a.device_candidate != DeviceCandidate::No) != (a.slot.is_some() && !protected) {
                return Err(format!("{name:?} has the wrong device candidacy"));
            }
            if a.in_step != self.step.contains(&AdapterKey(index as u32)) {
                return Err(format!("{name:?} disagrees with the step list"));
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
                    self.adapters.get(k.index()).and_then(Option::as_ref).and_then(|a| a.slot)
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
        if count != self.host.count || bytes != self.host.bytes {
            return Err(format!(
                "host tier says {} / {} bytes, adapters say {count} / {bytes}",
                self.host.count, self.host.bytes
            ));
        }
        if self.host.max_count.is_some_and(|m| count > m) || self.host.max_bytes.is_some_and(|m| bytes > m) {
            return Err(format!("host tier over capacity: {count} adapters, {bytes} bytes"));
        }
        if pinned != self.pinned || pinned >= self.config.slots {
            return Err(format!(
                "{pinned} pinned adapters (counter {}) for {} slots",
                self.pinned, self.config.slots
            ));
        }
        if (host_cands, idle, queued)
            != (self.host.candidates.len(), self.device.idle.len(), self.device.queued.len())
        {
            return Err("candidate sets and adapters disagree".into());
        }
        Ok(())
    }
}
