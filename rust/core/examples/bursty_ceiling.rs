//! How much room the `bursty` workload leaves above LRU for any online policy.
//!
//! `cargo run --release --example bursty_ceiling -- [REQUESTS] [SEEDS] [SLOTS...]`
//! (defaults: 1000000 requests, seeds 0..=19, 8 and 16 slots; 128 adapters, batches of 4).
//!
//! The generator (`Trace::generate(Workload::Bursty, ..)`) draws each request from the four adapters
//! "in a burst" with probability 0.8 and uniformly from all adapters otherwise. Given the generator's
//! state (the burst set), adapters outside it are exchangeable — each is equally likely to be asked for
//! next and equally likely to join the burst — so the best eviction *given that state* is any adapter
//! outside the burst set (here: the least recently used one), falling back to LRU when every candidate
//! is in it. That **state-informed** policy sees something no online policy sees (the hidden burst set)
//! and nothing of the future, so its hit rate estimates the ceiling for online policies on this
//! workload; Belady (which sees the future) is far above it.
//!
//! Both are replayed here with a standalone step model (steps of 4 requests, each step's distinct
//! adapters resident at once, victims never in the current step), the model the registry's replay
//! follows on these traces (no deferrals: a step never needs more than 4 of the slots). Plain LRU in
//! the same model is printed beside the registry's own LRU (`simulate`) as a check of the model.

use lora_pin_core::sim::{simulate, SimConfig, Trace, Workload};

/// The trace generator's SplitMix64 (Steele, Lea and Flood 2014), repeated here to recover the burst
/// set; the generated picks are checked against `Trace::generate`.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// The bursty picks and, per request, the burst set in force after it (what governs the requests
/// that follow).
fn bursty(n: usize, requests: usize, seed: u64) -> (Vec<usize>, Vec<[usize; 4]>) {
    let mut rng = SplitMix(seed);
    let mut bursting: Vec<usize> = (0..4).map(|_| rng.below(n)).collect();
    let (mut picks, mut states) = (Vec::with_capacity(requests), Vec::with_capacity(requests));
    for _ in 0..requests {
        picks.push(if rng.unit() < 0.8 { bursting[rng.below(4)] } else { rng.below(n) });
        if rng.unit() < 1.0 / 256.0 {
            let k = rng.below(4);
            bursting[k] = rng.below(n);
        }
        states.push([bursting[0], bursting[1], bursting[2], bursting[3]]);
    }
    (picks, states)
}

/// Hits of the step model with `slots` places; `informed` evicts outside the burst set first.
fn replay(picks: &[usize], states: &[[usize; 4]], n: usize, slots: usize, informed: bool) -> (u64, u64) {
    const ABSENT: u64 = u64::MAX;
    let mut last_used = vec![ABSENT; n];
    let mut resident: Vec<usize> = Vec::with_capacity(slots);
    let (mut hits, mut uses) = (0u64, 0u64);
    for (t, (step, state)) in picks.chunks(4).zip(states.chunks(4)).enumerate() {
        let mut used: Vec<usize> = Vec::with_capacity(4);
        for &a in step {
            if !used.contains(&a) {
                used.push(a);
            }
        }
        let burst = state.last().expect("a non-empty step");
        for &a in &used {
            uses += 1;
            if resident.contains(&a) {
                hits += 1;
                continue;
            }
            if resident.len() == slots {
                let victim = (0..resident.len())
                    .filter(|&i| !used.contains(&resident[i]))
                    .min_by_key(|&i| {
                        let r = resident[i];
                        (informed && burst.contains(&r), last_used[r])
                    })
                    .expect("a step fits in the slots");
                resident.swap_remove(victim);
            }
            resident.push(a);
        }
        for &a in &used {
            last_used[a] = t as u64;
        }
    }
    (hits, uses)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let requests: usize = args.first().map_or(Ok(1_000_000), |a| a.parse())?;
    let seeds: u64 = args.get(1).map_or(Ok(20), |a| a.parse())?;
    let slot_counts: Vec<usize> = if args.len() > 2 {
        args[2..].iter().map(|a| a.parse()).collect::<Result<_, _>>()?
    } else {
        vec![8, 16]
    };
    let n = 128;
    println!("bursty, {requests} requests over {n} adapters, batches of 4");
    println!(
        "{:>5} {:>4} {:>12} {:>12} {:>12} {:>10} {:>12}",
        "slots", "seed", "lru (sim)", "lru (model)", "informed", "inf-lru", "belady"
    );
    for &slots in &slot_counts {
        let (mut headroom, mut above) = (Vec::new(), 0);
        for seed in 0..seeds {
            let (picks, states) = bursty(n, requests, seed);
            let trace = Trace::generate(Workload::Bursty, n, requests, seed)?;
            let same = trace.requests().iter().zip(&picks).all(|(r, &p)| r.adapter == Some(p as u32));
            assert!(same && trace.requests().len() == picks.len(), "the generator copy drifted");
            let report = simulate(&trace, &SimConfig { batch_size: 4, ..SimConfig::new(slots, "lru") })?;
            let (lru_hits, uses) = replay(&picks, &states, n, slots, false);
            let (informed_hits, informed_uses) = replay(&picks, &states, n, slots, true);
            assert_eq!((uses, informed_uses), (report.uses, report.uses), "the step model drifted");
            let pct = |h: u64| 100.0 * h as f64 / uses as f64;
            let room = pct(informed_hits) - pct(lru_hits);
            headroom.push(room);
            above += usize::from(informed_hits > report.device.hits);
            println!(
                "{slots:>5} {seed:>4} {:>11.3}% {:>11.3}% {:>11.3}% {:>+9.3}pp {:>11.3}%",
                pct(report.device.hits),
                pct(lru_hits),
                pct(informed_hits),
                room,
                100.0 * report.belady_hit_rate(),
            );
        }
        let mean = headroom.iter().sum::<f64>() / headroom.len() as f64;
        let (lo, hi) =
            headroom.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| (l.min(x), h.max(x)));
        println!(
            "{slots:>5} informed - lru (model): mean {mean:+.3} pp, min {lo:+.3}, max {hi:+.3}; informed above the \
             registry's lru on {above}/{seeds} seeds"
        );
    }
    Ok(())
}
