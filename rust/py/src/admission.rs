//! Admission for schedulers that keep their own adapter slots (`lora_pin_core::admission`), for Python:
//! `lora_pin.vllm.Scheduler` calls it each step. Every decision is the core's.

use pyo3::prelude::*;

use super::errors::{new_error, py_err};
use super::shielded;
use lora_pin_core::admission::{self, Candidate, Rotating, Slots, Waiting};

fn count(py: Python<'_>, what: &str, v: i64) -> PyResult<u64> {
    counted(py, "admit_waiting", what, v)
}

fn counted(py: Python<'_>, call: &str, what: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v)
        .map_err(|_| new_error(py, "UsageError", format!("{call}: {what} must be at least 0 (got {v})")))
}

/// Which waiting requests to offer a step now, in order, and which to hold: lora_pin's admission for
/// an engine that keeps its own `slots` adapter slots (vLLM's `--max-loras`).
///
/// Request `i` waits for adapter `adapters[i]` (None: the base model) and has waited `waited[i]`
/// steps. Order: aged requests (waited `age_bound` steps or more), oldest first; then pinned
/// adapters'; then those needing no new slot (the base model's, a `running` adapter's); then the rest;
/// ties in the given order. Every slot a pin holds is reserved, running adapters keep theirs, the
/// rest go to new adapters in that order; once an aged request finds no slot, later ones are held
/// unless they take no slot the step does not already give (base, pinned, an adapter given a slot
/// earlier in this call), so the running adapters drain and the aged request gets a slot.
///
/// Returns `(offered, held)`: indices into `adapters`, each exactly once, each list in the order
/// above.
///
/// Raises:
///     UsageError: `adapters` and `waited` differ in length, a negative id or count, `age_bound`
///         below 1, or pins that leave no slot for other adapters (`slots` distinct pinned ids or
///         more). Nothing is changed.
#[pyfunction]
#[pyo3(signature = (adapters, waited, *, running, pinned, slots, age_bound))]
pub fn admit_waiting(
    py: Python<'_>,
    adapters: Vec<Option<i64>>,
    waited: Vec<i64>,
    running: Vec<i64>,
    pinned: Vec<i64>,
    slots: i64,
    age_bound: i64,
) -> PyResult<(Vec<u32>, Vec<u32>)> {
    shielded(py, || {
        if adapters.len() != waited.len() {
            let msg =
                format!("admit_waiting: {} adapters but {} waited counts", adapters.len(), waited.len());
            return Err(new_error(py, "UsageError", msg));
        }
        let requests = adapters
            .iter()
            .zip(&waited)
            .enumerate()
            .map(|(i, (&adapter, &waited))| {
                Ok(Waiting {
                    adapter: adapter.map(|a| count(py, &format!("adapter of request {i}"), a)).transpose()?,
                    waited: count(py, &format!("waited of request {i}"), waited)?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let ids = |what: &str, ids: &[i64]| -> PyResult<Vec<u64>> {
            ids.iter().map(|&a| count(py, &format!("a {what} adapter id"), a)).collect()
        };
        let (running, pinned) = (ids("running", &running)?, ids("pinned", &pinned)?);
        let slots = Slots {
            slots: usize::try_from(count(py, "slots", slots)?).unwrap_or(usize::MAX),
            running: &running,
            pinned: &pinned,
            age_bound: count(py, "age_bound", age_bound)?,
        };
        let admission = admission::admit_waiting(&requests, &slots).map_err(py_err)?;
        Ok((admission.offered, admission.held))
    })
}

/// Admission with rotation: which requests, running ones included, a step may schedule, so that an
/// adapter that waited past the age bound takes the slot of a running one (lora_pin's own engine's
/// rule), for an engine that keeps its own `slots` adapter slots (vLLM's `--max-loras`).
///
/// Request `i` is for adapter `adapters[i]` (None: the base model); `running[i]` says whether it is
/// running (started) or waiting; `waited[i]` is, for a waiting one, the steps it has waited, for a
/// running one the steps since it was last scheduled (0: scheduled in the previous step). Order:
/// aged requests (waited `age_bound` or more, running or waiting), oldest first; then pinned
/// adapters'; then those needing no new slot (the base model's, those of an adapter with a running
/// request scheduled in the previous step); then the rest; ties in the given order. Walking it, an
/// adapter fits if it is pinned, given a slot earlier in this call, or one of the `slots` minus pins
/// left; a running request whose adapter does not fit is suspended (it sits this step out), a
/// waiting one held. With no aged request, nothing scheduled in the previous step is suspended.
///
/// Returns `(offered, held, suspended)`: indices into `adapters`, each exactly once, each list in
/// the order above; `held` only waiting requests, `suspended` only running ones.
///
/// Raises:
///     UsageError: `adapters`, `waited` and `running` differ in length, a negative id or count,
///         `age_bound` below 1, or pins that leave no slot for other adapters (`slots` distinct
///         pinned ids or more). Nothing is changed.
#[pyfunction]
#[pyo3(signature = (adapters, waited, running, *, pinned, slots, age_bound))]
pub fn admit_rotating(
    py: Python<'_>,
    adapters: Vec<Option<i64>>,
    waited: Vec<i64>,
    running: Vec<bool>,
    pinned: Vec<i64>,
    slots: i64,
    age_bound: i64,
) -> PyResult<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    const CALL: &str = "admit_rotating";
    shielded(py, || {
        if adapters.len() != waited.len() || adapters.len() != running.len() {
            let msg = format!(
                "{CALL}: {} adapters but {} waited counts and {} running flags",
                adapters.len(),
                waited.len(),
                running.len()
            );
            return Err(new_error(py, "UsageError", msg));
        }
        let candidates = (0..adapters.len())
            .map(|i| {
                let adapter = adapters[i];
                Ok(Candidate {
                    adapter: adapter
                        .map(|a| counted(py, CALL, &format!("adapter of request {i}"), a))
                        .transpose()?,
                    waited: counted(py, CALL, &format!("waited of request {i}"), waited[i])?,
                    running: running[i],
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let pinned = pinned
            .iter()
            .map(|&a| counted(py, CALL, "a pinned adapter id", a))
            .collect::<PyResult<Vec<_>>>()?;
        let slots = Rotating {
            slots: usize::try_from(counted(py, CALL, "slots", slots)?).unwrap_or(usize::MAX),
            pinned: &pinned,
            age_bound: counted(py, CALL, "age_bound", age_bound)?,
        };
        let rotation = admission::admit_rotating(&candidates, &slots).map_err(py_err)?;
        Ok((rotation.offered, rotation.held, rotation.suspended))
    })
}
