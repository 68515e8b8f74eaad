//! q8_0 for several tokens on VNNI ([`crate::vnni`]): each group of a tile's rows moved once
//! into the order of [`ActV8`] and made unsigned ([`U8G`]), then `vpdpbusd` with `NT` tokens at
//! a time. Built from rustc 1.89 only (`build.rs`).

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;

use kt_core::ggml::QK;

use super::{add_product, ld, open_group, token_tiles, write_out, Acc, Tile, R, TC};
use crate::act::ActV8;
use crate::legacy;
use crate::vnni::{self, Dp, Vnni};

/// One q8_0 group of one row for `vpdpbusd` ([`vnni_q8`]): its levels + 128 (unsigned), 4
/// columns of each block per lane, in [`ActV8`]'s order.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(super) struct U8G([[u8; 32]; QK / 4]);

impl U8G {
    pub(super) const ZERO: U8G = U8G([[0; 32]; QK / 4]);
}

/// A q8_0 group of one row (repacked, [`crate::legacy`]) as [`U8G`]: column pairs `4m`
/// and `4m + 2` of each block side by side (`unpack`), likewise `4m + 1` and `4m + 3`, each
/// half's 4 blocks then joined with the other half's (a lane swap), levels + 128. (Weights
/// stored in this order instead measured no faster here, and slowed the one-token kernel's
/// widening by half.)
///
/// # Safety
/// AVX2 must be present (inlined into kernels that enable it).
#[inline(always)]
unsafe fn u8_quads(g: &[u8], out: &mut U8G) {
    let at = 2 * legacy::G;
    debug_assert!(g.len() >= at + 8 * 32);
    // SAFETY: AVX2 by the caller's contract; 4 × 64 bytes of levels after the 16 of scales.
    unsafe {
        let flip = _mm256_set1_epi8(i8::MIN);
        for m in 0..QK / 8 {
            let x = ld(&g[at + 64 * m..]);
            let y = ld(&g[at + 64 * m + 32..]);
            let (lo, hi) = (_mm256_unpacklo_epi16(x, y), _mm256_unpackhi_epi16(x, y));
            let a = _mm256_xor_si256(_mm256_permute2x128_si256::<0x20>(lo, hi), flip);
            let b = _mm256_xor_si256(_mm256_permute2x128_si256::<0x31>(lo, hi), flip);
            _mm256_store_si256(out.0[2 * m].as_mut_ptr().cast(), a);
            _mm256_store_si256(out.0[2 * m + 1].as_mut_ptr().cast(), b);
        }
    }
}

/// `NT` tokens' dots with one q8_0 group of each row ([`U8G`]), added to `acc[i][t..t + NT]`:
/// 8 `vpdpbusd` a row and token give the 8 blocks' sums in their lanes, started from the
/// activations' `-128·Σq` so that they are exactly the sums of the levels as stored.
#[inline(always)]
unsafe fn vnni_tokens<D: Dp, const NT: usize, const A: usize>(
    u: &[U8G; R],
    act: &[ActV8],
    dw: &[__m256; R],
    acc: &mut [[__m256; A]; R],
    t: usize,
    first: bool,
) {
    // SAFETY (whole function): AVX2/FMA and `D`'s features by the callers' contract; loads
    // stay inside the scratch and the activation blocks.
    unsafe {
        let mut s = [[_mm256_setzero_si256(); NT]; R];
        for k in 0..NT {
            let neg = ld(&act[k].neg);
            for i in 0..R {
                s[i][k] = neg;
            }
        }
        for j in 0..QK / 4 {
            let a = array!(_mm256_setzero_si256(); NT, |k| ld(&act[k].qs[32 * j..]));
            for i in 0..R {
                let w = ld(&u[i].0[j]);
                for k in 0..NT {
                    s[i][k] = D::dp(s[i][k], w, a[k]);
                }
            }
        }
        for k in 0..NT {
            let da = _mm256_loadu_ps(act[k].d.as_ptr());
            for i in 0..R {
                let sc = _mm256_mul_ps(dw[i], da);
                acc[i][t + k] = add_product(first, _mm256_cvtepi32_ps(s[i][k]), sc, acc[i][t + k]);
            }
        }
    }
}

/// q8_0 for several tokens with `vpdpbusd` ([`crate::vnni`]): each group of the tile's rows
/// is put in [`U8G`] order once (`u`) for all tokens, then `NT` tokens at a time share each
/// of its registers. The block sums are the integers [`super::wide`] finds, and what follows is the
/// same: the results are bit for bit those of the AVX2 kernel.
#[inline(always)]
unsafe fn vnni_q8<D: Dp, const NT: usize>(
    tile: &Tile<'_, ActV8>,
    out: &mut [[f32; R]],
    u: &mut [U8G; R],
    acc: &mut Acc,
) {
    let (n, ng) = (tile.n, tile.nb);
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for g in 0..ng {
            let first = g == 0;
            // SAFETY (whole loop): AVX2/FMA/F16C and `D`'s features by the callers' contract;
            // loads stay inside the groups, the scratch and the activation blocks.
            let (grp, dw) = unsafe { open_group(tile, t0, g) };
            for i in 0..R {
                unsafe { u8_quads(grp[i], &mut u[i]) };
            }
            let act = &tile.act[g * n + t0..g * n + t0 + tn];
            let mut t = 0;
            while t + NT <= tn {
                unsafe { vnni_tokens::<D, NT, { 2 * TC }>(u, &act[t..], &dw, acc, t, first) };
                t += NT;
            }
            while t < tn {
                unsafe { vnni_tokens::<D, 1, { 2 * TC }>(u, &act[t..], &dw, acc, t, first) };
                t += 1;
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// [`vnni_q8`] in encoding `v` ([`super::dots`] for q8_0 on VNNI).
///
/// # Safety
/// As [`super::dots`], `v`'s features present.
pub(super) unsafe fn dots(v: Vnni, tile: &Tile<'_, ActV8>, out: &mut [[f32; R]], u: &mut [U8G; R], acc: &mut Acc) {
    // SAFETY: the caller's contract.
    unsafe {
        match v {
            Vnni::Evex => vnni_q8_evex(tile, out, u, acc),
            Vnni::Vex => vnni_q8_vex(tile, out, u, acc),
        }
    }
}

/// [`vnni_q8`] with AVX512-VNNI (EVEX: 32 registers, 6 tokens at a time).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn vnni_q8_evex(tile: &Tile<'_, ActV8>, out: &mut [[f32; R]], u: &mut [U8G; R], acc: &mut Acc) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { vnni_q8::<vnni::Evex, 6>(tile, out, u, acc) }
}

/// [`vnni_q8`] with AVX-VNNI (VEX: 16 registers, 2 tokens at a time).
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn vnni_q8_vex(tile: &Tile<'_, ActV8>, out: &mut [[f32; R]], u: &mut [U8G; R], acc: &mut Acc) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { vnni_q8::<vnni::Vex, 2>(tile, out, u, acc) }
}
