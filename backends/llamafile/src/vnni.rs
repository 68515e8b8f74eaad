//! Which GGML types have VNNI kernels here. The encodings, their detection and `vpdpbusd`
//! itself are shared with the other x86 backends (`kt_x86::vnni`).

use kt_core::ggml::GgmlType;
pub use kt_x86::vnni::*;

/// Whether `t` has VNNI kernels: q8_0, the 32-column types with unsigned levels (mxfp4's
/// through its table + 12; the signed iq4_nl keeps AVX2's sign trick here, but for its 512-bit
/// kernels, `crate::legacy::Iq4NlV`), and the 256-column types whose scales cover 32 columns
/// (those of 16 columns would split `vpdpbusd`'s 4-column lanes between two scales): q4_K,
/// q5_K, and iq4_xs (signed levels: + 128 for `vpdpbusd`, 128·Σa taken off in i32).
pub const fn runs(t: GgmlType) -> bool {
    use GgmlType::*;
    matches!(t, Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | MXFP4 | Q4_K | Q5_K | IQ4_XS)
}
