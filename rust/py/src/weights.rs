//! `read_tensors`: the host tier's read of an adapter's tensors with their digests
//! (`lora_pin_kernels::weights`), for `lora_pin/weights/reader.py`.
//!
//! Python owns the file descriptor and the tensors; a call borrows both for its duration, with the
//! GIL released. Destinations are addresses of live, contiguous CPU tensors, which the reader checks
//! before every call: the function is private for that reason.

use std::io;
use std::ptr::NonNull;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::detached;
use super::errors::new_error;
use lora_pin_kernels::weights::{self, ReadAt, TensorRead};

/// One tensor as Python hands it over: name, safetensors dtype name, shape, file offset of its first
/// byte, and the address and byte length of where it goes.
type Job = (String, String, Vec<u64>, u64, usize, usize);

/// A descriptor the caller keeps open during the call.
struct Fd(i32);

impl ReadAt for Fd {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let offset =
            libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: pread writes at most `buf.len()` bytes at `buf`, which this function borrows
        // mutably; a descriptor that is not open gives EBADF, not undefined behaviour.
        let got = unsafe { libc::pread(self.0, buf.as_mut_ptr().cast(), buf.len(), offset) };
        usize::try_from(got).map_err(|_| io::Error::last_os_error())
    }
}

/// Reads each tensor of ``reads`` from the open file ``fd`` into its destination and hashes it.
///
/// Each read is ``(name, dtype, shape, offset, address, nbytes)``: the tensor's name and safetensors
/// dtype name and shape (what its digest covers), the file offset of its first byte, and the address
/// and length of a contiguous CPU tensor's memory that takes its ``nbytes`` bytes. Destinations must
/// not overlap. ``threads``: the most threads to share the reads among (the caller's included).
///
/// Returns ``(digests, non_finite)``: the 32-byte digests (``lora_pin.weights.digest.tensor_digest``'s)
/// of the reads, in order, joined in one ``bytes`` of ``32 * len(reads)``; and per read the number of
/// its elements that are NaN or infinite, for ``F64``, ``F32``, ``F16`` and ``BF16`` (None for other
/// dtypes).
///
/// Raises:
///     AdapterLoadError: naming the tensor whose bytes could not be read (an I/O error, or the file
///         ended before its last byte).
///     UsageError: a null destination or two destinations that overlap (nothing read).
#[pyfunction]
#[pyo3(name = "_read_tensors", signature = (fd, reads, *, threads = 1))]
pub fn read_tensors<'py>(
    py: Python<'py>,
    fd: i32,
    reads: Vec<Job>,
    threads: usize,
) -> PyResult<(Bound<'py, PyBytes>, Vec<Option<u64>>)> {
    let mut spans: Vec<(usize, usize, &str)> =
        reads.iter().filter(|j| j.5 > 0).map(|j| (j.4, j.5, j.0.as_str())).collect();
    spans.sort_unstable();
    for (i, &(address, nbytes, name)) in spans.iter().enumerate() {
        let why = match (address.checked_add(nbytes), spans.get(i + 1)) {
            _ if address == 0 => format!("the destination of tensor {name:?} is null"),
            (None, _) => format!("the destination of tensor {name:?} runs past the address space"),
            (Some(end), Some(next)) if next.0 < end => {
                format!("the destinations of tensors {name:?} and {:?} overlap", next.2)
            }
            _ => continue,
        };
        return Err(new_error(py, "UsageError", format!("_read_tensors: {why}")));
    }
    let found = detached(py, move || {
        let mut jobs: Vec<TensorRead<'_>> = reads
            .into_iter()
            .map(|(name, dtype, shape, offset, address, nbytes)| {
                let ptr = if nbytes == 0 { NonNull::dangling().as_ptr() } else { address as *mut u8 };
                // SAFETY: the caller's contract (the memory of a live contiguous CPU tensor, nbytes
                // long, that nothing else uses during the call); the checks above ruled out a null
                // address and overlap between destinations.
                let out = unsafe { std::slice::from_raw_parts_mut(ptr, nbytes) };
                TensorRead { name, dtype, shape, offset, out }
            })
            .collect();
        weights::read_tensors(&Fd(fd), &mut jobs, threads.max(1))
    })?;
    let digests: Vec<u8> = found.iter().flat_map(|f| f.digest).collect();
    Ok((PyBytes::new(py, &digests), found.iter().map(|f| f.non_finite).collect()))
}
