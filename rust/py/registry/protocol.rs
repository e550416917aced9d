//! The pre-transaction step protocol (`plan`, `acquire`, `release`, `load_done`, `load_failed`,
//! `end_step`), kept out of `LoRARegistry`'s public methods: nothing in the package calls it, and a
//! serving loop uses the step transaction (`begin_step` / `finish_step`). Tests, the simulator's
//! cross-checks and benchmarks reach it through `lora_pin._testing`, as private functions of
//! `lora_pin._core` that take the registry first.

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;

use super::{PyLoRARegistry, PyStepPlan};
use crate::py::text::Name;
use crate::py::{detached, shielded};

/// Plans one scheduler step and commits it, without acquiring its requests (a planner for tests,
/// simulations and benchmarks: a serving loop uses `begin_step`, which plans and acquires at once).
///
/// `names[i]` is request i's adapter (None for the base model) and `num_tokens[i]` its tokens this
/// step; `num_tokens` may also be one int, every request's count (a decode step). Admitted adapters
/// are protected from eviction until the next plan or `end_step`; planned loads until `load_done` /
/// `load_failed`.
///
/// Raises:
///     AdapterNotFoundError: a name is unknown (nothing was planned).
///     UsageError: the lengths differ, a token count is negative or not an int, a name is not a
///         str, or a step transaction is open.
#[pyfunction]
#[pyo3(name = "_plan")]
pub fn plan(
    py: Python<'_>,
    registry: &Bound<'_, PyLoRARegistry>,
    names: &Bound<'_, PyAny>,
    num_tokens: &Bound<'_, PyAny>,
) -> PyResult<PyStepPlan> {
    let this = registry.get();
    let (plan, n) = this.with_requests(py, names, Some(num_tokens), None, |reg, step, _| {
        reg.plan(step.adapters, step.num_tokens)
    })?;
    let indices = this.indices.at_least(py, n)?;
    Ok(PyStepPlan::planned(plan, std::sync::Arc::clone(&this.indices), indices, this.strs.clone()))
}

/// Counts one more request in flight per adapter name, atomically; None (the base model) passes
/// through. Returns the adapters' ids, to hand to `release`.
///
/// Raises:
///     AdapterNotFoundError: a name is not registered (nothing was counted).
#[pyfunction]
#[pyo3(name = "_acquire")]
pub fn acquire(
    py: Python<'_>,
    registry: &Bound<'_, PyLoRARegistry>,
    names: Vec<Option<PyBackedStr>>,
) -> PyResult<Vec<Option<String>>> {
    let shared = &registry.get().shared;
    let ids = detached(py, || {
        let names: Vec<Option<&str>> = names.iter().map(|n| n.as_deref()).collect();
        shared.lock().acquire(&names)
    })?;
    Ok(ids.into_iter().map(|id| id.map(|id| id.to_string())).collect())
}

/// Counts one request less in flight per id, atomically; None passes through.
///
/// Raises:
///     AdapterNotFoundError: an id is unknown.
///     UsageError: an id is released more often than it is in flight (nothing was released).
#[pyfunction]
#[pyo3(name = "_release")]
pub fn release(
    py: Python<'_>,
    registry: &Bound<'_, PyLoRARegistry>,
    ids: Vec<Option<PyBackedStr>>,
) -> PyResult<()> {
    let shared = &registry.get().shared;
    detached(py, || {
        let ids: Vec<Option<&str>> = ids.iter().map(|n| n.as_deref()).collect();
        shared.release(&ids)
    })
}

/// Ends the protection of the latest plan's adapters (the next plan does this itself).
///
/// Raises:
///     UsageError: a step transaction is open (`finish_step` ends it).
#[pyfunction]
#[pyo3(name = "_end_step")]
pub fn end_step(py: Python<'_>, registry: &Bound<'_, PyLoRARegistry>) -> PyResult<()> {
    let shared = &registry.get().shared;
    detached(py, || shared.lock().end_step())
}

/// Reports a load `plan` planned finished: the adapter's loading protection ends.
///
/// Raises:
///     AdapterNotFoundError: the name is unknown.
///     UsageError: no load of it is pending, or it belongs to the open step transaction.
#[pyfunction]
#[pyo3(name = "_load_done")]
pub fn load_done(py: Python<'_>, registry: &Bound<'_, PyLoRARegistry>, name: Name) -> PyResult<()> {
    let shared = &registry.get().shared;
    if let Some(mut reg) = shared.try_lock() {
        return shielded(py, || reg.load_done(&name).map_err(PyErr::from));
    }
    detached(py, || shared.lock().load_done(&name))
}

/// Reports a load `plan` planned failed: the adapter leaves its slot (and the host tier, if the load
/// was to read it from disk). Nothing else changes.
///
/// Raises:
///     AdapterNotFoundError: the name is unknown.
///     UsageError: no load of it is pending, or it belongs to the open step transaction.
#[pyfunction]
#[pyo3(name = "_load_failed")]
pub fn load_failed(py: Python<'_>, registry: &Bound<'_, PyLoRARegistry>, name: Name) -> PyResult<()> {
    let shared = &registry.get().shared;
    detached(py, || shared.lock().load_failed(&name))
}
