use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use crate::cache::Tier;
use crate::error::Error;
use crate::registry::{AdapterSize, Config, LoadSource, Registry, Unload};
use crate::shared::SharedRegistry;
use crate::spec::LoRARef;

fn size(rank: u32, bytes: u64) -> AdapterSize {
    AdapterSize { rank, host_bytes: bytes, device_bytes: bytes, scaling: 0.5 }
}

fn lora(name: &str) -> LoRARef {
    LoRARef::with_deterministic_id(name, &format!("/srv/{name}"), false, None).unwrap()
}

fn registry(slots: usize, max_loaded: Option<usize>, policy: &str, names: &[&str]) -> Registry {
    let mut config = Config::new(slots);
    config.max_loaded = max_loaded;
    config.device_policy = policy.into();
    config.host_policy = policy.into();
    let mut reg = Registry::new(config).unwrap();
    for (i, n) in names.iter().enumerate() {
        reg.register(lora(n), size(4 + i as u32, 100)).unwrap();
    }
    reg
}

fn plan(reg: &mut Registry, names: &[Option<&str>]) -> crate::plan::StepPlan {
    let plan = reg.plan_names(names, &vec![1; names.len()]).unwrap();
    reg.audit().unwrap();
    plan
}

fn finish_loads(reg: &mut Registry, p: &crate::plan::StepPlan) {
    for load in &p.loads {
        reg.load_done(&load.name).unwrap();
    }
}

/// Plans `names` and reports every load done.
fn step(reg: &mut Registry, names: &[Option<&str>]) {
    let p = plan(reg, names);
    finish_loads(reg, &p);
}

fn evicted(p: &crate::plan::StepPlan, tier: Tier) -> Vec<&str> {
    p.evictions.iter().filter(|e| e.tier == tier).map(|e| &*e.name).collect()
}

#[test]
fn segments_group_tokens_by_slot_and_skip_base_rows() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    let p = reg.plan_names(&[Some("a"), None, Some("b"), Some("a")], &[2, 1, 3, 1]).unwrap();
    assert_eq!(p.admitted, [0, 1, 2, 3]);
    assert!(p.deferred.is_empty());
    assert_eq!(p.request_slots, [0, -1, 1, 0]);
    assert_eq!(p.token_slots, [0, 0, -1, 1, 1, 1, 0]);
    assert_eq!(p.token_perm, [0, 1, 6, 3, 4, 5]);
    assert_eq!(p.seg_indptr, [0, 3, 6]);
    assert_eq!(p.seg_slots, [0, 1]);
    assert_eq!(p.slot_ranks, [4, 5]);
    assert_eq!(p.slot_scalings, [0.5, 0.5]);
    assert_eq!(p.slot_generations, [1, 1]);
    let loads: Vec<_> = p.loads.iter().map(|l| (&*l.name, l.slot, l.source)).collect();
    assert_eq!(loads, [("a", 0, LoadSource::Host), ("b", 1, LoadSource::Host)]);
    assert_eq!(&*p.loads[0].lora_id, &*lora("a").lora_id);
}

#[test]
fn segments_are_cut_into_chunks() {
    let mut config = Config::new(2);
    config.chunk_size = Some(2);
    let mut reg = Registry::new(config).unwrap();
    reg.register(lora("a"), size(8, 1)).unwrap();
    reg.register(lora("b"), size(8, 1)).unwrap();
    let p = reg.plan_names(&[Some("a"), None, Some("b"), Some("a")], &[2, 1, 3, 1]).unwrap();
    assert_eq!(p.seg_indptr, [0, 2, 3, 5, 6]);
    assert_eq!(p.seg_slots, [0, 0, 1, 1]);
}

#[test]
fn base_rows_take_no_slot() {
    // SGLang crashed on N adapters + 1 base request: here the base row needs nothing.
    let mut reg = registry(1, None, "lru", &["a"]);
    let p = plan(&mut reg, &[None, Some("a"), None]);
    assert_eq!(p.admitted, [0, 1, 2]);
    assert_eq!(p.request_slots, [-1, 0, -1]);
}

#[test]
fn admission_defers_beyond_the_slots_and_never_evicts_the_step() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    let p = plan(&mut reg, &[Some("a"), Some("b"), Some("c"), Some("a"), Some("c")]);
    assert_eq!(p.admitted, [0, 1, 3]);
    assert_eq!(p.deferred, [2, 4]);
    assert!(p.evictions.is_empty());
    assert_eq!(reg.stats().device.counters.refusals, 1);
}

#[test]
fn a_deferred_resident_adapter_is_the_victim_not_an_admitted_one() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    step(&mut reg, &[Some("b"), Some("c")]);
    // a misses; b is admitted (a hit), c is over budget: c goes, b stays.
    let p = plan(&mut reg, &[Some("a"), Some("b"), Some("c")]);
    assert_eq!(p.deferred, [2]);
    assert_eq!(evicted(&p, Tier::Device), ["c"]);
    assert_eq!(p.loads.len(), 1);
}

#[test]
fn lru_and_fifo_pick_their_victims() {
    for (policy, victim) in [("lru", "b"), ("fifo", "a")] {
        let mut reg = registry(2, None, policy, &["a", "b", "c"]);
        for step in [&[Some("a")][..], &[Some("b")], &[Some("a")], &[Some("c")]] {
            let p = plan(&mut reg, step);
            finish_loads(&mut reg, &p);
            if step == [Some("c")] {
                assert_eq!(evicted(&p, Tier::Device), [victim], "{policy}");
            }
        }
    }
}

#[test]
fn queued_adapters_keep_their_slots_while_an_idle_one_can_go() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    step(&mut reg, &[Some("b")]);
    step(&mut reg, &[Some("a")]);
    reg.acquire(&[Some("b")]).unwrap();
    // b is least recently used but has a request in flight: a goes.
    let p = plan(&mut reg, &[Some("c")]);
    assert_eq!(evicted(&p, Tier::Device), ["a"]);
    finish_loads(&mut reg, &p);
    // Every resident adapter now has requests queued: the least recent still yields its slot.
    reg.acquire(&[Some("c")]).unwrap();
    let p = plan(&mut reg, &[Some("a")]);
    assert_eq!(evicted(&p, Tier::Device), ["b"]);
}

#[test]
fn pins_are_refused_with_the_numbers_and_reserve_their_slots() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    reg.pin("a").unwrap();
    let err = reg.pin("b").unwrap_err();
    assert!(matches!(err, Error::Capacity(_)));
    assert!(err.to_string().contains("max_loras_per_batch=2 allows at most 1 pinned"), "{err}");
    // One slot for unpinned adapters: b is admitted, c deferred, a (pinned) admitted.
    let p = plan(&mut reg, &[Some("b"), Some("c"), Some("a")]);
    assert_eq!(p.admitted, [0, 2]);
    finish_loads(&mut reg, &p);
    for step in [[Some("c")], [Some("b")]] {
        let p = plan(&mut reg, &step);
        assert!(!evicted(&p, Tier::Device).contains(&"a"));
        finish_loads(&mut reg, &p);
    }
    reg.unpin("a").unwrap();
    reg.pin("b").unwrap();
    let p = plan(&mut reg, &[Some("c")]);
    assert_eq!(evicted(&p, Tier::Device), ["a"]);
}

#[test]
fn host_tier_evicts_before_it_registers_and_reloads_from_disk() {
    let mut reg = registry(1, Some(2), "lru", &["a", "b"]);
    step(&mut reg, &[Some("a")]);
    reg.end_step();
    // b is the least recently used: it leaves host memory before c enters.
    assert_eq!(reg.register(lora("c"), size(4, 100)).unwrap(), ["b"]);
    assert_eq!(reg.stats().host.resident, ["a", "c"]);
    let p = plan(&mut reg, &[Some("b")]);
    assert_eq!(p.loads[0].source, LoadSource::Disk);
    assert_eq!(p.evictions.len(), 2, "{:?}", p.evictions);
    assert_eq!(evicted(&p, Tier::Host), ["a"]);
    assert_eq!(evicted(&p, Tier::Device), ["a"]);
    let s = reg.stats();
    assert_eq!((s.host.counters.misses, s.host.counters.evictions), (1, 2));
}

#[test]
fn a_full_protected_host_tier_refuses_registrations_and_defers_disk_loads() {
    let mut reg = registry(1, Some(2), "lru", &["a", "b"]);
    reg.acquire(&[Some("a"), Some("b")]).unwrap();
    let err = reg.register(lora("c"), size(4, 100)).unwrap_err();
    assert!(err.to_string().contains("2 of them protected"), "{err}");
    assert_eq!(reg.stats().host.resident, ["a", "b"]);
    reg.release(&[Some(&lora("b").lora_id)]).unwrap();
    assert_eq!(reg.register(lora("c"), size(4, 100)).unwrap(), ["b"]);
    reg.acquire(&[Some("c")]).unwrap();
    let p = plan(&mut reg, &[Some("b"), Some("a")]);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), (&[][..], &[0, 1][..]));
    assert_eq!(reg.stats().host.counters.refusals, 2);
}

#[test]
fn loading_adapters_keep_their_slot_until_done_and_failed_loads_leave() {
    let mut reg = registry(1, Some(2), "lru", &["a", "b"]);
    plan(&mut reg, &[Some("a")]);
    let p = plan(&mut reg, &[Some("b")]);
    assert_eq!(p.deferred, [0]);
    reg.load_done("a").unwrap();
    assert!(matches!(reg.load_done("a"), Err(Error::Usage(_))));
    let p = plan(&mut reg, &[Some("b")]);
    assert_eq!(evicted(&p, Tier::Device), ["a"]);
    reg.load_failed("b").unwrap();
    reg.audit().unwrap();
    assert!(reg.stats().device.resident.is_empty());
    assert_eq!(reg.stats().host.resident, ["a", "b"]);
    reg.end_step();
    reg.register(lora("c"), size(4, 100)).unwrap();
    let p = plan(&mut reg, &[Some("a")]);
    assert_eq!(p.loads[0].source, LoadSource::Disk);
    reg.load_failed("a").unwrap();
    assert!(!reg.stats().host.resident.contains(&"a".to_owned()));
}

#[test]
fn registration_errors_name_both_refs() {
    let mut reg = registry(2, None, "lru", &["a"]);
    let other = LoRARef::with_deterministic_id("a", "/elsewhere", false, None).unwrap();
    let err = reg.register(other, size(4, 1)).unwrap_err().to_string();
    assert!(err.contains("/elsewhere") && err.contains("/srv/a"), "{err}");
    let mut same_id = lora("b");
    same_id.lora_id = lora("a").lora_id;
    assert!(matches!(reg.register(same_id, size(4, 1)), Err(Error::DuplicateAdapter { .. })));
    assert!(matches!(reg.register(lora("z"), size(0, 1)), Err(Error::Spec(_))));
    let err = reg.pin("nope").unwrap_err().to_string();
    assert!(err.contains("\"nope\"") && err.contains("registered: \"a\""), "{err}");
}

#[test]
fn release_is_atomic_and_never_goes_negative() {
    let mut reg = registry(2, None, "lru", &["a", "b"]);
    let ids = reg.acquire(&[Some("a"), None, Some("b")]).unwrap();
    assert!(ids[1].is_none());
    let a = ids[0].clone().unwrap();
    let b = ids[2].clone().unwrap();
    let err = reg.release(&[Some(&b), Some(&a), Some(&a)]).unwrap_err();
    assert!(matches!(err, Error::Usage(_)), "{err}");
    assert_eq!((reg.in_flight("a").unwrap(), reg.in_flight("b").unwrap()), (1, 1));
    reg.release(&[Some(&a), Some(&b)]).unwrap();
    assert!(matches!(reg.acquire(&[Some("a"), Some("x")]), Err(Error::AdapterNotFound { .. })));
    assert_eq!(reg.in_flight("a").unwrap(), 0);
}

#[test]
fn unload_waits_for_requests_and_is_idempotent() {
    let shared = Arc::new(SharedRegistry::new(registry(2, None, "lru", &["a", "b"])));
    let id: Arc<str> = shared.lock().acquire(&[Some("a")]).unwrap()[0].clone().unwrap();
    shared.lock().pin("a").unwrap();
    let err = shared.unload("a", Some(Duration::from_millis(20))).unwrap_err();
    assert!(matches!(err, Error::UnloadTimeout { in_flight: 1, .. }), "{err}");
    {
        let mut reg = shared.lock();
        assert!(!reg.contains("a"));
        assert!(matches!(reg.acquire(&[Some("a")]), Err(Error::AdapterNotFound { .. })));
        assert!(matches!(reg.register(lora("a"), size(4, 1)), Err(Error::AdapterInUse(_))));
        assert_eq!(reg.stats().pinned, 0);
        // Its running requests are still planned.
        assert_eq!(reg.plan_names(&[Some("a")], &[1]).unwrap().admitted, [0]);
    }
    let waiter = {
        let shared = shared.clone();
        std::thread::spawn(move || shared.unload("a", None))
    };
    std::thread::sleep(Duration::from_millis(20));
    shared.release(&[Some(&id)]).unwrap();
    waiter.join().unwrap().unwrap();
    shared.unload("a", Some(Duration::ZERO)).unwrap();
    assert!(matches!(shared.unload("never", None), Err(Error::AdapterNotFound { .. })));
    let mut reg = shared.lock();
    reg.audit().unwrap();
    assert!(reg.stats().device.resident.is_empty());
    assert_eq!(reg.unload("b").unwrap(), Unload::Done);
    reg.register(lora("a"), size(4, 1)).unwrap();
}

#[test]
fn a_continued_unload_leaves_a_later_adapter_of_the_same_name_alone() {
    let mut reg = registry(2, None, "lru", &["a"]);
    let id: Arc<str> = reg.acquire(&[Some("a")]).unwrap()[0].clone().unwrap();
    let Unload::Draining { in_flight: 1, serial } = reg.unload("a").unwrap() else { panic!("not draining") };
    reg.release(&[Some(&id)]).unwrap();
    // Another caller finishes the unload by name, and "a" is registered again.
    assert_eq!(reg.unload("a").unwrap(), Unload::Done);
    reg.register(lora("a"), size(8, 1)).unwrap();
    // The first unloader goes on with its registration: done, and the new "a" stays.
    assert_eq!(reg.continue_unload(serial), Unload::Done);
    assert!(reg.contains("a"));
    assert_eq!(reg.lookup("a", false).map(|k| reg.get(k).size.rank), Ok(8));
    reg.audit().unwrap();
}

#[test]
fn unloaded_names_are_remembered_for_repeat_unloads_within_a_bound() {
    use crate::registry::MAX_UNLOADED_NAMES;
    let mut reg = registry(2, None, "lru", &[]);
    for round in 0..2 {
        // "keep" is unloaded, registered again and unloaded again: its latest forget counts.
        reg.register(lora("keep"), size(4, 1)).unwrap();
        assert_eq!(reg.unload("keep").unwrap(), Unload::Done);
        if round == 0 {
            for i in 0..MAX_UNLOADED_NAMES - 1 {
                reg.register(lora(&format!("n{i}")), size(4, 1)).unwrap();
                assert_eq!(reg.unload(&format!("n{i}")).unwrap(), Unload::Done);
            }
        }
    }
    // 65538 forgets so far counting this one: the two oldest entries, keep's first and n0's, are out.
    reg.register(lora("extra"), size(4, 1)).unwrap();
    assert_eq!(reg.unload("extra").unwrap(), Unload::Done);
    assert_eq!(reg.unload("keep").unwrap(), Unload::Done, "its latest unload is within the bound");
    assert!(matches!(reg.unload("n0"), Err(Error::AdapterNotFound { .. })), "the oldest name is gone");
    assert_eq!(reg.unload("n1").unwrap(), Unload::Done);
    assert_eq!(reg.unload(&format!("n{}", MAX_UNLOADED_NAMES - 2)).unwrap(), Unload::Done);
    assert!(matches!(reg.unload("never"), Err(Error::AdapterNotFound { .. })));
    reg.audit().unwrap();
}

#[test]
fn a_drained_unload_that_timed_out_says_to_unload_again() {
    let mut reg = registry(2, None, "lru", &["a"]);
    let id: Arc<str> = reg.acquire(&[Some("a")]).unwrap()[0].clone().unwrap();
    assert!(matches!(reg.unload("a").unwrap(), Unload::Draining { .. }));
    reg.release(&[Some(&id)]).unwrap();
    let err = reg.register(lora("a"), size(4, 1)).unwrap_err();
    assert!(err.to_string().contains("unload(\"a\") again"), "{err}");
}

#[test]
fn limits_are_checked() {
    assert!(Registry::new(Config::new(0)).is_err());
    let mut c = Config::new(4);
    c.max_loaded = Some(3);
    assert!(Registry::new(c).unwrap_err().to_string().contains("max_loaded_loras=3"));
    let mut c = Config::new(4);
    c.device_policy = "lfu".into();
    assert!(matches!(Registry::new(c), Err(Error::Spec(_))));
}

/// One operation of a random sequence.
#[derive(Debug, Clone)]
enum Op {
    Register(u8, bool, u64),
    Pin(u8),
    Unpin(u8),
    Acquire(u8),
    Release(u8),
    Unload(u8),
    Plan(Vec<(Option<u8>, u32)>),
    LoadDone(u8),
    LoadFailed(u8),
    EndStep,
}

fn op() -> impl Strategy<Value = Op> {
    let name = 0u8..8;
    prop_oneof![
        1 => (name.clone(), prop::bool::weighted(0.2), 1u64..400).prop_map(|(n, p, b)| Op::Register(n, p, b)),
        1 => name.clone().prop_map(Op::Pin),
        1 => name.clone().prop_map(Op::Unpin),
        1 => name.clone().prop_map(Op::Acquire),
        1 => name.clone().prop_map(Op::Release),
        1 => name.clone().prop_map(Op::Unload),
        4 => prop::collection::vec((prop::option::weighted(0.85, name.clone()), 0u32..4), 0..10).prop_map(Op::Plan),
        2 => name.clone().prop_map(Op::LoadDone),
        1 => name.clone().prop_map(Op::LoadFailed),
        1 => Just(Op::EndStep),
    ]
}

/// Who may not be evicted before an operation, by name: (pinned, loading, in step, in flight).
fn protections(reg: &Registry) -> HashMap<String, (bool, bool, bool, bool)> {
    reg.adapters
        .iter()
        .flatten()
        .map(|a| (a.r.lora_name.clone(), (a.r.pinned, a.loading.is_some(), a.in_step, a.in_flight > 0)))
        .collect()
}

fn check_plan(
    reg: &Registry,
    before: &HashMap<String, (bool, bool, bool, bool)>,
    req: &[(Option<u8>, u32)],
    p: &crate::plan::StepPlan,
) {
    let admitted_names: HashSet<String> =
        p.admitted.iter().filter_map(|&i| req[i as usize].0).map(|n| format!("n{n}")).collect();
    for e in &p.evictions {
        let (pinned, loading, _, in_flight) = before[&*e.name];
        assert!(!pinned && !loading, "{e:?} was protected");
        assert!(!admitted_names.contains(&*e.name), "{e:?} is in the step");
        assert!(e.tier == Tier::Device || !in_flight, "{e:?} had requests in flight");
    }
    let mut unpinned = HashSet::new();
    for (j, &i) in p.admitted.iter().enumerate() {
        let slot = p.request_slots[j];
        match req[i as usize].0 {
            None => assert_eq!(slot, -1),
            Some(n) => {
                let a = reg.get(reg.lookup(&format!("n{n}"), true).unwrap());
                assert_eq!(
                    a.slot.map(|s| s as i32),
                    Some(slot),
                    "admitted request {i} has its adapter's slot"
                );
                if !a.r.pinned {
                    unpinned.insert(n);
                }
            }
        }
    }
    assert!(unpinned.len() <= reg.config.slots - reg.pinned);
    assert_eq!(p.admitted.len() + p.deferred.len(), req.len());
    assert!(p.deferred.iter().all(|&i| req[i as usize].0.is_some()), "base rows are never deferred");
    // The permutation covers every adapter token once, and segments agree with token_slots.
    let mut seen = vec![false; p.num_tokens()];
    for (s, w) in p.seg_indptr.windows(2).enumerate() {
        assert!(w[0] < w[1]);
        for &t in &p.token_perm[w[0] as usize..w[1] as usize] {
            assert_eq!(p.token_slots[t as usize], p.seg_slots[s]);
            assert!(!std::mem::replace(&mut seen[t as usize], true));
        }
    }
    assert_eq!(seen.iter().filter(|&&x| x).count(), p.token_slots.iter().filter(|&&s| s >= 0).count());
    assert_eq!(*p.seg_indptr.last().unwrap() as usize, p.token_perm.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_invariant(
        slots in 1usize..4,
        extra in prop::option::of(0usize..3),
        max_bytes in prop::option::of(400u64..1200),
        fifo in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut config = Config::new(slots);
        config.max_loaded = extra.map(|e| slots + e);
        config.max_host_bytes = max_bytes;
        config.chunk_size = Some(2);
        if fifo {
            config.device_policy = "fifo".into();
        }
        let mut reg = Registry::new(config).unwrap();
        let mut ids: HashMap<u8, Vec<Arc<str>>> = HashMap::new();
        let mut resident_pinned: HashSet<String> = HashSet::new();
        for op in ops {
            let before = protections(&reg);
            let name = |n: u8| format!("n{n}");
            match &op {
                Op::Register(n, pinned, bytes) => {
                    let r = LoRARef::with_deterministic_id(&name(*n), "/p", *pinned, None).unwrap();
                    if let Ok(gone) = reg.register(r, AdapterSize { rank: 8, host_bytes: *bytes, device_bytes: *bytes, scaling: 1.0 }) {
                        for g in gone {
                            let (pinned, loading, in_step, in_flight) = before[&g];
                            prop_assert!(!pinned && !loading && !in_step && !in_flight, "{g} was protected");
                        }
                    }
                }
                Op::Pin(n) => { let _ = reg.pin(&name(*n)); }
                Op::Unpin(n) => { let _ = reg.unpin(&name(*n)); }
                Op::Acquire(n) => {
                    if let Ok(got) = reg.acquire(&[Some(&name(*n))]) {
                        ids.entry(*n).or_default().push(got[0].clone().unwrap());
                    }
                }
                Op::Release(n) => {
                    if let Some(id) = ids.get_mut(n).and_then(Vec::pop) {
                        reg.release(&[Some(&id)]).unwrap();
                    } else if let Ok(key) = reg.lookup(&name(*n), true) {
                        let id = reg.get(key).id.clone();
                        prop_assert!(matches!(reg.release(&[Some(&id)]), Err(Error::Usage(_))));
                    }
                }
                Op::Unload(n) => {
                    if let Ok(Unload::Done) = reg.unload(&name(*n)) {
                        ids.remove(n);
                        resident_pinned.remove(&name(*n));
                    }
                }
                Op::Plan(req) => {
                    let names: Vec<Option<String>> = req.iter().map(|(n, _)| n.map(name)).collect();
                    let names: Vec<Option<&str>> = names.iter().map(Option::as_deref).collect();
                    let tokens: Vec<u32> = req.iter().map(|&(_, t)| t).collect();
                    match reg.plan_names(&names, &tokens) {
                        Ok(p) => check_plan(&reg, &before, req, &p),
                        Err(e) => prop_assert!(matches!(e, Error::AdapterNotFound { .. }), "{e}"),
                    }
                }
                Op::LoadDone(n) => { let _ = reg.load_done(&name(*n)); }
                Op::LoadFailed(n) => {
                    if reg.load_failed(&name(*n)).is_ok() {
                        resident_pinned.remove(&name(*n));
                    }
                }
                Op::EndStep => reg.end_step(),
            }
            if let Err(e) = reg.audit() {
                return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
            }
            // A pinned adapter, once in both tiers, stays there until unpinned or unloaded.
            resident_pinned.retain(|n| reg.lookup(n, false).is_ok_and(|k| reg.get(k).r.pinned));
            for n in &resident_pinned {
                let a = reg.get(reg.lookup(n, false).unwrap());
                prop_assert!(a.slot.is_some() && a.host_since.is_some(), "pinned {n} was evicted by {op:?}");
            }
            for a in reg.adapters.iter().flatten() {
                if a.r.pinned && a.slot.is_some() && a.loading.is_none() {
                    resident_pinned.insert(a.r.lora_name.clone());
                }
            }
        }
    }
}

#[test]
fn register_names_a_victim_once_even_when_it_left_both_tiers() {
    let mut reg = registry(1, Some(1), "lru", &["a"]);
    step(&mut reg, &[Some("a")]);
    reg.end_step();
    assert_eq!(reg.register(lora("b"), size(4, 100)).unwrap(), ["a"]);
    assert_eq!(reg.stats().device.counters.evictions, 1);
}
