//! The PyO3 bindings: the private module `lora_pin._core`. Only classes, conversions, the exception
//! mapping and GIL release live here; every decision is made by the core (`lora_pin_core`) and every
//! byte is moved by the kernels (`lora_pin_kernels`).

mod admission;
mod errors;
mod header;
mod patterns;
mod registry;
mod routing;
mod sgmv;
mod sim;
mod spec;
mod text;
#[cfg(unix)]
mod weights;

use pyo3::prelude::*;

/// lora_pin's native core. Import from `lora_pin`, not from here.
#[pymodule]
pub mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use super::admission::{admit_rotating, admit_waiting};
    #[pymodule_export]
    use super::errors::unload_timeout_error;
    #[pymodule_export]
    use super::header::{index_header, lora_pairs};
    #[pymodule_export]
    use super::patterns::PyPatternSet;
    #[pymodule_export]
    use super::registry::checked_names;
    #[pymodule_export]
    use super::registry::{PyFetchPlan, PyLoRARegistry, PyStepPlan};
    #[pymodule_export]
    use super::routing::{home_replicas, rank_replicas, replication_factor};
    #[pymodule_export]
    use super::sgmv::{cpu_features, dora_scale_rows, sgmv_cpu_available, PyCpuPageTable, PyCpuSgmvPlan};
    #[pymodule_export]
    use super::sim::{ranks_by_name, simulate, simulate_replicas, PyTrace};
    #[pymodule_export]
    use super::spec::{check_limits, parse_lora_paths, PyLoRARef};
    #[cfg(unix)]
    #[pymodule_export]
    use super::weights::read_tensors;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("MAX_SLOTS", lora_pin_core::limits::MAX_SLOTS)?;
        m.add("MAX_ADAPTER_RANK", lora_pin_core::limits::MAX_ADAPTER_RANK)?;
        m.add("OVERDUE_AFTER", lora_pin_core::limits::OVERDUE_AFTER)?;
        m.add("MIN_ARRIVAL_CV", lora_pin_core::sim::MIN_ARRIVAL_CV)?;
        m.add("MAX_ARRIVAL_CV", lora_pin_core::sim::MAX_ARRIVAL_CV)?;
        m.add("EVICTION_POLICIES", pyo3::types::PyTuple::new(m.py(), lora_pin_core::policy::POLICY_NAMES)?)
    }
}

/// Runs `f` with the GIL released and any panic turned into a `LoraPinError`: for anything not O(1).
pub(crate) fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> lora_pin_core::Result<T> + Send,
) -> PyResult<T> {
    match py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))) {
        Ok(result) => result.map_err(errors::py_err),
        Err(panic) => Err(errors::internal_error(py, &panic)),
    }
}

/// Runs `f` with the GIL held, turning any panic into a `LoraPinError` instead of a `PanicException`.
pub(crate) fn shielded<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => Err(errors::internal_error(py, &panic)),
    }
}
