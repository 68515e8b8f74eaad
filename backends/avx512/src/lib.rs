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
//! Its kernels are `kt-zmm`'s (the panel layouts, prepared activations and microkernels at each
//! level, which the `amx` backend shares); this crate names the levels as backends and selects
//! the best. Built with rustc ≥ 1.89 (`build.rs`); with an older one it registers nothing.
//!
//! **Must not** depend on another backend crate (what the x86 backends share is `kt-x86`'s and
//! `kt-zmm`'s), nor serve GGML formats (the `llamafile` backend's).
//!
//! # Safety
//! Every `unsafe fn` here needs the instructions of the level it runs (checked once by
//! `cpu_support` before the backend is selected) and slices as long as its doc says.

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
/// The level type, and the layouts and kernels the backends run (`kt-zmm`'s).
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use kt_zmm::{act, fold_exponents, fp8_tile_rows, glu_panel, mx_exponent_steps, pack, put_panel, Level};

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod imp {
    use core::ops::Range;

    use half::bf16;
    use kt_core::backend::{ActLayout, Instructions, TaskShape};
    use kt_core::bias::GateUpBias;
    use kt_core::mat::MatMut;
    use kt_core::swiglu::Glu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};
    use kt_zmm::pack::PANEL;
    use kt_zmm::{best_level, support, Level, Zmm};

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

    impl Avx512 {
        /// The level this backend runs: its own, or the best this CPU runs.
        pub fn level(&self) -> Level {
            self.level.unwrap_or_else(best_level)
        }

        /// Its level's kernels.
        fn zmm(&self) -> Zmm {
            // SAFETY: a backend's kernels run only after its cpu_support held (selection, and
            // every test through `skip_unless_runs!`), which is `support(level)`.
            unsafe { Zmm::new(self.level()) }
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
            Zmm::serves(format, cols)
        }

        fn row_granularity(&self, _format: WeightFormat) -> usize {
            PANEL
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            Ok(self.zmm().pack(m).named(self.name))
        }

        fn pack_kt(
            &self,
            format: WeightFormat,
            rows: usize,
            cols: usize,
            bytes: &[u8],
            scales: &[f32],
        ) -> Option<Result<PackedMatrix, Error>> {
            Some(self.zmm().pack_kt(format, rows, cols, bytes, scales)?.map(|m| m.named(self.name)))
        }

        fn act_layout(&self, format: WeightFormat) -> ActLayout {
            self.zmm().act_layout(format)
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            self.zmm().act_bytes(format, rows, cols)
        }

        fn sft_kernels(&self) -> &'static kt_core::sft::SftKernels {
            kt_x86_sft::kernels_512()
        }

        fn scratch_bytes(&self, shape: TaskShape) -> usize {
            self.zmm().scratch_bytes(shape)
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
            self.zmm().quantize_act(format, cols, src, rows, dst, scratch)
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
            h: MatMut<'_, bf16>,
            scratch: &mut [u8],
        ) {
            self.zmm().gate_up(gate.inner(), up.inner(), rows, act_gate, act_up, glu, bias, h, scratch)
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, a: &[u8], y: MatMut<'_, f32>, scratch: &mut [u8]) {
            self.zmm().down(down.inner(), rows, a, y, scratch)
        }

        fn instructions(&self, format: WeightFormat) -> Instructions {
            self.zmm().instructions(format)
        }
    }
}

#[cfg(all(test, target_arch = "x86_64", avx512_intrinsics))]
mod tests;
