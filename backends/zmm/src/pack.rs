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
//! Per-row int8 and int4 panels carry `bias` (−128·Σw per row): the kernels feed activations
//! offset by +128 (unsigned, as `vpdpbusd` wants them) into accumulators that start at −128·Σw.
//! The K-group kinds carry none: their kernels take the weights unsigned and the activations
//! signed, whose group sums come with them (`act`).
//!
//! Per-row int8 and int4 in the shapes KT packs (rows a multiple of 32, K of 64 / 128) are
//! kept in KT's own order instead (`kt`: `kt_core::format::kt_packed`, its `BufferB`), so KT's
//! converted files load by copying and the AMX backend's tiles read the same bytes. Its 32-row
//! tiles hold the same 128-byte units, only placed differently: in each run of 64 K bytes,
//! the 16 rows-0-15 halves come first, then the 16 rows-16-31 halves; int4 bytes pair k with
//! k + 64 (two's-complement nibbles) where the panel order pairs k with k + 4.
//!
//! Rows past the matrix end are zero; K is zero-padded to a whole unit. Scales: int8, int4 and
//! fp8-channel `[panel][32]`; int4-gG `[panel][group][32]` (as bf16 bits where every scale is
//! a bf16, widened in the kernels), and mxfp4, mxfp8 the same as their e8m0 codes (one byte
//! each, widened in the kernels; rebiased to f32 exponent fields where that is exact,
//! `exponent_codes`); fp8 block `[panel][k-block]` (a
//! panel never straddles a 128-row block). fp8 scales carry 2^120, which
//! undoes the exponent placement of the in-register e4m3 decode (not in `pairs`: the table gives
//! every e4m3 value exactly in bf16).

use kt_core::format::mx;
use kt_core::format::{kt_packed, FP8_BLOCK};
use kt_core::{Error, QuantMatrix, WeightFormat};
use kt_x86::int4;
use kt_x86::memory::WeightBuf;

use crate::level::Level;

/// Output rows per panel.
pub const PANEL: usize = 32;
/// Rows per zmm (a half panel).
pub const HALF: usize = 16;
/// Bytes per unit: 2 zmm.
pub const UNIT: usize = 128;

/// `2^(c − bias)` as f32, exactly (subnormal below 2^-126, infinite above 2^127, as the f32
/// products `2^(c − 127) · fold` it stands for).
pub fn mx_scale(c: u8, bias: i32) -> f32 {
    match i32::from(c) - bias {
        e if e > 127 => f32::INFINITY,
        e if e >= -126 => f32::from_bits(((e + 127) as u32) << 23),
        e if e >= -149 => f32::from_bits(1 << (e + 149)),
        _ => 0.0,
    }
}

/// Whether every nonzero element of an mxfp8 matrix in bf16-pair order times its scale,
/// `v · 2^(c − 127)`, is a normal bf16 (true of real checkpoints: the e4m3 magnitudes lie in
/// 2^-9..480, so the codes 10..=246 do). The AMX tiles then add each scale into its elements'
/// exponents as they decode them and sum the whole K in one tile. A code out of range passes
/// where its block is all zeros (the OCP rule codes a zero block 0; padded rows are 0).
fn mx_folds(m: &QuantMatrix, pairs: bool, codes: &[u8], code_bias: i32) -> bool {
    if !(pairs && m.format() == WeightFormat::Mxfp8) {
        return false;
    }
    // The element magnitudes' binary exponents span -9..=8.
    let fits = -126 + 9..=127 - 8;
    codes.iter().enumerate().all(|(at, &c)| fits.contains(&(i32::from(c) - code_bias)) || zero_block(m, at))
}

/// An MX matrix's codes rebiased to 127, `clamp(c + 127 − code_bias, 0, 255)`, so that each
/// placed in an f32's exponent field is its scale (`c << 23`: two instructions per 16 rows
/// where `vscalefps` took four: docs/tuning.md): 255 is +∞ as
/// [`mx_scale`] has it, and 0 (+0, not a subnormal) is allowed only where the block is all
/// zeros, whose sums are 0 whatever the scale. `None` if a nonzero block's scale is subnormal
/// (mxfp4's codes 0 and 1, mxfp8's 0): such a matrix keeps its codes for `vscalefps`.
fn exponent_codes(m: &QuantMatrix, codes: &[u8], code_bias: i32) -> Option<Vec<u8>> {
    let exponent = |(at, &c): (usize, &u8)| match i32::from(c) + 127 - code_bias {
        e if e >= 1 => Some(e.min(255) as u8),
        _ => zero_block(m, at).then_some(0),
    };
    codes.iter().enumerate().map(exponent).collect()
}

/// Whether the block at `at` (`[panel][group][32]` index) of an MX matrix is all zeros (either
/// sign), or lies in a padded row.
fn zero_block(m: &QuantMatrix, at: usize) -> bool {
    let groups = m.cols() / mx::MX_BLOCK;
    let (p, g, i) = (at / (groups * PANEL), at / PANEL % groups, at % PANEL);
    let r = p * PANEL + i;
    // Bytes per block and the bits of a byte that hold magnitudes (e2m1 nibbles, e4m3 bytes).
    let (bytes, magnitudes) =
        if m.format() == WeightFormat::Mxfp4 { (mx::MX_BLOCK / 2, 0x77) } else { (mx::MX_BLOCK, 0x7F) };
    r >= m.rows() || m.row_data(r)[g * bytes..(g + 1) * bytes].iter().all(|&b| b & magnitudes == 0)
}

/// 2^120: see the module docs.
pub const FP8_SCALE_FIX: f32 = f32::from_bits((127 + 120) << 23);

/// A matrix packed for the AVX-512 kernels.
pub struct Packed {
    /// The format packed.
    pub format: WeightFormat,
    /// Output rows.
    pub rows: usize,
    /// Input columns (K).
    pub cols: usize,
    /// Units of K per panel.
    pub units: usize,
    /// The panels (or KT's tiles).
    pub data: WeightBuf,
    /// Scales as the module docs lay them out (none for the MX kinds: `codes`; none for a
    /// K-group int4 matrix whose scales are all bf16: `scales16`).
    pub scales: Vec<f32>,
    /// K-group int4 scales as bf16 bits, `[panel][group][32]`, where every one is a bf16
    /// ([`int4::bf16_scales`]).
    pub scales16: Vec<u16>,
    /// The MX kinds' scales as their e8m0 codes `c`, `[panel][group][32]`, each standing for
    /// [`mx_scale`]`(c, code_bias)`: a quarter of f32 scales' bytes, which decode streams with
    /// the weights (mxfp4: 0.53 bytes a weight instead of 0.625).
    pub codes: Vec<u8>,
    /// `2^(c − code_bias)` is a code's packed scale: 127, less the fold of mxfp4's ½ (128) or of
    /// the fp8 decode's 2^120 (7).
    pub code_bias: i32,
    /// The MX codes are f32 exponent fields (`exponent_codes`): `code_bias` is 127 and a
    /// code's scale `f32::from_bits(c << 23)`.
    pub exponents: bool,
    /// An mxfp8 matrix whose every scale folds into its elements' bf16 exponents (`mx_folds`).
    pub folds: bool,
    /// Per-row int8 and int4: −128·Σw per row `[panel][32]` (module docs).
    pub bias: Vec<i32>,
    /// fp8 kinds in bf16-pair order (module docs), for the `vdpbf16ps` kernels.
    pub pairs: bool,
    /// In KT's order (module docs).
    pub kt: bool,
}

/// Whether a `rows × cols` matrix of `f` is packed in KT's order: per-row int8 and int4 in the
/// shapes KT's layout holds.
pub fn kt_order(f: WeightFormat, rows: usize, cols: usize) -> bool {
    matches!(f, WeightFormat::Int8Row | WeightFormat::Int4Row) && kt_packed::packed_bytes(f, rows, cols).is_ok()
}

/// Bytes of the units in one 64-byte-column tile of KT's order, and of one of its halves.
pub const KT_TILE: usize = 16 * UNIT;

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

    /// Panel `p`'s bytes (panel order only).
    pub fn panel(&self, p: usize) -> &[u8] {
        debug_assert!(!self.kt, "KT's order has no contiguous panels: see `run`");
        &self.data.as_slice()[p * self.panel_bytes()..(p + 1) * self.panel_bytes()]
    }

    /// Run `s` of panel `p`: (its first byte, its units), `None` past the last. A panel-order
    /// panel is one run of units at 128 bytes each; in KT's order each K block is one run of
    /// [`KT_TILE`]-byte tiles.
    #[inline]
    pub fn run(&self, p: usize, s: usize) -> Option<(*const u8, core::ops::Range<usize>)> {
        let data = self.data.as_slice();
        if self.kt {
            let (at, bytes) = kt_packed::row_tile_run(self.format, self.rows, self.cols, p * PANEL, s)?;
            Some((data[at..].as_ptr(), bytes.start / 4..bytes.end / 4))
        } else {
            (s == 0).then(|| (self.panel(p).as_ptr(), 0..self.units))
        }
    }

    /// Bytes held: weights, scales and biases.
    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * (self.scales.len() + self.bias.len()) + 2 * self.scales16.len() + self.codes.len()
    }

    /// The scales of a per-row-and-group kind (`[panel][group][32]`), in the encoding kept.
    pub fn group_scale_kind(&self) -> GroupScales<'_> {
        if self.exponents {
            GroupScales::Exponents(&self.codes)
        } else if !self.codes.is_empty() {
            GroupScales::Codes(&self.codes, self.code_bias)
        } else if !self.scales16.is_empty() {
            GroupScales::Bf16(&self.scales16)
        } else {
            GroupScales::F32(&self.scales)
        }
    }

    /// Where the scales at `at` (`[panel][group][32]` index) of a per-row-and-group kind lie or
    /// would lie: for a prefetch, which never faults (`kt_x86::prefetch::scales`).
    pub fn scales_at(&self, at: usize) -> *const u8 {
        match self.group_scale_kind() {
            GroupScales::Codes(c, _) | GroupScales::Exponents(c) => c.as_ptr().wrapping_add(at),
            GroupScales::Bf16(s) => s.as_ptr().wrapping_add(at).cast(),
            GroupScales::F32(s) => s.as_ptr().wrapping_add(at).cast(),
        }
    }

    /// The 32 rows' scales at `at` (`[panel][group][32]` index) of a per-row-and-group kind,
    /// as f32, one at a time (unpacking and tests; the kernels widen them in registers:
    /// `kernels::group_scales_f32`).
    pub fn group_scales(&self, at: usize) -> [f32; PANEL] {
        match self.group_scale_kind() {
            GroupScales::Codes(c, bias) => core::array::from_fn(|i| mx_scale(c[at + i], bias)),
            GroupScales::Exponents(c) => core::array::from_fn(|i| f32::from_bits(u32::from(c[at + i]) << 23)),
            GroupScales::Bf16(s) => core::array::from_fn(|i| f32::from_bits(u32::from(s[at + i]) << 16)),
            GroupScales::F32(s) => s[at..at + PANEL].try_into().expect("32 scales"),
        }
    }
}

/// A per-row-and-group kind's scales ([`Packed::group_scale_kind`]).
pub enum GroupScales<'a> {
    /// The MX kinds' e8m0 codes and their bias ([`mx_scale`]).
    Codes(&'a [u8], i32),
    /// The MX kinds' codes as f32 exponent fields ([`Packed::exponents`]).
    Exponents(&'a [u8]),
    /// K-group int4 scales that are all bf16, as their bits.
    Bf16(&'a [u16]),
    /// f32: per-row fp8 and the other K-group int4 matrices.
    F32(&'a [f32]),
}

/// Byte offset of (row `i` of a panel, column `c`) inside the panel, and for int4 whether it is
/// the high nibble (panel order).
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

/// The rows `src` of a panel (their stored bytes), their first `whole` units' columns, into the
/// panel's bytes `dst`: what [`place`] says column by column, 16 units at a time, each row's
/// bytes of them in turn, so that the units' 2 KB and a row's source line stay in L1 (column by
/// column, every store went to another unit: several times slower, docs/tuning.md, "Panels
/// packed").
fn place_units(f: WeightFormat, pairs: bool, src: &[&[u8]], whole: usize, dst: &mut [u8]) {
    const BLOCK: usize = 16;
    let is4 = int4::is_int4(f);
    for u0 in (0..whole).step_by(BLOCK) {
        for (i, s) in src.iter().enumerate() {
            let row = (i / HALF) * 64;
            for u in u0..(u0 + BLOCK).min(whole) {
                let d = &mut dst[u * UNIT..(u + 1) * UNIT];
                if is4 {
                    let (c, slot) = (u * 8, row + (i % HALF) * 4);
                    for (b, d) in d[slot..slot + 4].iter_mut().enumerate() {
                        *d = int4::nibble(f, s, c + b) | (int4::nibble(f, s, c + b + 4) << 4);
                    }
                } else if pairs {
                    // Byte kinds: a row's (k0, k1) beside three other rows', then its (k2, k3).
                    let (s, slot) = (&s[4 * u..4 * u + 4], row + (i % HALF / 4) * 16 + (i % 4) * 2);
                    d[slot..slot + 2].copy_from_slice(&s[..2]);
                    d[slot + 8..slot + 10].copy_from_slice(&s[2..]);
                } else {
                    // Four bytes of the row: four byte columns or two bf16 ones.
                    let slot = row + (i % HALF) * 4;
                    d[slot..slot + 4].copy_from_slice(&s[4 * u..4 * u + 4]);
                }
            }
        }
    }
}

/// Pack `m` (any format `supports` admits) for the kernels of `level`.
pub fn pack(m: &QuantMatrix, level: Level) -> Packed {
    let f = m.format();
    if kt_order(f, m.rows(), m.cols()) {
        let bytes = kt_packed::to_kt(m).expect("kt_order checked the shape");
        return from_kt(f, m.rows(), m.cols(), &bytes, m.scales()).expect("to_kt wrote this shape");
    }
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
    let whole = cols / unit_k(f);
    for (p, dst) in buf.chunks_exact_mut(units * UNIT).enumerate() {
        let panel_rows = p * PANEL..((p + 1) * PANEL).min(rows);
        let mut src: [&[u8]; PANEL] = [&[]; PANEL];
        src.iter_mut().zip(panel_rows.clone()).for_each(|(s, r)| *s = m.row_data(r));
        place_units(f, pairs, &src[..panel_rows.len()], whole, dst);
    }
    for r in 0..rows {
        let (p, i) = (r / PANEL, r % PANEL);
        let dst = &mut buf[p * units * UNIT..(p + 1) * units * UNIT];
        let src = m.row_data(r);
        for c in whole * unit_k(f)..cols {
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
    let fp8_fix = if pairs { 1.0 } else { FP8_SCALE_FIX };
    let (scales, codes, code_bias) = match f {
        WeightFormat::Mxfp4 => (Vec::new(), mx::panel_codes(m.scales(), m.rows(), m.cols(), PANEL), 128),
        WeightFormat::Mxfp8 => {
            (Vec::new(), mx::panel_codes(m.scales(), m.rows(), m.cols(), PANEL), if pairs { 127 } else { 7 })
        }
        _ => (pack_scales(m, panels, fp8_fix), Vec::new(), 0),
    };
    let (scales, scales16) = match f {
        WeightFormat::Int4Group { .. } => int4::bf16_scales(scales),
        _ => (scales, Vec::new()),
    };
    let bias = if f.int_activations() && f.k_group().is_none() { biases(m, panels) } else { Vec::new() };
    let folds = mx_folds(m, pairs, &codes, code_bias);
    let (codes, code_bias, exponents) = match exponent_codes(m, &codes, code_bias) {
        Some(exponents) if !codes.is_empty() => (exponents, 127, true),
        _ => (codes, code_bias, false),
    };
    Packed {
        format: f,
        rows,
        cols,
        units,
        data,
        scales,
        scales16,
        codes,
        code_bias,
        exponents,
        folds,
        bias,
        pairs,
        kt: false,
    }
}

/// A matrix from KT's packed bytes and per-row scales as they are (a converted file's
/// tensors): copied, with the row sums the kernels take off read from them.
pub fn from_kt(f: WeightFormat, rows: usize, cols: usize, bytes: &[u8], scales: &[f32]) -> Result<Packed, Error> {
    let len = kt_packed::checked_len(f, rows, cols, bytes)?;
    if scales.len() != rows {
        return Err(Error::ShapeMismatch { what: "KT per-row scales", expected: rows, found: scales.len() });
    }
    let mut data = kt_x86::memory::weight_buffer(len);
    data.as_mut_slice().copy_from_slice(bytes);
    let bias = kt_packed::row_sums(f, rows, cols, bytes).iter().map(|s| -128 * s).collect();
    let fix = int4::value_factor(f);
    let scales = scales.iter().map(|s| s * fix).collect();
    let units = cols / unit_k(f);
    let (codes, scales16) = (Vec::new(), Vec::new());
    Ok(Packed {
        format: f,
        rows,
        cols,
        units,
        data,
        scales,
        scales16,
        codes,
        code_bias: 0,
        exponents: false,
        folds: false,
        bias,
        pairs: false,
        kt: true,
    })
}

/// The signed integer weight of column c of an int8 or int4 row.
fn int_weight(f: WeightFormat, row: &[u8], c: usize) -> i32 {
    if f == WeightFormat::Int8Row {
        i32::from(row[c] as i8)
    } else {
        i32::from(int4::weight(f, row, c))
    }
}

/// −128·Σw per row, padded rows 0: `[panel][32]`.
fn biases(m: &QuantMatrix, panels: usize) -> Vec<i32> {
    let mut v = vec![0i32; panels * PANEL];
    for (r, b) in v.iter_mut().enumerate().take(m.rows()) {
        let row = m.row_data(r);
        *b = -128 * (0..m.cols()).map(|c| int_weight(m.format(), row, c)).sum::<i32>();
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
    let (d, (at, high)) = match p.kt {
        true => (p.data.as_slice(), kt_packed::position(p.format, p.rows, p.cols, r, c)),
        false => (p.panel(pi), place(p.format, p.pairs, i, c)),
    };
    let fix = if p.pairs { 1.0 } else { FP8_SCALE_FIX };
    let groups = p.format.k_group().map_or(1, |g| p.cols / g);
    let row_scale = || match p.format.k_group() {
        Some(g) => p.group_scales((pi * groups + c / g) * PANEL)[i],
        None => p.scales[pi * PANEL + i],
    };
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

#[cfg(test)]
mod tests {
    use kt_core::rng::SplitMix64;

    use super::*;

    #[test]
    fn packing_keeps_every_weight() {
        let mut r = SplitMix64::new(3);
        for f in WeightFormat::ALL {
            // (64, 3712) and (96, 7424): KT's order for int8 / int4, across a K block.
            for (rows, cols) in [(1, 128), (17, 256), (40, 384), (33, 160), (64, 3712), (96, 7424)] {
                if cols % f.col_multiple() != 0 {
                    continue;
                }
                let x: Vec<f32> = (0..rows * cols).map(|_| r.uniform(2.0)).collect();
                let q = QuantMatrix::quantize(f, rows, cols, &x).unwrap();
                let deq = q.dequantize();
                for level in [Level::Base, Level::Bf16] {
                    let p = pack(&q, level);
                    assert_eq!(p.kt, kt_order(f, rows, cols));
                    for row in 0..rows {
                        for c in 0..cols {
                            let got = unpack(&p, row, c);
                            assert_eq!(got, deq[row * cols + c], "{f} {level:?} {rows}x{cols} r{row} c{c}");
                        }
                    }
                }
            }
        }
    }
}
