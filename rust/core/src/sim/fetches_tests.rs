use super::*;
use crate::registry::LoadSource;
use crate::sim::tests::trace_of;
use crate::sim::trace::{Trace, Workload};
use crate::sim::{simulate, simulate_with, SimConfig};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn each_miss_waits_exactly_the_load_time_on_a_hand_worked_trace() {
    // One slot, one host place, batches of one, 20 ms steps, 50 ms reads: a b a. Registering b
    // evicted a, so every request misses: its step defers it and fetches its adapter at t, the loop
    // waits until t + 50 ms (no step), then admits it, and the next step is 20 ms later.
    // a: fetched at 0, admitted at 50; b: fetched at 70, admitted at 120; a: fetched at 140, at 190.
    let trace = trace_of(&["a", "b", "a"]);
    let config = SimConfig { batch_size: 1, max_loaded: Some(1), load_ms: 50.0, ..SimConfig::new(1, "lru") };
    let mut admitted_at = Vec::new();
    let r = simulate_with(&trace, &config, |batch, plan| {
        assert!(plan.loads.iter().all(|l| l.source == LoadSource::Host), "a disk read in a step");
        admitted_at.extend(plan.admitted.iter().map(|&i| batch[i as usize]));
    })
    .unwrap();
    assert_eq!(admitted_at, [0, 1, 2]);
    assert_eq!((r.steps, r.requests, r.host.misses), (3, 3, 3));
    let f = r.fetch;
    assert_eq!((f.fetches, f.deferred_requests), (3, 3));
    assert!(close(f.wait_ms_mean, 50.0) && close(f.wait_ms_p99, 50.0), "{f:?}");
    assert_eq!((f.wait_steps_mean, f.wait_steps_p99), (0.0, 0.0), "the waits were not steps");
}

#[test]
fn requests_for_resident_adapters_run_while_a_fetch_is_in_flight() {
    // Two slots, two host places; c was evicted by registering x (adapters are registered in
    // order of first use). Batches of two: c's request waits for its read (100 ms = 5 steps of
    // 20 ms) at the front of the queue while a's requests keep running beside it.
    let names = ["c", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "x"];
    let trace = trace_of(&names);
    let config = SimConfig { batch_size: 2, max_loaded: Some(2), load_ms: 100.0, ..SimConfig::new(2, "lru") };
    let mut first_step_admitted = Vec::new();
    let r = simulate_with(&trace, &config, |batch, plan| {
        if first_step_admitted.is_empty() {
            first_step_admitted = plan.admitted.iter().map(|&i| batch[i as usize]).collect();
        }
    })
    .unwrap();
    assert_eq!(first_step_admitted, [1], "a ran at once beside the waiting c");
    assert_eq!(r.requests, names.len() as u64);
    assert!(r.fetch.deferred_requests >= 1);
    let c_wait = r.fetch.wait_ms_p99;
    assert!(c_wait >= 100.0 - 1e-6, "c waited for its read: {c_wait} ms");
    assert!(r.fetch.wait_steps_p99 >= 5.0, "five steps ran meanwhile: {:?}", r.fetch);
}

#[test]
fn background_mode_serves_every_request_and_reads_only_by_fetches() {
    let trace = Trace::generate(Workload::parse("zipf:1.0").unwrap(), 40, 3000, 7).unwrap();
    for (slots, host, load_ms, step_seconds) in [(4, 6, 50.0, 0.02), (8, 8, 5.0, 0.0), (2, 30, 200.0, 0.001)]
    {
        let config = SimConfig {
            max_loaded: Some(host),
            load_ms,
            step_seconds,
            batch_size: 8,
            ..SimConfig::new(slots, "lru")
        };
        let r = simulate(&trace, &config).unwrap();
        assert_eq!(r.tokens, 3000);
        assert_eq!(r.host.misses, r.fetch.fetches, "every disk read is a fetch");
        // A request may wait for a fetch another one started, so less than a whole read.
        assert!(r.fetch.deferred_requests > 0 && r.fetch.wait_ms_p99 >= r.fetch.wait_ms_mean);
        assert!(r.fetch.wait_ms_p99 <= load_ms + 1e-6 || step_seconds > 0.0, "{:?}", r.fetch);
    }
    // load_ms = 0 is the blocking loop: no fetch, and the report of a config without the field.
    let blocking = SimConfig { max_loaded: Some(6), batch_size: 8, ..SimConfig::new(4, "lru") };
    let r = simulate(&trace, &blocking).unwrap();
    assert_eq!(r.fetch, FetchReport::default());
}

#[test]
fn a_negative_or_infinite_load_time_is_refused() {
    let trace = trace_of(&["a"]);
    for load_ms in [-1.0, f64::INFINITY, f64::NAN] {
        let err = simulate(&trace, &SimConfig { load_ms, ..SimConfig::new(1, "lru") }).unwrap_err();
        assert!(err.to_string().contains("load_ms"), "{err}");
    }
}

#[test]
fn the_percentile_is_the_nearest_rank() {
    assert_eq!(p99(Vec::new()), 0.0);
    assert_eq!(p99(vec![3.0]), 3.0);
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(p99(hundred), 99.0);
    let two_hundred: Vec<f64> = (1..=200).rev().map(f64::from).collect();
    assert_eq!(p99(two_hundred), 198.0);
}
