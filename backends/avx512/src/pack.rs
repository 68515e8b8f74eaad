//! Weight packing: panels of 32 output rows, K-major, in units of 128 bytes (two zmm: rows
//! 0-15, then rows 16-31), so every format streams the same way and one loop shape serves
//! decode and prefill.
//!
//! ```text
//!  one unit, one half (64 bytes = one zmm), dword i = row i of the half:
//!    bf16         unit = 2 k:  [w(k0) w(k1)]      k0 = `<< 16`, k1 = `& 0xFFFF0000`; also the
//!                                                 pair `vdpbf16ps` takes as it is
//!    fp8, mxfp8   unit = 4 k:  [w(k0) .. w(k3)]   e4m3 bytes, decoded by bit placement
//!      (`pairs`: avx512_bf16) 128-bit lane l = rows 4l..4l+3:
//!                  [r0k0 r0k1 r1k0 r1k1 .. r3k1 | r0k2 r0k3 .. r3k3]: a byte table to bf16 and
//!                  an unpack of its low and high bytes give 16 rows of (k0,k1), and of (k2,k3),
//!                  the pairs `vdpbf16ps` takes
//!    int8         unit = 4 k:  [w(k0) .. w(k3)]   signed bytes: one `vpdpbusd` per half
//!    int4 kinds   unit = 8 k:  byte j = w(k0+j) | w(k0+4+j) << 4, j < 4; nibbles as `kt_x86::int4`
//! ```
//!
//! Integer panels carry `bias` (−128·Σw per row, per K-group for the grouped kinds): the kernels
//! feed activations offset by +128 (unsigned, as `vpdpbusd` wants them) into accumulators that
//! start at −128·Σw.
//!
//! Rows past the matrix end are zero; K is zero-padded to a whole unit. Scales: int8, int4 and
//! fp8-channel `[panel][32]`; int4-gG, mxfp4, mxfp8 `[panel][group][32]`; fp8 block
//! `[panel][k-block]` (a panel never straddles a 128-row block). fp8 scales carry 2^120, which
//! undoes the exponent placement of the in-register e4m3 decode (not in `pairs`: the table gives
//! every e4m3 value exactly in bf16).

use kt_core::aligned::AlignedBuf;
use kt_core::format::FP8_BLOCK;
use kt_core::{QuantMatrix, WeightFormat};
use kt_x86::int4;

use crate::kernels::Level;

/// Output rows per panel.
pub const PANEL: usize = 32;
/// Rows per zmm (a half panel).
pub const HALF: usize = 16;
/// Bytes per unit: 2 zmm.
pub const UNIT: usize = 128;

/// 2^120: see the module docs.
pub const FP8_SCALE_FIX: f32 = f32::from_bits((127 + 120) << 23);

/// A matrix packed for the AVX-512 kernels.
pub struct Packed {
    pub format: WeightFormat,
    pub cols: usize,
    /// Units of K per panel.
    pub units: usize,
    pub data: AlignedBuf,
    pub scales: Vec<f32>,
    /// int formats: −128·Σw per row `[panel][group][32]` (one group for per-row scales).
    pub bias: Vec<i32>,
    /// fp8 kinds in bf16-pair order (module docs), for the `vdpbf16ps` kernels.
    pub pairs: bool,
}

/// Whether `level` packs format `f` in bf16-pair order: the fp8 kinds at [`Level::Bf16`].
pub fn pairs(f: WeightFormat, level: Level) -> bool {
    level == Level::Bf16 && matches!(f, WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8)
}

/// K per unit of a format.
pub fn unit_k(f: WeightFormat) -> usize {
    match f {
        WeightFormat::Bf16 => 2,
        f if int4::is_int4(f) => 8,
        _ => 4,
    }
}

impl Packed {
    /// Bytes per panel.
    pub fn panel_bytes(&self) -> usize {
        self.units * UNIT
    }

    pub fn panel(&self, p: usize) -> &[u8] {
        &self.data.as_slice()[p * self.panel_bytes()..(p + 1) * self.panel_bytes()]
    }

    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * (self.scales.len() + self.bias.len())
    }
}

/// Byte offset of (row `i` of a panel, column `c`) inside the panel, and for int4 whether it is
/// the high nibble.
fn place(f: WeightFormat, pairs: bool, i: usize, c: usize) -> (usize, bool) {
    let uk = unit_k(f);
    let (u, j) = (c / uk, c % uk);
    let half = u * UNIT + (i / HALF) * 64;
    let slot = half + (i % HALF) * 4;
    match f {
        _ if pairs => (half + (i % HALF / 4) * 16 + (j / 2) * 8 + (i % 4) * 2 + j % 2, false),
        WeightFormat::Bf16 => (slot + 2 * j, false),
        f if int4::is_int4(f) => (slot + j % 4, j >= 4),
        _ => (slot + j, false),
    }
}

/// Pack `m` (any format `supports` admits) into panels for the kernels of `level`.
pub fn pack(m: &QuantMatrix, level: Level) -> Packed {
    let f = m.format();
    let pairs = pairs(f, level);
    let (rows, cols) = (m.rows(), m.cols());
    let units = cols.div_ceil(unit_k(f));
    let panels = rows.div_ceil(PANEL);
    let mut data = kt_x86::memory::weight_buffer(panels * units * UNIT);
    let buf = data.as_mut_slice();
    let is4 = int4::is_int4(f);
    if is4 {
        let z = int4::zero_nibble(f);
        buf.fill(z | (z << 4));
    }
    for r in 0..rows {
        let (p, i) = (r / PANEL, r % PANEL);
        let dst = &mut buf[p * units * UNIT..(p + 1) * units * UNIT];
        let src = m.row_data(r);
        for c in 0..cols {
            let (at, high) = place(f, pairs, i, c);
            match f {
                WeightFormat::Bf16 => dst[at..at + 2].copy_from_slice(&src[2 * c..2 * c + 2]),
                f if is4 => {
                    let nib = int4::nibble(f, src, c);
                    dst[at] = if high { (dst[at] & 0x0F) | (nib << 4) } else { (dst[at] & 0xF0) | nib };
                }
                _ => dst[at] = src[c],
            }
        }
    }
    let scales = pack_scales(m, panels, if pairs { 1.0 } else { FP8_SCALE_FIX });
    let bias = if f.int_activations() { biases(m, panels) } else { Vec::new() };
    Packed { format: f, cols, units, data, scales, bias, pairs }
}

/// The signed integer weight of column c of an int8 or int4 row.
fn int_weight(f: WeightFormat, row: &[u8], c: usize) -> i32 {
    if f == WeightFormat::Int8Row {
        i32::from(row[c] as i8)
    } else {
        i32::from(int4::weight(f, row, c))
    }
}

/// −128·Σw per row and group, padded rows 0: `[panel][group][32]`.
fn biases(m: &QuantMatrix, panels: usize) -> Vec<i32> {
    let g = m.format().k_group().unwrap_or(m.cols());
    let groups = m.cols() / g;
    let mut v = vec![0i32; panels * groups * PANEL];
    for r in 0..m.rows() {
        let row = m.row_data(r);
        for c in 0..m.cols() {
            v[((r / PANEL) * groups + c / g) * PANEL + r % PANEL] -= 128 * int_weight(m.format(), row, c);
        }
    }
    v
}

/// The scales, times `fp8_fix` for the fp8 kinds (see the module docs).
fn pack_scales(m: &QuantMatrix, panels: usize, fp8_fix: f32) -> Vec<f32> {
    let (rows, cols, s, f) = (m.rows(), m.cols(), m.scales(), m.format());
    let fix = match f {
        WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => fp8_fix,
        f if int4::is_int4(f) => int4::value_factor(f),
        _ => 1.0,
    };
    let mut v = Vec::new();
    match f {
        WeightFormat::Bf16 => {}
        WeightFormat::Fp8Block => {
            let kb = cols.div_ceil(FP8_BLOCK);
            for p in 0..panels {
                let br = (p * PANEL) / FP8_BLOCK;
                v.extend((0..kb).map(|b| s[br * kb + b] * fix));
            }
        }
        _ => {
            // Per row (one group) or per row and K-group.
            let groups = cols / f.k_group().unwrap_or(cols);
            for p in 0..panels {
                for g in 0..groups {
                    v.extend((0..PANEL).map(|i| {
                        let r = p * PANEL + i;
                        if r < rows {
                            s[r * groups + g] * fix
                        } else {
                            0.0
                        }
                    }));
                }
            }
        }
    }
    v
}

/// Scalar decode of one packed weight times its scale (without the scale for bf16), for the
/// tests that check the layout.
#[cfg(test)]
pub fn unpack(p: &Packed, r: usize, c: usize) -> f32 {
    let (pi, i) = (r / PANEL, r % PANEL);
    let d = p.panel(pi);
    let (at, high) = place(p.format, p.pairs, i, c);
    let fix = if p.pairs { 1.0 } else { FP8_SCALE_FIX };
    let groups = p.format.k_group().map_or(1, |g| p.cols / g);
    let row_scale = || p.scales[(pi * groups + c / p.format.k_group().unwrap_or(p.cols)) * PANEL + i];
    match p.format {
        WeightFormat::Bf16 => kt_core::format::bf16::element(&d[at..at + 2], 0).to_f32(),
        WeightFormat::Fp8Block => {
            let kb = p.cols.div_ceil(FP8_BLOCK);
            kt_core::dtype::F8E4M3(d[at]).to_f32() * (p.scales[pi * kb + c / FP8_BLOCK] / fix)
        }
        WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => kt_core::dtype::F8E4M3(d[at]).to_f32() * (row_scale() / fix),
        WeightFormat::Int8Row => f32::from(d[at] as i8) * row_scale(),
        f => {
            let nib = if high { d[at] >> 4 } else { d[at] & 0x0F };
            f32::from(int4::nibble_table(f)[usize::from(nib)]) * row_scale()
        }
    }
}
