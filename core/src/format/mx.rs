//! OCP microscaling (MX) formats: per 32 columns of a row one e8m0 scale `2^X`, and elements
//! MXFP4 (e2m1 nibbles, low nibble = even column) or MXFP8 (e4m3 bytes). Quantization follows
//! the OCP MX spec: `X = floor(log2(amax)) - emax` (emax 2 for e2m1, 8 for e4m3), elements
//! rounded to nearest even and saturated. Scales are kept as f32 (exact powers of two).
//! [`Scales::Mse`] may step a block's scale one power of two down (the largest elements
//! saturated, the rest finer) or up (none saturated).
//!
//! MXFP4 values are integers when doubled (`2·e2m1` ∈ {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}), so the
//! kernels dot them as int8 against int8 activations and fold the ½ into the scale.

use alloc::vec;
use alloc::vec::Vec;

use super::scales::{Grid, Scales};
use super::{amax, raw_nibble};
use crate::dtype::{round_ne_small, F8E4M3};

/// The element grid of an MX format the scale search sees, e2m1 (`EMAX` 2) or e4m3 (8), with
/// e8m0 scales one power of two either side.
pub(crate) struct MxGrid<const EMAX: i32>;

impl<const EMAX: i32> Grid for MxGrid<EMAX> {
    const CODES_FIRST: bool = true;
    const LADDER: &'static [f32] = &[0.5, 2.0];
    const REFITS: usize = 0;
    const LARGEST: f32 = if EMAX == 2 { 6.0 } else { F8E4M3::MAX };
    #[inline]
    fn nearest(v: f32) -> f32 {
        const { assert!(EMAX == 2 || EMAX == 8, "MX elements: e2m1 or e4m3") };
        match EMAX {
            2 => fp4_nearest(v),
            _ => F8E4M3::round(v),
        }
    }
    fn stored(s: f32) -> f32 {
        s.clamp(pow2(-127), pow2(127))
    }
}

/// The value of `fp4_round(v)` without its code: steps of ½ below 2, 1 below 4, 2 above, each
/// rounded to nearest even (where the grid's even codes lie), saturating at 6.
#[inline]
fn fp4_nearest(v: f32) -> f32 {
    let a = v.abs();
    let step = if a < 2.0 {
        0.5
    } else if a < 4.0 {
        1.0
    } else {
        2.0
    };
    let mag = (round_ne_small(a * (1.0 / step)) * step).min(6.0);
    mag.copysign(v)
}

/// Columns per scale.
pub const MX_BLOCK: usize = 32;

/// Twice the value of each e2m1 code (bit 3 is the sign).
pub const FP4_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^x` for an e8m0 exponent range, as f32 (x in -127..=127).
pub(crate) fn pow2(x: i32) -> f32 {
    let x = x.clamp(-127, 127);
    if x == -127 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits(((x + 127) as u32) << 23)
    }
}

/// The e8m0 code of a scale `2^x` (x in -127..=127): its f32 exponent bits, 0 for `2^-127`.
pub fn e8m0_code(scale: f32) -> u8 {
    if scale.is_normal() {
        ((scale.to_bits() >> 23) & 0xFF) as u8
    } else {
        0
    }
}

/// The e8m0 codes of a `rows × cols` matrix's scales (`[rows, cols/32]`) in the order kernels
/// on panels of `panel` rows read them: `[panel][group][row of the panel]`, rows past the end
/// code 0.
pub fn panel_codes(scales: &[f32], rows: usize, cols: usize, panel: usize) -> Vec<u8> {
    let groups = cols / MX_BLOCK;
    (0..rows.div_ceil(panel) * groups * panel)
        .map(|at| {
            let (p, g, i) = (at / (groups * panel), at / panel % groups, at % panel);
            let r = p * panel + i;
            if r < rows {
                e8m0_code(scales[r * groups + g])
            } else {
                0
            }
        })
        .collect()
}

/// The shared scale of a block by the OCP rule (`2^-127`, e8m0's smallest, for a zero block).
fn block_scale(x: &[f32], emax: i32) -> f32 {
    let a = amax(x);
    if a == 0.0 {
        return pow2(-127);
    }
    // floor(log2(a)) from the exponent bits (a is finite and normal or subnormal).
    let e = if a.is_normal() { ((a.to_bits() >> 23) & 0xFF) as i32 - 127 } else { libm::floorf(libm::log2f(a)) as i32 };
    pow2(e - emax)
}

/// The e2m1 code of `v` (already divided by the scale), round to nearest even, saturating.
///
/// Branch-free (a block's random signs and magnitudes mispredict every branch): the magnitude
/// code counts the midpoints between 0, .5, 1, 1.5, 2, 3, 4, 6 that `|v|` lies above, a tie
/// going to the even code (`>` where the code below a midpoint is even, `>=` where the one
/// above is). `v` is finite (the callers check weights).
#[inline]
fn fp4_round(v: f32) -> u8 {
    let a = v.abs();
    let above = [a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0];
    let m = above.iter().map(|&b| u8::from(b)).sum::<u8>();
    m | u8::from(m != 0 && v < 0.0) << 3
}

/// The scales of one row's blocks for elements of `EMAX`: the OCP rule's, then `rule`'s choice.
fn row_scales<const EMAX: i32>(row: &[f32], rule: Scales, scales: &mut [f32]) {
    for (s, x) in scales.iter_mut().zip(row.chunks_exact(MX_BLOCK)) {
        *s = block_scale(x, EMAX);
    }
    rule.pick_groups::<MxGrid<EMAX>>(row, MX_BLOCK, scales);
}

/// Quantize `rows × cols` (cols a multiple of 32) to MXFP4: (nibbles, `rows × cols/32` scales).
pub fn quantize_fp4(rows: usize, cols: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let per_row = cols / MX_BLOCK;
    let mut data = vec![0u8; rows * cols / 2];
    let mut scales = vec![0.0f32; rows * per_row];
    for r in 0..rows {
        // A row at a time: its weights stay in cache from the scales to the codes.
        let (x, out) = (&src[r * cols..(r + 1) * cols], &mut data[r * cols / 2..(r + 1) * cols / 2]);
        let s = &mut scales[r * per_row..(r + 1) * per_row];
        row_scales::<2>(x, rule, s);
        for ((x, out), s) in x.chunks_exact(MX_BLOCK).zip(out.chunks_exact_mut(MX_BLOCK / 2)).zip(&*s) {
            // A power of two's inverse is exact (2^±127 included), so `v · (1/s)` is `v / s`.
            let inv = 1.0 / *s;
            for (pair, o) in x.chunks_exact(2).zip(out) {
                *o = fp4_round(pair[0] * inv) | fp4_round(pair[1] * inv) << 4;
            }
        }
    }
    (data, scales)
}

/// The e2m1 code (0..15) of element `c` of a row.
#[inline]
pub fn fp4_code(row: &[u8], c: usize) -> u8 {
    raw_nibble(row, c)
}

/// Twice the e2m1 value of element `c` of a row.
#[inline]
pub fn fp4_x2(row: &[u8], c: usize) -> i8 {
    FP4_X2[usize::from(fp4_code(row, c))]
}

/// Dequantize one MXFP4 row.
pub fn dequantize_fp4_row(row: &[u8], scales: &[f32], out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        *o = f32::from(fp4_x2(row, c)) * 0.5 * scales[c / MX_BLOCK];
    }
}

/// Quantize `rows × cols` (cols a multiple of 32) to MXFP8 (e4m3 elements).
pub fn quantize_fp8(rows: usize, cols: usize, src: &[f32], rule: Scales) -> (Vec<u8>, Vec<f32>) {
    let per_row = cols / MX_BLOCK;
    let mut data = vec![0u8; rows * cols];
    let mut scales = vec![0.0f32; rows * per_row];
    for r in 0..rows {
        row_scales::<8>(&src[r * cols..(r + 1) * cols], rule, &mut scales[r * per_row..(r + 1) * per_row]);
        for b in 0..per_row {
            let at = r * cols + b * MX_BLOCK;
            let x = &src[at..at + MX_BLOCK];
            let s = scales[r * per_row + b];
            for (o, &v) in data[at..at + MX_BLOCK].iter_mut().zip(x) {
                *o = F8E4M3::from_f32(v / s).0;
            }
        }
    }
    (data, scales)
}

/// Dequantize one MXFP8 row.
pub fn dequantize_fp8_row(row: &[u8], scales: &[f32], out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        *o = F8E4M3(row[c]).to_f32() * scales[c / MX_BLOCK];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp4_rounds_to_nearest_even_and_saturates() {
        let cases = [(0.2, 0), (0.25, 0), (0.3, 1), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)];
        for (v, code) in cases {
            assert_eq!(fp4_round(v), code, "{v}");
            assert_eq!(fp4_round(-v), if code == 0 { 0 } else { code | 8 }, "-{v}");
        }
        assert_eq!(fp4_round(100.0), 7);
        for code in 0..16u8 {
            let v = f32::from(FP4_X2[usize::from(code)]) * 0.5;
            assert_eq!(FP4_X2[usize::from(fp4_round(v))], FP4_X2[usize::from(code)], "code {code}");
        }
    }

    /// Every element of random blocks (and the grid's midpoints) against a search of the grid:
    /// the nearest e2m1 value of `v / s`, a tie to the even code, |v / s| > 6 saturating.
    #[test]
    fn fp4_blocks_take_the_nearest_grid_value() {
        let mut x: Vec<f32> = (0..64 * MX_BLOCK as u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761).rotate_left(13) ^ i;
                (h % 20_001) as f32 / 1000.0 - 10.0
            })
            .collect();
        // One block of exact midpoints (amax 5: scale 1).
        x[..MX_BLOCK].fill(0.0);
        x[..9].copy_from_slice(&[0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, 0.0, -0.0]);
        let (q, s) = quantize_fp4(2, x.len() / 2, &x, Scales::Absmax);
        for (c, &v) in x.iter().enumerate() {
            let (row, col) = (c / (x.len() / 2), c % (x.len() / 2));
            let scale = s[row * (x.len() / 2 / MX_BLOCK) + col / MX_BLOCK];
            let t = v / scale;
            let best = (0..16u8)
                .min_by(|&a, &b| {
                    let d = |k: u8| (f32::from(FP4_X2[usize::from(k)]) * 0.5 - t).abs();
                    d(a).total_cmp(&d(b)).then((a & 1).cmp(&(b & 1)))
                })
                .unwrap();
            let code = fp4_code(&q[row * x.len() / 4..], col);
            assert_eq!(FP4_X2[usize::from(code)], FP4_X2[usize::from(best)], "element {c}: {v} / {scale}");
        }
    }

    /// The search's e2m1 values are those of the codes `fp4_round` writes, ties included.
    #[test]
    fn fp4_grid_values_are_the_codes_values() {
        let mut v = -8.0f32;
        while v <= 8.0 {
            let want = f32::from(FP4_X2[usize::from(fp4_round(v))]) * 0.5;
            assert_eq!(MxGrid::<2>::nearest(v), want, "{v}");
            v += 1.0 / 64.0;
        }
    }

    #[test]
    fn scales_follow_the_ocp_rule() {
        // amax 5.0: floor(log2 5) = 2, so X = 0 for fp4 and -6 for fp8.
        let mut x = [0.0f32; MX_BLOCK];
        x[3] = -5.0;
        x[7] = 1.0;
        let (q, s) = quantize_fp4(1, MX_BLOCK, &x, Scales::Absmax);
        assert_eq!(s, [1.0]);
        let mut out = [0.0f32; MX_BLOCK];
        dequantize_fp4_row(&q, &s, &mut out);
        assert_eq!((out[3], out[7]), (-4.0, 1.0));
        let (q, s) = quantize_fp8(1, MX_BLOCK, &x, Scales::Absmax);
        assert_eq!(s, [1.0 / 64.0]);
        dequantize_fp8_row(&q, &s, &mut out);
        assert_eq!((out[3], out[7]), (-5.0, 1.0));
        let (_, s) = quantize_fp4(1, MX_BLOCK, &[0.0; MX_BLOCK], Scales::Absmax);
        assert_eq!(s, [pow2(-127)]);
    }
}
