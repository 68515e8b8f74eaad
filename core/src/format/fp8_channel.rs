//! FP8 e4m3 with one f32 scale per row (KT FP8_PERCHANNEL, `weight_scale`): `s = amax/448`,
//! `q = e4m3(x · (1/s))`. Value: `e4m3(q) · s`. [`Scales::Mse`] may pick another `s` per row.

use alloc::vec;
use alloc::vec::Vec;

use super::scales::{Grid, Scales};
use super::{amax, inverse};
use crate::dtype::F8E4M3;

/// The e4m3 grid the scale search sees (shared with the block and MXFP8 formats). Its error is
/// the same at any scale but for where the largest weights fall: a ladder over one octave.
pub(crate) struct E4m3Grid;

impl Grid for E4m3Grid {
    const CODES_FIRST: bool = true;
    const LADDER: &'static [f32] = &[0.84, 0.71, 0.59];
    const REFITS: usize = 2;
    const LARGEST: f32 = F8E4M3::MAX;
    #[inline]
    fn nearest(v: f32) -> f32 {
        F8E4M3::round(v)
    }
}

/// Quantize `rows × cols`; returns (e4m3 bytes, one scale per row).
pub fn quantize(rows: usize, cols: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let mut data = vec![0u8; rows * cols];
    let mut scales = vec![0.0f32; rows];
    for r in 0..rows {
        let x = &src[r * cols..(r + 1) * cols];
        let s = rule.pick::<E4m3Grid>(&[x], amax(x) / F8E4M3::MAX);
        let inv = inverse(s);
        scales[r] = s;
        for (o, &v) in data[r * cols..(r + 1) * cols].iter_mut().zip(x) {
            *o = F8E4M3::from_f32(v * inv).0;
        }
    }
    (data, scales)
}

/// `e4m3(q) · s` for every element of a row.
pub fn dequantize_row(row: &[u8], s: f32, out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(row) {
        *o = F8E4M3(b).to_f32() * s;
    }
}
