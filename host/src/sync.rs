//! The synchronisation primitives of the task queue, from loom under `--cfg loom` (so
//! `RUSTFLAGS="--cfg loom" cargo test -p kt-host --test loom` model-checks every interleaving)
//! and from std otherwise.

#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::thread;

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread;

/// Lock, ignoring poisoning: a task that panicked is reported through the queue, and the
/// queue's own state stays consistent because no critical section here can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wait on `cv`, ignoring poisoning (see [`lock`]).
pub(crate) fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(|e| e.into_inner())
}
