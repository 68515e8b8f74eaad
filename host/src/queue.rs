//! The asynchronous task queue of KT's `CPUInfer`: one queue thread runs submitted tasks in
//! FIFO order; `submit` returns at once with the task's ticket; `sync(allow_pending)` waits
//! until at most that many tasks are left, `sync_until(ticket)` until that task and every one
//! before it ran (what a caller sharing the queue with other threads waits for); the first error or panic of a task since the last `sync` is returned by it,
//! and the queue stays usable. Dropping the queue runs what is queued, then joins its thread.
//!
//! All synchronisation goes through the crate's `sync` module, so loom model-checks it (tests/loom.rs).

use std::collections::VecDeque;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::sync::{lock, thread, wait, Arc, Condvar, Mutex};

/// A unit of work: runs once on the queue thread.
pub type Task = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// Why a task failed, as the next `sync` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskError {
    /// The task returned an error.
    Failed(String),
    /// The task panicked (the message, when it was a string).
    Panicked(String),
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::Failed(m) => write!(f, "a CPU task failed: {m}"),
            TaskError::Panicked(m) => write!(f, "a CPU task panicked: {m}"),
        }
    }
}

impl std::error::Error for TaskError {}

struct State {
    tasks: VecDeque<Task>,
    /// Queued plus running.
    pending: usize,
    /// Tasks submitted so far (the last ticket handed out).
    submitted: u64,
    error: Option<TaskError>,
    shutdown: bool,
}

struct Inner {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

/// One FIFO queue with its own thread.
pub struct TaskQueue {
    inner: Arc<Inner>,
    thread: Option<thread::JoinHandle<()>>,
}

impl fmt::Debug for TaskQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TaskQueue({} pending)", lock(&self.inner.state).pending)
    }
}

impl Default for TaskQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl TaskQueue {
    /// A queue and its thread.
    pub fn new() -> Self {
        let inner = Arc::new(Inner {
            state: Mutex::new(State { tasks: VecDeque::new(), pending: 0, submitted: 0, error: None, shutdown: false }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let i = inner.clone();
        let thread = thread::spawn(move || run(&i));
        TaskQueue { inner, thread: Some(thread) }
    }

    /// Queue `task` behind every task submitted before it; returns at once with its ticket
    /// (1, 2, ... in submission order).
    pub fn submit(&self, task: Task) -> u64 {
        let mut s = lock(&self.inner.state);
        s.tasks.push_back(task);
        s.pending += 1;
        s.submitted += 1;
        let ticket = s.submitted;
        drop(s);
        self.inner.work.notify_one();
        ticket
    }

    /// Wait until at most `allow_pending` tasks are queued or running, then return the first
    /// error since the last `sync` (clearing it).
    pub fn sync(&self, allow_pending: usize) -> Result<(), TaskError> {
        let mut s = lock(&self.inner.state);
        while s.pending > allow_pending {
            s = wait(&self.inner.done, s);
        }
        s.error.take().map_or(Ok(()), Err)
    }

    /// Wait until the task with this ticket (and so, FIFO, every task before it) has run, then
    /// return the first error since the last sync (clearing it; it may be another caller's).
    pub fn sync_until(&self, ticket: u64) -> Result<(), TaskError> {
        let mut s = lock(&self.inner.state);
        // Done = submitted minus pending, since tasks finish in submission order.
        while s.submitted - (s.pending as u64) < ticket {
            s = wait(&self.inner.done, s);
        }
        s.error.take().map_or(Ok(()), Err)
    }

    /// Tasks queued or running now.
    pub fn pending(&self) -> usize {
        lock(&self.inner.state).pending
    }
}

fn run(inner: &Inner) {
    loop {
        let mut s = lock(&inner.state);
        let task = loop {
            if let Some(t) = s.tasks.pop_front() {
                break t;
            }
            if s.shutdown {
                return;
            }
            s = wait(&inner.work, s);
        };
        drop(s);
        let result = match catch_unwind(AssertUnwindSafe(task)) {
            Ok(Ok(())) => None,
            Ok(Err(m)) => Some(TaskError::Failed(m)),
            Err(p) => Some(TaskError::Panicked(
                p.downcast_ref::<&str>()
                    .map(|m| m.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default(),
            )),
        };
        let mut s = lock(&inner.state);
        if s.error.is_none() {
            s.error = result;
        }
        s.pending -= 1;
        drop(s);
        inner.done.notify_all();
    }
}

impl Drop for TaskQueue {
    fn drop(&mut self) {
        lock(&self.inner.state).shutdown = true;
        self.inner.work.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn fifo_order_allow_pending_and_errors_at_sync() {
        let q = TaskQueue::new();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let gate = std::sync::Arc::new(std::sync::Barrier::new(2));
        let (l, g) = (log.clone(), gate.clone());
        q.submit(Box::new(move || {
            g.wait(); // hold the queue until the test has checked allow_pending
            l.lock().unwrap().push(0);
            Ok(())
        }));
        for i in 1..5 {
            let l = log.clone();
            q.submit(Box::new(move || {
                l.lock().unwrap().push(i);
                if i == 2 {
                    Err("task 2 says no".into())
                } else {
                    Ok(())
                }
            }));
        }
        assert_eq!(q.pending(), 5);
        gate.wait();
        assert_eq!(q.sync(0), Err(TaskError::Failed("task 2 says no".into())));
        assert_eq!(*log.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(q.sync(0), Ok(()), "the error is reported once");
        q.submit(Box::new(|| panic!("boom")));
        assert_eq!(q.sync(0), Err(TaskError::Panicked("boom".into())));
        q.submit(Box::new(|| Ok(())));
        assert_eq!(q.sync(0), Ok(()), "usable after a panic");
    }

    #[test]
    fn stress_two_producers_with_panics() {
        // Thousands of submits from two threads, random sizes, injected panics: every task runs
        // exactly once, in per-producer order, no sync deadlocks, and `sync_until` returns
        // only once its task ran.
        let q = std::sync::Arc::new(TaskQueue::new());
        let ran = std::sync::Arc::new(AtomicUsize::new(0));
        let order: std::sync::Arc<[std::sync::Mutex<Vec<usize>>; 2]> = std::sync::Arc::new(Default::default());
        std::thread::scope(|s| {
            for p in 0..2 {
                let (q, ran, order) = (q.clone(), ran.clone(), order.clone());
                s.spawn(move || {
                    let mut r = kt_core::rng::SplitMix64::new(p as u64);
                    let mut errors = 0;
                    for i in 0..3000 {
                        let (ran, mine) = (ran.clone(), order.clone());
                        let spin = r.below(200);
                        let fail = r.below(50) == 0;
                        let ticket = q.submit(Box::new(move || {
                            (0..spin).for_each(|x| {
                                std::hint::black_box(x);
                            });
                            mine[p].lock().unwrap().push(i);
                            ran.fetch_add(1, Ordering::Relaxed);
                            assert!(!fail, "injected");
                            Ok(())
                        }));
                        if i % 97 == 0 && q.sync(r.below(4)).is_err() {
                            errors += 1;
                        }
                        // Waiting for its own ticket, a producer sees its task done, whatever
                        // the other one queued meanwhile.
                        if i % 89 == 0 {
                            let _ = q.sync_until(ticket);
                            assert!(order[p].lock().unwrap().len() > i);
                        }
                    }
                    errors
                });
            }
        });
        let _ = q.sync(0);
        assert_eq!(ran.load(Ordering::Relaxed), 6000);
        for o in order.iter() {
            let o = o.lock().unwrap();
            assert!(o.windows(2).all(|w| w[0] < w[1]) && o.len() == 3000);
        }
        assert_eq!(q.pending(), 0);
    }
}
