//! Replays a trace over N replicas of the same base model, each with its own registry (slots, host
//! tier, policy, pins), behind a router: `random`, `least-loaded`, `affinity` (the rule of
//! [`crate::routing`]) or `hash` (homes alone, whatever their queues: how far placement alone could
//! cut loads, and what it costs in queueing).
//!
//! The loop runs on one clock in steps of `step_seconds`. At each step the requests that have
//! arrived are routed one by one, in arrival order, each seeing the replicas' state at that moment
//! (where they hold its adapter, their queues); then every replica with a non-empty queue plans one
//! step of its first `batch_size` queued requests, exactly as [`super::simulate`] does for one
//! replica. Requests a step defers stay at the front of their replica's queue. A trace without
//! arrival times arrives all at once, which makes routing meaningless: give it Gamma arrivals
//! ([`Trace::with_gamma_arrivals`]).
//!
//! Both load-aware routers see the same thing: queues as they stand after every request routed
//! before. Least-loaded breaks ties at random (a fixed order would pile every tie onto the first
//! replica and inflate its queue, the figure the affinity router's queue is judged against);
//! affinity breaks them by the adapter's rendezvous order. A replica with a queued request for the
//! adapter counts as fetching it, as the live router counts a replica it sent the adapter to.
//!
//! The queueing figures are measured, not estimated: each replica's queue length is sampled after
//! routing at every step, and its utilisation is the share of steps in which it ran a batch.

use crate::error::{Error, Result};
use crate::routing::{home_replicas, rank_replicas, replication_factor, Holding, ReplicaStats, RouteRequest};
use crate::sim::belady::{min_misses, Demand};
use crate::sim::replay::{
    arrival_times, check_config, count_bytes, count_step, setup, tier_report, SimConfig, SimReport,
    StepInputs,
};
use crate::sim::trace::{SplitMix, Trace};

/// How requests are sent to replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Router {
    /// A uniformly random replica (seeded).
    Random,
    /// The replica with the shortest queue (ties: the earlier replica).
    LeastLoaded,
    /// [`crate::routing::rank_replicas`]: where the adapter is, then its homes, then load.
    Affinity,
    /// The least loaded of the adapter's homes (rendezvous hashing with the same replication factor
    /// as affinity), however long its queue; the base model and pinned adapters by load. Placement
    /// with no spill: the most an affinity router could save, and what it costs in queueing.
    Hash,
}

impl Router {
    /// Parses `random`, `least-loaded`, `affinity` or `hash`.
    ///
    /// Errors: [`Error::Spec`] naming the value and the choices.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "random" => Ok(Self::Random),
            "least-loaded" => Ok(Self::LeastLoaded),
            "affinity" => Ok(Self::Affinity),
            "hash" => Ok(Self::Hash),
            other => Err(Error::Spec(format!(
                "router {other:?} is not a router; choose random, least-loaded, affinity or hash"
            ))),
        }
    }
}

/// One replica's outcome: its own [`SimReport`] and its queue.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaReport {
    /// What the replica's registry did, as [`super::simulate`] reports it.
    pub sim: SimReport,
    /// Requests routed to it.
    pub routed: u64,
    /// Mean queue length (waiting and running requests) over the steps of the run.
    pub queue_mean: f64,
    /// Longest queue seen.
    pub queue_max: u64,
    /// Share of steps in which the replica ran a batch.
    pub utilisation: f64,
}

/// The outcome of [`simulate_replicas`]: one report per replica and the clock's steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterReport {
    /// Per replica, in order.
    pub replicas: Vec<ReplicaReport>,
    /// Steps of the shared clock (including steps where no replica ran).
    pub steps: u64,
}

/// Replays `trace` over `replicas` replicas configured as `config`, routed by `router`. A replica's
/// queue bound (for the affinity rule's spill) is `queue_bound`; `seed` seeds the random router.
///
/// Errors: [`Error::Spec`] for a bad configuration (as [`super::simulate`]), 0 replicas, a queue
/// bound of 0, or background loading (`load_ms` > 0), which the replica loop does not model.
pub fn simulate_replicas(
    trace: &Trace,
    config: &SimConfig,
    replicas: usize,
    router: Router,
    queue_bound: usize,
    seed: u64,
) -> Result<ClusterReport> {
    check_config(config)?;
    if replicas == 0 {
        return Err(Error::Spec("replicas must be at least 1 (got 0)".into()));
    }
    if queue_bound == 0 {
        return Err(Error::Spec("queue_bound must be at least 1 (got 0)".into()));
    }
    if config.load_ms > 0.0 {
        return Err(Error::Spec(
            "load_ms above 0 (background loading) is not modelled with replicas; use 0".into(),
        ));
    }
    let mut regs = Vec::with_capacity(replicas);
    let mut keys = Vec::new();
    let mut sizes = None;
    for _ in 0..replicas {
        let (reg, k, s) = setup(trace, config)?;
        regs.push(reg);
        keys = k;
        sizes = Some(s);
    }
    let sizes = sizes.ok_or_else(|| Error::Spec("replicas must be at least 1 (got 0)".into()))?;
    let starts: Vec<_> = regs.iter().map(|r| r.stats()).collect();
    let pinned: Vec<bool> = keys.iter().map(|&k| regs[0].get(k).protection.pinned).collect();
    let requests = trace.requests();
    let arrivals = arrival_times(requests);

    // Homes per adapter from its share of the trace's requests, as a router would from its counters.
    let mut counts = vec![0u64; trace.names().len()];
    for a in requests.iter().filter_map(|r| r.adapter) {
        counts[a as usize] += 1;
    }
    let total = requests.len().max(1) as f64;
    let homes: Vec<usize> =
        counts.iter().map(|&c| replication_factor(c as f64 / total, replicas)).collect::<Result<_>>()?;
    let names: Vec<String> = (0..replicas).map(|i| format!("replica-{i}")).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let free_slots = config.slots.saturating_sub(config.pins.len());

    let mut queues: Vec<Vec<u32>> = vec![Vec::new(); replicas];
    let mut reports = vec![ReplicaReport::default(); replicas];
    let mut demands: Vec<Demand> = (0..replicas).map(|_| Demand::new()).collect();
    let mut queue_sums = vec![0u64; replicas];
    let mut busy = vec![0u64; replicas];
    let mut inputs = StepInputs::default();
    // Not the trace's own stream: the same seed there picks the adapters.
    let mut rng = SplitMix::new(seed ^ 0xBB67_AE85_84CA_A73B);
    let mut stats: Vec<ReplicaStats> = names
        .iter()
        .map(|n| ReplicaStats {
            name: n.clone(),
            holding: Holding::Absent,
            free_slots,
            queue: 0,
            queue_bound,
        })
        .collect();
    let mut batch: Vec<u32> = Vec::new();
    let (mut next, mut clock, mut steps) = (0usize, 0.0f64, 0u64);
    while next < requests.len() || queues.iter().any(|q| !q.is_empty()) {
        if queues.iter().all(Vec::is_empty) {
            clock = clock.max(arrivals[next]);
        }
        while next < requests.len() && arrivals[next] <= clock {
            let r = &requests[next];
            let adapter = r.adapter.map(|a| a as usize).filter(|&a| !pinned[a]);
            let to = match router {
                Router::Random => rng.below(replicas),
                Router::LeastLoaded => least_loaded(&queues, 0..replicas, &mut rng),
                Router::Hash => match adapter {
                    Some(a) => {
                        let homes = home_replicas(&trace.names()[a], &name_refs, homes[a]);
                        least_loaded(&queues, homes.into_iter(), &mut rng)
                    }
                    None => least_loaded(&queues, 0..replicas, &mut rng),
                },
                Router::Affinity => {
                    let adapter = r.adapter.map(|a| a as usize);
                    for (i, s) in stats.iter_mut().enumerate() {
                        s.queue = queues[i].len();
                        s.holding = adapter.map_or(Holding::Absent, |a| {
                            let res = &regs[i].get(keys[a]).tenancy;
                            let queued =
                                || queues[i].iter().any(|&q| requests[q as usize].adapter == Some(a as u32));
                            if res.slot.is_some() {
                                Holding::Device
                            } else if res.fetching || queued() {
                                Holding::Fetching
                            } else if res.host_since.is_some() {
                                Holding::Host
                            } else {
                                Holding::Absent
                            }
                        });
                    }
                    let request = RouteRequest {
                        adapter: adapter.map(|a| trace.names()[a].as_str()),
                        pinned: adapter.is_some_and(|a| pinned[a]),
                        homes: adapter.map_or(1, |a| homes[a]),
                    };
                    rank_replicas(&request, &stats)?[0]
                }
            };
            queues[to].push(next as u32);
            reports[to].routed += 1;
            next += 1;
        }
        for i in 0..replicas {
            queue_sums[i] += queues[i].len() as u64;
            reports[i].queue_max = reports[i].queue_max.max(queues[i].len() as u64);
            if queues[i].is_empty() {
                continue;
            }
            batch.clear();
            batch.extend(queues[i].iter().take(config.batch_size));
            let plan = inputs.serve(&mut regs[i], trace, &keys, &batch, false)?;
            if plan.admitted.is_empty() {
                return Err(Error::Usage(format!(
                    "replica {i}: a step admitted none of its {} request(s); the simulation cannot progress",
                    batch.len()
                )));
            }
            busy[i] += 1;
            count_bytes(&mut reports[i].sim, &plan, &sizes);
            count_step(&mut reports[i].sim, &mut demands[i], requests, &batch, &plan, None);
            let mut admitted = plan.admitted.iter().map(|&p| p as usize).peekable();
            let mut pos = 0usize;
            queues[i].retain(|_| {
                let keep = admitted.next_if(|&a| a == pos).is_none();
                pos += 1;
                keep
            });
        }
        steps += 1;
        clock += config.step_seconds;
    }

    for (i, reg) in regs.iter().enumerate() {
        let end = reg.stats();
        let rep = &mut reports[i];
        rep.sim.requests = rep.routed;
        let device_bound = min_misses(&demands[i], config.slots, |a| pinned[a as usize], &[])?;
        rep.sim.device =
            tier_report(&end.device, &starts[i].device, rep.sim.device.bytes_moved, Some(device_bound));
        rep.sim.host = tier_report(&end.host, &starts[i].host, rep.sim.host.bytes_moved, None);
        rep.queue_mean = if steps == 0 { 0.0 } else { queue_sums[i] as f64 / steps as f64 };
        rep.utilisation = if steps == 0 { 0.0 } else { busy[i] as f64 / steps as f64 };
    }
    Ok(ClusterReport { replicas: reports, steps })
}

/// The replica among `candidates` with the shortest queue; ties broken uniformly at random.
fn least_loaded(
    queues: &[Vec<u32>],
    candidates: impl Iterator<Item = usize> + Clone,
    rng: &mut SplitMix,
) -> usize {
    let shortest = candidates.clone().map(|i| queues[i].len()).min().unwrap_or(0);
    let mut tied = candidates.filter(|&i| queues[i].len() == shortest);
    let count = tied.clone().count();
    tied.nth(rng.below(count.max(1))).unwrap_or(0)
}

#[cfg(test)]
#[path = "replicas_tests.rs"]
mod tests;
