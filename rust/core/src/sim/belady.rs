//! Belady's offline-optimal bound (MIN: on a miss with a full tier, evict the adapter whose next use
//! lies furthest in the future), at step granularity.
//!
//! The input is a demand sequence: per step, the distinct adapters that step uses. A step's adapters
//! must all be resident at once (a slot each), so none of them is ever a victim while the step is
//! served; pinned adapters take a place from their first use on and are never victims. A **use** is
//! one (step, adapter) pair, a **miss** a use whose adapter was not resident when the step began (a
//! load), a **hit** any other use. Loading only on demand loses nothing: any schedule that loads
//! early can load at the use instead, and MIN's furthest-next-use rule is optimal for set requests
//! by the same exchange argument as for single requests (checked against exhaustive search in the
//! tests).

use std::collections::BTreeSet;

use crate::error::{Error, Result};

/// Per step, the distinct adapters it uses (indices), stored flat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Demand {
    offsets: Vec<usize>,
    items: Vec<u32>,
}

impl Demand {
    /// No steps yet.
    pub fn new() -> Self {
        Self { offsets: vec![0], items: Vec::new() }
    }

    /// Appends a step using `adapters` (distinct).
    pub fn push_step(&mut self, adapters: impl IntoIterator<Item = u32>) {
        self.items.extend(adapters);
        self.offsets.push(self.items.len());
    }

    /// The number of steps.
    pub fn steps(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The number of uses (sum over steps of the adapters used).
    pub fn uses(&self) -> u64 {
        self.items.len() as u64
    }

    /// The adapters step `t` uses.
    pub fn step(&self, t: usize) -> &[u32] {
        &self.items[self.offsets[t]..self.offsets[t + 1]]
    }
}

/// The fewest misses any policy can have on `demand` with `capacity` places, where `pinned(a)` says
/// whether adapter `a` is pinned and `initial` lists the adapters resident before the first step.
///
/// Errors: [`Error::Usage`] when a step cannot fit: its adapters plus the pinned ones resident exceed
/// `capacity` (the planner's admission rule never lets that happen), or `initial` does not fit.
pub fn min_misses(
    demand: &Demand,
    capacity: usize,
    pinned: impl Fn(u32) -> bool,
    initial: &[u32],
) -> Result<u64> {
    const NEVER: u64 = u64::MAX;
    let adapters = demand.items.iter().chain(initial).map(|&a| a as usize + 1).max().unwrap_or(0);
    // next_use[p]: the step after the one at position p that uses the same adapter.
    let mut next_use = vec![NEVER; demand.items.len()];
    let mut next_seen = vec![NEVER; adapters];
    for t in (0..demand.steps()).rev() {
        let span = demand.offsets[t]..demand.offsets[t + 1];
        for (next, &a) in next_use[span.clone()].iter_mut().zip(&demand.items[span]) {
            *next = next_seen[a as usize];
            next_seen[a as usize] = t as u64;
        }
    }
    if initial.len() > capacity {
        return Err(Error::Usage(format!(
            "{} adapters are resident at the start but the tier holds {capacity}",
            initial.len()
        )));
    }
    let mut resident = vec![false; adapters];
    let mut key = vec![NEVER; adapters];
    let mut victims: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut count = 0usize;
    for &a in initial {
        if !std::mem::replace(&mut resident[a as usize], true) {
            count += 1;
            if !pinned(a) {
                key[a as usize] = next_seen[a as usize];
                victims.insert((key[a as usize], a));
            }
        }
    }
    let mut misses = 0u64;
    for t in 0..demand.steps() {
        let step = demand.step(t);
        for &a in step {
            if resident[a as usize] && !pinned(a) {
                victims.remove(&(key[a as usize], a));
            }
        }
        for &a in step {
            if resident[a as usize] {
                continue;
            }
            misses += 1;
            if count == capacity {
                let Some((_, victim)) = victims.pop_last() else {
                    return Err(Error::Usage(format!(
                        "step {t} uses {} adapter(s) but only {capacity} places exist beside the pinned ones",
                        step.len()
                    )));
                };
                resident[victim as usize] = false;
                count -= 1;
            }
            resident[a as usize] = true;
            count += 1;
        }
        for (p, &a) in (demand.offsets[t]..).zip(step) {
            if !pinned(a) {
                key[a as usize] = next_use[p];
                victims.insert((next_use[p], a));
            }
        }
    }
    Ok(misses)
}

/// A lower bound on the misses of any policy on `demand` with a pool of `pages` pages, where adapter
/// `a` takes `pages_of(a)` pages (at least 1) and `pinned(a)` says whether it is pinned.
///
/// The fewest misses with adapters of mixed sizes is NP-hard to find (general caching), but at no
/// moment can the pool hold more adapters than `pages` over the smallest adapter's pages, so every
/// paged schedule is also a schedule of that many equal places, and MIN over them ([`min_misses`])
/// misses no more than it. Exact when every adapter takes the same pages. Only adapters the demand
/// uses count, as only they are ever resident in a schedule that loads on demand.
///
/// Errors: as [`min_misses`], when a step's adapters cannot fit in those places.
pub fn min_misses_paged(
    demand: &Demand,
    pages: usize,
    pages_of: impl Fn(u32) -> usize,
    pinned: impl Fn(u32) -> bool,
) -> Result<u64> {
    let smallest = demand.items.iter().map(|&a| pages_of(a).max(1)).min().unwrap_or(1);
    min_misses(demand, pages / smallest, pinned, &[])
}

#[cfg(test)]
#[path = "belady_tests.rs"]
mod tests;
