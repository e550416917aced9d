//! First in, first out: the candidate that entered the tier earliest goes first, however often it
//! was used since.

use super::{AdapterKey, EvictionPolicy, Ranked, Usage};

/// Oldest arrival in the tier first.
#[derive(Debug, Default, Clone)]
pub struct Fifo(Ranked);

impl EvictionPolicy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        self.0.insert(key, usage.inserted_at);
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
