//! The quantized GGML types on AMX int8 tiles, for an expert with many tokens: a block of up to
//! [`MAX_TOKENS`] tokens × a [`PANEL`] of 32 rows, on the same packed bytes as the vector
//! kernels, generic over the tile seam ([`TileOps`]: the hardware or its emulator). Every
//! type is cut into parts of 32 columns: a block of the 32-column types (q4_0, q4_1, q5_0,
//! q5_1, iq4_nl, q8_0 packed for VNNI), an eighth of a block of the 256-column ones (the
//! K-quants, iq4_xs, the lattice types).
//!
//! ```text
//!  a panel's rows, once per task ([`unpack`]): every part's levels to two int8 B tiles
//!    (B6: rows 0-15, B7: 16-31; 8 rows of 4 columns × 16 weight rows), its factors to f32
//!    (and i32) vectors over the rows
//!  per part and token block:
//!    C0..C3 = 0;  A4, A5 = the two token halves' 32 values (a row each: ActT8, or ActK in
//!    column order)
//!    C0 += A4·B6, C1 += A4·B7, C2 += A5·B6, C3 += A5·B7    (tdpbssd: exact part sums)
//!    (scales of 16 columns: the same twice, K = 16 bytes, for the part's two halves)
//!    C stored; per token, 16 rows a vector: acc[slot] scaled and added as the vector kernels do
//! ```
//!
//! The sums are the integers the vector kernels find, and the scaling repeats theirs operation
//! for operation, per accumulator lane ("slot"): the 32-column types' ([`legacy::slot`]; the
//! first group sets it, `m·s` first where the type has an offset), `per32` for the K-quants
//! whose scales cover 32 columns, the `madd`-scaled sums and mins of `kquant` for those of 16;
//! then the lanes' sum `((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7))`. So the results are theirs bit
//! for bit, and whether an expert ran on tiles does not change its output.

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;
use core::mem::offset_of;

use kt_core::ggml::{ActKind, GgmlType, QK};
use kt_x86::amx::{TileConfig, TileOps, COLSB, ROWS};

use super::Packed;
use crate::act::{ActK, ActT8};
use crate::legacy::{self, slot, Offset, G};

mod unpack;

pub use unpack::unpack;

/// Rows of a panel: the 16 columns of each of two B tiles.
pub const PANEL: usize = 2 * ROWS;
/// Most tokens of a block: the 16 rows of each of two A tiles.
pub const MAX_TOKENS: usize = 2 * ROWS;
/// B tile rows per part: 32 columns, 4 to a row.
const B_ROWS: usize = QK / 4;
/// Bytes of one part's two B tiles.
const B_BLOCK: usize = 2 * B_ROWS * COLSB;
/// Bytes of one token's activations for a slice (a group of 8 blocks, or a 256-column block):
/// the same for both layouts the tiles read, so a token block's A rows are this far apart.
pub const ACT_BYTES: usize = size_of::<ActT8>();
const _: () = assert!(size_of::<ActK>() == ACT_BYTES);

/// Results of a block: `[token][row in panel]`.
pub type Block = [[f32; PANEL]; MAX_TOKENS];

/// How a type's part sums are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// The 32-column types: a scale per block, and an offset ([`legacy::offset`]).
    Legacy,
    /// 256-column types whose scales (and mins) cover 32 columns ([`crate::decode::KBlock::PER32`]).
    Per32,
    /// 256-column types whose scales cover 16 columns: each part's two halves summed apart.
    Sixteen,
}

/// The family of quantized type `t`.
pub fn family(t: GgmlType) -> Family {
    match t {
        _ if t.act() == ActKind::Q8_0 => Family::Legacy,
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::IQ4_XS => Family::Per32,
        _ => Family::Sixteen,
    }
}

/// Whether type `t` runs on tiles; `quads`: it was packed for VNNI (q8_0's levels in 4-column
/// lanes, the layout [`unpack()`] reads). Every 256-column type does, so all the types that
/// share [`ActK`] activations (gate's, read by up) agree on their layout.
pub fn runs(t: GgmlType, quads: bool) -> bool {
    use GgmlType::*;
    matches!(t, Q4_0 | Q4_1 | Q5_0 | Q5_1 | IQ4_NL | MXFP4) || (t == Q8_0 && quads) || t.act() == ActKind::Q8K
}

/// Parts of 32 columns in a row of `cols` columns of `t` (a 32-column type's last group
/// padded to 8 blocks).
fn parts(t: GgmlType, cols: usize) -> usize {
    match family(t) {
        Family::Legacy => (cols / QK).div_ceil(G) * G,
        _ => cols / QK,
    }
}

/// Bytes of one [`Panel`] for `cols` columns of type `t` (none for a type without tiles).
pub fn panel_bytes(t: GgmlType, cols: usize) -> usize {
    if t.act() == ActKind::F32 {
        return 0;
    }
    // Sixteen: two i32 scales and one word of two i16 mins per part.
    let ints = if family(t) == Family::Sixteen { 3 * 4 * PANEL } else { 0 };
    parts(t, cols) * (B_BLOCK + 2 * 4 * PANEL + ints)
}

/// A panel's rows unpacked for the tiles ([`unpack()`]): per part, its two B tiles and its f32
/// factors over the rows (`d`, `m`: a block's scale and offset; `d·scale` and `dmin·min` for
/// [`Family::Per32`]; `d` and `dmin` for [`Family::Sixteen`], whose i32 scales of each 16
/// columns are `sc`, two per part, and its i16 mins `mn`, the part's two in one word).
pub struct Panel<'a> {
    b: &'a mut [u8],
    d: &'a mut [[f32; PANEL]],
    m: &'a mut [[f32; PANEL]],
    sc: &'a mut [[i32; PANEL]],
    mn: &'a mut [[i32; PANEL]],
}

impl<'a> Panel<'a> {
    /// A panel for `cols` columns of `t` at the start of `bytes` (64-byte aligned,
    /// [`panel_bytes`] long at least), and the bytes after it.
    pub fn from_bytes(bytes: &'a mut [u8], t: GgmlType, cols: usize) -> (Self, &'a mut [u8]) {
        let (parts, ints) = match panel_bytes(t, cols) {
            0 => (0, 0),
            _ => (parts(t, cols), if family(t) == Family::Sixteen { parts(t, cols) } else { 0 }),
        };
        let (b, rest) = bytes.split_at_mut(parts * B_BLOCK);
        let (d, rest) = rest.split_at_mut(parts * 4 * PANEL);
        let (m, rest) = rest.split_at_mut(parts * 4 * PANEL);
        let (sc, rest) = rest.split_at_mut(2 * ints * 4 * PANEL);
        let (mn, rest) = rest.split_at_mut(ints * 4 * PANEL);
        let (d, m) = (bytemuck::cast_slice_mut(d), bytemuck::cast_slice_mut(m));
        (Panel { b, d, m, sc: bytemuck::cast_slice_mut(sc), mn: bytemuck::cast_slice_mut(mn) }, rest)
    }
}

/// Accumulators of a block, per slot: `[token][slot][row]`.
pub type Acc = [[[f32; PANEL]; G]; MAX_TOKENS];

/// Room for a part's C tiles, `[half][token][row]` i32 (the second half for
/// [`Family::Sixteen`]).
pub type Sums = [[[i32; PANEL]; MAX_TOKENS]; 2];

/// One part's sums for a token block (`two`: of more than [`ROWS`] tokens) into `c`
/// (`[token][row]`): token `i`'s A row at `a + i·ACT_BYTES`, the part's B tiles at `bt` and
/// `bt + B_ROWS·COLSB`, as configured.
///
/// # Safety
/// As [`block`]'s; the configured shapes read inside the activations and the panel.
#[inline(always)]
unsafe fn tile_sums<T: TileOps>(
    tiles: &mut T,
    a: *const u8,
    bt: *const u8,
    two: bool,
    c: &mut [[i32; PANEL]; MAX_TOKENS],
) {
    let (c, stride) = (c.as_mut_ptr().cast::<u8>(), 4 * PANEL);
    // SAFETY: the caller's contract; the stores write `c`.
    unsafe {
        tiles.zero::<0>();
        tiles.zero::<1>();
        tiles.load::<4>(a, ACT_BYTES);
        tiles.load::<6>(bt, COLSB);
        tiles.load::<7>(bt.add(B_ROWS * COLSB), COLSB);
        tiles.dpbssd::<0, 4, 6>();
        tiles.dpbssd::<1, 4, 7>();
        tiles.store::<0>(c, stride);
        tiles.store::<1>(c.add(4 * ROWS), stride);
        if two {
            tiles.zero::<2>();
            tiles.zero::<3>();
            tiles.load::<5>(a.add(ROWS * ACT_BYTES), ACT_BYTES);
            tiles.dpbssd::<2, 5, 6>();
            tiles.dpbssd::<3, 5, 7>();
            tiles.store::<2>(c.add(ROWS * stride), stride);
            tiles.store::<3>(c.add(ROWS * stride + 4 * ROWS), stride);
        }
    }
}

/// `out[t][i]` = row `i` of panel `p` (its type `t`, its first `nr` rows meaningful) · token
/// `t0 + t`, for `t < nt ≤ MAX_TOKENS`; `act` holds `n` tokens' activations prepared for the
/// tiles (`[slices][n]`, `ACT_BYTES` each: [`ActT8`] groups, or [`ActK`] blocks in column
/// order), `slices` per token. `next`: bytes to bring into L2 meanwhile, a share per slice
/// (the matrix's next panel of rows, which [`unpack()`] then reads from L2: from DRAM, its
/// strided rows were a latency-bound half of the tile path's time).
///
/// # Safety
/// `T`'s contract (for the hardware: AMX present and permitted), AVX-512F, AVX2, FMA and F16C
/// present; `p` unpacked from a matrix of `t` with `slices` slices a row.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn block<T: TileOps>(
    tiles: &mut T,
    t: GgmlType,
    p: &Panel<'_>,
    slices: usize,
    act: &[u8],
    (n, t0, nt): (usize, usize, usize),
    (acc, sums): (&mut Acc, &mut Sums),
    out: &mut Block,
    next: &[u8],
) {
    debug_assert!((1..=MAX_TOKENS).contains(&nt) && t0 + nt <= n && act.len() >= slices * n * ACT_BYTES);
    let (two, family) = (nt > ROWS, family(t));
    let qs = if family == Family::Legacy { offset_of!(ActT8, qs) } else { offset_of!(ActK, qs) };
    // SAFETY (whole body): the caller's contract; the tile loads read `nt` rows of 32 (or 16)
    // bytes inside the activations and 8 (or 4) rows of 64 bytes inside the panel's part; the
    // stores write `sums`.
    unsafe {
        tiles.config(&TileConfig::block(nt, if family == Family::Sixteen { QK / 2 } else { QK }));
        let mut ms = [[0.0f32; G]; MAX_TOKENS];
        for g in 0..slices {
            kt_x86::prefetch::share_to_l2(next, g, slices);
            let acts = &act[(g * n + t0) * ACT_BYTES..(g * n + t0 + nt) * ACT_BYTES];
            if family == Family::Per32 {
                act_part_sums(bytemuck::cast_slice(acts), &mut ms);
            }
            for k in 0..G {
                let part = G * g + k;
                // Token i's part k at `a + i·ACT_BYTES`, a pointer into the whole of `acts`.
                let (a, bt) = (acts.as_ptr().add(qs + QK * k), p.b.as_ptr().add(part * B_BLOCK));
                tile_sums(tiles, a, bt, two, &mut sums[0]);
                let first = g == 0;
                match family {
                    Family::Legacy => {
                        let acts: &[ActT8] = bytemuck::cast_slice(acts);
                        scale_legacy(legacy::offset(t) != Offset::Zero, p, part, k, acts, first, &sums[0], acc);
                    }
                    Family::Per32 => scale_per32(p, part, k, (bytemuck::cast_slice(acts), &ms), first, &sums[0], acc),
                    Family::Sixteen => {
                        // The second 16 columns: A rows 16 bytes on, B tile rows 4 on.
                        tile_sums(tiles, a.add(QK / 2), bt.add(B_ROWS / 2 * COLSB), two, &mut sums[1]);
                        scale_sixteen(p, part, k, bytemuck::cast_slice(acts), first, sums, acc);
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

/// A 32-column type's block `k` of a group (panel part `part`) into its slot: `acc = x·(d_w·d_a)`
/// for the first group (`+ m_w·s_a` first, where the type has an `offset`), else added by FMA,
/// as `q32`'s and `on_vnni`'s kernels do.
///
/// # Safety
/// AVX-512F present (inlined into [`block`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn scale_legacy(
    offset: bool,
    p: &Panel<'_>,
    part: usize,
    k: usize,
    acts: &[ActT8],
    first: bool,
    sums: &[[i32; PANEL]; MAX_TOKENS],
    acc: &mut Acc,
) {
    let s = slot(k);
    // SAFETY: AVX-512F by the contract; the loads and stores stay inside 16-row halves.
    unsafe {
        for h in 0..2 {
            let dw = _mm512_loadu_ps(p.d[part][16 * h..].as_ptr());
            let mw = _mm512_loadu_ps(p.m[part][16 * h..].as_ptr());
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

/// Per token of a block, `da·Σa` of each part of a slice's activations, as `act32` forms
/// them (`madd` of the 16-column sums with ones, then times `da`): once per slice, not per
/// part and row half.
///
/// # Safety
/// AVX2 present (inlined into [`block`]).
#[inline(always)]
unsafe fn act_part_sums(acts: &[ActK], out: &mut [[f32; G]; MAX_TOKENS]) {
    // SAFETY: AVX2 by the contract; 32 bytes of sums, 8 floats a row.
    unsafe {
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            let s = _mm256_madd_epi16(_mm256_loadu_si256(a.bsums.as_ptr().cast()), _mm256_set1_epi16(1));
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a.d)));
        }
    }
}

/// Part `k` of a [`Family::Per32`] block (panel part `part`) into slot `k`, as `per32`:
/// `acc = (acc or 0 for the first block) + s·(d·scale·da) − (dmin·min)·(da·Σa)`, the tokens'
/// `da·Σa` in `ms` ([`act_part_sums`]).
///
/// # Safety
/// AVX-512F present (inlined into [`block`]).
#[inline(always)]
unsafe fn scale_per32(
    p: &Panel<'_>,
    part: usize,
    k: usize,
    (acts, ms): (&[ActK], &[[f32; G]; MAX_TOKENS]),
    first: bool,
    sums: &[[i32; PANEL]; MAX_TOKENS],
    acc: &mut Acc,
) {
    // SAFETY: AVX-512F by the contract; the loads and stores stay inside 16-row halves.
    unsafe {
        for h in 0..2 {
            let (dsc, dmn) =
                (_mm512_loadu_ps(p.d[part][16 * h..].as_ptr()), _mm512_loadu_ps(p.m[part][16 * h..].as_ptr()));
            for (i, a) in acts.iter().enumerate() {
                let x = _mm512_cvtepi32_ps(ld(&sums[i][16 * h..]));
                let at = acc[i][k][16 * h..].as_mut_ptr();
                let kept = if first { _mm512_setzero_ps() } else { _mm512_loadu_ps(at) };
                let v = _mm512_fmadd_ps(x, _mm512_mul_ps(dsc, _mm512_set1_ps(a.d)), kept);
                _mm512_storeu_ps(at, _mm512_fnmadd_ps(dmn, _mm512_set1_ps(ms[i][k]), v));
            }
        }
    }
}

/// Part `k` of a [`Family::Sixteen`] block (panel part `part`, its two halves' sums in `sums`)
/// into slot `k`, as `kquant` does: the halves' sums times their scales and the activations'
/// two 16-column sums times the mins, each pair added in i32 (`madd`'s pairs: the mins by
/// `vpmaddwd` of the word of two i16 mins with the word of two sums), then
/// `acc = x·(d·da)` for the first block (else added by FMA) `− mins·(dmin·da)`.
///
/// # Safety
/// AVX-512F and AVX-512BW present (inlined into [`block`]).
#[inline(always)]
unsafe fn scale_sixteen(p: &Panel<'_>, part: usize, k: usize, acts: &[ActK], first: bool, sums: &Sums, acc: &mut Acc) {
    // SAFETY: AVX-512F/BW by the contract; the loads and stores stay inside 16-row halves.
    unsafe {
        for h in 0..2 {
            let r = 16 * h..16 * h + 16;
            let (sc0, sc1, mn) =
                (ld(&p.sc[2 * part][r.clone()]), ld(&p.sc[2 * part + 1][r.clone()]), ld(&p.mn[part][r.clone()]));
            let (d, dmin) =
                (_mm512_loadu_ps(p.d[part][r.clone()].as_ptr()), _mm512_loadu_ps(p.m[part][r.clone()].as_ptr()));
            for (i, a) in acts.iter().enumerate() {
                let (s0, s1) = (ld(&sums[0][i][r.clone()]), ld(&sums[1][i][r.clone()]));
                let dots = _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1));
                let pair = i32::from_le_bytes(bytemuck::cast([a.bsums[2 * k], a.bsums[2 * k + 1]]));
                let mins = _mm512_madd_epi16(mn, _mm512_set1_epi32(pair));
                let da = _mm512_set1_ps(a.d);
                let at = acc[i][k][r.start..].as_mut_ptr();
                let x = _mm512_cvtepi32_ps(dots);
                let x = if first {
                    _mm512_mul_ps(x, _mm512_mul_ps(d, da))
                } else {
                    _mm512_fmadd_ps(x, _mm512_mul_ps(d, da), _mm512_loadu_ps(at))
                };
                _mm512_storeu_ps(at, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, da), x));
            }
        }
    }
}

/// 16 i32s from `v`.
///
/// # Safety
/// AVX-512F present (inlined into [`block`]); `v` holds 16 values.
#[inline(always)]
unsafe fn ld(v: &[i32]) -> __m512i {
    debug_assert!(v.len() >= 16);
    // SAFETY: the contract.
    unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
}
