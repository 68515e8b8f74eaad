//! Weight packing: every format is stored as panels of 16 output rows, K-major, so one loop
//! serves decode (1-5 tokens per pass) and prefill (6×16 register tiles).
//!
//! ```text
//!  bf16, panel p = rows 16p..16p+16, one 32-byte slice per k, rows paired in its dwords:
//!    k=0: r0 r8 r1 r9 ... r7 r15 | k=1: r0 r8 ... | ...         -> one ymm per k; a shift
//!    left by 16 leaves rows 0-7 as f32, a mask of the high words rows 8-15 (`kernels::bf16_slice`)
//!  int8, unit = 4 consecutive k ("quad"):
//!    u=0: r0[k0 k1 k2 k3] r1[k0..k3] ... r15[k0..k3] | u=1 ...  -> 64 bytes = 2 ymm per unit
//!  int4 (all kinds), unit = 8 consecutive k ("octet"), byte j of row r:
//!    low nibble = k(8u + j), high nibble = k(8u + 4 + j), j < 4 -> 64 bytes = 2 ymm per unit
//!    nibble = w + 8 with w in -8..=7 (KT int4: w = n, its 16 folded into the scale;
//!    K-group: w = q), or mxfp4's e2m1 code (w = 2·value, the ½ folded into the scale); the
//!    kernels map a nibble to the signed byte w with one `vpshufb` table per format
//!  fp8, mxfp8 (1 byte per weight), unit = 2 consecutive k ("pair", K padded to even):
//!    32 bytes; dword j of lane l holds, from its top byte down, row 4l+j at k and at k+1,
//!    then row 8+4l+j at k and at k+1 -> each byte position of the dwords is one ymm of 8 rows
//!    at one k (shifts and a mask place it as an f32: `kernels::fp8_first`, `fp8_second`)
//! ```
//!
//! KT's per-row int4 panels also carry `rowsum` (Σ w per row): its kernels feed activations
//! offset by +128 (unsigned) and subtract 128·Σw. The K-group kinds carry none: their kernels
//! take the weights unsigned and the activations signed, whose group sums come with them
//! (`act`), so decode streams 0.5625 bytes a weight for them (int4-g32 with bf16 scales), not 0.75.
//!
//! Rows past the matrix end are zero (their outputs are dropped); K is zero-padded to a whole
//! unit. Scales: int8/int4/fp8-channel `[panel][16]`; int4-gG `[panel][group][16]` (as bf16 bits
//! where every scale is a bf16, widened in the kernels), and mxfp4, mxfp8 the same as their
//! e8m0 codes (one byte each, widened in the kernels);
//! fp8 block `[panel][k-block]` (a panel never straddles a 128-row block). fp8 scales carry a
//! factor 2^120 that undoes the exponent placement of the in-register e4m3 decode.

use kt_core::format::mx;
use kt_core::format::FP8_BLOCK;
use kt_core::{QuantMatrix, WeightFormat};
pub use kt_x86::int4::{is_int4, nibble_table};
use kt_x86::int4::{nibble as int4_nibble, weight as int4_w};
use kt_x86::memory::{weight_buffer, WeightBuf};

/// Output rows per panel.
pub const PANEL: usize = 16;

/// 2^120: see the module docs.
pub const FP8_SCALE_FIX: f32 = f32::from_bits((127 + 120) << 23);

/// A matrix packed for the AVX2 kernels.
pub struct Packed {
    pub format: WeightFormat,
    pub cols: usize,
    /// Units of K per panel (k, quads or octets).
    pub units: usize,
    /// Bytes per panel.
    pub panel_bytes: usize,
    pub data: WeightBuf,
    /// Scales as the module docs lay them out (none for the MX kinds: `codes`; none for a
    /// K-group int4 matrix whose scales are all bf16: `scales16`).
    pub scales: Vec<f32>,
    /// K-group int4 scales as bf16 bits, `[panel][group][16]`, where every one is a bf16
    /// (`kt_x86::int4::bf16_scales`).
    pub scales16: Vec<u16>,
    /// The MX kinds' scales as their e8m0 codes `c`, `[panel][group][16]`, each standing for
    /// `2^(c − code_bias)`: a quarter of f32 scales' bytes, which decode streams with the weights.
    pub codes: Vec<u8>,
    /// 127, less the fold of mxfp4's ½ (128) or of the fp8 decode's 2^120 (7).
    pub code_bias: i32,
    /// KT's per-row int4: Σ w per row (`[panel][16]`).
    pub rowsum: Vec<i32>,
}

/// K per unit of a format.
pub fn unit_k(f: WeightFormat) -> usize {
    match f {
        WeightFormat::Bf16 => 1,
        WeightFormat::Int8Row => 4,
        f if is_int4(f) => 8,
        _ => 2,
    }
}

/// Bytes one panel row-slot takes per unit.
fn unit_bytes(f: WeightFormat) -> usize {
    match f {
        WeightFormat::Bf16 => 2,
        WeightFormat::Int8Row => 4,
        f if is_int4(f) => 4,
        _ => 2,
    }
}

/// Where weight (row `i` of its panel, column `c`) of a bf16 panel lies: see the module docs.
fn bf16_at(i: usize, c: usize) -> usize {
    let word = if i < 8 { 2 * i } else { 2 * (i - 8) + 1 };
    (c * PANEL + word) * 2
}

/// Where weight (row `i` of its panel, column `c`) of an fp8 or mxfp8 panel lies: see the
/// module docs.
fn fp8_at(i: usize, c: usize) -> usize {
    let (lane, j) = ((i % 8) / 4, i % 4);
    let byte = 3 - (c % 2) - 2 * (i / 8);
    (c / 2) * 32 + lane * 16 + j * 4 + byte
}

impl Packed {
    pub fn panel(&self, p: usize) -> &[u8] {
        &self.data.as_slice()[p * self.panel_bytes..(p + 1) * self.panel_bytes]
    }

    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * (self.scales.len() + self.rowsum.len()) + 2 * self.scales16.len() + self.codes.len()
    }
}

/// Pack `m` (any format) into panels.
pub fn pack(m: &QuantMatrix) -> Packed {
    let f = m.format();
    let (rows, cols) = (m.rows(), m.cols());
    let uk = unit_k(f);
    let units = cols.div_ceil(uk);
    let panel_bytes = units * PANEL * unit_bytes(f);
    let panels = rows.div_ceil(PANEL);
    let mut data = weight_buffer(panels * panel_bytes);
    let buf = data.as_mut_slice();
    let int4 = is_int4(f);
    if int4 {
        let z = kt_x86::int4::zero_nibble(f); // w = 0 in padding
        buf.fill(z | z << 4);
    }
    for r in 0..rows {
        let (p, i) = (r / PANEL, r % PANEL);
        let dst = &mut buf[p * panel_bytes..(p + 1) * panel_bytes];
        let src = m.row_data(r);
        // One format test a row, not a weight (a load packs billions of weights).
        match f {
            WeightFormat::Bf16 => {
                for (c, w) in src[..2 * cols].chunks_exact(2).enumerate() {
                    let at = bf16_at(i, c);
                    dst[at..at + 2].copy_from_slice(w);
                }
            }
            WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => {
                for (c, &w) in src[..cols].iter().enumerate() {
                    dst[fp8_at(i, c)] = w;
                }
            }
            WeightFormat::Int8Row => {
                for (c, &w) in src[..cols].iter().enumerate() {
                    dst[(c / 4) * 64 + i * 4 + c % 4] = w;
                }
            }
            f if is_int4(f) => {
                // Whole octets from their 4 source bytes at once (every int4 kind stores its
                // nibbles as they come, low nibble the even column: `int4_nibble`).
                for (u, w) in src[..cols / 8 * 4].chunks_exact(4).enumerate() {
                    let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                    for j in 0..4 {
                        dst[u * 64 + i * 4 + j] =
                            ((w >> (4 * j)) & 0x0F) as u8 | (((w >> (16 + 4 * j)) & 0x0F) << 4) as u8;
                    }
                }
                for c in cols / 8 * 8..cols {
                    let nib = int4_nibble(f, src, c);
                    let (u, j) = (c / 8, c % 8);
                    let at = u * 64 + i * 4 + j % 4;
                    dst[at] = if j < 4 { (dst[at] & 0xF0) | nib } else { (dst[at] & 0x0F) | (nib << 4) };
                }
            }
            _ => unreachable!("supports() admits only these formats"),
        }
    }
    let (scales, codes, code_bias) = match f {
        WeightFormat::Mxfp4 => (Vec::new(), mx::panel_codes(m.scales(), m.rows(), m.cols(), PANEL), 128),
        WeightFormat::Mxfp8 => (Vec::new(), mx::panel_codes(m.scales(), m.rows(), m.cols(), PANEL), 7),
        _ => (pack_scales(m, panels), Vec::new(), 0),
    };
    let (scales, scales16) = match f {
        WeightFormat::Int4Group { .. } => kt_x86::int4::bf16_scales(scales),
        _ => (scales, Vec::new()),
    };
    let rowsum = if f == WeightFormat::Int4Row { row_sums(m, panels) } else { Vec::new() };
    Packed { format: f, cols, units, panel_bytes, data, scales, scales16, codes, code_bias, rowsum }
}

/// Σ w per row (and group), padded rows 0: `[panel][group][16]`.
fn row_sums(m: &QuantMatrix, panels: usize) -> Vec<i32> {
    let g = m.format().k_group().unwrap_or(m.cols());
    let groups = m.cols() / g;
    let mut v = vec![0i32; panels * groups * PANEL];
    for r in 0..m.rows() {
        let row = m.row_data(r);
        for c in 0..m.cols() {
            v[((r / PANEL) * groups + c / g) * PANEL + r % PANEL] += i32::from(int4_w(m.format(), row, c));
        }
    }
    v
}

fn pack_scales(m: &QuantMatrix, panels: usize) -> Vec<f32> {
    let (rows, cols, s) = (m.rows(), m.cols(), m.scales());
    let per_row = |v: &mut Vec<f32>, fix: f32| {
        for p in 0..panels {
            v.extend((0..PANEL).map(|i| s.get(p * PANEL + i).map_or(0.0, |x| x * fix)));
        }
    };
    let mut v = Vec::new();
    match m.format() {
        WeightFormat::Bf16 => {}
        WeightFormat::Int8Row => per_row(&mut v, 1.0),
        WeightFormat::Int4Row => per_row(&mut v, 16.0), // the kernels multiply by n, not 16n
        WeightFormat::Fp8Channel => per_row(&mut v, FP8_SCALE_FIX),
        // (The MX kinds' scales are codes: `pack_codes`.)
        f @ WeightFormat::Int4Group { .. } => {
            let groups = cols / f.k_group().unwrap_or(cols);
            for p in 0..panels {
                for g in 0..groups {
                    v.extend((0..PANEL).map(|i| {
                        let r = p * PANEL + i;
                        if r < rows {
                            s[r * groups + g]
                        } else {
                            0.0
                        }
                    }));
                }
            }
        }
        WeightFormat::Fp8Block => {
            let kb = cols.div_ceil(FP8_BLOCK);
            for p in 0..panels {
                let br = (p * PANEL) / FP8_BLOCK;
                v.extend((0..kb).map(|b| s[br * kb + b] * FP8_SCALE_FIX));
            }
        }
        _ => unreachable!("supports() admits only these formats"),
    }
    v
}

/// Scalar decode of one packed weight, used by the tests to check the layout.
#[cfg(test)]
pub fn unpack(p: &Packed, r: usize, c: usize) -> f32 {
    let (pi, i) = (r / PANEL, r % PANEL);
    let d = p.panel(pi);
    match p.format {
        WeightFormat::Bf16 => {
            let at = bf16_at(i, c);
            kt_core::format::bf16::element(&d[at..at + 2], 0).to_f32()
        }
        WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => {
            kt_core::dtype::F8E4M3(d[fp8_at(i, c)]).to_f32()
        }
        WeightFormat::Int8Row => f32::from(d[(c / 4) * 64 + i * 4 + c % 4] as i8),
        f if is_int4(f) => {
            let (u, j) = (c / 8, c % 8);
            let b = d[u * 64 + i * 4 + j % 4];
            let nib = if j < 4 { b & 0x0F } else { b >> 4 };
            let w = f32::from(nibble_table(p.format)[usize::from(nib)]);
            match p.format {
                WeightFormat::Int4Row => w * 16.0,
                WeightFormat::Mxfp4 => w * 0.5,
                _ => w,
            }
        }
        _ => unreachable!(),
    }
}
