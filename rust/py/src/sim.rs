//! `Trace` and `simulate` for Python: the capacity planner behind `lora-pin simulate`. Every number
//! comes from the core's replay (`lora_pin_core::sim`); the GIL is released while it runs.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::{new_error, py_err};
use super::{detached, shielded};
use lora_pin_core::registry::{AdmissionOrder, Paging, StepPlan};
use lora_pin_core::sim::{
    adapter_sizes, simulate_replicas as replicas_run, simulate_until, FetchReport, Router, SimConfig,
    SimReport, TierReport, Trace, Workload,
};

/// A request trace: adapter names and requests (adapter or None, tokens, optional arrival time).
/// Build one with `Trace.generate` or `Trace.from_jsonl`.
#[pyclass(frozen, name = "Trace", module = "lora_pin")]
pub struct PyTrace(Trace);

fn non_negative(py: Python<'_>, what: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| new_error(py, "SpecError", format!("{what} must be at least 0 (got {v})")))
}

#[pymethods]
impl PyTrace {
    /// `requests` requests over `adapters` adapters (`adapter-000`, ...) following `workload`:
    /// `zipf:ALPHA`, `power:ALPHA`, `uniform`, `shifting`, `bursty` or `scan`; one token each; the same arguments
    /// give the same trace.
    ///
    /// Raises:
    ///     SpecError: an unknown workload, a bad alpha, or a count out of range (the value named).
    #[staticmethod]
    #[pyo3(signature = (workload, *, adapters, requests, seed = 0))]
    fn generate(py: Python<'_>, workload: &str, adapters: i64, requests: i64, seed: u64) -> PyResult<Self> {
        let adapters = non_negative(py, "adapters", adapters)?;
        let requests = non_negative(py, "requests", requests)?;
        let workload = workload.to_owned();
        detached(py, move || {
            Ok(Self(Trace::generate(Workload::parse(&workload)?, adapters, requests, seed)?))
        })
    }

    /// Parses JSONL text: one request per line, `{"adapter": NAME or null, "tokens": N}` with an
    /// optional `"arrival": SECONDS` (non-decreasing). `source` names the text in errors.
    ///
    /// Raises:
    ///     SpecError: naming `source`, the line and the field that is wrong.
    #[staticmethod]
    #[pyo3(signature = (text, source = "<trace>"))]
    fn from_jsonl(py: Python<'_>, text: &str, source: &str) -> PyResult<Self> {
        detached(py, || Ok(Self(Trace::from_jsonl(text, source)?)))
    }

    /// Reads the JSONL trace file `path` (as `from_jsonl`) under the rules of an `@FILE` adapter list:
    /// a regular file only (a FIFO or a device is refused at once), at most 256 MiB.
    ///
    /// Raises:
    ///     SpecError: the file cannot be read, is not a regular file, is too large (each message names
    ///         the file), or a line is wrong (naming the file, the line and the field).
    #[staticmethod]
    fn from_file(py: Python<'_>, path: &str) -> PyResult<Self> {
        detached(py, || Ok(Self(Trace::from_file(path)?)))
    }

    /// This trace with Gamma gaps between arrivals (S-LoRA's arrivals): mean gap `1 / rate` seconds,
    /// coefficient of variation `cv` (shape `1 / cv**2`; 1 is Poisson). Replaces any arrival times.
    ///
    /// Raises:
    ///     SpecError: `rate` not a finite number above 0; `cv` outside `MIN_ARRIVAL_CV..=MAX_ARRIVAL_CV`
    ///         (1e-150..=1e150, where the shape is a finite number above 0); a Gamma scale
    ///         `cv**2 / rate` that is not a finite number above 0; arrival times past the largest float.
    #[pyo3(signature = (rate, *, cv = 1.0, seed = 0))]
    fn with_gamma_arrivals(&self, py: Python<'_>, rate: f64, cv: f64, seed: u64) -> PyResult<Self> {
        let trace = self.0.clone();
        detached(py, move || Ok(Self(trace.with_gamma_arrivals(rate, cv, seed)?)))
    }

    /// The adapters' names, in order of first use (generated traces: by index).
    #[getter]
    fn names(&self) -> Vec<String> {
        self.0.names().to_vec()
    }

    /// The `k` most requested adapters, most requested first (ties: the earlier name first).
    fn most_requested(&self, k: usize) -> Vec<String> {
        self.0.most_requested(k)
    }

    /// The requests as `(adapter name or None, tokens, arrival or None)` tuples.
    fn requests(&self) -> Vec<(Option<String>, u32, Option<f64>)> {
        let names = self.0.names();
        self.0
            .requests()
            .iter()
            .map(|r| (r.adapter.map(|a| names[a as usize].clone()), r.tokens, r.arrival))
            .collect()
    }

    fn __len__(&self) -> usize {
        self.0.requests().len()
    }

    fn __repr__(&self) -> String {
        format!("Trace(adapters={}, requests={})", self.0.names().len(), self.0.requests().len())
    }
}

fn tier<'py>(py: Python<'py>, t: &TierReport, uses: Option<u64>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("hits", t.hits)?;
    d.set_item("misses", t.misses)?;
    d.set_item("evictions", t.evictions)?;
    d.set_item("bytes_moved", t.bytes_moved)?;
    d.set_item("belady_misses", t.belady_misses)?;
    if let Some(uses) = uses {
        let rate = |misses: u64| if uses == 0 { 0.0 } else { (uses - misses) as f64 / uses as f64 };
        d.set_item("hit_rate", rate(t.misses))?;
        d.set_item("belady_hit_rate", t.belady_misses.map(rate))?;
    }
    Ok(d)
}

fn step_record<'py>(py: Python<'py>, batch: &[u32], plan: &StepPlan) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("batch", batch)?;
    d.set_item("admitted", &plan.admitted)?;
    d.set_item("deferred", &plan.deferred)?;
    let loads: Vec<(&str, u32, &str)> =
        plan.loads.iter().map(|l| (&*l.name, l.slot, l.source.as_str())).collect();
    d.set_item("loads", loads)?;
    let evictions: Vec<(&str, &str, Option<u32>)> =
        plan.evictions.iter().map(|e| (&*e.name, e.tier.as_str(), e.slot)).collect();
    d.set_item("evictions", evictions)?;
    let to_fetch: Vec<&str> = plan.to_fetch.iter().map(|f| &*f.name).collect();
    d.set_item("to_fetch", to_fetch)?;
    Ok(d)
}

fn fetch_dict<'py>(py: Python<'py>, f: &FetchReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("fetches", f.fetches)?;
    d.set_item("deferred_requests", f.deferred_requests)?;
    d.set_item("wait_steps_mean", f.wait_steps_mean)?;
    d.set_item("wait_steps_p99", f.wait_steps_p99)?;
    d.set_item("wait_ms_mean", f.wait_ms_mean)?;
    d.set_item("wait_ms_p99", f.wait_ms_p99)?;
    Ok(d)
}

/// How often a long replay takes the GIL back, to check for Ctrl-C and to report progress.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// The arguments `simulate` and `simulate_replicas` share, as Python gave them.
struct Shape<'a> {
    slots: i64,
    max_loaded_loras: Option<i64>,
    policy: &'a str,
    pins: Vec<String>,
    batch_size: i64,
    step_seconds: f64,
    adapter_bytes: u64,
    ranks: Vec<(u32, f64)>,
    max_host_bytes: Option<u64>,
}

impl Shape<'_> {
    /// The simulator's configuration of a blocking slot pool (no reads, no pages, no decode), counts
    /// checked non-negative (a `SpecError` naming the argument otherwise).
    fn config(self, py: Python<'_>) -> PyResult<SimConfig> {
        Ok(SimConfig {
            slots: non_negative(py, "slots", self.slots)?,
            max_loaded: self.max_loaded_loras.map(|v| non_negative(py, "max_loaded_loras", v)).transpose()?,
            policy: self.policy.to_owned(),
            pins: self.pins,
            batch_size: non_negative(py, "batch_size", self.batch_size)?,
            step_seconds: self.step_seconds,
            adapter_bytes: self.adapter_bytes,
            ranks: self.ranks,
            max_host_bytes: self.max_host_bytes,
            load_ms: 0.0,
            paging: None,
            decode: false,
            order: AdmissionOrder::Arrival,
        })
    }
}

/// Replays `trace` through the registry's planner — the calls `LoRAManager` makes per step: plan the
/// first `batch_size` waiting requests, acquire the admitted ones, load, release; deferred requests
/// run first next step — and reports both tiers beside Belady's offline-optimal bound.
///
/// A **use** is one (step, adapter) pair: the distinct adapters a step admitted. Device `hits` are
/// uses whose adapter was already in a slot, `misses` the slot loads; `hit_rate` is hits / uses.
/// `belady_misses` is the fewest misses any policy could have on the same uses with the same
/// capacity (device: the slots, pinned adapters holding theirs; host: `max_loaded_loras`, None when
/// unbounded). Host hits are slot loads copied from host memory, host misses reads from disk.
///
/// `load_ms` > 0 models background reads: steps begin in fetch mode (a request whose adapter is
/// not in the host tier is deferred and the adapter fetched), a fetch begun at step time t is done
/// at t + `load_ms` on the step clock (`step_seconds` per step, also without arrival times), and
/// when no request can run the loop waits for the next fetch (a wait is not a step). 0 (the
/// default) reads in the step that needs the adapter, as blocking mode does.
///
/// Sizes: `ranks` (a list of `(rank, weight)`) gives each adapter a rank drawn by the weights from a
/// hash of its name, and `adapter_bytes * rank / largest rank` bytes (`adapter_bytes` is then the
/// largest rank's size, what a slot holds); empty: every adapter `adapter_bytes`. `max_host_bytes`
/// bounds the host tier in bytes as well (Belady's host bound is then not computed).
///
/// Returns a dict: `steps`, `requests`, `adapter_requests`, `deferrals`, `worst_wait` (the most steps
/// one request was deferred), `tokens`, `uses`, `device`
/// and `host` (each `hits`, `misses`, `evictions`, `bytes_moved`, `belady_misses`; the device also
/// `hit_rate` and `belady_hit_rate`), and with `record=True` a `steps_log` list of per-step dicts
/// (`batch`: trace indices, `admitted` / `deferred`: positions in the batch, `loads`: (name, slot,
/// source), `evictions`: (name, tier, slot or None), `to_fetch`: names). `fetch` has the background
/// mode's figures (all 0 when `load_ms` is 0): `fetches` started, `deferred_requests` (requests
/// deferred at least once waiting for a fetch) and their extra wait, from the first step that
/// deferred them for a fetch to the step that admitted them, in steps and in milliseconds of the
/// step clock: `wait_steps_mean`, `wait_steps_p99`, `wait_ms_mean`, `wait_ms_p99` (nearest rank).
///
/// `progress`, when given, is called as `progress(served)` with the requests served so far, about
/// every 0.1 s of a long replay and once at the end (`served == len(trace)`). Pending signals are
/// checked as often, so Ctrl-C stops a long replay. The results do not depend on either.
///
/// With `page_rank` and `max_lora_memory` the device tier is a pool of `max_lora_memory` pages of
/// `page_rank` ranks (see `LoRARegistry`): an adapter of rank r takes ceil(r / page_rank) pages and
/// `slots` bounds the distinct adapters a step; the device `belady_misses` is then a lower bound
/// (Belady's MIN over as many places as the pages hold of the smallest adapter), not the optimum,
/// which is NP-hard to find for adapters of mixed sizes.
///
/// With `decode=True` each request runs `tokens` steps, one token a step, as an engine's decoding
/// requests do: offered in every step ahead of the waiting ones (`batch_size` bounds them together),
/// holding its adapter while it runs, and deferred like a waiting one when the step has no room for
/// it (no progress that step); `tokens` in the report is then one per request a step ran.
///
/// `order` is the order a step is offered its requests in: `"arrival"` (running ones first, then the
/// queue in arrival order) or `"longest_remaining"` (the registry's `offer_order` with that rule, as
/// `lora-pin serve --admission-order longest-remaining` offers them: overdue waiting requests, then
/// the base model's and pinned adapters', then the rest by tokens left to generate, most first).
///
/// Raises:
///     SpecError: slots or batch_size of 0, max_loaded_loras below slots, an unknown policy, a pin the
///         trace never names or beyond the pin limit, a negative step or load time, a rank outside
///         1..=MAX_ADAPTER_RANK or a weight not above 0, max_host_bytes of 0 or below a pinned
///         adapter's bytes, only one of page_rank and max_lora_memory, either of them 0, or an
///         adapter whose pages could never fit beside the pinned ones, an unknown `order`.
///     KeyboardInterrupt (or what a signal handler raises), or what `progress` raises: the replay
///         stops there.
#[pyfunction]
#[pyo3(signature = (
    trace, *, slots, max_loaded_loras = None, policy = "lru", pins = Vec::new(), batch_size = 4,
    step_seconds = 0.02, adapter_bytes = 33554432, load_ms = 0.0, record = false, progress = None,
    ranks = Vec::new(), max_host_bytes = None, page_rank = None, max_lora_memory = None, decode = false,
    order = "arrival"
))]
#[allow(clippy::too_many_arguments)]
pub fn simulate<'py>(
    py: Python<'py>,
    trace: &Bound<'py, PyTrace>,
    slots: i64,
    max_loaded_loras: Option<i64>,
    policy: &str,
    pins: Vec<String>,
    batch_size: i64,
    step_seconds: f64,
    adapter_bytes: u64,
    load_ms: f64,
    record: bool,
    progress: Option<Py<PyAny>>,
    ranks: Vec<(u32, f64)>,
    max_host_bytes: Option<u64>,
    page_rank: Option<u32>,
    max_lora_memory: Option<usize>,
    decode: bool,
    order: &str,
) -> PyResult<Bound<'py, PyDict>> {
    shielded(py, || {
        let order = AdmissionOrder::parse(order).map_err(py_err)?;
        let paging = match (page_rank, max_lora_memory) {
            (None, None) => None,
            (Some(page_rank), Some(pages)) => Some(Paging { page_rank, pages }),
            _ => {
                let msg = "page_rank and max_lora_memory go together (give both or neither)";
                return Err(new_error(py, "SpecError", msg.to_owned()));
            }
        };
        let shape = Shape {
            slots,
            max_loaded_loras,
            policy,
            pins,
            batch_size,
            step_seconds,
            adapter_bytes,
            ranks,
            max_host_bytes,
        };
        let config = SimConfig { load_ms, paging, decode, order, ..shape.config(py)? };
        let trace = &trace.get().0;
        let progress = progress.as_ref();
        let (run, log) = detached(py, || {
            let mut log = Vec::new();
            let mut served = 0usize;
            let mut last = Instant::now();
            let run = simulate_until(trace, &config, |batch, plan| {
                if record {
                    log.push((batch.to_vec(), plan.clone()));
                }
                served += plan.admitted.len();
                if last.elapsed() < PROGRESS_INTERVAL {
                    return ControlFlow::Continue(());
                }
                last = Instant::now();
                match Python::attach(|py| report_progress(py, progress, served)) {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(e) => ControlFlow::Break(e),
                }
            })?;
            Ok((run, log))
        })?;
        let report: SimReport = match run {
            ControlFlow::Continue(report) => report,
            ControlFlow::Break(e) => return Err(e),
        };
        if let Some(progress) = progress {
            progress.call1(py, (trace.requests().len(),))?;
        }
        let d = PyDict::new(py);
        d.set_item("steps", report.steps)?;
        d.set_item("requests", report.requests)?;
        d.set_item("adapter_requests", report.adapter_requests)?;
        d.set_item("deferrals", report.deferrals)?;
        d.set_item("worst_wait", report.worst_wait)?;
        d.set_item("tokens", report.tokens)?;
        d.set_item("uses", report.uses)?;
        d.set_item("device", tier(py, &report.device, Some(report.uses))?)?;
        d.set_item("host", tier(py, &report.host, None)?)?;
        d.set_item("fetch", fetch_dict(py, &report.fetch)?)?;
        if record {
            let steps = PyList::empty(py);
            for (batch, plan) in &log {
                steps.append(step_record(py, batch, plan)?)?;
            }
            d.set_item("steps_log", steps)?;
        }
        Ok(d)
    })
}

/// Runs pending signal handlers (Ctrl-C raises there), then calls `progress(served)`.
fn report_progress(py: Python<'_>, progress: Option<&Py<PyAny>>, served: usize) -> PyResult<()> {
    py.check_signals()?;
    if let Some(progress) = progress {
        progress.call1(py, (served,))?;
    }
    Ok(())
}

/// Replays `trace` over `replicas` replicas, each with its own registry configured as `simulate`'s
/// arguments say (pins on every replica, `ranks` and `max_host_bytes` likewise), behind `router`: `random`, `least-loaded` (shortest
/// queue, ties at random), `affinity` (`lora_pin.routing.rank_replicas`, homes from each adapter's
/// share of the trace, spilling past `queue_bound` queued requests) or `hash` (the least loaded of
/// the adapter's homes however long its queue: placement's most, and its cost in queueing). One clock in steps of `step_seconds`:
/// arrived requests are routed one by one, then every replica with work plans one step. Give the
/// trace arrival times (`Trace.with_gamma_arrivals`); without them all requests arrive at once.
///
/// Returns a dict: `steps` (of the clock) and `replicas`, a list with per replica `routed`,
/// `queue_mean`, `queue_max`, `utilisation` (share of steps with a batch), `steps`, `uses`,
/// `deferrals`, `adapter_requests`, and `device` / `host` as `simulate` gives them.
///
/// Raises:
///     SpecError: as `simulate`, an unknown router, 0 replicas, a queue bound of 0, or `load_ms` > 0.
#[pyfunction]
#[pyo3(signature = (
    trace, *, replicas, router, slots, max_loaded_loras = None, policy = "lru", pins = Vec::new(),
    batch_size = 4, step_seconds = 0.02, adapter_bytes = 33554432, queue_bound = 16, seed = 0,
    ranks = Vec::new(), max_host_bytes = None
))]
#[allow(clippy::too_many_arguments)]
pub fn simulate_replicas<'py>(
    py: Python<'py>,
    trace: &Bound<'py, PyTrace>,
    replicas: i64,
    router: &str,
    slots: i64,
    max_loaded_loras: Option<i64>,
    policy: &str,
    pins: Vec<String>,
    batch_size: i64,
    step_seconds: f64,
    adapter_bytes: u64,
    queue_bound: i64,
    seed: u64,
    ranks: Vec<(u32, f64)>,
    max_host_bytes: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    shielded(py, || {
        let shape = Shape {
            slots,
            max_loaded_loras,
            policy,
            pins,
            batch_size,
            step_seconds,
            adapter_bytes,
            ranks,
            max_host_bytes,
        };
        let config = shape.config(py)?;
        let replicas = non_negative(py, "replicas", replicas)?;
        let queue_bound = non_negative(py, "queue_bound", queue_bound)?;
        let router = Router::parse(router).map_err(py_err)?;
        let trace = &trace.get().0;
        let report = detached(py, || replicas_run(trace, &config, replicas, router, queue_bound, seed))?;
        let list = PyList::empty(py);
        for r in &report.replicas {
            let d = PyDict::new(py);
            d.set_item("routed", r.routed)?;
            d.set_item("queue_mean", r.queue_mean)?;
            d.set_item("queue_max", r.queue_max)?;
            d.set_item("utilisation", r.utilisation)?;
            d.set_item("steps", r.sim.steps)?;
            d.set_item("uses", r.sim.uses)?;
            d.set_item("deferrals", r.sim.deferrals)?;
            d.set_item("adapter_requests", r.sim.adapter_requests)?;
            d.set_item("device", tier(py, &r.sim.device, Some(r.sim.uses))?)?;
            d.set_item("host", tier(py, &r.sim.host, None)?)?;
            list.append(d)?;
        }
        let d = PyDict::new(py);
        d.set_item("steps", report.steps)?;
        d.set_item("replicas", list)?;
        Ok(d)
    })
}

/// The rank `simulate` gives each of `names` under the mix `ranks` (`(rank, weight)` pairs): drawn by
/// the weights from a hash of the name, so the same name gets the same rank in every run. A benchmark
/// that gives its adapters these ranks replays in `simulate` with the same sizes. Empty `ranks`: 16.
///
/// Raises:
///     SpecError: a rank outside 1..=MAX_ADAPTER_RANK or a weight that is not a finite number above 0.
#[pyfunction]
pub fn ranks_by_name(py: Python<'_>, names: Vec<String>, ranks: Vec<(u32, f64)>) -> PyResult<Vec<u32>> {
    let config = SimConfig { ranks, ..SimConfig::new(1, "lru") };
    detached(py, || Ok(adapter_sizes(&config, &names)?.iter().map(|s| s.rank).collect()))
}
