//! The NUMA pool: one [`Pool`] per sub-pool, its workers pinned to the CPUs of its node. Tasks
//! of NUMA part `p` run on sub-pool `p`, so a part's weights are read (and, at load, first
//! touched, which places their pages) by the threads of its node. The caller of a forward is
//! worker 0 of sub-pool 0; the other sub-pools' threads are all workers.

use std::panic::resume_unwind;

use kt_core::Executor;

use crate::placement::{Placement, PoolConfig, PoolError};
use crate::pool::{pin_current_thread, Panic, Pool};
use crate::sync::{lock, Mutex};
use crate::topology::Topology;

/// Sub-pools by NUMA part; an [`Executor`].
pub struct NumaPool {
    pools: Vec<Pool>,
    /// Worker number of each sub-pool's first thread.
    first_worker: Vec<usize>,
    placement: Placement,
    /// One job at a time, whoever calls; under it, each sub-pool's task list of the current
    /// job, kept between jobs so that a stage after warm-up allocates nothing.
    serial: Mutex<Vec<Vec<usize>>>,
}

/// Sub-pools whose jobs are built on the stack (more are built in a `Vec`).
const STACK_SUBPOOLS: usize = 16;

impl std::fmt::Debug for NumaPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NumaPool({} sub-pools, {} threads)", self.pools.len(), self.workers())
    }
}

impl NumaPool {
    /// Build the pool `config` describes on `topo` (workers are pinned where the OS allows).
    pub fn new(config: &PoolConfig, topo: &Topology) -> Result<Self, PoolError> {
        let placement = config.place(topo)?;
        let pools: Vec<Pool> =
            placement.subpools.iter().enumerate().map(|(i, s)| Pool::pinned(&s.cpus, i == 0)).collect();
        let first_worker = pools.iter().scan(0, |at, p| Some(std::mem::replace(at, *at + p.threads()))).collect();
        Ok(NumaPool { pools, first_worker, placement, serial: Mutex::new(Vec::new()) })
    }

    /// `threads` threads in `parts` sub-pools on the running machine ([`PoolConfig::split`]).
    pub fn with_threads(threads: usize, parts: usize) -> Result<Self, PoolError> {
        let topo = Topology::detect();
        Self::new(&PoolConfig::split(&topo, threads, parts)?, &topo)
    }

    /// Where its threads run.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Sub-pools.
    pub fn subpools(&self) -> usize {
        self.pools.len()
    }

    /// Worker threads pinned to their CPU (the caller, worker 0, is not counted).
    pub fn pinned_workers(&self) -> usize {
        self.pools.iter().map(Pool::pinned_workers).sum()
    }

    /// Pin the calling thread to sub-pool 0's caller slot; for a thread that owns the pool
    /// (the Python wrapper's queue thread). Whether the OS accepted it.
    pub fn pin_caller(&self) -> bool {
        self.placement.subpools[0].cpus.first().is_some_and(|&c| pin_current_thread(c))
    }
}

impl Executor for NumaPool {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        self.parallel_for_grouped(n_tasks, &|t| t, f);
    }

    fn workers(&self) -> usize {
        self.pools.iter().map(Pool::threads).sum()
    }

    fn parallel_for_grouped(
        &self,
        n_tasks: usize,
        group: &(dyn Fn(usize) -> usize + Sync),
        f: &(dyn Fn(usize, usize) + Sync),
    ) {
        if self.pools.len() == 1 {
            return self.pools[0].parallel_for(n_tasks, f);
        }
        let n = self.pools.len();
        let mut lists = lock(&self.serial);
        lists.resize_with(n, Vec::new);
        for list in lists.iter_mut() {
            list.clear();
            // Room for every task of this job, at least 256 (a stage of a forward has up to
            // 4 tasks a thread plus one per active expert): only a larger job allocates, once.
            list.reserve(n_tasks.next_power_of_two().max(256));
        }
        for t in 0..n_tasks {
            lists[group(t) % n].push(t);
        }
        let (lists, first) = (&*lists, &self.first_worker);
        // One job per sub-pool (each a closure of the same type), on the stack when few.
        let job = |p: usize| move |i: usize, w: usize| f(lists[p][i], first[p] + w);
        let (on_stack, on_heap);
        let jobs: &[_] = if n <= STACK_SUBPOOLS {
            on_stack = core::array::from_fn::<_, STACK_SUBPOOLS, _>(job);
            &on_stack[..n]
        } else {
            on_heap = (0..n).map(job).collect::<Vec<_>>();
            &on_heap
        };
        let mut panic: Option<Panic> = None;
        // Sub-pools 1.. with work run on their own workers while this thread works sub-pool 0.
        let others =
            || self.pools.iter().zip(jobs.iter()).zip(lists.iter()).skip(1).filter(|(_, list)| !list.is_empty());
        for ((pool, job), list) in others() {
            // SAFETY: every started pool is finished below, before `jobs` is dropped.
            unsafe { pool.start(job, list.len()) };
        }
        if !lists[0].is_empty() {
            // SAFETY: finished two lines below. (With no workers this only runs `help`.)
            unsafe { self.pools[0].start(&jobs[0], lists[0].len()) };
            self.pools[0].help(&jobs[0], lists[0].len());
            panic = self.pools[0].finish();
        }
        for ((pool, _), _) in others() {
            let p = pool.finish();
            panic = panic.or(p);
        }
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::placement::SubPoolConfig;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn two_parts() -> NumaPool {
        let topo = Topology::detect();
        let node = topo.nodes[0].os_index;
        let cfg = PoolConfig {
            subpools: vec![SubPoolConfig { node, threads: 2 }, SubPoolConfig { node, threads: 2 }],
            smt: false,
        };
        NumaPool::new(&cfg, &topo).unwrap()
    }

    #[test]
    fn each_group_runs_on_its_subpool_once() {
        let pool = two_parts();
        assert_eq!(pool.workers(), 4);
        for n in [0, 1, 5, 64] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.parallel_for_grouped(n, &|t| t % 3, &|t, w| {
                // Groups 0 and 2 go to sub-pool 0 (workers 0-1), group 1 to sub-pool 1 (2-3).
                assert_eq!(w / 2, (t % 3) % 2, "task {t} ran on worker {w}");
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn stress_two_callers_random_sizes_and_panics() {
        // Two threads share one pool (calls serialize); random task counts and groups, every
        // 7th call has a panicking task. No deadlock, no lost or doubled task.
        let pool = two_parts();
        std::thread::scope(|s| {
            for caller in 0..2u64 {
                let pool = &pool;
                s.spawn(move || {
                    let mut r = kt_core::rng::SplitMix64::new(caller);
                    for call in 0..1500 {
                        let n = r.below(40);
                        let bad = (call % 7 == 3 && n > 0).then(|| r.below(n));
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            pool.parallel_for_grouped(n, &|t| t * 5 % 3, &|t, _| {
                                hits[t].fetch_add(1, Ordering::Relaxed);
                                assert!(Some(t) != bad, "injected");
                            })
                        }));
                        assert_eq!(run.is_err(), bad.is_some());
                        if bad.is_none() {
                            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "call {call}");
                        } else {
                            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) <= 1), "call {call}");
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_panic_in_any_subpool_surfaces_after_all_finish() {
        let pool = two_parts();
        for bad in [3, 4] {
            let done = AtomicUsize::new(0);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.parallel_for_grouped(40, &|t| t, &|t, _| {
                    assert!(t != bad, "task {t} fails");
                    done.fetch_add(1, Ordering::Relaxed);
                })
            }));
            assert!(r.is_err());
            let count = AtomicUsize::new(0);
            pool.parallel_for(10, &|_, _| {
                count.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(count.load(Ordering::Relaxed), 10, "the pool stays usable");
        }
    }
}
