//! kt-kernel-rs backend crate `avx2`: AVX2+FMA kernels (issue: AVX2 backend).
//!
//! No kernels are registered yet: [`registered`] is empty, so this backend is never selected
//! (forcing it with `KT_KERNEL_CPU_VARIANT` reports that it has no kernels in this build).

use kt_core::Backend;

/// The backends this crate registers with the host, best first. Empty until its kernels land.
pub fn registered() -> &'static [&'static dyn Backend] {
    &[]
}
