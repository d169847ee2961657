//! A persistent pool of worker threads for the fast kernels (docs/kernels.md, step 7). Twin of
//! `cpp/src/thread_pool.{hpp,cpp}`, scheduling identically.
//!
//! `parallel_for(items, num_threads, f)` calls `f(item, thread)` once for every item in
//! `0..items`, on the calling thread (thread 0) and up to `num_threads - 1` workers (threads
//! 1, 2, ...). Items are handed out dynamically from an atomic counter, so callers order them
//! most expensive first. Workers are created on first need and live until the process ends; no
//! thread is created per call. A call that finds the pool busy (another caller, e.g. another
//! Python thread, is using it) runs every item on its own thread rather than waiting, so
//! concurrent calls never deadlock. The first panic of `f` is resumed on the caller after every
//! started item has finished.
//!
//! One job at a time: a caller that wins `try_lock` on `job` publishes the job (function, item
//! count, number of workers wanted) under `state`, bumps the generation and wakes the workers;
//! workers 1..=wanted take items from the shared counter, then report done. The caller takes
//! items too, then waits until every wanted worker has reported. Workers that were not wanted
//! for this job go back to sleep at once.
//!
//! Waiting (a worker for its next job, the caller for the workers' reports) first spins for up
//! to POOL_SPIN_MICROSECONDS on an atomic copy of the generation / pending count, then sleeps on
//! the condition variable; the mutex-guarded values stay the ones that decide.
//!
//! Hand-rolled rather than rayon so that both ports schedule the same way (one shared counter,
//! the caller participating, a busy pool meaning "run here"); rayon's work stealing splits
//! ranges recursively and blocks a second caller until the pool is free.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::constants::POOL_SPIN_MICROSECONDS;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, TryLockError};

/// The function of one job: `f(item, thread)`.
pub type ItemFn<'a> = dyn Fn(usize, usize) + Sync + 'a;

/// The published job. The lifetime is erased: the caller does not return before every worker
/// that was handed the pointer has reported done, so it never dangles while used.
#[derive(Clone, Copy)]
struct JobFn(*const ItemFn<'static>);

// SAFETY: the pointee is Sync (ItemFn requires it) and outlives every use (see JobFn).
unsafe impl Send for JobFn {}

struct State {
    generation: u64,
    job: Option<JobFn>,
    items: usize,
    wanted: usize,
    pending: usize,
    panic: Option<Box<dyn Any + Send>>,
    workers: usize,
}

struct ThreadPool {
    job: Mutex<()>,      // held by the caller that owns the pool for one job
    state: Mutex<State>, // guards everything in State; next_item is apart
    wake: Condvar,
    done: Condvar,
    next_item: AtomicUsize,
    /// Copies of State::generation and State::pending for spinning without the mutex.
    generation_atomic: AtomicU64,
    pending_atomic: AtomicUsize,
}

/// Returns once `done()` holds or POOL_SPIN_MICROSECONDS have passed (the caller then sleeps).
fn spin_until(done: impl Fn() -> bool) {
    let stop = Instant::now() + Duration::from_micros(POOL_SPIN_MICROSECONDS);
    let mut i = 1u32;
    loop {
        if done() {
            return;
        }
        std::hint::spin_loop();
        if i.is_multiple_of(64) && Instant::now() >= stop {
            return;
        }
        i = i.wrapping_add(1);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in f is caught before it can poison anything; recover regardless.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ThreadPool {
    fn instance() -> &'static ThreadPool {
        // Never dropped: workers may still be parked when the process exits.
        static POOL: OnceLock<ThreadPool> = OnceLock::new();
        POOL.get_or_init(|| ThreadPool {
            job: Mutex::new(()),
            state: Mutex::new(State {
                generation: 0,
                job: None,
                items: 0,
                wanted: 0,
                pending: 0,
                panic: None,
                workers: 0,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            next_item: AtomicUsize::new(0),
            generation_atomic: AtomicU64::new(0),
            pending_atomic: AtomicUsize::new(0),
        })
    }

    fn run(&'static self, items: usize, num_threads: usize, f: &ItemFn<'_>) {
        let _job = match self.job.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // busy: run on the caller's thread
                (0..items).for_each(|item| f(item, 0));
                return;
            }
        };
        let wanted = num_threads.min(items) - 1;
        self.ensure_workers(wanted);
        // SAFETY: only the lifetime is erased; this function does not return before `pending`
        // is 0, i.e. before every worker that read the pointer has stopped using it.
        let job =
            JobFn(unsafe { std::mem::transmute::<*const ItemFn<'_>, *const ItemFn<'static>>(f) });
        {
            let mut state = lock(&self.state);
            state.job = Some(job);
            state.items = items;
            state.wanted = wanted;
            state.pending = wanted;
            self.pending_atomic.store(wanted, Ordering::Relaxed);
            state.panic = None;
            self.next_item.store(0, Ordering::Relaxed);
            state.generation += 1;
            self.generation_atomic
                .store(state.generation, Ordering::Release);
        }
        self.wake.notify_all();
        self.take_items(f, items, 0);
        spin_until(|| self.pending_atomic.load(Ordering::Acquire) == 0);
        let mut state = lock(&self.state);
        while state.pending != 0 {
            state = self.done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.job = None;
        if let Some(payload) = state.panic.take() {
            drop(state);
            resume_unwind(payload);
        }
    }

    fn ensure_workers(&'static self, count: usize) {
        loop {
            let (thread, seen) = {
                let mut state = lock(&self.state);
                if state.workers >= count {
                    return;
                }
                state.workers += 1;
                (state.workers, state.generation)
            };
            std::thread::Builder::new()
                .name(format!("twinattn-{thread}"))
                .spawn(move || self.worker_loop(thread, seen))
                .expect("twinattn: cannot start a worker thread");
        }
    }

    fn take_items(&self, f: &ItemFn<'_>, items: usize, thread: usize) {
        loop {
            let item = self.next_item.fetch_add(1, Ordering::Relaxed);
            if item >= items {
                return;
            }
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(item, thread))) {
                let mut state = lock(&self.state);
                state.panic.get_or_insert(payload);
                self.next_item.store(items, Ordering::Relaxed); // stop handing out items
            }
        }
    }

    fn worker_loop(&self, thread: usize, mut seen: u64) {
        loop {
            spin_until(|| self.generation_atomic.load(Ordering::Acquire) != seen);
            let (job, items) = {
                let mut state = lock(&self.state);
                while state.generation == seen {
                    state = self.wake.wait(state).unwrap_or_else(|p| p.into_inner());
                }
                seen = state.generation;
                if thread > state.wanted {
                    continue; // not needed for this job
                }
                (
                    state.job.expect("a wanted worker always has a job"),
                    state.items,
                )
            };
            // SAFETY: the caller that published the job waits for this worker's report below
            // before it returns, so the function is alive here.
            let f = unsafe { &*job.0 };
            self.take_items(f, items, thread);
            let mut state = lock(&self.state);
            self.pending_atomic.fetch_sub(1, Ordering::Release);
            state.pending -= 1;
            if state.pending == 0 {
                self.done.notify_one();
            }
        }
    }
}

/// Calls `f(item, thread)` for every item in `0..items` on up to `num_threads` threads (the
/// caller is thread 0). See the module documentation.
pub fn parallel_for(items: usize, num_threads: usize, f: &ItemFn<'_>) {
    if items == 0 {
        return;
    }
    if num_threads <= 1 || items == 1 {
        (0..items).for_each(|item| f(item, 0));
        return;
    }
    ThreadPool::instance().run(items, num_threads, f);
}
