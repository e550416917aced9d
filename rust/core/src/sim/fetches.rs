//! Background reads in the replay (`SimConfig::load_ms` > 0): the steps run in fetch mode, a fetch
//! started at step time `t` completes at `t + load_ms` on the step clock (reported done at the first
//! step at or after it), and each request that waited for a fetch has its extra wait recorded.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::policy::AdapterKey;
use crate::registry::{Registry, StepPlan};
use crate::sim::trace::Request;

/// Slack for comparing step-clock times built by adding step times: a fetch due at the same moment
/// as a step is done by that step.
const CLOCK_SLACK: f64 = 1e-9;

/// Requests deferred because their adapter was not in the host tier, and how long they waited.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FetchReport {
    /// Fetches started.
    pub fetches: u64,
    /// Requests deferred at least once waiting for their adapter's fetch.
    pub deferred_requests: u64,
    /// Their extra wait in steps (from the first step that deferred them for a fetch to the step
    /// that admitted them): mean.
    pub wait_steps_mean: f64,
    /// The same, 99th percentile (nearest rank).
    pub wait_steps_p99: f64,
    /// Their extra wait in milliseconds of the step clock: mean.
    pub wait_ms_mean: f64,
    /// The same, 99th percentile (nearest rank).
    pub wait_ms_p99: f64,
}

/// The fetches in flight and the waits recorded so far.
pub(super) struct Fetches {
    load_seconds: f64,
    /// In flight, in start order (all take the same time, so also in completion order).
    pending: VecDeque<(f64, Arc<str>, u64)>,
    /// Per trace request: the step clock and step count when a fetch first deferred it.
    since: Vec<Option<(f64, u64)>>,
    /// Per request that waited: (steps, milliseconds).
    waits: Vec<(u64, f64)>,
    started: u64,
}

impl Fetches {
    pub(super) fn new(load_ms: f64, requests: usize) -> Self {
        Self {
            load_seconds: load_ms / 1000.0,
            pending: VecDeque::new(),
            since: vec![None; requests],
            waits: Vec::new(),
            started: 0,
        }
    }

    /// Reports done every fetch due by `clock`. One whose adapter cannot enter the host tier yet
    /// (every place it could take is one the waiting requests need) stays pending and is reported
    /// again at the next step, as a server's loader keeps its bytes until then.
    ///
    /// Errors: the registry's others (none expected: the replay never cancels a fetch).
    pub(super) fn complete(&mut self, reg: &mut Registry, clock: f64) -> Result<()> {
        let due = self.pending.iter().take_while(|p| p.0 <= clock + CLOCK_SLACK).count();
        let mut kept = VecDeque::new();
        for (due, name, serial) in self.pending.drain(..due) {
            match reg.fetch_done(&name, serial) {
                Ok(_) => {}
                Err(Error::Capacity(_)) => kept.push_back((due, name, serial)),
                Err(e) => return Err(e),
            }
        }
        kept.append(&mut self.pending);
        self.pending = kept;
        Ok(())
    }

    /// When the next fetch in flight is due, if any.
    pub(super) fn next_due(&self) -> Option<f64> {
        self.pending.front().map(|p| p.0)
    }

    /// Records a step's fetches (begun at `clock`) and its requests' waits: a deferred request
    /// whose adapter is outside the host tier starts waiting (if it was not already); an admitted
    /// one that waited stops. `steps` is the number of steps counted before this one.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record(
        &mut self,
        reg: &Registry,
        keys: &[AdapterKey],
        requests: &[Request],
        batch: &[u32],
        plan: &StepPlan,
        clock: f64,
        steps: u64,
    ) {
        for f in &plan.to_fetch {
            self.pending.push_back((clock + self.load_seconds, Arc::clone(&f.name), f.serial));
            self.started += 1;
        }
        for &d in &plan.deferred {
            let i = batch[d as usize] as usize;
            let Some(a) = requests[i].adapter else { continue };
            if self.since[i].is_none() && reg.get(keys[a as usize]).tenancy.host_since.is_none() {
                self.since[i] = Some((clock, steps));
            }
        }
        for &a in &plan.admitted {
            let i = batch[a as usize] as usize;
            if let Some((t0, s0)) = self.since[i].take() {
                self.waits.push((steps - s0, (clock - t0) * 1000.0));
            }
        }
    }

    /// The report, once every request has been served.
    pub(super) fn report(&self) -> FetchReport {
        let steps: Vec<f64> = self.waits.iter().map(|w| w.0 as f64).collect();
        let ms: Vec<f64> = self.waits.iter().map(|w| w.1).collect();
        FetchReport {
            fetches: self.started,
            deferred_requests: self.waits.len() as u64,
            wait_steps_mean: mean(&steps),
            wait_steps_p99: p99(steps),
            wait_ms_mean: mean(&ms),
            wait_ms_p99: p99(ms),
        }
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// The nearest-rank 99th percentile, 0 for no values.
fn p99(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = (values.len() * 99).div_ceil(100);
    values[rank.max(1) - 1]
}

#[cfg(test)]
#[path = "fetches_tests.rs"]
mod tests;
