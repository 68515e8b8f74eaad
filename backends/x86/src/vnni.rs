//! VNNI's `vpdpbusd` (u8 × i8, four products summed into each i32 lane and added, one
//! instruction): the int8 dot that AVX2 spreads over `vpmaddubsw`, `vpmaddwd` and `vpaddd`.
//! Two encodings run it on 256-bit registers: AVX-VNNI (VEX, Alder Lake and later) and
//! AVX512-VNNI with AVX512VL (EVEX, Ice Lake and later servers, Zen4; 32 registers). Which one
//! the CPU has is read once, at the first call. Their intrinsics are stable from rustc 1.89:
//! built with an older one (this crate's `build.rs`), [`detect`] finds none and the AVX2 kernels serve.

#[cfg(vnni_intrinsics)]
use core::arch::x86_64::*;
use std::sync::OnceLock;

/// The encoding a kernel is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vnni {
    /// AVX512-VNNI with AVX512F, BW and VL (every CPU with it has them): EVEX, 32 vector
    /// registers, 512-bit ones where a kernel uses them.
    Evex,
    /// AVX-VNNI: VEX, 16 vector registers.
    Vex,
}

/// The CPU's VNNI, EVEX first (more registers), or `None` (also where rustc was too old).
pub fn detect() -> Option<Vnni> {
    static FOUND: OnceLock<Option<Vnni>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        if !cfg!(vnni_intrinsics) {
            None
        } else if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
        {
            Some(Vnni::Evex)
        } else if crate::isa::has_avx_vnni() {
            Some(Vnni::Vex)
        } else {
            None
        }
    })
}

/// `vpdpbusd` in one encoding.
#[cfg(vnni_intrinsics)]
pub trait Dp {
    /// `acc + Σ u·s` of each lane's 4 byte pairs (`u` unsigned, `s` signed).
    ///
    /// # Safety
    /// The encoding's features must be present (inlined into kernels that enable them).
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;
}

/// AVX-VNNI.
#[cfg(vnni_intrinsics)]
pub struct Vex;
/// AVX512-VNNI with AVX512VL.
#[cfg(vnni_intrinsics)]
pub struct Evex;

#[cfg(vnni_intrinsics)]
#[allow(clippy::incompatible_msrv)] // Built from rustc 1.89 only (this crate's `build.rs`).
impl Dp for Vex {
    #[inline(always)]
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: AVX-VNNI by the caller's contract.
        unsafe { _mm256_dpbusd_avx_epi32(acc, u, s) }
    }
}

#[cfg(vnni_intrinsics)]
#[allow(clippy::incompatible_msrv)] // Built from rustc 1.89 only (this crate's `build.rs`).
impl Dp for Evex {
    #[inline(always)]
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: AVX512-VNNI and AVX512VL by the caller's contract.
        unsafe { _mm256_dpbusd_epi32(acc, u, s) }
    }
}
