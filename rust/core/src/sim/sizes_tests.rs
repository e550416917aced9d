//! Adapter sizes in the replay: mixed ranks, a host tier bounded in bytes, and the bytes each tier
//! moved.

use std::collections::HashMap;

use super::*;
use crate::registry::LoadSource;

fn skewed(requests: usize) -> Trace {
    Trace::generate(Workload::Zipf(1.0), 300, requests, 11).unwrap()
}

#[test]
fn with_one_size_the_bytes_moved_are_the_misses_times_the_size() {
    let trace = skewed(6000);
    for load_ms in [0.0, 30.0] {
        let config = SimConfig { max_loaded: Some(24), load_ms, ..SimConfig::new(8, "lru") };
        let r = simulate(&trace, &config).unwrap();
        assert!(r.host.misses > 0, "load_ms {load_ms}");
        assert_eq!(r.device.bytes_moved, r.device.misses * config.adapter_bytes, "load_ms {load_ms}");
        assert_eq!(r.host.bytes_moved, r.host.misses * config.adapter_bytes, "load_ms {load_ms}");
    }
}

#[test]
fn ranks_are_drawn_by_their_weights_from_the_name_and_sized_in_proportion() {
    let names: Vec<String> = (0..6000).map(|i| format!("adapter-{i}")).collect();
    let config = SimConfig { ranks: vec![(8, 1.0), (16, 1.0), (64, 2.0)], ..SimConfig::new(4, "lru") };
    let sizes = adapter_sizes(&config, &names).unwrap();
    let share = |rank: u32| sizes.iter().filter(|s| s.rank == rank).count() as f64 / names.len() as f64;
    assert!(
        (share(8) - 0.25).abs() < 0.03 && (share(16) - 0.25).abs() < 0.03 && (share(64) - 0.5).abs() < 0.03
    );
    for s in &sizes {
        assert_eq!(s.host_bytes, config.adapter_bytes * u64::from(s.rank) / 64);
        assert_eq!(s.device_bytes, s.host_bytes);
    }
    // The rank follows the name, not its position or the other names.
    let reversed: Vec<String> = names.iter().rev().cloned().collect();
    let again = adapter_sizes(&config, &reversed).unwrap();
    assert!(again.iter().rev().zip(&sizes).all(|(a, b)| a.rank == b.rank));
}

#[test]
fn mixed_ranks_move_the_bytes_of_the_adapters_loaded_and_read() {
    let trace = skewed(6000);
    let config =
        SimConfig { ranks: vec![(8, 1.0), (64, 1.0)], max_loaded: Some(24), ..SimConfig::new(8, "lru") };
    let sizes = adapter_sizes(&config, trace.names()).unwrap();
    let by_name: HashMap<&str, u64> =
        trace.names().iter().map(String::as_str).zip(sizes.iter().map(|s| s.host_bytes)).collect();
    let (mut device, mut host) = (0u64, 0u64);
    let r = simulate_with(&trace, &config, |_, plan| {
        for load in &plan.loads {
            device += by_name[&*load.name];
            if load.source == LoadSource::Disk {
                host += by_name[&*load.name];
            }
        }
    })
    .unwrap();
    assert_eq!((r.device.bytes_moved, r.host.bytes_moved), (device, host));
    assert!(device < r.device.misses * config.adapter_bytes, "some loads were of rank 8");
}

#[test]
fn a_host_tier_bounded_in_bytes_holds_as_many_adapters_as_fit() {
    let trace = skewed(6000);
    let by_count = SimConfig { max_loaded: Some(20), ..SimConfig::new(8, "lru") };
    let by_bytes =
        SimConfig { max_host_bytes: Some(20 * by_count.adapter_bytes), ..SimConfig::new(8, "lru") };
    let mut counted = simulate(&trace, &by_count).unwrap();
    // Belady's host bound is computed for a capacity in adapters only.
    counted.host.belady_misses = None;
    assert_eq!(counted, simulate(&trace, &by_bytes).unwrap());
    // The same bytes hold more adapters when most are small: fewer reads from disk.
    let small = SimConfig { ranks: vec![(8, 3.0), (64, 1.0)], ..by_bytes.clone() };
    let large = SimConfig { ranks: vec![(64, 1.0)], ..by_bytes };
    let reads = |c: &SimConfig| simulate(&trace, c).unwrap().host.misses;
    assert!(reads(&small) < reads(&large), "{} vs {}", reads(&small), reads(&large));
}

#[test]
fn bad_rank_mixes_are_refused_naming_the_value() {
    let names = vec!["a".to_owned()];
    let err = |ranks: Vec<(u32, f64)>| {
        adapter_sizes(&SimConfig { ranks, ..SimConfig::new(2, "lru") }, &names).unwrap_err().to_string()
    };
    assert!(err(vec![(0, 1.0)]).contains("rank 0"));
    assert!(err(vec![(8, 0.0)]).contains("weight 0"));
    assert!(err(vec![(8, f64::NAN)]).contains("weight NaN"));
}
