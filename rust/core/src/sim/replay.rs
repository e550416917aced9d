//! Replays a trace through the registry's own planner — the same [`Registry`] calls, in the same
//! order, that the live manager makes per step — and reports what each tier did, beside Belady's
//! bound for the same demand.
//!
//! The serving loop modelled: requests wait in arrival order; each step takes the first
//! `batch_size` waiting requests that have arrived, begins a step over them (one
//! [`Registry::begin_step`] plans and acquires the admitted ones at once), performs the planned
//! loads (reporting each done), runs, and finishes the step, releasing them. Deferred
//! requests stay at the front of the queue for the next step. A request is served by one step.
//! With [`SimConfig::decode`] a request runs `tokens` steps instead, one token a step as an
//! engine's decoding requests do: offered in every step ahead of the waiting ones, holding its
//! adapter while it runs, and deferred like a waiting one when the step has no room for it (it
//! then makes no progress that step).
//! With arrival times the step clock advances `step_seconds` per step and jumps ahead to the next
//! arrival when nothing waits; a request without one arrives with the request before it.
//!
//! With `load_ms` > 0 the loop runs in background mode: steps begin in fetch mode (a request whose
//! adapter is not in the host tier is deferred and the adapter fetched), a fetch begun at step
//! time `t` is reported done at the first step at or after `t + load_ms`, and a step that could
//! admit nothing waits instead (the clock jumps to the next fetch due, or the next arrival that
//! can join the batch; such a wait is not a step). See [`FetchReport`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::ops::ControlFlow;

use crate::error::{Error, Result};
use crate::limits::MAX_ADAPTER_RANK;
use crate::policy::{AdapterKey, PolicyKind};
use crate::registry::{
    AdapterSize, AdmissionOrder, Config, LoadSource, Offer, Paging, Registry, StepMode, StepPlan,
    StepRequest, TierStats, Wants,
};
use crate::sim::belady::{min_misses, min_misses_paged, Demand};
use crate::sim::fetches::{FetchReport, Fetches};
use crate::sim::trace::{Request, SplitMix, Trace};
use crate::spec::LoRARef;

/// One configuration to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Device slots (`max_loras_per_batch`).
    pub slots: usize,
    /// Host-tier capacity in adapters (`max_loaded_loras`); `None` is unbounded.
    pub max_loaded: Option<usize>,
    /// The eviction policy of both tiers.
    pub policy: String,
    /// Adapters pinned from the start (registered first, pinned).
    pub pins: Vec<String>,
    /// Requests a step takes from the queue, at least 1.
    pub batch_size: usize,
    /// Seconds a step takes (only matters for traces with arrival times), >= 0.
    pub step_seconds: f64,
    /// Bytes of an adapter of the largest rank in `ranks` (of every adapter when `ranks` is empty),
    /// in host memory and in a slot.
    pub adapter_bytes: u64,
    /// The mix of ranks, `(rank, weight)`: each adapter of the trace gets one, drawn by the weights
    /// from a hash of its name (the same rank in every run and on every replica), and
    /// `adapter_bytes * rank / largest rank` bytes. Empty: every adapter rank 16 of `adapter_bytes`.
    pub ranks: Vec<(u32, f64)>,
    /// Host-tier capacity in bytes (besides `max_loaded` in adapters); `None` is unbounded.
    pub max_host_bytes: Option<u64>,
    /// Milliseconds a read from disk takes, >= 0: 0 reads in the step that needs the adapter (the
    /// blocking mode); more runs the loop in background mode (see the module docs).
    pub load_ms: f64,
    /// The device tier in rank pages (`slots` is then the bound on distinct adapters a step);
    /// `None` is slot mode. Belady's device bound then counts the pages over the smallest adapter's
    /// as places: a lower bound, not the optimum (see [`TierReport::belady_misses`]).
    pub paging: Option<Paging>,
    /// Requests run `tokens` steps, one token a step, ahead of the waiting ones in every step (see
    /// the module docs); `tokens` then counts steps, and the report's tokens one per request a
    /// step ran. False: a step serves a request whole.
    pub decode: bool,
    /// The order a step is offered its requests in. [`AdmissionOrder::Arrival`]: running requests
    /// first, then the queue in arrival order (deferred ones at its front).
    /// [`AdmissionOrder::LongestRemaining`]: the registry's [`Registry::offer_order`] of the
    /// running and waiting requests, with each one's steps left (decode mode) or tokens, and the
    /// rounds younger waiting requests started ahead of it, counted as an engine counts them.
    pub order: AdmissionOrder,
}

impl SimConfig {
    /// `slots` slots, unbounded host tier, `policy`, no pins, batches of 4, 20 ms steps, 32 MiB adapters.
    pub fn new(slots: usize, policy: &str) -> Self {
        Self {
            slots,
            max_loaded: None,
            policy: policy.to_owned(),
            pins: Vec::new(),
            batch_size: 4,
            step_seconds: 0.02,
            adapter_bytes: 32 << 20,
            ranks: Vec::new(),
            max_host_bytes: None,
            load_ms: 0.0,
            paging: None,
            decode: false,
            order: AdmissionOrder::Arrival,
        }
    }
}

/// What one tier did over a simulation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierReport {
    /// Uses served from the tier (device: adapter already in a slot; host: a slot load copied from
    /// host memory).
    pub hits: u64,
    /// Uses that had to bring the adapter in (device: slot loads; host: reads from disk).
    pub misses: u64,
    /// Adapters evicted to make room.
    pub evictions: u64,
    /// Bytes brought into the tier (the sizes of the adapters missed; held at `u64::MAX` past it).
    pub bytes_moved: u64,
    /// Belady's fewest misses for the same demand and capacity; `None` when the tier is unbounded
    /// (host only: then the fewest disk reads are zero and no bound is worth printing). For a page
    /// pool (device tier, paged mode) a lower bound: MIN over as many places as the pool's pages
    /// hold of the smallest adapter, which no policy on adapters of mixed sizes can beat.
    pub belady_misses: Option<u64>,
}

/// The outcome of [`simulate`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SimReport {
    /// Steps planned.
    pub steps: u64,
    /// Requests served (all of the trace's).
    pub requests: u64,
    /// Requests that named an adapter (the rest used the base model).
    pub adapter_requests: u64,
    /// Deferrals: a request deferred in `k` steps counts `k` times.
    pub deferrals: u64,
    /// The most steps any one request was deferred (see `limits::OVERDUE_AFTER` for the bound on
    /// waits for room).
    pub worst_wait: u64,
    /// Tokens served.
    pub tokens: u64,
    /// Adapter uses: per step, the distinct adapters it admitted (the denominator of the device hit
    /// rate, and the same for every policy when admission does not depend on the policy).
    pub uses: u64,
    /// The device tier (slots).
    pub device: TierReport,
    /// The host tier.
    pub host: TierReport,
    /// Background mode (`load_ms` > 0): fetches and the requests that waited for them.
    pub fetch: FetchReport,
}

impl SimReport {
    /// Device hits / uses (0 when nothing used an adapter).
    pub fn device_hit_rate(&self) -> f64 {
        ratio(self.device.hits, self.uses)
    }

    /// Belady's device hit rate for the same demand: 1 - fewest misses / uses.
    pub fn belady_hit_rate(&self) -> f64 {
        ratio(self.uses - self.device.belady_misses.unwrap_or(self.uses), self.uses)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Replays `trace` under `config`. See the module docs for the serving loop modelled.
///
/// Errors: [`Error::Spec`] for a bad configuration (0 slots or batch size, host capacity below the
/// slots, an unknown policy, a pin that is not in the trace or exceeds the pin limit, a negative or
/// non-finite step time).
pub fn simulate(trace: &Trace, config: &SimConfig) -> Result<SimReport> {
    simulate_with(trace, config, |_, _| {})
}

/// [`simulate`], calling `on_step(batch, plan)` after each step with the trace indices of the
/// step's requests (in batch order) and the plan the registry made for them.
///
/// Errors: as [`simulate`].
pub fn simulate_with(
    trace: &Trace,
    config: &SimConfig,
    mut on_step: impl FnMut(&[u32], &StepPlan),
) -> Result<SimReport> {
    let run = simulate_until(trace, config, |batch, plan| {
        on_step(batch, plan);
        ControlFlow::<Infallible>::Continue(())
    })?;
    match run {
        ControlFlow::Continue(report) => Ok(report),
        ControlFlow::Break(never) => match never {},
    }
}

/// [`simulate_with`], where `on_step` may stop the replay early by returning `Break(b)`: the
/// result is then `Break(b)` and no report is made (a caller's progress display that was
/// interrupted, say). A replay that runs to the end returns `Continue(report)`, the same report
/// [`simulate`] gives.
///
/// Errors: as [`simulate`].
pub fn simulate_until<B>(
    trace: &Trace,
    config: &SimConfig,
    mut on_step: impl FnMut(&[u32], &StepPlan) -> ControlFlow<B>,
) -> Result<ControlFlow<B, SimReport>> {
    check_config(config)?;
    let (mut reg, keys, sizes) = setup(trace, config)?;
    let pinned: Vec<bool> = keys.iter().map(|&k| reg.get(k).protection.pinned).collect();
    let host_initial: Vec<u32> = (0..keys.len())
        .filter(|&i| reg.get(keys[i]).tenancy.host_since.is_some())
        .map(|i| i as u32)
        .collect();
    let start = reg.stats();

    let requests = trace.requests();
    let arrivals = arrival_times(requests);
    let mut report = SimReport { requests: requests.len() as u64, ..SimReport::default() };
    let mut demand = Demand::new();
    // Per request of the trace: the steps it was deferred so far.
    let mut waits = vec![0u64; requests.len()];
    let mut queue: VecDeque<u32> = VecDeque::with_capacity(config.batch_size.min(requests.len()));
    let mut next = 0usize;
    let mut clock = 0.0f64;
    let mut batch = Vec::new();
    let mut step = StepInputs::default();
    let background = config.load_ms > 0.0;
    let mut fetches = Fetches::new(config.load_ms, if background { requests.len() } else { 0 });
    // Decode mode: the requests running, in the order they started, with the steps each has left.
    let mut running: Vec<(u32, u32)> = Vec::new();
    let mut admitted = Vec::new();
    // Per request of the trace: the rounds in which younger waiting requests started ahead of it.
    let mut overtaken = vec![0u32; requests.len()];
    while next < requests.len() || !queue.is_empty() || !running.is_empty() {
        if queue.is_empty() && running.is_empty() {
            clock = clock.max(arrivals[next]);
        }
        while queue.len() + running.len() < config.batch_size
            && next < requests.len()
            && arrivals[next] <= clock
        {
            queue.push_back(next as u32);
            next += 1;
        }
        batch.clear();
        batch.extend(running.iter().map(|&(i, _)| i));
        batch.extend(queue.iter().copied());
        fetches.complete(&mut reg, clock)?;
        let started = running.len();
        // Arrival order offers the batch as it stands; another order offers it permuted.
        let order = (config.order != AdmissionOrder::Arrival)
            .then(|| offer_order(&reg, &keys, requests, &batch, &running, &overtaken, config.order));
        let ordered: Option<Vec<u32>> =
            order.as_ref().map(|o| o.iter().map(|&p| batch[p as usize]).collect());
        let offered = ordered.as_deref().unwrap_or(&batch);
        let mut plan = step.serve(&mut reg, trace, &keys, offered, background)?;
        count_bytes(&mut report, &plan, &sizes);
        if background {
            fetches.record(&reg, &keys, requests, offered, &plan, clock, report.steps);
        }
        if let Some(order) = &order {
            unorder(&mut plan, order);
        }
        if plan.admitted.is_empty() {
            // Background mode: nothing could run, so wait for the next fetch, or for a request
            // that can join the batch. (A blocking step that admits nothing never will.)
            let joins =
                background && queue.len() + running.len() < config.batch_size && next < requests.len();
            let joins = joins.then(|| arrivals[next]);
            let Some(wake) = fetches.next_due().into_iter().chain(joins).reduce(f64::min) else {
                return Err(Error::Usage(format!(
                    "step {} admitted none of its {} request(s); the simulation cannot progress",
                    report.steps,
                    batch.len()
                )));
            };
            clock = clock.max(wake);
            continue;
        }
        if order.is_some() {
            count_overtaken(&mut overtaken, &batch[started..], &plan, started);
        }
        count_step(&mut report, &mut demand, requests, &batch, &plan, config.decode.then_some(started));
        for &d in &plan.deferred {
            let waited = &mut waits[batch[d as usize] as usize];
            *waited += 1;
            report.worst_wait = report.worst_wait.max(*waited);
        }
        if let ControlFlow::Break(b) = on_step(&batch, &plan) {
            return Ok(ControlFlow::Break(b));
        }
        if config.decode {
            admitted.clear();
            admitted.resize(batch.len(), false);
            for &a in &plan.admitted {
                admitted[a as usize] = true;
            }
            let mut pos = 0;
            running.retain_mut(|(_, left)| {
                *left -= u32::from(admitted[pos]);
                pos += 1;
                *left > 0
            });
            for (pos, &i) in batch.iter().enumerate().skip(started) {
                let tokens = requests[i as usize].tokens;
                if admitted[pos] && tokens > 1 {
                    running.push((i, tokens - 1));
                }
            }
        }
        let waiting_deferred: Vec<u32> =
            plan.deferred.iter().filter(|&&d| d as usize >= started).map(|&d| d - started as u32).collect();
        keep_deferred(&mut queue, &batch[started..], &waiting_deferred);
        clock += config.step_seconds;
    }

    let end = reg.stats();
    // Belady's MIN is optimal for places of one size; for a page pool it gives a lower bound.
    let device_bound = Some(match config.paging {
        None => min_misses(&demand, config.slots, |a| pinned[a as usize], &[])?,
        Some(p) => {
            min_misses_paged(&demand, p.pages, |a| reg.key_pages(keys[a as usize]), |a| pinned[a as usize])?
        }
    });
    report.device = tier_report(&end.device, &start.device, report.device.bytes_moved, device_bound);
    let host_bound = config
        .max_loaded
        .map(|cap| min_misses(&demand, cap, |a| pinned[a as usize], &host_initial))
        .transpose()?;
    report.host = tier_report(&end.host, &start.host, report.host.bytes_moved, host_bound);
    report.fetch = fetches.report();
    Ok(ControlFlow::Continue(report))
}

/// Refuses a batch size of 0 and a negative or non-finite step or load time.
pub(super) fn check_config(config: &SimConfig) -> Result<()> {
    if config.batch_size == 0 {
        return Err(Error::Spec("batch_size must be at least 1 (got 0)".into()));
    }
    if !config.step_seconds.is_finite() || config.step_seconds < 0.0 {
        return Err(Error::Spec(format!("step_seconds must be a number >= 0 (got {})", config.step_seconds)));
    }
    if !config.load_ms.is_finite() || config.load_ms < 0.0 {
        return Err(Error::Spec(format!("load_ms must be a number >= 0 (got {})", config.load_ms)));
    }
    Ok(())
}

/// Each request's arrival time; one without a time arrives with the request before it (the first at 0).
pub(super) fn arrival_times(requests: &[Request]) -> Vec<f64> {
    requests
        .iter()
        .scan(0.0, |last, r| {
            *last = r.arrival.unwrap_or(*last);
            Some(*last)
        })
        .collect()
}

/// The per-step argument lists of the registry calls, kept between steps so a step allocates none.
#[derive(Default)]
pub(super) struct StepInputs {
    keys: Vec<Option<AdapterKey>>,
    tokens: Vec<u32>,
}

impl StepInputs {
    /// One step of the live manager's loop for the requests `batch` (trace indices): begin the step
    /// transaction (plan and acquire; in fetch mode when `fetch`), report every planned load done,
    /// finish. Returns the plan.
    ///
    /// Errors: the registry's.
    pub(super) fn serve(
        &mut self,
        reg: &mut Registry,
        trace: &Trace,
        keys: &[AdapterKey],
        batch: &[u32],
        fetch: bool,
    ) -> Result<StepPlan> {
        let requests = trace.requests();
        self.keys.clear();
        self.tokens.clear();
        for &i in batch {
            let r = &requests[i as usize];
            self.keys.push(r.adapter.map(|a| keys[a as usize]));
            self.tokens.push(r.tokens);
        }
        let mode = if fetch { StepMode::Fetch } else { StepMode::ReadInStep };
        let (plan, ticket) = reg.begin_step(StepRequest::new(&self.keys, &self.tokens, mode))?.begun()?;
        for index in 0..plan.loads.len() {
            reg.report_load(ticket, index, true)?;
        }
        reg.finish_step(ticket)?;
        Ok(plan)
    }
}

/// Adds the bytes one plan's loads and reads move to `report` (every plan: one that admits nothing
/// may still start fetches).
pub(super) fn count_bytes(report: &mut SimReport, plan: &StepPlan, sizes: &Sizes) {
    // A slot load copies the adapter. A read from disk is a load from disk in blocking mode, or a
    // fetch started in fetch mode (where a load from disk ends a fetch already counted).
    for load in &plan.loads {
        let bytes = sizes.by_key[load.key.index()];
        report.device.bytes_moved = report.device.bytes_moved.saturating_add(bytes);
        if load.source == LoadSource::Disk && !sizes.fetch_mode {
            report.host.bytes_moved = report.host.bytes_moved.saturating_add(bytes);
        }
    }
    for fetch in &plan.to_fetch {
        let bytes = sizes.by_name.get(&*fetch.name).copied().unwrap_or(0);
        report.host.bytes_moved = report.host.bytes_moved.saturating_add(bytes);
    }
}

/// Adds one step's admitted requests to `report` (tokens, adapter requests, uses, deferrals, the step)
/// and its distinct adapters, in first-use order, to `demand`. `decode`: the step ran one token of
/// each admitted request and its first `decode` requests were running before it (their adapter
/// requests are counted once, when they started); `None`: it served each admitted request whole.
pub(super) fn count_step(
    report: &mut SimReport,
    demand: &mut Demand,
    requests: &[Request],
    batch: &[u32],
    plan: &StepPlan,
    decode: Option<usize>,
) {
    let mut used: Vec<u32> = Vec::new();
    for &i in &plan.admitted {
        let r = &requests[batch[i as usize] as usize];
        report.tokens += decode.map_or(u64::from(r.tokens), |_| 1);
        if let Some(a) = r.adapter {
            if decode.is_none_or(|running| i as usize >= running) {
                report.adapter_requests += 1;
            }
            if !used.contains(&a) {
                used.push(a);
            }
        }
    }
    report.uses += used.len() as u64;
    demand.push_step(used);
    report.deferrals += plan.deferred.len() as u64;
    report.steps += 1;
}

/// The positions of `batch` (the `running` requests, then the waiting ones) in the order a step
/// offers them by `order` (see [`SimConfig::order`]).
fn offer_order(
    reg: &Registry,
    keys: &[AdapterKey],
    requests: &[Request],
    batch: &[u32],
    running: &[(u32, u32)],
    overtaken: &[u32],
    order: AdmissionOrder,
) -> Vec<u32> {
    let offers: Vec<Offer> = batch
        .iter()
        .enumerate()
        .map(|(pos, &i)| {
            let r = &requests[i as usize];
            let wants = r.adapter.map_or(Wants::Base, |a| Wants::Adapter(keys[a as usize]));
            match running.get(pos) {
                Some(&(_, left)) => Offer { wants, overtaken: None, remaining: left },
                None => Offer { wants, overtaken: Some(overtaken[i as usize]), remaining: r.tokens },
            }
        })
        .collect();
    reg.offer_order(&offers, order)
}

/// Makes `plan`, made for the batch in `order` (positions of the batch), index the batch itself:
/// its admitted requests (with their slots) and deferred ones (with their reasons) by position,
/// each list in batch order again.
fn unorder(plan: &mut StepPlan, order: &[u32]) {
    if order.iter().enumerate().all(|(i, &p)| p as usize == i) {
        return;
    }
    let mut admitted: Vec<(u32, i32)> =
        plan.admitted.iter().zip(&plan.request_slots).map(|(&a, &s)| (order[a as usize], s)).collect();
    admitted.sort_unstable();
    (plan.admitted, plan.request_slots) = admitted.into_iter().unzip();
    let mut deferred: Vec<_> =
        plan.deferred.iter().zip(&plan.reasons).map(|(&d, &why)| (order[d as usize], why)).collect();
    deferred.sort_unstable_by_key(|&(d, _)| d);
    (plan.deferred, plan.reasons) = deferred.into_iter().unzip();
    for failed in &mut plan.failed {
        failed.0 = order[failed.0 as usize];
    }
    plan.failed.sort_unstable_by_key(|f| f.0);
}

/// Counts a round against each waiting request (`waiting`, trace indices in arrival order, from
/// position `started` of the step's batch) that a younger waiting one started ahead of, as an
/// engine does for [`Offer::overtaken`].
fn count_overtaken(overtaken: &mut [u32], waiting: &[u32], plan: &StepPlan, started: usize) {
    let admitted = |pos: usize| plan.admitted.binary_search(&((started + pos) as u32)).is_ok();
    let Some(youngest) = (0..waiting.len()).rev().find(|&pos| admitted(pos)) else { return };
    for pos in 0..youngest {
        if !admitted(pos) {
            overtaken[waiting[pos] as usize] += 1;
        }
    }
}

/// Leaves in `queue` (which held `batch`) only the requests the step deferred, in order: they go first
/// in the next step. `deferred` holds their positions in `batch`, ascending.
fn keep_deferred(queue: &mut VecDeque<u32>, batch: &[u32], deferred: &[u32]) {
    let mut deferred = deferred.iter().peekable();
    let mut kept = 0;
    for (pos, i) in batch.iter().enumerate() {
        if deferred.next_if(|&&d| d as usize == pos).is_some() {
            queue[kept] = *i;
            kept += 1;
        }
    }
    queue.truncate(kept);
}

/// What a tier did between the `start` and `end` snapshots, with the bytes its misses moved and the
/// Belady bound for the same demand.
pub(super) fn tier_report(
    end: &TierStats,
    start: &TierStats,
    bytes_moved: u64,
    belady_misses: Option<u64>,
) -> TierReport {
    let (e, s) = (&end.counters, &start.counters);
    TierReport {
        hits: e.hits - s.hits,
        misses: e.misses - s.misses,
        evictions: e.evictions - s.evictions,
        bytes_moved,
        belady_misses,
    }
}

/// Every adapter's bytes, by registry key and by name, and whether steps run in fetch mode.
pub(super) struct Sizes {
    by_key: Vec<u64>,
    by_name: HashMap<String, u64>,
    fetch_mode: bool,
}

/// Each adapter's size under `config` (see [`SimConfig::ranks`]), in `names` order.
///
/// Errors: [`Error::Spec`] for a rank outside `1..=MAX_ADAPTER_RANK` or a weight that is not a
/// finite number above 0 (each naming the value).
pub fn adapter_sizes(config: &SimConfig, names: &[String]) -> Result<Vec<AdapterSize>> {
    for &(rank, weight) in &config.ranks {
        if !(1..=MAX_ADAPTER_RANK).contains(&(rank as usize)) {
            return Err(Error::Spec(format!("rank {rank} is not in 1..={MAX_ADAPTER_RANK}")));
        }
        if !(weight.is_finite() && weight > 0.0) {
            return Err(Error::Spec(format!("rank {rank}: weight {weight} is not a finite number above 0")));
        }
    }
    let Some(largest) = config.ranks.iter().map(|&(r, _)| r).max() else {
        let size = AdapterSize {
            rank: 16,
            host_bytes: config.adapter_bytes,
            device_bytes: config.adapter_bytes,
            scaling: 1.0,
        };
        return Ok(vec![size; names.len()]);
    };
    let total: f64 = config.ranks.iter().map(|&(_, w)| w).sum();
    Ok(names
        .iter()
        .map(|name| {
            // FNV-1a of the name, finished by SplitMix: stable across runs, platforms and replicas.
            let h = name
                .bytes()
                .fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3));
            let mut draw = SplitMix::new(h).unit() * total;
            let mut rank = largest;
            for &(r, w) in &config.ranks {
                if draw < w {
                    rank = r;
                    break;
                }
                draw -= w;
            }
            let bytes =
                (u128::from(config.adapter_bytes) * u128::from(rank) / u128::from(largest)).max(1) as u64;
            AdapterSize { rank, host_bytes: bytes, device_bytes: bytes, scaling: 1.0 }
        })
        .collect())
}

/// A registry with the trace's adapters registered (pinned ones first, pinned), their keys by trace
/// index, and their sizes.
pub(super) fn setup(trace: &Trace, config: &SimConfig) -> Result<(Registry, Vec<AdapterKey>, Sizes)> {
    let mut rc = Config::new(config.slots);
    rc.paging = config.paging;
    rc.max_loaded = config.max_loaded;
    rc.max_host_bytes = config.max_host_bytes;
    rc.device_policy = PolicyKind::parse("policy", &config.policy)?;
    rc.host_policy = rc.device_policy;
    let mut reg = Registry::new(rc)?;
    let names = trace.names();
    let pins: HashSet<&str> = config.pins.iter().map(String::as_str).collect();
    for p in &config.pins {
        if !names.contains(p) {
            return Err(Error::Spec(format!(
                "cannot pin adapter {p:?}: the trace never names it ({} adapter(s) in the trace)",
                names.len()
            )));
        }
    }
    let sizes = adapter_sizes(config, names)?;
    let order = (0..names.len())
        .filter(|&i| pins.contains(names[i].as_str()))
        .chain((0..names.len()).filter(|&i| !pins.contains(names[i].as_str())));
    for i in order {
        let r = sim_ref(&names[i], pins.contains(names[i].as_str()))?;
        reg.register(r, sizes[i]).map_err(|e| match e {
            Error::Capacity(msg) => Error::Spec(msg),
            other => other,
        })?;
    }
    let keys = names.iter().map(|n| reg.lookup(n, false)).collect::<Result<Vec<_>>>()?;
    let mut by_key = vec![0u64; keys.iter().map(|k| k.index() + 1).max().unwrap_or(0)];
    for (k, size) in keys.iter().zip(&sizes) {
        by_key[k.index()] = size.host_bytes;
    }
    let by_name = names.iter().cloned().zip(sizes.iter().map(|s| s.host_bytes)).collect();
    Ok((reg, keys, Sizes { by_key, by_name, fetch_mode: config.load_ms > 0.0 }))
}

/// The ref the simulator registers for `name` (path `sim://NAME`).
pub fn sim_ref(name: &str, pinned: bool) -> Result<LoRARef> {
    LoRARef::with_deterministic_id(name, &format!("sim://{name}"), pinned, None)
}
