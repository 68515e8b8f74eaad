//! kt-kernel-rs backend crate `amx`: AMX tile kernels (asm!) for prefill, AVX-512 for decode.
//!
//! No kernels are registered yet: [`registered`] is empty, so this backend is never selected
//! (forcing it with `KT_KERNEL_CPU_VARIANT` reports that it has no kernels in this build).

use kt_core::Backend;

/// The backends this crate registers with the host, best first. Empty until its kernels land.
pub fn registered() -> &'static [&'static dyn Backend] {
    &[]
}
