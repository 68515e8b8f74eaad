//! kt-kernel-rs backend crate `blis`: every weight format of ours on the system BLIS library's
//! own f32 microkernel, for CPUs without our hand kernels (ARM: Debian's BLIS runs NEON
//! kernels there); on x86 it runs when forced (`KT_KERNEL_CPU_VARIANT=blis`), our x86 backends
//! being far faster.
//!
//! Weights stay in their format's own bytes (`matrix`), row-major, so NR rows are a panel;
//! activations are the reference backend's (`act`); a task dequantizes a panel's rows once per
//! MC tokens into BLIS's B micropanel and runs the microkernel KC columns at a time in column
//! order (`kernels`), so every output is summed the same way whatever the task or thread.
//! BLIS's version, configuration, microkernel and block sizes are found at run time
//! (`library`); a missing or unsupported BLIS makes `cpu_support` say so.
//!
//! Built with the `system` feature only (it links libblis: Debian's libblis-pthread-dev);
//! without it the crate registers nothing. **Must not** depend on another backend crate.

#[cfg(blis_system)]
mod act;
#[cfg(blis_system)]
mod direct;
#[cfg(blis_system)]
mod few;
#[cfg(blis_system)]
mod kernels;
#[cfg(blis_system)]
mod lanes;
#[cfg(blis_system)]
mod library;
#[cfg(blis_system)]
mod matrix;
#[cfg(blis_system)]
mod task;

use kt_core::Backend;

/// The backends this crate registers with the host: `blis` where it was built with the system
/// library.
pub fn registered() -> &'static [&'static dyn Backend] {
    #[cfg(blis_system)]
    {
        static LIST: [&dyn Backend; 1] = [&imp::BLIS];
        &LIST
    }
    #[cfg(not(blis_system))]
    {
        &[]
    }
}

/// The system BLIS library this build runs: `Ok((version, configuration, few))` (e.g.
/// `("0.9.0", "zen3", 4)`; `few`: the tokens up to which a task runs our own loop, which gives
/// the microkernel's bits, 0 where it cannot), or what is missing; `None` in a build without it.
pub fn library() -> Option<Result<(String, String, usize), &'static str>> {
    #[cfg(blis_system)]
    {
        Some(library::Library::get().map(|l| (l.version.clone(), l.arch.clone(), few::tokens(l))))
    }
    #[cfg(not(blis_system))]
    {
        None
    }
}

/// BLIS's own sgemm rate on `c[m×n] = a[m×k] · b[n×k]ᵀ` with `threads` of its threads, GFLOP/s
/// (`kt bench`'s yardstick for this backend), or why it cannot run; `None` in a build without
/// the library.
pub fn sgemm_gflops(m: usize, n: usize, k: usize, threads: usize, min_secs: f64) -> Option<Result<f64, &'static str>> {
    #[cfg(blis_system)]
    {
        Some(library::sgemm_gflops(m, n, k, threads, min_secs))
    }
    #[cfg(not(blis_system))]
    {
        let _ = (m, n, k, threads, min_secs);
        None
    }
}

#[cfg(blis_system)]
pub use imp::{Blis, BLIS};

#[cfg(blis_system)]
mod imp {
    use core::ops::Range;

    use half::bf16;
    use kt_core::backend::{ActLayout, Instructions, TaskShape};
    use kt_core::bias::GateUpBias;
    use kt_core::mat::MatMut;
    use kt_core::reference::REFERENCE;
    use kt_core::swiglu::Glu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};

    use crate::act::{self, Act};
    use crate::kernels::for_tiles;
    use crate::library::Library;
    use crate::matrix::Matrix;
    use crate::task::{room_bytes, Room, Task};

    /// The BLIS backend.
    #[derive(Debug)]
    pub struct Blis;

    /// The one instance.
    pub static BLIS: Blis = Blis;

    impl Backend for Blis {
        fn name(&self) -> &'static str {
            "blis"
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            Library::get().map(|_| ())
        }

        fn serves(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
            !matches!(format, WeightFormat::Ggml(_)) && cols % format.col_multiple() == 0
        }

        fn row_granularity(&self, _format: WeightFormat) -> usize {
            Library::get().map_or(1, |l| l.nr)
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            let lib = Library::get().map_err(|missing| Error::VariantUnavailable {
                variant: self.name().into(),
                reason: format!("it needs {missing}"),
            })?;
            let p = Matrix::pack(m, lib);
            Ok(PackedMatrix::new(self.name(), m.format(), m.rows(), m.cols(), p.bytes(), p))
        }

        fn act_layout(&self, format: WeightFormat) -> ActLayout {
            act::layout(format)
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            REFERENCE.act_bytes(format, rows, cols)
        }

        fn scratch_bytes(&self, shape: TaskShape) -> usize {
            let room = Library::get().map_or(0, |l| room_bytes(l, shape.cols));
            room.max(REFERENCE.scratch_bytes(shape))
        }

        fn quantize_act(
            &self,
            format: WeightFormat,
            cols: usize,
            src: &[bf16],
            rows: &[u32],
            dst: &mut [u8],
            scratch: &mut [u8],
        ) {
            REFERENCE.quantize_act(format, cols, src, rows, dst, scratch)
        }

        fn gate_up(
            &self,
            gate: &PackedMatrix,
            up: &PackedMatrix,
            rows: Range<usize>,
            act_gate: &[u8],
            act_up: &[u8],
            glu: Glu,
            bias: Option<GateUpBias<'_>>,
            mut h: MatMut<'_, bf16>,
            scratch: &mut [u8],
        ) {
            let (g, u, n) = (gate.inner::<Matrix>(), up.inner::<Matrix>(), h.rows());
            let cols = g.cols();
            let ag = Act::parse(gate.format(), cols, n, act_gate);
            let au = Act::parse(up.format(), cols, n, act_up);
            let (lib, start) = (g.lib, rows.start);
            let mut room = Room::new(lib, cols, scratch);
            let task = Task { lib, ms: [g, u], acts: [&ag, &au], n, rows, room: &mut room };
            for_tiles(task, |t0, m, r0, nr, [gt, ut]| {
                for i in 0..m {
                    let out = &mut h.row_mut(t0 + i)[r0 - start..r0 - start + nr];
                    for (j, o) in out.iter_mut().enumerate() {
                        let (r, at) = (r0 + j, i * lib.nr + j);
                        let (mut gv, mut uv) = ([gt[at] * g.out_scale(r)], [ut[at] * u.out_scale(r)]);
                        if let Some(b) = bias {
                            b.add(r, 0..1, &mut gv, &mut uv);
                        }
                        *o = glu.apply(gv[0], uv[0]);
                    }
                }
            });
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, a: &[u8], mut y: MatMut<'_, f32>, scratch: &mut [u8]) {
            let (d, n) = (down.inner::<Matrix>(), y.rows());
            let cols = d.cols();
            let act = Act::parse(down.format(), cols, n, a);
            let (lib, start) = (d.lib, rows.start);
            let mut room = Room::new(lib, cols, scratch);
            let task = Task { lib, ms: [d], acts: [&act], n, rows, room: &mut room };
            for_tiles(task, |t0, m, r0, nr, [tile]| {
                for i in 0..m {
                    let out = &mut y.row_mut(t0 + i)[r0 - start..r0 - start + nr];
                    for (j, (o, t)) in out.iter_mut().zip(&tile[i * lib.nr..]).enumerate() {
                        *o = t * d.out_scale(r0 + j);
                    }
                }
            });
        }

        /// BLIS's f32 microkernel: FMA on vectors (NEON on ARM).
        fn instructions(&self, _format: WeightFormat) -> Instructions {
            Instructions::FmaF32
        }
    }
}

#[cfg(all(test, blis_system))]
mod tests {
    kt_core::conformance_suite!(&crate::BLIS);

    /// A token's results have the same bits alone, among a few tokens (our loop: `few`) and
    /// in a batch (the microkernel), in every format: rows that end inside a panel and a group
    /// of panels, K over three KC slices and a part of one.
    #[test]
    fn few_tokens_give_the_microkernels_bits() {
        use kt_core::kernel_case::KernelCase;
        use kt_core::{Backend, QuantMatrix, WeightFormat};
        let lib = match crate::library::Library::get() {
            Ok(lib) => lib,
            Err(missing) => {
                kt_core::skip_isa!(missing);
                return;
            }
        };
        if crate::few::tokens(lib) == 0 {
            // (BLIS's bulldozer-family kernels: NR = 3.)
            assert!(lib.sums.is_some(), "BLIS {} {}: its microkernel's sums were not found", lib.version, lib.arch);
            eprintln!(
                "skipped: BLIS {} {} has NR = {}, which the few-token loop is not built for",
                lib.version, lib.arch, lib.nr
            );
            return;
        }
        let (rows, cols) = (5 * lib.nr + 3, 3 * lib.kc + 128);
        let mut r = kt_core::rng::SplitMix64::new(3);
        let w: Vec<f32> = (0..rows * cols).map(|_| r.gaussian()).collect();
        for format in WeightFormat::ALL.into_iter().filter(|&f| crate::BLIS.serves(f, rows, cols)) {
            let m = QuantMatrix::quantize(format, rows, cols, &w).expect("finite");
            let mut batch = KernelCase::new(&crate::BLIS, &m, 40, 9);
            batch.run();
            for n in 1..=crate::few::tokens(lib) {
                let mut few = KernelCase::new(&crate::BLIS, &m, n, 9);
                few.run();
                for t in 0..n {
                    let same = few.outputs(t).iter().zip(batch.outputs(t)).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{format}: token {t} of {n} differs from the same token among 40");
                }
            }
        }
    }

    /// A task of a few tokens has the same bits on every set of lanes the direct loop can take
    /// on this CPU (AVX2's, AVX-512's) as on the few-token loop (the baseline), in every format.
    #[test]
    fn direct_lanes_give_the_same_bits() {
        use kt_core::kernel_case::KernelCase;
        use kt_core::{Backend, PackedMatrix, QuantMatrix, WeightFormat};

        use crate::library::{Library, Simd};
        let lib = match Library::get() {
            Ok(lib) => lib,
            Err(missing) => {
                kt_core::skip_isa!(missing);
                return;
            }
        };
        if crate::few::tokens(lib) == 0 {
            eprintln!("skipped: BLIS {} {} runs every task on its microkernel", lib.version, lib.arch);
            return;
        }
        let levels: Vec<Simd> =
            [Simd::Baseline, Simd::Avx2, Simd::Avx512].into_iter().filter(|&s| s <= lib.simd).collect();
        if levels.len() < 2 {
            eprintln!("skipped: this CPU has one set of lanes for the loop ({:?})", lib.simd);
            return;
        }
        let (rows, cols) = (9 * lib.nr + 5, 3 * lib.kc + 128);
        let mut r = kt_core::rng::SplitMix64::new(5);
        let w: Vec<f32> = (0..rows * cols).map(|_| r.gaussian()).collect();
        for format in WeightFormat::ALL.into_iter().filter(|&f| crate::BLIS.serves(f, rows, cols)) {
            let m = QuantMatrix::quantize(format, rows, cols, &w).expect("finite");
            for n in 1..=crate::direct::MAX_TOKENS {
                let outputs: Vec<Vec<f32>> = levels
                    .iter()
                    .map(|&simd| {
                        let p = crate::matrix::Matrix::pack(&m, lib.with_simd(simd));
                        let w = PackedMatrix::new("blis", format, rows, cols, p.bytes(), p);
                        let mut case = KernelCase::packed(&crate::BLIS, w, n, 11);
                        case.run();
                        (0..n).flat_map(|t| case.outputs(t).to_vec()).collect()
                    })
                    .collect();
                for (simd, out) in levels.iter().zip(&outputs).skip(1) {
                    let same = out.iter().zip(&outputs[0]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{format}, {n} tokens: {simd:?}'s lanes differ from {:?}'s", levels[0]);
                }
            }
        }
    }

    /// A BLIS_ARCH_TYPE that BLIS would abort the process on (an id past its list; knc, which
    /// Debian's build lacks; bulldozer's FMA4 kernels, or whatever the id names elsewhere) is
    /// refused with an error naming the variable; one it runs here (haswell) is taken. Each in a
    /// child process of this test binary: the library is found once a process.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn a_forced_configuration_blis_would_die_on_is_refused() {
        if let Some(expect) = std::env::var_os("KT_BLIS_FORCED_EXPECT") {
            let got = crate::library::Library::get().map(|l| l.arch.clone());
            match (expect.to_str(), got) {
                (Some("refused"), Err(why)) => assert!(why.contains("BLIS_ARCH_TYPE"), "{why}"),
                (Some("taken"), Ok(_)) => {}
                (expect, got) => panic!("expected {expect:?}, got {got:?}"),
            }
            return;
        }
        if crate::library::Library::get().is_err() || !std::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no BLIS here, or not an x86 CPU with AVX2 (the cases are x86's)");
            return;
        }
        for (id, expect) in [("99", "refused"), ("2", "refused"), ("12", "refused"), ("3", "taken"), ("-1", "taken")] {
            let exe = std::env::current_exe().expect("the test binary");
            let out = std::process::Command::new(exe)
                .args(["--exact", "tests::a_forced_configuration_blis_would_die_on_is_refused", "--nocapture"])
                .env("BLIS_ARCH_TYPE", id)
                .env("KT_BLIS_FORCED_EXPECT", expect)
                .output()
                .expect("the test binary runs");
            let text = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "BLIS_ARCH_TYPE={id}: the child ({:?}) said {text}", out.status);
        }
    }

    /// e4m3 matrices holding NaN codes (0x7F, 0xFF) give NaN in those rows and every other
    /// row's bits of the same matrix without them, on every path (the direct or few-token
    /// loop, the microkernel).
    #[test]
    fn e4m3_nan_codes_give_nan_rows() {
        use kt_core::kernel_case::KernelCase;
        use kt_core::{QuantMatrix, WeightFormat};
        if let Err(missing) = crate::library::Library::get() {
            kt_core::skip_isa!(missing);
            return;
        }
        let (rows, cols) = (40, 384);
        let mut r = kt_core::rng::SplitMix64::new(5);
        // Random codes but the NaN ones; then rows 3 and 17 given one each.
        let clean: Vec<u8> =
            (0..rows * cols).map(|_| (r.next_u64() % 0x7F) as u8 | (r.next_u64() as u8 & 0x80)).collect();
        let mut nan = clean.clone();
        (nan[3 * cols + 200], nan[17 * cols + 5]) = (0x7F, 0xFF);
        for format in [WeightFormat::Fp8Channel, WeightFormat::Fp8Block, WeightFormat::Mxfp8] {
            let scales = vec![if format == WeightFormat::Mxfp8 { 0.25 } else { 0.01 }; format.scale_count(rows, cols)];
            let matrix = |data: &[u8]| {
                QuantMatrix::from_parts(format, rows, cols, data.to_vec(), scales.clone()).expect("parts")
            };
            let (clean, nan) = (matrix(&clean), matrix(&nan));
            for n in [1, 3, 40] {
                let (mut a, mut b) =
                    (KernelCase::new(&crate::BLIS, &clean, n, 2), KernelCase::new(&crate::BLIS, &nan, n, 2));
                a.run();
                b.run();
                for t in 0..n {
                    for (row, (x, y)) in a.outputs(t).iter().zip(b.outputs(t)).enumerate() {
                        if row == 3 || row == 17 {
                            assert!(y.is_nan(), "{format} n{n}: row {row} of token {t} is {y}, not NaN");
                        } else {
                            assert_eq!(x.to_bits(), y.to_bits(), "{format} n{n}: row {row} of token {t}");
                        }
                    }
                }
            }
        }
    }

    /// The yardstick `kt bench` reports the backend against runs BLIS's own sgemm.
    #[test]
    fn blis_sgemm_rate_is_measured() {
        let g = match crate::sgemm_gflops(8, 96, 256, 1, 0.0).expect("built with BLIS") {
            Ok(g) => g,
            Err(missing) => {
                kt_core::skip_isa!(missing);
                return;
            }
        };
        assert!(g.is_finite() && g > 0.0, "{g}");
    }
}
