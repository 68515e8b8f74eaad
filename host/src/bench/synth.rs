//! Synthetic layers: uniform weights with std 1/sqrt(fan_in) (GGML formats: random valid
//! blocks of about that size), unit-std inputs, distinct top-k routing (random, or for decode a
//! sweep of all experts). Every expert has its own seeded stream, so generation runs in
//! parallel and the same seed gives the same layer.

use half::bf16;
use kt_core::ggml::random_matrix;
use kt_core::rng::{routing_weights, SplitMix64};
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

/// The routings the timed reps cycle through. A batch that routes fewer than `experts` rows
/// (decode) gets a sweep: routing `r` gives its tokens the next `n·k` experts of one shuffled
/// order, so a cycle touches every expert once and the weights stream from DRAM even where
/// the L3 would hold the few experts that 8 random routings touch (480 MiB on one machine
/// here: decode read 10% faster than the DRAM probe). Larger batches touch most experts each
/// time and are routed at random.
pub fn routings(n: usize, k: usize, experts: usize, seed: u64) -> Vec<(Vec<i64>, Vec<f32>)> {
    let rows = n * k;
    if rows >= experts || k == 0 {
        return (0..8).map(|r| routing(n, k, experts, seed ^ (r as u64 + 1) << 8)).collect();
    }
    let mut r = SplitMix64::new(seed);
    let mut order: Vec<i64> = (0..experts as i64).collect();
    for j in (1..experts).rev() {
        order.swap(j, r.below(j + 1));
    }
    (0..experts.div_ceil(rows))
        .map(|c| {
            // Consecutive positions mod `experts`, k ≤ experts of them per token: distinct.
            let ids: Vec<i64> = (0..rows).map(|j| order[(c * rows + j) % experts]).collect();
            let w: Vec<f32> = (0..n).flat_map(|_| routing_weights(&mut r, k)).collect();
            (ids, w)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::routings;

    #[test]
    fn decode_routings_sweep_every_expert_once_per_cycle() {
        // 3 tokens × 5 rows = 15 of 37 experts a routing: 3 routings, the last wrapping round.
        let (n, k, e) = (3, 5, 37);
        let rs = routings(n, k, e, 7);
        assert_eq!(rs.len(), 3);
        let mut seen = vec![0; e];
        for (c, (ids, w)) in rs.iter().enumerate() {
            assert_eq!((ids.len(), w.len()), (n * k, n * k));
            for (tok, ws) in ids.chunks(k).zip(w.chunks(k)) {
                let mut t = tok.to_vec();
                t.sort();
                t.dedup();
                assert_eq!(t.len(), k, "routing {c}: a token's experts repeat: {tok:?}");
                assert!((ws.iter().sum::<f32>() - 1.0).abs() < 1e-5 && ws.iter().all(|&x| x > 0.0));
            }
            for &i in ids {
                seen[i as usize] += 1;
            }
        }
        // 45 rows over 37 experts: each once, and the 8 the last routing wrapped to twice.
        assert_eq!(seen.iter().filter(|&&s| s == 1).count(), 29);
        assert_eq!(seen.iter().filter(|&&s| s == 2).count(), 8);
    }

    #[test]
    fn batches_routing_every_expert_are_random() {
        let rs = routings(16, 8, 128, 7);
        assert_eq!(rs.len(), 8);
        assert_ne!(rs[0].0, rs[1].0);
    }
}
