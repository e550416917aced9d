use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::registry::Unload;
use crate::shared::SharedRegistry;

use crate::registry::testkit::*;

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
    // Most likely the waiter sleeps in the unload by now; if not, it finds the adapter drained: the
    // outcome is the same, the pause only makes the wake-up the path usually taken.
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
    assert_eq!(reg.lookup("a", false).map(|k| reg.get(k).identity.size.rank), Ok(8));
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
