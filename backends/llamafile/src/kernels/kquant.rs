//! The 256-column types (K-quants, iq4_xs, the lattice types) on AVX2: each block's levels
//! decoded once per tile ([`DecK`] for several tokens, registers for one) and dotted by
//! `maddubs`, folded in i16 and scaled per 16 columns by one `madd` (or per 32 in f32 for the
//! [`KBlock::PER32`] types).

use super::*;

/// One block's levels `blk` with its activations `a`, as i32 lanes already scaled per 16
/// columns by `sc`: pair sums added in i16, [`KBlock::FOLD`] registers at a time, then one
/// `madd` with the scales per fold.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub(super) unsafe fn block_dot<B: KBlock>(blk: &B, a: &ActK, sc: __m256i) -> __m256i {
    // SAFETY: AVX2 in every caller (target_feature functions); loads inside the blocks.
    unsafe {
        let mut sum = _mm256_setzero_si256();
        let whole = if B::WHOLE { blk.regs() } else { [sum; REGS] };
        for f in (0..REGS).step_by(B::FOLD) {
            let mut p = pair_sums(B::SIGNED, reg_of(blk, &whole, f), ld(&a.qs[32 * f..]));
            for r in f + 1..f + B::FOLD {
                p = _mm256_add_epi16(p, pair_sums(B::SIGNED, reg_of(blk, &whole, r), ld(&a.qs[32 * r..])));
            }
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, sc));
        }
        sum
    }
}

/// A [`KBlock::PER32`] block's step for one row and token: `acc·keep + s·(d·scale)·da −
/// (dmin·min)·(da·Σa)` per 32-column part, `keep` all ones but for a tile's first block
/// (zeros: [`keep`]), `s` the parts' sums of levels times activations, `sc` the block's
/// [`KBlock::prep32`], `(da, m)` the token's [`act32`]. `no_mins` ([`KBlock::NO_MINS`]) leaves
/// the mins term out, and with it the work that made `m`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub(super) unsafe fn per32(
    no_mins: bool,
    keep: __m256,
    acc: __m256,
    s: __m256i,
    (dsc, dmn): (__m256, __m256),
    da: __m256,
    m: __m256,
) -> __m256 {
    // SAFETY: AVX and FMA in every caller (target_feature functions).
    unsafe {
        let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dsc, da), _mm256_and_ps(acc, keep));
        if no_mins {
            return x;
        }
        _mm256_fnmadd_ps(dmn, m, x)
    }
}

/// [`per32`]'s mask for block `b`: the accumulators are not zeroed per tile ([`Acc`]), so the
/// first block clears what they held, as a mask rather than a branch (with `add_product`'s
/// branch LLVM no longer unrolled the VNNI kernel's token loop and spilled its sums).
#[inline(always)]
pub(super) fn keep(b: usize) -> __m256 {
    // SAFETY: AVX in every caller (target_feature functions).
    unsafe { _mm256_castsi256_ps(_mm256_set1_epi32(-i32::from(b != 0))) }
}

/// An activation block's scale and `da·Σa` of each 32 columns, for [`per32`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub(super) unsafe fn act32(a: &ActK) -> (__m256, __m256) {
    // SAFETY: AVX2 in every caller (target_feature functions); the sums are 32 bytes.
    unsafe {
        let da = _mm256_set1_ps(a.d);
        let sums = _mm256_madd_epi16(ld(&a.bsums), _mm256_set1_epi16(1));
        (da, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), da))
    }
}

/// K-quants for one token, rows `rows` ([`gemv`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn kquant1<B: KBlock>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    one_token_tiles!(w, rows, act, out, ActK, |tile, res| unsafe { kquant1_tile::<B>(&tile, &mut res) })
}

/// One tile of [`kquant1`]: every register decoded in place and used at once, a row at a time
/// ([`block_dot`]; measured faster than a register at a time for all rows).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn kquant1_tile<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (mut acc, acts) = ([_mm256_setzero_ps(); R], tile.act());
    for b in 0..tile.nb {
        prefetch_next(tile, b);
        let a = &acts[b];
        let da = _mm256_set1_ps(a.d);
        // SAFETY (whole loop): AVX2/FMA/F16C present (this function's features); loads stay
        // inside the blocks' arrays.
        if B::PER32 {
            let (da, m) = unsafe { act32(a) };
            for i in 0..R {
                let blk = &blocks[i][b];
                let s = unsafe { block_dot(blk, a, _mm256_set1_epi16(1)) };
                acc[i] = unsafe { per32(B::NO_MINS, keep(b), acc[i], s, blk.prep32(), da, m) };
            }
            continue;
        }
        let bs = unsafe { ld(&a.bsums) };
        // The lattice types take the token's values in row order, turned once for the tile's
        // rows, and skip the turn of each row's levels into the lane layout.
        let rows = match B::ROWS_DOT {
            true => [unsafe { crate::lanes::transpose(array!(bs; REGS, |r| ld(&a.qs[32 * r..]))) }],
            false => [[bs; REGS]],
        };
        for i in 0..R {
            let blk = &blocks[i][b];
            let (sc, mn, d, dmin) = unsafe { blk.prep() };
            let dots = match B::ROWS_DOT {
                true => unsafe { blk.rows_dots(&rows, sc, &[bs])[0] },
                false => unsafe { block_dot(blk, a, sc) },
            };
            if B::NO_MINS {
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(_mm256_set1_ps(d), da), acc[i]);
                continue;
            }
            let mins = _mm256_madd_epi16(bs, mn);
            if B::MINS_IN_D {
                let x = _mm256_cvtepi32_ps(_mm256_sub_epi32(dots, mins));
                acc[i] = _mm256_fmadd_ps(x, _mm256_mul_ps(_mm256_set1_ps(d), da), acc[i]);
                continue;
            }
            let (mins, dots) = (_mm256_cvtepi32_ps(mins), _mm256_cvtepi32_ps(dots));
            acc[i] = _mm256_fnmadd_ps(mins, _mm256_mul_ps(_mm256_set1_ps(dmin), da), acc[i]);
            acc[i] = _mm256_fmadd_ps(dots, _mm256_mul_ps(_mm256_set1_ps(d), da), acc[i]);
        }
    }
    // SAFETY: AVX present.
    out[0] = unsafe { hsum4(acc) };
}

/// Two to [`FEW_ROWS`] tokens of a [`KBlock::ROWS_DOT`] type (the lattice types): each
/// block's levels looked up once a row and dotted with every token's values in row order
/// ([`KBlock::rows_dots`]), without [`kquant`](fn@kquant)'s store and reload of the levels; its bits.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn kquant_rows<const TN: usize, B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    debug_assert_eq!(n, TN);
    let mut acc = [[_mm256_setzero_ps(); TN]; R];
    for b in 0..tile.nb {
        prefetch_next(tile, b);
        let (mut rows, mut bs, mut da) =
            ([[_mm256_setzero_si256(); REGS]; TN], [_mm256_setzero_si256(); TN], [0.0; TN]);
        for t in 0..TN {
            let a = &acts[b * n + t];
            // SAFETY (whole loop): AVX2/FMA/F16C present (this function's features); loads stay
            // inside the activation blocks and the weight blocks.
            unsafe {
                bs[t] = ld(&a.bsums);
                rows[t] = crate::lanes::transpose(array!(bs[t]; REGS, |r| ld(&a.qs[32 * r..])));
            }
            da[t] = a.d;
        }
        for i in 0..R {
            let blk = &blocks[i][b];
            let (sc, _, d, _) = unsafe { blk.prep() };
            let dots = unsafe { blk.rows_dots(&rows, sc, &bs) };
            for t in 0..TN {
                // (d · da, then the first block's product or the sum: `kquant`'s order.)
                let s = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_set1_ps(da[t]));
                acc[i][t] = add_product(b == 0, _mm256_cvtepi32_ps(dots[t]), s, acc[i][t]);
            }
        }
    }
    // SAFETY: AVX present.
    unsafe { write_out(&acc, &mut out[..TN]) };
}

/// Most tokens [`kquant_rows`] takes.
pub(super) const FEW_ROWS: usize = 8;

/// [`kquant_rows`] for the tile's `n` tokens (2 to [`FEW_ROWS`]).
///
/// # Safety
/// As [`kquant_rows`].
#[inline(always)]
pub(super) unsafe fn kquant_few<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    // SAFETY: the caller's contract.
    unsafe {
        match tile.n {
            2 => kquant_rows::<2, B>(tile, out),
            3 => kquant_rows::<3, B>(tile, out),
            4 => kquant_rows::<4, B>(tile, out),
            5 => kquant_rows::<5, B>(tile, out),
            6 => kquant_rows::<6, B>(tile, out),
            7 => kquant_rows::<7, B>(tile, out),
            8 => kquant_rows::<8, B>(tile, out),
            n => unreachable!("{n} tokens for kquant_rows"),
        }
    }
}

/// K-quants for several tokens: each block decoded once into [`DecK`] and dotted with
/// `TC` tokens at a time.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn kquant<const TC: usize, B: KBlock>(
    tile: &Tile<'_, ActK>,
    out: &mut [[f32; R]],
    dec: &mut [DecK; R],
    acc: &mut Acc,
) {
    // The ACT_FOLD correction is made with the 16-column scales, after the PER32 branch.
    const { assert!(B::ACT_FOLD == 0 || !B::PER32, "an ACT_FOLD type's scales cover 16 columns") };
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<TC>(n) {
        for b in 0..tile.nb {
            // Block 0 sets the accumulators ([`Acc`]).
            let first = b == 0;
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            // SAFETY (whole loop): as in kquant1; stores stay inside the DecK arrays.
            for i in 0..R {
                let blk = &blocks[i][b];
                let o = &mut dec[i];
                let (sc, mn, d, dmin) = unsafe { blk.prep() };
                let whole = if B::WHOLE { unsafe { blk.regs() } } else { [sc; REGS] };
                let mut corr = _mm256_setzero_si256();
                for r in 0..REGS {
                    let x = unsafe { reg_of(blk, &whole, r) };
                    unsafe {
                        if B::ACT_FOLD > 0 {
                            // Exact: |128·(w₀ + w₁)| < 2^15 and the lanes far below 2^31.
                            let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(-128), x);
                            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(pairs, sc));
                            _mm256_store_si256(o.w[r].as_mut_ptr().cast(), x);
                        } else if B::SIGNED {
                            _mm256_store_si256(o.v[r].as_mut_ptr().cast(), _mm256_abs_epi8(x));
                            _mm256_store_si256(o.w[r].as_mut_ptr().cast(), x);
                        } else {
                            _mm256_store_si256(o.v[r].as_mut_ptr().cast(), x);
                        }
                    }
                }
                unsafe {
                    if B::PER32 {
                        let (dsc, dmn) = blk.prep32();
                        _mm256_store_ps(o.dsc.as_mut_ptr(), dsc);
                        if !B::NO_MINS {
                            _mm256_store_ps(o.dmn.as_mut_ptr(), dmn);
                        }
                    } else {
                        _mm256_store_si256(o.sc.as_mut_ptr().cast(), sc);
                        _mm256_store_si256(o.mn.as_mut_ptr().cast(), mn);
                    }
                }
                if B::ACT_FOLD > 0 {
                    unsafe { _mm256_store_si256(o.corr.as_mut_ptr().cast(), corr) };
                }
                (o.d, o.dmin) = (d, dmin);
            }
            // The activations unsigned for ACT_FOLD types (`a ^ 0x80 = a + 128`).
            let fold = if B::ACT_FOLD > 0 { B::ACT_FOLD } else { B::FOLD };
            let flip = _mm256_set1_epi8(if B::ACT_FOLD > 0 { -128 } else { 0 });
            for t in 0..tn {
                let a = &acts[b * n + t0 + t];
                let mut isum = [_mm256_setzero_si256(); R];
                for f in (0..REGS).step_by(fold) {
                    let mut p = [_mm256_setzero_si256(); R];
                    for r in f..f + fold {
                        let av = _mm256_xor_si256(unsafe { ld(&a.qs[32 * r..]) }, flip);
                        for i in 0..R {
                            let d = &dec[i];
                            let s = unsafe {
                                if B::ACT_FOLD > 0 {
                                    _mm256_maddubs_epi16(av, ld(&d.w[r]))
                                } else if B::SIGNED {
                                    _mm256_maddubs_epi16(ld(&d.v[r]), _mm256_sign_epi8(av, ld(&d.w[r])))
                                } else {
                                    _mm256_maddubs_epi16(ld(&d.v[r]), av)
                                }
                            };
                            p[i] = _mm256_add_epi16(p[i], s);
                        }
                    }
                    for i in 0..R {
                        // PER32 types' parts are summed unscaled, and scaled in f32 by `per32`.
                        let sc = if B::PER32 { _mm256_set1_epi16(1) } else { unsafe { ld(&dec[i].sc) } };
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p[i], sc));
                    }
                }
                if B::PER32 {
                    let (da, m) = unsafe { act32(a) };
                    for i in 0..R {
                        let d = &dec[i];
                        let sc = unsafe { (_mm256_load_ps(d.dsc.as_ptr()), _mm256_load_ps(d.dmn.as_ptr())) };
                        acc[i][t] = unsafe { per32(B::NO_MINS, keep(b), acc[i][t], isum[i], sc, da, m) };
                    }
                    continue;
                }
                if B::ACT_FOLD > 0 {
                    for i in 0..R {
                        isum[i] = _mm256_sub_epi32(isum[i], unsafe { ld(&dec[i].corr) });
                    }
                }
                let bs = unsafe { ld(&a.bsums) };
                let da = _mm256_set1_ps(a.d);
                for i in 0..R {
                    let d = &dec[i];
                    let s = _mm256_mul_ps(_mm256_set1_ps(d.d), da);
                    let x = add_product(first, _mm256_cvtepi32_ps(isum[i]), s, acc[i][t]);
                    if B::NO_MINS {
                        acc[i][t] = x;
                        continue;
                    }
                    let mins = _mm256_madd_epi16(bs, unsafe { ld(&d.mn) });
                    let m = _mm256_mul_ps(_mm256_set1_ps(d.dmin), da);
                    acc[i][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), m, x);
                }
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use kt_core::aligned::AlignedBuf;
    use kt_core::ggml::{
        random_matrix, BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs,
    };
    use kt_core::rng::SplitMix64;
    use kt_core::{Backend, WeightFormat};

    use super::*;
    use crate::LLAMAFILE_AVX2;

    /// [`kquant_rows`] gives [`kquant`](fn@kquant)'s bits (which the tile and 512-bit kernels repeat) for
    /// `B` at every token count it takes, on a tile of 4 rows and a short one of 3.
    fn check<B: KBlock>(t: GgmlType) {
        let (rows, cols) = (7, 512);
        let m = random_matrix(t, rows, cols, 9);
        let format = WeightFormat::Ggml(t);
        let packed = LLAMAFILE_AVX2.pack(&m).expect("packs");
        let w = &packed.inner::<crate::matrix::Matrix>().w;
        let mut buf = AlignedBuf::zeroed(size_of::<Scratch>());
        let (scratch, _) = Scratch::from_bytes(buf.as_mut_slice());
        for n in 2..=FEW_ROWS {
            let mut r = SplitMix64::new(n as u64);
            let x: Vec<bf16> = (0..n * cols).map(|_| bf16::from_f32(r.gaussian())).collect();
            let ids: Vec<u32> = (0..n as u32).collect();
            let mut act = AlignedBuf::zeroed(LLAMAFILE_AVX2.act_bytes(format, n, cols));
            let mut tmp = AlignedBuf::zeroed(4 * cols * n + 4096);
            LLAMAFILE_AVX2.quantize_act(format, cols, &x, &ids, act.as_mut_slice(), tmp.as_mut_slice());
            for (r0, nr) in [(0, R), (4, 3)] {
                let tile = Tile::<u8>::new(w, r0, nr, act.as_slice(), n);
                let (mut want, mut got) = (vec![[0.0f32; R]; n], vec![[0.0f32; R]; n]);
                // SAFETY: AVX2, FMA and F16C checked by the caller; the activations are `n`
                // tokens of this type's, the tile inside the matrix.
                unsafe {
                    kquant::<TC, B>(tile.cast(), &mut want, &mut scratch.k, &mut scratch.acc);
                    kquant_few::<B>(tile.cast(), &mut got);
                }
                for (tok, (g, w)) in got.iter().zip(&want).enumerate() {
                    let same = g[..nr].iter().zip(&w[..nr]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{t} n {n} rows {r0}+{nr} token {tok}: {g:?} against {w:?}");
                }
            }
        }
    }

    #[test]
    fn few_tokens_in_row_order_give_the_level_stores_bits() {
        kt_core::skip_unless_runs!(&LLAMAFILE_AVX2);
        check::<BlockIq1S>(GgmlType::IQ1_S);
        check::<BlockIq1M>(GgmlType::IQ1_M);
        check::<BlockIq2Xxs>(GgmlType::IQ2_XXS);
        check::<BlockIq2Xs>(GgmlType::IQ2_XS);
        check::<BlockIq2S>(GgmlType::IQ2_S);
        check::<BlockIq3Xxs>(GgmlType::IQ3_XXS);
        check::<BlockIq3S>(GgmlType::IQ3_S);
    }
}
