//! `CpuSgmvPlan`: the CPU LoRA kernels (`lora_pin_kernels::sgmv`) for `lora_pin.ops.grouped`.
//!
//! Python owns the tensors; a call borrows their memory by address for its duration, with the GIL
//! released. The addresses must come from live, contiguous CPU tensors of the named dtype, which
//! `lora_pin/ops/grouped.py` checks before every call: this class is private for that reason.

use std::ptr::NonNull;

use pyo3::prelude::*;

use super::errors::{new_error, py_err};
use super::{detached, shielded};
use lora_pin_kernels::sgmv::{
    available, cpu_features as features, dora_scale_rows as scale_rows, CpuPlan, Data, DataMut, PageTable,
};

/// One tensor's memory as Python hands it over: address and element count.
type Raw = (usize, usize);

/// Whether this CPU runs the kernels (x86-64 with AVX-512 F, BW and VL).
#[pyfunction]
pub fn sgmv_cpu_available() -> bool {
    available()
}

/// The matrix units of this CPU that the CPU path chooses by: a dict of ``avx2`` (with FMA),
/// ``avx512`` (what the native kernels need), ``avx512_bf16`` and ``amx_bf16`` (AMX tiles with bf16
/// products, enabled by the operating system), each a bool.
#[pyfunction]
pub fn cpu_features() -> std::collections::BTreeMap<&'static str, bool> {
    let f = features();
    [("avx2", f.avx2), ("avx512", f.avx512), ("avx512_bf16", f.avx512_bf16), ("amx_bf16", f.amx_bf16)].into()
}

/// DoRA rows' rescale in place: ``out[rows[i]] = factors[slots[i]] * (out[rows[i]] - bias) + bias``.
///
/// Each buffer is ``(address, numel)`` of a contiguous CPU tensor: ``out`` float32 ``[n_rows, width]``,
/// ``bias`` float32 ``[width]`` or None, ``factors`` float32 ``[slots, width]``, ``rows`` and ``slots``
/// int64 ``[N]``. Every index is checked before anything is written.
///
/// Raises:
///     OpArgumentError: a length, alignment or overlap mismatch, or a row or slot out of range (nothing
///         written).
#[pyfunction]
#[pyo3(signature = (out, width, bias, factors, rows, slots))]
pub fn dora_scale_rows(
    py: Python<'_>,
    out: Raw,
    width: usize,
    bias: Option<Raw>,
    factors: Raw,
    rows: Raw,
    slots: Raw,
) -> PyResult<()> {
    check(py, "out", out, 4, None)?;
    if let Some(bias) = bias {
        check(py, "bias", bias, 4, Some((out, 4)))?;
    }
    check(py, "factors", factors, 4, Some((out, 4)))?;
    check(py, "rows", rows, 8, Some((out, 4)))?;
    check(py, "slots", slots, 8, Some((out, 4)))?;
    detached(py, move || {
        // SAFETY: the caller's contract (live contiguous tensors of these dtypes); `check` ruled out
        // misalignment and overlap with the written buffer.
        let (out, bias, factors, rows, slots) = unsafe {
            (
                view_mut::<f32>(out),
                bias.map(|b| view::<f32>(b)),
                view::<f32>(factors),
                view(rows),
                view(slots),
            )
        };
        scale_rows(out, width, bias, factors, rows, slots)
    })
}

/// One step's layout for the CPU kernels: groups of tokens by slot, each slot's ranks.
///
/// Args:
///     n_tokens: rows of the activations.
///     tokens: the tokens of every group, group by group.
///     group_indptr: ``len(groups) + 1`` offsets into ``tokens``, rising from 0.
///     group_slots: the slot of each group.
///     ranks: ``[slots, n_slices]`` row-major, each in ``[0, max_rank]``.
///     n_slices: 1 to 8.
///     max_rank: the pool's rank ``R``.
///
/// Raises:
///     OpArgumentError: naming the token, slot, rank or offset out of range.
#[pyclass(frozen, name = "CpuSgmvPlan", module = "lora_pin._core")]
pub struct PyCpuSgmvPlan(CpuPlan);

/// The dtypes the kernels take, by their torch names.
#[derive(Clone, Copy)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    fn parse(py: Python<'_>, name: &str) -> PyResult<Self> {
        match name {
            "float32" => Ok(Dtype::F32),
            "bfloat16" => Ok(Dtype::Bf16),
            "float16" => Ok(Dtype::F16),
            _ => Err(new_error(
                py,
                "OpArgumentError",
                format!("the CPU kernels take float32, bfloat16 or float16, not {name}"),
            )),
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// Checks one buffer of `size`-byte elements: aligned, and not overlapping `written` (a buffer of
/// `written_size`-byte elements).
fn check(py: Python<'_>, what: &str, raw: Raw, size: usize, written: Option<(Raw, usize)>) -> PyResult<()> {
    let (addr, n) = raw;
    if n > 0 && (addr == 0 || addr % size != 0) {
        return Err(new_error(
            py,
            "OpArgumentError",
            format!("{what} is not aligned for its dtype (address {addr:#x})"),
        ));
    }
    if let Some(((w, wn), w_size)) = written {
        let overlap = n > 0 && wn > 0 && addr < w + wn * w_size && w < addr + n * size;
        if overlap {
            return Err(new_error(
                py,
                "OpArgumentError",
                format!("{what} overlaps the tensor the kernel writes"),
            ));
        }
    }
    Ok(())
}

/// The op's dtype, after [`check`] of the buffer the kernel writes (`written`), of those it reads in
/// that dtype (`read`) and of the float32 slot scalings if any, each read one against the written one.
fn checked(
    py: Python<'_>,
    dtype: &str,
    written: (&str, Raw),
    read: &[(&str, Raw)],
    scalings: Option<Raw>,
) -> PyResult<Dtype> {
    let dtype = Dtype::parse(py, dtype)?;
    let size = dtype.size();
    let (name, out) = written;
    check(py, name, out, size, None)?;
    for &(what, raw) in read {
        check(py, what, raw, size, Some((out, size)))?;
    }
    if let Some(scalings) = scalings {
        check(py, "slot_scalings", scalings, 4, Some((out, size)))?;
    }
    Ok(dtype)
}

/// The memory at `raw` as a slice of `T`.
///
/// # Safety
/// `raw` is the address and length of a live tensor of element type `T` that nothing else writes
/// during the slice's life (checked by the Python caller).
unsafe fn view<'a, T>(raw: Raw) -> &'a [T] {
    let ptr = if raw.1 == 0 { NonNull::dangling().as_ptr() } else { raw.0 as *const T };
    // SAFETY: the function's contract.
    unsafe { std::slice::from_raw_parts(ptr, raw.1) }
}

/// As [`view`], writable.
///
/// # Safety
/// As for [`view`], and no other slice overlaps it (checked by [`check`]).
unsafe fn view_mut<'a, T>(raw: Raw) -> &'a mut [T] {
    let ptr = if raw.1 == 0 { NonNull::dangling().as_ptr() } else { raw.0 as *mut T };
    // SAFETY: the function's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr, raw.1) }
}

/// The read-only buffer `raw` by dtype.
///
/// # Safety
/// As for [`view`].
unsafe fn data<'a>(dtype: Dtype, raw: Raw) -> Data<'a> {
    // SAFETY: the function's contract.
    unsafe {
        match dtype {
            Dtype::F32 => Data::F32(view(raw)),
            Dtype::Bf16 => Data::Bf16(view(raw)),
            Dtype::F16 => Data::F16(view(raw)),
        }
    }
}

/// The written buffer `raw` by dtype.
///
/// # Safety
/// As for [`view_mut`].
unsafe fn data_mut<'a>(dtype: Dtype, raw: Raw) -> DataMut<'a> {
    // SAFETY: the function's contract.
    unsafe {
        match dtype {
            Dtype::F32 => DataMut::F32(view_mut(raw)),
            Dtype::Bf16 => DataMut::Bf16(view_mut(raw)),
            Dtype::F16 => DataMut::F16(view_mut(raw)),
        }
    }
}

/// A layer group's page tables for the paged kernels, checked against the pool they index (issue 37):
/// slot ``s`` owns pages ``page_table[page_indptr[s]:page_indptr[s + 1]]``, in rank order.
///
/// Args:
///     page_indptr: ``slots + 1`` offsets into ``page_table``, rising from 0 to ``len(page_table)``.
///     page_table: page indices, each in ``[0, num_pages)``.
///     page_rank: ranks per page, at least 1.
///     num_pages: the pool's pages.
///
/// Raises:
///     OpArgumentError: naming the offset, page or ``page_rank`` out of range.
#[pyclass(frozen, name = "CpuPageTable", module = "lora_pin._core")]
pub struct PyCpuPageTable(PageTable);

#[pymethods]
impl PyCpuPageTable {
    #[new]
    #[pyo3(signature = (page_indptr, page_table, *, page_rank, num_pages))]
    fn new(
        py: Python<'_>,
        page_indptr: Vec<i64>,
        page_table: Vec<i64>,
        page_rank: usize,
        num_pages: usize,
    ) -> PyResult<Self> {
        shielded(py, || {
            PageTable::new(&page_indptr, &page_table, page_rank, num_pages).map(Self).map_err(py_err)
        })
    }

    /// Ranks per page.
    #[getter]
    fn page_rank(&self) -> usize {
        self.0.page_rank()
    }

    /// The pool's pages.
    #[getter]
    fn num_pages(&self) -> usize {
        self.0.num_pages()
    }

    /// The slots the tables describe.
    #[getter]
    fn n_slots(&self) -> usize {
        self.0.n_slots()
    }

    fn __repr__(&self) -> String {
        format!(
            "CpuPageTable(slots={}, page_rank={}, num_pages={})",
            self.0.n_slots(),
            self.0.page_rank(),
            self.0.num_pages()
        )
    }
}

#[pymethods]
impl PyCpuSgmvPlan {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (n_tokens, tokens, group_indptr, group_slots, ranks, *, n_slices, max_rank))]
    fn new(
        py: Python<'_>,
        n_tokens: usize,
        tokens: Vec<i64>,
        group_indptr: Vec<i64>,
        group_slots: Vec<i64>,
        ranks: Vec<i64>,
        n_slices: usize,
        max_rank: usize,
    ) -> PyResult<Self> {
        shielded(py, || {
            CpuPlan::new(n_tokens, &tokens, &group_indptr, &group_slots, &ranks, n_slices, max_rank)
                .map(Self)
                .map_err(py_err)
        })
    }

    /// The number of tokens the groups cover.
    #[getter]
    fn n_rows(&self) -> usize {
        self.0.n_rows()
    }

    /// Shrink into ``v`` (zeroed by the caller): ``v[t, s*R + j] = x[t] · a[slot(t), s*R + j]`` below
    /// each slice's rank, for the plan's tokens only.
    ///
    /// Each buffer is ``(address, numel)`` of a contiguous CPU tensor of ``dtype``: ``x``
    /// ``[n_tokens, in_features]``, ``a`` ``[slots, n_slices * R, in_features]``, ``v``
    /// ``[n_tokens, n_slices * R]``.
    ///
    /// ``threads``: the most threads to share the work among (the caller's included); small work runs
    /// on one.
    ///
    /// Raises:
    ///     OpArgumentError: a length, dtype, alignment or overlap mismatch (nothing written).
    ///     UsageError: this CPU lacks AVX-512.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dtype, x, in_features, a, v, *, threads = 1))]
    fn shrink(
        &self,
        py: Python<'_>,
        dtype: &str,
        x: Raw,
        in_features: usize,
        a: Raw,
        v: Raw,
        threads: usize,
    ) -> PyResult<()> {
        let dtype = checked(py, dtype, ("v", v), &[("x", x), ("a", a)], None)?;
        let plan = &self.0;
        detached(py, move || {
            // SAFETY: the caller's contract (live contiguous tensors of `dtype`); `checked` ruled out
            // misalignment and overlap with the written buffer.
            let (x, a, v) = unsafe { (data(dtype, x), data(dtype, a), data_mut(dtype, v)) };
            plan.shrink(x, in_features, a, v, threads)
        })
    }

    /// Expand into ``out`` in place: ``out[t, o_s:o_{s+1}] += scaling[slot, s] · v[t, slice s] @
    /// b[slot, o_s:o_{s+1}]ᵀ`` for the plan's tokens; other rows untouched.
    ///
    /// Buffers as for ``shrink``: ``out`` ``[n_tokens, out_total]``, ``v`` ``[n_tokens, n_slices * R]``,
    /// ``b`` ``[slots, out_total, R]`` of ``dtype``, ``scalings`` float32 ``[slots, n_slices]``.
    ///
    /// Raises:
    ///     OpArgumentError: as for ``shrink``, or bad ``slice_offsets``.
    ///     UsageError: this CPU lacks AVX-512.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dtype, out, v, b, scalings, slice_offsets, *, threads = 1))]
    fn expand(
        &self,
        py: Python<'_>,
        dtype: &str,
        out: Raw,
        v: Raw,
        b: Raw,
        scalings: Raw,
        slice_offsets: Vec<usize>,
        threads: usize,
    ) -> PyResult<()> {
        let dtype = checked(py, dtype, ("out", out), &[("v", v), ("b", b)], Some(scalings))?;
        let plan = &self.0;
        detached(py, move || {
            // SAFETY: as in `shrink`.
            let (out, v, b, scalings) =
                unsafe { (data_mut(dtype, out), data(dtype, v), data(dtype, b), view::<f32>(scalings)) };
            plan.expand(out, v, b, scalings, &slice_offsets, threads)
        })
    }

    /// Shrink then expand in one call: ``out += scaling · (x @ Aᵀ) @ Bᵀ`` for the plan's tokens, with
    /// ``v`` kept in a scratch buffer (``shrink`` and ``expand`` without a tensor between them).
    ///
    /// Buffers as for ``shrink`` and ``expand``: ``out`` ``[n_tokens, out_total]``, ``x``
    /// ``[n_tokens, in_features]``, ``a`` ``[slots, n_slices * R, in_features]``, ``b``
    /// ``[slots, out_total, R]`` of ``dtype``, ``scalings`` float32 ``[slots, n_slices]``.
    ///
    /// Raises:
    ///     OpArgumentError: as for ``shrink`` and ``expand`` (``out`` untouched).
    ///     UsageError: this CPU lacks AVX-512.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dtype, out, x, in_features, a, b, scalings, slice_offsets, *, threads = 1))]
    fn lora_delta(
        &self,
        py: Python<'_>,
        dtype: &str,
        out: Raw,
        x: Raw,
        in_features: usize,
        a: Raw,
        b: Raw,
        scalings: Raw,
        slice_offsets: Vec<usize>,
        threads: usize,
    ) -> PyResult<()> {
        let dtype = checked(py, dtype, ("out", out), &[("x", x), ("a", a), ("b", b)], Some(scalings))?;
        let plan = &self.0;
        detached(py, move || {
            // SAFETY: as in `shrink`.
            let (out, x, a, b, scalings) = unsafe {
                (data_mut(dtype, out), data(dtype, x), data(dtype, a), data(dtype, b), view::<f32>(scalings))
            };
            plan.lora_delta(out, x, in_features, a, b, scalings, &slice_offsets, threads)
        })
    }

    /// ``shrink`` reading A through page tables: ``a_pages`` ``[num_pages, n_slices * page_rank,
    /// in_features]`` of ``dtype`` (``pages`` says which pages hold each slot's ranks); ``x`` and ``v``
    /// as for ``shrink``.
    ///
    /// Raises:
    ///     OpArgumentError: as for ``shrink``, or ``pages`` describe another number of slots, or a
    ///         slot's rank exceeds what its pages hold (nothing written).
    ///     UsageError: this CPU lacks AVX-512.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dtype, x, in_features, a_pages, pages, v, *, threads = 1))]
    fn paged_shrink(
        &self,
        py: Python<'_>,
        dtype: &str,
        x: Raw,
        in_features: usize,
        a_pages: Raw,
        pages: &PyCpuPageTable,
        v: Raw,
        threads: usize,
    ) -> PyResult<()> {
        let dtype = checked(py, dtype, ("v", v), &[("x", x), ("a_pages", a_pages)], None)?;
        let (plan, pages) = (&self.0, &pages.0);
        detached(py, move || {
            // SAFETY: as in `shrink`.
            let (x, a, v) = unsafe { (data(dtype, x), data(dtype, a_pages), data_mut(dtype, v)) };
            plan.paged_shrink(x, in_features, a, pages, v, threads)
        })
    }

    /// ``expand`` reading B through page tables: ``b_pages`` ``[num_pages, out_total, page_rank]`` of
    /// ``dtype``; ``out``, ``v``, ``scalings`` and ``slice_offsets`` as for ``expand``.
    ///
    /// Raises:
    ///     OpArgumentError: as for ``expand`` and ``paged_shrink`` (nothing written).
    ///     UsageError: this CPU lacks AVX-512.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dtype, out, v, b_pages, pages, scalings, slice_offsets, *, threads = 1))]
    fn paged_expand(
        &self,
        py: Python<'_>,
        dtype: &str,
        out: Raw,
        v: Raw,
        b_pages: Raw,
        pages: &PyCpuPageTable,
        scalings: Raw,
        slice_offsets: Vec<usize>,
        threads: usize,
    ) -> PyResult<()> {
        let dtype = checked(py, dtype, ("out", out), &[("v", v), ("b_pages", b_pages)], Some(scalings))?;
        let (plan, pages) = (&self.0, &pages.0);
        detached(py, move || {
            // SAFETY: as in `shrink`.
            let (out, v, b, scalings) = unsafe {
                (data_mut(dtype, out), data(dtype, v), data(dtype, b_pages), view::<f32>(scalings))
            };
            plan.paged_expand(out, v, b, pages, scalings, &slice_offsets, threads)
        })
    }

    /// ``paged_shrink`` then ``paged_expand`` in one call, ``v`` kept in a scratch buffer
    /// (``lora_delta`` through page tables): ``out += scaling · (x @ Aᵀ) @ Bᵀ`` for the plan's tokens.
    ///
    /// Buffers as for ``paged_shrink`` and ``paged_expand``: ``out`` ``[n_tokens, out_total]``, ``x``
    /// ``[n_tokens, in_features]``, ``a_pages`` ``[num_pages, n_slices * page_rank, in_features]``,
    /// ``b_pages`` ``[num_pages, out_total, page_rank]`` of ``dtype``, ``scalings`` float32
    /// ``[slots, n_slices]``.
    ///
    /// Raises:
    ///     OpArgumentError: as for ``paged_shrink`` and ``paged_expand`` (``out`` untouched).
    ///     UsageError: this CPU lacks AVX-512.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dtype, out, x, in_features, a_pages, b_pages, pages, scalings, slice_offsets, *, threads = 1))]
    fn paged_lora_delta(
        &self,
        py: Python<'_>,
        dtype: &str,
        out: Raw,
        x: Raw,
        in_features: usize,
        a_pages: Raw,
        b_pages: Raw,
        pages: &PyCpuPageTable,
        scalings: Raw,
        slice_offsets: Vec<usize>,
        threads: usize,
    ) -> PyResult<()> {
        let inputs = [("x", x), ("a_pages", a_pages), ("b_pages", b_pages)];
        let dtype = checked(py, dtype, ("out", out), &inputs, Some(scalings))?;
        let (plan, pages) = (&self.0, &pages.0);
        detached(py, move || {
            // SAFETY: as in `shrink`.
            let (out, x, a, b, scalings) = unsafe {
                (
                    data_mut(dtype, out),
                    data(dtype, x),
                    data(dtype, a_pages),
                    data(dtype, b_pages),
                    view::<f32>(scalings),
                )
            };
            plan.paged_lora_delta(out, x, in_features, a, b, pages, scalings, &slice_offsets, threads)
        })
    }

    fn __repr__(&self) -> String {
        format!("CpuSgmvPlan(rows={})", self.0.n_rows())
    }
}
