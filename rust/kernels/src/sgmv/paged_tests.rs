//! The paged kernels against a plain float64 reference written from the slot-layout weights the pages
//! were cut from: random page orders and page ranks (1, odd, 4, 8, 16), ranks below, at and past a
//! page, spare pages and every element a slot does not own filled with NaN (a kernel that reads one
//! shows it), idle slots, threads.

use proptest::prelude::*;

use super::sgmv_tests::{check_expanded, check_shrunk, Dtype, Rng, Tensor};
use super::{available, CpuPlan, PageTable};
use lora_pin_core::Error;

#[derive(Debug, Clone)]
struct Case {
    n_tokens: usize,
    n_slots: usize,
    n_slices: usize,
    max_rank: usize,
    page_rank: usize,
    spare_pages: usize,
    in_features: usize,
    widths: Vec<usize>,
    ranks: Vec<i64>,
    tokens: Vec<i64>,
    indptr: Vec<i64>,
    slots: Vec<i64>,
    seed: u64,
    threads: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..4, 1usize..5, prop_oneof![Just(4usize), Just(16), Just(20), Just(64)], 1usize..40)
        .prop_flat_map(|(n_slices, n_slots, max_rank, n_tokens)| {
            (
                Just((n_slices, n_slots, max_rank, n_tokens)),
                prop_oneof![Just(1usize), Just(3), Just(4), Just(8), Just(16)],
                0usize..3,
                prop_oneof![1usize..40, Just(64usize), 60usize..70],
                prop::collection::vec(0usize..40, n_slices),
                prop::collection::vec(0..=max_rank as i64, n_slots * n_slices),
                Just(()).prop_perturb(move |_, mut rng| {
                    let mut order: Vec<i64> = (0..n_tokens as i64).collect();
                    for i in (1..order.len()).rev() {
                        order.swap(i, rng.random_range(0..=i));
                    }
                    order.truncate(rng.random_range(0..=n_tokens));
                    let mut indptr = vec![0i64];
                    let mut slots = Vec::new();
                    while (*indptr.last().unwrap() as usize) < order.len() {
                        let left = order.len() - *indptr.last().unwrap() as usize;
                        // Up to 24 tokens a group: the expand's row and panel paths both run.
                        indptr.push(indptr.last().unwrap() + rng.random_range(1..=left.min(24)) as i64);
                        slots.push(rng.random_range(0..n_slots) as i64);
                    }
                    (order, indptr, slots)
                }),
                any::<u64>(),
                1usize..4,
            )
        })
        .prop_map(|(dims, page_rank, spare_pages, in_features, widths, ranks, groups, seed, threads)| {
            let (n_slices, n_slots, max_rank, n_tokens) = dims;
            let (tokens, indptr, slots) = groups;
            Case {
                n_tokens,
                n_slots,
                n_slices,
                max_rank,
                page_rank,
                spare_pages,
                in_features,
                widths,
                ranks,
                tokens,
                indptr,
                slots,
                seed: seed | 1,
                threads,
            }
        })
}

/// A paged pool's page tables: each slot's pages drawn from a shuffled order.
struct Tables {
    indptr: Vec<i64>,
    table: Vec<i64>,
    num_pages: usize,
}

impl Tables {
    fn page(&self, slot: usize, k: usize) -> usize {
        self.table[self.indptr[slot] as usize + k] as usize
    }
}

impl Case {
    fn plan(&self) -> CpuPlan {
        CpuPlan::new(
            self.n_tokens,
            &self.tokens,
            &self.indptr,
            &self.slots,
            &self.ranks,
            self.n_slices,
            self.max_rank,
        )
        .unwrap()
        .with_min_share(if self.threads > 1 { 1 } else { usize::MAX })
    }

    fn rank(&self, slot: usize, s: usize) -> usize {
        self.ranks[slot * self.n_slices + s] as usize
    }

    fn slot_of(&self) -> Vec<Option<usize>> {
        let mut out = vec![None; self.n_tokens];
        for (g, &slot) in self.slots.iter().enumerate() {
            for &t in &self.tokens[self.indptr[g] as usize..self.indptr[g + 1] as usize] {
                out[t as usize] = Some(slot as usize);
            }
        }
        out
    }

    fn offsets(&self) -> Vec<usize> {
        let mut offsets = vec![0usize];
        for w in &self.widths {
            offsets.push(offsets.last().unwrap() + w);
        }
        offsets
    }

    fn tables(&self, rng: &mut Rng) -> Tables {
        let counts: Vec<usize> = (0..self.n_slots)
            .map(|k| (0..self.n_slices).map(|s| self.rank(k, s)).max().unwrap().div_ceil(self.page_rank))
            .collect();
        let num_pages = counts.iter().sum::<usize>() + self.spare_pages;
        let mut order: Vec<i64> = (0..num_pages as i64).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let mut indptr = vec![0i64];
        for c in &counts {
            indptr.push(indptr.last().unwrap() + *c as i64);
        }
        order.truncate(*indptr.last().unwrap() as usize);
        Tables { indptr, table: order, num_pages }
    }

    /// A's pages cut from `a` (`[slots, n_slices * R, in]`), NaN wherever no slot's rank reaches.
    fn a_pages(&self, dtype: Dtype, a: &Tensor, t: &Tables) -> Tensor {
        let (s, r, n, p) = (self.n_slices, self.max_rank, self.in_features, self.page_rank);
        let mut pages = vec![f32::NAN; t.num_pages * s * p * n];
        for k in 0..self.n_slots {
            for slice in 0..s {
                for j in 0..self.rank(k, slice) {
                    let row = (t.page(k, j / p) * s + slice) * p + j % p;
                    let src = ((k * s + slice) * r + j) * n;
                    pages[row * n..(row + 1) * n].copy_from_slice(&a.values[src..src + n]);
                }
            }
        }
        Tensor::new(dtype, pages)
    }

    /// B's pages cut from `b` (`[slots, out_total, R]`), NaN wherever no slot's rank reaches.
    fn b_pages(&self, dtype: Dtype, b: &Tensor, t: &Tables, offsets: &[usize]) -> Tensor {
        let (r, p, out_total) = (self.max_rank, self.page_rank, offsets[self.n_slices]);
        let mut pages = vec![f32::NAN; t.num_pages * out_total * p];
        for k in 0..self.n_slots {
            for slice in 0..self.n_slices {
                for o in offsets[slice]..offsets[slice + 1] {
                    for j in 0..self.rank(k, slice) {
                        pages[(t.page(k, j / p) * out_total + o) * p + j % p] =
                            b.values[(k * out_total + o) * r + j];
                    }
                }
            }
        }
        Tensor::new(dtype, pages)
    }

    /// The paged shrink against the reference; `perturb` reads a slot's first page where its second
    /// should be (the check must then fail: it sees which page a rank comes from).
    fn check_shrink(&self, dtype: Dtype, perturb: bool) -> std::result::Result<(), TestCaseError> {
        let mut rng = Rng(self.seed);
        let (t, s, r, n) = (self.n_tokens, self.n_slices, self.max_rank, self.in_features);
        let x = Tensor::new(dtype, (0..t * n).map(|_| rng.uniform()));
        let a = Tensor::new(dtype, (0..self.n_slots * s * r * n).map(|_| rng.uniform()));
        let mut tables = self.tables(&mut rng);
        let a_pages = self.a_pages(dtype, &a, &tables);
        if perturb {
            perturb_tables(&mut tables);
        }
        let pages = PageTable::new(&tables.indptr, &tables.table, self.page_rank, tables.num_pages).unwrap();
        let sentinel = 7.0;
        let mut v = Tensor::new(dtype, (0..t * s * r).map(|_| sentinel));
        self.plan().paged_shrink(x.data(), n, a_pages.data(), &pages, v.data_mut(), self.threads).unwrap();
        check_shrunk(&v, &x, &a, sentinel, &self.slot_of(), |k, q| self.rank(k, q), (s, r))
    }

    /// The paged expand against the reference; `perturb` as for [`Case::check_shrink`].
    fn check_expand(&self, dtype: Dtype, perturb: bool) -> std::result::Result<(), TestCaseError> {
        let mut rng = Rng(self.seed);
        let (t, s, r) = (self.n_tokens, self.n_slices, self.max_rank);
        let offsets = self.offsets();
        let out_total = offsets[s];
        let v = Tensor::new(dtype, (0..t * s * r).map(|_| rng.uniform()));
        let b = Tensor::new(dtype, (0..self.n_slots * out_total * r).map(|_| rng.uniform()));
        let mut tables = self.tables(&mut rng);
        let b_pages = self.b_pages(dtype, &b, &tables, &offsets);
        if perturb {
            perturb_tables(&mut tables);
        }
        let pages = PageTable::new(&tables.indptr, &tables.table, self.page_rank, tables.num_pages).unwrap();
        let scalings: Vec<f32> = (0..self.n_slots * s).map(|_| rng.uniform() * 4.0).collect();
        let before = Tensor::new(dtype, (0..t * out_total).map(|_| rng.uniform()));
        let mut out = Tensor::new(dtype, before.values.iter().copied());
        self.plan()
            .paged_expand(out.data_mut(), v.data(), b_pages.data(), &pages, &scalings, &offsets, self.threads)
            .unwrap();
        let slots = self.slot_of();
        check_expanded(&out, &before, &v, &b, &scalings, &offsets, &slots, |k, q| self.rank(k, q), r)
    }

    /// The fused paged delta against the two paged ops it fuses (each checked against the reference
    /// above): bit for bit, `v` rounded to the dtype in between as the two ops round it.
    fn check_delta(&self, dtype: Dtype) -> std::result::Result<(), TestCaseError> {
        let mut rng = Rng(self.seed ^ 0x5eed);
        let (t, s, r, n) = (self.n_tokens, self.n_slices, self.max_rank, self.in_features);
        let offsets = self.offsets();
        let out_total = offsets[s];
        let x = Tensor::new(dtype, (0..t * n).map(|_| rng.uniform()));
        let a = Tensor::new(dtype, (0..self.n_slots * s * r * n).map(|_| rng.uniform()));
        let b = Tensor::new(dtype, (0..self.n_slots * out_total * r).map(|_| rng.uniform()));
        let tables = self.tables(&mut rng);
        let (a_pages, b_pages) =
            (self.a_pages(dtype, &a, &tables), self.b_pages(dtype, &b, &tables, &offsets));
        let pages = PageTable::new(&tables.indptr, &tables.table, self.page_rank, tables.num_pages).unwrap();
        let scalings: Vec<f32> = (0..self.n_slots * s).map(|_| rng.uniform() * 4.0).collect();
        let before: Vec<f32> = (0..t * out_total).map(|_| rng.uniform()).collect();
        let plan = self.plan();
        let mut fused = Tensor::new(dtype, before.iter().copied());
        plan.paged_lora_delta(
            fused.data_mut(),
            x.data(),
            n,
            a_pages.data(),
            b_pages.data(),
            &pages,
            &scalings,
            &offsets,
            self.threads,
        )
        .unwrap();
        let mut v = Tensor::new(dtype, (0..t * s * r).map(|_| 0.0));
        plan.paged_shrink(x.data(), n, a_pages.data(), &pages, v.data_mut(), self.threads).unwrap();
        let mut apart = Tensor::new(dtype, before.iter().copied());
        plan.paged_expand(
            apart.data_mut(),
            v.data(),
            b_pages.data(),
            &pages,
            &scalings,
            &offsets,
            self.threads,
        )
        .unwrap();
        for i in 0..t * out_total {
            prop_assert_eq!(fused.raw(i), apart.raw(i), "out element {} ({:?})", i, dtype);
        }
        Ok(())
    }
}

/// The first slot with two pages reads its page 1 where its page 0 is (page j -> j + 1).
fn perturb_tables(t: &mut Tables) {
    let slot =
        (0..t.indptr.len() - 1).find(|&k| t.indptr[k + 1] - t.indptr[k] >= 2).expect("a slot of 2 pages");
    let first = t.indptr[slot] as usize;
    t.table[first] = t.table[first + 1];
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn paged_shrink_matches_the_reference(case in case()) {
        pass_without_kernels!();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            case.check_shrink(dtype, false)?;
        }
    }

    #[test]
    fn paged_expand_matches_the_reference(case in case()) {
        pass_without_kernels!();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            case.check_expand(dtype, false)?;
        }
    }

    #[test]
    fn the_fused_paged_delta_is_shrink_then_expand(case in case()) {
        pass_without_kernels!();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            case.check_delta(dtype)?;
        }
    }
}

/// Two slots of ranks 16 and 5 in pages of 4, every token on slot 0 (so its pages are read), enough
/// tokens for the expand's panel path and few enough for its row path in the other group.
fn two_page_case(page_rank: usize) -> Case {
    Case {
        n_tokens: 12,
        n_slots: 2,
        n_slices: 2,
        max_rank: 16,
        page_rank,
        spare_pages: 1,
        in_features: 37,
        widths: vec![20, 9],
        ranks: vec![16, 12, 5, 0],
        tokens: (0..12).collect(),
        indptr: vec![0, 9, 11, 12],
        slots: vec![0, 1, 0],
        seed: 12345,
        threads: 1,
    }
}

#[test]
fn a_kernel_reading_the_wrong_page_fails_the_checks() {
    if !available() {
        return;
    }
    for page_rank in [1, 4, 8] {
        let case = two_page_case(page_rank);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            assert!(case.check_shrink(dtype, false).is_ok(), "{page_rank} {dtype:?}");
            assert!(case.check_expand(dtype, false).is_ok(), "{page_rank} {dtype:?}");
            assert!(case.check_shrink(dtype, true).is_err(), "shrink perturbed: {page_rank} {dtype:?}");
            assert!(case.check_expand(dtype, true).is_err(), "expand perturbed: {page_rank} {dtype:?}");
        }
    }
}

fn op_err<T: std::fmt::Debug>(result: lora_pin_core::Result<T>) -> String {
    match result {
        Err(Error::OpArgument(msg)) => msg,
        other => panic!("expected an OpArgument error, got {other:?}"),
    }
}

#[test]
fn bad_page_tables_are_refused_by_name() {
    assert!(op_err(PageTable::new(&[0, 1], &[0], 0, 4)).contains("page_rank"));
    assert!(op_err(PageTable::new(&[0, 2, 1], &[0, 1], 4, 4)).contains("page_indptr must rise"));
    assert!(op_err(PageTable::new(&[1, 2], &[0, 1], 4, 4)).contains("page_indptr must rise"));
    assert!(op_err(PageTable::new(&[0, 1], &[0, 1], 4, 4)).contains("len(page_table)=2"));
    assert!(op_err(PageTable::new(&[], &[], 4, 4)).contains("page_indptr"));
    assert!(op_err(PageTable::new(&[0, 2], &[0, 4], 4, 4)).contains("page_table[1] = 4"));
    assert!(op_err(PageTable::new(&[0, 1], &[-1], 4, 4)).contains("page_table[0] = -1"));
}

#[test]
fn pages_that_do_not_fit_the_plan_are_refused_and_nothing_is_written() {
    // Two slots, ranks 5 and 0, page_rank 4: slot 0 needs 2 pages.
    let plan = CpuPlan::new(2, &[1], &[0, 1], &[0], &[5, 0], 1, 8).unwrap();
    let (n, p) = (3, 4);
    let x = vec![1f32; 2 * n];
    let mut v = vec![9f32; 2 * 8];
    let shrink = |pages: &PageTable, a: &[f32], v: &mut [f32]| {
        plan.paged_shrink(super::Data::F32(&x), n, super::Data::F32(a), pages, super::DataMut::F32(v), 1)
    };
    let a = vec![1f32; 2 * p * n];
    let short = PageTable::new(&[0, 1, 1], &[0], p, 2).unwrap();
    assert!(op_err(shrink(&short, &a, &mut v)).contains("slot 0 has rank 5 in slice 0 but its 1 pages"));
    let three = PageTable::new(&[0, 2, 2, 2], &[0, 1], p, 2).unwrap();
    assert!(op_err(shrink(&three, &a, &mut v)).contains("slots + 1"));
    let fits = PageTable::new(&[0, 2, 2], &[1, 0], p, 2).unwrap();
    assert!(op_err(shrink(&fits, &a[..a.len() - 1], &mut v)).contains("a_pages has 23 elements"));
    assert_eq!(v, vec![9f32; 16]);
    let mut out = vec![5f32; 2 * 6];
    let b = vec![1f32; 2 * 6 * p];
    let expand = |pages: &PageTable, b: &[f32], out: &mut [f32]| {
        plan.paged_expand(
            super::DataMut::F32(out),
            super::Data::F32(&v),
            super::Data::F32(b),
            pages,
            &[1.0, 1.0],
            &[0, 6],
            1,
        )
    };
    assert!(op_err(expand(&short, &b, &mut out)).contains("slot 0 has rank 5"));
    assert!(op_err(expand(&fits, &b[1..], &mut out)).contains("b_pages has 47 elements"));
    assert_eq!(out, vec![5f32; 12]);
    let delta = |pages: &PageTable, a: &[f32], b: &[f32], out: &mut [f32]| {
        let (x, a, b) = (super::Data::F32(&x), super::Data::F32(a), super::Data::F32(b));
        plan.paged_lora_delta(super::DataMut::F32(out), x, n, a, b, pages, &[1.0, 1.0], &[0, 6], 1)
    };
    assert!(op_err(delta(&short, &a, &b, &mut out)).contains("slot 0 has rank 5"));
    assert!(op_err(delta(&fits, &a[1..], &b, &mut out)).contains("a_pages has 23 elements"));
    if available() {
        assert!(op_err(delta(&fits, &a, &b[1..], &mut out)).contains("b_pages has 47 elements"));
    } else {
        // The fused delta's shrink half runs before its expand half checks B: without the kernels, the
        // CPU's refusal comes first (still nothing written).
        assert!(
            matches!(delta(&fits, &a, &b[1..], &mut out), Err(Error::Usage(msg)) if msg.contains("AVX-512"))
        );
    }
    assert_eq!(out, vec![5f32; 12], "the fused delta writes nothing on an error");
    if available() {
        expand(&fits, &b, &mut out).unwrap();
        assert_eq!(&out[..6], &[5f32; 6], "row 0 uses no slot");
        assert_eq!(&out[6..], &[50f32; 6], "row 1: 5 + 5 ranks of 9 x 1");
    }
}
