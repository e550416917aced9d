use crate::error::Error;
use crate::registry::testkit::*;
use crate::registry::{Config, Registry};

fn bytes_registry(max_host_bytes: u64, names: &[(&str, u64)]) -> Registry {
    let mut config = Config::new(2);
    config.max_host_bytes = Some(max_host_bytes);
    let mut reg = Registry::new(config).unwrap();
    for (name, bytes) in names {
        reg.register(lora(name), size(4, *bytes)).unwrap();
    }
    reg
}

#[test]
fn a_replacement_keeps_the_registration_slot_and_pin_and_resizes_the_tiers() {
    let mut reg = registry(2, None, "lru", &["a", "b"]);
    reg.pin("a").unwrap();
    step(&mut reg, &[Some("a")]);
    let (id, serial) = (reg.lora_ref("a").unwrap().lora_id, reg.serial("a").unwrap());
    let slot = reg.placement().adapters[0].slot;
    assert!(slot.is_some());
    assert!(reg.replace("a", serial, size(8, 300)).unwrap().is_empty());
    reg.audit().unwrap();
    let place = &reg.placement().adapters[0];
    assert_eq!((&*place.id, place.serial, place.slot, place.pinned), (id.as_str(), serial, slot, true));
    assert_eq!((place.host_bytes, reg.stats().host.bytes), (300, 400));
    assert_eq!(reg.plan_names(&[Some("a")], &[1]).unwrap().slot_ranks[slot.unwrap() as usize], 8);
}

#[test]
fn a_growing_replacement_evicts_idle_adapters_and_a_refused_one_changes_nothing() {
    let mut reg = bytes_registry(300, &[("a", 100), ("b", 100), ("c", 100)]);
    let serial = reg.serial("a").unwrap();
    // a grows by 100: the least recently used other adapter (b) leaves.
    assert_eq!(reg.replace("a", serial, size(4, 200)).unwrap(), ["b"]);
    reg.audit().unwrap();
    assert_eq!(reg.stats().host.resident, ["a", "c"]);
    reg.pin("c").unwrap();
    let before = (reg.stats(), reg.placement());
    let err = reg.replace("a", serial, size(4, 250)).unwrap_err();
    assert!(matches!(err, Error::Capacity(_)), "{err}");
    assert!(err.to_string().contains("cannot replace adapter \"a\""), "{err}");
    reg.audit().unwrap();
    let after = (reg.stats(), reg.placement());
    assert_eq!(before.1, after.1);
    assert_eq!(before.0.host.resident, after.0.host.resident);
    assert_eq!(before.0.host.counters.refusals + 1, after.0.host.counters.refusals);
}

#[test]
fn a_pinned_replacement_past_the_host_bytes_is_refused() {
    let mut reg = bytes_registry(300, &[("a", 100), ("b", 100)]);
    reg.pin("a").unwrap();
    let serial = reg.serial("a").unwrap();
    assert!(matches!(reg.replace("a", serial, size(4, 301)), Err(Error::Capacity(_))));
    reg.audit().unwrap();
    assert_eq!(reg.placement().adapters[0].host_bytes, 100);
}

#[test]
fn a_replacement_of_an_evicted_adapter_brings_it_into_the_host_tier() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    assert_eq!(reg.stats().host.resident, ["b", "c"]);
    let serial = reg.serial("a").unwrap();
    assert_eq!(reg.replace("a", serial, size(4, 100)).unwrap(), ["b"]);
    reg.audit().unwrap();
    assert_eq!(reg.stats().host.resident, ["a", "c"]);
}

#[test]
fn a_replacement_ends_a_fetch_whose_report_is_then_refused() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    let serial = reg.serial("a").unwrap();
    let fetch = reg.prefetch(&[Some("a")]).unwrap();
    assert_eq!(fetch.to_fetch.len(), 1);
    assert!(reg.placement().adapters[0].fetching);
    reg.replace("a", serial, size(4, 150)).unwrap();
    reg.audit().unwrap();
    let stats = reg.stats();
    assert!(stats.host.fetching.is_empty());
    assert_eq!((stats.host.reserved_bytes, stats.host.bytes), (0, 250));
    assert!(matches!(reg.fetch_done("a", serial), Err(Error::Usage(_))));
    reg.audit().unwrap();
}

#[test]
fn a_replacement_of_another_registration_or_a_draining_adapter_is_refused() {
    let mut reg = registry(2, None, "lru", &["a", "b"]);
    let serial = reg.serial("a").unwrap();
    assert!(matches!(reg.replace("a", serial + 100, size(4, 1)), Err(Error::AdapterNotFound { .. })));
    assert!(matches!(reg.replace("a", serial, size(0, 1)), Err(Error::Spec(_))));
    reg.acquire(&[Some("a")]).unwrap();
    reg.unload("a").unwrap();
    assert!(matches!(reg.replace("a", serial, size(4, 1)), Err(Error::AdapterNotFound { .. })));
    reg.audit().unwrap();
}

#[test]
fn placement_tells_each_adapters_tier_and_counts() {
    let mut reg = registry(2, Some(2), "lru", &["a", "b", "c"]);
    step(&mut reg, &[Some("b")]);
    reg.acquire(&[Some("c"), Some("c")]).unwrap();
    let p = reg.placement();
    let tiers: Vec<(&str, bool, bool, u64)> =
        p.adapters.iter().map(|a| (&*a.name, a.slot.is_some(), a.host, a.in_flight)).collect();
    assert_eq!(tiers, [("a", false, false, 0), ("b", true, true, 0), ("c", false, true, 2)]);
    assert_eq!((p.slots, p.free_slots, p.host_bytes), (2, 1, 200));
}

#[test]
fn a_replacement_that_grows_a_pinned_adapter_past_the_room_of_another_is_refused() {
    // 300 host bytes: p (100, pinned) and q (200). Growing p to 200 would leave q 100 bytes beside
    // the pins, and q's requests would wait for ever: refused as pin would be, nothing changed.
    let mut reg = bytes_registry(300, &[("p", 100), ("q", 200)]);
    reg.pin("p").unwrap();
    let serial = reg.serial("p").unwrap();
    let before = (reg.stats(), reg.placement());
    let err = reg.replace("p", serial, size(8, 200)).unwrap_err();
    assert!(matches!(err, Error::Capacity(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("cannot replace adapter \"p\""), "{msg}");
    assert!(msg.contains("\"q\" needs 200") && msg.contains("200 of max_host_bytes=300"), "{msg}");
    reg.audit().unwrap();
    let after = (reg.stats(), reg.placement());
    assert_eq!(before.1, after.1);
    assert_eq!(before.0.host.resident, after.0.host.resident);
    assert_eq!(before.0.host.counters.refusals + 1, after.0.host.counters.refusals);
    // Growing it to what leaves q its room is accepted.
    assert_eq!(reg.replace("p", serial, size(8, 100)).unwrap(), Vec::<String>::new());
    reg.audit().unwrap();
}

#[test]
fn a_replacement_that_grows_an_unpinned_adapter_past_the_room_beside_the_pins_is_refused() {
    // p is pinned while evicted from the host tier: its 100 bytes are promised though not
    // resident, so the host tier has room for q's 250 now, but not once p is read again.
    let mut reg = bytes_registry(300, &[("p", 100), ("q", 100), ("r", 100), ("s", 100)]);
    assert_eq!(reg.stats().host.resident, ["q", "r", "s"]);
    reg.pin("p").unwrap();
    let serial = reg.serial("q").unwrap();
    let before = reg.placement();
    let err = reg.replace("q", serial, size(4, 250)).unwrap_err();
    assert!(matches!(err, Error::Capacity(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("\"q\" needs 250") && msg.contains("100 of max_host_bytes=300"), "{msg}");
    reg.audit().unwrap();
    assert_eq!(reg.placement(), before);
    assert_eq!(reg.replace("q", serial, size(4, 200)).unwrap(), ["r"]);
    reg.audit().unwrap();
}
