//! Least recently used: the candidate whose last use by a planned step is oldest goes first.

use super::{AdapterKey, EvictionPolicy, Ranked, Usage};

/// Least recently used first.
#[derive(Debug, Default, Clone)]
pub struct Lru(Ranked);

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        self.0.insert(key, usage.last_used);
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
