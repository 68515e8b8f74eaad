//! `MoeLayer`: one MoE layer's packed experts, the backend that runs them and an executor.
//! Build it from f32 or already-quantized matrices, then call [`MoeLayer::forward`] as many
//! times as you like. Experts are packed on the executor, each NUMA part by its own sub-pool,
//! so a part's pages are first touched (and so placed) on the node that computes with them.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use half::bf16;
use kt_core::bias::ExpertBias;
use kt_core::forward::{self, ExpertF32, LayerWeights};
use kt_core::{
    Backend, Error, Executor, LayerFormat, MoeConfig, PackedMatrix, QuantMatrix, Routing, Scales, WeightFormat,
};

use crate::numa_pool::NumaPool;
use crate::placement::PoolError;
use crate::pool::Pool;
use crate::registry;
use crate::scratch::{self, SharedScratch};

/// How to build a layer.
#[derive(Clone)]
pub struct LayerOptions {
    /// The backend; `None` picks the best available for the format (`KT_KERNEL_CPU_VARIANT`
    /// honoured).
    pub backend: Option<&'static dyn Backend>,
    /// Runs the forward's tasks and packs the experts at load.
    pub executor: Arc<dyn Executor>,
    /// How [`MoeLayer::from_f32`] chooses each row's or group's scale (KT's absmax by default;
    /// layers loaded already quantized keep theirs).
    pub scales: Scales,
    /// The calls' scratch, shared by every layer built from these options or their clones.
    /// Layers on one executor run one at a time, so one scratch sized to the largest call
    /// serves a whole model: one per layer held it times the layers (about 1.1 GB each for
    /// DeepSeek-V3 at SGLang's 8192-token chunks, 64 GB over its 58 MoE layers).
    pub scratch: SharedScratch,
}

impl Default for LayerOptions {
    /// One thread per CPU this process may use, unpinned.
    fn default() -> Self {
        Self::threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl LayerOptions {
    /// A persistent pool of `threads` unpinned threads.
    pub fn threads(threads: usize) -> Self {
        Self::executor(Arc::new(Pool::new(threads)))
    }

    /// A NUMA pool of `threads` pinned threads in `parts` sub-pools (use the layer's
    /// `MoeConfig::parts`), placed on the running machine's nodes ([`NumaPool::with_threads`]).
    pub fn numa(threads: usize, parts: usize) -> Result<Self, PoolError> {
        Ok(Self::executor(Arc::new(NumaPool::with_threads(threads, parts)?)))
    }

    /// Run on `executor`, backend chosen automatically, with a scratch of their own.
    pub fn executor(executor: Arc<dyn Executor>) -> Self {
        LayerOptions { backend: None, executor, scales: Scales::Absmax, scratch: SharedScratch::default() }
    }
}

/// One MoE layer ready to run.
pub struct MoeLayer {
    cfg: MoeConfig,
    /// The packed experts and the backend that packed (and runs) them.
    weights: LayerWeights,
    executor: Arc<dyn Executor>,
    /// Shared with the layers built from the same options.
    scratch: SharedScratch,
}

impl std::fmt::Debug for MoeLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeLayer({:?}, {} on {})", self.cfg, self.weights.format, self.backend().name())
    }
}

fn backend_for(cfg: &MoeConfig, format: LayerFormat, opts: &LayerOptions) -> Result<&'static dyn Backend, Error> {
    cfg.validate_for(format)?;
    let part = cfg.part_ranges(format)?.iter().map(|r| r.len()).max().unwrap_or(0);
    let h = cfg.hidden;
    let shapes = [(format.gate, part, h), (format.up, part, h), (format.down, h, part)];
    match opts.backend {
        Some(b) => registry::check_given(b, &shapes).map(|()| b),
        None => registry::select_for(&shapes),
    }
}

/// `pack(e, p, part_range)` for every expert and part, part `p`'s tasks on sub-pool `p`;
/// results expert-major.
fn pack_parts<T: Send>(
    experts: usize,
    ranges: &[Range<usize>],
    exec: &dyn Executor,
    pack: impl Fn(usize, usize, Range<usize>) -> T + Sync,
) -> Vec<T> {
    let parts = ranges.len();
    let slots: Vec<Mutex<Option<T>>> = (0..experts * parts).map(|_| Mutex::new(None)).collect();
    exec.parallel_for_grouped(slots.len(), &|t| t % parts, &|t, _| {
        let (e, p) = (t / parts, t % parts);
        *slots[t].lock().unwrap_or_else(|e| e.into_inner()) = Some(pack(e, p, ranges[p].clone()));
    });
    slots.into_iter().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every task ran")).collect()
}

/// What a packing task returns: the expert's part, `None` for an expert not kept on the CPU.
type Packed<E> = Result<Option<forward::ExpertWeights>, E>;

/// One matrix as a loader has it: logical, or as KT's packed bytes (a converted file's
/// tensors, which a backend in KT's order copies as they are).
pub enum PartMatrix<'a> {
    /// A logical matrix.
    Quant(QuantMatrix),
    /// Per-row int8 or int4 in KT's packed order, with one scale per row.
    Kt {
        /// `Int8Row` or `Int4Row`.
        format: WeightFormat,
        /// Output rows.
        rows: usize,
        /// Input columns.
        cols: usize,
        /// The packed bytes.
        bytes: &'a [u8],
        /// One per row.
        scales: Vec<f32>,
    },
}

impl PartMatrix<'_> {
    fn shape(&self) -> (usize, usize) {
        match self {
            PartMatrix::Quant(m) => (m.rows(), m.cols()),
            PartMatrix::Kt { rows, cols, .. } => (*rows, *cols),
        }
    }

    fn format(&self) -> WeightFormat {
        match self {
            PartMatrix::Quant(m) => m.format(),
            PartMatrix::Kt { format, .. } => *format,
        }
    }

    /// Its values, row-major.
    pub fn dequantize(self) -> Result<Vec<f32>, Error> {
        Ok(match self {
            PartMatrix::Quant(m) => m.dequantize(),
            PartMatrix::Kt { format, rows, cols, bytes, scales } => {
                kt_core::format::kt_packed::from_kt(format, rows, cols, bytes, scales)?.dequantize()
            }
        })
    }

    /// Packed by `backend`: KT's bytes copied where it keeps their order.
    pub(crate) fn pack(self, backend: &dyn Backend) -> Result<PackedMatrix, Error> {
        match self {
            PartMatrix::Quant(m) => backend.pack(&m),
            PartMatrix::Kt { format, rows, cols, bytes, scales } => {
                match backend.pack_kt(format, rows, cols, bytes, &scales) {
                    Some(packed) => packed,
                    None => backend.pack(&kt_core::format::kt_packed::from_kt(format, rows, cols, bytes, scales)?),
                }
            }
        }
    }
}

impl MoeLayer {
    /// Quantize f32 experts to `format` and pack them. `expert(e)` returns `[gate, up, down]`
    /// row-major (gate/up `[I,H]`, down `[H,I]`), or `None` for an expert not kept on the CPU.
    /// It is called on the executor's threads once per expert and NUMA part (each part packs
    /// its own slice on its own node), so a generator or reader produces experts lazily and
    /// only a few are alive at once.
    pub fn from_f32(
        cfg: &MoeConfig,
        format: impl Into<LayerFormat>,
        expert: impl Fn(usize) -> Option<[Vec<f32>; 3]> + Sync,
        opts: &LayerOptions,
    ) -> Result<Self, Error> {
        Self::try_from_f32(cfg, format, |e| Ok(expert(e)), opts)
    }

    /// [`MoeLayer::from_f32`] with a fallible reader: the first error (in expert order) is
    /// returned, the caller's own error type or the layer's converted into it.
    pub fn try_from_f32<E: From<Error> + Send>(
        cfg: &MoeConfig,
        format: impl Into<LayerFormat>,
        expert: impl Fn(usize) -> Result<Option<[Vec<f32>; 3]>, E> + Sync,
        opts: &LayerOptions,
    ) -> Result<Self, E> {
        let format = format.into();
        let backend = backend_for(cfg, format, opts)?;
        let ranges = cfg.part_ranges(format)?;
        let packed = pack_parts(cfg.experts, &ranges, &*opts.executor, |e, _, r| -> Packed<E> {
            let Some([gate, up, down]) = expert(e)? else { return Ok(None) };
            let x = ExpertF32 { gate: &gate, up: &up, down: &down };
            Ok(Some(forward::pack_part_f32(backend, cfg, format, opts.scales, x, r)?))
        });
        Self::assemble(cfg, format, backend, packed, opts)
    }

    /// Pack already-quantized experts (loaded from a file): `(gate, up, down)` per expert, or
    /// `None` for an expert not kept on the CPU, in the formats `format` names. Called once per
    /// expert and NUMA part, as in [`MoeLayer::from_f32`].
    pub fn from_quantized(
        cfg: &MoeConfig,
        expert: impl Fn(usize) -> Option<(QuantMatrix, QuantMatrix, QuantMatrix)> + Sync,
        format: impl Into<LayerFormat>,
        opts: &LayerOptions,
    ) -> Result<Self, Error> {
        Self::try_from_quantized(cfg, |e| Ok(expert(e)), format, opts)
    }

    /// [`MoeLayer::from_quantized`] with a fallible reader, as [`MoeLayer::try_from_f32`].
    pub fn try_from_quantized<E: From<Error> + Send>(
        cfg: &MoeConfig,
        expert: impl Fn(usize) -> Result<Option<(QuantMatrix, QuantMatrix, QuantMatrix)>, E> + Sync,
        format: impl Into<LayerFormat>,
        opts: &LayerOptions,
    ) -> Result<Self, E> {
        let format = format.into();
        let backend = backend_for(cfg, format, opts)?;
        let ranges = cfg.part_ranges(format)?;
        let packed = pack_parts(cfg.experts, &ranges, &*opts.executor, |e, _, r| -> Packed<E> {
            let Some((g, u, d)) = expert(e)? else { return Ok(None) };
            let found = LayerFormat { gate: g.format(), up: u.format(), down: d.format() };
            if found != format {
                return Err(Error::FormatMismatch { expert: e, expected: format, found }.into());
            }
            Ok(Some(forward::pack_part(backend, cfg, &g, &u, &d, r)?))
        });
        Self::assemble(cfg, format, backend, packed, opts)
    }

    /// Pack experts given per NUMA part (as KT's converted files store them): `part(e, p)` gives
    /// part `p`'s gate and up rows `[I_p, H]` and down columns `[H, I_p]` for the `I_p` of
    /// `cfg.part_ranges`, or `None` for an expert not kept on the CPU. The first error (in
    /// expert order) is returned.
    pub fn from_part_matrices<E: From<Error> + Send>(
        cfg: &MoeConfig,
        format: impl Into<LayerFormat>,
        part: impl Fn(usize, usize) -> Result<Option<(QuantMatrix, QuantMatrix, QuantMatrix)>, E> + Sync,
        opts: &LayerOptions,
    ) -> Result<Self, E> {
        let part = |e, p| Ok(part(e, p)?.map(|(g, u, d)| [g, u, d].map(PartMatrix::Quant)));
        Self::from_part_sources(cfg, format, part, opts)
    }

    /// As [`MoeLayer::from_part_matrices`], each matrix logical or in KT's packed bytes: those
    /// are copied as they are by a backend that keeps KT's order ([`Backend::pack_kt`]), else
    /// unpacked and packed.
    pub fn from_part_sources<'a, E: From<Error> + Send>(
        cfg: &MoeConfig,
        format: impl Into<LayerFormat>,
        part: impl Fn(usize, usize) -> Result<Option<[PartMatrix<'a>; 3]>, E> + Sync,
        opts: &LayerOptions,
    ) -> Result<Self, E> {
        let format = format.into();
        let backend = backend_for(cfg, format, opts)?;
        let ranges = cfg.part_ranges(format)?;
        let packed = pack_parts(cfg.experts, &ranges, &*opts.executor, |e, p, r| -> Packed<E> {
            let Some([g, u, d]) = part(e, p)? else { return Ok(None) };
            let (h, ip) = (cfg.hidden, r.len());
            for (what, m, f, rows, cols) in [
                ("gate_proj", &g, format.gate, ip, h),
                ("up_proj", &u, format.up, ip, h),
                ("down_proj", &d, format.down, h, ip),
            ] {
                if m.shape() != (rows, cols) || m.format() != f {
                    let found = m.shape().0 * m.shape().1;
                    return Err(Error::ShapeMismatch { what, expected: rows * cols, found }.into());
                }
            }
            let pack = |m: PartMatrix<'_>| m.pack(backend);
            Ok(Some(forward::ExpertWeights { gate: pack(g)?, up: pack(u)?, down: pack(d)? }))
        });
        Self::assemble(cfg, format, backend, packed, opts)
    }

    fn assemble<E: From<Error>>(
        cfg: &MoeConfig,
        format: LayerFormat,
        backend: &'static dyn Backend,
        packed: Vec<Packed<E>>,
        opts: &LayerOptions,
    ) -> Result<Self, E> {
        let mut weights = LayerWeights::empty(cfg, format, backend)?;
        let parts = weights.parts.len();
        let mut packed = packed.into_iter();
        for e in 0..cfg.experts {
            let per_part: Vec<_> = packed.by_ref().take(parts).collect::<Result<_, _>>()?;
            if let Some(per_part) = per_part.into_iter().collect::<Option<Vec<_>>>() {
                weights.set_expert(e, per_part)?;
            }
        }
        Ok(MoeLayer { cfg: cfg.clone(), weights, executor: opts.executor.clone(), scratch: opts.scratch.clone() })
    }

    /// Give slot `e`'s expert biases (gpt-oss's): see [`kt_core::bias`].
    pub fn set_bias(&mut self, e: usize, bias: ExpertBias) -> Result<(), Error> {
        self.weights.set_bias(e, bias)
    }

    /// Its packed weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }

    /// The executor it runs on.
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.executor
    }

    /// The layer's shape.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The backend running it.
    pub fn backend(&self) -> &'static dyn Backend {
        self.weights.backend()
    }

    /// The formats of its weights.
    pub fn format(&self) -> LayerFormat {
        self.weights.format
    }

    /// Bytes of expert `e`'s packed weights (0 if not loaded).
    pub fn expert_bytes(&self, e: usize) -> usize {
        self.weights.expert_bytes(e)
    }

    /// Bytes of all packed weights.
    pub fn bytes(&self) -> usize {
        self.weights.bytes()
    }

    /// The scratch it shares with the layers built from the same options
    /// ([`LayerOptions::scratch`]).
    pub fn scratch(&self) -> &SharedScratch {
        &self.scratch
    }

    /// `output[n,H] = Σ_j weights[t,j] · expert_{ids[t,j]}(input[t])` over CPU-resident experts
    /// (`ids` < 0, ≥ E or masked are skipped). `input` is `[n, H]` bf16, `ids` and `weights`
    /// `[n, k]`, `gpu_mask` `[E]`.
    pub fn forward(
        &self,
        input: &[bf16],
        ids: &[i64],
        weights: &[f32],
        gpu_mask: Option<&[bool]>,
    ) -> Result<Vec<bf16>, Error> {
        let mut out = vec![bf16::ZERO; input.len()];
        self.forward_into(input, ids, weights, gpu_mask, &mut out)?;
        Ok(out)
    }

    /// As [`MoeLayer::forward`], writing into `out` (`[n, H]`).
    pub fn forward_into(
        &self,
        input: &[bf16],
        ids: &[i64],
        weights: &[f32],
        gpu_mask: Option<&[bool]>,
        out: &mut [bf16],
    ) -> Result<(), Error> {
        let h = self.cfg.hidden;
        if input.len() % h != 0 {
            return Err(Error::ShapeMismatch {
                what: "hidden_states (a multiple of hidden)",
                expected: h,
                found: input.len(),
            });
        }
        let routing = Routing { tokens: input.len() / h, k: self.cfg.top_k, ids, weights, gpu_mask };
        let mut scratch = scratch::lock(&self.scratch);
        forward::forward(&*self.executor, &self.cfg, &self.weights, input, &routing, out, &mut scratch.forward)
    }
}
