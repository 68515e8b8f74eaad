//! ggml's non-linear 4-bit types: a nibble indexes a table of levels, times a block scale.
//! IQ4_NL has one f16 scale per 32 columns and IQ4_XS a 6-bit signed scale per 32 columns of a
//! 256-column super-block, both over [`KVALUES_IQ4NL`]; MXFP4 (gpt-oss's GGUF experts) one e8m0
//! scale per 32 columns over [`KVALUES_MXFP4`].

use bytemuck::{Pod, Zeroable};
use half::f16;

/// The sixteen levels a nibble selects.
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The e2m1 values doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), as ggml keeps
/// them: MXFP4's scale is halved to match ([`e8m0_half`]).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

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

/// `2^(e − 128) · KVALUES_MXFP4[nibble]`, 32 columns, nibbles as in Q4_0.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockMxfp4 {
    /// e8m0 scale code.
    pub e: u8,
    /// Nibbles.
    pub qs: [u8; 16],
}

/// `2^(e − 128)`, half the e8m0 value `2^(e − 127)`, bit for bit as ggml's
/// `ggml_e8m0_to_fp32_half` (a subnormal for e < 2; 255 is 2^127, not NaN).
pub fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { u32::from(e - 1) << 23 })
}

fn lut(y: &mut [f32], qs: &[u8], d: f32, levels: &[i8; 16]) {
    for (j, &b) in qs.iter().enumerate() {
        y[j] = d * f32::from(levels[usize::from(b & 0xF)]);
        y[j + 16] = d * f32::from(levels[usize::from(b >> 4)]);
    }
}

impl BlockIq4Nl {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        lut(y, &self.qs, f16::from_le_bytes(self.d).to_f32(), &KVALUES_IQ4NL);
    }
}

impl BlockMxfp4 {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        lut(y, &self.qs, e8m0_half(self.e), &KVALUES_MXFP4);
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
            lut(&mut y[32 * ib..], &self.qs[16 * ib..16 * ib + 16], d * f32::from(self.scale(ib)), &KVALUES_IQ4NL);
        }
    }
}
