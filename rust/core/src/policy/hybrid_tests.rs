use super::*;
use crate::policy::ReuseDistance;

impl Hybrid {
    fn entry(&self, key: AdapterKey) -> History {
        self.history[key.index()].expect("a known key")
    }
}

fn at(inserted_at: u64, last_used: u64, uses: u64) -> Usage {
    Usage { inserted_at, last_used, uses, bytes: 0, rank: 8 }
}

/// Inserts `key` as a candidate after each of `times` (one use each), all in one stay in the tier.
fn use_at(p: &mut dyn EvictionPolicy, key: u32, times: &[u64]) {
    for (i, &t) in times.iter().enumerate() {
        if i > 0 {
            p.remove(AdapterKey(key));
        }
        p.insert(AdapterKey(key), &at(times[0], t, i as u64 + 1));
    }
}

#[test]
fn a_capped_count_outweighs_a_long_gap_until_recency_passes_eight_octaves() {
    // a: ten uses at 0..=9 (IRR 1, count capped at 4). b: uses at 100 and 164 (IRR 64, count 2).
    // Now = 164. a: max(class 0, class(155) = 28) - 8 * 4 = -4. b: max(class(64) = 24, 0) - 8 * 2 = 8.
    let mut p = Hybrid::default();
    use_at(&mut p, 0, &(0..10).collect::<Vec<_>>());
    use_at(&mut p, 1, &[100, 164]);
    assert_eq!(p.entry(AdapterKey(0)).count, 4);
    assert_eq!(p.victim(), Some(AdapterKey(1)));
    // `reuse` ranks a by its recency alone (28 > 24) and evicts it.
    let mut r = ReuseDistance::default();
    use_at(&mut r, 0, &(0..10).collect::<Vec<_>>());
    use_at(&mut r, 1, &[100, 164]);
    assert_eq!(r.victim(), Some(AdapterKey(0)));
    // The same b at 2936 and 3000: a's recency class is class(2991) = 45, 45 - 32 = 13 > 8, so a goes.
    let mut q = Hybrid::default();
    use_at(&mut q, 0, &(0..10).collect::<Vec<_>>());
    use_at(&mut q, 1, &[2936, 3000]);
    assert_eq!(q.victim(), Some(AdapterKey(0)));
}

#[test]
fn a_newcomer_goes_first_until_an_evicted_newcomer_comes_back_quickly() {
    let mut p = Hybrid::default();
    // b: uses at 0 and 64 (rank 24 - 16 = 8). x: loaded at 65, used once: no measured distance.
    use_at(&mut p, 1, &[0, 64]);
    p.insert(AdapterKey(0), &at(65, 65, 1));
    assert_eq!(p.victim(), Some(AdapterKey(0)));
    // x is evicted and reloaded at 70 for its second use, 5 ticks later (class 9 < 24): newcomers are
    // now ranked by recency, 0 - 8 for x; b (8) goes, and so it does for a newcomer never seen (z).
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &at(70, 70, 2));
    assert_eq!(p.entry(AdapterKey(0)).score, -8);
    assert_eq!(p.victim(), Some(AdapterKey(1)));
    p.insert(AdapterKey(2), &at(71, 71, 1));
    assert_eq!(p.victim(), Some(AdapterKey(1)));
}

#[test]
fn slow_returns_in_a_row_restore_the_reuse_order_for_newcomers() {
    let mut p = Hybrid::default();
    // One quick return switches newcomer protection on.
    p.insert(AdapterKey(0), &at(1, 1, 1));
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &at(2, 2, 2));
    p.remove(AdapterKey(0));
    assert_eq!(p.protect_newcomers, MEMORY);
    // MEMORY newcomers, each evicted and back 1000 ticks later (class 39 >= 24), switch it off.
    for k in 1..=MEMORY {
        let t = u64::from(k) * 10_000;
        p.insert(AdapterKey(k), &at(t, t, 1));
        p.remove(AdapterKey(k));
        p.insert(AdapterKey(k), &at(t + 1000, t + 1000, 2));
        p.remove(AdapterKey(k));
    }
    assert_eq!(p.protect_newcomers, 0);
    // b: uses at 2_000_000 and 2_000_064 (rank 8); a newcomer z at 2_000_065 again goes first.
    use_at(&mut p, 500, &[2_000_000, 2_000_064]);
    p.insert(AdapterKey(501), &at(2_000_065, 2_000_065, 1));
    assert_eq!(p.victim(), Some(AdapterKey(501)));
    assert_eq!(p.len(), 2);
}

#[test]
fn reinsertion_without_a_new_use_keeps_count_and_distance() {
    let mut p = Hybrid::default();
    use_at(&mut p, 0, &[0, 4]);
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &at(0, 4, 2));
    let h = p.entry(AdapterKey(0));
    assert_eq!((h.count, h.irr, h.score), (2, 8, 8 - 16));
    // Reloaded (a new stay in the tier) with a new use: the count starts again at 1.
    p.remove(AdapterKey(0));
    p.insert(AdapterKey(0), &at(50, 50, 3));
    assert_eq!(p.entry(AdapterKey(0)).count, 1);
}

#[test]
#[should_panic(expected = "is not a candidate")]
fn removing_an_absent_key_is_a_bug() {
    Hybrid::default().remove(AdapterKey(1));
}

proptest::proptest! {
    /// The victim has the largest rank of all candidates, ranks computed one by one from the
    /// definition, over random uses, reloads and protections.
    #[test]
    fn the_victim_has_the_largest_rank(
        ops in proptest::collection::vec((0u32..10, 1u64..300, 0u8..3), 1..200),
    ) {
        let mut p = Hybrid::default();
        let (mut now, mut state) = (0u64, vec![None::<(u64, u64, u64)>; 10]);
        for (key, step, op) in ops {
            now += step;
            let k = AdapterKey(key);
            let current = state[key as usize];
            if let Some((inserted_at, last_used, uses)) = current {
                p.remove(k);
                // 0: a use in the same stay; 1: evicted, reloaded for a use; 2: a protection round trip.
                let next = match op {
                    0 => (inserted_at, now, uses + 1),
                    1 => (now, now, uses + 1),
                    _ => (inserted_at, last_used, uses),
                };
                p.insert(k, &at(next.0, next.1, next.2));
                state[key as usize] = Some(next);
            } else {
                p.insert(k, &at(now, now, 1));
                state[key as usize] = Some((now, now, 1));
            }
            let rank = |key: usize| {
                let h = p.entry(AdapterKey(key as u32));
                let distance = h.score + WEIGHT * h.count as i64;
                distance.max(i64::from(class(p.now - h.last_used))) - WEIGHT * h.count as i64
            };
            let best = (0..10).filter(|&i| state[i].is_some()).map(rank).max();
            proptest::prop_assert_eq!(p.victim().map(|v| rank(v.index())), best);
        }
    }
}

/// `at` with `bytes`.
fn sized_at(inserted_at: u64, last_used: u64, uses: u64, bytes: u64) -> Usage {
    Usage { bytes, ..at(inserted_at, last_used, uses) }
}

#[test]
fn sized_evicts_one_big_cold_adapter_before_several_small_warm_ones() {
    // Big (8x the bytes: 3 octaves) used at 40 and 60; four small ones used at 20 and 48..=51;
    // now is 100. The oldest small one's recency (52 ticks, class 22) is just past the big one's
    // (40, class 21), so hybrid evicts it; sized, the big one's bytes (12 classes) outweigh that.
    for (policy, expected) in [(Hybrid::default(), AdapterKey(1)), (Hybrid::sized(), AdapterKey(0))] {
        let mut p = policy;
        p.insert(AdapterKey(0), &sized_at(40, 40, 1, 8 << 20));
        p.remove(AdapterKey(0));
        p.insert(AdapterKey(0), &sized_at(40, 60, 2, 8 << 20));
        for k in 1..=4u32 {
            p.insert(AdapterKey(k), &sized_at(20, 20, 1, 1 << 20));
            p.remove(AdapterKey(k));
            p.insert(AdapterKey(k), &sized_at(20, 47 + u64::from(k), 2, 1 << 20));
        }
        // Time passes to 100 (a newcomer's unknown distance would make it the victim: it is used).
        p.insert(AdapterKey(5), &sized_at(100, 100, 1, 1 << 20));
        p.remove(AdapterKey(5));
        assert_eq!(p.victim(), Some(expected), "{}", p.name());
    }
}

#[test]
fn sized_with_one_size_ranks_as_hybrid() {
    // The same uses, every adapter one size: the sized ranking is hybrid's, shifted by a constant.
    let (mut a, mut b) = (Hybrid::default(), Hybrid::sized());
    let mut seed = 7u64;
    for t in 0..400u64 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let key = AdapterKey((seed >> 33) as u32 % 12);
        for p in [&mut a, &mut b] {
            if p.history.get(key.index()).copied().flatten().is_some_and(|h| h.candidate) {
                p.remove(key);
            }
            let uses = p.history.get(key.index()).copied().flatten().map_or(1, |h| h.uses + 1);
            p.insert(key, &sized_at(0, t, uses, 4 << 20));
        }
        assert_eq!(a.victim(), b.victim(), "step {t}");
    }
}
