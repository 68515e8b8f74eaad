//! Model checks of the task queue under every interleaving loom explores.
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kt-host --release --test loom`.
#![cfg(loom)]

use kt_host::queue::{TaskError, TaskQueue};
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
