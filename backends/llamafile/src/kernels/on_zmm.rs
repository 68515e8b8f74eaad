//! q4_K and q5_K ([`KBlock::PER32`]) for several tokens on AVX512-VNNI, in 512-bit registers:
//! one register holds a register of the lane layout for two rows (the tile's rows in pairs,
//! [`Pairs`]) against each token's activations broadcast to both halves, so one `vpdpbusd`
//! does the work of two 256-bit ones (on a Xeon with two 512-bit units, 1.86× their
//! throughput) and each f32 step serves two rows. Lane for lane the operations are those of
//! [`per32`](super::per32): the results are bit for bit the AVX2 kernels'. Built from rustc
//! 1.89 only (`build.rs`).

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;

use super::{act32, fresh, hsum4, ld, prefetch_next, token_tiles, Acc, Tile, R, TC};
use crate::act::ActK;
use crate::decode::KBlock;
use crate::lanes::REGS;

/// Tokens a group shares each weight register with: 16 accumulators of 2 rows' pairs.
const NT: usize = 8;

/// One block's levels for the tile's rows in pairs: `[pair][register]`, row `2p` in the low
/// 32 bytes, row `2p + 1` in the high.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Pairs([[[u8; 64]; REGS]; R / 2]);

impl Pairs {
    /// Zeros.
    pub const ZERO: Pairs = Pairs([[[0; 64]; REGS]; R / 2]);
}

/// The accumulators ([`Acc`]) as pairs of rows: `[pair][token]`, row `2p` in the low lanes.
type Acc2 = [[__m512; 2 * TC]; R / 2];

/// `lo` and `hi` as one register.
#[inline(always)]
unsafe fn join(lo: __m256, hi: __m256) -> __m512 {
    // SAFETY: AVX512F by the callers' contract.
    unsafe {
        let lo = _mm512_castpd256_pd512(_mm256_castps_pd(lo));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, _mm256_castps_pd(hi)))
    }
}

/// `K` tokens' dots with one block of the tile's rows (levels `lv`, [`KBlock::prep32`] in
/// pairs `sc`), added to `acc[p][t..t + K]`, or setting them for a tile's `FIRST` block (an
/// FMA with a zero register, as [`super::per32`] does with its mask, without loading them).
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
        // Each register's levels and activations read where used ([`fresh`]): LLVM otherwise
        // broadcast every token's activations for all 8 registers first, and spilled them.
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        for r in 0..REGS {
            let (lv, act) = (&*fresh(lv), &*core::ptr::slice_from_raw_parts(fresh(act.as_ptr()), K));
            let w = array!(_mm512_setzero_si512(); R / 2, |p| _mm512_load_si512(lv.0[p][r].as_ptr().cast()));
            for k in 0..K {
                let a = _mm512_broadcast_i64x4(ld(&act[k].qs[32 * r..]));
                for p in 0..R / 2 {
                    s[p][k] = _mm512_dpbusd_epi32(s[p][k], w[p], a);
                }
            }
        }
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
    let n = tile.n;
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for b in 0..tile.nb {
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            // SAFETY (whole loop): this function's features; stores stay inside `lv`.
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            for i in 0..R {
                for r in 0..REGS {
                    let at = lv.0[i / 2][r][32 * (i % 2)..].as_mut_ptr();
                    unsafe { _mm256_store_si256(at.cast(), blk[i].reg(r)) };
                }
            }
            let sc = array!((_mm512_setzero_ps(), _mm512_setzero_ps()); R / 2, |p| unsafe {
                let ((d0, m0), (d1, m1)) = (blk[2 * p].prep32(), blk[2 * p + 1].prep32());
                (join(d0, d1), join(m0, m1))
            });
            let act = &tile.act[b * n + t0..b * n + t0 + tn];
            if b == 0 {
                groups!(NT, tn, |K, t| unsafe { tokens::<K, true>(lv, &sc, &act[t..], acc, t) });
            } else {
                groups!(NT, tn, |K, t| unsafe { tokens::<K, false>(lv, &sc, &act[t..], acc, t) });
            }
        }
        for (t, o) in out[t0..t0 + tn].iter_mut().enumerate() {
            // SAFETY: this function's features.
            *o = unsafe {
                let half = |v: __m512, h: bool| {
                    let v = _mm512_castps_pd(v);
                    _mm256_castpd_ps(if h { _mm512_extractf64x4_pd::<1>(v) } else { _mm512_castpd512_pd256(v) })
                };
                hsum4([half(acc[0][t], false), half(acc[0][t], true), half(acc[1][t], false), half(acc[1][t], true)])
            };
        }
    }
}
