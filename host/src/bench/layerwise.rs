//! `kt bench --layerwise`: SGLang's layerwise-prefill write ([`write_expert`], KT's
//! `write_weight_scale_to_buffer`) timed for every expert of a checkpoint's first MoE layer on
//! the pool's threads, against the DRAM read bandwidth the same run measures on those threads.
//! Each expert's bytes are read from the mapped checkpoint and written into one of two slots of
//! host buffers the size SGLang gives them, expert `e` into slot `e % 2`: the fork's double
//! buffer, which the GPU copies one slot from while the CPU writes the other.

use std::time::Instant;

use kt_core::Executor;

use crate::error::WeightError;
use crate::numa_pool::NumaPool;
use crate::weights::gpu_buffer::{write_expert, GpuEncoding, RankBuffers};
use crate::weights::Checkpoint;

use super::roofline::{dram_gbps, Threads};

/// One layer's writes.
#[derive(Clone, Debug)]
pub struct LayerwiseResult {
    /// The checkpoint's encoding, which the buffers get.
    pub encoding: GpuEncoding,
    /// MoE layer written.
    pub layer: usize,
    /// GPU tensor-parallel ranks written per expert.
    pub tp: usize,
    /// Experts written per rep.
    pub experts: usize,
    /// Weight and scale bytes of one expert.
    pub expert_bytes: usize,
    /// Fastest rep, ms per expert.
    pub ms_best: f64,
    /// Median rep, ms per expert.
    pub ms_median: f64,
    /// expert_bytes / ms_best.
    pub gbps: f64,
    /// Threads the writes ran on.
    pub threads: usize,
    /// Their DRAM read bandwidth, measured in the same run.
    pub dram_gbps: f64,
    /// Reps timed.
    pub reps: usize,
}

impl LayerwiseResult {
    /// Bytes written per second over DRAM read bandwidth (the write also reads as many).
    pub fn dram_ratio(&self) -> f64 {
        self.gbps / self.dram_gbps
    }
}

/// Time writing every expert of MoE layer `layer` (`hidden` H, `intermediate` I, `experts`
/// E) for `tp` GPU ranks on `pool`, for at least `min_seconds` (and 3 reps); the DRAM probe
/// reads `dram_bytes` on the pool's CPUs.
pub fn run(
    ck: &Checkpoint,
    layer: usize,
    (hidden, intermediate, experts): (usize, usize, usize),
    tp: usize,
    (pool, dram_bytes): (&NumaPool, usize),
    min_seconds: f64,
) -> Result<LayerwiseResult, WeightError> {
    // Room for the widest encoding (bf16) in every buffer, scales included, for each slot.
    let part = intermediate / tp.max(1);
    let slot = 4 * part * hidden;
    let mut bufs: Vec<[Vec<u8>; 4]> = (0..tp).map(|_| std::array::from_fn(|_| vec![0u8; 2 * slot])).collect();
    let ranks: [Vec<RankBuffers>; 2] = std::array::from_fn(|s| {
        bufs.iter_mut()
            .map(|b| {
                let at = |v: &mut Vec<u8>| v[s * slot..].as_mut_ptr() as usize;
                RankBuffers { w13: at(&mut b[0]), w13_scale: at(&mut b[1]), w2: at(&mut b[2]), w2_scale: at(&mut b[3]) }
            })
            .collect()
    });
    let write_layer = || -> Result<GpuEncoding, WeightError> {
        let mut enc = GpuEncoding::Bf16;
        for e in 0..experts {
            // SAFETY: each rank's slot holds 4·I/tp·H bytes, more than any encoding's weights
            // (2·I/tp·H bf16 for w13, I/tp·H for w2) or scales need.
            enc = unsafe { write_expert(ck, (layer, e), (hidden, intermediate), &ranks[e % 2], pool)? };
        }
        Ok(enc)
    };
    let encoding = write_layer()?; // pages of the checkpoint mapped in, buffers touched
    let cpus = super::pool_cpus(pool.placement());
    let threads = pool.workers();
    let dram = dram_gbps(Threads { n: threads, cpus: &cpus }, dram_bytes);
    pool.pin_caller();
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || start.elapsed().as_secs_f64() < min_seconds {
        let t0 = Instant::now();
        write_layer()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3 / experts as f64);
    }
    times.sort_by(f64::total_cmp);
    let expert_bytes = encoding.expert_bytes(hidden, intermediate, tp);
    Ok(LayerwiseResult {
        encoding,
        layer,
        tp,
        experts,
        expert_bytes,
        ms_best: times[0],
        ms_median: times[times.len() / 2],
        gbps: expert_bytes as f64 / times[0] / 1e6,
        threads,
        dram_gbps: dram,
        reps: times.len(),
    })
}
