//! The registry's hot paths: a step transaction over 256 requests, 64 adapters and 16 slots (2
//! pinned, zipf-like popularity so steps mix hits and misses, a host tier for 48 so some loads read
//! from disk), reading in the step and in fetch mode; and register/unload of an adapter.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use lora_pin_core::{AdapterKey, AdapterSize, Config, LoRARef, Registry, StepMode, StepRequest};

const ADAPTERS: usize = 64;
const REQUESTS: usize = 256;

fn size() -> AdapterSize {
    AdapterSize { rank: 8, host_bytes: 1 << 20, device_bytes: 1 << 20, scaling: 2.0 }
}

fn registry() -> (Registry, Vec<String>) {
    let mut config = Config::new(16);
    config.max_loaded = Some(48);
    let mut reg = Registry::new(config).unwrap();
    let names: Vec<String> = (0..ADAPTERS).map(|i| format!("adapter-{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        let r = LoRARef::with_deterministic_id(name, &format!("/srv/adapters/{name}"), i < 2, None).unwrap();
        reg.register(r, size()).unwrap();
    }
    (reg, names)
}

/// Steps of 256 requests: 10% base model, the rest zipf-like (a small xorshift keeps it dependency-free).
fn workload(names: &[String], steps: usize) -> Vec<Vec<Option<&str>>> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..steps)
        .map(|_| {
            (0..REQUESTS)
                .map(|_| {
                    if next() < 0.1 {
                        None
                    } else {
                        let rank = (1.0 - next()).powf(-1.0 / 1.2) as usize;
                        Some(names[rank.clamp(1, ADAPTERS) - 1].as_str())
                    }
                })
                .collect()
        })
        .collect()
}

fn bench_plan(c: &mut Criterion) {
    let (mut reg, names) = registry();
    let steps = workload(&names, 64);
    let tokens = vec![1u32; REQUESTS];
    let mut group = c.benchmark_group("registry");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    let mut i = 0;
    // The step transaction over keys (how the live manager steps), blocking and in fetch mode:
    // fetch mode defers the host misses and fetches them, each reported done after the step.
    let keyed: Vec<Vec<Option<AdapterKey>>> =
        steps.iter().map(|s| s.iter().map(|n| n.map(|n| reg.lookup(n, false).unwrap())).collect()).collect();
    for fetch in [false, true] {
        let name = if fetch { "begin_finish_step_256_fetch_mode" } else { "begin_finish_step_256" };
        group.bench_function(name, |b| {
            b.iter(|| {
                let mode = if fetch { StepMode::Fetch } else { StepMode::ReadInStep };
                let request = StepRequest::new(&keyed[i % keyed.len()], &tokens, mode);
                let (plan, ticket) = reg.begin_step(request).unwrap().begun().unwrap();
                for index in 0..plan.loads.len() {
                    reg.report_load(ticket, index, true).unwrap();
                }
                reg.finish_step(ticket).unwrap();
                for f in &plan.to_fetch {
                    reg.fetch_done(&f.name, f.serial).unwrap();
                }
                i += 1;
                plan
            })
        });
    }
    group.throughput(Throughput::Elements(1));
    group.bench_function("register_unload", |b| {
        b.iter_batched(
            || LoRARef::with_deterministic_id("extra", "/srv/adapters/extra", false, None).unwrap(),
            |r| {
                reg.register(r, size()).unwrap();
                reg.unload("extra").unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
