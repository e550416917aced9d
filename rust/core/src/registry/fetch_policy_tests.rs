//! The fetch policy against a plain model of an engine's queue: requests arrive, wait, run for a
//! few steps and leave; every step offers the running requests first, then the waiting ones in
//! arrival order, in fetch mode; reads finish at random steps. Checked: no fetch evicts an adapter
//! a request waits for (or runs with) while one no request names is evictable, and only for an
//! overdue adapter; no pinned adapter is ever evicted; a plan starts no more fetches than one
//! step can use; every request is admitted once arrivals stop.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use crate::error::Error;
use crate::limits::OVERDUE_AFTER;
use crate::registry::testkit::*;
use crate::registry::{Deferral, Registry, StepMode, StepRequest};

/// A request in the model: its adapter and the steps it still runs once admitted.
#[derive(Debug, Clone)]
struct Request {
    adapter: usize,
    left: u32,
}

/// The model's own view of the host tier between steps: which adapters the last plan named (and
/// where first), which are fresh (fetched, waiting for a plan to admit them), which are pinned.
#[derive(Default)]
struct Model {
    named: BTreeMap<usize, u32>,
    fresh: BTreeSet<usize>,
    pinned: BTreeSet<usize>,
}

struct World {
    reg: Registry,
    names: Vec<String>,
    model: Model,
    running: Vec<Request>,
    waiting: Vec<Request>,
    /// Fetches started and not reported: (adapter, serial).
    reads: Vec<(usize, u64)>,
    served: usize,
}

impl World {
    fn new(slots: usize, host: usize, adapters: usize, pins: usize) -> Self {
        let names: Vec<String> = (0..adapters).map(|i| format!("n{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut reg = registry(slots, Some(host), "lru", &refs);
        let mut model = Model::default();
        for (i, name) in names.iter().enumerate().take(pins) {
            reg.pin(name).unwrap();
            model.pinned.insert(i);
        }
        Self { reg, names, model, running: Vec::new(), waiting: Vec::new(), reads: Vec::new(), served: 0 }
    }

    fn index(&self, name: &str) -> usize {
        self.names.iter().position(|n| n == name).unwrap()
    }

    fn resident(&self) -> BTreeSet<usize> {
        self.reg.stats().host.resident.iter().map(|n| self.index(n)).collect()
    }

    fn overdue(&self, adapter: usize) -> bool {
        let key = self.reg.lookup(&self.names[adapter], false).unwrap();
        self.reg.get(key).tenancy.deferred_plans >= OVERDUE_AFTER
    }

    /// Reports the reads `finish` says are done (every one when `finish` is None), checking each
    /// one's evictions against the model.
    fn install(&mut self, finish: Option<&[bool]>) -> std::result::Result<(), TestCaseError> {
        let mut open = Vec::new();
        for (at, (adapter, serial)) in std::mem::take(&mut self.reads).into_iter().enumerate() {
            if finish.is_some_and(|f| !f.get(at).copied().unwrap_or(true)) {
                open.push((adapter, serial));
                continue;
            }
            let resident = self.resident();
            // Evictable by any fetch: resident, unpinned, not fresh, and named by no request.
            let unneeded: BTreeSet<usize> = resident
                .iter()
                .copied()
                .filter(|a| {
                    !self.model.pinned.contains(a)
                        && !self.model.fresh.contains(a)
                        && !self.model.named.contains_key(a)
                })
                .collect();
            let overdue = self.overdue(adapter);
            match self.reg.fetch_done(&self.names[adapter], serial) {
                Ok(evicted) => {
                    let evicted: Vec<usize> = evicted.iter().map(|n| self.index(n)).collect();
                    for victim in &evicted {
                        prop_assert!(
                            !self.model.pinned.contains(victim),
                            "a fetch evicted pinned n{}",
                            victim
                        );
                        prop_assert!(!self.model.fresh.contains(victim), "a fetch evicted fresh n{}", victim);
                        if let Some(&at) = self.model.named.get(victim) {
                            prop_assert!(
                                unneeded.iter().all(|u| evicted.contains(u)),
                                "n{adapter}'s fetch evicted n{victim}, which a request needs, while \
                                 an adapter no request needs was evictable"
                            );
                            let own = self.model.named.get(&adapter).copied();
                            prop_assert!(
                                overdue && own.is_some_and(|own| own < at),
                                "n{adapter}'s fetch (overdue: {overdue}, first request {own:?}) evicted \
                                 n{victim}, needed by request {at}"
                            );
                        }
                    }
                    self.model.fresh.insert(adapter);
                }
                // No room yet (its place is needed): the caller keeps the bytes and reports again.
                Err(Error::Capacity(_)) => open.push((adapter, serial)),
                Err(e) => return Err(TestCaseError::fail(format!("fetch_done: {e}"))),
            }
        }
        self.reads = open;
        self.reg.audit().map_err(TestCaseError::fail)?;
        Ok(())
    }

    /// One step: the running requests, then the waiting ones, offered in fetch mode; every
    /// admitted request runs.
    fn step(&mut self) -> std::result::Result<(), TestCaseError> {
        let offered: Vec<Request> = self.running.iter().chain(&self.waiting).cloned().collect();
        let names: Vec<Option<&str>> = offered.iter().map(|r| Some(self.names[r.adapter].as_str())).collect();
        let keys: Vec<_> = names.iter().map(|n| n.map(|n| self.reg.lookup(n, false).unwrap())).collect();
        let overdue_before: BTreeSet<usize> =
            offered.iter().map(|r| r.adapter).filter(|&a| self.overdue(a)).collect();
        let resident_before = self.resident();
        let tokens = vec![1; keys.len()];
        let request = StepRequest::new(&keys, &tokens, StepMode::Fetch);
        let (plan, ticket) = self.reg.begin_step(request).unwrap().begun().unwrap();
        for i in 0..plan.loads.len() {
            self.reg.report_load(ticket, i, true).unwrap();
        }
        self.reg.finish_step(ticket).unwrap();
        self.reg.audit().map_err(TestCaseError::fail)?;
        for eviction in &plan.evictions {
            let victim = self.index(&eviction.name);
            prop_assert!(!self.model.pinned.contains(&victim), "a plan evicted pinned n{}", victim);
        }
        prop_assert!(self
            .model
            .pinned
            .iter()
            .all(|p| !resident_before.contains(p) || self.resident().contains(p)));
        // The fetch budget: one step admits at most `limit` unpinned adapters, so no plan starts
        // reads of more (overdue and pinned adapters aside, which go whatever the budget).
        let limit = self.reg.config.slots - self.reg.pinned;
        let started: Vec<usize> = plan.to_fetch.iter().map(|f| self.index(&f.name)).collect();
        let budgeted: Vec<usize> = started
            .iter()
            .copied()
            .filter(|a| !overdue_before.contains(a) && !self.model.pinned.contains(a))
            .collect();
        prop_assert!(
            budgeted.len() <= limit,
            "one plan started {} reads for {} slots",
            budgeted.len(),
            limit
        );
        if !budgeted.is_empty() {
            let fetching: BTreeSet<usize> =
                self.reg.stats().host.fetching.iter().map(|n| self.index(n)).collect();
            let waiting_in_host: BTreeSet<usize> = plan
                .deferred
                .iter()
                .zip(&plan.reasons)
                .filter(|(_, why)| matches!(why, Deferral::DeviceRoom | Deferral::Fairness))
                .map(|(&i, _)| offered[i as usize].adapter)
                .collect();
            let ready = fetching
                .union(&waiting_in_host)
                .filter(|a| !self.model.pinned.contains(a) && !overdue_before.contains(a))
                .count();
            prop_assert!(ready <= limit, "{ready} adapters ready or read for a step of {limit}");
        }
        let reads: Vec<(usize, u64)> =
            plan.to_fetch.iter().map(|f| (self.index(&f.name), f.serial)).collect();
        self.reads.extend(reads);
        // The model's own bookkeeping of what the plan named and what stays fresh.
        let admitted: BTreeSet<u32> = plan.admitted.iter().copied().collect();
        let mut named = BTreeMap::new();
        for (i, r) in offered.iter().enumerate() {
            named.entry(r.adapter).or_insert(i as u32);
        }
        let admitted_adapters: BTreeSet<usize> =
            admitted.iter().map(|&i| offered[i as usize].adapter).collect();
        self.model.fresh.retain(|a| named.contains_key(a) && !admitted_adapters.contains(a));
        self.model.named = named;
        let running = self.running.len();
        let mut still_running = Vec::new();
        let mut still_waiting = Vec::new();
        for (i, mut r) in offered.into_iter().enumerate() {
            if admitted.contains(&(i as u32)) {
                r.left -= 1;
                if r.left == 0 {
                    self.served += 1;
                } else {
                    still_running.push(r);
                }
            } else if i < running {
                still_running.push(r);
            } else {
                still_waiting.push(r);
            }
        }
        self.running = still_running;
        self.waiting = still_waiting;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn fetches_keep_needed_adapters_stay_in_budget_and_serve_every_request(
        slots in 2usize..5,
        host_extra in 0usize..5,
        adapters in 3usize..12,
        pins in 0usize..2,
        steps in prop::collection::vec(
            (prop::collection::vec((0usize..64, 1u32..4), 0..4), prop::collection::vec(any::<bool>(), 0..8)),
            1..30,
        ),
    ) {
        let pins = pins.min(slots - 1);
        let host = slots + host_extra;
        let mut world = World::new(slots, host, adapters.max(slots + 1), pins);
        let count = world.names.len();
        let mut arrived = 0;
        for (arrivals, finish) in &steps {
            world.install(Some(finish))?;
            for &(a, left) in arrivals {
                world.waiting.push(Request { adapter: a % count, left });
                arrived += 1;
            }
            world.step()?;
        }
        // Arrivals stop: every request is served within a bound (reads finish by the next step).
        let bound = 4 * (arrived + 2) * (OVERDUE_AFTER as usize + 4);
        let mut extra = 0;
        while world.served < arrived {
            world.install(None)?;
            world.step()?;
            extra += 1;
            prop_assert!(extra <= bound, "{} of {} requests served after {} more steps", world.served, arrived, extra);
        }
    }
}
