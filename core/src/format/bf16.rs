//! bf16 weights: each f32 rounded to bf16 (nearest, ties to even); little-endian bit patterns.

use alloc::vec::Vec;
use half::bf16;

/// Round every value to bf16.
pub fn quantize(src: &[f32]) -> Vec<u8> {
    src.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect()
}

/// The bf16 value of element `c` of a row.
#[inline]
pub fn element(row: &[u8], c: usize) -> bf16 {
    bf16::from_bits(u16::from_le_bytes([row[2 * c], row[2 * c + 1]]))
}

/// Widen a row of bf16 to f32 (exact).
pub fn dequantize_row(row: &[u8], out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        *o = element(row, c).to_f32();
    }
}
