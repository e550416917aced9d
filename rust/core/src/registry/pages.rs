//! The device tier's memory in rank pages: a budget of pages instead of a count of max-rank slots.
//!
//! A page holds `page_rank` ranks of every targeted module's A and B (its in and out features), so one
//! page index is valid in every module's pool tensor. An adapter of rank `r` takes
//! `ceil(r / page_rank)` pages; they need not be contiguous (each adapter has its page table), so the
//! pool never fragments, and eviction frees whole adapters. An adapter's *slot* is its first page:
//! unique while it is resident, so the plan's per-slot arrays (ranks, scalings, epochs, segments)
//! stay as they are, with one entry per page, and its page table says where its ranks are.
//!
//! Slot mode (no [`Paging`]) is the special case where every adapter takes one page of the largest
//! rank: `slots` pages, page `s` being slot `s`, so it behaves exactly as a table of slots.
//!
//! The budget rules, each the slot rule with pages counted (see `plan::SlotBudget`):
//! - a step admits unpinned adapters while their pages fit in the pages the pinned adapters leave
//!   (every pinned adapter's pages are set aside, resident or not, so a pinned adapter always fits),
//!   and, as today, at most `slots - pinned` distinct unpinned adapters;
//! - a pin is refused when the pinned adapters' pages would leave no room for the largest registered
//!   unpinned adapter (at least one page); a registration when the adapter could never fit beside the
//!   pinned ones.

use std::collections::BTreeSet;

use super::adapter::AdapterSize;
use super::Registry;
use crate::error::{Error, Result};
use crate::limits::MAX_SLOTS;
use crate::policy::AdapterKey;

/// A device tier sized in rank pages (`max_lora_memory`), for [`super::Config::paging`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Paging {
    /// Ranks per page, at least 1 (8 is S-LoRA's and SGLang's choice).
    pub page_rank: u32,
    /// Pages in the device pool, 1 to [`MAX_SLOTS`].
    pub pages: usize,
}

impl Paging {
    /// Refuses a page size or count no pool can have.
    ///
    /// Errors: [`Error::Spec`] naming the value.
    pub(super) fn check(&self) -> Result<()> {
        if self.page_rank == 0 {
            return Err(Error::Spec("page_rank must be at least 1 (got 0)".into()));
        }
        if self.pages == 0 || self.pages > MAX_SLOTS {
            return Err(Error::Spec(format!(
                "max_lora_memory must be 1 to {MAX_SLOTS} pages (got {})",
                self.pages
            )));
        }
        Ok(())
    }
}

/// Pages an adapter of `rank` takes: `ceil(rank / page_rank)`, or one slot-sized page in slot mode.
pub(crate) fn pages_for(paging: Option<Paging>, rank: u32) -> usize {
    paging.map_or(1, |p| rank.div_ceil(p.page_rank) as usize)
}

/// The page allocator: free pages, and per slot (an adapter's first page) its page table. Lowest
/// pages first, so slot mode hands out slots exactly as the slot table did.
#[derive(Debug)]
pub(crate) struct PagePool {
    free: BTreeSet<u32>,
    /// Indexed by slot: the page table of the adapter whose first page it is, empty otherwise.
    tables: Vec<Vec<u32>>,
}

impl PagePool {
    /// `pages` free pages.
    pub(crate) fn new(pages: u32) -> Self {
        Self { free: (0..pages).collect(), tables: vec![Vec::new(); pages as usize] }
    }

    /// Pages free now.
    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Takes the `n` (at least 1) lowest free pages as one adapter's page table; returns its slot
    /// (the first of them), or `None` when fewer than `n` are free (nothing changes then).
    pub(crate) fn alloc(&mut self, n: usize) -> Option<u32> {
        if n == 0 || self.free.len() < n {
            return None;
        }
        let table: Vec<u32> = (0..n).map(|_| self.free.pop_first().expect("counted free")).collect();
        let slot = table[0];
        self.tables[slot as usize] = table;
        Some(slot)
    }

    /// Frees the pages of the adapter in `slot`; returns how many.
    pub(crate) fn release(&mut self, slot: u32) -> usize {
        let table = std::mem::take(&mut self.tables[slot as usize]);
        debug_assert!(!table.is_empty(), "slot {slot} holds no pages");
        self.free.extend(&table);
        table.len()
    }

    /// The page table of the adapter in `slot` (empty when none has it).
    pub(crate) fn table(&self, slot: u32) -> &[u32] {
        &self.tables[slot as usize]
    }

    /// The allocator's invariants against `occupied` (each resident adapter's slot and the pages it
    /// needs): every table starts at its slot and has the pages its adapter needs, no page is in two
    /// tables or both in a table and free, and the free and used pages add up to the pool.
    pub(crate) fn check(
        &self,
        occupied: impl Iterator<Item = (u32, usize)>,
    ) -> std::result::Result<(), String> {
        let mut owner: Vec<Option<u32>> = vec![None; self.tables.len()];
        let mut used = 0;
        let mut slots = 0;
        for (slot, needs) in occupied {
            slots += 1;
            let table = self.tables.get(slot as usize).ok_or(format!("slot {slot} is past the pool"))?;
            if table.len() != needs || table.first() != Some(&slot) {
                return Err(format!("slot {slot} holds pages {table:?}, its adapter needs {needs}"));
            }
            for &p in table {
                match owner.get_mut(p as usize) {
                    Some(o @ None) if !self.free.contains(&p) => *o = Some(slot),
                    _ => return Err(format!("page {p} of slot {slot} is free, shared or past the pool")),
                }
            }
            used += table.len();
        }
        if self.tables.iter().filter(|t| !t.is_empty()).count() != slots {
            return Err("a page table belongs to no resident adapter".into());
        }
        if used + self.free.len() != self.tables.len() {
            return Err(format!(
                "{used} pages used and {} free in a pool of {}",
                self.free.len(),
                self.tables.len()
            ));
        }
        Ok(())
    }
}

impl Registry {
    /// Pages `size` takes in this registry's device pool.
    pub(crate) fn pages_of(&self, size: AdapterSize) -> usize {
        pages_for(self.config.paging, size.rank)
    }

    /// Pages `key` takes.
    pub(crate) fn key_pages(&self, key: AdapterKey) -> usize {
        self.pages_of(self.get(key).identity.size)
    }

    /// Pages in the device pool (slots in slot mode).
    pub(crate) fn total_pages(&self) -> usize {
        self.device.slots.len()
    }

    /// The registered unpinned adapter with the most pages, `except` aside.
    fn largest_unpinned_pages(&self, except: Option<AdapterKey>) -> Option<(&str, usize)> {
        self.adapters
            .iter()
            .enumerate()
            .filter_map(|(i, a)| a.as_ref().filter(|a| !a.protection.pinned).map(|a| (i, a)))
            .filter(|&(i, _)| except != Some(AdapterKey(i as u32)))
            .map(|(_, a)| (a.spec_name(), self.pages_of(a.identity.size)))
            .max_by_key(|&(_, pages)| pages)
    }

    /// The page rule of a pin (paged mode only: in slot mode the slot count rule is the same rule):
    /// with `name` (`key` when registered) pinned at `pages`, the pinned adapters' pages (`pinned`,
    /// after the change) leave room for the largest registered unpinned adapter, and at least one page.
    ///
    /// Errors: [`Error::Capacity`] naming the adapters and the numbers (a device-tier refusal).
    pub(super) fn check_pin_pages(
        &mut self,
        name: &str,
        pages: usize,
        pinned: usize,
        key: Option<AdapterKey>,
    ) -> Result<()> {
        let Some(paging) = self.config.paging else { return Ok(()) };
        let total = self.total_pages();
        let (other, needs) = match self.largest_unpinned_pages(key) {
            Some((other, needs)) => (format!("adapter {other:?}"), needs),
            None => ("an unpinned adapter".to_owned(), 1),
        };
        if pinned + needs.max(1) <= total {
            return Ok(());
        }
        self.device.counters.refusals += 1;
        Err(Error::Capacity(format!(
            "cannot pin adapter {name:?} ({pages} page(s) of page_rank={}): the pinned adapters would take \
             {pinned} of max_lora_memory={total} pages, leaving {}, and {other} needs {needs}; every \
             registered adapter must fit in the device pool beside the pinned ones (unpin one, or raise \
             max_lora_memory)",
            paging.page_rank,
            total.saturating_sub(pinned)
        )))
    }

    /// The page rule of a new unpinned size (a registration, a replacement): the adapter fits in the
    /// pages the pinned adapters leave, so its requests never wait forever. `pinned_pages` is the
    /// pinned adapters' pages after the change; `what` says what is refused.
    ///
    /// Errors: [`Error::Capacity`] with the numbers (a device-tier refusal).
    pub(super) fn check_unpinned_pages(
        &mut self,
        what: impl FnOnce() -> String,
        pages: usize,
        pinned_pages: usize,
    ) -> Result<()> {
        let Some(paging) = self.config.paging else { return Ok(()) };
        let total = self.total_pages();
        if pinned_pages + pages <= total {
            return Ok(());
        }
        self.device.counters.refusals += 1;
        Err(Error::Capacity(format!(
            "cannot {}: it needs {pages} page(s) of page_rank={} but the pinned adapters take {pinned_pages} \
             of max_lora_memory={total} pages, leaving {}",
            what(),
            paging.page_rank,
            total.saturating_sub(pinned_pages)
        )))
    }
}

#[cfg(test)]
#[path = "pages_tests.rs"]
mod tests;
