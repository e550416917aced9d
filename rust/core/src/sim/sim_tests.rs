use std::collections::{HashMap, HashSet, VecDeque};

use proptest::prelude::*;

use super::*;
use crate::policy::{PolicyKind, POLICY_NAMES};
use crate::registry::{AdapterSize, AdmissionOrder, Config, Registry, StepMode, StepPlan, StepRequest};
use crate::shared::SharedRegistry;

/// One request of one token per name, no arrival times; adapters named in first-use order.
pub(super) fn trace_of(names: &[&str]) -> Trace {
    let mut all: Vec<String> = Vec::new();
    for n in names {
        if !all.iter().any(|a| a == n) {
            all.push((*n).to_owned());
        }
    }
    let requests = names
        .iter()
        .map(|n| Request {
            adapter: all.iter().position(|a| a == n).map(|i| i as u32),
            tokens: 1,
            arrival: None,
        })
        .collect();
    Trace::new(all, requests).unwrap()
}

#[test]
fn each_policy_on_a_hand_worked_trace() {
    // Two slots, one request per step: a b a c b a.
    // lru:   a- b- a+ c-(evicts b) b-(evicts a) a-(evicts c)  -> 1 hit
    // fifo:  a- b- a+ c-(evicts a) b+ a-(evicts b)             -> 2 hits
    // reuse: a- b- a+ c-(evicts b: used once, a has a reuse distance) b-(evicts c, used once) a+ -> 2 hits
    // belady: a- b- a+ c-(evicts either) then one of b/a hits  -> 2 hits
    let trace = trace_of(&["a", "b", "a", "c", "b", "a"]);
    for (policy, hits) in [("lru", 1), ("fifo", 2), ("reuse", 2)] {
        let config = SimConfig { batch_size: 1, ..SimConfig::new(2, policy) };
        let r = simulate(&trace, &config).unwrap();
        assert_eq!((r.device.hits, r.uses, r.steps), (hits, 6, 6), "{policy}");
        assert_eq!(r.device.misses, 6 - hits, "{policy}");
        assert_eq!(r.device.belady_misses, Some(4), "{policy}");
        assert_eq!(r.device.bytes_moved, (6 - hits) * config.adapter_bytes);
    }
}

#[test]
fn a_cyclic_sweep_defeats_lru_and_fifo_but_not_reuse() {
    // Three slots, batches of one, a b c d e repeated: LRU and FIFO always evict what comes next.
    let names: Vec<&str> = ["a", "b", "c", "d", "e"].iter().cycle().take(50).copied().collect();
    let trace = trace_of(&names);
    let hits = |p: &str| simulate(&trace, &SimConfig { batch_size: 1, ..SimConfig::new(3, p) }).unwrap();
    assert_eq!(hits("lru").device.hits, 0);
    assert_eq!(hits("fifo").device.hits, 0);
    let reuse = hits("reuse");
    let belady = 50 - reuse.device.belady_misses.unwrap();
    assert!(reuse.device.hits >= belady * 3 / 4, "reuse {} vs belady {belady}", reuse.device.hits);
}

#[test]
fn deferred_requests_wait_at_the_front_and_count_once_per_step() {
    // One slot: a b a b in one batch of 4 admits a's two requests, defers b's; b runs next step.
    let trace = trace_of(&["a", "b", "a", "b"]);
    let mut batches = Vec::new();
    let r = simulate_with(&trace, &SimConfig { batch_size: 4, ..SimConfig::new(1, "lru") }, |batch, plan| {
        batches.push((batch.to_vec(), plan.admitted.clone(), plan.deferred.clone()));
    })
    .unwrap();
    assert_eq!(batches, [(vec![0, 1, 2, 3], vec![0, 2], vec![1, 3]), (vec![1, 3], vec![0, 1], vec![])]);
    assert_eq!((r.steps, r.deferrals, r.requests, r.tokens, r.uses), (2, 2, 4, 4, 2));
    assert_eq!(r.worst_wait, 1, "b's requests each waited one step");
}

#[test]
fn the_worst_wait_is_reported_and_bounded() {
    // One slot, batches of 4 over a steady mix of three adapters: every request waits for its turn.
    let names: Vec<&str> = (0..60).map(|i| ["a", "b", "c"][(i * 7 / 3) % 3]).collect();
    let r =
        simulate_with(&trace_of(&names), &SimConfig { batch_size: 4, ..SimConfig::new(1, "lru") }, |_, _| {})
            .unwrap();
    assert!(r.worst_wait >= 1, "{r:?}");
    // One slot, no pins: at most OVERDUE_AFTER + 3 adapters' turns.
    assert!(r.worst_wait <= u64::from(crate::limits::OVERDUE_AFTER) + 3, "{r:?}");
}

#[test]
fn simulate_until_stops_when_asked_and_otherwise_reports_as_simulate() {
    let trace = trace_of(&["a", "b", "c", "a", "b", "c", "a", "b"]);
    let config = SimConfig { batch_size: 2, ..SimConfig::new(2, "lru") };
    let mut steps = 0;
    let stopped = simulate_until(&trace, &config, |_, _| {
        steps += 1;
        if steps == 2 {
            std::ops::ControlFlow::Break("stop")
        } else {
            std::ops::ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!((stopped, steps), (std::ops::ControlFlow::Break("stop"), 2));
    let full = simulate_until(&trace, &config, |_, _| std::ops::ControlFlow::<()>::Continue(())).unwrap();
    assert_eq!(full, std::ops::ControlFlow::Continue(simulate(&trace, &config).unwrap()));
}

#[test]
fn arrivals_pace_the_steps() {
    // Steps of 1 s: the second request (t=0.5) joins the step at t=1, the third (t=10) waits alone.
    let at = |t: f64| Request { adapter: Some(0), tokens: 1, arrival: Some(t) };
    let trace = Trace::new(vec!["a".into()], vec![at(0.0), at(0.5), at(0.7), at(10.0)]).unwrap();
    let mut sizes = Vec::new();
    let config = SimConfig { step_seconds: 1.0, ..SimConfig::new(2, "lru") };
    simulate_with(&trace, &config, |batch, _| sizes.push(batch.len())).unwrap();
    assert_eq!(sizes, [1, 2, 1]);
}

#[test]
fn configuration_errors_name_the_value() {
    let trace = trace_of(&["a", "b"]);
    let err = |c: SimConfig| simulate(&trace, &c).unwrap_err().to_string();
    assert!(err(SimConfig { batch_size: 0, ..SimConfig::new(2, "lru") }).contains("batch_size"));
    assert!(err(SimConfig::new(2, "lfu")).contains("\"lfu\" is not an eviction policy"));
    assert!(err(SimConfig { pins: vec!["zz".into()], ..SimConfig::new(2, "lru") }).contains("\"zz\""));
    let two_pins = SimConfig { pins: vec!["a".into(), "b".into()], ..SimConfig::new(2, "lru") };
    assert!(err(two_pins).contains("cannot pin adapter \"b\""));
    assert!(err(SimConfig { max_loaded: Some(1), ..SimConfig::new(2, "lru") }).contains("max_loaded_loras"));
}

#[test]
fn jsonl_traces_are_read_with_errors_that_name_the_line() {
    let t = Trace::from_jsonl(
        "{\"adapter\": \"x\", \"tokens\": 3}\n\n{\"adapter\": null, \"tokens\": 1, \"arrival\": 0.5}\n{\"adapter\": \"y\", \"tokens\": 2}\n",
        "t.jsonl",
    )
    .unwrap();
    assert_eq!(t.names(), ["x", "y"]);
    assert_eq!(t.requests()[1], Request { adapter: None, tokens: 1, arrival: Some(0.5) });
    for (text, expected) in [
        ("{\"adapter\": \"x\"", "t.jsonl:1: not valid JSON"),
        ("[1]", "t.jsonl:1: expected a JSON object"),
        ("{\"adapter\": \"x\", \"tokens\": 1, \"lora\": 2}", "unknown field \"lora\""),
        ("{\"tokens\": 1}", "field \"adapter\" is missing"),
        ("{\"adapter\": 3, \"tokens\": 1}", "\"adapter\" must be a string or null"),
        ("{\"adapter\": \"x\", \"tokens\": -1}", "\"tokens\" must be an integer"),
        ("{\"adapter\": \"x\", \"tokens\": 1, \"arrival\": 2}\n{\"adapter\": \"x\", \"tokens\": 1, \"arrival\": 1}", "request 1 arrives at 1"),
    ] {
        let err = Trace::from_jsonl(text, "t.jsonl").unwrap_err().to_string();
        assert!(err.contains(expected), "{err:?} lacks {expected:?}");
    }
}

#[test]
fn trace_files_are_read_only_when_regular_and_bounded() {
    let dir = std::env::temp_dir().join(format!("lora_pin_trace_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("t.jsonl");
    std::fs::write(&good, "{\"adapter\": \"x\", \"tokens\": 3}\n").unwrap();
    assert_eq!(Trace::from_file(good.to_str().unwrap()).unwrap().names(), ["x"]);
    let big = dir.join("big.jsonl");
    std::fs::File::create(&big).unwrap().set_len(super::trace::MAX_TRACE_FILE_BYTES + 1).unwrap(); // sparse
    let err = |file: &str| Trace::from_file(file).unwrap_err().to_string();
    assert!(err(big.to_str().unwrap()).contains("is larger than"));
    assert!(err("/dev/zero").contains("is not a regular file"));
    assert!(err(dir.to_str().unwrap()).contains("is not a regular file"));
    assert!(err(dir.join("missing").to_str().unwrap()).contains("cannot read the trace file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generators_are_deterministic_and_shaped_as_documented() {
    let a = Trace::generate(Workload::Zipf(1.2), 16, 5000, 7).unwrap();
    assert_eq!(a, Trace::generate(Workload::Zipf(1.2), 16, 5000, 7).unwrap());
    assert_ne!(a, Trace::generate(Workload::Zipf(1.2), 16, 5000, 8).unwrap());
    assert_eq!(a.most_requested(2), ["adapter-000", "adapter-001"]);
    let scan = Trace::generate(Workload::Scan, 3, 7, 0).unwrap();
    let order: Vec<_> = scan.requests().iter().map(|r| r.adapter.unwrap()).collect();
    assert_eq!(order, [0, 1, 2, 0, 1, 2, 0]);
    // Shifting: the hottest adapter of the last tenth is not the hottest of the first tenth.
    let s = Trace::generate(Workload::Shifting, 10, 10_000, 1).unwrap();
    let hottest = |part: &[Request]| {
        let mut c = [0; 10];
        part.iter().for_each(|r| c[r.adapter.unwrap() as usize] += 1);
        (0..10).max_by_key(|&i| c[i]).unwrap()
    };
    assert_eq!(hottest(&s.requests()[..1000]), 0);
    assert_eq!(hottest(&s.requests()[9000..]), 9);
    let u = Trace::generate(Workload::Uniform, 4, 4000, 3).unwrap();
    assert!(u.requests().iter().all(|r| r.adapter.unwrap() < 4 && r.tokens == 1));
    for bad in ["zipf", "zipf:0", "zipf:x", "lru"] {
        assert!(Workload::parse(bad).is_err(), "{bad}");
    }
    assert_eq!(Workload::parse("zipf:1.5").unwrap().label(), "zipf:1.5");
}

/// The live path, written independently of the simulator: a [`SharedRegistry`] (what the Python
/// `LoRARegistry` wraps) driven the way `LoRAManager` drives it — begin a step over the names (plan
/// and acquire at once), report each load done, finish the step — with deferred requests run again first.
fn live_plans(trace: &Trace, config: &SimConfig) -> Vec<StepPlan> {
    let mut rc = Config::new(config.slots);
    rc.max_loaded = config.max_loaded;
    rc.device_policy = PolicyKind::parse("policy", &config.policy).unwrap();
    rc.host_policy = rc.device_policy;
    let live = SharedRegistry::new(Registry::new(rc).unwrap());
    let size = AdapterSize {
        rank: 16,
        host_bytes: config.adapter_bytes,
        device_bytes: config.adapter_bytes,
        scaling: 1.0,
    };
    let pinned: HashSet<&String> = config.pins.iter().collect();
    let mut order: Vec<&String> = trace.names().iter().filter(|n| pinned.contains(n)).collect();
    order.extend(trace.names().iter().filter(|n| !pinned.contains(n)));
    for n in order {
        live.lock().register(sim_ref(n, pinned.contains(n)).unwrap(), size).unwrap();
    }
    let name = |i: u32| trace.requests()[i as usize].adapter.map(|a| trace.names()[a as usize].as_str());
    let mut waiting: VecDeque<u32> = VecDeque::new();
    let mut next = 0u32;
    let mut plans = Vec::new();
    while (next as usize) < trace.requests().len() || !waiting.is_empty() {
        while waiting.len() < config.batch_size && (next as usize) < trace.requests().len() {
            waiting.push_back(next);
            next += 1;
        }
        let batch: Vec<u32> = waiting.drain(..).collect();
        let names: Vec<Option<&str>> = batch.iter().map(|&i| name(i)).collect();
        let tokens: Vec<u32> = batch.iter().map(|&i| trace.requests()[i as usize].tokens).collect();
        let keys: Vec<_> = names.iter().map(|n| n.map(|n| live.lock().lookup(n, false).unwrap())).collect();
        let request = StepRequest::new(&keys, &tokens, StepMode::ReadInStep);
        let (plan, ticket) = live.lock().begin_step(request).unwrap().begun().unwrap();
        for index in 0..plan.loads.len() {
            live.lock().report_load(ticket, index, true).unwrap();
        }
        live.finish_step(ticket).unwrap();
        live.lock().audit().unwrap();
        waiting.extend(plan.deferred.iter().map(|&d| batch[d as usize]));
        plans.push(plan);
    }
    plans
}

#[test]
fn the_simulator_and_the_live_registry_make_the_same_decisions() {
    let trace = Trace::generate(Workload::Zipf(0.9), 24, 3000, 11).unwrap();
    let pins = trace.most_requested(2);
    for policy in POLICY_NAMES {
        for (slots, max_loaded, batch) in [(4, None, 6), (6, Some(9), 8), (3, Some(3), 2)] {
            let config = SimConfig {
                max_loaded,
                pins: if slots > 3 { pins.clone() } else { Vec::new() },
                batch_size: batch,
                ..SimConfig::new(slots, policy)
            };
            let mut simulated = Vec::new();
            simulate_with(&trace, &config, |_, plan| simulated.push(plan.clone())).unwrap();
            let live = live_plans(&trace, &config);
            assert_eq!(simulated.len(), live.len(), "{policy} {slots}");
            for (t, (s, l)) in simulated.iter().zip(&live).enumerate() {
                assert_eq!(s, l, "{policy}, {slots} slots, step {t}");
            }
            assert!(simulated.iter().any(|p| !p.evictions.is_empty()), "the test must evict");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    /// Whatever the workload, policy and sizes: no pinned adapter is ever evicted from either tier,
    /// each is loaded into a slot at most once, and no policy beats Belady's bound.
    #[test]
    fn pinned_adapters_are_never_evicted(
        workload in prop::sample::select(vec!["zipf:1.1", "uniform", "shifting", "bursty", "scan"]),
        policy in prop::sample::select(POLICY_NAMES.to_vec()),
        slots in 2usize..6,
        pins in 0usize..5,
        extra_host in prop::option::of(0usize..4),
        batch in 1usize..7,
        seed in 0u64..1000,
    ) {
        let trace = Trace::generate(Workload::parse(workload).unwrap(), 12, 400, seed).unwrap();
        let pins = trace.most_requested(pins.min(slots - 1));
        let config = SimConfig {
            max_loaded: extra_host.map(|e| slots + e),
            pins: pins.clone(),
            batch_size: batch,
            ..SimConfig::new(slots, policy)
        };
        let mut loads: HashMap<String, u32> = HashMap::new();
        let mut bad = Vec::new();
        let r = simulate_with(&trace, &config, |_, plan| {
            bad.extend(plan.evictions.iter().filter(|e| pins.iter().any(|p| **p == *e.name)).map(|e| e.name.to_string()));
            for l in plan.loads.iter().filter(|l| pins.iter().any(|p| **p == *l.name)) {
                *loads.entry(l.name.to_string()).or_default() += 1;
            }
        }).unwrap();
        prop_assert!(bad.is_empty(), "pinned adapters evicted: {:?}", bad);
        prop_assert!(loads.values().all(|&n| n == 1), "pinned adapters loaded twice: {:?}", loads);
        prop_assert!(r.device.misses >= r.device.belady_misses.unwrap());
        if let Some(b) = r.host.belady_misses {
            prop_assert!(r.host.misses >= b);
        }
        prop_assert_eq!(r.device.hits + r.device.misses, r.uses);
    }
}

#[test]
fn power_workload_matches_the_inverse_cdf_of_numpy_power() {
    // P(id < k) = P(x < k / n) = (k / n)^alpha for numpy's power(alpha).
    let n = 100;
    let t = Trace::generate(Workload::parse("power:0.3").unwrap(), n, 200_000, 5).unwrap();
    for k in [1usize, 10, 50] {
        let below = t.requests().iter().filter(|r| (r.adapter.unwrap() as usize) < k).count();
        let want = (k as f64 / n as f64).powf(0.3);
        let got = below as f64 / 200_000.0;
        assert!((got - want).abs() < 0.01, "k={k}: {got} vs {want}");
    }
    let u = Trace::generate(Workload::Power(1.0), 4, 40_000, 1).unwrap();
    let zeros = u.requests().iter().filter(|r| r.adapter == Some(0)).count();
    assert!((9_000..11_000).contains(&zeros), "{zeros}");
    assert!(Workload::parse("power:0").is_err());
    assert_eq!(Workload::parse("power:0.5").unwrap().label(), "power:0.5");
}

#[test]
fn gamma_arrivals_have_the_asked_rate_and_coefficient_of_variation() {
    for cv in [0.5, 1.0, 3.0] {
        let t = Trace::generate(Workload::Uniform, 4, 100_000, 2)
            .unwrap()
            .with_gamma_arrivals(50.0, cv, 9)
            .unwrap();
        let times: Vec<f64> = t.requests().iter().map(|r| r.arrival.unwrap()).collect();
        let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((mean * 50.0 - 1.0).abs() < 0.05, "cv {cv}: mean gap {mean}");
        assert!((var.sqrt() / mean - cv).abs() < 0.08 * cv, "cv {cv}: got {}", var.sqrt() / mean);
    }
    let t = Trace::generate(Workload::Uniform, 4, 10, 2).unwrap();
    assert!(t.with_gamma_arrivals(0.0, 1.0, 0).is_err());
}

/// Requests `(adapter, tokens)`, none with an arrival time.
fn decode_trace(requests: &[(&str, u32)]) -> Trace {
    let mut names: Vec<String> = Vec::new();
    for (n, _) in requests {
        if !names.iter().any(|a| a == n) {
            names.push((*n).to_owned());
        }
    }
    let requests = requests
        .iter()
        .map(|(n, tokens)| Request {
            adapter: names.iter().position(|a| a == n).map(|i| i as u32),
            tokens: *tokens,
            arrival: None,
        })
        .collect();
    Trace::new(names, requests).unwrap()
}

#[test]
fn decoding_requests_hold_their_adapter_for_their_steps() {
    // One slot: a runs its 3 steps while b waits (deferred 3 times), then b runs its 2.
    let trace = decode_trace(&[("a", 3), ("b", 2)]);
    let config = SimConfig { batch_size: 8, decode: true, ..SimConfig::new(1, "lru") };
    let r = simulate(&trace, &config).unwrap();
    assert_eq!((r.steps, r.deferrals, r.worst_wait, r.tokens), (5, 3, 3, 5));
    assert_eq!((r.device.misses, r.device.hits, r.uses, r.adapter_requests), (2, 3, 5, 2));
    // Served whole, each takes one step: b waits one.
    let whole = simulate(&trace, &SimConfig { decode: false, ..config }).unwrap();
    assert_eq!((whole.steps, whole.deferrals, whole.tokens), (2, 1, 5));
}

#[test]
fn running_requests_come_first_and_the_batch_bounds_them_with_the_waiting() {
    // Two slots, batches of 2: a and b start together; c joins only when one of them ends.
    let trace = decode_trace(&[("a", 2), ("b", 4), ("c", 1)]);
    let config = SimConfig { batch_size: 2, decode: true, ..SimConfig::new(2, "lru") };
    let mut batches = Vec::new();
    let r = simulate_with(&trace, &config, |batch, _| batches.push(batch.to_vec())).unwrap();
    assert_eq!(batches, vec![vec![0, 1], vec![0, 1], vec![1, 2], vec![1]]);
    assert_eq!((r.steps, r.deferrals, r.tokens, r.adapter_requests), (4, 0, 7, 3));
}

#[test]
fn decode_mode_with_one_token_requests_is_the_whole_request_replay() {
    let trace = Trace::generate(Workload::parse("zipf:1.0").unwrap(), 30, 800, 3).unwrap();
    for (slots, batch) in [(4, 6), (8, 16)] {
        let whole = SimConfig { batch_size: batch, max_loaded: Some(12), ..SimConfig::new(slots, "lru") };
        let decode = SimConfig { decode: true, ..whole.clone() };
        assert_eq!(simulate(&trace, &whole).unwrap(), simulate(&trace, &decode).unwrap());
    }
}

#[test]
fn an_overdue_adapter_takes_the_slot_of_a_running_request_which_then_waits() {
    // One slot. b waits 4 plans behind a, turns overdue and goes first; then a, ahead of b in the
    // batch, takes the slot back and b, running, waits 4 plans again: running requests make no
    // progress while deferred, and each turn loads an adapter again (the engine's rotation, issue 37).
    let trace = decode_trace(&[("a", 10), ("b", 2)]);
    let config = SimConfig { batch_size: 8, decode: true, ..SimConfig::new(1, "lru") };
    let mut deferred = Vec::new();
    let r = simulate_with(&trace, &config, |batch, plan| {
        deferred.push(plan.deferred.iter().map(|&d| batch[d as usize]).collect::<Vec<_>>());
    })
    .unwrap();
    let (a, b, none) = (vec![0u32], vec![1u32], Vec::new());
    let mut expected = vec![b.clone(); crate::limits::OVERDUE_AFTER as usize];
    expected.push(a.clone());
    expected.extend(vec![b; crate::limits::OVERDUE_AFTER as usize]);
    expected.extend([a, none.clone(), none]);
    assert_eq!(deferred, expected);
    assert_eq!((r.steps, r.deferrals, r.device.misses, r.tokens), (12, 10, 5, 12));
}

#[test]
fn longest_remaining_runs_the_longest_request_throughout_and_ends_sooner() {
    // Two slots, three adapters, all waiting at once: a and b 10 tokens each, c 20, c last. In arrival
    // order a and b start and c waits its turn; longest remaining first starts c at once and lets a
    // and b share the other slot: 20 steps, the least two slots can do (c alone needs 20).
    let trace = decode_trace(&[("a", 10), ("b", 10), ("c", 20)]);
    let arrival = SimConfig { batch_size: 8, decode: true, ..SimConfig::new(2, "lru") };
    let longest = SimConfig { order: AdmissionOrder::LongestRemaining, ..arrival.clone() };
    let mut c_ran = Vec::new();
    let fast = simulate_with(&trace, &longest, |batch, plan| {
        c_ran.push(plan.admitted.iter().any(|&a| batch[a as usize] == 2));
    })
    .unwrap();
    let slow = simulate(&trace, &arrival).unwrap();
    assert_eq!((fast.steps, fast.tokens), (20, 40));
    assert!(c_ran.iter().all(|&ran| ran), "c sat out a step: {c_ran:?}");
    assert!(slow.steps > fast.steps, "{} vs {}", slow.steps, fast.steps);
    assert_eq!(slow.tokens, 40);
}

#[test]
fn longest_remaining_serves_every_request_within_the_age_bound() {
    // A paged pool short of the adapters in flight, Zipf requests of 1..32 tokens: every request is
    // served, no step holds more pages than the pool, and no request waits past the bound arrival
    // order keeps: deferred at most twice the age bound in a row (the core admits an adapter that
    // waited OVERDUE_AFTER plans first, whatever the order).
    let trace = Trace::generate(Workload::Zipf(1.0), 64, 600, 11).unwrap();
    let requests: Vec<Request> = trace
        .requests()
        .iter()
        .enumerate()
        .map(|(i, r)| Request { tokens: 1 + (i as u32 * 7919) % 32, ..*r })
        .collect();
    let trace = Trace::new(trace.names().to_vec(), requests).unwrap();
    let paging = crate::registry::Paging { page_rank: 8, pages: 24 };
    let base = SimConfig {
        batch_size: 32,
        decode: true,
        ranks: vec![(8, 4.0), (16, 2.0), (64, 1.0)],
        paging: Some(paging),
        ..SimConfig::new(24, "lru")
    };
    let total: u64 = trace.requests().iter().map(|r| u64::from(r.tokens)).sum();
    for order in [AdmissionOrder::Arrival, AdmissionOrder::LongestRemaining] {
        let config = SimConfig { order, ..base.clone() };
        // Per request: the steps it has been deferred in a row, and the most of them.
        let (mut streak, mut longest) = (vec![0u32; 600], 0u32);
        let report = simulate_with(&trace, &config, |batch, plan| {
            let pages: usize = plan
                .slots_used
                .iter()
                .map(|&s| (plan.page_indptr[s as usize + 1] - plan.page_indptr[s as usize]) as usize)
                .sum();
            assert!(pages <= 24, "{order:?}: a step holds {pages} pages");
            for &a in &plan.admitted {
                streak[batch[a as usize] as usize] = 0;
            }
            for &d in &plan.deferred {
                let s = &mut streak[batch[d as usize] as usize];
                *s += 1;
                longest = longest.max(*s);
            }
        })
        .unwrap();
        assert_eq!((report.requests, report.tokens), (600, total), "{order:?}");
        assert!(
            longest <= 2 * crate::limits::OVERDUE_AFTER,
            "{order:?}: a request deferred {longest} steps in a row"
        );
    }
}
