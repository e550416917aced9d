//! Arguments from Python that error messages quote or the core reads: text that must encode as UTF-8,
//! integers that must fit, and any object rendered boundedly for a message.
//!
//! A `str` may hold a lone surrogate (`json.loads('"\\ud800"')` returns one, so client traffic can
//! send it), which has no UTF-8 encoding; an int may exceed every machine width; a dict may nest
//! 100,000 deep, so its `repr` raises `RecursionError`. Each becomes a `SpecError` naming the argument.

use std::ops::Deref;

use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyString;

use super::errors::new_error;

/// Longest quote of an object in a message, in characters.
const MAX_QUOTE: usize = 120;

/// `obj` rendered for an error message: Python's `repr` at most four levels deep and about
/// [`MAX_QUOTE`] characters long (`reprlib`), so a deeply nested or huge value renders, and a
/// `__repr__` that raises gives the type name instead.
pub(crate) fn quote(obj: &Bound<'_, PyAny>) -> String {
    let rendered = (|| -> PyResult<String> {
        let repr = obj.py().import("reprlib")?.getattr("Repr")?.call0()?;
        for (field, value) in [("maxlevel", 4), ("maxstring", MAX_QUOTE), ("maxother", MAX_QUOTE)] {
            repr.setattr(field, value)?;
        }
        repr.call_method1("repr", (obj,))?.extract::<String>()
    })();
    rendered.unwrap_or_else(|_| format!("<{}>", type_name(obj)))
}

/// The name of `obj`'s type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

/// `obj` as UTF-8 text; `what` names it in the errors.
///
/// Raises:
///     SpecError: `obj` is a `str` holding a lone surrogate.
///     TypeError: `obj` is not a `str`.
pub(crate) fn text(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<PyBackedStr> {
    let s = obj
        .cast::<PyString>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a str, got {}", type_name(obj))))?;
    PyBackedStr::try_from(s.clone()).map_err(|_| {
        new_error(
            obj.py(),
            "SpecError",
            format!(
                "{what} {} is not valid text: it holds a lone surrogate, which has no UTF-8 encoding",
                quote(obj)
            ),
        )
    })
}

/// An adapter-name argument, as UTF-8 text (see [`text`]): a `SpecError`, not a `UnicodeEncodeError`,
/// for a lone surrogate.
pub(crate) struct Name(PyBackedStr);

impl<'a, 'py> FromPyObject<'a, 'py> for Name {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        text(&obj.to_owned(), "adapter name").map(Name)
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// Integer argument `what` as an `i64` (range checks are the caller's).
///
/// Raises:
///     SpecError: the int does not fit an `i64`; the message names `what` and `min..=i64::MAX`.
///     TypeError: `obj` is not an integer.
pub(crate) fn int_arg(obj: &Bound<'_, PyAny>, what: &str, min: i64) -> PyResult<i64> {
    obj.extract::<i64>().map_err(|e| {
        if !e.is_instance_of::<PyOverflowError>(obj.py()) {
            return e;
        }
        // A huge int's repr can itself fail (str-conversion digit limit): its size is enough.
        let shown = obj
            .repr()
            .ok()
            .map(|r| r.to_string())
            .filter(|r| r.len() <= 40)
            .or_else(|| {
                let bits = obj.call_method0("bit_length").ok()?.extract::<u64>().ok()?;
                Some(format!("an int of {bits} bits"))
            })
            .unwrap_or_else(|| "an int too large to show".to_owned());
        new_error(
            obj.py(),
            "SpecError",
            format!("{what} must be an integer in {min}..={} (got {shown})", i64::MAX),
        )
    })
}
