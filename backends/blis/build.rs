//! With the `system` feature: compile `src/shim.c` against the system BLIS's `blis.h` and link
//! its library (a threading flavour's own directory first: Debian installs `libblis.so` and
//! `libblis.so.4` as separate alternatives, so with several flavours installed the library
//! linked and the one loaded could differ; install one, as scripts/bootstrap.sh does); `cfg
//! blis_system` then compiles the backend. `KT_BLIS_INCLUDE` and `KT_BLIS_LIB` name other
//! directories. Where rustc has the AVX-512 intrinsics (1.89), `cfg avx512_intrinsics`.

/// `cfg(avx512_intrinsics)` where rustc has them stable (the one-token loop's AVX-512 lanes).
#[path = "../avx512/build.rs"]
mod avx512_intrinsics;

fn main() {
    avx512_intrinsics::main();
    println!("cargo::rustc-check-cfg=cfg(blis_system)");
    println!("cargo:rerun-if-env-changed=KT_BLIS_INCLUDE");
    println!("cargo:rerun-if-env-changed=KT_BLIS_LIB");
    println!("cargo:rerun-if-changed=src/shim.c");
    #[cfg(feature = "system")]
    system::build();
}

#[cfg(feature = "system")]
mod system {
    use std::path::PathBuf;

    /// Debian's multiarch triple for the target (its include and library directories).
    fn multiarch() -> String {
        let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        format!("{arch}-linux-gnu")
    }

    /// The first of `candidates` that holds `file`.
    fn find(var: &str, candidates: &[PathBuf], file: &str) -> Option<PathBuf> {
        let from_env = std::env::var_os(var).map(PathBuf::from);
        from_env.into_iter().chain(candidates.iter().cloned()).find(|d| d.join(file).exists())
    }

    pub fn build() {
        let triple = multiarch();
        let flavours = ["blis-pthread", "blis-serial", "blis-openmp"];
        let includes: Vec<PathBuf> = flavours
            .iter()
            .map(|f| PathBuf::from(format!("/usr/include/{triple}/{f}")))
            .chain([PathBuf::from("/usr/include/blis"), PathBuf::from("/usr/local/include/blis")])
            .collect();
        let Some(include) = find("KT_BLIS_INCLUDE", &includes, "blis.h") else {
            panic!(
                "the blis feature needs the system BLIS library's headers (blis.h), found in none of {includes:?}: \
                 install Debian's libblis-pthread-dev (apt-get install -y libblis-pthread-dev), or set \
                 KT_BLIS_INCLUDE and KT_BLIS_LIB to your BLIS's include and library directories"
            );
        };
        let libs: Vec<PathBuf> = flavours
            .iter()
            .map(|f| PathBuf::from(format!("/usr/lib/{triple}/{f}")))
            .chain([PathBuf::from(format!("/usr/lib/{triple}")), PathBuf::from("/usr/local/lib")])
            .collect();
        let Some(lib) = find("KT_BLIS_LIB", &libs, "libblis.so") else {
            panic!(
                "the blis feature needs the system BLIS library (libblis.so), found in none of {libs:?}: install \
                 Debian's libblis-pthread-dev, or set KT_BLIS_LIB"
            );
        };
        cc::Build::new().file("src/shim.c").include(&include).opt_level(2).warnings(false).compile("kt_blis_shim");
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=blis");
        println!("cargo:rustc-cfg=blis_system");
    }
}
