//! Entry points of the fuzz targets (`fuzz/fuzz_targets/*.rs` are one line each). Each takes
//! arbitrary bytes and must return without panicking, whatever they hold.
#![forbid(unsafe_code)]

use alloc::vec::Vec;

use half::bf16;

use crate::forward::{forward, LayerWeights, Workspace};
use crate::reference::REFERENCE;
use crate::testing::{build_layer, random_experts};
use crate::{MoeConfig, QuantMatrix, Routing, Scales, SerialExecutor, WeightFormat};

fn take<const N: usize>(data: &mut &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let n = N.min(data.len());
    out[..n].copy_from_slice(&data[..n]);
    *data = &data[n..];
    out
}

/// Quantize arbitrary f32 bits (NaN, inf, subnormals) in every format with an arbitrary shape,
/// either scale rule, then slice and dequantize: errors are fine, panics and non-finite output
/// are not.
pub fn quantize(mut data: &[u8]) {
    let [f, r, c] = take::<3>(&mut data);
    let format = WeightFormat::ALL[usize::from(f) % WeightFormat::ALL.len()];
    // The format byte's top bit picks the rule.
    let scales = if f & 0x80 != 0 { Scales::Mse } else { Scales::Absmax };
    let (rows, cols) = (usize::from(r % 9), usize::from(c % 200));
    let vals: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    if let Ok(q) = QuantMatrix::quantize_with(format, scales, rows, cols, &vals) {
        assert!(q.dequantize().iter().all(|v| v.is_finite()));
        let _ = q.slice_cols(cols / 3..cols).map(|s| s.dequantize());
        let _ = q.slice_rows(rows / 2..rows).map(|s| s.dequantize());
    }
    let _ = QuantMatrix::from_parts(format, rows, cols, data.to_vec(), vals);
}

/// One tiny reference layer per format, built once per fuzzing process (building them per
/// input made the target a hundred times slower).
pub struct RoutingLayers(Vec<(MoeConfig, LayerWeights)>);

impl RoutingLayers {
    /// Build every format's layer.
    pub fn new() -> Self {
        RoutingLayers(
            WeightFormat::ALL
                .iter()
                .map(|&format| {
                    // The smallest shapes the format allows keep each run fast.
                    let h = format.col_multiple().max(8);
                    let cfg = MoeConfig { max_tokens: 8, ..MoeConfig::new(5, 2, h, 2 * h) };
                    let layer = build_layer(&REFERENCE, &cfg, format, &random_experts(&cfg, 1));
                    (cfg, layer)
                })
                .collect(),
        )
    }
}

impl Default for RoutingLayers {
    fn default() -> Self {
        Self::new()
    }
}

/// Arbitrary routing (ids, weights, masks, token counts, k) into a tiny reference layer:
/// validation errors are fine, panics are not.
pub fn routing(layers: &RoutingLayers, mut data: &[u8]) {
    let [n, k, m, fmt] = take::<4>(&mut data);
    let (cfg, layer) = &layers.0[usize::from(fmt) % layers.0.len()];
    let h = cfg.hidden;
    let tokens = usize::from(n % 10);
    let k = usize::from(k % 4);
    let ids: Vec<i64> = data.iter().take(tokens * k + usize::from(m & 1)).map(|&b| i64::from(b as i8) % 7).collect();
    let weights: Vec<f32> =
        (0..tokens * k).map(|i| f32::from(data.get(i).copied().unwrap_or(0)) / 64.0 - 1.0).collect();
    let mask: Vec<bool> = (0..5 + usize::from(m >> 7)).map(|e| m & (1 << (e % 7)) != 0).collect();
    let r = Routing { tokens, k, ids: &ids, weights: &weights, gpu_mask: (m & 2 != 0).then_some(&mask[..]) };
    let input = alloc::vec![bf16::from_f32(0.5); tokens * h];
    let mut out = alloc::vec![bf16::ZERO; tokens * h];
    let _ = forward(&SerialExecutor, cfg, layer, &input, &r, &mut out, &mut Workspace::default());
}
