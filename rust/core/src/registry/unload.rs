//! Unloading: an adapter is unregistered at once (no new requests, its pin dropped), and forgotten
//! once its requests in flight drain. Forgotten names are remembered for a while, so that a repeated
//! unload is a no-op rather than an error.

use std::collections::VecDeque;

use super::Registry;
use crate::error::Result;
use crate::hash::FxHashMap;
use crate::limits::{MAX_UNLOADED_NAMES, OVERDUE_AFTER};
use crate::policy::AdapterKey;

/// What an unload found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unload {
    /// The adapter is forgotten (now, or by an earlier unload).
    Done,
    /// It is unregistered and `in_flight` requests still use it.
    Draining {
        /// Requests still using it.
        in_flight: u64,
        /// The registration being unloaded: [`Registry::continue_unload`] goes on with this one,
        /// not with a later adapter registered under the same name.
        serial: u64,
    },
}

/// Names unloaded (and not registered again), each with the number of its latest forget; `order`
/// holds the latest [`MAX_UNLOADED_NAMES`] forgets, oldest first, and a name leaves with its latest
/// one (a server unloading ever new names must not grow this without bound).
#[derive(Debug, Default)]
pub(super) struct UnloadedNames {
    latest: FxHashMap<String, u64>,
    order: VecDeque<(u64, String)>,
    forgets: u64,
}

impl UnloadedNames {
    fn contains(&self, name: &str) -> bool {
        self.latest.contains_key(name)
    }

    fn remember(&mut self, name: String) {
        self.forgets += 1;
        self.latest.insert(name.clone(), self.forgets);
        self.order.push_back((self.forgets, name));
        while self.order.len() > MAX_UNLOADED_NAMES {
            if let Some((forget, old)) = self.order.pop_front() {
                if self.latest.get(&old) == Some(&forget) {
                    self.latest.remove(&old);
                }
            }
        }
    }

    /// `name` is registered again: unloading it is no longer a no-op.
    pub(super) fn forget_name(&mut self, name: &str) {
        self.latest.remove(name);
    }
}

impl Registry {
    /// Whether `name` was unloaded (among the latest [`MAX_UNLOADED_NAMES`] names) and not
    /// registered since.
    pub fn was_unloaded(&self, name: &str) -> bool {
        self.unloaded.contains(name)
    }

    /// Starts (or continues) unloading `name`: it is unregistered (no new acquires, its pin dropped)
    /// and forgotten as soon as no request is in flight. Unloading a forgotten adapter is `Done`.
    ///
    /// Errors: [`crate::Error::AdapterNotFound`] for a name never registered.
    pub fn unload(&mut self, name: &str) -> Result<Unload> {
        let Some(&key) = self.by_name.get(name) else {
            return if self.unloaded.contains(name) { Ok(Unload::Done) } else { Err(self.not_found(name)) };
        };
        self.get_mut(key).protection.draining = true;
        self.drop_pin(key);
        // A read in flight is cancelled at once, whatever the requests still in flight: the
        // reservation is released now, and the reader's report is refused (it drops the bytes).
        if self.get(key).tenancy.fetching {
            self.end_fetch(key, None, &mut Vec::new());
        }
        Ok(self.finish_unload(key))
    }

    /// Goes on with an unload [`Registry::unload`] started: `serial` is from its
    /// [`Unload::Draining`]. [`Unload::Done`] once that registration is forgotten (now, or already:
    /// an adapter registered since under the same name is left alone).
    pub fn continue_unload(&mut self, serial: u64) -> Unload {
        let key = self
            .adapters
            .iter()
            .position(|a| a.as_ref().is_some_and(|a| a.identity.serial == serial && a.protection.draining));
        match key {
            Some(index) => self.finish_unload(AdapterKey(index as u32)),
            None => Unload::Done,
        }
    }

    fn finish_unload(&mut self, key: AdapterKey) -> Unload {
        let a = self.get(key);
        if a.protection.in_flight > 0 {
            return Unload::Draining { in_flight: a.protection.in_flight, serial: a.identity.serial };
        }
        self.forget(key);
        Unload::Done
    }

    fn forget(&mut self, key: AdapterKey) {
        if self.get(key).tenancy.slot.is_some() {
            self.free_slot(key);
        }
        if self.get(key).tenancy.host_since.is_some() {
            self.leave_host(key);
        }
        let a = self.get_mut(key);
        a.protection.in_step = false;
        a.protection.loading = None;
        a.protection.fresh = false;
        self.refresh(key);
        self.step.retain(|&k| k != key);
        self.fresh.retain(|&k| k != key);
        self.named.retain(|&k| k != key);
        let a = self.adapters[key.index()].take().expect("a live adapter key");
        self.overdue -= usize::from(a.tenancy.deferred_plans >= OVERDUE_AFTER);
        self.bytes_registered.0 -= a.identity.size.host_bytes;
        self.bytes_registered.1 -= a.identity.size.device_bytes;
        self.names_epoch += 1;
        self.by_name.remove(&a.identity.name);
        self.by_id.remove(&a.identity.id);
        self.unloaded.remember(a.identity.spec.lora_name);
        self.free_keys.push(key.0);
    }
}

#[cfg(test)]
#[path = "unload_tests.rs"]
mod tests;
