//! kt-kernel-rs backend crate `avx512`: AVX-512 kernels for every weight format the AVX2 backend
//! runs (bf16, per-row int8, KT int4, K-group int4, fp8 block and per-channel, mxfp4, mxfp8),
//! for the Xeons (Skylake-SP on) and AMD Zen 4/5 most KT users run.
//!
//! It registers KT's run-time sub-variants as backends of their own, each using only the
//! instructions its name allows, so each can be forced with `KT_KERNEL_CPU_VARIANT`:
//!
//! | backend | needs | integer dots | bf16 and fp8 weights |
//! |---|---|---|---|
//! | `avx512_base` | F, BW | `vpmaddubsw`/`vpmaddwd` | widened to f32, `vfmadd231ps` |
//! | `avx512_vnni` | + VNNI | `vpdpbusd` | widened to f32, `vfmadd231ps` |
//! | `avx512_vbmi` | + VBMI | `vpdpbusd`, mxfp4's and int4's nibble tables by `vpermb` | widened to f32, `vfmadd231ps` |
//! | `avx512_bf16` | + BF16 | `vpdpbusd` | `vdpbf16ps` (fp8 to bf16 by `vpermi2b` tables) |
//! | `avx512` | F, BW | the best of the above this CPU runs | |
//!
//! (VL too, which every CPU with BW has.)
//!
//! Weights are packed into 32-row panels of 128-byte units (`pack`); activations prepared per
//! token (`act`); one microkernel family (`kernels`) serves decode and prefill (tiles of up to
//! 12 tokens × 32 rows). Built with rustc ≥ 1.89 (`build.rs`); with an older one it registers
//! nothing.
//!
//! **Must not** depend on another backend crate (what the x86 backends share is `kt-x86`'s),
//! nor serve GGML formats (the `llamafile` backend's).
//!
//! # Safety
//! Every `unsafe fn` here needs the instructions of the level it runs (checked once by
//! `cpu_support` before the backend is selected) and slices as long as its doc says.

// The 1.89 intrinsics are compiled only where build.rs found rustc ≥ 1.89.
#![allow(clippy::incompatible_msrv)]

// `pack` and `act` are public for the AMX backend, whose tiles read the same packed bytes and
// prepared activations (every AMX CPU has AVX-512).
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod act;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod kernels;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod pack;

use kt_core::Backend;

/// The backends this crate registers with the host, best first: `avx512` (the best sub-variant
/// this CPU runs), then KT's sub-variants from the widest.
pub fn registered() -> &'static [&'static dyn Backend] {
    #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
    {
        static LIST: [&dyn Backend; 5] = [&imp::AVX512, &imp::BF16, &imp::VBMI, &imp::VNNI, &imp::BASE];
        &LIST
    }
    #[cfg(not(all(target_arch = "x86_64", avx512_intrinsics)))]
    {
        &[]
    }
}

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use imp::{Avx512, AVX512, BF16 as AVX512_BF16};
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use kernels::{fold_exponents, fp8_tile_rows, glu_panel, mx_exponent_steps, put_panel};

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use kernels::Level;

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod imp {
    use core::ops::Range;

    use half::bf16;
    use kt_core::backend::{ActLayout, Instructions, TaskShape};
    use kt_core::bias::{with_bias, GateUpBias};
    use kt_core::mat::MatMut;
    use kt_core::swiglu::Glu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};
    use kt_x86::tiles::{balanced_token_tiles, row_tiles, RowTile};

    use crate::act::{self, Act};
    use crate::kernels::{glu_panel, max_tokens, panel_tile, put_panel, Level, Tile, MAX_NT};
    use crate::pack::{self, Packed, PANEL};

    /// An AVX-512 backend: one of KT's sub-variants, or (`level: None`) the best this CPU runs.
    #[derive(Debug)]
    pub struct Avx512 {
        name: &'static str,
        level: Option<Level>,
    }

    /// The best sub-variant this CPU runs.
    pub static AVX512: Avx512 = Avx512 { name: "avx512", level: None };
    /// `avx512_bf16`, KT's widest sub-variant.
    pub static BF16: Avx512 = Avx512 { name: "avx512_bf16", level: Some(Level::Bf16) };
    pub(crate) static VBMI: Avx512 = Avx512 { name: "avx512_vbmi", level: Some(Level::Vbmi) };
    pub(crate) static VNNI: Avx512 = Avx512 { name: "avx512_vnni", level: Some(Level::Vnni) };
    pub(crate) static BASE: Avx512 = Avx512 { name: "avx512_base", level: Some(Level::Base) };

    /// `Ok` if this CPU runs `level`, else the first missing feature. AVX2 and FMA too: the
    /// SwiGLU is `kt-x86`'s 256-bit one.
    fn support(level: Level) -> Result<(), &'static str> {
        let need: [(&str, bool, Level); 8] = [
            ("AVX2", is_x86_feature_detected!("avx2"), Level::Base),
            ("FMA", is_x86_feature_detected!("fma"), Level::Base),
            ("AVX512F", is_x86_feature_detected!("avx512f"), Level::Base),
            ("AVX512BW", is_x86_feature_detected!("avx512bw"), Level::Base),
            // Every CPU with AVX512BW has VL (Skylake-SP on, Zen 4 on); the masked loads use it.
            ("AVX512VL", is_x86_feature_detected!("avx512vl"), Level::Base),
            ("AVX512-VNNI", is_x86_feature_detected!("avx512vnni"), Level::Vnni),
            ("AVX512-VBMI", is_x86_feature_detected!("avx512vbmi"), Level::Vbmi),
            ("AVX512-BF16", is_x86_feature_detected!("avx512bf16"), Level::Bf16),
        ];
        match need.iter().find(|(_, has, from)| *from <= level && !has) {
            Some((missing, ..)) => Err(missing),
            None => Ok(()),
        }
    }

    impl Avx512 {
        /// The level this backend runs: its own, or the best this CPU runs (detected once: it
        /// is asked on every task).
        pub fn level(&self) -> Level {
            static BEST: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
            self.level.unwrap_or_else(|| {
                *BEST.get_or_init(|| {
                    let widest = [Level::Bf16, Level::Vbmi, Level::Vnni];
                    widest.into_iter().find(|&l| support(l).is_ok()).unwrap_or(Level::Base)
                })
            })
        }
    }

    impl Avx512 {
        /// Whether `format`'s kernels are the `vdpbf16ps` ones (bf16 activations, no f32 copy):
        /// float formats at the bf16 level.
        fn dot(&self, format: WeightFormat) -> bool {
            self.level() == Level::Bf16 && !format.int_activations()
        }
    }

    fn packed(m: &PackedMatrix) -> &Packed {
        m.get::<Packed>().expect("a layer hands a backend only the matrices it packed")
    }

    /// Run every (panel, token tile) of `rows` of `w` and hand each tile to `emit`, in tiles of
    /// at most `max_nt` tokens.
    fn for_tiles(
        level: Level,
        w: &Packed,
        rows: &Range<usize>,
        act: &Act<'_>,
        (n, max_nt): (usize, usize),
        mut emit: impl FnMut(&RowTile, usize, usize, &Tile),
    ) {
        let mut tile: Tile = [[0.0; PANEL]; MAX_NT];
        for panel in row_tiles(rows.clone(), PANEL) {
            for (t0, nt) in balanced_token_tiles(n, max_nt) {
                // SAFETY: the backend is only selected when the CPU runs `level` (cpu_support),
                // and `act` was prepared by this backend for w's format and K with n rows.
                unsafe { panel_tile(level, w, panel.index, act, t0, nt, &mut tile) };
                emit(&panel, t0, nt, &tile);
            }
        }
    }

    impl Backend for Avx512 {
        fn name(&self) -> &'static str {
            self.name
        }

        /// KT's name of the sub-variant this backend runs (`avx512_bf16` … `avx512_base`).
        fn variant(&self) -> &'static str {
            match self.level() {
                Level::Bf16 => BF16.name,
                Level::Vbmi => VBMI.name,
                Level::Vnni => VNNI.name,
                Level::Base => BASE.name,
            }
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            support(self.level.unwrap_or(Level::Base))
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
            Ok(pack::matrix(self.name, m, self.level()))
        }

        fn pack_kt(
            &self,
            format: WeightFormat,
            rows: usize,
            cols: usize,
            bytes: &[u8],
            scales: &[f32],
        ) -> Option<Result<PackedMatrix, Error>> {
            pack::kt_matrix(self.name, format, rows, cols, bytes, scales)
        }

        fn act_layout(&self, format: WeightFormat) -> ActLayout {
            ActLayout(act::layout(format, self.dot(format)))
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            act::bytes(format, rows, cols, self.dot(format))
        }

        fn sft_kernels(&self) -> &'static kt_core::sft::SftKernels {
            &kt_x86_sft::KERNELS_512
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
            act::prepare(format, cols, src, rows, dst, scratch, self.dot(format))
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
            let (g, u, level) = (packed(gate), packed(up), self.level());
            let n = h.rows();
            let ag = Act::parse(g.format, g.cols, n, act_gate, self.dot(g.format));
            let au = Act::parse(u.format, u.cols, n, act_up, self.dot(u.format));
            let (mut ut, mut room): (Tile, _) = ([[0.0; PANEL]; MAX_NT], [[0.0; PANEL]; 2]);
            // Each up tile is paired with the gate tile of the same panel and tokens.
            let max_nt = max_tokens(g).min(max_tokens(u));
            for_tiles(level, g, &rows, &ag, (n, max_nt), |panel, t0, nt, gt| {
                // SAFETY: as in for_tiles.
                unsafe { panel_tile(level, u, panel.index, &au, t0, nt, &mut ut) };
                let (at, within) = (panel.rows.start - rows.start, panel.in_tile(PANEL));
                for t in 0..nt {
                    let out = &mut h.row_mut(t0 + t)[at..at + within.len()];
                    let first = panel.index * PANEL;
                    let (gv, uv) = with_bias(bias, first, within.clone(), [&gt[t], &ut[t]], &mut room);
                    // SAFETY: cpu_support guarantees AVX2+FMA before this backend is used.
                    unsafe { glu_panel(glu, gv, uv, within.clone(), out) };
                }
            });
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, a: &[u8], mut y: MatMut<'_, f32>, _scratch: &mut [u8]) {
            let d = packed(down);
            let n = y.rows();
            let act = Act::parse(d.format, d.cols, n, a, self.dot(d.format));
            for_tiles(self.level(), d, &rows, &act, (n, max_tokens(d)), |panel, t0, nt, tile| {
                let (at, within) = (panel.rows.start - rows.start, panel.in_tile(PANEL));
                for (t, res) in tile.iter().enumerate().take(nt) {
                    put_panel(&mut y.row_mut(t0 + t)[at..at + within.len()], res, within.clone());
                }
            });
        }

        fn instructions(&self, format: WeightFormat) -> Instructions {
            match (format.int_activations(), self.level()) {
                (true, Level::Base) => Instructions::Int8PairsZmm,
                (true, _) => Instructions::Int8Vnni,
                (false, Level::Bf16) => Instructions::Bf16DotZmm,
                (false, _) => Instructions::FmaF32Zmm,
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64", avx512_intrinsics))]
mod tests;
