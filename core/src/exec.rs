//! The `Executor` trait: how a stage's independent tasks are spread over threads. Core has the
//! serial one; the host supplies thread pools. Results never depend on which executor runs.
#![forbid(unsafe_code)]

/// Runs `n_tasks` independent tasks and returns when all are done.
pub trait Executor: Send + Sync {
    /// Call `f(task, worker)` once for every `task < n_tasks`, on up to [`Executor::workers`]
    /// threads (`worker < workers()`), and return after the last call has returned. Two calls
    /// with the same `worker` never overlap (a worker's scratch is handed to each of its tasks
    /// in turn). Everything the tasks wrote happens-before the return.
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync));

    /// Threads that may run tasks at once.
    fn workers(&self) -> usize;

    /// As [`Executor::parallel_for`], where task `t` belongs to group `group(t)` (its NUMA
    /// part): an executor with sub-pools runs group `g` on sub-pool `g % sub_pools`, next to
    /// that part's weights. Worker numbers stay below [`Executor::workers`]. Others ignore it.
    fn parallel_for_grouped(
        &self,
        n_tasks: usize,
        group: &(dyn Fn(usize) -> usize + Sync),
        f: &(dyn Fn(usize, usize) + Sync),
    ) {
        let _ = group;
        self.parallel_for(n_tasks, f);
    }

    /// Names the work of the next call (the forward names its stages), for an executor that
    /// times its calls (`kt bench --stages`). Others ignore it.
    fn label(&self, what: &'static str) {
        let _ = what;
    }
}

/// Runs every task on the calling thread, in order.
#[derive(Clone, Copy, Debug, Default)]
pub struct SerialExecutor;

impl Executor for SerialExecutor {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        for t in 0..n_tasks {
            f(t, 0);
        }
    }

    fn workers(&self) -> usize {
        1
    }
}
