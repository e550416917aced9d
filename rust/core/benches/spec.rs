//! Parsing 10,000 mixed `--lora-paths` items (every accepted form) through the core.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lora_pin_core::spec::{parse_items, Limits, SpecItem};

/// The same mix the Python benchmark (`benches/spec_parse.py`) uses: bare paths, `NAME=PATH`,
/// SGLang JSON (every fifth pinned-false, some pinned) and vLLM JSON.
fn mixed_items(n: usize) -> Vec<SpecItem> {
    (0..n)
        .map(|i| {
            SpecItem::Text(match i % 4 {
                0 => format!("/srv/adapters/bare-{i}"),
                1 => format!("name-{i}=/srv/adapters/named-{i}"),
                2 => format!(
                    r#"{{"lora_name": "sg-{i}", "lora_path": "/srv/adapters/sg-{i}", "pinned": {}}}"#,
                    i % 40 == 2
                ),
                _ => format!(
                    r#"{{"name": "vl-{i}", "path": "/srv/adapters/vl-{i}", "base_model_name": "llama"}}"#
                ),
            })
        })
        .collect()
}

fn bench_parse(c: &mut Criterion) {
    let items = mixed_items(10_000);
    let mut group = c.benchmark_group("spec");
    group.throughput(Throughput::Elements(items.len() as u64));
    group.bench_function("parse_10k_mixed", |b| {
        b.iter(|| parse_items(std::hint::black_box(&items), Limits::default()).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench_parse);
criterion_main!(benches);
