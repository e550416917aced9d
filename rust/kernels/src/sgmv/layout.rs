//! Where a slot's rank rows live in a pool: the slot layout (every slot `max_rank` ranks wide) or rank
//! pages read through a page table (issue 37). The kernels ([`super::avx512`]) find A's rows and B's
//! rank columns only through a [`Layout`], so one body of SIMD code serves both.

/// A run of one slot's ranks that lies contiguous in B's innermost dimension: ranks `lo..lo + len`,
/// with `b[offset + o * stride + j]` the element of output row `o` (counted from the pool's row 0)
/// and rank `lo + j`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) lo: usize,
    pub(crate) len: usize,
    pub(crate) offset: usize,
    pub(crate) stride: usize,
}

/// The addresses (element offsets) of a slot's weights. Callers stay below the slot's rank, which the
/// plan bounded by what the layout holds (`max_rank`, or the slot's pages).
pub(crate) trait Layout: Sync {
    /// The offset of A's row for rank `j` of slice `slice` of `slot` (`in_features` long).
    fn a_row(&self, slot: usize, slice: usize, j: usize) -> usize;
    /// How many [`Span`]s hold ranks `0..rank` of `slot`'s B.
    fn n_spans(&self, rank: usize) -> usize;
    /// The `k`-th of them (`k < n_spans(rank)`), cut at `rank`.
    fn span(&self, slot: usize, rank: usize, k: usize) -> Span;
}

/// The slot layout: `a [n_slots, n_slices * R, in_features]`, `b [n_slots, out_total, R]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slots {
    pub(crate) n_slices: usize,
    pub(crate) max_rank: usize,
    pub(crate) in_features: usize,
    pub(crate) out_total: usize,
}

impl Layout for Slots {
    #[inline(always)]
    fn a_row(&self, slot: usize, slice: usize, j: usize) -> usize {
        ((slot * self.n_slices + slice) * self.max_rank + j) * self.in_features
    }

    #[inline(always)]
    fn n_spans(&self, rank: usize) -> usize {
        usize::from(rank > 0)
    }

    #[inline(always)]
    fn span(&self, slot: usize, rank: usize, _k: usize) -> Span {
        Span { lo: 0, len: rank, offset: slot * self.out_total * self.max_rank, stride: self.max_rank }
    }
}

/// The paged layout: `a_pages [num_pages, n_slices * page_rank, in_features]`,
/// `b_pages [num_pages, out_total, page_rank]`; slot `s`'s `k`-th page is
/// `table[indptr[s] + k]` and holds its ranks `k * page_rank..(k + 1) * page_rank`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pages<'a> {
    pub(crate) n_slices: usize,
    pub(crate) page_rank: usize,
    pub(crate) in_features: usize,
    pub(crate) out_total: usize,
    pub(crate) indptr: &'a [usize],
    pub(crate) table: &'a [usize],
}

impl Pages<'_> {
    #[inline(always)]
    fn page(&self, slot: usize, k: usize) -> usize {
        self.table[self.indptr[slot] + k]
    }
}

impl Layout for Pages<'_> {
    #[inline(always)]
    fn a_row(&self, slot: usize, slice: usize, j: usize) -> usize {
        let page = self.page(slot, j / self.page_rank);
        ((page * self.n_slices + slice) * self.page_rank + j % self.page_rank) * self.in_features
    }

    #[inline(always)]
    fn n_spans(&self, rank: usize) -> usize {
        rank.div_ceil(self.page_rank)
    }

    #[inline(always)]
    fn span(&self, slot: usize, rank: usize, k: usize) -> Span {
        let lo = k * self.page_rank;
        Span {
            lo,
            len: (rank - lo).min(self.page_rank),
            offset: self.page(slot, k) * self.out_total * self.page_rank,
            stride: self.page_rank,
        }
    }
}
