//! The threads the CPU kernels share a call among: started once, asleep between calls.
//!
//! A call posts its tasks; the workers it wakes and the calling thread take them one by one from a
//! shared counter, so a thread slowed by a neighbour takes fewer. Idle workers wait on a condition
//! variable, not in a spin loop: between two LoRA calls torch runs the base model's GEMMs on its own
//! OpenMP threads, and a spinning worker would take a core from them (and theirs from us, which is why
//! `OMP_WAIT_POLICY=PASSIVE` helps; see README, "CPU threads").
//!
//! One call at a time uses the workers; a call that finds them busy (another Python thread inside a
//! kernel) runs its tasks on its own thread instead of waiting.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

/// One call's tasks, as the workers see them.
#[derive(Clone, Copy)]
struct Job {
    // Erased to 'static: `Pool::run` withdraws the job and waits for every worker that took it up
    // before the borrowed closure and counters go out of scope.
    task: &'static (dyn Fn(usize) + Sync),
    n_tasks: usize,
    next: &'static AtomicUsize,
    panicked: &'static AtomicBool,
    helpers: usize,
}

struct State {
    job: Option<Job>,
    // Bumped for every job, so a worker joins each job at most once.
    epoch: u64,
    joined: usize,
    // Workers inside the current job's tasks.
    active: usize,
    workers: usize,
}

/// The kernels' worker threads.
pub(crate) struct Pool {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
    // Held by the call that owns the workers.
    owner: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is consistent at every unlock (tasks run outside the lock, their panics are caught).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The process's pool (workers start on first use, one fewer than the threads a call asks for).
pub(crate) fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State { job: None, epoch: 0, joined: 0, active: 0, workers: 0 }),
        work: Condvar::new(),
        done: Condvar::new(),
        owner: Mutex::new(()),
    })
}

impl Pool {
    /// Runs `task(i)` for every `i < n_tasks` on up to `threads` threads (the caller's included) and
    /// returns when all have run. Tasks must be independent: any order, any thread.
    ///
    /// Panics if a task panicked (the remaining tasks are skipped), once no worker is inside the call.
    pub(crate) fn run(&'static self, threads: usize, n_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        let helpers = threads.min(n_tasks).saturating_sub(1);
        let owner = if helpers > 0 { self.owner.try_lock().ok() } else { None };
        let Some(_owner) = owner else {
            (0..n_tasks).for_each(task);
            return;
        };
        let next = AtomicUsize::new(0);
        let panicked = AtomicBool::new(false);
        {
            let mut st = lock(&self.state);
            while st.workers < helpers {
                let spawned =
                    std::thread::Builder::new().name("lora_pin-sgmv".into()).spawn(move || self.worker());
                if spawned.is_err() {
                    break; // fewer helpers: the tasks still all run
                }
                st.workers += 1;
            }
            // SAFETY: the job is withdrawn below, and this function waits until no worker is inside
            // it, before `task`, `next` and `panicked` go out of scope.
            let job = unsafe {
                Job {
                    task: std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(
                        task,
                    ),
                    n_tasks,
                    next: std::mem::transmute::<&AtomicUsize, &'static AtomicUsize>(&next),
                    panicked: std::mem::transmute::<&AtomicBool, &'static AtomicBool>(&panicked),
                    helpers,
                }
            };
            st.job = Some(job);
            st.epoch += 1;
            st.joined = 0;
        }
        self.work.notify_all();
        // Caught, so that the job is withdrawn and the workers are out of it before anything unwinds.
        let mine = catch_unwind(AssertUnwindSafe(|| drain(n_tasks, &next, task)));
        if mine.is_err() {
            next.store(n_tasks, Ordering::Relaxed);
        }
        let mut st = lock(&self.state);
        st.job = None;
        while st.active > 0 {
            st = self.done.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        drop(st);
        if let Err(panic) = mine {
            std::panic::resume_unwind(panic);
        }
        if panicked.load(Ordering::Relaxed) {
            panic!("a CPU kernel task panicked on a worker thread");
        }
    }

    fn worker(&'static self) {
        let mut seen = 0;
        let mut st = lock(&self.state);
        loop {
            match st.job {
                Some(job) if st.epoch != seen && st.joined < job.helpers => {
                    seen = st.epoch;
                    st.joined += 1;
                    st.active += 1;
                    drop(st);
                    let ran = catch_unwind(AssertUnwindSafe(|| drain(job.n_tasks, job.next, job.task)));
                    if ran.is_err() {
                        job.panicked.store(true, Ordering::Relaxed);
                        // The remaining tasks are skipped; the caller reports the panic.
                        job.next.store(job.n_tasks, Ordering::Relaxed);
                    }
                    st = lock(&self.state);
                    st.active -= 1;
                    if st.active == 0 {
                        self.done.notify_all();
                    }
                }
                _ => st = self.work.wait(st).unwrap_or_else(PoisonError::into_inner),
            }
        }
    }
}

/// Takes tasks from `next` until none is left.
fn drain(n_tasks: usize, next: &AtomicUsize, task: &(dyn Fn(usize) + Sync)) {
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            return;
        }
        task(i);
    }
}
