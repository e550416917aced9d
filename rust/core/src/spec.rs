//! Adapter specs: every form serving frameworks use to name adapters at start-up, parsed into
//! [`LoRARef`]s with errors that name the offending item.
//!
//! Accepted items (each whitespace-stripped):
//! - `PATH`: the adapter's name is the path itself (SGLang's rule);
//! - `NAME=PATH`: split on the first `=` (a name never contains `=`, a path may);
//! - a JSON object, SGLang form `{"lora_name", "lora_path", "pinned"?}` or vLLM form
//!   `{"name", "path", "base_model_name"?, "pinned"?}`; an item is JSON when it starts with `{`;
//! - `@FILE`: the entries of a JSON array in that file (strings in any form above but `@FILE`, or objects).
//!
//! Paths are kept exactly as written (relative paths stay relative to the process's working
//! directory, also inside `@FILE` lists): resolving and containment are the loader's job.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde_json::{Map, Value};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::textfile::{read_regular_text, TextFileError};

/// One adapter named at start-up or at run time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LoRARef {
    /// Stable identifier: deterministic for parsed specs (see [`deterministic_id`]), random for run-time loads.
    pub lora_id: String,
    /// The name requests use.
    pub lora_name: String,
    /// Where the adapter's files are, as written.
    pub lora_path: String,
    /// Whether the adapter stays resident in both tiers until unpinned.
    pub pinned: bool,
    /// The base model the adapter was trained on, when the spec says (vLLM form).
    pub base_model_name: Option<String>,
}

impl LoRARef {
    /// A ref with the deterministic id of `(name, path)`. Name and path are validated as a parsed item's are.
    pub fn with_deterministic_id(
        name: &str,
        path: &str,
        pinned: bool,
        base_model_name: Option<String>,
    ) -> Result<Self> {
        let loc = Loc::runtime(name, path);
        let name = checked_name(name, &loc)?;
        let path = checked_path(path, &loc)?;
        Ok(Self::build(name, path, pinned, base_model_name))
    }

    /// A ref with a fresh random id, for adapters loaded at run time.
    pub fn with_random_id(name: &str, path: &str, pinned: bool) -> Result<Self> {
        let mut r = Self::with_deterministic_id(name, path, pinned, None)?;
        r.lora_id = Uuid::new_v4().simple().to_string();
        Ok(r)
    }

    fn build(name: &str, path: &str, pinned: bool, base_model_name: Option<String>) -> Self {
        Self {
            lora_id: deterministic_id(name, path),
            lora_name: name.to_owned(),
            lora_path: path.to_owned(),
            pinned,
            base_model_name,
        }
    }
}

/// The id every process and machine derives for `(name, path)`: the hex form of
/// UUIDv5(NAMESPACE_URL, name + "\0" + path), so all ranks of a deployment agree without talking.
pub fn deterministic_id(name: &str, path: &str) -> String {
    let mut key = Vec::with_capacity(name.len() + 1 + path.len());
    key.extend_from_slice(name.as_bytes());
    key.push(0);
    key.extend_from_slice(path.as_bytes());
    Uuid::new_v5(&Uuid::NAMESPACE_URL, &key).simple().to_string()
}

/// One item as a caller hands it over.
#[derive(Debug, Clone, PartialEq)]
pub enum SpecItem {
    /// A command-line style string: `PATH`, `NAME=PATH`, a JSON object, or `@FILE`.
    Text(String),
    /// An already-decoded object (a Python dict) with either key set.
    Object(Map<String, Value>),
    /// One entry of a `{name: path}` mapping.
    Pair {
        /// The adapter name.
        name: String,
        /// The adapter path.
        path: String,
    },
    /// An adapter reference made already (its id, random or chosen, is kept).
    Ref(LoRARef),
}

/// The start-up limits that specs are cross-checked against, when known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Device slots per step (`--max-loras-per-batch`).
    pub max_loras_per_batch: Option<usize>,
    /// Host-tier capacity in adapters (`--max-loaded-loras`).
    pub max_loaded_loras: Option<usize>,
}

/// Parses every item, then checks duplicate names and the limits.
///
/// Errors: [`Error::Spec`] naming the 0-based item index (and the `@FILE` entry) and quoting the item.
pub fn parse_items(items: &[SpecItem], limits: Limits) -> Result<Vec<LoRARef>> {
    check_limit_values(limits)?;
    let mut refs = Vec::with_capacity(items.len());
    let mut locs: Vec<Loc> = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        match item {
            SpecItem::Text(text) => parse_text(index, text, &mut refs, &mut locs)?,
            SpecItem::Object(map) => {
                let loc = Loc::item(index, Quote::Object(map));
                refs.push(parse_object(map, &loc)?);
                locs.push(loc);
            }
            SpecItem::Pair { name, path } => {
                let loc = Loc::item(index, Quote::Pair(name, path));
                let name = checked_name(name, &loc)?;
                let path = checked_path(path, &loc)?;
                refs.push(LoRARef::build(name, path, false, None));
                locs.push(loc);
            }
            SpecItem::Ref(r) => {
                refs.push(r.clone());
                locs.push(Loc::item(index, Quote::Pair(&r.lora_name, &r.lora_path)));
            }
        }
    }
    check_duplicates(&refs, &locs)?;
    check_counts(&refs, limits)?;
    Ok(refs)
}

/// The canonical item for `r`: `PATH`, `NAME=PATH`, or a JSON object, whichever is the shortest form
/// that parses back to `r` (its deterministic id included).
pub fn format_ref(r: &LoRARef) -> String {
    let plain = !r.pinned && r.base_model_name.is_none();
    let safe_start = |s: &str| !s.starts_with('{') && !s.starts_with('@');
    if plain && r.lora_name == r.lora_path && safe_start(&r.lora_path) && !r.lora_path.contains('=') {
        return r.lora_path.clone();
    }
    if plain && safe_start(&r.lora_name) {
        return format!("{}={}", r.lora_name, r.lora_path);
    }
    let mut obj = Map::new();
    if let Some(base) = &r.base_model_name {
        obj.insert("name".into(), Value::String(r.lora_name.clone()));
        obj.insert("path".into(), Value::String(r.lora_path.clone()));
        obj.insert("base_model_name".into(), Value::String(base.clone()));
    } else {
        obj.insert("lora_name".into(), Value::String(r.lora_name.clone()));
        obj.insert("lora_path".into(), Value::String(r.lora_path.clone()));
    }
    if r.pinned {
        obj.insert("pinned".into(), Value::Bool(true));
    }
    Value::Object(obj).to_string()
}

/// Checks the limits against each other and against a number of adapters, `pinned` of them pinned.
///
/// Errors: [`Error::Spec`] with the numbers involved.
pub fn check_limits(num_adapters: usize, num_pinned: usize, limits: Limits) -> Result<()> {
    check_limit_values(limits)?;
    if let Some(slots) = limits.max_loras_per_batch {
        if num_pinned > slots - 1 {
            return Err(Error::Spec(format!(
                "{num_pinned} adapters are pinned but max_loras_per_batch={slots} allows at most {} \
                 (one slot must stay free for unpinned adapters and the base model's neighbours)",
                slots - 1
            )));
        }
    }
    if let Some(loaded) = limits.max_loaded_loras {
        if num_adapters > loaded {
            return Err(Error::Spec(format!(
                "{num_adapters} adapters were given but max_loaded_loras={loaded} holds at most {loaded}"
            )));
        }
    }
    Ok(())
}

fn check_limit_values(limits: Limits) -> Result<()> {
    if limits.max_loras_per_batch == Some(0) {
        return Err(Error::Spec("max_loras_per_batch must be at least 1 (got 0)".into()));
    }
    if let Some(slots) = limits.max_loras_per_batch.filter(|&s| s > crate::limits::MAX_SLOTS) {
        return Err(Error::Spec(format!(
            "max_loras_per_batch={slots} is too large: at most {} device slots",
            crate::limits::MAX_SLOTS
        )));
    }
    if let (Some(slots), Some(loaded)) = (limits.max_loras_per_batch, limits.max_loaded_loras) {
        if loaded < slots {
            return Err(Error::Spec(format!(
                "max_loaded_loras={loaded} must be >= max_loras_per_batch={slots} \
                 (an adapter in a device slot is also in the host tier)"
            )));
        }
    }
    Ok(())
}

fn check_counts(refs: &[LoRARef], limits: Limits) -> Result<()> {
    let pinned = refs.iter().filter(|r| r.pinned).count();
    check_limits(refs.len(), pinned, limits)
}

fn check_duplicates(refs: &[LoRARef], locs: &[Loc]) -> Result<()> {
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(refs.len());
    for (i, r) in refs.iter().enumerate() {
        if let Some(&first) = seen.get(r.lora_name.as_str()) {
            return Err(Error::Spec(format!(
                "duplicate adapter name {:?}: {} and {}",
                r.lora_name, locs[first], locs[i]
            )));
        }
        seen.insert(&r.lora_name, i);
    }
    Ok(())
}

fn parse_text<'a>(
    index: usize,
    text: &'a str,
    refs: &mut Vec<LoRARef>,
    locs: &mut Vec<Loc<'a>>,
) -> Result<()> {
    let loc = Loc::item(index, Quote::Text(text));
    let item = text.trim();
    if let Some(file) = item.strip_prefix('@') {
        for (entry, value) in read_list_file(file.trim(), &loc)?.into_iter().enumerate() {
            let entry_loc = loc.entry(entry, &value);
            let r = match &value {
                Value::String(s) if s.trim_start().starts_with('@') => {
                    return Err(entry_loc.error("an @FILE list cannot name another @FILE"));
                }
                Value::String(s) => parse_line(s, &entry_loc)?,
                Value::Object(map) => parse_object(map, &entry_loc)?,
                other => {
                    return Err(
                        entry_loc.error(&format!("expected a string or an object, got {}", json_type(other)))
                    )
                }
            };
            refs.push(r);
            locs.push(entry_loc);
        }
        return Ok(());
    }
    refs.push(parse_line(item, &loc)?);
    locs.push(loc);
    Ok(())
}

/// One string item that is not `@FILE`.
fn parse_line(text: &str, loc: &Loc) -> Result<LoRARef> {
    let item = text.trim();
    if item.is_empty() {
        return Err(loc.error("the item is empty"));
    }
    if item.starts_with('{') {
        return match serde_json::from_str::<Value>(item) {
            Ok(Value::Object(map)) => {
                match duplicate_key(item) {
                    Some(key) => Err(loc
                        .error(&format!("the key {key:?} appears twice in the object; give each key once"))),
                    None => parse_object(&map, loc),
                }
            }
            Ok(other) => Err(loc.error(&format!("expected a JSON object, got {}", json_type(&other)))),
            Err(e) => Err(loc.error(&format!("malformed JSON: {e}"))),
        };
    }
    let (name, path) = match item.split_once('=') {
        Some((name, path)) => (checked_name(name, loc)?, checked_path(path, loc)?),
        None => {
            let path = checked_path(item, loc)?;
            (path, path)
        }
    };
    Ok(LoRARef::build(name, path, false, None))
}

const SGLANG_KEYS: [&str; 3] = ["lora_name", "lora_path", "pinned"];
const VLLM_KEYS: [&str; 4] = ["name", "path", "base_model_name", "pinned"];

fn parse_object(map: &Map<String, Value>, loc: &Loc) -> Result<LoRARef> {
    for key in map.keys() {
        if !SGLANG_KEYS.contains(&key.as_str()) && !VLLM_KEYS.contains(&key.as_str()) {
            return Err(loc.error(&format!(
                "unknown key {key:?}; allowed keys: \"lora_name\", \"lora_path\", \"pinned\" (SGLang form) \
                 or \"name\", \"path\", \"base_model_name\", \"pinned\" (vLLM form)"
            )));
        }
    }
    let sglang: Vec<&str> = ["lora_name", "lora_path"].into_iter().filter(|k| map.contains_key(*k)).collect();
    let vllm: Vec<&str> =
        ["name", "path", "base_model_name"].into_iter().filter(|k| map.contains_key(*k)).collect();
    if !sglang.is_empty() && !vllm.is_empty() {
        return Err(loc.error(&format!(
            "the object mixes the SGLang keys {sglang:?} with the vLLM keys {vllm:?}; use one form"
        )));
    }
    let (name_key, path_key) = if vllm.is_empty() { ("lora_name", "lora_path") } else { ("name", "path") };
    let name = required_str(map, name_key, loc)?;
    let path = required_str(map, path_key, loc)?;
    let pinned = match map.get("pinned") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(loc.error(&format!(
                "\"pinned\" must be a JSON boolean (true or false), got {} {other}",
                json_type(other)
            )))
        }
    };
    let base_model_name = match map.get("base_model_name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(
                loc.error(&format!("\"base_model_name\" must be a string or null, got {}", json_type(other)))
            )
        }
    };
    let name = checked_name(name, loc)?;
    let path = checked_path(path, loc)?;
    Ok(LoRARef::build(name, path, pinned, base_model_name))
}

fn required_str<'a>(map: &'a Map<String, Value>, key: &str, loc: &Loc) -> Result<&'a str> {
    match map.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(loc.error(&format!("{key:?} must be a string, got {}", json_type(other)))),
        None => Err(loc.error(&format!("missing key {key:?}"))),
    }
}

fn checked_name<'a>(name: &'a str, loc: &Loc) -> Result<&'a str> {
    if name.trim().is_empty() {
        return Err(loc.error("the adapter name is empty"));
    }
    // SGLang keeps the spaces (`a =/p` names `"a "`): trimming would serve another name, another id.
    if name.trim() != name {
        return Err(loc.error(&format!(
            "the adapter name {name:?} has leading or trailing whitespace; remove it (servers differ on \
             whether it is part of the name)"
        )));
    }
    if name.contains('=') {
        return Err(loc.error(&format!("the adapter name {name:?} contains '='")));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(loc.error(&format!("the adapter name {name:?} contains the control character {c:?}")));
    }
    Ok(name)
}

fn checked_path<'a>(path: &'a str, loc: &Loc) -> Result<&'a str> {
    if path.trim().is_empty() {
        return Err(loc.error("the adapter path is empty"));
    }
    if path.trim() != path {
        return Err(loc.error(&format!(
            "the adapter path {path:?} has leading or trailing whitespace; remove it (as written it names \
             another file)"
        )));
    }
    if let Some(c) = path.chars().find(|c| c.is_control()) {
        return Err(loc.error(&format!("the adapter path {path:?} contains the control character {c:?}")));
    }
    Ok(path)
}

/// The largest `@FILE` list read (64 MiB: some hundred thousand adapters), so a wrong path such as
/// `@/dev/zero` cannot exhaust memory.
pub const MAX_LIST_FILE_BYTES: u64 = 64 << 20;

fn read_list_file(file: &str, loc: &Loc) -> Result<Vec<Value>> {
    if file.is_empty() {
        return Err(loc.error("'@' must be followed by the path of a JSON file"));
    }
    let text = read_regular_text(file, MAX_LIST_FILE_BYTES).map_err(|e| match e {
        TextFileError::Io(e) => loc.error(&format!("cannot read the adapter list file {file:?}: {e}")),
        TextFileError::NotRegular => loc.error(&format!(
            "the adapter list file {file:?} is not a regular file (a FIFO, device or folder); only regular \
             files are read"
        )),
        TextFileError::TooLarge => loc.error(&format!(
            "the adapter list file {file:?} is larger than {MAX_LIST_FILE_BYTES} bytes; split it"
        )),
    })?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(entries)) => match duplicate_key(&text) {
            Some(key) => Err(loc.error(&format!(
                "the adapter list file {file:?} has an object in which the key {key:?} appears twice; give \
                 each key once"
            ))),
            None => Ok(entries),
        },
        Ok(other) => Err(loc.error(&format!(
            "the adapter list file {file:?} must hold a JSON array, got {}",
            json_type(&other)
        ))),
        Err(e) => Err(loc.error(&format!("the adapter list file {file:?} is malformed JSON: {e}"))),
    }
}

/// The first key that appears twice in one object anywhere in `text` (valid JSON): `serde_json`
/// keeps the last silently, which would make `{"lora_name": "a", "lora_name": "b"}` adapter "b".
fn duplicate_key(text: &str) -> Option<String> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

    struct Walk;
    impl<'de> DeserializeSeed<'de> for Walk {
        type Value = Option<String>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Walk {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut found = None;
            while let Some(key) = map.next_key::<String>()? {
                let inner = map.next_value_seed(Walk)?;
                if found.is_none() && !seen.insert(key.clone()) {
                    found = Some(key);
                }
                found = found.or(inner);
            }
            Ok(found)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(inner) = seq.next_element_seed(Walk)? {
                found = found.or(inner);
            }
            Ok(found)
        }
        fn visit_bool<E>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_str<E>(self, _: &str) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
    }
    Walk.deserialize(&mut serde_json::Deserializer::from_str(text)).ok().flatten()
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What an error quotes of the item it is about.
#[derive(Debug, Clone, Copy)]
enum Quote<'a> {
    Text(&'a str),
    Object(&'a Map<String, Value>),
    Pair(&'a str, &'a str),
}

/// Where an item came from: its index, and its entry in an `@FILE` list. Rendered only when an error
/// needs it, so the happy path formats nothing.
#[derive(Debug, Clone)]
struct Loc<'a> {
    /// `None` for a ref built at run time rather than parsed from a list.
    index: Option<usize>,
    quote: Quote<'a>,
    /// The entry's index in an `@FILE` list and its rendered quote.
    entry: Option<(usize, String)>,
}

impl<'a> Loc<'a> {
    const MAX_QUOTE: usize = 120;

    fn item(index: usize, quote: Quote<'a>) -> Self {
        Self { index: Some(index), quote, entry: None }
    }

    fn runtime(name: &'a str, path: &'a str) -> Self {
        Self { index: None, quote: Quote::Pair(name, path), entry: None }
    }

    fn entry(&self, entry: usize, value: &Value) -> Self {
        let mut quote = String::new();
        match value {
            Value::String(s) => push_quote(&mut quote, Quote::Text(s)),
            other => push_quote(&mut quote, Quote::Text(&other.to_string())),
        }
        Self { index: self.index, quote: self.quote, entry: Some((entry, quote)) }
    }

    fn error(&self, what: &str) -> Error {
        Error::Spec(format!("{self}: {what}"))
    }
}

fn push_quote(out: &mut String, quote: Quote<'_>) {
    let text = match quote {
        Quote::Text(s) => s.to_owned(),
        Quote::Object(map) => Value::Object(map.clone()).to_string(),
        Quote::Pair(name, path) => format!("{name}={path}"),
    };
    if text.chars().count() > Loc::MAX_QUOTE {
        let cut: String = text.chars().take(Loc::MAX_QUOTE).collect();
        let _ = write!(out, "{cut:?}...");
    } else {
        let _ = write!(out, "{text:?}");
    }
}

impl std::fmt::Display for Loc<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut label = match self.index {
            Some(i) => format!("item {i} ("),
            None => String::from("adapter ("),
        };
        push_quote(&mut label, self.quote);
        label.push(')');
        if let Some((entry, quote)) = &self.entry {
            let _ = write!(label, " entry {entry} ({quote})");
        }
        f.write_str(&label)
    }
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
