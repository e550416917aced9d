use super::*;
use proptest::prelude::*;

fn text(items: &[&str]) -> Vec<SpecItem> {
    items.iter().map(|s| SpecItem::Text((*s).to_owned())).collect()
}

fn parse(items: &[&str]) -> Result<Vec<LoRARef>> {
    parse_items(&text(items), Limits::default())
}

fn err(items: &[&str]) -> String {
    match parse(items) {
        Err(Error::Spec(msg)) => msg,
        other => panic!("expected a spec error, got {other:?}"),
    }
}

#[test]
fn bare_path_is_its_own_name() {
    let refs = parse(&["  /models/math  "]).unwrap();
    assert_eq!(refs[0].lora_name, "/models/math");
    assert_eq!(refs[0].lora_path, "/models/math");
    assert!(!refs[0].pinned);
}

#[test]
fn whitespace_around_a_name_or_path_is_refused_not_trimmed() {
    // SGLang keeps it (`a =/p` names "a "): trimming silently would serve another name.
    for (item, what) in [
        ("a =/p", "name \"a \""),
        ("a= /p", "path \" /p\""),
        (r#"{"lora_name": " a", "lora_path": "/p"}"#, "name \" a\""),
        (r#"{"name": "a", "path": "/p\t"}"#, "path \"/p\\t\""),
    ] {
        let msg = err(&[item]);
        assert!(msg.contains(what) && msg.contains("leading or trailing whitespace"), "{item}: {msg}");
    }
    assert!(LoRARef::with_deterministic_id("a ", "/p", false, None).is_err());
    assert_eq!(
        parse(&["  a=/p  "]).unwrap()[0].lora_name,
        "a",
        "the item itself is stripped, as SGLang does"
    );
}

#[test]
fn name_equals_path_splits_on_first_equals() {
    let refs = parse(&["math=/a/b=c"]).unwrap();
    assert_eq!(refs[0].lora_name, "math");
    assert_eq!(refs[0].lora_path, "/a/b=c");
}

#[test]
fn sglang_json_with_and_without_pinned() {
    let refs = parse(&[
        r#"{"lora_name": "a", "lora_path": "/a", "pinned": true}"#,
        r#" {"lora_name": "b", "lora_path": "/b"} "#,
    ])
    .unwrap();
    assert!(refs[0].pinned);
    assert!(!refs[1].pinned);
    assert_eq!(refs[1].lora_path, "/b");
}

#[test]
fn vllm_json_keeps_base_model_name() {
    let refs = parse(&[
        r#"{"name": "a", "path": "/a", "base_model_name": "llama"}"#,
        r#"{"name": "b", "path": "/b", "base_model_name": null, "pinned": true}"#,
    ])
    .unwrap();
    assert_eq!(refs[0].base_model_name.as_deref(), Some("llama"));
    assert_eq!(refs[1].base_model_name, None);
    assert!(refs[1].pinned);
}

#[test]
fn objects_and_pairs() {
    let mut map = Map::new();
    map.insert("lora_name".into(), Value::String("x".into()));
    map.insert("lora_path".into(), Value::String("/x".into()));
    let items = vec![SpecItem::Object(map), SpecItem::Pair { name: "y".into(), path: "/y".into() }];
    let refs = parse_items(&items, Limits::default()).unwrap();
    assert_eq!(refs[0].lora_name, "x");
    assert_eq!(refs[1].lora_path, "/y");
}

#[test]
fn at_file_expands_in_place() {
    let dir = std::env::temp_dir().join(format!("lora_pin_spec_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("list.json");
    std::fs::write(
        &file,
        r#"["a=/a", {"name": "b", "path": "/b"}, "{\"lora_name\": \"c\", \"lora_path\": \"/c\", \"pinned\": true}"]"#,
    )
    .unwrap();
    let at = format!("@{}", file.display());
    let refs = parse(&["first=/f", &at, "last=/l"]).unwrap();
    let names: Vec<_> = refs.iter().map(|r| r.lora_name.as_str()).collect();
    assert_eq!(names, ["first", "a", "b", "c", "last"]);
    assert!(refs[3].pinned);

    std::fs::write(&file, r#"["a=/a", 7]"#).unwrap();
    let msg = err(&["x=/x", &at]);
    assert!(msg.contains("item 1") && msg.contains("entry 1") && msg.contains("a number"), "{msg}");
    std::fs::write(&file, r#"{"a": 1}"#).unwrap();
    assert!(err(&[&at]).contains("must hold a JSON array"));
    std::fs::write(&file, r#"["a=/a", {"name": "b", "path": "/b", "name": "c"}]"#).unwrap();
    assert!(err(&[&at]).contains("the key \"name\" appears twice"));
    std::fs::write(&file, r#"["@other.json"]"#).unwrap();
    assert!(err(&[&at]).contains("cannot name another @FILE"));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(err(&[&at]).contains("cannot read the adapter list file"));
    if std::path::Path::new("/dev/zero").exists() {
        assert!(err(&["@/dev/zero"]).contains("not a regular file"));
    }
    let big = std::env::temp_dir().join(format!("lora_pin_big_list_{}.json", std::process::id()));
    std::fs::File::create(&big).unwrap().set_len(MAX_LIST_FILE_BYTES + 1).unwrap(); // sparse
    assert!(err(&[&format!("@{}", big.display())]).contains("is larger than"));
    std::fs::remove_file(&big).unwrap();
    assert!(err(&["@"]).contains("must be followed by the path"));
}

#[cfg(unix)]
#[test]
fn an_at_file_that_is_a_fifo_is_refused_without_blocking() {
    let fifo = std::env::temp_dir().join(format!("lora_pin_fifo_{}", std::process::id()));
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        return; // no mkfifo on this system
    }
    let item = format!("@{}", fifo.display());
    let (tx, rx) = std::sync::mpsc::channel();
    // On a thread: opened the blocking way, the open would wait for a writer forever.
    std::thread::spawn(move || tx.send(err(&[&item])));
    // A hang guard: the refusal takes microseconds; a blocking open would wait for ever.
    let msg = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("parsing a FIFO @FILE blocked");
    std::fs::remove_file(&fifo).unwrap();
    assert!(msg.contains("item 0") && msg.contains("not a regular file"), "{msg}");
}

#[test]
fn deterministic_ids_depend_on_name_and_path_only() {
    let a = parse(&["m=/p"]).unwrap();
    let b = parse(&[r#"{"lora_name": "m", "lora_path": "/p", "pinned": true}"#]).unwrap();
    assert_eq!(a[0].lora_id, b[0].lora_id);
    assert_ne!(a[0].lora_id, parse(&["m=/q"]).unwrap()[0].lora_id);
    // The NUL separator keeps ("ab", "c") and ("a", "bc") apart.
    assert_ne!(deterministic_id("ab", "c"), deterministic_id("a", "bc"));
    assert_eq!(a[0].lora_id.len(), 32);
    let fresh = LoRARef::with_random_id("m", "/p", false).unwrap();
    assert_ne!(fresh.lora_id, a[0].lora_id);
}

#[test]
fn errors_name_the_index_and_quote_the_item() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["ok=/a", "   "], &["item 1", "empty"]),
        (&["=/a"], &["item 0", "name is empty"]),
        (&["a="], &["item 0", "path is empty"]),
        (&["a\u{7}b=/x"], &["control character"]),
        (&["{\"lora_name\": \"a\""], &["malformed JSON", "line 1 column"]),
        (&["{} x"], &["malformed JSON"]),
        (
            &[r#"{"lora_name": "a", "lora_path": "/a", "pin": true}"#],
            &["unknown key \"pin\"", "allowed keys"],
        ),
        (&[r#"{"lora_name": "a", "lora_path": "/a", "pinned": "false"}"#], &["JSON boolean", "a string"]),
        (&[r#"{"lora_name": "a"}"#], &["missing key \"lora_path\""]),
        (&[r#"{"path": "/a"}"#], &["missing key \"name\""]),
        (&[r#"{"lora_name": 3, "lora_path": "/a"}"#], &["\"lora_name\" must be a string"]),
        (&[r#"{"name": "a", "path": "/a", "base_model_name": 1}"#], &["base_model_name"]),
        (&[r#"{"lora_name": "a", "path": "/a"}"#], &["mixes"]),
        (&[r#"{"lora_name": "a=b", "lora_path": "/a"}"#], &["contains '='"]),
        (&[r#"{"lora_name": "  ", "lora_path": "/a"}"#], &["name is empty"]),
        (&[r#"{"lora_name": "a", "lora_path": "/a", "lora_name": "b"}"#], &["\"lora_name\" appears twice"]),
        (
            &[r#"{"name": "a", "path": "/a", "base_model_name": null, "path": "/b"}"#],
            &["\"path\" appears twice"],
        ),
    ];
    for (items, needles) in cases {
        let msg = err(items);
        for needle in *needles {
            assert!(msg.contains(needle), "{items:?}: {msg:?} lacks {needle:?}");
        }
        let last = items.len() - 1;
        assert!(msg.contains(&format!("item {last} (")), "{msg}");
    }
}

#[test]
fn duplicate_names_name_both_items_but_shared_paths_are_fine() {
    let msg = err(&["a=/x", "b=/y", r#"{"lora_name": "a", "lora_path": "/z"}"#]);
    assert!(msg.contains("duplicate adapter name \"a\""), "{msg}");
    assert!(msg.contains("item 0") && msg.contains("item 2"), "{msg}");
    assert_eq!(parse(&["a=/same", "b=/same"]).unwrap().len(), 2);
}

#[test]
fn limit_cross_checks_give_the_numbers() {
    let items = text(&[
        r#"{"lora_name": "a", "lora_path": "/a", "pinned": true}"#,
        r#"{"lora_name": "b", "lora_path": "/b", "pinned": true}"#,
        "c=/c",
    ]);
    let lim = |slots, loaded| Limits { max_loras_per_batch: slots, max_loaded_loras: loaded };
    let msg = |l| match parse_items(&items, l) {
        Err(Error::Spec(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(msg(lim(Some(0), None)).contains("at least 1 (got 0)"));
    let m = msg(lim(Some(2), None));
    assert!(m.contains("2 adapters are pinned") && m.contains("at most 1"), "{m}");
    assert!(msg(lim(Some(4), Some(3))).contains("max_loaded_loras=3 must be >= max_loras_per_batch=4"));
    let m = msg(lim(Some(2), Some(2)));
    assert!(m.contains("pinned"), "{m}");
    let m = msg(lim(Some(3), Some(2)));
    assert!(m.contains("max_loaded_loras=2"), "{m}");
    assert!(parse_items(&items, lim(Some(3), Some(3))).is_ok());
    let m = match parse_items(&items, lim(None, Some(2))) {
        Err(Error::Spec(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("3 adapters were given") && m.contains("max_loaded_loras=2"), "{m}");
}

#[test]
fn format_picks_the_shortest_faithful_form() {
    let r =
        |name: &str, path: &str, pinned| LoRARef::with_deterministic_id(name, path, pinned, None).unwrap();
    assert_eq!(format_ref(&r("/p", "/p", false)), "/p");
    assert_eq!(format_ref(&r("n", "/p=q", false)), "n=/p=q");
    assert!(format_ref(&r("n", "/p", true)).starts_with('{'));
    assert!(format_ref(&r("{n", "/p", false)).starts_with('{'));
    assert!(format_ref(&r("@n", "@n", false)).starts_with('{'));
}

fn arb_ref() -> impl Strategy<Value = LoRARef> {
    let name = "[^=\\p{Cc}]{1,12}".prop_filter("non-blank", |s| !s.trim().is_empty());
    let path = "[^\\p{Cc}]{1,20}".prop_filter("non-blank", |s| !s.trim().is_empty());
    let base = proptest::option::of("[a-z/]{0,8}");
    (name, path, any::<bool>(), base).prop_map(|(n, p, pinned, base)| {
        LoRARef::with_deterministic_id(n.trim(), p.trim(), pinned, base).unwrap()
    })
}

proptest! {
    #[test]
    fn arbitrary_text_never_panics(items in proptest::collection::vec(".{0,40}", 0..6)) {
        let items: Vec<SpecItem> = items.into_iter().map(SpecItem::Text).collect();
        let _ = parse_items(&items, Limits { max_loras_per_batch: Some(2), max_loaded_loras: Some(4) });
    }

    #[test]
    fn json_like_text_never_panics(body in "\\{[\"a-z_:, {}\\[\\]0-9truefalsn]{0,60}") {
        let _ = parse_items(&[SpecItem::Text(body)], Limits::default());
    }

    #[test]
    fn parse_of_format_is_identity(r in arb_ref()) {
        let back = parse_items(&[SpecItem::Text(format_ref(&r))], Limits::default()).unwrap();
        prop_assert_eq!(back, vec![r]);
    }
}
