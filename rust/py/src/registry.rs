//! `LoRARegistry` and `StepPlan` for Python: a frozen class around the shared registry (one lock, so
//! threads never see "Already borrowed"), the GIL released whenever the lock is taken.

mod names;
mod requests;
mod step;

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyDict;

pub use self::names::checked_names;
use self::requests::{token_counts, NameCache, Requests, Resolved, Unregistered};
use self::step::{NameStrs, RequestIndices};
pub use self::step::{PyFetchPlan, PyStepPlan};

use super::errors::{new_error, py_err};
use super::spec::PyLoRARef;
use super::text::{int_arg, Name};
use super::{detached, shielded};
use lora_pin_core::policy::{AdapterKey, PolicyKind};
use lora_pin_core::registry::tiers::TierCounters;
use lora_pin_core::registry::{
    AdapterSize, AdmissionOrder, Config, Offer, Paging, Registry, StepMode, StepRequest, StepRequests,
    StepTicket, TierStats, Unload, Wants,
};
use lora_pin_core::shared::SharedRegistry;

/// How long an unload waits with the GIL released before it checks for Ctrl-C.
const UNLOAD_SLICE: Duration = Duration::from_millis(50);

/// Names, ids, in-flight counts and pins of LoRA adapters, the two tiers they live in (host memory
/// and device slots, or device pages), and the per-step planner. Thread-safe.
///
/// Two device layouts: slot mode (`max_loras_per_batch` max-rank slots), or paged mode
/// (`page_rank` and `max_lora_memory` given): the device pool is `max_lora_memory` pages of
/// `page_rank` ranks of every targeted module, an adapter of rank `r` takes `ceil(r / page_rank)`
/// pages (not contiguous: each has a page table, see `StepPlan.page_table`), and a step admits
/// adapters while their pages fit beside those of the pinned adapters.
///
/// Args:
///     max_loras_per_batch: device slots (adapters one step can use), at least 1; in paged mode the
///         most distinct adapters one step holds, None for no bound but the pages.
///     page_rank: ranks per device page (paged mode, with `max_lora_memory`), at least 1.
///     max_lora_memory: device pages (paged mode, with `page_rank`), 1 to 65536.
///     max_loaded_loras: host-tier capacity in adapters (>= max_loras_per_batch); None is unbounded.
///     max_host_bytes: host-tier capacity in bytes; None is unbounded.
///     eviction_policy: the device tier's policy, "lru", "fifo", "reuse", "hybrid" or "size"
///         (hybrid weighing bytes, for paged mode).
///     host_eviction_policy: the host tier's policy, "lru", "fifo", "reuse", "hybrid" or "size".
///     chunk_size: longest segment, in tokens, in a plan's segment arrays; None leaves them whole.
///
/// Raises:
///     SpecError: a limit is out of range or inconsistent, a policy is unknown, only one of
///         `page_rank` and `max_lora_memory` is given, or `max_loras_per_batch` is None without them.
#[pyclass(frozen, name = "LoRARegistry", module = "lora_pin")]
pub struct PyLoRARegistry {
    shared: SharedRegistry,
    names: Mutex<NameCache>,
    indices: Arc<RequestIndices>,
    strs: NameStrs,
}

fn count(py: Python<'_>, what: &str, v: i64, min: u64) -> PyResult<u64> {
    u64::try_from(v)
        .ok()
        .filter(|&c| c >= min)
        .ok_or_else(|| new_error(py, "SpecError", format!("{what} must be at least {min} (got {v})")))
}

/// A limit argument of any int size: past `i64` is a `SpecError` naming it, not an `OverflowError`.
fn limit(py: Python<'_>, what: &str, v: &Bound<'_, PyAny>, min: u64) -> PyResult<u64> {
    count(py, what, int_arg(v, what, min as i64)?, min)
}

fn usage(py: Python<'_>, msg: String) -> PyErr {
    new_error(py, "UsageError", msg)
}

impl PyLoRARegistry {
    /// Reads a step's names (and token counts, when given), resolves them to keys under the lock and
    /// runs `f` there, with the GIL released; returns `f`'s result and the number of requests.
    /// Names not registered are held or unknown as `unregistered` says (an error without it); `f`
    /// gets the unknown ones.
    fn with_requests<R: Send>(
        &self,
        py: Python<'_>,
        names: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        unregistered: Option<&Unregistered>,
        f: impl Fn(&mut Registry, StepRequests<'_>, Vec<Arc<str>>) -> lora_pin_core::Result<R> + Send + Sync,
    ) -> PyResult<(R, usize)> {
        let mut use_cache = true;
        loop {
            // `try_lock`: only a re-entrant call (Python code run by an error message) can find it
            // locked, and that one simply reads without the cache.
            let mut requests = {
                let cache = if use_cache { self.names.try_lock() } else { None };
                Requests::read(py, names, cache.as_deref())?
            };
            let tokens = match num_tokens {
                Some(t) => token_counts(py, t, requests.len())?,
                None => Vec::new(),
            };
            // Borrowed, not moved: the names must be dropped with the GIL held, after the closure.
            let done = detached(py, || {
                let mut reg = self.shared.lock();
                match requests.resolve(&reg, unregistered)? {
                    Resolved::Stale => Ok(None),
                    Resolved::Keys { epoch, keys, holds, unknown } => {
                        let unknown = unknown.iter().map(|&m| Arc::from(&*requests.misses[m])).collect();
                        let step = StepRequests {
                            adapters: requests.adapters(),
                            num_tokens: &tokens,
                            holds: &holds,
                        };
                        Ok(Some((f(&mut reg, step, unknown)?, epoch, keys)))
                    }
                }
            })?;
            // A name changed its key since the cache was filled (a register or a forget): read the
            // names again, all by text.
            let Some((result, epoch, keys)) = done else {
                use_cache = false;
                continue;
            };
            if !requests.misses.is_empty() {
                let released =
                    self.names.try_lock().map(|mut c| c.insert(py, epoch, &requests.misses, &keys));
                drop(released);
            }
            return Ok((result, requests.len()));
        }
    }

    /// Empties the name cache after a register or a forget, freeing the cached strs early (plans
    /// stay right without this: they check the registry's names epoch).
    fn clear_names(&self) {
        let cached = self.names.try_lock().map(|mut cache| cache.take());
        drop(cached);
    }
}

#[pymethods]
impl PyLoRARegistry {
    #[new]
    #[pyo3(signature = (
        max_loras_per_batch, max_loaded_loras = None, *, max_host_bytes = None, eviction_policy = "lru",
        host_eviction_policy = "lru", chunk_size = None, page_rank = None, max_lora_memory = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        py: Python<'_>,
        max_loras_per_batch: Option<&Bound<'_, PyAny>>,
        max_loaded_loras: Option<&Bound<'_, PyAny>>,
        max_host_bytes: Option<&Bound<'_, PyAny>>,
        eviction_policy: &str,
        host_eviction_policy: &str,
        chunk_size: Option<&Bound<'_, PyAny>>,
        page_rank: Option<&Bound<'_, PyAny>>,
        max_lora_memory: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        shielded(py, || {
            let page_rank = page_rank.map(|v| limit(py, "page_rank", v, 1)).transpose()?;
            let pages = max_lora_memory.map(|v| limit(py, "max_lora_memory", v, 1)).transpose()?;
            let paging = match (page_rank, pages) {
                (None, None) => None,
                (Some(page_rank), Some(pages)) => Some(Paging {
                    page_rank: u32::try_from(page_rank).unwrap_or(u32::MAX),
                    pages: usize::try_from(pages).unwrap_or(usize::MAX),
                }),
                _ => {
                    let msg = format!(
                        "page_rank and max_lora_memory go together (got page_rank={page_rank:?}, \
                         max_lora_memory={pages:?})"
                    );
                    return Err(new_error(py, "SpecError", msg));
                }
            };
            let slots = match (max_loras_per_batch, paging) {
                (Some(v), _) => limit(py, "max_loras_per_batch", v, 1)? as usize,
                // Paged, unbounded by count: every adapter takes a page at least.
                (None, Some(p)) => p.pages,
                (None, None) => {
                    let msg = "max_loras_per_batch is required without page_rank and max_lora_memory";
                    return Err(new_error(py, "SpecError", msg.to_owned()));
                }
            };
            let config = Config {
                slots,
                paging,
                max_loaded: max_loaded_loras
                    .map(|v| limit(py, "max_loaded_loras", v, 1))
                    .transpose()?
                    .map(|v| v as usize),
                max_host_bytes: max_host_bytes.map(|v| limit(py, "max_host_bytes", v, 1)).transpose()?,
                device_policy: PolicyKind::parse("eviction_policy", eviction_policy).map_err(py_err)?,
                host_policy: PolicyKind::parse("host_eviction_policy", host_eviction_policy)
                    .map_err(py_err)?,
                chunk_size: chunk_size
                    .map(|v| limit(py, "chunk_size", v, 1))
                    .transpose()?
                    .map(|v| v as usize),
            };
            Ok(Self {
                shared: SharedRegistry::new(Registry::new(config).map_err(py_err)?),
                names: Mutex::default(),
                indices: Arc::new(RequestIndices::new()),
                strs: NameStrs::default(),
            })
        })
    }

    /// Device slots: in paged mode, the most distinct adapters one step holds.
    #[getter]
    fn max_loras_per_batch(&self, py: Python<'_>) -> PyResult<usize> {
        detached(py, || Ok(self.shared.lock().config().slots))
    }

    /// Ranks per device page, None in slot mode.
    #[getter]
    fn page_rank(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        detached(py, || Ok(self.shared.lock().config().paging.map(|p| p.page_rank)))
    }

    /// Device pages (the plan's slot arrays have one entry per page), None in slot mode.
    #[getter]
    fn max_lora_memory(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        detached(py, || Ok(self.shared.lock().config().paging.map(|p| p.pages)))
    }

    /// Host-tier capacity in adapters, None if unbounded.
    #[getter]
    fn max_loaded_loras(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        detached(py, || Ok(self.shared.lock().config().max_loaded))
    }

    /// Longest segment in tokens, None if segments are whole.
    #[getter]
    fn chunk_size(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        detached(py, || Ok(self.shared.lock().config().chunk_size))
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
            host_bytes: count(py, "host_bytes", host_bytes, 0)?,
            device_bytes: count(py, "device_bytes", device_bytes, 0)?,
            scaling: scaling as f32,
        };
        let evicted = detached(py, || self.shared.lock().register(r, size));
        self.clear_names();
        evicted
    }

    /// Pins an adapter: it is never evicted from either tier until unpinned.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is not registered.
    ///     CapacityError: fewer than one device slot would stay for unpinned adapters, or the pinned
    ///         adapters would overflow the host tier (the message gives the numbers).
    fn pin(&self, py: Python<'_>, name: Name) -> PyResult<()> {
        detached(py, || self.shared.lock().pin(&name))
    }

    /// Unpins an adapter (a no-op if it is not pinned).
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is not registered.
    fn unpin(&self, py: Python<'_>, name: Name) -> PyResult<()> {
        detached(py, || self.shared.lock().unpin(&name))
    }

    /// Unloads an adapter: unregisters it (no new acquires; its pin is dropped), waits with the GIL
    /// released until its in-flight requests finish, then forgets it (the caller frees its tensors).
    /// Idempotent: unloading a forgotten adapter returns at once (for the latest 65536 names unloaded).
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name was never registered.
    ///     UnloadTimeoutError: requests are still in flight after `timeout` seconds; the adapter
    ///         stays unregistered and a later unload finishes it.
    ///     UsageError: `timeout` is negative or NaN.
    #[pyo3(signature = (name, timeout = None))]
    fn unload(&self, py: Python<'_>, name: Name, timeout: Option<f64>) -> PyResult<()> {
        let started = Instant::now();
        let deadline = match timeout {
            None => None,
            // A timeout too long to represent as an instant waits forever.
            Some(t) if t >= 0.0 => Duration::try_from_secs_f64(t).ok().and_then(|d| started.checked_add(d)),
            Some(t) => return Err(usage(py, format!("timeout must be >= 0 seconds or None (got {t})"))),
        };
        // The first slice unregisters the adapter by name; later ones go on with that registration
        // (its serial), never with an adapter registered meanwhile under the same name.
        let mut serial = None;
        loop {
            let wait = deadline
                .map_or(UNLOAD_SLICE, |d| d.saturating_duration_since(Instant::now()).min(UNLOAD_SLICE));
            let state = match serial {
                None => detached(py, || self.shared.unload_for(&name, wait))?,
                Some(s) => {
                    detached(py, || Ok::<_, lora_pin_core::Error>(self.shared.continue_unload_for(s, wait)))?
                }
            };
            match state {
                Unload::Done => {
                    self.clear_names();
                    return Ok(());
                }
                Unload::Draining { in_flight, serial: s } => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(py_err(lora_pin_core::Error::UnloadTimeout {
                            name: name.to_owned(),
                            in_flight,
                            waited: started.elapsed(),
                        }));
                    }
                    serial = Some(s);
                    py.check_signals()?;
                }
            }
        }
    }

    /// Unregisters an adapter and forgets it if no request is in flight, without waiting. Returns
    /// whether it is forgotten. To poll until it is, use `begin_unload` and `finish_unload`: a
    /// second `try_unload` of the name would unregister an adapter registered under it meanwhile.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name was never registered.
    fn try_unload(&self, py: Python<'_>, name: Name) -> PyResult<bool> {
        let done = detached(py, || self.shared.unload_for(&name, Duration::ZERO))? == Unload::Done;
        if done {
            self.clear_names();
        }
        Ok(done)
    }

    /// Unregisters an adapter (no new acquires; its pin is dropped) and forgets it if no request is
    /// in flight. Returns None once it is forgotten, else a handle for `finish_unload`, which goes on
    /// with this registration only. `lora_pin.registry.unload_async` polls with these.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name was never registered.
    fn begin_unload(&self, py: Python<'_>, name: Name) -> PyResult<Option<u64>> {
        match detached(py, || self.shared.unload_for(&name, Duration::ZERO))? {
            Unload::Done => {
                self.clear_names();
                Ok(None)
            }
            Unload::Draining { serial, .. } => Ok(Some(serial)),
        }
    }

    /// Forgets the adapter `begin_unload` returned `handle` for, if its requests have finished.
    /// Returns how many are still in flight: 0 means it is forgotten (now, or before).
    fn finish_unload(&self, py: Python<'_>, handle: u64) -> PyResult<u64> {
        match detached(py, || {
            Ok::<_, lora_pin_core::Error>(self.shared.continue_unload_for(handle, Duration::ZERO))
        })? {
            Unload::Done => {
                self.clear_names();
                Ok(0)
            }
            Unload::Draining { in_flight, .. } => Ok(in_flight),
        }
    }

    /// Begins a step transaction, or says what must happen before one can begin. The answer's
    /// `action` is the caller's next move:
    ///
    /// - "begun": the step is planned and, atomically with it, every admitted request acquired, so
    ///   no unload or re-registration can come between the two. Report each planned load with
    ///   `report_load(plan.ticket, index, ok)` and end the step with `finish_step(plan.ticket)`,
    ///   which releases everything it holds (and fails any load not reported).
    /// - "discover" (only with `discover`): names nobody knows, in `unknown`; nothing was planned.
    ///   Discover them and begin again.
    /// - "read_first" (mode "read_first"): the step would read adapters from disk (evicted from
    ///   the host tier), listed in `to_read`; nothing was planned. Read each, `enter_host_tier`
    ///   it, and begin again, so a read that fails changes nothing.
    /// - "fetching" (mode "fetch" and `whole`): the batch's adapters are not all in the host tier.
    ///   The plan defers every request and lists the fetches it started in `to_fetch` (the batch's
    ///   resident adapters are not evicted for them); wait for the batch's fetches and begin again.
    ///   `progress` says whether waiting can change the answer.
    ///
    /// `mode` says how adapters outside the host tier are brought in: "read_in_step" (the step
    /// reads them itself: loads with source "disk"), "read_first" (as above), or "fetch"
    /// (background mode: no disk read is ever planned; a request whose adapter is not in the host
    /// tier is deferred, taking none of the slot budget, and the adapter starts *fetching*: its
    /// host room is made now (the host evictions are in `evictions`; free those tensors), it is
    /// listed once in `to_fetch` as `(name, serial)`, and the caller reads it off the step's path
    /// and reports `fetch_done(name, serial)` or `fetch_failed(name, serial)`. One fetching already
    /// is not listed again; one the host tier cannot make room for now is not fetched, and its
    /// requests are deferred (retried by the next step)).
    ///
    /// With `whole`, a step that cannot admit every request raises CapacityError and changes
    /// nothing (a per-sequence batch must run whole).
    ///
    /// The core sees the whole step: `failed` names adapters whose last read failed (their
    /// requests fail), `discovering` names not registered yet that are being read (their requests
    /// wait), and a name unloaded while its requests waited fails them (so does one being
    /// unloaded); the plan lists those in `failed` as `(index, why)` and runs the rest. Each
    /// deferred request's reason is in `reasons`.
    ///
    /// Raises:
    ///     AdapterNotFoundError: a name is unknown and `discover` is not set (nothing was planned);
    ///         with `whole`, also one being unloaded or in `failed` (a batch runs whole).
    ///     CapacityError: `whole` and not every request fits (the message has the numbers).
    ///     UsageError: the lengths differ, a token count is negative or not an int, a name is not
    ///         a str, `mode` is not a mode, or a step is open already.
    #[pyo3(signature = (
        names, num_tokens, mode = "read_in_step", *, whole = false, failed = Vec::new(),
        discovering = Vec::new(), discover = false
    ))]
    #[allow(clippy::too_many_arguments)] // the step's requests, its mode and what the caller holds
    fn begin_step(
        &self,
        py: Python<'_>,
        names: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        mode: &str,
        whole: bool,
        failed: Vec<PyBackedStr>,
        discovering: Vec<PyBackedStr>,
        discover: bool,
    ) -> PyResult<PyStepPlan> {
        let mode = match mode {
            "read_in_step" => StepMode::ReadInStep,
            "read_first" => StepMode::ReadFirst,
            "fetch" => StepMode::Fetch,
            other => {
                let msg = format!(
                    "begin_step: mode must be \"read_in_step\", \"read_first\" or \"fetch\" (got {other:?})"
                );
                return Err(usage(py, msg));
            }
        };
        let unregistered = Unregistered { failed, discovering, defer: discover, whole };
        let (start, n) = self.with_requests(
            py,
            names,
            Some(num_tokens),
            Some(&unregistered),
            |reg, requests, unknown| {
                let failed: Vec<AdapterKey> =
                    unregistered.failed.iter().filter_map(|n| reg.lookup(n, true).ok()).collect();
                reg.begin_step(StepRequest { requests, failed: &failed, unknown, mode, whole })
            },
        )?;
        let indices = self.indices.at_least(py, n)?;
        Ok(PyStepPlan::new(start, Arc::clone(&self.indices), indices, self.strs.clone()))
    }

    /// Enters `name`, whose weights the caller has just read again for registration `serial` (see
    /// `serial`), into the host tier, evicting unprotected adapters to make room; returns their
    /// names (free their host tensors).
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is not registered, being unloaded, or registered again
    ///         since (another serial).
    ///     CapacityError: the host tier cannot make room (nothing was evicted).
    fn enter_host_tier(&self, py: Python<'_>, name: Name, serial: u64) -> PyResult<Vec<String>> {
        detached(py, || self.shared.lock().enter_host_tier(&name, serial))
    }

    /// Starts background reads ahead of any step: fetches every adapter named in `names` (a
    /// scheduler's waiting queue, in order; None entries and repeats are fine) that is neither in
    /// the host tier nor being fetched. Each fetch reserves its host bytes and evicts nobody (room is
    /// made by `fetch_done`, once its read succeeded); one that could not fit beside the protected
    /// adapters, the other reservations and the resident ones named earlier in `names` is skipped.
    /// May be called while a step is open (its adapters are protected).
    ///
    /// Returns a `FetchPlan`: `to_fetch` (`(name, serial)` to read and report with `fetch_done` /
    /// `fetch_failed`) and `skipped`.
    ///
    /// Raises:
    ///     AdapterNotFoundError: a name is not registered or being unloaded (nothing was started).
    ///     UsageError: a name is not a str.
    fn prefetch(&self, py: Python<'_>, names: Vec<Option<PyBackedStr>>) -> PyResult<PyFetchPlan> {
        let plan = detached(py, || {
            let names: Vec<Option<&str>> = names.iter().map(|n| n.as_deref()).collect();
            self.shared.lock().prefetch(&names)
        })?;
        Ok(PyFetchPlan::new(plan, self.strs.clone()))
    }

    /// Reports the fetch of `name` for registration `serial` (from `to_fetch`) done, its read
    /// having succeeded: the adapter enters the host tier, unprotected adapters leaving it to make
    /// room; returns their names (free their host tensors). Put its host tensors in place before
    /// the next step admits it.
    ///
    /// Raises:
    ///     AdapterNotFoundError: `name` is not registered under `serial` any more (unloaded or
    ///         registered again): drop the bytes read.
    ///     UsageError: it is not being fetched (cancelled by an unload, taken over by a blocking
    ///         read, or reported already): drop the bytes read.
    ///     CapacityError: the adapters protected now (pinned, in a step, fresh) leave it no room;
    ///         the fetch goes on: keep the bytes and report it again after a step. Nothing changed.
    fn fetch_done(&self, py: Python<'_>, name: Name, serial: u64) -> PyResult<Vec<String>> {
        let evicted = detached(py, || self.shared.lock().fetch_done(&name, serial))?;
        Ok(evicted.iter().map(|n| n.to_string()).collect())
    }

    /// Reports the fetch of `name` for registration `serial` failed: its host reservation is
    /// released and it stays outside the host tier; a later request fetches it again.
    ///
    /// Raises:
    ///     AdapterNotFoundError: as `fetch_done`.
    ///     UsageError: as `fetch_done`.
    fn fetch_failed(&self, py: Python<'_>, name: Name, serial: u64) -> PyResult<()> {
        detached(py, || self.shared.lock().fetch_failed(&name, serial))
    }

    /// Reports load `index` (into the step's `loads`) of the open step `ticket`: done (`ok`) or
    /// failed (the adapter leaves its slot, and the host tier if it was to be read from disk).
    ///
    /// Raises:
    ///     UsageError: `ticket` is not the open step, or that load is not pending.
    fn report_load(&self, py: Python<'_>, ticket: u64, index: usize, ok: bool) -> PyResult<()> {
        // O(1): done with the GIL held when the lock is free, which saves releasing and taking back
        // the GIL per load; waiting for the lock releases it.
        if let Some(mut reg) = self.shared.try_lock() {
            return shielded(py, || reg.report_load(StepTicket(ticket), index, ok).map_err(py_err));
        }
        detached(py, || self.shared.lock().report_load(StepTicket(ticket), index, ok))
    }

    /// Ends step `ticket`: fails every load it did not report, releases its requests and ends its
    /// adapters' step protection; wakes unloads waiting for them.
    ///
    /// Raises:
    ///     UsageError: `ticket` is not the open step (finished already); nothing changes.
    fn finish_step(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        // O(slots): done with the GIL held when the lock is free, which saves releasing and taking
        // back the GIL every step; waiting for the lock releases it.
        let ticket = StepTicket(ticket);
        if let Some(done) = shielded(py, || Ok(self.shared.try_finish_step(ticket)))? {
            return done.map_err(py_err);
        }
        detached(py, || self.shared.finish_step(ticket))
    }

    /// The order to offer a scheduler's requests to a step in, as indices, by `order`.
    /// `"arrival"`: running requests first, as given; then the waiting ones, ranked: overdue
    /// (overtaken in `OVERDUE_AFTER` rounds or more), then those of pinned adapters, then those that
    /// cost no load (the base model's, an adapter's in a device slot), then the rest, each rank in
    /// the given (arrival) order. `"longest_remaining"`: overdue waiting requests, then those that
    /// take no device room (the base model's, pinned adapters'), then the rest by `remaining`, most
    /// first, running before waiting on a tie, then in the given order.
    /// `names[i]` is request i's adapter (None: the base model; a name not registered ranks with
    /// the rest), `overtaken[i]` None for a running request, else the rounds in which younger
    /// requests started ahead of it, and `remaining[i]` the tokens it has left to generate (None:
    /// no limit; needed for `"longest_remaining"` only). Changes nothing.
    ///
    /// Raises:
    ///     UsageError: the lengths differ, or `"longest_remaining"` without `remaining`.
    ///     SpecError: an unknown `order`.
    #[pyo3(signature = (names, overtaken, remaining = None, order = "arrival"))]
    fn offer_order(
        &self,
        py: Python<'_>,
        names: Vec<Option<PyBackedStr>>,
        overtaken: Vec<Option<u32>>,
        remaining: Option<Vec<Option<u64>>>,
        order: &str,
    ) -> PyResult<Vec<u32>> {
        let order = AdmissionOrder::parse(order).map_err(py_err)?;
        if names.len() != overtaken.len() {
            let msg = format!("offer_order: {} names but {} overtaken counts", names.len(), overtaken.len());
            return Err(usage(py, msg));
        }
        let remaining: Vec<u32> = match remaining {
            Some(r) if r.len() != names.len() => {
                let msg = format!("offer_order: {} names but {} remaining counts", names.len(), r.len());
                return Err(usage(py, msg));
            }
            Some(r) => {
                r.into_iter().map(|t| t.map_or(u32::MAX, |t| u32::try_from(t).unwrap_or(u32::MAX))).collect()
            }
            None if order == AdmissionOrder::LongestRemaining => {
                let msg = "offer_order: order \"longest_remaining\" needs each request's remaining tokens";
                return Err(usage(py, msg.to_owned()));
            }
            None => vec![0; names.len()],
        };
        detached(py, || {
            let reg = self.shared.lock();
            let offers: Vec<Offer> = names
                .iter()
                .zip(&overtaken)
                .zip(&remaining)
                .map(|((name, &overtaken), &remaining)| {
                    let wants = match name {
                        None => Wants::Base,
                        Some(n) => reg.lookup(n, false).map_or(Wants::Unregistered, Wants::Adapter),
                    };
                    Offer { wants, overtaken, remaining }
                })
                .collect();
            Ok(reg.offer_order(&offers, order))
        })
    }

    /// Cuts a batch of adapter names (None: the base model) into groups of request indices, in
    /// order, each of which fits the device slots at once (at most `max_loras_per_batch - pinned`
    /// distinct unpinned adapters a group): the same rule `begin_step` admits by.
    ///
    /// Raises:
    ///     AdapterNotFoundError: a name is unknown.
    ///     UsageError: a name is not a str.
    fn split(&self, py: Python<'_>, names: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        Ok(self.with_requests(py, names, None, None, |reg, step, _| Ok(reg.split(step.adapters)))?.0)
    }

    /// Why the batch `names` cannot run as one step, with the numbers, or None when it fits.
    ///
    /// Raises:
    ///     AdapterNotFoundError: a name is unknown.
    ///     UsageError: a name is not a str.
    fn overflow(&self, py: Python<'_>, names: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
        Ok(self.with_requests(py, names, None, None, |reg, step, _| Ok(reg.overflow(step.adapters)))?.0)
    }

    /// Empties `slots` in the registry's view: each occupant leaves its slot and is loaded again on
    /// its next use. For a caller that found a slot not holding what the registry says.
    ///
    /// Raises:
    ///     UsageError: a step transaction is open.
    fn invalidate_slots(&self, py: Python<'_>, slots: Vec<u32>) -> PyResult<()> {
        detached(py, || self.shared.lock().invalidate_slots(&slots))
    }

    /// Replaces the weights of `name`, registered as `serial`, by new ones the caller holds in host
    /// memory: name, id, serial, pin, requests and slot stay; rank, bytes and scaling become these.
    /// The adapter ends in the host tier (a fetch of it is over: its report will be refused); a slot
    /// it holds keeps the old contents until the caller refreshes them. Returns the adapters evicted
    /// from the host tier to make room (free their host tensors).
    ///
    /// Raises:
    ///     AdapterNotFoundError: `name` is not registered, is being unloaded, or was registered again
    ///         since (another serial).
    ///     CapacityError: the host tier cannot make room, the pinned adapters would overflow it, or
    ///         a registered adapter would no longer fit in it beside the pinned ones (as for `pin`).
    ///     SpecError: rank < 1, a negative byte count, or a non-finite scaling.
    ///     Nothing changes on an error.
    #[pyo3(signature = (name, serial, *, rank, host_bytes, device_bytes, scaling = 1.0))]
    #[allow(clippy::too_many_arguments)] // register's keyword arguments, plus the name and serial
    fn replace(
        &self,
        py: Python<'_>,
        name: Name,
        serial: u64,
        rank: i64,
        host_bytes: i64,
        device_bytes: i64,
        scaling: f64,
    ) -> PyResult<Vec<String>> {
        let Ok(rank @ 1..) = u32::try_from(rank) else {
            let msg = format!("adapter {:?}: rank must be in 1..=4294967295 (got {rank})", &*name);
            return Err(new_error(py, "SpecError", msg));
        };
        let size = AdapterSize {
            rank,
            host_bytes: count(py, "host_bytes", host_bytes, 0)?,
            device_bytes: count(py, "device_bytes", device_bytes, 0)?,
            scaling: scaling as f32,
        };
        detached(py, || self.shared.lock().replace(&name, serial, size))
    }

    /// Where every adapter is, at one instant: a dict with `adapters`, a list sorted by name of
    /// `(name, id, serial, tier, slot, pinned, in_flight, draining, host_bytes)` (`tier` is
    /// "device", "host", "fetching" or "disk"; `slot` None outside the device tier), and the tiers'
    /// room: `slots`, `free_slots` (pages and free pages, in paged mode), `host_bytes`, `reserved_bytes`,
    /// `max_host_bytes`.
    fn placement<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = detached(py, || Ok(self.shared.lock().placement()))?;
        let adapters = p
            .adapters
            .iter()
            .map(|a| {
                let tier = match (a.slot, a.host, a.fetching) {
                    (Some(_), _, _) => "device",
                    (None, true, _) => "host",
                    (None, false, true) => "fetching",
                    (None, false, false) => "disk",
                };
                (&*a.name, &*a.id, a.serial, tier, a.slot, a.pinned, a.in_flight, a.draining, a.host_bytes)
            })
            .collect::<Vec<_>>();
        let d = PyDict::new(py);
        d.set_item("adapters", adapters)?;
        d.set_item("slots", p.slots)?;
        d.set_item("free_slots", p.free_slots)?;
        d.set_item("host_bytes", p.host_bytes)?;
        d.set_item("reserved_bytes", p.reserved_bytes)?;
        d.set_item("max_host_bytes", p.max_host_bytes)?;
        Ok(d)
    }

    /// The registration serial of `name` (also while it is being unloaded): unique for the
    /// registry's life, so it tells a re-registered name from an earlier registration.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    fn serial(&self, py: Python<'_>, name: Name) -> PyResult<u64> {
        detached(py, || self.shared.lock().serial(&name))
    }

    /// The ref registered under `name` (also while it is being unloaded); `pinned` is the current state.
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    fn lora_ref(&self, py: Python<'_>, name: Name) -> PyResult<PyLoRARef> {
        Ok(PyLoRARef(detached(py, || self.shared.lock().lora_ref(&name))?))
    }

    /// Requests in flight for `name` (also while it is being unloaded).
    ///
    /// Raises:
    ///     AdapterNotFoundError: the name is unknown.
    fn in_flight(&self, py: Python<'_>, name: Name) -> PyResult<u64> {
        detached(py, || self.shared.lock().in_flight(&name))
    }

    /// Counters per tier (hits, misses, loads, evictions, refusals), what is resident and pinned in
    /// each, and the registry's counts, as plain Python values. The host tier's `fetching` lists
    /// the adapters being fetched and `reserved_bytes` their reserved room (`bytes +
    /// reserved_bytes` is the room used); the top-level `fetching` counts them.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = detached(py, || Ok(self.shared.lock().stats()))?;
        let d = PyDict::new(py);
        d.set_item("registered", s.registered)?;
        d.set_item("pinned", s.pinned)?;
        d.set_item("pinned_names", s.pinned_names)?;
        d.set_item("unloading", s.unloading)?;
        d.set_item("fetching", s.host.fetching.len())?;
        d.set_item("host", tier_dict(py, &s.host)?)?;
        d.set_item("device", tier_dict(py, &s.device)?)?;
        Ok(d)
    }

    /// Checks every internal invariant of the registry (for tests).
    ///
    /// Raises:
    ///     LoraPinError: an invariant is broken (a bug in lora_pin); the message says which.
    fn audit(&self, py: Python<'_>) -> PyResult<()> {
        let result = detached(py, || Ok(self.shared.lock().audit()))?;
        result.map_err(|e| new_error(py, "LoraPinError", format!("registry invariant broken: {e}")))
    }

    fn __contains__(&self, py: Python<'_>, name: Name) -> PyResult<bool> {
        detached(py, || Ok(self.shared.lock().contains(&name)))
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        detached(py, || Ok(self.shared.lock().len()))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (s, c) = detached(py, || {
            let reg = self.shared.lock();
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
    d.set_item("fetching", &t.fetching)?;
    d.set_item("bytes", t.bytes)?;
    d.set_item("reserved_bytes", t.reserved_bytes)?;
    d.set_item("max_bytes", t.max_bytes)?;
    d.set_item("pages", t.pages)?;
    d.set_item("max_pages", t.max_pages)?;
    Ok(d)
}
