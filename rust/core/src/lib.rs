//! lora_pin's core: everything that decides. Adapter specs, the registry, the two-tier cache with
//! its eviction policies, per-step batch planning, replica routing and the simulator. Plain Rust with
//! no Python in it and no bytes of tensors: the kernels and the tensor reader are `lora_pin_kernels`
//! (which depends on this crate, never the reverse), the PyO3 bindings `lora_pin_py`.

pub mod admission;
pub mod error;
pub mod hash;
pub mod header;
pub mod limits;
pub mod patterns;
pub mod policy;
pub mod registry;
pub mod routing;
pub mod shared;
pub mod sim;
pub mod spec;
pub mod textfile;

pub use error::{Error, Result};
pub use policy::{AdapterKey, EvictionPolicy, PolicyKind, Usage};
pub use registry::tiers::{Eviction, Tier, TierCounters};
pub use registry::{
    AdapterSize, AdmissionOrder, Config, Deferral, Fetch, FetchPlan, Hold, Load, LoadSource, Offer, Registry,
    Stats, StepMode, StepPlan, StepRequest, StepRequests, StepStart, StepTicket, TierStats, Unload, Wants,
};
pub use shared::SharedRegistry;
pub use spec::{Limits, LoRARef, SpecItem};
