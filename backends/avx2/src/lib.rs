//! kt-kernel-rs backend `avx2`: AVX2+FMA kernels for every weight format (bf16, per-row int8,
//! KT int4, K-group int4, fp8 block and per-channel), for CPUs without AVX-512: AMD Zen2/Zen3,
//! consumer Intel. Registered when the CPU has AVX2 and FMA (checked at run time).
//!
//! Weights are packed into 16-row panels (`pack`); activations prepared per token (`act`);
//! one microkernel family (`kernels`) serves decode (runs of 1-5 tokens) and prefill (6×16
//! runs, 4×16 for int formats); a `matrix::Matrix` is a packed matrix with its microkernel,
//! chosen when it is packed.
//!
//! **Must not** depend on another backend crate (what the x86 backends share is `kt-x86`'s),
//! nor serve GGML formats (the `llamafile` backend's).
//!
//! # Safety
//! Every `unsafe fn` here needs AVX2 and FMA (checked once by `cpu_support` before the backend
//! is selected) and slices as long as its doc says.

#[cfg(target_arch = "x86_64")]
mod act;
#[cfg(target_arch = "x86_64")]
mod kernels;
#[cfg(target_arch = "x86_64")]
mod matrix;
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

#[cfg(target_arch = "x86_64")]
mod imp {
    use core::ops::Range;

    use half::bf16;
    use kt_core::backend::{ActLayout, Instructions, TaskShape};
    use kt_core::bias::{with_bias, GateUpBias};
    use kt_core::mat::MatMut;
    use kt_core::swiglu::Glu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};
    use kt_x86::panels::{panels, token_runs, PanelRows};
    use kt_x86::swiglu::glu16;

    use crate::act::{self, Act};
    use crate::kernels::{Acc, MAX_RUN};
    use crate::matrix::Matrix;
    use crate::pack::PANEL;

    /// The AVX2 backend.
    #[derive(Debug)]
    pub struct Avx2;

    /// The one instance.
    pub static AVX2: Avx2 = Avx2;

    /// Run every (panel, token run) of `rows` of `m` and hand each run's results to `emit`.
    fn for_tiles(
        m: &Matrix,
        rows: &Range<usize>,
        act: &Act<'_>,
        n: usize,
        mut emit: impl FnMut(&PanelRows, usize, usize, &Acc),
    ) {
        let mut tile: Acc = [[0.0; PANEL]; MAX_RUN];
        for panel in panels(rows.clone(), PANEL) {
            for (t0, nt) in token_runs(n, m.max_run) {
                // SAFETY: the backend is only selected when AVX2+FMA are present (cpu_support),
                // and `act` was prepared by this backend for m's format and K with n rows.
                unsafe { (m.run)(&m.w, panel.index, act, t0, nt, &mut tile) };
                emit(&panel, t0, nt, &tile);
            }
        }
    }

    impl Backend for Avx2 {
        fn name(&self) -> &'static str {
            "avx2"
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            kt_x86::isa::avx2_fma()
        }

        fn serves(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
            // Every format of ours; GGML's types are the llamafile backend's.
            let known = !matches!(format, WeightFormat::Ggml(_));
            known && cols % format.col_multiple() == 0
        }

        fn row_granularity(&self, _format: WeightFormat) -> usize {
            PANEL
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            Ok(Matrix::pack(self.name(), m))
        }

        fn act_layout(&self, format: WeightFormat) -> ActLayout {
            ActLayout(act::layout(format))
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            act::bytes(format, rows, cols)
        }

        fn sft_kernels(&self) -> &'static kt_core::sft::SftKernels {
            kt_x86_sft::kernels()
        }

        fn scratch_bytes(&self, shape: TaskShape) -> usize {
            act::scratch_bytes(shape.cols)
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
            act::prepare(format, cols, src, rows, dst, scratch)
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
            _scratch: &mut [u8],
        ) {
            let (gate, up, n) = (gate.inner::<Matrix>(), up.inner::<Matrix>(), h.rows());
            let (g, u) = (&gate.w, &up.w);
            let (ag, au) = (Act::parse(g.format, g.cols, n, act_gate), Act::parse(u.format, u.cols, n, act_up));
            let mut ut: Acc = [[0.0; PANEL]; MAX_RUN];
            let (mut hv, mut room) = ([0u16; PANEL], [[0.0; PANEL]; 2]);
            // Each up tile is paired with the gate tile of the same panel and tokens.
            for_tiles(gate, &rows, &ag, n, |panel, t0, nt, gt| {
                // SAFETY: as in for_tiles, for `up`.
                unsafe { (up.run)(u, panel.index, &au, t0, nt, &mut ut) };
                let (at, within) = (panel.rows.start - rows.start, panel.in_panel(PANEL));
                for t in 0..nt {
                    let first = panel.index * PANEL;
                    let (gv, uv) = with_bias(bias, first, within.clone(), [&gt[t], &ut[t]], &mut room);
                    // SAFETY: cpu_support guarantees AVX2+FMA before this backend is used.
                    unsafe { glu16(glu, gv, uv, &mut hv) };
                    let out = &mut h.row_mut(t0 + t)[at..at + within.len()];
                    for (o, &v) in out.iter_mut().zip(&hv[within.clone()]) {
                        *o = bf16::from_bits(v);
                    }
                }
            });
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, a: &[u8], mut y: MatMut<'_, f32>, _scratch: &mut [u8]) {
            let (down, n) = (down.inner::<Matrix>(), y.rows());
            let act = Act::parse(down.w.format, down.w.cols, n, a);
            for_tiles(down, &rows, &act, n, |panel, t0, nt, tile| {
                let (at, within) = (panel.rows.start - rows.start, panel.in_panel(PANEL));
                for (t, res) in tile.iter().enumerate().take(nt) {
                    y.row_mut(t0 + t)[at..at + within.len()].copy_from_slice(&res[within.clone()]);
                }
            });
        }

        fn instructions(&self, format: WeightFormat) -> Instructions {
            if format.int_activations() {
                Instructions::Int8Pairs
            } else {
                Instructions::FmaF32
            }
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
    fn packing_keeps_every_weight() {
        let mut r = SplitMix64::new(3);
        for f in WeightFormat::ALL {
            // (130 and 6 columns: a last int4 octet or int8 quad only partly filled.)
            for (rows, cols) in [(1, 128), (17, 256), (40, 384), (5, 130), (3, 6)] {
                if cols % f.col_multiple() != 0 {
                    continue;
                }
                let x: Vec<f32> = (0..rows * cols).map(|_| r.uniform(2.0)).collect();
                let q = QuantMatrix::quantize(f, rows, cols, &x).unwrap();
                let deq = q.dequantize();
                let p = pack::pack(&q);
                for row in 0..rows {
                    for c in 0..cols {
                        let raw = pack::unpack(&p, row, c);
                        let scale = match f {
                            WeightFormat::Bf16 => 1.0,
                            f if f.k_group().is_some() => {
                                let g = f.k_group().unwrap();
                                q.scales()[row * (cols / g) + c / g]
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

    /// K-group int4 scales are packed as bf16 bits where every one is a bf16, else kept f32
    /// (GPTQ's f16 scales, loaded as stored); the conformance suite runs both kinds.
    #[test]
    fn kgroup_scales_pack_as_bf16_only_where_they_are_bf16() {
        let f = WeightFormat::Int4Group { group: 32 };
        for (scale, bf16) in [(0.01f32, false), (f32::from_bits(0.01f32.to_bits() & 0xFFFF_0000), true)] {
            let m = QuantMatrix::from_parts(f, 32, 64, vec![0x3C; 32 * 32], vec![scale; 64]).unwrap();
            let p = pack::pack(&m);
            let halves = (p.scales.is_empty(), p.scales16.iter().all(|&h| f32::from_bits(u32::from(h) << 16) == scale));
            assert_eq!((halves, p.scales16.len()), ((bf16, true), if bf16 { 2 * 2 * 16 } else { 0 }), "{scale}");
        }
    }
}
