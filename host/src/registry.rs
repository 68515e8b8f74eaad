//! The backends compiled into this build, and run-time selection honouring
//! `KT_KERNEL_CPU_VARIANT` (force a variant) and `KT_KERNEL_DEBUG=1` (explain the choice).

use kt_core::reference::REFERENCE;
use kt_core::select::{self, Selection};
use kt_core::{Backend, Error, LayerFormat, WeightFormat};

/// Backend crates compiled in (Cargo features), whether or not they register kernels yet.
pub fn compiled() -> Vec<&'static str> {
    let mut v = vec!["reference"];
    if cfg!(feature = "avx2") {
        v.push("avx2");
    }
    if cfg!(feature = "avx512") {
        v.push("avx512");
    }
    if cfg!(feature = "amx") {
        v.push("amx");
    }
    if cfg!(feature = "llamafile") {
        v.push("llamafile");
    }
    if cfg!(feature = "blis") {
        v.push("blis");
    }
    v
}

/// Every backend with kernels in this build, reference first.
#[allow(unused_mut)] // with --no-default-features only the reference is pushed
pub fn registered() -> Vec<&'static dyn Backend> {
    let mut v: Vec<&'static dyn Backend> = vec![&REFERENCE];
    #[cfg(feature = "avx2")]
    v.extend_from_slice(kt_backend_avx2::registered());
    #[cfg(feature = "avx512")]
    v.extend_from_slice(kt_backend_avx512::registered());
    #[cfg(feature = "amx")]
    v.extend_from_slice(kt_backend_amx::registered());
    #[cfg(feature = "llamafile")]
    v.extend_from_slice(kt_backend_llamafile::registered());
    #[cfg(feature = "blis")]
    v.extend_from_slice(kt_backend_blis::registered());
    v
}

fn debug() -> bool {
    std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1")
}

/// The default backend: the best available, or the one `KT_KERNEL_CPU_VARIANT` forces.
pub fn select_default() -> Result<Selection, Error> {
    let forced = std::env::var("KT_KERNEL_CPU_VARIANT").ok();
    let s = select::select(&registered(), forced.as_deref(), &compiled())?;
    if debug() {
        eprint!("[kt-kernel] backend selection:\n{}", indent(&s.explanation));
    }
    Ok(s)
}

/// The backend for a layer of `format`, matrices of these `(format, rows, cols)`: the default
/// one if it serves them, else the next best (logged under `KT_KERNEL_DEBUG=1`).
pub fn select_for(format: LayerFormat, shapes: &[(WeightFormat, usize, usize)]) -> Result<&'static dyn Backend, Error> {
    let preferred = select_default()?.backend;
    let s = select::for_format(&registered(), preferred, format, shapes)?;
    if debug() {
        eprint!("{}", indent(&s.explanation));
    }
    Ok(s.backend)
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}
