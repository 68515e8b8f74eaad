//! Sets `cfg(avx512_intrinsics)` where rustc is 1.89 or later, where the AVX-512 intrinsics and
//! target features are stable; the workspace builds from 1.85 (Debian's rustc), and built
//! with an older rustc this crate registers no backend.

use std::process::Command;

/// Prints the cfg (also run by the blis backend's build script).
pub fn main() {
    println!("cargo:rustc-check-cfg=cfg(avx512_intrinsics)");
    println!("cargo:rerun-if-env-changed=RUSTC");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc).arg("--version").output().ok().and_then(|o| String::from_utf8(o.stdout).ok());
    // "rustc 1.95.0 (…)": the minor number of 1.x.
    let minor = version.as_deref().and_then(|v| v.split_whitespace().nth(1)).and_then(|v| v.split('.').nth(1));
    if minor.and_then(|m| m.parse::<u32>().ok()).is_some_and(|m| m >= 89) {
        println!("cargo:rustc-cfg=avx512_intrinsics");
    }
}
