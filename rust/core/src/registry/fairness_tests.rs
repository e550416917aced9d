//! Age-aware admission: no request whose adapter its scheduler keeps naming waits for room past the
//! bound [`OVERDUE_AFTER`] states, whatever younger requests arrive ahead of it.

use proptest::prelude::*;

use crate::limits::OVERDUE_AFTER;
use crate::registry::testkit::*;
use crate::registry::{Deferral, Registry, StepMode, StepRequest};

/// Begins and finishes one step over `names`; returns the admitted request indices.
fn run_step(reg: &mut Registry, names: &[Option<&str>], fetch: bool) -> (Vec<u32>, Vec<Deferral>) {
    let keys: Vec<_> = names.iter().map(|n| n.map(|n| reg.lookup(n, false).unwrap())).collect();
    let mode = if fetch { StepMode::Fetch } else { StepMode::ReadInStep };
    let tokens = vec![1; names.len()];
    let (plan, ticket) = reg.begin_step(StepRequest::new(&keys, &tokens, mode)).unwrap().begun().unwrap();
    for (i, _) in plan.loads.iter().enumerate() {
        reg.report_load(ticket, i, true).unwrap();
    }
    reg.finish_step(ticket).unwrap();
    reg.audit().unwrap();
    (plan.admitted, plan.reasons)
}

#[test]
fn a_request_behind_a_steady_stream_of_younger_ones_is_admitted_in_bounded_steps() {
    // Two slots, kept busy by a and b, whose requests the scheduler puts first every step (running
    // requests before waiting ones); c's request waits at the end.
    let mut reg = registry(2, None, "lru", &["a", "b", "c"]);
    let names = [Some("a"), Some("b"), Some("a"), Some("c")];
    let mut waited = 0;
    let (admitted, reasons) = loop {
        let (admitted, reasons) = run_step(&mut reg, &names, false);
        if admitted.contains(&3) {
            break (admitted, reasons);
        }
        assert_eq!(reasons.last(), Some(&Deferral::DeviceRoom));
        waited += 1;
        assert!(waited <= OVERDUE_AFTER, "c waited {waited} steps");
    };
    assert_eq!(waited, OVERDUE_AFTER, "admitted as soon as it is overdue");
    // Its place came from b, the adapter of the youngest first request, which gave way and says so.
    assert_eq!((admitted, reasons), (vec![0, 2, 3], vec![Deferral::Fairness]));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// An adversarial arrival stream: each step, requests for random adapters arrive, and the
    /// scheduler puts a random set of young requests (fresh every step) before every request still
    /// waiting (oldest first). Each waiting request is admitted within `OVERDUE_AFTER + ceil(W / B)`
    /// steps, `W` the unpinned adapters and `B` the slots the pins leave; pins and the budget hold
    /// (the audit runs after every step).
    #[test]
    fn no_request_waits_past_the_bound(
        slots in 2usize..=5,
        extra in 1usize..=5,
        pin in any::<bool>(),
        fetch in any::<bool>(),
        steps in prop::collection::vec(
            (prop::collection::vec(0usize..10, 0..3), prop::collection::vec(0usize..10, 0..8)),
            1..50,
        ),
    ) {
        let pinned = usize::from(pin && slots >= 3);
        let count = slots + extra;
        let names: Vec<String> = (0..count).map(|i| format!("n{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut reg = registry(slots, None, "lru", &refs);
        if pinned == 1 {
            reg.pin("n0").unwrap();
        }
        let budget = slots - pinned;
        let bound = OVERDUE_AFTER as usize + (count - pinned).div_ceil(budget);
        // Waiting requests, oldest first: (adapter, steps waited).
        let mut waiting: Vec<(usize, usize)> = Vec::new();
        let mut worst = 0;
        for (arrivals, young) in &steps {
            waiting.extend(arrivals.iter().map(|&a| (a % count, 0)));
            let mut batch: Vec<Option<&str>> = young.iter().map(|&a| Some(refs[a % count])).collect();
            let first_waiting = batch.len();
            batch.extend(waiting.iter().map(|&(a, _)| Some(refs[a])));
            let (admitted, _) = run_step(&mut reg, &batch, fetch);
            let mut kept = Vec::new();
            for (at, &(a, waited)) in waiting.iter().enumerate() {
                if !admitted.contains(&((first_waiting + at) as u32)) {
                    kept.push((a, waited + 1));
                    worst = worst.max(waited + 1);
                }
            }
            waiting = kept;
            prop_assert!(worst <= bound, "a request waited {} steps (bound {})", worst, bound);
        }
    }
}
