//! `_index_header` and `_lora_pairs`: a safetensors header's tensors and the LoRA pairs among them
//! (`lora_pin_core::header`), for `lora_pin/weights/reader.py`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::detached;
use lora_pin_core::header::{self, HeaderError, LoraPair, StoredTensor};

/// One stored tensor as Python takes it: name, safetensors dtype name, shape, and its bytes' range
/// from the file's start.
type Stored = (String, String, Vec<u64>, u64, u64);
/// One LoRA pair: module key, the indexes of its A and B, whether it is an embedding's, and the index
/// of its DoRA magnitude (None without).
type Pair = (String, usize, usize, bool, Option<usize>);
/// What `_index_header` returns: the tensor count, the tensors, the pairs and the unused tensors.
type Indexed = (usize, Vec<Stored>, Vec<Pair>, Vec<usize>);

fn pairs_of(pairs: Vec<LoraPair>) -> Vec<Pair> {
    pairs.into_iter().map(|p| (p.module_key, p.a, p.b, p.embedding, p.magnitude)).collect()
}

/// Indexes a safetensors header and finds the LoRA pairs in it.
///
/// ``json`` is the header's JSON (the bytes after its 8-byte length), ``data_start`` where the data
/// starts in the file and ``file_size`` the file's length.
///
/// Returns ``(count, tensors, pairs, unused)``: the number of tensors the header names; when it is at
/// most ``max_tensors``, every tensor as ``(name, dtype, shape, begin, end)`` in the header's order
/// (offsets from the file's start), the LoRA pairs as ``(module_key, a, b, embedding, magnitude)``
/// (indexes into ``tensors``; ``magnitude`` None without DoRA) and the indexes of the tensors in no
/// complete pair, by name; otherwise three empty lists.
///
/// Raises:
///     ValueError: the header breaks the safetensors format, or a pair's A or B is not 2-D (the
///         message says what is wrong, naming the tensor).
#[pyfunction]
#[pyo3(name = "_index_header")]
pub fn index_header(
    py: Python<'_>,
    json: &[u8],
    data_start: u64,
    file_size: u64,
    max_tensors: usize,
) -> PyResult<Indexed> {
    let found = detached(py, move || {
        Ok(header::index_header(json, data_start, file_size, max_tensors).and_then(|tensors| {
            let (pairs, unused) = header::lora_pairs(&tensors).map_err(HeaderError::Invalid)?;
            Ok((tensors, pairs, unused))
        }))
    })?;
    let (tensors, pairs, unused) = match found {
        Ok(found) => found,
        Err(HeaderError::TooMany(count)) => return Ok((count, Vec::new(), Vec::new(), Vec::new())),
        Err(HeaderError::Invalid(why)) => return Err(PyValueError::new_err(why)),
    };
    let stored: Vec<Stored> =
        tensors.into_iter().map(|t| (t.name, t.dtype, t.shape, t.begin, t.end)).collect();
    Ok((stored.len(), stored, pairs_of(pairs), unused))
}

/// The LoRA pairs among ``tensors`` (``(name, shape)`` each) and the indexes of the tensors in no
/// complete pair, by name, as :func:`_index_header` gives them for a header's tensors.
///
/// Raises:
///     ValueError: a pair's A or B is not 2-D.
#[pyfunction]
#[pyo3(name = "_lora_pairs")]
pub fn lora_pairs(py: Python<'_>, tensors: Vec<(String, Vec<u64>)>) -> PyResult<(Vec<Pair>, Vec<usize>)> {
    let found = detached(py, move || {
        let tensors: Vec<StoredTensor> = tensors
            .into_iter()
            .map(|(name, shape)| StoredTensor { name, dtype: String::new(), shape, begin: 0, end: 0 })
            .collect();
        Ok(header::lora_pairs(&tensors))
    })?;
    let (pairs, unused) = found.map_err(PyValueError::new_err)?;
    Ok((pairs_of(pairs), unused))
}
