//! Each worker's block of scratch, handed to the tasks it runs, one at a time: what a backend
//! asks for its largest task ([`crate::Backend::scratch_bytes`]), allocated once and reused by
//! every stage of every call (the inference forward's and the SFT passes').

use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, Ordering};

use crate::aligned::{round_up, AlignedBuf};
use crate::mat::SharedMut;
use crate::Executor;

/// The workers' scratch blocks; grows to the largest call and stays.
#[derive(Debug, Default)]
pub struct WorkerScratch {
    buf: AlignedBuf,
    /// Per worker: whether a task of it holds its block. `Executor` promises one task at a
    /// time per worker; this checks it (one atomic swap a task) instead of trusting it.
    busy: Vec<AtomicBool>,
}

impl WorkerScratch {
    /// Blocks of at least `bytes` each (64-byte aligned) for `exec`'s workers.
    pub fn blocks(&mut self, exec: &dyn Executor, bytes: usize) -> Blocks<'_> {
        let (stride, workers) = (round_up(bytes), exec.workers());
        self.buf.ensure(stride * workers);
        if self.busy.len() < workers {
            self.busy = (0..workers).map(|_| AtomicBool::new(false)).collect();
        }
        Blocks { all: SharedMut::new(self.buf.as_mut_slice()), stride, busy: &self.busy }
    }
}

/// The blocks of one call, shared by its stages.
pub struct Blocks<'a> {
    all: SharedMut<'a, u8>,
    stride: usize,
    busy: &'a [AtomicBool],
}

impl Blocks<'_> {
    /// `f(task, its worker's block)` for every `task < n` on `exec`, task `t` in group
    /// `group(t)` ([`Executor::parallel_for_grouped`]).
    pub fn run(
        &self,
        exec: &dyn Executor,
        n: usize,
        group: &(dyn Fn(usize) -> usize + Sync),
        f: &(dyn Fn(usize, &mut [u8]) + Sync),
    ) {
        exec.parallel_for_grouped(n, group, &|i, worker| {
            let claim = &self.busy[worker];
            assert!(!claim.swap(true, Ordering::Acquire), "executor ran two tasks at once as worker {worker}");
            // SAFETY: workers' blocks are disjoint, and the claim above makes this task the only
            // holder of its worker's block until it is released below.
            f(i, unsafe { self.all.slice_mut(worker * self.stride..(worker + 1) * self.stride) });
            claim.store(false, Ordering::Release);
        })
    }
}
