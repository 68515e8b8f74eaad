//! Kernels on VNNI ([`crate::vnni`]). q8_0: weights packed with their levels + 128 in 4-column
//! lanes ([`legacy::to_quads`]), activations in the same order ([`ActV8`]), 8 `vpdpbusd` a
//! row, token and group, `NT` tokens at a time (with AVX512-VNNI in 512-bit registers, as
//! one of the 32-column types: [`super::on_zmm`]). q4_0, q4_1, q5_0, q5_1 with AVX-VNNI: the
//! 32-column kernel as on AVX2, each pair of blocks summed by two `vpdpbusd` (levels are
//! unsigned already) where `maddubs` took two `vpmaddubsw` and an add, then a fold of i16 sums
//! (with AVX512-VNNI: in q8_0's lanes and 512-bit registers, [`super::on_zmm`]). q4_K, q5_K
//! and iq4_xs ([`KBlock::PER32`]): 8 `vpdpbusd` a row, token and block give the 32-column
//! parts' sums (iq4_xs's signed levels go in + 128 and come out less 128·Σa, in i32: the same
//! integers as AVX2's sign trick); several tokens with AVX512-VNNI in 512-bit registers
//! ([`super::on_zmm`]), here for AVX-VNNI and for one token. Built from rustc 1.89 only
//! (`build.rs`).

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;
use core::marker::PhantomData;
use core::ops::Range;

use kt_core::ggml::{GgmlType, QK};

use super::{
    act32, add_product, fresh, keep, ld, legacy_tiles, legacy_with, on_zmm, open_group, per32, prefetch_next,
    token_tiles, write_out, DecK, Packed, PairSums, Scratch, Tile, R, TC,
};
use crate::act::{ActG8, ActK, ActV8};
use crate::decode::{Iq4XsU, KBlock, Q4KU, Q5KU};
use crate::lanes::REGS;
use crate::legacy;
use crate::vnni::{self, Dp, Vnni};

/// `NT` tokens' dots with one group of each row (`grp`), added to `acc[i][t..t + NT]`: 8
/// `vpdpbusd` a row and token give the 8 blocks' sums in their lanes, started from the
/// activations' `-128·Σq` so that they are exactly the sums of the levels as GGUF stores them.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn vnni_tokens<D: Dp, const NT: usize, const A: usize>(
    grp: &[&[u8]; R],
    act: &[ActV8],
    dw: &[__m256; R],
    acc: &mut [[__m256; A]; R],
    t: usize,
    first: bool,
) {
    // SAFETY (whole function): AVX2/FMA and `D`'s features by the callers' contract; loads
    // stay inside the groups (8 registers of levels after the 16 bytes of scales) and the
    // activation blocks.
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
                let w = ld(&grp[i][2 * legacy::G + 32 * j..]);
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

/// One tile: `NT` tokens at a time share each register of a group's rows, the rest one at a
/// time. The block sums are the integers [`super::wide`] finds, and what follows is the same:
/// the results are bit for bit those of the AVX2 kernels. `TC`, `A`: as [`super::wide`]'s.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn vnni_q8<D: Dp, const NT: usize, const TC: usize, const A: usize>(
    tile: &Tile<'_, ActV8>,
    out: &mut [[f32; R]],
    acc: &mut [[__m256; A]; R],
) {
    let (n, ng, acts) = (tile.n, tile.nb, tile.act());
    for (t0, tn) in token_tiles::<TC>(n) {
        for g in 0..ng {
            // `A` = 1 (one token): the caller's zeroed registers, added to; else group 0 sets them.
            let first = A > 1 && g == 0;
            // SAFETY (whole loop): AVX2/FMA/F16C and `D`'s features by the callers' contract;
            // loads stay inside the groups and the activation blocks.
            let (grp, dw) = unsafe { open_group(tile, t0, g) };
            let act = &acts[g * n + t0..g * n + t0 + tn];
            groups!(NT, tn, |K, t| unsafe { vnni_tokens::<D, K, A>(&grp, &act[t..], &dw, acc, t, first) });
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// `NT` tokens' dots with one block of each row of a [`KBlock::PER32`] type (`blk`, whose
/// [`KBlock::prep32`] is `sc`; its levels decoded into `dec` when several tokens share them,
/// else decoded here), added to `acc[i][t..t + NT]`: 8 `vpdpbusd` a row and token give the
/// 32-column parts' sums in their lanes (the lane layout keeps each i32 lane in one part),
/// the integers [`super::kquant()`] finds with `maddubs` and a `madd` with ones; then the same
/// f32 step ([`per32`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn k32_tokens<D: Dp, B: KBlock, const NT: usize, const A: usize>(
    blk: &[&B; R],
    dec: Option<&[DecK; R]>,
    sc: &[(__m256, __m256); R],
    act: &[ActK],
    acc: &mut [[__m256; A]; R],
    t: usize,
    keep: __m256,
) {
    // SAFETY (whole function): AVX2/FMA/F16C and `D`'s features by the callers' contract;
    // loads stay inside the blocks, the decoded levels and the activation blocks.
    unsafe {
        // Levels read afresh by each group: seeing that they do not change, LLVM loaded all 32
        // registers once before the groups and spilled them to the stack, a store and a load
        // more each (q4_K 1.1x slower than reading them here).
        let dec = dec.map(|d| &*fresh(d));
        // Registers in pairs, for one token into two chains a row (even and odd registers:
        // else each row waits on a chain of 8 `vpdpbusd` per block).
        let (mut s, mut odd) = ([[_mm256_setzero_si256(); NT]; R], [[_mm256_setzero_si256(); NT]; R]);
        for p in 0..REGS / 2 {
            for r in [2 * p, 2 * p + 1] {
                let w = array!(_mm256_setzero_si256(); R, |i| match dec {
                    Some(d) => ld(&d[i].v[r]),
                    None => blk[i].ureg(r),
                });
                let s = if NT == 1 && r % 2 == 1 { &mut odd } else { &mut s };
                for k in 0..NT {
                    let a = ld(&act[k].qs[32 * r..]);
                    for i in 0..R {
                        s[i][k] = D::dp(s[i][k], w[i], a);
                    }
                }
            }
        }
        if NT == 1 {
            for i in 0..R {
                s[i][0] = _mm256_add_epi32(s[i][0], odd[i][0]);
            }
        }
        for k in 0..NT {
            let (da, m) = act32(&act[k]);
            // Signed levels went in + 128: take 128·Σa of each 32-column part off.
            let off = if B::SIGNED {
                _mm256_slli_epi32::<7>(_mm256_madd_epi16(ld(&act[k].bsums), _mm256_set1_epi16(1)))
            } else {
                _mm256_setzero_si256()
            };
            for i in 0..R {
                let s = if B::SIGNED { _mm256_sub_epi32(s[i][k], off) } else { s[i][k] };
                acc[i][t + k] = per32(B::NO_MINS, keep, acc[i][t + k], s, sc[i], da, m);
            }
        }
    }
}

/// One tile of a [`KBlock::PER32`] type: `NT` tokens at a time share each register of a
/// block's rows (decoded once per token tile into `dec`, or where used for one token), the
/// rest in one group ([`groups`]); accumulators set by the first block and added to in block
/// order as [`super::kquant()`] does: the results are bit for bit those of the AVX2 kernels.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn vnni_k32<D: Dp, B: KBlock, const NT: usize, const TC: usize, const A: usize>(
    tile: &Tile<'_, ActK>,
    out: &mut [[f32; R]],
    mut dec: Option<&mut [DecK; R]>,
    acc: &mut [[__m256; A]; R],
) {
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<TC>(n) {
        for b in 0..tile.nb {
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            // SAFETY (whole loop): the callers' contract, as above.
            let sc = array!(unsafe { (_mm256_setzero_ps(), _mm256_setzero_ps()) }; R, |i| unsafe { blk[i].prep32() });
            if let Some(d) = dec.as_deref_mut() {
                for i in 0..R {
                    for r in 0..REGS {
                        unsafe { _mm256_store_si256(d[i].v[r].as_mut_ptr().cast(), blk[i].ureg(r)) };
                    }
                }
            }
            let (act, dec) = (&acts[b * n + t0..b * n + t0 + tn], dec.as_deref());
            let keep = keep(b);
            groups!(NT, tn, |K, t| unsafe { k32_tokens::<D, B, K, A>(&blk, dec, &sc, &act[t..], acc, t, keep) });
        }
        // SAFETY: AVX by the callers' contract.
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// `vpdpbusd` for the 32-column kernel: both halves of a pair into i32 lanes of 4 columns.
struct Dpbusd<D>(PhantomData<D>);

impl<D: Dp> PairSums for Dpbusd<D> {
    const I32: bool = true;
    #[inline(always)]
    unsafe fn sums(lo: __m256i, aa: __m256i, hi: __m256i, ab: __m256i) -> __m256i {
        // SAFETY: `D`'s features by the caller's contract.
        unsafe { D::dp(D::dp(_mm256_setzero_si256(), lo, aa), hi, ab) }
    }
}

/// [`super::dots`] for a matrix packed for VNNI encoding `v`.
///
/// # Safety
/// As [`super::dots`].
pub(super) unsafe fn dots<const ID: u32>(v: Vnni, raw: &Tile<'_, u8>, out: &mut [[f32; R]], scratch: &mut Scratch) {
    // SAFETY: the caller's contract.
    unsafe {
        match v {
            Vnni::Evex => dots_evex::<ID>(raw, out, scratch),
            Vnni::Vex => dots_vex::<ID>(raw, out, scratch),
        }
    }
}

/// The 32-column types with unsigned levels in encoding `D`: the AVX2 kernel's structure,
/// its pair sums by `vpdpbusd`.
///
/// # Safety
/// As [`super::dots`], `D`'s features present (inlined into functions that enable them).
#[inline(always)]
unsafe fn legacy_dots<D: Dp, const ID: u32>(raw: &Tile<'_, u8>, out: &mut [[f32; R]], scratch: &mut Scratch) {
    // SAFETY (every arm): the caller's contract; act was prepared for this type on VNNI.
    unsafe {
        match const { super::ty::<ID>() } {
            GgmlType::Q4_0 => legacy_tiles::<legacy::Q40, Dpbusd<D>>(raw, out, scratch),
            GgmlType::Q4_1 => legacy_tiles::<legacy::Q41, Dpbusd<D>>(raw, out, scratch),
            GgmlType::Q5_0 => legacy_tiles::<legacy::Q50, Dpbusd<D>>(raw, out, scratch),
            GgmlType::Q5_1 => legacy_tiles::<legacy::Q51, Dpbusd<D>>(raw, out, scratch),
            GgmlType::MXFP4 => legacy_tiles::<legacy::Mxfp4, Dpbusd<D>>(raw, out, scratch),
            t => unreachable!("{t} has no VNNI kernel (vnni::runs)"),
        }
    }
}

/// Each type's kernel with AVX512-VNNI, in 512-bit registers ([`super::on_zmm`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
unsafe fn dots_evex<const ID: u32>(raw: &Tile<'_, u8>, out: &mut [[f32; R]], scratch: &mut Scratch) {
    // SAFETY: this function's features; the caller's contract.
    unsafe {
        macro_rules! k32 {
            ($b:ty) => {
                if !on_zmm::k32_few::<$b>(raw.cast(), out) {
                    on_zmm::dots::<$b>(raw.cast(), out, &mut scratch.pairs, &mut scratch.acc)
                }
            };
        }
        match const { super::ty::<ID>() } {
            GgmlType::Q4_K => k32!(Q4KU),
            GgmlType::Q5_K => k32!(Q5KU),
            GgmlType::IQ4_XS => k32!(Iq4XsU),
            _ => on_zmm::legacy_dots::<ID>(raw.cast(), out, &mut scratch.pairs, &mut scratch.acc),
        }
    }
}

/// Each type's kernel with AVX-VNNI (VEX: 16 registers, 2 tokens a group).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dots_vex<const ID: u32>(raw: &Tile<'_, u8>, out: &mut [[f32; R]], scratch: &mut Scratch) {
    use vnni::Vex;
    const NT: usize = 2;
    // SAFETY (every arm): this function's features; the caller's contract.
    unsafe {
        match const { super::ty::<ID>() } {
            GgmlType::Q8_0 => vnni_q8::<Vex, NT, { 2 * TC }, { 2 * TC }>(raw.cast(), out, &mut scratch.acc),
            GgmlType::Q4_K => vnni_k32::<Vex, Q4KU, NT, { 2 * TC }, { 2 * TC }>(
                raw.cast(),
                out,
                Some(&mut scratch.k),
                &mut scratch.acc,
            ),
            GgmlType::Q5_K => vnni_k32::<Vex, Q5KU, NT, { 2 * TC }, { 2 * TC }>(
                raw.cast(),
                out,
                Some(&mut scratch.k),
                &mut scratch.acc,
            ),
            GgmlType::IQ4_XS => vnni_k32::<Vex, Iq4XsU, NT, { 2 * TC }, { 2 * TC }>(
                raw.cast(),
                out,
                Some(&mut scratch.k),
                &mut scratch.acc,
            ),
            _ => legacy_dots::<Vex, ID>(raw, out, scratch),
        }
    }
}

/// [`super::gemv`] for a matrix packed for VNNI encoding `v`.
///
/// # Safety
/// As [`super::gemv`].
pub(super) unsafe fn gemv<const ID: u32>(v: Vnni, w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe {
        match v {
            Vnni::Evex => gemv_evex::<ID>(w, rows, act, out),
            Vnni::Vex => gemv_vex::<ID>(w, rows, act, out),
        }
    }
}

/// Each type's one-token kernel in encoding `D`.
///
/// # Safety
/// As [`super::gemv`], `D`'s features present (inlined into functions that enable them).
#[inline(always)]
unsafe fn gemv_in<D: Dp, const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    macro_rules! l {
        ($b:ty) => {
            // SAFETY: this function's features; `act` holds one token prepared for the type (the
            // caller's contract).
            one_token_tiles!(w, rows, act, out, ActG8, |tile, res| unsafe {
                legacy_with::<1, 1, $b, Dpbusd<D>>(&tile, &mut res, &mut [[_mm256_setzero_ps(); 1]; R])
            })
        };
    }
    macro_rules! k {
        ($b:ty) => {
            // SAFETY: this function's features; `act` holds one token prepared for the type (the
            // caller's contract).
            one_token_tiles!(w, rows, act, out, ActK, |tile, res| unsafe {
                vnni_k32::<D, $b, 1, 1, 1>(&tile, &mut res, None, &mut [[_mm256_setzero_ps(); 1]; R])
            })
        };
    }
    // SAFETY (every arm): the caller's contract; act was prepared for this type on VNNI.
    match const { super::ty::<ID>() } {
        GgmlType::Q8_0 => one_token_tiles!(w, rows, act, out, ActV8, |tile, res| unsafe {
            vnni_q8::<D, 1, 1, 1>(&tile, &mut res, &mut [[_mm256_setzero_ps(); 1]; R])
        }),
        GgmlType::Q4_0 => l!(legacy::Q40),
        GgmlType::Q4_1 => l!(legacy::Q41),
        GgmlType::Q5_0 => l!(legacy::Q50),
        GgmlType::Q5_1 => l!(legacy::Q51),
        GgmlType::MXFP4 => l!(legacy::Mxfp4),
        GgmlType::Q4_K => k!(Q4KU),
        GgmlType::Q5_K => k!(Q5KU),
        GgmlType::IQ4_XS => k!(Iq4XsU),
        t => unreachable!("{t} has no VNNI kernel (vnni::runs)"),
    }
}

/// [`gemv_in`] with AVX512-VNNI.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
unsafe fn gemv_evex<const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    unsafe {
        match const { super::ty::<ID>() } {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::MXFP4 | GgmlType::Q8_0 => {
                on_zmm::legacy_gemv::<ID>(w, rows, act, out)
            }
            _ => gemv_in::<vnni::Evex, ID>(w, rows, act, out),
        }
    }
}

/// [`gemv_in`] with AVX-VNNI.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn gemv_vex<const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { gemv_in::<vnni::Vex, ID>(w, rows, act, out) }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use kt_core::aligned::AlignedBuf;
    use kt_core::ggml::{random_matrix, GgmlType};
    use kt_core::rng::SplitMix64;

    use super::super::{Kernels, Packed, Scratch, R};
    use crate::vnni::{self, Vnni};

    /// The AVX-VNNI (VEX) kernels, which a CPU that also has AVX512-VNNI never selects, bit
    /// for bit against the AVX2 ones, at one token and several (a full group, a rest, several
    /// token tiles), on a tile of fewer than `R` rows too.
    #[test]
    fn vex_kernels_match_avx2_bit_for_bit() {
        if !is_x86_feature_detected!("avxvnni") || !is_x86_feature_detected!("f16c") {
            eprintln!("this CPU has no AVX-VNNI: its kernels are not tested here");
            return;
        }
        let (rows, cols) = (6, 512);
        for &t in GgmlType::ALL.iter().filter(|&&t| vnni::runs(t)) {
            let m = random_matrix(t, rows, cols, 5);
            for n in [1, 2, 3, 7, 70] {
                let mut r = SplitMix64::new(n as u64);
                let x: Vec<bf16> = (0..n * cols).map(|_| bf16::from_f32(r.gaussian())).collect();
                let ids: Vec<u32> = (0..n as u32).collect();
                let y = |v: Option<Vnni>| {
                    let w = Packed::new(t, rows, cols, m.data(), v);
                    let mut act = AlignedBuf::zeroed(crate::act::bytes(t, n, cols, v));
                    let mut y = vec![0u32; n * rows];
                    // SAFETY: AVX2/FMA/F16C and AVX-VNNI checked above; act prepared for w.
                    unsafe {
                        let mut xs = vec![0u8; crate::act::scratch_bytes(cols)];
                        let kind = crate::act::layout(t, v);
                        crate::act::prepare(t, cols, &x, &ids, act.as_mut_slice(), kind, &mut xs);
                        if n == 1 {
                            let mut out = vec![0.0f32; rows];
                            (Kernels::of(t).gemv)(&w, 0..rows, act.as_mut_slice(), &mut out);
                            y.iter_mut().zip(&out).for_each(|(y, o)| *y = o.to_bits());
                        } else {
                            let mut bytes = AlignedBuf::zeroed(size_of::<Scratch>());
                            let (mut out, (scratch, _)) =
                                (vec![[0.0f32; R]; n], Scratch::from_bytes(bytes.as_mut_slice()));
                            for r0 in (0..rows).step_by(R) {
                                let nr = R.min(rows - r0);
                                (Kernels::of(t).panel_run)(&w, r0, nr, act.as_mut_slice(), n, &mut out, scratch);
                                for (tok, o) in out.iter().enumerate() {
                                    for i in 0..nr {
                                        y[tok * rows + r0 + i] = o[i].to_bits();
                                    }
                                }
                            }
                        }
                    }
                    y
                };
                assert_eq!(y(Some(Vnni::Vex)), y(None), "{t:?} n{n}");
            }
        }
    }
}
