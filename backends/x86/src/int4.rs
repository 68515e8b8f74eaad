//! The int4 kinds' weights as the x86 kernels store them: one nibble per weight that a
//! `vpshufb` table maps to the signed weight byte (KT's int4: its own two's-complement nibble,
//! so KT's packed bytes are used as they are; the K-group kinds: `nibble − 8`; mxfp4: its e2m1
//! code to 2·value), with the row sums the unsigned-activation kernels take off.
#![forbid(unsafe_code)]

use kt_core::format::{int4_group, int4_row, mx};
use kt_core::WeightFormat;

/// Stored as int4 nibbles (with row sums) by the x86 backends.
pub fn is_int4(f: WeightFormat) -> bool {
    matches!(f, WeightFormat::Int4Row | WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4)
}

/// The signed int4 weight of column c of a row: KT int4's n (value 16·n·d), K-group q, or
/// mxfp4's 2·e2m1.
#[inline]
pub fn weight(f: WeightFormat, row: &[u8], c: usize) -> i8 {
    match f {
        WeightFormat::Int4Row => int4_row::weight_i8(row, c) >> 4,
        WeightFormat::Mxfp4 => mx::fp4_x2(row, c),
        _ => int4_group::weight_i8(row, c),
    }
}

/// The stored nibble of column c: KT int4's two's complement, mxfp4's own code, else `w + 8`.
#[inline]
pub fn nibble(f: WeightFormat, row: &[u8], c: usize) -> u8 {
    match f {
        WeightFormat::Mxfp4 => mx::fp4_code(row, c),
        WeightFormat::Int4Row => weight(f, row, c) as u8 & 0x0F,
        _ => (weight(f, row, c) + 8) as u8,
    }
}

/// The nibble of a zero weight (what padding holds).
pub fn zero_nibble(f: WeightFormat) -> u8 {
    match f {
        WeightFormat::Mxfp4 | WeightFormat::Int4Row => 0,
        _ => 8,
    }
}

/// The `vpshufb` table from a stored nibble to the signed weight byte.
pub fn nibble_table(f: WeightFormat) -> [i8; 16] {
    match f {
        WeightFormat::Mxfp4 => mx::FP4_X2,
        WeightFormat::Int4Row => core::array::from_fn(|n| ((n as u8) << 4) as i8 >> 4),
        _ => core::array::from_fn(|n| n as i8 - 8),
    }
}

/// The K-group kinds' weights as an unsigned multiplicand, `w + offset`, for kernels that take
/// the activations signed (and start each group's sums at `−offset·Σx`): the table from the
/// stored nibble (`None`: the nibble itself, int4-gG's `w + 8`) and the offset.
pub fn unsigned_weights(f: WeightFormat) -> (Option<[i8; 16]>, i32) {
    match f {
        WeightFormat::Mxfp4 => (Some(mx::FP4_X2.map(|v| v + 12)), 12),
        _ => (None, 8),
    }
}

/// The factor between the int4 weight the kernels multiply and the format's value (before its
/// scale): 16 for KT's int4 (its n stands for 16·n), ½ for mxfp4 (2·e2m1), else 1.
pub fn value_factor(f: WeightFormat) -> f32 {
    match f {
        WeightFormat::Int4Row => 16.0,
        WeightFormat::Mxfp4 => 0.5,
        _ => 1.0,
    }
}

/// A K-group matrix's packed scales as `(scales, [])`, or as `([], their bf16 bits)` where every
/// one is a bf16 (our quantizer's and Kimi-K2's are; GPTQ's f16 ones need not be): half the
/// bytes, which decode streams with the weights (int4-g32: 0.5625 bytes a weight, not 0.625).
pub fn bf16_scales(scales: Vec<f32>) -> (Vec<f32>, Vec<u16>) {
    match scales.iter().all(|s| s.to_bits() & 0xFFFF == 0) {
        true => (Vec::new(), scales.iter().map(|s| (s.to_bits() >> 16) as u16).collect()),
        false => (scales, Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_core::QuantMatrix;

    #[test]
    fn table_of_the_nibble_times_the_factor_is_the_dequantized_weight() {
        let mut r = kt_core::rng::SplitMix64::new(11);
        for f in [WeightFormat::Int4Row, WeightFormat::Int4Group { group: 32 }, WeightFormat::Mxfp4] {
            let x: Vec<f32> = (0..3 * 64).map(|_| r.uniform(2.0)).collect();
            let q = QuantMatrix::quantize(f, 3, 64, &x).unwrap();
            let deq = q.dequantize();
            for row in 0..3 {
                for c in 0..64 {
                    let w = nibble_table(f)[usize::from(nibble(f, q.row_data(row), c))];
                    assert_eq!(w, weight(f, q.row_data(row), c), "{f} r{row} c{c}");
                    let scale = match f.k_group() {
                        Some(g) => q.scales()[row * (64 / g) + c / g],
                        None => q.scales()[row],
                    };
                    assert_eq!(f32::from(w) * value_factor(f) * scale, deq[row * 64 + c], "{f} r{row} c{c}");
                }
            }
            assert_eq!(nibble_table(f)[usize::from(zero_nibble(f))], 0);
        }
    }
}
