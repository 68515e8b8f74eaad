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
    /// Bytes held over all workers.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

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

/// Typed pieces cut one after another from a worker's block, each starting 64-byte aligned, so
/// a task's buffers come from the block its worker reuses instead of the allocator (fresh
/// allocations in worker threads were page faults on every call: the SFT forward spent more
/// time zeroing new pages than in its products).
pub(crate) struct Carve<'a>(&'a mut [u8]);

impl<'a> Carve<'a> {
    /// Cut from `block`, which must be 64-byte aligned (the blocks of [`WorkerScratch`] are).
    pub(crate) fn new(block: &'a mut [u8]) -> Self {
        Carve(block)
    }

    /// Bytes a piece of `len` `T` takes.
    pub(crate) const fn bytes<T>(len: usize) -> usize {
        round_up(len * size_of::<T>())
    }

    /// The next `len` values, their old contents (any bit pattern is a valid `T`).
    ///
    /// # Panics
    /// If fewer bytes are left than [`Carve::bytes`] of the piece: the block was sized for
    /// fewer pieces than are cut (a bug).
    pub(crate) fn take<T: bytemuck::Pod>(&mut self, len: usize) -> &'a mut [T] {
        let (piece, rest) = core::mem::take(&mut self.0).split_at_mut(Self::bytes::<T>(len));
        self.0 = rest;
        bytemuck::cast_slice_mut(&mut piece[..len * size_of::<T>()])
    }

    /// What is left, for the backend's own scratch.
    pub(crate) fn rest(self) -> &'a mut [u8] {
        self.0
    }
}
