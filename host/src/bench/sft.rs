//! `kt bench --sft`: one SFT layer's steps timed against its own inference forward, in one
//! run: the inference forward, the forward that saves its cache (with LoRA of rank `r` on
//! every projection), and the backward of that cache (with the base weights' gradients too
//! for `--full-weight-grad`), with the cache's bytes.

use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use kt_core::sft::{lora_of, random_lora, Backward, BaseGrads, LoraGrads, TransposeFormat};
use kt_core::{Error, Executor, MoeConfig, Routing, WeightFormat};

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
    /// Reps timed.
    pub reps: usize,
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
            reps,
        });
    }
    Ok(cases)
}
