//! ggml's K-quants: 256-column super-blocks of 16 or 32-column sub-blocks with quantized
//! sub-block scales (Q2_K…Q6_K), and Q8_K, the activation format they are dotted with.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::round_away;

/// Columns per super-block.
pub const QK_K: usize = 256;

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// 2-bit values, 4-bit scale and min per 16 columns.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    /// Scale (low nibble) and min (high nibble) per 16 columns.
    pub scales: [u8; 16],
    /// Values, four per byte.
    pub qs: [u8; 64],
    /// f16 super-scale of the scales.
    pub d: [u8; 2],
    /// f16 super-scale of the mins.
    pub dmin: [u8; 2],
}

/// 3-bit values (2 low bits + a high-bit mask), 6-bit signed scales per 16 columns.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    /// Third bits.
    pub hmask: [u8; 32],
    /// Low two bits.
    pub qs: [u8; 64],
    /// 16 six-bit scales, packed.
    pub scales: [u8; 12],
    /// f16 super-scale.
    pub d: [u8; 2],
}

/// 4-bit values, 6-bit scale and min per 32 columns.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    /// f16 super-scale of the scales.
    pub d: [u8; 2],
    /// f16 super-scale of the mins.
    pub dmin: [u8; 2],
    /// 8 scales and 8 mins, six bits each, packed.
    pub scales: [u8; 12],
    /// Nibbles: byte `32c + l` holds columns `64c + l` (low) and `64c + 32 + l` (high).
    pub qs: [u8; 128],
}

/// 5-bit values, 6-bit scale and min per 32 columns.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    /// f16 super-scale of the scales.
    pub d: [u8; 2],
    /// f16 super-scale of the mins.
    pub dmin: [u8; 2],
    /// As in Q4_K.
    pub scales: [u8; 12],
    /// Fifth bits: bit `2c` (`2c+1`) of byte `l` for the low (high) nibble of chunk `c`.
    pub qh: [u8; 32],
    /// Low nibbles, as in Q4_K.
    pub qs: [u8; 128],
}

/// 6-bit values, i8 scale per 16 columns.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low nibbles.
    pub ql: [u8; 128],
    /// High two bits.
    pub qh: [u8; 64],
    /// Signed scales.
    pub scales: [i8; 16],
    /// f16 super-scale.
    pub d: [u8; 2],
}

/// Activations for the K-quants: i8 values with an f32 scale, and sums of each 16 values
/// (the K-quant kernels fold their mins in with them).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Values.
    pub qs: [i8; 256],
    /// `Σ qs[16j..16j+16]`.
    pub bsums: [i16; 16],
}

/// Scale and min `j` (0..8) of Q4_K/Q5_K's 12 packed bytes.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The inverse of [`scale_min_k4`] for eight 6-bit scales and mins.
pub fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

/// Q3_K's sixteen 6-bit scales, unpacked and made signed (`- 32`).
#[inline]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    const M1: u32 = 0x0303_0303;
    const M2: u32 = 0x0f0f_0f0f;
    let aux = [
        (a0 & M2) | ((tmp & M1) << 4),
        (a1 & M2) | (((tmp >> 2) & M1) << 4),
        ((a0 >> 4) & M2) | (((tmp >> 4) & M1) << 4),
        ((a1 >> 4) & M2) | (((tmp >> 6) & M1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (aux[i / 4] >> (8 * (i % 4))) as u8 as i8 - 32;
    }
    out
}

impl BlockQ2K {
    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, min) = (h(self.d), h(self.dmin));
        let mut is = 0;
        for n in 0..2 {
            let q = &self.qs[32 * n..32 * n + 32];
            for j in 0..4 {
                let shift = 2 * j;
                for half in 0..2 {
                    let sc = self.scales[is];
                    is += 1;
                    let (dl, ml) = (d * f32::from(sc & 0xF), min * f32::from(sc >> 4));
                    let at = 128 * n + 32 * j + 16 * half;
                    for l in 0..16 {
                        y[at + l] = dl * f32::from((q[l + 16 * half] >> shift) & 3) - ml;
                    }
                }
            }
        }
    }
}

impl BlockQ3K {
    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = h(self.d);
        let scales = q3k_scales(&self.scales);
        let mut is = 0;
        for n in 0..2 {
            let q = &self.qs[32 * n..32 * n + 32];
            for j in 0..4 {
                let (shift, m) = (2 * j, 1u8 << (4 * n + j));
                for half in 0..2 {
                    let dl = d * f32::from(scales[is]);
                    is += 1;
                    let at = 128 * n + 32 * j + 16 * half;
                    for l in 0..16 {
                        let lo = ((q[l + 16 * half] >> shift) & 3) as i8;
                        let hi = if self.hmask[l + 16 * half] & m != 0 { 0 } else { 4 };
                        y[at + l] = dl * f32::from(lo - hi);
                    }
                }
            }
        }
    }
}

impl BlockQ4K {
    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, min) = (h(self.d), h(self.dmin));
        for c in 0..4 {
            let q = &self.qs[32 * c..32 * c + 32];
            let (s1, m1) = scale_min_k4(2 * c, &self.scales);
            let (s2, m2) = scale_min_k4(2 * c + 1, &self.scales);
            let (d1, m1) = (d * f32::from(s1), min * f32::from(m1));
            let (d2, m2) = (d * f32::from(s2), min * f32::from(m2));
            for l in 0..32 {
                y[64 * c + l] = d1 * f32::from(q[l] & 0xF) - m1;
                y[64 * c + 32 + l] = d2 * f32::from(q[l] >> 4) - m2;
            }
        }
    }

    /// Quantize 256 values: per 32 columns an asymmetric 4-bit fit `x ≈ s·q - m` (min/max,
    /// then two least-squares refinements of `s` and `m` for the chosen levels), the scales
    /// and mins quantized to 6 bits of f16 super-scales.
    pub fn quantize(x: &[f32]) -> Self {
        let mut s = [0.0f32; 8];
        let mut m = [0.0f32; 8];
        for (j, xs) in x[..QK_K].chunks_exact(32).enumerate() {
            (s[j], m[j]) = fit_asym(xs, 15.0);
        }
        let smax = s.iter().fold(0.0f32, |a, &v| a.max(v));
        let mmax = m.iter().fold(0.0f32, |a, &v| a.max(v));
        let d = f16::from_f32(smax / 63.0);
        let dmin = f16::from_f32(mmax / 63.0);
        let (df, dminf) = (d.to_f32(), dmin.to_f32());
        let q6 = |v: f32, by: f32| if by > 0.0 { (round_away(v / by) as i32).clamp(0, 63) as u8 } else { 0 };
        let sq: [u8; 8] = core::array::from_fn(|j| q6(s[j], df));
        let mq: [u8; 8] = core::array::from_fn(|j| q6(m[j], dminf));
        let mut qs = [0u8; 128];
        for (j, xs) in x[..QK_K].chunks_exact(32).enumerate() {
            let (dl, ml) = (df * f32::from(sq[j]), dminf * f32::from(mq[j]));
            let id = if dl > 0.0 { 1.0 / dl } else { 0.0 };
            let (c, hi) = (j / 2, j % 2);
            for (l, &v) in xs.iter().enumerate() {
                let q = (round_away((v + ml) * id) as i32).clamp(0, 15) as u8;
                qs[32 * c + l] |= q << (4 * hi);
            }
        }
        BlockQ4K { d: d.to_le_bytes(), dmin: dmin.to_le_bytes(), scales: pack_scale_min_k4(&sq, &mq), qs }
    }
}

/// Fit `x ≈ s·q - m` with `q` in `0..=levels`, `s, m ≥ 0`: start from the min/max span, then
/// refit `s, m` by least squares on the chosen levels (twice), keeping the better fit.
fn fit_asym(x: &[f32], levels: f32) -> (f32, f32) {
    let lo = x.iter().fold(0.0f32, |a, &v| a.min(v));
    let hi = x.iter().fold(lo, |a, &v| a.max(v));
    let err = |s: f32, m: f32| -> f32 {
        let id = if s > 0.0 { 1.0 / s } else { 0.0 };
        x.iter()
            .map(|&v| {
                let e = s * round_away((v + m) * id).clamp(0.0, levels) - m - v;
                e * e
            })
            .sum()
    };
    let (mut s, mut m) = ((hi - lo) / levels, -lo);
    let mut best = err(s, m);
    for _ in 0..2 {
        let id = if s > 0.0 { 1.0 / s } else { return (s, m) };
        let (mut sq, mut sqq, mut sx, mut sqx) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for &v in x {
            let q = round_away((v + m) * id).clamp(0.0, levels);
            (sq, sqq, sx, sqx) = (sq + q, sqq + q * q, sx + v, sqx + q * v);
        }
        let n = x.len() as f32;
        let det = n * sqq - sq * sq;
        if det <= 0.0 {
            break;
        }
        let ns = (n * sqx - sq * sx) / det;
        let nm = (ns * sq - sx) / n;
        let (ns, nm) = if nm < 0.0 { (if sqq > 0.0 { sqx / sqq } else { 0.0 }, 0.0) } else { (ns, nm) };
        if ns.is_nan() || ns <= 0.0 {
            break;
        }
        let e = err(ns, nm);
        if e >= best {
            break;
        }
        (s, m, best) = (ns, nm, e);
    }
    (s, m)
}

impl BlockQ5K {
    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, min) = (h(self.d), h(self.dmin));
        for c in 0..4 {
            let q = &self.qs[32 * c..32 * c + 32];
            let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
            let (s1, m1) = scale_min_k4(2 * c, &self.scales);
            let (s2, m2) = scale_min_k4(2 * c + 1, &self.scales);
            let (d1, m1) = (d * f32::from(s1), min * f32::from(m1));
            let (d2, m2) = (d * f32::from(s2), min * f32::from(m2));
            for l in 0..32 {
                let h1 = if self.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if self.qh[l] & u2 != 0 { 16 } else { 0 };
                y[64 * c + l] = d1 * f32::from((q[l] & 0xF) + h1) - m1;
                y[64 * c + 32 + l] = d2 * f32::from((q[l] >> 4) + h2) - m2;
            }
        }
    }
}

impl BlockQ6K {
    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = h(self.d);
        for n in 0..2 {
            let (ql, qh, sc) = (&self.ql[64 * n..], &self.qh[32 * n..], &self.scales[8 * n..]);
            let y = &mut y[128 * n..];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                y[l] = d * f32::from(sc[is]) * f32::from(q1);
                y[l + 32] = d * f32::from(sc[is + 2]) * f32::from(q2);
                y[l + 64] = d * f32::from(sc[is + 4]) * f32::from(q3);
                y[l + 96] = d * f32::from(sc[is + 6]) * f32::from(q4);
            }
        }
    }
}

impl BlockQ8K {
    /// Quantize 256 activations: `d = amax/127`, `q = roundf(x/d)`, and the 16-column sums.
    pub fn quantize(x: &[f32]) -> Self {
        let amax = x[..QK_K].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut b = BlockQ8K { d, qs: [0; 256], bsums: [0; 16] };
        for (o, &v) in b.qs.iter_mut().zip(x) {
            *o = round_away(v * id) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        b
    }

    /// The 256 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        for (o, &q) in y.iter_mut().zip(&self.qs) {
            *o = f32::from(q) * self.d;
        }
    }
}
