//! A panel's rows unpacked for the tiles, once per task: each 32-column part's levels in column
//! order, 8 rows at a time transposed by 4-byte words into the rows of its two B tiles, and the
//! factors that scale the part's sums, over the rows. Both families of types reach the same
//! B tiles: the 32-column types a group of 8 blocks at a time (8 parts), the 256-column types
//! a block at a time (8 parts again, from the lane layout of [`crate::lanes`] put back in
//! column order).

use core::arch::x86_64::*;

use kt_core::ggml::GgmlType;
use kt_x86::amx::COLSB;

use super::{family, Family, Packed, Panel, B_BLOCK, B_ROWS, PANEL};
use crate::act::transpose8;
use crate::decode::KBlock;
use crate::legacy::{self, Offset, G, ORDER};

/// Unpack rows `r0..r0 + nr` (`nr ≤ PANEL`) of `w` into `p`; rows past `nr` repeat the last.
///
/// # Safety
/// AVX2, FMA and F16C are present; `w`'s type runs on tiles ([`super::runs`]); `p` was made
/// for `w.t` and `w.cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn unpack(w: &Packed, r0: usize, nr: usize, p: &mut Panel<'_>) {
    debug_assert!((1..=PANEL).contains(&nr) && r0 + nr <= w.rows);
    macro_rules! k {
        ($b:ty) => {
            // SAFETY: the caller's contract; `w` holds blocks of `$b`.
            unsafe { unpack_k::<$b>(w, r0, nr, p) }
        };
    }
    by_kblock!(w.t, k, {
        debug_assert_eq!(family(w.t), Family::Legacy, "{} has no tile kernels (on_amx::runs)", w.t);
        // SAFETY: the caller's contract.
        unsafe { unpack_legacy(w, r0, nr, p) }
    })
}

/// The byte offsets of rows `8q..8q + 8` of the panel starting at row `r0` of `w` (past `nr`,
/// the last row's).
fn eight_rows(w: &Packed, r0: usize, nr: usize, q: usize) -> [usize; 8] {
    core::array::from_fn(|i| (r0 + (8 * q + i).min(nr - 1)) * w.row_bytes)
}

/// Parts `part0..part0 + 8` of rows `8q..8q + 8` into the B tiles: `lv[i][k]` is row `i`'s
/// part `k`, in column order; an 8 × 8 transpose of 4-byte words makes each of its 8 words a
/// half row of one B tile row.
///
/// # Safety
/// AVX2 is present (inlined into functions that enable it); `p` holds part `part0 + 7`.
#[inline(always)]
unsafe fn store_parts(p: &mut Panel<'_>, part0: usize, q: usize, lv: &[[__m256i; G]; 8]) {
    for k in 0..G {
        // SAFETY: AVX2 by the contract; the stores stay inside the panel's part `part0 + k`.
        unsafe {
            let words = transpose8(array!(_mm256_setzero_si256(); 8, |i| lv[i][k]));
            let at = (part0 + k) * B_BLOCK + (q / 2) * B_ROWS * COLSB + 32 * (q % 2);
            for (j, v) in words.iter().enumerate() {
                _mm256_storeu_si256(p.b.as_mut_ptr().add(at + j * COLSB).cast(), *v);
            }
        }
    }
}

/// 8 vectors of 8 rows' values (`v[i]`: row `i`'s 8 values) transposed into `dst[k][8q..8q+8]`
/// for `k` in `at[..]` (value `k` of each row to `dst[at[k]]`).
///
/// # Safety
/// AVX2 is present (inlined into functions that enable it).
#[inline(always)]
unsafe fn store_rows<T: bytemuck::Pod>(dst: &mut [[T; PANEL]], at: impl Fn(usize) -> usize, q: usize, v: [__m256i; 8]) {
    const { assert!(size_of::<T>() == 4) };
    // SAFETY: AVX2 by the contract; each store writes 8 values of 4 bytes inside one row.
    unsafe {
        for (k, v) in transpose8(v).iter().enumerate() {
            let row = &mut dst[at(k)][8 * q..8 * q + 8];
            _mm256_storeu_si256(row.as_mut_ptr().cast(), *v);
        }
    }
}

/// The 32-column types: group `g` of each row gives parts `8g..8g + 8` (its blocks), with
/// their scales (and offsets) as the vector kernels form them (`m = k·d` by the same multiply).
///
/// # Safety
/// As [`unpack`], for a 32-column type.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_legacy(w: &Packed, r0: usize, nr: usize, p: &mut Panel<'_>) {
    let (gb, t) = (w.slice_bytes, w.t);
    let offset = legacy::offset(t);
    for q in 0..PANEL / 8 {
        let rows = eight_rows(w, r0, nr, q);
        for g in 0..w.slices {
            let grp = array!(&[][..]; 8, |i| &w.data[rows[i] + g * gb..rows[i] + (g + 1) * gb]);
            // SAFETY (whole loop): AVX2/F16C by this function's features; each group is `gb`
            // bytes inside its row.
            unsafe {
                let lv = array!([_mm256_setzero_si256(); G]; 8, |i| levels(t, w.zmm, grp[i]));
                store_parts(p, G * g, q, &lv);
                // Scales in slot order: slot `s` is block `ORDER[s]`.
                let dw = array!(_mm256_setzero_si256(); 8, |i| _mm256_castps_si256(legacy::scales(grp[i], 0)));
                let mw = array!(_mm256_setzero_si256(); 8, |i| _mm256_castps_si256(match offset {
                    Offset::Zero => _mm256_setzero_ps(),
                    Offset::OfD(k) => _mm256_mul_ps(_mm256_castsi256_ps(dw[i]), _mm256_set1_ps(k)),
                    Offset::Stored => legacy::scales(grp[i], 2 * G),
                }));
                store_rows(p.d, |s| G * g + ORDER[s], q, dw);
                store_rows(p.m, |s| G * g + ORDER[s], q, mw);
            }
        }
    }
}

/// One row's group of 8 blocks as their levels in column order, one register per block (block
/// `k` in register `k`): what each block contributes to the integer sums, as the vector
/// kernels read it (unsigned with the types' offsets left to `m·s`, mxfp4's through its table;
/// iq4_nl's table values; q8_0's signed values). `zmm`: packed for the 512-bit kernels (the
/// 4- and 5-bit levels in 4-column lanes, [`legacy::to_nibble_quads`]).
///
/// # Safety
/// AVX2 is present; `g` is one whole group of `t`, packed as [`super::runs`] requires.
#[inline(always)]
unsafe fn levels(t: GgmlType, zmm: bool, g: &[u8]) -> [__m256i; G] {
    // SAFETY (whole body): AVX2 by contract; loads stay inside the group (levels after the
    // scales, q5's plane after the nibbles).
    unsafe {
        let at = legacy::levels_at(t);
        let table = legacy::lut(t);
        let five = matches!(t, GgmlType::Q5_0 | GgmlType::Q5_1);
        if t == GgmlType::Q8_0 {
            // + 128 in the layout. (`array!`, not `map`: a `map` closure lacks the caller's
            // features, and its `xor` was a call per register.)
            let regs = array!(_mm256_setzero_si256(); G, |j| {
                _mm256_xor_si256(super::super::ld(&g[at + 32 * j..]), _mm256_set1_epi8(-128))
            });
            return in_columns(regs);
        }
        if zmm {
            // Register j: nibble j / 4 of the 32 bytes at 32·(j % 4); its fifth bits, bit j of
            // the plane's bytes.
            let low = _mm256_set1_epi8(0x0F);
            let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.unwrap_or(&[0; 16]).as_ptr().cast()));
            let plane = if five { super::super::ld(&g[at + 16 * G..]) } else { _mm256_setzero_si256() };
            let regs = array!(_mm256_setzero_si256(); G, |j| {
                let b = super::super::ld(&g[at + 32 * (j % 4)..]);
                let n = _mm256_and_si256(if j < 4 { b } else { _mm256_srli_epi16::<4>(b) }, low);
                match () {
                    _ if table.is_some() => _mm256_shuffle_epi8(lut, n),
                    _ if five => _mm256_or_si256(n, legacy::bit4(plane, j)),
                    _ => n,
                }
            });
            return in_columns(regs);
        }
        let mut out = [_mm256_setzero_si256(); G];
        let low = _mm_set1_epi8(0x0F);
        let lut = _mm_loadu_si128(table.unwrap_or(&[0; 16]).as_ptr().cast());
        for k in 0..G {
            // Byte j: column j in its low nibble, column j + 16 in its high one.
            let b = _mm_loadu_si128(g.as_ptr().add(at + 16 * k).cast());
            let (mut lo, mut hi) = (_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16::<4>(b), low));
            match t {
                _ if table.is_some() => (lo, hi) = (_mm_shuffle_epi8(lut, lo), _mm_shuffle_epi8(lut, hi)),
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

/// A group's 8 registers in 4-column lanes (`legacy::quad_at`: register `j = 2m + h` holds
/// in lane `slot(k)` columns `8m + 2h` + 0, 1, 4, 5 of block `k`) as each block's levels in
/// column order: a transpose gathers each block's 8 words, a shuffle puts each 8 columns back
/// in order.
///
/// # Safety
/// AVX2 is present (inlined into functions that enable it).
#[inline(always)]
unsafe fn in_columns(regs: [__m256i; G]) -> [__m256i; G] {
    // SAFETY: register operations; AVX2 by the contract.
    unsafe {
        let order = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
        let mut out = [_mm256_setzero_si256(); G];
        for (s, r) in transpose8(regs).into_iter().enumerate() {
            out[ORDER[s]] = _mm256_shuffle_epi8(r, order);
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

/// The 256-column types: block `b` of each row gives parts `8b..8b + 8`, its levels as the
/// vector kernels decode them ([`KBlock::regs`], the lane layout) put back in column order,
/// and its factors: for [`KBlock::PER32`] types `(d·scale, dmin·min)` of each part
/// ([`KBlock::prep32`]) in `d`, `m`; for the others `d`, `dmin` in every part's `d`, `m`, the
/// i16 scales of each 16 columns widened to i32 in `sc`, and each part's two i16 mins in one
/// word of `mn`.
///
/// # Safety
/// As [`unpack`], for blocks of `B`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_k<B: KBlock>(w: &Packed, r0: usize, nr: usize, p: &mut Panel<'_>) {
    let sixteen = family(w.t) == Family::Sixteen;
    for q in 0..PANEL / 8 {
        let rows = eight_rows(w, r0, nr, q);
        let blocks = array!(&[][..]; 8, |i| bytemuck::cast_slice::<u8, B>(&w.data[rows[i]..][..w.row_bytes]));
        for b in 0..w.slices {
            let blk = array!(&blocks[0][0]; 8, |i| &blocks[i][b]);
            // SAFETY (whole loop): AVX2/FMA/F16C by this function's features.
            unsafe {
                let lv = array!([_mm256_setzero_si256(); G]; 8, |i| column_parts(registers(blk[i])));
                store_parts(p, G * b, q, &lv);
                if !sixteen {
                    let f = array!((_mm256_setzero_ps(), _mm256_setzero_ps()); 8, |i| blk[i].prep32());
                    store_rows(
                        p.d,
                        |k| G * b + k,
                        q,
                        array!(_mm256_setzero_si256(); 8, |i| _mm256_castps_si256(f[i].0)),
                    );
                    store_rows(
                        p.m,
                        |k| G * b + k,
                        q,
                        array!(_mm256_setzero_si256(); 8, |i| _mm256_castps_si256(f[i].1)),
                    );
                    continue;
                }
                let f = array!((_mm256_setzero_si256(), _mm256_setzero_si256(), 0.0, 0.0); 8, |i| blk[i].prep());
                for h in 0..2 {
                    // 16-column groups 8h..8h + 8.
                    store_rows(
                        p.sc,
                        |k| 2 * G * b + 8 * h + k,
                        q,
                        array!(_mm256_setzero_si256(); 8, |i| widen(f[i].0, h)),
                    );
                }
                // Part k's two mins: word k of the row's mins.
                store_rows(p.mn, |k| G * b + k, q, array!(_mm256_setzero_si256(); 8, |i| f[i].1));
                let d =
                    _mm256_castps_si256(_mm256_setr_ps(f[0].2, f[1].2, f[2].2, f[3].2, f[4].2, f[5].2, f[6].2, f[7].2));
                let dmin =
                    _mm256_castps_si256(_mm256_setr_ps(f[0].3, f[1].3, f[2].3, f[3].3, f[4].3, f[5].3, f[6].3, f[7].3));
                for k in 0..G {
                    _mm256_storeu_si256(p.d[G * b + k][8 * q..].as_mut_ptr().cast(), d);
                    _mm256_storeu_si256(p.m[G * b + k][8 * q..].as_mut_ptr().cast(), dmin);
                }
            }
        }
    }
}

/// i16 values `8h..8h + 8` of `v` as i32.
///
/// # Safety
/// AVX2 is present (inlined into functions that enable it).
#[inline(always)]
unsafe fn widen(v: __m256i, h: usize) -> __m256i {
    // SAFETY: register operations; AVX2 by the contract.
    unsafe { _mm256_cvtepi16_epi32(if h == 0 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256::<1>(v) }) }
}

/// A block's levels, its 8 registers in the lane layout: [`KBlock::regs`] for the types that
/// decode them together, else [`KBlock::reg`] each, in a loop (`regs`' default maps a closure,
/// which lacks the caller's target features: a call per intrinsic).
///
/// # Safety
/// AVX2, FMA and F16C are present (inlined into functions that enable them).
#[inline(always)]
unsafe fn registers<B: KBlock>(blk: &B) -> [__m256i; G] {
    // SAFETY: the contract.
    unsafe {
        match B::WHOLE {
            true => blk.regs(),
            false => array!(_mm256_setzero_si256(); G, |r| blk.reg(r)),
        }
    }
}

/// A block's 8 lane-layout registers as its 8 parts of 32 columns in column order. The lane
/// layout is a transpose of 2-byte words within each 128-bit half ([`crate::lanes::transpose`]),
/// so the same transpose undoes it: register `j` then holds 16-column group `j` in its low half
/// and group `j + 8` in its high one, and part `l` is groups `2l` and `2l + 1`.
///
/// # Safety
/// AVX2 is present (inlined into functions that enable it).
#[inline(always)]
unsafe fn column_parts(regs: [__m256i; G]) -> [__m256i; G] {
    // SAFETY: register operations; AVX2 by the contract.
    unsafe {
        let y = crate::lanes::transpose(regs);
        let mut out = [_mm256_setzero_si256(); G];
        for l in 0..G / 2 {
            out[l] = _mm256_permute2x128_si256::<0x20>(y[2 * l], y[2 * l + 1]);
            out[l + G / 2] = _mm256_permute2x128_si256::<0x31>(y[2 * l], y[2 * l + 1]);
        }
        out
    }
}
