//! `MoeLayer`: one MoE layer's packed experts, the backend that runs them and an executor.
//! Build it from f32 or already-quantized matrices (experts packed in parallel), then call
//! [`MoeLayer::forward`] as many times as you like.

use std::sync::{Arc, Mutex};

use half::bf16;
use kt_core::forward::{self, ExpertF32, LayerWeights, Workspace};
use kt_core::{Backend, Error, Executor, MoeConfig, QuantMatrix, Routing, WeightFormat};

use crate::exec::parallel_map;
use crate::pool::Pool;
use crate::registry;

/// How to build a layer.
#[derive(Clone)]
pub struct LayerOptions {
    /// The backend; `None` picks the best available for the format (`KT_KERNEL_CPU_VARIANT`
    /// honoured).
    pub backend: Option<&'static dyn Backend>,
    /// Runs the forward's tasks.
    pub executor: Arc<dyn Executor>,
    /// Threads used to quantize and pack experts at load.
    pub load_threads: usize,
}

impl Default for LayerOptions {
    /// One thread per CPU this process may use.
    fn default() -> Self {
        Self::threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl LayerOptions {
    /// A persistent pool of `threads` threads for compute, and as many for loading.
    pub fn threads(threads: usize) -> Self {
        LayerOptions { backend: None, executor: Arc::new(Pool::new(threads)), load_threads: threads.max(1) }
    }
}

/// One MoE layer ready to run.
pub struct MoeLayer {
    cfg: MoeConfig,
    backend: &'static dyn Backend,
    weights: LayerWeights,
    executor: Arc<dyn Executor>,
    workspace: Mutex<Workspace>,
}

impl std::fmt::Debug for MoeLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeLayer({:?}, {} on {})", self.cfg, self.weights.format, self.backend.name())
    }
}

fn backend_for(cfg: &MoeConfig, format: WeightFormat, opts: &LayerOptions) -> Result<&'static dyn Backend, Error> {
    cfg.validate_for(format)?;
    let part = cfg.part_ranges(format)?.iter().map(|r| r.len()).max().unwrap_or(0);
    let shapes = [(part, cfg.hidden), (cfg.hidden, part)];
    match opts.backend {
        Some(b) if b.cpu_support().is_ok() && shapes.iter().all(|&(r, c)| b.supports(format, r, c)) => Ok(b),
        Some(b) => Err(Error::NoBackend {
            format,
            detail: format!("backend {} cannot run it on this CPU or these shapes", b.name()),
        }),
        None => registry::select_for(format, &shapes),
    }
}

impl MoeLayer {
    /// Quantize f32 experts to `format` and pack them. `expert(e)` returns `[gate, up, down]`
    /// row-major (gate/up `[I,H]`, down `[H,I]`), or `None` for an expert not kept on the CPU.
    /// It is called from `load_threads` threads, so a generator or reader produces experts
    /// lazily and only a few are alive at once.
    pub fn from_f32(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Option<[Vec<f32>; 3]> + Sync,
        opts: &LayerOptions,
    ) -> Result<Self, Error> {
        let backend = backend_for(cfg, format, opts)?;
        let packed = parallel_map(cfg.experts, opts.load_threads, |e| {
            expert(e)
                .map(|[gate, up, down]| {
                    forward::pack_expert_f32(backend, cfg, format, ExpertF32 { gate: &gate, up: &up, down: &down })
                })
                .transpose()
        });
        Self::assemble(cfg, format, backend, packed, opts)
    }

    /// Pack already-quantized experts (loaded from a file): `(gate, up, down)` per expert, or
    /// `None` for an expert not kept on the CPU. All must share one format.
    pub fn from_quantized(
        cfg: &MoeConfig,
        expert: impl Fn(usize) -> Option<(QuantMatrix, QuantMatrix, QuantMatrix)> + Sync,
        format: WeightFormat,
        opts: &LayerOptions,
    ) -> Result<Self, Error> {
        let backend = backend_for(cfg, format, opts)?;
        let packed = parallel_map(cfg.experts, opts.load_threads, |e| {
            expert(e)
                .map(|(g, u, d)| {
                    if [g.format(), u.format(), d.format()].iter().any(|&f| f != format) {
                        return Err(Error::NoBackend { format, detail: format!("expert {e} mixes formats") });
                    }
                    forward::pack_expert(backend, cfg, &g, &u, &d)
                })
                .transpose()
        });
        Self::assemble(cfg, format, backend, packed, opts)
    }

    fn assemble(
        cfg: &MoeConfig,
        format: WeightFormat,
        backend: &'static dyn Backend,
        packed: Vec<Result<Option<Vec<forward::ExpertWeights>>, Error>>,
        opts: &LayerOptions,
    ) -> Result<Self, Error> {
        let mut weights = LayerWeights::empty(cfg, format)?;
        for (e, p) in packed.into_iter().enumerate() {
            if let Some(p) = p? {
                weights.set_expert(e, p);
            }
        }
        Ok(MoeLayer {
            cfg: cfg.clone(),
            backend,
            weights,
            executor: opts.executor.clone(),
            workspace: Mutex::new(Workspace::default()),
        })
    }

    /// The layer's shape.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The backend running it.
    pub fn backend(&self) -> &'static dyn Backend {
        self.backend
    }

    /// The format of its weights.
    pub fn format(&self) -> WeightFormat {
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
        let mut ws = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        forward::forward(self.backend, &*self.executor, &self.cfg, &self.weights, input, &routing, out, &mut ws)
    }
}
