//! kt-kernel-rs backend `llamafile`: GGML's block formats as GGUF files store them (f32, f16,
//! bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K…q6_K, iq4_nl, iq4_xs and the lattice types iq1_s,
//! iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s), any mix of them per
//! projection, with AVX2 kernels. It is named for KT-Kernel's LLAMAFILE method, which it
//! replaces; nothing of llamafile is used. Registered when the CPU has AVX2, FMA and F16C.
//!
//! Weights keep their GGUF values, rearranged at load (`kernels::Packed`: 32-column types in
//! groups of 8 blocks, 256-column ones with their levels in the lane layout of `lanes`, q3_K's,
//! q5_K's and q6_K's first gathered into planes of whole levels and some types' scales
//! unpacked, the lattice types as stored, put in that layout as they are decoded);
//! activations are quantized per token to the type's `vec_dot_type` (Q8_K for 256-column types,
//! Q8_0 with sums for 32-column ones, f32 for float types) in a block-major layout (`act`).
//! Where the CPU has VNNI (AVX-VNNI or AVX512-VNNI), q8_0 (packed for it), q4_0, q4_1, q5_0,
//! q5_1, q4_K, q5_K and iq4_xs run on `vpdpbusd` (`vnni`, `kernels::on_vnni`,
//! `kernels::on_zmm`), with the same results bit for bit.

#[cfg(target_arch = "x86_64")]
mod act;
#[cfg(target_arch = "x86_64")]
mod decode;
#[cfg(target_arch = "x86_64")]
mod kernels;
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
mod lattice;
#[cfg(target_arch = "x86_64")]
mod legacy;
#[cfg(target_arch = "x86_64")]
mod vnni;

use kt_core::Backend;

/// The backends this crate registers with the host.
pub fn registered() -> &'static [&'static dyn Backend] {
    #[cfg(target_arch = "x86_64")]
    {
        static LIST: [&dyn Backend; 1] = [&imp::LLAMAFILE];
        &LIST
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        &[]
    }
}

#[cfg(target_arch = "x86_64")]
pub use imp::{Llamafile, LLAMAFILE, LLAMAFILE_AVX2};

#[cfg(target_arch = "x86_64")]
mod imp {
    use core::ops::Range;

    use half::bf16;
    use kt_core::mat::MatMut;
    use kt_core::swiglu::swiglu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};

    use crate::kernels::{dots, gemv, Packed, Scratch, R};
    use crate::vnni::{self, Vnni};

    /// The GGML backend.
    #[derive(Debug)]
    pub struct Llamafile {
        /// Whether kernels with VNNI run where the CPU has it.
        vnni: bool,
    }

    /// The instance the host registers: VNNI kernels where the CPU has VNNI.
    pub static LLAMAFILE: Llamafile = Llamafile { vnni: true };

    /// AVX2 kernels only, whatever the CPU: for comparing the two on a VNNI CPU (tests, benches).
    pub static LLAMAFILE_AVX2: Llamafile = Llamafile { vnni: false };

    impl Llamafile {
        /// The VNNI encoding this instance's kernels use on this CPU.
        fn vnni(&self) -> Option<Vnni> {
            self.vnni.then(vnni::detect).flatten()
        }
    }

    fn packed(m: &PackedMatrix) -> &Packed {
        m.get::<Packed>().expect("matrix packed by the llamafile backend")
    }

    fn ggml(f: WeightFormat) -> kt_core::ggml::GgmlType {
        match f {
            WeightFormat::Ggml(t) => t,
            _ => unreachable!("the llamafile backend is only handed GGML formats"),
        }
    }

    /// `dst[..nr] = src[..nr]`; a whole tile as one fixed-size move (a call to `memmove`
    /// for 16 bytes otherwise, per tile and token).
    #[inline(always)]
    fn put(dst: &mut [f32], src: &[f32; R], nr: usize) {
        if nr == R {
            dst[..R].copy_from_slice(src);
        } else {
            dst[..nr].copy_from_slice(&src[..nr]);
        }
    }

    /// `emit(r0, nr, results, scratch)` for each tile of up to `R` rows of `rows`, results
    /// `[n][R]`, for two tokens or more (one goes to [`gemv`]).
    fn for_tiles(
        w: &Packed,
        rows: &Range<usize>,
        act: &[u8],
        n: usize,
        mut emit: impl FnMut(usize, usize, &[[f32; R]], &mut Scratch),
    ) {
        let mut out = vec![[0.0f32; R]; n];
        let mut scratch = Scratch::new();
        for r0 in rows.clone().step_by(R) {
            let nr = R.min(rows.end - r0);
            // SAFETY: selected only where cpu_support passed (AVX2, FMA, F16C), VNNI where
            // detected; act was prepared by quantize_act for this matrix's type with n tokens.
            unsafe { dots(w, r0, nr, act, n, &mut out, &mut scratch) };
            emit(r0, nr, &out, &mut scratch);
        }
    }

    impl Backend for Llamafile {
        fn name(&self) -> &'static str {
            if self.vnni {
                "llamafile"
            } else {
                "llamafile-avx2"
            }
        }

        fn priority(&self) -> u32 {
            // Below avx2: it serves only GGML formats, which avx2 declines.
            5
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            if !std::arch::is_x86_feature_detected!("avx2") {
                Err("AVX2")
            } else if !std::arch::is_x86_feature_detected!("fma") {
                Err("FMA")
            } else if !std::arch::is_x86_feature_detected!("f16c") {
                Err("F16C")
            } else {
                Ok(())
            }
        }

        fn supports(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
            matches!(format, WeightFormat::Ggml(_)) && cols % format.col_multiple() == 0
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            let t = ggml(m.format());
            let p = Packed::new(t, m.rows(), m.cols(), m.data(), self.vnni());
            Ok(PackedMatrix::new(m.format(), m.rows(), m.cols(), p.data.len(), p))
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            crate::act::bytes(ggml(format), rows, cols, self.vnni().is_some())
        }

        fn quantize_act(&self, format: WeightFormat, cols: usize, src: &[bf16], rows: &[u32], dst: &mut [u8]) {
            // SAFETY: cpu_support passed before this backend was selected.
            unsafe { crate::act::prepare(ggml(format), cols, src, rows, dst, self.vnni().is_some()) }
        }

        fn gate_up(
            &self,
            gate: &PackedMatrix,
            up: &PackedMatrix,
            rows: Range<usize>,
            act: &[u8],
            mut h: MatMut<'_, bf16>,
        ) {
            let (g, u) = (packed(gate), packed(up));
            let (n, nr) = (h.rows(), rows.len());
            // The activations were prepared for gate's type; up may read another layout.
            let moved = crate::act::relayout(u.t, g.t, act, n, g.cols, self.vnni().is_some());
            let up_act: &[u8] = moved.as_deref().map_or(act, bytemuck::cast_slice);
            // Gate and up of the whole task, token-major, then SwiGLU 16 lanes at a time.
            let (mut gs, mut us) = (vec![0.0f32; n * nr], vec![0.0f32; n * nr]);
            if n == 1 {
                // SAFETY: as in for_tiles.
                unsafe {
                    gemv(g, rows.clone(), act, &mut gs);
                    gemv(u, rows.clone(), up_act, &mut us);
                }
            } else {
                let mut ut = vec![[0.0f32; R]; n];
                for_tiles(g, &rows, act, n, |r0, k, gt, scratch| {
                    // SAFETY: as in for_tiles.
                    unsafe { dots(u, r0, k, up_act, n, &mut ut, scratch) };
                    for t in 0..n {
                        let at = t * nr + r0 - rows.start;
                        put(&mut gs[at..], &gt[t], k);
                        put(&mut us[at..], &ut[t], k);
                    }
                });
            }
            for t in 0..n {
                let (gr, ur, out) = (&gs[t * nr..(t + 1) * nr], &us[t * nr..(t + 1) * nr], h.row_mut(t));
                let mut c = 0;
                while c + 16 <= nr {
                    let mut bits = [0u16; 16];
                    let (g16, u16s) = (gr[c..c + 16].try_into().expect("16"), ur[c..c + 16].try_into().expect("16"));
                    // SAFETY: cpu_support (AVX2, FMA) passed before this backend was selected.
                    unsafe { kt_backend_avx2::swiglu16(g16, u16s, &mut bits) };
                    for (o, b) in out[c..c + 16].iter_mut().zip(bits) {
                        *o = bf16::from_bits(b);
                    }
                    c += 16;
                }
                for j in c..nr {
                    out[j] = swiglu(gr[j], ur[j]);
                }
            }
        }

        fn uses_vnni(&self, format: WeightFormat) -> bool {
            self.vnni().is_some() && vnni::runs(ggml(format))
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, act: &[u8], mut y: MatMut<'_, f32>) {
            let d = packed(down);
            let n = y.rows();
            if n == 1 {
                // SAFETY: as in for_tiles.
                unsafe { gemv(d, rows.clone(), act, y.row_mut(0)) };
                return;
            }
            for_tiles(d, &rows, act, n, |r0, nr, res, _| {
                for (t, r) in res.iter().enumerate() {
                    put(&mut y.row_mut(t)[r0 - rows.start..], r, nr);
                }
            });
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Both instances where this CPU has VNNI (the AVX2 kernels and the VNNI ones), else one.
    fn instances() -> Vec<&'static Llamafile> {
        if crate::vnni::detect().is_some() {
            vec![&LLAMAFILE, &LLAMAFILE_AVX2]
        } else {
            eprintln!("this CPU has no VNNI: its kernels are not tested here");
            vec![&LLAMAFILE]
        }
    }

    /// VNNI where it runs: q8_0, the unsigned 32-column types and q4_K/q5_K/iq4_xs, the
    /// registered instance, a VNNI CPU.
    #[test]
    fn uses_vnni_names_the_kernels_that_run_on_it() {
        use kt_core::ggml::GgmlType;
        use kt_core::{Backend, WeightFormat};
        let (q8, q4) = (WeightFormat::Ggml(GgmlType::Q8_0), WeightFormat::Ggml(GgmlType::Q4_0));
        let here = crate::vnni::detect().is_some();
        assert_eq!(LLAMAFILE.uses_vnni(q8), here);
        assert_eq!(LLAMAFILE.uses_vnni(q4), here);
        assert!(!LLAMAFILE.uses_vnni(WeightFormat::Ggml(GgmlType::IQ4_NL)));
        assert_eq!(LLAMAFILE.uses_vnni(WeightFormat::Ggml(GgmlType::Q4_K)), here);
        assert_eq!(LLAMAFILE.uses_vnni(WeightFormat::Ggml(GgmlType::IQ4_XS)), here);
        assert!(!LLAMAFILE.uses_vnni(WeightFormat::Ggml(GgmlType::Q6_K)));
        assert!(!LLAMAFILE_AVX2.uses_vnni(q8));
    }

    #[test]
    fn conformance() {
        if let Err(missing) = kt_core::Backend::cpu_support(&crate::LLAMAFILE) {
            eprintln!("conformance skipped: this CPU lacks {missing}");
            return;
        }
        for b in instances() {
            let failures = kt_core::testing::ggml_conformance_failures(b, &kt_core::SerialExecutor);
            assert!(failures.is_empty(), "{}: {} failures:\n{}", b.name(), failures.len(), failures.join("\n"));
        }
    }

    /// Every tile shape of the kernels (one token; 2-4; 5-32; 33-64 in one tile; more in
    /// several; a last tile of fewer than `R` rows; a row range starting inside the matrix;
    /// a 32-column type's last group part padding)
    /// against the reference backend's dots of the same weights and activations; the VNNI
    /// kernels, where they run, bit for bit against the AVX2 ones.
    #[test]
    fn tiles_match_the_reference_at_every_token_count() {
        use half::bf16;
        use kt_core::aligned::AlignedBuf;
        use kt_core::ggml::{random_matrix, GgmlType};
        use kt_core::mat::MatMut;
        use kt_core::reference::REFERENCE;
        use kt_core::rng::SplitMix64;
        use kt_core::{Backend, WeightFormat};

        if LLAMAFILE.cpu_support().is_err() {
            return;
        }
        let rows = 6;
        let mut failures = Vec::new();
        for &t in GgmlType::ALL {
            let format = WeightFormat::Ggml(t);
            let cols = if format.col_multiple() == 256 { 512 } else { 288 };
            let m = random_matrix(t, rows, cols, 3);
            for n in [1, 2, 4, 5, 32, 33, 64, 65, 130] {
                let mut r = SplitMix64::new(n as u64);
                let x: Vec<bf16> = (0..n * cols).map(|_| bf16::from_f32(r.gaussian())).collect();
                let ids: Vec<u32> = (0..n as u32).collect();
                // Rows in two calls, as the plan's row blocks (granularity 1): a full tile
                // and a 1-row one, then a call starting at row 5, not a multiple of `R`.
                let y = |b: &dyn Backend| {
                    let w = b.pack(&m).expect("packs");
                    let mut act = AlignedBuf::zeroed(b.act_bytes(format, n, cols));
                    b.quantize_act(format, cols, &x, &ids, act.as_mut_slice());
                    let mut y = vec![0.0f32; n * rows];
                    for part in [0..5, 5..rows] {
                        let view = MatMut::from_slice(&mut y[part.start..], n, part.len(), rows);
                        b.down(&w, part, act.as_mut_slice(), view);
                    }
                    y
                };
                let want = y(&REFERENCE);
                let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(1e-30);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let mut first: Option<Vec<u32>> = None;
                for b in instances() {
                    let got = y(b);
                    // `f32::max` would drop a NaN error; this fold keeps it, and the check sees it.
                    let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs() / scale).fold(0.0f32, |a, e| {
                        if e.is_nan() || e > a {
                            e
                        } else {
                            a
                        }
                    });
                    if worst.is_nan() || worst > 1e-5 {
                        failures.push(format!("{} {t:?} n{n}: max error {worst:.2e} of the largest output", b.name()));
                    }
                    match &first {
                        Some(f) if *f != bits(&got) => failures.push(format!("{} {t:?} n{n}: bits differ", b.name())),
                        Some(_) => {}
                        None => first = Some(bits(&got)),
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
