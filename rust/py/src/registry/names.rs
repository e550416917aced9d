//! The names check, for the Python callers that read a step's names before the core does
//! (`discover`, `split`, `prefetch`): the same reader `begin_step` uses, so the rule is written once.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use super::requests::Requests;

/// `names` as a new list after the check every step makes of its names.
///
/// Raises:
///     UsageError: `names` is a str or not iterable, or an entry is neither a str nor None (named by
///         its position).
///     SpecError: an entry holds a lone surrogate (it has no UTF-8 encoding, so it names nothing).
#[pyfunction]
#[pyo3(name = "_checked_names")]
pub fn checked_names<'py>(py: Python<'py>, names: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    let items = match names.try_iter() {
        Ok(iter) if !names.is_instance_of::<PyString>() => iter.collect::<PyResult<Vec<_>>>()?,
        // A str, or not iterable: the reader refuses it, naming what it got.
        _ => {
            Requests::read(py, names, None)?;
            Vec::new()
        }
    };
    let list = PyList::new(py, items)?;
    Requests::read(py, list.as_any(), None)?;
    Ok(list)
}
