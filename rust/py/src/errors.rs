//! The one mapping from the core's [`Error`] to lora_pin's exception hierarchy, which is defined in
//! Python (`lora_pin/errors.py`) so that classes can also derive from `ValueError`, `KeyError`, ...

use std::any::Any;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use lora_pin_core::Error;

/// The classes of `lora_pin.errors` the bindings raise, each looked up once and kept.
const CLASSES: [&str; 10] = [
    "LoraPinError",
    "SpecError",
    "AdapterNotFoundError",
    "DuplicateAdapterError",
    "CapacityError",
    "AdapterInUseError",
    "UnloadTimeoutError",
    "UsageError",
    "OpArgumentError",
    "AdapterLoadError",
];

static CACHED: [PyOnceLock<Py<PyType>>; CLASSES.len()] = [const { PyOnceLock::new() }; CLASSES.len()];

/// The class `name` from `lora_pin.errors` (resolved once per class and cached, not on every raise).
pub(crate) fn error_class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let lookup = || -> PyResult<Py<PyType>> {
        Ok(py.import("lora_pin.errors")?.getattr(name)?.cast_into::<PyType>()?.unbind())
    };
    match CLASSES.iter().position(|&c| c == name) {
        Some(i) => Ok(CACHED[i].get_or_try_init(py, lookup)?.bind(py).clone()),
        None => Ok(lookup()?.into_bound(py)),
    }
}

/// A `name` error (a class in `lora_pin.errors`) carrying `msg`.
pub(crate) fn new_error(py: Python<'_>, name: &str, msg: String) -> PyErr {
    match error_class(py, name) {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(e) => e,
    }
}

/// The exception `err` raises in Python: one class per variant. A function rather than `From`, which
/// the orphan rule refuses (neither type is this crate's): a core result is raised with
/// `.map_err(py_err)`.
pub(crate) fn py_err(err: Error) -> PyErr {
    let class = match &err {
        Error::Spec(_) => "SpecError",
        Error::AdapterNotFound { .. } => "AdapterNotFoundError",
        Error::DuplicateAdapter { .. } => "DuplicateAdapterError",
        Error::Capacity(_) => "CapacityError",
        Error::AdapterInUse(_) => "AdapterInUseError",
        Error::UnloadTimeout { .. } => "UnloadTimeoutError",
        Error::Usage(_) => "UsageError",
        Error::OpArgument(_) => "OpArgumentError",
        Error::WeightFile(_) => "AdapterLoadError",
    };
    Python::attach(|py| new_error(py, class, err.to_string()))
}

/// The `UnloadTimeoutError` an unload of `name` raises after waiting `waited` seconds with `in_flight`
/// requests still using it, for the Python unloads that wait themselves (`unload_async`): the message
/// is the core's, as from `LoRARegistry.unload`.
///
/// Raises:
///     UsageError: `waited` is negative or not finite.
#[pyfunction]
#[pyo3(name = "_unload_timeout_error")]
pub fn unload_timeout_error(
    py: Python<'_>,
    name: String,
    in_flight: u64,
    waited: f64,
) -> PyResult<Py<PyAny>> {
    let Ok(waited) = std::time::Duration::try_from_secs_f64(waited) else {
        return Err(new_error(
            py,
            "UsageError",
            format!("waited must be finite seconds >= 0 (got {waited})"),
        ));
    };
    let err = py_err(Error::UnloadTimeout { name, in_flight, waited });
    Ok(err.into_value(py).into_any())
}

/// A `LoraPinError` for a panic caught at the boundary: a bug in lora_pin, never a `PanicException`.
pub(crate) fn internal_error(py: Python<'_>, panic: &Box<dyn Any + Send>) -> PyErr {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned());
    new_error(
        py,
        "LoraPinError",
        format!("internal error in lora_pin's core (a bug; please report it): {what}"),
    )
}
