//! Shrink and expand over a pool in rank pages (issue 37): the same kernels as the slot layout, with
//! A's rows and B's rank columns found through a validated [`PageTable`].
//!
//! Slot `s` owns pages `table[indptr[s]..indptr[s + 1]]`, in rank order: its `k`-th page holds ranks
//! `k * page_rank..(k + 1) * page_rank` of every slice (`a_pages [num_pages, n_slices * page_rank,
//! in_features]`, `b_pages [num_pages, out_total, page_rank]`). A page's ranks are contiguous, so the
//! kernels run one page's rank block exactly as they run a slot's; per-slot ranks bound the work as in
//! the slot layout, and `v` keeps the slot layout's `[n_tokens, n_slices * R]`.

use lora_pin_core::Result;

use super::layout::Pages;
use super::{arg, CpuPlan, Data, DataMut};

/// A layer group's page tables, checked against the pool they index: every page inside it, every
/// slot's pages a rising range of the table.
#[derive(Debug, Clone)]
pub struct PageTable {
    page_rank: usize,
    num_pages: usize,
    // [n_slots + 1], rising from 0 to len(table).
    indptr: Vec<usize>,
    // Each in [0, num_pages).
    table: Vec<usize>,
}

impl PageTable {
    /// Validates the tables of a pool of `num_pages` pages of `page_rank` ranks.
    ///
    /// Errors: [`lora_pin_core::Error::OpArgument`] naming what is wrong: `page_rank` below 1,
    /// `page_indptr` empty or not rising from 0 to `len(page_table)`, or a `page_table` entry outside
    /// `[0, num_pages)`.
    pub fn new(page_indptr: &[i64], page_table: &[i64], page_rank: usize, num_pages: usize) -> Result<Self> {
        if page_rank == 0 {
            return Err(arg("page_rank must be at least 1, got 0".into()));
        }
        if page_indptr.first() != Some(&0)
            || page_indptr.last() != Some(&(page_table.len() as i64))
            || page_indptr.windows(2).any(|w| w[0] > w[1])
        {
            return Err(arg(format!(
                "page_indptr must rise from 0 to len(page_table)={}, got {page_indptr:?}",
                page_table.len()
            )));
        }
        let table = page_table
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                usize::try_from(p).ok().filter(|&p| p < num_pages).ok_or_else(|| {
                    arg(format!("page_table[{i}] = {p} lies outside the pool's pages [0, {num_pages})"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Non-negative and at most len(table): checked above.
        let indptr = page_indptr.iter().map(|&i| i as usize).collect();
        Ok(Self { page_rank, num_pages, indptr, table })
    }

    /// Ranks per page.
    pub fn page_rank(&self) -> usize {
        self.page_rank
    }

    /// The pages of the pool the tables index.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// The slots the tables describe.
    pub fn n_slots(&self) -> usize {
        self.indptr.len() - 1
    }

    fn layout(&self, n_slices: usize, in_features: usize, out_total: usize) -> Pages<'_> {
        Pages {
            n_slices,
            page_rank: self.page_rank,
            in_features,
            out_total,
            indptr: &self.indptr,
            table: &self.table,
        }
    }
}

impl CpuPlan {
    /// Whether `pages` describe this plan's slots and hold every slot's rank in every slice.
    fn check_pages(&self, pages: &PageTable) -> Result<()> {
        if pages.n_slots() != self.n_slots {
            return Err(arg(format!(
                "page_indptr has {} entries for {} slots (expected slots + 1)",
                pages.indptr.len(),
                self.n_slots
            )));
        }
        for slot in 0..self.n_slots {
            let n_pages = pages.indptr[slot + 1] - pages.indptr[slot];
            let held = n_pages * pages.page_rank;
            for slice in 0..self.n_slices {
                let rank = self.rank(slot, slice);
                if rank > held {
                    return Err(arg(format!(
                        "slot {slot} has rank {rank} in slice {slice} but its {n_pages} pages of \
                         page_rank={} hold {held}",
                        pages.page_rank
                    )));
                }
            }
        }
        Ok(())
    }

    /// [`CpuPlan::shrink`] reading A through `pages`: `v[t, s*R + j] = Σ_i x[t, i] ·
    /// a_pages[page(slot(t), j / page_rank), s * page_rank + j % page_rank, i]` for `j < rank(slot(t),
    /// s)`; the caller passes `v` zeroed and only those elements are written.
    ///
    /// Shapes (row-major): `x` `[n_tokens, in_features]`, `a_pages` `[num_pages, n_slices * page_rank,
    /// in_features]`, `v` `[n_tokens, n_slices * R]`; one dtype for all three.
    ///
    /// Errors: as for [`CpuPlan::shrink`], and [`lora_pin_core::Error::OpArgument`] where `pages` are
    /// for another number of slots or a slot's rank exceeds what its pages hold (nothing written).
    pub fn paged_shrink(
        &self,
        x: Data<'_>,
        in_features: usize,
        a_pages: Data<'_>,
        pages: &PageTable,
        v: DataMut<'_>,
        threads: usize,
    ) -> Result<()> {
        self.check_pages(pages)?;
        let (s, p) = (self.n_slices, pages.page_rank);
        let shape = "num_pages x n_slices*page_rank x in_features";
        self.check_len("a_pages", a_pages.len(), &[pages.num_pages, s, p, in_features], shape)?;
        self.shrink_in(x, in_features, a_pages, v, threads, &pages.layout(s, in_features, 0))
    }

    /// [`CpuPlan::expand`] reading B through `pages`: `out[t, o_s + o] += scaling[slot, s] · Σ_j v[t,
    /// s*R + j] · b_pages[page(slot, j / page_rank), o_s + o, j % page_rank]` over `j < rank(slot, s)`,
    /// fp32 accumulation with `out`'s value, rounded once; rows outside the plan untouched.
    ///
    /// Shapes (row-major): `out` `[n_tokens, out_total]`, `v` `[n_tokens, n_slices * R]`, `b_pages`
    /// `[num_pages, out_total, page_rank]`, `scalings` `[n_slots, n_slices]`.
    ///
    /// Errors: as for [`CpuPlan::expand`] and [`CpuPlan::paged_shrink`] (nothing written).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_expand(
        &self,
        out: DataMut<'_>,
        v: Data<'_>,
        b_pages: Data<'_>,
        pages: &PageTable,
        scalings: &[f32],
        slice_offsets: &[usize],
        threads: usize,
    ) -> Result<()> {
        let out_total = self.check_offsets(slice_offsets)?;
        self.check_pages(pages)?;
        let shape = "num_pages x out_total x page_rank";
        self.check_len("b_pages", b_pages.len(), &[pages.num_pages, out_total, pages.page_rank], shape)?;
        let layout = pages.layout(self.n_slices, 0, out_total);
        self.expand_in(out, v, b_pages, scalings, slice_offsets, threads, &layout)
    }

    /// [`CpuPlan::paged_shrink`] then [`CpuPlan::paged_expand`] in one call, `v` kept in a scratch
    /// buffer of the call ([`CpuPlan::lora_delta`] through page tables): `out += scaling · (x Aᵀ) Bᵀ`
    /// for the plan's tokens, A and B read through `pages`.
    ///
    /// Shapes as for those two; `x`, `a_pages`, `b_pages` and `out` share one dtype.
    ///
    /// Errors: as for [`CpuPlan::paged_shrink`] and [`CpuPlan::paged_expand`]; `out` is untouched on
    /// any error.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_lora_delta(
        &self,
        out: DataMut<'_>,
        x: Data<'_>,
        in_features: usize,
        a_pages: Data<'_>,
        b_pages: Data<'_>,
        pages: &PageTable,
        scalings: &[f32],
        slice_offsets: &[usize],
        threads: usize,
    ) -> Result<()> {
        self.through_scratch(
            x,
            |v| self.paged_shrink(x, in_features, a_pages, pages, v, threads),
            |v| self.paged_expand(out, v, b_pages, pages, scalings, slice_offsets, threads),
        )
    }
}
