//! The core's one error type. Every fallible core function returns [`Result`]; the Python
//! bindings map each variant to exactly one exception class (see `rust/py/src/errors.rs`).

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
    /// A name or id is already registered; both refs are described.
    DuplicateAdapter {
        /// The ref being registered.
        new: String,
        /// The ref already registered under that name or id.
        existing: String,
    },
    /// A tier cannot make room (a registration, a pin); the message gives the numbers.
    Capacity(String),
    /// The adapter is still in use (being unloaded with requests in flight).
    AdapterInUse(String),
    /// An unload waited `waited` and `in_flight` requests still use the adapter.
    UnloadTimeout {
        /// The adapter being unloaded (it stays unregistered).
        name: String,
        /// Requests still using it.
        in_flight: u64,
        /// How long the unload waited.
        waited: std::time::Duration,
    },
    /// A call's arguments contradict the registry's state or each other (a release without an
    /// acquire, lists of different lengths, a load that is not pending).
    Usage(String),
    /// An argument of a CPU LoRA kernel (`sgmv`) has the wrong length, dtype or an index out of range.
    OpArgument(String),
    /// An adapter's weight file could not be read (an I/O error, or it ended early); names the tensor.
    WeightFile(String),
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
            Error::DuplicateAdapter { new, existing } => {
                write!(f, "cannot register {new}: {existing} is already registered")
            }
            Error::Capacity(msg)
            | Error::AdapterInUse(msg)
            | Error::Usage(msg)
            | Error::OpArgument(msg)
            | Error::WeightFile(msg) => f.write_str(msg),
            Error::UnloadTimeout { name, in_flight, waited } => write!(
                f,
                "unloading adapter {name:?} timed out after {:.3} s with {in_flight} request(s) \
                 still in flight; it stays unregistered (no new requests) and a later unload finishes it",
                waited.as_secs_f64()
            ),
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
