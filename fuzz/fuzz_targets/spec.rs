//! Fuzzes the adapter spec parser: any bytes, read as a list of spec items (one per line, every form:
//! `PATH`, `NAME=PATH`, JSON objects), never panic, and every accepted ref formats back to a spec that
//! parses to the same ref. `@FILE` items are skipped: they read the filesystem, which a fuzzer must not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lora_pin_core::spec::{format_ref, parse_items, Limits, SpecItem};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.split('\n');
    // The first line sets the limits, so their cross-checks are fuzzed too.
    let limit = |s: Option<&str>| s.and_then(|s| s.trim().parse::<usize>().ok());
    let header = lines.next().unwrap_or_default();
    let mut numbers = header.split(',');
    let limits =
        Limits { max_loras_per_batch: limit(numbers.next()), max_loaded_loras: limit(numbers.next()) };
    let items: Vec<SpecItem> = lines
        .filter(|l| !l.trim_start().starts_with('@'))
        .map(|l| match serde_json::from_str::<serde_json::Value>(l) {
            // A line starting with a space that holds a JSON object is handed over decoded, as a Python
            // dict would be; every other line is a command-line string.
            Ok(serde_json::Value::Object(map)) if l.starts_with(' ') => SpecItem::Object(map),
            _ => SpecItem::Text(l.to_owned()),
        })
        .collect();
    if let Ok(refs) = parse_items(&items, limits) {
        for r in &refs {
            let again = parse_items(&[SpecItem::Text(format_ref(r))], Limits::default())
                .expect("a formatted ref parses");
            assert_eq!(&again[0], r, "parse(format(ref)) must equal ref");
        }
    }
});
