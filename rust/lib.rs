//! lora_pin's core: adapter specs, the registry, the two-tier cache with its eviction policies, and
//! per-step batch planning. Plain Rust with no Python in it; the PyO3 bindings live in `py/` behind
//! the `python` feature.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod admission;
pub mod digests;
pub mod error;
pub mod hash;
pub mod header;
pub mod limits;
pub mod patterns;
pub mod policy;
pub mod registry;
pub mod routing;
pub mod sgmv;
pub mod shared;
pub mod sim;
pub mod spec;
pub mod textfile;
pub mod weights;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use policy::{AdapterKey, EvictionPolicy, PolicyKind, Usage};
pub use registry::tiers::{Eviction, Tier, TierCounters};
pub use registry::{
    AdapterSize, Config, Deferral, Fetch, FetchPlan, Hold, Load, LoadSource, Offer, Registry, Stats,
    StepMode, StepPlan, StepRequest, StepRequests, StepStart, StepTicket, TierStats, Unload, Wants,
};
pub use shared::SharedRegistry;
pub use spec::{Limits, LoRARef, SpecItem};
