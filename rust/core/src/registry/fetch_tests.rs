use std::sync::Arc;

use crate::error::Error;
use crate::limits::OVERDUE_AFTER;
use crate::policy::AdapterKey;
use crate::registry::testkit::*;
use crate::registry::tiers::Tier;
use crate::registry::{LoadSource, Registry, StepMode, StepPlan, StepRequest, StepTicket, Unload};

/// How a test begins its steps: the mode, and whether the batch runs whole.
type Options = (StepMode, bool);

const FETCH: Options = (StepMode::Fetch, false);
const BLOCKING: Options = (StepMode::ReadInStep, false);
const WHOLE_FETCH: Options = (StepMode::Fetch, true);

fn keys(reg: &Registry, names: &[Option<&str>]) -> Vec<Option<AdapterKey>> {
    names.iter().map(|n| n.map(|n| reg.lookup(n, false).unwrap())).collect()
}

/// Begins a fetch-mode step over `names`, one token each, and checks the invariants.
fn begin(reg: &mut Registry, names: &[Option<&str>], options: Options) -> (StepPlan, Option<StepTicket>) {
    let keys = keys(reg, names);
    let tokens = vec![1; names.len()];
    let request = StepRequest { whole: options.1, ..StepRequest::new(&keys, &tokens, options.0) };
    start(reg, request).unwrap()
}

fn fetches(p: &StepPlan) -> Vec<(&str, u64)> {
    p.to_fetch.iter().map(|f| (&*f.name, f.serial)).collect()
}

/// Two slots, a host tier of two adapters, "a" evicted from it by registering "c".
fn with_a_evicted() -> Registry {
    let reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    assert_eq!(reg.stats().host.resident, ["b", "c"]);
    reg
}

#[test]
fn fetch_mode_defers_a_host_miss_reserves_its_room_and_admits_it_once_fetched() {
    let mut reg = with_a_evicted();
    let serial = reg.serial("a").unwrap();
    let (p, ticket) = begin(&mut reg, &[Some("a"), Some("b"), None, Some("a")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([1, 2].as_slice(), [0, 3].as_slice()));
    assert_eq!(fetches(&p), [("a", serial)]);
    // The reservation evicts nobody: c leaves only once a's read has succeeded.
    assert!(p.evictions.is_empty());
    assert!(p.loads.iter().all(|l| &*l.name == "b" && l.source == LoadSource::Host));
    let stats = reg.stats();
    assert_eq!(
        (stats.host.fetching.as_slice(), stats.host.reserved_bytes),
        (["a".to_owned()].as_slice(), 100)
    );
    assert_eq!(
        (stats.host.resident.as_slice(), stats.host.used, stats.host.bytes),
        (["b".to_owned(), "c".to_owned()].as_slice(), 2, 200)
    );
    reg.finish_step(ticket.unwrap()).unwrap();
    // b ran in the step, so c is the least recently used.
    assert_eq!(reg.fetch_done("a", serial).unwrap(), [Arc::from("c")]);
    reg.audit().unwrap();
    assert_eq!(reg.stats().host.resident, ["a", "b"]);
    assert_eq!(reg.stats().host.reserved_bytes, 0);
    let (p, _) = begin(&mut reg, &[Some("a")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.to_fetch.len()), ([0].as_slice(), 0));
    assert_eq!(p.loads[0].source, LoadSource::Host, "no disk read on a step's path");
}

#[test]
fn requests_waiting_for_a_fetch_never_take_budget_from_admitted_ones() {
    // One slot: a step may use one unpinned adapter. b and c resident.
    let mut reg = registry(1, Some(2), "lru", &["a", "b", "c"]);
    let (p, _) = begin(&mut reg, &[Some("a"), Some("b"), Some("a")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([1].as_slice(), [0, 2].as_slice()));
    assert_eq!((fetches(&p).len(), evicted(&p, Tier::Host)), (1, vec![]));
}

#[test]
fn a_fetch_the_host_tier_has_no_room_for_is_retried_by_the_next_step() {
    // One host place, held by b, which an older request keeps in the step.
    let mut reg = registry(1, Some(1), "lru", &["a", "b"]);
    let (p, ticket) = begin(&mut reg, &[Some("b"), Some("a")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([0].as_slice(), [1].as_slice()));
    assert!(p.to_fetch.is_empty());
    assert_eq!(reg.stats().host.counters.refusals, 1);
    reg.report_load(ticket.unwrap(), 0, true).unwrap();
    reg.finish_step(ticket.unwrap()).unwrap();
    let (p, t) = begin(&mut reg, &[Some("a")], FETCH);
    assert_eq!((fetches(&p).len(), p.deferred.as_slice()), (1, [0].as_slice()));
    assert!(p.evictions.is_empty(), "b leaves both tiers once a's read has succeeded");
    reg.finish_step(t.unwrap()).unwrap();
    assert_eq!(reg.fetch_done("a", reg.serial("a").unwrap()).unwrap(), [Arc::from("b")]);
    assert_eq!(reg.stats().device.resident, Vec::<String>::new());
    reg.audit().unwrap();
}

#[test]
fn an_adapter_being_fetched_is_fetched_once_and_its_requests_wait() {
    let mut reg = with_a_evicted();
    let serial = reg.serial("a").unwrap();
    let (p, ticket) = begin(&mut reg, &[Some("a")], FETCH);
    assert_eq!(fetches(&p), [("a", serial)]);
    reg.finish_step(ticket.unwrap()).unwrap();
    let (p, ticket) = begin(&mut reg, &[Some("a"), Some("a")], FETCH);
    assert!(p.to_fetch.is_empty() && p.evictions.is_empty());
    assert_eq!(p.deferred, [0, 1]);
    reg.finish_step(ticket.unwrap()).unwrap();
    assert_eq!(reg.stats().host.counters.misses, 1, "one read, counted once");
}

#[test]
fn a_failed_fetch_releases_its_reservation_and_a_later_request_fetches_again() {
    let mut reg = with_a_evicted();
    let serial = reg.serial("a").unwrap();
    let (_, ticket) = begin(&mut reg, &[Some("a")], FETCH);
    reg.finish_step(ticket.unwrap()).unwrap();
    let before = reg.stats().host;
    assert!(matches!(reg.fetch_failed("a", serial + 100), Err(Error::AdapterNotFound { .. })));
    assert!(matches!(reg.fetch_done("nobody", serial), Err(Error::AdapterNotFound { .. })));
    assert_eq!(reg.stats().host, before, "refused reports change nothing");
    reg.fetch_failed("a", serial).unwrap();
    reg.audit().unwrap();
    let host = reg.stats().host;
    assert!(host.fetching.is_empty() && host.reserved_bytes == 0 && !host.resident.contains(&"a".to_owned()));
    assert!(matches!(reg.fetch_done("a", serial), Err(Error::Usage(_))), "reported twice");
    let (p, _) = begin(&mut reg, &[Some("a")], FETCH);
    assert_eq!(fetches(&p), [("a", serial)]);
}

#[test]
fn unloading_an_adapter_being_fetched_cancels_the_fetch_at_once() {
    let mut reg = with_a_evicted();
    let serial = reg.serial("a").unwrap();
    // A request acquired outside any step keeps "a" draining, but the fetch is cancelled anyway.
    let id = reg.acquire(&[Some("a")]).unwrap()[0].clone().unwrap();
    let (_, ticket) = begin(&mut reg, &[Some("a")], FETCH);
    reg.finish_step(ticket.unwrap()).unwrap();
    assert!(matches!(reg.unload("a").unwrap(), Unload::Draining { in_flight: 1, .. }));
    reg.audit().unwrap();
    let host = reg.stats().host;
    assert!(host.fetching.is_empty() && host.reserved_bytes == 0);
    // The reservation is gone, and it evicted nobody.
    assert_eq!((reg.host.count, reg.host.bytes, reg.host.reserved_count), (2, 200, 0));
    assert!(matches!(reg.fetch_done("a", serial), Err(Error::Usage(_))));
    reg.release(&[Some(&id)]).unwrap();
    assert_eq!(reg.unload("a").unwrap(), Unload::Done);
    // A new "a" is another registration: the old fetch's report is refused.
    reg.register(lora("a"), size(4, 100)).unwrap();
    assert!(matches!(reg.fetch_done("a", serial), Err(Error::AdapterNotFound { .. })));
    reg.audit().unwrap();
}

#[test]
fn a_pinned_adapter_outside_the_host_tier_is_fetched_like_the_others() {
    let mut reg = with_a_evicted();
    reg.pin("a").unwrap();
    let (p, ticket) = begin(&mut reg, &[Some("a"), Some("b")], FETCH);
    assert_eq!((p.admitted.as_slice(), fetches(&p).len()), ([1].as_slice(), 1));
    reg.finish_step(ticket.unwrap()).unwrap();
    reg.fetch_done("a", reg.serial("a").unwrap()).unwrap();
    let (p, _) = begin(&mut reg, &[Some("a"), Some("c")], FETCH);
    assert_eq!(p.admitted, [0], "c left the host tier for a; a is pinned and stays");
    assert_eq!(fetches(&p).len(), 1);
}

#[test]
fn prefetch_starts_reads_in_queue_order_and_never_evicts_the_queue_head() {
    // A host tier of two adapters, holding c and d; a and b evicted.
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c", "d"]);
    assert!(matches!(reg.prefetch(&[Some("a"), Some("zzz")]), Err(Error::AdapterNotFound { .. })));
    assert!(reg.stats().host.fetching.is_empty(), "an unknown name starts nothing");
    // The queue: d first (resident), then a twice, b, and base-model entries. a takes c's place;
    // b would need d's, but d is nearer the head of the queue.
    let p = reg.prefetch(&[None, Some("d"), Some("a"), Some("a"), None, Some("b")]).unwrap();
    reg.audit().unwrap();
    let names: Vec<&str> = p.to_fetch.iter().map(|f| &*f.name).collect();
    assert_eq!(names, ["a"]);
    assert_eq!(p.skipped.iter().map(|n| &**n).collect::<Vec<_>>(), ["b"]);
    assert_eq!(reg.stats().host.resident, ["c", "d"], "a reservation evicts nobody");
    // Fetching already: nothing more to start.
    assert!(reg.prefetch(&[Some("a")]).unwrap().to_fetch.is_empty());
    // With d no longer in the queue, b may take its place.
    let p = reg.prefetch(&[Some("b")]).unwrap();
    assert_eq!(p.to_fetch.len(), 1);
    reg.audit().unwrap();
    // The reads' reports make the room, each evicting the least recently used.
    assert_eq!(reg.fetch_done("a", reg.serial("a").unwrap()).unwrap(), [Arc::from("c")]);
    assert_eq!(reg.fetch_done("b", reg.serial("b").unwrap()).unwrap(), [Arc::from("d")]);
    reg.audit().unwrap();
}

#[test]
fn prefetch_while_a_step_is_open_leaves_the_step_alone() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    let (_, ticket) = begin(&mut reg, &[Some("b"), Some("c")], FETCH);
    let p = reg.prefetch(&[Some("a")]).unwrap();
    assert!(p.to_fetch.is_empty());
    assert_eq!(p.skipped.len(), 1);
    reg.finish_step(ticket.unwrap()).unwrap();
    // b's and c's requests run on between steps: their places are still not a fetch's to take.
    assert!(reg.prefetch(&[Some("a")]).unwrap().to_fetch.is_empty());
    // Once a plan names them no more, they are.
    let (_, ticket) = begin(&mut reg, &[None], FETCH);
    reg.finish_step(ticket.unwrap()).unwrap();
    assert_eq!(reg.prefetch(&[Some("a")]).unwrap().to_fetch.len(), 1);
}

#[test]
fn a_blocking_read_of_an_adapter_being_fetched_takes_over_its_reservation() {
    let mut reg = with_a_evicted();
    let serial = reg.serial("a").unwrap();
    assert_eq!(reg.prefetch(&[Some("a")]).unwrap().to_fetch.len(), 1);
    // A blocking step (fetch off) reads a itself: no second reservation; the room is made now.
    let (p, ticket) = begin(&mut reg, &[Some("a")], BLOCKING);
    assert_eq!(p.loads[0].source, LoadSource::Disk);
    assert_eq!(evicted(&p, Tier::Host), ["b"]);
    reg.report_load(ticket.unwrap(), 0, true).unwrap();
    reg.finish_step(ticket.unwrap()).unwrap();
    assert!(matches!(reg.fetch_done("a", serial), Err(Error::Usage(_))), "the background read is dropped");
    assert_eq!((reg.host.count, reg.host.reserved_count), (2, 0));
    reg.audit().unwrap();
    // So does enter_host_tier, the read-first path.
    let mut reg = with_a_evicted();
    reg.prefetch(&[Some("a")]).unwrap();
    assert_eq!(reg.enter_host_tier("a", serial).unwrap(), ["b"]);
    assert!(matches!(reg.fetch_failed("a", serial), Err(Error::Usage(_))));
    assert_eq!(reg.stats().host.resident, ["a", "c"]);
    reg.audit().unwrap();
}

#[test]
fn all_or_nothing_in_fetch_mode_begins_no_step_until_every_adapter_is_in_the_host_tier() {
    let mut reg = with_a_evicted();
    let serial = reg.serial("a").unwrap();
    let (p, ticket) = begin(&mut reg, &[Some("b"), Some("a"), None, Some("a")], WHOLE_FETCH);
    assert_eq!((ticket, p.deferred.as_slice()), (None, [0, 1, 2, 3].as_slice()));
    assert!(p.admitted.is_empty() && p.loads.is_empty());
    assert_eq!(fetches(&p), [("a", serial)]);
    assert_eq!(reg.in_flight("b").unwrap(), 0, "nothing acquired");
    let (p, ticket) = begin(&mut reg, &[Some("b"), Some("a")], WHOLE_FETCH);
    assert!(ticket.is_none() && p.to_fetch.is_empty(), "still fetching");
    reg.fetch_done("a", serial).unwrap();
    let (p, ticket) = begin(&mut reg, &[Some("b"), Some("a")], WHOLE_FETCH);
    assert!(ticket.is_some());
    assert_eq!(p.admitted, [0, 1]);
    // A batch over the budget is refused whole before any fetch starts.
    let mut reg = registry(1, Some(2), "lru", &["a", "b", "c"]);
    let keys = keys(&reg, &[Some("a"), Some("b")]);
    assert!(matches!(
        reg.begin_step(StepRequest::new(&keys, &[1, 1], StepMode::Fetch).whole()),
        Err(Error::Capacity(_))
    ));
    assert!(reg.stats().host.fetching.is_empty());
}

#[test]
fn fetch_mode_plans_exactly_as_blocking_mode_when_every_adapter_is_in_the_host_tier() {
    let names = [Some("a"), None, Some("b"), Some("a"), Some("c"), Some("b")];
    let mut blocking = registry(2, None, "lru", &["a", "b", "c"]);
    let mut fetching = registry(2, None, "lru", &["a", "b", "c"]);
    for step in 0..3 {
        let rotated: Vec<Option<&str>> = names.iter().cycle().skip(step).take(names.len()).copied().collect();
        let (p, t) = begin(&mut blocking, &rotated, BLOCKING);
        let (q, u) = begin(&mut fetching, &rotated, FETCH);
        assert_eq!(p, q);
        blocking.finish_step(t.unwrap()).unwrap();
        fetching.finish_step(u.unwrap()).unwrap();
    }
    assert_eq!(blocking.stats(), fetching.stats());
}

#[test]
fn a_fetched_adapter_stays_fresh_until_a_plan_admits_it_or_leaves_it_out() {
    // One slot (a step uses one unpinned adapter), two host places; x and y resident.
    let mut reg = registry(1, Some(2), "lru", &["a", "b", "x", "y"]);
    let (p, t) = begin(&mut reg, &[Some("x"), Some("a"), Some("b")], FETCH);
    assert_eq!(fetches(&p), [("a", reg.serial("a").unwrap())], "y's place goes to a; none is left for b");
    reg.finish_step(t.unwrap()).unwrap();
    assert_eq!(reg.fetch_done("a", reg.serial("a").unwrap()).unwrap(), [Arc::from("y")]);
    // x still takes the one slot, so a's requests wait again: b's fetch must not undo a's.
    let (p, t) = begin(&mut reg, &[Some("x"), Some("a"), Some("b")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([0].as_slice(), [1, 2].as_slice()));
    assert!(p.to_fetch.is_empty() && p.evictions.is_empty());
    assert!(reg.get(reg.lookup("a", false).unwrap()).protection.fresh);
    reg.finish_step(t.unwrap()).unwrap();
    // Nor may a prefetch, nor take x's place: x's request runs on between steps.
    assert!(reg.prefetch(&[Some("b")]).unwrap().to_fetch.is_empty());
    // a's turn: admitted, and fresh no more; x is named no more, so b's fetch may take its place.
    let (p, t) = begin(&mut reg, &[Some("a"), Some("b")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([0].as_slice(), [1].as_slice()));
    assert_eq!(p.to_fetch.len(), 1);
    assert!(!reg.get(reg.lookup("a", false).unwrap()).protection.fresh);
    reg.finish_step(t.unwrap()).unwrap();
    // A fetched adapter whose requests are gone is fresh only until the next plan.
    assert_eq!(reg.fetch_done("b", reg.serial("b").unwrap()).unwrap(), [Arc::from("x")]);
    assert_eq!(reg.fresh.len(), 1);
    let (_, t) = begin(&mut reg, &[Some("a")], FETCH);
    assert!(reg.fresh.is_empty());
    reg.finish_step(t.unwrap()).unwrap();
}

#[test]
fn a_whole_batch_that_cannot_begin_ends_the_freshness_of_adapters_it_leaves_out() {
    // One host place: a is fetched and fresh, then a batch that must run whole asks for b only.
    let mut reg = registry(1, Some(1), "lru", &["a", "b"]);
    let p = reg.prefetch(&[Some("a")]).unwrap();
    assert_eq!(p.to_fetch.len(), 1);
    assert_eq!(reg.fetch_done("a", reg.serial("a").unwrap()).unwrap(), [Arc::from("b")]);
    // The batch plans no step, yet it leaves a out: a stays through this plan, protected no more after.
    let (p, t) = begin(&mut reg, &[Some("b")], WHOLE_FETCH);
    assert!(t.is_none() && p.to_fetch.is_empty() && p.evictions.is_empty());
    assert!(reg.fresh.is_empty());
    // So the batch's next plan makes room with it, and b's fetch starts.
    let (p, t) = begin(&mut reg, &[Some("b")], WHOLE_FETCH);
    assert!(t.is_none());
    assert_eq!(fetches(&p), [("b", reg.serial("b").unwrap())]);
    assert!(p.evictions.is_empty());
    assert_eq!(reg.fetch_done("b", reg.serial("b").unwrap()).unwrap(), [Arc::from("a")]);
}

#[test]
fn an_overdue_request_takes_host_room_from_younger_requests_never_older_ones() {
    // Two slots and two host places: the step's adapters can hold the whole host tier.
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "x"]);
    let a_serial = reg.serial("a").unwrap();
    // a's request is older than b's and x's, but b and x hold the tier for requests of their own:
    // a waits until it is overdue, then x (the youngest) yields its place.
    for _ in 0..OVERDUE_AFTER {
        let (p, t) = begin(&mut reg, &[Some("a"), Some("b"), Some("x")], FETCH);
        assert_eq!((p.admitted.as_slice(), p.to_fetch.len()), ([1, 2].as_slice(), 0));
        reg.finish_step(t.unwrap()).unwrap();
    }
    let (p, t) = begin(&mut reg, &[Some("a"), Some("b"), Some("x")], FETCH);
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([1].as_slice(), [0, 2].as_slice()));
    assert_eq!(fetches(&p), [("a", a_serial)]);
    assert!(p.evictions.is_empty());
    reg.finish_step(t.unwrap()).unwrap();
    assert_eq!(reg.fetch_done("a", a_serial).unwrap(), [Arc::from("x")]);
    // With a's request the youngest, the older ones keep their places however long a waits.
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "x"]);
    for _ in 0..3 * OVERDUE_AFTER {
        let (p, t) = begin(&mut reg, &[Some("b"), Some("x"), Some("a")], FETCH);
        assert_eq!((p.admitted.as_slice(), p.to_fetch.len()), ([0, 1].as_slice(), 0));
        reg.finish_step(t.unwrap()).unwrap();
    }
}

#[test]
fn requests_resubmitted_in_order_all_run_although_later_ones_keep_the_tier_busy() {
    // Two slots, two host places, four adapters; every step, new requests for b and x arrive
    // behind the deferred ones, which are resubmitted first. Without the yield rule, b and x
    // would hold the host tier for ever and a and c never be fetched.
    let mut reg = registry(2, Some(2), "lru", &["a", "c", "b", "x"]);
    let mut queue: Vec<&str> = vec!["a", "c"];
    let mut served: Vec<&str> = Vec::new();
    for _ in 0..12 {
        let mut names: Vec<Option<&str>> = queue.iter().map(|&n| Some(n)).collect();
        names.extend([Some("b"), Some("x")]);
        let (p, t) = begin(&mut reg, &names, FETCH);
        let fetched: Vec<(String, u64)> = p.to_fetch.iter().map(|f| (f.name.to_string(), f.serial)).collect();
        for i in 0..p.loads.len() {
            reg.report_load(t.unwrap(), i, true).unwrap();
        }
        reg.finish_step(t.unwrap()).unwrap();
        for (name, serial) in fetched {
            reg.fetch_done(&name, serial).unwrap();
        }
        served.extend(p.admitted.iter().filter(|&&i| (i as usize) < queue.len()).map(|&i| queue[i as usize]));
        queue =
            p.deferred.iter().filter(|&&i| (i as usize) < queue.len()).map(|&i| queue[i as usize]).collect();
        reg.audit().unwrap();
    }
    assert_eq!(served, ["a", "c"]);
}
