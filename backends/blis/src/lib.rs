//! kt-kernel-rs backend crate `blis`: BLIS/AOCL GEMM for AMD hosts (needs the system BLIS library).
//!
//! No kernels yet: [`registered`] is empty, and the host builds it only with its Cargo feature
//! `blis` (off by default), so `KT_KERNEL_CPU_VARIANT=blis` is an unknown value in a default build.
//! When its kernels land it follows the other backends' shape (`pack`, `act`, `kernels`, the
//! conformance suite in one line) and depends on no other backend crate.

use kt_core::Backend;

/// The backends this crate registers with the host, best first. Empty until its kernels land.
pub fn registered() -> &'static [&'static dyn Backend] {
    &[]
}
