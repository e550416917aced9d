//! One registered adapter, in three named parts: who it is, what protects it from eviction, and
//! where it is resident.

use std::sync::Arc;

use super::tiers::{DeviceCandidate, HostCandidate};
use super::LoadSource;
use crate::spec::LoRARef;

/// What loading an adapter learned about it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterSize {
    /// LoRA rank, at least 1.
    pub rank: u32,
    /// Bytes its weights take in host memory.
    pub host_bytes: u64,
    /// Bytes its weights take in a device slot.
    pub device_bytes: u64,
    /// `lora_alpha / r` (or the rsLoRA form): the factor the expand kernel applies.
    pub scaling: f32,
}

/// Who an adapter is: fixed for the life of its registration.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    /// The spec it was registered with (its `pinned` is the pin asked at registration; the current
    /// pin state is [`Protection::pinned`]).
    pub(crate) spec: LoRARef,
    /// The name, shared with plans and evictions (no copy per step).
    pub(crate) name: Arc<str>,
    /// The id, shared likewise.
    pub(crate) id: Arc<str>,
    /// Which registration this is: unique for the registry's life, unlike names, ids and keys.
    pub(crate) serial: u64,
    pub(crate) size: AdapterSize,
}

/// What keeps an adapter from being evicted (or forgotten), each class kept apart.
#[derive(Debug, Clone, Default)]
pub(crate) struct Protection {
    /// The operator's choice, until unpinned.
    pub(crate) pinned: bool,
    /// Requests acquired and not yet released.
    pub(crate) in_flight: u64,
    /// Unregistered: no new acquires; forgotten once `in_flight` is 0 and an unload asks.
    pub(crate) draining: bool,
    /// A planned load not yet reported done or failed.
    pub(crate) loading: Option<LoadSource>,
    /// Admitted by the open step (or the latest plan).
    pub(crate) in_step: bool,
    /// Of `in_flight`, the requests the open step transaction acquired (released by its finish).
    pub(crate) step_holds: u64,
    /// Fetched, and no plan has admitted it since (or left it out): its requests are waiting.
    pub(crate) fresh: bool,
}

impl Protection {
    /// Whether no tier may evict it, whatever its requests in flight.
    pub(crate) fn shields(&self) -> bool {
        self.pinned || self.loading.is_some() || self.in_step || self.fresh
    }
}

/// [`Tenancy::named_at`] of an adapter no request of the latest plan named.
pub(crate) const NOT_NAMED: u32 = u32::MAX;

/// Where an adapter is, and the history the eviction policies read.
#[derive(Debug, Clone)]
pub(crate) struct Tenancy {
    /// Logical time it entered the host tier, when resident there.
    pub(crate) host_since: Option<u64>,
    /// A background read is in flight (see `fetch`): not in the host tier yet, but its host bytes
    /// are reserved there; never in a slot.
    pub(crate) fetching: bool,
    pub(crate) slot: Option<u32>,
    pub(crate) device_since: u64,
    pub(crate) last_used: u64,
    pub(crate) uses: u64,
    pub(crate) host_candidate: HostCandidate,
    pub(crate) device_candidate: DeviceCandidate,
    /// The index of the first request naming it in the latest fetch-mode plan ([`NOT_NAMED`]: none).
    pub(crate) named_at: u32,
    /// The naming (see `Registry::name_requests`) that last set `named_at`.
    pub(crate) named_in: u64,
    /// Consecutive plans that named it and deferred it for room (device or host, or fairness);
    /// from [`crate::limits::OVERDUE_AFTER`] on it is admitted before younger requests.
    pub(crate) deferred_plans: u32,
}

/// One registered (or draining) adapter.
#[derive(Debug, Clone)]
pub(crate) struct Adapter {
    pub(crate) identity: Identity,
    pub(crate) protection: Protection,
    pub(crate) tenancy: Tenancy,
}

impl Adapter {
    /// Its spec with the current pin state.
    pub(crate) fn lora_ref(&self) -> LoRARef {
        LoRARef { pinned: self.protection.pinned, ..self.identity.spec.clone() }
    }

    pub(crate) fn spec_name(&self) -> &str {
        &self.identity.spec.lora_name
    }
}
