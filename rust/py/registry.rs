//! `LoRARegistry` and `StepPlan` for Python: a frozen class around the shared registry (one lock, so
//! threads never see "Already borrowed"), the GIL released whenever the lock is taken.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyByteArray, PyDict, PyList, PyTuple};

use super::errors::new_error;
use super::spec::PyLoRARef;
use super::{detached, shielded};
use crate::cache::TierCounters;
use crate::plan::StepPlan;
use crate::registry::{AdapterSize, Config, Registry, TierStats, Unload};
use crate::shared::SharedRegistry;

/// How long an unload waits with the GIL released before it checks for Ctrl-C.
const UNLOAD_SLICE: Duration = Duration::from_millis(50);

/// Names, ids, in-flight counts and pins of LoRA adapters, the two tiers they live in (host memory
/// and device slots), and the per-step planner. Thread-safe.
///
/// Args:
///     max_loras_per_batch: device slots (adapters one step can use), at least 1.
///     max_loaded_loras: host-tier capacity in adapters (>= max_loras_per_batch); None is unbounded.
///     max_host_bytes: host-tier capacity in bytes; None is unbounded.
///     eviction_policy: the device tier's policy, "lru", "fifo" or "reuse".
///     host_eviction_policy: the host tier's policy, "lru", "fifo" or "reuse".
///     chunk_size: longest segment, in tokens, in a plan's segment arrays; None leaves them whole.
///
/// Raises:
///     SpecError: a limit is out of range or inconsistent, or a policy is unknown.
#[pyclass(frozen, name = "LoRARegistry", module = "lora_pin")]
pub struct PyLoRARegistry(SharedRegistry);

fn count(py: Python<'_>, what: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| new_error(py, "SpecError", format!("{what} must be at least 0 (got {v})")))
}

fn usage(py: Python<'_>, msg: String) -> PyErr {
    new_error(py, "UsageError", msg)
}

#[pymethods]
impl PyLoRARegistry {
    #[new]
    #[pyo3(signature = (
        max_loras_per_batch, max_loaded_loras = None, *, max_host_bytes = None, eviction_policy = "lru",
        host_eviction_policy = "lru", chunk_size = None
    ))]
    fn py_new(
        py: Python<'_>,
        max_loras_per_batch: i64,
        max_loaded_loras: Option<i64>,
        max_host_bytes: Option<i64>,
        eviction_policy: &str,
        host_eviction_policy: &str,
        chunk_size: Option<i64>,
    ) -> PyResult<Self> {
        shielded(py, || {
            let config = Config {
                slots: count(py, "max_loras_per_batch", max_loras_per_batch)? as usize,
                max_loaded: max_loaded_loras
                    .map(|v| count(py, "max_loaded_loras", v))
                    .transpose()?
                    .map(|v| v as usize),
                max_host_bytes: max_host_bytes.map(|v| count(py, "max_host_bytes", v)).transpose()?,
                device_policy: eviction_policy.to_owned(),
                host_policy: host_eviction_policy.to_owned(),
                chunk_size: chunk_size.map(|v| count(py, "chunk_size", v)).transpose()?.map(|v| v as usize),
            };
            Ok(Self(SharedRegistry::new(Registry::new(config)?)))
        })
    }

    /// Device slots.
    #[getter]
    fn max_loras_per_batch(&self, py: Python<'_>) -> PyResult<usize> {
        detached(py, || Ok(self.0.lock().config().slots))
    }

    /// Host-tier capacity in adapters, None if unbounded.
    #[getter]
    fn max_loaded_loras(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        detached(py, || Ok(self.0.lock().config().max_loaded))
    }

    /// Longest segment in tokens, None if segments are whole.
    #[getter]
    fn chunk_size(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        detached(py, || Ok(self.0.lock().config().chunk_size))
    }

    /// Registers an adapter whose weights the caller has just loaded into host memory.
    ///
    /// When the host tier is full, unprotected adapters are evicted from it first (least recently used
    /// first, by default); their names are returned so the caller frees their host tensors. A pinned
    /// ref is pinned with `pin`'s checks.
    ///
    /// Raises:
    ///     DuplicateAdapterError: the name or id is registered (the message names both refs).
    ///     AdapterInUseError: an adapter of that name is being unloaded and still has requests.
    ///     CapacityError: the host tier or the pin limit cannot take it (nothing was evicted).
    ///     SpecError: rank < 1, a negative byte count, or a non-finite scaling.
    #[pyo3(signature = (lora_ref, *, rank, host_bytes, device_bytes, scaling = 1.0))]
    fn register(
        &self,
        py: Python<'_>,
        lora_ref: &Bound<'_, PyLoRARef>,
        rank: i64,
        host_bytes: i64,
        device_bytes: i64,
        scaling: f64,
    ) -> PyResult<Vec<String>> {
        let r = lora_ref.get().0.clone();
        let Ok(rank @ 1..) = u32::try_from(rank) else {
            let msg = format!("adapter {:?}: rank must be in 1..=4294967295 (got {rank})", r.lora_name);
            return Err(new_error(py, "SpecError", msg));
        };
        let size = AdapterSize {
            rank,
            host_bytes: count(py, "host_bytes", host_bytes)?,
            device_bytes: count(py, "device_bytes", device_bytes)?,
            scaling: scaling as f32,
        };
        detached(py, || self.0.lock().register(r, size))
    }

    /// Pins an adapter: it is never evicted from either tier until unpinned.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is not registered.
    ///     CapacityError: fewer than one device slot would stay for unpinned adapters, or the pinned
    ///         adapters would overflow the host tier (the message gives the numbers).
    fn pin(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        detached(py, || self.0.lock().pin(name))
    }

    /// Unpins an adapter (a no-op if it is not pinned).
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is not registered.
    fn unpin(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        detached(py, || self.0.lock().unpin(name))
    }

    /// Counts one more request in flight per adapter name, atomically; None (the base model) passes
    /// through. Returns the adapters' ids, to hand to `release`.
    ///
    /// Raises:
    ///     AdapterNotFoundError: a name is not registered (nothing was counted).
    fn acquire(&self, py: Python<'_>, names: Vec<Option<PyBackedStr>>) -> PyResult<Vec<Option<String>>> {
        let ids = detached(py, || {
            let names: Vec<Option<&str>> = names.iter().map(|n| n.as_deref()).collect();
            self.0.lock().acquire(&names)
        })?;
        Ok(ids.into_iter().map(|id| id.map(|id| id.to_string())).collect())
    }

    /// Counts one request less in flight per id, atomically; None passes through.
    ///
    /// Raises:
    ///     AdapterNotFoundError: an id is unknown.
    ///     UsageError: an id is released more often than it is in flight (nothing was released).
    fn release(&self, py: Python<'_>, ids: Vec<Option<PyBackedStr>>) -> PyResult<()> {
        detached(py, || {
            let ids: Vec<Option<&str>> = ids.iter().map(|n| n.as_deref()).collect();
            self.0.release(&ids)
        })
    }

    /// Unloads an adapter: unregisters it (no new acquires; its pin is dropped), waits with the GIL
    /// released until its in-flight requests finish, then forgets it (the caller frees its tensors).
    /// Idempotent: unloading a forgotten adapter returns at once.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name was never registered.
    ///     UnloadTimeoutError: requests are still in flight after `timeout` seconds; the adapter
    ///         stays unregistered and a later unload finishes it.
    ///     UsageError: `timeout` is negative or NaN.
    #[pyo3(signature = (name, timeout = None))]
    fn unload(&self, py: Python<'_>, name: &str, timeout: Option<f64>) -> PyResult<()> {
        let started = Instant::now();
        let deadline = match timeout {
            None => None,
            Some(t) if t >= 0.0 => {
                Some(started + Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX / 4))
            }
            Some(t) => return Err(usage(py, format!("timeout must be >= 0 seconds or None (got {t})"))),
        };
        loop {
            let wait = deadline
                .map_or(UNLOAD_SLICE, |d| d.saturating_duration_since(Instant::now()).min(UNLOAD_SLICE));
            match detached(py, || self.0.unload_for(name, wait))? {
                Unload::Done => return Ok(()),
                Unload::Draining { in_flight } => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(crate::Error::UnloadTimeout {
                            name: name.to_owned(),
                            in_flight,
                            waited: started.elapsed(),
                        }
                        .into());
                    }
                    py.check_signals()?;
                }
            }
        }
    }

    /// Unregisters an adapter and forgets it if no request is in flight, without waiting. Returns
    /// whether it is forgotten; `lora_pin.registry.unload_async` awaits this.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name was never registered.
    fn try_unload(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        Ok(detached(py, || self.0.unload_for(name, Duration::ZERO))? == Unload::Done)
    }

    /// Plans one scheduler step and commits it.
    ///
    /// `names[i]` is request i's adapter (None for the base model) and `num_tokens[i]` its tokens this
    /// step. Requests are admitted in order while every admitted adapter can have a device slot (at
    /// most `max_loras_per_batch - pinned` distinct unpinned adapters, plus pinned ones); the others are
    /// deferred, never failed. Admitted adapters are protected from eviction until the next plan or
    /// `end_step`; planned loads until `load_done` / `load_failed`.
    ///
    /// Raises:
    ///     AdapterNotFoundError: a name is unknown (nothing was planned).
    ///     UsageError: the lists differ in length, a token count is negative or a name is not a str.
    fn plan(
        &self,
        py: Python<'_>,
        names: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<PyStepPlan> {
        let (distinct, requests) = distinct_names(py, names)?;
        let tokens = token_counts(py, num_tokens)?;
        // Borrowed, not moved: the names must be dropped with the GIL held, after the closure.
        let plan = detached(py, || {
            let mut reg = self.0.lock();
            let keys = distinct.iter().map(|n| reg.lookup(n, true)).collect::<crate::Result<Vec<_>>>()?;
            let adapters: Vec<_> =
                requests.iter().map(|&i| if i == BASE { None } else { Some(keys[i as usize]) }).collect();
            reg.plan(&adapters, &tokens)
        })?;
        Ok(PyStepPlan(plan))
    }

    /// Ends the protection of the latest plan's adapters (the next plan does this itself).
    fn end_step(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || {
            self.0.lock().end_step();
            Ok(())
        })
    }

    /// Reports a planned load finished: the adapter's loading protection ends.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    ///     UsageError: no load of it is pending.
    fn load_done(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        detached(py, || self.0.lock().load_done(name))
    }

    /// Reports a planned load failed: the adapter leaves its slot (and the host tier, if the load was
    /// to read it from disk). Nothing else changes.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    ///     UsageError: no load of it is pending.
    fn load_failed(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        detached(py, || self.0.lock().load_failed(name))
    }

    /// The ref registered under `name` (also while it is being unloaded); `pinned` is the current state.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    fn lora_ref(&self, py: Python<'_>, name: &str) -> PyResult<PyLoRARef> {
        Ok(PyLoRARef(detached(py, || self.0.lock().lora_ref(name))?))
    }

    /// Requests in flight for `name` (also while it is being unloaded).
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    fn in_flight(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        detached(py, || self.0.lock().in_flight(name))
    }

    /// Counters per tier (hits, misses, loads, evictions, refusals), what is resident and pinned in
    /// each, and the registry's counts, as plain Python values.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = detached(py, || Ok(self.0.lock().stats()))?;
        let d = PyDict::new(py);
        d.set_item("registered", s.registered)?;
        d.set_item("pinned", s.pinned)?;
        d.set_item("unloading", s.unloading)?;
        d.set_item("host", tier_dict(py, &s.host)?)?;
        d.set_item("device", tier_dict(py, &s.device)?)?;
        Ok(d)
    }

    /// Checks every internal invariant of the registry (for tests).
    ///
    /// Raises:
    ///     LoraPinError: an invariant is broken (a bug in lora_pin); the message says which.
    fn audit(&self, py: Python<'_>) -> PyResult<()> {
        let result = detached(py, || Ok(self.0.lock().audit()))?;
        result.map_err(|e| new_error(py, "LoraPinError", format!("registry invariant broken: {e}")))
    }

    fn __contains__(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        detached(py, || Ok(self.0.lock().contains(name)))
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        detached(py, || Ok(self.0.lock().len()))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (s, c) = detached(py, || {
            let reg = self.0.lock();
            Ok((reg.stats(), reg.config().clone()))
        })?;
        let cap = |c: Option<usize>| c.map_or_else(|| "unbounded".to_owned(), |c| c.to_string());
        Ok(format!(
            "LoRARegistry(registered={}, pinned={}, unloading={}, host={}/{} adapters, device={}/{} slots, \
             policies={}/{})",
            s.registered,
            s.pinned,
            s.unloading.len(),
            s.host.used,
            cap(s.host.capacity),
            s.device.used,
            c.slots,
            c.device_policy,
            c.host_policy
        ))
    }
}

/// Marks a base-model request among the indices into the distinct names.
const BASE: u32 = u32::MAX;

/// Hashes a Python object's address: addresses are unique while the objects live, and aligned, so
/// the multiply spreads them and the shift brings high bits down to the bucket bits.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let h = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// The distinct name objects and, per request, the index of its name (or [`BASE`]). Requests naming
/// the same str object (the common case) extract and look it up once.
fn distinct_names(py: Python<'_>, names: &Bound<'_, PyAny>) -> PyResult<(Vec<PyBackedStr>, Vec<u32>)> {
    let mut seen: HashMap<usize, u32, BuildHasherDefault<AddressHasher>> = HashMap::default();
    let mut distinct: Vec<PyBackedStr> = Vec::new();
    let mut requests = Vec::with_capacity(names.len().unwrap_or(0));
    let mut add = |i: usize, item: &Bound<'_, PyAny>| -> PyResult<()> {
        if item.is_none() {
            requests.push(BASE);
            return Ok(());
        }
        let index = match seen.get(&(item.as_ptr() as usize)) {
            Some(&index) => index,
            None => {
                let name: PyBackedStr = item.extract().map_err(|_| {
                    usage(
                        py,
                        format!("names[{i}] must be an adapter name (str) or None, got {}", type_name(item)),
                    )
                })?;
                distinct.push(name);
                let index = (distinct.len() - 1) as u32;
                seen.insert(item.as_ptr() as usize, index);
                index
            }
        };
        requests.push(index);
        Ok(())
    };
    if let Ok(list) = names.cast::<PyList>() {
        for (i, item) in list.iter().enumerate() {
            add(i, &item)?;
        }
    } else if let Ok(tuple) = names.cast::<PyTuple>() {
        for (i, item) in tuple.iter().enumerate() {
            add(i, &item)?;
        }
    } else {
        for (i, item) in names.try_iter()?.enumerate() {
            add(i, &item?)?;
        }
    }
    Ok((distinct, requests))
}

fn token_counts(py: Python<'_>, num_tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let count = |i: usize, item: Bound<'_, PyAny>| -> PyResult<u32> {
        let n: i64 = item
            .extract()
            .map_err(|_| usage(py, format!("num_tokens[{i}] must be an int, got {}", type_name(&item))))?;
        u32::try_from(n)
            .map_err(|_| usage(py, format!("num_tokens[{i}] must be in 0..=4294967295 (got {n})")))
    };
    if let Ok(list) = num_tokens.cast::<PyList>() {
        return list.iter().enumerate().map(|(i, item)| count(i, item)).collect();
    }
    let iter = num_tokens.try_iter().map_err(|_| {
        usage(py, format!("num_tokens must be a sequence of ints, got {}", type_name(num_tokens)))
    })?;
    iter.enumerate().map(|(i, item)| count(i, item?)).collect()
}

fn type_name(item: &Bound<'_, PyAny>) -> String {
    item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

fn tier_dict<'py>(py: Python<'py>, t: &TierStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let TierCounters { hits, misses, loads, evictions, refusals } = t.counters;
    d.set_item("hits", hits)?;
    d.set_item("misses", misses)?;
    d.set_item("loads", loads)?;
    d.set_item("evictions", evictions)?;
    d.set_item("refusals", refusals)?;
    d.set_item("resident", &t.resident)?;
    d.set_item("pinned", &t.pinned)?;
    d.set_item("used", t.used)?;
    d.set_item("capacity", t.capacity)?;
    d.set_item("bytes", t.bytes)?;
    d.set_item("max_bytes", t.max_bytes)?;
    Ok(d)
}

/// One committed step plan. Token indices count the admitted requests' tokens only (each request's
/// tokens contiguous, requests in `admitted` order). The array properties are native-endian
/// `bytearray`s: `torch.frombuffer(plan.seg_indptr, dtype=torch.int32)` (int32 unless noted; an empty
/// array is an empty `bytearray`, which `torch.frombuffer` rejects: use `torch.empty(0)` then).
#[pyclass(frozen, name = "StepPlan", module = "lora_pin")]
pub struct PyStepPlan(StepPlan);

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
    /// Indices of the admitted requests, in batch order.
    #[getter]
    fn admitted(&self) -> Vec<u32> {
        self.0.admitted.clone()
    }

    /// Indices of the deferred requests, in batch order.
    #[getter]
    fn deferred(&self) -> Vec<u32> {
        self.0.deferred.clone()
    }

    /// `[len(admitted)]` int32: each admitted request's slot, -1 for the base model.
    #[getter]
    fn request_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.request_slots)
    }

    /// `[T]` int32: each admitted token's slot, -1 for the base model.
    #[getter]
    fn token_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.token_slots)
    }

    /// `[N]` int32: indices of the tokens with an adapter, grouped by slot (ascending); base tokens left out.
    #[getter]
    fn token_perm<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.token_perm)
    }

    /// `[S + 1]` int32: segment s is `token_perm[seg_indptr[s]:seg_indptr[s + 1]]`.
    #[getter]
    fn seg_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.seg_indptr)
    }

    /// `[S]` int32: each segment's slot.
    #[getter]
    fn seg_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.seg_slots)
    }

    /// `[slots]` int32: the rank of each slot's adapter, 0 for an empty slot.
    #[getter]
    fn slot_ranks<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.slot_ranks)
    }

    /// `[slots]` float32: the scaling of each slot's adapter, 0 for an empty slot.
    #[getter]
    fn slot_scalings<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.slot_scalings)
    }

    /// `[slots]` int64: each slot's generation, bumped whenever its occupant changes.
    #[getter]
    fn slot_generations<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        byte_array(py, &self.0.slot_generations)
    }

    /// `T`: the admitted requests' tokens.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.0.num_tokens()
    }

    /// Loads to perform before the step runs: `(name, lora_id, slot, source)`, source "host" (copy
    /// from the host tier) or "disk" (read the adapter again, then copy).
    #[getter]
    fn loads(&self) -> Vec<(String, String, u32, &'static str)> {
        self.0.loads.iter().map(|l| (l.name.clone(), l.lora_id.clone(), l.slot, l.source.as_str())).collect()
    }

    /// Evictions made while planning: `(name, tier, slot)`, tier "device" or "host", slot -1 for host.
    #[getter]
    fn evictions(&self) -> Vec<(String, &'static str, i64)> {
        self.0
            .evictions
            .iter()
            .map(|e| (e.name.clone(), e.tier.as_str(), e.slot.map_or(-1, i64::from)))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(admitted={}, deferred={}, tokens={}, segments={}, loads={}, evictions={})",
            self.0.admitted.len(),
            self.0.deferred.len(),
            self.0.num_tokens(),
            self.0.seg_slots.len(),
            self.0.loads.len(),
            self.0.evictions.len()
        )
    }
}
