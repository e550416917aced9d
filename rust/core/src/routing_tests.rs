use proptest::prelude::*;

use super::*;

fn replica(name: &str, holding: Holding, free_slots: usize, queue: usize) -> ReplicaStats {
    ReplicaStats { name: name.into(), holding, free_slots, queue, queue_bound: 8 }
}

fn request(adapter: Option<&str>, pinned: bool, homes: usize) -> RouteRequest<'_> {
    RouteRequest { adapter, pinned, homes }
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("replica-{i}")).collect()
}

#[test]
fn device_then_host_or_fetching_then_home_with_a_free_slot_then_least_loaded() {
    let all: Vec<String> = names(6);
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let home = home_replicas("a", &refs, 1)[0];
    // Everyone else is absent; give the loads so that load order is the reverse of the rule's.
    let mut stats: Vec<ReplicaStats> = all.iter().map(|n| replica(n, Holding::Absent, 0, 0)).collect();
    let others: Vec<usize> = (0..6).filter(|&i| i != home).collect();
    stats[others[0]] = replica(&all[others[0]], Holding::Device, 0, 7);
    stats[others[1]] = replica(&all[others[1]], Holding::Host, 0, 6);
    stats[others[2]] = replica(&all[others[2]], Holding::Fetching, 0, 5);
    stats[home] = replica(&all[home], Holding::Absent, 1, 4);
    stats[others[3]] = replica(&all[others[3]], Holding::Absent, 3, 1);
    stats[others[4]] = replica(&all[others[4]], Holding::Absent, 3, 0);
    let order = rank_replicas(&request(Some("a"), false, 1), &stats).unwrap();
    assert_eq!(order, vec![others[0], others[2], others[1], home, others[4], others[3]]);
}

#[test]
fn a_home_without_a_free_slot_ranks_with_the_rest_by_load() {
    let all = names(3);
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let home = home_replicas("a", &refs, 1)[0];
    let mut stats: Vec<ReplicaStats> = all.iter().map(|n| replica(n, Holding::Absent, 2, 1)).collect();
    stats[home].free_slots = 0;
    stats[home].queue = 0;
    let order = rank_replicas(&request(Some("a"), false, 1), &stats).unwrap();
    assert_eq!(order[0], home, "least loaded among the non-homes and the full home");
    stats[home].queue = 2;
    let order = rank_replicas(&request(Some("a"), false, 1), &stats).unwrap();
    assert_eq!(*order.last().unwrap(), home);
}

#[test]
fn ties_follow_the_adapters_rendezvous_order_so_they_do_not_all_fall_on_one_replica() {
    let all = names(5);
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let stats: Vec<ReplicaStats> = all.iter().map(|n| replica(n, Holding::Absent, 2, 1)).collect();
    let mut firsts = [0usize; 5];
    for a in 0..500 {
        let adapter = format!("adapter-{a}");
        let order = rank_replicas(&request(Some(&adapter), false, 2), &stats).unwrap();
        assert_eq!(order, home_replicas(&adapter, &refs, 5), "{adapter}");
        firsts[order[0]] += 1;
    }
    assert!(firsts.iter().all(|&c| (60..140).contains(&c)), "{firsts:?}");
    // The base model and pinned adapters have no order of their own: the replicas' order.
    for req in [request(Some("a"), true, 2), request(None, false, 1)] {
        assert_eq!(rank_replicas(&req, &stats).unwrap(), vec![0, 1, 2, 3, 4]);
    }
}

#[test]
fn a_replica_at_its_queue_bound_spills_to_the_next_choice() {
    let all = names(3);
    let mut stats: Vec<ReplicaStats> = all.iter().map(|n| replica(n, Holding::Absent, 1, 0)).collect();
    stats[1].holding = Holding::Device;
    stats[1].queue = 7;
    assert_eq!(rank_replicas(&request(Some("a"), false, 1), &stats).unwrap()[0], 1);
    stats[1].queue = 8;
    let order = rank_replicas(&request(Some("a"), false, 1), &stats).unwrap();
    assert_eq!(*order.last().unwrap(), 1, "full replica last: {order:?}");
    stats[2].holding = Holding::Host;
    assert_eq!(rank_replicas(&request(Some("a"), false, 1), &stats).unwrap()[0], 2);
}

#[test]
fn pinned_adapters_and_the_base_model_are_routed_by_load_alone() {
    let all = names(4);
    let mut stats: Vec<ReplicaStats> =
        all.iter().enumerate().map(|(i, n)| replica(n, Holding::Absent, 1, 5 - i)).collect();
    stats[0].holding = Holding::Device;
    stats[1].holding = Holding::Host;
    for req in [request(Some("a"), true, 1), request(None, false, 1)] {
        assert_eq!(rank_replicas(&req, &stats).unwrap(), vec![3, 2, 1, 0]);
    }
}

#[test]
fn bad_stats_are_refused_naming_the_replica() {
    let req = request(Some("a"), false, 1);
    assert!(matches!(rank_replicas(&req, &[]), Err(Error::Spec(m)) if m.contains("no replicas")));
    let mut stats = vec![replica("r0", Holding::Absent, 1, 0), replica("r0", Holding::Absent, 1, 0)];
    let err = rank_replicas(&req, &stats).unwrap_err().to_string();
    assert!(err.contains("\"r0\" is named twice"), "{err}");
    stats[1].name = "r1".into();
    stats[1].queue_bound = 0;
    let err = rank_replicas(&req, &stats).unwrap_err().to_string();
    assert!(err.contains("\"r1\"") && err.contains("queue_bound"), "{err}");
    assert!(rank_replicas(&request(Some("a"), false, 0), &stats[..1]).is_err());
    assert!(matches!(Holding::parse("gpu"), Err(Error::Spec(m)) if m.contains("\"gpu\"")));
}

#[test]
fn replication_factor_grows_with_the_share_of_traffic() {
    assert_eq!(replication_factor(0.0, 8).unwrap(), 1);
    assert_eq!(replication_factor(0.01, 8).unwrap(), 1);
    assert_eq!(replication_factor(0.125, 8).unwrap(), 1);
    assert_eq!(replication_factor(0.2, 8).unwrap(), 2);
    assert_eq!(replication_factor(0.5, 8).unwrap(), 4);
    assert_eq!(replication_factor(1.0, 8).unwrap(), 8);
    assert!(replication_factor(1.5, 8).is_err());
    assert!(replication_factor(f64::NAN, 8).is_err());
    assert!(replication_factor(0.5, 0).is_err());
}

#[test]
fn homes_spread_evenly_over_replicas() {
    let all = names(8);
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let mut counts = [0usize; 8];
    for a in 0..8000 {
        counts[home_replicas(&format!("adapter-{a:04}"), &refs, 1)[0]] += 1;
    }
    for c in counts {
        assert!((800..1200).contains(&c), "{counts:?}");
    }
}

proptest! {
    // Each case hashes 2 x 2000 adapters; a few dozen cases cover the replica counts.
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn adding_a_replica_moves_about_one_in_n_plus_one_homes(n in 2usize..12, homes in 1usize..3) {
        let before = names(n);
        let after = names(n + 1);
        let b: Vec<&str> = before.iter().map(String::as_str).collect();
        let a: Vec<&str> = after.iter().map(String::as_str).collect();
        let adapters = 2000;
        let mut moved = 0usize;
        for i in 0..adapters {
            let name = format!("adapter-{i}");
            let mut old: Vec<usize> = home_replicas(&name, &b, homes);
            let mut new: Vec<usize> = home_replicas(&name, &a, homes);
            old.sort_unstable();
            new.sort_unstable();
            if old != new {
                // Only the new replica may join; no other home changes.
                prop_assert!(new.contains(&n));
                let kept: Vec<usize> = new.iter().copied().filter(|&r| r != n).collect();
                prop_assert!(kept.iter().all(|r| old.contains(r)));
                moved += 1;
            }
        }
        let expected = adapters as f64 * homes.min(n + 1) as f64 / (n + 1) as f64;
        let got = moved as f64;
        prop_assert!((got - expected).abs() < 0.2 * expected + 30.0, "moved {moved}, expected ~{expected}");
    }

    #[test]
    fn every_replica_is_ranked_once_and_full_ones_come_last(
        loads in prop::collection::vec((0usize..4, 0usize..3, 0usize..6), 1..10),
        pinned in any::<bool>(),
        homes in 1usize..4,
    ) {
        let holdings = [Holding::Device, Holding::Host, Holding::Fetching, Holding::Absent];
        let stats: Vec<ReplicaStats> = loads
            .iter()
            .enumerate()
            .map(|(i, &(h, free, queue))| ReplicaStats {
                name: format!("r{i}"),
                holding: holdings[h],
                free_slots: free,
                queue,
                queue_bound: 4,
            })
            .collect();
        let order = rank_replicas(&request(Some("a"), pinned, homes), &stats).unwrap();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..stats.len()).collect::<Vec<_>>());
        let full: Vec<bool> = order.iter().map(|&i| stats[i].queue >= 4).collect();
        prop_assert!(full.windows(2).all(|w| w[0] <= w[1]), "{:?}", full);
        if pinned {
            let queues: Vec<usize> =
                order.iter().filter(|&&i| stats[i].queue < 4).map(|&i| stats[i].queue).collect();
            prop_assert!(queues.windows(2).all(|w| w[0] <= w[1]));
        }
    }
}
