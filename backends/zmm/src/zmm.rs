//! [`Zmm`]: one level's kernels as the operations of a backend (pack, prepare activations,
//! gate/up with SwiGLU, down), which the `avx512` backends and the `amx` backend's vector path
//! forward to.

use core::ops::Range;

use half::bf16;
use kt_core::backend::{ActLayout, Instructions, TaskShape};
use kt_core::bias::{with_bias, GateUpBias};
use kt_core::mat::MatMut;
use kt_core::swiglu::Glu;
use kt_core::{Error, QuantMatrix, WeightFormat};
use kt_x86::panels::{balanced_token_runs, panels, PanelRows};

use crate::act::{self, Act};
use crate::kernels::{glu_panel, max_run, put_panel, stage_bytes, Acc, MAX_RUN, STAGE_FROM_TILES};
use crate::level::Level;
use crate::matrix::Matrix;
use crate::pack::PANEL;

/// `Ok` if this CPU runs `level`, else the first missing feature. AVX2 and FMA too: the
/// SwiGLU is `kt-x86`'s 256-bit one.
pub fn support(level: Level) -> Result<(), &'static str> {
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

/// The widest level this CPU runs (detected once), [`Level::Base`] where it runs none.
pub fn best_level() -> Level {
    static BEST: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *BEST.get_or_init(|| {
        [Level::Bf16, Level::Vbmi, Level::Vnni].into_iter().find(|&l| support(l).is_ok()).unwrap_or(Level::Base)
    })
}

/// The kernels of one [`Level`], as a backend's operations. Its methods run that level's
/// instructions: make one only where [`support`] holds for it.
#[derive(Clone, Copy, Debug)]
pub struct Zmm {
    level: Level,
}

/// Run every (panel, token tile) of `rows` of the matrices `ms`, each against its activations,
/// and hand each tile's results to `emit`, in tiles of the fewest tokens any of them runs at
/// once. Where a panel has [`STAGE_FROM_TILES`] tiles or more, a matrix with a staged kernel
/// has the panel decoded once for them into `scratch` ([`Matrix::stage`]; where it is too
/// short, each tile decodes): the same sums, the decoding not repeated a tile.
fn for_tiles<const M: usize>(
    ms: [(&Matrix, &Act<'_>); M],
    rows: &Range<usize>,
    n: usize,
    scratch: &mut [u8],
    mut emit: impl FnMut(&PanelRows, usize, usize, &[Acc; M]),
) {
    let mut tiles: [Acc; M] = [[[0.0; PANEL]; MAX_RUN]; M];
    let max_nt = ms.iter().map(|(m, _)| max_run(&m.w)).min().unwrap_or(MAX_RUN);
    let stages = n > (STAGE_FROM_TILES - 1) * max_nt;
    let mut need = ms.map(|(m, _)| if stages { m.stage_bytes().unwrap_or(0) } else { 0 });
    if need.iter().sum::<usize>() > scratch.len() {
        need = [0; M];
    }
    for panel in panels(rows.clone(), PANEL) {
        let mut rest = &mut scratch[..];
        let staged = core::array::from_fn::<_, M, _>(|i| {
            let (mine, more) = core::mem::take(&mut rest).split_at_mut(need[i]);
            rest = more;
            let run = if need[i] > 0 { ms[i].0.stage(panel.index, mine) } else { None };
            run.map(|r| (r, mine.as_ptr()))
        });
        for (t0, nt) in balanced_token_runs(n, max_nt) {
            for (i, &(m, act)) in ms.iter().enumerate() {
                // SAFETY: m's kernels run on this CPU (Matrix), `act` was prepared by this
                // level for its format and K with n rows, and a staged kernel reads the panel
                // it was just given.
                unsafe {
                    match staged[i] {
                        Some((run, at)) => run(&m.w, panel.index, at, act, t0, nt, &mut tiles[i]),
                        None => (m.run())(&m.w, panel.index, act, t0, nt, &mut tiles[i]),
                    }
                }
            }
            emit(&panel, t0, nt, &tiles);
        }
    }
}

impl Zmm {
    /// The kernels of `level`.
    ///
    /// # Safety
    /// This CPU runs `level` ([`support`]): every method runs its instructions.
    pub const unsafe fn new(level: Level) -> Self {
        Zmm { level }
    }

    /// Its level.
    pub fn level(self) -> Level {
        self.level
    }

    /// Whether `format`'s kernels are the `vdpbf16ps` ones (bf16 activations, no f32 copy):
    /// float formats at the bf16 level.
    fn dot(self, format: WeightFormat) -> bool {
        self.level == Level::Bf16 && !format.int_activations()
    }

    /// Every format of ours whose K fits its unit; GGML's types are the llamafile backend's.
    pub fn serves(format: WeightFormat, cols: usize) -> bool {
        !matches!(format, WeightFormat::Ggml(_)) && cols % format.col_multiple() == 0
    }

    /// `m` packed into panels, with the kernel this level runs on them.
    pub fn pack(self, m: &QuantMatrix) -> Matrix {
        Matrix::pack(m, self.level)
    }

    /// KT's packed bytes taken as they are where its layout holds the shape (`Backend::pack_kt`).
    pub fn pack_kt(
        self,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        scales: &[f32],
    ) -> Option<Result<Matrix, Error>> {
        Matrix::from_kt(self.level, format, rows, cols, bytes, scales)
    }

    /// See `Backend::act_layout`.
    pub fn act_layout(self, format: WeightFormat) -> ActLayout {
        ActLayout(act::layout(format, self.dot(format)))
    }

    /// See `Backend::act_bytes`.
    pub fn act_bytes(self, format: WeightFormat, rows: usize, cols: usize) -> usize {
        act::bytes(format, rows, cols, self.dot(format))
    }

    /// See `Backend::scratch_bytes`: the activations' preparation, or the panels a task stages
    /// ([`Matrix::stage`]: gate's and up's at once), whichever is more.
    pub fn scratch_bytes(self, shape: TaskShape) -> usize {
        let stage = |f| stage_bytes(f, self.level, shape.cols);
        let f = shape.format;
        act::scratch_bytes(shape.cols).max(stage(f.gate) + stage(f.up)).max(stage(f.down))
    }

    /// See `Backend::quantize_act`.
    pub fn quantize_act(
        self,
        format: WeightFormat,
        cols: usize,
        src: &[bf16],
        rows: &[u32],
        dst: &mut [u8],
        scratch: &mut [u8],
    ) {
        act::prepare(format, cols, src, rows, dst, scratch, self.dot(format))
    }

    /// See `Backend::gate_up`.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_up(
        self,
        gate: &Matrix,
        up: &Matrix,
        rows: Range<usize>,
        act_gate: &[u8],
        act_up: &[u8],
        glu: Glu,
        bias: Option<GateUpBias<'_>>,
        mut h: MatMut<'_, bf16>,
        scratch: &mut [u8],
    ) {
        let (g, u, n) = (&gate.w, &up.w, h.rows());
        let ag = Act::parse(g.format, g.cols, n, act_gate, self.dot(g.format));
        let au = Act::parse(u.format, u.cols, n, act_up, self.dot(u.format));
        let mut room = [[0.0; PANEL]; 2];
        // Each up tile is paired with the gate tile of the same panel and tokens.
        for_tiles([(gate, &ag), (up, &au)], &rows, n, scratch, |panel, t0, nt, [gt, ut]| {
            let (at, within) = (panel.rows.start - rows.start, panel.in_panel(PANEL));
            for t in 0..nt {
                let out = &mut h.row_mut(t0 + t)[at..at + within.len()];
                let first = panel.index * PANEL;
                let (gv, uv) = with_bias(bias, first, within.clone(), [&gt[t], &ut[t]], &mut room);
                // SAFETY: every level has AVX2 and FMA (support), which the SwiGLU runs on.
                unsafe { glu_panel(glu, gv, uv, within.clone(), out) };
            }
        });
    }

    /// See `Backend::down`.
    pub fn down(self, down: &Matrix, rows: Range<usize>, a: &[u8], mut y: MatMut<'_, f32>, scratch: &mut [u8]) {
        let (d, n) = (&down.w, y.rows());
        let act = Act::parse(d.format, d.cols, n, a, self.dot(d.format));
        for_tiles([(down, &act)], &rows, n, scratch, |panel, t0, nt, [tile]| {
            let (at, within) = (panel.rows.start - rows.start, panel.in_panel(PANEL));
            for (t, res) in tile.iter().enumerate().take(nt) {
                put_panel(&mut y.row_mut(t0 + t)[at..at + within.len()], res, within.clone());
            }
        });
    }

    /// See `Backend::instructions`.
    pub fn instructions(self, format: WeightFormat) -> Instructions {
        match (format.int_activations(), self.level) {
            (true, Level::Base) => Instructions::Int8PairsZmm,
            (true, _) => Instructions::Int8Vnni,
            (false, Level::Bf16) => Instructions::Bf16DotZmm,
            (false, _) => Instructions::FmaF32Zmm,
        }
    }
}
