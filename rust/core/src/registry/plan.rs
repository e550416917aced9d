//! One scheduler step: the step's requests in, the admitted set, a slot per request, the loads and
//! evictions, and the kernels' segment arrays out.
//!
//! Admission walks the requests in batch order and decides per adapter at its first request:
//! a pinned adapter is admitted; an unpinned one while fewer than `slots - pinned` distinct unpinned
//! adapters are admitted and its pages fit in those the pinned adapters leave (see `pages`; in slot
//! mode the two rules are one). Then every admitted adapter not in a slot gets one (its pages) (and a host-tier place
//! first when it was evicted from host memory), evicting only adapters outside the step. An adapter
//! whose tier cannot make room is deferred with all its requests, so every admitted request has a
//! slot and a plan never fails half-way.
//!
//! In fetch mode (background reads) an adapter outside the host tier is deferred at its first
//! request, before the budget counts it, and its fetch starts once the admitted adapters are in
//! the step (so a fetch never evicts one of them); see `fetch`.

use std::sync::Arc;

use super::fetch::{Claim, Fetch};
use super::pages::pages_for;
use super::tiers::Eviction;
use super::{AdmissionOrder, LoadSource, Registry};
use crate::error::{Error, Result};
use crate::limits::OVERDUE_AFTER;
use crate::policy::AdapterKey;

/// A load the caller must perform before running the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Load {
    /// The adapter's name (shared with the registry: no copy per load).
    pub name: Arc<str>,
    /// The adapter's id (shared likewise).
    pub lora_id: Arc<str>,
    /// The adapter's registration serial: tells it from a later registration of the same name.
    pub serial: u64,
    /// The adapter's key in the registry.
    pub key: AdapterKey,
    /// The slot to copy it into.
    pub slot: u32,
    /// Where its weights are now.
    pub source: LoadSource,
}

/// A step's plan ([`Registry::begin_step`]). Token indices count the admitted requests' tokens only, each
/// request's tokens contiguous, requests in `admitted` order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// Indices (into the step's requests) of the admitted requests, in batch order.
    pub admitted: Vec<u32>,
    /// Indices of the deferred requests, in batch order.
    pub deferred: Vec<u32>,
    /// `[len(admitted)]` the slot of each admitted request, -1 for the base model.
    pub request_slots: Vec<i32>,
    /// Loads to perform, in the order their slots were assigned.
    pub loads: Vec<Load>,
    /// Adapters evicted while planning, in order (a host eviction of a device-resident adapter
    /// comes right after its device eviction).
    pub evictions: Vec<Eviction>,
    /// `[T]` the slot of each admitted token, -1 for the base model.
    pub token_slots: Vec<i32>,
    /// `[N]` indices of the admitted tokens that have an adapter, grouped by slot (ascending), in
    /// token order within a slot; base-model tokens are left out.
    pub token_perm: Vec<i32>,
    /// `[S + 1]` segment `s` is `token_perm[seg_indptr[s]..seg_indptr[s + 1]]`.
    pub seg_indptr: Vec<i32>,
    /// `[S]` the slot of each segment.
    pub seg_slots: Vec<i32>,
    /// `[slots]` rank of each slot's adapter, 0 for an empty slot.
    pub slot_ranks: Vec<i32>,
    /// `[slots]` scaling of each slot's adapter, 0 for an empty slot.
    pub slot_scalings: Vec<f32>,
    /// `[slots]` each slot's epoch, bumped whenever its occupant changes.
    pub slot_epochs: Vec<i64>,
    /// `[slots + 1]` the page table of slot `s`'s adapter is `page_table[page_indptr[s]..page_indptr[s +
    /// 1]]` (empty for an empty slot). `slots` is the device pool's pages (a slot is an adapter's first
    /// page); in slot mode slot `s` holds page `s` alone.
    pub page_indptr: Vec<i32>,
    /// `[P]` the page indices of every slot's adapter, its rank blocks in order (rows
    /// `k * page_rank .. (k + 1) * page_rank` of the adapter are in page `page_table[page_indptr[s] + k]`).
    pub page_table: Vec<i32>,
    /// The slots the admitted requests use, ascending.
    pub slots_used: Vec<u32>,
    /// Fetch mode: the fetches this plan started, in first-request order (their adapters'
    /// requests are in `deferred`; host evictions that made their room are in `evictions`).
    pub to_fetch: Vec<Fetch>,
    /// Why each deferred request waits, parallel to `deferred`.
    pub reasons: Vec<Deferral>,
    /// The requests that fail this step (neither admitted nor deferred) and why, in batch order.
    pub failed: Vec<(u32, Hold)>,
    /// The longest segment, in tokens (the registry's `chunk_size`), for [`StepPlan::subset`].
    pub chunk_size: Option<usize>,
}

/// Why a deferred request waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Deferral {
    /// Its adapter needs a device slot and none can be had now: more distinct unpinned adapters
    /// than the slots left by the pinned ones (or more pages than they leave), or every slot holds
    /// a protected adapter.
    DeviceRoom,
    /// Its adapter is outside the host tier and its read does not start now: the tier cannot make
    /// room for it (full of pinned, in-flight or fetching adapters, or of those other requests
    /// need), or as many adapters as one step can admit are ready already (the fetch budget).
    HostRoom,
    /// Its adapter is being read (fetched, or discovered in `adapter_dir`).
    Loading,
    /// It gave its place to an older waiting request (see `admit_waiting_first`).
    Fairness,
}

impl Deferral {
    /// The reason's name, as Python sees it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DeviceRoom => "device_room",
            Self::HostRoom => "host_room",
            Self::Loading => "loading",
            Self::Fairness => "fairness",
        }
    }
}

/// A request the caller hands the core without an adapter key to plan it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hold {
    /// Its adapter is being discovered (read from `adapter_dir`, not registered yet): deferred.
    Discovering,
    /// Its adapter's last read failed: the request fails.
    ReadFailed,
    /// Its adapter was unloaded (or is being unloaded) while it waited: the request fails.
    Unloaded,
}

impl Hold {
    /// The hold's name, as Python sees it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Discovering => "discovering",
            Self::ReadFailed => "read_failed",
            Self::Unloaded => "unloaded",
        }
    }

    fn mark(self) -> i32 {
        match self {
            Self::Discovering => DEFER_LOADING,
            Self::ReadFailed => FAILED_READ,
            Self::Unloaded => FAILED_UNLOADED,
        }
    }
}

impl StepPlan {
    /// `T`: the admitted requests' tokens.
    pub fn num_tokens(&self) -> usize {
        self.token_slots.len()
    }

    /// The kernel arrays of the sub-batch a scheduler built from this step's admitted requests:
    /// `requests[k]` (a request index, as in `admitted`) runs `num_tokens[k]` tokens, each request's
    /// tokens contiguous, in `requests` order. Sorted and segmented as the step's own arrays are (one
    /// segmenter); in [`StepPlan::step_arrays`]' layout, `request_slots` being the sub-batch's.
    ///
    /// Errors: [`Error::Usage`] when the lengths differ, a request is not admitted or repeats, a
    /// count is 0, or the tokens overflow an `i32`.
    pub fn subset(&self, requests: &[u32], num_tokens: &[u32]) -> Result<(Vec<u8>, [usize; 4])> {
        if requests.len() != num_tokens.len() {
            return Err(Error::Usage(format!(
                "subset: {} requests but {} token counts",
                requests.len(),
                num_tokens.len()
            )));
        }
        let mut taken = vec![false; self.admitted.len()];
        let mut request_slots = Vec::with_capacity(requests.len());
        for &r in requests {
            // `admitted` is in batch order, so ascending.
            match self.admitted.binary_search(&r) {
                Ok(k) if !std::mem::replace(&mut taken[k], true) => request_slots.push(self.request_slots[k]),
                _ => {
                    return Err(Error::Usage(format!(
                        "subset: requests {requests:?} must be distinct admitted indices of the step \
                         (admitted: {:?})",
                        self.admitted
                    )))
                }
            }
        }
        if num_tokens.contains(&0) {
            return Err(Error::Usage(format!(
                "subset: every token count must be at least 1 (got {num_tokens:?})"
            )));
        }
        let total = check_step_size(requests.len(), num_tokens)?;
        let mut token_slots = Vec::with_capacity(total);
        for (&slot, &n) in request_slots.iter().zip(num_tokens) {
            token_slots.extend(std::iter::repeat_n(slot, n as usize));
        }
        let slots = self.slot_ranks.len();
        let (token_perm, counts) = sort_by_slot(&token_slots, slots);
        let (mut seg_indptr, mut seg_slots) = (Vec::new(), Vec::new());
        cut_segments(&counts, slots, self.chunk_size, &mut seg_indptr, &mut seg_slots);
        Ok(arrays_buffer(&token_perm, &[&request_slots, &seg_indptr, &seg_slots]))
    }

    /// The admitted requests a scheduler starts now, in batch order, given which requests were
    /// waiting (`waiting[i]`: not started in an earlier step): all of them but, after a waiting
    /// request deferred for a device slot ([`Deferral::DeviceRoom`], or [`Deferral::Fairness`]:
    /// it gave way), the waiting ones that use an adapter. So a request deferred for want of a slot
    /// is not overtaken, step after step, by later waiting ones of its rank: the running ones
    /// finish, their slots free up, and it is admitted. Base-model requests hold no slot and start.
    /// That is [`AdmissionOrder::Arrival`]'s rule; [`AdmissionOrder::LongestRemaining`] starts every
    /// admitted request (its overtaking is bounded by the age bound alone).
    ///
    /// Errors: [`Error::Usage`] when `waiting` is not one flag per request.
    pub fn startable(&self, waiting: &[bool], order: AdmissionOrder) -> Result<Vec<u32>> {
        let requests = self.admitted.len() + self.deferred.len() + self.failed.len();
        if waiting.len() != requests {
            return Err(Error::Usage(format!(
                "startable: {} waiting flags for a step of {requests} requests",
                waiting.len()
            )));
        }
        if order == AdmissionOrder::LongestRemaining {
            return Ok(self.admitted.clone());
        }
        let mut barrier = false;
        let mut start = Vec::with_capacity(self.admitted.len());
        let (mut admitted, mut deferred) = (self.admitted.iter().zip(&self.request_slots).peekable(), 0);
        for (i, &waits) in waiting.iter().enumerate() {
            let i = i as u32;
            if self.deferred.get(deferred) == Some(&i) {
                let why = self.reasons[deferred];
                barrier |= waits && matches!(why, Deferral::DeviceRoom | Deferral::Fairness);
                deferred += 1;
            } else if let Some((_, &slot)) = admitted.next_if(|&(&a, _)| a == i) {
                if !(barrier && waits && slot >= 0) {
                    start.push(i);
                }
            }
        }
        Ok(start)
    }

    /// The step's kernel arrays in one native-endian buffer, for one host-to-device copy: `token_perm`
    /// widened to int64 (8-byte aligned, first), then `request_slots`, `seg_indptr` and `seg_slots`
    /// as int32; with each part's length in int32 words (`2 * N`, `A`, `S + 1`, `S`).
    pub fn step_arrays(&self) -> (Vec<u8>, [usize; 4]) {
        arrays_buffer(&self.token_perm, &[&self.request_slots, &self.seg_indptr, &self.seg_slots])
    }
}

/// `token_perm` widened to int64, then `parts` as int32, in one native-endian buffer; with each
/// part's length in int32 words.
fn arrays_buffer(token_perm: &[i32], parts: &[&[i32]; 3]) -> (Vec<u8>, [usize; 4]) {
    let words = [2 * token_perm.len(), parts[0].len(), parts[1].len(), parts[2].len()];
    let mut bytes = Vec::with_capacity(4 * words.iter().sum::<usize>());
    for &t in token_perm {
        bytes.extend_from_slice(&i64::from(t).to_ne_bytes());
    }
    for part in parts {
        for &v in *part {
            bytes.extend_from_slice(&v.to_ne_bytes());
        }
    }
    (bytes, words)
}

/// A key's mark before admission looks at it.
const UNSEEN: i32 = i32::MIN;
/// A key's mark once admitted, until it has its slot (then the mark is the slot; -1 is the base
/// model's).
const ADMITTED: i32 = -2;
/// A deferred key's marks, one per [`Deferral`] (`DEFER_DEVICE - mark` is its discriminant).
const DEFER_DEVICE: i32 = -3;
const DEFER_HOST: i32 = -4;
const DEFER_LOADING: i32 = -5;
const DEFER_FAIRNESS: i32 = -6;
/// Failed requests' marks (per request only: no key is marked so).
const FAILED_READ: i32 = -7;
const FAILED_UNLOADED: i32 = -8;

fn is_deferred(mark: i32) -> bool {
    (DEFER_FAIRNESS..=DEFER_DEVICE).contains(&mark)
}

fn deferral(mark: i32) -> Deferral {
    match mark {
        DEFER_DEVICE => Deferral::DeviceRoom,
        DEFER_HOST => Deferral::HostRoom,
        DEFER_LOADING => Deferral::Loading,
        _ => Deferral::Fairness,
    }
}

fn failure(mark: i32) -> Hold {
    if mark == FAILED_READ {
        Hold::ReadFailed
    } else {
        Hold::Unloaded
    }
}

/// Fetch mode's admission notes: the adapters outside the host tier with their first request, in
/// first-request order, and each admitted adapter's first request (parallel to the step list).
#[derive(Default)]
struct Waiting {
    keys: Vec<(AdapterKey, u32)>,
    firsts: Vec<u32>,
    /// The adapters admission deferred although they are in the host tier (all unpinned): the
    /// next steps can take them without a read.
    ready: usize,
    /// Their pages.
    ready_pages: usize,
}

/// One step's requests: request `i` uses `adapters[i]` (None: the base model, or a held request)
/// for `num_tokens[i]` tokens; `holds` are the requests planned by their hold, not by a key.
#[derive(Debug, Clone, Copy)]
pub struct StepRequests<'a> {
    /// Each request's adapter.
    pub adapters: &'a [Option<AdapterKey>],
    /// Each request's tokens.
    pub num_tokens: &'a [u32],
    /// `(request, hold)`, requests ascending, each with `None` in `adapters`.
    pub holds: &'a [(u32, Hold)],
}

/// Why a place was refused to an adapter.
#[derive(Clone, Copy)]
enum Refusal {
    Host,
    Device,
}

impl Registry {
    /// Plans one step over requests given by name (`None` is the base model), resolving each distinct
    /// name once (requests whose names share one string are recognised by address). See
    /// [`Registry::plan`].
    ///
    /// Errors: as [`Registry::plan`], and [`Error::AdapterNotFound`] for an unknown name (nothing is
    /// planned then).
    #[cfg(test)]
    pub(crate) fn plan_names(&mut self, names: &[Option<&str>], num_tokens: &[u32]) -> Result<StepPlan> {
        let mut seen: crate::hash::FxHashMap<(usize, usize), AdapterKey> = Default::default();
        let mut adapters = Vec::with_capacity(names.len());
        for name in names {
            adapters.push(match name {
                None => None,
                Some(n) => {
                    let address = (n.as_ptr() as usize, n.len());
                    Some(match seen.get(&address) {
                        Some(&k) => k,
                        None => {
                            let k = self.lookup(n, true)?;
                            seen.insert(address, k);
                            k
                        }
                    })
                }
            });
        }
        self.plan(&adapters, num_tokens)
    }

    /// Plans one step and commits it, outside a transaction (test support only, with
    /// [`Registry::end_step`], [`Registry::load_done`] and [`Registry::load_failed`]: the unit tests
    /// look at a plan's state between those calls): the previous step's protection ends, the admitted
    /// adapters are protected until the next plan (or `end_step`), and the planned loads are marked
    /// loading until `load_done` / `load_failed`.
    ///
    /// `adapters[i]` and `num_tokens[i]` describe request `i` (adapters from [`Registry::lookup`];
    /// ones being unloaded are served, their requests are still running).
    ///
    /// Errors: [`Error::Usage`] when the two slices differ in length, the admitted tokens overflow
    /// an `i32`, or a step transaction is open (nothing is planned then).
    #[cfg(test)]
    pub(crate) fn plan(&mut self, adapters: &[Option<AdapterKey>], num_tokens: &[u32]) -> Result<StepPlan> {
        self.plan_in(StepRequests { adapters, num_tokens, holds: &[] }, false)
    }

    /// Plans one step over `requests` and commits it (for [`Registry::begin_step`], which acquires
    /// it): the previous plan's protection ends, the admitted adapters are protected as in the step,
    /// and the planned loads are marked loading until reported. `adapters[i]` and `num_tokens[i]`
    /// describe request `i` (adapters from [`Registry::lookup`]).
    ///
    /// In fetch mode (`fetch`) a request whose adapter is not in the host tier is deferred (it takes
    /// none of the slot budget), and the adapter's fetch starts unless it is fetching already or the
    /// host tier cannot make room now, even after adapters admitted for younger requests yield
    /// theirs; the plan's `to_fetch` lists the fetches started. In either mode a fresh adapter (see
    /// [`Registry::fetch_done`]) stays fresh only if this plan defers it.
    ///
    /// The requests' holds (sorted by request, each with no adapter) are neither admitted nor
    /// counted: each is deferred or fails as its [`Hold`] says.
    ///
    /// Errors: [`Error::Usage`] when the two slices differ in length, the admitted tokens overflow
    /// an `i32`, or a step transaction is open (nothing is planned then).
    pub(super) fn plan_in(&mut self, requests: StepRequests<'_>, fetch: bool) -> Result<StepPlan> {
        let StepRequests { adapters, num_tokens, .. } = requests;
        self.refuse_open_step("plan")?;
        let total = check_step_size(adapters.len(), num_tokens)?;
        // This plan's decision per adapter key, in a dense table the per-request loops read instead
        // of the adapters themselves.
        let mut marks = std::mem::take(&mut self.plan_marks);
        marks.clear();
        marks.resize(self.adapters.len(), UNSEEN);
        // The base model's mark, last: requests without an adapter read it.
        marks.push(-1);
        let mut plan = StepPlan::default();
        let mut waiting = Waiting::default();
        self.name_requests(adapters, fetch);
        self.admit(adapters, &mut marks, fetch.then_some(&mut waiting));
        if fetch && self.start_waiting_fetches(&mut waiting, &mut marks, &mut plan) > 0 {
            self.reoffer_room(adapters, &mut marks, &waiting);
        }
        self.place_admitted(&mut marks, &mut plan);
        self.end_freshness(&marks);
        self.fill_outputs(&marks, requests, total, &mut plan);
        self.count_deferrals(adapters, &mut marks);
        self.plan_marks = marks;
        Ok(plan)
    }

    /// Starts the fetches of the adapters waiting for the host tier, overdue ones first (the room
    /// their fetches take is known before the budget decides the rest), each group in
    /// first-request order, within the fetch budget: while fewer unpinned adapters than one step
    /// may admit are ready for the next steps (deferred in the host tier, or being fetched), since a read beyond that only
    /// holds host room the next steps cannot use. Pinned adapters (they take no budget) and overdue
    /// ones (the oldest requests) fetch whatever the budget. A fetch takes no host place a waiting
    /// or running request needs ([`Registry::fetch_evictable`]), but for an overdue adapter, which
    /// may take those of younger requests; adapters admitted for younger requests then yield
    /// theirs if that is enough ([`Registry::yield_room`]), so no request waits forever behind
    /// adapters that later requests keep in the host tier. Returns how many adapters yielded.
    fn start_waiting_fetches(
        &mut self,
        waiting: &mut Waiting,
        marks: &mut [i32],
        plan: &mut StepPlan,
    ) -> usize {
        let budget = self.slot_budget();
        let (limit, page_limit) = (budget.limit(), budget.page_limit());
        let fetching_unpinned = |reg: &Self, key: AdapterKey| {
            let a = reg.get(key);
            a.tenancy.fetching && !a.protection.pinned
        };
        let fetching = waiting.keys.iter().filter(|&&(key, _)| fetching_unpinned(self, key));
        let mut ready = waiting.ready + fetching.clone().count();
        let mut ready_pages =
            waiting.ready_pages + fetching.map(|&(key, _)| self.key_pages(key)).sum::<usize>();
        let mut yielded = 0;
        // Overdue adapters first: the places adapters yield for them count as ready before the
        // budget decides the other fetches.
        let overdue_first =
            [true, false].into_iter().flat_map(|pass| waiting.keys.iter().map(move |&k| (pass, k)));
        for (pass, (key, first)) in overdue_first {
            let a = self.get(key);
            let overdue = a.tenancy.deferred_plans >= OVERDUE_AFTER;
            if overdue != pass {
                continue;
            }
            if a.tenancy.fetching {
                marks[key.index()] = DEFER_LOADING;
                continue;
            }
            let pinned = a.protection.pinned;
            if !overdue && !pinned && (ready >= limit || ready_pages >= page_limit) {
                continue;
            }
            let bytes = a.identity.size.host_bytes;
            if overdue && !self.host.fits(bytes, self.fetch_evictable(key).0, true) {
                let (gave_way, pages) = self.yield_room(first, key, &mut waiting.firsts, marks);
                ready += gave_way;
                ready_pages += pages;
                yielded += gave_way;
            }
            if self.start_fetch(key) {
                ready += usize::from(!pinned);
                ready_pages += if pinned { 0 } else { self.key_pages(key) };
                marks[key.index()] = DEFER_LOADING;
                let a = self.get(key);
                plan.to_fetch.push(Fetch { name: Arc::clone(&a.identity.name), serial: a.identity.serial });
            }
        }
        yielded
    }

    /// Offers the device room that adapters gave way with ([`Registry::yield_room`]) to the adapters
    /// admission deferred for want of it, in batch order, so a step does not leave a slot empty that
    /// a request could use: one in the host tier is admitted when the step's budget fits it and
    /// protecting it leaves every fetch of this step's adapters that could land still able to (the
    /// yielded host places stay the overdue fetches').
    fn reoffer_room(&mut self, adapters: &[Option<AdapterKey>], marks: &mut [i32], waiting: &Waiting) {
        let paging = self.config.paging;
        let mut budget = self.slot_budget();
        for &key in &self.step {
            let a = self.get(key);
            budget.take(a.protection.pinned, pages_for(paging, a.identity.size.rank));
        }
        let fetches: Vec<AdapterKey> =
            waiting.keys.iter().map(|&(key, _)| key).filter(|&key| self.get(key).tenancy.fetching).collect();
        let landing: Vec<bool> = fetches.iter().map(|&key| self.fetch_fits(key, Claim::Fetch)).collect();
        for &key in adapters.iter().flatten() {
            let a = self.get(key);
            let pages = pages_for(paging, a.identity.size.rank);
            if marks[key.index()] != DEFER_DEVICE || a.tenancy.host_since.is_none() || !budget.fits(pages) {
                continue;
            }
            self.get_mut(key).protection.in_step = true;
            self.refresh(key);
            let lands = |reg: &Self| {
                fetches.iter().zip(&landing).all(|(&f, &could)| !could || reg.fetch_fits(f, Claim::Fetch))
            };
            if !lands(self) {
                self.get_mut(key).protection.in_step = false;
                self.refresh(key);
                continue;
            }
            budget.take(false, pages);
            marks[key.index()] = ADMITTED;
            self.step.push(key);
            self.device.counters.refusals -= 1;
        }
    }

    /// Defers, youngest first, admitted adapters whose first request comes after request `first`
    /// (`key`'s, overdue) and that only the step protects, until a fetch of `key` could make its
    /// room; defers none when all of them would not be enough. Returns how many it deferred, and
    /// their pages.
    /// `firsts` is parallel to `self.step`.
    fn yield_room(
        &mut self,
        first: u32,
        key: AdapterKey,
        firsts: &mut Vec<u32>,
        marks: &mut [i32],
    ) -> (usize, usize) {
        let bytes = self.get(key).identity.size.host_bytes;
        let evictable = self.fetch_evictable(key).0;
        let protected_count = self.host.count - evictable.count;
        let protected_bytes = self.host.bytes - evictable.bytes;
        let mut need_count = self.host.max_count.map_or(0, |m| (protected_count + 1).saturating_sub(m));
        let mut need_bytes = self.host.max_bytes.map_or(0, |m| (protected_bytes + bytes).saturating_sub(m));
        let mut picks = Vec::new();
        // `self.step` is in first-request order: the younger adapters are at its end.
        for at in (0..self.step.len()).rev() {
            if firsts[at] <= first || (need_count == 0 && need_bytes == 0) {
                break;
            }
            let a = self.get(self.step[at]);
            let p = &a.protection;
            if p.pinned || p.in_flight > 0 || p.loading.is_some() || p.fresh {
                continue;
            }
            picks.push(at);
            need_count = need_count.saturating_sub(1);
            need_bytes = need_bytes.saturating_sub(a.identity.size.host_bytes);
        }
        if need_count > 0 || need_bytes > 0 {
            return (0, 0);
        }
        let (yielded, mut pages) = (picks.len(), 0);
        // Descending positions: each removal leaves the earlier ones in place.
        for at in picks {
            let gave_way = self.step.remove(at);
            pages += self.key_pages(gave_way);
            firsts.remove(at);
            marks[gave_way.index()] = DEFER_FAIRNESS;
            self.get_mut(gave_way).protection.in_step = false;
            self.refresh(gave_way);
        }
        (yielded, pages)
    }

    /// Fresh adapters (fetched, waiting for a step to admit their requests) stay protected while
    /// plans defer them, and only then: one this plan admitted, or did not ask for, is fresh no more.
    fn end_freshness(&mut self, marks: &[i32]) {
        if self.fresh.is_empty() {
            return;
        }
        let mut fresh = std::mem::take(&mut self.fresh);
        fresh.retain(|&key| {
            let keep = is_deferred(marks[key.index()]);
            if !keep {
                self.get_mut(key).protection.fresh = false;
                self.refresh(key);
            }
            keep
        });
        self.fresh = fresh;
    }

    /// Fresh adapters not among `keys` are fresh no more: [`Registry::end_freshness`] for a plan
    /// that defers all of `keys` and admits nothing. Returns whether any was fresh.
    pub(super) fn end_freshness_outside(&mut self, keys: &[AdapterKey]) -> bool {
        let mut fresh = std::mem::take(&mut self.fresh);
        let before = fresh.len();
        fresh.retain(|&key| {
            let keep = keys.contains(&key);
            if !keep {
                self.get_mut(key).protection.fresh = false;
                self.refresh(key);
            }
            keep
        });
        let freed = fresh.len() < before;
        self.fresh = fresh;
        freed
    }

    /// Admission by budget, in batch order: marks each admitted adapter [`ADMITTED`] and puts it in
    /// the step, each refused one deferred (its reason's mark); the previous step's adapters not admitted again
    /// lose their protection. With `waiting` (fetch mode), an adapter outside the host tier is
    /// deferred without counting against the budget, and noted there.
    fn admit(
        &mut self,
        adapters: &[Option<AdapterKey>],
        marks: &mut [i32],
        mut waiting: Option<&mut Waiting>,
    ) {
        // Adapters in both the previous step and this one stay protected throughout: ending the old
        // step first would put them back among the candidates only to take them out again.
        let spare = std::mem::take(&mut self.spare_step);
        let mut previous = std::mem::replace(&mut self.step, spare);
        let mut budget = self.slot_budget();
        let (overdue, overdue_pages) = if self.overdue > 0 {
            self.admit_overdue(adapters, marks, &mut budget, waiting.as_deref_mut())
        } else {
            (0, 0)
        };
        let base_mark = marks.len() - 1;
        let paging = self.config.paging;
        for (i, &request) in adapters.iter().enumerate() {
            // Base-model requests read the base mark (never UNSEEN) instead of branching on None,
            // which base rows mixed in at random would mispredict.
            let index = request.map_or(base_mark, AdapterKey::index);
            let (UNSEEN, Some(key)) = (marks[index], request) else {
                continue;
            };
            let mark = &mut marks[index];
            let a = self.get_mut(key);
            if let Some(waiting) = waiting.as_deref_mut() {
                if a.tenancy.host_since.is_none() {
                    *mark = DEFER_HOST;
                    waiting.keys.push((key, i as u32));
                    continue;
                }
            }
            let pages = pages_for(paging, a.identity.size.rank);
            if !budget.take(a.protection.pinned, pages) {
                // Refused only because overdue adapters went first: it gave way.
                let gave_way = budget.fits_without(overdue, overdue_pages, pages);
                *mark = if gave_way { DEFER_FAIRNESS } else { DEFER_DEVICE };
                self.device.counters.refusals += 1;
                if let Some(waiting) = waiting.as_deref_mut() {
                    waiting.ready += 1;
                    waiting.ready_pages += pages;
                }
                continue;
            }
            *mark = ADMITTED;
            let newly = !std::mem::replace(&mut a.protection.in_step, true);
            self.step.push(key);
            if let Some(waiting) = waiting.as_deref_mut() {
                waiting.firsts.push(i as u32);
            }
            if newly {
                self.refresh(key);
            }
        }
        for &key in &previous {
            if marks[key.index()] != ADMITTED {
                self.get_mut(key).protection.in_step = false;
                self.refresh(key);
            }
        }
        previous.clear();
        self.spare_step = previous;
    }

    /// Admits the overdue adapters the requests name before anything else, oldest first, those
    /// `budget` has room for (the oldest always fits: no adapter needs more pages than the pinned
    /// ones leave); returns how many it admitted (all unpinned) and their pages. In fetch mode (`waiting`) one outside
    /// the host tier is left to the fetch path, and the admitted ones count as the oldest requests.
    fn admit_overdue(
        &mut self,
        adapters: &[Option<AdapterKey>],
        marks: &mut [i32],
        budget: &mut SlotBudget,
        mut waiting: Option<&mut Waiting>,
    ) -> (usize, usize) {
        // (plans deferred, first request, key); the mark ADMITTED here only dedupes, and the distinct
        // keys seen are UNSEEN again after.
        let mut overdue: Vec<(u32, u32, AdapterKey)> = Vec::new();
        let mut seen: Vec<AdapterKey> = Vec::new();
        for (i, &request) in adapters.iter().enumerate() {
            let Some(key) = request else { continue };
            if marks[key.index()] != UNSEEN {
                continue;
            }
            marks[key.index()] = ADMITTED;
            seen.push(key);
            let a = self.get(key);
            let outside = waiting.is_some() && a.tenancy.host_since.is_none();
            if a.tenancy.deferred_plans >= OVERDUE_AFTER && !a.protection.pinned && !outside {
                overdue.push((a.tenancy.deferred_plans, i as u32, key));
            }
        }
        for key in seen {
            marks[key.index()] = UNSEEN;
        }
        overdue.sort_unstable_by_key(|&(plans, first, _)| (std::cmp::Reverse(plans), first));
        let (before, pages_before) = (budget.used(), budget.pages_used());
        for &(_, _, key) in &overdue {
            if !budget.take(false, self.key_pages(key)) {
                // Left UNSEEN: admission proper defers it (a younger overdue one may still fit).
                continue;
            }
            marks[key.index()] = ADMITTED;
            self.step.push(key);
            if let Some(waiting) = waiting.as_deref_mut() {
                waiting.firsts.push(0);
            }
            if !std::mem::replace(&mut self.get_mut(key).protection.in_step, true) {
                self.refresh(key);
            }
        }
        (budget.used() - before, budget.pages_used() - pages_before)
    }

    /// This step's [`SlotBudget`], nothing counted yet.
    pub(super) fn slot_budget(&self) -> SlotBudget {
        SlotBudget {
            limit: self.config.slots - self.pinned,
            used: 0,
            page_limit: self.total_pages() - self.device.pinned_pages,
            pages_used: 0,
            counted: Vec::new(),
        }
    }

    /// Counts, per adapter the requests name, one more plan deferring it for room, or none since it
    /// was admitted (a read it waits for counts neither way); keeps `overdue` exact. Leaves the
    /// requests' marks [`UNSEEN`].
    fn count_deferrals(&mut self, adapters: &[Option<AdapterKey>], marks: &mut [i32]) {
        for &key in adapters.iter().flatten() {
            let mark = std::mem::replace(&mut marks[key.index()], UNSEEN);
            if mark == UNSEEN || mark == DEFER_LOADING {
                continue;
            }
            let plans = &mut self.get_mut(key).tenancy.deferred_plans;
            let was = *plans >= OVERDUE_AFTER;
            *plans = if is_deferred(mark) { plans.saturating_add(1) } else { 0 };
            let now = *plans >= OVERDUE_AFTER;
            self.overdue = self.overdue + usize::from(now) - usize::from(was);
        }
    }

    /// A slot (and a host place) for every admitted adapter, in batch order; an adapter no tier can
    /// make room for is deferred after all. Leaves each admitted adapter's slot as its mark.
    fn place_admitted(&mut self, marks: &mut [i32], plan: &mut StepPlan) {
        // Refused adapters leave `self.step`, so it is walked by position.
        let mut at = 0;
        while let Some(&key) = self.step.get(at) {
            at += 1;
            if self.get(key).tenancy.slot.is_some() {
                self.device.counters.hits += 1;
            } else if let Err(refusal) = self.bring_in(key, plan) {
                marks[key.index()] = match refusal {
                    Refusal::Host => {
                        self.host.counters.refusals += 1;
                        DEFER_HOST
                    }
                    Refusal::Device => {
                        self.device.counters.refusals += 1;
                        DEFER_DEVICE
                    }
                };
                self.get_mut(key).protection.in_step = false;
                at -= 1;
                self.step.remove(at);
                self.refresh(key);
                continue;
            }
            let now = self.tick();
            let a = self.get_mut(key);
            a.tenancy.last_used = now;
            a.tenancy.uses += 1;
        }
        // Admitted adapters are protected, so no later load took their slots.
        for &key in &self.step {
            marks[key.index()] = self.get(key).tenancy.slot.expect("an admitted adapter has a slot") as i32;
        }
    }

    /// Gives `key` (admitted, in the step, in no slot) a slot, reading it from disk first if it left
    /// the host tier; or says which tier refused.
    fn bring_in(&mut self, key: AdapterKey, plan: &mut StepPlan) -> std::result::Result<(), Refusal> {
        let a = self.get(key);
        let source = if a.tenancy.host_since.is_some() { LoadSource::Host } else { LoadSource::Disk };
        let bytes = a.identity.size.host_bytes;
        // A blocking read of an adapter being fetched takes over the fetch's reservation.
        let fetching = a.tenancy.fetching;
        let host_room =
            if fetching { self.fetch_fits(key, Claim::Read) } else { self.host.room_possible(bytes) };
        if source == LoadSource::Disk && !host_room {
            return Err(Refusal::Host);
        }
        let pages = self.pages_of(a.identity.size);
        if !self.device.pages_possible(pages) {
            return Err(Refusal::Device);
        }
        match source {
            LoadSource::Disk if fetching => self.end_fetch(key, Some(Claim::Read), &mut plan.evictions),
            LoadSource::Disk => {
                self.make_host_room(bytes, &mut plan.evictions);
                self.enter_host(key);
                self.host.counters.misses += 1;
                self.host.counters.loads += 1;
            }
            LoadSource::Host => self.host.counters.hits += 1,
        }
        let slot = self.take_pages(pages, &mut plan.evictions);
        self.get_mut(key).protection.loading = Some(source);
        self.occupy_slot(key, slot);
        self.device.counters.misses += 1;
        self.device.counters.loads += 1;
        let a = self.get(key);
        plan.loads.push(Load {
            name: Arc::clone(&a.identity.name),
            lora_id: Arc::clone(&a.identity.id),
            serial: a.identity.serial,
            key,
            slot,
            source,
        });
        Ok(())
    }

    /// The plan's arrays, from each adapter key's mark (its slot, or why it waits) and each held
    /// request's hold.
    fn fill_outputs(&self, marks: &[i32], requests: StepRequests<'_>, total: usize, plan: &mut StepPlan) {
        let request_slots = self.sort_requests(marks, requests, plan);
        let counts = self.sort_tokens(request_slots, requests.num_tokens, total, plan);
        self.fill_segments(&counts, plan);
        self.fill_slot_tables(marks, plan);
    }

    /// The admitted, deferred (with reasons) and failed requests, in batch order, and the admitted
    /// requests' slots (-1 for base), which it returns.
    fn sort_requests(&self, marks: &[i32], requests: StepRequests<'_>, plan: &mut StepPlan) -> Vec<i32> {
        let StepRequests { adapters, holds, .. } = requests;
        // Simple passes, each with few live values (pushing to several vectors in one loop spills
        // their lengths to memory and chains every request through it).
        let base_mark = marks.len() - 1;
        let mut request_slots: Vec<i32> =
            adapters.iter().map(|key| marks[key.map_or(base_mark, AdapterKey::index)]).collect();
        for &(i, hold) in holds {
            request_slots[i as usize] = hold.mark();
        }
        let mut admitted: Vec<u32> = (0..adapters.len() as u32).collect();
        if request_slots.iter().any(|&slot| slot < -1) {
            for &i in &admitted {
                let mark = request_slots[i as usize];
                if is_deferred(mark) {
                    plan.deferred.push(i);
                    // One that gave way and left the host tier too (its room went to an older
                    // request's fetch) now waits for the host tier.
                    let left = adapters[i as usize].is_some_and(|k| self.get(k).tenancy.host_since.is_none());
                    let why =
                        if mark == DEFER_FAIRNESS && left { Deferral::HostRoom } else { deferral(mark) };
                    plan.reasons.push(why);
                } else if mark < -1 {
                    plan.failed.push((i, failure(mark)));
                }
            }
            admitted.retain(|&i| request_slots[i as usize] >= -1);
        }
        plan.admitted = admitted;
        request_slots
    }

    /// The admitted requests' slots and tokens' slots (`request_slots`, with the marks of the others
    /// still in), and the token permutation sorted by slot; returns per bucket (each slot, then base)
    /// its tokens, then where its run starts in the permutation, then where it ends.
    fn sort_tokens(
        &self,
        mut request_slots: Vec<i32>,
        num_tokens: &[u32],
        total: usize,
        plan: &mut StepPlan,
    ) -> Vec<i32> {
        let all_admitted = plan.admitted.len() == request_slots.len();
        let mut token_slots = Vec::with_capacity(total);
        // One token per request (a decode step): the token slots are the admitted requests' slots.
        let single = num_tokens.iter().all(|&n| n == 1);
        if !single {
            for (&slot, &n) in request_slots.iter().zip(num_tokens) {
                if slot >= -1 {
                    token_slots.extend(std::iter::repeat_n(slot, n as usize));
                }
            }
        }
        if !all_admitted {
            request_slots.retain(|&slot| slot >= -1);
        }
        if single {
            token_slots.extend_from_slice(&request_slots);
        }
        let (token_perm, counts) = sort_by_slot(&token_slots, self.total_pages());
        plan.request_slots = request_slots;
        plan.token_slots = token_slots;
        plan.token_perm = token_perm;
        counts
    }

    /// The kernels' segments: each slot's run of the permutation (`counts` from [`Self::sort_tokens`]),
    /// cut into chunks of at most `chunk_size` tokens.
    fn fill_segments(&self, counts: &[i32], plan: &mut StepPlan) {
        plan.chunk_size = self.config.chunk_size;
        cut_segments(counts, self.total_pages(), plan.chunk_size, &mut plan.seg_indptr, &mut plan.seg_slots);
    }

    /// Per slot its adapter's rank, scaling, epoch and page table, and the slots the step uses.
    fn fill_slot_tables(&self, marks: &[i32], plan: &mut StepPlan) {
        let slots = self.total_pages();
        plan.page_indptr.reserve_exact(slots + 1);
        plan.page_indptr.push(0);
        plan.slot_ranks.reserve_exact(slots);
        plan.slot_scalings.reserve_exact(slots);
        plan.slot_epochs.reserve_exact(slots);
        for (s, key) in self.device.slots.iter().enumerate() {
            let (rank, scaling) = key.map_or((0, 0.0), |k| {
                let a = self.get(k);
                (a.identity.size.rank as i32, a.identity.size.scaling)
            });
            plan.slot_ranks.push(rank);
            plan.slot_scalings.push(scaling);
            plan.slot_epochs.push(self.device.epochs[s] as i64);
            plan.page_table.extend(self.device.pages.table(s as u32).iter().map(|&p| p as i32));
            plan.page_indptr.push(plan.page_table.len() as i32);
        }
        plan.slots_used = self.step.iter().map(|&k| marks[k.index()] as u32).collect();
        plan.slots_used.sort_unstable();
    }
}

/// The slot budget of one step: at most `slots - pinned` distinct unpinned adapters, and their pages
/// within the pages the pinned adapters leave, pinned ones always fitting (their pages are set aside
/// whether they are resident or not). In slot mode every adapter takes one page of `slots`, so the
/// two bounds are one. The rule's one statement: admission, `split`, `overflow` and `host_misses`
/// count with it, in batch order.
pub(super) struct SlotBudget {
    limit: usize,
    used: usize,
    page_limit: usize,
    pages_used: usize,
    /// The distinct unpinned adapters counted, for [`SlotBudget::admits`].
    counted: Vec<AdapterKey>,
}

impl SlotBudget {
    /// Whether a request for `key` (`pinned` or not, taking `pages`) fits with the requests counted
    /// before it; counts `key` when it is a new unpinned adapter that fits.
    pub(super) fn admits(&mut self, key: AdapterKey, pinned: bool, pages: usize) -> bool {
        if pinned || self.counted.contains(&key) {
            return true;
        }
        let fits = self.take(false, pages);
        if fits {
            self.counted.push(key);
        }
        fits
    }

    /// [`SlotBudget::admits`] for a caller that sees each adapter once (admission, through its marks):
    /// whether one more adapter of `pages` fits, counting it.
    pub(super) fn take(&mut self, pinned: bool, pages: usize) -> bool {
        if pinned {
            return true;
        }
        let fits = self.fits(pages);
        self.used += usize::from(fits);
        self.pages_used += if fits { pages } else { 0 };
        fits
    }

    /// Whether one more adapter of `pages` fits, counting nothing.
    fn fits(&self, pages: usize) -> bool {
        self.used < self.limit && self.pages_used + pages <= self.page_limit
    }

    /// Whether one more adapter of `pages` would fit had the `adapters` adapters of `pages_of_them`
    /// pages not been counted (they went first for their age: the one refused gave way to them).
    fn fits_without(&self, adapters: usize, pages_of_them: usize, pages: usize) -> bool {
        self.used - adapters < self.limit && self.pages_used - pages_of_them + pages <= self.page_limit
    }

    /// Starts counting afresh (the next group of a split).
    pub(super) fn restart(&mut self) {
        self.used = 0;
        self.pages_used = 0;
        self.counted.clear();
    }

    /// The distinct unpinned adapters one step may use.
    pub(super) fn limit(&self) -> usize {
        self.limit
    }

    /// The pages the unpinned adapters of one step may take.
    pub(super) fn page_limit(&self) -> usize {
        self.page_limit
    }

    /// The distinct unpinned adapters counted so far.
    pub(super) fn used(&self) -> usize {
        self.used
    }

    /// The pages counted so far.
    pub(super) fn pages_used(&self) -> usize {
        self.pages_used
    }
}

/// The permutation of `token_slots` (each token's slot, -1 for the base model) that groups the
/// tokens with an adapter by slot, ascending, in token order within a slot (base tokens left out);
/// and per bucket (each of `slots`, then base) its tokens, where its run starts in the permutation,
/// and where it ends. The one segmenter: a step's plan and [`StepPlan::subset`] both sort with it.
fn sort_by_slot(token_slots: &[i32], slots: usize) -> (Vec<i32>, Vec<i32>) {
    // Buckets: one per slot, then one for base-model tokens, so the per-token loops index instead of
    // branching on -1 (base rows are mixed in unpredictably).
    let bucket = |slot: i32| (slot as u32 as usize).min(slots);
    // Per bucket: its tokens, then where its run starts in `token_perm`, then the next free place in
    // that run (one allocation for the three).
    let mut counts = vec![0i32; 3 * (slots + 1)];
    let (per_bucket, rest) = counts.split_at_mut(slots + 1);
    let (start, fill) = rest.split_at_mut(slots + 1);
    // Four interleaved counters per bucket, so runs of one slot do not chain every increment
    // through one memory cell.
    let mut lanes = vec![[0i32; 4]; slots + 1];
    for (t, &slot) in token_slots.iter().enumerate() {
        lanes[bucket(slot)][t & 3] += 1;
    }
    for (count, lane) in per_bucket.iter_mut().zip(&lanes) {
        *count = lane.iter().sum();
    }
    // Counting sort of the tokens by bucket; the base bucket's run, last, is cut off.
    let mut next = 0;
    for (b, &count) in per_bucket.iter().enumerate() {
        start[b] = next;
        next += count;
    }
    fill.copy_from_slice(start);
    let mut token_perm = vec![0; next as usize];
    for (t, &slot) in token_slots.iter().enumerate() {
        let b = bucket(slot);
        token_perm[fill[b] as usize] = t as i32;
        fill[b] += 1;
    }
    token_perm.truncate(start[slots] as usize);
    (token_perm, counts)
}

/// Each slot's run of the permutation (`counts` from [`sort_by_slot`]) as segments of at most
/// `chunk_size` tokens: `seg_indptr` (from 0) and `seg_slots`, appended.
fn cut_segments(
    counts: &[i32],
    slots: usize,
    chunk_size: Option<usize>,
    seg_indptr: &mut Vec<i32>,
    seg_slots: &mut Vec<i32>,
) {
    let (per_slot, start) = (&counts[..slots], &counts[slots + 1..2 * slots + 1]);
    let chunk = chunk_size.map_or(i32::MAX, |c| c.min(i32::MAX as usize) as i32);
    let segments = per_slot.iter().filter(|&&c| c > 0).count();
    seg_indptr.reserve_exact(segments + 1);
    seg_slots.reserve_exact(segments);
    seg_indptr.push(0);
    for (s, (&begin, &count)) in start.iter().zip(per_slot).enumerate() {
        let mut at = begin;
        while at < begin + count {
            at = (at + chunk.min(begin + count - at)).min(begin + count);
            seg_indptr.push(at);
            seg_slots.push(s as i32);
        }
    }
}

/// The step's total tokens, checked to fit the int32 segment arrays and memory.
pub(super) fn check_step_size(requests: usize, num_tokens: &[u32]) -> Result<usize> {
    if requests != num_tokens.len() {
        return Err(Error::Usage(format!(
            "plan got {requests} adapter names but {} token counts; give one of each per request",
            num_tokens.len()
        )));
    }
    let total: u64 = num_tokens.iter().map(|&n| u64::from(n)).sum();
    if total > i32::MAX as u64 {
        return Err(Error::Usage(format!(
            "plan got {total} tokens; at most {} fit the int32 segment arrays",
            i32::MAX
        )));
    }
    if total > 1 << 24 {
        // A huge step's token arrays (a few of 4 bytes a token) may not fit in memory: refused
        // here rather than aborting the process when one is allocated.
        let mut probe: Vec<[i32; 4]> = Vec::new();
        probe.try_reserve_exact(total as usize).map_err(|_| {
            Error::Capacity(format!("plan got {total} tokens; their token arrays cannot be allocated"))
        })?;
    }
    Ok(total as usize)
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "fairness_tests.rs"]
mod fairness_tests;
