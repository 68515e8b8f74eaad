//! A persistent worker pool: workers wait for jobs (spinning ~200 µs, then parked on a condvar,
//! so an idle pool costs no CPU) and claim tasks from a shared counter, which balances skewed
//! tasks without locks. Starting a job costs one atomic increment when workers are spinning.
//! Workers may be pinned to CPUs ([`Pool::pinned`]); the NUMA pool runs one such pool per node.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Duration;

use kt_core::Executor;

use crate::sync::{lock, thread, wait, Arc, AtomicBool, AtomicU64, AtomicUsize, Condvar, Mutex, Ordering, Spin};

type Task = dyn Fn(usize, usize) + Sync;
pub(crate) type Panic = Box<dyn Any + Send>;

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(200);

struct Shared {
    /// Bumped once per job (and at shutdown).
    epoch: AtomicU64,
    /// The current job and the worker number of its first thread; written before `epoch` is
    /// bumped.
    job: Mutex<Option<(&'static Task, usize)>>,
    next: AtomicUsize,
    /// Workers that have not finished the current job: the stage barrier.
    pending: AtomicUsize,
    /// Whether the caller waits on `done` for `pending` to reach 0 (it spun its budget out).
    done_lock: Mutex<bool>,
    done: Condvar,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    panic: Mutex<Option<Panic>>,
    /// Workers whose pinning succeeded.
    pinned: AtomicUsize,
}

/// A pool of threads; with [`Pool::new`] the caller of [`Executor::parallel_for`] is worker 0.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<thread::JoinHandle<()>>,
    /// Whether the calling thread runs tasks too (worker 0).
    caller_joins: bool,
    /// One job at a time, whoever calls.
    serial: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool({} threads)", self.threads())
    }
}

impl Pool {
    /// A pool of `threads` threads (at least 1): `threads - 1` unpinned workers plus the caller.
    pub fn new(threads: usize) -> Self {
        Self::build(&vec![None; threads.max(1) - 1], true)
    }

    /// Workers pinned one to each CPU of `cpus` (OS numbers). With `caller_joins`, the caller is
    /// worker 0 and `cpus[0]` is left for it (it is not pinned: it is the caller's thread);
    /// otherwise every CPU gets a worker and the caller only waits.
    pub fn pinned(cpus: &[usize], caller_joins: bool) -> Self {
        let skip = usize::from(caller_joins).min(cpus.len());
        let cpus: Vec<Option<usize>> = cpus[skip..].iter().map(|&c| Some(c)).collect();
        Self::build(&cpus, caller_joins)
    }

    fn build(cpus: &[Option<usize>], caller_joins: bool) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            done_lock: Mutex::new(false),
            done: Condvar::new(),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
            pinned: AtomicUsize::new(0),
        });
        let first = usize::from(caller_joins);
        let workers = cpus
            .iter()
            .enumerate()
            .map(|(i, &cpu)| {
                let s = shared.clone();
                let w = first + i;
                spawn(format!("kt-worker-{w}"), move || {
                    if cpu.is_some_and(pin_current_thread) {
                        s.pinned.fetch_add(1, Ordering::Relaxed);
                    }
                    worker(&s, w)
                })
            })
            .collect();
        Pool { shared, workers, caller_joins, serial: Mutex::new(()) }
    }

    /// Threads that run tasks (the caller included when it joins).
    pub fn threads(&self) -> usize {
        self.workers.len() + usize::from(self.caller_joins)
    }

    /// Workers pinned to their CPU so far (pinning happens as each thread starts).
    pub fn pinned_workers(&self) -> usize {
        self.shared.pinned.load(Ordering::Relaxed)
    }

    /// Workers parked on the condvar now (idle past the spin budget: they use no CPU).
    pub fn parked_workers(&self) -> usize {
        self.shared.sleepers.load(Ordering::Relaxed)
    }

    /// Publish a job: `f(task, base + worker)` for `task < n`.
    ///
    /// # Safety
    /// [`Pool::finish`] must be called before `f` is dropped, and no other job may be started
    /// on this pool until then.
    pub(crate) unsafe fn start(&self, f: &(dyn Fn(usize, usize) + Sync + '_), n: usize) {
        let s = &*self.shared;
        // SAFETY: the caller promises `finish` runs before `f` dies; `finish` waits until every
        // worker is done with the job and clears the slot, so the 'static never escapes.
        let f: &'static Task = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Task>(f) };
        *lock(&s.job) = Some((f, n));
        s.next.store(0, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.bump();
    }

    /// The caller's share of the started job, as worker 0 (only for a pool the caller joins).
    pub(crate) fn help(&self, f: &(dyn Fn(usize, usize) + Sync + '_), n: usize) {
        debug_assert!(self.caller_joins);
        run_tasks(&self.shared, f, n, 0);
    }

    /// Wait for the started job's workers (spinning, then blocked, so a caller on an
    /// oversubscribed core leaves it to the workers); the first panic of its tasks, if any.
    pub(crate) fn finish(&self) -> Option<Panic> {
        let s = &*self.shared;
        let mut spin = Spin::new();
        while s.pending.load(Ordering::Acquire) != 0 {
            if spin.expired(SPIN) {
                let mut g = lock(&s.done_lock);
                while s.pending.load(Ordering::Acquire) != 0 {
                    *g = true;
                    g = wait(&s.done, g);
                }
                *g = false;
                break;
            }
        }
        *lock(&s.job) = None;
        lock(&s.panic).take()
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> thread::JoinHandle<()> {
    #[cfg(not(loom))]
    return thread::Builder::new().name(name).spawn(f).expect("spawn a worker thread");
    #[cfg(loom)]
    {
        let _ = name;
        thread::spawn(f)
    }
}

/// Pin the calling thread to OS CPU `cpu`; whether the OS accepted it (a CPU outside this
/// process's set, e.g. from a synthetic topology, is refused and the thread stays unpinned).
pub fn pin_current_thread(cpu: usize) -> bool {
    #[cfg(all(target_os = "linux", not(loom)))]
    {
        if cpu >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (cpu checked
        // above), and sched_setaffinity reads exactly size_of::<cpu_set_t>() bytes.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(all(target_os = "linux", not(loom))))]
    {
        let _ = cpu;
        false
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
        lock(&s.panic).get_or_insert(p);
    }
}

fn worker(s: &Shared, w: usize) {
    let mut seen = 0u64;
    loop {
        let mut spin = Spin::new();
        while s.epoch.load(Ordering::Acquire) == seen {
            if spin.expired(SPIN) {
                // A parked worker holds no AMX tile state: a context switch then saves none.
                // (kt-x86 configures every backend's tiles, the amx and llamafile ones alike.)
                #[cfg(target_arch = "x86_64")]
                kt_x86::amx::release();
                let mut g = lock(&s.lock);
                s.sleepers.fetch_add(1, Ordering::Relaxed);
                while s.epoch.load(Ordering::Acquire) == seen {
                    g = wait(&s.wake, g);
                }
                s.sleepers.fetch_sub(1, Ordering::Relaxed);
                break;
            }
        }
        seen = s.epoch.load(Ordering::Acquire);
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        let job = *lock(&s.job);
        if let Some((f, n)) = job {
            run_tasks(s, f, n, w);
        }
        if s.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last one out wakes a caller that stopped spinning (checked under the lock, so
            // a caller between its check and its wait cannot miss it; no syscall otherwise).
            if *lock(&s.done_lock) {
                s.done.notify_all();
            }
        }
    }
}

impl Shared {
    /// Publish a new epoch and wake parked workers. The lock is taken every time: a worker
    /// checks the epoch under it before waiting, so the bump is seen either by that check or by
    /// the notify (a lock-free "any sleepers?" test would need SeqCst reasoning loom cannot
    /// check; the uncontended lock costs tens of ns per stage).
    fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
        let _g = lock(&self.lock);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            self.wake.notify_all();
        }
    }
}

impl Executor for Pool {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        if self.workers.is_empty() || (n_tasks <= 1 && self.caller_joins) {
            (0..n_tasks).for_each(|t| f(t, 0));
            return;
        }
        let _one = lock(&self.serial);
        // SAFETY: `finish` is called below, before `f` can be dropped, under the serial lock.
        unsafe { self.start(f, n_tasks) };
        if self.caller_joins {
            self.help(f, n_tasks);
        }
        if let Some(p) = self.finish() {
            resume_unwind(p);
        }
    }

    fn workers(&self) -> usize {
        self.threads()
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_task_once_across_many_jobs_and_sleeps() {
        for pool in [Pool::new(3), Pool::pinned(&[0, 0, 0], false)] {
            let threads = pool.threads();
            for round in 0..200 {
                let n = round % 17;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.parallel_for(n, &|t, w| {
                    assert!(w < threads);
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
                if round % 50 == 0 {
                    std::thread::sleep(Duration::from_millis(2)); // let workers park
                }
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

    #[test]
    fn idle_workers_park_and_wake_for_the_next_job() {
        let pool = Pool::new(3);
        for _ in 0..3 {
            pool.parallel_for(8, &|_, _| {});
            let start = std::time::Instant::now();
            while pool.parked_workers() < 2 {
                assert!(start.elapsed() < Duration::from_secs(10), "workers never parked");
                std::thread::sleep(Duration::from_millis(1));
            }
            let seen = AtomicUsize::new(0);
            pool.parallel_for(64, &|_, _| {
                seen.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(seen.load(Ordering::Relaxed), 64);
        }
    }

    #[test]
    fn workers_pin_to_real_cpus_and_refuse_absent_ones() {
        let pool = Pool::pinned(&[0, 0], true);
        pool.parallel_for(4, &|_, _| {});
        assert_eq!(pool.pinned_workers(), 1, "CPU 0 exists wherever this runs");
        let pool = Pool::pinned(&[0, 100_000], true);
        pool.parallel_for(4, &|_, _| {});
        assert_eq!(pool.pinned_workers(), 0);
    }
}
