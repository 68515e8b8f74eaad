//! `kt bench --layerwise`: SGLang's layerwise-prefill write ([`write_expert`], KT's
//! `write_weight_scale_to_buffer`) timed for every expert of a checkpoint's first MoE layer,
//! against the DRAM read bandwidth the same run measures on one thread (a write runs on the one
//! thread that SGLang's call hands it). Each expert's bytes are read from the mapped checkpoint
//! and written once into host buffers the size SGLang gives them, reused from expert to expert.

use std::time::Instant;

use crate::error::WeightError;
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
    /// One thread's DRAM read bandwidth, measured in the same run.
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
/// E) for `tp` GPU ranks, for at least `min_seconds` (and 3 reps).
pub fn run(
    ck: &Checkpoint,
    layer: usize,
    (hidden, intermediate, experts): (usize, usize, usize),
    tp: usize,
    min_seconds: f64,
) -> Result<LayerwiseResult, WeightError> {
    // Room for the widest encoding (bf16) in every buffer, scales included.
    let part = intermediate / tp.max(1);
    let mut bufs: Vec<[Vec<u8>; 4]> = (0..tp).map(|_| std::array::from_fn(|_| vec![0u8; 4 * part * hidden])).collect();
    let ranks: Vec<RankBuffers> = bufs
        .iter_mut()
        .map(|b| RankBuffers {
            w13: b[0].as_mut_ptr() as usize,
            w13_scale: b[1].as_mut_ptr() as usize,
            w2: b[2].as_mut_ptr() as usize,
            w2_scale: b[3].as_mut_ptr() as usize,
        })
        .collect();
    let write_layer = || -> Result<GpuEncoding, WeightError> {
        let mut enc = GpuEncoding::Bf16;
        for e in 0..experts {
            // SAFETY: each rank's buffers hold 4·I/tp·H bytes, more than any encoding's
            // weights (2·I/tp·H bf16 for w13, I/tp·H for w2) or scales need.
            enc = unsafe { write_expert(ck, layer, e, hidden, intermediate, &ranks)? };
        }
        Ok(enc)
    };
    let encoding = write_layer()?; // pages of the checkpoint mapped in, buffers touched
    let dram = dram_gbps(Threads::unpinned(1), 256 << 20);
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
        dram_gbps: dram,
        reps: times.len(),
    })
}
