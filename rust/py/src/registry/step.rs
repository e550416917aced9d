//! `StepPlan` for Python: the core's plan, its arrays as `bytearray`s and its request indices as
//! lists built from a shared list of ints by C-level slicing, not one int at a time.

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyString, PyTuple};

use super::requests::AddressMap;
use crate::errors::py_err;
use crate::shielded;
use lora_pin_core::registry::tiers::Tier;
use lora_pin_core::registry::{AdmissionOrder, Fetch, FetchPlan, LoadSource, StepPlan, StepStart};

/// Past this many deferred requests, `admitted` is built item by item instead of by deleting them
/// from a slice (each deletion moves the list's tail).
const DELETE_AT_MOST: usize = 32;

/// The ints `0..len` as one Python list that plans slice their request indices from; it grows
/// (doubling) to the longest step seen. Never handed out itself, so never mutated. Also the tuple
/// `0..n` of the latest step that admitted all its `n` requests, handed out as is (immutable): a
/// steady batch's `outcome` builds no tuple.
pub(super) struct RequestIndices(Mutex<Option<Py<PyList>>>, Mutex<Option<Py<PyTuple>>>);

impl RequestIndices {
    pub(super) fn new() -> Self {
        Self(Mutex::new(None), Mutex::new(None))
    }

    /// The tuple `0..n`. `try_lock`: as for [`RequestIndices::at_least`].
    fn range<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyTuple>> {
        let Some(mut shared) = self.1.try_lock() else {
            return PyTuple::new(py, 0..n);
        };
        if let Some(tuple) = shared.as_ref().filter(|t| t.bind(py).len() == n) {
            return Ok(tuple.bind(py).clone());
        }
        let tuple = PyTuple::new(py, 0..n)?;
        let old = shared.replace(tuple.clone().unbind());
        drop(shared);
        drop(old);
        Ok(tuple)
    }

    /// A list of at least `0..n`. `try_lock`: only a re-entrant call can find it locked, and that
    /// one gets a list of its own.
    pub(super) fn at_least<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Py<PyList>> {
        let Some(mut shared) = self.0.try_lock() else {
            return Ok(PyList::new(py, 0..n)?.unbind());
        };
        match shared.as_ref() {
            Some(list) if list.bind(py).len() >= n => Ok(list.clone_ref(py)),
            _ => {
                let longer = shared.as_ref().map_or(0, |l| l.bind(py).len() * 2).max(n).max(256);
                let list = PyList::new(py, 0..longer)?.unbind();
                let old = shared.replace(list.clone_ref(py));
                drop(shared);
                drop(old);
                Ok(list)
            }
        }
    }
}

/// The most names [`NameStrs`] holds; past it, it starts over.
const NAME_STRS_CAPACITY: usize = 1024;

/// The Python strs that `loads` and `evictions` hand out for the core's names, by the address of
/// the name's `Arc<str>` (shared with the registry, so a name's address is the same in every plan).
/// Each entry holds a clone of its `Arc`, so the address cannot be reused by another name while
/// cached. Locked only with the GIL held and never across a GIL release, so it is never contended.
#[derive(Clone, Default)]
pub(super) struct NameStrs(Arc<Mutex<AddressMap<NameStr>>>);

/// A cached name and its Python str.
type NameStr = (Arc<str>, Py<PyString>);

impl NameStrs {
    /// The Python str for `name`, made once per name. `try_lock`: only a re-entrant call can find
    /// it locked, and that one makes a str of its own.
    fn get<'py>(&self, py: Python<'py>, name: &Arc<str>) -> Bound<'py, PyString> {
        let Some(mut strs) = self.0.try_lock() else {
            return PyString::new(py, name);
        };
        let address = Arc::as_ptr(name).cast::<u8>() as usize;
        if let Some((_, s)) = strs.get(&address) {
            return s.bind(py).clone();
        }
        if strs.len() >= NAME_STRS_CAPACITY {
            // Exact strs and `Arc`s: dropping them runs no Python code.
            strs.clear();
        }
        let s = PyString::new(py, name);
        strs.insert(address, (Arc::clone(name), s.clone().unbind()));
        s
    }
}

/// What `begin_step` answered: a begun step, or what to do before one can begin.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Begun,
    Discover,
    ReadFirst,
    Fetching,
}

/// One answer of `begin_step`: its `action`, and for a begun step the committed plan. Token
/// indices count the admitted requests' tokens only (each request's tokens contiguous, requests in
/// `admitted` order). The array properties are native-endian `bytearray`s:
/// `torch.frombuffer(plan.seg_indptr, dtype=torch.int32)` (int32 unless noted; an empty array is an
/// empty `bytearray`, which `torch.frombuffer` rejects: use `torch.empty(0)` then).
#[pyclass(frozen, name = "StepPlan", module = "lora_pin")]
pub struct PyStepPlan {
    plan: StepPlan,
    action: Action,
    /// The step transaction's ticket (a begun step), None otherwise.
    ticket: Option<u64>,
    /// The names to discover or read first.
    names: Vec<Arc<str>>,
    /// Fetching: whether waiting can change the answer.
    progress: bool,
    /// At least `0..len(admitted) + len(deferred)`, shared with other plans.
    indices: Py<PyList>,
    /// The registry's request indices, for `outcome`.
    shared: Arc<RequestIndices>,
    /// The registry's strs for names.
    strs: NameStrs,
}

impl PyStepPlan {
    pub(super) fn new(
        start: StepStart,
        shared: Arc<RequestIndices>,
        indices: Py<PyList>,
        strs: NameStrs,
    ) -> Self {
        let empty = StepPlan::default();
        let (plan, action, ticket, names, progress) = match start {
            StepStart::Begun(plan, ticket) => (plan, Action::Begun, Some(ticket.0), Vec::new(), true),
            StepStart::Discover(names) => (empty, Action::Discover, None, names, true),
            StepStart::ReadFirst(names) => (empty, Action::ReadFirst, None, names, true),
            StepStart::Fetching { plan, progress } => (plan, Action::Fetching, None, Vec::new(), progress),
        };
        Self { plan, action, ticket, names, progress, indices, shared, strs }
    }

    fn names_if<'py>(&self, py: Python<'py>, action: Action) -> PyResult<Bound<'py, PyList>> {
        let names: &[Arc<str>] = if self.action == action { &self.names } else { &[] };
        PyList::new(py, names.iter().map(|n| self.strs.get(py, n)))
    }
}

/// Kernel arrays for Python: one buffer and its parts' lengths in int32 words.
type Arrays<'py> = (Bound<'py, PyByteArray>, (usize, usize, usize, usize));

/// The raw bytes of a slice of plain numbers.
fn byte_array<'py, T: Copy>(py: Python<'py>, values: &[T]) -> Bound<'py, PyByteArray> {
    // SAFETY: only instantiated with i32, f32 and i64, which have no padding and no invalid bit
    // patterns; the byte slice covers exactly the slice's memory and lives as long as `values`.
    let bytes =
        unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) };
    PyByteArray::new(py, bytes)
}

#[pymethods]
impl PyStepPlan {
    /// What to do next: "begun" (the step began: run it and finish it), "discover" (register the
    /// names in `unknown` and begin again), "read_first" (read the adapters in `to_read` into the
    /// host tier and begin again) or "fetching" (a whole batch waits for the fetches of its
    /// adapters: wait for them and begin again). Only a begun step has a ticket and plans
    /// anything, but a fetching answer's `to_fetch`, `evictions` and `deferred`.
    #[getter]
    fn action(&self, py: Python<'_>) -> Py<PyString> {
        let name = match self.action {
            Action::Begun => intern!(py, "begun"),
            Action::Discover => intern!(py, "discover"),
            Action::ReadFirst => intern!(py, "read_first"),
            Action::Fetching => intern!(py, "fetching"),
        };
        name.clone().unbind()
    }

    /// The step transaction's ticket (a begun step), for `report_load` and `finish_step`; None
    /// for any other answer.
    #[getter]
    fn ticket(&self) -> Option<u64> {
        self.ticket
    }

    /// Adapters to read from disk before the step can begin (action "read_first"), else empty.
    #[getter]
    fn to_read<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.names_if(py, Action::ReadFirst)
    }

    /// Names the step's requests use that nobody knows (action "discover"), else empty.
    #[getter]
    fn unknown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.names_if(py, Action::Discover)
    }

    /// Action "fetching": whether waiting for fetches can change the answer (this answer started
    /// fetches, fetches are in flight, or it lifted the protection of fresh adapters outside the
    /// batch). False: beginning again gives this answer again unless other callers change the
    /// registry. True for every other action.
    #[getter]
    fn progress(&self) -> bool {
        self.progress
    }

    /// Why each deferred request waits, parallel to `deferred`: "device_room" (no slot now),
    /// "host_room" (outside the host tier, its read not started: no room that other requests do not
    /// need, or as many adapters as a step can admit are ready already), "loading" (being read) or
    /// "fairness" (it gave way to an older waiting request).
    #[getter]
    fn reasons<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.plan.reasons.iter().map(|r| PyString::intern(py, r.as_str())))
    }

    /// `(index, why)` of each request that fails this step, in batch order: why is "read_failed"
    /// (its adapter's last read failed) or "unloaded" (its adapter was unloaded while it waited).
    #[getter]
    fn failed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.plan.failed.iter().map(|&(i, hold)| (i, PyString::intern(py, hold.as_str()))))
    }

    /// The step's kernel arrays in one call: `(buffer, words)`, a native-endian `bytearray` holding
    /// `token_perm` as int64, then `request_slots`, `seg_indptr` and `seg_slots` as int32, and the
    /// four parts' lengths in int32 words (`2 * N`, `A`, `S + 1`, `S`): one int32 tensor of it,
    /// split by `words`, gives every array (the first viewed as int64) with one copy to a device.
    fn step_arrays<'py>(&self, py: Python<'py>) -> Arrays<'py> {
        let (bytes, [a, b, c, d]) = self.plan.step_arrays();
        (PyByteArray::new(py, &bytes), (a, b, c, d))
    }

    /// The kernel arrays of the sub-batch a scheduler built from this step's admitted requests:
    /// `requests[k]` (a request index, as in `admitted`) runs `num_tokens[k]` tokens, each request's
    /// tokens contiguous, in `requests` order; as `step_arrays`, `request_slots` being the
    /// sub-batch's. Sorted and segmented by the rule the step's own arrays follow.
    ///
    /// Raises:
    ///     UsageError: the lengths differ, a request is not admitted or repeats, a count is below 1,
    ///         or the tokens overflow an int32.
    fn subset<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<i64>,
        num_tokens: Vec<i64>,
    ) -> PyResult<Arrays<'py>> {
        let narrow = |v: &[i64]| v.iter().map(|&x| u32::try_from(x)).collect::<Result<Vec<_>, _>>();
        let (Ok(requests), Ok(num_tokens)) = (narrow(&requests), narrow(&num_tokens)) else {
            let msg = format!(
                "subset: requests {requests:?} must be admitted indices of the step and num_tokens \
                 {num_tokens:?} counts of at least 1"
            );
            return Err(super::usage(py, msg));
        };
        let (bytes, [a, b, c, d]) =
            shielded(py, || self.plan.subset(&requests, &num_tokens).map_err(py_err))?;
        Ok((PyByteArray::new(py, &bytes), (a, b, c, d)))
    }

    /// The admitted requests a scheduler starts now (indices, in batch order), given which
    /// requests were waiting (one flag per request: not started in an earlier step): all but, after
    /// a waiting request deferred for a device slot ("device_room", or "fairness": it gave way), the
    /// waiting ones that use an adapter, so it is not overtaken step after step by later ones.
    /// That is `order="arrival"`; `"longest_remaining"` starts every admitted request.
    ///
    /// Raises:
    ///     UsageError: `waiting` is not one flag per request.
    ///     SpecError: an unknown `order`.
    #[pyo3(signature = (waiting, order = "arrival"))]
    fn startable(&self, waiting: Vec<bool>, order: &str) -> PyResult<Vec<u32>> {
        let order = AdmissionOrder::parse(order).map_err(py_err)?;
        self.plan.startable(&waiting, order).map_err(py_err)
    }

    /// Each slot the admitted requests use, ascending, and its generation: native-endian int64
    /// pairs `[slot, epoch, slot, epoch, ...]` as `bytes`, which compare equal exactly when
    /// two plans use the same slots at the same epochs (`memoryview(b).cast("q")` reads them).
    #[getter]
    fn slots_used<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let epochs = &self.plan.slot_epochs;
        let pairs: Vec<i64> =
            self.plan.slots_used.iter().flat_map(|&s| [i64::from(s), epochs[s as usize]]).collect();
        // SAFETY: i64 has no padding; the byte slice covers exactly `pairs`, which outlives it.
        let bytes = unsafe {
            std::slice::from_raw_parts(pairs.as_ptr().cast::<u8>(), std::mem::size_of_val(&*pairs))
        };
        PyBytes::new(py, bytes)
    }

    /// What became of the step's requests, in one call: `(admitted, deferred, reasons, failed,
    /// num_tokens)`, the first three tuples as the properties of those names give them, `failed`
    /// as its property, and `num_tokens` the admitted requests' tokens.
    #[allow(clippy::type_complexity)]
    fn outcome<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyTuple>, Bound<'py, PyTuple>, Bound<'py, PyList>, usize)>
    {
        let plan = &self.plan;
        let admitted = if plan.deferred.is_empty() && plan.failed.is_empty() {
            self.shared.range(py, plan.admitted.len())?
        } else {
            PyTuple::new(py, &plan.admitted)?
        };
        let deferred = PyTuple::new(py, &self.plan.deferred)?;
        let reasons = PyTuple::new(py, self.plan.reasons.iter().map(|r| PyString::intern(py, r.as_str())))?;
        Ok((admitted, deferred, reasons, self.failed(py)?, self.plan.num_tokens()))
    }

    /// Indices of the admitted requests, in batch order.
    #[getter]
    fn admitted<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let deferred = &self.plan.deferred;
        if deferred.len() > DELETE_AT_MOST || !self.plan.failed.is_empty() {
            return PyList::new(py, &self.plan.admitted);
        }
        let list = self.indices.bind(py).get_slice(0, self.plan.admitted.len() + deferred.len());
        // Runs of consecutive deferred requests, from the back so earlier indices stay put.
        let mut end = deferred.len();
        while end > 0 {
            let mut start = end - 1;
            while start > 0 && deferred[start - 1] + 1 == deferred[start] {
                start -= 1;
            }
            list.del_slice(deferred[start] as usize, deferred[end - 1] as usize + 1)?;
            end = start;
        }
        Ok(list)
    }

    /// Indices of the deferred requests, in batch order.
    #[getter]
    fn deferred(&self) -> Vec<u32> {
        self.plan.deferred.clone()
    }

    /// `[len(admitted)]` int32: each admitted request's slot, -1 for the base model.
    #[getter]
    fn request_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.request_slots)
    }

    /// `[T]` int32: each admitted token's slot, -1 for the base model.
    #[getter]
    fn token_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.token_slots)
    }

    /// `[N]` int32: indices of the tokens with an adapter, grouped by slot (ascending); base tokens left out.
    #[getter]
    fn token_perm<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.token_perm)
    }

    /// `[S + 1]` int32: segment s is `token_perm[seg_indptr[s]:seg_indptr[s + 1]]`.
    #[getter]
    fn seg_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.seg_indptr)
    }

    /// `[S]` int32: each segment's slot.
    #[getter]
    fn seg_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.seg_slots)
    }

    /// `[slots]` int32: the rank of each slot's adapter, 0 for an empty slot.
    #[getter]
    fn slot_ranks<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.slot_ranks)
    }

    /// `[slots]` float32: the scaling of each slot's adapter, 0 for an empty slot.
    #[getter]
    fn slot_scalings<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.slot_scalings)
    }

    /// `[slots]` int64: each slot's epoch, bumped whenever its occupant changes.
    #[getter]
    fn slot_epochs<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.slot_epochs)
    }

    /// `[slots + 1]` int32: slot `s`'s adapter's page table is `page_table[page_indptr[s]:page_indptr[s
    /// + 1]]` (empty for an empty slot). A slot is its adapter's first page, so `slots` is the
    /// device pool's pages; in slot mode slot `s` holds page `s` alone.
    #[getter]
    fn page_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.page_indptr)
    }

    /// `[P]` int32: every slot's page indices, each adapter's rank blocks in order (ranks
    /// `k * page_rank` to `(k + 1) * page_rank - 1` of slot `s`'s adapter are in page
    /// `page_table[page_indptr[s] + k]`).
    #[getter]
    fn page_table<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.plan.page_table)
    }

    /// `T`: the admitted requests' tokens.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.plan.num_tokens()
    }

    /// Loads to perform before the step runs: `(name, lora_id, slot, source)`, source "host" (copy
    /// from the host tier) or "disk" (read the adapter again, then copy). A step transaction reports
    /// each by its index in this list.
    #[getter]
    fn loads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.plan.loads.iter().map(|l| {
                let source = match l.source {
                    LoadSource::Host => intern!(py, "host"),
                    LoadSource::Disk => intern!(py, "disk"),
                };
                (self.strs.get(py, &l.name), self.strs.get(py, &l.lora_id), l.slot, source)
            }),
        )
    }

    /// Fetches this step started (`begin_step(fetch=True)`): `(name, serial)` per adapter, in
    /// first-request order; read each off the step's path and report `fetch_done(name, serial)` or
    /// `fetch_failed(name, serial)`. Their requests are in `deferred`.
    #[getter]
    fn to_fetch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        fetch_list(py, &self.strs, &self.plan.to_fetch)
    }

    /// Evictions made while planning: `(name, tier, slot)`, tier "device" or "host", slot -1 for host.
    #[getter]
    fn evictions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.plan.evictions.iter().map(|e| {
                let tier = match e.tier {
                    Tier::Host => intern!(py, "host"),
                    Tier::Device => intern!(py, "device"),
                };
                (self.strs.get(py, &e.name), tier, e.slot.map_or(-1, i64::from))
            }),
        )
    }

    fn __repr__(&self) -> String {
        if matches!(self.action, Action::Discover | Action::ReadFirst) {
            let names: Vec<&str> = self.names.iter().map(|n| &**n).collect();
            let what = if self.action == Action::Discover { "discover" } else { "read_first" };
            return format!("StepPlan(action={what}, names={names:?})");
        }
        format!(
            "StepPlan(admitted={}, deferred={}, tokens={}, segments={}, loads={}, evictions={}, to_fetch={})",
            self.plan.admitted.len(),
            self.plan.deferred.len(),
            self.plan.num_tokens(),
            self.plan.seg_slots.len(),
            self.plan.loads.len(),
            self.plan.evictions.len(),
            self.plan.to_fetch.len()
        )
    }
}

fn fetch_list<'py>(py: Python<'py>, strs: &NameStrs, fetches: &[Fetch]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, fetches.iter().map(|f| (strs.get(py, &f.name), f.serial)))
}

/// What `LoRARegistry.prefetch` started.
#[pyclass(frozen, name = "FetchPlan", module = "lora_pin")]
pub struct PyFetchPlan {
    plan: FetchPlan,
    strs: NameStrs,
}

impl PyFetchPlan {
    pub(super) fn new(plan: FetchPlan, strs: NameStrs) -> Self {
        Self { plan, strs }
    }
}

#[pymethods]
impl PyFetchPlan {
    /// `(name, serial)` per fetch started, in the order of the names given: read each and report
    /// `fetch_done(name, serial)` or `fetch_failed(name, serial)`.
    #[getter]
    fn to_fetch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        fetch_list(py, &self.strs, &self.plan.to_fetch)
    }

    /// Adapters that need a fetch but the host tier cannot make room for now (full of protected
    /// adapters), in the order of the names given.
    #[getter]
    fn skipped<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.plan.skipped.iter().map(|n| self.strs.get(py, n)))
    }

    fn __repr__(&self) -> String {
        format!("FetchPlan(to_fetch={}, skipped={})", self.plan.to_fetch.len(), self.plan.skipped.len())
    }
}
