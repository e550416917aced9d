use super::*;

fn used(uses: u64, last_used: u64) -> Usage {
    Usage { inserted_at: last_used, last_used, uses, bytes: 0, rank: 8 }
}

#[test]
fn distances_fall_into_quarter_octaves() {
    assert_eq!(
        [class(0), class(1), class(2), class(3), class(4), class(5), class(7), class(8)],
        [0, 0, 4, 6, 8, 9, 11, 12]
    );
    assert_eq!(class(u64::MAX), 63 * 4 + 3);
}

#[test]
fn a_single_use_goes_before_a_reused_adapter_and_ties_go_to_the_most_recent() {
    let mut p = ReuseDistance::default();
    // a: used at 10 and 20 (IRR 10); b: used once at 30; c: used once at 31.
    p.insert(AdapterKey(0), &used(1, 10));
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &used(2, 20));
    p.insert(AdapterKey(1), &used(1, 30));
    p.insert(AdapterKey(2), &used(1, 31));
    // b and c have no measured distance; c is the more recent of the two.
    assert_eq!(p.victim(), Some(AdapterKey(2)));
    p.remove(AdapterKey(2));
    assert_eq!(p.victim(), Some(AdapterKey(1)));
    p.remove(AdapterKey(1));
    assert_eq!(p.victim(), Some(AdapterKey(0)));
    assert_eq!(p.len(), 1);
}

#[test]
fn a_short_reuse_distance_protects_until_recency_outgrows_the_others() {
    let mut p = ReuseDistance::default();
    // a: IRR 2 at time 12. b: IRR 64 at time 100 (now = 100): a's recency 88 > 64, so a goes.
    p.insert(AdapterKey(0), &used(1, 10));
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &used(2, 12));
    p.insert(AdapterKey(1), &used(1, 36));
    p.remove(AdapterKey(1));
    p.insert(AdapterKey(1), &used(2, 100));
    assert_eq!(p.victim(), Some(AdapterKey(0)));
    // With b's IRR at 256 instead, a (rank max(2, 88) = 88) stays and b goes.
    let mut q = ReuseDistance::default();
    q.insert(AdapterKey(0), &used(1, 10));
    q.remove(AdapterKey(0));
    q.insert(AdapterKey(0), &used(2, 12));
    q.insert(AdapterKey(1), &used(1, 1));
    q.remove(AdapterKey(1));
    q.insert(AdapterKey(1), &used(2, 257));
    assert_eq!(q.victim(), Some(AdapterKey(1)));
}

#[test]
fn reinsertion_without_a_new_use_keeps_the_distance() {
    let mut p = ReuseDistance::default();
    p.insert(AdapterKey(0), &used(1, 10));
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &used(2, 14));
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &used(2, 14));
    assert_eq!(p.entry(AdapterKey(0)).irr, class(4));
    // Uses that another instance saw count: 3 uses more over 30 ticks is a distance of 10.
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &used(5, 44));
    assert_eq!(p.entry(AdapterKey(0)).irr, class(10));
}

#[test]
#[should_panic(expected = "is not a candidate")]
fn removing_an_absent_key_is_a_bug() {
    ReuseDistance::default().remove(AdapterKey(1));
}
