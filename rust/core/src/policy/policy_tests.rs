use proptest::prelude::*;

use super::*;

fn usage(inserted_at: u64, last_used: u64) -> Usage {
    Usage { inserted_at, last_used, uses: 0, bytes: 0, rank: 8 }
}

#[test]
fn lru_picks_the_oldest_use_and_fifo_the_oldest_arrival() {
    let mut lru = PolicyKind::parse("policy", "lru").unwrap().build();
    let mut fifo = PolicyKind::parse("policy", "fifo").unwrap().build();
    // key 0 arrived first but was used last; key 1 arrived second and was used first.
    for p in [&mut lru, &mut fifo] {
        p.insert(AdapterKey(0), &usage(1, 9));
        p.insert(AdapterKey(1), &usage(2, 3));
        p.insert(AdapterKey(2), &usage(5, 5));
    }
    assert_eq!(lru.victim(), Some(AdapterKey(1)));
    assert_eq!(fifo.victim(), Some(AdapterKey(0)));
    lru.remove(AdapterKey(1));
    fifo.remove(AdapterKey(0));
    assert_eq!(lru.victim(), Some(AdapterKey(2)));
    assert_eq!(fifo.victim(), Some(AdapterKey(1)));
    assert_eq!((lru.len(), fifo.len()), (2, 2));
}

#[test]
fn unknown_policy_names_the_choices() {
    let err = PolicyKind::parse("eviction_policy", "lfu").unwrap_err().to_string();
    assert!(err.contains("\"lfu\"") && err.contains("\"lru\", \"fifo\""), "{err}");
}

#[test]
#[should_panic(expected = "is not a candidate")]
fn removing_an_absent_key_is_a_bug() {
    Ranked::default().remove(AdapterKey(3));
}

proptest! {
    /// Against a naive model (a list scanned for its minimum), over random inserts and removes.
    #[test]
    fn ranked_matches_a_linear_scan(ops in prop::collection::vec((0u32..12, 0u64..50, any::<bool>()), 0..200)) {
        let mut ranked = Ranked::default();
        let mut model: Vec<(u64, u32)> = Vec::new();
        for (key, score, insert) in ops {
            let present = model.iter().position(|&(_, k)| k == key);
            match (insert, present) {
                (true, None) => { ranked.insert(AdapterKey(key), score); model.push((score, key)); }
                (false, Some(i)) => { ranked.remove(AdapterKey(key)); model.remove(i); }
                _ => {}
            }
            prop_assert_eq!(ranked.first(), model.iter().min().map(|&(_, k)| AdapterKey(k)));
            prop_assert_eq!(ranked.len(), model.len());
        }
    }
}
