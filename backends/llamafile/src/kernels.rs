//! Dot kernels: a tile of [`R`] weight rows against every token, [`TC`] tokens at a time.
//! Each weight block is decoded once per tile ([`crate::decode`]) and dotted with the
//! matching block of each token: `maddubs` (u8 levels × i8 activations, pairs summed to i16),
//! `madd` with the scales (K-quants) or with ones (32-column types) to i32, then f32.
//! Every output is computed in block order by one call, whatever the tile: results do not
//! depend on how rows are split over tasks.

use core::arch::x86_64::*;

use bytemuck::Pod;
use kt_core::ggml::{self, ActKind, BlockQ8K, GgmlType, QK, QK_K};

use crate::act::ActQ8;
use crate::decode::{self, Dec32, DecK};

/// Rows per tile.
pub const R: usize = 4;
/// Tokens per accumulator tile (fewer for small batches, whose accumulators then stay in
/// registers).
const TC: usize = 16;

/// A GGML matrix as GGUF stores it: rows of whole blocks, row-major (the original bytes).
#[derive(Debug)]
pub struct Packed {
    /// Its type.
    pub t: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Row-major blocks.
    pub data: Vec<u8>,
}

impl Packed {
    fn row(&self, r: usize) -> &[u8] {
        let rb = self.t.row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn ld<T>(p: &[T]) -> __m256i {
    debug_assert!(size_of_val(p) >= 32);
    // SAFETY: callers pass ≥ 32 bytes.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// Decoded blocks of one tile, reused across calls.
pub struct Scratch {
    k: [DecK; R],
    l: [Dec32; R],
}

impl Scratch {
    /// Fresh buffers.
    pub fn new() -> Box<Self> {
        Box::new(Scratch { k: [DecK::new(); R], l: [Dec32::new(); R] })
    }
}

/// `out[t][i] = row r0+i · token t` for `i < nr ≤ R`, `t < n`, `act` prepared for `w.t`.
///
/// # Safety
/// AVX2 and FMA must be present; `act` must hold `n` tokens prepared by [`crate::act`].
pub unsafe fn dots(
    w: &Packed,
    r0: usize,
    nr: usize,
    act: &[u8],
    n: usize,
    out: &mut [[f32; R]],
    scratch: &mut Scratch,
) {
    debug_assert!((1..=R).contains(&nr) && r0 + nr <= w.rows);
    let rows: [&[u8]; R] = core::array::from_fn(|i| w.row(r0 + i.min(nr - 1)));
    let (dk, d32) = (&mut scratch.k, &mut scratch.l);
    macro_rules! k {
        ($signed:literal, $b:ty, $f:path) => {{
            let a = bytemuck::cast_slice(act);
            let nb = w.cols / QK_K;
            // SAFETY: the caller's contract; act holds [blocks][n] BlockQ8K.
            unsafe {
                match n {
                    1 => kquant::<$signed, 1, $b>(rows, nr, nb, a, n, out, $f, dk),
                    2..=4 => kquant::<$signed, 4, $b>(rows, nr, nb, a, n, out, $f, dk),
                    _ => kquant::<$signed, TC, $b>(rows, nr, nb, a, n, out, $f, dk),
                }
            }
        }};
    }
    macro_rules! l {
        ($signed:literal, $b:ty, $f:path) => {{
            let a = bytemuck::cast_slice(act);
            let nb = w.cols / QK;
            // SAFETY: the caller's contract; act holds [blocks][n] ActQ8.
            unsafe {
                match n {
                    1 => legacy::<$signed, 1, $b>(rows, nr, nb, a, n, out, $f, d32),
                    2..=4 => legacy::<$signed, 4, $b>(rows, nr, nb, a, n, out, $f, d32),
                    _ => legacy::<$signed, TC, $b>(rows, nr, nb, a, n, out, $f, d32),
                }
            }
        }};
    }
    match w.t {
        GgmlType::Q2_K => k!(false, ggml::BlockQ2K, decode::q2_k),
        GgmlType::Q3_K => k!(false, ggml::BlockQ3K, decode::q3_k),
        GgmlType::Q4_K => k!(false, ggml::BlockQ4K, decode::q4_k),
        GgmlType::Q5_K => k!(false, ggml::BlockQ5K, decode::q5_k),
        GgmlType::Q6_K => k!(false, ggml::BlockQ6K, decode::q6_k),
        GgmlType::IQ4_XS => k!(true, ggml::BlockIq4Xs, decode::iq4_xs),
        GgmlType::Q4_0 => l!(false, ggml::BlockQ4_0, decode::q4_0),
        GgmlType::Q4_1 => l!(false, ggml::BlockQ4_1, decode::q4_1),
        GgmlType::Q5_0 => l!(false, ggml::BlockQ5_0, decode::q5_0),
        GgmlType::Q5_1 => l!(false, ggml::BlockQ5_1, decode::q5_1),
        GgmlType::Q8_0 => l!(true, ggml::BlockQ8_0, decode::q8_0),
        GgmlType::IQ4_NL => l!(true, ggml::BlockIq4Nl, decode::iq4_nl),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            debug_assert_eq!(w.t.act(), ActKind::F32);
            // SAFETY: the caller's contract; act holds [n][cols] f32.
            unsafe { float(w.t, rows, nr, w.cols, bytemuck::cast_slice(act), n, out) }
        }
    }
}

/// Prefetch the `b`-th of `nb` slices of the `len` bytes at `next` (the next tile's rows):
/// a tile's rows are short streams that the hardware prefetcher does not ramp up on.
#[inline(always)]
fn prefetch_slice(next: *const u8, len: usize, b: usize, nb: usize) {
    let step = len.div_ceil(nb).next_multiple_of(64);
    let mut off = b * step;
    while off < ((b + 1) * step).min(len) {
        // SAFETY: prefetching has no architectural effect and does not fault, whatever the
        // address (the pointer is never dereferenced).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// `maddubs` of 32 levels with 32 activations: `|w|·sign(a, w)` for signed levels.
#[inline(always)]
unsafe fn pair_sums<const SIGNED: bool>(v: &[u8], w: &[i8], a: __m256i) -> __m256i {
    // SAFETY: AVX2 in every caller (target_feature functions); 32-byte chunks.
    unsafe {
        if SIGNED {
            _mm256_maddubs_epi16(ld(v), _mm256_sign_epi8(a, ld(w)))
        } else {
            _mm256_maddubs_epi16(ld(v), a)
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn kquant<const SIGNED: bool, const TC: usize, B: Pod>(
    rows: [&[u8]; R],
    nr: usize,
    nb: usize,
    act: &[BlockQ8K],
    n: usize,
    out: &mut [[f32; R]],
    dec_fn: unsafe fn(&B, &mut DecK),
    dec: &mut [DecK; R],
) {
    let blocks: [&[B]; R] = rows.map(|r| bytemuck::cast_slice(r));
    let (next, len) = (rows[0].as_ptr().wrapping_add(R * rows[0].len()), R * rows[0].len());
    for t0 in (0..n).step_by(TC) {
        let tn = TC.min(n - t0);
        let mut acc = [[_mm256_setzero_ps(); TC]; R];
        for b in 0..nb {
            if t0 == 0 {
                prefetch_slice(next, len, b, nb);
            }
            for i in 0..R {
                // SAFETY: AVX2 present (this function's features).
                unsafe { dec_fn(&blocks[i][b], &mut dec[i]) };
            }
            for t in 0..tn {
                let a = &act[b * n + t0 + t];
                let mut isum = [_mm256_setzero_si256(); R];
                for c in 0..8 {
                    // SAFETY: 32-byte chunks of 256-byte arrays.
                    let av = unsafe { ld(&a.qs[32 * c..]) };
                    for i in 0..R {
                        let d = &dec[i];
                        // SAFETY: as above.
                        let p = unsafe { pair_sums::<SIGNED>(&d.v[32 * c..], &d.w[32 * c..], av) };
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p, unsafe { ld(&d.sc[c]) }));
                    }
                }
                // SAFETY: 16 i16 sums.
                let bs = unsafe { ld(&a.bsums) };
                let da = _mm256_set1_ps(a.d);
                for i in 0..R {
                    let d = &dec[i];
                    // SAFETY: 16 i16 mins.
                    let mins = _mm256_madd_epi16(bs, unsafe { ld(&d.mn) });
                    let s = _mm256_mul_ps(_mm256_set1_ps(d.d), da);
                    let m = _mm256_mul_ps(_mm256_set1_ps(d.dmin), da);
                    let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), s, acc[i][t]);
                    acc[i][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), m, x);
                }
            }
        }
        for (t, o) in out[t0..t0 + tn].iter_mut().enumerate() {
            for i in 0..nr {
                // SAFETY: AVX present.
                o[i] = unsafe { hsum(acc[i][t]) };
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn legacy<const SIGNED: bool, const TC: usize, B: Pod>(
    rows: [&[u8]; R],
    nr: usize,
    nb: usize,
    act: &[ActQ8],
    n: usize,
    out: &mut [[f32; R]],
    dec_fn: unsafe fn(&B, &mut Dec32),
    dec: &mut [Dec32; R],
) {
    let blocks: [&[B]; R] = rows.map(|r| bytemuck::cast_slice(r));
    let (next, len) = (rows[0].as_ptr().wrapping_add(R * rows[0].len()), R * rows[0].len());
    let ones = _mm256_set1_epi16(1);
    for t0 in (0..n).step_by(TC) {
        let tn = TC.min(n - t0);
        let mut acc = [[_mm256_setzero_ps(); TC]; R];
        let mut offs = [[0.0f32; TC]; R];
        for b in 0..nb {
            if t0 == 0 {
                prefetch_slice(next, len, b, nb);
            }
            for i in 0..R {
                // SAFETY: AVX2 present (this function's features).
                unsafe { dec_fn(&blocks[i][b], &mut dec[i]) };
            }
            for t in 0..tn {
                let a = &act[b * n + t0 + t];
                // SAFETY: 32 activations.
                let av = unsafe { ld(&a.qs) };
                for i in 0..R {
                    let d = &dec[i];
                    // SAFETY: 32-byte arrays.
                    let p = unsafe { pair_sums::<SIGNED>(&d.v, &d.w, av) };
                    let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                    acc[i][t] = _mm256_fmadd_ps(s, _mm256_set1_ps(d.d * a.d), acc[i][t]);
                    offs[i][t] += d.m * a.s;
                }
            }
        }
        for (t, o) in out[t0..t0 + tn].iter_mut().enumerate() {
            for i in 0..nr {
                // SAFETY: AVX present.
                o[i] = unsafe { hsum(acc[i][t]) } + offs[i][t];
            }
        }
    }
}

/// Float rows: each row converted to f32 once, then dotted with every token.
#[target_feature(enable = "avx2,fma")]
unsafe fn float(t: GgmlType, rows: [&[u8]; R], nr: usize, cols: usize, act: &[f32], n: usize, out: &mut [[f32; R]]) {
    let mut buf = vec![0.0f32; nr * cols];
    for (i, b) in buf.chunks_exact_mut(cols).enumerate() {
        let src = rows[i];
        let mut c = 0;
        if t == GgmlType::F16 {
            while c + 8 <= cols {
                // SAFETY: 16 bytes of src and 8 floats of b at c.
                unsafe {
                    let h = _mm_loadu_si128(src.as_ptr().add(2 * c).cast());
                    _mm256_storeu_ps(b.as_mut_ptr().add(c), _mm256_cvtph_ps(h));
                }
                c += 8;
            }
        }
        ggml::dequantize_row(t, &src[c * t.block_bytes()..], &mut b[c..]);
    }
    for (tok, o) in out[..n].iter_mut().enumerate() {
        let x = &act[tok * cols..(tok + 1) * cols];
        for (i, w) in buf.chunks_exact(cols).enumerate() {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c + 32 <= cols {
                for (k, a) in acc.iter_mut().enumerate() {
                    // SAFETY: c + 8k + 8 ≤ cols for both slices.
                    unsafe {
                        let wv = _mm256_loadu_ps(w.as_ptr().add(c + 8 * k));
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(c + 8 * k)), *a);
                    }
                }
                c += 32;
            }
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            // SAFETY: AVX present.
            let mut s = unsafe { hsum(v) };
            for j in c..cols {
                s += w[j] * x[j];
            }
            o[i] = s;
        }
    }
}
