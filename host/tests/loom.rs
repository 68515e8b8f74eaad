//! Model checks of the task queue and the worker pools (claim counter, stage barrier, park and
//! wake, sub-pools) under every interleaving loom explores.
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kt-host --release --test loom`.
#![cfg(loom)]

use kt_core::Executor;
use kt_host::numa_pool::NumaPool;
use kt_host::placement::{PoolConfig, SubPoolConfig};
use kt_host::pool::Pool;
use kt_host::queue::{TaskError, TaskQueue};
use kt_host::topology::{Node, Source, Topology};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;

/// Submit `tasks` tasks that each count once; returns the counter.
fn submit_counters(q: &TaskQueue, tasks: usize) -> Arc<AtomicUsize> {
    let n = Arc::new(AtomicUsize::new(0));
    for _ in 0..tasks {
        let n = n.clone();
        q.submit(Box::new(move || {
            n.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }));
    }
    n
}

#[test]
fn submit_then_sync_sees_every_task() {
    loom::model(|| {
        let q = TaskQueue::new();
        let n = submit_counters(&q, 2);
        q.sync(0).unwrap();
        assert_eq!(n.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn allow_pending_leaves_at_most_that_many() {
    loom::model(|| {
        let q = TaskQueue::new();
        let n = submit_counters(&q, 2);
        q.sync(1).unwrap();
        assert!(n.load(Ordering::SeqCst) >= 1);
        q.sync(0).unwrap();
        assert_eq!(n.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn an_error_surfaces_at_the_next_sync_only() {
    loom::model(|| {
        let q = TaskQueue::new();
        q.submit(Box::new(|| Err("bad".into())));
        q.submit(Box::new(|| Ok(())));
        assert_eq!(q.sync(0), Err(TaskError::Failed("bad".into())));
        assert_eq!(q.sync(0), Ok(()));
    });
}

#[test]
fn drop_runs_queued_tasks_and_joins() {
    loom::model(|| {
        let n = {
            let q = TaskQueue::new();
            submit_counters(&q, 1)
        };
        assert_eq!(n.load(Ordering::SeqCst), 1);
    });
}

/// The pools' state space is too large to exhaust; bound the preemptions per execution (loom's
/// advice: most concurrency bugs need only a few).
fn bounded() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b
}

/// Run `jobs` jobs of `tasks` tasks on `exec`; each task must run exactly once per job, and
/// every write of a job must be visible when `parallel_for` returns (the stage barrier).
fn jobs(exec: &dyn Executor, jobs: usize, tasks: usize) {
    for _ in 0..jobs {
        let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        exec.parallel_for(tasks, &|t, w| {
            assert!(w < exec.workers());
            hits[t].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }
}

#[test]
fn pool_claims_each_task_once_and_the_barrier_holds() {
    // Two jobs: the second wakes a worker that may be spinning, parked or still finishing.
    bounded().check(|| {
        let pool = Pool::new(2);
        jobs(&pool, 2, 2);
    });
}

#[test]
fn numa_subpools_finish_before_the_call_returns() {
    bounded().check(|| {
        let topo = Topology {
            nodes: vec![Node { os_index: 0, cores: vec![vec![0], vec![1]] }],
            logical_cpus: 2,
            l3_bytes: 0,
            mem_available: 0,
            mem_total: 0,
            source: Source::Sysfs,
        };
        let one = SubPoolConfig { node: 0, threads: 1 };
        let pool = NumaPool::new(&PoolConfig { subpools: vec![one, one], smt: false }, &topo).unwrap();
        jobs(&pool, 1, 2);
    });
}
