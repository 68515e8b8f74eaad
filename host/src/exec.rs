//! A plain scoped-thread executor. The caller is worker 0; helpers claim tasks from a shared
//! counter. The simplest executor: a yardstick for the persistent pools in tests.

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
    }
}
