//! The header of an adapter's safetensors weight file: every tensor's dtype, shape and byte range,
//! checked as the format requires, and the LoRA pairs PEFT saved among them (what
//! `lora_pin/weights/reader.py` reads a file by).
//!
//! The header is untrusted: every entry is checked (a known dtype, a shape of sizes, `[begin, end]`
//! offsets holding exactly the shape's bytes) and the ranges must lie back to back over the whole data,
//! so each tensor's bytes are its own. Errors say what was wrong in the words the Python reader used
//! (values shown as Python shows them).

use std::collections::HashMap;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

/// The prefix of every tensor name PEFT saves (before the module key).
pub const PEFT_PREFIX: &str = "base_model.model.";

/// One tensor of a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// Its name (`base_model.model.<module>.lora_A.weight` for PEFT's).
    pub name: String,
    /// Its safetensors dtype name (`F32`).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its first byte's offset from the file's start.
    pub begin: u64,
    /// The offset just past its last byte.
    pub end: u64,
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// It names more tensors than the caller's limit (the count; nothing else was checked).
    TooMany(usize),
    /// It breaks the format; the message says where.
    Invalid(String),
}

/// One module's LoRA pair among a header's tensors (indexes into them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraPair {
    /// The module's key, relative to the base model (`model.layers.0.self_attn.q_proj`).
    pub module_key: String,
    /// Its A (`[r, in]`).
    pub a: usize,
    /// Its B (`[out, r]`).
    pub b: usize,
    /// Whether it is an embedding's (`lora_embedding_A`/`_B`).
    pub embedding: bool,
    /// Its DoRA magnitude vector (`[out]`), if it has one.
    pub magnitude: Option<usize>,
}

/// The element size of each dtype the safetensors format names.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

/// The header's entries in file order; a key given twice keeps its first place and its last value
/// (as a Python dict built from the JSON does).
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct Walk;
        impl<'de> Visitor<'de> for Walk {
            type Value = Option<Entries>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
                let mut entries: Vec<(String, Value)> = Vec::new();
                let mut at: HashMap<String, usize> = HashMap::new();
                while let Some((key, value)) = map.next_entry::<String, Value>()? {
                    match at.get(&key) {
                        Some(&i) => entries[i].1 = value,
                        None => {
                            at.insert(key.clone(), entries.len());
                            entries.push((key, value));
                        }
                    }
                }
                Ok(Some(Entries(entries)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                while seq.next_element::<Value>()?.is_some() {}
                Ok(None)
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
        match deserializer.deserialize_any(Walk)? {
            Some(entries) => Ok(entries),
            None => Err(serde::de::Error::custom(NOT_AN_OBJECT)),
        }
    }
}

const NOT_AN_OBJECT: &str = "the header is not a JSON object";

/// Every tensor of the safetensors header `json` (the JSON after the 8-byte length), in the header's
/// order, with offsets from the file's start: its data starts at byte `data_start` and the file is
/// `file_size` bytes long. `__metadata__` is skipped.
///
/// # Errors
/// [`HeaderError::TooMany`] when it names more than `max_tensors` tensors (checked before any entry);
/// [`HeaderError::Invalid`] when it is not a JSON object, an entry is not an object, has an unknown
/// dtype, a shape that is not a list of sizes, offsets that are not `[begin, end]` or that do not hold
/// the shape's bytes, or the ranges do not lie back to back over the data (`data_start..file_size`).
pub fn index_header(
    json: &[u8],
    data_start: u64,
    file_size: u64,
    max_tensors: usize,
) -> Result<Vec<StoredTensor>, HeaderError> {
    let entries = match serde_json::from_slice::<Entries>(json) {
        Ok(Entries(entries)) => entries,
        Err(e) if e.to_string().starts_with(NOT_AN_OBJECT) => {
            return Err(HeaderError::Invalid(NOT_AN_OBJECT.to_string()));
        }
        Err(e) => return Err(HeaderError::Invalid(format!("the header is not JSON: {e}"))),
    };
    let count = entries.iter().filter(|(k, _)| k != "__metadata__").count();
    if count > max_tensors {
        return Err(HeaderError::TooMany(count));
    }
    let mut tensors = Vec::with_capacity(count);
    for (name, entry) in entries {
        if name != "__metadata__" {
            tensors.push(stored_entry(name, &entry, data_start)?);
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].begin, tensors[i].end));
    let mut position = data_start;
    for i in order {
        let t = &tensors[i];
        if t.begin != position {
            return Err(HeaderError::Invalid(format!(
                "tensor {} starts at {}, expected {}",
                py_str(&t.name),
                t.begin - data_start,
                position - data_start
            )));
        }
        position = t.end;
    }
    if position != file_size {
        return Err(HeaderError::Invalid(format!(
            "tensors cover {} bytes of {}",
            position - data_start,
            file_size.saturating_sub(data_start)
        )));
    }
    Ok(tensors)
}

fn stored_entry(name: String, entry: &Value, data_start: u64) -> Result<StoredTensor, HeaderError> {
    let fail = |why: String| Err(HeaderError::Invalid(format!("tensor {}: {why}", py_str(&name))));
    let Value::Object(fields) = entry else {
        return fail(format!("expected an object, got {}", shown(entry, 80)));
    };
    let none = Value::Null;
    let (dtype, shape, offsets) = (
        fields.get("dtype").unwrap_or(&none),
        fields.get("shape").unwrap_or(&none),
        fields.get("data_offsets").unwrap_or(&none),
    );
    let Some((dtype, size)) = dtype.as_str().and_then(|d| Some((d, dtype_size(d)?))) else {
        return fail(format!("unknown dtype {}", shown(dtype, 40)));
    };
    let dims: Option<Vec<u64>> = shape.as_array().and_then(|dims| dims.iter().map(Value::as_u64).collect());
    let Some(dims) = dims else {
        return fail(format!("shape {} is not a list of sizes", shown(shape, 80)));
    };
    let range = match offsets.as_array().map(Vec::as_slice) {
        Some([begin, end]) => begin.as_u64().zip(end.as_u64()).filter(|(b, e)| b <= e),
        _ => None,
    };
    let Some((begin, end)) = range else {
        return fail(format!("data_offsets {} are not [begin, end]", shown(offsets, 80)));
    };
    let bytes = dims.iter().try_fold(size, |n, &d| n.checked_mul(d));
    let placed = begin.checked_add(data_start).zip(end.checked_add(data_start));
    match (bytes, placed) {
        (Some(bytes), Some((first, last))) if bytes == end - begin => {
            Ok(StoredTensor { name, dtype: dtype.to_string(), shape: dims, begin: first, end: last })
        }
        _ => fail(format!("{} bytes do not hold shape {} of {dtype}", end - begin, py_repr(shape))),
    }
}

/// One half of a module's pair: which (`'a'`, `'b'` or `'m'` for a magnitude) and whether it is an
/// embedding's, and the tensor's index.
type Half = ((char, bool), usize);

/// The LoRA pairs among a header's `tensors` (PEFT's names: `base_model.model.<module>.lora_A.weight`
/// and `.lora_B.weight`, `.lora_embedding_A` and `_B` for an embedding, and `.lora_magnitude_vector`
/// beside either for DoRA), in the order their modules' first tensor comes, and the indexes of every
/// tensor in no complete pair, by name. A module with halves of both kinds, a half twice, or no A or no
/// B has no pair: its tensors are unused.
///
/// # Errors
/// A pair's A or B is not 2-D (the message names the tensor and its shape).
pub fn lora_pairs(tensors: &[StoredTensor]) -> Result<(Vec<LoraPair>, Vec<usize>), String> {
    // Per module, in first-seen order: each half's (half, is_embedding) and tensor index.
    let mut modules: Vec<(&str, Vec<Half>)> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    let mut unused: Vec<usize> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        // Every suffix starts with ".lora_" and holds it once: the name's tail from its last ".lora_" is
        // its suffix, if it has one. A tensor without PEFT's prefix is unused, never a module's half.
        let half = t.name.rfind(".lora_").filter(|_| t.name.starts_with(PEFT_PREFIX)).and_then(|cut| {
            let kind = match &t.name[cut..] {
                ".lora_A.weight" => ('a', false),
                ".lora_B.weight" => ('b', false),
                ".lora_embedding_A" => ('a', true),
                ".lora_embedding_B" => ('b', true),
                ".lora_magnitude_vector" => ('m', false),
                _ => return None,
            };
            Some((&t.name[PEFT_PREFIX.len()..cut], kind))
        });
        let Some((module, kind)) = half else {
            unused.push(i);
            continue;
        };
        let slot = *at.entry(module).or_insert_with(|| {
            modules.push((module, Vec::new()));
            modules.len() - 1
        });
        let halves = &mut modules[slot].1;
        match halves.iter_mut().find(|(k, _)| *k == kind) {
            Some(held) => held.1 = i,
            None => halves.push((kind, i)),
        }
    }
    let mut pairs = Vec::new();
    for (module, halves) in modules {
        // A linear's pair and an embedding's are never mixed; a half given under both kinds is one too
        // many; a magnitude takes the kind of the pair it sits beside.
        let kinds: Vec<bool> = halves.iter().filter(|((h, _), _)| *h != 'm').map(|((_, e), _)| *e).collect();
        let embedding = kinds.iter().any(|&e| e);
        let find = |half: char| halves.iter().find(|((h, _), _)| *h == half).map(|(_, i)| *i);
        let per_half = ['a', 'b', 'm'].iter().filter(|&&h| find(h).is_some()).count();
        let (Some(a), Some(b)) = (find('a'), find('b')) else {
            unused.extend(halves.iter().map(|(_, i)| *i));
            continue;
        };
        if kinds.iter().any(|&e| e != embedding) || per_half != halves.len() {
            unused.extend(halves.iter().map(|(_, i)| *i));
            continue;
        }
        for i in [a, b] {
            if tensors[i].shape.len() != 2 {
                return Err(format!(
                    "tensor {} has shape {}, expected 2-D",
                    py_str(&tensors[i].name),
                    py_list(&tensors[i].shape)
                ));
            }
        }
        pairs.push(LoraPair { module_key: module.to_string(), a, b, embedding, magnitude: find('m') });
    }
    unused.sort_by(|&x, &y| tensors[x].name.cmp(&tensors[y].name));
    Ok((pairs, unused))
}

/// `value` as Python's `repr` shows what `orjson.loads` makes of it, cut to `limit` characters (as
/// `format(repr(value), f".{limit}")`).
fn shown(value: &Value, limit: usize) -> String {
    py_repr(value).chars().take(limit).collect()
}

fn py_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".to_string(),
        Value::Bool(b) => (if *b { "True" } else { "False" }).to_string(),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(x) if x.is_finite() && x == x.trunc() && x.abs() < 1e16 => format!("{x:.1}"),
            _ => n.to_string(),
        },
        Value::String(s) => py_str(s),
        Value::Array(items) => format!("[{}]", items.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Object(fields) => format!(
            "{{{}}}",
            fields
                .iter()
                .map(|(k, v)| format!("{}: {}", py_str(k), py_repr(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn py_list(dims: &[u64]) -> String {
    format!("[{}]", dims.iter().map(u64::to_string).collect::<Vec<_>>().join(", "))
}

/// A string as Python's `repr` shows it (single quotes unless it holds one and no double quote).
fn py_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(entries: &[(&str, &str, &[u64])]) -> (Vec<u8>, u64) {
        let mut at = 0;
        let mut fields = Vec::new();
        for (name, dtype, shape) in entries {
            let bytes = dtype_size(dtype).unwrap() * shape.iter().product::<u64>();
            fields.push(format!(
                "\"{name}\": {{\"dtype\": \"{dtype}\", \"shape\": {shape:?}, \"data_offsets\": [{at}, {}]}}",
                at + bytes
            ));
            at += bytes;
        }
        (format!("{{\"__metadata__\": {{\"format\": \"pt\"}}, {}}}", fields.join(", ")).into_bytes(), at)
    }

    #[test]
    fn a_header_is_indexed_in_its_order_with_file_offsets() {
        let (json, data) = header(&[("z", "F32", &[2, 3]), ("a", "F16", &[4])]);
        let got = index_header(&json, 100, 100 + data, 10).unwrap();
        assert_eq!(got.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["z", "a"]);
        assert_eq!((got[0].begin, got[0].end, got[1].begin, got[1].end), (100, 124, 124, 132));
        assert_eq!(got[0].shape, [2, 3]);
        assert_eq!(index_header(&json, 100, 100 + data, 1), Err(HeaderError::TooMany(2)));
    }

    #[test]
    fn a_broken_header_is_refused_saying_what_is_wrong() {
        let refused = |json: &str, size: u64| match index_header(json.as_bytes(), 8, 8 + size, 10) {
            Err(HeaderError::Invalid(why)) => why,
            other => panic!("{json}: {other:?}"),
        };
        assert!(refused("{", 0).starts_with("the header is not JSON: "));
        assert_eq!(refused("[1]", 0), "the header is not a JSON object");
        assert_eq!(refused(r#"{"t": [1]}"#, 0), "tensor 't': expected an object, got [1]");
        let entry = |body: &str| format!(r#"{{"t": {{{body}}}}}"#);
        assert_eq!(
            refused(&entry(r#""dtype": "F33", "shape": [], "data_offsets": [0, 4]"#), 4),
            "tensor 't': unknown dtype 'F33'"
        );
        assert_eq!(
            refused(&entry(r#""dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]"#), 4),
            "tensor 't': shape [1.0] is not a list of sizes"
        );
        assert_eq!(
            refused(&entry(r#""dtype": "F32", "shape": [true], "data_offsets": [0, 4]"#), 4),
            "tensor 't': shape [True] is not a list of sizes"
        );
        assert_eq!(
            refused(&entry(r#""dtype": "F32", "shape": [1], "data_offsets": [4, 0]"#), 4),
            "tensor 't': data_offsets [4, 0] are not [begin, end]"
        );
        assert_eq!(
            refused(&entry(r#""dtype": "F32", "shape": [2], "data_offsets": [0, 4]"#), 4),
            "tensor 't': 4 bytes do not hold shape [2] of F32"
        );
        let two = r#"{"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]},
                      "b": {"dtype": "U8", "shape": [1], "data_offsets": [3, 4]}}"#;
        assert_eq!(refused(two, 4), "tensor 'a' starts at 1, expected 0");
        let gap = r#"{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}"#;
        assert_eq!(refused(gap, 3), "tensors cover 1 bytes of 3");
    }

    #[test]
    fn pairs_are_found_by_peft_names_and_the_rest_is_unused() {
        let p = PEFT_PREFIX;
        let names = [
            format!("{p}m.q.lora_A.weight"),
            format!("{p}m.q.lora_B.weight"),
            format!("{p}m.e.lora_embedding_B"),
            format!("{p}m.e.lora_embedding_A"),
            format!("{p}m.d.lora_A.weight"),
            format!("{p}m.d.lora_magnitude_vector"),
            format!("{p}m.d.lora_B.weight"),
            format!("{p}m.x.lora_A.weight"),
            format!("{p}m.y.lora_A.weight"),
            format!("{p}m.y.lora_embedding_B"),
            "m.q.lora_A.weight".to_string(),
        ];
        let tensors: Vec<StoredTensor> = names
            .iter()
            .map(|n| StoredTensor {
                name: n.clone(),
                dtype: "F32".into(),
                shape: vec![1, 1],
                begin: 0,
                end: 4,
            })
            .collect();
        let (pairs, unused) = lora_pairs(&tensors).unwrap();
        let found: Vec<(&str, usize, usize, bool, Option<usize>)> =
            pairs.iter().map(|p| (p.module_key.as_str(), p.a, p.b, p.embedding, p.magnitude)).collect();
        assert_eq!(
            found,
            [("m.q", 0, 1, false, None), ("m.e", 3, 2, true, None), ("m.d", 4, 6, false, Some(5))]
        );
        assert_eq!(unused, [7, 8, 9, 10]);
        let mut flat = tensors[..2].to_vec();
        flat[0].shape = vec![4];
        assert_eq!(
            lora_pairs(&flat),
            Err(format!("tensor '{p}m.q.lora_A.weight' has shape [4], expected 2-D"))
        );
    }

    #[test]
    fn values_are_shown_as_python_shows_them() {
        let v: Value = serde_json::from_str(r#"{"k": [1, -2, 2.5, 3.0, null, false, "it's"]}"#).unwrap();
        assert_eq!(py_repr(&v), r#"{'k': [1, -2, 2.5, 3.0, None, False, "it's"]}"#);
        assert_eq!(shown(&v, 8), "{'k': [1");
    }
}
