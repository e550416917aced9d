//! The registry: adapters by name and id, their in-flight counts, pins, the two tiers and the
//! per-step planner, as one module tree:
//!
//! - `adapter`: one adapter's identity, protections and tenancy (where it is, its use history);
//! - `tiers`: the host ledger and the device slot table (counts, bytes, candidate sets);
//! - `pages`: the device tier's memory in rank pages (the page allocator, the page budget's rules);
//! - `moves`: moving adapters between tiers, keeping each tier's eviction candidates exact;
//! - `fetch`: background reads (the fetching state: host bytes reserved, read in flight);
//! - `lifecycle`: weights replaced in place under a name, and where every adapter is;
//! - `plan`: one scheduler step's admission, slots, loads and segment arrays;
//! - `step`: the step transaction (plan and acquire at once, `finish_step` releases all);
//! - `unload`: draining and forgetting adapters;
//! - `audit`: the invariants, for tests.
//!
//! Protection classes, kept apart:
//! - **pinned**: the operator's choice, until unpinned; never evicted from either tier;
//! - **in the step**: admitted by the open step (or the latest plan), until it ends; never evicted
//!   from either tier;
//! - **loading**: a planned load not yet reported done or failed; never evicted;
//! - **fetching**: a background read in flight; not in either tier yet, so never evicted, but its
//!   host bytes are reserved;
//! - **fresh**: fetched, until a plan admits it or leaves it out (its waiting requests are gone);
//!   never evicted, so a fetch is not undone before the requests that waited for it run;
//! - **named**: wanted by a request of the latest fetch-mode plan (waiting, or running in the
//!   engine between its steps); no fetch evicts it (but one for an overdue adapter named earlier),
//!   and other claims only once no adapter outside this and the classes above is left;
//! - **in flight**: acquired and not yet released. Never evicted from the host tier. In the device
//!   tier such an adapter is evicted only when no idle one is left: requests that are queued, not
//!   running, must not hold slots forever, or with more busy adapters than slots every other
//!   adapter would starve.

mod adapter;
mod audit;
mod fetch;
mod lifecycle;
mod moves;
mod offer;
mod pages;
mod plan;
mod step;
#[cfg(test)]
mod testkit;
pub mod tiers;
mod unload;

use std::sync::Arc;

pub use self::adapter::AdapterSize;
use self::adapter::{Adapter, Identity, Protection, Tenancy, NOT_NAMED};
pub use self::fetch::{Fetch, FetchPlan};
pub use self::lifecycle::{Place, Placement};
pub use self::offer::{AdmissionOrder, Offer, Wants};
pub use self::pages::Paging;
pub use self::plan::{Deferral, Hold, Load, StepPlan, StepRequests};
pub use self::step::{StepMode, StepRequest, StepStart, StepTicket};
use self::tiers::{DeviceCandidate, DeviceTier, HostCandidate, HostLedger, Tier, TierCounters};
pub use self::unload::Unload;
use crate::error::{Error, Result};
use crate::hash::FxHashMap;
pub use crate::limits::{MAX_SLOTS, MAX_UNLOADED_NAMES};
use crate::policy::{AdapterKey, PolicyKind};
use crate::spec::{self, Limits, LoRARef};

/// How the registry is sized and which policies it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Device slots (`max_loras_per_batch`), at least 1: with `paging`, the most distinct adapters
    /// one step holds (a bound beside the pages).
    pub slots: usize,
    /// The device tier in rank pages (`page_rank`, `max_lora_memory`); `None` is slot mode, where
    /// every adapter takes one of `slots` max-rank slots.
    pub paging: Option<Paging>,
    /// Host-tier capacity in adapters (`max_loaded_loras`); `None` is unbounded.
    pub max_loaded: Option<usize>,
    /// Host-tier capacity in bytes; `None` is unbounded.
    pub max_host_bytes: Option<u64>,
    /// The device tier's eviction policy (see [`crate::policy`]).
    pub device_policy: PolicyKind,
    /// The host tier's eviction policy.
    pub host_policy: PolicyKind,
    /// Longest segment in tokens in a plan's segment arrays; `None` leaves segments whole.
    pub chunk_size: Option<usize>,
}

impl Config {
    /// `slots` device slots, everything else unbounded, LRU in both tiers.
    pub fn new(slots: usize) -> Self {
        Self {
            slots,
            paging: None,
            max_loaded: None,
            max_host_bytes: None,
            device_policy: PolicyKind::Lru,
            host_policy: PolicyKind::Lru,
            chunk_size: None,
        }
    }
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

/// Names, ids, counts, pins and the two tiers. Not thread-safe by itself: see `shared.rs`.
#[derive(Debug)]
pub struct Registry {
    pub(crate) config: Config,
    pub(crate) adapters: Vec<Option<Adapter>>,
    free_keys: Vec<u32>,
    by_name: FxHashMap<Arc<str>, AdapterKey>,
    by_id: FxHashMap<Arc<str>, AdapterKey>,
    /// Names unloaded (and not registered again), so a repeated unload is a no-op; see `unload`.
    unloaded: unload::UnloadedNames,
    pub(crate) host: HostLedger,
    pub(crate) device: DeviceTier,
    pub(crate) clock: u64,
    pub(crate) pinned: usize,
    pinned_host_bytes: u64,
    pub(crate) step: Vec<AdapterKey>,
    /// The fresh adapters (see `fetch`).
    pub(crate) fresh: Vec<AdapterKey>,
    /// The adapters the latest fetch-mode plan's requests named (see `fetch`).
    pub(crate) named: Vec<AdapterKey>,
    /// Fetch-mode plans that named their requests' adapters so far.
    namings: u64,
    /// Per adapter key, the latest plan's decision (planning scratch, kept to reuse its memory).
    pub(crate) plan_marks: Vec<i32>,
    /// An empty buffer for the next plan's `step` (the previous step's, kept to reuse its memory).
    pub(crate) spare_step: Vec<AdapterKey>,
    /// How many adapters are overdue (deferred by [`crate::limits::OVERDUE_AFTER`] plans or more).
    pub(crate) overdue: usize,
    /// The step transaction [`Registry::begin_step`] opened, until [`Registry::finish_step`].
    open_step: Option<step::OpenStep>,
    steps_begun: u64,
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
    /// `max_host_bytes` or `chunk_size` is 0, or the paging has a `page_rank` of 0 or pages outside
    /// 1 to [`MAX_SLOTS`].
    pub fn new(config: Config) -> Result<Self> {
        if let Some(paging) = config.paging {
            paging.check()?;
        }
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
        let pages = config.paging.map_or(config.slots, |p| p.pages) as u32;
        let host = HostLedger::new(
            config.max_loaded,
            config.max_host_bytes,
            config.host_policy.build(),
            config.host_policy.build(),
        );
        let device = DeviceTier::new(pages, config.device_policy.build(), config.device_policy.build());
        Ok(Self {
            config,
            adapters: Vec::new(),
            free_keys: Vec::new(),
            by_name: FxHashMap::default(),
            by_id: FxHashMap::default(),
            unloaded: unload::UnloadedNames::default(),
            host,
            device,
            clock: 0,
            pinned: 0,
            pinned_host_bytes: 0,
            step: Vec::new(),
            fresh: Vec::new(),
            named: Vec::new(),
            namings: 0,
            plan_marks: Vec::new(),
            spare_step: Vec::new(),
            overdue: 0,
            open_step: None,
            steps_begun: 0,
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

    /// The [`Error::AdapterNotFound`] for `name`, listing the registered names.
    pub fn not_found(&self, name: &str) -> Error {
        Error::AdapterNotFound { name: name.to_owned(), registered: self.not_found_list() }
    }

    /// The registered names, sorted, as [`Error::AdapterNotFound`] lists them.
    pub(crate) fn not_found_list(&self) -> Vec<String> {
        let mut registered: Vec<String> = self
            .adapters
            .iter()
            .flatten()
            .filter(|a| !a.protection.draining)
            .map(|a| a.spec_name().to_owned())
            .collect();
        registered.sort_unstable();
        registered
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
            Some(&key) if draining_too || !self.get(key).protection.draining => Ok(key),
            _ => Err(self.not_found(name)),
        }
    }

    /// The ref registered under `name` (its `pinned` is the current pin state).
    ///
    /// Errors: [`Error::AdapterNotFound`].
    pub fn lora_ref(&self, name: &str) -> Result<LoRARef> {
        Ok(self.get(self.lookup(name, true)?).lora_ref())
    }

    /// Requests in flight for `name` (registered or being unloaded).
    ///
    /// Errors: [`Error::AdapterNotFound`].
    pub fn in_flight(&self, name: &str) -> Result<u64> {
        Ok(self.get(self.lookup(name, true)?).protection.in_flight)
    }

    /// The registration serial of `name` (registered or being unloaded): unique for the registry's
    /// life, so it tells a re-registered name from the registration a plan was made for.
    ///
    /// Errors: [`Error::AdapterNotFound`].
    pub fn serial(&self, name: &str) -> Result<u64> {
        Ok(self.get(self.lookup(name, true)?).identity.serial)
    }

    /// Whether `name` is registered (and not being unloaded).
    pub fn contains(&self, name: &str) -> bool {
        self.lookup(name, false).is_ok()
    }

    /// The number of registered adapters (those being unloaded excluded).
    pub fn len(&self) -> usize {
        self.adapters.iter().flatten().filter(|a| !a.protection.draining).count()
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
    /// when the pin or the host tier cannot take it, or it could never fit in the host tier beside
    /// the pinned adapters (see [`Registry::pin`]; nothing is evicted then); [`Error::Spec`] for a
    /// rank of 0, a non-finite scaling, or byte totals past 2^64.
    pub fn register(&mut self, r: LoRARef, size: AdapterSize) -> Result<Vec<String>> {
        check_size(&r, size)?;
        self.check_name_free(&r)?;
        let totals = self.registered_totals_with(&r, size)?;
        if r.pinned {
            self.check_pin(&r.lora_name, size, None)?;
        } else {
            let what = || format!("register {}", describe(&r));
            self.check_unpinned_pages(what, self.pages_of(size), self.device.pinned_pages)?;
            let what = || format!("register {} ({} host bytes)", describe(&r), size.host_bytes);
            self.check_pin_room(what, self.pinned_host_bytes, Some((&r.lora_name, size.host_bytes)), None)?;
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
        self.bytes_registered = totals;
        self.insert_adapter(r, size);
        Ok(evicted.into_iter().filter(|e| e.tier == Tier::Host).map(|e| e.name.to_string()).collect())
    }

    /// Refuses a name or id already taken (also by an adapter being unloaded).
    fn check_name_free(&self, r: &LoRARef) -> Result<()> {
        if let Some(&key) = self.by_name.get(r.lora_name.as_str()) {
            let existing = self.get(key);
            if existing.protection.draining && existing.protection.in_flight > 0 {
                return Err(Error::AdapterInUse(format!(
                    "cannot register {}: an adapter named {:?} is being unloaded and {} request(s) still \
                     use it; finish the unload first",
                    describe(r),
                    r.lora_name,
                    existing.protection.in_flight
                )));
            }
            if existing.protection.draining {
                return Err(Error::AdapterInUse(format!(
                    "cannot register {}: an earlier unload of {:?} timed out; its requests have finished \
                     since, so unload({:?}) again to finish it first",
                    describe(r),
                    r.lora_name,
                    r.lora_name
                )));
            }
            return Err(Error::DuplicateAdapter {
                new: describe(r),
                existing: describe(&existing.lora_ref()),
            });
        }
        if let Some(&key) = self.by_id.get(r.lora_id.as_str()) {
            return Err(Error::DuplicateAdapter {
                new: describe(r),
                existing: describe(&self.get(key).lora_ref()),
            });
        }
        Ok(())
    }

    /// The registered byte totals with `size` added, or why they would overflow.
    fn registered_totals_with(&self, r: &LoRARef, size: AdapterSize) -> Result<(u64, u64)> {
        let (host_total, device_total) = self.bytes_registered;
        host_total.checked_add(size.host_bytes).zip(device_total.checked_add(size.device_bytes)).ok_or_else(
            || {
                Error::Spec(format!(
                    "cannot register {}: its host_bytes={} or device_bytes={} would take the registered \
                     adapters' total past 2^64 bytes",
                    describe(r),
                    size.host_bytes,
                    size.device_bytes
                ))
            },
        )
    }

    /// Puts a checked `r` into the tables and the host tier (room was made).
    fn insert_adapter(&mut self, r: LoRARef, size: AdapterSize) {
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
        let pinned = r.pinned;
        if pinned {
            self.pinned += 1;
            self.pinned_host_bytes += size.host_bytes;
            self.device.pinned_pages += self.pages_of(size);
        }
        self.unloaded.forget_name(&r.lora_name);
        self.names_epoch += 1;
        self.registrations += 1;
        self.by_name.insert(name.clone(), key);
        self.by_id.insert(id.clone(), key);
        self.adapters[key.index()] = Some(Adapter {
            identity: Identity { spec: r, name, id, serial: self.registrations, size },
            protection: Protection { pinned, ..Protection::default() },
            tenancy: Tenancy {
                host_since: Some(now),
                fetching: false,
                slot: None,
                device_since: 0,
                last_used: now,
                uses: 0,
                host_candidate: HostCandidate::No,
                device_candidate: DeviceCandidate::No,
                named_at: NOT_NAMED,
                named_in: 0,
                deferred_plans: 0,
            },
        });
        self.host.count += 1;
        self.host.bytes += size.host_bytes;
        self.host.counters.loads += 1;
        self.refresh(key);
    }

    /// The registered unpinned adapter with the most host bytes, `except` aside: the one that needs
    /// the most room beside the pinned adapters.
    fn largest_unpinned(&self, except: Option<AdapterKey>) -> Option<(&str, u64)> {
        self.adapters
            .iter()
            .enumerate()
            .filter_map(|(i, a)| a.as_ref().filter(|a| !a.protection.pinned).map(|a| (i, a)))
            .filter(|&(i, _)| except != Some(AdapterKey(i as u32)))
            .map(|(_, a)| (a.spec_name(), a.identity.size.host_bytes))
            .max_by_key(|&(_, bytes)| bytes)
    }

    /// Whether `name` (`key` when registered) of `host_bytes` may be pinned: one slot stays for
    /// unpinned adapters, and every other registered adapter still fits in the host tier beside the
    /// pinned ones (else its requests would wait forever).
    fn check_pin(&mut self, name: &str, size: AdapterSize, key: Option<AdapterKey>) -> Result<()> {
        let (slots, host_bytes) = (self.config.slots, size.host_bytes);
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
        let pages = self.pages_of(size);
        self.check_pin_pages(name, pages, self.device.pinned_pages + pages, key)?;
        let what = || format!("pin adapter {name:?} ({host_bytes} host bytes)");
        self.check_pin_room(what, self.pinned_host_bytes + host_bytes, None, key)
    }

    /// The pin-room rule, for every change to the pinned adapters' host bytes or to an unpinned
    /// adapter's (a pin, a registration, a replacement): with `max_host_bytes`, the pinned adapters
    /// fit in the host tier, and every registered unpinned adapter fits in it beside them (else its
    /// requests would wait forever for room that can never come).
    ///
    /// `pinned` is the pinned adapters' host bytes after the change; `unpinned` the name and host
    /// bytes of an unpinned adapter after the change when the registry does not count it so yet (one
    /// being registered or replaced); `except` the registered adapter whose entry the change
    /// supersedes (left out of the registry's own unpinned ones). `what` says what is refused.
    ///
    /// Errors: [`Error::Capacity`] with the numbers (counted as a host-tier refusal).
    fn check_pin_room(
        &mut self,
        what: impl FnOnce() -> String,
        pinned: u64,
        unpinned: Option<(&str, u64)>,
        except: Option<AdapterKey>,
    ) -> Result<()> {
        let Some(max) = self.host.max_bytes else { return Ok(()) };
        let take = if pinned == self.pinned_host_bytes { "take" } else { "would take" };
        let why = if pinned > max {
            format!("the pinned adapters {take} {pinned} of max_host_bytes={max}")
        } else {
            // The registered unpinned adapters fit beside the pins as they are (the rule held before
            // this change), so only pins that grow need them looked through: a registration stays O(1).
            let registered =
                if pinned > self.pinned_host_bytes { self.largest_unpinned(except) } else { None };
            let largest = match (registered, unpinned) {
                (Some(a), Some(b)) => Some(if b.1 > a.1 { b } else { a }),
                (a, b) => a.or(b),
            };
            match largest.filter(|&(_, needs)| pinned.saturating_add(needs) > max) {
                None => return Ok(()),
                Some((other, needs)) => format!(
                    "the pinned adapters {take} {pinned} of max_host_bytes={max}, leaving {} bytes, and \
                     adapter {other:?} needs {needs}, so it could never enter the host tier beside them; \
                     every registered adapter must fit in the host tier beside the pinned ones (unload it, \
                     unpin one or raise max_host_bytes)",
                    max - pinned
                ),
            }
        };
        self.host.counters.refusals += 1;
        Err(Error::Capacity(format!("cannot {}: {why}", what())))
    }

    /// Pins `name`: from now on it is never evicted from either tier (an adapter evicted from the host
    /// tier before is read again on its next use and stays). Pinning a pinned adapter does nothing.
    ///
    /// Errors: [`Error::AdapterNotFound`]; [`Error::Capacity`] with the numbers when fewer than one
    /// device slot would stay for unpinned adapters, the pinned adapters would overflow the host tier,
    /// or another registered adapter would no longer fit in it beside them (the invariant that keeps
    /// every request from waiting forever: each registered adapter fits beside the pinned ones).
    pub fn pin(&mut self, name: &str) -> Result<()> {
        let key = self.lookup(name, false)?;
        let a = self.get(key);
        if a.protection.pinned {
            return Ok(());
        }
        let size = a.identity.size;
        self.check_pin(name, size, Some(key))?;
        self.pinned += 1;
        self.pinned_host_bytes += size.host_bytes;
        self.device.pinned_pages += self.pages_of(size);
        self.get_mut(key).protection.pinned = true;
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
        if a.protection.pinned {
            a.protection.pinned = false;
            let size = a.identity.size;
            self.pinned -= 1;
            self.pinned_host_bytes -= size.host_bytes;
            self.device.pinned_pages -= self.pages_of(size);
            self.refresh(key);
        }
    }

    /// Looks up every name and counts one more request in flight for each, atomically: on an error
    /// nothing is counted. `None` (the base model) passes through. Returns the adapters' ids.
    /// Test support only (with [`Registry::release`]: the unit tests' way to hold requests without
    /// a step); callers step with [`Registry::begin_step`], which plans and acquires at once.
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name not registered (or being unloaded).
    #[cfg(test)]
    pub(crate) fn acquire(&mut self, names: &[Option<&str>]) -> Result<Vec<Option<Arc<str>>>> {
        let keys =
            names.iter().map(|n| n.map(|n| self.lookup(n, false)).transpose()).collect::<Result<Vec<_>>>()?;
        Ok(keys.into_iter().map(|key| key.map(|key| self.hold(key, 1))).collect())
    }

    /// Counts `n` more requests in flight for `key`; returns its id.
    #[cfg(test)]
    pub(crate) fn hold(&mut self, key: AdapterKey, n: u64) -> Arc<str> {
        let a = self.get_mut(key);
        let was = a.protection.in_flight;
        a.protection.in_flight += n;
        let id = a.identity.id.clone();
        if was == 0 && n > 0 {
            self.refresh(key);
        }
        id
    }

    /// Counts `n` requests less in flight for `key` (the caller checked there are that many);
    /// returns whether an adapter being unloaded drained.
    pub(crate) fn unhold(&mut self, key: AdapterKey, n: u64) -> bool {
        let a = self.get_mut(key);
        a.protection.in_flight -= n;
        if a.protection.in_flight == 0 && n > 0 {
            let drained = a.protection.draining;
            self.refresh(key);
            return drained;
        }
        false
    }

    /// Counts one request less in flight per id, atomically (`None` passes through). Returns whether
    /// an adapter being unloaded drained, so waiters can be woken.
    ///
    /// Errors: [`Error::AdapterNotFound`] for an unknown id; [`Error::Usage`] when an id is released
    /// more often than [`Registry::acquire`] counted it (the open step's requests are released by
    /// [`Registry::finish_step`] only; nothing is released then).
    #[cfg(test)]
    pub(crate) fn release(&mut self, ids: &[Option<&str>]) -> Result<bool> {
        let mut wanted: Vec<(AdapterKey, u64)> = Vec::new();
        for id in ids.iter().flatten() {
            let Some(&key) = self.by_id.get(*id) else {
                return Err(Error::AdapterNotFound {
                    name: format!("id {id}"),
                    registered: self.adapters.iter().flatten().map(|a| a.identity.id.to_string()).collect(),
                });
            };
            match wanted.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += 1,
                None => wanted.push((key, 1)),
            }
        }
        for &(key, n) in &wanted {
            let a = self.get(key);
            // The open step's requests are its own: only `finish_step` releases them.
            let acquired = a.protection.in_flight - a.protection.step_holds;
            if acquired < n {
                return Err(Error::Usage(format!(
                    "cannot release adapter {:?} (id {}) {n} time(s): only {acquired} request(s) acquired \
                     with acquire are in flight",
                    a.spec_name(),
                    a.identity.id,
                )));
            }
        }
        let mut drained = false;
        for (key, n) in wanted {
            drained |= self.unhold(key, n);
        }
        Ok(drained)
    }

    /// A snapshot of the counters and of what is resident and pinned.
    pub fn stats(&self) -> Stats {
        let mut host = TierStats { counters: self.host.counters, ..TierStats::default() };
        let mut device = TierStats { counters: self.device.counters, ..TierStats::default() };
        let mut registered = 0;
        let mut unloading = Vec::new();
        let mut pinned = Vec::new();
        for a in self.adapters.iter().flatten() {
            let name = a.spec_name().to_owned();
            if a.protection.draining {
                unloading.push(name.clone());
            } else {
                registered += 1;
            }
            if a.protection.pinned {
                pinned.push(name.clone());
            }
            if a.tenancy.fetching {
                host.fetching.push(name.clone());
            }
            if a.tenancy.host_since.is_some() {
                host.resident.push(name.clone());
                if a.protection.pinned {
                    host.pinned.push(name.clone());
                }
            }
            if a.tenancy.slot.is_some() {
                device.resident.push(name.clone());
                if a.protection.pinned {
                    device.pinned.push(name);
                }
            }
        }
        for list in [
            &mut host.resident,
            &mut host.pinned,
            &mut host.fetching,
            &mut device.resident,
            &mut device.pinned,
            &mut pinned,
        ] {
            list.sort_unstable();
        }
        unloading.sort_unstable();
        host.used = self.host.count - self.host.reserved_count;
        host.capacity = self.host.max_count;
        host.bytes = self.host.bytes - self.host.reserved_bytes;
        host.reserved_bytes = self.host.reserved_bytes;
        host.max_bytes = self.host.max_bytes;
        device.used = device.resident.len();
        device.capacity = Some(self.config.slots);
        device.bytes = self
            .adapters
            .iter()
            .flatten()
            .filter(|a| a.tenancy.slot.is_some())
            .map(|a| a.identity.size.device_bytes)
            .sum();
        device.pages = self.total_pages() - self.device.pages.free_count();
        device.max_pages = Some(self.total_pages());
        Stats { registered, pinned: self.pinned, pinned_names: pinned, unloading, host, device }
    }
}

/// Refuses sizes no adapter can have.
fn check_size(r: &LoRARef, size: AdapterSize) -> Result<()> {
    if size.rank == 0 {
        return Err(Error::Spec(format!("adapter {:?}: rank must be at least 1 (got 0)", r.lora_name)));
    }
    if !size.scaling.is_finite() {
        return Err(Error::Spec(format!(
            "adapter {:?}: scaling must be finite (got {})",
            r.lora_name, size.scaling
        )));
    }
    Ok(())
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
    /// Adapters being fetched, sorted by name (host tier only; see `fetch`).
    pub fetching: Vec<String>,
    /// Adapters resident (slots used, for the device tier).
    pub used: usize,
    /// Capacity in adapters (slots, for the device tier); `None` is unbounded.
    pub capacity: Option<usize>,
    /// Bytes resident.
    pub bytes: u64,
    /// Bytes reserved for adapters being fetched (host tier only): `bytes + reserved_bytes` is
    /// the room used.
    pub reserved_bytes: u64,
    /// Capacity in bytes; `None` is unbounded.
    pub max_bytes: Option<u64>,
    /// Pages resident (device tier only; slots in slot mode, where a page is a slot).
    pub pages: usize,
    /// Capacity in pages (device tier only); `None` for the host tier.
    pub max_pages: Option<usize>,
}

/// [`Registry::stats`]: both tiers plus the registry's own numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Registered adapters (those being unloaded excluded).
    pub registered: usize,
    /// Pinned adapters.
    pub pinned: usize,
    /// Every pinned adapter, resident or not, sorted by name.
    pub pinned_names: Vec<String>,
    /// Adapters being unloaded, waiting for their requests to finish.
    pub unloading: Vec<String>,
    /// The host tier.
    pub host: TierStats,
    /// The device tier.
    pub device: TierStats,
}

/// `name=path (id …)`, how errors show a ref.
pub(crate) fn describe(r: &LoRARef) -> String {
    format!("{:?} (path {:?}, id {})", r.lora_name, r.lora_path, r.lora_id)
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
