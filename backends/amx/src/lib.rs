//! kt-kernel-rs backend crate `amx`: Intel AMX tiles (through `asm!`) for the experts with many
//! tokens, the AVX-512 backend's kernels for the others, on the same packed bytes.
//!
//! The weights are packed as the `avx512_bf16` level packs them (`kt_zmm::pack`, shared with
//! the `avx512` backend):
//! per-row int8 and int4 in KT's own `BufferB` order (so KT's converted files load by copying),
//! the rest in 32-row panels whose 128-byte units are rows of AMX B tiles of both halves (or,
//! for int4 and fp8 kinds, decode to them in L1). Each expert runs on tiles from its format's
//! measured threshold of tokens (`kernels::measured_tile_from`; `KT_AMX_TILE_FROM` overrides
//! it), on the AVX-512 kernels below it (`kernels`: every KT format has tile kernels: int8,
//! int4 per row and per K-group, mxfp4 on int8 tiles; bf16, fp8, mxfp8 on bf16 tiles); the
//! integer formats give the same bits either way (exact sums, one scaling order).
//!
//! The tile instructions sit behind a seam (`tile::TileOps`, `kt_x86::amx`, which the `llamafile`
//! backend's tile kernels share) with a scalar emulator, so the tile loops are tested on CPUs
//! without AMX (the `amx_emulated` backend of the tests).
//!
//! **Must not** depend on another backend crate (its AVX-512 kernels are `kt-zmm`'s: every AMX
//! CPU has AVX-512), nor serve GGML formats (the `llamafile` backend's).

// The 1.89 intrinsics are compiled only where build.rs found rustc ≥ 1.89.
#![allow(clippy::incompatible_msrv)]

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod kernels;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod matrix;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod probe;
/// The tile seam, `kt_x86::amx`.
#[cfg(target_arch = "x86_64")]
pub use kt_x86::amx as tile;

use kt_core::Backend;

/// The backends this crate registers with the host, best first: `amx`.
pub fn registered() -> &'static [&'static dyn Backend] {
    #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
    {
        static LIST: [&dyn Backend; 1] = [&imp::AMX];
        &LIST
    }
    #[cfg(not(all(target_arch = "x86_64", avx512_intrinsics)))]
    {
        &[]
    }
}

/// Release this thread's AMX tiles if it holds any (what a pool worker does before it parks:
/// a context switch then saves no tile data). Costs nothing elsewhere.
pub fn release_tiles() {
    #[cfg(target_arch = "x86_64")]
    tile::release();
}

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use imp::{AmxBackend, AMX};

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod imp {
    use core::marker::PhantomData;
    use core::ops::Range;

    use half::bf16;
    use kt_core::backend::{ActLayout, Instructions, TaskShape};
    use kt_core::bias::{with_bias, GateUpBias};
    use kt_core::mat::MatMut;
    use kt_core::swiglu::Glu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};
    use kt_x86::panels::{balanced_token_runs, panels};
    use kt_zmm::act::Act;
    use kt_zmm::pack::{Packed, PANEL};
    use kt_zmm::{glu_panel, put_panel, support, Level, Zmm};

    use crate::kernels::{self, Acc, Block, TileRun, Work, MAX_RUN};
    use crate::matrix::Matrix;
    #[cfg(test)]
    use crate::tile::Emulator;
    use crate::tile::{tile_from, Hardware, Tiles};

    /// The AMX backend over tile instructions `T`: [`Hardware`] (the `amx` backend:
    /// [`Amx`](crate::tile::Amx), or the `tile-floor` feature's floor), or the
    /// [`Emulator`](crate::tile::Emulator) (the tests' `amx_emulated`).
    pub struct AmxBackend<T> {
        name: &'static str,
        /// Tokens from which an expert runs on tiles; 0: [`tile_from`] with the format's
        /// measured threshold ([`kernels::measured_tile_from`]).
        from: usize,
        tiles: PhantomData<fn() -> T>,
    }

    impl<T> AmxBackend<T> {
        /// The backend named `name`, on tiles from `from` tokens per expert (0: the default).
        pub const fn new(name: &'static str, from: usize) -> Self {
            AmxBackend { name, from, tiles: PhantomData }
        }

        /// Tokens from which an expert of `format` runs on tiles (None: never).
        fn from(&self, format: WeightFormat, folds: bool) -> Option<usize> {
            tile_from(self.from, kernels::measured_tile_from(format, folds))
        }

        /// `simd` with its tile kernel and the tokens from which it runs, named this backend's.
        fn wrap(&self, simd: kt_zmm::Matrix) -> PackedMatrix
        where
            T: Tiles + 'static,
        {
            let w = &simd.w;
            let (format, rows, cols, bytes) = (w.format, w.rows, w.cols, w.bytes());
            let from = self.from(format, w.folds);
            PackedMatrix::new(self.name, format, rows, cols, bytes, Matrix::<T>::new(simd, from))
        }
    }

    impl<T> core::fmt::Debug for AmxBackend<T> {
        fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
            f.debug_struct("AmxBackend").field("name", &self.name).field("from", &self.from).finish()
        }
    }

    /// AMX tiles, with the AVX-512 kernels below each format's threshold of tokens (built with the
    /// `tile-floor` feature: `amx_floor`, on tiles whose products do nothing).
    pub static AMX: AmxBackend<Hardware> =
        AmxBackend::new(if cfg!(feature = "tile-floor") { "amx_floor" } else { "amx" }, 0);

    /// The `avx512_bf16` level's kernels: what runs below a format's tile threshold, and the
    /// prepared activations and packed bytes the tiles read.
    const SIMD_LEVEL: Level = Level::Bf16;

    /// [`SIMD_LEVEL`]'s kernels.
    fn simd() -> Zmm {
        // SAFETY: a backend's kernels run only after its cpu_support held, which includes
        // `support(SIMD_LEVEL)`.
        unsafe { Zmm::new(SIMD_LEVEL) }
    }

    impl<T: Tiles> AmxBackend<T> {
        /// Every (panel of `rows`, token block) of `w` through its tile kernel `run`, each
        /// handed to `emit` with its block (which may run another matrix's panel: `panel` the
        /// bytes of a panel of each). The token blocks go in groups whose activations stay in
        /// L2 beside the panels ([`group_blocks`]): each group takes every panel, a panel's
        /// blocks one after another, so a panel's weights come from DRAM (or L3) once a group,
        /// and the next panel's while its blocks work ([`TileRun`]).
        #[allow(clippy::too_many_arguments)]
        fn for_blocks(
            run: TileRun<T>,
            w: &Packed,
            rows: &Range<usize>,
            act: &Act<'_>,
            n: usize,
            panel: usize,
            mut emit: impl FnMut(Range<usize>, Block, &Acc),
        ) {
            let (mut tiles, mut work) = (T::default(), Work::default());
            let mut out: Acc = [[0.0; PANEL]; MAX_RUN];
            let runs = balanced_token_runs(n, MAX_RUN);
            let per_group = group_blocks(act, runs.len(), panel);
            for group in 0..runs.len().div_ceil(per_group) {
                let blocks = runs.clone().skip(group * per_group).take(per_group);
                for panel in panels(rows.clone(), PANEL) {
                    for (i, (t0, nt)) in blocks.clone().enumerate() {
                        let b = Block { t0, nt, share: (i, blocks.len()) };
                        // SAFETY: the backend is selected only where T's tiles run
                        // (cpu_support); `run` is w's tile kernel; `act` was prepared by
                        // simd() for w.
                        unsafe { run(&mut tiles, w, panel.index, act, b, &mut work, &mut out) };
                        let at = panel.rows.start - rows.start;
                        emit(at..at + panel.rows.len(), b, &out);
                    }
                }
            }
        }
    }

    /// L2 bytes a group of token blocks keeps its activations in beside the panels it works on
    /// and the next ones on their way: seven eighths of the 2 MiB of every AMX Xeon's core.
    const GROUP_L2_BYTES: usize = 7 << 18;

    /// Bytes of one 32-row panel of `w`.
    fn panel_bytes(w: &Packed) -> usize {
        w.data.len() / w.rows.div_ceil(PANEL).max(1)
    }

    /// Token blocks of a group ([`AmxBackend::for_blocks`]) out of `blocks`: as many as keep
    /// their activation rows (of `act`) in [`GROUP_L2_BYTES`] beside two panels' `panel`
    /// bytes (this one's and the next one's), evened out over the groups; all of them where
    /// not even one fits so, when the panels stay in L2 and the activations stream past.
    fn group_blocks(act: &Act<'_>, blocks: usize, panel: usize) -> usize {
        let block = MAX_RUN * act.kp * if act.q.is_empty() { 2 } else { 1 };
        match GROUP_L2_BYTES.saturating_sub(2 * panel) / block.max(1) {
            0 => blocks.max(1),
            most => blocks.div_ceil(blocks.div_ceil(most)).max(1),
        }
    }

    impl<T: Tiles + 'static> Backend for AmxBackend<T> {
        fn name(&self) -> &'static str {
            self.name
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            support(SIMD_LEVEL)?;
            T::available()
        }

        fn serves(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
            Zmm::serves(format, cols)
        }

        fn row_granularity(&self, _format: WeightFormat) -> usize {
            PANEL
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            Ok(self.wrap(simd().pack(m)))
        }

        fn pack_kt(
            &self,
            format: WeightFormat,
            rows: usize,
            cols: usize,
            bytes: &[u8],
            scales: &[f32],
        ) -> Option<Result<PackedMatrix, Error>> {
            Some(simd().pack_kt(format, rows, cols, bytes, scales)?.map(|m| self.wrap(m)))
        }

        fn act_layout(&self, format: WeightFormat) -> ActLayout {
            simd().act_layout(format)
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            simd().act_bytes(format, rows, cols)
        }

        fn sft_kernels(&self) -> &'static kt_core::sft::SftKernels {
            kt_x86_sft::kernels_512()
        }

        fn scratch_bytes(&self, shape: TaskShape) -> usize {
            simd().scratch_bytes(shape)
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
            simd().quantize_act(format, cols, src, rows, dst, scratch)
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
            let (gate, up, n) = (gate.inner::<Matrix<T>>(), up.inner::<Matrix<T>>(), h.rows());
            let (Some(run_gate), Some(run_up)) = (gate.on_tiles(n), up.on_tiles(n)) else {
                return simd().gate_up(&gate.simd, &up.simd, rows, act_gate, act_up, glu, bias, h, scratch);
            };
            let (g, u) = (&gate.simd.w, &up.simd.w);
            let ag = Act::parse(g.format, g.cols, n, act_gate, true);
            let au = Act::parse(u.format, u.cols, n, act_up, true);
            let (mut ub, mut room): (Acc, _) = ([[0.0; PANEL]; MAX_RUN], [[0.0; PANEL]; 2]);
            let (mut tiles, mut work) = (T::default(), Work::default());
            let panel = panel_bytes(g) + panel_bytes(u);
            Self::for_blocks(run_gate, g, &rows, &ag, n, panel, |at, b, gb| {
                let p = (rows.start + at.start) / PANEL;
                // SAFETY: as in for_blocks, for `u`.
                unsafe { run_up(&mut tiles, u, p, &au, b, &mut work, &mut ub) };
                let Block { t0, nt, .. } = b;
                for t in 0..nt {
                    let (gv, uv) = with_bias(bias, rows.start + at.start, 0..at.len(), [&gb[t], &ub[t]], &mut room);
                    // SAFETY: SIMD_LEVEL's support (AVX2 and FMA among it) holds.
                    unsafe { glu_panel(glu, gv, uv, 0..at.len(), &mut h.row_mut(t0 + t)[at.clone()]) };
                }
            });
        }

        fn down(&self, down: &PackedMatrix, rows: Range<usize>, a: &[u8], mut y: MatMut<'_, f32>, scratch: &mut [u8]) {
            let (down, n) = (down.inner::<Matrix<T>>(), y.rows());
            let Some(run) = down.on_tiles(n) else {
                return simd().down(&down.simd, rows, a, y, scratch);
            };
            let d = &down.simd.w;
            let act = Act::parse(d.format, d.cols, n, a, true);
            Self::for_blocks(run, d, &rows, &act, n, panel_bytes(d), |at, b, block| {
                for (t, res) in block.iter().enumerate().take(b.nt) {
                    put_panel(&mut y.row_mut(b.t0 + t)[at.clone()], res, 0..at.len());
                }
            });
        }

        /// The tiles' family for the formats that run on them from some token count (mxfp8
        /// where its scales fold), else the AVX-512 kernels'.
        fn instructions(&self, format: WeightFormat) -> Instructions {
            if self.from(format, true).is_none() {
                return simd().instructions(format);
            }
            match format {
                WeightFormat::Int8Row
                | WeightFormat::Int4Row
                | WeightFormat::Int4Group { .. }
                | WeightFormat::Mxfp4 => Instructions::AmxInt8,
                WeightFormat::Bf16 | WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => {
                    Instructions::AmxBf16
                }
                f => simd().instructions(f),
            }
        }
    }

    #[cfg(test)]
    #[test]
    fn groups_keep_their_activations_in_l2_evened_out() {
        let act = |kp, int: bool| Act { kp, q: if int { &[0u8][..] } else { &[] }, ..Act::default() };
        // int8 rows of K = 7168 (blocks and panels of 224 KiB): six blocks beside two panels in
        // 1.75 MiB; eight blocks as 4 + 4, seven as 4 + 3, thirteen as 5 + 5 + 3.
        let (int8, panel) = (act(7168, true), 32 * 7168);
        for (blocks, want) in [(1, 1), (6, 6), (7, 4), (8, 4), (13, 5)] {
            assert_eq!(group_blocks(&int8, blocks, panel), want, "{blocks} blocks");
        }
        // Gate and up panels both: four blocks.
        assert_eq!(group_blocks(&int8, 8, 2 * panel), 4);
        // bf16 (448 KiB blocks and panels): two blocks beside one matrix's panels; none beside
        // gate's and up's, which then stay in L2 while every block streams past.
        assert_eq!(group_blocks(&act(7168, false), 8, 2 * panel), 2);
        assert_eq!(group_blocks(&act(7168, false), 8, 4 * panel), 8);
        // Short rows: every block in one group.
        assert_eq!(group_blocks(&act(256, true), 40, 32 * 256), 40);
    }

    /// The emulated tiles at the default threshold, and at every token count.
    #[cfg(test)]
    pub(crate) static EMULATED: AmxBackend<Emulator> = AmxBackend::new("amx_emulated", 0);
    #[cfg(test)]
    pub(crate) static EMULATED_ALL: AmxBackend<Emulator> = AmxBackend::new("amx_emulated_all", 1);
    /// Never on tiles: the AVX-512 kernels alone, which the tiles must give the bits of.
    #[cfg(test)]
    pub(crate) static VECTOR: AmxBackend<Emulator> = AmxBackend::new("amx_vector", usize::MAX);
    /// The hardware tiles at every token count, whatever the format's threshold.
    #[cfg(test)]
    pub(crate) static HARDWARE_ALL: AmxBackend<Hardware> = AmxBackend::new("amx_all", 1);
}

#[cfg(all(test, target_arch = "x86_64", avx512_intrinsics))]
mod tests;
