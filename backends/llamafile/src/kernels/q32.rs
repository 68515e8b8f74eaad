//! The 32-column types (q4_0, q4_1, q5_0, q5_1, iq4_nl; q8_0 widened to i16) on AVX2, in
//! groups of 8 blocks ([`crate::legacy`]): pair sums per block gathered into one register, one
//! conversion and FMA per group and token.

use super::*;

/// [`legacy`](fn@legacy) for one token, rows `rows` ([`gemv`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy1<L: PairLevels>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    one_token_tiles!(w, rows, act, out, ActG8, |tile, res| unsafe {
        legacy::<1, 1, L>(&tile, &mut res, &mut [[_mm256_setzero_ps(); 1]; R])
    })
}

/// [`wide`] for one token, rows `rows` ([`gemv`]): pieces widened where used, no scratch.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn wide1(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    one_token_tiles!(w, rows, act, out, ActW8, |tile, res| unsafe {
        wide::<1, 1>(&tile, &mut res, &mut [], &mut [[_mm256_setzero_ps(); 1]; R])
    })
}

/// The 32-column types for several tokens: [`legacy_with`] in the accumulator tile that fits `n`.
///
/// # Safety
/// As [`dots`]; `P`'s features present (inlined into functions that enable them).
#[inline(always)]
pub(super) unsafe fn legacy_tiles<L: PairLevels, P: PairSums>(
    raw: &Tile<'_, u8>,
    out: &mut [[f32; R]],
    scratch: &mut Scratch,
) {
    let tile = raw.cast::<ActG8>();
    // SAFETY: the caller's contract.
    unsafe {
        match tile.n {
            ..=4 => legacy_with::<4, 4, L, P>(tile, out, &mut [[_mm256_setzero_ps(); 4]; R]),
            5..=TC => legacy_with::<TC, { 2 * TC }, L, P>(tile, out, &mut scratch.acc),
            _ => legacy_with::<{ 2 * TC }, { 2 * TC }, L, P>(tile, out, &mut scratch.acc),
        }
    }
}

/// How the 32-column kernel sums the products of a pair of blocks with unsigned levels
/// (`lo`, `hi`: columns 0..16 and 16..32 of both) and their activations (`aa`, `ab`).
pub(super) trait PairSums {
    /// The sums come out in i32 lanes (4 columns each), else in i16 (column pairs).
    const I32: bool;
    /// The sums.
    ///
    /// # Safety
    /// The implementation's features must be present (inlined into kernels that enable them).
    unsafe fn sums(lo: __m256i, aa: __m256i, hi: __m256i, ab: __m256i) -> __m256i;
}

/// AVX2: `maddubs` on each half, the halves added in i16 (levels ≤ 31: no overflow).
pub(super) struct Maddubs;

impl PairSums for Maddubs {
    const I32: bool = false;
    #[inline(always)]
    unsafe fn sums(lo: __m256i, aa: __m256i, hi: __m256i, ab: __m256i) -> __m256i {
        // SAFETY: AVX2 by the caller's contract.
        unsafe { _mm256_add_epi16(_mm256_maddubs_epi16(lo, aa), _mm256_maddubs_epi16(hi, ab)) }
    }
}

/// [`legacy_with`] on AVX2.
/// (Inlined into [`legacy1`], whose features are the same.)
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy<const TC: usize, const A: usize, L: PairLevels>(
    tile: &Tile<'_, ActG8>,
    out: &mut [[f32; R]],
    acc: &mut [[__m256; A]; R],
) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { legacy_with::<TC, A, L, Maddubs>(tile, out, acc) }
}

/// 32-column types, repacked ([`crate::legacy`]): per group of 8 blocks, row and token, the 4
/// pairs' sums (`P`; signed levels always by `maddubs` and the sign trick) gathered into one
/// register of 8 block sums, then one multiply-add with the 8 scale products, into `acc`
/// ([`Acc`]). The block sums are exact integers whichever `P`: the results do not depend on it.
///
/// # Safety
/// AVX2, FMA, F16C and `P`'s features must be present (inlined into functions that enable
/// them); the tile's activations are `ActG8` for its type.
#[inline(always)]
#[allow(unused_unsafe)] // It runs inlined: one block for the intrinsics, the inner ones for their notes.
pub(super) unsafe fn legacy_with<const TC: usize, const A: usize, L: PairLevels, P: PairSums>(
    tile: &Tile<'_, ActG8>,
    out: &mut [[f32; R]],
    acc: &mut [[__m256; A]; R],
) {
    // SAFETY (whole body, its inner blocks noting what each relies on): AVX2, FMA, F16C and
    // `P`'s features by the caller's contract; loads stay inside the groups and the activation
    // blocks.
    unsafe {
        let (n, ng, ones, acts) = (tile.n, tile.nb, _mm256_set1_epi16(1), tile.act());
        for (t0, tn) in token_tiles::<TC>(n) {
            for g in 0..ng {
                // `A` = 1 (one token): the caller's zeroed registers, added to; else group 0 sets them.
                let first = A > 1 && g == 0;
                // SAFETY (whole loop): AVX2/FMA/F16C present (the caller's contract); loads stay
                // inside the groups and the activation blocks.
                let (grp, dw) = unsafe { open_group(tile, t0, g) };
                let mw = array!(_mm256_setzero_ps(); R, |i| match L::OFFSET {
                    Offset::Zero => _mm256_setzero_ps(),
                    Offset::OfD(k) => _mm256_mul_ps(dw[i], _mm256_set1_ps(k)),
                    Offset::Stored => unsafe { legacy::scales(grp[i], 2 * legacy::G) },
                });
                // With several tokens, unsigned levels (nibbles, fifth bits) are decoded once for all
                // of them; signed ones (iq4_nl: levels and their magnitudes) cost more registers
                // than they save, so they, and everything for one token, are decoded where used.
                let hoist = TC > 1 && !L::SIGNED;
                let mut lv = [[(_mm256_setzero_si256(), _mm256_setzero_si256()); 4]; R];
                if hoist {
                    for i in 0..R {
                        for p in 0..4 {
                            lv[i][p] = unsafe { L::pair(grp[i], p) };
                        }
                    }
                }
                for t in 0..tn {
                    let a = &acts[g * n + t0 + t];
                    let (da, sa) = unsafe { (_mm256_loadu_ps(a.d.as_ptr()), _mm256_loadu_ps(a.s.as_ptr())) };
                    let sc = array!(_mm256_setzero_ps(); R, |i| _mm256_mul_ps(dw[i], da));
                    let offset = L::OFFSET != Offset::Zero;
                    if offset {
                        for i in 0..R {
                            acc[i][t] = add_product(first, mw[i], sa, acc[i][t]);
                        }
                    }
                    for i in 0..R {
                        let mut parts = [_mm256_setzero_si256(); 4];
                        for p in 0..4 {
                            let (aa, ab) = unsafe { (ld(&a.qs[64 * p..]), ld(&a.qs[64 * p + 32..])) };
                            let (lo, hi) = if hoist { lv[i][p] } else { unsafe { L::pair(grp[i], p) } };
                            parts[p] = if L::SIGNED {
                                let pa = unsafe { pair_sums(true, lo, aa) };
                                let pb = unsafe { pair_sums(true, hi, ab) };
                                _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones))
                            } else if P::I32 {
                                unsafe { P::sums(lo, aa, hi, ab) }
                            } else {
                                // Levels ≤ 31: two pair sums fit in i16 together.
                                let s16 = unsafe { P::sums(lo, aa, hi, ab) };
                                if L::FOUR_BIT {
                                    s16
                                } else {
                                    _mm256_madd_epi16(s16, ones)
                                }
                            };
                        }
                        let v = unsafe {
                            if L::FOUR_BIT && !P::I32 {
                                legacy::block_sums16(parts)
                            } else {
                                legacy::block_sums(parts)
                            }
                        };
                        acc[i][t] = add_product(first && !offset, _mm256_cvtepi32_ps(v), sc[i], acc[i][t]);
                    }
                }
            }
            unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
        }
    }
}

/// Piece `c` (column pair c of the 8 blocks) of a q8_0 group, widened to i16.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub(super) unsafe fn q8_piece(g: &[u8], c: usize) -> __m256i {
    let at = 2 * legacy::G + 16 * c;
    debug_assert!(g.len() >= at + 16);
    // SAFETY: 16 bytes at `at` inside the group; AVX2 by the callers' contract.
    unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(g.as_ptr().add(at).cast())) }
}

/// `x`, through an empty `asm` statement that LLVM must assume changes it, so that the adds
/// into an accumulator stay one after another. Without it the piece loop was unrolled, its adds
/// regrouped into one tree per accumulator, all 16 pieces kept live and spilled; with an opaque
/// trip count instead (the earlier remedy) it kept a loop with a counter of its own, 24 µops a
/// piece where this loop has 23 (q8_0 tiles 1-4% faster in alternated `dots` runs).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn in_order(mut x: __m256i) -> __m256i {
    // SAFETY: an empty statement; it reads and writes only `x`'s register.
    unsafe { core::arch::asm!("/* {0} */", inout(ymm_reg) x, options(pure, nomem, nostack, preserves_flags)) };
    x
}

/// `NT` tokens' dots with one q8_0 group of each row (`widened`: its pieces in `w16`, else
/// widened here), added to `acc[i][t..t + NT]`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn wide_tokens<const NT: usize, const TC: usize>(
    grp: &[&[u8]; R],
    w16: &[W16],
    act: &[ActW8],
    dw: &[__m256; R],
    acc: &mut [[__m256; TC]],
    t: usize,
    widened: bool,
    first: bool,
) {
    // SAFETY (whole function): AVX2/FMA by the callers' features; loads stay inside the
    // groups, the scratch and the activation blocks.
    unsafe {
        let mut s = [[_mm256_setzero_si256(); NT]; R];
        for c in 0..QK / 2 {
            let av = array!(_mm256_setzero_si256(); NT, |k| ld(&act[k].qs[16 * c..]));
            for i in 0..R {
                let w = if widened { ld(&w16[i].0[c]) } else { q8_piece(grp[i], c) };
                for k in 0..NT {
                    s[i][k] = in_order(_mm256_add_epi32(s[i][k], _mm256_madd_epi16(w, av[k])));
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

/// q8_0, repacked ([`crate::legacy`]) and with [`ActW8`] activations: levels widened to i16
/// (once per group for all tokens when there are several), so each 16-value piece is one
/// `madd` whose lanes are the 8 blocks' shares, summed over the group's 16 pieces: no sign
/// trick, no gathering, one conversion and one FMA per group.
/// `w16`: scratch for `R` rows' widened pieces with several tokens, unused (empty) for one;
/// `acc`: the tile's accumulators ([`Acc`]).
/// (Inlined into [`wide1`], whose features are the same.)
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn wide<const TC: usize, const A: usize>(
    tile: &Tile<'_, ActW8>,
    out: &mut [[f32; R]],
    w16: &mut [W16],
    acc: &mut [[__m256; A]; R],
) {
    const PIECES: usize = QK / 2;
    let (n, ng, acts) = (tile.n, tile.nb, tile.act());
    for (t0, tn) in token_tiles::<TC>(n) {
        for g in 0..ng {
            // `A` = 1 (one token): the caller's zeroed registers, added to; else group 0 sets them.
            let first = A > 1 && g == 0;
            // SAFETY (whole loop): AVX2/FMA/F16C present (this function's features); loads stay
            // inside the groups (16 bytes of levels per piece after the 16 of scales), the
            // activation blocks and the scratch.
            let (grp, dw) = unsafe { open_group(tile, t0, g) };
            if TC > 1 {
                for i in 0..R {
                    for c in 0..PIECES {
                        unsafe { _mm256_store_si256(w16[i].0[c].as_mut_ptr().cast(), q8_piece(grp[i], c)) };
                    }
                }
            }
            // Two tokens at a time when there are several: each widened piece, loaded once,
            // serves both (half the weight loads per `madd`; 4 rows × 2 tokens is what fits in
            // the registers).
            let mut t = 0;
            while TC > 1 && t + 2 <= tn {
                unsafe { wide_tokens::<2, A>(&grp, w16, &acts[g * n + t0 + t..], &dw, acc, t, true, first) };
                t += 2;
            }
            if t < tn {
                unsafe { wide_tokens::<1, A>(&grp, w16, &acts[g * n + t0 + t..], &dw, acc, t, TC > 1, first) };
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}
