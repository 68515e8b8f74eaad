//! kt-kernel-rs backend crate `amx`: AMX tile kernels (asm!) for prefill, AVX-512 for decode (its
//! issue: the AMX backend).
//!
//! No kernels yet: [`registered`] is empty, and the host builds it only with its Cargo feature
//! `amx` (off by default), so `KT_KERNEL_CPU_VARIANT=amx` is an unknown value in a default build.
//! When its kernels land it follows the other backends' shape (`pack`, `act`, `kernels`, the
//! conformance suite in one line) and depends on no other backend crate except `avx512` (every AMX
//! CPU has AVX-512).

use kt_core::Backend;

/// The backends this crate registers with the host, best first. Empty until its kernels land.
pub fn registered() -> &'static [&'static dyn Backend] {
    &[]
}
