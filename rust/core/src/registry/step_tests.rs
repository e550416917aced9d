use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::policy::AdapterKey;
use crate::registry::testkit::*;
use crate::registry::{
    Config, Deferral, Hold, LoadSource, Registry, StepMode, StepPlan, StepRequest, StepRequests, StepStart,
    StepTicket, Unload,
};
use crate::shared::SharedRegistry;

/// Begins a step over `adapters` that reads what it needs itself (a whole batch when `whole`).
fn begin(
    reg: &mut Registry,
    adapters: &[Option<AdapterKey>],
    num_tokens: &[u32],
    whole: bool,
) -> crate::Result<(StepPlan, StepTicket)> {
    reg.begin_step(StepRequest { whole, ..StepRequest::new(adapters, num_tokens, StepMode::ReadInStep) })?
        .begun()
}

/// Begins a step over `requests`, with holds, whose adapters `failed` failed their last read.
fn held(
    reg: &mut Registry,
    requests: StepRequests<'_>,
    failed: &[AdapterKey],
) -> crate::Result<(StepPlan, StepTicket)> {
    reg.begin_step(StepRequest { requests, failed, ..StepRequest::new(&[], &[], StepMode::ReadInStep) })?
        .begun()
}

#[test]
fn a_step_holds_its_adapters_until_finished_so_an_unload_waits_for_it() {
    let shared = Arc::new(SharedRegistry::new(registry(2, None, "lru", &["a", "b"])));
    let a = shared.lock().lookup("a", false).unwrap();
    let (plan, ticket) = begin(&mut shared.lock(), &[Some(a), None, Some(a)], &[1, 1, 1], false).unwrap();
    assert_eq!(plan.admitted, [0, 1, 2]);
    assert_eq!(shared.lock().in_flight("a").unwrap(), 2);
    // Another thread unloads "a" and loads a new "a" meanwhile: the unload cannot finish, and the
    // name cannot be taken, while the step holds the old registration.
    assert!(matches!(shared.unload_for("a", Duration::ZERO).unwrap(), Unload::Draining { in_flight: 2, .. }));
    let again = shared.lock().register(lora("a"), size(4, 100)).unwrap_err();
    assert!(matches!(again, Error::AdapterInUse(_)), "{again}");
    let waiter = {
        let shared = Arc::clone(&shared);
        // A hang guard: the step below finishes at once, and the unload returns with it.
        std::thread::spawn(move || shared.unload("a", Some(Duration::from_secs(120))))
    };
    shared.lock().report_load(ticket, 0, true).unwrap();
    shared.finish_step(ticket).unwrap();
    waiter.join().unwrap().unwrap();
    let mut reg = shared.lock();
    assert!(!reg.contains("a"));
    reg.register(lora("a"), size(4, 100)).unwrap();
    assert_eq!(reg.in_flight("a").unwrap(), 0);
    reg.audit().unwrap();
}

#[test]
fn loads_are_reported_by_index_and_unreported_ones_fail_at_finish() {
    let mut reg = registry(2, None, "lru", &["a", "b"]);
    let (a, b) = (reg.lookup("a", false).unwrap(), reg.lookup("b", false).unwrap());
    let (plan, ticket) = begin(&mut reg, &[Some(a), Some(b)], &[2, 3], false).unwrap();
    assert_eq!(plan.loads.len(), 2);
    assert_eq!(plan.loads[0].serial, reg.serial("a").unwrap());
    reg.report_load(ticket, 0, true).unwrap();
    assert!(matches!(reg.report_load(ticket, 0, true), Err(Error::Usage(_))), "reported twice");
    assert!(matches!(reg.report_load(StepTicket(ticket.0 + 1), 1, true), Err(Error::Usage(_))));
    // The name-based calls cannot touch the transaction's loads.
    assert!(matches!(reg.load_done("b"), Err(Error::Usage(_))));
    reg.audit().unwrap();
    reg.finish_step(ticket).unwrap();
    let stats = reg.stats();
    assert_eq!(stats.device.resident, ["a"], "b's load was never reported: it failed");
    assert_eq!((reg.in_flight("a").unwrap(), reg.in_flight("b").unwrap()), (0, 0));
    assert!(matches!(reg.finish_step(ticket), Err(Error::Usage(_))), "finished twice");
    reg.audit().unwrap();
}

#[test]
fn one_step_is_open_at_a_time_and_plain_plans_wait_for_it() {
    let mut reg = registry(2, None, "lru", &["a"]);
    let a = reg.lookup("a", false).unwrap();
    let (_, ticket) = begin(&mut reg, &[Some(a)], &[1], false).unwrap();
    assert!(matches!(begin(&mut reg, &[Some(a)], &[1], false), Err(Error::Usage(_))));
    assert!(matches!(reg.plan(&[Some(a)], &[1]), Err(Error::Usage(_))));
    assert!(matches!(reg.end_step(), Err(Error::Usage(_))));
    assert_eq!(reg.in_flight("a").unwrap(), 1, "refused calls acquired nothing");
    reg.finish_step(ticket).unwrap();
    let (_, next) = begin(&mut reg, &[Some(a)], &[1], false).unwrap();
    assert_ne!(next, ticket);
    reg.finish_step(next).unwrap();
}

#[test]
fn a_failed_load_leaves_its_slot_and_a_disk_load_the_host_tier() {
    let mut reg = registry(1, Some(1), "lru", &["a", "b"]);
    let a = reg.lookup("a", false).unwrap();
    let (plan, ticket) = begin(&mut reg, &[Some(a)], &[1], false).unwrap();
    assert_eq!(plan.loads[0].source, LoadSource::Disk, "b's registration evicted a from host memory");
    reg.report_load(ticket, 0, false).unwrap();
    reg.finish_step(ticket).unwrap();
    let stats = reg.stats();
    assert!(stats.device.resident.is_empty() && !stats.host.resident.contains(&"a".to_owned()));
    assert_eq!(reg.in_flight("a").unwrap(), 0);
    reg.audit().unwrap();
}

#[test]
fn all_or_nothing_refuses_a_batch_that_does_not_fit_and_changes_nothing() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    let keys: Vec<_> = ["a", "b", "c"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let before = reg.stats();
    let err = begin(&mut reg, &keys, &[1, 1, 1], true).unwrap_err();
    assert!(matches!(err, Error::Capacity(_)));
    assert!(err.to_string().contains("3 distinct unpinned adapters but 2 slots minus 0 pinned"), "{err}");
    assert_eq!(reg.stats(), before);
    assert_eq!(reg.open_ticket(), None);
    reg.audit().unwrap();
}

#[test]
fn an_adapter_being_unloaded_fails_its_requests_and_the_rest_run() {
    let mut reg = registry(2, None, "lru", &["a", "b"]);
    let (a, b) = (reg.lookup("a", false).unwrap(), reg.lookup("b", false).unwrap());
    reg.acquire(&[Some("a")]).unwrap();
    assert!(matches!(reg.unload("a").unwrap(), Unload::Draining { .. }));
    let err = begin(&mut reg, &[Some(a), Some(b)], &[1, 1], true).unwrap_err();
    assert!(
        matches!(err, Error::AdapterNotFound { .. }) && err.to_string().contains("being unloaded"),
        "a batch runs whole: {err}"
    );
    let (plan, ticket) = begin(&mut reg, &[Some(a), Some(b), None], &[1, 1, 1], false).unwrap();
    assert_eq!(plan.failed, [(0, Hold::Unloaded)]);
    assert_eq!((plan.admitted, plan.deferred), (vec![1, 2], vec![]));
    assert_eq!(reg.in_flight("a").unwrap(), 1, "the failed request holds nothing");
    reg.finish_step(ticket).unwrap();
    reg.audit().unwrap();
}

#[test]
fn held_requests_wait_or_fail_and_hold_nothing() {
    let mut reg = registry(2, None, "lru", &["a"]);
    let a = reg.lookup("a", false).unwrap();
    let adapters = [None, Some(a), None, Some(a)];
    let holds = [(0, Hold::Discovering), (2, Hold::Unloaded)];
    let requests = StepRequests { adapters: &adapters, num_tokens: &[3, 1, 5, 2], holds: &holds };
    let (plan, ticket) = held(&mut reg, requests, &[]).unwrap();
    assert_eq!((plan.admitted.clone(), plan.deferred.clone()), (vec![1, 3], vec![0]));
    assert_eq!(
        (plan.reasons.clone(), plan.failed.clone()),
        (vec![Deferral::Loading], vec![(2, Hold::Unloaded)])
    );
    assert_eq!(plan.num_tokens(), 3, "only the admitted requests' tokens");
    reg.finish_step(ticket).unwrap();
    let (plan, ticket) = held(&mut reg, requests, &[a]).unwrap();
    assert_eq!(plan.failed, [(1, Hold::ReadFailed), (2, Hold::Unloaded), (3, Hold::ReadFailed)]);
    assert!(plan.admitted.is_empty());
    reg.finish_step(ticket).unwrap();
    assert_eq!(reg.in_flight("a").unwrap(), 0);
    let bad = [(1, Hold::Discovering)];
    let requests = StepRequests { adapters: &adapters, num_tokens: &[1; 4], holds: &bad };
    assert!(matches!(held(&mut reg, requests, &[]), Err(Error::Usage(_))));
    reg.audit().unwrap();
}

#[test]
fn each_deferred_request_says_why() {
    // Two slots, one pinned: one unpinned adapter a step.
    let mut reg = registry(2, None, "lru", &["p", "a", "b"]);
    reg.pin("p").unwrap();
    let keys: Vec<_> = ["a", "b", "p"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let (plan, ticket) = begin(&mut reg, &keys, &[1, 1, 1], false).unwrap();
    assert_eq!((plan.admitted.clone(), plan.deferred.clone()), (vec![0, 2], vec![1]));
    assert_eq!(plan.reasons, [Deferral::DeviceRoom]);
    reg.finish_step(ticket).unwrap();
}

/// The budget counts every pinned adapter, also one evicted from host memory before it was pinned
/// (a copy of the rule that read the host tier's pinned list missed those and split too coarsely).
#[test]
fn split_and_overflow_count_pins_outside_the_host_tier() {
    let mut reg = registry(3, Some(3), "lru", &["a", "b", "c", "d"]);
    assert!(!reg.stats().host.resident.contains(&"a".to_owned()), "d's registration evicted a");
    reg.pin("a").unwrap();
    let stats = reg.stats();
    assert_eq!((stats.pinned, stats.pinned_names.clone()), (1, vec!["a".to_owned()]));
    assert!(stats.host.pinned.is_empty());
    let keys: Vec<_> = ["b", "c", "d"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    assert_eq!(reg.split(&keys), [vec![0, 1], vec![2]]);
    let why = reg.overflow(&keys).unwrap();
    assert!(why.contains("3 slots minus 1 pinned leave room for 2"), "{why}");
    for group in reg.split(&keys) {
        let names: Vec<_> = group.iter().map(|&i| keys[i as usize]).collect();
        let (plan, ticket) = begin(&mut reg, &names, &vec![1; names.len()], true).unwrap();
        assert!(plan.deferred.is_empty());
        reg.finish_step(ticket).unwrap();
    }
    let with_pin = [Some(reg.lookup("a", false).unwrap()), keys[0], keys[1]];
    assert_eq!(reg.split(&with_pin), [vec![0, 1, 2]], "a pinned adapter always fits");
    reg.audit().unwrap();
}

#[test]
fn host_misses_are_what_a_step_would_read_from_disk_and_entering_them_makes_room() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    let keys: Vec<_> = ["a", "b", "c"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    assert_eq!(reg.host_misses(&keys).iter().map(|n| &**n).collect::<Vec<_>>(), ["a"]);
    // Past the budget (two slots, no pins) nothing counts: c would be deferred anyway.
    let over = [keys[1], keys[2], keys[0]];
    assert!(reg.host_misses(&over).is_empty());
    let before = reg.stats();
    let serial = reg.serial("a").unwrap();
    assert!(matches!(reg.enter_host_tier("a", serial + 100), Err(Error::AdapterNotFound { .. })));
    assert_eq!(reg.enter_host_tier("a", serial).unwrap(), ["b"]);
    assert_eq!(reg.stats().host.counters.misses, before.host.counters.misses + 1);
    assert!(reg.host_misses(&keys[..1]).is_empty());
    assert!(reg.enter_host_tier("a", serial).unwrap().is_empty(), "resident already: nothing to do");
    reg.audit().unwrap();
    // A host tier full of protected adapters refuses, and nothing changes.
    let (_, ticket) = begin(&mut reg, &[keys[0], keys[2]], &[1, 1], false).unwrap();
    let held = reg.stats();
    let b = reg.serial("b").unwrap();
    assert!(matches!(reg.enter_host_tier("b", b), Err(Error::Capacity(_))));
    assert_eq!(reg.stats().host.resident, held.host.resident);
    reg.finish_step(ticket).unwrap();
}

#[test]
fn each_answer_says_what_to_do_before_a_step_can_begin_and_changes_nothing_else() {
    // Two slots, a host tier of two adapters: registering c evicted a from it.
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    let keys: Vec<_> = ["a", "b"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let before = reg.stats();
    // Names nobody knows come first, whatever the mode.
    let unknown = vec![Arc::from("x")];
    let request =
        StepRequest { unknown: unknown.clone(), ..StepRequest::new(&keys, &[1, 1], StepMode::ReadFirst) };
    assert!(matches!(reg.begin_step(request).unwrap(), StepStart::Discover(n) if n == unknown));
    // Read first: the adapters the step would admit that are outside the host tier.
    let start = reg.begin_step(StepRequest::new(&keys, &[1, 1], StepMode::ReadFirst)).unwrap();
    assert!(matches!(start, StepStart::ReadFirst(ref n) if n == &[Arc::from("a")]), "{start:?}");
    assert_eq!(
        (reg.open_ticket(), reg.stats()),
        (None, before),
        "no answer but a begun step changes anything"
    );
    // Read in the step: the step begins and loads a from disk itself.
    let (plan, ticket) = begin(&mut reg, &keys, &[1, 1], false).unwrap();
    assert_eq!(plan.loads.iter().map(|l| (&*l.name, l.source)).next(), Some(("a", LoadSource::Disk)));
    reg.finish_step(ticket).unwrap();
    reg.audit().unwrap();
}

#[test]
fn a_whole_batch_waiting_for_fetches_hears_whether_waiting_can_help() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    let keys: Vec<_> = ["a", "b"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let whole = || StepRequest::new(&keys, &[1, 1], StepMode::Fetch).whole();
    // Its fetch starts, then is in flight: waiting for it can change the answer.
    let Ok(StepStart::Fetching { plan, progress: true }) = reg.begin_step(whole()) else { panic!("fetch a") };
    assert_eq!(plan.to_fetch.len(), 1);
    assert_eq!(plan.deferred, [0, 1]);
    assert!(matches!(reg.begin_step(whole()), Ok(StepStart::Fetching { progress: true, .. })));
    reg.fetch_done("a", plan.to_fetch[0].serial).unwrap();
    let (_, ticket) = reg.begin_step(whole()).unwrap().begun().unwrap();
    reg.finish_step(ticket).unwrap();
    // A host tier of 150 bytes holds one adapter of 100: b, which the batch keeps, leaves a's fetch
    // no room, and nothing in flight or fresh can make any.
    let mut config = Config::new(2);
    config.max_host_bytes = Some(150);
    let mut reg = Registry::new(config).unwrap();
    for n in ["a", "b"] {
        reg.register(lora(n), size(4, 100)).unwrap();
    }
    let keys: Vec<_> = ["a", "b"].iter().map(|n| Some(reg.lookup(n, false).unwrap())).collect();
    let start = reg.begin_step(StepRequest::new(&keys, &[1, 1], StepMode::Fetch).whole()).unwrap();
    assert!(
        matches!(start, StepStart::Fetching { ref plan, progress: false } if plan.to_fetch.is_empty()),
        "{start:?}"
    );
    assert!(matches!(start.begun(), Err(Error::Usage(_))));
    reg.audit().unwrap();
}
