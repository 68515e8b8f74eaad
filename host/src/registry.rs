//! The backends compiled into this build, best first, and run-time selection by formats,
//! honouring `KT_KERNEL_CPU_VARIANT` (force a backend by name) and `KT_KERNEL_DEBUG=1`
//! (explain the choice on stderr).
//!
//! The order of [`registered`] is the whole ranking: a layer runs on the first backend this
//! CPU runs that serves its formats ([`kt_core::select`]). Wider instructions come first (`amx`,
//! which this CPU runs only with AMX tiles and Linux's permission for them); the reference
//! backend, which serves everything slowly, is last. `blis` (built with the feature of that name)
//! comes after our x86 backends, which run every format it serves faster: on x86 it runs when
//! forced; where they do not run (ARM) it is the first.

use kt_core::reference::REFERENCE;
use kt_core::select::{self, Selection};
use kt_core::{Backend, Error, WeightFormat};

/// Every backend with kernels in this build, best first.
#[allow(unused_mut, clippy::vec_init_then_push)] // with --no-default-features only the reference is pushed
pub fn registered() -> Vec<&'static dyn Backend> {
    let mut v: Vec<&'static dyn Backend> = Vec::new();
    #[cfg(feature = "amx")]
    v.extend_from_slice(kt_backend_amx::registered());
    #[cfg(feature = "avx512")]
    v.extend_from_slice(kt_backend_avx512::registered());
    #[cfg(feature = "avx2")]
    v.extend_from_slice(kt_backend_avx2::registered());
    #[cfg(feature = "blis")]
    v.extend_from_slice(kt_backend_blis::registered());
    #[cfg(feature = "llamafile")]
    v.extend_from_slice(kt_backend_llamafile::registered());
    v.push(&REFERENCE);
    v
}

fn debug() -> bool {
    std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1")
}

fn forced() -> Option<String> {
    std::env::var("KT_KERNEL_CPU_VARIANT").ok()
}

/// The default backend (what `kt_kernel.__cpu_variant__` reports): the one
/// `KT_KERNEL_CPU_VARIANT` forces, else the best this CPU runs.
pub fn select_default() -> Result<Selection, Error> {
    let s = select::select(&registered(), forced().as_deref())?;
    if debug() {
        eprint!("[kt-kernel] backend selection:\n{}", indent(&s.explanation));
    }
    Ok(s)
}

/// The backend for a layer whose matrices are these `(format, rows, cols)`: the forced one
/// (an error naming the format and the backends that run it, if it cannot), else the best
/// that serves them (logged under `KT_KERNEL_DEBUG=1`).
pub fn select_for(shapes: &[(WeightFormat, usize, usize)]) -> Result<&'static dyn Backend, Error> {
    let s = select::for_layer(&registered(), forced().as_deref(), shapes)?;
    if debug() {
        eprint!(
            "[kt-kernel] backend for {:?}:\n{}",
            shapes.iter().map(|s| s.0).collect::<Vec<_>>(),
            indent(&s.explanation)
        );
    }
    Ok(s.backend)
}

/// `Ok` if `b`, given explicitly, runs these matrices on this CPU; else the error naming the
/// format and the backends that do.
pub fn check_given(b: &'static dyn Backend, shapes: &[(WeightFormat, usize, usize)]) -> Result<(), Error> {
    select::check_serves(b, "given explicitly", &registered(), shapes)
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}
