use super::*;
use crate::sim::{simulate, Workload};

fn skewed(requests: usize) -> Trace {
    Trace::generate(Workload::Power(0.3), 200, requests, 3)
        .unwrap()
        .with_gamma_arrivals(600.0, 1.0, 4)
        .unwrap()
}

fn loads(report: &ClusterReport) -> u64 {
    report.replicas.iter().map(|r| r.sim.device.misses).sum()
}

#[test]
fn one_replica_makes_the_same_decisions_as_the_single_replica_replay() {
    let trace = skewed(4000);
    let config = SimConfig::new(8, "lru");
    let single = simulate(&trace, &config).unwrap();
    for router in [Router::Random, Router::LeastLoaded, Router::Affinity] {
        let cluster = simulate_replicas(&trace, &config, 1, router, 16, 0).unwrap();
        let r = &cluster.replicas[0];
        assert_eq!(r.sim.device, single.device, "{router:?}");
        assert_eq!((r.sim.uses, r.sim.steps, r.sim.deferrals), (single.uses, single.steps, single.deferrals));
        assert_eq!(r.routed, 4000);
    }
}

#[test]
fn every_request_is_served_once_by_some_replica() {
    let trace = skewed(3000);
    let config = SimConfig::new(4, "lru");
    for router in [Router::Random, Router::LeastLoaded, Router::Affinity] {
        let cluster = simulate_replicas(&trace, &config, 4, router, 16, 1).unwrap();
        let routed: u64 = cluster.replicas.iter().map(|r| r.routed).sum();
        let served: u64 = cluster.replicas.iter().map(|r| r.sim.adapter_requests).sum();
        assert_eq!((routed, served), (3000, 3000), "{router:?}");
        for r in &cluster.replicas {
            assert!(r.utilisation <= 1.0 && r.queue_mean <= r.queue_max as f64);
        }
    }
}

#[test]
fn affinity_loads_fewer_adapters_than_least_loaded_under_skew() {
    let trace = skewed(20_000);
    let config = SimConfig::new(8, "lru");
    let least = simulate_replicas(&trace, &config, 4, Router::LeastLoaded, 16, 0).unwrap();
    let affinity = simulate_replicas(&trace, &config, 4, Router::Affinity, 16, 0).unwrap();
    assert!(
        loads(&affinity) < loads(&least),
        "affinity {} vs least-loaded {}",
        loads(&affinity),
        loads(&least)
    );
}

#[test]
fn bad_cluster_settings_are_refused() {
    let trace = skewed(10);
    let config = SimConfig::new(4, "lru");
    assert!(simulate_replicas(&trace, &config, 0, Router::Affinity, 4, 0).is_err());
    assert!(simulate_replicas(&trace, &config, 2, Router::Affinity, 0, 0).is_err());
    let mut background = config.clone();
    background.load_ms = 5.0;
    assert!(simulate_replicas(&trace, &background, 2, Router::Affinity, 4, 0).is_err());
    assert!(matches!(Router::parse("round-robin"), Err(Error::Spec(m)) if m.contains("round-robin")));
}

#[test]
fn least_loaded_spreads_its_ties_over_the_replicas() {
    // At 80% of capacity queues are often equal; a fixed tie-break would load the first replica most.
    let trace = Trace::generate(Workload::Zipf(1.0), 200, 20_000, 5)
        .unwrap()
        .with_gamma_arrivals(640.0, 1.0, 6)
        .unwrap();
    let cluster = simulate_replicas(&trace, &SimConfig::new(8, "lru"), 4, Router::LeastLoaded, 4, 0).unwrap();
    let queues: Vec<f64> = cluster.replicas.iter().map(|r| r.queue_mean).collect();
    let (low, high) = queues.iter().fold((f64::MAX, 0.0f64), |(l, h), &q| (l.min(q), h.max(q)));
    assert!(high / low < 1.05, "{queues:?}");
}

#[test]
fn hash_routing_loads_least_and_queues_most() {
    let trace = skewed(20_000);
    let config = SimConfig::new(8, "lru");
    let run = |router| simulate_replicas(&trace, &config, 4, router, 4, 0).unwrap();
    let (least, affinity, hash) = (run(Router::LeastLoaded), run(Router::Affinity), run(Router::Hash));
    assert!(loads(&hash) < loads(&affinity) && loads(&affinity) < loads(&least));
    let worst = |r: &ClusterReport| r.replicas.iter().map(|x| x.queue_mean).fold(0.0, f64::max);
    assert!(worst(&hash) > worst(&affinity), "{} vs {}", worst(&hash), worst(&affinity));
    assert_eq!(Router::parse("hash").unwrap(), Router::Hash);
}
