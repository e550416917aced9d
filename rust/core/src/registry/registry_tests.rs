use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use proptest::prelude::*;

use crate::error::Error;
use crate::policy::PolicyKind;
use crate::registry::tiers::Tier;
use crate::registry::{AdapterSize, Config, LoadSource, Registry, StepMode, StepPlan, StepRequest, Unload};
use crate::spec::LoRARef;

use crate::registry::testkit::*;

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
fn every_registered_adapter_fits_in_the_host_tier_beside_the_pinned_ones() {
    // 250 host bytes, three slots: pinning b and c (200 bytes) would leave 50, and a needs 100, so
    // a's requests would wait for ever; the pin is refused with the numbers, as is a registration
    // that could never enter beside the pins.
    let mut config = Config::new(3);
    config.max_host_bytes = Some(250);
    let mut reg = Registry::new(config).unwrap();
    for n in ["a", "b", "c"] {
        reg.register(lora(n), size(4, 100)).unwrap();
    }
    reg.pin("b").unwrap();
    let before = reg.stats();
    let err = reg.pin("c").unwrap_err();
    assert!(matches!(err, Error::Capacity(_)));
    let msg = err.to_string();
    assert!(msg.contains("\"a\" needs 100") && msg.contains("200 of max_host_bytes=250"), "{msg}");
    let pinned = LoRARef::with_deterministic_id("d", "/srv/d", true, None).unwrap();
    assert!(matches!(reg.register(pinned, size(4, 60)), Err(Error::Capacity(_))));
    let err = reg.register(lora("e"), size(4, 200)).unwrap_err().to_string();
    assert!(err.contains("could never enter the host tier beside them"), "{err}");
    assert_eq!((reg.stats().pinned_names, reg.stats().registered), (before.pinned_names, before.registered));
    reg.audit().unwrap();
    // Without a, c may be pinned.
    assert_eq!(reg.unload("a").unwrap(), Unload::Done);
    reg.pin("c").unwrap();
    reg.audit().unwrap();
}

#[test]
fn a_failed_fetch_leaves_every_other_adapter_where_it_was() {
    // The host tier (two places) holds b and c, both in slots; a's read begins and fails.
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    step(&mut reg, &[Some("b"), Some("c")]);
    reg.end_step().unwrap();
    let before = residency(&reg);
    let evictions = (reg.stats().host.counters.evictions, reg.stats().device.counters.evictions);
    let p = reg.prefetch(&[Some("a")]).unwrap();
    assert_eq!(p.to_fetch.len(), 1);
    assert_eq!(residency(&reg), before, "a reservation evicts nobody");
    reg.fetch_failed("a", reg.serial("a").unwrap()).unwrap();
    assert_eq!(residency(&reg), before);
    assert_eq!((reg.stats().host.counters.evictions, reg.stats().device.counters.evictions), evictions);
    reg.audit().unwrap();
}

/// A whole-batch fetch step that waits marks the adapters in the host tier fresh (`a, b` start
/// outside it, `c, d` in it), one of them with its disk read pending (from a plan outside a step); that read fails: the adapter leaves the host
/// tier and is fresh no more (the case a random search found: it stayed fresh outside the tier).
#[test]
fn a_failed_read_of_a_fresh_adapter_ends_its_freshness() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c", "d"]);
    reg.end_step().unwrap();
    reg.plan_names(&[Some("a"), None], &[0, 0]).unwrap();
    let keys: Vec<_> = ["b", "a"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let request = StepRequest { whole: true, ..StepRequest::new(&keys, &[0, 0], StepMode::Fetch) };
    let (p, ticket) = start(&mut reg, request).unwrap();
    assert!(ticket.is_none() && p.deferred.len() == 2, "the whole batch waits for b");
    assert!(reg.get(keys[1].unwrap()).protection.fresh);
    reg.load_failed("a").unwrap();
    reg.audit().unwrap();
    let a = reg.get(keys[1].unwrap());
    assert!(a.tenancy.host_since.is_none() && !a.protection.fresh);
    assert!(reg.fresh.is_empty());
}

#[test]
fn a_read_the_protected_adapters_leave_no_room_for_waits_and_changes_nothing() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    let serial = reg.serial("a").unwrap();
    assert_eq!(reg.prefetch(&[Some("a")]).unwrap().to_fetch.len(), 1);
    // A step takes b and c (the whole host tier) before a's read ends.
    let keys: Vec<_> = ["b", "c"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let (p, ticket) =
        reg.begin_step(StepRequest::new(&keys, &[1, 1], StepMode::ReadInStep)).unwrap().begun().unwrap();
    assert_eq!(p.admitted, [0, 1]);
    let before = (residency(&reg), reg.stats().host);
    assert!(matches!(reg.fetch_done("a", serial), Err(Error::Capacity(_))));
    assert_eq!((residency(&reg), reg.stats().host), before);
    reg.audit().unwrap();
    for index in 0..p.loads.len() {
        reg.report_load(ticket, index, true).unwrap();
    }
    reg.finish_step(ticket).unwrap();
    // Once the step is over, the same report makes its room.
    assert_eq!(reg.fetch_done("a", serial).unwrap().len(), 1);
    reg.audit().unwrap();
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
fn limits_are_checked() {
    assert!(Registry::new(Config::new(0)).is_err());
    let mut c = Config::new(4);
    c.max_loaded = Some(3);
    assert!(Registry::new(c).unwrap_err().to_string().contains("max_loaded_loras=3"));
    assert!(matches!(PolicyKind::parse("eviction_policy", "lfu"), Err(Error::Spec(_))));
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
    BeginStep(Vec<(Option<u8>, u32)>, bool, bool),
    ReportLoad(usize, bool),
    FinishStep,
    Prefetch(Vec<Option<u8>>),
    FetchReport(u8, bool),
    Replace(u8, u64),
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
        4 => (prop::collection::vec((prop::option::weighted(0.85, name.clone()), 0u32..4), 0..10), prop::bool::weighted(0.2))
            .prop_map(|(r, all)| Op::BeginStep(r, all, false)),
        4 => (prop::collection::vec((prop::option::weighted(0.85, name.clone()), 0u32..4), 0..10), prop::bool::weighted(0.2))
            .prop_map(|(r, all)| Op::BeginStep(r, all, true)),
        3 => (0usize..4, prop::bool::weighted(0.8)).prop_map(|(i, ok)| Op::ReportLoad(i, ok)),
        3 => Just(Op::FinishStep),
        1 => prop::collection::vec(prop::option::weighted(0.9, name.clone()), 0..5).prop_map(Op::Prefetch),
        3 => (name.clone(), prop::bool::weighted(0.8)).prop_map(|(n, ok)| Op::FetchReport(n, ok)),
        2 => (name.clone(), 1u64..800).prop_map(|(n, b)| Op::Replace(n, b)),
    ]
}

/// Who may not be evicted before an operation, by name: (pinned, loading, in step, in flight).
fn protections(reg: &Registry) -> HashMap<String, (bool, bool, bool, bool)> {
    reg.adapters
        .iter()
        .flatten()
        .map(|a| {
            (
                a.identity.spec.lora_name.clone(),
                (
                    a.protection.pinned,
                    a.protection.loading.is_some(),
                    a.protection.in_step,
                    a.protection.in_flight > 0,
                ),
            )
        })
        .collect()
}

fn check_plan(
    reg: &Registry,
    before: &HashMap<String, (bool, bool, bool, bool)>,
    req: &[(Option<u8>, u32)],
    p: &StepPlan,
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
                    a.tenancy.slot.map(|s| s as i32),
                    Some(slot),
                    "admitted request {i} has its adapter's slot"
                );
                if !a.protection.pinned {
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

/// Where each adapter is: in the host tier or not, and its slot.
fn residency(reg: &Registry) -> HashMap<String, (bool, Option<u32>)> {
    reg.adapters
        .iter()
        .flatten()
        .map(|a| (a.identity.spec.lora_name.clone(), (a.tenancy.host_since.is_some(), a.tenancy.slot)))
        .collect()
}

/// A fetch-mode plan's fetches: each adapter listed once, now fetching, and all its requests
/// deferred; recorded in `fetches` for the reports.
fn check_fetches(
    reg: &Registry,
    req: &[(Option<u8>, u32)],
    p: &StepPlan,
    fetches: &mut HashMap<String, u64>,
) -> Result<(), TestCaseError> {
    for f in &p.to_fetch {
        let a = reg.get(reg.lookup(&f.name, false).unwrap());
        prop_assert!(a.tenancy.fetching && a.identity.serial == f.serial);
        prop_assert!(p.to_fetch.iter().filter(|g| g.name == f.name).count() == 1, "fetched twice");
        // An earlier fetch of it, if still recorded, was cancelled or taken over since (starting a
        // fetch of an adapter being fetched is a debug assertion in `start_fetch`).
        fetches.insert(f.name.to_string(), f.serial);
        for (i, (n, _)) in req.iter().enumerate() {
            if n.map(|n| format!("n{n}")).as_deref() == Some(&*f.name) {
                prop_assert!(p.deferred.contains(&(i as u32)), "a request of {} admitted", f.name);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_invariant(
        slots in 1usize..4,
        extra in prop::option::of(0usize..3),
        max_bytes in prop::option::of(400u64..1200),
        fifo in any::<bool>(),
        preload in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut config = Config::new(slots);
        config.max_loaded = extra.map(|e| slots + e);
        config.max_host_bytes = max_bytes;
        config.chunk_size = Some(2);
        if fifo {
            config.device_policy = PolicyKind::Fifo;
        }
        if preload {
            config.max_loaded = Some(slots + extra.unwrap_or(0));
        }
        let mut reg = Registry::new(config).unwrap();
        if preload {
            // Every name registered into a host tier too small for them: most start outside it,
            // so steps in fetch mode start fetches.
            for n in 0..8 {
                let r = LoRARef::with_deterministic_id(&format!("n{n}"), "/p", false, None).unwrap();
                reg.register(r, AdapterSize { rank: 8, host_bytes: 100, device_bytes: 100, scaling: 1.0 }).unwrap();
            }
        }
        let mut ids: HashMap<u8, Vec<Arc<str>>> = HashMap::new();
        let mut resident_pinned: HashSet<String> = HashSet::new();
        // The open step transaction: its ticket, and per adapter name the requests it acquired.
        let mut open: Option<(crate::registry::StepTicket, HashMap<String, u64>)> = None;
        // Fetches handed out and not reported yet: name -> serial.
        let mut fetches: HashMap<String, u64> = HashMap::new();
        for op in ops {
            let before = protections(&reg);
            let fresh: HashSet<String> =
                reg.adapters.iter().flatten().filter(|a| a.protection.fresh).map(|a| a.identity.spec.lora_name.clone()).collect();
            let evictions_before = reg.host.counters.evictions + reg.device.counters.evictions;
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
                        let id = reg.get(key).identity.id.clone();
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
                        Err(Error::Usage(_)) => prop_assert!(open.is_some(), "plan refused with no step open"),
                        Err(e) => prop_assert!(matches!(e, Error::AdapterNotFound { .. }), "{e}"),
                    }
                }
                Op::LoadDone(n) => { let _ = reg.load_done(&name(*n)); }
                Op::LoadFailed(n) => {
                    if reg.load_failed(&name(*n)).is_ok() {
                        resident_pinned.remove(&name(*n));
                    }
                }
                Op::EndStep => {
                    prop_assert_eq!(reg.end_step().is_ok(), open.is_none());
                }
                Op::BeginStep(req, all, fetch) => {
                    // Fetch-mode steps ask for registered adapters only (unknown names become base
                    // rows), so that they meet adapters outside the host tier often.
                    let known = |n: &Option<u8>| n.filter(|&n| reg.lookup(&name(n), false).is_ok());
                    let req: &Vec<(Option<u8>, u32)> =
                        &if *fetch { req.iter().map(|(n, t)| (known(n), *t)).collect() } else { req.clone() };
                    let names: Vec<Option<String>> = req.iter().map(|(n, _)| n.map(name)).collect();
                    let keys: Result<Vec<_>, _> =
                        names.iter().map(|n| n.as_deref().map(|n| reg.lookup(n, false)).transpose()).collect();
                    let Ok(keys) = keys else { continue };
                    let tokens: Vec<u32> = req.iter().map(|&(_, t)| t).collect();
                    let mode = if *fetch { StepMode::Fetch } else { StepMode::ReadInStep };
                    match start(&mut reg, StepRequest { whole: *all, ..StepRequest::new(&keys, &tokens, mode) }) {
                        Ok((p, None)) => {
                            // Fetch mode, all or nothing: no step, every request waits.
                            prop_assert!(*fetch && *all && open.is_none());
                            prop_assert!(p.evictions.is_empty(), "a fetch evicted from the host tier");
                            prop_assert_eq!(p.deferred.len(), req.len());
                            check_fetches(&reg, req, &p, &mut fetches)?;
                        }
                        Ok((p, Some(ticket))) => {
                            prop_assert!(open.is_none(), "a second step began while one was open");
                            prop_assert!(!*all || p.deferred.is_empty());
                            check_plan(&reg, &before, req, &p);
                            if *fetch {
                                prop_assert!(p.loads.iter().all(|l| l.source == LoadSource::Host), "a disk read in a step");
                                // A fetch evicts nobody when it starts: room is made when its read succeeded.
                                prop_assert!(p.evictions.iter().all(|e| e.tier == Tier::Device), "a fetch evicted from the host tier");
                                check_fetches(&reg, req, &p, &mut fetches)?;
                            } else {
                                prop_assert!(p.to_fetch.is_empty());
                            }
                            let mut held: HashMap<String, u64> = HashMap::new();
                            for &i in &p.admitted {
                                if let Some(n) = &names[i as usize] {
                                    *held.entry(n.clone()).or_default() += 1;
                                }
                            }
                            open = Some((ticket, held));
                        }
                        Err(Error::Usage(_)) => prop_assert!(open.is_some()),
                        Err(e) => prop_assert!(*all && matches!(e, Error::Capacity(_)), "{e}"),
                    }
                }
                Op::ReportLoad(i, ok) => {
                    let ticket = open.as_ref().map_or(crate::registry::StepTicket(0), |o| o.0);
                    let _ = reg.report_load(ticket, *i, *ok);
                }
                Op::FinishStep => {
                    let ticket = open.as_ref().map_or(crate::registry::StepTicket(0), |o| o.0);
                    prop_assert_eq!(reg.finish_step(ticket).is_ok(), open.is_some());
                    open = None;
                }
                Op::Prefetch(names) => {
                    let names: Vec<Option<String>> = names.iter().map(|n| n.map(name)).collect();
                    let names: Vec<Option<&str>> = names.iter().map(Option::as_deref).collect();
                    match reg.prefetch(&names) {
                        Ok(p) => {
                            for f in &p.to_fetch {
                                prop_assert!(names.contains(&Some(&*f.name)));
                                prop_assert!(p.to_fetch.iter().filter(|g| g.name == f.name).count() == 1);
                                fetches.insert(f.name.to_string(), f.serial);
                            }
                        }
                        Err(e) => prop_assert!(matches!(e, Error::AdapterNotFound { .. }), "{e}"),
                    }
                }
                Op::FetchReport(n, ok) => {
                    let Some(serial) = fetches.remove(&name(*n)) else { continue };
                    let live = reg.lookup(&name(*n), true).ok().map(|k| reg.get(k)).filter(|a| a.identity.serial == serial);
                    let fetching = live.is_some_and(|a| a.tenancy.fetching);
                    let live = live.is_some();
                    let places = residency(&reg);
                    let got = if *ok { reg.fetch_done(&name(*n), serial) } else { reg.fetch_failed(&name(*n), serial).map(|()| Vec::new()) };
                    let moved = !*ok || got.is_err();
                    match got {
                        Ok(gone) => {
                            prop_assert!(fetching);
                            for g in gone {
                                let (pinned, loading, in_step, in_flight) = before[&*g];
                                prop_assert!(!pinned && !loading && !in_step && !in_flight, "{g} was protected");
                            }
                        }
                        Err(Error::Capacity(_)) => {
                            // Read, but the protected adapters leave it no room now: it goes on.
                            prop_assert!(*ok && fetching);
                            fetches.insert(name(*n), serial);
                        }
                        Err(Error::Usage(_)) => prop_assert!(live && !fetching),
                        Err(e) => prop_assert!(!live && matches!(e, Error::AdapterNotFound { .. }), "{e}"),
                    }
                    if moved {
                        // A failed read (or a refused report) moves no other adapter in either tier.
                        let mut after = residency(&reg);
                        after.remove(&name(*n));
                        let mut places = places;
                        places.remove(&name(*n));
                        prop_assert_eq!(places, after);
                    }
                }
                Op::Replace(n, bytes) => {
                    let Ok(serial) = reg.serial(&name(*n)) else { continue };
                    let placement = reg.placement();
                    match reg.replace(&name(*n), serial, AdapterSize { rank: 8, host_bytes: *bytes, device_bytes: *bytes, scaling: 1.0 }) {
                        Ok(gone) => {
                            for g in gone {
                                let (pinned, loading, in_step, in_flight) = before[&g];
                                prop_assert!(!pinned && !loading && !in_step && !in_flight, "{g} was protected");
                            }
                        }
                        // A refused replacement changes nothing.
                        Err(e) => {
                            prop_assert!(matches!(e, Error::Capacity(_) | Error::AdapterNotFound { .. }), "{e}");
                            prop_assert_eq!(placement, reg.placement());
                        }
                    }
                }
            }
            // A fresh adapter is evicted by nothing (it may leave by an unload only).
            if reg.host.counters.evictions + reg.device.counters.evictions > evictions_before {
                for n in &fresh {
                    if let Ok(k) = reg.lookup(n, true) {
                        prop_assert!(reg.get(k).tenancy.host_since.is_some(), "fresh {n} was evicted by {op:?}");
                    }
                }
            }
            // Every adapter's count in flight is exactly what the model holds: the acquires not
            // released, plus the open step's requests.
            for a in reg.adapters.iter().flatten() {
                let n = a.identity.spec.lora_name.trim_start_matches('n').parse::<u8>().unwrap();
                let acquired = ids.get(&n).map_or(0, Vec::len) as u64;
                let stepped = open.as_ref().and_then(|o| o.1.get(&a.identity.spec.lora_name)).copied().unwrap_or(0);
                prop_assert_eq!(a.protection.in_flight, acquired + stepped, "{} after {:?}", a.identity.spec.lora_name, op);
            }
            if let Err(e) = reg.audit() {
                return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
            }
            // A pinned adapter, once in both tiers, stays there until unpinned or unloaded.
            resident_pinned.retain(|n| reg.lookup(n, false).is_ok_and(|k| reg.get(k).protection.pinned));
            for n in &resident_pinned {
                let a = reg.get(reg.lookup(n, false).unwrap());
                prop_assert!(a.tenancy.slot.is_some() && a.tenancy.host_since.is_some(), "pinned {n} was evicted by {op:?}");
            }
            for a in reg.adapters.iter().flatten() {
                if a.protection.pinned && a.tenancy.slot.is_some() && a.protection.loading.is_none() {
                    resident_pinned.insert(a.identity.spec.lora_name.clone());
                }
            }
        }
    }
}

#[test]
fn register_names_a_victim_once_even_when_it_left_both_tiers() {
    let mut reg = registry(1, Some(1), "lru", &["a"]);
    step(&mut reg, &[Some("a")]);
    reg.end_step().unwrap();
    assert_eq!(reg.register(lora("b"), size(4, 100)).unwrap(), ["a"]);
    assert_eq!(reg.stats().device.counters.evictions, 1);
}
