//! ggml's legacy 32-column blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (also the activation format of
//! the legacy types). Value `d·q` (`d·q + m` for the `_1` types); the nibble of column `j < 16`
//! is the low half of byte `j`, column `j + 16` the high half.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::round_away;

/// Columns per legacy block.
pub const QK: usize = 32;

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// `d · (nibble - 8)`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// f16 scale.
    pub d: [u8; 2],
    /// Nibbles.
    pub qs: [u8; 16],
}

/// `d · nibble + m`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// f16 scale.
    pub d: [u8; 2],
    /// f16 offset.
    pub m: [u8; 2],
    /// Nibbles.
    pub qs: [u8; 16],
}

/// `d · (5-bit - 16)`: bit 4 of column `j` is bit `j` of `qh`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// f16 scale.
    pub d: [u8; 2],
    /// Fifth bits, little-endian u32.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; 16],
}

/// `d · 5-bit + m`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// f16 scale.
    pub d: [u8; 2],
    /// f16 offset.
    pub m: [u8; 2],
    /// Fifth bits, little-endian u32.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; 16],
}

/// `d · q` with i8 `q`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// f16 scale.
    pub d: [u8; 2],
    /// Values.
    pub qs: [i8; 32],
}

impl BlockQ4_0 {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = h(self.d);
        for (j, &b) in self.qs.iter().enumerate() {
            y[j] = f32::from(i16::from(b & 0xF) as i8 - 8) * d;
            y[j + 16] = f32::from((b >> 4) as i8 - 8) * d;
        }
    }

    /// ggml's `quantize_row_q4_0_ref`: `d = max / -8` for the signed value of largest
    /// magnitude (the first one on ties), `q = min(15, trunc(x/d + 8.5))`.
    pub fn quantize(x: &[f32]) -> Self {
        let max = x[..QK].iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = |v: f32| ((v * id + 8.5) as u8).min(15);
        let mut qs = [0u8; 16];
        for (j, o) in qs.iter_mut().enumerate() {
            *o = q(x[j]) | (q(x[j + 16]) << 4);
        }
        BlockQ4_0 { d: f16::from_f32(d).to_le_bytes(), qs }
    }
}

impl BlockQ4_1 {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, m) = (h(self.d), h(self.m));
        for (j, &b) in self.qs.iter().enumerate() {
            y[j] = f32::from(b & 0xF) * d + m;
            y[j + 16] = f32::from(b >> 4) * d + m;
        }
    }
}

impl BlockQ5_0 {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, qh) = (h(self.d), u32::from_le_bytes(self.qh));
        for (j, &b) in self.qs.iter().enumerate() {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            y[j] = f32::from(((b & 0xF) | h0) as i8 - 16) * d;
            y[j + 16] = f32::from(((b >> 4) | h1) as i8 - 16) * d;
        }
    }
}

impl BlockQ5_1 {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, m, qh) = (h(self.d), h(self.m), u32::from_le_bytes(self.qh));
        for (j, &b) in self.qs.iter().enumerate() {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            y[j] = f32::from((b & 0xF) | h0) * d + m;
            y[j + 16] = f32::from((b >> 4) | h1) * d + m;
        }
    }
}

impl BlockQ8_0 {
    /// The 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = h(self.d);
        for (o, &q) in y.iter_mut().zip(&self.qs) {
            *o = f32::from(q) * d;
        }
    }

    /// ggml's `quantize_row_q8_0_ref`: `d = amax/127`, `q = roundf(x/d)` (ties away from
    /// zero), `d` stored as f16. Also the activation quantizer of the legacy types.
    pub fn quantize(x: &[f32]) -> Self {
        let amax = x[..QK].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; 32];
        for (o, &v) in qs.iter_mut().zip(x) {
            *o = round_away(v * id) as i8;
        }
        BlockQ8_0 { d: f16::from_f32(d).to_le_bytes(), qs }
    }

    /// The scale as f32.
    pub fn scale(&self) -> f32 {
        h(self.d)
    }
}
