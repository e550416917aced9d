//! Capacity planning: replay a request trace through the registry's planner and compare every
//! policy with Belady's offline-optimal bound. One engine: the simulator drives the same
//! [`crate::Registry`] the live manager drives, call for call.

pub mod belady;
mod fetches;
pub mod replay;
pub mod replicas;
pub mod trace;

pub use belady::{min_misses, min_misses_paged, Demand};
pub use fetches::FetchReport;
pub use replay::{
    adapter_sizes, sim_ref, simulate, simulate_until, simulate_with, SimConfig, SimReport, TierReport,
};
pub use replicas::{simulate_replicas, ClusterReport, ReplicaReport, Router};
pub use trace::{Request, Trace, Workload, MAX_ARRIVAL_CV, MIN_ARRIVAL_CV};

#[cfg(test)]
#[path = "sim_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "sizes_tests.rs"]
mod sizes_tests;

#[cfg(test)]
#[path = "pages_sim_tests.rs"]
mod pages_sim_tests;
