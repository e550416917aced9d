//! The CPU kernels against a plain float64 reference written from the ops' definitions, over random
//! shapes (ranks below, at and past a vector, odd widths, several tokens per slot, idle slots).

use half::{bf16, f16};
use proptest::prelude::*;

use super::{available, CpuPlan, Data, DataMut};
use lora_pin_core::Error;

/// A small deterministic generator for tensor contents (proptest picks the seed).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(super) fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Dtype {
    F32,
    Bf16,
    F16,
}

/// Values rounded to the dtype (stored as f32) and their bits in that dtype.
pub(super) struct Tensor {
    pub(super) values: Vec<f32>,
    bits: Vec<u16>,
    dtype: Dtype,
}

impl Tensor {
    pub(super) fn new(dtype: Dtype, values: impl IntoIterator<Item = f32>) -> Self {
        let (mut out, mut bits) = (Vec::new(), Vec::new());
        for v in values {
            match dtype {
                Dtype::F32 => out.push(v),
                Dtype::Bf16 => {
                    let h = bf16::from_f32(v);
                    bits.push(h.to_bits());
                    out.push(h.to_f32());
                }
                Dtype::F16 => {
                    let h = f16::from_f32(v);
                    bits.push(h.to_bits());
                    out.push(h.to_f32());
                }
            }
        }
        Self { values: out, bits, dtype }
    }

    pub(super) fn data(&self) -> Data<'_> {
        match self.dtype {
            Dtype::F32 => Data::F32(&self.values),
            Dtype::Bf16 => Data::Bf16(&self.bits),
            Dtype::F16 => Data::F16(&self.bits),
        }
    }

    pub(super) fn data_mut(&mut self) -> DataMut<'_> {
        match self.dtype {
            Dtype::F32 => DataMut::F32(&mut self.values),
            Dtype::Bf16 => DataMut::Bf16(&mut self.bits),
            Dtype::F16 => DataMut::F16(&mut self.bits),
        }
    }

    /// The current contents as f64 (after a kernel wrote the bits).
    pub(super) fn read(&self, i: usize) -> f64 {
        match self.dtype {
            Dtype::F32 => self.values[i] as f64,
            Dtype::Bf16 => bf16::from_bits(self.bits[i]).to_f64(),
            Dtype::F16 => f16::from_bits(self.bits[i]).to_f64(),
        }
    }

    pub(super) fn raw(&self, i: usize) -> u32 {
        match self.dtype {
            Dtype::F32 => self.values[i].to_bits(),
            _ => self.bits[i] as u32,
        }
    }

    /// Relative rounding error of one store in this dtype.
    pub(super) fn eps(&self) -> f64 {
        match self.dtype {
            Dtype::F32 => 2f64.powi(-23),
            Dtype::Bf16 => 2f64.powi(-8),
            Dtype::F16 => 2f64.powi(-11),
        }
    }

    /// Half the gap between subnormals: the absolute rounding error near zero.
    pub(super) fn tiny(&self) -> f64 {
        match self.dtype {
            Dtype::F16 => 2f64.powi(-25),
            _ => 1e-30,
        }
    }
}

/// A random step: slots with ranks per slice, slice widths, and groups of tokens (some tokens idle).
#[derive(Debug, Clone)]
struct Case {
    n_tokens: usize,
    n_slots: usize,
    n_slices: usize,
    max_rank: usize,
    in_features: usize,
    widths: Vec<usize>,
    ranks: Vec<i64>,
    tokens: Vec<i64>,
    indptr: Vec<i64>,
    slots: Vec<i64>,
    seed: u64,
    // 1: one thread; more: that many, with every group worth a thread.
    threads: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..4, 1usize..5, prop_oneof![Just(1usize), Just(4), Just(16), Just(20), Just(64)], 1usize..40)
        .prop_flat_map(|(n_slices, n_slots, max_rank, n_tokens)| {
            (
                Just((n_slices, n_slots, max_rank, n_tokens)),
                prop_oneof![1usize..40, Just(64usize), 60usize..70],
                prop::collection::vec(0usize..40, n_slices),
                prop::collection::vec(0..=max_rank as i64, n_slots * n_slices),
                Just(()).prop_perturb(move |_, mut rng| {
                    // Shuffle the tokens, keep a prefix, and cut it into groups on random slots.
                    let mut order: Vec<i64> = (0..n_tokens as i64).collect();
                    for i in (1..order.len()).rev() {
                        order.swap(i, rng.random_range(0..=i));
                    }
                    order.truncate(rng.random_range(0..=n_tokens));
                    let mut indptr = vec![0i64];
                    let mut slots = Vec::new();
                    while (*indptr.last().unwrap() as usize) < order.len() {
                        let left = order.len() - *indptr.last().unwrap() as usize;
                        // Up to 24 tokens a group: groups of PANEL_TOKENS and more take the panel expand,
                        // block by block up to PANEL_STREAM_TOKENS and streamed past it.
                        indptr.push(indptr.last().unwrap() + rng.random_range(1..=left.min(24)) as i64);
                        slots.push(rng.random_range(0..n_slots) as i64);
                    }
                    (order, indptr, slots)
                }),
                any::<u64>(),
                1usize..4,
            )
        })
        .prop_map(
            |((n_slices, n_slots, max_rank, n_tokens), in_features, widths, ranks, groups, seed, threads)| {
                let (tokens, indptr, slots) = groups;
                Case {
                    n_tokens,
                    n_slots,
                    n_slices,
                    max_rank,
                    in_features,
                    widths,
                    ranks,
                    tokens,
                    indptr,
                    slots,
                    seed: seed | 1,
                    threads,
                }
            },
        )
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

    /// The slot of each token, `None` for tokens no group covers.
    fn slot_of(&self) -> Vec<Option<usize>> {
        let mut out = vec![None; self.n_tokens];
        for (g, &slot) in self.slots.iter().enumerate() {
            for &t in &self.tokens[self.indptr[g] as usize..self.indptr[g + 1] as usize] {
                out[t as usize] = Some(slot as usize);
            }
        }
        out
    }

    fn rank(&self, slot: usize, s: usize) -> usize {
        self.ranks[slot * self.n_slices + s] as usize
    }

    fn check_shrink(&self, dtype: Dtype) -> std::result::Result<(), TestCaseError> {
        let mut rng = Rng(self.seed);
        let (t, s, r, n) = (self.n_tokens, self.n_slices, self.max_rank, self.in_features);
        let x = Tensor::new(dtype, (0..t * n).map(|_| rng.uniform()));
        // Zero past each slot's rank, as the pool keeps it.
        let a = Tensor::new(
            dtype,
            (0..self.n_slots * s * r * n).map(|i| {
                let (slot, row) = (i / (s * r * n), (i / n) % (s * r));
                if row % r < self.rank(slot, row / r) {
                    rng.uniform()
                } else {
                    0.0
                }
            }),
        );
        let sentinel = 7.0;
        let mut v = Tensor::new(dtype, (0..t * s * r).map(|_| sentinel));
        self.plan().shrink(x.data(), n, a.data(), v.data_mut(), self.threads).unwrap();
        check_shrunk(&v, &x, &a, sentinel, &self.slot_of(), |k, q| self.rank(k, q), (s, r))
    }

    fn check_expand(&self, dtype: Dtype) -> std::result::Result<(), TestCaseError> {
        let mut rng = Rng(self.seed);
        let (t, s, r) = (self.n_tokens, self.n_slices, self.max_rank);
        let mut offsets = vec![0usize];
        for w in &self.widths {
            offsets.push(offsets.last().unwrap() + w);
        }
        let out_total = offsets[s];
        let v = Tensor::new(dtype, (0..t * s * r).map(|_| rng.uniform()));
        // B past each slot's rank holds NaN: the kernel must never read it.
        let b = Tensor::new(
            dtype,
            (0..self.n_slots * out_total * r).map(|i| {
                let (slot, row, j) = (i / (out_total * r), (i / r) % out_total, i % r);
                let slice = offsets.iter().rposition(|&o| o <= row).unwrap().min(s - 1);
                let slice = (0..s).find(|&q| offsets[q] <= row && row < offsets[q + 1]).unwrap_or(slice);
                if j < self.rank(slot, slice) {
                    rng.uniform()
                } else {
                    f32::NAN
                }
            }),
        );
        let scalings: Vec<f32> = (0..self.n_slots * s).map(|_| rng.uniform() * 4.0).collect();
        let before = Tensor::new(dtype, (0..t * out_total).map(|_| rng.uniform()));
        let mut out = Tensor::new(dtype, before.values.iter().copied());
        self.plan().expand(out.data_mut(), v.data(), b.data(), &scalings, &offsets, self.threads).unwrap();
        let slots = self.slot_of();
        check_expanded(&out, &before, &v, &b, &scalings, &offsets, &slots, |k, q| self.rank(k, q), r)
    }

    /// `lora_delta` gives bit for bit what `shrink` then `expand` give (same kernels, same rounding of v).
    fn check_lora_delta(&self, dtype: Dtype) -> std::result::Result<(), TestCaseError> {
        let mut rng = Rng(self.seed);
        let (t, s, r, n) = (self.n_tokens, self.n_slices, self.max_rank, self.in_features);
        let mut offsets = vec![0usize];
        for w in &self.widths {
            offsets.push(offsets.last().unwrap() + w);
        }
        let out_total = offsets[s];
        let x = Tensor::new(dtype, (0..t * n).map(|_| rng.uniform()));
        let a = Tensor::new(dtype, (0..self.n_slots * s * r * n).map(|_| rng.uniform()));
        let b = Tensor::new(dtype, (0..self.n_slots * out_total * r).map(|_| rng.uniform()));
        let scalings: Vec<f32> = (0..self.n_slots * s).map(|_| rng.uniform() * 4.0).collect();
        let before: Vec<f32> = (0..t * out_total).map(|_| rng.uniform()).collect();
        let plan = self.plan();
        let mut v = Tensor::new(dtype, (0..t * s * r).map(|_| 0.0));
        plan.shrink(x.data(), n, a.data(), v.data_mut(), self.threads).unwrap();
        let mut want = Tensor::new(dtype, before.iter().copied());
        plan.expand(want.data_mut(), v.data(), b.data(), &scalings, &offsets, self.threads).unwrap();
        let mut got = Tensor::new(dtype, before.iter().copied());
        plan.lora_delta(got.data_mut(), x.data(), n, a.data(), b.data(), &scalings, &offsets, self.threads)
            .unwrap();
        for i in 0..t * out_total {
            prop_assert_eq!(got.raw(i), want.raw(i), "{:?} element {}", dtype, i);
        }
        Ok(())
    }
}

/// Checks a shrink's `v` (`[T, s*r]`) against the f64 reference of `x` (`[T, n]`) and a slot-layout
/// `a` (`[slots, s*r, n]`): a column past its token's slot rank, or of a token with no slot, still
/// holds `sentinel`. `slot_of`: each token's slot; `rank(slot, slice)`.
pub(super) fn check_shrunk(
    v: &Tensor,
    x: &Tensor,
    a: &Tensor,
    sentinel: f32,
    slot_of: &[Option<usize>],
    rank: impl Fn(usize, usize) -> usize,
    (s, r): (usize, usize),
) -> std::result::Result<(), TestCaseError> {
    let n = x.values.len() / slot_of.len().max(1);
    for (tok, slot) in slot_of.iter().enumerate() {
        for col in 0..s * r {
            let (slice, j) = (col / r, col % r);
            let got = v.read(tok * s * r + col);
            match slot.filter(|&k| j < rank(k, slice)) {
                None => prop_assert_eq!(got, sentinel as f64, "token {} col {} was written", tok, col),
                Some(k) => {
                    let terms = (0..n).map(|i| {
                        x.values[tok * n + i] as f64 * a.values[((k * s + slice) * r + j) * n + i] as f64
                    });
                    let (want, size) = terms.fold((0.0, 0.0), |(w, m), p| (w + p, m + p.abs()));
                    let tol = v.eps() * want.abs() + 1e-6 * size + v.tiny();
                    prop_assert!(
                        (got - want).abs() <= tol,
                        "{:?} token {} col {}: got {} want {}",
                        v.dtype,
                        tok,
                        col,
                        got,
                        want
                    );
                }
            }
        }
    }
    Ok(())
}

/// Checks an expand's `out` (`[T, out_total]`, `before` it ran) against the f64 reference of `v`
/// (`[T, s*r]`), a slot-layout `b` (`[slots, out_total, r]`) and `scalings` (`[slots, s]`): a row of
/// a token with no slot, or a slice of rank 0, is unchanged bit for bit.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_expanded(
    out: &Tensor,
    before: &Tensor,
    v: &Tensor,
    b: &Tensor,
    scalings: &[f32],
    offsets: &[usize],
    slot_of: &[Option<usize>],
    rank: impl Fn(usize, usize) -> usize,
    r: usize,
) -> std::result::Result<(), TestCaseError> {
    let s = offsets.len() - 1;
    let out_total = offsets[s];
    for (tok, slot) in slot_of.iter().enumerate() {
        for slice in 0..s {
            for o in offsets[slice]..offsets[slice + 1] {
                let i = tok * out_total + o;
                let rank = slot.map_or(0, |k| rank(k, slice));
                let Some(k) = slot.filter(|_| rank > 0) else {
                    prop_assert_eq!(out.raw(i), before.raw(i), "token {} output {} changed", tok, o);
                    continue;
                };
                let scale = scalings[k * s + slice] as f64;
                let terms = (0..rank).map(|j| {
                    scale
                        * v.values[tok * s * r + slice * r + j] as f64
                        * b.values[(k * out_total + o) * r + j] as f64
                });
                let (delta, size) = terms.fold((0.0, 0.0), |(w, m), p| (w + p, m + p.abs()));
                let want = before.values[i] as f64 + delta;
                let got = out.read(i);
                let tol = out.eps() * want.abs() + 1e-6 * (size + before.values[i].abs() as f64) + out.tiny();
                prop_assert!(
                    (got - want).abs() <= tol,
                    "{:?} token {} output {}: got {} want {}",
                    out.dtype,
                    tok,
                    o,
                    got,
                    want
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn lora_delta_is_shrink_then_expand(case in case()) {
        pass_without_kernels!();
        for dtype in [Dtype::F32, Dtype::Bf16] {
            case.check_lora_delta(dtype)?;
        }
    }

    #[test]
    fn shrink_matches_the_reference(case in case()) {
        pass_without_kernels!();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            case.check_shrink(dtype)?;
        }
    }

    #[test]
    fn expand_matches_the_reference(case in case()) {
        pass_without_kernels!();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            case.check_expand(dtype)?;
        }
    }
}

#[test]
fn the_kernels_run_here_or_refuse_by_name() {
    // The property tests above run the kernels only where the CPU has them (x86-64 with AVX-512 F, BW
    // and VL, FMA, F16C). Elsewhere (an AVX2-only CPU) every entry must refuse, naming what it needs,
    // and write nothing: lora_pin's CPU backend then takes torch's grouped GEMMs.
    #[cfg(target_arch = "x86_64")]
    assert_eq!(
        available(),
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    );
    if available() {
        return;
    }
    eprintln!("this CPU lacks AVX-512: the kernel property tests checked the refusal only");
    let plan = CpuPlan::new(1, &[0], &[0, 1], &[0], &[2], 1, 2).unwrap();
    let (x, a, b) = (vec![1f32; 3], vec![1f32; 2 * 3], vec![1f32; 4 * 2]);
    let mut v = vec![7f32; 2];
    let mut out = vec![5f32; 4];
    let refused = |r: lora_pin_core::Result<()>| match r {
        Err(Error::Usage(msg)) => msg.contains("AVX-512") && msg.contains("torch path"),
        _ => false,
    };
    assert!(refused(plan.shrink(Data::F32(&x), 3, Data::F32(&a), DataMut::F32(&mut v), 1)));
    assert!(refused(plan.expand(DataMut::F32(&mut out), Data::F32(&v), Data::F32(&b), &[1.0], &[0, 4], 1)));
    assert!(refused(plan.lora_delta(
        DataMut::F32(&mut out),
        Data::F32(&x),
        3,
        Data::F32(&a),
        Data::F32(&b),
        &[1.0],
        &[0, 4],
        1
    )));
    assert_eq!((v, out), (vec![7f32; 2], vec![5f32; 4]), "nothing written");
}

fn err(result: lora_pin_core::Result<CpuPlan>) -> String {
    match result {
        Err(Error::OpArgument(msg)) => msg,
        other => panic!("expected an OpArgument error, got {other:?}"),
    }
}

#[test]
fn bad_layouts_are_refused_by_name() {
    let ranks = [4, 4];
    let new = |tokens: &[i64], indptr: &[i64], slots: &[i64], ranks: &[i64], n_slices| {
        CpuPlan::new(5, tokens, indptr, slots, ranks, n_slices, 4)
    };
    assert!(err(new(&[5], &[0, 1], &[0], &ranks, 1)).contains("token 5"));
    assert!(err(new(&[-1], &[0, 1], &[0], &ranks, 1)).contains("token -1"));
    assert!(err(new(&[1, 1], &[0, 2], &[0], &ranks, 1)).contains("more than one row"));
    assert!(err(new(&[1], &[0, 1], &[2], &ranks, 1)).contains("slot 2"));
    assert!(err(new(&[1], &[0, 1], &[-1], &ranks, 1)).contains("slot -1"));
    assert!(err(new(&[1], &[0, 2], &[0], &ranks, 1)).contains("group_indptr"));
    assert!(err(new(&[1, 2], &[0, 2, 1], &[0, 0], &ranks, 1)).contains("group_indptr"));
    assert!(err(new(&[1], &[0, 1], &[0, 0], &ranks, 1)).contains("groups + 1"));
    assert!(err(new(&[1], &[0, 1], &[0], &[5, 4], 1)).contains("max_rank=4"));
    assert!(err(new(&[1], &[0, 1], &[0], &[4, 4, 4], 2)).contains("multiple of n_slices"));
    assert!(err(new(&[1], &[0, 1], &[0], &ranks, 9)).contains("n_slices"));
}

#[test]
fn bad_buffers_are_refused_and_nothing_is_written() {
    let plan = CpuPlan::new(2, &[1], &[0, 1], &[0], &[2], 1, 2).unwrap();
    let (x, a) = (vec![1f32; 2 * 3], vec![1f32; 2 * 3]);
    let mut v = vec![9f32; 2 * 2];
    let short = plan.shrink(Data::F32(&x[..5]), 3, Data::F32(&a), DataMut::F32(&mut v), 1);
    assert!(matches!(short, Err(Error::OpArgument(ref m)) if m.starts_with("x has 5 elements")));
    let bits = vec![0u16; 2 * 3];
    let mixed = plan.shrink(Data::Bf16(&bits), 3, Data::F32(&a), DataMut::F32(&mut v), 1);
    assert!(matches!(mixed, Err(Error::OpArgument(ref m)) if m.contains("one dtype")));
    assert_eq!(v, vec![9f32; 4]);
    let mut out = vec![5f32; 2 * 3];
    let offsets = plan.expand(DataMut::F32(&mut out), Data::F32(&v), Data::F32(&a), &[1.0], &[1, 3], 1);
    assert!(matches!(offsets, Err(Error::OpArgument(ref m)) if m.contains("slice_offsets")));
    let scalings = plan.expand(DataMut::F32(&mut out), Data::F32(&v), Data::F32(&a), &[], &[0, 3], 1);
    assert!(matches!(scalings, Err(Error::OpArgument(ref m)) if m.contains("slot_scalings")));
    assert_eq!(out, vec![5f32; 6]);
    // Lengths whose product overflows are refused, not wrapped to a size a short buffer passes.
    let wrapped = plan.shrink(Data::F32(&[]), 1 << 63, Data::F32(&a), DataMut::F32(&mut v), 1);
    assert!(matches!(wrapped, Err(Error::OpArgument(ref m)) if m.contains("overflows")), "{wrapped:?}");
    let wide = plan.expand(DataMut::F32(&mut out), Data::F32(&v), Data::F32(&[]), &[1.0], &[0, 1 << 63], 1);
    assert!(matches!(wide, Err(Error::OpArgument(ref m)) if m.contains("overflows")), "{wide:?}");
    assert_eq!(out, vec![5f32; 6]);
}

#[test]
fn a_huge_token_count_allocates_nothing_per_token() {
    // n_tokens is the caller's word; the plan's memory follows the tokens given, not it.
    let plan = CpuPlan::new(1 << 45, &[7, 3], &[0, 2], &[0], &[2], 1, 2).unwrap();
    assert_eq!(plan.n_rows(), 2);
    let repeated = CpuPlan::new(1 << 45, &[7, 7], &[0, 2], &[0], &[2], 1, 2);
    assert!(matches!(repeated, Err(Error::OpArgument(ref m)) if m.contains("token 7 appears")));
}

#[test]
fn the_pool_runs_every_task_once_under_concurrent_calls() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Four callers share the pool's workers: one holds them, the others run on their own threads.
    std::thread::scope(|scope| {
        for caller in 0..4 {
            scope.spawn(move || {
                for round in 0..200 {
                    let n = 1 + (caller * 7 + round) % 23;
                    let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    super::pool::pool().run(3, n, &|i| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert!(
                        counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                        "caller {caller} round {round}"
                    );
                }
            });
        }
    });
}

#[test]
fn a_task_that_panics_on_a_worker_panics_the_caller_and_the_pool_goes_on() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pool = super::pool::pool();
    for _ in 0..20 {
        let result = std::panic::catch_unwind(|| {
            pool.run(2, 64, &|i| {
                if i % 2 == 1 {
                    panic!("task {i} failed");
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            })
        });
        assert!(result.is_err());
    }
    let ran = AtomicUsize::new(0);
    pool.run(2, 16, &|_| {
        ran.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(ran.load(Ordering::Relaxed), 16);
}

#[test]
fn cpu_features_agree_with_the_kernels_and_imply_each_other() {
    let f = crate::sgmv::cpu_features();
    assert_eq!(f.avx512, crate::sgmv::available());
    // Every CPU with AVX-512 F has AVX2; AMX CPUs have AVX-512 (no CPU pairs AMX with less).
    assert!(!f.avx512 || f.avx2);
    assert!(!f.amx_bf16 || f.avx512);
}
