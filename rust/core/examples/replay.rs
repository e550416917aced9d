//! Replays generated traces of a million requests through the registry's planner and prints, per
//! workload and policy, the requests per second, the device hit rate and Belady's bound.
//!
//! `cargo run --release --example replay -- [REQUESTS] [SLOTS] [BATCH] [WORKLOAD...]`
//! (defaults: 1000000 requests, 16 slots, batches of 4, all five workloads; 128 adapters, seed 0).

use std::time::Instant;

use lora_pin_core::policy::POLICY_NAMES;
use lora_pin_core::sim::{simulate, SimConfig, Trace, Workload};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let requests: usize = args.first().map_or(Ok(1_000_000), |a| a.parse())?;
    let slots: usize = args.get(1).map_or(Ok(16), |a| a.parse())?;
    let batch: usize = args.get(2).map_or(Ok(4), |a| a.parse())?;
    let workloads: Vec<String> = if args.len() > 3 {
        args[3..].to_vec()
    } else {
        ["zipf:1.0", "uniform", "shifting", "bursty", "scan"].map(String::from).to_vec()
    };
    println!("{requests} requests over 128 adapters, {slots} slots, batches of {batch}");
    println!(
        "{:<10} {:<6} {:>12} {:>9} {:>9} {:>9}",
        "workload", "policy", "requests/s", "hit rate", "belady", "gap"
    );
    for w in &workloads {
        let trace = Trace::generate(Workload::parse(w)?, 128, requests, 0)?;
        for policy in POLICY_NAMES {
            let config = SimConfig { batch_size: batch, ..SimConfig::new(slots, policy) };
            let started = Instant::now();
            let report = simulate(&trace, &config)?;
            let rate = requests as f64 / started.elapsed().as_secs_f64();
            let (hit, bound) = (report.device_hit_rate(), report.belady_hit_rate());
            println!(
                "{w:<10} {policy:<6} {rate:>12.0} {:>8.2}% {:>8.2}% {:>8.2}pp",
                100.0 * hit,
                100.0 * bound,
                100.0 * (bound - hit)
            );
        }
    }
    Ok(())
}
