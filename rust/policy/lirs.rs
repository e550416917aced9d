//! LIRS proper (S. Jiang and X. Zhang, "LIRS: An Efficient Low Inter-reference Recency Set Replacement
//! Policy to Improve Buffer Cache Performance", SIGMETRICS 2002): an LIR set of `capacity - hirs`
//! adapters with low inter-reference recency, kept; the other residents (HIR) queue in `Q` and go
//! first. The stack `S` holds references in recency order, its bottom always an LIR adapter; an HIR
//! adapter referenced while in `S` (its IRR is below the bottom LIR's recency) becomes LIR and the
//! bottom LIR becomes a resident HIR at the end of `Q`.
//!
//! The policy sees references as insertions with a new use, after the step that made them (so after
//! that step's evictions), and evictions not at all: an evicted block stays in `Q` (or, if it was LIR,
//! in the LIR set) until referenced again and is skipped as a victim meanwhile. The tier's capacity is
//! taken as the most candidates seen at once. When no queued HIR adapter is a candidate, the lowest
//! LIR candidate in `S` goes. Scratch attempt for issue #7, not registered for users.

use std::collections::BTreeSet;

use super::{AdapterKey, EvictionPolicy, Usage};

#[derive(Debug, Clone, Copy, Default)]
struct Block {
    lir: bool,
    /// Position in `S` (its last reference), if in `S`.
    in_stack: Option<u64>,
    /// Position in `Q`, if queued as a resident HIR.
    in_queue: Option<u64>,
    uses: u64,
    entered: u64,
    candidate: bool,
    known: bool,
}

/// LIRS; see the module docs.
#[derive(Debug, Clone)]
pub struct Lirs {
    name: &'static str,
    /// Resident-HIR share of the capacity: `max(1, capacity * hir_permille / 1000)`.
    hir_permille: usize,
    blocks: Vec<Block>,
    stack: BTreeSet<(u64, AdapterKey)>,
    queue: BTreeSet<(u64, AdapterKey)>,
    lir_count: usize,
    capacity: usize,
    len: usize,
    clock: u64,
}

impl Lirs {
    /// LIRS with `hir_permille`/1000 of the capacity for resident HIR adapters (at least one).
    pub fn new(name: &'static str, hir_permille: usize) -> Self {
        Self {
            name,
            hir_permille,
            blocks: Vec::new(),
            stack: BTreeSet::new(),
            queue: BTreeSet::new(),
            lir_count: 0,
            capacity: 0,
            len: 0,
            clock: 0,
        }
    }

    fn lir_target(&self) -> usize {
        let hirs = (self.capacity * self.hir_permille / 1000).max(1);
        self.capacity.saturating_sub(hirs).max(1)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn push_stack_top(&mut self, key: AdapterKey) {
        let t = self.tick();
        let b = &mut self.blocks[key.index()];
        if let Some(old) = b.in_stack.replace(t) {
            self.stack.remove(&(old, key));
        }
        self.stack.insert((t, key));
    }

    fn push_queue_end(&mut self, key: AdapterKey) {
        let t = self.tick();
        let b = &mut self.blocks[key.index()];
        if let Some(old) = b.in_queue.replace(t) {
            self.queue.remove(&(old, key));
        }
        self.queue.insert((t, key));
    }

    fn dequeue(&mut self, key: AdapterKey) {
        if let Some(old) = self.blocks[key.index()].in_queue.take() {
            self.queue.remove(&(old, key));
        }
    }

    /// Drops HIR entries from the bottom of `S` until an LIR one is there.
    fn prune(&mut self) {
        while let Some(&(t, key)) = self.stack.first() {
            if self.blocks[key.index()].lir {
                break;
            }
            self.stack.remove(&(t, key));
            self.blocks[key.index()].in_stack = None;
        }
    }

    /// The bottom LIR adapter becomes a resident HIR at the end of `Q`.
    fn demote_bottom(&mut self) {
        if let Some(&(t, key)) = self.stack.first() {
            self.stack.remove(&(t, key));
            let b = &mut self.blocks[key.index()];
            b.in_stack = None;
            b.lir = false;
            self.lir_count -= 1;
            self.push_queue_end(key);
            self.prune();
        }
    }

    fn reference(&mut self, key: AdapterKey) {
        let b = self.blocks[key.index()];
        if b.lir {
            let was_bottom = self.stack.first().map(|&(_, k)| k) == Some(key);
            self.push_stack_top(key);
            if was_bottom {
                self.prune();
            }
            return;
        }
        if self.lir_count < self.lir_target() {
            self.dequeue(key);
            self.blocks[key.index()].lir = true;
            self.lir_count += 1;
            self.push_stack_top(key);
            return;
        }
        if b.in_stack.is_some() {
            self.dequeue(key);
            self.blocks[key.index()].lir = true;
            self.lir_count += 1;
            self.push_stack_top(key);
            self.demote_bottom();
        } else {
            self.push_queue_end(key);
            self.push_stack_top(key);
        }
    }
}

impl EvictionPolicy for Lirs {
    fn name(&self) -> &'static str {
        self.name
    }

    fn insert(&mut self, key: AdapterKey, usage: &Usage) {
        if self.blocks.len() <= key.index() {
            self.blocks.resize(key.index() + 1, Block::default());
        }
        let b = self.blocks[key.index()];
        assert!(!b.candidate, "{key:?} is already a candidate");
        let new_use = !b.known || b.uses < usage.uses;
        {
            let b = &mut self.blocks[key.index()];
            b.known = true;
            b.uses = usage.uses;
            b.entered = usage.inserted_at;
            b.candidate = true;
        }
        self.len += 1;
        self.capacity = self.capacity.max(self.len);
        if new_use {
            self.reference(key);
        } else if !self.blocks[key.index()].lir && self.blocks[key.index()].in_queue.is_none() {
            self.push_queue_end(key);
        }
    }

    fn remove(&mut self, key: AdapterKey) {
        let b = self.blocks.get_mut(key.index()).filter(|b| b.candidate);
        let b = b.unwrap_or_else(|| panic!("{key:?} is not a candidate"));
        b.candidate = false;
        self.len -= 1;
    }

    fn victim(&self) -> Option<AdapterKey> {
        let candidate = |&&(_, k): &&(u64, AdapterKey)| self.blocks[k.index()].candidate;
        self.queue
            .iter()
            .find(candidate)
            .or_else(|| self.stack.iter().find(candidate))
            .map(|&(_, k)| k)
            .or_else(|| {
                // Candidates in neither (LIR pruned? cannot happen) or HIR out of Q: any candidate.
                self.blocks.iter().position(|b| b.candidate).map(|i| AdapterKey(i as u32))
            })
    }

    fn len(&self) -> usize {
        self.len
    }
}
