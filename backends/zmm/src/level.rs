//! [`Level`]: which AVX-512 extensions a set of kernels runs (KT's sub-variants).

/// Instructions a sub-variant may use beyond AVX-512F/BW, as KT's variants nest them: each
/// level has every instruction of the ones before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// AVX-512F/BW (`avx512_base`): integer dots by `vpmaddubsw`/`vpmaddwd`.
    Base,
    /// + AVX512-VNNI: `vpdpbusd`.
    Vnni,
    /// + AVX512-VBMI: `vpermb` looks up mxfp4's and KT int4's nibbles unmasked, and its byte
    ///   tables serve the fp8 → bf16 decode of [`Level::Bf16`]; without `vdpbf16ps` the e4m3 →
    ///   f32 decode by bit placement (≤ 3 instructions per 16 weights, exact) needs none, so
    ///   this level runs [`Level::Vnni`]'s float kernels.
    Vbmi,
    /// + AVX512-BF16: `vdpbf16ps` for bf16 weights, and for fp8 ones decoded to bf16 by
    ///   VBMI byte tables.
    Bf16,
}
