//! The AVX-512 kernels behind [`CpuPlan::shrink`] and [`CpuPlan::expand`].
//!
//! Every function here is `unsafe`: its caller guarantees that the CPU has the features [`detected`]
//! checks and that the buffers' lengths match the plan's shapes (`CpuPlan` checks both before it calls
//! in). Under those, every pointer below stays inside its buffer: token indices, slots and ranks were
//! bounded when the plan was built, and every partial vector is read and written through a mask.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::layout::Layout;
use super::{CpuPlan, Tile};

/// Whether this CPU has everything the kernels use.
pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// bfloat16 bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Bf16(u16);

/// float16 bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct F16(u16);

/// A buffer's address, shared by the threads of one call (each writes only its own groups' rows).
#[derive(Clone, Copy)]
pub(super) struct Shared<T>(pub(super) T);

// SAFETY: only addresses of buffers that outlive the call's scoped threads are wrapped, and the
// threads write disjoint rows (a token belongs to one group, and each group to one thread).
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as for `Send`.
unsafe impl<T> Sync for Shared<T> {}

impl<T: Copy> Shared<T> {
    /// The address (a method, so that closures capture the whole `Shared`).
    pub(super) fn get(&self) -> T {
        self.0
    }
}

pub(super) fn bf16(s: &[u16]) -> &[Bf16] {
    // SAFETY: `Bf16` is a transparent `u16`.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}

pub(super) fn bf16_mut(s: &mut [u16]) -> &mut [Bf16] {
    // SAFETY: `Bf16` is a transparent `u16`.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) }
}

pub(super) fn f16(s: &[u16]) -> &[F16] {
    // SAFETY: `F16` is a transparent `u16`.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}

pub(super) fn f16_mut(s: &mut [u16]) -> &mut [F16] {
    // SAFETY: `F16` is a transparent `u16`.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) }
}

/// A storage dtype: 16 elements load into one fp32 vector and store back rounded to nearest even.
pub(super) trait Elem: Copy {
    /// Loads the 16 elements at `p`.
    unsafe fn load(p: *const Self) -> __m512;
    /// Loads the elements at `p` whose mask bit is set; the other lanes are zero and never read.
    unsafe fn load_masked(p: *const Self, m: __mmask16) -> __m512;
    /// Stores the lanes whose mask bit is set.
    unsafe fn store_masked(p: *mut Self, m: __mmask16, v: __m512);
    /// One value, rounded to nearest even.
    unsafe fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load(p: *const Self) -> __m512 {
        _mm512_loadu_ps(p)
    }

    #[inline(always)]
    unsafe fn load_masked(p: *const Self, m: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(m, p)
    }

    #[inline(always)]
    unsafe fn store_masked(p: *mut Self, m: __mmask16, v: __m512) {
        _mm512_mask_storeu_ps(p, m, v)
    }

    #[inline(always)]
    unsafe fn from_f32(x: f32) -> Self {
        x
    }
}

#[inline(always)]
unsafe fn widen_bf16(bits: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
}

impl Elem for Bf16 {
    #[inline(always)]
    unsafe fn load(p: *const Self) -> __m512 {
        widen_bf16(_mm256_loadu_si256(p.cast()))
    }

    #[inline(always)]
    unsafe fn load_masked(p: *const Self, m: __mmask16) -> __m512 {
        widen_bf16(_mm256_maskz_loadu_epi16(m, p.cast()))
    }

    #[inline(always)]
    unsafe fn store_masked(p: *mut Self, m: __mmask16, v: __m512) {
        // Round to nearest even (torch's rule); a NaN stays a quiet NaN.
        let bits = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded =
            _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
        _mm256_mask_storeu_epi16(p.cast(), m, h)
    }

    #[inline(always)]
    unsafe fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16((bits >> 16) as u16 | 0x40);
        }
        Bf16((bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }
}

impl Elem for F16 {
    #[inline(always)]
    unsafe fn load(p: *const Self) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }

    #[inline(always)]
    unsafe fn load_masked(p: *const Self, m: __mmask16) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast()))
    }

    #[inline(always)]
    unsafe fn store_masked(p: *mut Self, m: __mmask16, v: __m512) {
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        _mm256_mask_storeu_epi16(p.cast(), m, h)
    }

    #[inline(always)]
    unsafe fn from_f32(x: f32) -> Self {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x));
        F16(_mm_extract_epi16::<0>(h) as u16)
    }
}

/// The mask of the first `n` lanes (`n <= 16`).
#[inline(always)]
fn first(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// Rows of A per register block (the tokens of a block: 1 to 4); shrink tiles start at multiples.
pub(super) const ROWS: usize = 4;

/// Output columns per expand block; expand tiles start at multiples.
pub(super) const COLUMNS: usize = 16;

/// `[Σ_i a_r[i] · x_t[i]]` for 4 rows of A and `NT` token rows of x, all `n` long.
#[inline(always)]
unsafe fn dot_block<E: Elem, const NT: usize>(
    rows: [*const E; ROWS],
    xs: [*const E; NT],
    n: usize,
) -> [[f32; NT]; ROWS] {
    let mut acc = [[_mm512_setzero_ps(); NT]; ROWS];
    let mut xv = [_mm512_setzero_ps(); NT];
    let full = n / 16;
    for c in 0..full {
        let off = c * 16;
        for t in 0..NT {
            xv[t] = E::load(xs[t].add(off));
        }
        for r in 0..ROWS {
            let av = E::load(rows[r].add(off));
            for t in 0..NT {
                acc[r][t] = _mm512_fmadd_ps(av, xv[t], acc[r][t]);
            }
        }
    }
    if !n.is_multiple_of(16) {
        let (off, m) = (full * 16, first(n % 16));
        for t in 0..NT {
            xv[t] = E::load_masked(xs[t].add(off), m);
        }
        for r in 0..ROWS {
            let av = E::load_masked(rows[r].add(off), m);
            for t in 0..NT {
                acc[r][t] = _mm512_fmadd_ps(av, xv[t], acc[r][t]);
            }
        }
    }
    let mut sums = [[0f32; NT]; ROWS];
    for r in 0..ROWS {
        for t in 0..NT {
            sums[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    sums
}

/// Rounds one fp32 value to `E` and stores it. A scalar store on purpose: LLVM folds a one-lane masked
/// store of a truncated vector into a 32-bit store, which overwrote the next 16-bit element.
#[inline(always)]
unsafe fn store_one<E: Elem>(p: *mut E, value: f32) {
    p.write(E::from_f32(value))
}

/// [`CpuPlan::shrink`] for `tiles` (rows `lo..hi` of A in one slice of one group; tiles write
/// disjoint columns of `v`), A's rows found through `layout`.
/// Safety: the module's contract; `x`, `a` and `v` are the buffers `CpuPlan::shrink` (or
/// `paged_shrink`) checked against `layout`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(super) unsafe fn shrink<E: Elem, L: Layout>(
    plan: &CpuPlan,
    tiles: &[Tile],
    x: *const E,
    in_features: usize,
    a: *const E,
    v: *mut E,
    layout: &L,
) {
    let (n_slices, max_rank) = (plan.n_slices, plan.max_rank);
    let v_stride = n_slices * max_rank;
    for tile in tiles {
        let (g, s) = (&plan.groups[tile.group], tile.slice);
        let tokens = &plan.tokens[g.start..g.end];
        let rank = plan.rank(g.slot, s);
        for j0 in (tile.lo..tile.hi.min(rank)).step_by(ROWS) {
            // A short last block repeats its last row; the repeats are computed and dropped. Each
            // row is looked up on its own: a block may straddle two pages.
            let nr = (rank - j0).min(ROWS);
            let mut rows = [a; ROWS];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = a.add(layout.a_row(g.slot, s, j0 + r.min(nr - 1)));
            }
            for block in tokens.chunks(4) {
                let out = Out { v, v_stride, col: s * max_rank + j0, n_rows: nr };
                match block.len() {
                    1 => rows_times_tokens::<E, 1>(rows, x, in_features, block, out),
                    2 => rows_times_tokens::<E, 2>(rows, x, in_features, block, out),
                    3 => rows_times_tokens::<E, 3>(rows, x, in_features, block, out),
                    _ => rows_times_tokens::<E, 4>(rows, x, in_features, block, out),
                }
            }
        }
    }
}

/// Where a shrink block's sums go: `v[token * v_stride + col + r]` for the first `n_rows` rows `r`.
#[derive(Clone, Copy)]
struct Out<E> {
    v: *mut E,
    v_stride: usize,
    col: usize,
    n_rows: usize,
}

/// One register block of the shrink: 4 rows of A against the `NT` tokens of `block`.
#[inline(always)]
unsafe fn rows_times_tokens<E: Elem, const NT: usize>(
    rows: [*const E; ROWS],
    x: *const E,
    in_features: usize,
    block: &[usize],
    out: Out<E>,
) {
    let mut xs = [x; NT];
    for t in 0..NT {
        xs[t] = x.add(block[t] * in_features);
    }
    let sums = dot_block::<E, NT>(rows, xs, in_features);
    for (r, row) in sums.iter().enumerate().take(out.n_rows) {
        for t in 0..NT {
            store_one(out.v.add(block[t] * out.v_stride + out.col + r), row[t]);
        }
    }
}

/// Lane `i` of the result is the sum of `p[i]`'s 16 lanes.
#[inline(always)]
unsafe fn transpose_sum(p: &[__m512; 16]) -> __m512 {
    // Pairs: per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
    let mut q = [_mm512_setzero_ps(); 8];
    for i in 0..8 {
        let (a, b) = (p[2 * i], p[2 * i + 1]);
        q[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // Quads: per 128-bit lane, the partial sums of p[4i..4i+4] in order.
    let mut w = [_mm512_setzero_ps(); 4];
    for i in 0..4 {
        let (a, b) = (_mm512_castps_pd(q[2 * i]), _mm512_castps_pd(q[2 * i + 1]));
        w[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        );
    }
    // Fold the four 128-bit lanes: [w0, w1] then [w2, w3] to half sums, then to whole ones.
    fold_lanes(fold_lanes(w[0], w[1]), fold_lanes(w[2], w[3]))
}

/// `[a.L0 + a.L1, a.L2 + a.L3, b.L0 + b.L1, b.L2 + b.L3]` over 128-bit lanes.
#[inline(always)]
unsafe fn fold_lanes(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
}

/// [`CpuPlan::expand`] for `tiles` (columns `lo..hi` of one slice's output for one group; tiles write
/// disjoint elements of `out`), B's rank columns found through `layout`.
/// Safety: the module's contract; the buffers are the ones `CpuPlan::expand` (or `paged_expand`)
/// checked against `layout`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn expand<E: Elem, L: Layout>(
    plan: &CpuPlan,
    tiles: &[Tile],
    out: *mut E,
    v: *const E,
    b: *const E,
    scalings: &[f32],
    slice_offsets: &[usize],
    layout: &L,
) {
    let (n_slices, max_rank) = (plan.n_slices, plan.max_rank);
    let out_total = slice_offsets[n_slices];
    let v_stride = n_slices * max_rank;
    for tile in tiles {
        let (g, s) = (&plan.groups[tile.group], tile.slice);
        let tokens = &plan.tokens[g.start..g.end];
        let rank = plan.rank(g.slot, s);
        let (lo, hi) = (slice_offsets[s], slice_offsets[s + 1]);
        if rank == 0 || lo == hi {
            continue;
        }
        let scale = _mm512_set1_ps(scalings[g.slot * n_slices + s]);
        let width = hi - lo;
        if tokens.len() >= PANEL_TOKENS {
            let block = Block { b, slot: g.slot, row0: lo, rank, width, lo: tile.lo, hi: tile.hi.min(width) };
            let rows = Rows { v: v.add(s * max_rank), v_stride, out: out.add(lo), out_total, scale };
            expand_panels(tokens, block, rows, layout);
            continue;
        }
        let n_spans = layout.n_spans(rank);
        for o0 in (tile.lo..tile.hi.min(width)).step_by(COLUMNS) {
            let n_out = (width - o0).min(COLUMNS);
            let m = first(n_out);
            for &t in tokens {
                let v_row = v.add(t * v_stride + s * max_rank);
                let mut p = [_mm512_setzero_ps(); 16];
                for k in 0..n_spans {
                    let span = layout.span(g.slot, rank, k);
                    let block = b.add(span.offset + (lo + o0) * span.stride);
                    let (v_span, stride) = (v_row.add(span.lo), span.stride);
                    if n_out == COLUMNS {
                        row_products::<E>(&mut p, block, stride, COLUMNS - 1, v_span, span.len)
                    } else {
                        row_products::<E>(&mut p, block, stride, n_out - 1, v_span, span.len)
                    }
                }
                let dst = out.add(t * out_total + lo + o0);
                let sum = _mm512_fmadd_ps(transpose_sum(&p), scale, E::load_masked(dst, m));
                E::store_masked(dst, m, sum);
            }
        }
    }
}

/// How far ahead of the rows being read the expand asks for B's lines (one stream, read once).
const PREFETCH_BYTES: usize = 4096;

/// `p[o] += b_row(o)[..rank] ⊙ v[..rank]`, folded to 16 lanes, for the 16 rows of a block (`stride`
/// apart); rows past `last` repeat row `last` (their sums are never stored). A slot's ranks in several
/// spans (pages) add up in `p`.
#[inline(always)]
unsafe fn row_products<E: Elem>(
    p: &mut [__m512; 16],
    block: *const E,
    stride: usize,
    last: usize,
    v_row: *const E,
    rank: usize,
) {
    let mut j0 = 0;
    while j0 < rank {
        let m = first((rank - j0).min(16));
        let vv = E::load_masked(v_row.add(j0), m);
        let mut row = block.add(j0);
        for (o, acc) in p.iter_mut().enumerate() {
            _mm_prefetch::<_MM_HINT_T0>(row.cast::<i8>().wrapping_add(PREFETCH_BYTES));
            *acc = _mm512_fmadd_ps(E::load_masked(row, m), vv, *acc);
            if o < last {
                row = row.add(stride);
            }
        }
        j0 += 16;
    }
}

/// From this many tokens on, a group's expand transposes each block of 16 rows of B once
/// ([`expand_panels`]) instead of folding every token's 16 products ([`row_products`]).
pub(super) const PANEL_TOKENS: usize = 8;

/// One slice of one group's B (the pool `b`, the group's `slot`, the slice's first row `row0` of
/// `out_total`), and the output columns `lo..hi` of the slice a tile computes.
#[derive(Clone, Copy)]
struct Block<E> {
    b: *const E,
    slot: usize,
    row0: usize,
    rank: usize,
    width: usize,
    lo: usize,
    hi: usize,
}

/// Where the slice's rows live: `v`'s and `out`'s first columns of the slice, and the scaling.
#[derive(Clone, Copy)]
struct Rows<E> {
    v: *const E,
    v_stride: usize,
    out: *mut E,
    out_total: usize,
    scale: __m512,
}

/// Output columns whose panels [`expand_panels`] builds at a time: 64 KiB of panel at rank 16, so it
/// stays in L2 while every token's row streams past it.
const PANEL_COLUMNS: usize = 1024;

/// Groups of more tokens than this build [`PANEL_COLUMNS`] columns of panels at a time; smaller ones
/// build and use one block's panel at a time, which keeps it in L1. Not many more: used block by block,
/// each token's `out` row is touched 16 columns at a time, and rows a multiple of 4 KiB apart share L1
/// sets (one fp32 run of 64 tokens, 4096 wide, warm: 0.82 ms block by block against 0.29 ms streamed).
const PANEL_STREAM_TOKENS: usize = 16;

/// The expand of many tokens of one slot and slice. Per block of 16 output columns, B's 16 rows are
/// transposed once into `rank` vectors of 16 lanes (`panel[j]` lane `c` is `b[o0 + c, j]`,
/// [`build_panel`]); then each token's outputs are, per block, `rank` FMAs of the panel with the
/// token's `v[j]` broadcast, four tokens at a time, added to `out` with the scaling (fp32
/// accumulation, one rounding). A group of up to [`PANEL_STREAM_TOKENS`] tokens uses each block's
/// panel as soon as it is built; a longer one builds the panels of [`PANEL_COLUMNS`] columns first and
/// then runs each token's row of `out` through them in order, so `out` streams row by row.
#[inline(always)]
unsafe fn expand_panels<E: Elem, L: Layout>(tokens: &[usize], block: Block<E>, rows: Rows<E>, layout: &L) {
    let rank = block.rank;
    // The tokens' v in fp32, read once for every column.
    let mut vs = vec![0f32; tokens.len() * rank];
    for (i, &t) in tokens.iter().enumerate() {
        let row = rows.v.add(t * rows.v_stride);
        for j0 in (0..rank).step_by(16) {
            let n = (rank - j0).min(16);
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), E::load_masked(row.add(j0), first(n)));
            vs[i * rank + j0..i * rank + j0 + n].copy_from_slice(&lanes[..n]);
        }
    }
    let columns = if tokens.len() > PANEL_STREAM_TOKENS { PANEL_COLUMNS } else { COLUMNS };
    let mut panels = vec![0f32; (block.hi - block.lo).min(columns).next_multiple_of(COLUMNS) * rank];
    for c0 in (block.lo..block.hi).step_by(columns) {
        let c1 = (c0 + columns).min(block.hi);
        for (i, o0) in (c0..c1).step_by(COLUMNS).enumerate() {
            let n_out = (block.width - o0).min(COLUMNS);
            build_panel(block, o0, n_out, panels.as_mut_ptr().add(i * COLUMNS * rank), layout);
        }
        for (k, chunk) in tokens.chunks(4).enumerate() {
            let vs = vs.as_ptr().add(k * 4 * rank);
            for (i, o0) in (c0..c1).step_by(COLUMNS).enumerate() {
                let m = first((block.width - o0).min(COLUMNS));
                let at = Panel { panel: panels.as_ptr().add(i * COLUMNS * rank), vs, rank, o0, m };
                match chunk.len() {
                    1 => panel_tokens::<E, 1>(chunk, at, rows),
                    2 => panel_tokens::<E, 2>(chunk, at, rows),
                    3 => panel_tokens::<E, 3>(chunk, at, rows),
                    _ => panel_tokens::<E, 4>(chunk, at, rows),
                }
            }
        }
    }
}

/// Writes the panel of the 16 output columns from `o0` (`n_out` of them real) to `panel`:
/// `rank` vectors of 16 lanes, `panel[j]` lane `c` = `b[o0 + c, j]`, lanes past `n_out` zero. Each 16
/// ranks of the block's rows are loaded as 16 vectors and transposed in registers ([`transpose16`]), so
/// the panel costs a few shuffles per vector rather than a scalar move per element: built this way it
/// pays for itself from a handful of tokens even when B is already in cache.
#[inline(always)]
unsafe fn build_panel<E: Elem, L: Layout>(
    block: Block<E>,
    o0: usize,
    n_out: usize,
    panel: *mut f32,
    layout: &L,
) {
    for k in 0..layout.n_spans(block.rank) {
        let span = layout.span(block.slot, block.rank, k);
        let rows = block.b.add(span.offset + (block.row0 + o0) * span.stride);
        for j0 in (0..span.len).step_by(16) {
            let n = (span.len - j0).min(16);
            let m = first(n);
            let mut r = [_mm512_setzero_ps(); 16];
            for (c, row) in r.iter_mut().enumerate().take(n_out) {
                let at = rows.add(c * span.stride + j0);
                _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>().wrapping_add(PREFETCH_BYTES));
                *row = E::load_masked(at, m);
            }
            transpose16(&mut r);
            for (j, lanes) in r.iter().enumerate().take(n) {
                _mm512_storeu_ps(panel.add((span.lo + j0 + j) * COLUMNS), *lanes);
            }
        }
    }
}

/// Transposes 16 vectors of 16 lanes in place: afterwards `r[j]` lane `c` is what `r[c]` lane `j` was.
/// Interleaves 32-bit then 64-bit elements within 128-bit lanes (rows in groups of 4, elements in
/// groups of 4 apart), then moves 128-bit lanes across vectors twice.
#[inline(always)]
unsafe fn transpose16(r: &mut [__m512; 16]) {
    // t[2g + h] (g: rows 2g, 2g+1; h: low/high pair): per 128-bit lane k, [r[2g][4k+2h], r[2g+1][4k+2h],
    // r[2g][4k+2h+1], r[2g+1][4k+2h+1]].
    let mut t = [_mm512_setzero_ps(); 16];
    for g in 0..8 {
        t[2 * g] = _mm512_unpacklo_ps(r[2 * g], r[2 * g + 1]);
        t[2 * g + 1] = _mm512_unpackhi_ps(r[2 * g], r[2 * g + 1]);
    }
    // s[4q + e] (q: rows 4q..4q+4): per 128-bit lane k, [r[4q + i][4k + e] for i in 0..4].
    let mut s = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        for h in 0..2 {
            let (a, b) = (_mm512_castps_pd(t[4 * q + h]), _mm512_castps_pd(t[4 * q + 2 + h]));
            s[4 * q + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            s[4 * q + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    // Element j = 4k + e takes 128-bit lane k of s[e], s[4 + e], s[8 + e], s[12 + e], in that order.
    for e in 0..4 {
        let even01 = _mm512_shuffle_f32x4::<0b10_00_10_00>(s[e], s[4 + e]);
        let odd01 = _mm512_shuffle_f32x4::<0b11_01_11_01>(s[e], s[4 + e]);
        let even23 = _mm512_shuffle_f32x4::<0b10_00_10_00>(s[8 + e], s[12 + e]);
        let odd23 = _mm512_shuffle_f32x4::<0b11_01_11_01>(s[8 + e], s[12 + e]);
        r[e] = _mm512_shuffle_f32x4::<0b10_00_10_00>(even01, even23);
        r[4 + e] = _mm512_shuffle_f32x4::<0b10_00_10_00>(odd01, odd23);
        r[8 + e] = _mm512_shuffle_f32x4::<0b11_01_11_01>(even01, even23);
        r[12 + e] = _mm512_shuffle_f32x4::<0b11_01_11_01>(odd01, odd23);
    }
}

/// A block's panel, the first of its tokens' fp32 `v` rows, and its output columns.
#[derive(Clone, Copy)]
struct Panel {
    panel: *const f32,
    vs: *const f32,
    rank: usize,
    o0: usize,
    m: __mmask16,
}

/// `out[t, o0..o0 + 16] += scale · Σ_j v[t, j] · panel[j]` for the `NT` tokens of `chunk`.
#[inline(always)]
unsafe fn panel_tokens<E: Elem, const NT: usize>(chunk: &[usize], at: Panel, rows: Rows<E>) {
    let mut acc = [_mm512_setzero_ps(); NT];
    for j in 0..at.rank {
        let p = _mm512_loadu_ps(at.panel.add(j * COLUMNS));
        for (t, sum) in acc.iter_mut().enumerate() {
            *sum = _mm512_fmadd_ps(_mm512_set1_ps(*at.vs.add(t * at.rank + j)), p, *sum);
        }
    }
    for (sum, &token) in acc.iter().zip(chunk) {
        let dst = rows.out.add(token * rows.out_total + at.o0);
        E::store_masked(dst, at.m, _mm512_fmadd_ps(*sum, rows.scale, E::load_masked(dst, at.m)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_moves_every_element_to_its_mirror() {
        if !detected() {
            return;
        }
        let before: Vec<f32> = (0..256).map(|i| i as f32).collect();
        let mut after = [0f32; 256];
        // SAFETY: `detected()` holds, and each load and store covers 16 floats inside a 256-float buffer.
        unsafe {
            let mut r = [_mm512_setzero_ps(); 16];
            for (c, row) in r.iter_mut().enumerate() {
                *row = _mm512_loadu_ps(before.as_ptr().add(16 * c));
            }
            transpose16(&mut r);
            for (j, lanes) in r.iter().enumerate() {
                _mm512_storeu_ps(after.as_mut_ptr().add(16 * j), *lanes);
            }
        }
        for j in 0..16 {
            for c in 0..16 {
                assert_eq!(after[16 * j + c], before[16 * c + j], "lane {c} of vector {j}");
            }
        }
    }
}
