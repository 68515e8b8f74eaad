//! Per-row symmetric int4 exactly as KT's AMXINT4 (`amx_buffers.hpp`, `BufferBInt4Impl::from_mat`):
//! `d = amax/112`; `q8 = sat_i8(rne(x · (1/d)))`; the magnitude is rounded to a multiple of 16 by
//! `(|q8| + 8) & 0xF0` (ties away from zero) and the sign restored, giving `16·n`, n in -7..=7.
//! The nibble n is stored two's complement (low nibble = even column here; KT's packed BufferB
//! puts column k low and k+64 high, a packing detail). Value: `16 · n · d`.
//! [`Scales::Mse`] picks `d` by the search, with n the nearest of -7..=7 to `x / 16d` (one
//! rounding, not KT's two); a row where no scale beats absmax's keeps KT's bytes.

use alloc::vec;
use alloc::vec::Vec;

use super::scales::{Grid, Scales};
use super::{amax, inverse, signed_nibble};
use crate::dtype::{quantize_i8_small, round_ne_small};

/// The grid the scale search sees, in units of `16·d`: n in -7..=7, the codes KT's quantizer
/// writes (its kernels never see -8).
pub(crate) struct Int4RowGrid;

impl Grid for Int4RowGrid {
    const LADDER: &'static [f32] = &[0.85, 0.7, 0.55];
    const LOCAL: &'static [f32] = &[0.95, 1.05];
    const REFITS: usize = 2;
    const LARGEST: f32 = 7.0;
    #[inline]
    fn nearest(v: f32) -> f32 {
        round_ne_small(v).clamp(-Self::LARGEST, Self::LARGEST)
    }
}

/// KT's 4-bit rounding of an int8 to a multiple of 16, in the same 8-bit wrapping arithmetic.
#[inline]
pub fn round_to_16(q8: i8) -> i8 {
    let mag = (q8.unsigned_abs().wrapping_add(8)) & 0xF0;
    if q8 < 0 {
        (mag as i8).wrapping_neg()
    } else {
        mag as i8
    }
}

/// Quantize `rows × cols` (cols even); returns (nibble data, one scale d per row).
pub fn quantize(rows: usize, cols: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let rb = cols / 2;
    let mut data = vec![0u8; rows * rb];
    let mut scales = vec![0.0f32; rows];
    for r in 0..rows {
        let x = &src[r * cols..(r + 1) * cols];
        let d = amax(x) / 112.0; // KT divides here (its int8 scale is a product: int8_row::scale)
        let s = rule.pick::<Int4RowGrid>(&[x], 16.0 * d);
        let row = &mut data[r * rb..(r + 1) * rb];
        if s == 16.0 * d {
            // KT's rounding: |v · inv| ≤ 112 (+ rounding), inside quantize_i8_small's range.
            let inv = inverse(d);
            scales[r] = d;
            put_nibbles(row, x, |v| (round_to_16(quantize_i8_small(v * inv)) >> 4) as u8 & 0x0F);
        } else {
            let inv = inverse(s);
            scales[r] = s / 16.0;
            put_nibbles(row, x, |v| Int4RowGrid::nearest(v * inv) as i8 as u8 & 0x0F);
        }
    }
    (data, scales)
}

/// `nib` of each of a row's weights, two columns a byte, the even one low (generic, so that the
/// rounding inlines into the loop).
#[inline]
fn put_nibbles(row: &mut [u8], x: &[f32], nib: impl Fn(f32) -> u8) {
    for (b, pair) in row.iter_mut().zip(x.chunks_exact(2)) {
        *b = nib(pair[0]) | nib(pair[1]) << 4;
    }
}

/// The int8-equivalent weight `16·n` that KT's integer kernels multiply with.
#[inline]
pub fn weight_i8(row: &[u8], c: usize) -> i8 {
    signed_nibble(row, c).wrapping_mul(16)
}

/// `16 · n · d` for every element of a row.
pub fn dequantize_row(row: &[u8], d: f32, out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        *o = f32::from(weight_i8(row, c)) * d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_kt() {
        assert_eq!(round_to_16(0), 0);
        assert_eq!(round_to_16(7), 0);
        assert_eq!(round_to_16(8), 16);
        assert_eq!(round_to_16(-8), -16);
        assert_eq!(round_to_16(-7), 0);
        assert_eq!(round_to_16(112), 112);
        assert_eq!(round_to_16(-112), -112);
        assert_eq!(round_to_16(119), 112);
        assert_eq!(round_to_16(120), 0x80u8 as i8); // wraps like KT's epi8 arithmetic
    }
}
