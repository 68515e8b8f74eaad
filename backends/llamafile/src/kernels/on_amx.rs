//! The 32-column types (q4_0, q4_1, q5_0, q5_1, iq4_nl, q8_0 packed for VNNI) on AMX int8 tiles,
//! for an expert with many tokens: a block of up to [`MAX_TOKENS`] tokens × a [`PANEL`] of 32
//! rows, on the same packed bytes as the vector kernels, generic over the tile seam
//! ([`TileOps`]: the hardware or its emulator).
//!
//! ```text
//!  a panel's rows, once per task: every block's levels unpacked to two int8 B tiles (B6: rows
//!    0-15, B7: 16-31; 8 rows of 4 columns × 16 weight rows), its scales (and offsets) to f32
//!    vectors over the rows                                             (unpack, in scratch)
//!  per block of 32 columns and token block:
//!    C0..C3 = 0;  A4, A5 = the two token halves' 32 values (ActT8 rows)
//!    C0 += A4·B6, C1 += A4·B7, C2 += A5·B6, C3 += A5·B7    (tdpbssd: exact block sums)
//!    C stored; per token, 16 rows a vector: acc[slot] = fma(Σ, d_w·d_a, acc[slot])
//! ```
//!
//! The sums are the integers the vector kernels find (unsigned levels for the types with an
//! offset, signed for iq4_nl and q8_0), and the scaling repeats theirs operation for operation:
//! per block slot ([`legacy::slot`]) an accumulator that the first group sets (`m·s` first where
//! the type has an offset), then `((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7))`, the order of their
//! lane sum. So the results are theirs bit for bit, and whether an expert ran on tiles does
//! not change its output.

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;

use kt_core::ggml::{GgmlType, KVALUES_IQ4NL, QK};
use kt_x86::amx::{TileConfig, TileOps, COLSB, ROWS};

use super::Packed;
use crate::act::{transpose8, ActT8};
use crate::legacy::{self, slot, Offset, G, ORDER};

/// Rows of a panel: the 16 columns of each of two B tiles.
pub const PANEL: usize = 2 * ROWS;
/// Most tokens of a block: the 16 rows of each of two A tiles.
pub const MAX_TOKENS: usize = 2 * ROWS;
/// B tile rows per block: 32 columns, 4 to a row.
const B_ROWS: usize = QK / 4;
/// Bytes of one block's two B tiles.
const B_BLOCK: usize = 2 * B_ROWS * COLSB;

/// Results of a block: `[token][row in panel]`.
pub type Block = [[f32; PANEL]; MAX_TOKENS];

/// Whether type `t` runs on tiles; `quads`: it was packed for VNNI (q8_0's levels in 4-column
/// lanes, the layout [`unpack`] reads).
pub fn runs(t: GgmlType, quads: bool) -> bool {
    use GgmlType::*;
    matches!(t, Q4_0 | Q4_1 | Q5_0 | Q5_1 | IQ4_NL) || (t == Q8_0 && quads)
}

/// Bytes of one [`Panel`] for `cols` columns.
pub fn panel_bytes(cols: usize) -> usize {
    let blocks = (cols / QK).div_ceil(G) * G;
    blocks * (B_BLOCK + 2 * 4 * PANEL)
}

/// A panel's rows unpacked for the tiles: per block (the last group's padding included), its
/// two B tiles, and its scales and offsets (`m`; unused for types without) over the rows.
pub struct Panel<'a> {
    b: &'a mut [u8],
    d: &'a mut [[f32; PANEL]],
    m: &'a mut [[f32; PANEL]],
}

impl<'a> Panel<'a> {
    /// A panel for `cols` columns at the start of `bytes` (64-byte aligned, [`panel_bytes`]
    /// long at least), and the bytes after it.
    pub fn from_bytes(bytes: &'a mut [u8], cols: usize) -> (Self, &'a mut [u8]) {
        let blocks = (cols / QK).div_ceil(G) * G;
        let (b, rest) = bytes.split_at_mut(blocks * B_BLOCK);
        let (d, rest) = rest.split_at_mut(blocks * 4 * PANEL);
        let (m, rest) = rest.split_at_mut(blocks * 4 * PANEL);
        (Panel { b, d: bytemuck::cast_slice_mut(d), m: bytemuck::cast_slice_mut(m) }, rest)
    }
}

/// Accumulators of a block, per slot: `[token][slot][row]`.
pub type Acc = [[[f32; PANEL]; G]; MAX_TOKENS];

/// Room for a block's C tiles, `[token][row]` i32.
pub type Sums = [[i32; PANEL]; MAX_TOKENS];

/// One row's group of 8 blocks as their levels in column order, one register per block (block
/// `k` in register `k`): what each block contributes to the integer sums, as the vector
/// kernels read it (unsigned with the types' offsets left to `m·s`; iq4_nl's table values;
/// q8_0's signed values).
///
/// # Safety
/// AVX2 is present; `g` is one whole group of `t`, packed as [`runs`] requires.
#[inline(always)]
unsafe fn levels(t: GgmlType, g: &[u8]) -> [__m256i; G] {
    // SAFETY (whole body): AVX2 by contract; loads stay inside the group (levels after the
    // scales, q5's plane after the nibbles).
    unsafe {
        let mut out = [_mm256_setzero_si256(); G];
        if t == GgmlType::Q8_0 {
            // Register j holds, in lane slot(k), columns 8m + 2h + {0, 1, 4, 5} (j = 2m + h) of
            // block k, + 128 (`legacy::quad_at`): a transpose gathers each block's 8 words, a
            // shuffle puts each 8 columns back in order.
            let regs = array!(_mm256_setzero_si256(); G, |j| super::ld(&g[2 * G + 32 * j..]));
            let order = _mm256_setr_epi8(
                0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14,
                15,
            );
            for (s, r) in transpose8(regs).into_iter().enumerate() {
                out[ORDER[s]] = _mm256_shuffle_epi8(_mm256_xor_si256(r, _mm256_set1_epi8(-128)), order);
            }
            return out;
        }
        let at = legacy::levels_at(t);
        let low = _mm_set1_epi8(0x0F);
        let lut = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
        for k in 0..G {
            // Byte j: column j in its low nibble, column j + 16 in its high one.
            let b = _mm_loadu_si128(g.as_ptr().add(at + 16 * k).cast());
            let (mut lo, mut hi) = (_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16::<4>(b), low));
            match t {
                GgmlType::IQ4_NL => (lo, hi) = (_mm_shuffle_epi8(lut, lo), _mm_shuffle_epi8(lut, hi)),
                GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    // The fifth bits: plane byte 16·(k % 2) + j, bit 2·(k / 2) for column j, the
                    // next bit for column j + 16 (`legacy::plane`).
                    let plane = _mm_loadu_si128(g.as_ptr().add(at + 16 * G + 16 * (k % 2)).cast());
                    (lo, hi) =
                        (_mm_or_si128(lo, bit4(plane, 2 * (k / 2))), _mm_or_si128(hi, bit4(plane, 2 * (k / 2) + 1)));
                }
                _ => {}
            }
            out[k] = _mm256_set_m128i(hi, lo);
        }
        out
    }
}

/// Bit `i` of each byte of `plane` as 0x10.
///
/// # Safety
/// SSE2 is present (inlined into functions with AVX2).
#[inline(always)]
unsafe fn bit4(plane: __m128i, i: usize) -> __m128i {
    // SAFETY: SSE2 by contract. A 16-bit shift moves the bit down; the mask keeps one bit per byte.
    unsafe {
        let v = _mm_srl_epi16(plane, _mm_cvtsi32_si128(i as i32));
        _mm_slli_epi16::<4>(_mm_and_si128(v, _mm_set1_epi8(1)))
    }
}

/// Unpack rows `r0..r0 + nr` (`nr ≤ PANEL`) of `w` into `p`: row `i`'s 4-column words of block
/// `b` to row `4i..` of B tile `i / 16` (a transpose of words, 8 rows at a time), its scales
/// and offsets to `p.d[b][i]`, `p.m[b][i]`. Rows past `nr` repeat the last.
///
/// # Safety
/// AVX2, FMA and F16C are present; [`runs`]`(w)`; `p` was made for `w.cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn unpack(w: &Packed, r0: usize, nr: usize, p: &mut Panel<'_>) {
    debug_assert!((1..=PANEL).contains(&nr) && r0 + nr <= w.rows);
    let (gb, t) = (w.slice_bytes, w.t);
    let offset = legacy::offset(t);
    for q in 0..PANEL / 8 {
        // The 8 rows' starts (past `nr`, the last row's).
        let rows = array!(0usize; 8, |i| (r0 + (8 * q + i).min(nr - 1)) * w.row_bytes);
        for g in 0..w.slices {
            let grp = array!(&[][..]; 8, |i| &w.data[rows[i] + g * gb..rows[i] + (g + 1) * gb]);
            // SAFETY (whole loop): AVX2/F16C by this function's features; each group is `gb`
            // bytes inside its row; the stores stay inside the panel's block `8g + k`.
            unsafe {
                let lv = array!([_mm256_setzero_si256(); G]; 8, |i| levels(t, grp[i]));
                for k in 0..G {
                    let words = transpose8(array!(_mm256_setzero_si256(); 8, |i| lv[i][k]));
                    let at = (G * g + k) * B_BLOCK + (q / 2) * B_ROWS * COLSB + 32 * (q % 2);
                    for (j, v) in words.iter().enumerate() {
                        _mm256_storeu_si256(p.b.as_mut_ptr().add(at + j * COLSB).cast(), *v);
                    }
                }
                // Scales (and offsets) of the 8 rows, slot order, transposed to one vector per
                // slot: as the vector kernels form them (`m = k·d` by the same multiply).
                let dw = array!(_mm256_setzero_si256(); 8, |i| _mm256_castps_si256(legacy::scales(grp[i], 0)));
                let mw = array!(_mm256_setzero_si256(); 8, |i| _mm256_castps_si256(match offset {
                    Offset::Zero => _mm256_setzero_ps(),
                    Offset::OfD(k) => _mm256_mul_ps(_mm256_castsi256_ps(dw[i]), _mm256_set1_ps(k)),
                    Offset::Stored => legacy::scales(grp[i], 2 * G),
                }));
                for (dst, src) in [(&mut *p.d, dw), (&mut *p.m, mw)] {
                    for (s, v) in transpose8(src).iter().enumerate() {
                        let row = &mut dst[G * g + ORDER[s]][8 * q..8 * q + 8];
                        _mm256_storeu_si256(row.as_mut_ptr().cast(), *v);
                    }
                }
            }
        }
    }
}

/// The tiles' shapes for `nt` tokens: C and A rows are the tokens of each half, A rows one
/// block (32 bytes), B 8 rows.
fn config(nt: usize) -> TileConfig {
    let (h0, h1) = (nt.min(ROWS), nt.saturating_sub(ROWS));
    let c = TileConfig::new().with(0, h0, COLSB).with(1, h0, COLSB).with(4, h0, QK);
    let c = c.with(6, B_ROWS, COLSB).with(7, B_ROWS, COLSB);
    match h1 {
        0 => c,
        _ => c.with(2, h1, COLSB).with(3, h1, COLSB).with(5, h1, QK),
    }
}

/// `out[t][i]` = row `i` of panel `p` (its type `t`, its first `nr` rows meaningful) · token
/// `t0 + t`, for `t < nt ≤ MAX_TOKENS`; `act` holds `n` tokens' [`ActT8`] groups
/// (`[groups][n]`), `groups` per token.
///
/// # Safety
/// `T`'s contract (for the hardware: AMX present and permitted), AVX-512F, AVX2, FMA and F16C
/// present; `p` unpacked from a matrix of `t` with `groups` groups a row.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn block<T: TileOps>(
    tiles: &mut T,
    t: GgmlType,
    p: &Panel<'_>,
    groups: usize,
    act: &[ActT8],
    (n, t0, nt): (usize, usize, usize),
    (acc, sums): (&mut Acc, &mut Sums),
    out: &mut Block,
) {
    debug_assert!((1..=MAX_TOKENS).contains(&nt) && t0 + nt <= n && act.len() >= groups * n);
    let two = nt > ROWS;
    let offset = legacy::offset(t) != Offset::Zero;
    let a_stride = size_of::<ActT8>();
    // SAFETY (whole body): the caller's contract; the tile loads read `nt` ActT8 rows of 32
    // bytes and 8 rows of 64 bytes inside the panel's block; the stores write `sums`.
    unsafe {
        tiles.config(&config(nt));
        for g in 0..groups {
            let first = g == 0;
            let acts = &act[g * n + t0..g * n + t0 + nt];
            for k in 0..G {
                let b = G * g + k;
                tiles.zero::<0>();
                tiles.zero::<1>();
                // Token i's block k at `a + i·a_stride`, a pointer into the whole of `acts`.
                let a = acts.as_ptr().cast::<u8>().add(core::mem::offset_of!(ActT8, qs) + QK * k);
                let bt = p.b.as_ptr().add(b * B_BLOCK);
                tiles.load::<4>(a, a_stride);
                tiles.load::<6>(bt, COLSB);
                tiles.load::<7>(bt.add(B_ROWS * COLSB), COLSB);
                tiles.dpbssd::<0, 4, 6>();
                tiles.dpbssd::<1, 4, 7>();
                let c = sums.as_mut_ptr().cast::<u8>();
                let stride = 4 * PANEL;
                tiles.store::<0>(c, stride);
                tiles.store::<1>(c.add(4 * ROWS), stride);
                if two {
                    tiles.zero::<2>();
                    tiles.zero::<3>();
                    tiles.load::<5>(a.add(ROWS * a_stride), a_stride);
                    tiles.dpbssd::<2, 5, 6>();
                    tiles.dpbssd::<3, 5, 7>();
                    tiles.store::<2>(c.add(ROWS * stride), stride);
                    tiles.store::<3>(c.add(ROWS * stride + 4 * ROWS), stride);
                }
                let s = slot(k);
                for h in 0..2 {
                    let dw = _mm512_loadu_ps(p.d[b][16 * h..].as_ptr());
                    let mw = _mm512_loadu_ps(p.m[b][16 * h..].as_ptr());
                    for (i, a) in acts.iter().enumerate() {
                        let x = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[i][16 * h..].as_ptr().cast()));
                        let sc = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[k]));
                        let at = acc[i][s][16 * h..].as_mut_ptr();
                        let v = match (first, offset) {
                            (true, false) => _mm512_mul_ps(x, sc),
                            (false, false) => _mm512_fmadd_ps(x, sc, _mm512_loadu_ps(at)),
                            (_, true) => {
                                let sa = _mm512_set1_ps(a.s[k]);
                                let m = match first {
                                    true => _mm512_mul_ps(mw, sa),
                                    false => _mm512_fmadd_ps(mw, sa, _mm512_loadu_ps(at)),
                                };
                                _mm512_fmadd_ps(x, sc, m)
                            }
                        };
                        _mm512_storeu_ps(at, v);
                    }
                }
            }
        }
        // The slots' sums in the vector kernels' order (`kernels::hsum4`).
        for i in 0..nt {
            for h in 0..2 {
                let v = |s: usize| _mm512_loadu_ps(acc[i][s][16 * h..].as_ptr());
                let lo = _mm512_add_ps(_mm512_add_ps(v(0), v(1)), _mm512_add_ps(v(2), v(3)));
                let hi = _mm512_add_ps(_mm512_add_ps(v(4), v(5)), _mm512_add_ps(v(6), v(7)));
                _mm512_storeu_ps(out[i][16 * h..].as_mut_ptr(), _mm512_add_ps(lo, hi));
            }
        }
    }
}
