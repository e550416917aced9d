use crate::error::Error;
use crate::registry::tiers::Tier;
use crate::registry::{AdmissionOrder, Config, Deferral, LoadSource, Registry};

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
    assert_eq!(p.slot_epochs, [1, 1]);
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

/// `subset`'s buffer, decoded: (token_perm, request_slots, seg_indptr, seg_slots).
fn decoded((bytes, words): (Vec<u8>, [usize; 4])) -> (Vec<i64>, Vec<i32>, Vec<i32>, Vec<i32>) {
    let perm = bytes[..4 * words[0]].chunks(8).map(|c| i64::from_ne_bytes(c.try_into().unwrap())).collect();
    let ints: Vec<i32> =
        bytes[4 * words[0]..].chunks(4).map(|c| i32::from_ne_bytes(c.try_into().unwrap())).collect();
    let (slots, rest) = ints.split_at(words[1]);
    let (indptr, seg_slots) = rest.split_at(words[2]);
    (perm, slots.to_vec(), indptr.to_vec(), seg_slots.to_vec())
}

#[test]
fn a_subset_is_segmented_as_a_step_of_those_requests_would_be() {
    let mut config = Config::new(2);
    config.chunk_size = Some(2);
    let mut reg = Registry::new(config).unwrap();
    for n in ["a", "b", "c"] {
        reg.register(lora(n), size(4, 100)).unwrap();
    }
    // c waits for a slot: request 3 is not admitted.
    let p = reg.plan_names(&[Some("a"), None, Some("b"), Some("c"), Some("a")], &[1; 5]).unwrap();
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([0, 1, 2, 4].as_slice(), [3].as_slice()));
    // The whole step again, with its own counts: the plan's own arrays.
    let whole = decoded(p.subset(&[0, 1, 2, 4], &[1; 4]).unwrap());
    let perm: Vec<i64> = p.token_perm.iter().map(|&t| i64::from(t)).collect();
    assert_eq!(whole, (perm, p.request_slots.clone(), p.seg_indptr.clone(), p.seg_slots.clone()));
    // Requests 4 (a, 3 tokens), 1 (base, 2) and 2 (b, 1), in that order: rows 0..3 are a's (cut at
    // the chunk size), 3..5 base, 5 b's.
    let (perm, slots, indptr, seg_slots) = decoded(p.subset(&[4, 1, 2], &[3, 2, 1]).unwrap());
    let a = p.request_slots[3];
    let b = p.request_slots[2];
    assert_eq!(slots, [a, -1, b]);
    let (first, second) = if a < b { (vec![0, 1, 2], vec![5]) } else { (vec![5], vec![0, 1, 2]) };
    assert_eq!(perm, [first, second].concat());
    assert_eq!(indptr, if a < b { vec![0, 2, 3, 4] } else { vec![0, 1, 3, 4] });
    assert_eq!(seg_slots, if a < b { vec![a, a, b] } else { vec![b, a, a] });
    // Bad sub-batches are refused by name.
    for (requests, counts) in [(&[3][..], &[1][..]), (&[0, 0], &[1, 1]), (&[0], &[0]), (&[0, 1], &[1])] {
        assert!(matches!(p.subset(requests, counts), Err(Error::Usage(_))), "{requests:?} {counts:?}");
    }
}

#[test]
fn no_waiting_request_with_an_adapter_starts_after_one_deferred_for_a_slot() {
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    // Two slots: a and b admitted, c deferred for a slot; the base request and a's second admitted.
    let p = reg.plan_names(&[Some("a"), Some("b"), Some("c"), None, Some("a")], &[1; 5]).unwrap();
    assert_eq!((p.admitted.as_slice(), p.deferred.as_slice()), ([0, 1, 3, 4].as_slice(), [2].as_slice()));
    assert_eq!(p.reasons, [Deferral::DeviceRoom]);
    // Request 0 runs; the rest wait. After c, the base request starts, a's waiting one does not.
    assert_eq!(p.startable(&[false, true, true, true, true], AdmissionOrder::Arrival).unwrap(), [0, 1, 3]);
    // A running request past the barrier goes on; with c not waiting there is no barrier.
    assert_eq!(
        p.startable(&[false, true, true, true, false], AdmissionOrder::Arrival).unwrap(),
        [0, 1, 3, 4]
    );
    assert_eq!(p.startable(&[true, true, false, true, true], AdmissionOrder::Arrival).unwrap(), [0, 1, 3, 4]);
    assert!(matches!(p.startable(&[true; 4], AdmissionOrder::Arrival), Err(Error::Usage(_))));
    // Longest remaining first holds nothing back: every admitted request starts.
    let lrpt = AdmissionOrder::LongestRemaining;
    assert_eq!(p.startable(&[false, true, true, true, true], lrpt).unwrap(), [0, 1, 3, 4]);
    assert!(matches!(p.startable(&[true; 4], lrpt), Err(Error::Usage(_))));
}
