//! Reading a step's requests from Python cheaply: list items are read as borrowed references (no
//! reference counting), and adapter names are resolved through a cache keyed by the str object's
//! address, so a serving loop that passes the same name objects every step converts and hashes no
//! name text at all.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyBool, PyInt, PyList, PyString, PyTuple};

use super::usage;
use lora_pin_core::policy::AdapterKey;
use lora_pin_core::registry::{Hold, Registry};

/// Hashes a Python object's address: addresses are unique while the objects live, and aligned, so
/// the multiply spreads them and the shift brings high bits down to the bucket bits.
#[derive(Default)]
pub(super) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let h = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

pub(super) type AddressMap<V> = HashMap<usize, V, BuildHasherDefault<AddressHasher>>;

/// The most name objects the cache holds; past it, it starts over (a loop that makes new name
/// objects every step gains nothing from the cache, and must not grow it without bound).
const NAME_CACHE_CAPACITY: usize = 1024;

/// Adapter names met by earlier plans, by the address of their str object, each with the key it
/// resolved to while the registry's names epoch was `epoch`. Every entry holds a strong reference to
/// its str, so its address cannot be taken by another object while cached. Only exact `str`
/// objects are cached: dropping one runs no Python code.
///
/// Locked only with the GIL held and never across a GIL release, so it is never contended.
pub(super) struct NameCache {
    epoch: u64,
    keys: AddressMap<(Py<PyString>, AdapterKey)>,
    /// A direct-mapped index into `keys` by address bits, checked first: one load and compare per
    /// request instead of a hash probe. An entry's address is always one that `keys` holds.
    front: Box<[(usize, AdapterKey); FRONT_SIZE]>,
}

/// Entries of [`NameCache::front`] (a power of two, well above the adapters one step names).
const FRONT_SIZE: usize = 1024;

fn front_index(address: usize) -> usize {
    // Objects are 16-byte aligned; higher bits are folded in so that neighbours spread.
    ((address >> 4) ^ (address >> 14)) & (FRONT_SIZE - 1)
}

impl Default for NameCache {
    fn default() -> Self {
        Self { epoch: 0, keys: AddressMap::default(), front: Box::new([(0, AdapterKey(0)); FRONT_SIZE]) }
    }
}

impl NameCache {
    /// Empties the cache (the registry calls this when a name may have changed its key, so the
    /// cached strings are freed early; correctness rests on the epoch check alone).
    pub(super) fn take(&mut self) -> AddressMap<(Py<PyString>, AdapterKey)> {
        self.front.fill((0, AdapterKey(0)));
        std::mem::take(&mut self.keys)
    }

    /// The key cached for the str object at `address`.
    #[inline(always)]
    fn get(&self, address: usize) -> Option<AdapterKey> {
        let (front, key) = self.front[front_index(address)];
        if front == address {
            return Some(key);
        }
        self.keys.get(&address).map(|&(_, key)| key)
    }

    /// Adds the names a plan resolved at the registry's names epoch `epoch`. Returns what the
    /// cache let go of, for the caller to drop after unlocking.
    pub(super) fn insert(
        &mut self,
        py: Python<'_>,
        epoch: u64,
        names: &[PyBackedStr],
        keys: &[Option<AdapterKey>],
    ) -> AddressMap<(Py<PyString>, AdapterKey)> {
        let mut old = AddressMap::default();
        if epoch < self.epoch {
            return old;
        }
        if epoch > self.epoch || self.keys.len() + names.len() > NAME_CACHE_CAPACITY {
            old = self.take();
            self.epoch = epoch;
        }
        // Names held (no key) are looked up again by every step: they are few, and short-lived.
        for (name, key) in names.iter().zip(keys) {
            let Some(key) = *key else { continue };
            let name = name.as_py_str().bind(py);
            if name.is_exact_instance_of::<PyString>() {
                let address = name.as_ptr() as usize;
                self.keys.insert(address, (name.clone().unbind(), key));
                self.front[front_index(address)] = (address, key);
            }
        }
        old
    }
}

/// A step's requests as read from Python: the key of each request whose name the cache knew, and
/// the distinct names it did not know, to be looked up under the registry's lock.
pub(super) struct Requests {
    /// Per request: `None` for the base model, else its adapter's key (a placeholder until
    /// [`Requests::resolve`] for a name not in the cache).
    adapters: Vec<Option<AdapterKey>>,
    /// Names not in the cache, each object once.
    pub(super) misses: Vec<PyBackedStr>,
    /// `(request, index into misses)` for each request naming a miss.
    patches: Vec<(u32, u32)>,
    /// The names epoch the cache's keys were valid at when read, if any request used one.
    hits_epoch: Option<u64>,
}

/// How [`Requests::resolve`] treats a name that is not registered (nor being unloaded).
#[derive(Default)]
pub(super) struct Unregistered {
    /// Names whose last read failed (their requests fail).
    pub(super) failed: Vec<PyBackedStr>,
    /// Names being discovered (their requests wait).
    pub(super) discovering: Vec<PyBackedStr>,
    /// Any other such name is listed in `unknown` for the caller to discover, instead of an error.
    pub(super) defer: bool,
    /// The step must run whole: a request that would fail is an error instead.
    pub(super) whole: bool,
}

impl Unregistered {
    /// The hold of unregistered `name`, or None when it goes to `unknown`.
    ///
    /// Errors: [`lora_pin_core::Error::AdapterNotFound`] for a name nobody knows.
    fn hold(&self, reg: &Registry, name: &str) -> lora_pin_core::Result<Option<Hold>> {
        let failed = self.failed.iter().any(|n| &**n == name);
        if !self.whole && failed {
            Ok(Some(Hold::ReadFailed))
        } else if !failed && self.discovering.iter().any(|n| &**n == name) {
            Ok(Some(Hold::Discovering))
        } else if !failed && self.defer {
            Ok(None)
        } else if !self.whole && reg.was_unloaded(name) {
            Ok(Some(Hold::Unloaded))
        } else {
            Err(reg.not_found(name))
        }
    }
}

/// What [`Requests::resolve`] found.
pub(super) enum Resolved {
    /// Every request has its key or its hold; `misses[i]` resolved to `keys[i]` at names epoch
    /// `epoch` (None: held, or unknown).
    Keys { epoch: u64, keys: Vec<Option<AdapterKey>>, holds: Vec<(u32, Hold)>, unknown: Vec<usize> },
    /// A name changed its key since the cache was filled: read the requests again without it.
    Stale,
}

impl Requests {
    /// Reads `names` (a list, tuple or other iterable of str or None), through `cache` unless None.
    ///
    /// Errors: `UsageError` naming the first item that is neither a str nor None.
    pub(super) fn read(
        py: Python<'_>,
        names: &Bound<'_, PyAny>,
        cache: Option<&NameCache>,
    ) -> PyResult<Self> {
        if names.is_instance_of::<PyString>() {
            // A str is a sequence of one-character names: surely a missing list.
            return Err(usage(
                py,
                format!("names must be a sequence of adapter names, got the str {}", names.repr()?),
            ));
        }
        let mut reader = Reader {
            cache,
            seen: AddressMap::default(),
            requests: Requests {
                adapters: Vec::with_capacity(names.len().unwrap_or(0)),
                misses: Vec::new(),
                patches: Vec::new(),
                hits_epoch: None,
            },
        };
        for_each_item(py, names, "names", "a sequence of adapter names (str or None)", |i, item| {
            reader.add(py, i, item)
        })?;
        Ok(reader.requests)
    }

    /// The number of requests.
    pub(super) fn len(&self) -> usize {
        self.adapters.len()
    }

    /// Looks up the names the cache did not know, with the registry locked, and fills in their keys;
    /// a name not registered is held, or listed as unknown (by its index into `misses`), as
    /// `unregistered` says.
    ///
    /// Errors: [`lora_pin_core::Error::AdapterNotFound`] for an unknown name (`unregistered` None, or
    /// saying so).
    pub(super) fn resolve(
        &mut self,
        reg: &Registry,
        unregistered: Option<&Unregistered>,
    ) -> lora_pin_core::Result<Resolved> {
        let epoch = reg.names_epoch();
        if self.hits_epoch.is_some_and(|e| e != epoch) {
            return Ok(Resolved::Stale);
        }
        let mut keys = Vec::with_capacity(self.misses.len());
        let mut held = Vec::new();
        let mut unknown = Vec::new();
        for (m, name) in self.misses.iter().enumerate() {
            match (reg.lookup(name, true), unregistered) {
                (Ok(key), _) => keys.push(Some(key)),
                (Err(e), None) => return Err(e),
                (Err(_), Some(u)) => {
                    match u.hold(reg, name)? {
                        Some(hold) => held.push((m, hold)),
                        None => unknown.push(m),
                    }
                    keys.push(None);
                }
            }
        }
        let mut holds = Vec::new();
        for &(request, miss) in &self.patches {
            let key = keys[miss as usize];
            self.adapters[request as usize] = key;
            if key.is_none() {
                if let Some(&(_, hold)) = held.iter().find(|&&(m, _)| m == miss as usize) {
                    holds.push((request, hold));
                }
            }
        }
        Ok(Resolved::Keys { epoch, keys, holds, unknown })
    }

    /// Each request's adapter key, once resolved.
    pub(super) fn adapters(&self) -> &[Option<AdapterKey>] {
        &self.adapters
    }
}

struct Reader<'c> {
    cache: Option<&'c NameCache>,
    /// Miss objects met in this step, by address (each held by `requests.misses`).
    seen: AddressMap<u32>,
    requests: Requests,
}

impl Reader<'_> {
    #[inline(always)]
    fn add(&mut self, py: Python<'_>, i: usize, item: Borrowed<'_, '_, PyAny>) -> PyResult<()> {
        if item.is_none() {
            self.requests.adapters.push(None);
            return Ok(());
        }
        if let Some(cache) = self.cache {
            if let Some(key) = cache.get(item.as_ptr() as usize) {
                self.requests.hits_epoch = Some(cache.epoch);
                self.requests.adapters.push(Some(key));
                return Ok(());
            }
        }
        self.add_miss(py, i, item)
    }

    #[cold]
    #[inline(never)]
    fn add_miss(&mut self, py: Python<'_>, i: usize, item: Borrowed<'_, '_, PyAny>) -> PyResult<()> {
        let requests = &mut self.requests;
        let address = item.as_ptr() as usize;
        let miss = match self.seen.get(&address) {
            Some(&miss) => miss,
            None => {
                let item = item.to_owned();
                if !item.is_instance_of::<PyString>() {
                    let what = type_name(&item);
                    return Err(usage(
                        py,
                        format!("names[{i}] must be an adapter name (str) or None, got {what}"),
                    ));
                }
                // A lone surrogate (JSON's "\ud800") is bad input, not bad usage.
                let name = crate::text::text(&item, &format!("names[{i}]"))?;
                requests.misses.push(name);
                let miss = (requests.misses.len() - 1) as u32;
                self.seen.insert(address, miss);
                miss
            }
        };
        requests.patches.push((requests.adapters.len() as u32, miss));
        requests.adapters.push(None);
        Ok(())
    }
}

/// The token count of each of `n` requests: `num_tokens` is one int for all (a decode step) or a
/// list, tuple or other iterable of ints.
///
/// Errors: `UsageError` naming a count that is not an int or not in `0..=u32::MAX`, or when
/// `num_tokens` is neither an int nor iterable. (A length that differs from `n` is left to the
/// planner, which names both lengths.)
pub(super) fn token_counts(py: Python<'_>, num_tokens: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<u32>> {
    let in_range = |what: &dyn std::fmt::Display, v: i64| {
        u32::try_from(v).map_err(|_| usage(py, format!("{what} must be in 0..=4294967295 (got {v})")))
    };
    if num_tokens.is_instance_of::<PyBool>() {
        return Err(usage(py, format!("num_tokens must be an int or a sequence of ints, got {num_tokens}")));
    }
    if num_tokens.is_instance_of::<PyInt>() {
        let all: i64 = num_tokens
            .extract()
            .map_err(|_| usage(py, format!("num_tokens must be in 0..=4294967295 (got {num_tokens})")))?;
        return Ok(vec![in_range(&"num_tokens", all)?; n]);
    }
    let mut counts = Vec::with_capacity(n);
    // The previous item if it was an exact int: lists of counts repeat small ints, which are shared
    // objects, so an item that is the same object has the same value. Only for a list or tuple, which
    // keeps the previous item alive (no Python code runs between two items read on this path); an
    // iterator's items are freed as it goes, and the next one may be a new int at the same address.
    let held = num_tokens.cast::<PyList>().is_ok() || num_tokens.cast::<PyTuple>().is_ok();
    let mut previous: Option<(usize, u32)> = None;
    for_each_item(py, num_tokens, "num_tokens", "an int or a sequence of ints", |i, item| {
        let address = item.as_ptr() as usize;
        if let Some((_, v)) = previous.filter(|&(a, _)| held && a == address) {
            counts.push(v);
            return Ok(());
        }
        previous = None;
        if item.is_exact_instance_of::<PyInt>() {
            // SAFETY: `item` is a live exact int (checked just above; the GIL is held), from which
            // `PyLong_AsLong` reads the value without running Python code; -1 with an exception set
            // means the value does not fit, left to the slow path below for its message.
            let v = unsafe { ffi::PyLong_AsLong(item.as_ptr()) };
            if v != -1 || PyErr::take(py).is_none() {
                // `c_long` is i64 here but i32 on Windows.
                #[allow(clippy::useless_conversion)]
                let v = in_range(&format_args!("num_tokens[{i}]"), i64::from(v))?;
                counts.push(v);
                previous = Some((address, v));
                return Ok(());
            }
        }
        let item = item.to_owned();
        if item.is_instance_of::<PyBool>() {
            return Err(usage(py, format!("num_tokens[{i}] must be an int, got {item}")));
        }
        let v: i64 = item.extract().map_err(|_| {
            if item.is_instance_of::<PyInt>() {
                usage(py, format!("num_tokens[{i}] must be in 0..=4294967295 (got {item})"))
            } else {
                usage(py, format!("num_tokens[{i}] must be an int, got {}", type_name(&item)))
            }
        })?;
        counts.push(in_range(&format_args!("num_tokens[{i}]"), v)?);
        Ok(())
    })?;
    Ok(counts)
}

/// Calls `visit(i, item)` for each item of `seq` (a list, a tuple or any iterable). List and tuple
/// items are borrowed, not counted: `visit` must not run Python code before it takes an owned
/// reference (`to_owned`), or a list item could be freed under it.
///
/// Errors: what `visit` returns; `UsageError` when `seq` is not iterable (`what` names the
/// argument, `expected` what it should be); what iterating raises.
#[inline(always)]
fn for_each_item<'py>(
    py: Python<'py>,
    seq: &Bound<'py, PyAny>,
    what: &str,
    expected: &str,
    mut visit: impl FnMut(usize, Borrowed<'_, 'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    if let Ok(list) = seq.cast::<PyList>() {
        for i in 0..list.len() {
            // SAFETY: `list` is a list and the GIL is held. `PyList_GetItem` checks `i` against the
            // current length (a list shortened by Python code run on an error path gives NULL and
            // IndexError, not a read past its end) and returns a borrowed item, which stays valid
            // while `visit` uses it because nothing runs Python code that could remove it from the
            // list before `visit` takes an owned reference.
            let item = unsafe { Borrowed::from_ptr_or_err(py, ffi::PyList_GetItem(list.as_ptr(), i as _))? };
            visit(i, item)?;
        }
        return Ok(());
    }
    if let Ok(tuple) = seq.cast::<PyTuple>() {
        for i in 0..tuple.len() {
            visit(i, tuple.get_borrowed_item(i)?)?;
        }
        return Ok(());
    }
    let iter = seq
        .try_iter()
        .map_err(|_| usage(py, format!("{what} must be {expected}, got {}", type_name(seq))))?;
    for (i, item) in iter.enumerate() {
        let item = item?;
        visit(i, item.as_borrowed())?;
    }
    Ok(())
}

pub(super) fn type_name(item: &Bound<'_, PyAny>) -> String {
    item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}
