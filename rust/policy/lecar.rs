//! Regret-weighted mixing of two experts, after LeCaR (G. Vietri, L. V. Rodriguez, W. A. Martinez,
//! S. Lyons, J. Liu, R. Rangaswami, M. Zhao and G. Narasimhan, "Driving Cache Replacement with
//! ML-based LeCaR", HotStorage 2018).
//!
//! Each eviction follows one expert, drawn with probability proportional to its weight. An adapter
//! evicted on one expert's choice (the other expert would have kept it) goes into that expert's
//! history; when it comes back while still remembered, the expert is charged:
//! `w *= exp(-LEARNING_RATE * DISCOUNT^age)`, `age` the evictions since, and the weights are
//! renormalised. Histories remember the last `N` such evictions, `N` the most candidates seen at once
//! (the policy is not told the tier's capacity), and `DISCOUNT = 0.005^(1/N)` as in the paper.
//!
//! The trait does not say whether a removal is an eviction; a candidate removed while it is the
//! current victim is noted, and counted as evicted when it comes back with a new tier-entry time.
//! Scratch attempt for issue #7 (`lecar`: LRU and LFU as in the paper; `lecar-hybrid`: LRU and
//! `hybrid`), not registered for users.

use super::{AdapterKey, EvictionPolicy, Ranked, Usage};

/// LeCaR's learning rate.
const LEARNING_RATE: f64 = 0.45;
const HISTORY: u64 = 1;

/// Most frequently used first out: LeCaR's second expert. Uses since registration, ties to the
/// oldest use.
#[derive(Debug, Default, Clone)]
pub struct Lfu(Ranked);

impl EvictionPolicy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        self.0.insert(key, (usage.uses.min(1 << 23) << 40) | (usage.last_used & ((1 << 40) - 1)));
    }

    fn remove(&mut self, key: AdapterKey) {
        self.0.remove(key);
    }

    fn victim(&self) -> Option<AdapterKey> {
        self.0.first()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// What the mixer remembers of an adapter.
#[derive(Debug, Clone, Copy, Default)]
struct Ghost {
    /// When it entered the tier (as last inserted).
    entered: u64,
    /// Which experts chose it when it was removed as the victim (bit 0: first, bit 1: second), and
    /// the eviction count then.
    chosen_by: u8,
    at: u64,
    candidate: bool,
}

/// Two experts mixed by regret; see the module docs.
#[derive(Debug)]
pub struct Mixed {
    name: &'static str,
    experts: [Box<dyn EvictionPolicy>; 2],
    weights: [f64; 2],
    ghosts: Vec<Ghost>,
    evictions: u64,
    capacity: usize,
    rng: u64,
    draw: f64,
}

impl Mixed {
    /// Mixes `first` and `second`, equal weights to start.
    pub fn new(name: &'static str, first: Box<dyn EvictionPolicy>, second: Box<dyn EvictionPolicy>) -> Self {
        Self {
            name,
            experts: [first, second],
            weights: [0.5, 0.5],
            ghosts: Vec::new(),
            evictions: 0,
            capacity: 1,
            rng: 0x5EED,
            draw: 0.0,
        }
    }

    /// The expert the next eviction follows.
    fn expert(&self) -> usize {
        usize::from(self.draw >= self.weights[0])
    }

    fn next_draw(&mut self) {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        self.draw = (z >> 11) as f64 / (1u64 << 53) as f64;
    }
}

impl EvictionPolicy for Mixed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        if self.ghosts.len() <= key.index() {
            self.ghosts.resize(key.index() + 1, Ghost::default());
        }
        let g = self.ghosts[key.index()];
        let returned = g.chosen_by != 0 && g.entered != usage.inserted_at;
        let age = self.evictions.saturating_sub(g.at);
        let history = self.capacity as u64 * HISTORY;
        if returned && age < history {
            let discount = 0.005f64.powf(1.0 / history as f64);
            let regret = (-LEARNING_RATE * discount.powf(age as f64)).exp();
            for e in 0..2 {
                if g.chosen_by & (1 << e) != 0 && g.chosen_by != 3 {
                    self.weights[e] *= regret;
                }
            }
            let total = self.weights[0] + self.weights[1];
            self.weights = [self.weights[0] / total, self.weights[1] / total];
        }
        self.ghosts[key.index()] = Ghost { entered: usage.inserted_at, chosen_by: 0, at: 0, candidate: true };
        for e in &mut self.experts {
            e.insert(key, usage);
        }
        self.capacity = self.capacity.max(self.len());
    }

    fn remove(&mut self, key: AdapterKey) {
        if self.victim() == Some(key) {
            let mut chosen_by = 0;
            for (i, e) in self.experts.iter().enumerate() {
                if e.victim() == Some(key) {
                    chosen_by |= 1 << i;
                }
            }
            self.evictions += 1;
            let g = &mut self.ghosts[key.index()];
            (g.chosen_by, g.at) = (chosen_by, self.evictions);
            self.next_draw();
        }
        self.ghosts[key.index()].candidate = false;
        for e in &mut self.experts {
            e.remove(key);
        }
    }

    fn victim(&self) -> Option<AdapterKey> {
        self.experts[self.expert()].victim()
    }

    fn len(&self) -> usize {
        self.experts[0].len()
    }
}
