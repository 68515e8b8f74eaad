//! kt-kernel-rs backend `llamafile`: GGML's block formats as GGUF files store them (f32, f16,
//! bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K…q6_K, iq4_nl, iq4_xs and the lattice types iq1_s,
//! iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s), any mix of them per
//! projection, with AVX2 kernels. It is named for KT-Kernel's LLAMAFILE method, which it
//! replaces; nothing of llamafile is used. Registered when the CPU has AVX2, FMA and F16C.
//!
//! Modules: `pack` (weights rearranged at load), `act` (prepared activations), `kernels`
//! (`kquant` for the 256-column types, `q32` for the 32-column ones, `float`, and the VNNI and
//! 512-bit variants `on_vnni`, `on_zmm`, `lattice1` (one token of the lattice types, their
//! grids in registers), and the AMX tiles' `on_amx`), `tiled` (an expert's
//! projections on tiles), `matrix` (a packed matrix with its type's kernels, chosen when it is
//! packed), and the layouts they share (`decode`, `lanes`, `lattice`, `legacy`).
//!
//! Weights keep their GGUF values, rearranged at load (`pack::Packed`: 32-column types in
//! groups of 8 blocks, 256-column ones with their levels in the lane layout of `lanes`, q3_K's,
//! q5_K's and q6_K's first gathered into planes of whole levels and some types' scales
//! unpacked, the lattice types as stored, put in that layout as they are decoded);
//! activations are quantized per token to the type's `vec_dot_type` (Q8_K for 256-column types,
//! Q8_0 with sums for 32-column ones, f32 for float types) in a block-major layout (`act`).
//! Where the CPU has VNNI (AVX-VNNI or AVX512-VNNI), q8_0 (packed for it), q4_0, q4_1, q5_0,
//! q5_1, q4_K, q5_K and iq4_xs run on `vpdpbusd` (`vnni`, `kernels::on_vnni`,
//! `kernels::on_zmm`), with the same results bit for bit; with AVX512-VBMI one token of
//! the lattice types does too (`kernels::lattice1`). Where the CPU
//! has AMX and `KT_AMX_TILE_FROM=n` asks for them (off by default: measured slower, see
//! `TILES_MEASURED_FROM`), an expert with at least n tokens (and two at least) of a quantized
//! type runs on int8 tiles (`kernels::on_amx`, driven by `tiled`; its activations then in a
//! tile layout: `act::ActT8`, or `act::ActK` in column order), with the same results bit for
//! bit again.
//!
//! **Must not** depend on another backend crate (what the x86 backends share is `kt-x86`'s),
//! nor serve a format that is not GGML's (our formats are the `avx2` backend's).
//!
//! # Safety
//! Every `unsafe fn` here needs the CPU features it enables, or its caller's (AVX2, FMA and
//! F16C, checked once by `cpu_support` before the backend is selected; AVX-VNNI or AVX512-VNNI
//! for `kernels::on_vnni` and `kernels::on_zmm`, checked by `vnni::detect`; AVX-512F and the
//! granted AMX permission for the tiles, checked by `Llamafile::tiles_here`), and slices as
//! long as its doc says (a tile's rows, a token's prepared activations).

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
mod matrix;
#[cfg(target_arch = "x86_64")]
mod pack;
#[cfg(all(target_arch = "x86_64", vnni_intrinsics))]
mod tiled;
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
    use kt_core::backend::{ActLayout, Instructions, TaskShape};
    use kt_core::bias::GateUpBias;
    use kt_core::mat::MatMut;
    use kt_core::swiglu::Glu;
    use kt_core::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};
    use kt_x86::panels::panels_from;
    use kt_x86::swiglu::glu_row;

    use crate::kernels::{Scratch, R};
    use crate::matrix::Matrix;
    use crate::vnni::{self, Vnni};

    /// The GGML backend.
    #[derive(Debug)]
    pub struct Llamafile {
        /// Whether kernels with VNNI run where the CPU has it.
        vnni: bool,
        /// Where its AMX tiles come from.
        tiles: TileSource,
        /// Tokens per expert from which an expert runs on tiles; 0: `kt_x86::amx::tile_from`
        /// with [`TILES_MEASURED_FROM`].
        from: usize,
        /// What this CPU gives the instance, found at its first use.
        here: std::sync::OnceLock<Here>,
    }

    /// What an instance's kernels run on this CPU.
    #[derive(Clone, Copy, Debug)]
    struct Here {
        /// The VNNI encoding of its kernels.
        vnni: Option<Vnni>,
        /// Whether its tiles run.
        tiles: bool,
    }

    /// Where an instance's tile instructions come from.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum TileSource {
        /// It has no tile kernels.
        Off,
        /// The CPU's AMX, where it has it and Linux permits it.
        Hardware,
        /// The scalar emulator (tests, on any CPU with AVX-512).
        #[cfg_attr(not(test), allow(dead_code))]
        Emulated,
    }

    /// The instance the host registers: VNNI kernels where the CPU has VNNI, AMX tiles for the
    /// quantized types' experts with many tokens where it has AMX.
    pub static LLAMAFILE: Llamafile = Llamafile::new(true, TileSource::Hardware, 0);

    /// AVX2 kernels only, whatever the CPU: for comparing the two on a VNNI CPU (tests, benches).
    pub static LLAMAFILE_AVX2: Llamafile = Llamafile::new(false, TileSource::Off, 0);

    /// Emulated tiles from two tokens per expert (every count `on_tiles` allows), over the VNNI
    /// kernels (tests).
    #[cfg(test)]
    pub(crate) static LLAMAFILE_EMULATED: Llamafile = Llamafile::new(true, TileSource::Emulated, 1);

    /// The hardware's tiles from two tokens per expert (tests; tiles only where the CPU has AMX).
    #[cfg(test)]
    pub(crate) static LLAMAFILE_TILES_ALL: Llamafile = Llamafile::new(true, TileSource::Hardware, 1);

    impl Llamafile {
        const fn new(vnni: bool, tiles: TileSource, from: usize) -> Self {
            Llamafile { vnni, tiles, from, here: std::sync::OnceLock::new() }
        }

        /// What this instance runs here, found once.
        fn here(&self) -> Here {
            *self.here.get_or_init(|| {
                let avx512 = cfg!(vnni_intrinsics)
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw");
                let tiles = match self.tiles {
                    TileSource::Off => false,
                    TileSource::Hardware => avx512 && kt_x86::amx::hardware_available().is_ok(),
                    TileSource::Emulated => avx512,
                };
                Here { vnni: self.vnni.then(vnni::detect).flatten(), tiles }
            })
        }

        /// The VNNI encoding this instance's kernels use on this CPU.
        fn vnni(&self) -> Option<Vnni> {
            self.here().vnni
        }

        /// Whether this instance's tiles run here: AVX-512F and BW (their results' scaling) and,
        /// for the hardware, AMX with Linux's permission; built with rustc ≥ 1.89 (the
        /// intrinsics).
        fn tiles_here(&self) -> bool {
            self.here().tiles
        }

        /// Whether an expert of type `t` with `n` tokens runs on tiles (its activations then in
        /// the tile layout): the one rule its activations and its kernels both follow. Never
        /// for one token: the one-token kernels accumulate in orders of their own (the
        /// K-quants with 16-column scales subtract their mins before scaling), which the tiles
        /// repeat only for two tokens or more.
        fn on_tiles(&self, t: kt_core::ggml::GgmlType, n: usize) -> bool {
            self.from().is_some_and(|from| n >= from.max(2)) && self.tiles_here() && tile_type(t, self.vnni().is_some())
        }

        /// The layout an expert of type `t` with `n` tokens reads: the tiles' where it runs on
        /// them ([`Llamafile::on_tiles`]), else its vector kernels'.
        fn layout(&self, t: kt_core::ggml::GgmlType, n: usize) -> crate::act::Layout {
            match self.on_tiles(t, n) {
                true => crate::act::Layout::T8,
                false => crate::act::layout(t, self.vnni()),
            }
        }

        /// Tokens per expert from which an expert runs on tiles (None: never).
        fn from(&self) -> Option<usize> {
            kt_x86::amx::tile_from(self.from, TILES_MEASURED_FROM)
        }
    }

    /// Tokens per expert from which the GGUF types run on tiles unless `KT_AMX_TILE_FROM` says
    /// otherwise: never. In the device job's `tile-from` phase the tiles lost to the vector
    /// kernels for every type timed at every token count (each 32-column part's sums stored
    /// from the C tiles and scaled, as for the `amx` backend's K-group kinds, which lose there
    /// too; docs/performance.md, "Tile thresholds per format").
    const TILES_MEASURED_FROM: Option<usize> = None;

    /// `crate::tiled::$f::<T>(args)` with `T` the tile instructions `$source` names.
    #[cfg(vnni_intrinsics)]
    macro_rules! by_source {
        ($source:expr, $f:ident($($a:expr),*)) => {
            match $source {
                TileSource::Hardware => crate::tiled::$f::<kt_x86::amx::Hardware>($($a),*),
                TileSource::Emulated => crate::tiled::$f::<kt_x86::amx::Emulator>($($a),*),
                TileSource::Off => unreachable!("on_tiles is false for an instance without tiles"),
            }
        };
    }

    /// Whether type `t` has tile kernels (`quads`: q8_0 is packed for VNNI).
    fn tile_type(t: kt_core::ggml::GgmlType, quads: bool) -> bool {
        #[cfg(vnni_intrinsics)]
        return crate::kernels::on_amx::runs(t, quads);
        #[cfg(not(vnni_intrinsics))]
        return {
            let _ = (t, quads);
            false
        };
    }

    fn ggml(f: WeightFormat) -> kt_core::ggml::GgmlType {
        match f {
            WeightFormat::Ggml(t) => t,
            _ => unreachable!("the llamafile backend serves only GGML formats"),
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

    /// A task's scratch, carved from its worker's bytes ([`Backend::scratch_bytes`]):
    ///
    /// ```text
    ///  | Scratch (decoded blocks, accumulators) | out [n][R] | ut [n][R] | gs [n][16] | us [n][16] |   f32
    /// ```
    /// (`gs`/`us` hold `nr` floats instead where that is more: one token's whole task.)
    struct Work<'a> {
        tile: &'a mut Scratch,
        out: &'a mut [[f32; R]],
        ut: &'a mut [[f32; R]],
        gs: &'a mut [f32],
        us: &'a mut [f32],
    }

    /// Rows of gate and up computed before one SwiGLU pass: 16 lanes at a time.
    const CHUNK: usize = 16;

    /// Floats of `gs` (and of `us`) in a [`Work`] for `n` tokens and `nr` rows.
    fn chunk_floats(n: usize, nr: usize) -> usize {
        (n * CHUNK).max(nr)
    }

    /// Bytes of a [`Work`] for `n` tokens and `nr` rows.
    fn work_bytes(n: usize, nr: usize) -> usize {
        size_of::<Scratch>() + 4 * (2 * n * R + 2 * chunk_floats(n, nr))
    }

    fn work(bytes: &mut [u8], n: usize, nr: usize) -> Work<'_> {
        let (tile, rest) = Scratch::from_bytes(bytes);
        let (out, rest) = rest.split_at_mut(4 * n * R);
        let (ut, rest) = rest.split_at_mut(4 * n * R);
        let (gs, rest) = rest.split_at_mut(4 * chunk_floats(n, nr));
        Work {
            tile,
            out: bytemuck::cast_slice_mut(out),
            ut: bytemuck::cast_slice_mut(ut),
            gs: bytemuck::cast_slice_mut(gs),
            us: bytemuck::cast_slice_mut(&mut rest[..4 * chunk_floats(n, nr)]),
        }
    }

    /// `emit(r0, nr, results, scratch)` for each tile of up to `R` rows of `rows`, results
    /// `[n][R]`, for two tokens or more (one goes to [`Matrix::gemv`]).
    fn for_tiles(
        w: &Matrix,
        rows: &Range<usize>,
        act: &[u8],
        n: usize,
        out: &mut [[f32; R]],
        scratch: &mut Scratch,
        mut emit: impl FnMut(usize, usize, &[[f32; R]], &mut Scratch),
    ) {
        for tile in panels_from(rows.clone(), R) {
            let (r0, nr) = (tile.start, tile.len());
            // SAFETY: selected only where cpu_support passed (AVX2, FMA, F16C), VNNI where
            // detected; act was prepared by quantize_act for this matrix's type with n tokens.
            unsafe { w.panel_run(r0, nr, act, n, out, scratch) };
            emit(r0, nr, out, scratch);
        }
    }

    impl Backend for Llamafile {
        fn name(&self) -> &'static str {
            match (self.vnni, self.tiles) {
                (_, TileSource::Emulated) => "llamafile_emulated_tiles",
                (true, _) => "llamafile",
                (false, _) => "llamafile-avx2",
            }
        }

        fn cpu_support(&self) -> Result<(), &'static str> {
            kt_x86::isa::avx2_fma()?;
            if !is_x86_feature_detected!("f16c") {
                return Err("F16C");
            }
            if self.tiles == TileSource::Emulated && !self.tiles_here() {
                return Err("AVX-512F and AVX-512BW (the tile kernels' scaling)");
            }
            Ok(())
        }

        fn serves(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
            matches!(format, WeightFormat::Ggml(_)) && cols % format.col_multiple() == 0
        }

        fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
            let WeightFormat::Ggml(t) = m.format() else {
                return Err(Error::UnsupportedFormat {
                    format: m.format(),
                    context: "by the llamafile backend (GGML types)",
                });
            };
            if t == kt_core::ggml::GgmlType::MXFP4 && !crate::legacy::mxfp4_scales_fit(m.data()) {
                return Err(Error::UnsupportedFormat {
                    format: m.format(),
                    context:
                        "with a block scale above 2^15 by the llamafile backend, whose kernels keep block scales as f16",
                });
            }
            let p = Matrix::pack(t, m.rows(), m.cols(), m.data(), self.vnni());
            Ok(PackedMatrix::new(self.name(), m.format(), m.rows(), m.cols(), p.w.data.len(), p))
        }

        /// The vector kernels' layout: an expert of one token never runs on tiles.
        fn act_layout(&self, format: WeightFormat) -> ActLayout {
            self.act_layout_for(format, 1)
        }

        fn act_layout_for(&self, format: WeightFormat, tokens: usize) -> ActLayout {
            let t = ggml(format);
            ActLayout(t.act() as u32 * 8 + self.layout(t, tokens) as u32)
        }

        fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
            crate::act::bytes(ggml(format), rows, cols, self.vnni())
        }

        fn sft_kernels(&self) -> &'static kt_core::sft::SftKernels {
            kt_x86_sft::kernels()
        }

        fn scratch_bytes(&self, shape: TaskShape) -> usize {
            let vector =
                work_bytes(shape.tokens, shape.rows.next_multiple_of(R)).max(crate::act::scratch_bytes(shape.cols));
            // The tile path's room only for a layer with a type on tiles (its panels are
            // K-sized: a DeepSeek-V3 hidden makes them half a megabyte).
            #[cfg(vnni_intrinsics)]
            if self.tiles_here() {
                let [g, u, d] = [shape.format.gate, shape.format.up, shape.format.down].map(ggml);
                let quads = self.vnni().is_some();
                if [g, u, d].into_iter().any(|t| tile_type(t, quads)) {
                    let tiled = |t| crate::tiled::bytes(shape.tokens, shape.cols, t);
                    return vector.max(tiled([g, u])).max(tiled([d, d]));
                }
            }
            vector
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
            let t = ggml(format);
            let kind = self.layout(t, rows.len());
            // SAFETY: cpu_support passed before this backend was selected.
            unsafe { crate::act::prepare(t, cols, src, rows, dst, kind, scratch) }
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
            let (g, u) = (gate.inner::<Matrix>(), up.inner::<Matrix>());
            let (n, nr) = (h.rows(), rows.len());
            #[cfg(vnni_intrinsics)]
            if self.on_tiles(g.w.t, n) || self.on_tiles(u.w.t, n) {
                let gate = crate::tiled::Operand { m: g, act: act_gate, tiles: self.on_tiles(g.w.t, n) };
                let up = crate::tiled::Operand { m: u, act: act_up, tiles: self.on_tiles(u.w.t, n) };
                // SAFETY: cpu_support and tiles_here passed (on_tiles); each operand's
                // activations were prepared by quantize_act under the same rule.
                return unsafe { by_source!(self.tiles, gate_up(gate, up, rows, glu, bias, h, scratch)) };
            }
            let Work { tile, out, ut, gs, us } = work(scratch, n, nr);
            if n == 1 {
                let (gs, us) = (&mut gs[..nr], &mut us[..nr]);
                // SAFETY: as in for_tiles; glu_row needs AVX2 and FMA, which cpu_support checked.
                unsafe {
                    g.gemv(rows.clone(), act_gate, gs);
                    u.gemv(rows.clone(), act_up, us);
                    if let Some(b) = bias {
                        b.add(rows.start, 0..nr, gs, us);
                    }
                    glu_row(glu, gs, us, h.row_mut(0));
                }
                return;
            }
            // CHUNK rows at a time: gate and up for every token, token-major, then SwiGLU 16
            // lanes at a time (the last chunk's rows, fewer than 16, by the scalar definition).
            for chunk in panels_from(rows.clone(), CHUNK) {
                let (c0, c1) = (chunk.start, chunk.end);
                for_tiles(g, &chunk, act_gate, n, out, tile, |r0, k, gt, tile| {
                    // SAFETY: as in for_tiles (features checked; act prepared for the type).
                    unsafe { u.panel_run(r0, k, act_up, n, ut, tile) };
                    for t in 0..n {
                        put(&mut gs[t * CHUNK + r0 - c0..], &gt[t], k);
                        put(&mut us[t * CHUNK + r0 - c0..], &ut[t], k);
                    }
                });
                for t in 0..n {
                    let (at, w) = (t * CHUNK, c1 - c0);
                    if let Some(b) = bias {
                        b.add(c0, 0..w, &mut gs[at..at + w], &mut us[at..at + w]);
                    }
                    let out = &mut h.row_mut(t)[c0 - rows.start..c1 - rows.start];
                    // SAFETY: cpu_support (AVX2, FMA) passed before this backend was selected.
                    unsafe { glu_row(glu, &gs[at..at + w], &us[at..at + w], out) };
                }
            }
        }

        fn down(
            &self,
            down: &PackedMatrix,
            rows: Range<usize>,
            act: &[u8],
            mut y: MatMut<'_, f32>,
            scratch: &mut [u8],
        ) {
            let d = down.inner::<Matrix>();
            let n = y.rows();
            #[cfg(vnni_intrinsics)]
            if self.on_tiles(d.w.t, n) {
                let d = crate::tiled::Operand { m: d, act, tiles: true };
                // SAFETY: as in gate_up.
                return unsafe { by_source!(self.tiles, down(d, rows, y, scratch)) };
            }
            if n == 1 {
                // SAFETY: as in for_tiles (features checked; act prepared for the type).
                unsafe { d.gemv(rows.clone(), act, y.row_mut(0)) };
                return;
            }
            let Work { tile, out, .. } = work(scratch, n, 0);
            for_tiles(d, &rows, act, n, out, tile, |r0, nr, res, _| {
                for (t, r) in res.iter().enumerate() {
                    put(&mut y.row_mut(t)[r0 - rows.start..], r, nr);
                }
            });
        }

        fn instructions(&self, format: WeightFormat) -> Instructions {
            use kt_core::ggml::GgmlType::{IQ4_NL, Q2_K, Q3_K};
            // Another format has no kernels here: its answer is where its activations would go.
            let WeightFormat::Ggml(t) = format else {
                return if format.int_activations() { Instructions::Int8Pairs } else { Instructions::FmaF32 };
            };
            if self.from().is_some() && self.tiles_here() && tile_type(t, self.vnni().is_some()) {
                Instructions::AmxInt8
            } else if self.vnni().is_some() && vnni::runs(t)
                // iq4_nl: its 512-bit kernels (`legacy::Iq4NlV`); q2_K and q3_K: their levels
                // scaled in the 512-bit ones (`KBlock::SCALED`).
                || self.vnni() == Some(Vnni::Evex) && matches!(t, IQ4_NL | Q2_K | Q3_K)
            {
                Instructions::Int8Vnni
            } else if self.vnni() == Some(Vnni::Evex) && t.act() == kt_core::ggml::ActKind::Q8K {
                Instructions::Int8PairsZmm
            } else if t.act() == kt_core::ggml::ActKind::F32 {
                Instructions::FmaF32
            } else {
                Instructions::Int8Pairs
            }
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

    /// The instruction family of each type's kernels: AMX int8 tiles for the quantized types on
    /// an AMX CPU, VNNI for the types `vnni::runs` names on a VNNI CPU, f32 FMA for the float
    /// types, AVX2's pairs for the rest.
    #[test]
    fn instructions_name_the_kernels_that_run() {
        use kt_core::backend::Instructions;
        use kt_core::ggml::GgmlType;
        use kt_core::{Backend, WeightFormat};
        let g = WeightFormat::Ggml;
        let vnni = if crate::vnni::detect().is_some() { Instructions::Int8Vnni } else { Instructions::Int8Pairs };
        // The quantized types run on tiles (prefill) where the CPU has AMX and, for the default
        // instance, `KT_AMX_TILE_FROM` asks for them.
        let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
        let tiles = cfg!(vnni_intrinsics) && avx512 && kt_x86::isa::request_amx().is_ok();
        let asked = kt_x86::amx::tile_from_env().is_some();
        let on_tiles = |other| if tiles && asked { Instructions::AmxInt8 } else { other };
        let tiles_all = if tiles { Instructions::AmxInt8 } else { vnni };
        assert_eq!(crate::imp::LLAMAFILE_TILES_ALL.instructions(g(GgmlType::Q4_0)), tiles_all);
        for t in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::IQ4_XS] {
            assert_eq!(LLAMAFILE.instructions(g(t)), on_tiles(vnni), "{t}");
            assert_eq!(LLAMAFILE_AVX2.instructions(g(t)), Instructions::Int8Pairs, "{t}");
        }
        // iq4_nl, q2_K and q3_K: `vpdpbusd` in the 512-bit kernels only.
        let evex = match crate::vnni::detect() {
            Some(crate::vnni::Vnni::Evex) => Instructions::Int8Vnni,
            _ => Instructions::Int8Pairs,
        };
        for t in [GgmlType::IQ4_NL, GgmlType::Q3_K, GgmlType::Q2_K] {
            assert_eq!(LLAMAFILE.instructions(g(t)), on_tiles(evex), "{t}");
        }
        assert_eq!(LLAMAFILE.instructions(g(GgmlType::MXFP4)), on_tiles(vnni));
        // The other 256-column types: `vpmaddubsw` in 512-bit registers with AVX512-VNNI.
        let zmm = match crate::vnni::detect() {
            Some(crate::vnni::Vnni::Evex) => Instructions::Int8PairsZmm,
            _ => Instructions::Int8Pairs,
        };
        for t in [GgmlType::Q6_K, GgmlType::IQ2_XS, GgmlType::IQ1_M] {
            assert_eq!(LLAMAFILE.instructions(g(t)), on_tiles(zmm), "{t}");
            assert_eq!(LLAMAFILE_AVX2.instructions(g(t)), Instructions::Int8Pairs, "{t}");
        }
        assert_eq!(LLAMAFILE.instructions(g(GgmlType::F16)), Instructions::FmaF32);
        // A format it does not serve gets an answer and a refused pack, not a panic.
        assert_eq!(LLAMAFILE.instructions(WeightFormat::Bf16), Instructions::FmaF32);
        let m = kt_core::QuantMatrix::quantize(WeightFormat::Bf16, 2, 32, &[0.5; 64]).unwrap();
        let e = LLAMAFILE.pack(&m).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("bf16") && e.contains("llamafile"), "{e}");
    }

    kt_core::conformance_suite!(&crate::LLAMAFILE);

    mod emulated_tiles {
        kt_core::conformance_suite!(&crate::imp::LLAMAFILE_EMULATED);
    }

    /// Every layer of the GGML suite with a type that runs on tiles (every quantized type:
    /// the 32-column ones, the K-quants with scales of 32 and of 16 columns, iq4_xs, the
    /// lattice types), on tiles for every expert of two tokens or more, at every token count
    /// from 1 to 70 (one and two token halves, short last token blocks, row ranges starting
    /// inside a panel, a row's last group part padding, gate and up one on tiles and one
    /// not), emulated and, on an AMX CPU, on the hardware: the vector kernels' bits.
    #[test]
    fn tiles_give_the_vector_kernels_bits() {
        use kt_core::testing::{build_ggml_layer, ggml_layer_formats, random_input, run, scenario_routing, Scenario};
        use kt_core::{Backend, MoeConfig, Routing, SerialExecutor};

        use crate::imp::{LLAMAFILE_EMULATED, LLAMAFILE_TILES_ALL};
        kt_core::skip_unless_runs!(&LLAMAFILE_EMULATED);
        let mut tiled: Vec<&'static dyn Backend> = vec![&LLAMAFILE_EMULATED];
        match kt_x86::isa::request_amx() {
            Ok(()) => tiled.push(&LLAMAFILE_TILES_ALL),
            Err(why) => kt_core::skip_isa!(format!("{why} (the hardware tiles)")),
        }
        let vector: &'static dyn Backend = &LLAMAFILE_AVX2;
        let on_tiles =
            |f: kt_core::WeightFormat| LLAMAFILE_EMULATED.instructions(f) == kt_core::backend::Instructions::AmxInt8;
        let mut checked = 0;
        for lf in ggml_layer_formats() {
            if ![lf.gate, lf.up, lf.down].into_iter().any(on_tiles) {
                continue;
            }
            let wide = [lf.gate, lf.up, lf.down].iter().any(|f| f.col_multiple() == 256);
            let (h, i) = if wide { (512, 256) } else { (288, 160) };
            let cfg = MoeConfig { max_tokens: 70, ..MoeConfig::new(3, 2, h, i) };
            let want_layer = build_ggml_layer(vector, &cfg, lf, 11).0;
            let layers: Vec<_> = tiled.iter().map(|&b| (b, build_ggml_layer(b, &cfg, lf, 11).0)).collect();
            for tokens in 1..=70 {
                let input = random_input(tokens, h, tokens as u64);
                let s = if tokens % 3 == 0 { Scenario::Random } else { Scenario::Skewed };
                let (ids, w, mask) = scenario_routing(s, tokens, &cfg, tokens as u64);
                let r = Routing { tokens, k: 2, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
                let want = run(&SerialExecutor, &cfg, &want_layer, &input, &r);
                for (b, layer) in &layers {
                    let got = run(&SerialExecutor, &cfg, layer, &input, &r);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} differs from {} on {lf}, {tokens} tokens ({s:?})", b.name(), vector.name());
                }
            }
            checked += 1;
        }
        // Every layer of the suite but the float ones (f32, f16, bf16).
        assert!(checked >= ggml_layer_formats().len() - 3, "only {checked} layer formats had a type on tiles");
    }

    /// The AVX2 kernels where this CPU would otherwise run VNNI ones (the registered instance
    /// runs the suite above).
    #[test]
    fn conformance_of_the_avx2_kernels_on_a_vnni_cpu() {
        if crate::vnni::detect().is_none() {
            eprintln!("skipped: this CPU has no VNNI, so the suite above ran the AVX2 kernels");
            return;
        }
        let failures = kt_core::testing::ggml_conformance_failures(&LLAMAFILE_AVX2, &kt_core::SerialExecutor);
        assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    }

    /// An MXFP4 block scale the kernels' f16 cannot hold (2^16, code 144) is refused with an
    /// error naming it; 2^15 (143) packs.
    #[test]
    fn mxfp4_scales_above_f16_are_refused() {
        use kt_core::ggml::{random_matrix, GgmlType};
        use kt_core::{Backend, QuantMatrix};

        let m = random_matrix(GgmlType::MXFP4, 2, 64, 1);
        for (e, packs) in [(143u8, true), (144, false)] {
            let mut data = m.data().to_vec();
            data[17] = e; // the second block's scale
            let m = QuantMatrix::from_parts(m.format(), 2, 64, data, Vec::new()).unwrap();
            match LLAMAFILE.pack(&m) {
                Ok(_) => assert!(packs, "code {e} packed"),
                Err(err) => {
                    assert!(!packs, "code {e}: {err}");
                    assert!(err.to_string().contains("block scale above 2^15"), "{err}");
                }
            }
        }
    }

    /// Every tile shape of the kernels (one token; a few without the level store: 2-7 for the
    /// 32-column types, 2-6 for the K-quants with 32-column scales; up to 32; 33-64 in one
    /// tile; more in several; a last tile of fewer than `R` rows; a row range starting inside
    /// the matrix; a 32-column type's last group part padding) against the reference
    /// backend's dots of the same weights and activations; the VNNI kernels, where they run,
    /// bit for bit against the AVX2 ones.
    #[test]
    fn tiles_match_the_reference_at_every_token_count() {
        use half::bf16;
        use kt_core::aligned::AlignedBuf;
        use kt_core::backend::TaskShape;
        use kt_core::ggml::{random_matrix, GgmlType};
        use kt_core::mat::MatMut;
        use kt_core::reference::REFERENCE;
        use kt_core::rng::SplitMix64;
        use kt_core::{Backend, WeightFormat};

        kt_core::skip_unless_runs!(&LLAMAFILE);
        let rows = 6;
        let mut failures = Vec::new();
        for &t in GgmlType::ALL {
            let format = WeightFormat::Ggml(t);
            let cols = if format.col_multiple() == 256 { 512 } else { 288 };
            let m = random_matrix(t, rows, cols, 3);
            for n in [1, 2, 3, 4, 5, 6, 7, 32, 33, 64, 65, 130] {
                let mut r = SplitMix64::new(n as u64);
                let x: Vec<bf16> = (0..n * cols).map(|_| bf16::from_f32(r.gaussian())).collect();
                let ids: Vec<u32> = (0..n as u32).collect();
                // Rows in two calls, as the plan's row blocks (granularity 1): a full tile
                // and a 1-row one, then a call starting at row 5, not a multiple of `R`.
                let y = |b: &dyn Backend| {
                    let w = b.pack(&m).expect("packs");
                    let mut act = AlignedBuf::zeroed(b.act_bytes(format, n, cols));
                    let shape = TaskShape { format: format.into(), tokens: n, rows, cols };
                    let mut scratch = AlignedBuf::zeroed(b.scratch_bytes(shape));
                    b.quantize_act(format, cols, &x, &ids, act.as_mut_slice(), scratch.as_mut_slice());
                    let mut y = vec![0.0f32; n * rows];
                    for part in [0..5, 5..rows] {
                        let view = MatMut::from_slice(&mut y[part.start..], n, part.len(), rows);
                        b.down(&w, part, act.as_mut_slice(), view, scratch.as_mut_slice());
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
