//! Seed study: replays the five generated workloads at 8 and 16 slots (128 adapters, batches of 4)
//! on many seeds and prints, per workload and slot count, how each challenger policy does against
//! the better of the two baselines (`lru`, `fifo`) and against Belady's bound.
//!
//! `cargo run --release --example policy_seeds -- [REQUESTS] [SEEDS] [CHALLENGER...]`
//! (defaults: 1000000 requests, seeds 0..=19, challengers `reuse` and `hybrid`). Runs on two threads.
//!
//! Per cell and challenger: mean, min and max of (challenger − best of lru/fifo) in percentage points of
//! device hit rate, the seeds where the challenger is strictly best of {lru, fifo, challenger} (more
//! device hits), and the mean gap to Belady. With `SEED_ROWS=1` it also prints one line per seed.

use std::collections::BTreeMap;
use std::time::Instant;

use lora_pin_core::sim::{simulate, SimConfig, Trace, Workload};

const WORKLOADS: [&str; 5] = ["zipf:1.0", "uniform", "shifting", "bursty", "scan"];
const SLOTS: [usize; 2] = [8, 16];

/// Device hits per policy (same order as the policy list), uses and Belady's misses, of one run.
#[derive(Debug, Clone)]
struct Cell {
    hits: Vec<u64>,
    uses: u64,
    belady_misses: u64,
}

type Results = BTreeMap<(usize, usize, u64), Cell>;

fn run_seed(seed: u64, requests: usize, policies: &[String]) -> Result<Results, String> {
    let mut out = Results::new();
    for (w, name) in WORKLOADS.iter().enumerate() {
        let workload = Workload::parse(name).map_err(|e| e.to_string())?;
        let trace = Trace::generate(workload, 128, requests, seed).map_err(|e| e.to_string())?;
        for (s, &slots) in SLOTS.iter().enumerate() {
            let mut cell = Cell { hits: Vec::new(), uses: 0, belady_misses: 0 };
            for (p, policy) in policies.iter().enumerate() {
                let config = SimConfig { batch_size: 4, ..SimConfig::new(slots, policy) };
                let report = simulate(&trace, &config).map_err(|e| e.to_string())?;
                let bound = report.device.belady_misses.expect("the device tier is bounded");
                if p == 0 {
                    (cell.uses, cell.belady_misses) = (report.uses, bound);
                } else if (report.uses, bound) != (cell.uses, cell.belady_misses) {
                    return Err(format!("{name} seed {seed}: {policy} saw a different demand"));
                }
                cell.hits.push(report.device.hits);
            }
            out.insert((w, s, seed), cell);
        }
    }
    Ok(out)
}

fn pp(hits: u64, uses: u64) -> f64 {
    100.0 * hits as f64 / uses as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let requests: usize = args.first().map_or(Ok(1_000_000), |a| a.parse())?;
    let seeds: u64 = args.get(1).map_or(Ok(20), |a| a.parse())?;
    let challengers: Vec<String> =
        if args.len() > 2 { args[2..].to_vec() } else { vec!["reuse".into(), "hybrid".into()] };
    let mut policies: Vec<String> = vec!["lru".into(), "fifo".into()];
    policies.extend(challengers.iter().cloned());
    let seed_rows = std::env::var("SEED_ROWS").is_ok_and(|v| v == "1");

    let started = Instant::now();
    let all: Vec<u64> = (0..seeds).collect();
    let halves = all.split_at(all.len().div_ceil(2));
    let mut results = Results::new();
    std::thread::scope(|scope| -> Result<(), String> {
        let workers: Vec<_> = [halves.0, halves.1]
            .into_iter()
            .map(|part| {
                let policies = &policies;
                scope.spawn(move || -> Result<Results, String> {
                    let mut out = Results::new();
                    for &seed in part {
                        out.extend(run_seed(seed, requests, policies)?);
                    }
                    Ok(out)
                })
            })
            .collect();
        for worker in workers {
            results.extend(worker.join().map_err(|_| "a worker panicked".to_string())??);
        }
        Ok(())
    })?;
    let elapsed = started.elapsed().as_secs_f64();

    println!(
        "{requests} requests over 128 adapters, batches of 4, seeds 0..={}, policies {}",
        seeds - 1,
        policies.join(",")
    );
    for (c, challenger) in challengers.iter().enumerate() {
        let p = c + 2;
        println!();
        println!("{challenger} vs best of lru/fifo (pp of device hit rate)");
        println!(
            "{:<9} {:>5} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9}",
            "workload", "slots", "mean", "min", "max", "best", "lru", "fifo", "policy", "belady-gap"
        );
        for (w, name) in WORKLOADS.iter().enumerate() {
            for (s, slots) in SLOTS.iter().enumerate() {
                let cells: Vec<(u64, &Cell)> =
                    (0..seeds).map(|seed| (seed, &results[&(w, s, seed)])).collect();
                let margins: Vec<f64> = cells
                    .iter()
                    .map(|(_, c)| pp(c.hits[p], c.uses) - pp(c.hits[0].max(c.hits[1]), c.uses))
                    .collect();
                let best = cells.iter().filter(|(_, c)| c.hits[p] > c.hits[0].max(c.hits[1])).count();
                let n = seeds as f64;
                let mean = |f: &dyn Fn(&Cell) -> f64| cells.iter().map(|(_, c)| f(c)).sum::<f64>() / n;
                let gap = mean(&|c| 100.0 - pp(c.belady_misses, c.uses) - pp(c.hits[p], c.uses));
                println!(
                    "{name:<9} {slots:>5} {:>+9.3} {:>+9.3} {:>+9.3} {:>5}/{:<2} {:>8.2}% {:>8.2}% {:>8.2}% {:>9.2}",
                    margins.iter().sum::<f64>() / n,
                    margins.iter().copied().fold(f64::INFINITY, f64::min),
                    margins.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    best,
                    seeds,
                    mean(&|c| pp(c.hits[0], c.uses)),
                    mean(&|c| pp(c.hits[1], c.uses)),
                    mean(&|c| pp(c.hits[p], c.uses)),
                    gap,
                );
                if seed_rows {
                    for ((seed, c), m) in cells.iter().zip(&margins) {
                        println!(
                            "    seed {seed:>2}: lru {:.3}% fifo {:.3}% {challenger} {:.3}% belady {:.3}% margin {m:+.3}",
                            pp(c.hits[0], c.uses),
                            pp(c.hits[1], c.uses),
                            pp(c.hits[p], c.uses),
                            100.0 - pp(c.belady_misses, c.uses),
                        );
                    }
                }
            }
        }
        for (s, slots) in SLOTS.iter().enumerate() {
            let wins: Vec<usize> = (0..seeds)
                .map(|seed| {
                    (0..WORKLOADS.len())
                        .filter(|&w| {
                            let c = &results[&(w, s, seed)];
                            c.hits[p] > c.hits[0].max(c.hits[1])
                        })
                        .count()
                })
                .collect();
            let at_least_four = wins.iter().filter(|&&k| k >= 4).count();
            let spread: Vec<String> = (0..=WORKLOADS.len())
                .map(|k| format!("{k}:{}", wins.iter().filter(|&&x| x == k).count()))
                .collect();
            println!(
                "{slots} slots: {challenger} strictly best on >= 4 of 5 workloads on {at_least_four}/{seeds} seeds \
                 (seeds by workloads won: {})",
                spread.join(" ")
            );
        }
    }
    println!();
    println!("{} simulations in {elapsed:.1} s on 2 threads", seeds as usize * 10 * policies.len());
    Ok(())
}
