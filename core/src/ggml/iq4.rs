//! ggml's non-linear 4-bit types: a nibble indexes [`KVALUES_IQ4NL`], times a block scale.
//! IQ4_NL has one f16 scale per 32 columns; IQ4_XS a 6-bit signed scale per 32 columns of a
//! 256-column super-block.

use bytemuck::{Pod, Zeroable};
use half::f16;

/// The sixteen levels a nibble selects.
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// `d · KVALUES[nibble]`, 32 columns, nibbles as in Q4_0.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq4Nl {
    /// f16 scale.
    pub d: [u8; 2],
    /// Nibbles.
    pub qs: [u8; 16],
}

/// `d · (ls - 32) · KVALUES[nibble]` per 32-column sub-block of 256.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq4Xs {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// High two bits of each sub-block's scale, little-endian u16.
    pub scales_h: [u8; 2],
    /// Low four bits of the scales, two per byte.
    pub scales_l: [u8; 4],
    /// Nibbles: 16 bytes per sub-block, as in Q4_0.
    pub qs: [u8; 128],
}

fn lut(y: &mut [f32], qs: &[u8], d: f32) {
    for (j, &b) in qs.iter().enumerate() {
        y[j] = d * f32::from(KVALUES_IQ4NL[usize::from(b & 0xF)]);
        y[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(b >> 4)]);
    }
}

impl BlockIq4Nl {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        lut(y, &self.qs, f16::from_le_bytes(self.d).to_f32());
    }
}

impl BlockIq4Xs {
    /// The signed scale of sub-block `ib` (0..8), `ls - 32`.
    #[inline]
    pub fn scale(&self, ib: usize) -> i8 {
        let h = u16::from_le_bytes(self.scales_h);
        let ls = ((self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | ((((h >> (2 * ib)) & 3) as u8) << 4);
        ls as i8 - 32
    }

    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = f16::from_le_bytes(self.d).to_f32();
        for ib in 0..8 {
            lut(&mut y[32 * ib..], &self.qs[16 * ib..16 * ib + 16], d * f32::from(self.scale(ib)));
        }
    }
}
