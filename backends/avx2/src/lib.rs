//! kt-kernel-rs backend `avx2`: AVX2+FMA kernels for every weight format (bf16, per-row int8,
//! KT int4, K-group int4, fp8 block and per-channel), for CPUs without AVX-512: AMD Zen2/Zen3,
//! consumer Intel. Registered when the CPU has AVX2 and FMA (checked at run time).
//!
//! Weights are packed into 16-row panels (`pack`); one microkernel family (`kernels`)
//! serves decode (tiles of 1-5 tokens) and prefill (6×16 tiles, 4×16 for int formats).

#[cfg(target_arch = "x86_64")]
mod act;
#[cfg(target_arch = "x86_64")]
mod kernels;
#[cfg(target_arch = "x86_64")]
mod pack;

use kt_core::Backend;

/// The backends this crate registers with the host.
pub fn registered() -> &'static [&'static dyn Backend] {
    #[cfg(target_arch = "x86_64")]
    {
        static LIST: [&dyn Backend; 1] = [&imp::AVX2];
        &LIST
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        &[]
    }
}

#[cfg(target_arch = "x86_64")]
pub use imp::{Avx2, AVX2};
/// KT's SwiGLU on 16 lanes (also used by the llamafile backend).
#[cfg(target_arch = "x86_64")]
pub use kernels::swiglu16;

#[cfg(target_arch = "x86_64")]
mod imp {
    use core::ops::Range;

    use half::bf16;
    use kt_core::mat::MatMut;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};

    use crate::act::{self, Act};
    use crate::kernels::{panel_tile, swiglu16, Tile, MAX_NT, MAX_NT_INT};
    use crate::pack::{self, Packed, PANEL};

    /// The AVX2 backend.
    #[derive(Debug)]
    pub struct Avx2;

    /// The one instance.
    pub static AVX2: Avx2 = Avx2;

    fn packed(m: &PackedMatrix) -> &Packed {
        m.get::<Packed>().expect("matrix packed by the avx2 backend")
    }

    /// Run every (panel, token tile) of `rows` of `w` and hand each tile to `emit`.
    fn for_tiles(
        w: &Packed,
        rows: &Range<usize>,
        act: &Act<'_>,
        n: usize,
        mut emit: impl FnMut(usize, usize, usize, &Tile),
    ) {
        let max_nt = if matches!(act, Act::Int { .. }) { MAX_NT_INT } else { MAX_NT };
        let mut tile: Tile = [[0.0; PANEL]; MAX_NT];
        for p in rows.start / PANEL..rows.end.div_ceil(PANEL) {
            let mut t0 = 0;
            while t0 < n {
                let nt = (n - t0).min(max_nt);
                // SAFETY: the backend is only selected when AVX2+FMA are present (cpu_support),
                // and `act` was prepared by this backend for w's format and K with n rows.
                unsafe { panel_tile(w, p, act, t0, nt, &mut tile) };
                emit(p, t0, nt, &tile);
                t0 += nt;
            }
        }
    }

    impl Backend for Avx2 {
        fn name(&self) -> &'static str {
            "avx2"
        }

        fn priority(&self) -> u32 {
            10
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                Ok(())
            } else {
                Err("avx2+fma")
            }
        }

        fn supports(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
            let known = matches!(
                format,
                WeightFormat::Bf16
                    | WeightFormat::Int8Row
                    | WeightFormat::Int4Row
                    | WeightFormat::Int4Group { .. }
                    | WeightFormat::Fp8Block
                    | WeightFormat::Fp8Channel
            );
            known && cols % format.col_multiple() == 0
        }

        fn row_granularity(&self, _format: WeightFormat) -> usize {
            PANEL
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            let p = pack::pack(m);
            Ok(PackedMatrix::new(m.format(), m.rows(), m.cols(), p.bytes(), p))
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            act::bytes(format, rows, cols)
        }

        fn quantize_act(&self, format: WeightFormat, cols: usize, src: &[bf16], rows: &[u32], dst: &mut [u8]) {
            act::prepare(format, cols, src, rows, dst)
        }

        fn gate_up(
            &self,
            gate: &PackedMatrix,
            up: &PackedMatrix,
            rows: Range<usize>,
            a: &[u8],
            mut h: MatMut<'_, bf16>,
        ) {
            let (g, u) = (packed(gate), packed(up));
            let n = h.rows();
            let act = Act::parse(g.format, g.cols, n, a);
            let mut ut: Tile = [[0.0; PANEL]; MAX_NT];
            let mut hv = [0u16; PANEL];
            // Each up tile is paired with the gate tile of the same panel and tokens.
            for_tiles(g, &rows, &act, n, |p, t0, nt, gt| {
                // SAFETY: as in for_tiles.
                unsafe { panel_tile(u, p, &act, t0, nt, &mut ut) };
                let (r0, r1) = ((p * PANEL).max(rows.start), ((p + 1) * PANEL).min(rows.end));
                for t in 0..nt {
                    // SAFETY: cpu_support guarantees AVX2+FMA before this backend is used.
                    unsafe { swiglu16(&gt[t], &ut[t], &mut hv) };
                    let out = &mut h.row_mut(t0 + t)[r0 - rows.start..r1 - rows.start];
                    for (o, &v) in out.iter_mut().zip(&hv[r0 - p * PANEL..r1 - p * PANEL]) {
                        *o = bf16::from_bits(v);
                    }
                }
            });
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, a: &[u8], mut y: MatMut<'_, f32>) {
            let d = packed(down);
            let n = y.rows();
            let act = Act::parse(d.format, d.cols, n, a);
            for_tiles(d, &rows, &act, n, |p, t0, nt, tile| {
                let (r0, r1) = ((p * PANEL).max(rows.start), ((p + 1) * PANEL).min(rows.end));
                for (t, res) in tile.iter().enumerate().take(nt) {
                    y.row_mut(t0 + t)[r0 - rows.start..r1 - rows.start]
                        .copy_from_slice(&res[r0 - p * PANEL..r1 - p * PANEL]);
                }
            });
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use kt_core::rng::SplitMix64;
    use kt_core::{QuantMatrix, WeightFormat};

    use crate::pack;

    kt_core::conformance_suite!(&crate::AVX2);

    #[test]
    fn swiglu16_matches_the_scalar_definition() {
        if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")) {
            return;
        }
        let mut r = SplitMix64::new(9);
        let mut worst = 0.0f32;
        for round in 0..2000 {
            let scale = [0.1, 1.0, 10.0, 100.0][round % 4];
            let g: [f32; 16] = core::array::from_fn(|_| r.uniform(scale));
            let u: [f32; 16] = core::array::from_fn(|_| r.uniform(scale));
            let mut out = [0u16; 16];
            // SAFETY: AVX2 and FMA checked above.
            unsafe { crate::kernels::swiglu16(&g, &u, &mut out) };
            for i in 0..16 {
                let want = kt_core::swiglu::swiglu(g[i], u[i]).to_f32();
                let got = half::bf16::from_bits(out[i]).to_f32();
                // The polynomial exp may move a result across a bf16 rounding boundary: one ulp.
                let ulp = want.abs().max(f32::MIN_POSITIVE) / 128.0;
                assert!((got - want).abs() <= ulp, "g={} u={} got={got} want={want}", g[i], u[i]);
                worst = worst.max((got - want).abs() / ulp);
            }
        }
        assert!(worst <= 1.0);
        let mut out = [0u16; 16];
        // Extremes: very negative g gives ~0, very positive g gives g·u.
        unsafe { crate::kernels::swiglu16(&[-1000.0; 16], &[3.0; 16], &mut out) };
        assert!(half::bf16::from_bits(out[0]).to_f32().abs() < 1e-30);
        unsafe { crate::kernels::swiglu16(&[1000.0; 16], &[2.0; 16], &mut out) };
        assert_eq!(half::bf16::from_bits(out[0]).to_f32(), 2000.0);
    }

    #[test]
    fn packing_keeps_every_weight() {
        let mut r = SplitMix64::new(3);
        for f in WeightFormat::ALL {
            for (rows, cols) in [(1, 128), (17, 256), (40, 384)] {
                let x: Vec<f32> = (0..rows * cols).map(|_| r.uniform(2.0)).collect();
                let q = QuantMatrix::quantize(f, rows, cols, &x).unwrap();
                let deq = q.dequantize();
                let p = pack::pack(&q);
                for row in 0..rows {
                    for c in 0..cols {
                        let raw = pack::unpack(&p, row, c);
                        let scale = match f {
                            WeightFormat::Bf16 => 1.0,
                            WeightFormat::Int4Group { group } => {
                                q.scales()[row * (cols / usize::from(group)) + c / usize::from(group)]
                            }
                            WeightFormat::Fp8Block => q.scales()[(row / 128) * cols.div_ceil(128) + c / 128],
                            _ => q.scales()[row],
                        };
                        assert_eq!(raw * scale, deq[row * cols + c], "{f} r{row} c{c}");
                    }
                }
            }
        }
    }
}
