//! The decode cases' paired roofline: right after each timed forward, the pool itself streams as
//! many bytes as that forward's weights from DRAM, and the case reports the median over its reps
//! of that read's time over the forward's (`stream×`). The run's DRAM probe reads once before
//! and once after each method, and on a shared machine the bandwidth moves between seconds
//! (by 2× within a run on a small VM), so a forward's ratio to it says as much
//! about the moment it ran as about the kernels; a read of the same bytes, by the same threads,
//! a millisecond later, does not move with the machine.
//!
//! The buffer is a region per sub-pool, allocated and first touched by one of its workers (so
//! placed on its node, as each NUMA part's weights are) on huge pages as the weights are
//! (`kt_x86::memory::weight_buffer`); each read takes the same share of every region, in tasks
//! grouped by region, as a forward's tasks are grouped by part.

use std::hint::black_box;
use std::sync::Mutex;
use std::time::Instant;

use kt_core::plan::target_tasks;
use kt_core::Executor;
use kt_x86::memory::{weight_buffer, WeightBuf};

use super::roofline::read_sum;
use crate::numa_pool::NumaPool;

/// Bytes a task reads at once are a multiple of this (whole `read_sum` steps).
const STEP: usize = 128;

/// A DRAM buffer the pool streams in windows, each starting where the last one ended.
pub struct Stream {
    regions: Vec<WeightBuf>,
    /// Offset of the next window in every region.
    at: usize,
}

impl Stream {
    /// At least `bytes` (many times the L3, so a window comes from DRAM) split over `pool`'s
    /// sub-pools, each region allocated and written by one of its own workers.
    pub fn new(pool: &NumaPool, bytes: usize) -> Stream {
        let parts = pool.subpools().max(1);
        let each = bytes.div_ceil(parts).next_multiple_of(STEP);
        let made: Vec<Mutex<Option<WeightBuf>>> = (0..parts).map(|_| Mutex::new(None)).collect();
        pool.parallel_for_grouped(parts, &|g| g, &|g, _| {
            let mut b = weight_buffer(each);
            // Not zeros: no page of it may be the kernel's shared zero page.
            let words: &mut [u64] = bytemuck::cast_slice_mut(b.as_mut_slice());
            words.iter_mut().enumerate().for_each(|(i, w)| *w = i as u64 | 1);
            *made[g].lock().unwrap_or_else(|e| e.into_inner()) = Some(b);
        });
        let regions = made
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every region's task ran"))
            .collect();
        Stream { regions, at: 0 }
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.regions.iter().map(WeightBuf::len).sum()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Seconds `pool` takes to read `bytes` of the buffer (rounded up to whole steps of every
    /// region; a window larger than the buffer reads it more than once), in
    /// [`target_tasks`] tasks as a forward's stage is cut.
    pub fn read(&mut self, pool: &NumaPool, bytes: usize) -> f64 {
        let (parts, each) = (self.regions.len(), self.regions[0].len());
        let mut left = bytes.div_ceil(parts).next_multiple_of(STEP);
        let per_part = target_tasks(pool.workers()).div_ceil(parts).max(1);
        let mut seconds = 0.0;
        while left > 0 {
            if self.at + left.min(each) > each {
                self.at = 0;
            }
            let take = left.min(each - self.at);
            let chunk = take.div_ceil(per_part).next_multiple_of(STEP);
            let (regions, at) = (&self.regions, self.at);
            let t0 = Instant::now();
            pool.parallel_for_grouped(parts * per_part, &|t| t / per_part, &|t, _| {
                let (g, j) = (t / per_part, t % per_part);
                let range = at + (j * chunk).min(take)..at + ((j + 1) * chunk).min(take);
                black_box(read_sum(bytemuck::cast_slice(&regions[g][range])));
            });
            seconds += t0.elapsed().as_secs_f64();
            self.at += take;
            left -= take;
        }
        seconds
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Every region is filled (no zero page), windows advance and wrap, and a window larger
    /// than the buffer still reads (more than once) in a positive time.
    #[test]
    fn windows_advance_wrap_and_outgrow_the_buffer() {
        let pool = NumaPool::with_threads(2, 2).expect("a pool of two sub-pools");
        let mut s = Stream::new(&pool, 1 << 20);
        assert_eq!(s.regions.len(), 2);
        assert!(s.len() >= 1 << 20);
        for r in &s.regions {
            assert!(r.chunks(4096).all(|page| page[0] == 1), "a region's pages were not written");
        }
        let each = s.regions[0].len();
        assert!(s.read(&pool, 256 << 10) > 0.0);
        assert_eq!(s.at, (256 << 10) / 2);
        s.read(&pool, 300 << 10);
        assert_eq!(s.at, (556 << 10) / 2, "a window that fits the rest follows the last");
        s.read(&pool, 900 << 10);
        assert_eq!(s.at, (900 << 10) / 2, "a window that does not fit the rest starts over");
        assert!(s.read(&pool, 3 << 20) > 0.0, "a window larger than the buffer");
        assert_eq!(s.at, each);
    }
}
