//! `LoRARef` and `parse_lora_paths` for Python.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};
use serde_json::{Map, Number, Value};

use super::errors::{new_error, py_err};
use super::text::{int_arg, quote, text, type_name};
use super::{detached, shielded};
use lora_pin_core::spec::{self, Limits, LoRARef, SpecItem};

/// One adapter: its id, name, path, whether it is pinned, and (vLLM form) its base model's name.
///
/// Frozen and hashable. `LoRARef(name, path)` gets the deterministic id of `(name, path)` that every
/// process derives alike; `LoRARef.new(name, path)` mints a random id for a run-time load.
///
/// Raises:
///     SpecError: the name or path is empty or holds a lone surrogate, or the name holds `=` or a
///         control character.
#[pyclass(frozen, eq, hash, name = "LoRARef", module = "lora_pin")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyLoRARef(pub LoRARef);

#[pymethods]
impl PyLoRARef {
    #[new]
    #[pyo3(signature = (lora_name, lora_path, *, pinned = false, base_model_name = None, lora_id = None))]
    fn py_new(
        py: Python<'_>,
        lora_name: &Bound<'_, PyAny>,
        lora_path: &Bound<'_, PyAny>,
        pinned: bool,
        base_model_name: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        shielded(py, || {
            let (name, path) = (text(lora_name, "lora_name")?, text(lora_path, "lora_path")?);
            let base = base_model_name.map(|b| text(b, "base_model_name")).transpose()?;
            let mut r = LoRARef::with_deterministic_id(&name, &path, pinned, base.map(|b| b.to_string()))
                .map_err(py_err)?;
            if let Some(id) = lora_id.map(|id| text(id, "lora_id")).transpose()? {
                if id.is_empty() {
                    return Err(new_error(py, "SpecError", "lora_id must not be empty".into()));
                }
                r.lora_id = id.to_string();
            }
            Ok(Self(r))
        })
    }

    /// A ref with a fresh random id, for an adapter loaded at run time.
    ///
    /// Raises:
    ///     SpecError: the name or path is invalid (or holds a lone surrogate).
    #[staticmethod]
    #[pyo3(signature = (lora_name, lora_path, pinned = false))]
    fn new(
        py: Python<'_>,
        lora_name: &Bound<'_, PyAny>,
        lora_path: &Bound<'_, PyAny>,
        pinned: bool,
    ) -> PyResult<Self> {
        shielded(py, || {
            let (name, path) = (text(lora_name, "lora_name")?, text(lora_path, "lora_path")?);
            LoRARef::with_random_id(&name, &path, pinned).map(Self).map_err(py_err)
        })
    }

    /// The adapter's id (32 hex digits).
    #[getter]
    fn lora_id(&self) -> &str {
        &self.0.lora_id
    }

    /// The name requests use.
    #[getter]
    fn lora_name(&self) -> &str {
        &self.0.lora_name
    }

    /// Where the adapter's files are, as written.
    #[getter]
    fn lora_path(&self) -> &str {
        &self.0.lora_path
    }

    /// Whether the adapter stays resident until unpinned.
    #[getter]
    fn pinned(&self) -> bool {
        self.0.pinned
    }

    /// The base model's name, when the spec gave one.
    #[getter]
    fn base_model_name(&self) -> Option<&str> {
        self.0.base_model_name.as_deref()
    }

    /// The fields as a dict (`base_model_name` only when set).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("lora_id", &self.0.lora_id)?;
        d.set_item("lora_name", &self.0.lora_name)?;
        d.set_item("lora_path", &self.0.lora_path)?;
        d.set_item("pinned", self.0.pinned)?;
        if let Some(base) = &self.0.base_model_name {
            d.set_item("base_model_name", base)?;
        }
        Ok(d)
    }

    /// The canonical `--lora-paths` item for this ref: `parse_lora_paths([r.to_spec()]) == [r]` for
    /// refs with deterministic ids.
    fn to_spec(&self) -> String {
        spec::format_ref(&self.0)
    }

    fn __repr__(&self) -> String {
        let base = match &self.0.base_model_name {
            Some(b) => format!(", base_model_name={b:?}"),
            None => String::new(),
        };
        format!(
            "LoRARef(lora_name={:?}, lora_path={:?}, pinned={}{base}, lora_id={:?})",
            self.0.lora_name,
            self.0.lora_path,
            if self.0.pinned { "True" } else { "False" },
            self.0.lora_id
        )
    }
}

/// Parses adapter specs in every form serving frameworks use into refs.
///
/// `values` is `None` (no adapters), a `{name: path}` dict, or a list whose items are `PATH`,
/// `NAME=PATH`, a JSON object string (SGLang `{"lora_name", "lora_path", "pinned"}` or vLLM
/// `{"name", "path", "base_model_name"}`), a dict with either key set, or `@FILE` (a JSON array of
/// such items). With the limits given, the pins and the count are cross-checked against them.
///
/// Raises:
///     SpecError: an item is invalid (the message names its 0-based index and quotes it), two items
///         share a name, or the limits are inconsistent or out of range (the message gives the numbers).
#[pyfunction]
#[pyo3(signature = (values, *, max_loras_per_batch = None, max_loaded_loras = None))]
pub fn parse_lora_paths(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    max_loras_per_batch: Option<&Bound<'_, PyAny>>,
    max_loaded_loras: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<PyLoRARef>> {
    shielded(py, || {
        let limits = limits(py, max_loras_per_batch, max_loaded_loras)?;
        let items = spec_items(py, values)?;
        let refs = detached(py, move || spec::parse_items(&items, limits))?;
        Ok(refs.into_iter().map(PyLoRARef).collect())
    })
}

/// Checks the limits against each other and against `num_adapters` adapters, `num_pinned` of them pinned.
///
/// Raises:
///     SpecError: a limit is out of range or they disagree; the message gives the numbers.
#[pyfunction]
#[pyo3(signature = (num_adapters, num_pinned, *, max_loras_per_batch = None, max_loaded_loras = None))]
pub fn check_limits(
    py: Python<'_>,
    num_adapters: usize,
    num_pinned: usize,
    max_loras_per_batch: Option<&Bound<'_, PyAny>>,
    max_loaded_loras: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    shielded(py, || {
        let limits = limits(py, max_loras_per_batch, max_loaded_loras)?;
        spec::check_limits(num_adapters, num_pinned, limits).map_err(py_err)
    })
}

fn limits(
    py: Python<'_>,
    slots: Option<&Bound<'_, PyAny>>,
    loaded: Option<&Bound<'_, PyAny>>,
) -> PyResult<Limits> {
    let conv = |what: &str, v: Option<&Bound<'_, PyAny>>| -> PyResult<Option<usize>> {
        match v.map(|v| int_arg(v, what, 1)).transpose()? {
            None => Ok(None),
            Some(n) if n >= 0 => Ok(Some(n as usize)),
            Some(n) => Err(new_error(py, "SpecError", format!("{what} must be at least 1 (got {n})"))),
        }
    };
    Ok(Limits {
        max_loras_per_batch: conv("max_loras_per_batch", slots)?,
        max_loaded_loras: conv("max_loaded_loras", loaded)?,
    })
}

fn spec_items(py: Python<'_>, values: &Bound<'_, PyAny>) -> PyResult<Vec<SpecItem>> {
    if values.is_none() {
        return Ok(Vec::new());
    }
    if let Ok(dict) = values.cast::<PyDict>() {
        let mut items = Vec::with_capacity(dict.len());
        for (index, (k, v)) in dict.iter().enumerate() {
            if !k.is_instance_of::<PyString>() || !v.is_instance_of::<PyString>() {
                return Err(spec_error(
                    py,
                    format!(
                        "item {index} ({}: {}): a {{name: path}} dict needs string keys and values",
                        quote(&k),
                        quote(&v)
                    ),
                ));
            }
            let (name, path) =
                (text(&k, &format!("item {index}'s name"))?, text(&v, &format!("item {index}'s path"))?);
            items.push(SpecItem::Pair { name: name.to_string(), path: path.to_string() });
        }
        return Ok(items);
    }
    if values.is_instance_of::<PyString>() || values.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(spec_error(
            py,
            format!(
                "expected a list of adapter items, a {{name: path}} dict or None, got the single string {}; \
                 wrap it in a list",
                quote(values)
            ),
        ));
    }
    let iter = values.try_iter().map_err(|_| {
        let ty = type_name(values);
        spec_error(py, format!("expected a list of adapter items, a {{name: path}} dict or None, got {ty}"))
    })?;
    let mut items = Vec::with_capacity(values.len().unwrap_or(0));
    for (index, item) in iter.enumerate() {
        let item = item?;
        if item.is_instance_of::<PyString>() {
            items.push(SpecItem::Text(text(&item, &format!("item {index}"))?.to_string()));
        } else if let Ok(d) = item.cast::<PyDict>() {
            items.push(SpecItem::Object(json_object(py, index, d)?));
        } else if let Ok(r) = item.cast::<PyLoRARef>() {
            items.push(SpecItem::Ref(r.get().0.clone()));
        } else {
            let ty = type_name(&item);
            return Err(spec_error(
                py,
                format!("item {index} ({}): expected a string or a dict, got {ty}", quote(&item)),
            ));
        }
    }
    Ok(items)
}

/// A Python dict item as a JSON object, so it goes through exactly the checks a JSON string does.
fn json_object(py: Python<'_>, index: usize, d: &Bound<'_, PyDict>) -> PyResult<Map<String, Value>> {
    let mut map = Map::new();
    for (k, v) in d.iter() {
        if !k.is_instance_of::<PyString>() {
            return Err(spec_error(
                py,
                format!("item {index} ({}): dict keys must be strings, got {}", quote(d), quote(&k)),
            ));
        }
        let key = text(&k, &format!("item {index}'s key"))?.to_string();
        let value = if v.is_none() {
            Value::Null
        } else if let Ok(b) = v.cast::<PyBool>() {
            Value::Bool(b.is_true())
        } else if v.is_instance_of::<PyString>() {
            Value::String(text(&v, &format!("item {index}'s value of {key:?}"))?.to_string())
        } else if v.is_instance_of::<PyInt>() {
            // No spec key takes a number: any one is refused later, with its value quoted, so an int
            // past i64 keeps its magnitude as a float rather than turn into another number.
            match (v.extract::<i64>(), v.extract::<f64>()) {
                (Ok(i), _) => Value::Number(Number::from(i)),
                (_, Ok(f)) => Number::from_f64(f).map_or(Value::Null, Value::Number),
                _ => return Err(bad_value(py, index, d, &key, &v)),
            }
        } else if let Ok(f) = v.cast::<PyFloat>() {
            // NaN and infinities have no JSON number: refused here, never taken for null.
            match Number::from_f64(f.value()) {
                Some(n) => Value::Number(n),
                None => return Err(bad_value(py, index, d, &key, &v)),
            }
        } else if v.hasattr("__fspath__")? {
            let os = py.import("os")?;
            match os.call_method1("fspath", (&v,))?.extract::<String>() {
                Ok(path) => Value::String(path),
                Err(_) => return Err(bad_value(py, index, d, &key, &v)),
            }
        } else {
            let ty = type_name(&v);
            return Err(spec_error(
                py,
                format!(
                    "item {index} ({}): the value of {key:?} has type {ty}, which no spec key takes",
                    quote(d)
                ),
            ));
        };
        map.insert(key, value);
    }
    Ok(map)
}

fn bad_value(py: Python<'_>, index: usize, d: &Bound<'_, PyDict>, key: &str, v: &Bound<'_, PyAny>) -> PyErr {
    spec_error(
        py,
        format!(
            "item {index} ({}): the value of {key:?} ({}) is not one a spec key takes",
            quote(d),
            quote(v)
        ),
    )
}

fn spec_error(py: Python<'_>, msg: String) -> PyErr {
    new_error(py, "SpecError", msg)
}
