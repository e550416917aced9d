//! The replica routing rule: which of N replicas of the same base model should serve a request for an
//! adapter. One pure function, so the simulator and a live request router rank replicas the same way.
//!
//! A request for a pinned adapter, or for the base model, goes to the least loaded replica: pinned
//! adapters sit on every replica, so where they are says nothing. Any other request prefers, in
//! order:
//!
//! 1. a replica holding the adapter in a device slot (no load at all);
//! 2. one holding it in host memory or fetching it (a copy into a slot, no read from disk);
//! 3. one of the adapter's *home* replicas (rendezvous hashing of adapter and replica names) with a
//!    free slot, so that the replicas that will load it agree without talking to each other;
//! 4. any other replica, least loaded first.
//!
//! Within a class the least loaded replica comes first (shortest queue, then most free slots, then
//! the adapter's rendezvous order: its homes first, then the replica that would be its next home).
//! Breaking ties by the adapter's own order rather than by position spreads them: with every queue
//! equal, the first replica in the list would otherwise take every tie, and its queue alone would
//! grow. A replica whose queue has reached its bound is moved behind every replica still under its
//! bound, so a hot adapter's requests spill to the next choice rather than wait behind one replica.
//!
//! Rendezvous hashing (Thaler and Ravishankar 1998) gives each (adapter, replica) pair a weight; the
//! adapter's homes are the replicas with the highest weights. Adding a replica makes it a home only
//! for the adapters where its weight beats the current lowest home: about `homes / (N + 1)` of them,
//! and no other adapter's homes change.

use crate::error::{Error, Result};

/// Where a replica holds the adapter a request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holding {
    /// In a device slot: served without a load.
    Device,
    /// In host memory: one copy into a slot.
    Host,
    /// Being read from disk into host memory; will be in host memory soon.
    Fetching,
    /// Not on the replica: a read from disk and a copy.
    Absent,
}

impl Holding {
    /// Parses `device`, `host`, `fetching` or `absent`.
    ///
    /// Errors: [`Error::Spec`] naming the value and the choices.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "device" => Ok(Self::Device),
            "host" => Ok(Self::Host),
            "fetching" => Ok(Self::Fetching),
            "absent" => Ok(Self::Absent),
            other => Err(Error::Spec(format!(
                "holding {other:?} is not a holding; choose device, host, fetching or absent"
            ))),
        }
    }
}

/// One replica's state as the router sees it, for the adapter of the request being routed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStats {
    /// The replica's name; its identity in rendezvous hashing (unique among the replicas).
    pub name: String,
    /// Where the replica holds the request's adapter (ignored for the base model and pinned adapters).
    pub holding: Holding,
    /// Device slots that are free or hold an adapter no running request uses.
    pub free_slots: usize,
    /// Requests waiting or running on the replica.
    pub queue: usize,
    /// The queue length at which the replica counts as full and requests spill elsewhere (>= 1).
    pub queue_bound: usize,
}

/// The request being routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteRequest<'a> {
    /// The adapter's name; `None` is the base model.
    pub adapter: Option<&'a str>,
    /// The adapter is pinned (resident on every replica): routed by load alone.
    pub pinned: bool,
    /// How many home replicas the adapter has (see [`replication_factor`]), at least 1; more than the
    /// replicas means all of them.
    pub homes: usize,
}

/// The number of home replicas for an adapter that takes `share` (0..=1) of the requests among
/// `replicas` replicas: `ceil(share * replicas)`, at least 1 and at most `replicas`.
///
/// Why: with one home, an adapter with share `s` sends `s` of all traffic to one replica, which can
/// carry only about `1 / replicas` of it. `ceil(s * replicas)` homes give each home at most about
/// `1 / replicas` of the traffic from that adapter, so no replica is overloaded by one popular adapter
/// while a rare one (share below `1 / replicas`) keeps a single home and is loaded once.
///
/// Errors: [`Error::Spec`] when `share` is not a number in 0..=1 or `replicas` is 0.
pub fn replication_factor(share: f64, replicas: usize) -> Result<usize> {
    if !(0.0..=1.0).contains(&share) {
        return Err(Error::Spec(format!("share must be a number in 0..=1 (got {share})")));
    }
    if replicas == 0 {
        return Err(Error::Spec("replicas must be at least 1 (got 0)".into()));
    }
    let homes = (share * replicas as f64).ceil() as usize;
    Ok(homes.clamp(1, replicas))
}

/// 64-bit finaliser of SplitMix64: spreads a hash's bits so weights of neighbouring names differ.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of `s`: stable across releases and platforms, as rendezvous weights must be (a router and
/// a simulator on different machines must agree on every adapter's homes).
fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3))
}

/// The rendezvous weight of `replica` for `adapter`: the adapter's homes are its highest weights.
pub fn rendezvous_weight(adapter: &str, replica: &str) -> u64 {
    mix(mix(name_hash(adapter)) ^ name_hash(replica).rotate_left(17))
}

/// The indices into `replicas` of `adapter`'s `homes` home replicas, best first (all of them when
/// `homes >= replicas.len()`); ties in weight go to the earlier replica.
pub fn home_replicas(adapter: &str, replicas: &[&str], homes: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..replicas.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(rendezvous_weight(adapter, replicas[i])), i));
    order.truncate(homes);
    order
}

/// Ranks `replicas` for `request`, best first: every index into `replicas` once (see the module docs
/// for the rule). The router sends the request to the first; a caller that finds it unreachable
/// tries the next.
///
/// Errors: [`Error::Spec`] for an empty list, a replica name given twice, a queue bound of 0 (each
/// naming the replica), or `homes` of 0.
pub fn rank_replicas(request: &RouteRequest<'_>, replicas: &[ReplicaStats]) -> Result<Vec<usize>> {
    if replicas.is_empty() {
        return Err(Error::Spec("cannot route a request: no replicas".into()));
    }
    if request.homes == 0 {
        return Err(Error::Spec("homes must be at least 1 (got 0)".into()));
    }
    for (i, r) in replicas.iter().enumerate() {
        if r.queue_bound == 0 {
            return Err(Error::Spec(format!("replica {:?}: queue_bound must be at least 1 (got 0)", r.name)));
        }
        if let Some(j) = replicas[..i].iter().position(|o| o.name == r.name) {
            return Err(Error::Spec(format!("replica {:?} is named twice (#{j} and #{i})", r.name)));
        }
    }
    let affinity = request.adapter.filter(|_| !request.pinned);
    // Each replica's place in the adapter's rendezvous order (its homes are the first `homes`); the
    // base model and pinned adapters keep the replicas' own order.
    let mut rendezvous: Vec<usize> = (0..replicas.len()).collect();
    if let Some(adapter) = affinity {
        let names: Vec<&str> = replicas.iter().map(|r| r.name.as_str()).collect();
        for (rank, i) in home_replicas(adapter, &names, replicas.len()).into_iter().enumerate() {
            rendezvous[i] = rank;
        }
    }
    let class = |i: usize| -> u8 {
        let r = &replicas[i];
        if affinity.is_none() {
            return 0;
        }
        match r.holding {
            Holding::Device => 0,
            Holding::Host | Holding::Fetching => 1,
            Holding::Absent if rendezvous[i] < request.homes && r.free_slots > 0 => 2,
            Holding::Absent => 3,
        }
    };
    let mut order: Vec<usize> = (0..replicas.len()).collect();
    order.sort_by_key(|&i| {
        let r = &replicas[i];
        let full = r.queue >= r.queue_bound;
        (full, class(i), r.queue, std::cmp::Reverse(r.free_slots), rendezvous[i])
    });
    Ok(order)
}

#[cfg(test)]
#[path = "routing_tests.rs"]
mod tests;
