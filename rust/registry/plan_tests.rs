use crate::error::Error;
use crate::registry::tiers::Tier;
use crate::registry::{Config, LoadSource, Registry};

use crate::registry::testkit::*;

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
fn host_tier_evicts_before_it_registers_and_reloads_from_disk() {
    let mut reg = registry(1, Some(2), "lru", &["a", "b"]);
    step(&mut reg, &[Some("a")]);
    reg.end_step().unwrap();
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
    reg.end_step().unwrap();
    reg.register(lora("c"), size(4, 100)).unwrap();
    let p = plan(&mut reg, &[Some("a")]);
    assert_eq!(p.loads[0].source, LoadSource::Disk);
    reg.load_failed("a").unwrap();
    assert!(!reg.stats().host.resident.contains(&"a".to_owned()));
}
