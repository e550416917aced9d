//! The core's one error type. Every fallible core function returns [`Result`]; the Python
//! bindings map each variant to exactly one exception class (see `py/errors.rs`).

use std::fmt;

/// Everything that can go wrong in the core, with the values needed to explain it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// An adapter spec (a `--lora-paths` item, a dict, an `@FILE`) or a limit cross-check is invalid.
    Spec(String),
    /// A name that is not registered was used.
    AdapterNotFound {
        /// The name that was looked up.
        name: String,
        /// The names that are registered, sorted.
        registered: Vec<String>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Spec(msg) => f.write_str(msg),
            Error::AdapterNotFound { name, registered } => {
                write!(f, "no adapter named {name:?} is registered")?;
                if registered.is_empty() {
                    f.write_str(" (none are registered)")
                } else {
                    write!(f, "; registered: {}", quoted_list(registered))
                }
            }
        }
    }
}

impl std::error::Error for Error {}

/// `"a", "b", "c"` — names quoted so empty or odd ones stay visible; long lists are cut.
pub(crate) fn quoted_list(names: &[String]) -> String {
    const SHOWN: usize = 20;
    let mut out = names.iter().take(SHOWN).map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        out.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    out
}

/// The core's result type.
pub type Result<T> = std::result::Result<T, Error>;
