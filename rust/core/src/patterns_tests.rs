//! Tests of the config-regex matcher: PEFT anchoring, refusals by name, keys, limits, captures.

use super::*;

fn set(patterns: &[&str], anchoring: Anchoring) -> PatternSet {
    PatternSet::new(patterns, anchoring).unwrap()
}

fn refusal(pattern: &str) -> String {
    match PatternSet::new(&[pattern], Anchoring::Full) {
        Err(PatternError::Refused { index: 0, why }) => why,
        other => panic!("{pattern:?} should be refused, got {other:?}"),
    }
}

const KEY: &str = "model.layers.0.self_attn.q_proj";

#[test]
fn fullmatch_and_match_anchor_as_python() {
    let full = set(&[r".*q_proj", "q_proj", r"model\..*"], Anchoring::Full);
    assert_eq!(full.matching(KEY).unwrap(), [0, 2]);
    let start = set(&["model", "layers", r"(.*\.)?(q_proj)$", r"(.*\.)?(self_attn)$"], Anchoring::Start);
    assert_eq!(start.matching(KEY).unwrap(), [0, 2]);
    assert_eq!(start.first_match(KEY).unwrap(), Some(0));
    assert_eq!(start.first_match("lm_head").unwrap(), None);
}

#[test]
fn a_dotted_suffix_starts_at_the_key_or_after_a_dot_and_sees_what_precedes() {
    let suffix = set(
        &["q_proj", "self_attn", r"self_attn\.q_proj", "proj", r"^q_proj", r"\bq_proj", "0.*q", r"x|q_proj"],
        Anchoring::DottedSuffix,
    );
    // "proj" is no dotted suffix; "^" only holds at the key's start; "\b" holds after the dot.
    assert_eq!(suffix.matching(KEY).unwrap(), [0, 2, 5, 7]);
    assert_eq!(suffix.matching("q_proj").unwrap(), [0, 4, 5, 7]);
}

#[test]
fn a_top_level_alternation_stays_inside_the_anchors() {
    // Python: re.fullmatch("a|b.*", "ab") matches through the second branch only.
    let full = set(&["a|b.*", "x|model.*"], Anchoring::Full);
    assert_eq!(full.matching("ab").unwrap(), Vec::<usize>::new());
    assert_eq!(full.matching(KEY).unwrap(), [1]);
}

#[test]
fn the_exponential_pattern_matches_in_linear_time() {
    let pattern = format!("{}X", "(?:.|.)".repeat(40));
    let full = set(&[pattern.as_str()], Anchoring::Full);
    let start = std::time::Instant::now();
    assert_eq!(full.first_match(KEY).unwrap(), None);
    assert_eq!(full.first_match(&format!("{}X", "a".repeat(40))).unwrap(), Some(0));
    // A hang guard, not a benchmark: microseconds in linear time, however busy the machine; days for a
    // backtracking engine's 2^40 ways.
    assert!(start.elapsed().as_secs_f64() < 60.0);
}

#[test]
fn python_end_of_string_is_read_as_the_crates() {
    let full = set(&[r"q_proj\Z", r"\\Z"], Anchoring::Start);
    assert_eq!(full.first_match("q_proj").unwrap(), Some(0));
    assert_eq!(full.first_match("q_projx").unwrap(), None);
    assert_eq!(full.first_match(r"\Z").unwrap(), Some(1)); // an escaped backslash, then Z
}

#[test]
fn python_only_constructs_are_refused_by_name() {
    for (pattern, named) in [
        (r"(?=a)a", "look-around"),
        (r"(?!vision).*", "look-around"),
        (r"(?<=a)b", "look-around"),
        (r"(?<!a)b", "look-around"),
        (r"(a)\1", "back-reference"),
        (r"(?P<x>a)(?P=x)", "named back-reference"),
        (r"(?>a)", "atomic group"),
        (r"(a)?(?(1)b|c)", "conditional"),
        (r"a(?#note)", "comment"),
        (r"a*+", "possessive"),
        (r"a{2}+", "possessive"),
    ] {
        let why = refusal(pattern);
        assert!(why.contains(named), "{pattern:?}: {why}");
    }
}

#[test]
fn syntax_read_differently_is_refused() {
    for (pattern, named) in [
        (r"\<q", "literal characters"),
        (r"q\b{end}", "literal characters"),
        (r"[[a]]", "nested class"),
        (r"[a&&b]", "nested class"),
        (r"[a~~b]", "nested class"),
        (r"[[:alpha:]]", "nested class"),
        (r"\pL", "Unicode class"),
        (r"\x{41}", "braced escape"),
        (r"(?x)a b", "flag 'x'"),
        (r"(?U)a*", "flag 'U'"),
        (r"a(?i)b", "after the start"),
        (r"(?i)\u212a", "non-ASCII"),
        (r"(?i:[a-\u0130])", "non-ASCII"),
        (r"(?<n>a)", "(?P<name>"),
        ("[é]", "byte-wise"),
    ] {
        let why = refusal(pattern);
        assert!(why.contains(named), "{pattern:?}: {why}");
    }
}

#[test]
fn flags_that_open_the_pattern_apply_to_all_of_it() {
    let full = set(&[r"(?i)MODEL\..*", r"(?s)(?i)m.*", r"(?i:M)odel.*", r"(?-i:M)odel.*"], Anchoring::Full);
    assert_eq!(full.matching(KEY).unwrap(), [0, 1, 2]);
    // Non-ASCII without case folding is fine: it can only fail to match an ASCII key.
    assert_eq!(set(&["é.*"], Anchoring::Full).first_match(KEY).unwrap(), None);
}

#[test]
fn keys_outside_printable_ascii_are_refused() {
    let full = set(&[".*"], Anchoring::Full);
    for key in ["a\n", "é", "a\tb", "\x7f", ""] {
        assert_eq!(full.first_match(key), Err(PatternError::Key { key: key.to_owned() }));
    }
    assert_eq!(full.first_match(" ~").unwrap(), Some(0));
}

#[test]
fn counted_repetitions_past_the_size_limit_are_refused() {
    let err = PatternSet::new(&[r"(?:.{1000}){1000}"], Anchoring::Full).unwrap_err();
    assert!(matches!(err, PatternError::Refused { .. } | PatternError::TooLarge { .. }), "{err}");
}

#[test]
fn used_by_reports_each_pattern_that_matched_a_key() {
    let suffix = set(&["q_proj", "lm_head", ".*proj"], Anchoring::DottedSuffix);
    let keys = [KEY, "model.layers.0.mlp.down_proj"];
    assert_eq!(suffix.used_by(&keys).unwrap(), [true, false, true]);
}

#[test]
fn group_captures_as_a_backtracking_engine_would() {
    let layers =
        set(&[r"(?:^|.*?\.)blocks\.(?P<idx>\d+)\.", r"(?:^|.*?\.)layers\.(?P<idx>\d+)\."], Anchoring::Start);
    assert_eq!(layers.group("model.layers.12.layers.3.mlp", "idx").unwrap(), Some("12"));
    assert_eq!(layers.group("blocks.7.x.layers.2.y", "idx").unwrap(), Some("7"));
    assert_eq!(layers.group("model.embed", "idx").unwrap(), None);
    let branch = set(&[r"(?:^|.*?\.)a|b\.(?P<idx>\d+)\."], Anchoring::Start);
    assert_eq!(branch.group("a.1.", "idx").unwrap(), None); // matched by the branch without the group
}
