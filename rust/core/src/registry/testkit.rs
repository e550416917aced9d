//! Helpers shared by the registry's tests.

use crate::policy::PolicyKind;
use crate::registry::tiers::Tier;
use crate::registry::{AdapterSize, Config, Registry, StepPlan, StepRequest, StepStart, StepTicket};
use crate::spec::LoRARef;

pub(super) fn size(rank: u32, bytes: u64) -> AdapterSize {
    AdapterSize { rank, host_bytes: bytes, device_bytes: bytes, scaling: 0.5 }
}

pub(super) fn lora(name: &str) -> LoRARef {
    LoRARef::with_deterministic_id(name, &format!("/srv/{name}"), false, None).unwrap()
}

pub(super) fn registry(slots: usize, max_loaded: Option<usize>, policy: &str, names: &[&str]) -> Registry {
    let mut config = Config::new(slots);
    config.max_loaded = max_loaded;
    config.device_policy = PolicyKind::parse("policy", policy).unwrap();
    config.host_policy = config.device_policy;
    let mut reg = Registry::new(config).unwrap();
    for (i, n) in names.iter().enumerate() {
        reg.register(lora(n), size(4 + i as u32, 100)).unwrap();
    }
    reg
}

pub(super) fn plan(reg: &mut Registry, names: &[Option<&str>]) -> StepPlan {
    let plan = reg.plan_names(names, &vec![1; names.len()]).unwrap();
    reg.audit().unwrap();
    plan
}

pub(super) fn finish_loads(reg: &mut Registry, p: &StepPlan) {
    for load in &p.loads {
        reg.load_done(&load.name).unwrap();
    }
}

/// Plans `names` and reports every load done.
pub(super) fn step(reg: &mut Registry, names: &[Option<&str>]) {
    let p = plan(reg, names);
    finish_loads(reg, &p);
}

/// Begins a step as `request` asks and checks the invariants: the plan and its ticket when a step
/// began, a whole batch's deferring plan and no ticket when it waits for fetches. Panics on the
/// other answers (a test that expects them matches [`Registry::begin_step`] itself).
pub(super) fn start(
    reg: &mut Registry,
    request: StepRequest<'_>,
) -> crate::Result<(StepPlan, Option<StepTicket>)> {
    let begun = match reg.begin_step(request)? {
        StepStart::Begun(plan, ticket) => (plan, Some(ticket)),
        StepStart::Fetching { plan, .. } => (plan, None),
        other => panic!("begin_step answered {other:?}"),
    };
    reg.audit().unwrap();
    Ok(begun)
}

pub(super) fn evicted(p: &StepPlan, tier: Tier) -> Vec<&str> {
    p.evictions.iter().filter(|e| e.tier == tier).map(|e| &*e.name).collect()
}
