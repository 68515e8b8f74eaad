//! The system BLIS library: its version and configuration, and the native f32 microkernel of
//! the running CPU's configuration with its block sizes (`src/shim.c` reaches what blis.h
//! keeps inline). Found once; BLIS's own threads are never started (only the microkernel is
//! called, on our pool's threads).

use core::ffi::{c_char, c_int, c_long, c_void, CStr};
use std::sync::OnceLock;

use kt_core::aligned::AlignedBuf;
use kt_core::rng::SplitMix64;

extern "C" {
    fn kt_blis_version() -> *const c_char;
    fn kt_blis_forced_arch() -> *const c_char;
    fn kt_blis_arch() -> *const c_char;
    fn kt_blis_query(
        cntx: *mut *mut c_void,
        ukr: *mut *mut c_void,
        mr: *mut c_long,
        nr: *mut c_long,
        kc: *mut c_long,
        row_pref: *mut c_int,
    ) -> c_int;
    fn kt_blis_sgemm_full(m: c_long, n: c_long, k: c_long, a: *const f32, b: *const f32, c: *mut f32, threads: c_long);
    fn kt_blis_sgemm(
        ukr: *mut c_void,
        cntx: *mut c_void,
        m: c_long,
        n: c_long,
        k: c_long,
        a: *const f32,
        b: *const f32,
        beta: f32,
        c: *mut f32,
        rs_c: c_long,
        cs_c: c_long,
        next_a: *const f32,
        next_b: *const f32,
    );
}

/// The BLIS versions whose microkernel interface this backend calls (`m, n, k, alpha, a, b,
/// beta, c, rs_c, cs_c, auxinfo, cntx`, since 0.9).
const VERSIONS: [&str; 2] = ["0.9", "1."];

/// Most rows a panel may have: BLIS's NR, at most this (a panel's scales are kept on the stack).
pub const MAX_NR: usize = 64;

/// The library found at run time.
#[derive(Clone, Debug)]
pub struct Library {
    /// `bli_info_get_version_str`.
    pub version: String,
    /// The configuration BLIS runs on this CPU (`bli_arch_string`: `zen3`, `haswell`,
    /// `cortexa57`...).
    pub arch: String,
    /// Tokens a microkernel call takes (MR).
    pub mr: usize,
    /// Weight rows a microkernel call takes (NR): the packed panels' rows.
    pub nr: usize,
    /// K per microkernel call (KC): every output element is summed KC at a time, in order.
    pub kc: usize,
    /// How the microkernel sums a call's products, where [`Sums::probe`] could tell: what a
    /// loop of ours must do to give its bits.
    pub sums: Option<Sums>,
    /// The vector instructions our own loops (the B micropanel's fill, the few-token loop)
    /// are compiled for.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub simd: Simd,
    cntx: usize,
    ukr: usize,
}

/// Vector instructions of this CPU that our loops are compiled for, found once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub enum Simd {
    /// The target's baseline (on aarch64: NEON).
    Baseline,
    /// x86's AVX2 and FMA.
    Avx2,
    /// x86's AVX-512 F, BW and VL (with AVX2 and FMA).
    Avx512,
}

impl Simd {
    fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
            let avx512 = std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl");
            if avx2 && avx512 {
                return Simd::Avx512;
            }
            if avx2 {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    }
}

/// How a microkernel sums `c = beta·c + a·b` over a call's `k`: each element a chain over `k`
/// in order from zero, each step one multiply-add, then `c + chain` (`beta` = 1) or the chain
/// (`beta` = 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sums {
    /// Each step fused, rounded once (FMA: BLIS's x86 and NEON kernels).
    Fused,
    /// Each step a product then a sum (a portable kernel compiled without FMA).
    Separate,
}

impl Sums {
    /// One chain's step.
    #[inline(always)]
    pub fn step<const FUSED: bool>(acc: f32, a: f32, b: f32) -> f32 {
        if FUSED {
            a.mul_add(b, acc)
        } else {
            acc + a * b
        }
    }

    /// Which of the two gives every element of `lib`'s microkernel on random values with
    /// spread exponents (two calls of `k` = KC and an odd `k`, the second adding to the first),
    /// bit for bit; `None` for a kernel that sums otherwise (split chains, another order).
    fn probe(lib: &Library) -> Option<Sums> {
        let (mr, nr, kc) = (lib.mr, lib.nr, lib.kc);
        let mut r = SplitMix64::new(0x9E37_79B9_7F4A_7C15);
        let mut next = || {
            let scale = [1.0, 3.0e-3, 7.0e2][r.below(3)];
            r.uniform(0.5) * scale
        };
        let mut aligned = |len: usize| {
            let mut buf = AlignedBuf::zeroed(4 * len);
            bytemuck::cast_slice_mut::<u8, f32>(buf.as_mut_slice()).iter_mut().for_each(|x| *x = next());
            buf
        };
        let ks = [kc, kc.min(37)];
        let (a, b) = (aligned(kc * mr), aligned(kc * nr));
        let (a, b): (&[f32], &[f32]) = (bytemuck::cast_slice(a.as_slice()), bytemuck::cast_slice(b.as_slice()));
        let mut c = vec![0.0f32; mr * nr];
        for (i, &k) in ks.iter().enumerate() {
            let beta = if i == 0 { 0.0 } else { 1.0 };
            // SAFETY: a and b are 64-byte aligned and hold KC·MR and KC·NR floats, c MR rows of NR.
            unsafe { lib.sgemm((mr, nr, k), a, b, beta, &mut c, nr, (a.as_ptr(), b.as_ptr())) };
        }
        let ours = |fused: bool| {
            (0..mr * nr).all(|at| {
                let (i, j) = (at / nr, at % nr);
                let mut out = 0.0f32;
                for (s, &k) in ks.iter().enumerate() {
                    let mut acc = 0.0f32;
                    for l in 0..k {
                        let (x, w) = (a[l * mr + i], b[l * nr + j]);
                        acc = if fused { Sums::step::<true>(acc, x, w) } else { Sums::step::<false>(acc, x, w) };
                    }
                    out = if s == 0 { acc } else { out + acc };
                }
                out.to_bits() == c[at].to_bits()
            })
        };
        [Sums::Fused, Sums::Separate].into_iter().find(|&s| ours(s == Sums::Fused))
    }
}

/// Whether BLIS's configuration `name`, forced by BLIS_ARCH_TYPE, runs here: BLIS takes the
/// variable on trust, aborting the process where its build lacks the configuration and dying
/// on an illegal instruction where the CPU lacks the kernels', so only those known to be built
/// (Debian's x86-64 and arm64 builds) and this CPU's are let through.
fn runs_forced(name: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        match name {
            "generic" => true,
            "penryn" => has!("sse4.1"),
            "sandybridge" => has!("avx"),
            "excavator" | "steamroller" | "piledriver" => has!("avx") && has!("fma"),
            "haswell" | "zen" | "zen2" | "zen3" => has!("avx2") && has!("fma"),
            "skx" => has!("avx512f") && has!("avx512dq") && has!("avx512bw") && has!("avx512vl"),
            _ => false,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        matches!(name, "generic" | "cortexa57" | "cortexa53")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        name == "generic"
    }
}

impl Library {
    /// The library of this process, or why it cannot run here.
    pub fn get() -> Result<&'static Library, &'static str> {
        static FOUND: OnceLock<Result<Library, &'static str>> = OnceLock::new();
        FOUND.get_or_init(Library::query).as_ref().map_err(|e| *e)
    }

    fn query() -> Result<Library, &'static str> {
        // SAFETY: the shim's functions take no arguments or out-pointers to locals; BLIS
        // returns static NUL-terminated strings.
        unsafe {
            let text = |p: *const c_char| {
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            let version = text(kt_blis_version());
            if !VERSIONS.iter().any(|v| version.starts_with(v)) {
                return Err("BLIS 0.9 or 1.x (the library loaded is another version)");
            }
            let forced = kt_blis_forced_arch();
            if !forced.is_null() && !runs_forced(&text(forced)) {
                return Err("BLIS_ARCH_TYPE unset, or naming a configuration of BLIS's that its Debian build \
                            holds and whose instructions this CPU has (x86: skx, haswell, sandybridge, penryn, \
                            zen, zen2, zen3, excavator, steamroller, piledriver; aarch64: cortexa57, cortexa53; \
                            generic): BLIS itself aborts the process on the others");
            }
            let (mut cntx, mut ukr) = (core::ptr::null_mut(), core::ptr::null_mut());
            // (Whether the microkernel prefers row-stored C: ours is, `[token][row]`, and a
            // kernel that prefers columns stores rows through its general path.)
            let (mut mr, mut nr, mut kc, mut row_pref) = (0, 0, 0, 0);
            if kt_blis_query(&mut cntx, &mut ukr, &mut mr, &mut nr, &mut kc, &mut row_pref) == 0 {
                return Err("an f32 microkernel in BLIS's context for this CPU");
            }
            // Every KC slice of a micropanel must start where the whole one does, 64-byte aligned.
            if nr as usize > MAX_NR {
                return Err("a BLIS configuration whose NR is at most 64");
            }
            if (kc * mr) % 16 != 0 || (kc * nr) % 16 != 0 || kc % 2 != 0 {
                return Err(
                    "a BLIS configuration whose KC is even and KC·MR and KC·NR multiples of 16 floats (64-byte slices)",
                );
            }
            let arch = text(kt_blis_arch());
            let mut lib = Library {
                version,
                arch,
                mr: mr as usize,
                nr: nr as usize,
                kc: kc as usize,
                sums: None,
                simd: Simd::detect(),
                cntx: cntx as usize,
                ukr: ukr as usize,
            };
            lib.sums = Sums::probe(&lib);
            Ok(lib)
        }
    }

    /// This library with our loops compiled for `simd` (a level this CPU has), leaked: a
    /// packed matrix keeps its library for the process.
    #[cfg(test)]
    pub fn with_simd(&self, simd: Simd) -> &'static Library {
        assert!(simd <= self.simd, "{simd:?} is not on this CPU");
        Box::leak(Box::new(Library { simd, ..self.clone() }))
    }

    /// `c[m×n] = beta·c + a·b` over `k` by the microkernel: `a` holds `k` groups of MR floats,
    /// `b` `k` groups of NR, `c` row-major with `rs_c` floats a row; `next_a`/`next_b` are what
    /// the next call reads (the microkernel may prefetch them).
    ///
    /// # Safety
    /// `m ≤ MR`, `n ≤ NR`; `a` and `b` are 64-byte aligned and hold `k·MR` and `k·NR` floats, `c`
    /// `m` rows of `rs_c ≥ n`; `next_a` and `next_b` point into readable memory (or are null).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub unsafe fn sgemm(
        &self,
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &mut [f32],
        rs_c: usize,
        next: (*const f32, *const f32),
    ) {
        debug_assert!(m <= self.mr && n <= self.nr && a.len() >= k * self.mr && b.len() >= k * self.nr);
        debug_assert!(c.len() >= (m.max(1) - 1) * rs_c + n);
        // SAFETY: the caller's contract; the context and microkernel are BLIS's for this CPU.
        unsafe {
            kt_blis_sgemm(
                self.ukr as *mut c_void,
                self.cntx as *mut c_void,
                m as c_long,
                n as c_long,
                k as c_long,
                a.as_ptr(),
                b.as_ptr(),
                beta,
                c.as_mut_ptr(),
                rs_c as c_long,
                1,
                next.0,
                next.1,
            )
        }
    }
}

/// BLIS's own sgemm rate, GFLOP/s, on `c[m×n] = a[m×k] · b[n×k]ᵀ` with `threads` of its
/// threads: the best of at least three calls and `min_secs` of them (the blis backend's
/// yardstick in `kt bench`).
pub fn sgemm_gflops(m: usize, n: usize, k: usize, threads: usize, min_secs: f64) -> Result<f64, &'static str> {
    Library::get()?;
    let fill =
        |len: usize, seed: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + seed) % 13) as f32 / 13.0 - 0.5).collect() };
    let (a, b, mut c) = (fill(m * k, 1), fill(n * k, 2), vec![0.0f32; m * n]);
    let call = |c: &mut [f32]| {
        // SAFETY: a, b and c hold m·k, n·k and m·n floats, row-major as the shim reads them.
        unsafe {
            kt_blis_sgemm_full(
                m as c_long,
                n as c_long,
                k as c_long,
                a.as_ptr(),
                b.as_ptr(),
                c.as_mut_ptr(),
                threads.max(1) as c_long,
            )
        }
    };
    call(&mut c);
    let (mut best, mut spent, mut reps) = (f64::INFINITY, 0.0, 0);
    while reps < 3 || spent < min_secs {
        let t = std::time::Instant::now();
        call(&mut c);
        let s = t.elapsed().as_secs_f64();
        (best, spent, reps) = (best.min(s), spent + s, reps + 1);
    }
    Ok(2.0 * (m * n * k) as f64 / best / 1e9)
}
