//! Vectors of f32 that the direct loop ([`crate::direct`]) keeps its chains in: the compiler
//! keeps a loop's `[f32; NR]` accumulators in memory, these in registers. A panel's NR rows
//! are `NR / W` lanes of `W` floats.

/// A vector of [`Lane::W`] floats.
pub trait Lane: Copy {
    /// Floats a lane holds.
    const W: usize;
    fn zero() -> Self;
    fn splat(x: f32) -> Self;
    /// `src[..W]`.
    fn load(src: &[f32]) -> Self;
    /// Into `dst[..W]`.
    fn store(self, dst: &mut [f32]);
    /// `acc + x·w`, rounded once (the microkernel's step where its sums are [`crate::library::Sums::Fused`]).
    fn fma(acc: Self, x: Self, w: Self) -> Self;
}

/// x86 lanes. Only code compiled for the lane's instructions (`direct`'s `target_feature`
/// functions, entered where the CPU has them) uses them.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::incompatible_msrv)] // (AVX-512's, below)
mod x86 {
    use core::arch::x86_64::*;

    use super::Lane;

    macro_rules! lane {
        ($t:ty, $w:literal, $zero:ident, $set1:ident, $load:ident, $store:ident, $fma:ident) => {
            impl Lane for $t {
                const W: usize = $w;
                #[inline(always)]
                fn zero() -> $t {
                    // SAFETY: used only where the CPU has the lane's instructions (above).
                    unsafe { $zero() }
                }
                #[inline(always)]
                fn splat(x: f32) -> $t {
                    // SAFETY: as in zero.
                    unsafe { $set1(x) }
                }
                #[inline(always)]
                fn load(src: &[f32]) -> $t {
                    let src = &src[..$w];
                    // SAFETY: src holds W floats; as in zero.
                    unsafe { $load(src.as_ptr()) }
                }
                #[inline(always)]
                fn store(self, dst: &mut [f32]) {
                    let dst = &mut dst[..$w];
                    // SAFETY: dst holds W floats; as in zero.
                    unsafe { $store(dst.as_mut_ptr(), self) }
                }
                #[inline(always)]
                fn fma(acc: $t, x: $t, w: $t) -> $t {
                    // SAFETY: as in zero.
                    unsafe { $fma(x, w, acc) }
                }
            }
        };
    }

    lane!(__m128, 4, _mm_setzero_ps, _mm_set1_ps, _mm_loadu_ps, _mm_storeu_ps, _mm_fmadd_ps);
    lane!(__m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps);
    // The 1.89 intrinsics are compiled only where build.rs found rustc ≥ 1.89.
    #[cfg(avx512_intrinsics)]
    lane!(__m512, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps);
}

/// NEON's lane (in aarch64's baseline).
#[cfg(target_arch = "aarch64")]
impl Lane for core::arch::aarch64::float32x4_t {
    const W: usize = 4;
    #[inline(always)]
    fn zero() -> Self {
        // SAFETY: NEON is in aarch64's baseline.
        unsafe { core::arch::aarch64::vdupq_n_f32(0.0) }
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: as in zero.
        unsafe { core::arch::aarch64::vdupq_n_f32(x) }
    }
    #[inline(always)]
    fn load(src: &[f32]) -> Self {
        let src = &src[..4];
        // SAFETY: src holds 4 floats; as in zero.
        unsafe { core::arch::aarch64::vld1q_f32(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        let dst = &mut dst[..4];
        // SAFETY: dst holds 4 floats; as in zero.
        unsafe { core::arch::aarch64::vst1q_f32(dst.as_mut_ptr(), self) }
    }
    #[inline(always)]
    fn fma(acc: Self, x: Self, w: Self) -> Self {
        // SAFETY: as in zero.
        unsafe { core::arch::aarch64::vfmaq_f32(acc, x, w) }
    }
}
