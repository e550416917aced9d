use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::tests::{scenario, Arrival};
use super::*;

fn c(adapter: Option<u64>, waited: u64, running: bool) -> Candidate {
    Candidate { adapter, waited, running }
}

fn rotating(slots: usize, pinned: &[u64], age_bound: u64) -> Rotating<'_> {
    Rotating { slots, pinned, age_bound }
}

#[test]
fn an_aged_adapter_takes_the_slot_of_a_running_one() {
    // Three slots, 9 pinned: two for others. 5 and 6 ran in the previous step; 3 waited 4 steps (bound
    // 4): it takes a slot first, 5 (first given) keeps the other, 6's running request sits out.
    let candidates = [
        c(Some(5), 0, true),  // 0: in a slot: free
        c(Some(6), 0, true),  // 1: in a slot, but the slots are gone: suspended
        c(Some(9), 7, true),  // 2: pinned, aged too: never suspended
        c(Some(3), 4, false), // 3: aged: first
        c(None, 0, false),    // 4: base
        c(Some(6), 1, false), // 5: waiting for 6: held with it
        c(Some(3), 0, false), // 6: 3 was given a slot in this call
        c(Some(7), 0, false), // 7: needs a slot: none
    ];
    let got = admit_rotating(&candidates, &rotating(3, &[9], 4)).unwrap();
    assert_eq!(got.offered, [2, 3, 0, 4, 6]);
    assert_eq!(got.suspended, [1]);
    assert_eq!(got.held, [5, 7]);
}

#[test]
fn aged_oldest_first_running_or_waiting() {
    // One slot; 1 runs; 2 sat out 5 steps, 3 waited 6: 3 goes, 1 and 2 sit out.
    let candidates = [c(Some(1), 0, true), c(Some(2), 5, true), c(Some(3), 6, false)];
    let got = admit_rotating(&candidates, &rotating(1, &[], 2)).unwrap();
    assert_eq!((got.offered, got.suspended, got.held), (vec![2], vec![1, 0], vec![]));
}

#[test]
fn without_aged_requests_nothing_running_is_suspended() {
    // Two slots, 1 and 2 ran: 3 (not aged) waits, nothing moves. A running request that sat out one
    // step (4: its adapter lost the slot) is not in a slot: it waits like a new one.
    let candidates = [
        c(Some(1), 0, true),
        c(Some(2), 0, true),
        c(Some(4), 1, true),
        c(Some(3), 3, false),
        c(Some(1), 3, false),
    ];
    let got = admit_rotating(&candidates, &rotating(2, &[], 4)).unwrap();
    assert_eq!((got.offered, got.suspended, got.held), (vec![0, 1, 4], vec![2], vec![3]));
    // Once 3 is aged it takes the first slot; 1 was given first among the rest.
    let candidates = [c(Some(1), 0, true), c(Some(2), 0, true), c(Some(3), 4, false)];
    let got = admit_rotating(&candidates, &rotating(2, &[], 4)).unwrap();
    assert_eq!((got.offered, got.suspended, got.held), (vec![2, 0], vec![1], vec![]));
}

#[test]
fn bad_slots_are_refused_naming_the_numbers() {
    let refused = |s: &Rotating<'_>| match admit_rotating(&[c(None, 0, true)], s) {
        Err(Error::Usage(msg)) => msg,
        other => panic!("{other:?}"),
    };
    assert!(refused(&rotating(2, &[1, 2, 2], 1)).contains("admit_rotating: 2 pinned adapters leave no slot"));
    assert!(refused(&rotating(0, &[], 1)).contains("slots: 0"));
    assert!(refused(&rotating(2, &[], 0)).contains("age bound"));
    assert_eq!(admit_rotating(&[], &rotating(1, &[], 1)).unwrap(), Rotation::default());
}

/// An engine over [`admit_rotating`], as vLLM runs it with rotation: each step every request that
/// arrived and has not finished is a candidate (waiting until it is first scheduled; then running,
/// its wait the steps since it was last scheduled), every offered one is scheduled and makes one
/// token. Checks at every step:
/// - offered, held and suspended split the candidates; held ones wait, suspended ones run;
/// - base and pinned requests are always offered;
/// - at most `slots - pins` distinct unpinned adapters are offered;
/// - with no aged candidate, every request scheduled in the previous step is offered again;
/// - the bound: a candidate of an unpinned adapter waits at most `age_bound + d / (slots - pins)`
///   steps, `d` the other unpinned adapters among the candidates at the step it aged.
///
/// Returns, per request, the step it was first scheduled at.
fn simulate(slot_count: usize, pinned: &[u64], age_bound: u64, requests: &[Arrival]) -> Vec<u64> {
    let free = slot_count - pinned.iter().collect::<BTreeSet<_>>().len();
    let mut started: Vec<Option<u64>> = vec![None; requests.len()];
    let mut last: Vec<u64> = vec![0; requests.len()];
    let mut left: Vec<u64> = requests.iter().map(|r| r.2).collect();
    // Request -> the bound on its current wait, fixed at the step it aged.
    let mut bounds: HashMap<usize, u64> = HashMap::new();
    let total: u64 = left.iter().sum();
    let last_arrival = requests.iter().map(|r| r.0).max().unwrap_or(0);
    let horizon = last_arrival + (total + 1) * (age_bound + requests.len() as u64 + 1);
    let unpinned = |a: Option<u64>| a.filter(|a| !pinned.contains(a));
    for step in 0..=horizon {
        let live: Vec<usize> =
            (0..requests.len()).filter(|&r| requests[r].0 <= step && left[r] > 0).collect();
        if live.is_empty() && requests.iter().all(|r| r.0 <= step) {
            break;
        }
        let input: Vec<Candidate> = live
            .iter()
            .map(|&r| match started[r] {
                None => c(requests[r].1, step - requests[r].0, false),
                Some(_) => c(requests[r].1, step - last[r] - 1, true),
            })
            .collect();
        let got = admit_rotating(&input, &rotating(slot_count, pinned, age_bound)).unwrap();
        let mut all: Vec<u32> = got.offered.iter().chain(&got.held).chain(&got.suspended).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..input.len() as u32).collect::<Vec<_>>(), "the lists split the candidates");
        assert!(got.held.iter().all(|&i| !input[i as usize].running), "only waiting ones are held");
        assert!(got.suspended.iter().all(|&i| input[i as usize].running), "only running ones are suspended");
        let offered: BTreeSet<u32> = got.offered.iter().copied().collect();
        let in_slots: BTreeSet<u64> =
            offered.iter().filter_map(|&i| unpinned(input[i as usize].adapter)).collect();
        assert!(in_slots.len() <= free, "step {step}: {in_slots:?} in {free} free slots");
        let any_aged = input.iter().any(|x| x.waited >= age_bound);
        for (i, x) in input.iter().enumerate() {
            let r = live[i];
            if unpinned(x.adapter).is_none() {
                assert!(offered.contains(&(i as u32)), "step {step}: base or pinned request {r} not offered");
                continue;
            }
            if !any_aged && x.running && x.waited == 0 {
                assert!(offered.contains(&(i as u32)), "step {step}: request {r} suspended with none aged");
            }
            if x.waited == age_bound {
                let others: BTreeSet<u64> = input
                    .iter()
                    .filter_map(|y| unpinned(y.adapter))
                    .filter(|&a| Some(a) != x.adapter)
                    .collect();
                bounds.insert(r, age_bound + others.len() as u64 / free as u64);
            }
            if x.waited >= age_bound {
                let bound = bounds[&r];
                assert!(x.waited <= bound, "step {step}: request {r} waited {} (bound {bound})", x.waited);
            }
        }
        for &i in &got.offered {
            let r = live[i as usize];
            started[r].get_or_insert(step);
            last[r] = step;
            left[r] -= 1;
        }
    }
    assert!(left.iter().all(|&l| l == 0), "every request finishes");
    started.into_iter().map(|s| s.expect("every request starts")).collect()
}

#[test]
fn a_long_running_adapter_yields_its_slot_and_gets_it_back() {
    // One slot: adapter 1's request needs 20 steps; adapter 2's arrives at step 1 and needs 2. With
    // bound 2, 2 is aged at step 3 and starts there (draining would have waited 20 steps); 1's request
    // sits out and comes back once 2 finishes.
    let offered = simulate(1, &[], 2, &[(0, Some(1), 20), (1, Some(2), 2)]);
    assert_eq!(offered, [0, 3]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn rotation_keeps_pins_slots_and_the_wait_bound((slot_count, pinned, age_bound, requests) in scenario(8, 8)) {
        let started = simulate(slot_count, &pinned, age_bound, &requests);
        for (r, &(arrival, adapter, _)) in requests.iter().enumerate() {
            if adapter.is_none_or(|a| pinned.contains(&a)) {
                prop_assert_eq!(started[r], arrival, "base and pinned requests start on arrival");
            }
        }
    }

    #[test]
    fn each_candidate_left_out_found_the_slots_full(
        candidates in prop::collection::vec((prop::option::of(0u64..6), 0u64..8, any::<bool>()), 0..24),
        pins in 0u64..=2,
        extra in 1usize..=4,
        age_bound in 1u64..=6,
    ) {
        let pinned: Vec<u64> = (0..pins).collect();
        let free = extra;
        let input: Vec<Candidate> = candidates.iter().map(|&(a, w, r)| c(a, w, r)).collect();
        let got = admit_rotating(&input, &rotating(pins as usize + extra, &pinned, age_bound)).unwrap();
        // A plain model of the order: aged oldest first, pinned, base or in a slot, the rest; ties by index.
        let in_slot: BTreeSet<u64> =
            input.iter().filter(|x| x.running && x.waited == 0).filter_map(|x| x.adapter).collect();
        let key = |i: u32| {
            let x = &input[i as usize];
            let aged = x.waited >= age_bound;
            let class = match x.adapter {
                _ if aged => 0,
                Some(a) if pinned.contains(&a) => 1,
                None => 2,
                Some(a) if in_slot.contains(&a) => 2,
                Some(_) => 3,
            };
            (class, if aged { u64::MAX - x.waited } else { 0 }, i)
        };
        let mut merged: Vec<u32> = got.offered.iter().chain(&got.held).chain(&got.suspended).copied().collect();
        merged.sort_by_key(|&i| key(i));
        for list in [&got.offered, &got.held, &got.suspended] {
            let mut sorted = list.clone();
            sorted.sort_by_key(|&i| key(i));
            prop_assert_eq!(&sorted, list, "each list in rank order");
        }
        let mut given = BTreeSet::new();
        for i in merged {
            let x = &input[i as usize];
            let offered = got.offered.contains(&i);
            match x.adapter {
                None => prop_assert!(offered, "a base request is always offered"),
                Some(a) if pinned.contains(&a) => prop_assert!(offered, "a pinned one is always offered"),
                Some(a) if offered => {
                    given.insert(a);
                }
                Some(a) => prop_assert!(
                    !given.contains(&a) && given.len() == free,
                    "request {} left out with its adapter given or a slot free", i
                ),
            }
            if !offered {
                prop_assert_eq!(got.suspended.contains(&i), x.running);
            }
        }
        prop_assert!(given.len() <= free);
    }
}
