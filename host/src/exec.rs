//! A plain scoped-thread executor. The caller is worker 0; helpers claim tasks from a shared
//! counter. (The NUMA pool issue replaces it with persistent, pinned workers.)

use std::sync::atomic::{AtomicUsize, Ordering};

use kt_core::Executor;

/// Spawns up to `threads - 1` scoped helpers per `parallel_for`.
#[derive(Clone, Copy, Debug)]
pub struct ThreadExecutor {
    threads: usize,
}

impl ThreadExecutor {
    /// An executor using `threads` threads (at least 1).
    pub fn new(threads: usize) -> Self {
        ThreadExecutor { threads: threads.max(1) }
    }
}

impl Executor for ThreadExecutor {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let workers = self.threads.min(n_tasks);
        if workers <= 1 {
            (0..n_tasks).for_each(|t| f(t, 0));
            return;
        }
        let next = AtomicUsize::new(0);
        let work = |w: usize| loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= n_tasks {
                break;
            }
            f(t, w);
        };
        std::thread::scope(|s| {
            for w in 1..workers {
                let work = &work;
                s.spawn(move || work(w));
            }
            work(0);
        });
    }

    fn workers(&self) -> usize {
        self.threads
    }
}

/// `f(i)` for `i < n` on `threads` threads, results in index order.
pub fn parallel_map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let slots: Vec<std::sync::Mutex<Option<T>>> = (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    ThreadExecutor::new(threads).parallel_for(n, &|i, _| {
        let v = f(i);
        *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
    });
    slots.into_iter().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every task ran")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        for threads in [1, 2, 5] {
            let hits: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
            ThreadExecutor::new(threads).parallel_for(100, &|t, w| {
                assert!(w < threads);
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        assert_eq!(parallel_map(7, 3, |i| i * i), vec![0, 1, 4, 9, 16, 25, 36]);
    }
}
