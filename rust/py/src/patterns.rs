//! `PatternSet` for Python: an adapter config's regexes, compiled once, matched in linear time with
//! the GIL released for many keys.

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::detached;
use super::errors::new_error;
use lora_pin_core::patterns::{Anchoring, PatternError, PatternSet};

/// A field's regexes (Python `re` syntax), compiled once into one set whose matching never backtracks:
/// a key costs time linear in its length whatever the patterns, and one pass reports every pattern
/// that matches it, as Python applies them: `anchoring="start"` as `re.match`, `"full"` as
/// `re.fullmatch`, `"dotted_suffix"` as PEFT's `re.match(rf"(.*\.)?({pattern})$", key)` (one pass
/// from the key's start and one after each dot). Every match runs with the GIL released.
///
/// Patterns must be ones `re.compile` accepts. `context` opens every error message and `labels` (one
/// per pattern) names a pattern in it, e.g. `"adapter 'a' (...): field 'rank_pattern'"` and
/// `"key 'q_proj'"`; without labels a pattern is named by its text.
///
/// Raises:
///     AdapterLoadError: a pattern uses a construct the matcher lacks or would read differently from
///         Python's `re` (look-around, back-references, possessive quantifiers, ...; the construct is
///         named), or the patterns compile past `MAX_COMPILED_BYTES`; `labels` is not one per pattern;
///         an unknown `anchoring`.
#[pyclass(frozen, name = "PatternSet", module = "lora_pin")]
pub struct PyPatternSet {
    set: PatternSet,
    context: String,
}

#[pymethods]
impl PyPatternSet {
    #[new]
    #[pyo3(signature = (patterns, *, anchoring, context = "", labels = None))]
    fn py_new(
        py: Python<'_>,
        patterns: Vec<String>,
        anchoring: &str,
        context: &str,
        labels: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let context = context.to_owned();
        let anchoring = match anchoring {
            "start" => Anchoring::Start,
            "full" => Anchoring::Full,
            "dotted_suffix" => Anchoring::DottedSuffix,
            other => {
                let why = format!("anchoring must be 'start', 'full' or 'dotted_suffix', got {other:?}");
                return Err(new_error(py, "AdapterLoadError", format!("{context}: {why}")));
            }
        };
        if labels.as_ref().is_some_and(|l| l.len() != patterns.len()) {
            return Err(new_error(
                py,
                "AdapterLoadError",
                format!("{context}: labels must name each of the {} pattern(s)", patterns.len()),
            ));
        }
        let built = detached(py, || Ok(PatternSet::new(&patterns, anchoring)))?;
        match built {
            Ok(set) => Ok(Self { set, context }),
            Err(err) => {
                let message = match &err {
                    PatternError::Refused { index, why } => {
                        let shown = match &labels {
                            Some(labels) => labels[*index].clone(),
                            None => format!("pattern {:?}", patterns[*index]),
                        };
                        format!("{shown} {why}")
                    }
                    other => other.to_string(),
                };
                Err(refused(py, &context, message))
            }
        }
    }

    /// The patterns, as given.
    #[getter]
    fn patterns(&self) -> Vec<String> {
        self.set.patterns().to_vec()
    }

    /// How the patterns are applied: `"start"`, `"full"` or `"dotted_suffix"`.
    #[getter]
    fn anchoring(&self) -> &'static str {
        match self.set.anchoring() {
            Anchoring::Start => "start",
            Anchoring::Full => "full",
            Anchoring::DottedSuffix => "dotted_suffix",
        }
    }

    fn __len__(&self) -> usize {
        self.set.patterns().len()
    }

    fn __repr__(&self) -> String {
        format!("PatternSet({} pattern(s), anchoring={:?})", self.set.patterns().len(), self.anchoring())
    }

    /// The index of the first pattern (in the order given) matching `key`, or None.
    ///
    /// Raises:
    ///     AdapterLoadError: `key` is empty or holds a character outside printable ASCII.
    fn first_match(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let key = key_text(py, &self.context, key)?;
        // Released even for one key: linear time is still up to key length x compiled size.
        detached(py, || Ok(self.set.first_match(&key)))?.map_err(|e| self.error(py, e))
    }

    /// `first_match` of each of `keys`, in one call with the GIL released.
    ///
    /// Raises:
    ///     AdapterLoadError: a key is empty or holds a character outside printable ASCII.
    fn first_matches(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Option<usize>>> {
        let keys = keys.iter().map(|k| key_text(py, &self.context, k)).collect::<PyResult<Vec<_>>>()?;
        let found =
            detached(py, || Ok(keys.iter().map(|k| self.set.first_match(k)).collect::<Result<Vec<_>, _>>()))?;
        found.map_err(|e| self.error(py, e))
    }

    /// For each pattern, whether it matches at least one of `keys`; the GIL is released.
    ///
    /// Raises:
    ///     AdapterLoadError: a key is empty or holds a character outside printable ASCII.
    fn used_by(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let keys = keys.iter().map(|k| key_text(py, &self.context, k)).collect::<PyResult<Vec<_>>>()?;
        detached(py, || Ok(self.set.used_by(&keys)))?.map_err(|e| self.error(py, e))
    }

    /// The text group `name` captured in `key` by the first pattern matching it, as `re` would
    /// capture it; None when no pattern matches or the group took no part.
    ///
    /// Raises:
    ///     AdapterLoadError: `key` is empty or holds a character outside printable ASCII.
    fn group(&self, py: Python<'_>, key: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<String>> {
        let key = key_text(py, &self.context, key)?;
        let captured = detached(py, || Ok(self.set.group(&key, name).map(|c| c.map(str::to_owned))))?;
        captured.map_err(|e| self.error(py, e))
    }
}

impl PyPatternSet {
    fn error(&self, py: Python<'_>, err: PatternError) -> PyErr {
        refused(py, &self.context, err.to_string())
    }
}

fn refused(py: Python<'_>, context: &str, message: String) -> PyErr {
    let text = if context.is_empty() { message } else { format!("{context} {message}") };
    new_error(py, "AdapterLoadError", text)
}

/// A key as text; a str Rust cannot hold (a lone surrogate) is refused like any key outside
/// printable ASCII, instead of escaping as `UnicodeEncodeError`.
fn key_text(py: Python<'_>, context: &str, key: &Bound<'_, PyAny>) -> PyResult<String> {
    let text = key.cast::<PyString>().map_err(|_| {
        let shown = key.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
        refused(py, context, format!("module key {shown} is not a str"))
    })?;
    match text.to_str() {
        Ok(s) => Ok(s.to_owned()),
        Err(_) => {
            let shown = text.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
            Err(refused(
                py,
                context,
                format!("module key {shown} is not valid Unicode (it holds a lone surrogate)"),
            ))
        }
    }
}
