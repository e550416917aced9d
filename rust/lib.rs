//! lora_pin's core: adapter specs, the registry, the two-tier cache with its eviction policies, and
//! per-step batch planning. Plain Rust with no Python in it; the PyO3 bindings live in `py/` behind
//! the `python` feature.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cache;
pub mod error;
pub mod hash;
pub mod patterns;
pub mod plan;
pub mod policy;
pub mod registry;
pub mod sgmv;
pub mod shared;
pub mod sim;
pub mod spec;

#[cfg(feature = "python")]
mod py;

pub use cache::{Eviction, Tier, TierCounters};
pub use error::{Error, Result};
pub use plan::{Load, StepPlan};
pub use policy::{AdapterKey, EvictionPolicy, Usage};
pub use registry::{AdapterSize, Config, LoadSource, Registry, Stats, TierStats, Unload};
pub use shared::SharedRegistry;
pub use spec::{Limits, LoRARef, SpecItem};
