//! The replica routing rule (`lora_pin_core::routing`) for Python: `lora_pin.routing` wraps these in typed
//! dataclasses. Every decision is the core's.

use pyo3::prelude::*;

use super::errors::{new_error, py_err};
use super::shielded;
use lora_pin_core::routing::{self, Holding, ReplicaStats, RouteRequest};

fn count(py: Python<'_>, what: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| new_error(py, "SpecError", format!("{what} must be at least 0 (got {v})")))
}

/// Ranks replicas for one request, best first: the indices into `replicas`, each once.
///
/// `replicas` holds one `(name, holding, free_slots, queue, queue_bound)` tuple per replica, where
/// `holding` (`device`, `host`, `fetching` or `absent`) says where that replica holds `adapter`.
/// `adapter` None is the base model; it and a `pinned` adapter are routed by load alone. Otherwise:
/// device, then host or fetching, then the adapter's `homes` home replicas (rendezvous hashing) with
/// a free slot, then the rest; least loaded first within each; a replica whose queue has reached its
/// bound goes behind all replicas under theirs.
///
/// Raises:
///     SpecError: no replicas, a name given twice, an unknown holding, a queue bound of 0, a negative
///         count (each naming the replica), or `homes` of 0.
#[pyfunction]
#[pyo3(signature = (adapter, replicas, *, pinned = false, homes = 1))]
pub fn rank_replicas(
    py: Python<'_>,
    adapter: Option<&str>,
    replicas: Vec<(String, String, i64, i64, i64)>,
    pinned: bool,
    homes: i64,
) -> PyResult<Vec<usize>> {
    shielded(py, || {
        let stats = replicas
            .into_iter()
            .map(|(name, holding, free_slots, queue, queue_bound)| {
                let field = |what: &str, v: i64| count(py, &format!("replica {name:?}: {what}"), v);
                Ok(ReplicaStats {
                    holding: Holding::parse(&holding)
                        .map_err(|e| new_error(py, "SpecError", format!("replica {name:?}: {e}")))?,
                    free_slots: field("free_slots", free_slots)?,
                    queue: field("queue", queue)?,
                    queue_bound: field("queue_bound", queue_bound)?,
                    name,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let request = RouteRequest { adapter, pinned, homes: count(py, "homes", homes)? };
        routing::rank_replicas(&request, &stats).map_err(py_err)
    })
}

/// The home replicas of an adapter taking `share` (0..=1) of the traffic among `replicas`
/// replicas: `ceil(share * replicas)`, clamped to 1..=replicas.
///
/// Raises:
///     SpecError: `share` outside 0..=1 or `replicas` below 1.
#[pyfunction]
pub fn replication_factor(py: Python<'_>, share: f64, replicas: i64) -> PyResult<usize> {
    routing::replication_factor(share, count(py, "replicas", replicas)?).map_err(py_err)
}

/// The indices into `replicas` (names) of `adapter`'s `homes` home replicas by rendezvous hashing,
/// best first (all of them when `homes` is at least their number).
///
/// Raises:
///     SpecError: a negative `homes`.
#[pyfunction]
pub fn home_replicas(
    py: Python<'_>,
    adapter: &str,
    replicas: Vec<String>,
    homes: i64,
) -> PyResult<Vec<usize>> {
    let names: Vec<&str> = replicas.iter().map(String::as_str).collect();
    Ok(routing::home_replicas(adapter, &names, count(py, "homes", homes)?))
}
