//! Per-row symmetric int8 (KT AMXINT8, `BufferB::from_mat`): `d = amax · (1/127)` per row,
//! `q = sat_i8(rne(x · (1/d)))`, value `q · d`. [`Scales::Mse`] may pick a smaller `d`, the codes
//! clamped to ±127 as absmax's are.

use alloc::vec;
use alloc::vec::Vec;

use super::scales::{Grid, Scales};
use super::{amax, inverse};
use crate::dtype::{quantize_i8_small, round_ne_small};

/// The int8 grid the scale search sees: the codes -127..=127 (absmax's never reach -128).
pub(crate) struct Int8Grid;

impl Grid for Int8Grid {
    const LADDER: &'static [f32] = &[0.95, 0.85];
    const REFITS: usize = 2;
    const LARGEST: f32 = 127.0;
    #[inline]
    fn nearest(v: f32) -> f32 {
        round_ne_small(v).clamp(-Self::LARGEST, Self::LARGEST)
    }
}

/// Quantize `rows × cols`; returns (i8 data as bytes, one scale per row).
pub fn quantize(rows: usize, cols: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let mut data = vec![0u8; rows * cols];
    let mut scales = vec![0.0f32; rows];
    for r in 0..rows {
        let x = &src[r * cols..(r + 1) * cols];
        let d = rule.pick::<Int8Grid>(&[x], scale(amax(x)));
        let inv = inverse(d);
        scales[r] = d;
        for (o, &v) in data[r * cols..(r + 1) * cols].iter_mut().zip(x) {
            *o = Int8Grid::nearest(v * inv) as i8 as u8;
        }
    }
    (data, scales)
}

/// KT's per-row scale of a row with largest magnitude `amax`: `amax · (1/127)`, a product as
/// in KT's code (`amax / 127` differs in the last bit for some rows, and then the rounding of a
/// value at a half: checked against KT's own files, tests/fixtures/kt).
#[inline]
pub fn scale(amax: f32) -> f32 {
    amax * (1.0 / 127.0)
}

/// One row: the int8 values and their scale. Shared with per-token activation quantization,
/// which KT defines by the same formula.
pub fn quantize_row(x: &[f32]) -> (impl Iterator<Item = i8> + '_, f32) {
    let d = scale(amax(x));
    let inv = inverse(d);
    // |v · inv| ≤ 127 (+ rounding) by the choice of d, inside quantize_i8_small's range.
    (x.iter().map(move |&v| quantize_i8_small(v * inv)), d)
}

/// `q · d` for every element of a row.
pub fn dequantize_row(row: &[u8], d: f32, out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(row) {
        *o = f32::from(b as i8) * d;
    }
}
