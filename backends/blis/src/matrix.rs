//! [`Matrix`]: a matrix in its format's own bytes (compact), in panels of NR rows whose
//! elements are stored column by column (`[panel][unit][row in panel]`, a unit being one
//! element's bytes, or a byte of two 4-bit columns), so a KC-deep slice of a panel dequantizes
//! into BLIS's B micropanel (`[k][row in panel]` in f32) in one forward pass.
//!
//! ```text
//!  row-major   r0: e00 e01 e02 …      panel (NR rows)   e00 e10 … e(NR-1)0 | e01 e11 … | …
//!              r1: e10 e11 e12 …   →  units, column by column, each the rows' one after another
//! ```

use kt_core::format::{int4_group, int4_row, mx, FP8_BLOCK};
use kt_core::{QuantMatrix, WeightFormat};

use crate::library::{Library, MAX_NR};

/// A packed matrix: its panels and its scales as quantized, and the library whose microkernel
/// runs it (found when it was packed).
pub struct Matrix {
    /// The library (its microkernel and block sizes).
    pub lib: &'static Library,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    /// Rows per panel (BLIS's NR).
    nr: usize,
    /// `[panel][unit][row in panel][unit bytes]`; a last panel's missing rows are zeros.
    data: Vec<u8>,
    /// The format's scales, as [`QuantMatrix::scales`] lays them out.
    scales: Vec<f32>,
    /// Whether an e4m3 matrix holds a NaN code (its reads then decode them: [`e4m3`]).
    nan: bool,
}

/// (bytes per unit, columns per unit) of a format.
fn unit(format: WeightFormat) -> (usize, usize) {
    match format {
        WeightFormat::Bf16 => (2, 1),
        WeightFormat::Int4Row | WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 => (1, 2),
        _ => (1, 1),
    }
}

/// An e4m3 byte's value, without a table or branches (so a loop over a panel's bytes runs in
/// vector registers): the same bits as [`kt_core::dtype::F8E4M3::to_f32`] for every byte, or,
/// without `NAN`, for every byte but the NaN codes 0x7F and 0xFF (±480 then: for matrices
/// found at pack time to hold none, which saves a compare and a select a weight). The
/// byte's exponent and mantissa bits placed where an f32 keeps them, its bias moved from 7 to
/// 127, give a normal value; a subnormal one (exponent 0), `m · 2^-9`, is made as
/// `2^-6 · (1 + m/8) − 2^-6`, exactly and without an f32 subnormal (which slows some CPUs).
#[inline(always)]
pub fn e4m3<const NAN: bool>(byte: u8) -> f32 {
    let sub = byte & 0x78 == 0;
    let bits = ((u32::from(byte) << 20) & 0x07F0_0000) + ((120 + u32::from(sub)) << 23);
    let mag = f32::from_bits(bits) - if sub { 1.0 / 64.0 } else { 0.0 };
    let value = f32::from_bits(mag.to_bits() | ((u32::from(byte) & 0x80) << 24));
    if NAN && byte & 0x7F == 0x7F {
        f32::NAN
    } else {
        value
    }
}

/// A format's elements and scales as [`Matrix::read`] hands them to a [`Reader`]: element `e`
/// of a unit's bytes is `decode(unit, e)` times `scale(row, column)`, a scale holding for
/// `group` columns at a time (from a multiple of `group`), or no scale: bf16, and the per-row
/// formats, whose scale multiplies the results instead ([`Matrix::out_scale`]: one multiply a
/// result, not a weight).
#[derive(Clone, Copy)]
pub struct Format<D, S> {
    pub decode: D,
    pub group: usize,
    pub scale: Option<S>,
}

impl<D, S: Fn(usize, usize) -> f32> Format<D, S> {
    /// Whether the elements are multiplied by a scale.
    #[inline(always)]
    pub fn scaled(&self) -> bool {
        self.scale.is_some()
    }

    /// Panel `p`'s scales for column `k` (for rows past the matrix's, its last row's), where
    /// the format has them.
    #[inline(always)]
    pub fn scales(&self, m: &Matrix, p: usize, k: usize, sc: &mut [f32]) {
        if let Some(scale) = &self.scale {
            for (j, s) in sc.iter_mut().enumerate() {
                *s = scale((p * m.nr + j).min(m.rows - 1), k);
            }
        }
    }
}

/// What reads a matrix's panels with its format's [`Format`] ([`Matrix::read`]): the B
/// micropanel's fill and the direct loop ([`crate::direct`]), so both give the same values.
pub trait Reader {
    type Out;
    /// Reads `m`, whose units are `UB` bytes of `PER` columns each.
    fn read<const UB: usize, const PER: usize>(
        self,
        m: &Matrix,
        f: Format<impl Fn(&[u8], usize) -> f32, impl Fn(usize, usize) -> f32>,
    ) -> Self::Out;
}

impl Matrix {
    /// `m` in panels of `lib`'s NR rows.
    pub fn pack(m: &QuantMatrix, lib: &'static Library) -> Matrix {
        let nr = lib.nr;
        let (rows, cols, format) = (m.rows(), m.cols(), m.format());
        let (ub, per) = unit(format);
        let units = cols / per;
        let panels = rows.div_ceil(nr);
        let mut data = vec![0u8; panels * units * nr * ub];
        for r in 0..rows {
            let (p, j, src) = (r / nr, r % nr, m.row_data(r));
            for u in 0..units {
                let at = ((p * units + u) * nr + j) * ub;
                data[at..at + ub].copy_from_slice(&src[u * ub..(u + 1) * ub]);
            }
        }
        let e4m3 = matches!(format, WeightFormat::Fp8Channel | WeightFormat::Fp8Block | WeightFormat::Mxfp8);
        let nan = e4m3 && data.iter().any(|b| b & 0x7F == 0x7F);
        Matrix { lib, format, rows, cols, nr, data, scales: m.scales().to_vec(), nan }
    }

    /// The weight format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The factor row `r`'s sums are multiplied by: its scale in the per-row formats (which
    /// [`Matrix::read`] leaves out of the elements), 1 in the others.
    #[inline(always)]
    pub fn out_scale(&self, r: usize) -> f32 {
        match self.format {
            WeightFormat::Int8Row | WeightFormat::Int4Row | WeightFormat::Fp8Channel => self.scales[r],
            _ => 1.0,
        }
    }

    /// Input columns (K).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }

    /// Asks for the bytes of columns `k0..k0 + kc` of panel `p` (past the panel's end: the
    /// next panel's first) to be brought into L1 ahead of their use: a hint, and none past the
    /// matrix's bytes or on CPUs without a prefetch instruction here.
    #[inline(always)]
    pub fn prefetch(&self, p: usize, (k0, kc): (usize, usize)) {
        let (ub, per) = unit(self.format);
        let start = (p * (self.cols / per) + k0 / per) * self.nr * ub;
        let end = (start + kc.div_ceil(per) * self.nr * ub).min(self.data.len());
        for at in (start..end).step_by(64) {
            prefetch_line(&self.data[at]);
        }
    }

    /// Panel `p`'s bytes (`UB`-byte units of `PER` columns, the matrix's own).
    #[inline(always)]
    pub fn panel<const UB: usize, const PER: usize>(&self, p: usize) -> &[u8] {
        let len = self.cols / PER * self.nr * UB;
        &self.data[p * len..(p + 1) * len]
    }

    /// `reader` run with this matrix's [`Format`].
    #[inline(always)]
    pub fn read<R: Reader>(&self, reader: R) -> R::Out {
        let (cols, s) = (self.cols, &self.scales[..]);
        let none = None::<fn(usize, usize) -> f32>;
        match self.format {
            WeightFormat::Bf16 => {
                let decode = |b: &[u8], _| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                reader.read::<2, 1>(self, Format { decode, group: cols, scale: none })
            }
            WeightFormat::Int8Row => {
                let decode = |b: &[u8], _| f32::from(b[0] as i8);
                reader.read::<1, 1>(self, Format { decode, group: cols, scale: none })
            }
            WeightFormat::Fp8Channel | WeightFormat::Fp8Block | WeightFormat::Mxfp8 if self.nan => {
                self.read_e4m3::<R, true>(reader)
            }
            WeightFormat::Fp8Channel | WeightFormat::Fp8Block | WeightFormat::Mxfp8 => {
                self.read_e4m3::<R, false>(reader)
            }
            WeightFormat::Int4Row => {
                let decode = |b: &[u8], e| f32::from(int4_row::weight_i8(b, e));
                reader.read::<1, 2>(self, Format { decode, group: cols, scale: none })
            }
            WeightFormat::Int4Group { group } => {
                let (decode, g) = (|b: &[u8], e| f32::from(int4_group::weight_i8(b, e)), usize::from(group));
                let scale = |r: usize, k: usize| s[r * (cols / g) + k / g];
                reader.read::<1, 2>(self, Format { decode, group: g, scale: Some(scale) })
            }
            WeightFormat::Mxfp4 => {
                let (decode, blocks) = (|b: &[u8], e| f32::from(mx::fp4_x2(b, e)), cols / mx::MX_BLOCK);
                let scale = |r: usize, k: usize| 0.5 * s[r * blocks + k / mx::MX_BLOCK];
                reader.read::<1, 2>(self, Format { decode, group: mx::MX_BLOCK, scale: Some(scale) })
            }
            _ => unreachable!("the blis backend serves none of GGML's types (serves)"),
        }
    }

    /// [`Matrix::read`] of an e4m3 format, its bytes decoded by [`e4m3`]`::<NAN>`.
    #[inline(always)]
    fn read_e4m3<R: Reader, const NAN: bool>(&self, reader: R) -> R::Out {
        let (cols, s, decode) = (self.cols, &self.scales[..], |b: &[u8], _| e4m3::<NAN>(b[0]));
        match self.format {
            WeightFormat::Fp8Channel => {
                reader.read::<1, 1>(self, Format { decode, group: cols, scale: None::<fn(usize, usize) -> f32> })
            }
            WeightFormat::Fp8Block => {
                let blocks = cols.div_ceil(FP8_BLOCK);
                let scale = |r: usize, k: usize| s[(r / FP8_BLOCK) * blocks + k / FP8_BLOCK];
                reader.read::<1, 1>(self, Format { decode, group: FP8_BLOCK, scale: Some(scale) })
            }
            _ => {
                let blocks = cols / mx::MX_BLOCK;
                let scale = |r: usize, k: usize| s[r * blocks + k / mx::MX_BLOCK];
                reader.read::<1, 1>(self, Format { decode, group: mx::MX_BLOCK, scale: Some(scale) })
            }
        }
    }

    /// Columns `k0..k0 + kc` (`k0` and `kc` multiples of a unit's columns) of panel `p` as a
    /// B micropanel: `dst[(k − k0)·nr + j]` is row `p·nr + j`'s weight `k` (anything for rows
    /// past the matrix's, whose results are not kept).
    /// `NR`: the panels' rows where the caller knows them at compile time (its loops then
    /// have fixed counts), 0 where not.
    #[inline(always)]
    pub fn micropanel<const NR: usize>(&self, p: usize, (k0, kc): (usize, usize), dst: &mut [f32]) {
        self.read(Fill::<NR> { p, k0, kc, dst })
    }
}

/// Bytes of a panel the fill asks for ahead of the unit it decodes: the weights stream in
/// from DRAM while the fill and the microkernel work.
const FILL_AHEAD: usize = 2048;

/// [`Matrix::micropanel`]'s reader.
struct Fill<'d, const NR: usize> {
    p: usize,
    k0: usize,
    kc: usize,
    dst: &'d mut [f32],
}

impl<const NR: usize> Reader for Fill<'_, NR> {
    type Out = ();

    #[inline(always)]
    fn read<const UB: usize, const PER: usize>(
        self,
        m: &Matrix,
        f: Format<impl Fn(&[u8], usize) -> f32, impl Fn(usize, usize) -> f32>,
    ) {
        let Fill { p, k0, kc, dst } = self;
        debug_assert!(NR == 0 || NR == m.nr);
        let nr = if NR == 0 { m.nr } else { NR };
        let mut sc = [0.0f32; MAX_NR];
        let sc = &mut sc[..nr];
        let panel = m.panel::<UB, PER>(p);
        let (step, at0) = (nr * UB, p * panel.len());
        // A group's columns at a time, its scales read once (a group is whole units).
        let mut k = k0;
        while k < k0 + kc {
            f.scales(m, p, k, sc);
            let end = ((k / f.group + 1) * f.group).min(k0 + kc);
            for u in k / PER..end / PER {
                // The first unit to start in a cache line asks for the line FILL_AHEAD bytes
                // on (past the panel's end: the next panel's, the task's next).
                if u * step % 64 < step {
                    if let Some(b) = m.data.get(at0 + u * step + FILL_AHEAD) {
                        prefetch_line(b);
                    }
                }
                let src = &panel[u * step..(u + 1) * step];
                for e in 0..PER {
                    let out = &mut dst[(u * PER + e - k0) * nr..(u * PER + e - k0 + 1) * nr];
                    if NR == 0 {
                        for ((o, b), s) in out.iter_mut().zip(src.chunks_exact(UB)).zip(sc.iter()) {
                            *o = (f.decode)(b, e);
                            if f.scaled() {
                                *o *= s;
                            }
                        }
                    } else {
                        // (A fixed count: unrolled, no bounds checks; decoded, then scaled, so
                        // the compiler keeps both in vector registers.)
                        let mut w = [0.0f32; NR];
                        for j in 0..NR {
                            w[j] = (f.decode)(&src[j * UB..(j + 1) * UB], e);
                        }
                        for j in 0..NR {
                            out[j] = if f.scaled() { w[j] * sc[j] } else { w[j] };
                        }
                    }
                }
            }
            k = end;
        }
    }
}

/// Brings the cache line of `byte` into L1 (a hint).
#[inline(always)]
pub fn prefetch_line(byte: &u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally; SSE is in x86-64's baseline.
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((byte as *const u8).cast())
    };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: `prfm` is a hint that reads nothing architecturally and touches no register.
    unsafe {
        core::arch::asm!("prfm pldl1keep, [{0}]", in(reg) byte as *const u8, options(nostack, preserves_flags, readonly))
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = byte;
}

#[cfg(test)]
mod tests {
    use kt_core::dtype::F8E4M3;

    #[test]
    fn e4m3_gives_the_bits_of_every_byte() {
        for b in 0..=255u8 {
            let (ours, theirs) = (super::e4m3::<true>(b), F8E4M3(b).to_f32());
            assert_eq!(ours.to_bits(), theirs.to_bits(), "byte {b:#04x}: {ours} against {theirs}");
            if b & 0x7F != 0x7F {
                assert_eq!(super::e4m3::<false>(b).to_bits(), theirs.to_bits(), "byte {b:#04x} without NaN codes");
            }
        }
    }
}
