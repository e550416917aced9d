//! The registry: adapters by name and id, their in-flight counts, pins, and unload bookkeeping.
//! It owns the two tiers (`cache.rs`) and plans steps (`plan.rs`); every state change goes through
//! [`Registry::refresh`], which keeps each tier's eviction candidates exact.
//!
//! Protection classes, kept apart:
//! - **pinned**: the operator's choice, until unpinned; never evicted from either tier;
//! - **in the step**: admitted by the latest plan, until the next plan or [`Registry::end_step`];
//!   never evicted from either tier;
//! - **loading**: a planned load not yet reported done or failed; never evicted;
//! - **in flight**: acquired and not yet released. Never evicted from the host tier. In the device
//!   tier such an adapter is evicted only when no idle one is left: requests that are queued, not
//!   running, must not hold slots forever, or with more busy adapters than slots every other
//!   adapter would starve.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::cache::{DeviceCandidate, DeviceTier, HostTier, Tier, TierCounters};
use crate::error::{Error, Result};
use crate::hash::FxHashMap;
use crate::policy::{self, AdapterKey};
use crate::spec::{self, Limits, LoRARef};

/// How many unloaded names a registry remembers, so that unloading one again is a no-op (older ones
/// are then unknown: [`Error::AdapterNotFound`]).
pub const MAX_UNLOADED_NAMES: usize = 1 << 16;

/// The most device slots a registry has (each is a LoRA-sized buffer on the GPU: far more than fit).
pub const MAX_SLOTS: usize = 1 << 16;

/// How the registry is sized and which policies it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Device slots (`max_loras_per_batch`), at least 1.
    pub slots: usize,
    /// Host-tier capacity in adapters (`max_loaded_loras`); `None` is unbounded.
    pub max_loaded: Option<usize>,
    /// Host-tier capacity in bytes; `None` is unbounded.
    pub max_host_bytes: Option<u64>,
    /// The device tier's eviction policy (`lru`, `fifo`, `reuse` or `hybrid`; see [`crate::policy`]).
    pub device_policy: String,
    /// The host tier's eviction policy.
    pub host_policy: String,
    /// Longest segment in tokens in a plan's segment arrays; `None` leaves segments whole.
    pub chunk_size: Option<usize>,
}

impl Config {
    /// `slots` device slots, everything else unbounded, LRU in both tiers.
    pub fn new(slots: usize) -> Self {
        Self {
            slots,
            max_loaded: None,
            max_host_bytes: None,
            device_policy: "lru".into(),
            host_policy: "lru".into(),
            chunk_size: None,
        }
    }
}

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

/// Where a planned load reads the adapter from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoadSource {
    /// The weights are in the host tier: copy them into the slot.
    Host,
    /// The adapter was evicted from the host tier: read it from its path, then copy it.
    Disk,
}

impl LoadSource {
    /// `"host"` or `"disk"`.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadSource::Host => "host",
            LoadSource::Disk => "disk",
        }
    }
}

/// One registered (or draining) adapter.
#[derive(Debug, Clone)]
pub(crate) struct Adapter {
    pub(crate) r: LoRARef,
    pub(crate) name: Arc<str>,
    pub(crate) id: Arc<str>,
    pub(crate) size: AdapterSize,
    pub(crate) in_flight: u64,
    /// Unregistered: no new acquires; forgotten once `in_flight` is 0 and an unload asks.
    pub(crate) draining: bool,
    /// Which registration this is: unique for the registry's life, unlike names, ids and keys.
    pub(crate) serial: u64,
    pub(crate) loading: Option<LoadSource>,
    pub(crate) in_step: bool,
    /// Logical time it entered the host tier, when resident there.
    pub(crate) host_since: Option<u64>,
    pub(crate) slot: Option<u32>,
    pub(crate) device_since: u64,
    pub(crate) last_used: u64,
    pub(crate) uses: u64,
    pub(crate) host_candidate: bool,
    pub(crate) device_candidate: DeviceCandidate,
}

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

/// Names, ids, counts, pins and the two tiers. Not thread-safe by itself: see `shared.rs`.
#[derive(Debug)]
pub struct Registry {
    pub(crate) config: Config,
    pub(crate) adapters: Vec<Option<Adapter>>,
    free_keys: Vec<u32>,
    by_name: FxHashMap<Arc<str>, AdapterKey>,
    by_id: FxHashMap<Arc<str>, AdapterKey>,
    /// Names unloaded (and not registered again), so a repeated unload is a no-op, each with the
    /// number of its latest forget; `unloaded_order` holds the latest [`MAX_UNLOADED_NAMES`] forgets,
    /// oldest first, and a name leaves with its latest one.
    unloaded: FxHashMap<String, u64>,
    unloaded_order: VecDeque<(u64, String)>,
    forgets: u64,
    pub(crate) host: HostTier,
    pub(crate) device: DeviceTier,
    pub(crate) clock: u64,
    pub(crate) pinned: usize,
    pinned_host_bytes: u64,
    pub(crate) step: Vec<AdapterKey>,
    /// Per adapter key, the latest plan's decision (planning scratch, kept to reuse its memory).
    pub(crate) plan_marks: Vec<i32>,
    /// An empty buffer for the next plan's `step` (the previous step's, kept to reuse its memory).
    pub(crate) spare_step: Vec<AdapterKey>,
    names_epoch: u64,
    registrations: u64,
    /// Host and device bytes of every registered adapter: every byte count the tiers keep is a part
    /// of these, so checking them at register keeps all the sums from overflowing.
    pub(crate) bytes_registered: (u64, u64),
}

impl Registry {
    /// An empty registry.
    ///
    /// Errors: [`Error::Spec`] when `slots` is 0 or above [`MAX_SLOTS`], `max_loaded < slots`,
    /// `max_host_bytes` or `chunk_size` is 0, or a policy name is unknown.
    pub fn new(config: Config) -> Result<Self> {
        spec::check_limits(
            0,
            0,
            Limits { max_loras_per_batch: Some(config.slots), max_loaded_loras: config.max_loaded },
        )?;
        if config.max_host_bytes == Some(0) {
            return Err(Error::Spec("max_host_bytes must be at least 1 (got 0)".into()));
        }
        if config.chunk_size == Some(0) {
            return Err(Error::Spec("chunk_size must be at least 1 (got 0)".into()));
        }
        if config.slots > MAX_SLOTS {
            return Err(Error::Spec(format!(
                "max_loras_per_batch={} is too large: at most {MAX_SLOTS} device slots",
                config.slots
            )));
        }
        let slots = config.slots as u32;
        let host = HostTier::new(
            config.max_loaded,
            config.max_host_bytes,
            policy::by_name("host_eviction_policy", &config.host_policy)?,
        );
        let device = DeviceTier::new(
            slots,
            policy::by_name("eviction_policy", &config.device_policy)?,
            policy::by_name("eviction_policy", &config.device_policy)?,
        );
        Ok(Self {
            config,
            adapters: Vec::new(),
            free_keys: Vec::new(),
            by_name: FxHashMap::default(),
            by_id: FxHashMap::default(),
            unloaded: FxHashMap::default(),
            unloaded_order: VecDeque::new(),
            forgets: 0,
            host,
            device,
            clock: 0,
            pinned: 0,
            pinned_host_bytes: 0,
            step: Vec::new(),
            plan_marks: Vec::new(),
            spare_step: Vec::new(),
            names_epoch: 0,
            registrations: 0,
            bytes_registered: (0, 0),
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(crate) fn get(&self, key: AdapterKey) -> &Adapter {
        self.adapters[key.index()].as_ref().expect("a live adapter key")
    }

    pub(crate) fn get_mut(&mut self, key: AdapterKey) -> &mut Adapter {
        self.adapters[key.index()].as_mut().expect("a live adapter key")
    }

    fn not_found(&self, name: &str) -> Error {
        let mut registered: Vec<String> =
            self.adapters.iter().flatten().filter(|a| !a.draining).map(|a| a.r.lora_name.clone()).collect();
        registered.sort_unstable();
        Error::AdapterNotFound { name: name.to_owned(), registered }
    }

    /// A counter that changes whenever a name starts or stops naming a key (a register, a forget),
    /// so a caller may keep `name -> key` answers of [`Registry::lookup`] for as long as it is
    /// unchanged (keys are reused after a forget).
    pub fn names_epoch(&self) -> u64 {
        self.names_epoch
    }

    /// The key of a registered adapter, or of one being unloaded when `draining_too`.
    ///
    /// Errors: [`Error::AdapterNotFound`] listing what is registered.
    pub fn lookup(&self, name: &str, draining_too: bool) -> Result<AdapterKey> {
        match self.by_name.get(name) {
            Some(&key) if draining_too || !self.get(key).draining => Ok(key),
            _ => Err(self.not_found(name)),
        }
    }

    /// The ref registered under `name` (its `pinned` is the current pin state).
    ///
    /// Errors: [`Error::AdapterNotFound`].
    pub fn lora_ref(&self, name: &str) -> Result<LoRARef> {
        Ok(self.get(self.lookup(name, true)?).r.clone())
    }

    /// Requests in flight for `name` (registered or being unloaded).
    ///
    /// Errors: [`Error::AdapterNotFound`].
    pub fn in_flight(&self, name: &str) -> Result<u64> {
        Ok(self.get(self.lookup(name, true)?).in_flight)
    }

    /// Whether `name` is registered (and not being unloaded).
    pub fn contains(&self, name: &str) -> bool {
        self.lookup(name, false).is_ok()
    }

    /// The number of registered adapters (those being unloaded excluded).
    pub fn len(&self) -> usize {
        self.adapters.iter().flatten().filter(|a| !a.draining).count()
    }

    /// Whether no adapter is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers `r`, whose weights the caller has just loaded into host memory. Host-tier victims
    /// are evicted first when the tier is full; their names are returned so the caller frees them.
    /// A pinned `r` is pinned with [`Registry::pin`]'s checks.
    ///
    /// Errors: [`Error::DuplicateAdapter`] naming both refs (same name or same id);
    /// [`Error::AdapterInUse`] while an adapter of that name is being unloaded; [`Error::Capacity`]
    /// when the pin or the host tier cannot take it (nothing is evicted then); [`Error::Spec`] for a
    /// rank of 0 or a non-finite scaling.
    pub fn register(&mut self, r: LoRARef, size: AdapterSize) -> Result<Vec<String>> {
        if size.rank == 0 {
            return Err(Error::Spec(format!("adapter {:?}: rank must be at least 1 (got 0)", r.lora_name)));
        }
        if !size.scaling.is_finite() {
            return Err(Error::Spec(format!(
                "adapter {:?}: scaling must be finite (got {})",
                r.lora_name, size.scaling
            )));
        }
        if let Some(&key) = self.by_name.get(r.lora_name.as_str()) {
            let existing = self.get(key);
            if existing.draining && existing.in_flight > 0 {
                return Err(Error::AdapterInUse(format!(
                    "cannot register {}: an adapter named {:?} is being unloaded and {} request(s) still \
                     use it; finish the unload first",
                    describe(&r),
                    r.lora_name,
                    existing.in_flight
                )));
            }
            if existing.draining {
                return Err(Error::AdapterInUse(format!(
                    "cannot register {}: an earlier unload of {:?} timed out; its requests have finished \
                     since, so unload({:?}) again to finish it first",
                    describe(&r),
                    r.lora_name,
                    r.lora_name
                )));
            }
            return Err(Error::DuplicateAdapter { new: describe(&r), existing: describe(&existing.r) });
        }
        if let Some(&key) = self.by_id.get(r.lora_id.as_str()) {
            return Err(Error::DuplicateAdapter { new: describe(&r), existing: describe(&self.get(key).r) });
        }
        let (host_total, device_total) = self.bytes_registered;
        let totals = host_total.checked_add(size.host_bytes).zip(device_total.checked_add(size.device_bytes));
        let Some(totals) = totals else {
            return Err(Error::Spec(format!(
                "cannot register {}: its host_bytes={} or device_bytes={} would take the registered \
                 adapters' total past 2^64 bytes",
                describe(&r),
                size.host_bytes,
                size.device_bytes
            )));
        };
        if r.pinned {
            self.check_pin(&r.lora_name, size.host_bytes)?;
        }
        if !self.host.room_possible(size.host_bytes) {
            self.host.counters.refusals += 1;
            return Err(Error::Capacity(format!(
                "cannot register {}: {}",
                describe(&r),
                self.host.shortage(size.host_bytes)
            )));
        }
        let mut evicted = Vec::new();
        self.make_host_room(size.host_bytes, &mut evicted);
        let key = match self.free_keys.pop() {
            Some(k) => AdapterKey(k),
            None => {
                self.adapters.push(None);
                AdapterKey((self.adapters.len() - 1) as u32)
            }
        };
        let now = self.tick();
        let name: Arc<str> = Arc::from(r.lora_name.as_str());
        let id: Arc<str> = Arc::from(r.lora_id.as_str());
        if r.pinned {
            self.pinned += 1;
            self.pinned_host_bytes += size.host_bytes;
        }
        self.unloaded.remove(r.lora_name.as_str());
        self.names_epoch += 1;
        self.registrations += 1;
        self.bytes_registered = totals;
        self.by_name.insert(name.clone(), key);
        self.by_id.insert(id.clone(), key);
        self.adapters[key.index()] = Some(Adapter {
            r,
            name,
            id,
            size,
            in_flight: 0,
            draining: false,
            serial: self.registrations,
            loading: None,
            in_step: false,
            host_since: Some(now),
            slot: None,
            device_since: 0,
            last_used: now,
            uses: 0,
            host_candidate: false,
            device_candidate: DeviceCandidate::No,
        });
        self.host.count += 1;
        self.host.bytes += size.host_bytes;
        self.host.counters.loads += 1;
        self.refresh(key);
        Ok(evicted.into_iter().filter(|e| e.tier == Tier::Host).map(|e| e.name.to_string()).collect())
    }

    fn check_pin(&mut self, name: &str, host_bytes: u64) -> Result<()> {
        let slots = self.config.slots;
        if self.pinned + 1 > slots - 1 {
            self.device.counters.refusals += 1;
            return Err(Error::Capacity(format!(
                "cannot pin adapter {name:?}: {} adapter(s) are pinned and max_loras_per_batch={slots} \
                 allows at most {} pinned, so that one device slot stays for unpinned adapters",
                self.pinned,
                slots - 1
            )));
        }
        if let Some(max) = self.host.max_count {
            if self.pinned + 1 > max {
                self.host.counters.refusals += 1;
                return Err(Error::Capacity(format!(
                    "cannot pin adapter {name:?}: {} adapter(s) are pinned and max_loaded_loras={max}",
                    self.pinned
                )));
            }
        }
        if let Some(max) = self.host.max_bytes {
            if self.pinned_host_bytes + host_bytes > max {
                self.host.counters.refusals += 1;
                return Err(Error::Capacity(format!(
                    "cannot pin adapter {name:?} ({host_bytes} host bytes): pinned adapters already take \
                     {} of max_host_bytes={max}",
                    self.pinned_host_bytes
                )));
            }
        }
        Ok(())
    }

    /// Pins `name`: from now on it is never evicted from either tier (an adapter evicted from the host
    /// tier before is read again on its next use and stays). Pinning a pinned adapter does nothing.
    ///
    /// Errors: [`Error::AdapterNotFound`]; [`Error::Capacity`] with the numbers when fewer than one
    /// device slot would stay for unpinned adapters, or the pinned adapters would overflow the host tier.
    pub fn pin(&mut self, name: &str) -> Result<()> {
        let key = self.lookup(name, false)?;
        let a = self.get(key);
        if a.r.pinned {
            return Ok(());
        }
        let bytes = a.size.host_bytes;
        self.check_pin(name, bytes)?;
        self.pinned += 1;
        self.pinned_host_bytes += bytes;
        self.get_mut(key).r.pinned = true;
        self.refresh(key);
        Ok(())
    }

    /// Unpins `name`; it becomes an ordinary eviction candidate. Unpinning an unpinned adapter does nothing.
    ///
    /// Errors: [`Error::AdapterNotFound`].
    pub fn unpin(&mut self, name: &str) -> Result<()> {
        let key = self.lookup(name, false)?;
        self.drop_pin(key);
        Ok(())
    }

    fn drop_pin(&mut self, key: AdapterKey) {
        let a = self.get_mut(key);
        if a.r.pinned {
            a.r.pinned = false;
            let bytes = a.size.host_bytes;
            self.pinned -= 1;
            self.pinned_host_bytes -= bytes;
            self.refresh(key);
        }
    }

    /// Looks up every name and counts one more request in flight for each, atomically: on an error
    /// nothing is counted. `None` (the base model) passes through. Returns the adapters' ids.
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name not registered (or being unloaded).
    pub fn acquire(&mut self, names: &[Option<&str>]) -> Result<Vec<Option<Arc<str>>>> {
        let keys =
            names.iter().map(|n| n.map(|n| self.lookup(n, false)).transpose()).collect::<Result<Vec<_>>>()?;
        Ok(keys
            .into_iter()
            .map(|key| {
                key.map(|key| {
                    let a = self.get_mut(key);
                    a.in_flight += 1;
                    let id = a.id.clone();
                    if a.in_flight == 1 {
                        self.refresh(key);
                    }
                    id
                })
            })
            .collect())
    }

    /// Counts one request less in flight per id, atomically (`None` passes through). Returns whether
    /// an adapter being unloaded drained, so waiters can be woken.
    ///
    /// Errors: [`Error::AdapterNotFound`] for an unknown id; [`Error::Usage`] when an id is released
    /// more often than it is in flight (nothing is released then).
    pub fn release(&mut self, ids: &[Option<&str>]) -> Result<bool> {
        let mut wanted: Vec<(AdapterKey, u64)> = Vec::new();
        for id in ids.iter().flatten() {
            let Some(&key) = self.by_id.get(*id) else {
                return Err(Error::AdapterNotFound {
                    name: format!("id {id}"),
                    registered: self.adapters.iter().flatten().map(|a| a.id.to_string()).collect(),
                });
            };
            match wanted.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += 1,
                None => wanted.push((key, 1)),
            }
        }
        for &(key, n) in &wanted {
            let a = self.get(key);
            if a.in_flight < n {
                return Err(Error::Usage(format!(
                    "cannot release adapter {:?} (id {}) {n} time(s): only {} request(s) are in flight",
                    a.r.lora_name, a.id, a.in_flight
                )));
            }
        }
        let mut drained = false;
        for (key, n) in wanted {
            let a = self.get_mut(key);
            a.in_flight -= n;
            if a.in_flight == 0 {
                drained |= a.draining;
                self.refresh(key);
            }
        }
        Ok(drained)
    }

    /// Starts (or continues) unloading `name`: it is unregistered (no new acquires, its pin dropped)
    /// and forgotten as soon as no request is in flight. Unloading a forgotten adapter is `Done`.
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name never registered.
    pub fn unload(&mut self, name: &str) -> Result<Unload> {
        let Some(&key) = self.by_name.get(name) else {
            return if self.unloaded.contains_key(name) {
                Ok(Unload::Done)
            } else {
                Err(self.not_found(name))
            };
        };
        self.get_mut(key).draining = true;
        self.drop_pin(key);
        Ok(self.finish_unload(key))
    }

    /// Goes on with an unload [`Registry::unload`] started: `serial` is from its
    /// [`Unload::Draining`]. [`Unload::Done`] once that registration is forgotten (now, or already:
    /// an adapter registered since under the same name is left alone).
    pub fn continue_unload(&mut self, serial: u64) -> Unload {
        let key =
            self.adapters.iter().position(|a| a.as_ref().is_some_and(|a| a.serial == serial && a.draining));
        match key {
            Some(index) => self.finish_unload(AdapterKey(index as u32)),
            None => Unload::Done,
        }
    }

    fn finish_unload(&mut self, key: AdapterKey) -> Unload {
        let a = self.get(key);
        if a.in_flight > 0 {
            return Unload::Draining { in_flight: a.in_flight, serial: a.serial };
        }
        self.forget(key);
        Unload::Done
    }

    fn forget(&mut self, key: AdapterKey) {
        if self.get(key).slot.is_some() {
            self.free_slot(key);
        }
        if self.get(key).host_since.is_some() {
            self.leave_host(key);
        }
        let a = self.get_mut(key);
        a.in_step = false;
        a.loading = None;
        self.refresh(key);
        self.step.retain(|&k| k != key);
        let a = self.adapters[key.index()].take().expect("a live adapter key");
        self.bytes_registered.0 -= a.size.host_bytes;
        self.bytes_registered.1 -= a.size.device_bytes;
        self.names_epoch += 1;
        self.by_name.remove(&a.name);
        self.by_id.remove(&a.id);
        self.remember_unloaded(a.r.lora_name);
        self.free_keys.push(key.0);
    }

    fn remember_unloaded(&mut self, name: String) {
        self.forgets += 1;
        self.unloaded.insert(name.clone(), self.forgets);
        self.unloaded_order.push_back((self.forgets, name));
        // A server that unloads ever new names must not grow this without bound.
        while self.unloaded_order.len() > MAX_UNLOADED_NAMES {
            if let Some((forget, old)) = self.unloaded_order.pop_front() {
                if self.unloaded.get(&old) == Some(&forget) {
                    self.unloaded.remove(&old);
                }
            }
        }
    }

    /// Ends the protection of the latest plan's adapters (the next plan does this itself).
    pub fn end_step(&mut self) {
        while let Some(key) = self.step.pop() {
            self.get_mut(key).in_step = false;
            self.refresh(key);
        }
    }

    /// The planned load of `name` finished: its loading protection ends.
    ///
    /// Errors: [`Error::AdapterNotFound`]; [`Error::Usage`] when no load of it is pending.
    pub fn load_done(&mut self, name: &str) -> Result<()> {
        let key = self.pending_load(name)?;
        self.get_mut(key).loading = None;
        self.refresh(key);
        Ok(())
    }

    /// The planned load of `name` failed: it is not in its device slot any more, nor in the host tier
    /// if the load was to read it from disk. Nothing else changes.
    ///
    /// Errors: [`Error::AdapterNotFound`]; [`Error::Usage`] when no load of it is pending.
    pub fn load_failed(&mut self, name: &str) -> Result<()> {
        let key = self.pending_load(name)?;
        let source = self.get_mut(key).loading.take();
        self.free_slot(key);
        if source == Some(LoadSource::Disk) {
            self.leave_host(key);
        }
        self.refresh(key);
        Ok(())
    }

    fn pending_load(&self, name: &str) -> Result<AdapterKey> {
        let key = self.lookup(name, true)?;
        if self.get(key).loading.is_none() {
            return Err(Error::Usage(format!("no load of adapter {name:?} is pending")));
        }
        Ok(key)
    }

    /// A snapshot of the counters and of what is resident and pinned.
    pub fn stats(&self) -> Stats {
        let mut host = TierStats { counters: self.host.counters, ..TierStats::default() };
        let mut device = TierStats { counters: self.device.counters, ..TierStats::default() };
        let mut registered = 0;
        let mut unloading = Vec::new();
        for a in self.adapters.iter().flatten() {
            if a.draining {
                unloading.push(a.r.lora_name.clone());
            } else {
                registered += 1;
            }
            if a.host_since.is_some() {
                host.resident.push(a.r.lora_name.clone());
                if a.r.pinned {
                    host.pinned.push(a.r.lora_name.clone());
                }
            }
            if a.slot.is_some() {
                device.resident.push(a.r.lora_name.clone());
                if a.r.pinned {
                    device.pinned.push(a.r.lora_name.clone());
                }
            }
        }
        for list in [&mut host.resident, &mut host.pinned, &mut device.resident, &mut device.pinned] {
            list.sort_unstable();
        }
        unloading.sort_unstable();
        host.used = self.host.count;
        host.capacity = self.host.max_count;
        host.bytes = self.host.bytes;
        host.max_bytes = self.host.max_bytes;
        device.used = device.resident.len();
        device.capacity = Some(self.config.slots);
        device.bytes =
            self.adapters.iter().flatten().filter(|a| a.slot.is_some()).map(|a| a.size.device_bytes).sum();
        Stats { registered, pinned: self.pinned, unloading, host, device }
    }
}

/// One tier's counters and contents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Hits, misses, loads, evictions and refusals so far.
    pub counters: TierCounters,
    /// Adapters resident, sorted by name.
    pub resident: Vec<String>,
    /// Pinned adapters resident, sorted by name.
    pub pinned: Vec<String>,
    /// Adapters resident (slots used, for the device tier).
    pub used: usize,
    /// Capacity in adapters (slots, for the device tier); `None` is unbounded.
    pub capacity: Option<usize>,
    /// Bytes resident.
    pub bytes: u64,
    /// Capacity in bytes; `None` is unbounded.
    pub max_bytes: Option<u64>,
}

/// [`Registry::stats`]: both tiers plus the registry's own numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Registered adapters (those being unloaded excluded).
    pub registered: usize,
    /// Pinned adapters.
    pub pinned: usize,
    /// Adapters being unloaded, waiting for their requests to finish.
    pub unloading: Vec<String>,
    /// The host tier.
    pub host: TierStats,
    /// The device tier.
    pub device: TierStats,
}

/// `name=path (id …)`, how errors show a ref.
fn describe(r: &LoRARef) -> String {
    format!("{:?} (path {:?}, id {})", r.lora_name, r.lora_path, r.lora_id)
}
