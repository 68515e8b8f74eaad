//! [`Matrix`]: a matrix in its format's own bytes (compact), in panels of NR rows whose
//! elements are stored column by column (`[panel][unit][row in panel]`, a unit being one
//! element's bytes, or a byte of two 4-bit columns), so a KC-deep slice of a panel dequantizes
//! into BLIS's B micropanel (`[k][row in panel]` in f32) in one forward pass.
//!
//! ```text
//!  row-major   r0: e00 e01 e02 …      panel (NR rows)   e00 e10 … e(NR-1)0 | e01 e11 … | …
//!              r1: e10 e11 e12 …   →  units, column by column, each the rows' one after another
//! ```

use kt_core::dtype::F8E4M3;
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
}

/// (bytes per unit, columns per unit) of a format.
fn unit(format: WeightFormat) -> (usize, usize) {
    match format {
        WeightFormat::Bf16 => (2, 1),
        WeightFormat::Int4Row | WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 => (1, 2),
        _ => (1, 1),
    }
}

/// e4m3's 256 values.
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| core::array::from_fn(|b| F8E4M3(b as u8).to_f32()))
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
        Matrix { lib, format, rows, cols, nr, data, scales: m.scales().to_vec() }
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

    /// Columns `k0..k0 + kc` (`k0` and `kc` multiples of a unit's columns) of panel `p` as a
    /// B micropanel: `dst[(k − k0)·nr + j]` is row `p·nr + j`'s weight `k` (anything for rows
    /// past the matrix's, whose results are not kept).
    /// `NR`: the panels' rows where the caller knows them at compile time (its loops then
    /// have fixed counts), 0 where not.
    #[inline(always)]
    pub fn micropanel<const NR: usize>(&self, p: usize, (k0, kc): (usize, usize), dst: &mut [f32]) {
        let (rows, cols, nr) = (self.rows, self.cols, self.nr);
        let s = &self.scales;
        // Row r's scale index base, where its scales are per row or per (row, group).
        let row_of = |j: usize| (p * nr + j).min(rows - 1);
        match self.format {
            WeightFormat::Bf16 => self.fill::<2, 1, NR>(
                p,
                k0,
                kc,
                dst,
                |b, _| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
                (cols, |_, _| 1.0),
            ),
            WeightFormat::Int8Row => {
                self.fill::<1, 1, NR>(p, k0, kc, dst, |b, _| f32::from(b[0] as i8), (cols, |j, _| s[row_of(j)]))
            }
            WeightFormat::Fp8Channel => {
                let t = e4m3_table();
                self.fill::<1, 1, NR>(p, k0, kc, dst, |b, _| t[usize::from(b[0])], (cols, |j, _| s[row_of(j)]))
            }
            WeightFormat::Fp8Block => {
                let (t, per_row) = (e4m3_table(), cols.div_ceil(FP8_BLOCK));
                let scale = |j: usize, k: usize| s[(row_of(j) / FP8_BLOCK) * per_row + k / FP8_BLOCK];
                self.fill::<1, 1, NR>(p, k0, kc, dst, |b, _| t[usize::from(b[0])], (FP8_BLOCK, scale))
            }
            WeightFormat::Mxfp8 => {
                let (t, per_row) = (e4m3_table(), cols / mx::MX_BLOCK);
                let scale = |j: usize, k: usize| s[row_of(j) * per_row + k / mx::MX_BLOCK];
                self.fill::<1, 1, NR>(p, k0, kc, dst, |b, _| t[usize::from(b[0])], (mx::MX_BLOCK, scale))
            }
            WeightFormat::Int4Row => {
                let scale = (cols, |j: usize, _: usize| s[row_of(j)]);
                self.fill::<1, 2, NR>(p, k0, kc, dst, |b, e| f32::from(int4_row::weight_i8(b, e)), scale)
            }
            WeightFormat::Int4Group { group } => {
                let (g, per_row) = (usize::from(group), cols / usize::from(group));
                let scale = |j: usize, k: usize| s[row_of(j) * per_row + k / g];
                self.fill::<1, 2, NR>(p, k0, kc, dst, |b, e| f32::from(int4_group::weight_i8(b, e)), (g, scale))
            }
            WeightFormat::Mxfp4 => {
                let per_row = cols / mx::MX_BLOCK;
                let scale = |j: usize, k: usize| 0.5 * s[row_of(j) * per_row + k / mx::MX_BLOCK];
                self.fill::<1, 2, NR>(p, k0, kc, dst, |b, e| f32::from(mx::fp4_x2(b, e)), (mx::MX_BLOCK, scale))
            }
            _ => unreachable!("the blis backend serves none of GGML's types (serves)"),
        }
    }

    /// [`Matrix::micropanel`] for a format of `UB`-byte units of `PER` columns: element `e` of
    /// a unit is `decode(unit, e)`, times `scale(row in panel, column)`, the same for `group`
    /// columns at a time (read once a group into `sc`).
    #[inline(always)]
    fn fill<const UB: usize, const PER: usize, const NR: usize>(
        &self,
        p: usize,
        k0: usize,
        kc: usize,
        dst: &mut [f32],
        decode: impl Fn(&[u8], usize) -> f32,
        (group, scale): (usize, impl Fn(usize, usize) -> f32),
    ) {
        debug_assert!(NR == 0 || NR == self.nr);
        let (nr, units) = (if NR == 0 { self.nr } else { NR }, self.cols / PER);
        let mut sc = [0.0f32; MAX_NR];
        let sc = &mut sc[..nr];
        let panel = &self.data[p * units * nr * UB..(p + 1) * units * nr * UB];
        // The column whose scales come next (a division a group, not a column).
        let mut next = k0;
        for u in k0 / PER..(k0 + kc) / PER {
            let src = &panel[u * nr * UB..(u + 1) * nr * UB];
            for e in 0..PER {
                let k = u * PER + e;
                if k == next {
                    sc.iter_mut().enumerate().for_each(|(j, s)| *s = scale(j, k));
                    next = (k / group + 1) * group;
                }
                let out = &mut dst[(k - k0) * nr..(k - k0 + 1) * nr];
                if NR == 0 {
                    for ((o, b), s) in out.iter_mut().zip(src.chunks_exact(UB)).zip(sc.iter()) {
                        *o = decode(b, e) * s;
                    }
                } else {
                    // (A fixed count: unrolled, no bounds checks.)
                    for j in 0..NR {
                        out[j] = decode(&src[j * UB..(j + 1) * UB], e) * sc[j];
                    }
                }
            }
        }
    }
}

/// Brings the cache line of `byte` into L1 (a hint).
#[inline(always)]
fn prefetch_line(byte: &u8) {
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
