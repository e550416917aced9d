//! Request traces for the simulator: read from JSONL, or generated from a named workload with a seed.
//!
//! A request names one adapter (or none: the base model) and carries its token count for the step
//! that serves it, and optionally an arrival time in seconds.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::textfile::{read_regular_text, TextFileError};

/// The largest trace file [`Trace::from_file`] reads (256 MiB: some six million requests), so a wrong
/// path such as `/dev/zero` cannot exhaust memory.
pub const MAX_TRACE_FILE_BYTES: u64 = 256 << 20;

/// The smallest and largest coefficient of variation [`Trace::with_gamma_arrivals`] takes: between
/// them the Gamma shape `1 / cv^2` is a finite number above 0 (from 1e-300 to 1e300). Past them it
/// rounds to infinity or to 0, where no Gamma draw exists.
pub const MIN_ARRIVAL_CV: f64 = 1e-150;
/// See [`MIN_ARRIVAL_CV`].
pub const MAX_ARRIVAL_CV: f64 = 1e150;

/// How many candidates [`gamma`] draws before it gives up. Each is accepted with probability above
/// 0.95 for every shape, so this bound is never met by a valid shape; it makes the loop end by
/// construction, whatever rounding does to the acceptance test.
const GAMMA_TRIES: usize = 1000;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Index into [`Trace::names`]; `None` is the base model.
    pub adapter: Option<u32>,
    /// Tokens it puts into the step that serves it.
    pub tokens: u32,
    /// When it arrives, in seconds from the trace's start; `None` is "already waiting".
    pub arrival: Option<f64>,
}

/// Adapter names and requests, in arrival order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    names: Vec<String>,
    requests: Vec<Request>,
}

/// A generated workload's popularity pattern.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Workload {
    /// Adapter of rank `r` (0-based) with probability proportional to `1 / (r + 1)^alpha`; adapter
    /// `i` has rank `i`.
    Zipf(f64),
    /// S-LoRA's popularity: adapter `min(floor(x * n), n - 1)` where `x` follows numpy's
    /// `power(alpha)` (density `alpha * x^(alpha - 1)` on `[0, 1]`, drawn as `u^(1 / alpha)`): alpha 1
    /// is uniform, lower alphas crowd the requests onto the low adapter ids.
    Power(f64),
    /// Every adapter equally likely.
    Uniform,
    /// Zipf with alpha 1 whose ranking rotates: at request `i` of `m` the rank-`r` adapter is
    /// `(r + floor(i * n / m)) mod n`, so the hottest adapter changes `n` times over the trace.
    Shifting,
    /// Four adapters are "in a burst" at any time and take 80% of the requests between them; the
    /// rest are uniform. After each request, with probability 1/256, one bursting adapter (chosen
    /// uniformly) is replaced by a uniformly chosen adapter.
    Bursty,
    /// A cyclic sweep: request `i` uses adapter `i mod n`.
    Scan,
}

impl Workload {
    /// Parses `zipf:ALPHA`, `power:ALPHA`, `uniform`, `shifting`, `bursty` or `scan`.
    ///
    /// Errors: [`Error::Spec`] naming the value and the choices, or a bad alpha.
    pub fn parse(text: &str) -> Result<Self> {
        let choices = "choose zipf:ALPHA, power:ALPHA (ALPHA > 0), uniform, shifting, bursty or scan";
        let alpha = |a: &str| match a.parse::<f64>() {
            Ok(a) if a.is_finite() && a > 0.0 => Ok(a),
            _ => Err(Error::Spec(format!(
                "workload {text:?}: ALPHA must be a finite number above 0 (got {a:?})"
            ))),
        };
        match text.trim() {
            "uniform" => Ok(Self::Uniform),
            "shifting" => Ok(Self::Shifting),
            "bursty" => Ok(Self::Bursty),
            "scan" => Ok(Self::Scan),
            other => {
                if let Some(a) = other.strip_prefix("zipf:") {
                    Ok(Self::Zipf(alpha(a)?))
                } else if let Some(a) = other.strip_prefix("power:") {
                    Ok(Self::Power(alpha(a)?))
                } else {
                    Err(Error::Spec(format!("workload {text:?} is not a workload; {choices}")))
                }
            }
        }
    }

    /// The canonical spelling, as [`Workload::parse`] accepts it.
    pub fn label(&self) -> String {
        match self {
            Self::Zipf(a) => format!("zipf:{a}"),
            Self::Power(a) => format!("power:{a}"),
            Self::Uniform => "uniform".into(),
            Self::Shifting => "shifting".into(),
            Self::Bursty => "bursty".into(),
            Self::Scan => "scan".into(),
        }
    }
}

/// SplitMix64 (Steele, Lea and Flood 2014): a small, fast, seedable generator; traces must not
/// depend on a crate's version of a random-number algorithm.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut SplitMix) -> f64 {
    let u = 1.0 - rng.unit();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * rng.unit()).cos()
}

/// A Gamma(`shape`, 1) draw (Marsaglia and Tsang 2000; shapes below 1 boosted by `u^(1/shape)`).
/// `None` when `shape` is not a finite number above 0 (at infinity the acceptance test is NaN, so the
/// rejection loop never ends; at 0 the boost is NaN), or when [`GAMMA_TRIES`] candidates were all
/// rejected.
fn gamma(rng: &mut SplitMix, shape: f64) -> Option<f64> {
    if !shape.is_finite() || shape <= 0.0 {
        return None;
    }
    if shape < 1.0 {
        return Some(gamma(rng, shape + 1.0)? * (1.0 - rng.unit()).powf(1.0 / shape));
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    for _ in 0..GAMMA_TRIES {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = 1.0 - rng.unit();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return Some(d * v);
        }
    }
    None
}

/// Samples ranks `0..n` with probability proportional to `1 / (rank + 1)^alpha`.
struct ZipfSampler {
    cdf: Vec<f64>,
}

impl ZipfSampler {
    fn new(n: usize, alpha: f64) -> Self {
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for r in 0..n {
            total += 1.0 / ((r + 1) as f64).powf(alpha);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Self { cdf }
    }

    fn sample(&self, rng: &mut SplitMix) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len() - 1)
    }
}

impl Trace {
    /// A trace over `names`; every request's adapter must index into them.
    ///
    /// Errors: [`Error::Spec`] for a duplicate name, an adapter index out of range, or arrival
    /// times that are negative, not finite or decreasing (each naming the request).
    pub fn new(names: Vec<String>, requests: Vec<Request>) -> Result<Self> {
        let mut seen = HashMap::new();
        for (i, n) in names.iter().enumerate() {
            if let Some(j) = seen.insert(n.as_str(), i) {
                return Err(Error::Spec(format!("trace: adapter {n:?} is named twice (#{j} and #{i})")));
            }
        }
        let mut last = 0.0f64;
        for (i, r) in requests.iter().enumerate() {
            if let Some(a) = r.adapter {
                if a as usize >= names.len() {
                    return Err(Error::Spec(format!(
                        "trace: request {i} uses adapter #{a} but the trace names {} adapter(s)",
                        names.len()
                    )));
                }
            }
            if let Some(t) = r.arrival {
                if !t.is_finite() || t < 0.0 {
                    return Err(Error::Spec(format!(
                        "trace: request {i} arrives at {t}; arrival must be a finite number >= 0"
                    )));
                }
                if t < last {
                    return Err(Error::Spec(format!(
                        "trace: request {i} arrives at {t}, before the previous request ({last}); sort \
                         the trace by arrival"
                    )));
                }
                last = t;
            }
        }
        Ok(Self { names, requests })
    }

    /// Reads the JSONL trace file `file` (see [`Trace::from_jsonl`]) under the `@FILE` list's rules: a
    /// regular file only (a FIFO or a device is refused without waiting), at most
    /// [`MAX_TRACE_FILE_BYTES`]. Errors name the file.
    ///
    /// Errors: [`Error::Spec`]: the file cannot be read, is not a regular file, is larger than the limit,
    /// or is not a valid trace (as [`Trace::from_jsonl`]).
    pub fn from_file(file: &str) -> Result<Self> {
        let text = read_regular_text(file, MAX_TRACE_FILE_BYTES).map_err(|e| {
            Error::Spec(match e {
                TextFileError::Io(e) => format!("cannot read the trace file {file:?}: {e}"),
                TextFileError::NotRegular => format!(
                    "the trace file {file:?} is not a regular file (a FIFO, device or folder); only regular \
                     files are read"
                ),
                TextFileError::TooLarge => {
                    format!("the trace file {file:?} is larger than {MAX_TRACE_FILE_BYTES} bytes; cut it")
                }
            })
        })?;
        Self::from_jsonl(&text, file)
    }

    /// Reads JSONL: one request per non-blank line, `{"adapter": NAME or null, "tokens": N}` with an
    /// optional `"arrival": SECONDS` (non-decreasing). Adapters are named in order of first use.
    /// `source` names the text in errors.
    ///
    /// Errors: [`Error::Spec`] naming `source`, the line and the field: malformed JSON, a missing or
    /// unknown field, a wrong type, tokens outside `0..=4294967295`, arrivals out of order.
    pub fn from_jsonl(text: &str, source: &str) -> Result<Self> {
        let mut names: Vec<String> = Vec::new();
        let mut index: HashMap<String, u32> = HashMap::new();
        let mut requests = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line_no = n + 1;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |what: String| Error::Spec(format!("{source}:{line_no}: {what}"));
            let value: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(format!("not valid JSON ({e})")))?;
            let serde_json::Value::Object(obj) = value else {
                return Err(bad("expected a JSON object like {\"adapter\": \"a\", \"tokens\": 16}".into()));
            };
            if let Some(k) = obj.keys().find(|k| !matches!(k.as_str(), "adapter" | "tokens" | "arrival")) {
                return Err(bad(format!("unknown field {k:?}; the fields are adapter, tokens, arrival")));
            }
            let adapter = match obj.get("adapter") {
                Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(match index.get(s) {
                    Some(&i) => i,
                    None => {
                        let i = u32::try_from(names.len())
                            .map_err(|_| bad("more than 4294967295 adapters".into()))?;
                        index.insert(s.clone(), i);
                        names.push(s.clone());
                        i
                    }
                }),
                Some(other) => {
                    return Err(bad(format!("field \"adapter\" must be a string or null (got {other})")))
                }
                None => return Err(bad("field \"adapter\" is missing (use null for the base model)".into())),
            };
            let tokens = match obj.get("tokens") {
                Some(v) => v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| {
                    bad(format!("field \"tokens\" must be an integer in 0..=4294967295 (got {v})"))
                })?,
                None => return Err(bad("field \"tokens\" is missing".into())),
            };
            let arrival = match obj.get("arrival") {
                None | Some(serde_json::Value::Null) => None,
                Some(v) => Some(
                    v.as_f64()
                        .filter(|t| t.is_finite() && *t >= 0.0)
                        .ok_or_else(|| bad(format!("field \"arrival\" must be seconds >= 0 (got {v})")))?,
                ),
            };
            requests.push(Request { adapter, tokens, arrival });
        }
        Self::new(names, requests).map_err(|e| Error::Spec(format!("{source}: {e}")))
    }

    /// `requests` requests over `adapters` adapters named `adapter-000`, ... following `workload`,
    /// one token each, all waiting from the start; the same arguments give the same trace.
    ///
    /// Errors: [`Error::Spec`] when `adapters` is 0 or above 4294967295; [`Error::Capacity`] when the
    /// trace cannot be allocated.
    pub fn generate(workload: Workload, adapters: usize, requests: usize, seed: u64) -> Result<Self> {
        if adapters == 0 || u32::try_from(adapters).is_err() {
            return Err(Error::Spec(format!("adapters must be in 1..=4294967295 (got {adapters})")));
        }
        let width = adapters.saturating_sub(1).to_string().len().max(3);
        let too_big =
            |what: &str| Error::Capacity(format!("a generated trace of {what} cannot be allocated"));
        let mut names = Vec::new();
        names.try_reserve_exact(adapters).map_err(|_| too_big(&format!("{adapters} adapters")))?;
        names.extend((0..adapters).map(|i| format!("adapter-{i:0width$}")));
        let mut rng = SplitMix::new(seed);
        let n = adapters;
        let mut picks: Vec<usize> = Vec::new();
        picks.try_reserve_exact(requests).map_err(|_| too_big(&format!("{requests} requests")))?;
        match workload {
            Workload::Uniform => picks.extend((0..requests).map(|_| rng.below(n))),
            Workload::Scan => picks.extend((0..requests).map(|i| i % n)),
            Workload::Zipf(alpha) => {
                let z = ZipfSampler::new(n, alpha);
                picks.extend((0..requests).map(|_| z.sample(&mut rng)));
            }
            Workload::Power(alpha) => picks.extend((0..requests).map(|_| {
                let x = rng.unit().powf(1.0 / alpha);
                ((x * n as f64) as usize).min(n - 1)
            })),
            Workload::Shifting => {
                let z = ZipfSampler::new(n, 1.0);
                picks.extend((0..requests).map(|i| {
                    let offset = (i as u128 * n as u128 / requests as u128) as usize;
                    (z.sample(&mut rng) + offset) % n
                }));
            }
            Workload::Bursty => {
                let mut bursting: Vec<usize> = (0..4).map(|_| rng.below(n)).collect();
                for _ in 0..requests {
                    picks.push(if rng.unit() < 0.8 { bursting[rng.below(4)] } else { rng.below(n) });
                    if rng.unit() < 1.0 / 256.0 {
                        let k = rng.below(4);
                        bursting[k] = rng.below(n);
                    }
                }
            }
        }
        let requests = picks
            .into_iter()
            .map(|a| Request { adapter: Some(a as u32), tokens: 1, arrival: None })
            .collect();
        Ok(Self { names, requests })
    }

    /// This trace with Gamma-distributed gaps between arrivals, as S-LoRA's workloads: mean gap
    /// `1 / rate` seconds, coefficient of variation `cv` (shape `1 / cv^2`; cv 1 is Poisson arrivals,
    /// higher is burstier). Replaces any arrival times; the same arguments give the same times.
    ///
    /// Errors: [`Error::Spec`] when `rate` is not a finite number above 0; when `cv` is outside
    /// [`MIN_ARRIVAL_CV`]`..=`[`MAX_ARRIVAL_CV`] (or NaN); when the Gamma scale `1 / (rate * shape)`
    /// is not a finite number above 0 (an extreme rate with an extreme cv); or when the arrival
    /// times pass the largest `f64` (a rate so low that the gaps add up past it). Each names the
    /// values.
    pub fn with_gamma_arrivals(mut self, rate: f64, cv: f64, seed: u64) -> Result<Self> {
        if !rate.is_finite() || rate <= 0.0 {
            return Err(Error::Spec(format!("arrival rate must be a finite number above 0 (got {rate:?})")));
        }
        if !(MIN_ARRIVAL_CV..=MAX_ARRIVAL_CV).contains(&cv) {
            return Err(Error::Spec(format!(
                "arrival cv must be a number in {MIN_ARRIVAL_CV:e}..={MAX_ARRIVAL_CV:e}, where the Gamma \
                 shape 1/cv^2 is a finite number above 0 (got {cv:?})"
            )));
        }
        let shape = 1.0 / (cv * cv);
        let scale = 1.0 / (rate * shape);
        if !scale.is_finite() || scale <= 0.0 {
            return Err(Error::Spec(format!(
                "arrival rate {rate:?} with cv {cv:?}: the Gamma scale cv^2/rate is {scale:?}, not a finite \
                 number above 0; bring the rate or the cv nearer 1"
            )));
        }
        let mut rng = SplitMix::new(seed ^ 0x6A09_E667_F3BC_C908);
        let mut clock = 0.0;
        for r in &mut self.requests {
            let gap = gamma(&mut rng, shape).ok_or_else(|| {
                Error::Spec(format!("arrival cv {cv:?}: no Gamma draw of shape {shape:?} was found"))
            })?;
            clock += gap * scale;
            r.arrival = Some(clock);
        }
        if !clock.is_finite() {
            return Err(Error::Spec(format!(
                "arrival rate {rate:?} with cv {cv:?}: the arrival times of {} requests pass the largest \
                 number (about 1.8e308 seconds); raise the rate",
                self.requests.len()
            )));
        }
        Ok(self)
    }

    /// The adapters' names; a request's `adapter` indexes into them.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The requests, in arrival order.
    pub fn requests(&self) -> &[Request] {
        &self.requests
    }

    /// The `k` most requested adapters, most requested first (ties: the earlier name first).
    pub fn most_requested(&self, k: usize) -> Vec<String> {
        let mut counts = vec![0u64; self.names.len()];
        for a in self.requests.iter().filter_map(|r| r.adapter) {
            counts[a as usize] += 1;
        }
        let mut order: Vec<usize> = (0..self.names.len()).filter(|&i| counts[i] > 0).collect();
        order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
        order.into_iter().take(k).map(|i| self.names[i].clone()).collect()
    }
}

#[cfg(test)]
#[path = "trace_tests.rs"]
mod tests;
