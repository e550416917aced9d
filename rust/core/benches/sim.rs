//! The capacity planner: replaying 100 000 generated requests (128 adapters, 16 slots, batches of 4)
//! per policy, Belady's bound alone on the same demand, and each policy's victim choice among 1024
//! candidates (victim, evict, re-insert: the tier's steady state under misses).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use lora_pin_core::policy::{AdapterKey, PolicyKind, POLICY_NAMES};
use lora_pin_core::sim::{min_misses, simulate, Demand, SimConfig, Trace, Workload};
use lora_pin_core::Usage;

const REQUESTS: usize = 100_000;

fn replay(c: &mut Criterion) {
    let mut group = c.benchmark_group("simulate");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    group.sample_size(10);
    for workload in ["zipf:1.0", "scan"] {
        let trace = Trace::generate(Workload::parse(workload).unwrap(), 128, REQUESTS, 0).unwrap();
        for policy in POLICY_NAMES {
            let config = SimConfig::new(16, policy);
            group.bench_function(format!("{workload}/{policy}"), |b| {
                b.iter(|| simulate(black_box(&trace), &config).unwrap())
            });
        }
    }
    group.finish();
}

fn belady(c: &mut Criterion) {
    let trace = Trace::generate(Workload::Zipf(1.0), 128, REQUESTS, 0).unwrap();
    let mut demand = Demand::new();
    for chunk in trace.requests().chunks(4) {
        let mut step: Vec<u32> = chunk.iter().filter_map(|r| r.adapter).collect();
        step.sort_unstable();
        step.dedup();
        demand.push_step(step);
    }
    let mut group = c.benchmark_group("belady");
    group.throughput(Throughput::Elements(demand.uses()));
    group.bench_function("zipf:1.0/16 slots", |b| {
        b.iter(|| min_misses(black_box(&demand), 16, |_| false, &[]).unwrap())
    });
    group.finish();
}

fn victim(c: &mut Criterion) {
    const CANDIDATES: u32 = 1024;
    let mut group = c.benchmark_group("victim");
    for policy in POLICY_NAMES {
        group.bench_function(format!("{policy}/{CANDIDATES}"), |b| {
            b.iter_batched_ref(
                || {
                    let mut p = PolicyKind::parse("policy", policy).unwrap().build();
                    for k in 0..CANDIDATES {
                        let t = u64::from(k) * 7 % 1031;
                        p.insert(
                            AdapterKey(k),
                            &Usage {
                                inserted_at: t,
                                last_used: t,
                                uses: 1 + u64::from(k % 5),
                                bytes: 1,
                                rank: 8,
                            },
                        );
                    }
                    (p, 2000u64)
                },
                |(p, clock)| {
                    for _ in 0..64 {
                        let key = p.victim().unwrap();
                        p.remove(key);
                        *clock += 1;
                        p.insert(
                            key,
                            &Usage {
                                inserted_at: *clock,
                                last_used: *clock,
                                uses: *clock,
                                bytes: 1,
                                rank: 8,
                            },
                        );
                    }
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, replay, belady, victim);
criterion_main!(benches);
