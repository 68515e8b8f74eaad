//! KT's SwiGLU on vectors: `bf16(silu(bf16(g)) · bf16(u))` with a polynomial exp, 16 lanes
//! at a time, the same results as `kt_core::swiglu` up to one bf16 ulp.

use core::arch::x86_64::*;

use half::bf16;
use kt_core::swiglu::{swiglu, Glu};

/// Round 8 f32 to bf16 (nearest, ties to even), returned as f32 with the low 16 bits clear.
///
/// # Safety
/// The CPU has AVX2 (inlined into [`swiglu16`], whose features it uses).
#[inline(always)]
unsafe fn round_bf16(x: __m256) -> __m256 {
    // SAFETY: register-only AVX2/FMA intrinsics; the inlining caller enables them (this function's
    // `# Safety`).
    unsafe {
        let b = _mm256_castps_si256(x);
        let lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        let r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
        _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(0xFFFF_0000u32 as i32)))
    }
}

/// e^x for x ≤ 88 (Cephes `expf`: range reduction by ln 2 in two parts, degree-5 polynomial;
/// about 1e-7 relative error). Inputs below -87.3 flush to 0.
///
/// # Safety
/// The CPU has AVX2 and FMA (inlined into [`swiglu16`], whose features it uses).
#[inline(always)]
pub unsafe fn exp8(x: __m256) -> __m256 {
    // SAFETY: register-only AVX2/FMA intrinsics; the inlining caller enables them (this function's
    // `# Safety`).
    unsafe {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
        let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(core::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_001e-1] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }
}

/// `bf16(silu(bf16(g)) · bf16(u))` for 16 rows, as bf16 bits: the SwiGLU of `kt_core::swiglu`
/// with a polynomial exp.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn swiglu16(g: &[f32; 16], u: &[f32; 16], out: &mut [u16; 16]) {
    // SAFETY: 16-element arrays, AVX2+FMA enabled here.
    unsafe {
        let one = _mm256_set1_ps(1.0);
        let half = |i: usize| {
            let gv = round_bf16(_mm256_loadu_ps(g.as_ptr().add(i)));
            let uv = round_bf16(_mm256_loadu_ps(u.as_ptr().add(i)));
            let e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.0)));
            let h = round_bf16(_mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
            _mm256_srli_epi32(_mm256_castps_si256(h), 16)
        };
        let packed = _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi32(half(0), half(8)));
        _mm256_storeu_si256(out.as_mut_ptr().cast(), packed);
    }
}

/// `out[i] = swiglu(g[i], u[i])` for every `i`: 16 lanes at a time, the last `len % 16` with the
/// scalar definition.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn swiglu_row(g: &[f32], u: &[f32], out: &mut [bf16]) {
    let n = out.len().min(g.len()).min(u.len());
    let mut c = 0;
    while c + 16 <= n {
        let mut bits = [0u16; 16];
        let (g16, u16s) = (g[c..c + 16].try_into().expect("16"), u[c..c + 16].try_into().expect("16"));
        // SAFETY: AVX2 and FMA by this function's contract.
        unsafe { swiglu16(g16, u16s, &mut bits) };
        for (o, b) in out[c..c + 16].iter_mut().zip(bits) {
            *o = bf16::from_bits(b);
        }
        c += 16;
    }
    for j in c..n {
        out[j] = swiglu(g[j], u[j]);
    }
}

/// [`swiglu16`] for plain SwiGLU, else the layer's clamped variant by its scalar definition
/// (KT's clamped forms are rare: the MX methods only).
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[inline]
pub unsafe fn glu16(glu: Glu, g: &[f32; 16], u: &[f32; 16], out: &mut [u16; 16]) {
    if glu.is_silu() {
        // SAFETY: this function's `# Safety` is the callee's (its features and slices).
        return unsafe { swiglu16(g, u, out) };
    }
    for i in 0..16 {
        out[i] = glu.apply(g[i], u[i]).to_bits();
    }
}

/// [`swiglu_row`] for plain SwiGLU, else the clamped variant (see [`glu16`]).
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[inline]
pub unsafe fn glu_row(glu: Glu, g: &[f32], u: &[f32], out: &mut [bf16]) {
    if glu.is_silu() {
        // SAFETY: this function's `# Safety` is the callee's (its features and slices).
        return unsafe { swiglu_row(g, u, out) };
    }
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = glu.apply(g, u);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avx2_fma() -> bool {
        let here = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if !here {
            kt_core::skip_isa!("AVX2 or FMA");
        }
        here
    }

    #[test]
    fn swiglu16_matches_the_scalar_definition() {
        if !avx2_fma() {
            return;
        }
        let mut r = kt_core::rng::SplitMix64::new(9);
        for round in 0..2000 {
            let scale = [0.1, 1.0, 10.0, 100.0][round % 4];
            let g: [f32; 16] = core::array::from_fn(|_| r.uniform(scale));
            let u: [f32; 16] = core::array::from_fn(|_| r.uniform(scale));
            let mut out = [0u16; 16];
            // SAFETY: AVX2 and FMA checked above.
            unsafe { swiglu16(&g, &u, &mut out) };
            for i in 0..16 {
                let want = swiglu(g[i], u[i]).to_f32();
                let got = bf16::from_bits(out[i]).to_f32();
                // The polynomial exp may move a result across a bf16 rounding boundary: one ulp.
                let ulp = want.abs().max(f32::MIN_POSITIVE) / 128.0;
                assert!((got - want).abs() <= ulp, "g={} u={} got={got} want={want}", g[i], u[i]);
            }
        }
        let mut out = [0u16; 16];
        // Extremes: very negative g gives ~0, very positive g gives g·u.
        // SAFETY: AVX2 and FMA checked above.
        unsafe { swiglu16(&[-1000.0; 16], &[3.0; 16], &mut out) };
        assert!(bf16::from_bits(out[0]).to_f32().abs() < 1e-30);
        // SAFETY: as above.
        unsafe { swiglu16(&[1000.0; 16], &[2.0; 16], &mut out) };
        assert_eq!(bf16::from_bits(out[0]).to_f32(), 2000.0);
    }

    #[test]
    fn swiglu_row_takes_every_length() {
        if !avx2_fma() {
            return;
        }
        let mut r = kt_core::rng::SplitMix64::new(5);
        for n in [0, 1, 15, 16, 17, 40] {
            let g: Vec<f32> = (0..n).map(|_| r.uniform(4.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| r.uniform(4.0)).collect();
            let mut out = vec![bf16::ZERO; n];
            // SAFETY: AVX2 and FMA checked above.
            unsafe { swiglu_row(&g, &u, &mut out) };
            for i in 0..n {
                let want = swiglu(g[i], u[i]).to_f32();
                let ulp = want.abs().max(f32::MIN_POSITIVE) / 128.0;
                assert!((out[i].to_f32() - want).abs() <= ulp, "n{n} i{i}");
            }
        }
    }
}
