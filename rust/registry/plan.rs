//! One scheduler step: the step's requests in, the admitted set, a slot per request, the loads and
//! evictions, and the kernels' segment arrays out.
//!
//! Admission walks the requests in batch order and decides per adapter at its first request:
//! a pinned adapter is admitted; an unpinned one while fewer than `slots - pinned` distinct unpinned
//! adapters are admitted. Then every admitted adapter not in a slot gets one (and a host-tier place
//! first when it was evicted from host memory), evicting only adapters outside the step. An adapter
//! whose tier cannot make room is deferred with all its requests, so every admitted request has a
//! slot and a plan never fails half-way.
//!
//! In fetch mode (background reads) an adapter outside the host tier is deferred at its first
//! request, before the budget counts it, and its fetch starts once the admitted adapters are in
//! the step (so a fetch never evicts one of them); see `fetch`.

use std::sync::Arc;

use super::fetch::Fetch;
use super::tiers::Eviction;
use super::{LoadSource, Registry};
use crate::error::{Error, Result};
use crate::hash::FxHashMap;
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

/// The outcome of [`Registry::plan`]. Token indices count the admitted requests' tokens only, each
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
    /// `[slots]` each slot's generation, bumped whenever its occupant changes.
    pub slot_generations: Vec<i64>,
    /// Fetch mode: the fetches this plan started, in first-request order (their adapters'
    /// requests are in `deferred`; host evictions that made their room are in `evictions`).
    pub to_fetch: Vec<Fetch>,
}

impl StepPlan {
    /// `T`: the admitted requests' tokens.
    pub fn num_tokens(&self) -> usize {
        self.token_slots.len()
    }
}

/// A key's mark before admission looks at it.
const UNSEEN: i32 = i32::MIN;
/// A key's mark once admitted, until it has its slot (then the mark is the slot).
const ADMITTED: i32 = -3;
/// A deferred key's mark.
const DEFERRED: i32 = -2;

/// Fetch mode's admission notes: the adapters outside the host tier with their first request, in
/// first-request order, and each admitted adapter's first request (parallel to the step list).
#[derive(Default)]
struct Waiting {
    keys: Vec<(AdapterKey, u32)>,
    firsts: Vec<u32>,
}

/// Why an adapter was deferred.
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
    pub fn plan_names(&mut self, names: &[Option<&str>], num_tokens: &[u32]) -> Result<StepPlan> {
        let mut seen: FxHashMap<(usize, usize), AdapterKey> = FxHashMap::default();
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

    /// Plans one step and commits it: the previous step's protection ends, the admitted adapters are
    /// protected until the next plan (or [`Registry::end_step`]), and the planned loads are marked
    /// loading until [`Registry::load_done`] / [`Registry::load_failed`].
    ///
    /// `adapters[i]` and `num_tokens[i]` describe request `i` (adapters from [`Registry::lookup`];
    /// ones being unloaded are served, their requests are still running).
    ///
    /// Errors: [`Error::Usage`] when the two slices differ in length, the admitted tokens overflow
    /// an `i32`, or a step transaction is open (nothing is planned then).
    pub fn plan(&mut self, adapters: &[Option<AdapterKey>], num_tokens: &[u32]) -> Result<StepPlan> {
        self.plan_in(adapters, num_tokens, false)
    }

    /// [`Registry::plan`], in fetch mode when `fetch`: a request whose adapter is not in the host
    /// tier is deferred (it takes none of the slot budget), and the adapter's fetch starts unless
    /// it is fetching already or the host tier cannot make room now, even after adapters admitted
    /// for younger requests yield theirs; the plan's `to_fetch` lists the fetches started. In
    /// either mode a fresh adapter (see [`Registry::fetch_done`]) stays fresh only if this plan
    /// defers it.
    ///
    /// Errors: as [`Registry::plan`].
    pub fn plan_in(
        &mut self,
        adapters: &[Option<AdapterKey>],
        num_tokens: &[u32],
        fetch: bool,
    ) -> Result<StepPlan> {
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
        self.admit(adapters, &mut marks, fetch.then_some(&mut waiting));
        if fetch {
            self.start_waiting_fetches(&mut waiting, &mut marks, &mut plan);
        }
        self.place_admitted(&mut marks, &mut plan);
        self.end_freshness(&marks);
        self.fill_outputs(&marks, adapters, num_tokens, total, &mut plan);
        self.plan_marks = marks;
        Ok(plan)
    }

    /// Starts the fetches of the adapters waiting for the host tier, in first-request order. When
    /// the tier cannot make room for one, adapters admitted for later requests yield theirs if
    /// that is enough ([`Registry::yield_room`]): a waiting request goes before younger ones, so
    /// no request waits forever behind adapters that later requests keep in the step.
    fn start_waiting_fetches(&mut self, waiting: &mut Waiting, marks: &mut [i32], plan: &mut StepPlan) {
        for &(key, first) in &waiting.keys {
            let a = self.get(key);
            if a.residency.fetching {
                continue;
            }
            let bytes = a.identity.size.host_bytes;
            if !self.host.room_possible(bytes) {
                self.yield_room(first, bytes, &mut waiting.firsts, marks);
            }
            if self.start_fetch(key) {
                let a = self.get(key);
                plan.to_fetch.push(Fetch { name: Arc::clone(&a.identity.name), serial: a.identity.serial });
            }
        }
    }

    /// Defers, youngest first, admitted adapters whose first request comes after request `first`
    /// and that only the step protects, until the host tier could make room for `bytes`; defers
    /// none when all of them would not be enough. `firsts` is parallel to `self.step`.
    fn yield_room(&mut self, first: u32, bytes: u64, firsts: &mut Vec<u32>, marks: &mut [i32]) {
        let protected_count = self.host.count - self.host.candidates.len();
        let protected_bytes = self.host.bytes - self.host.candidate_bytes;
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
            return;
        }
        // Descending positions: each removal leaves the earlier ones in place.
        for at in picks {
            let key = self.step.remove(at);
            firsts.remove(at);
            marks[key.index()] = DEFERRED;
            self.get_mut(key).protection.in_step = false;
            self.refresh(key);
        }
    }

    /// Fresh adapters (fetched, waiting for a step to admit their requests) stay protected while
    /// plans defer them, and only then: one this plan admitted, or did not ask for, is fresh no more.
    fn end_freshness(&mut self, marks: &[i32]) {
        if self.fresh.is_empty() {
            return;
        }
        let mut fresh = std::mem::take(&mut self.fresh);
        fresh.retain(|&key| {
            let keep = marks[key.index()] == DEFERRED;
            if !keep {
                self.get_mut(key).protection.fresh = false;
                self.refresh(key);
            }
            keep
        });
        self.fresh = fresh;
    }

    /// Fresh adapters not among `keys` are fresh no more: [`Registry::end_freshness`] for a plan
    /// that defers all of `keys` and admits nothing.
    pub(super) fn end_freshness_outside(&mut self, keys: &[AdapterKey]) {
        let mut fresh = std::mem::take(&mut self.fresh);
        fresh.retain(|&key| {
            let keep = keys.contains(&key);
            if !keep {
                self.get_mut(key).protection.fresh = false;
                self.refresh(key);
            }
            keep
        });
        self.fresh = fresh;
    }

    /// Admission by budget, in batch order: marks each admitted adapter [`ADMITTED`] and puts it in
    /// the step, each refused one [`DEFERRED`]; the previous step's adapters not admitted again
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
        let budget = self.config.slots - self.pinned;
        let mut unpinned = 0;
        let base_mark = marks.len() - 1;
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
                if a.residency.host_since.is_none() {
                    *mark = DEFERRED;
                    waiting.keys.push((key, i as u32));
                    continue;
                }
            }
            if !(a.protection.pinned || unpinned < budget) {
                *mark = DEFERRED;
                self.device.counters.refusals += 1;
                continue;
            }
            *mark = ADMITTED;
            unpinned += usize::from(!a.protection.pinned);
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

    /// A slot (and a host place) for every admitted adapter, in batch order; an adapter no tier can
    /// make room for is deferred after all. Leaves each admitted adapter's slot as its mark.
    fn place_admitted(&mut self, marks: &mut [i32], plan: &mut StepPlan) {
        // Refused adapters leave `self.step`, so it is walked by position.
        let mut at = 0;
        while let Some(&key) = self.step.get(at) {
            at += 1;
            if self.get(key).residency.slot.is_some() {
                self.device.counters.hits += 1;
            } else if let Err(refusal) = self.bring_in(key, plan) {
                match refusal {
                    Refusal::Host => self.host.counters.refusals += 1,
                    Refusal::Device => self.device.counters.refusals += 1,
                }
                marks[key.index()] = DEFERRED;
                self.get_mut(key).protection.in_step = false;
                at -= 1;
                self.step.remove(at);
                self.refresh(key);
                continue;
            }
            let now = self.tick();
            let a = self.get_mut(key);
            a.residency.last_used = now;
            a.residency.uses += 1;
        }
        // Admitted adapters are protected, so no later load took their slots.
        for &key in &self.step {
            marks[key.index()] = self.get(key).residency.slot.expect("an admitted adapter has a slot") as i32;
        }
    }

    /// Gives `key` (admitted, in the step, in no slot) a slot, reading it from disk first if it left
    /// the host tier; or says which tier refused.
    fn bring_in(&mut self, key: AdapterKey, plan: &mut StepPlan) -> std::result::Result<(), Refusal> {
        let a = self.get(key);
        let source = if a.residency.host_since.is_some() { LoadSource::Host } else { LoadSource::Disk };
        let bytes = a.identity.size.host_bytes;
        // A blocking read of an adapter being fetched takes over the fetch's reservation.
        let fetching = a.residency.fetching;
        let host_room = if fetching { self.fetch_fits(key) } else { self.host.room_possible(bytes) };
        if source == LoadSource::Disk && !host_room {
            return Err(Refusal::Host);
        }
        if !self.device.slot_possible() {
            return Err(Refusal::Device);
        }
        match source {
            LoadSource::Disk if fetching => self.end_fetch(key, true, &mut plan.evictions),
            LoadSource::Disk => {
                self.make_host_room(bytes, &mut plan.evictions);
                self.enter_host(key);
                self.host.counters.misses += 1;
                self.host.counters.loads += 1;
            }
            LoadSource::Host => self.host.counters.hits += 1,
        }
        let slot = self.take_slot(&mut plan.evictions);
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

    /// The plan's arrays, from each adapter key's mark (its slot, or [`DEFERRED`]).
    fn fill_outputs(
        &self,
        marks: &[i32],
        adapters: &[Option<AdapterKey>],
        num_tokens: &[u32],
        total: usize,
        plan: &mut StepPlan,
    ) {
        let slots = self.config.slots;
        // Buckets: one per slot, then one for base-model tokens, so the per-request and per-token
        // loops index instead of branching on -1 (base rows are mixed in unpredictably).
        let bucket = |slot: i32| (slot as u32 as usize).min(slots);
        // Per bucket: its tokens, then where its run starts in `token_perm`, then the next free
        // place in that run (one allocation for the three).
        let mut counts = vec![0i32; 3 * (slots + 1)];
        let (per_bucket, rest) = counts.split_at_mut(slots + 1);
        let (start, fill) = rest.split_at_mut(slots + 1);
        // Simple passes, each with few live values (pushing to several vectors in one loop spills
        // their lengths to memory and chains every request through it).
        let base_mark = marks.len() - 1;
        let mut request_slots: Vec<i32> =
            adapters.iter().map(|key| marks[key.map_or(base_mark, AdapterKey::index)]).collect();
        let mut admitted: Vec<u32> = (0..adapters.len() as u32).collect();
        let mut deferred = Vec::new();
        if request_slots.contains(&DEFERRED) {
            deferred = admitted.iter().copied().filter(|&i| request_slots[i as usize] == DEFERRED).collect();
            admitted.retain(|&i| request_slots[i as usize] != DEFERRED);
        }
        let mut token_slots = Vec::with_capacity(total);
        // One token per request (a decode step): the token slots are the admitted requests' slots.
        let single = num_tokens.iter().all(|&n| n == 1);
        if !single {
            for (&slot, &n) in request_slots.iter().zip(num_tokens) {
                if slot != DEFERRED {
                    token_slots.extend(std::iter::repeat_n(slot, n as usize));
                }
            }
        }
        if !deferred.is_empty() {
            request_slots.retain(|&slot| slot != DEFERRED);
        }
        if single {
            token_slots.extend_from_slice(&request_slots);
        }
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
        plan.admitted = admitted;
        plan.deferred = deferred;
        plan.request_slots = request_slots;
        plan.token_slots = token_slots;
        plan.token_perm = token_perm;
        let (per_slot, start) = (&per_bucket[..slots], &start[..slots]);
        let chunk = self.config.chunk_size.map_or(i32::MAX, |c| c.min(i32::MAX as usize) as i32);
        let segments = per_slot.iter().filter(|&&c| c > 0).count();
        plan.seg_indptr.reserve_exact(segments + 1);
        plan.seg_slots.reserve_exact(segments);
        plan.seg_indptr.push(0);
        for (s, (&begin, &count)) in start.iter().zip(per_slot).enumerate() {
            let mut at = begin;
            while at < begin + count {
                at = (at + chunk.min(begin + count - at)).min(begin + count);
                plan.seg_indptr.push(at);
                plan.seg_slots.push(s as i32);
            }
        }
        plan.slot_ranks.reserve_exact(slots);
        plan.slot_scalings.reserve_exact(slots);
        plan.slot_generations.reserve_exact(slots);
        for (s, key) in self.device.slots.iter().enumerate() {
            let (rank, scaling) = key.map_or((0, 0.0), |k| {
                let a = self.get(k);
                (a.identity.size.rank as i32, a.identity.size.scaling)
            });
            plan.slot_ranks.push(rank);
            plan.slot_scalings.push(scaling);
            plan.slot_generations.push(self.device.generations[s] as i64);
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
