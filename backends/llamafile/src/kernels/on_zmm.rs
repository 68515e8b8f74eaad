//! Several tokens on AVX512-VNNI in 512-bit registers: one register holds a register of the
//! lane layout for two rows (the tile's rows in pairs, [`Pairs`]) against each token's
//! activations broadcast to both halves, so one `vpdpbusd` does the work of two 256-bit ones
//! (on a Xeon with two 512-bit units, 1.86× their throughput) and each f32 step serves two
//! rows. For q4_K and q5_K ([`KBlock::PER32`], [`dots`]) and q8_0 ([`q8`]). Lane for lane the
//! operations are those of the 256-bit kernels ([`per32`](super::per32), and
//! [`vnni_q8`](super::on_vnni)): the results are bit for bit the AVX2 kernels'. Built from
//! rustc 1.89 only (`build.rs`).

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;

use super::{act32, fresh, hsum4, ld, open_group, prefetch_next, token_tiles, Acc, Tile, R, TC};
use crate::act::{ActK, ActV8};
use crate::decode::KBlock;
use crate::lanes::REGS;
use crate::legacy;

/// Tokens a group shares each weight register with: 16 accumulators of 2 rows' pairs.
const NT: usize = 8;

/// One block's levels for the tile's rows in pairs: `[pair][register]`, row `2p` in the low
/// 32 bytes, row `2p + 1` in the high.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Pairs([[[u8; 64]; REGS]; R / 2]);

impl Pairs {
    /// Register `r` of row `i` from `reg(i, r)`, for every row and register of a block.
    ///
    /// # Safety
    /// AVX must be present (inlined into the kernels, whose features they are).
    #[inline(always)]
    unsafe fn fill(&mut self, reg: impl Fn(usize, usize) -> __m256i) {
        for i in 0..R {
            for r in 0..REGS {
                let at = self.0[i / 2][r][32 * (i % 2)..].as_mut_ptr();
                // SAFETY: AVX by the contract; 32 bytes inside the aligned pair's half.
                unsafe { _mm256_store_si256(at.cast(), reg(i, r)) };
            }
        }
    }
}

/// The accumulators ([`Acc`]) as pairs of rows: `[pair][token]`, row `2p` in the low lanes.
type Acc2 = [[__m512; 2 * TC]; R / 2];

/// `lo` and `hi` as one register.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn join(lo: __m256, hi: __m256) -> __m512 {
    // SAFETY: AVX512F by the callers' contract.
    unsafe {
        let lo = _mm512_castpd256_pd512(_mm256_castps_pd(lo));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, _mm256_castps_pd(hi)))
    }
}

/// `s[p][k]` plus the 8 `vpdpbusd` of pair `p`'s levels in `lv` with token `k`'s values
/// (`qs(&act[k])`, each register's 32 bytes broadcast to both halves), for `K` tokens.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn dp_pairs<A, const K: usize>(lv: &Pairs, act: &[A], qs: impl Fn(&A) -> &[i8], s: &mut [[__m512i; K]; R / 2]) {
    // SAFETY (whole function): AVX512F/VNNI by the callers' contract; loads stay inside the
    // levels and the `K` activation blocks.
    unsafe {
        for r in 0..REGS {
            // Each register's levels and activations read where used ([`fresh`]): LLVM otherwise
            // broadcast every token's activations for all 8 registers first, and spilled them.
            let (lv, act) = (&*fresh(lv), &*core::ptr::slice_from_raw_parts(fresh(act.as_ptr()), K));
            let w = array!(_mm512_setzero_si512(); R / 2, |p| _mm512_load_si512(lv.0[p][r].as_ptr().cast()));
            for k in 0..K {
                let a = _mm512_broadcast_i64x4(ld(&qs(&act[k])[32 * r..]));
                for p in 0..R / 2 {
                    s[p][k] = _mm512_dpbusd_epi32(s[p][k], w[p], a);
                }
            }
        }
    }
}

/// `K` tokens' dots with one block of the tile's rows (levels `lv`, [`KBlock::prep32`] in
/// pairs `sc`), added to `acc[p][t..t + K]`, or setting them for a tile's `FIRST` block (an
/// FMA with a zero register, as [`super::per32`] does with its mask, without loading them).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn tokens<const K: usize, const FIRST: bool>(
    lv: &Pairs,
    sc: &[(__m512, __m512); R / 2],
    act: &[ActK],
    acc: &mut Acc2,
    t: usize,
) {
    // SAFETY (whole function): AVX2/FMA/AVX512F/VNNI by the callers' contract; loads stay
    // inside the levels, the activation blocks and the accumulators.
    unsafe {
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        dp_pairs(lv, act, |a| &a.qs, &mut s);
        for k in 0..K {
            let (da, m) = act32(&act[k]);
            let (da, m) = (join(da, da), join(m, m));
            for p in 0..R / 2 {
                let (dsc, dmn) = sc[p];
                let kept = if FIRST { _mm512_setzero_ps() } else { acc[p][t + k] };
                let x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[p][k]), _mm512_mul_ps(dsc, da), kept);
                acc[p][t + k] = _mm512_fnmadd_ps(dmn, m, x);
            }
        }
    }
}

/// [`super::dots`] for a [`KBlock::PER32`] type on AVX512-VNNI: `NT` tokens at a time, the
/// rest in one group, each block's levels decoded once per token tile into `lv`.
///
/// # Safety
/// As [`super::dots`]; AVX512F, AVX512BW, AVX512VL and AVX512-VNNI must be present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dots<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]], lv: &mut Pairs, acc: &mut Acc) {
    // SAFETY: `Acc` and `Acc2` are the same 8 KiB of plain data, and the scratch keeps it
    // 64-byte aligned (`Scratch` is, and holds it first).
    debug_assert!((acc.as_ptr() as usize).is_multiple_of(64));
    let acc: &mut Acc2 = unsafe { &mut *(acc as *mut Acc).cast() };
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for b in 0..tile.nb {
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            // SAFETY (whole loop): this function's features; stores stay inside `lv`.
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            unsafe { lv.fill(|i, r| blk[i].reg(r)) };
            let sc = array!((_mm512_setzero_ps(), _mm512_setzero_ps()); R / 2, |p| unsafe {
                let ((d0, m0), (d1, m1)) = (blk[2 * p].prep32(), blk[2 * p + 1].prep32());
                (join(d0, d1), join(m0, m1))
            });
            let act = &acts[b * n + t0..b * n + t0 + tn];
            if b == 0 {
                groups!(NT, tn, |K, t| unsafe { tokens::<K, true>(lv, &sc, &act[t..], acc, t) });
            } else {
                groups!(NT, tn, |K, t| unsafe { tokens::<K, false>(lv, &sc, &act[t..], acc, t) });
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// `out[t][i]` = the sum of row `i`'s lanes in `acc[i / 2][t]`, as the 256-bit kernels'
/// `write_out` sums the same four registers.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn write_out(acc: &Acc2, out: &mut [[f32; R]]) {
    for (t, o) in out.iter_mut().enumerate() {
        // SAFETY: AVX512F by the callers' contract.
        *o = unsafe {
            let half = |v: __m512, h: bool| {
                let v = _mm512_castps_pd(v);
                _mm256_castpd_ps(if h { _mm512_extractf64x4_pd::<1>(v) } else { _mm512_castpd512_pd256(v) })
            };
            hsum4([half(acc[0][t], false), half(acc[0][t], true), half(acc[1][t], false), half(acc[1][t], true)])
        };
    }
}

/// `K` tokens' dots with one q8_0 group of the tile's rows (levels + 128 in `lv`, the 8 blocks'
/// scales in pairs `dw`), added to `acc[p][t..t + K]` or setting them for a tile's `FIRST`
/// group: 8 `vpdpbusd` a pair and token from the activations' `-128·Σq`, then as
/// [`vnni_tokens`](super::on_vnni) (a product, or an FMA, with the scales' product).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn q8_tokens<const K: usize, const FIRST: bool>(
    lv: &Pairs,
    dw: &[__m512; R / 2],
    act: &[ActV8],
    acc: &mut Acc2,
    t: usize,
) {
    // SAFETY (whole function): AVX2/FMA/AVX512F/VNNI by the callers' contract; loads stay
    // inside the levels, the activation blocks and the accumulators.
    unsafe {
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        for k in 0..K {
            let neg = _mm512_broadcast_i64x4(ld(&act[k].neg));
            for p in 0..R / 2 {
                s[p][k] = neg;
            }
        }
        dp_pairs(lv, act, |a| &a.qs, &mut s);
        for k in 0..K {
            let da = _mm512_castsi512_ps(_mm512_broadcast_i64x4(ld(&act[k].d)));
            for p in 0..R / 2 {
                let (x, sc) = (_mm512_cvtepi32_ps(s[p][k]), _mm512_mul_ps(dw[p], da));
                acc[p][t + k] = if FIRST { _mm512_mul_ps(x, sc) } else { _mm512_fmadd_ps(x, sc, acc[p][t + k]) };
            }
        }
    }
}

/// [`super::dots`] for q8_0 on AVX512-VNNI: each group's levels copied into `lv` once per
/// token tile, then `NT` tokens at a time, the rest in one group.
///
/// # Safety
/// As [`super::dots`] for a matrix packed for VNNI; AVX512F, AVX512BW, AVX512VL and
/// AVX512-VNNI must be present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q8(tile: &Tile<'_, ActV8>, out: &mut [[f32; R]], lv: &mut Pairs, acc: &mut Acc) {
    // SAFETY: as in [`dots`].
    debug_assert!((acc.as_ptr() as usize).is_multiple_of(64));
    let acc: &mut Acc2 = unsafe { &mut *(acc as *mut Acc).cast() };
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for g in 0..tile.nb {
            // SAFETY (whole loop): this function's features; loads stay inside the groups
            // (8 registers of levels after the 16 bytes of scales), stores inside `lv`.
            let (grp, dw) = unsafe { open_group(tile, t0, g) };
            unsafe { lv.fill(|i, r| ld(&grp[i][2 * legacy::G + 32 * r..])) };
            let dw = array!(_mm512_setzero_ps(); R / 2, |p| unsafe { join(dw[2 * p], dw[2 * p + 1]) });
            let act = &acts[g * n + t0..g * n + t0 + tn];
            if g == 0 {
                groups!(NT, tn, |K, t| unsafe { q8_tokens::<K, true>(lv, &dw, &act[t..], acc, t) });
            } else {
                groups!(NT, tn, |K, t| unsafe { q8_tokens::<K, false>(lv, &dw, &act[t..], acc, t) });
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}
