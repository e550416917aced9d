//! The replay over a device pool in rank pages: every step within the pages, every request served,
//! and at equal bytes more adapters a step and fewer deferrals than max-rank slots.

use super::*;
use crate::registry::Paging;

const MIX: [(u32, f64); 3] = [(8, 4.0), (16, 2.0), (64, 1.0)];

fn trace() -> Trace {
    Trace::generate(Workload::Zipf(1.0), 512, 8000, 37).unwrap()
}

/// Slots of the largest rank in `memory` bytes, and pages of rank 8 in the same bytes.
fn pools(memory: u64) -> (SimConfig, SimConfig) {
    let base = SimConfig { batch_size: 64, ranks: MIX.to_vec(), ..SimConfig::new(1, "lru") };
    let slots = (memory / base.adapter_bytes) as usize;
    let pages = (memory / (base.adapter_bytes / 8)) as usize;
    let paged = SimConfig { slots: pages, paging: Some(Paging { page_rank: 8, pages }), ..base.clone() };
    (SimConfig { slots, ..base }, paged)
}

#[test]
fn every_paged_step_holds_its_pages_and_every_request_is_served() {
    let trace = trace();
    let (_, paged) = pools(8 * (32 << 20));
    let mut steps = 0;
    let report = simulate_with(&trace, &paged, |_, plan| {
        let mut used: Vec<i32> = plan
            .slots_used
            .iter()
            .flat_map(|&s| {
                let s = s as usize;
                plan.page_table[plan.page_indptr[s] as usize..plan.page_indptr[s + 1] as usize].to_vec()
            })
            .collect();
        let n = used.len();
        used.sort_unstable();
        used.dedup();
        assert_eq!(used.len(), n, "a page serves two adapters");
        assert!(n <= 64);
        steps += 1;
    })
    .unwrap();
    assert_eq!(report.requests, 8000);
    assert_eq!(report.steps, steps);
    let bound = report.device.belady_misses.unwrap();
    assert!(0 < bound && bound <= report.device.misses, "{bound} vs {}", report.device.misses);
}

#[test]
fn at_equal_bytes_pages_hold_more_adapters_a_step_and_defer_fewer_requests() {
    let trace = trace();
    let (slots, pages) = pools(8 * (32 << 20));
    let (s, p) = (simulate(&trace, &slots).unwrap(), simulate(&trace, &pages).unwrap());
    let per_step = |r: &SimReport| r.uses as f64 / r.steps as f64;
    assert!(per_step(&p) > 3.0 * per_step(&s), "{} vs {}", per_step(&p), per_step(&s));
    assert!(p.deferrals * 3 < s.deferrals, "{} vs {}", p.deferrals, s.deferrals);
}
