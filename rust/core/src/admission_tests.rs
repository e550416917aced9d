use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;

fn w(adapter: Option<u64>, waited: u64) -> Waiting {
    Waiting { adapter, waited }
}

fn slots<'a>(slots: usize, running: &'a [u64], pinned: &'a [u64], age_bound: u64) -> Slots<'a> {
    Slots { slots, running, pinned, age_bound }
}

#[test]
fn aged_oldest_first_then_pinned_then_free_then_the_rest() {
    // Four slots: 9 pinned, 5 running, two left for new adapters.
    let waiting = [
        w(Some(1), 0), // 0: needs a slot, first new adapter
        w(None, 0),    // 1: base, free
        w(Some(9), 0), // 2: pinned
        w(Some(5), 3), // 3: aged (bound 3)
        w(Some(2), 7), // 4: aged, older: first
        w(Some(5), 0), // 5: running, free
        w(Some(3), 1), // 6: needs a slot, none left (1 and 2 took them)
        w(Some(1), 2), // 7: adapter 1 was given a slot in this call
    ];
    let got = admit_waiting(&waiting, &slots(4, &[5], &[9], 3)).unwrap();
    assert_eq!(got.offered, [4, 3, 2, 1, 5, 0, 7]);
    assert_eq!(got.held, [6]);
    assert_eq!(admit_waiting(&[], &slots(1, &[], &[], 1)).unwrap(), Admission::default());
}

#[test]
fn an_aged_request_without_a_slot_drains_the_running_adapters() {
    // Two slots, both running (7, 8); 3 aged finds none: 7's and 8's requests wait, aged or not, so that
    // they finish; base and pinned ones still go. Without the drain an adapter with steady traffic
    // would keep its slot forever.
    let waiting = [
        w(Some(7), 0), // 0: running adapter, held while draining
        w(Some(3), 9), // 1: aged, no slot: drains
        w(Some(8), 5), // 2: aged too, younger than 1: held
        w(None, 0),    // 3: base: offered
        w(Some(4), 0), // 4: new adapter: held
    ];
    let got = admit_waiting(&waiting, &slots(3, &[7, 8, 8], &[1], 5)).unwrap();
    assert_eq!(got.offered, [3]);
    assert_eq!(got.held, [1, 2, 0, 4]);
    // A request older than the aged one still takes its running adapter's slot.
    let got = admit_waiting(&[w(Some(8), 10), w(Some(3), 9)], &slots(2, &[7, 8], &[], 5)).unwrap();
    assert_eq!((got.offered, got.held), (vec![0], vec![1]));
    // A request that is not aged yet and finds no slot drains nothing.
    let got = admit_waiting(&[w(Some(3), 1), w(Some(7), 0)], &slots(2, &[7, 8], &[], 5)).unwrap();
    assert_eq!((got.offered, got.held), (vec![1], vec![0]));
}

#[test]
fn bad_slots_are_refused_naming_the_numbers() {
    let refused = |s: &Slots<'_>| match admit_waiting(&[w(None, 0)], s) {
        Err(Error::Usage(msg)) => msg,
        other => panic!("{other:?}"),
    };
    assert!(refused(&slots(2, &[], &[1, 2, 2], 1)).contains("2 pinned adapters leave no slot"));
    assert!(refused(&slots(0, &[], &[], 1)).contains("slots: 0"));
    assert!(refused(&slots(2, &[], &[], 0)).contains("age bound"));
    // Running adapters that overfill the slots: nothing new, no error.
    let got = admit_waiting(&[w(Some(4), 0), w(Some(1), 0)], &slots(2, &[1, 2, 3], &[], 1)).unwrap();
    assert_eq!((got.offered, got.held), (vec![1], vec![0]));
}

#[test]
fn rank_is_aged_pinned_free_slot() {
    let ranks: Vec<u8> =
        [(false, Need::Slot), (false, Need::Free), (false, Need::Pinned), (true, Need::Slot)]
            .iter()
            .map(|&(o, n)| rank(o, n))
            .collect();
    assert_eq!(ranks, [3, 2, 1, 0]);
}

/// A scheduler over [`admit_waiting`], as vLLM runs it: each step the waiting requests (arrived, not
/// offered yet, in arrival order) are admitted, every offered one starts and runs its steps, and a
/// request's adapter is running while it runs. Checks at every step the two promises: never more
/// distinct unpinned adapters than the slots left by the pins, and an aged request that is the oldest
/// waiting is held at most `max_run - 1` steps in a row (the longest run drains by then). Returns the
/// step each request was offered at.
fn simulate(slot_count: usize, pinned: &[u64], age_bound: u64, requests: &[Arrival]) -> Vec<u64> {
    let max_run = requests.iter().map(|r| r.2).max().unwrap_or(1);
    let mut offered_at: Vec<Option<u64>> = vec![None; requests.len()];
    // Request index -> the step its run ends at (it is running at steps before it).
    let mut runs: HashMap<usize, u64> = HashMap::new();
    let mut oldest_held_since: Option<(usize, u64)> = None;
    let last_arrival = requests.iter().map(|r| r.0).max().unwrap_or(0);
    let horizon = last_arrival + (requests.len() as u64 + 1) * (age_bound + max_run) + 1;
    for step in 0..=horizon {
        runs.retain(|_, &mut end| end > step);
        let running: Vec<u64> = runs.keys().filter_map(|&r| requests[r].1).collect();
        let waiting: Vec<usize> =
            (0..requests.len()).filter(|&r| requests[r].0 <= step && offered_at[r].is_none()).collect();
        if waiting.is_empty() && requests.iter().all(|r| r.0 <= step) {
            break;
        }
        let input: Vec<Waiting> = waiting
            .iter()
            .map(|&r| Waiting { adapter: requests[r].1, waited: step - requests[r].0 })
            .collect();
        let got = admit_waiting(&input, &slots(slot_count, &running, pinned, age_bound)).unwrap();
        let mut all: Vec<u32> = got.offered.iter().chain(&got.held).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..input.len() as u32).collect::<Vec<_>>(), "offered and held split the waiting");
        let unpinned = |a: &Option<u64>| a.filter(|a| !pinned.contains(a));
        let in_slots: BTreeSet<u64> = running
            .iter()
            .map(|&a| Some(a))
            .chain(got.offered.iter().map(|&i| input[i as usize].adapter))
            .filter_map(|a| unpinned(&a))
            .collect();
        let distinct_pins = pinned.iter().collect::<BTreeSet<_>>().len();
        assert!(
            in_slots.len() <= slot_count - distinct_pins,
            "step {step}: unpinned adapters {in_slots:?} in {slot_count} slots with pins {pinned:?}"
        );
        for &i in &got.offered {
            let r = waiting[i as usize];
            offered_at[r] = Some(step);
            runs.insert(r, step + requests[r].2);
        }
        // The oldest waiting request (smallest index: requests arrive in index order).
        let Some(&oldest) = waiting.first() else { continue };
        if offered_at[oldest].is_none() && step - requests[oldest].0 >= age_bound {
            let since = match oldest_held_since {
                Some((r, since)) if r == oldest => since,
                _ => step,
            };
            assert!(
                step - since < max_run,
                "request {oldest} is aged and the oldest waiting, and held since step {since} (now {step}, \
                 runs last at most {max_run} steps)"
            );
            oldest_held_since = Some((oldest, since));
        }
    }
    offered_at.into_iter().map(|s| s.expect("every request is offered")).collect()
}

#[test]
fn a_steady_running_adapter_does_not_keep_its_slot_from_an_aged_request() {
    // One slot: adapter 1 gets a request every step, each running 3 steps; adapter 2's request arrives
    // at step 1. Once it is aged (bound 1), adapter 1's requests wait, aged or not, until 1 drains;
    // were its aged ones let in, adapter 1 would run until its traffic stops.
    let mut requests: Vec<Arrival> = (0..30).map(|s| (s, Some(1), 3)).collect();
    requests.insert(2, (1, Some(2), 1));
    let offered = simulate(1, &[], 1, &requests);
    // Aged at step 2; adapter 1's last run (started at step 1) ends at step 4.
    assert_eq!(offered[2], 4);
}

/// A request of a simulated engine loop: its arrival step, adapter (`None`: the base model) and run
/// length.
pub(super) type Arrival = (u64, Option<u64>, u64);

/// `(slots, pinned, age_bound, requests)`: a scenario for a simulated engine loop, with runs of up to
/// `max_run` steps over adapters `0..adapters` (the first pinned ones among them).
pub(super) fn scenario(
    max_run: u64,
    adapters: u64,
) -> impl Strategy<Value = (usize, Vec<u64>, u64, Vec<Arrival>)> {
    (1usize..=4, 0usize..=2, 1u64..=5, 1u64..=max_run).prop_flat_map(
        move |(free, pins, age_bound, max_run)| {
            let request = (0u64..6, prop::option::weighted(0.85, 0u64..adapters), 1u64..=max_run);
            (
                Just(free + pins),
                Just((0..pins as u64).collect::<Vec<u64>>()),
                Just(age_bound),
                prop::collection::vec(request, 0..40),
            )
                .prop_map(|(slots, pinned, age_bound, mut requests)| {
                    // Arrival steps as gaps, so requests are in arrival order.
                    let mut at = 0;
                    for r in &mut requests {
                        at += r.0 / 3;
                        r.0 = at;
                    }
                    (slots, pinned, age_bound, requests)
                })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn no_request_starves_and_the_slots_are_never_overfilled((slot_count, pinned, age_bound, requests) in scenario(6, 7)) {
        let offered = simulate(slot_count, &pinned, age_bound, &requests);
        // Base and pinned requests never wait.
        for (r, &(arrival, adapter, _)) in requests.iter().enumerate() {
            if adapter.is_none_or(|a| pinned.contains(&a)) {
                prop_assert_eq!(offered[r], arrival);
            }
        }
    }

    #[test]
    fn held_only_for_want_of_a_slot_or_while_draining(
        waiting in prop::collection::vec((prop::option::of(0u64..6), 0u64..8), 0..24),
        running in prop::collection::vec(0u64..6, 0..4),
        pins in 0u64..=2,
        extra in 1usize..=4,
        age_bound in 1u64..=6,
    ) {
        let pinned: Vec<u64> = (0..pins).collect();
        let slot_count = pins as usize + extra;
        let input: Vec<Waiting> = waiting.iter().map(|&(adapter, waited)| Waiting { adapter, waited }).collect();
        let got = admit_waiting(&input, &slots(slot_count, &running, &pinned, age_bound)).unwrap();
        // A plain model of the order: aged oldest first, then pinned, free, the rest, ties by index.
        let key = |i: u32| {
            let x = &input[i as usize];
            let aged = x.waited >= age_bound;
            let class = match x.adapter {
                _ if aged => 0,
                Some(a) if pinned.contains(&a) => 1,
                None => 2,
                Some(a) if running.contains(&a) => 2,
                Some(_) => 3,
            };
            (class, if aged { u64::MAX - x.waited } else { 0 }, i)
        };
        let mut merged: Vec<u32> = got.offered.iter().chain(&got.held).copied().collect();
        merged.sort_by_key(|&i| key(i));
        let mut offered = got.offered.clone();
        offered.sort_by_key(|&i| key(i));
        prop_assert_eq!(&offered, &got.offered, "offered in rank order");
        let free = slot_count - pins as usize
            - running.iter().filter(|a| !pinned.contains(a)).collect::<BTreeSet<_>>().len().min(extra);
        let mut new = BTreeSet::new();
        let mut draining = false;
        for i in merged {
            let x = &input[i as usize];
            let held = got.held.contains(&i);
            match x.adapter {
                None => prop_assert!(!held, "a base request is never held"),
                Some(a) if pinned.contains(&a) || new.contains(&a) => prop_assert!(!held),
                Some(a) => {
                    let is_new = !running.contains(&a);
                    if held {
                        prop_assert!(draining || (is_new && new.len() == free), "request {} held with room", i);
                    } else {
                        prop_assert!(!draining, "request {} offered while draining", i);
                        if is_new {
                            new.insert(a);
                        }
                    }
                }
            }
            draining |= held && x.waited >= age_bound;
        }
        prop_assert!(new.len() <= free);
    }
}
