//! FP8 e4m3 with one f32 scale per 128×128 block (DeepSeek-V3 `weight_scale_inv`, which despite
//! its name multiplies): `s = amax(block)/448`, `q = e4m3(x · (1/s))`. Value: `e4m3(q) · s`.
//! Scales are row-major `[ceil(rows/128), ceil(cols/128)]`; edge blocks may be partial.
//! [`Scales::Mse`] may pick another `s` per block.

use alloc::vec;
use alloc::vec::Vec;

use super::fp8_channel::E4m3Grid;
use super::scales::Scales;
use super::{inverse, FP8_BLOCK};
use crate::dtype::F8E4M3;

/// Quantize `rows × cols`; returns (e4m3 bytes, block scales).
pub fn quantize(rows: usize, cols: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let (br, bc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    let mut scales = vec![0.0f32; br * bc];
    for (r, row) in src.chunks(cols.max(1)).enumerate().take(rows) {
        for (b, blk) in row.chunks(FP8_BLOCK).enumerate() {
            let s = &mut scales[(r / FP8_BLOCK) * bc + b];
            *s = blk.iter().fold(*s, |m, x| m.max(x.abs()));
        }
    }
    for s in &mut scales {
        *s /= F8E4M3::MAX;
    }
    if rule != Scales::Absmax {
        for (b, s) in scales.iter_mut().enumerate() {
            let (r0, c0) = (b / bc * FP8_BLOCK, b % bc * FP8_BLOCK);
            let c1 = (c0 + FP8_BLOCK).min(cols);
            let block: Vec<&[f32]> =
                (r0..(r0 + FP8_BLOCK).min(rows)).map(|r| &src[r * cols + c0..r * cols + c1]).collect();
            *s = rule.pick::<E4m3Grid>(&block, *s);
        }
    }
    let mut data = vec![0u8; rows * cols];
    for (r, (out, row)) in data.chunks_mut(cols.max(1)).zip(src.chunks(cols.max(1))).enumerate().take(rows) {
        for (b, (o, x)) in out.chunks_mut(FP8_BLOCK).zip(row.chunks(FP8_BLOCK)).enumerate() {
            // One inverse a block and row, not one a weight.
            let inv = inverse(scales[(r / FP8_BLOCK) * bc + b]);
            for (o, &x) in o.iter_mut().zip(x) {
                *o = F8E4M3::from_f32(x * inv).0;
            }
        }
    }
    (data, scales)
}

/// `e4m3(q) · s` for a row, given that row's block-row of scales.
pub fn dequantize_row(row: &[u8], block_scales: &[f32], out: &mut [f32]) {
    for (c, (o, &b)) in out.iter_mut().zip(row).enumerate() {
        *o = F8E4M3(b).to_f32() * block_scales[c / FP8_BLOCK];
    }
}
