//! Several tokens on AVX512-VNNI in 512-bit registers: one register holds a register of the
//! lane layout for two rows (the tile's rows in pairs, [`Pairs`]) against each token's
//! activations broadcast to both halves, so one `vpdpbusd` does the work of two 256-bit ones
//! (nearly twice their throughput on a CPU with two 512-bit units) and each f32 step serves two
//! rows. For q4_K, q5_K and iq4_xs ([`KBlock::PER32`], [`dots`]; 2-6 tokens without the
//! level store, [`few`]), q6_K and the lattice types (`vpmaddubsw`, as AVX2 does:
//! [`kquant16`]), q2_K and q3_K (their levels times their 16-column scales, one `vpdpbusd` a
//! register: [`KBlock::SCALED`]; 2-6 tokens without the level store, [`few`]) and the
//! 32-column types ([`legacy()`]: q8_0's bytes, q4_0, q4_1, q5_0,
//! q5_1, mxfp4 and iq4_nl through their tables, q8_0's and iq4_nl's + 128 taken back out of
//! each block's sum, the others' levels packed in q8_0's 4-column lanes, [`quads`]; up to 7
//! tokens without a level store, [`legacy_few`]). One token of q2_K, q3_K and q6_K also runs
//! two rows a register ([`k16_one`], the 256-bit one-token kernel's steps).
//! Lane for lane the operations are those of the 256-bit kernels ([`per32`](super::per32),
//! [`vnni_q8`](super::on_vnni) and [`legacy`](fn@super::legacy)'s f32 steps): the results are
//! bit for bit the AVX2 kernels'.
//! Built from rustc 1.89 only (`build.rs`).

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;
use core::ops::Range;

use kt_core::ggml::GgmlType;

use super::{act32, fresh, hsum4, ld, open_group, prefetch_next, token_tiles, Acc, Packed, Tile, R, TC};
use crate::act::{ActK, ActV8};
use crate::decode::{reg_of, KBlock};
use crate::lanes::REGS;
use crate::legacy::{self, LGroup, Offset};

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

/// The scratch's accumulators as [`Acc2`], for the kernels here.
#[inline(always)]
fn in_pairs(acc: &mut Acc) -> &mut Acc2 {
    debug_assert!((acc.as_ptr() as usize).is_multiple_of(64));
    // SAFETY: `Acc` and `Acc2` are the same 8 KiB of plain data, and the scratch keeps it
    // 64-byte aligned (`Scratch` is, and holds it first).
    unsafe { &mut *(acc as *mut Acc).cast() }
}

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

/// `lo` and `hi` as one register (integers).
///
/// # Safety
/// AVX512F is present (inlined into kernels that enable it).
#[inline(always)]
unsafe fn join_si(lo: __m256i, hi: __m256i) -> __m512i {
    // SAFETY: AVX512F by the callers' contract.
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
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
/// pairs `sc`), added to `acc[p][t..t + K]`, or setting them for a tile's `FIRST` block:
/// [`dp_pairs`], then [`k32_scale`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn tokens<B: KBlock, const K: usize, const FIRST: bool>(
    lv: &Pairs,
    sc: &[(__m512, __m512); R / 2],
    act: &[ActK],
    acc: &mut Acc2,
    t: usize,
) {
    // SAFETY (whole function): AVX512F/VNNI by the callers' contract; loads stay inside the
    // levels and the activation blocks.
    unsafe {
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        dp_pairs(lv, act, |a| &a.qs, &mut s);
        k32_scale::<B, K, _, FIRST>(&s, sc, act, acc, t);
    }
}

/// The f32 steps of a [`KBlock::PER32`] block on `K` tokens' 32-column sums `s` (pairs of rows,
/// row `2p` low; signed levels went in + 128, so 128·Σa of each part comes off):
/// `acc[p][t + k]` plus (or, for a tile's `FIRST` block, set to: an FMA with a zero register,
/// as [`super::per32`] does with its mask, without loading them) `Σ·d·sc·d_a − d·mn·m_a`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn k32_scale<B: KBlock, const K: usize, const A: usize, const FIRST: bool>(
    s: &[[__m512i; K]; R / 2],
    sc: &[(__m512, __m512); R / 2],
    act: &[ActK],
    acc: &mut [[__m512; A]; R / 2],
    t: usize,
) {
    // SAFETY (whole function): AVX2/FMA/AVX512F by the callers' contract; loads stay inside
    // the activation blocks and the accumulators.
    unsafe {
        for k in 0..K {
            let (da, m) = act32(&act[k]);
            let (da, m) = (join(da, da), join(m, m));
            let off = if B::SIGNED {
                let sums = _mm256_madd_epi16(ld(&act[k].bsums), _mm256_set1_epi16(1));
                _mm512_broadcast_i64x4(_mm256_slli_epi32::<7>(sums))
            } else {
                _mm512_setzero_si512()
            };
            for p in 0..R / 2 {
                let (dsc, dmn) = sc[p];
                let kept = if FIRST { _mm512_setzero_ps() } else { acc[p][t + k] };
                let s = if B::SIGNED { _mm512_sub_epi32(s[p][k], off) } else { s[p][k] };
                let x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dsc, da), kept);
                acc[p][t + k] = if B::NO_MINS { x } else { _mm512_fnmadd_ps(dmn, m, x) };
            }
        }
    }
}

/// Each row pair's [`KBlock::prep32`] of block `b`, row `2p` low.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn prep_pairs<B: KBlock>(blk: &[&B; R]) -> [(__m512, __m512); R / 2] {
    // SAFETY: the callers' features.
    unsafe {
        array!((_mm512_setzero_ps(), _mm512_setzero_ps()); R / 2, |p| {
            let ((d0, m0), (d1, m1)) = (blk[2 * p].prep32(), blk[2 * p + 1].prep32());
            (join(d0, d1), join(m0, m1))
        })
    }
}

/// [`super::dots`] for a [`KBlock::PER32`] type on AVX512-VNNI: `NT` tokens at a time, the
/// rest in one group, each block's levels decoded once per token tile into `lv`.
///
/// # Safety
/// As [`super::dots`]; AVX512F, AVX512BW, AVX512VL and AVX512-VNNI must be present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dots<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]], lv: &mut Pairs, acc: &mut Acc) {
    let acc = in_pairs(acc);
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for b in 0..tile.nb {
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            // SAFETY (whole loop): this function's features; stores stay inside `lv`.
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            unsafe { lv.fill(|i, r| blk[i].ureg(r)) };
            let sc = unsafe { prep_pairs(&blk) };
            let act = &acts[b * n + t0..b * n + t0 + tn];
            if b == 0 {
                groups!(NT, tn, |K, t| unsafe { tokens::<B, K, true>(lv, &sc, &act[t..], acc, t) });
            } else {
                groups!(NT, tn, |K, t| unsafe { tokens::<B, K, false>(lv, &sc, &act[t..], acc, t) });
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// A pair of rows' lane sums with one token's 256 values `qs` (in the lane layout): each
/// row's registers `2h | 2h + 1` (`qa`, `qb`, one 512-bit register each) against the token's
/// same two (one 64-byte load, no broadcast) in 4 `vpdpbusd`, the halves (even and odd
/// registers) added: row `a`'s sums in the low lanes, `b`'s in the high, the layout of the
/// several-token kernels' row pairs.
///
/// # Safety
/// AVX512F and AVX512-VNNI are present (inlined into kernels that enable them).
#[inline(always)]
unsafe fn pair_dots(qa: &[__m512i; 4], qb: &[__m512i; 4], qs: &[i8; 256]) -> __m512i {
    // SAFETY: the callers' features; four 64-byte loads inside `qs`.
    unsafe {
        let dot = |q: &[__m512i; 4]| {
            (0..4).fold(_mm512_setzero_si512(), |s, h| {
                _mm512_dpbusd_epi32(s, q[h], _mm512_loadu_si512(qs[64 * h..].as_ptr().cast()))
            })
        };
        let (x, y) = (dot(qa), dot(qb));
        _mm512_add_epi32(_mm512_shuffle_i64x2::<0x44>(x, y), _mm512_shuffle_i64x2::<0xEE>(x, y))
    }
}

/// The f32 steps of a block family in [`few`]: its factors of a block (`prep`), row `i`'s
/// register `r` for [`pair_dots`] (`reg`), and the step on the i32 sums (`scale`).
trait FewSteps<B: KBlock> {
    type Prep;
    /// # Safety
    /// The few-token kernels' features.
    unsafe fn prep(blk: &[&B; R]) -> Self::Prep;
    /// # Safety
    /// As `prep`.
    unsafe fn reg(blk: &B, prep: &Self::Prep, i: usize, r: usize) -> __m256i;
    /// # Safety
    /// As `prep`.
    unsafe fn scale<const K: usize, const FIRST: bool>(
        s: &[[__m512i; K]; R / 2],
        prep: &Self::Prep,
        act: &[ActK],
        acc: &mut [[__m512; K]; R / 2],
    );
}

/// [`KBlock::PER32`] types: [`prep_pairs`], levels unsigned as they are, [`k32_scale`].
struct Per32;

impl<B: KBlock> FewSteps<B> for Per32 {
    type Prep = [(__m512, __m512); R / 2];
    #[inline(always)]
    unsafe fn prep(blk: &[&B; R]) -> Self::Prep {
        // SAFETY: the caller's features.
        unsafe { prep_pairs(blk) }
    }
    #[inline(always)]
    unsafe fn reg(blk: &B, _: &Self::Prep, _: usize, r: usize) -> __m256i {
        // SAFETY: the caller's features.
        unsafe { blk.ureg(r) }
    }
    #[inline(always)]
    unsafe fn scale<const K: usize, const FIRST: bool>(
        s: &[[__m512i; K]; R / 2],
        sc: &Self::Prep,
        act: &[ActK],
        acc: &mut [[__m512; K]; R / 2],
    ) {
        // SAFETY: the caller's features; `K` blocks of activations.
        unsafe { k32_scale::<B, K, K, FIRST>(s, sc, act, acc, 0) }
    }
}

/// [`KBlock::SCALED`] 16-column types: [`k16_prep`], levels [`scaled`], [`k16_scale`].
struct Scaled16;

impl<B: KBlock> FewSteps<B> for Scaled16 {
    type Prep = ([(__m256i, __m256i); R], K16);
    #[inline(always)]
    unsafe fn prep(blk: &[&B; R]) -> Self::Prep {
        // SAFETY: the caller's features.
        unsafe { k16_prep(blk) }
    }
    #[inline(always)]
    unsafe fn reg(blk: &B, (sf, _): &Self::Prep, i: usize, r: usize) -> __m256i {
        // SAFETY: the caller's features.
        unsafe { scaled(blk.reg(r), sf[i]) }
    }
    #[inline(always)]
    unsafe fn scale<const K: usize, const FIRST: bool>(
        s: &[[__m512i; K]; R / 2],
        (_, f): &Self::Prep,
        act: &[ActK],
        acc: &mut [[__m512; K]; R / 2],
    ) {
        // SAFETY: the caller's features; `K` blocks of activations.
        unsafe { k16_scale::<B, K, K, FIRST>(s, f, act, acc, 0) }
    }
}

/// Most tokens of a call the few-token kernels take.
const FEW: usize = 6;

/// A call of 2..=[`FEW`] tokens (an expert's share of a batched decode) of a [`KBlock::PER32`]
/// type on its few-token kernel ([`few`]); false, having done nothing, for other counts.
///
/// # Safety
/// As [`dots`].
#[inline(always)]
pub(super) unsafe fn k32_few<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) -> bool {
    // SAFETY: the caller's contract.
    unsafe { few::<B, Per32>(tile, out) }
}

/// [`few`] for `tile.n` tokens where it is 2..=[`FEW`] (true), else nothing (false).
///
/// # Safety
/// As [`dots`] (or [`kquant16`]) for `S`'s types.
#[inline(always)]
unsafe fn few<B: KBlock, S: FewSteps<B>>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) -> bool {
    const { assert!(FEW == 6, "one arm below for each count up to FEW") };
    // SAFETY: the caller's contract, for `tile.n` tokens.
    unsafe {
        match tile.n {
            2 => few_n::<B, S, 2>(tile, out),
            3 => few_n::<B, S, 3>(tile, out),
            4 => few_n::<B, S, 4>(tile, out),
            5 => few_n::<B, S, 5>(tile, out),
            6 => few_n::<B, S, 6>(tile, out),
            _ => return false,
        }
    }
    true
}

/// [`dots`] (or [`kquant16`]'s scaled path) for a call of `K` ≤ [`FEW`] tokens, with no level
/// store: each row's registers (`S::reg`) two to a 512-bit register for [`pair_dots`], then
/// `S::scale`: the same integer sums in the same f32 steps, so the same bits. In cache
/// 1.2-1.7× [`dots`]' speed at 2-6 tokens; at 7 only q4_K gained, at 8 none.
///
/// # Safety
/// As [`few`], for `K` tokens.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn few_n<B: KBlock, S: FewSteps<B>, const K: usize>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    debug_assert_eq!(tile.n, K);
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let acts = tile.act();
    let mut acc = [[_mm512_setzero_ps(); K]; R / 2];
    for b in 0..tile.nb {
        prefetch_next(tile, b);
        // SAFETY (whole loop): this function's features; loads stay inside the blocks and the
        // tokens' activation blocks (their 256 values in four 64-byte quarters).
        unsafe {
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            let prep = S::prep(&blk);
            let act = &acts[b * K..b * K + K];
            let s = few_sums::<K>(|i, r| S::reg(blk[i], &prep, i, r), act);
            if b == 0 {
                S::scale::<K, true>(&s, &prep, act, &mut acc);
            } else {
                S::scale::<K, false>(&s, &prep, act, &mut acc);
            }
        }
    }
    // SAFETY: this function's features.
    unsafe { write_out(&acc, out) };
}

/// The few-token kernels' i32 sums ([`few_n`]): `K` tokens' [`pair_dots`] with
/// the tile's rows in pairs, row `i`'s register `r` from `reg(i, r)`, two to a 512-bit
/// register, with no level store.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn few_sums<const K: usize>(reg: impl Fn(usize, usize) -> __m256i, act: &[ActK]) -> [[__m512i; K]; R / 2] {
    // SAFETY: the callers' features; `pair_dots` reads inside the `K` activation blocks.
    unsafe {
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        for p in 0..R / 2 {
            let regs = |i: usize| array!(_mm512_setzero_si512(); 4, |h| join_si(reg(i, 2 * h), reg(i, 2 * h + 1)));
            let (qa, qb) = (regs(2 * p), regs(2 * p + 1));
            for k in 0..K {
                s[p][k] = pair_dots(&qa, &qb, &act[k].qs);
            }
        }
        s
    }
}

/// `out[t][i]` = the sum of row `i`'s lanes in `acc[i / 2][t]`, as the 256-bit kernels'
/// `write_out` sums the same four registers.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn write_out<const A: usize>(acc: &[[__m512; A]; R / 2], out: &mut [[f32; R]]) {
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

/// The 16 words `f(0), …, f(15)` as one register.
///
/// # Safety
/// AVX512F is present (inlined into kernels that enable it).
#[inline(always)]
unsafe fn words(f: impl Fn(usize) -> usize) -> __m512i {
    let w = array!(0i32; 16, |l| f(l) as i32);
    // SAFETY: 64 bytes; AVX512F by the caller's contract.
    unsafe { _mm512_loadu_si512(w.as_ptr().cast()) }
}

/// One row's group of a 32-column type with unsigned levels (q8_0's + 128, q4_0, q4_1, q5_0,
/// q5_1, and mxfp4's and iq4_nl's through their tables) in [`ActV8`]'s order, as 4 registers
/// of two: registers 0 | 1, 2 | 3, 4 | 5 and 6 | 7. q8_0's are its 4 × 64 bytes
/// ([`legacy::to_quads`]); the others' group was packed so ([`legacy::to_nibble_quads`]): the
/// low nibbles of its two 64-byte halves are registers 0..4, the high ones 4..8; q5's fifth
/// bits come from their plane (bit `j` of byte `i` for register `j`) by a rotate of each
/// register's bit to bit 4.
///
/// # Safety
/// AVX512F and AVX512BW are present (inlined into kernels that enable them); `g` is one
/// whole group of `L`.
#[inline(always)]
unsafe fn quads<L: LGroup>(g: &[u8]) -> [__m512i; 4] {
    // SAFETY (whole body): AVX512F/BW by the caller's contract; loads stay inside the group
    // (q8_0's 256 bytes, or 128 bytes of nibbles at `L::LEVELS` and q5's 32-byte plane after
    // them).
    unsafe {
        let levels = if L::BYTES {
            256
        } else if L::PLANE {
            160
        } else {
            128
        };
        debug_assert!(g.len() >= L::LEVELS + levels);
        let at = g[L::LEVELS..].as_ptr();
        if L::BYTES {
            return array!(_mm512_setzero_si512(); 4, |q| _mm512_loadu_si512(at.add(64 * q).cast()));
        }
        // Registers 0 | 1 and 4 | 5, then 2 | 3 and 6 | 7.
        let (a, b) = (_mm512_loadu_si512(at.cast()), _mm512_loadu_si512(at.add(64).cast()));
        let low = _mm512_set1_epi8(0x0F);
        let high = |x: __m512i| _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
        let mut out = [_mm512_and_si512(a, low), _mm512_and_si512(b, low), high(a), high(b)];
        if let Some(lut) = L::LUT {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(lut.as_ptr().cast()));
            out = array!(_mm512_setzero_si512(); 4, |q| _mm512_shuffle_epi8(lut, out[q]));
        }
        if L::PLANE {
            let plane = _mm512_broadcast_i64x4(_mm256_loadu_si256(at.add(128).cast()));
            for (q, o) in out.iter_mut().enumerate() {
                // Half h holds register j = 2q + h: its bit j to bit 4 of each byte, by a left
                // rotate of 4 − j (mod 32) of each word (what crosses into a neighbour byte
                // is masked off).
                let rot = words(|l| (4 + 32 - (2 * q + l / 8)) % 32);
                let bits = _mm512_rolv_epi32(plane, rot);
                *o = _mm512_or_si512(*o, _mm512_and_si512(bits, _mm512_set1_epi8(0x10)));
            }
        }
        out
    }
}

/// `K` tokens' dots with one group of a 32-column type's rows (levels in `lv` in
/// [`ActV8`]'s order, the 8 blocks' scales and offsets in pairs `f`), added to
/// `acc[p][t..t + K]` or setting them for a tile's `FIRST` group: 8 `vpdpbusd` a pair and
/// token give the 8 block sums, then [`legacy_scale`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn legacy_tokens<L: LGroup, const K: usize, const FIRST: bool>(
    lv: &Pairs,
    f: &Factors,
    act: &[ActV8],
    acc: &mut Acc2,
    t: usize,
) {
    // SAFETY (whole function): AVX512F/VNNI by the callers' contract; loads stay inside the
    // levels and the activation blocks.
    unsafe {
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        if L::PLUS_128 {
            // Each block's sum starts at -128·Σa, the levels' + 128 taken back out.
            for k in 0..K {
                let neg = _mm512_broadcast_i64x4(ld(&act[k].neg));
                s.iter_mut().for_each(|s| s[k] = neg);
            }
        }
        dp_pairs(lv, act, |a| &a.qs, &mut s);
        legacy_scale::<L, K, _, FIRST>(&s, f, act, acc, t);
    }
}

/// A group's scales `d` and offsets `m` ([`legacy::offset`]) in pairs of rows (row `2p` low).
type Factors = ([__m512; R / 2], [__m512; R / 2]);

/// The [`Factors`] of a group of each row (`grp`, its scales `dw`), as the AVX2 kernel forms
/// them (`m = k·d` by the same multiply).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn factors<L: LGroup>(grp: &[&[u8]; R], dw: &[__m256; R]) -> Factors {
    // SAFETY (whole body): the callers' features; q4_1's and q5_1's offsets follow the scales.
    unsafe {
        let mw = array!(_mm256_setzero_ps(); R, |i| match L::OFFSET {
            Offset::Zero => _mm256_setzero_ps(),
            Offset::OfD(k) => _mm256_mul_ps(dw[i], _mm256_set1_ps(k)),
            Offset::Stored => legacy::scales(grp[i], 2 * legacy::G),
        });
        (
            array!(_mm512_setzero_ps(); R / 2, |p| join(dw[2 * p], dw[2 * p + 1])),
            array!(_mm512_setzero_ps(); R / 2, |p| join(mw[2 * p], mw[2 * p + 1])),
        )
    }
}

/// The f32 steps of the AVX2 kernel ([`super::legacy()`]) on `K` tokens' block sums `s` of a
/// group (pairs of rows, row `2p` low): `acc[p][t + k]` plus (or, for a tile's `FIRST` group,
/// set to) `m·s_a + Σq·d·d_a` of each block.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn legacy_scale<L: LGroup, const K: usize, const A: usize, const FIRST: bool>(
    s: &[[__m512i; K]; R / 2],
    (dw, mw): &Factors,
    act: &[ActV8],
    acc: &mut [[__m512; A]; R / 2],
    t: usize,
) {
    let offset = L::OFFSET != Offset::Zero;
    // SAFETY (whole function): AVX2/FMA/AVX512F by the callers' contract; loads stay inside
    // the activation blocks and the accumulators.
    unsafe {
        for k in 0..K {
            let wide = |x: &[f32; 8]| _mm512_castsi512_ps(_mm512_broadcast_i64x4(ld(x)));
            let (da, sa) = (wide(&act[k].d), wide(&act[k].s));
            for p in 0..R / 2 {
                let mut a = acc[p][t + k];
                if offset {
                    a = if FIRST { _mm512_mul_ps(mw[p], sa) } else { _mm512_fmadd_ps(mw[p], sa, a) };
                }
                let (x, sc) = (_mm512_cvtepi32_ps(s[p][k]), _mm512_mul_ps(dw[p], da));
                acc[p][t + k] = if FIRST && !offset { _mm512_mul_ps(x, sc) } else { _mm512_fmadd_ps(x, sc, a) };
            }
        }
    }
}

/// The 32-column types on AVX512-VNNI, for eight tokens or more (fewer:
/// [`legacy_few`]): each group's levels put in pairs of rows into `lv` once per token tile
/// ([`quads`]), then `NT` tokens at a time, the rest in one group. Block sums and f32 steps
/// are the AVX2 kernel's: so are the results, bit for bit.
///
/// # Safety
/// As [`super::dots`] for a matrix of `L` packed for VNNI with [`ActV8`] activations;
/// AVX512F, AVX512BW, AVX512VL and AVX512-VNNI must be present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn legacy<L: LGroup>(tile: &Tile<'_, ActV8>, out: &mut [[f32; R]], lv: &mut Pairs, acc: &mut Acc2) {
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for g in 0..tile.nb {
            // SAFETY (whole loop): this function's features; loads stay inside the groups,
            // stores inside `lv`.
            let (grp, dw) = unsafe { open_group(tile, t0, g) };
            let f = unsafe { factors::<L>(&grp, &dw) };
            if L::BYTES {
                // Each row's registers copied as they are (the 64-byte loads and shuffles
                // below measured 4% slower at 33 tokens).
                unsafe { lv.fill(|i, r| ld(&grp[i][L::LEVELS + 32 * r..])) };
            } else {
                for p in 0..R / 2 {
                    let (a, b) = unsafe { (quads::<L>(grp[2 * p]), quads::<L>(grp[2 * p + 1])) };
                    for m in 0..4 {
                        // Register 2m of both rows, then 2m + 1.
                        let (even, odd) =
                            (_mm512_shuffle_i64x2::<0x44>(a[m], b[m]), _mm512_shuffle_i64x2::<0xEE>(a[m], b[m]));
                        unsafe { _mm512_store_si512(lv.0[p][2 * m].as_mut_ptr().cast(), even) };
                        unsafe { _mm512_store_si512(lv.0[p][2 * m + 1].as_mut_ptr().cast(), odd) };
                    }
                }
            }
            let act = &acts[g * n + t0..g * n + t0 + tn];
            if g == 0 {
                groups!(NT, tn, |K, t| unsafe { legacy_tokens::<L, K, true>(lv, &f, &act[t..], acc, t) });
            } else {
                groups!(NT, tn, |K, t| unsafe { legacy_tokens::<L, K, false>(lv, &f, &act[t..], acc, t) });
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// [`legacy()`] for a call of `K` ≤ 7 tokens (one, or an expert's share of a batched decode;
/// at 5-7 1.1-1.8× [`legacy()`]'s speed in cache, at 8 no faster), with no level store: each
/// row's [`quads`] (registers 2h | 2h + 1 in one register) for [`pair_dots`], whose row pairs
/// are [`legacy_tokens`]' layout (row `2p` low), then [`legacy_scale`]: the same integer sums
/// in the same f32 steps (one token's from zero, as the AVX2 one-token kernel's; more set by
/// the first group, as [`legacy()`]'s), so the same bits. At one token this is a third of
/// [`legacy()`]'s vector work, whose moves of the levels into `lv` and back were as much work
/// as the dot.
///
/// # Safety
/// As [`legacy()`], for `K` tokens.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn legacy_few<L: LGroup, const K: usize>(tile: &Tile<'_, ActV8>, out: &mut [[f32; R]]) {
    debug_assert_eq!(tile.n, K);
    let acts = tile.act();
    let mut acc = [[_mm512_setzero_ps(); K]; R / 2];
    for g in 0..tile.nb {
        // SAFETY (whole loop): this function's features; loads stay inside the groups and the
        // tokens' activation blocks (their 256 values in four 64-byte quarters).
        unsafe {
            let (grp, dw) = open_group(tile, 0, g);
            let f = factors::<L>(&grp, &dw);
            let act = &acts[g * K..g * K + K];
            let mut s = [[_mm512_setzero_si512(); K]; R / 2];
            for p in 0..R / 2 {
                let (qa, qb) = (quads::<L>(grp[2 * p]), quads::<L>(grp[2 * p + 1]));
                for k in 0..K {
                    let (a, v) = (&act[k], pair_dots(&qa, &qb, &act[k].qs));
                    // Each block's sum from -128·Σa, the levels' + 128 taken back out.
                    s[p][k] = if L::PLUS_128 { _mm512_add_epi32(v, _mm512_broadcast_i64x4(ld(&a.neg))) } else { v };
                }
            }
            if K > 1 && g == 0 {
                legacy_scale::<L, K, K, true>(&s, &f, act, &mut acc, 0);
            } else {
                legacy_scale::<L, K, K, false>(&s, &f, act, &mut acc, 0);
            }
        }
    }
    // SAFETY: this function's features.
    unsafe { write_out(&acc, out) };
}

/// `$f!(L)` with `L` the [`LGroup`] of 32-column type `$t`.
macro_rules! by_lgroup {
    ($t:expr, $f:ident) => {
        match $t {
            GgmlType::Q4_0 => $f!(legacy::Q40),
            GgmlType::Q4_1 => $f!(legacy::Q41),
            GgmlType::Q5_0 => $f!(legacy::Q50),
            GgmlType::Q5_1 => $f!(legacy::Q51),
            GgmlType::MXFP4 => $f!(legacy::Mxfp4),
            GgmlType::IQ4_NL => $f!(legacy::Iq4NlV),
            GgmlType::Q8_0 => $f!(legacy::Q80V),
            t => unreachable!("{t} has no 512-bit 32-column kernel"),
        }
    };
}

/// [`super::dots`] for a 32-column type ([`legacy()`]).
///
/// # Safety
/// As [`legacy()`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn legacy_dots<const ID: u32>(
    tile: &Tile<'_, ActV8>,
    out: &mut [[f32; R]],
    lv: &mut Pairs,
    acc: &mut Acc,
) {
    let acc = in_pairs(acc);
    macro_rules! run {
        ($l:ty) => {
            // SAFETY: the caller's contract.
            unsafe {
                match tile.n {
                    2 => legacy_few::<$l, 2>(tile, out),
                    3 => legacy_few::<$l, 3>(tile, out),
                    4 => legacy_few::<$l, 4>(tile, out),
                    5 => legacy_few::<$l, 5>(tile, out),
                    6 => legacy_few::<$l, 6>(tile, out),
                    7 => legacy_few::<$l, 7>(tile, out),
                    _ => legacy::<$l>(tile, out, lv, acc),
                }
            }
        };
    }
    let t = const { super::ty::<ID>() };
    by_lgroup!(t, run)
}

/// [`super::gemv`] for a 32-column type ([`legacy_few`]).
///
/// # Safety
/// As [`legacy_few`], for one token.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn legacy_gemv<const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    macro_rules! run {
        ($l:ty) => {
            // SAFETY: this function's features; `act` holds one token prepared for the type (the
            // caller's contract).
            one_token_tiles!(w, rows, act, out, ActV8, |tile, res| unsafe { legacy_few::<$l, 1>(&tile, &mut res) })
        };
    }
    let t = const { super::ty::<ID>() };
    by_lgroup!(t, run)
}

/// Registers of levels a [`kquant16`] step folds in i16 before scaling them:
/// [`KBlock::FOLD`], at most 2 (more would hold too many registers across a token group; the
/// i32 sums are exact either way, so the results stay the AVX2 kernel's).
const fn fold16<B: KBlock>() -> usize {
    if B::FOLD < 2 {
        B::FOLD
    } else {
        2
    }
}

/// `K` tokens' dots with one block of a 16-column-scale type's rows (levels in `lv`; per
/// pair the i16 scales `sc` and mins `mn`, and `d`, `dmin` of both rows), added to
/// `acc[p][t..t + K]` or setting them for a tile's `FIRST` block: `maddubs` pair sums folded
/// in i16 ([`fold16`]) and scaled into the i32 sums by one `vpdpwssd` (AVX2's `madd` and add
/// in one; 4-7% faster), then [`super::kquant()`]'s f32 step. A [`KBlock::SCALED`] type's
/// levels are in `lv` scaled, and [`k16_scaled_tokens`] takes them.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn k16_tokens<B: KBlock, const K: usize, const FIRST: bool>(
    lv: &Pairs,
    signs: &Pairs,
    f: &K16,
    act: &[ActK],
    acc: &mut Acc2,
    t: usize,
) {
    // SAFETY (whole function): AVX2/FMA/AVX512F/BW by the callers' contract; loads stay
    // inside the levels, the activation blocks and the accumulators.
    unsafe {
        if B::SCALED.is_some() {
            return k16_scaled_tokens::<B, K, FIRST>(lv, f, act, acc, t);
        }
        let fold = const { fold16::<B>() };
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        for r0 in (0..REGS).step_by(fold) {
            // Read where used, as in [`dp_pairs`].
            let (lv, act) = (&*fresh(lv), &*core::ptr::slice_from_raw_parts(fresh(act.as_ptr()), K));
            let w = array!([_mm512_setzero_si512(); 2]; R / 2, |p| {
                array!(_mm512_setzero_si512(); 2, |j| _mm512_load_si512(lv.0[p][r0 + j % fold].as_ptr().cast()))
            });
            // Signed levels: |w| in `lv`, and each activation negated where w < 0 (AVX2's
            // `vpsignb`, which AVX-512 lacks: a masked subtraction from zero).
            let neg = array!([0; 2]; R / 2, |p| if B::SIGNED {
                array!(0; 2, |j| _mm512_movepi8_mask(_mm512_load_si512(signs.0[p][r0 + j % fold].as_ptr().cast())))
            } else {
                [0; 2]
            });
            for k in 0..K {
                let a = array!(_mm512_setzero_si512(); 2, |j| _mm512_broadcast_i64x4(ld(&act[k].qs[32 * (r0 + j % fold)..])));
                for p in 0..R / 2 {
                    let a = array!(_mm512_setzero_si512(); 2, |j| if B::SIGNED {
                        _mm512_mask_sub_epi8(a[j], neg[p][j], _mm512_setzero_si512(), a[j])
                    } else {
                        a[j]
                    });
                    let mut x = _mm512_maddubs_epi16(w[p][0], a[0]);
                    if fold == 2 {
                        x = _mm512_add_epi16(x, _mm512_maddubs_epi16(w[p][1], a[1]));
                    }
                    s[p][k] = _mm512_dpwssd_epi32(s[p][k], x, f[p].0);
                }
            }
        }
        k16_scale::<B, K, { 2 * TC }, FIRST>(&s, f, act, acc, t);
    }
}

/// [`super::kquant()`]'s f32 step on `K` tokens' i32 sums `s` of a 16-column-scale block (pairs
/// of rows, row `2p` low; `f` as [`k16_tokens`]' but for a [`KBlock::SCALED`] type whose
/// levels went in scaled, `f[p].0` is each 16 columns' `c − o·scale`, and its `Σa` times
/// that comes off first): `acc[p][t + k]` plus (or, for a tile's `FIRST` block, set to)
/// `Σ·d·d_a − mins·dmin·d_a`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn k16_scale<B: KBlock, const K: usize, const A: usize, const FIRST: bool>(
    s: &[[__m512i; K]; R / 2],
    f: &K16,
    act: &[ActK],
    acc: &mut [[__m512; A]; R / 2],
    t: usize,
) {
    let (o, c) = B::SCALED.unwrap_or((0, 0));
    // SAFETY (whole function): AVX2/FMA/AVX512F/BW by the callers' contract; loads stay
    // inside the activation blocks and the accumulators.
    unsafe {
        for k in 0..K {
            let (bs, da) = (_mm512_broadcast_i64x4(ld(&act[k].bsums)), _mm512_set1_ps(act[k].d));
            // With levels offset by `o`, the mins are `o·scale` (q3_K), the fix's complement
            // to `c`: Σa·c less the fix's sum, one `madd` a token for every pair.
            let csum = if o != 0 { _mm512_madd_epi16(bs, _mm512_set1_epi16(c)) } else { _mm512_setzero_si512() };
            for p in 0..R / 2 {
                let (fix, mn, d, dmin) = f[p];
                let fixsum = if (o, c) != (0, 0) { _mm512_madd_epi16(bs, fix) } else { _mm512_setzero_si512() };
                let (x, sd) = (_mm512_cvtepi32_ps(_mm512_sub_epi32(s[p][k], fixsum)), _mm512_mul_ps(d, da));
                let x = if FIRST { _mm512_mul_ps(x, sd) } else { _mm512_fmadd_ps(x, sd, acc[p][t + k]) };
                if B::NO_MINS {
                    acc[p][t + k] = x;
                    continue;
                }
                let mins = if o != 0 { _mm512_sub_epi32(csum, fixsum) } else { _mm512_madd_epi16(bs, mn) };
                let md = if B::MINS_IN_D { sd } else { _mm512_mul_ps(dmin, da) };
                acc[p][t + k] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), md, x);
            }
        }
    }
}

/// [`k16_tokens`] for a [`KBlock::SCALED`] type, its levels scaled in `lv`: [`dp_pairs`] (one
/// `vpdpbusd` a register, as the 32-column-scale types take), then [`k16_scale`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn k16_scaled_tokens<B: KBlock, const K: usize, const FIRST: bool>(
    lv: &Pairs,
    f: &K16,
    act: &[ActK],
    acc: &mut Acc2,
    t: usize,
) {
    // SAFETY: the callers' features; loads inside the levels and the activation blocks.
    unsafe {
        let mut s = [[_mm512_setzero_si512(); K]; R / 2];
        dp_pairs(lv, act, |a| &a.qs, &mut s);
        k16_scale::<B, K, { 2 * TC }, FIRST>(&s, f, act, acc, t);
    }
}

/// A block's factors for the token steps of the tile's rows in pairs ([`k16_scale`]): per
/// pair the i16 factors of each 16 columns (the scales; for a [`KBlock::SCALED`] type,
/// whose levels go in scaled, its `c − o·scale`), the mins, `d` and `dmin`.
type K16 = [(__m512i, __m512i, __m512, __m512); R / 2];

/// Each row's [`KBlock::prep`] of a block as [`K16`], and for a [`KBlock::SCALED`] type each
/// row's scales and `c − o·scale` in both bytes of each word, for [`scaled`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn k16_prep<B: KBlock>(blk: &[&B; R]) -> ([(__m256i, __m256i); R], K16) {
    // SAFETY (whole function): the callers' features.
    unsafe {
        let prep = array!((_mm256_setzero_si256(), _mm256_setzero_si256(), 0.0, 0.0); R, |i| blk[i].prep());
        let fac = array!(_mm256_setzero_si256(); R, |i| match B::SCALED {
            Some((o, c)) => _mm256_sub_epi16(_mm256_set1_epi16(c), _mm256_mullo_epi16(prep[i].0, _mm256_set1_epi16(o))),
            None => prep[i].0,
        });
        let f = array!((_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_ps(), _mm512_setzero_ps()); R / 2, |p| {
            let ((_, mn0, d0, m0), (_, mn1, d1, m1)) = (prep[2 * p], prep[2 * p + 1]);
            let halves = |x: f32, y: f32| join(_mm256_set1_ps(x), _mm256_set1_ps(y));
            (join_si(fac[2 * p], fac[2 * p + 1]), join_si(mn0, mn1), halves(d0, d1), halves(m0, m1))
        });
        let both_bytes = _mm256_set1_epi16(0x0101);
        (array!((fac[0], fac[0]); R, |i| (prep[i].0, _mm256_mullo_epi16(fac[i], both_bytes))), f)
    }
}

/// Register `l` of levels (bytes) times `sc` (the i16 scale of each byte pair's 16 columns)
/// plus `fix` (`c − o·scale`, in 0..=255, [`KBlock::SCALED`], in both bytes of each word),
/// each byte's own product: one `vpmullw` of both bytes of a lane, since the low byte's product
/// plus its `fix` lies in 0..=255 and carries nothing into the high one.
///
/// # Safety
/// AVX2 is present (inlined into kernels that enable it).
#[inline(always)]
unsafe fn scaled(l: __m256i, (sc, fix): (__m256i, __m256i)) -> __m256i {
    // SAFETY: AVX2 by the caller's contract.
    unsafe { _mm256_add_epi16(_mm256_mullo_epi16(l, sc), fix) }
}

/// One token of a 16-column-scale type with unsigned levels (q2_K, q3_K, q6_K) on a tile, two
/// rows a 512-bit register (row `2p` low): each block's registers of both rows meet the
/// token's register broadcast to both halves, [`super::kquant1_tile`]'s i32 sums and f32
/// steps, so its bits.
///
/// # Safety
/// As [`super::kquant1_tile`]; AVX512F, AVX512BW, AVX512VL and AVX512-VNNI must be present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k16_one<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    const { assert!(!B::PER32 && !B::SIGNED && !B::WHOLE && !B::ROWS_DOT && !B::NO_MINS) };
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let acts = tile.act();
    let mut acc = [[_mm512_setzero_ps(); 1]; R / 2];
    for b in 0..tile.nb {
        prefetch_next(tile, b);
        // SAFETY (whole loop): this function's features; loads stay inside the blocks and the
        // token's activation block.
        unsafe {
            let a = &acts[b];
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            let (bs, da) = (_mm512_broadcast_i64x4(ld(&a.bsums)), _mm512_set1_ps(a.d));
            let (sf, f) = k16_prep(&blk);
            for p in 0..R / 2 {
                // The scales themselves (`f`'s are a SCALED type's fix).
                let (sc, (_, mn, d, dmin)) = (join_si(sf[2 * p].0, sf[2 * p + 1].0), f[p]);
                let mut dots = _mm512_setzero_si512();
                for f in (0..REGS).step_by(B::FOLD) {
                    let mut x = _mm512_setzero_si512();
                    for r in f..f + B::FOLD {
                        let w = join_si(blk[2 * p].reg(r), blk[2 * p + 1].reg(r));
                        x = _mm512_add_epi16(x, _mm512_maddubs_epi16(w, _mm512_broadcast_i64x4(ld(&a.qs[32 * r..]))));
                    }
                    dots = _mm512_dpwssd_epi32(dots, x, sc);
                }
                let mins = _mm512_madd_epi16(bs, mn);
                let sd = _mm512_mul_ps(d, da);
                acc[p][0] = if B::MINS_IN_D {
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots, mins)), sd, acc[p][0])
                } else {
                    let x = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, da), acc[p][0]);
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), sd, x)
                };
            }
        }
    }
    // SAFETY: this function's features.
    unsafe { write_out(&acc, out) };
}

/// [`super::gemv`] for q2_K, q3_K and q6_K ([`k16_one`]).
///
/// # Safety
/// As [`super::gemv`] for a matrix of one of those types, packed for AVX512-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn k16_gemv<const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    macro_rules! run {
        ($b:ty) => {
            // SAFETY: this function's features; `act` holds one token prepared for the type (the
            // caller's contract).
            one_token_tiles!(w, rows, act, out, ActK, |tile, res| unsafe { k16_one::<$b>(&tile, &mut res) })
        };
    }
    match const { super::ty::<ID>() } {
        GgmlType::Q2_K => run!(kt_core::ggml::BlockQ2K),
        GgmlType::Q3_K => run!(crate::decode::Q3KU),
        GgmlType::Q6_K => run!(crate::decode::Q6KP),
        t => unreachable!("{t} has no 512-bit one-token kernel"),
    }
}

/// [`super::dots`] for a 256-column type whose scales cover 16 columns (q2_K, q3_K, q6_K, the
/// signed lattice types) in 512-bit registers: [`super::kquant()`]'s integers and f32 steps for
/// two rows a register, `NT` tokens at a time, each block's levels (their magnitudes in `lv`,
/// signed ones in `signs`; q2_K's and q3_K's scaled, [`KBlock::SCALED`]) put in place once per
/// token tile.
///
/// # Safety
/// As [`super::dots`]; AVX512F, AVX512BW, AVX512VL and AVX512-VNNI must be present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn kquant16<B: KBlock>(
    tile: &Tile<'_, ActK>,
    out: &mut [[f32; R]],
    lv: &mut Pairs,
    signs: &mut Pairs,
    acc: &mut Acc,
) {
    const {
        assert!(!B::PER32);
        if let Some((o, _)) = B::SCALED {
            assert!(!B::SIGNED && !B::WHOLE && (o == 0 || B::MINS_IN_D));
        }
    };
    // SAFETY: the caller's contract; 2..=FEW tokens of a scaled type run without level stores.
    if B::SCALED.is_some() && unsafe { few::<B, Scaled16>(tile, out) } {
        return;
    }
    let acc = in_pairs(acc);
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<{ 2 * TC }>(n) {
        for b in 0..tile.nb {
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            // SAFETY (whole loop): this function's features; stores stay inside `lv`.
            let blk = array!(&blocks[0][0]; R, |i| &blocks[i][b]);
            let zeros = [_mm256_setzero_si256(); REGS];
            let whole = array!(zeros; R, |i| if B::WHOLE { unsafe { blk[i].regs() } } else { zeros });
            let (sf, f) = unsafe { k16_prep(&blk) };
            unsafe {
                if B::SCALED.is_some() {
                    lv.fill(|i, r| scaled(blk[i].reg(r), sf[i]));
                } else if B::SIGNED {
                    lv.fill(|i, r| _mm256_abs_epi8(reg_of(blk[i], &whole[i], r)));
                    signs.fill(|i, r| reg_of(blk[i], &whole[i], r));
                } else {
                    lv.fill(|i, r| reg_of(blk[i], &whole[i], r));
                }
            }
            let act = &acts[b * n + t0..b * n + t0 + tn];
            if b == 0 {
                groups!(NT, tn, |K, t| unsafe { k16_tokens::<B, K, true>(lv, signs, &f, &act[t..], acc, t) });
            } else {
                groups!(NT, tn, |K, t| unsafe { k16_tokens::<B, K, false>(lv, signs, &f, &act[t..], acc, t) });
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}
