//! Sets `cfg(vnni_intrinsics)` where rustc is 1.89 or later: the VNNI kernels' intrinsics and
//! target features (`avxvnni`, `avx512vnni`, `avx512vl`) are stable from there, and the
//! workspace builds with 1.85 (Debian's rustc). Built without it, the AVX2 kernels serve.

use std::process::Command;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(vnni_intrinsics)");
    println!("cargo:rerun-if-env-changed=RUSTC");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc).arg("--version").output().ok().and_then(|o| String::from_utf8(o.stdout).ok());
    // "rustc 1.95.0 (…)": the minor number of 1.x.
    let minor = version.as_deref().and_then(|v| v.split_whitespace().nth(1)).and_then(|v| v.split('.').nth(1));
    if minor.and_then(|m| m.parse::<u32>().ok()).is_some_and(|m| m >= 89) {
        println!("cargo:rustc-cfg=vnni_intrinsics");
    }
}
