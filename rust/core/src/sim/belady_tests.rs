use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

/// Exhaustive search over every schedule: after step t the resident set may be any set that holds
/// the step's adapters and the pinned ones already resident, drawn from what was resident plus the
/// step's adapters (no prefetching, but any evictions, lazy or not), of size at most `capacity`.
fn brute_force(steps: &[Vec<u32>], capacity: usize, pinned: u32, initial: u32) -> Option<u64> {
    brute_force_sized(steps, capacity, &[1; 32], pinned, initial)
}

/// [`brute_force`] where adapter `a` takes `sizes[a]` of the `capacity` places (a page pool).
fn brute_force_sized(
    steps: &[Vec<u32>],
    capacity: usize,
    sizes: &[usize],
    pinned: u32,
    initial: u32,
) -> Option<u64> {
    let held = |set: u32| (0..32).filter(|a| set & (1 << a) != 0).map(|a| sizes[a]).sum::<usize>();
    let mut best: HashMap<u32, u64> = HashMap::from([(initial, 0)]);
    for step in steps {
        let need: u32 = step.iter().map(|&a| 1 << a).sum();
        let mut next: HashMap<u32, u64> = HashMap::new();
        for (&state, &cost) in &best {
            let misses = (need & !state).count_ones() as u64;
            let pool = state | need;
            let keep = need | (state & pinned);
            let mut subset = pool;
            loop {
                if subset & keep == keep && held(subset) <= capacity {
                    let c = next.entry(subset).or_insert(u64::MAX);
                    *c = (*c).min(cost + misses);
                }
                if subset == 0 {
                    break;
                }
                subset = (subset - 1) & pool;
            }
        }
        best = next;
    }
    best.values().min().copied()
}

fn demand(steps: &[Vec<u32>]) -> Demand {
    let mut d = Demand::new();
    for s in steps {
        d.push_step(s.iter().copied());
    }
    d
}

#[test]
fn a_hand_worked_sequence() {
    // capacity 2: a b | c (evict b: a is used next) | a | b (evict c or a? c is never used again)
    let steps = [vec![0, 1], vec![2], vec![0], vec![1]];
    assert_eq!(min_misses(&demand(&steps), 2, |_| false, &[]).unwrap(), 4);
    // a b c a b c ... with 2 places: MIN keeps one of each pair, 1 hit per 2 steps after warm-up.
    let cyclic: Vec<Vec<u32>> = (0..9).map(|i| vec![i % 3]).collect();
    assert_eq!(min_misses(&demand(&cyclic), 2, |_| false, &[]).unwrap(), 6);
}

#[test]
fn pinned_adapters_take_a_place_and_stay() {
    // capacity 2, adapter 0 pinned: after its first use only one place is left for 1 and 2.
    let steps = [vec![0], vec![1], vec![2], vec![1], vec![2]];
    assert_eq!(min_misses(&demand(&steps), 2, |a| a == 0, &[]).unwrap(), 5);
    assert_eq!(min_misses(&demand(&steps), 2, |_| false, &[]).unwrap(), 3);
}

#[test]
fn a_step_that_cannot_fit_is_an_error() {
    let err = min_misses(&demand(&[vec![0], vec![1, 2]]), 2, |a| a == 0, &[]).unwrap_err();
    assert!(err.to_string().contains("step 1 uses 2 adapter(s)"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn min_matches_exhaustive_search(
        capacity in 1usize..5,
        raw in prop::collection::vec(prop::collection::btree_set(0u32..6, 1..4), 1..12),
        pinned in 0u32..64,
        initial in 0u32..64,
    ) {
        // Keep only steps that fit beside the pinned adapters already used, as admission does.
        let pinned = pinned & ((1 << (capacity - 1)) - 1) & 0b11;
        let initial = initial & ((1 << capacity) - 1) & !pinned;
        let mut steps = Vec::new();
        let mut pinned_seen = 0u32;
        for s in raw {
            let set: u32 = s.iter().map(|&a| 1 << a).sum();
            let total = (set | pinned_seen).count_ones() as usize;
            let unpinned = (set & !pinned).count_ones() as usize;
            if total <= capacity && unpinned <= capacity - pinned.count_ones() as usize {
                pinned_seen |= set & pinned;
                steps.push(s.into_iter().collect::<Vec<u32>>());
            }
        }
        let init: Vec<u32> = (0..6).filter(|a| initial & (1 << a) != 0).collect();
        let expected = brute_force(&steps, capacity, pinned, initial);
        let got = min_misses(&demand(&steps), capacity, |a| pinned & (1 << a) != 0, &init).ok();
        prop_assert_eq!(got, expected, "steps {:?} capacity {} pinned {:b} initial {:?}", steps, capacity, pinned, init);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// The paged bound never exceeds the fewest misses found by exhaustive search over every
    /// schedule of the page pool, and equals it when every adapter takes the same pages.
    #[test]
    fn the_paged_bound_is_below_the_optimum_of_the_page_pool(
        pages in 1usize..9,
        sizes in prop::collection::vec(1usize..4, 6),
        raw in prop::collection::vec(prop::collection::btree_set(0u32..6, 1..4), 1..10),
        pinned in 0u32..4,
        same in any::<bool>(),
    ) {
        let sizes: Vec<usize> = if same { vec![sizes[0]; 6] } else { sizes };
        let size_of = |set: u32| (0..6).filter(|a| set & (1 << a) != 0).map(|a| sizes[a]).sum::<usize>();
        // Keep the steps that fit beside the pinned adapters already used, as admission does.
        let pinned = if size_of(pinned) < pages { pinned } else { 0 };
        let mut steps = Vec::new();
        let mut pinned_seen = 0u32;
        for s in raw {
            let set: u32 = s.iter().map(|&a| 1 << a).sum();
            if size_of(set | pinned_seen) <= pages && size_of(set & !pinned) + size_of(pinned) <= pages {
                pinned_seen |= set & pinned;
                steps.push(s.into_iter().collect::<Vec<u32>>());
            }
        }
        prop_assume!(!steps.is_empty());
        let optimum = brute_force_sized(&steps, pages, &sizes, pinned, 0).unwrap();
        let bound = min_misses_paged(&demand(&steps), pages, |a| sizes[a as usize], |a| pinned & (1 << a) != 0)
            .unwrap();
        prop_assert!(bound <= optimum, "bound {} optimum {} steps {:?} sizes {:?}", bound, optimum, steps, sizes);
        if same {
            prop_assert_eq!(bound, optimum, "steps {:?} sizes {:?}", steps, sizes);
        }
    }
}
