//! Synthetic layers: uniform weights with std 1/sqrt(fan_in) (GGML formats: random valid
//! blocks of about that size), unit-std inputs, random distinct top-k routing. Every expert has
//! its own seeded stream, so generation runs in parallel and the same seed gives the same layer.

use half::bf16;
use kt_core::ggml::random_matrix;
use kt_core::rng::SplitMix64;
use kt_core::{LayerFormat, MoeConfig, QuantMatrix, WeightFormat};

/// Expert `e` of layer `l`: `[gate [I,H], up [I,H], down [H,I]]`.
pub fn expert(cfg: &MoeConfig, seed: u64, l: usize, e: usize) -> [Vec<f32>; 3] {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let mut r = SplitMix64::stream(seed, ((l as u64) << 32) | e as u64);
    // Uniform on [-a, a] has std a/sqrt(3).
    let mut m = |len: usize, fan_in: usize| {
        let a = (3.0 / fan_in as f32).sqrt();
        (0..len).map(|_| r.uniform(a)).collect::<Vec<f32>>()
    };
    [m(i * h, h), m(i * h, h), m(h * i, i)]
}

/// Expert `e` of layer `l` as random valid GGML blocks of the formats `lf` (GGUF models
/// are not re-quantized here, and most K-quant and IQ types have no quantizer): `(gate, up, down)`.
pub fn ggml_expert(
    cfg: &MoeConfig,
    lf: LayerFormat,
    seed: u64,
    l: usize,
    e: usize,
) -> (QuantMatrix, QuantMatrix, QuantMatrix) {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let s = seed ^ (((l as u64) << 32) | e as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let m = |f: WeightFormat, r, c, s| match f {
        WeightFormat::Ggml(t) => random_matrix(t, r, c, s),
        f => unreachable!("GGML formats only, not {f}"),
    };
    (m(lf.gate, i, h, s), m(lf.up, i, h, s ^ 1), m(lf.down, h, i, s ^ 2))
}

/// `[n, h]` inputs with unit std.
pub fn input(n: usize, h: usize, seed: u64) -> Vec<bf16> {
    let mut r = SplitMix64::new(seed);
    (0..n * h).map(|_| bf16::from_f32(r.uniform(3f32.sqrt()))).collect()
}

/// Distinct experts per token, weights positive and summing to 1.
pub fn routing(n: usize, k: usize, experts: usize, seed: u64) -> (Vec<i64>, Vec<f32>) {
    kt_core::rng::random_routing(n, k, experts, seed)
}
