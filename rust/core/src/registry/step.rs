//! The step transaction: one call plans a scheduler step and acquires its admitted requests at
//! once, under the registry's lock, so no unload or re-registration can slip in between; the
//! step's planned loads are reported by index; [`Registry::finish_step`] releases everything the
//! step holds and fails every load it never reported. Also the budget rule's other faces: which
//! batches fit ([`Registry::split`]) and why one does not ([`Registry::overflow`]).

use std::sync::Arc;

use super::fetch::Claim;
use super::plan::{check_step_size, Hold, StepPlan, StepRequests};
use super::tiers::Tier;
use super::Registry;
use crate::error::{Error, Result};
use crate::policy::AdapterKey;

/// The handle of an open step transaction, from [`Registry::begin_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StepTicket(pub u64);

/// How a step treats the adapters it needs that are outside the host tier (evicted from host
/// memory, or being fetched).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StepMode {
    /// The step reads them itself: each is a planned load from disk ([`LoadSource::Disk`]).
    ///
    /// [`LoadSource::Disk`]: super::LoadSource::Disk
    #[default]
    ReadInStep,
    /// A step that would read from disk does not begin: the answer is [`StepStart::ReadFirst`].
    ReadFirst,
    /// Their requests wait while they are fetched in the background (see [`Registry::plan_in`]);
    /// a batch that must run whole waits for all of them ([`StepStart::Fetching`]).
    Fetch,
}

/// One step for [`Registry::begin_step`]: its requests and how to begin it.
#[derive(Debug, Clone)]
pub struct StepRequest<'a> {
    /// The requests; `holds` are those the caller could give no adapter key (deferred or failed
    /// as their [`Hold`] says).
    pub requests: StepRequests<'a>,
    /// Adapters whose last read failed: their requests fail (a whole batch: the step is refused).
    pub failed: &'a [AdapterKey],
    /// Names the requests use that nobody knows: no step begins while there are any
    /// ([`StepStart::Discover`]).
    pub unknown: Vec<Arc<str>>,
    /// How adapters outside the host tier are brought in.
    pub mode: StepMode,
    /// A batch that must run whole (all or nothing): a step that cannot admit every request is
    /// refused with [`Error::Capacity`] and changes nothing.
    pub whole: bool,
}

impl<'a> StepRequest<'a> {
    /// The requests `adapters` / `num_tokens` (no holds, nothing failed or unknown), begun in `mode`.
    pub fn new(adapters: &'a [Option<AdapterKey>], num_tokens: &'a [u32], mode: StepMode) -> Self {
        Self {
            requests: StepRequests { adapters, num_tokens, holds: &[] },
            failed: &[],
            unknown: Vec::new(),
            mode,
            whole: false,
        }
    }

    /// This request, as a batch that must run whole.
    pub fn whole(self) -> Self {
        Self { whole: true, ..self }
    }
}

/// What [`Registry::begin_step`] did, and so what the caller does next.
#[derive(Debug)]
pub enum StepStart {
    /// The step began: run it (perform its loads, reporting each) and finish it.
    Begun(StepPlan, StepTicket),
    /// No step began: these names are neither registered nor held. Register them (or give up) and
    /// begin again.
    Discover(Vec<Arc<str>>),
    /// No step began ([`StepMode::ReadFirst`]): these adapters, which the step would admit, are
    /// outside the host tier. Read each, [`Registry::enter_host_tier`] it, and begin again.
    ReadFirst(Vec<Arc<str>>),
    /// No step began ([`StepMode::Fetch`], a whole batch): its adapters are not all in the host
    /// tier. The plan defers every request and lists the fetches it started (`to_fetch`) and the
    /// host evictions that made their room; wait for the batch's fetches and begin again.
    Fetching {
        /// The deferring plan.
        plan: StepPlan,
        /// Whether waiting can change the answer: this plan started fetches, fetches are in flight,
        /// or it lifted the protection of fresh adapters outside the batch (their room is free to
        /// the next plan). When false the next answer is this one again, unless other callers
        /// change the registry: read in the step instead, or give up.
        progress: bool,
    },
}

impl StepStart {
    /// The begun step's plan and ticket: for callers whose mode always begins a step
    /// ([`StepMode::ReadInStep`], or [`StepMode::Fetch`] not whole, with no unknown names).
    ///
    /// Errors: [`Error::Usage`] naming the answer, when no step began.
    pub fn begun(self) -> Result<(StepPlan, StepTicket)> {
        let what = match self {
            Self::Begun(plan, ticket) => return Ok((plan, ticket)),
            Self::Discover(_) => "names to discover",
            Self::ReadFirst(_) => "adapters to read first",
            Self::Fetching { .. } => "a whole batch waiting for its fetches",
        };
        Err(Error::Usage(format!("begin_step began no step: it answered {what}")))
    }
}

/// What an open step holds.
#[derive(Debug)]
pub(super) struct OpenStep {
    ticket: StepTicket,
    /// The admitted adapters (each holds its `step_holds` requests) and their registration serials.
    held: Vec<(AdapterKey, u64)>,
    /// Per planned load, in the plan's order: its adapter and serial until it is reported.
    pending: Vec<Option<(AdapterKey, u64)>>,
}

impl Registry {
    /// Begins one step transaction, or says what must happen first: plans the step and acquires its
    /// admitted requests atomically, under the registry's lock, so no unload or re-registration
    /// can slip in between.
    ///
    /// As [`Registry::plan_in`], and then every admitted request counts as in flight until
    /// [`Registry::finish_step`] (so an unload of one of its adapters waits for the step), and each
    /// planned load stays protected until reported with [`Registry::report_load`] (or failed by the
    /// finish). The requests of an adapter in `failed` fail, as do those of an adapter being
    /// unloaded ([`Hold::Unloaded`]); the plan lists them in `failed` and runs the rest.
    ///
    /// The answer ([`StepStart`]) is the caller's next action: [`StepStart::Begun`], or no step
    /// and what to do before beginning again (discover names, read adapters first, wait for
    /// fetches).
    ///
    /// Errors: [`Error::Usage`] when a step is open already, the lengths differ, a hold names no
    /// request without an adapter or holds are out of order; with `whole`, [`Error::Capacity`] when
    /// not every request fits, and [`Error::AdapterNotFound`] for an adapter being unloaded or in
    /// `failed`. Nothing changes on an error.
    pub fn begin_step(&mut self, request: StepRequest<'_>) -> Result<StepStart> {
        let StepRequest { requests, failed, unknown, mode, whole } = request;
        if !unknown.is_empty() {
            return Ok(StepStart::Discover(unknown));
        }
        let owned = self.check_holds(requests, failed, whole)?;
        let requests = match &owned {
            Some((adapters, holds)) => StepRequests { adapters, num_tokens: requests.num_tokens, holds },
            None => requests,
        };
        let adapters = requests.adapters;
        let num_tokens = requests.num_tokens;
        if mode == StepMode::ReadFirst {
            // A batch refused whole must not make anyone read (and make host room) first.
            if let Some(why) = whole.then(|| self.overflow(adapters)).flatten() {
                return Err(Error::Capacity(why));
            }
            let to_read = self.host_misses(adapters);
            if !to_read.is_empty() {
                return Ok(StepStart::ReadFirst(to_read));
            }
        }
        if mode == StepMode::Fetch && whole {
            if let Some(why) = self.overflow(adapters) {
                return Err(Error::Capacity(why));
            }
            check_step_size(adapters.len(), num_tokens)?;
            let mut plan = StepPlan::default();
            let keys: Vec<AdapterKey> = adapters.iter().flatten().copied().collect();
            let outside = keys.iter().any(|&k| self.get(k).tenancy.host_since.is_none());
            if outside {
                // A batch keeps no queue across steps: the latest plan's requests are not waiting.
                self.name_requests(&[], false);
                let mut skipped = Vec::new();
                self.fetch_in_order(&keys, true, &mut plan.to_fetch, &mut skipped);
                // This plan defers the whole batch: fresh adapters it does not ask for lose their
                // protection after it, as after a plan that begins a step without them (so the
                // batch's next plan may make room with them, never this one).
                let freed = self.end_freshness_outside(&keys);
                plan.deferred = (0..adapters.len() as u32).collect();
                let progress = !plan.to_fetch.is_empty() || self.host.reserved_count > 0 || freed;
                return Ok(StepStart::Fetching { plan, progress });
            }
        }
        let (plan, ticket) = self.begin_checked(requests, mode == StepMode::Fetch, whole)?;
        Ok(StepStart::Begun(plan, ticket))
    }

    /// Refuses a step while one is open, or (`all_or_nothing`) one with an adapter being unloaded.
    fn check_begin(&self, adapters: &[Option<AdapterKey>], all_or_nothing: bool) -> Result<()> {
        if let Some(open) = &self.open_step {
            return Err(Error::Usage(format!(
                "step {} is open; finish it before beginning another",
                open.ticket.0
            )));
        }
        if !all_or_nothing {
            return Ok(());
        }
        for key in adapters.iter().flatten() {
            let a = self.get(*key);
            if a.protection.draining {
                return Err(Error::AdapterNotFound {
                    name: format!("{} (being unloaded: it takes no new requests)", a.spec_name()),
                    registered: self.not_found_list(),
                });
            }
        }
        Ok(())
    }

    /// [`Registry::check_begin`], and the holds checked; returns the requests with the requests
    /// of adapters in `failed` or being unloaded turned into holds, when there are any.
    #[allow(clippy::type_complexity)]
    fn check_holds(
        &self,
        requests: StepRequests<'_>,
        failed: &[AdapterKey],
        all_or_nothing: bool,
    ) -> Result<Option<(Vec<Option<AdapterKey>>, Vec<(u32, Hold)>)>> {
        let StepRequests { adapters, holds, .. } = requests;
        self.check_begin(adapters, all_or_nothing)?;
        let mut previous = None;
        for &(i, hold) in holds {
            if adapters.get(i as usize) != Some(&None) || previous.is_some_and(|p| p >= i) {
                return Err(Error::Usage(format!(
                    "begin_step: hold {hold:?} of request {i} names no request without an adapter, or \
                     holds are not in ascending request order"
                )));
            }
            previous = Some(i);
        }
        let held = |key: AdapterKey| {
            if failed.contains(&key) {
                Some(Hold::ReadFailed)
            } else if self.get(key).protection.draining {
                Some(Hold::Unloaded)
            } else {
                None
            }
        };
        if all_or_nothing && !failed.is_empty() {
            if let Some(key) = adapters.iter().flatten().copied().find(|&k| failed.contains(&k)) {
                return Err(Error::AdapterNotFound {
                    name: format!("{} (its last read failed)", self.get(key).spec_name()),
                    registered: self.not_found_list(),
                });
            }
        }
        if !adapters.iter().flatten().any(|&k| held(k).is_some()) {
            return Ok(None);
        }
        let mut owned = adapters.to_vec();
        let mut owned_holds = Vec::with_capacity(holds.len());
        let mut given = holds.iter().peekable();
        for (i, request) in owned.iter_mut().enumerate() {
            if let Some(&&(at, hold)) = given.peek() {
                if at as usize == i {
                    owned_holds.push((at, hold));
                    given.next();
                    continue;
                }
            }
            if let Some(hold) = request.and_then(held) {
                owned_holds.push((i as u32, hold));
                *request = None;
            }
        }
        Ok(Some((owned, owned_holds)))
    }

    /// Begins a step [`Registry::check_holds`] allowed.
    fn begin_checked(
        &mut self,
        requests: StepRequests<'_>,
        fetch: bool,
        all_or_nothing: bool,
    ) -> Result<(StepPlan, StepTicket)> {
        let adapters = requests.adapters;
        if all_or_nothing {
            if let Some(why) = self.overflow(adapters) {
                return Err(Error::Capacity(why));
            }
        }
        let plan = self.plan_in(requests, fetch)?;
        let ticket = StepTicket(self.steps_begun + 1);
        self.steps_begun += 1;
        let held = self.step.iter().map(|&k| (k, self.get(k).identity.serial)).collect();
        let pending = plan.loads.iter().map(|l| Some((l.key, l.serial))).collect();
        self.open_step = Some(OpenStep { ticket, held, pending });
        for &i in &plan.admitted {
            if let Some(key) = adapters[i as usize] {
                let p = &mut self.get_mut(key).protection;
                // In the step, hence no eviction candidate whatever its count: no refresh needed.
                p.in_flight += 1;
                p.step_holds += 1;
            }
        }
        if all_or_nothing && !plan.deferred.is_empty() {
            // Only a host tier full of protected adapters defers past the budget check above.
            let why = format!(
                "a batch of {} sequences cannot run at once: the host tier cannot make room for every \
                 adapter it uses ({} request(s) would wait)",
                adapters.len(),
                plan.deferred.len()
            );
            self.finish_step(ticket)?;
            return Err(Error::Capacity(why));
        }
        Ok((plan, ticket))
    }

    /// The adapters among `adapters` that a step would admit now (the budget rule, in batch order)
    /// but that are not in the host tier: a step over them would read them from disk. Changes
    /// nothing. A caller that reads them first ([`Registry::enter_host_tier`]) keeps disk reads, and
    /// the evictions that make room for them, out of the step: a read that fails then changes nothing.
    pub fn host_misses(&self, adapters: &[Option<AdapterKey>]) -> Vec<Arc<str>> {
        let mut budget = self.slot_budget();
        let mut misses: Vec<Arc<str>> = Vec::new();
        for &key in adapters.iter().flatten() {
            let a = self.get(key);
            if !budget.admits(key, a.protection.pinned, self.pages_of(a.identity.size)) {
                continue;
            }
            if a.tenancy.host_since.is_none() && !misses.contains(&a.identity.name) {
                misses.push(Arc::clone(&a.identity.name));
            }
        }
        misses
    }

    /// Enters `name`, whose weights the caller has just read again for registration `serial`, into
    /// the host tier, evicting unprotected adapters to make room; returns their names so the caller
    /// frees them. An adapter in the host tier already is left as it is.
    ///
    /// Errors: [`Error::AdapterNotFound`] (also while being unloaded, or when the name was
    /// registered again since: its serial differs); [`Error::Capacity`] when the host tier cannot
    /// make room (nothing is evicted then).
    pub fn enter_host_tier(&mut self, name: &str, serial: u64) -> Result<Vec<String>> {
        let key = self.lookup(name, false)?;
        if self.get(key).identity.serial != serial {
            return Err(Error::AdapterNotFound {
                name: format!("{name} (registration {serial}: registered again since)"),
                registered: self.not_found_list(),
            });
        }
        let bytes = self.get(key).identity.size.host_bytes;
        if self.get(key).tenancy.host_since.is_some() {
            return Ok(Vec::new());
        }
        let fetching = self.get(key).tenancy.fetching;
        // The caller's own read takes over the fetch's reservation (its report will be refused).
        let possible =
            if fetching { self.fetch_fits(key, Claim::Read) } else { self.host.room_possible(bytes) };
        if !possible {
            self.host.counters.refusals += 1;
            return Err(Error::Capacity(format!(
                "cannot read adapter {name:?} again: {}",
                self.host.shortage(bytes)
            )));
        }
        let mut evicted = Vec::new();
        if fetching {
            self.end_fetch(key, Some(Claim::Read), &mut evicted);
        } else {
            self.make_host_room(bytes, &mut evicted);
            self.enter_host(key);
            self.host.counters.misses += 1;
            self.host.counters.loads += 1;
        }
        Ok(evicted.into_iter().filter(|e| e.tier == Tier::Host).map(|e| e.name.to_string()).collect())
    }

    /// Reports planned load `index` (into the step's `loads`) of step `ticket`: done (`ok`: its
    /// loading protection ends) or failed (it leaves its slot, and the host tier too when the load
    /// was to read it from disk).
    ///
    /// Errors: [`Error::Usage`] when `ticket` is not the open step or that load is not pending.
    pub fn report_load(&mut self, ticket: StepTicket, index: usize, ok: bool) -> Result<()> {
        let open = self.open_step_mut(ticket)?;
        let Some((key, serial)) = open.pending.get_mut(index).and_then(Option::take) else {
            return Err(Error::Usage(format!("load {index} of step {} is not pending", ticket.0)));
        };
        // The step holds the adapter, so it cannot have been forgotten since it was planned.
        debug_assert_eq!(self.get(key).identity.serial, serial);
        if ok {
            self.get_mut(key).protection.loading = None;
            self.refresh(key);
        } else {
            self.fail_load(key);
        }
        Ok(())
    }

    /// Ends step `ticket`: every load it did not report fails, its requests are released and its
    /// adapters stop being protected as in the step. Returns whether an adapter being unloaded
    /// drained (waiters should be woken).
    ///
    /// Errors: [`Error::Usage`] when `ticket` is not the open step (nothing changes).
    pub fn finish_step(&mut self, ticket: StepTicket) -> Result<bool> {
        self.open_step_mut(ticket)?;
        let open = self.open_step.take().expect("checked open");
        for (key, _) in open.pending.into_iter().flatten() {
            self.fail_load(key);
        }
        let mut drained = false;
        for (key, _) in open.held {
            let n = std::mem::take(&mut self.get_mut(key).protection.step_holds);
            drained |= self.unhold(key, n);
        }
        self.end_protection();
        Ok(drained)
    }

    /// Whether the open step holds `key`.
    pub(super) fn step_holds(&self, key: AdapterKey) -> bool {
        self.open_step.as_ref().is_some_and(|o| o.held.iter().any(|&(k, _)| k == key))
    }

    /// The open step's ticket, if one is open.
    pub fn open_ticket(&self) -> Option<StepTicket> {
        self.open_step.as_ref().map(|o| o.ticket)
    }

    fn open_step_mut(&mut self, ticket: StepTicket) -> Result<&mut OpenStep> {
        let open = self.open_step.as_ref().map(|o| o.ticket);
        match (open, &mut self.open_step) {
            (Some(t), Some(step)) if t == ticket => Ok(step),
            (Some(t), _) => Err(Error::Usage(format!(
                "step {} is not the open step (step {} is); it was finished already",
                ticket.0, t.0
            ))),
            _ => Err(Error::Usage(format!("step {} is not open; it was finished already", ticket.0))),
        }
    }

    /// Cuts a batch into groups of request indices, in order, each of which fits the device slots
    /// at once: at most `slots - pinned` distinct unpinned adapters a group, and their pages within
    /// those the pinned adapters leave (pinned ones always fit).
    pub fn split(&self, adapters: &[Option<AdapterKey>]) -> Vec<Vec<u32>> {
        let mut budget = self.slot_budget();
        let mut groups = Vec::new();
        let mut current = Vec::new();
        for (i, request) in adapters.iter().enumerate() {
            if let Some(key) = *request {
                let pinned = self.get(key).protection.pinned;
                let pages = self.key_pages(key);
                if !budget.admits(key, pinned, pages) {
                    groups.push(std::mem::take(&mut current));
                    budget.restart();
                    budget.admits(key, pinned, pages);
                }
            }
            current.push(i as u32);
        }
        if !current.is_empty() {
            groups.push(current);
        }
        groups
    }

    /// Why a batch cannot run in one step (more distinct unpinned adapters than the slots left
    /// by the pinned ones, or more pages than they leave), with the numbers; `None` when it fits.
    pub fn overflow(&self, adapters: &[Option<AdapterKey>]) -> Option<String> {
        let mut budget = self.slot_budget();
        let mut over: Vec<AdapterKey> = Vec::new();
        for &key in adapters.iter().flatten() {
            if !budget.admits(key, self.get(key).protection.pinned, self.key_pages(key))
                && !over.contains(&key)
            {
                over.push(key);
            }
        }
        (!over.is_empty()).then(|| {
            if let Some(paging) = self.config.paging {
                let pages: usize = over.iter().map(|&k| self.key_pages(k)).sum();
                return format!(
                    "a batch of {} sequences uses {} distinct unpinned adapters of {} pages (page_rank={}) \
                     but max_lora_memory={} pages minus {} pinned leave {} pages and max_loras_per_batch={} \
                     minus {} pinned leave room for {} adapters; use LoRAManager.split(names) to cut it into \
                     batches that fit",
                    adapters.len(),
                    budget.used() + over.len(),
                    budget.pages_used() + pages,
                    paging.page_rank,
                    self.total_pages(),
                    self.device.pinned_pages,
                    budget.page_limit(),
                    self.config.slots,
                    self.pinned,
                    budget.limit()
                );
            }
            format!(
                "a batch of {} sequences uses {} distinct unpinned adapters but {} slots minus {} pinned \
                 leave room for {}; use LoRAManager.split(names) to cut it into batches that fit",
                adapters.len(),
                budget.used() + over.len(),
                self.config.slots,
                self.pinned,
                budget.limit()
            )
        })
    }

    /// Empties `slots` in the registry's view: each occupant leaves its slot (it is loaded again on
    /// its next use), its loading protection ended. For a caller that found a slot not holding what
    /// the registry says (a stale plan); out-of-range and empty slots are skipped.
    ///
    /// Errors: [`Error::Usage`] while a step transaction is open (finish it first).
    pub fn invalidate_slots(&mut self, slots: &[u32]) -> Result<()> {
        self.refuse_open_step("invalidate_slots")?;
        for &slot in slots {
            if let Some(&Some(key)) = self.device.slots.get(slot as usize) {
                self.get_mut(key).protection.loading = None;
                self.free_slot(key);
            }
        }
        Ok(())
    }

    /// Ends the protection of the latest plan's adapters (the next plan does this itself). For
    /// callers of [`Registry::plan`]; a step transaction ends with [`Registry::finish_step`].
    ///
    /// Errors: [`Error::Usage`] while a step transaction is open.
    #[cfg(test)]
    pub(crate) fn end_step(&mut self) -> Result<()> {
        self.refuse_open_step("end_step")?;
        self.end_protection();
        Ok(())
    }

    fn end_protection(&mut self) {
        // In admission order, so equal candidates enter the policies in the order a later plan's
        // admission would have released them.
        let mut step = std::mem::take(&mut self.step);
        for &key in &step {
            self.get_mut(key).protection.in_step = false;
            self.refresh(key);
        }
        step.clear();
        self.step = step;
    }

    pub(super) fn refuse_open_step(&self, what: &str) -> Result<()> {
        match &self.open_step {
            Some(open) => Err(Error::Usage(format!(
                "{what}: step {} is open; finish it first (a step transaction owns the step's protection)",
                open.ticket.0
            ))),
            None => Ok(()),
        }
    }

    /// The planned load of `name` finished: its loading protection ends. For callers of
    /// [`Registry::plan`]; a step transaction reports with [`Registry::report_load`].
    ///
    /// Errors: [`Error::AdapterNotFound`]; [`Error::Usage`] when no load of it is pending.
    #[cfg(test)]
    pub(crate) fn load_done(&mut self, name: &str) -> Result<()> {
        let key = self.pending_load(name)?;
        self.get_mut(key).protection.loading = None;
        self.refresh(key);
        Ok(())
    }

    /// The planned load of `name` failed: it is not in its device slot any more, nor in the host tier
    /// if the load was to read it from disk. Nothing else changes.
    ///
    /// Errors: [`Error::AdapterNotFound`]; [`Error::Usage`] when no load of it is pending.
    #[cfg(test)]
    pub(crate) fn load_failed(&mut self, name: &str) -> Result<()> {
        let key = self.pending_load(name)?;
        self.fail_load(key);
        Ok(())
    }

    fn fail_load(&mut self, key: AdapterKey) {
        let source = self.get_mut(key).protection.loading.take();
        if self.get(key).tenancy.slot.is_some() {
            self.free_slot(key);
        }
        if source == Some(super::LoadSource::Disk) && self.get(key).tenancy.host_since.is_some() {
            self.leave_host(key);
        }
        self.refresh(key);
    }

    #[cfg(test)]
    fn pending_load(&self, name: &str) -> Result<AdapterKey> {
        let key = self.lookup(name, true)?;
        if self.get(key).protection.loading.is_none() {
            return Err(Error::Usage(format!("no load of adapter {name:?} is pending")));
        }
        if self.open_step.as_ref().is_some_and(|o| o.pending.iter().flatten().any(|&(k, _)| k == key)) {
            return Err(Error::Usage(format!(
                "the load of adapter {name:?} belongs to the open step: report it with report_load"
            )));
        }
        Ok(key)
    }
}

#[cfg(test)]
#[path = "step_tests.rs"]
mod tests;
