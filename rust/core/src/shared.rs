//! A [`Registry`] shared between threads: one lock around it and a condition variable that wakes
//! unloads when an adapter being unloaded drains.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::registry::{Registry, StepTicket, Unload};

/// A thread-safe registry.
#[derive(Debug)]
pub struct SharedRegistry {
    inner: Mutex<Registry>,
    drained: Condvar,
}

impl SharedRegistry {
    /// Wraps `registry`.
    pub fn new(registry: Registry) -> Self {
        Self { inner: Mutex::new(registry), drained: Condvar::new() }
    }

    /// Locks the registry.
    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        self.inner.lock()
    }

    /// Locks the registry if no one holds the lock, without waiting.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, Registry>> {
        self.inner.try_lock()
    }

    /// [`Registry::release`], waking unloads when an adapter being unloaded drained.
    ///
    /// Errors: as [`Registry::release`].
    #[cfg(test)]
    pub(crate) fn release(&self, ids: &[Option<&str>]) -> Result<()> {
        if self.inner.lock().release(ids)? {
            self.drained.notify_all();
        }
        Ok(())
    }

    /// [`Registry::finish_step`], waking unloads when an adapter being unloaded drained.
    ///
    /// Errors: as [`Registry::finish_step`].
    pub fn finish_step(&self, ticket: StepTicket) -> Result<()> {
        if self.inner.lock().finish_step(ticket)? {
            self.drained.notify_all();
        }
        Ok(())
    }

    /// [`SharedRegistry::finish_step`] if no one holds the lock now; `None` (nothing done) otherwise.
    ///
    /// Errors: as [`Registry::finish_step`].
    pub fn try_finish_step(&self, ticket: StepTicket) -> Option<Result<()>> {
        let drained = self.inner.try_lock()?.finish_step(ticket);
        Some(drained.map(|drained| {
            if drained {
                self.drained.notify_all();
            }
        }))
    }

    /// Unregisters `name` and waits up to `wait` for its requests to drain, then forgets it.
    /// Returns [`Unload::Draining`] if requests are still in flight after `wait`; go on with
    /// [`SharedRegistry::continue_unload_for`] and its serial.
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name never registered.
    pub fn unload_for(&self, name: &str, wait: Duration) -> Result<Unload> {
        let state = self.inner.lock().unload(name)?;
        Ok(match state {
            Unload::Done => Unload::Done,
            Unload::Draining { serial, .. } => self.continue_unload_for(serial, wait),
        })
    }

    /// Waits up to `wait` for the unload of registration `serial` (from [`Unload::Draining`]) to
    /// drain, then forgets it; an adapter registered meanwhile under the same name is left alone.
    pub fn continue_unload_for(&self, serial: u64, wait: Duration) -> Unload {
        let deadline = Instant::now().checked_add(wait);
        let mut reg = self.inner.lock();
        loop {
            let state = reg.continue_unload(serial);
            let Unload::Draining { .. } = state else { return state };
            match deadline {
                Some(d) if Instant::now() >= d => return state,
                Some(d) => {
                    self.drained.wait_until(&mut reg, d);
                }
                None => self.drained.wait(&mut reg),
            }
        }
    }

    /// Unregisters `name`, waits for its requests to drain (at most `timeout`; forever with `None`),
    /// then forgets it. Idempotent: unloading a forgotten adapter returns at once (for the latest
    /// [`crate::limits::MAX_UNLOADED_NAMES`] names unloaded).
    ///
    /// Errors: [`Error::AdapterNotFound`] for a name never registered; [`Error::UnloadTimeout`] when
    /// requests are still in flight after `timeout` (the adapter stays unregistered).
    pub fn unload(&self, name: &str, timeout: Option<Duration>) -> Result<()> {
        let started = Instant::now();
        match self.unload_for(name, timeout.unwrap_or(Duration::MAX))? {
            Unload::Done => Ok(()),
            Unload::Draining { in_flight, .. } => {
                Err(Error::UnloadTimeout { name: name.to_owned(), in_flight, waited: started.elapsed() })
            }
        }
    }
}
