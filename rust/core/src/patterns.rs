//! Regexes from adapter configs, matched in time linear in the module key whatever the patterns.
//!
//! PEFT configs hold Python `re` patterns (`target_modules` as a string, `rank_pattern` and
//! `alpha_pattern` keys, `layers_pattern`, `exclude_modules`) that PEFT matches with Python's
//! backtracking engine, where one crafted pattern costs 2^K steps per module name. Here a field's
//! patterns are compiled once into a [`PatternSet`]: one multi-pattern regex of the `regex` crate's
//! engine (`regex-automata`), whose automata never backtrack, so one pass over a key costs
//! O(key length x compiled size) and reports every pattern that matches (the first in file order is
//! the lowest index). Each pattern is parsed once: the syntax tree that is checked below is the one
//! compiled.
//!
//! A set gives the answer Python's `re` gives, or refuses the pattern; it never answers differently:
//! - Keys must be non-empty printable ASCII (space to `~`). On those `.`, `$`, `\w`, `\d`, `\s`, `\b`,
//!   `\B` and case-insensitive ASCII letters mean the same in both engines (Python's `$` also matches
//!   before a final newline, its `\s` and `\w` cover other characters than the crate's, and before
//!   3.14 its `\B` never matches in an empty string; none of that can occur in such a key), so the sets
//!   are compiled byte-wise, without Unicode tables.
//! - Python constructs the crate lacks are refused, naming the construct: look-around,
//!   back-references, atomic groups, possessive quantifiers, conditionals and comment groups.
//! - Syntax both accept with different meanings is refused: `\<`, `\>` and `\b{...}` (word
//!   boundaries in the crate, literals in Python), nested classes and class set operations (`[[`,
//!   `&&`, `--`, `~~`: literal characters in Python), flags other than `i`, `m` and `s`, flags set
//!   anywhere but at the start (Python 3.10 applies them to the whole pattern, the crate from where
//!   they stand), and non-ASCII characters under `i` (the two fold case differently).
//! - `\Z` (Python's end of string) is the crate's `\z`.
//!
//! Whether Python accepts a pattern at all is Python's to say (`re.compile`, in the caller): a set
//! is only built from patterns Python compiles.

use std::fmt;
use std::sync::OnceLock;

use regex_automata::meta::{self, Regex};
use regex_automata::nfa::thompson::WhichCaptures;
use regex_automata::{Anchored, Input, MatchKind};
use regex_syntax::ast::{self, Ast};
use regex_syntax::hir::{translate::TranslatorBuilder, Hir, Look};

/// The most bytes a field's patterns may compile to together (the NFA size limit): 4,096 full
/// module names (`base_model\.model\.model\.layers\.79\.self_attn\.q_proj`) take more than 8 MiB; a
/// counted repetition such as `(?:.{1000}){1000}` does not fit, and is refused instead of taking
/// memory and time proportional to its counts. Matching a key costs at worst key length x this
/// size, when the patterns defeat the lazy DFA's cache.
pub const MAX_COMPILED_BYTES: usize = 16 << 20;

/// The lazy DFA's cache per set and thread: the states of 4,096 module-name patterns over a model's
/// keys take about 4 MiB (at 2 MiB the cache thrashes and matching falls back to the NFA simulation,
/// 250x slower there).
pub const DFA_CACHE_BYTES: usize = 8 << 20;

/// How a pattern is applied to a key, as Python's `re` applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchoring {
    /// `re.match`: the match starts at the key's start and may end anywhere.
    Start,
    /// `re.fullmatch`: the match covers the whole key.
    Full,
    /// PEFT's `rank_pattern` / `alpha_pattern` rule, `re.match(rf"(.*\.)?({pattern})$", key)`: the
    /// pattern covers the key from its start or from just after one of its dots to its end. Matched
    /// from each such start in turn (a dotted module key has a handful), with the characters before it
    /// still seen by `^` and `\b`: the one `.*` that opens every PEFT form would otherwise make each
    /// of thousands of patterns live at every dot, too many automaton states to cache.
    DottedSuffix,
}

/// Why a set could not be built, or a key could not be matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PatternError {
    /// Pattern `index` uses a construct that would match differently from Python's `re`, or none.
    Refused {
        /// The pattern's position in the list given.
        index: usize,
        /// What it uses, e.g. "uses look-around ((?=, (?!, (?<= or (?<!)".
        why: String,
    },
    /// The patterns together compile past [`MAX_COMPILED_BYTES`].
    TooLarge {
        /// How many patterns were given.
        count: usize,
    },
    /// A key is empty or holds a character outside printable ASCII.
    Key {
        /// The key, as given.
        key: String,
    },
}

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PatternError::Refused { index, why } => write!(f, "pattern {index} {why}"),
            PatternError::TooLarge { count } => write!(
                f,
                "the {count} pattern(s) together compile to more than MAX_COMPILED_BYTES={MAX_COMPILED_BYTES} bytes"
            ),
            PatternError::Key { key } => write!(
                f,
                "module key {key:?} is empty or holds a character outside printable ASCII; config regexes \
                 are matched only against non-empty printable-ASCII module keys, where they match as \
                 Python's re does"
            ),
        }
    }
}

impl std::error::Error for PatternError {}

/// A field's patterns, compiled once: which patterns match a key, in one linear-time pass.
#[derive(Debug)]
pub struct PatternSet {
    patterns: Vec<String>,
    // Each pattern as compiled: anchored, in the crate's syntax tree.
    hirs: Vec<Hir>,
    anchoring: Anchoring,
    set: Regex,
    // One regex per pattern, built on first use, for the capture groups a set does not report.
    single: Vec<OnceLock<Regex>>,
}

impl PatternSet {
    /// Compiles `patterns` (Python `re` syntax, each already accepted by `re.compile`) to be applied
    /// as `anchoring` says.
    ///
    /// Errors: [`PatternError::Refused`] for the first pattern that uses a construct the crate lacks or
    /// reads differently, [`PatternError::TooLarge`] past [`MAX_COMPILED_BYTES`].
    pub fn new<S: AsRef<str>>(patterns: &[S], anchoring: Anchoring) -> Result<Self, PatternError> {
        let mut hirs = Vec::with_capacity(patterns.len());
        for (index, pattern) in patterns.iter().enumerate() {
            let hir =
                translate(pattern.as_ref(), anchoring).map_err(|why| PatternError::Refused { index, why })?;
            hirs.push(hir);
        }
        let config = config(MatchKind::All).which_captures(WhichCaptures::None);
        let set = meta::Builder::new().configure(config).build_many_from_hir(&hirs).map_err(|err| {
            match err.size_limit() {
                Some(_) => PatternError::TooLarge { count: patterns.len() },
                // Translation already refused every pattern the engine cannot take; pinned on the first
                // pattern that fails alone all the same, rather than assumed away.
                None => PatternError::Refused {
                    index: hirs.iter().position(|hir| single(hir).is_none()).unwrap_or(0),
                    why: format!("cannot be compiled: {err}"),
                },
            }
        })?;
        Ok(Self {
            patterns: patterns.iter().map(|p| p.as_ref().to_owned()).collect(),
            single: (0..hirs.len()).map(|_| OnceLock::new()).collect(),
            hirs,
            anchoring,
            set,
        })
    }

    /// The patterns, as given.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// How the patterns are applied.
    pub fn anchoring(&self) -> Anchoring {
        self.anchoring
    }

    /// The indices of the patterns matching `key`, ascending.
    ///
    /// Errors: [`PatternError::Key`] when `key` is empty or holds a character outside printable ASCII.
    pub fn matching(&self, key: &str) -> Result<Vec<usize>, PatternError> {
        check_key(key)?;
        let mut found = regex_automata::PatternSet::new(self.set.pattern_len());
        let mut search_from = |start: usize| {
            let input = Input::new(key.as_bytes()).range(start..).anchored(Anchored::Yes);
            // Adds to `found`: the starts' matches are united.
            self.set.which_overlapping_matches(&input, &mut found);
        };
        search_from(0);
        if self.anchoring == Anchoring::DottedSuffix {
            key.bytes().enumerate().filter(|&(_, b)| b == b'.').for_each(|(i, _)| search_from(i + 1));
        }
        Ok(found.iter().map(|p| p.as_usize()).collect())
    }

    /// The lowest index of a pattern matching `key` (PEFT's "first in file order"), if any.
    ///
    /// Errors: [`PatternError::Key`] when `key` is empty or holds a character outside printable ASCII.
    pub fn first_match(&self, key: &str) -> Result<Option<usize>, PatternError> {
        Ok(self.matching(key)?.first().copied())
    }

    /// For each pattern, whether it matches at least one of `keys`: one pass per key.
    ///
    /// Errors: [`PatternError::Key`] for the first key that is empty or outside printable ASCII.
    pub fn used_by<S: AsRef<str>>(&self, keys: &[S]) -> Result<Vec<bool>, PatternError> {
        let mut used = vec![false; self.patterns.len()];
        for key in keys {
            for index in self.matching(key.as_ref())? {
                used[index] = true;
            }
        }
        Ok(used)
    }

    /// The text captured by group `name` of the first pattern matching `key`, as Python's `re`
    /// would capture it (leftmost-first, the groups a backtracking engine reports); None when no
    /// pattern matches or the group took no part in the match.
    ///
    /// Errors: [`PatternError::Key`] when `key` is empty or holds a character outside printable ASCII,
    /// [`PatternError::TooLarge`] when the matching pattern with its groups passes the size limit.
    pub fn group<'k>(&self, key: &'k str, name: &str) -> Result<Option<&'k str>, PatternError> {
        let Some(index) = self.first_match(key)? else {
            return Ok(None);
        };
        let regex = match self.single[index].get() {
            Some(regex) => regex,
            // Alone with its groups a pattern is a little larger than in the set, so it may not fit.
            None => {
                let built = single(&self.hirs[index]).ok_or(PatternError::TooLarge { count: 1 })?;
                self.single[index].get_or_init(|| built)
            }
        };
        let mut captures = regex.create_captures();
        regex.captures(Input::new(key.as_bytes()).anchored(Anchored::Yes), &mut captures);
        // The key is ASCII, so any byte range of it is text.
        Ok(captures.get_group_by_name(name).map(|span| &key[span.start..span.end]))
    }
}

fn config(kind: MatchKind) -> meta::Config {
    meta::Config::new()
        .match_kind(kind)
        .utf8_empty(false)
        .nfa_size_limit(Some(MAX_COMPILED_BYTES))
        .hybrid_cache_capacity(DFA_CACHE_BYTES)
}

/// One pattern alone, with the capture groups a set leaves out; None if it cannot be built.
fn single(hir: &Hir) -> Option<Regex> {
    meta::Builder::new().configure(config(MatchKind::LeftmostFirst)).build_from_hir(hir).ok()
}

fn check_key(key: &str) -> Result<(), PatternError> {
    // Not empty either: Python before 3.14 never matches `\B` in an empty string.
    if !key.is_empty() && key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        Ok(())
    } else {
        Err(PatternError::Key { key: key.to_owned() })
    }
}

/// `pattern` with `anchoring` applied, in the crate's syntax tree, or why it cannot be.
fn translate(pattern: &str, anchoring: Anchoring) -> Result<Hir, String> {
    let pattern = end_of_text_as_crate(pattern);
    let parsed = ast::parse::Parser::new().parse(&pattern).map_err(|err| parse_refusal(&pattern, &err))?;
    check_top(&parsed)?;
    // Byte-wise, as keys are ASCII: this refuses what only the translation can (a non-ASCII character in
    // a class), per pattern so the error names it.
    let hir = TranslatorBuilder::new()
        .unicode(false)
        .utf8(false)
        .build()
        .translate(&pattern, &parsed)
        .map_err(|err| format!("cannot be compiled byte-wise: {}", err.kind()))?;
    // Anchored around the whole pattern, as `re.match`, `re.fullmatch` and PEFT's `({pattern})$`
    // apply it: a top-level alternation stays inside the anchors. A dotted suffix starts where the
    // search starts (anchored there), which may be past the key's start.
    Ok(Hir::concat(match anchoring {
        Anchoring::Start => vec![Hir::look(Look::Start), hir],
        Anchoring::Full => vec![Hir::look(Look::Start), hir, Hir::look(Look::End)],
        Anchoring::DottedSuffix => vec![hir, Hir::look(Look::End)],
    }))
}

/// Python's `\Z` (end of string) spelled as the crate's `\z`. Every backslash in Python's syntax
/// escapes exactly the character after it, so escapes are read pairwise.
fn end_of_text_as_crate(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        out.push(c);
        if c == '\\' {
            match chars.next() {
                Some('Z') => out.push('z'),
                Some(next) => out.push(next),
                None => {}
            }
        }
    }
    out
}

fn parse_refusal(pattern: &str, err: &ast::Error) -> String {
    use ast::ErrorKind;
    match err.kind() {
        ErrorKind::UnsupportedLookAround => "uses look-around ((?=, (?!, (?<= or (?<!)".into(),
        ErrorKind::UnsupportedBackreference => "uses a back-reference (\\1) or an octal escape".into(),
        kind => {
            // The error points into the group's opening; the construct is named by its start.
            let upto = pattern.get(..err.span().end.offset).unwrap_or(pattern);
            let at = upto.rfind("(?").map_or("", |start| &pattern[start..]);
            let named = [
                ("(?P=", "a named back-reference (?P=...)"),
                ("(?>", "an atomic group (?>...)"),
                ("(?(", "a conditional group (?(...)...)"),
                ("(?#", "a comment group (?#...)"),
            ];
            match named.iter().find(|(start, _)| at.starts_with(start)) {
                Some((_, what)) => format!("uses {what}"),
                None => format!("uses syntax the linear-time matcher does not support ({kind})"),
            }
        }
    }
}

/// Flags may only open the pattern (Python 3.11 refuses them elsewhere; 3.10 applies them to all
/// of it); everything after them is checked with the flags they set.
fn check_top(parsed: &Ast) -> Result<(), String> {
    let items: &[Ast] = match parsed {
        Ast::Concat(concat) => &concat.asts,
        other => std::slice::from_ref(other),
    };
    let mut case_insensitive = false;
    let mut opening = true;
    for item in items {
        match item {
            Ast::Flags(set) if opening => case_insensitive = apply_flags(&set.flags, case_insensitive)?,
            other => {
                opening = false;
                check(other, case_insensitive)?;
            }
        }
    }
    Ok(())
}

fn check(node: &Ast, case_insensitive: bool) -> Result<(), String> {
    match node {
        Ast::Empty(_) | Ast::Dot(_) | Ast::ClassPerl(_) => Ok(()),
        Ast::Flags(_) => Err("sets flags after the start of the pattern (Python 3.11 refuses that, \
                              3.10 applies them to the whole pattern)"
            .into()),
        Ast::Literal(literal) => check_literal(literal, case_insensitive),
        Ast::Assertion(assertion) => check_assertion(assertion),
        Ast::ClassUnicode(_) => Err("uses a Unicode class \\p{...}, which Python's re lacks".into()),
        Ast::ClassBracketed(class) => check_class(&class.kind, case_insensitive),
        Ast::Repetition(repetition) => {
            if matches!(*repetition.ast, Ast::Repetition(_)) {
                // The crate repeats the repetition; Python 3.11 reads `a*+` as possessive.
                return Err(
                    "uses a possessive quantifier (*+, ++, ?+ or {m,n}+) or a repeated repetition".into()
                );
            }
            check(&repetition.ast, case_insensitive)
        }
        Ast::Group(group) => {
            let inner = match &group.kind {
                ast::GroupKind::CaptureName { starts_with_p: false, .. } => {
                    return Err("uses (?<name>...), which Python's re spells (?P<name>...)".into())
                }
                ast::GroupKind::NonCapturing(flags) => apply_flags(flags, case_insensitive)?,
                _ => case_insensitive,
            };
            check(&group.ast, inner)
        }
        Ast::Alternation(alternation) => alternation.asts.iter().try_for_each(|a| check(a, case_insensitive)),
        Ast::Concat(concat) => concat.asts.iter().try_for_each(|a| check(a, case_insensitive)),
    }
}

fn apply_flags(flags: &ast::Flags, mut case_insensitive: bool) -> Result<bool, String> {
    let mut negated = false;
    for item in &flags.items {
        match &item.kind {
            ast::FlagsItemKind::Negation => negated = true,
            ast::FlagsItemKind::Flag(ast::Flag::CaseInsensitive) => case_insensitive = !negated,
            ast::FlagsItemKind::Flag(ast::Flag::MultiLine | ast::Flag::DotMatchesNewLine) => {}
            ast::FlagsItemKind::Flag(other) => {
                let letter = match other {
                    ast::Flag::SwapGreed => 'U',
                    ast::Flag::Unicode => 'u',
                    ast::Flag::CRLF => 'R',
                    _ => 'x',
                };
                return Err(format!(
                    "uses the flag {letter:?}; only i, m and s mean the same in Python's re and the matcher"
                ));
            }
        }
    }
    Ok(case_insensitive)
}

fn check_literal(literal: &ast::Literal, case_insensitive: bool) -> Result<(), String> {
    match literal.kind {
        ast::LiteralKind::HexBrace(_) => Err("uses a braced escape \\x{...}, which Python's re lacks".into()),
        _ if case_insensitive && !literal.c.is_ascii() => Err(format!(
            "uses the non-ASCII character {:?} case-insensitively; Python's re and the matcher fold \
             case differently outside ASCII",
            literal.c
        )),
        _ => Ok(()),
    }
}

fn check_assertion(assertion: &ast::Assertion) -> Result<(), String> {
    use ast::AssertionKind::*;
    match assertion.kind {
        StartLine | EndLine | StartText | EndText | WordBoundary | NotWordBoundary => Ok(()),
        WordBoundaryStart
        | WordBoundaryEnd
        | WordBoundaryStartAngle
        | WordBoundaryEndAngle
        | WordBoundaryStartHalf
        | WordBoundaryEndHalf => {
            Err("uses \\<, \\> or \\b{...}, which Python's re reads as literal characters".into())
        }
    }
}

fn check_class(set: &ast::ClassSet, case_insensitive: bool) -> Result<(), String> {
    match set {
        ast::ClassSet::BinaryOp(_) => Err(NESTED_CLASS.into()),
        ast::ClassSet::Item(item) => check_class_item(item, case_insensitive),
    }
}

const NESTED_CLASS: &str =
    "uses a nested class or a class operation ([[, &&, --, ~~), which Python's re reads as literal characters";

fn check_class_item(item: &ast::ClassSetItem, case_insensitive: bool) -> Result<(), String> {
    use ast::ClassSetItem::*;
    match item {
        Empty(_) | Perl(_) => Ok(()),
        Literal(literal) => check_literal(literal, case_insensitive),
        Range(range) => {
            check_literal(&range.start, case_insensitive)?;
            check_literal(&range.end, case_insensitive)
        }
        Ascii(_) | Bracketed(_) => Err(NESTED_CLASS.into()),
        Unicode(_) => Err("uses a Unicode class \\p{...}, which Python's re lacks".into()),
        Union(union) => union.items.iter().try_for_each(|i| check_class_item(i, case_insensitive)),
    }
}

#[cfg(test)]
#[path = "patterns_tests.rs"]
mod tests;
