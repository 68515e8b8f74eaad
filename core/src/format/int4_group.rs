//! K-group symmetric int4 (KT RAWINT4, compressed-tensors "pack-quantized"): per `group`
//! columns of a row one bf16 scale `s = bf16(amax/7)`, `q = clamp(rne(x · (1/s)), -8, 7)`,
//! stored as the nibble `q + 8` (low nibble = even column). Value: `(nibble - 8) · s`.
//! [`Scales::Mse`] picks another bf16 `s` per group, the codes the same -8..=7.

use alloc::vec;
use alloc::vec::Vec;
use half::bf16;

use super::scales::{Grid, Scales};
use super::{amax, inverse, raw_nibble};
use crate::dtype::{quantize_i8_small, round_ne_small};

/// The grid the scale search sees: the codes -8..=7, scales rounded to bf16.
pub(crate) struct Int4GroupGrid;

impl Grid for Int4GroupGrid {
    const LADDER: &'static [f32] = &[0.85, 0.7];
    const LOCAL: &'static [f32] = &[0.95, 1.05];
    const REFITS: usize = 1;
    const LARGEST: f32 = 8.0;
    #[inline]
    fn nearest(v: f32) -> f32 {
        round_ne_small(v).clamp(-8.0, 7.0)
    }
    fn stored(s: f32) -> f32 {
        bf16::from_f32(s).to_f32()
    }
}

/// Quantize `rows × cols` (cols a multiple of `group`); returns (nibbles, `rows × cols/group`
/// scales, row-major).
pub fn quantize(rows: usize, cols: usize, group: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let rb = cols / 2;
    let per_row = cols / group;
    let mut data = vec![0u8; rows * rb];
    let mut scales = vec![0.0f32; rows * per_row];
    for r in 0..rows {
        // A row at a time: its weights stay in cache from the scales to the codes.
        let s = &mut scales[r * per_row..(r + 1) * per_row];
        for (s, x) in s.iter_mut().zip(src[r * cols..(r + 1) * cols].chunks_exact(group)) {
            *s = bf16::from_f32(amax(x) / 7.0).to_f32();
        }
        rule.pick_groups::<Int4GroupGrid>(&src[r * cols..(r + 1) * cols], group, s);
        let row = &mut data[r * rb..(r + 1) * rb];
        for g in 0..per_row {
            let x = &src[r * cols + g * group..r * cols + (g + 1) * group];
            let inv = inverse(scales[r * per_row + g]);
            // A byte (two columns) at a time, rounded without branches (|x · inv| ≤ ~7.03 for
            // finite inputs, where `quantize_i8_small` is `round_ne`): faster than a nibble at a
            // time (docs/tuning.md).
            let nibble = |v: f32| (quantize_i8_small(v * inv).clamp(-8, 7) + 8) as u8;
            for (b, pair) in row[g * group / 2..(g + 1) * group / 2].iter_mut().zip(x.chunks_exact(2)) {
                *b = nibble(pair[0]) | nibble(pair[1]) << 4;
            }
        }
    }
    (data, scales)
}

/// The signed value `nibble - 8` of element `c`.
#[inline]
pub fn weight_i8(row: &[u8], c: usize) -> i8 {
    raw_nibble(row, c) as i8 - 8
}

/// `(nibble - 8) · s` for every element of a row.
pub fn dequantize_row(row: &[u8], group: usize, scales: &[f32], out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        *o = f32::from(weight_i8(row, c)) * scales[c / group];
    }
}
