//! The multi-adapter LoRA GEMM on the CPU (SGMV: segmented gather matrix-vector): shrink and expand for
//! decode-sized groups of tokens, in one call per op for a whole batch.
//!
//! The torch path (`lora_pin/ops/grouped.py`) runs one BLAS call per slot and slice. For a few tokens
//! per adapter those calls are matrix-vector products that BLAS runs well below the memory bandwidth,
//! plus a fixed cost per call; this module instead streams each adapter's weights once, with every
//! token of the adapter in registers, and converts bf16/fp16 on the fly (fp32 accumulation, one
//! rounding). Python owns every buffer: a call borrows the memory of tensors the caller has checked
//! (CPU, contiguous, one dtype) for its duration and never keeps it.
//!
//! [`CpuPlan`] is the validated shape of one step (which tokens use which slot, each slot's ranks);
//! [`CpuPlan::shrink`] and [`CpuPlan::expand`] check every buffer's length against it, so no index can
//! leave a buffer. The kernels need AVX-512 (F, BW, VL); [`available`] says whether this CPU has it,
//! and elsewhere Python keeps the torch path.

#[cfg(target_arch = "x86_64")]
mod avx512;
mod dora;
mod layout;
mod paged;
mod pool;

pub use dora::dora_scale_rows;
pub use paged::PageTable;

use layout::{Layout, Slots};

use lora_pin_core::{Error, Result};

/// One buffer's elements, by dtype: what Python's tensor holds (bf16 and fp16 as their bits).
#[derive(Debug, Clone, Copy)]
pub enum Data<'a> {
    /// float32.
    F32(&'a [f32]),
    /// bfloat16, as its bits.
    Bf16(&'a [u16]),
    /// float16, as its bits.
    F16(&'a [u16]),
}

/// A buffer a kernel writes, by dtype.
#[derive(Debug)]
pub enum DataMut<'a> {
    /// float32.
    F32(&'a mut [f32]),
    /// bfloat16, as its bits.
    Bf16(&'a mut [u16]),
    /// float16, as its bits.
    F16(&'a mut [u16]),
}

impl Data<'_> {
    fn len(&self) -> usize {
        match self {
            Data::F32(s) => s.len(),
            Data::Bf16(s) | Data::F16(s) => s.len(),
        }
    }

    fn dtype(&self) -> &'static str {
        match self {
            Data::F32(_) => "float32",
            Data::Bf16(_) => "bfloat16",
            Data::F16(_) => "float16",
        }
    }
}

impl DataMut<'_> {
    /// The same buffer, read-only (for its length and dtype).
    fn as_data(&self) -> Data<'_> {
        match self {
            DataMut::F32(s) => Data::F32(s),
            DataMut::Bf16(s) => Data::Bf16(s),
            DataMut::F16(s) => Data::F16(s),
        }
    }
}

/// Whether this CPU runs the kernels (x86-64 with AVX-512 F, BW and VL, plus FMA and F16C).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::detected()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The matrix units a CPU offers, as the CPU path chooses between the native kernels and the BLAS
/// (oneDNN, MKL) GEMMs torch calls: what wins where was measured per unit (BENCHMARKS.md, CPU ops).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    /// AVX2 and FMA (every x86-64 CPU of the last decade).
    pub avx2: bool,
    /// Everything the native kernels use ([`available`]).
    pub avx512: bool,
    /// AVX512-BF16 dot products (oneDNN's bf16 GEMMs on Cooper Lake, Zen 4 and later).
    pub avx512_bf16: bool,
    /// AMX tiles with bf16 products, enabled by the operating system (Sapphire Rapids and later):
    /// oneDNN's bf16 GEMMs run on them.
    pub amx_bf16: bool,
}

/// What this CPU has (all false off x86-64).
pub fn cpu_features() -> CpuFeatures {
    #[cfg(target_arch = "x86_64")]
    {
        CpuFeatures {
            avx2: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            avx512: avx512::detected(),
            avx512_bf16: is_x86_feature_detected!("avx512bf16"),
            amx_bf16: amx_bf16_enabled(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        CpuFeatures::default()
    }
}

/// AMX-BF16 and AMX-TILE in CPUID leaf 7 (EDX bits 22 and 24), with the tile state enabled by the
/// operating system in XCR0 (bits 17 and 18). std's detection of AMX is not stable yet.
#[cfg(target_arch = "x86_64")]
fn amx_bf16_enabled() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only where leaf 0 says it exists.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    let amx = leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0;
    amx && is_x86_feature_detected!("xsave") && tile_state_enabled()
}

/// Whether XCR0 has the AMX tile configuration and data states (bits 17 and 18).
#[cfg(target_arch = "x86_64")]
fn tile_state_enabled() -> bool {
    use std::arch::x86_64::__cpuid;
    // SAFETY: XGETBV runs only where leaf 1 ECX bit 27 (OSXSAVE) says the operating system allows it.
    __cpuid(1).ecx & (1 << 27) != 0 && unsafe { xcr0() } & (0b11 << 17) == 0b11 << 17
}

/// XCR0. Safety: the CPU and the operating system support XSAVE (OSXSAVE set).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller guarantees XSAVE and OSXSAVE; XCR0 exists wherever they do.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

/// The tokens of one slot, `tokens[start..end]` of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) slot: usize,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// One step's validated layout: groups of tokens by slot, and each slot's rank per slice.
#[derive(Debug, Clone)]
pub struct CpuPlan {
    n_tokens: usize,
    n_slices: usize,
    max_rank: usize,
    n_slots: usize,
    // [n_slots * n_slices], each in [0, max_rank].
    ranks: Vec<usize>,
    tokens: Vec<usize>,
    groups: Vec<Group>,
    // The least work worth a thread ([`MIN_SHARE`]; tests lower it to run tiny shapes threaded).
    min_share: usize,
}

fn arg(msg: String) -> Error {
    Error::OpArgument(msg)
}

impl CpuPlan {
    /// Validates a step's layout. `tokens[group_indptr[g]..group_indptr[g + 1]]` are the tokens of
    /// group `g`, which uses `group_slots[g]`; `ranks` is `[n_slots, n_slices]` row-major.
    ///
    /// Groups whose slot has rank 0 in every slice are dropped (no work); a token may appear in one
    /// group only.
    ///
    /// Errors: [`Error::OpArgument`] naming the value out of range (a token outside `[0, n_tokens)` or
    /// repeated, a slot outside `[0, n_slots)`, a rank outside `[0, max_rank]`, an `indptr` that does
    /// not rise from 0 to `len(tokens)`, `n_slices` outside 1..=8).
    pub fn new(
        n_tokens: usize,
        tokens: &[i64],
        group_indptr: &[i64],
        group_slots: &[i64],
        ranks: &[i64],
        n_slices: usize,
        max_rank: usize,
    ) -> Result<Self> {
        if !(1..=8).contains(&n_slices) {
            return Err(arg(format!("n_slices must be in 1..=8, got {n_slices}")));
        }
        if !ranks.len().is_multiple_of(n_slices) {
            return Err(arg(format!(
                "slot_ranks has {} values, not a multiple of n_slices={n_slices}",
                ranks.len()
            )));
        }
        let n_slots = ranks.len() / n_slices;
        let ranks = ranks
            .iter()
            .map(|&r| {
                usize::try_from(r)
                    .ok()
                    .filter(|&r| r <= max_rank)
                    .ok_or_else(|| arg(format!("slot_ranks must lie in [0, max_rank={max_rank}], got {r}")))
            })
            .collect::<Result<Vec<_>>>()?;
        if group_indptr.len() != group_slots.len() + 1 {
            return Err(arg(format!(
                "group_indptr has {} entries for {} groups (expected groups + 1)",
                group_indptr.len(),
                group_slots.len()
            )));
        }
        if group_indptr.first() != Some(&0)
            || group_indptr.last() != Some(&(tokens.len() as i64))
            || group_indptr.windows(2).any(|w| w[0] > w[1])
        {
            return Err(arg(format!(
                "group_indptr must rise from 0 to len(tokens)={}, got {group_indptr:?}",
                tokens.len()
            )));
        }
        let tokens = tokens
            .iter()
            .map(|&t| {
                usize::try_from(t)
                    .ok()
                    .filter(|&i| i < n_tokens)
                    .ok_or_else(|| arg(format!("token {t} lies outside [0, {n_tokens})")))
            })
            .collect::<Result<Vec<_>>>()?;
        // Sorted, not a flag per token: n_tokens is the caller's word, the tokens are what is here.
        let mut sorted = tokens.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(arg(format!("token {} appears in more than one row", w[0])));
        }
        let mut groups = Vec::with_capacity(group_slots.len());
        for (g, &slot) in group_slots.iter().enumerate() {
            let slot = usize::try_from(slot)
                .ok()
                .filter(|&s| s < n_slots)
                .ok_or_else(|| arg(format!("group {g} uses slot {slot}, outside [0, {n_slots})")))?;
            let (start, end) = (group_indptr[g] as usize, group_indptr[g + 1] as usize);
            let busy = ranks[slot * n_slices..(slot + 1) * n_slices].iter().any(|&r| r > 0);
            if start < end && busy {
                groups.push(Group { slot, start, end });
            }
        }
        Ok(Self { n_tokens, n_slices, max_rank, n_slots, ranks, tokens, groups, min_share: MIN_SHARE })
    }

    /// The number of tokens the plan's groups cover.
    pub fn n_rows(&self) -> usize {
        self.groups.iter().map(|g| g.end - g.start).sum()
    }

    fn rank(&self, slot: usize, slice: usize) -> usize {
        self.ranks[slot * self.n_slices + slice]
    }

    /// `len` must be the product of `dims` (checked: an overflowing product is an error, never a
    /// wrapped length that a short buffer would pass).
    fn check_len(&self, what: &str, len: usize, dims: &[usize], shape: &str) -> Result<()> {
        match dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d)) {
            Some(expected) if expected == len => Ok(()),
            Some(expected) => Err(arg(format!("{what} has {len} elements, expected {expected} ({shape})"))),
            None => Err(arg(format!("{what}: {shape} = {dims:?} overflows the address space"))),
        }
    }

    /// Shrink: `v[t, s*R + j] = Σ_i x[t, i] · a[slot(t), s*R + j, i]` for `j < rank(slot(t), s)`, fp32
    /// accumulation, rounded once to `v`'s dtype. Only the plan's tokens' rows of `v` are written, and
    /// in them only the columns below each slice's rank: the caller passes `v` zeroed.
    ///
    /// Shapes (row-major): `x` `[n_tokens, in_features]`, `a` `[n_slots, n_slices * R, in_features]`,
    /// `v` `[n_tokens, n_slices * R]`, `R = max_rank`; one dtype for all three.
    ///
    /// The work is shared among up to `threads` threads (the caller's included) when there is enough
    /// of it; each thread takes whole groups.
    ///
    /// Errors: [`Error::OpArgument`] for a length or dtype mismatch (nothing written), or
    /// [`Error::Usage`] where this CPU lacks the kernels ([`available`]).
    pub fn shrink(
        &self,
        x: Data<'_>,
        in_features: usize,
        a: Data<'_>,
        v: DataMut<'_>,
        threads: usize,
    ) -> Result<()> {
        let (s, r) = (self.n_slices, self.max_rank);
        self.check_len("a", a.len(), &[self.n_slots, s, r, in_features], "slots x n_slices*R x in_features")?;
        let layout = Slots { n_slices: s, max_rank: r, in_features, out_total: 0 };
        self.shrink_in(x, in_features, a, v, threads, &layout)
    }

    /// [`CpuPlan::shrink`] with A's rows found through `layout` (`a`'s length checked against it).
    fn shrink_in<L: Layout>(
        &self,
        x: Data<'_>,
        in_features: usize,
        a: Data<'_>,
        mut v: DataMut<'_>,
        threads: usize,
        layout: &L,
    ) -> Result<()> {
        let (t, s, r) = (self.n_tokens, self.n_slices, self.max_rank);
        self.check_len("x", x.len(), &[t, in_features], "n_tokens x in_features")?;
        self.check_len("v", v.as_data().len(), &[t, s, r], "n_tokens x n_slices*R")?;
        if x.dtype() != a.dtype() || x.dtype() != v.as_data().dtype() {
            return Err(arg(format!(
                "x, a and v must share one dtype, got {}, {} and {}",
                x.dtype(),
                a.dtype(),
                v.as_data().dtype()
            )));
        }
        if self.groups.is_empty() || in_features == 0 {
            return Ok(());
        }
        self.require_kernels()?;
        #[cfg(target_arch = "x86_64")]
        match (x, a, &mut v) {
            (Data::F32(x), Data::F32(a), DataMut::F32(v)) => {
                self.shrink_typed(x, in_features, a, v, threads, layout)
            }
            (Data::Bf16(x), Data::Bf16(a), DataMut::Bf16(v)) => self.shrink_typed(
                avx512::bf16(x),
                in_features,
                avx512::bf16(a),
                avx512::bf16_mut(v),
                threads,
                layout,
            ),
            (Data::F16(x), Data::F16(a), DataMut::F16(v)) => self.shrink_typed(
                avx512::f16(x),
                in_features,
                avx512::f16(a),
                avx512::f16_mut(v),
                threads,
                layout,
            ),
            _ => unreachable!("dtypes were checked equal"),
        }
        Ok(())
    }

    #[cfg(target_arch = "x86_64")]
    fn shrink_typed<E: avx512::Elem, L: Layout>(
        &self,
        x: &[E],
        in_features: usize,
        a: &[E],
        v: &mut [E],
        threads: usize,
        layout: &L,
    ) {
        let (x, a, v) =
            (avx512::Shared(x.as_ptr()), avx512::Shared(a.as_ptr()), avx512::Shared(v.as_mut_ptr()));
        let units = |g: &Group, s: usize| (self.rank(g.slot, s), avx512::ROWS, avx512::ROWS * in_features);
        self.in_parallel(threads, units, |tiles| {
            // SAFETY: `shrink_in` checked the CPU (`require_kernels`) and every length against the plan,
            // whose tokens, slots and ranks `new` bounded, and its caller `a` against `layout` (and a
            // page table's entries and ranks); the tiles write disjoint columns of `v`.
            unsafe { avx512::shrink(self, tiles, x.get(), in_features, a.get(), v.get(), layout) }
        });
    }

    /// Expand: `out[t, o_s + o] += scaling[slot, s] · Σ_j v[t, s*R + j] · b[slot, o_s + o, j]` over
    /// `j < rank(slot, s)`, for every token of the plan and every slice `s` (`o < o_{s+1} − o_s`), fp32
    /// accumulation with `out`'s value, rounded once. Rows of `out` outside the plan are not touched.
    ///
    /// Shapes (row-major): `out` `[n_tokens, out_total]`, `v` `[n_tokens, n_slices * R]`, `b`
    /// `[n_slots, out_total, R]`, `scalings` `[n_slots, n_slices]`; `slice_offsets` holds
    /// `n_slices + 1` offsets rising from 0 to `out_total`.
    ///
    /// Errors: as for [`CpuPlan::shrink`], and for bad `slice_offsets`.
    pub fn expand(
        &self,
        out: DataMut<'_>,
        v: Data<'_>,
        b: Data<'_>,
        scalings: &[f32],
        slice_offsets: &[usize],
        threads: usize,
    ) -> Result<()> {
        let out_total = self.check_offsets(slice_offsets)?;
        let (s, r) = (self.n_slices, self.max_rank);
        self.check_len("b", b.len(), &[self.n_slots, out_total, r], "slots x out_total x R")?;
        let layout = Slots { n_slices: s, max_rank: r, in_features: 0, out_total };
        self.expand_in(out, v, b, scalings, slice_offsets, threads, &layout)
    }

    /// `slice_offsets`' last offset (`out_total`) once they are `n_slices + 1` offsets rising from 0.
    fn check_offsets(&self, slice_offsets: &[usize]) -> Result<usize> {
        let s = self.n_slices;
        if slice_offsets.len() != s + 1
            || slice_offsets[0] != 0
            || slice_offsets.windows(2).any(|w| w[0] > w[1])
        {
            return Err(arg(format!(
                "slice_offsets must be n_slices + 1 = {} offsets rising from 0, got {slice_offsets:?}",
                s + 1
            )));
        }
        Ok(slice_offsets[s])
    }

    /// [`CpuPlan::expand`] with B's rank columns found through `layout` (`b`'s length and
    /// `slice_offsets` checked against it).
    #[allow(clippy::too_many_arguments)]
    fn expand_in<L: Layout>(
        &self,
        mut out: DataMut<'_>,
        v: Data<'_>,
        b: Data<'_>,
        scalings: &[f32],
        slice_offsets: &[usize],
        threads: usize,
        layout: &L,
    ) -> Result<()> {
        let (t, s, r) = (self.n_tokens, self.n_slices, self.max_rank);
        let out_total = slice_offsets[s];
        self.check_len("out", out.as_data().len(), &[t, out_total], "n_tokens x out_total")?;
        self.check_len("v", v.len(), &[t, s, r], "n_tokens x n_slices*R")?;
        self.check_len("slot_scalings", scalings.len(), &[self.n_slots, s], "slots x n_slices")?;
        let out_dtype = out.as_data().dtype();
        if out_dtype != v.dtype() || out_dtype != b.dtype() {
            return Err(arg(format!(
                "out, v and b must share one dtype, got {}, {} and {}",
                out_dtype,
                v.dtype(),
                b.dtype()
            )));
        }
        if self.groups.is_empty() || out_total == 0 {
            return Ok(());
        }
        self.require_kernels()?;
        #[cfg(target_arch = "x86_64")]
        match (&mut out, v, b) {
            (DataMut::F32(o), Data::F32(v), Data::F32(b)) => {
                self.expand_typed(o, v, b, scalings, slice_offsets, threads, layout)
            }
            (DataMut::Bf16(o), Data::Bf16(v), Data::Bf16(b)) => self.expand_typed(
                avx512::bf16_mut(o),
                avx512::bf16(v),
                avx512::bf16(b),
                scalings,
                slice_offsets,
                threads,
                layout,
            ),
            (DataMut::F16(o), Data::F16(v), Data::F16(b)) => self.expand_typed(
                avx512::f16_mut(o),
                avx512::f16(v),
                avx512::f16(b),
                scalings,
                slice_offsets,
                threads,
                layout,
            ),
            _ => unreachable!("dtypes were checked equal"),
        }
        Ok(())
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    fn expand_typed<E: avx512::Elem, L: Layout>(
        &self,
        out: &mut [E],
        v: &[E],
        b: &[E],
        scalings: &[f32],
        slice_offsets: &[usize],
        threads: usize,
        layout: &L,
    ) {
        let (out, v, b) =
            (avx512::Shared(out.as_mut_ptr()), avx512::Shared(v.as_ptr()), avx512::Shared(b.as_ptr()));
        let units = |g: &Group, s: usize| {
            let rank = self.rank(g.slot, s);
            let width = if rank == 0 { 0 } else { slice_offsets[s + 1] - slice_offsets[s] };
            (width, avx512::COLUMNS, avx512::COLUMNS * rank)
        };
        self.in_parallel(threads, units, |tiles| {
            // SAFETY: as in `shrink_typed`; `slice_offsets` rise to `out_total`, which sized `out` and
            // `b`; the tiles write disjoint columns of `out`.
            unsafe {
                avx512::expand(self, tiles, out.get(), v.get(), b.get(), scalings, slice_offsets, layout)
            }
        });
    }

    /// Shrink then expand (`out += scaling · (x Aᵀ) Bᵀ` for the plan's tokens), with `v` kept in a
    /// scratch buffer of the call: [`CpuPlan::shrink`] and [`CpuPlan::expand`] in one call.
    ///
    /// Shapes as for those two; `x`, `a`, `b` and `out` share one dtype.
    ///
    /// Errors: as for [`CpuPlan::shrink`] and [`CpuPlan::expand`]; `out` is untouched on any error.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_delta(
        &self,
        out: DataMut<'_>,
        x: Data<'_>,
        in_features: usize,
        a: Data<'_>,
        b: Data<'_>,
        scalings: &[f32],
        slice_offsets: &[usize],
        threads: usize,
    ) -> Result<()> {
        self.through_scratch(
            x,
            |v| self.shrink(x, in_features, a, v, threads),
            |v| self.expand(out, v, b, scalings, slice_offsets, threads),
        )
    }

    /// Runs `shrink` into a zeroed scratch `v` `[n_tokens, n_slices * R]` of `like`'s dtype, then
    /// `expand` reading it: the fused calls' one body (shrink writes only the scratch, and expand checks
    /// everything before it writes `out`, so `out` is untouched on any error).
    pub(crate) fn through_scratch(
        &self,
        like: Data<'_>,
        shrink: impl FnOnce(DataMut<'_>) -> Result<()>,
        expand: impl FnOnce(Data<'_>) -> Result<()>,
    ) -> Result<()> {
        let (t, s, r) = (self.n_tokens, self.n_slices, self.max_rank);
        let n = [t, s, r].iter().try_fold(1usize, |p, &d| p.checked_mul(d));
        let n = n.ok_or_else(|| arg(format!("v: [{t}, {s} * {r}] overflows the address space")))?;
        match like {
            Data::F32(_) => {
                let mut v = vec![0f32; n];
                shrink(DataMut::F32(&mut v))?;
                expand(Data::F32(&v))
            }
            Data::Bf16(_) => {
                let mut v = vec![0u16; n];
                shrink(DataMut::Bf16(&mut v))?;
                expand(Data::Bf16(&v))
            }
            Data::F16(_) => {
                let mut v = vec![0u16; n];
                shrink(DataMut::F16(&mut v))?;
                expand(Data::F16(&v))
            }
        }
    }

    /// Runs `kernel` over the plan's work on up to `threads` threads of the pool (the calling one
    /// included). The work of a group in slice `s` is `units(group, s) = (extent, step, cost)`:
    /// `extent` rows of A (shrink) or columns of the slice's output (expand), taken `step` at a time,
    /// each step reading `cost` weight elements (scaled by [`work_factor`]). Shares are tiles of whole
    /// steps, so the work of one busy slot is shared too; each share holds at least [`MIN_SHARE`].
    fn in_parallel(
        &self,
        threads: usize,
        units: impl Fn(&Group, usize) -> (usize, usize, usize),
        kernel: impl Fn(&[Tile]) + Sync,
    ) {
        let mut total = 0usize;
        for g in &self.groups {
            for s in 0..self.n_slices {
                let (extent, step, cost) = units(g, s);
                total += extent.div_ceil(step) * cost * work_factor(g);
            }
        }
        // A few shares per thread: a thread that a neighbour slows takes fewer of them.
        let n_tasks = if threads <= 1 { 1 } else { (total / self.min_share).clamp(1, 4 * threads) };
        let quota = total.div_ceil(n_tasks).max(1);
        let mut tiles = Vec::new();
        let mut bounds = vec![0];
        let mut filled = 0usize;
        for (index, g) in self.groups.iter().enumerate() {
            for s in 0..self.n_slices {
                let (extent, step, cost) = units(g, s);
                let (n_steps, step_cost) = (extent.div_ceil(step), (cost * work_factor(g)).max(1));
                let mut done = 0;
                while done < n_steps {
                    let take = quota.saturating_sub(filled).div_ceil(step_cost).clamp(1, n_steps - done);
                    tiles.push(Tile {
                        group: index,
                        slice: s,
                        lo: done * step,
                        hi: ((done + take) * step).min(extent),
                    });
                    filled += take * step_cost;
                    done += take;
                    if filled >= quota && bounds.len() < n_tasks {
                        bounds.push(tiles.len());
                        filled = 0;
                    }
                }
            }
        }
        if bounds.last() != Some(&tiles.len()) {
            bounds.push(tiles.len());
        }
        let n_shares = bounds.len() - 1;
        if n_shares <= 1 {
            return kernel(&tiles);
        }
        let share = |i: usize| kernel(&tiles[bounds[i]..bounds[i + 1]]);
        pool::pool().run(threads, n_shares, &share);
    }

    /// The same plan, sharing work among threads from `min_share` up (tests: tiny shapes, threaded).
    #[cfg(test)]
    pub(crate) fn with_min_share(mut self, min_share: usize) -> Self {
        self.min_share = min_share.max(1);
        self
    }

    fn require_kernels(&self) -> Result<()> {
        if available() {
            Ok(())
        } else {
            Err(Error::Usage(
                "the CPU SGMV kernels need x86-64 with AVX-512 (F, BW, VL); use the torch path".into(),
            ))
        }
    }
}

/// The least work (weight elements, scaled by [`work_factor`]) worth a share of its own: about
/// 15 µs of streaming fp32 weights from memory, above the cost of waking a pooled thread.
const MIN_SHARE: usize = 1 << 17;

/// Part of one group's work in one slice: rows `lo..hi` of A (shrink) or columns `lo..hi` of the
/// slice's output (expand).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) group: usize,
    pub(crate) slice: usize,
    pub(crate) lo: usize,
    pub(crate) hi: usize,
}

/// How a group's cost grows with its tokens: the kernels read its weights once per 4 tokens from
/// cache, and the first pass from memory dominates.
fn work_factor(g: &Group) -> usize {
    4 + (g.end - g.start)
}

/// Ends a kernel property test's case early (it passes) on a CPU without the kernels, where
/// `sgmv_tests::the_kernels_run_here_or_refuse_by_name` checks that every entry refuses instead and the
/// CPU backend takes torch's path.
#[cfg(test)]
macro_rules! pass_without_kernels {
    () => {
        if !$crate::sgmv::available() {
            return Ok(());
        }
    };
}

#[cfg(test)]
mod paged_tests;
#[cfg(test)]
mod sgmv_tests;
