//! `kt bench --sft`: one SFT layer's steps timed against its own inference forward, in one
//! run: the inference forward, the forward that saves its cache (with LoRA of rank `r` on
//! every projection), and the backward of that cache (with the base weights' gradients too
//! for `--full-weight-grad`), with the cache's bytes and what each step's roofline needs (the
//! bytes of the experts it reads, its base operations, the instructions its kernels run on).

use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use kt_core::backend::Instructions;
use kt_core::sft::{lora_of, random_lora, Backward, BaseGrads, LoraGrads, TransposeFormat};
use kt_core::{Error, Executor, MoeConfig, Routing, WeightFormat};

use super::roofline::Roofline;
use super::synth;
use crate::layer::{LayerOptions, MoeLayer};
use crate::sft::{SftLayer, SftOptions};

/// One token count's times (best and median ms over the reps).
#[derive(Clone, Debug)]
pub struct SftCase {
    /// Tokens per step.
    pub tokens: usize,
    /// The inference forward.
    pub inference: (f64, f64),
    /// The forward that saves its cache.
    pub forward: (f64, f64),
    /// The backward.
    pub backward: (f64, f64),
    /// Bytes the saved cache held.
    pub cache_bytes: usize,
    /// Bytes of the SFT layer's packed weights (inference experts and transposes).
    pub weight_bytes: usize,
    /// The forwards' and the backward's roofline inputs.
    pub roof: [StepRoof; 2],
    /// Reps timed.
    pub reps: usize,
}

/// What bounds one step: the bytes of the experts the routing touches (the forwards read the
/// inference experts, the backward their transposes, and with the base weights' gradients
/// reads and writes those too, bf16) and its base operations (2·3·H·I per routed row, twice for
/// the backward with the base weights' gradients: LoRA's rank-r products are left out), on the
/// instructions of the kernels that read the weights.
#[derive(Clone, Copy, Debug)]
pub struct StepRoof {
    /// Bytes of the distinct experts touched.
    pub bytes: usize,
    /// Operations.
    pub ops: f64,
    /// The kernels' instructions.
    pub instructions: Instructions,
}

impl StepRoof {
    /// The roofline time in ms on `roof`: the larger of reading the bytes and doing the ops.
    pub fn ms(&self, roof: &Roofline) -> f64 {
        let (peak, _) = roof.peak(self.instructions);
        (self.bytes as f64 / (roof.dram_gbps * 1e9)).max(self.ops / (peak * 1e9)) * 1e3
    }
}

/// What [`run`] times besides the layer and token counts.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    /// LoRA rank (alpha 2·rank).
    pub rank: usize,
    /// Whether the backward adds the base weights' gradients.
    pub full_weight_grad: bool,
    /// What the backward's transposes are packed in.
    pub transposes: TransposeFormat,
    /// Each token count runs at least this long (and 3 reps).
    pub min_seconds: f64,
    /// Weights, inputs and routing.
    pub seed: u64,
}

/// Time `format` at each token count of `tokens` on `executor` as `r` says.
pub fn run(
    cfg: &MoeConfig,
    format: WeightFormat,
    tokens: &[usize],
    executor: Arc<dyn Executor>,
    r: &Run,
) -> Result<Vec<SftCase>, Error> {
    let (rank, seed) = (r.rank, r.seed);
    let opts = LayerOptions::executor(executor);
    let expert = |e| Some(synth::expert(cfg, seed, 0, e));
    let sft = SftOptions { max_cache_depth: 1, transposes: r.transposes };
    let layer = SftLayer::from_f32(cfg, format, expert, &opts, sft)?;
    let inference = MoeLayer::from_f32(cfg, format, expert, &opts)?;
    let backend = inference.backend();
    // Every expert's inference bytes and transposes' bytes are alike (synthetic experts).
    let per_expert = [inference.bytes(), layer.bytes() - inference.bytes()].map(|b| b / cfg.experts);
    let transposed = layer.transposes_format().unwrap_or(format);
    let instructions = [backend.instructions(format), backend.instructions(transposed)];
    let mats = random_lora(cfg, rank, false, seed);
    let lora = lora_of(&mats, rank, 2.0 * rank as f32);
    let mut grads = random_lora(cfg, rank, true, seed);
    let base_len = if r.full_weight_grad { cfg.experts * cfg.hidden * cfg.intermediate } else { 0 };
    let mut base = [(); 3].map(|_| vec![bf16::ZERO; base_len]);
    let mut cases = Vec::new();
    for &n in tokens {
        let (h, k) = (cfg.hidden, cfg.top_k);
        let x = synth::input(n, h, seed);
        let (ids, w) = synth::routing(n, k, cfg.experts, seed);
        let rt = Routing { tokens: n, k, ids: &ids, weights: &w, gpu_mask: None };
        let go = synth::input(n, h, seed + 1);
        let (mut out, mut gi, mut gw) = (vec![bf16::ZERO; n * h], vec![bf16::ZERO; n * h], vec![0.0f32; n * k]);
        let (mut t_inf, mut t_fwd, mut t_bwd, mut cache_bytes) = (Vec::new(), Vec::new(), Vec::new(), 0);
        let start = Instant::now();
        while t_bwd.len() < 3 || start.elapsed().as_secs_f64() < r.min_seconds {
            let t = Instant::now();
            inference.forward_into(&x, &ids, &w, None, &mut out)?;
            t_inf.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            layer.forward(&x, &rt, Some(&lora), true, &mut out)?;
            t_fwd.push(t.elapsed().as_secs_f64() * 1e3);
            cache_bytes = layer.cache_bytes();
            let [a, b, c, d, e, f] = &mut grads;
            let g = LoraGrads { gate_a: a, gate_b: b, up_a: c, up_b: d, down_a: e, down_b: f };
            let [bg, bu, bd] = &mut base;
            let base = r.full_weight_grad.then(|| BaseGrads { gate: bg, up: bu, down: bd });
            let outs = Backward { grad_input: &mut gi, grad_weights: &mut gw, lora: Some(g), base, grad_scale: 1.0 };
            let t = Instant::now();
            layer.backward(&go, Some(&lora), outs)?;
            t_bwd.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let reps = t_bwd.len();
        let mut seen = vec![false; cfg.experts];
        ids.iter().for_each(|&e| seen[e as usize] = true);
        let touched = seen.iter().filter(|&&s| s).count();
        let ops = 6.0 * (cfg.hidden * cfg.intermediate * k * n) as f64;
        // Full fine-tuning reads and writes the touched experts' bf16 gradients (3·H·I each).
        let (grads, bwd_ops) = match r.full_weight_grad {
            true => (3 * cfg.hidden * cfg.intermediate * 4, 2.0 * ops),
            false => (0, ops),
        };
        let bytes = [per_expert[0], per_expert[1] + grads].map(|b| touched * b);
        let roof = [0, 1].map(|i| StepRoof { bytes: bytes[i], ops: [ops, bwd_ops][i], instructions: instructions[i] });
        let stat = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (v[0], v[v.len() / 2])
        };
        cases.push(SftCase {
            tokens: n,
            inference: stat(t_inf),
            forward: stat(t_fwd),
            backward: stat(t_bwd),
            cache_bytes,
            weight_bytes: layer.bytes(),
            roof,
            reps,
        });
    }
    Ok(cases)
}
