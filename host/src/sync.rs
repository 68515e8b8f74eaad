//! The synchronisation primitives of the task queue and the worker pool, from loom under
//! `--cfg loom` (so `RUSTFLAGS="--cfg loom" cargo test -p kt-host --test loom` model-checks
//! every interleaving) and from std otherwise.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::thread;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread;

/// Lock, ignoring poisoning: a task that panicked is reported through the queue or the pool,
/// and their own state stays consistent because no critical section here can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wait on `cv`, ignoring poisoning (see [`lock`]).
pub(crate) fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(|e| e.into_inner())
}

/// A spin budget: `true` once a waiter has spun long enough and should park. Under loom there
/// is no clock, and a waiter parks at once.
pub(crate) struct Spin {
    #[cfg(not(loom))]
    start: std::time::Instant,
    #[cfg(not(loom))]
    spins: u32,
}

impl Spin {
    pub(crate) fn new() -> Self {
        Spin {
            #[cfg(not(loom))]
            start: std::time::Instant::now(),
            #[cfg(not(loom))]
            spins: 0,
        }
    }

    /// One more spin; whether `budget` has run out. Under loom it has at once, without a
    /// yield: a yield would make loom run the other threads first and so never explore the
    /// schedules where this thread goes to sleep before they act.
    pub(crate) fn expired(&mut self, budget: std::time::Duration) -> bool {
        #[cfg(loom)]
        {
            let _ = budget;
            true
        }
        #[cfg(not(loom))]
        {
            std::hint::spin_loop();
            self.spins += 1;
            self.spins % 128 == 0 && self.start.elapsed() > budget
        }
    }
}
