//! A persistent worker pool: `threads - 1` workers wait for jobs (spinning ~200 µs, then parked
//! on a condvar, so an idle pool costs no CPU), the caller is worker 0, tasks are claimed from a
//! shared counter. Starting a job costs one atomic increment when workers are spinning, instead
//! of a thread spawn per stage. (NUMA sub-pools and pinning come with the NUMA pool issue.)

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kt_core::Executor;

type Task = dyn Fn(usize, usize) + Sync;

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(200);

struct Shared {
    /// Bumped once per job (and at shutdown).
    epoch: AtomicU64,
    /// The current job; written by the caller before `epoch` is bumped.
    job: Mutex<Option<(&'static Task, usize)>>,
    next: AtomicUsize,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// A pool of `threads` threads (the caller counts as one).
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time, whoever calls.
    serial: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool({} threads)", self.workers.len() + 1)
    }
}

impl Pool {
    /// A pool of `threads` threads (at least 1): `threads - 1` workers plus the caller.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        });
        let workers = (1..threads.max(1))
            .map(|w| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("kt-worker-{w}"))
                    .spawn(move || worker(&s, w))
                    .expect("spawn a worker thread")
            })
            .collect();
        Pool { shared, workers, serial: Mutex::new(()) }
    }
}

fn run_tasks(s: &Shared, f: &(dyn Fn(usize, usize) + Sync + '_), n: usize, w: usize) {
    let r = catch_unwind(AssertUnwindSafe(|| loop {
        let t = s.next.fetch_add(1, Ordering::Relaxed);
        if t >= n {
            break;
        }
        f(t, w);
    }));
    if let Err(p) = r {
        s.next.store(usize::MAX / 2, Ordering::Relaxed); // stop handing out tasks
        s.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
    }
}

fn worker(s: &Shared, w: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins += 1;
            if spins % 128 == 0 && start.elapsed() > SPIN {
                let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                let mut g = guard;
                while s.epoch.load(Ordering::SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
        }
        seen = s.epoch.load(Ordering::Acquire);
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((f, n)) = job {
            run_tasks(s, f, n, w);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Shared {
    fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }
}

impl Executor for Pool {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        if self.workers.is_empty() || n_tasks <= 1 {
            (0..n_tasks).for_each(|t| f(t, 0));
            return;
        }
        let _one = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: the 'static lifetime never escapes this call: every worker finishes with the
        // job (pending reaches 0) before we return, and the job slot is cleared below.
        let f_static: &'static Task =
            unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Task>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some((f_static, n_tasks));
        s.next.store(0, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.bump();
        run_tasks(s, f, n_tasks, 0);
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Some(p) = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(p);
        }
    }

    fn workers(&self) -> usize {
        self.workers.len() + 1
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.bump();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_once_across_many_jobs_and_sleeps() {
        let pool = Pool::new(3);
        for round in 0..200 {
            let n = round % 17;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.parallel_for(n, &|t, w| {
                assert!(w < 3);
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
            if round % 50 == 0 {
                std::thread::sleep(Duration::from_millis(2)); // let workers park
            }
        }
    }

    #[test]
    fn a_panicking_task_surfaces_and_the_pool_stays_usable() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.parallel_for(64, &|t, _| assert!(t != 40, "task 40 fails"))));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.parallel_for(10, &|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }
}
