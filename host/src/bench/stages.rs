//! Where a forward's time goes (`kt bench --stages`): an executor that times each call of the
//! one it wraps under the label the forward gave it (its stages: `StageKind::name`), and the
//! medians over a case's reps, the forward's own serial work (planning, buffers) beside them.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kt_core::Executor;

/// The label of a call that was given none (packing at load, say).
const UNLABELLED: &str = "other";
/// The time of a forward outside its executor calls.
pub const SERIAL: &str = "serial";

/// Times every call of `inner`.
pub struct StageClock {
    inner: Arc<dyn Executor>,
    /// The label of the next call, and the (label, seconds) of the calls since the last `take`.
    state: Mutex<(&'static str, Vec<(&'static str, f64)>)>,
}

impl StageClock {
    /// A clock around `inner`.
    pub fn new(inner: Arc<dyn Executor>) -> Self {
        StageClock { inner, state: Mutex::new((UNLABELLED, Vec::new())) }
    }

    /// The calls timed since the last `take`, in order.
    pub fn take(&self) -> Vec<(&'static str, f64)> {
        std::mem::take(&mut self.lock().1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (&'static str, Vec<(&'static str, f64)>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn timed(&self, call: impl FnOnce()) {
        let t = Instant::now();
        call();
        let s = t.elapsed().as_secs_f64();
        let mut state = self.lock();
        let label = std::mem::replace(&mut state.0, UNLABELLED);
        state.1.push((label, s));
    }
}

impl Executor for StageClock {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        self.timed(|| self.inner.parallel_for(n_tasks, f));
    }

    fn workers(&self) -> usize {
        self.inner.workers()
    }

    fn parallel_for_grouped(
        &self,
        n_tasks: usize,
        group: &(dyn Fn(usize) -> usize + Sync),
        f: &(dyn Fn(usize, usize) + Sync),
    ) {
        self.timed(|| self.inner.parallel_for_grouped(n_tasks, group, f));
    }

    fn label(&self, what: &'static str) {
        self.lock().0 = what;
    }
}

/// Per label, in the order first seen, the median over `reps` of its seconds in a rep (a label
/// called twice in one rep counts once, summed), and [`SERIAL`]: a rep's time outside them;
/// none without reps.
pub fn medians(reps: &[(f64, Vec<(&'static str, f64)>)]) -> Vec<(&'static str, f64)> {
    if reps.is_empty() {
        return Vec::new();
    }
    let mut labels: Vec<&'static str> = Vec::new();
    for (_, calls) in reps {
        for &(l, _) in calls {
            if !labels.contains(&l) {
                labels.push(l);
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let per_rep = |l: &str| -> Vec<f64> {
        reps.iter().map(|(_, calls)| calls.iter().filter(|c| c.0 == l).map(|c| c.1).sum()).collect()
    };
    let serial = reps.iter().map(|(total, calls)| (total - calls.iter().map(|c| c.1).sum::<f64>()).max(0.0)).collect();
    labels.iter().map(|&l| (l, median(per_rep(l)))).chain([(SERIAL, median(serial))]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_core::SerialExecutor;

    /// A labelled call is recorded under its label, the next unlabelled one as "other", and
    /// the medians put each label's per-rep sum and the rest of each rep in order.
    #[test]
    fn calls_are_timed_under_their_labels() {
        let clock = StageClock::new(Arc::new(SerialExecutor));
        clock.label("Gather");
        clock.parallel_for(3, &|_, _| std::thread::sleep(std::time::Duration::from_millis(2)));
        clock.parallel_for_grouped(1, &|t| t, &|_, _| {});
        let calls = clock.take();
        assert_eq!(calls.iter().map(|c| c.0).collect::<Vec<_>>(), ["Gather", UNLABELLED]);
        assert!(calls[0].1 >= 0.006, "{calls:?}");
        assert!(clock.take().is_empty());

        let reps = [
            (1.0, vec![("A", 0.25), ("B", 0.25), ("A", 0.25)]),
            (2.0, vec![("A", 0.5), ("B", 0.5)]),
            (3.0, vec![("B", 1.0)]),
        ];
        assert_eq!(medians(&reps), [("A", 0.5), ("B", 0.5), (SERIAL, 1.0)]);
        assert!(medians(&[]).is_empty());
    }
}
