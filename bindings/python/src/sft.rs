//! `SftMoe`: one MoE layer for LoRA fine-tuning (`kt_host::SftLayer`). The LoRA matrices and
//! their gradients stay the caller's (torch parameters and their `.grad`, or numpy arrays):
//! their addresses are registered once and read or added to by every step, as KT keeps its
//! zero-copy pointers. Forward and backward are tasks on the `CpuInfer` queue, so they take
//! their turn with inference forwards and their errors surface at the next sync.

use std::sync::{Arc, Mutex};

use half::bf16;
use kt_core::sft::TransposeFormat;
use kt_core::sft::{Backward, BaseGrads, Lora, LoraGrads};
use kt_core::{MoeConfig, QuantMatrix, Routing, WeightFormat};
use kt_host::error::WeightError;
use kt_host::slots::Slots;
use kt_host::source::WeightSource;
use kt_host::{SftLayer, SftOptions};
use pyo3::prelude::*;

use crate::cuda::Key;
use crate::errors::{KTNotImplementedError, KTRuntimeError};
use crate::infer::CpuInfer;
use crate::moe::{array_expert, checked_map, mask_at, next_layer_id, source, DType};
use crate::value_error;

/// Addresses of the six bf16 LoRA matrices (or their gradients) in `Lora`'s order.
type Six = [usize; 6];

/// A registered LoRA: rank, alpha and the matrices' addresses.
type Registered = (usize, f32, Six);

struct Shared {
    /// Unique among native layers: the key of its CUDA host functions.
    id: u64,
    cfg: MoeConfig,
    format: WeightFormat,
    /// KT's `_SkipLoRA` methods, or full fine-tuning at rank 0: the base alone.
    skip_lora: bool,
    sft: SftOptions,
    layer: Mutex<Option<Arc<SftLayer>>>,
    /// `(rank, alpha, matrices)` once `set_lora` ran.
    lora: Mutex<Option<Registered>>,
    /// The gradients' addresses once `set_lora_grads` ran.
    grads: Mutex<Option<Six>>,
    /// The base weights' gradients' addresses once `set_base_grads` ran (full fine-tuning).
    base_grads: Mutex<Option<[usize; 3]>>,
    /// The wrapper's `gpu_experts_mask` (`[E]` bytes, nonzero = on the GPU), read at every
    /// forward (0: none).
    mask_ptr: usize,
}

/// One layer's experts for LoRA fine-tuning.
#[pyclass(frozen, module = "kt_kernel.kt_kernel_ext")]
pub struct SftMoe {
    shared: Arc<Shared>,
}

/// A step's buffers (the wrapper keeps them alive and in place until the task's sync).
#[derive(Clone, Copy)]
struct Buffers {
    n: usize,
    /// `[n, H]`: the input (forward) or the output's gradient (backward).
    x: usize,
    x_dtype: DType,
    /// `[n, k]` int64 ids and float32 weights (forward).
    ids: usize,
    weights: usize,
    /// `[n, H]`: the output (forward) or the input's gradient (backward).
    out: usize,
    out_dtype: DType,
    /// `[n, k]` float32: the weights' gradient (backward).
    grad_weights: usize,
}

#[pymethods]
impl SftMoe {
    /// A layer of `experts` experts, `top_k` per token, hidden `hidden`, intermediate
    /// `intermediate`, at most `max_tokens` a step, in `method`'s format (KT's SFT method names:
    /// `AMXBF16_SFT`, `AMXINT8_SFT`/`INT8_SFT`, `AMXINT4_SFT`, `AMXINT4_KGroup_SFT` with
    /// `group_size`, `AMXFP8_SFT`, each with `_SkipLoRA`), keeping up to `max_cache_depth`
    /// saved forwards; `lora = False` runs the base alone (full fine-tuning without LoRA);
    /// `backward_weights` is what the backward's transposes are packed in: `"bf16"` (exact) or
    /// `"method"` (the method's own format per part, as KT: a quarter of bf16's bytes for int4);
    /// `mask_ptr` is the address of the wrapper's `[E]` bool GPU-expert mask (0 for none);
    /// `swiglu_limit` / `swiglu_alpha` select KT's clamped SwiGLU variants (gpt-oss's limit for
    /// MXFP4_SFT), differentiated as torch's clamp is.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (experts, top_k, hidden, intermediate, max_tokens, method, max_cache_depth = 1, group_size = 128, lora = true, backward_weights = "bf16", mask_ptr = 0, swiglu_limit = 0.0, swiglu_alpha = 0.0))]
    fn new(
        experts: usize,
        top_k: usize,
        hidden: usize,
        intermediate: usize,
        max_tokens: usize,
        method: &str,
        max_cache_depth: usize,
        group_size: usize,
        lora: bool,
        backward_weights: &str,
        mask_ptr: usize,
        swiglu_limit: f32,
        swiglu_alpha: f32,
    ) -> PyResult<Self> {
        let (base, skip_lora) = match method.strip_suffix("_SkipLoRA") {
            Some(b) => (b, true),
            None => (method, !lora),
        };
        let format = match base {
            "AMXBF16_SFT" => WeightFormat::Bf16,
            "AMXINT8_SFT" | "INT8_SFT" => WeightFormat::Int8Row,
            "AMXINT4_SFT" => WeightFormat::Int4Row,
            "AMXINT4_KGroup_SFT" => WeightFormat::Int4Group {
                group: group_size
                    .try_into()
                    .map_err(|_| value_error(format!("group_size {group_size} is too large")))?,
            },
            "AMXFP8_SFT" => WeightFormat::Fp8Block,
            "RAWINT4_SFT" => WeightFormat::Int4Group { group: 32 },
            "MXFP4_SFT" => WeightFormat::Mxfp4,
            _ => {
                return Err(KTNotImplementedError::new_err(format!(
                    "SFT method {method} has no CPU backend in this build (the zero-point int4 kinds AMXINT4_1_SFT and \
                     AMXINT4_1KGroup_SFT are not implemented); working: AMXBF16_SFT, AMXINT8_SFT, INT8_SFT, \
                     AMXINT4_SFT, AMXINT4_KGroup_SFT, AMXFP8_SFT, RAWINT4_SFT, MXFP4_SFT and their _SkipLoRA variants"
                )))
            }
        };
        if max_cache_depth == 0 {
            return Err(value_error("max_cache_depth must be positive, got 0"));
        }
        let transposes = match backward_weights {
            "bf16" => TransposeFormat::Bf16,
            "method" => TransposeFormat::Layer,
            w => return Err(value_error(format!("backward_weights must be \"bf16\" or \"method\", got {w:?}"))),
        };
        let glu = kt_core::swiglu::Glu::new(swiglu_limit, swiglu_alpha).ok_or_else(|| {
            value_error(format!(
                "swiglu_limit and swiglu_alpha must be finite and >= 0, got {swiglu_limit} and {swiglu_alpha}"
            ))
        })?;
        let cfg = MoeConfig { max_tokens, glu, ..MoeConfig::new(experts, top_k, hidden, intermediate) };
        cfg.validate_for(format).map_err(value_error)?;
        Ok(SftMoe {
            shared: Arc::new(Shared {
                id: next_layer_id(),
                cfg,
                format,
                skip_lora,
                sft: SftOptions { max_cache_depth, transposes },
                layer: Mutex::new(None),
                lora: Mutex::new(None),
                grads: Mutex::new(None),
                base_grads: Mutex::new(None),
                mask_ptr,
            }),
        })
    }

    /// Quantize and pack experts from row-major arrays at these addresses (gate and up
    /// `[E, I, H]`, down `[E, H, I]`, of `dtype`; slot `p` gets logical expert `map[p]`), with
    /// their transposes for the backward. Blocks, GIL released.
    #[allow(clippy::too_many_arguments)]
    fn load_from_arrays(
        &self,
        py: Python<'_>,
        infer: &CpuInfer,
        gate: usize,
        up: usize,
        down: usize,
        dtype: &str,
        map: Vec<i64>,
    ) -> PyResult<()> {
        let (dtype, s) = (DType::parse(dtype)?, &self.shared);
        let (h, i) = (s.cfg.hidden, s.cfg.intermediate);
        let map = checked_map(&map, s.cfg.experts)?;
        let cfg = layer_config(s, infer)?;
        let opts = infer.layer_options();
        let layer = py.detach(|| {
            SftLayer::from_f32(
                &cfg,
                s.format,
                // SAFETY: the wrapper checked shapes, dtypes and contiguity of the three arrays
                // and keeps them alive for this call.
                |slot| Some(unsafe { array_expert(dtype, [gate, up, down], map[slot], h, i) }),
                &opts,
                s.sft,
            )
        });
        *s.layer.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(layer.map_err(value_error)?));
        Ok(())
    }

    /// Load experts exactly as a checkpoint stores them, in the layer's own format (KT's
    /// RAWINT4: int4 groups of 32 as compressed-tensors packs them, offset-8 nibbles with the
    /// even column low, and a scale per group; FP8: e4m3 bytes and a scale per 128×128 block;
    /// MXFP4: e2m1 nibbles, even column low, and a power-of-two scale per 32 columns):
    /// `ptrs` holds, per logical expert, the addresses of gate, its scales, up, its scales,
    /// down and its scales (row-major, scales of `scale_dtype`); slot `p` gets logical expert
    /// `map[p]`. Blocks, GIL released.
    fn load_from_quantized(
        &self,
        py: Python<'_>,
        infer: &CpuInfer,
        ptrs: Vec<usize>,
        scale_dtype: &str,
        map: Vec<i64>,
    ) -> PyResult<()> {
        let (scale_dtype, s) = (DType::parse(scale_dtype)?, &self.shared);
        let (f, e, h, i) = (s.format, s.cfg.experts, s.cfg.hidden, s.cfg.intermediate);
        if !matches!(f, WeightFormat::Int4Group { .. } | WeightFormat::Fp8Block | WeightFormat::Mxfp4) {
            return Err(value_error(format!(
                "stored weights load into RAWINT4_SFT, AMXFP8_SFT and MXFP4_SFT layers, not {f}"
            )));
        }
        if ptrs.len() != 6 * e {
            return Err(value_error(format!("expected 6 addresses for each of {e} experts, got {}", ptrs.len())));
        }
        let map = checked_map(&map, e)?;
        let cfg = layer_config(s, infer)?;
        let opts = infer.layer_options();
        let matrix = |e: usize, proj: usize| {
            let (rows, cols) = if proj == 2 { (h, i) } else { (i, h) };
            let (bytes, count) = (f.data_bytes(rows, cols), f.scale_count(rows, cols));
            let (data, scales) = (ptrs[6 * e + 2 * proj], ptrs[6 * e + 2 * proj + 1]);
            // SAFETY: the wrapper checked every tensor's shape, dtype and contiguity and keeps
            // them alive for this call.
            let (d, sc) = unsafe {
                (std::slice::from_raw_parts(data as *const u8, bytes).to_vec(), scale_dtype.read(scales, count))
            };
            QuantMatrix::from_parts(f, rows, cols, d, sc)
        };
        // Every expert's lengths are these (the config fixed them): checked once, on expert 0.
        for proj in 0..3 {
            matrix(0, proj).map_err(value_error)?;
        }
        let layer = py.detach(|| {
            let expert = |slot: usize| {
                let m = |proj| matrix(map[slot], proj).ok();
                Some((m(0)?, m(1)?, m(2)?))
            };
            SftLayer::from_quantized(&cfg, f, expert, &opts, s.sft)
        });
        *s.layer.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(layer.map_err(value_error)?));
        Ok(())
    }

    /// Load layer `layer` of the checkpoint at `path`: Hugging Face safetensors (any layout and
    /// dtype the inference loader reads) or converted (`kt convert`, KT's converter: for as
    /// many NUMA parts as the pool has sub-pools), slot `p` holding logical expert `map[p]`.
    /// Blocks, GIL released.
    fn load_from_checkpoint(
        &self,
        py: Python<'_>,
        infer: &CpuInfer,
        path: std::path::PathBuf,
        layer: usize,
        map: Vec<i64>,
    ) -> PyResult<()> {
        let s = &self.shared;
        let map = checked_map(&map, s.cfg.experts)?;
        let cfg = layer_config(s, infer)?;
        let opts = infer.layer_options();
        let loaded = py.detach(|| -> Result<SftLayer, WeightError> {
            let slots = Slots { map: Some(&map), gpu: None };
            match &*source(&path)? {
                WeightSource::Hf(ck) => SftLayer::from_checkpoint(ck, layer, s.format, &cfg, slots, &opts, s.sft),
                WeightSource::Kt(ck) => SftLayer::from_converted(ck, layer, s.format, &cfg, slots, &opts, s.sft),
                _ => Err(WeightError::Config {
                    path: path.clone(),
                    detail: "SFT loads base weights from a Hugging Face safetensors checkpoint or a `kt convert` / \
                             KT-converted one (GGUF models are not read for SFT); or pass tensors to \
                             load_weights_from_tensors"
                        .into(),
                }),
            }
        });
        *s.layer.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(loaded.map_err(value_error)?));
        Ok(())
    }

    /// Register the six bf16 LoRA matrices' addresses (`[E, r, H]`, `[E, I, r]`, `[E, r, H]`,
    /// `[E, I, r]`, `[E, r, I]`, `[E, H, r]`; the wrapper checked them), read by every step.
    fn set_lora(&self, rank: usize, alpha: f32, ptrs: Six) -> PyResult<()> {
        let lora = (rank, alpha, ptrs);
        // Check the shapes' arithmetic once, on a view of no data.
        let cfg = &self.shared.cfg;
        let empty = [bf16::ZERO; 0];
        let l = Lora {
            rank,
            alpha,
            gate_a: &empty,
            gate_b: &empty,
            up_a: &empty,
            up_b: &empty,
            down_a: &empty,
            down_b: &empty,
        };
        if let Err(e @ kt_core::Error::InvalidConfig { .. }) = l.validate(cfg) {
            return Err(value_error(e));
        }
        *self.shared.lora.lock().unwrap_or_else(|e| e.into_inner()) = Some(lora);
        Ok(())
    }

    /// Register the LoRA gradients' addresses (bf16, the matrices' shapes), added to by every
    /// backward; `None` to stop.
    fn set_lora_grads(&self, ptrs: Option<Six>) {
        *self.shared.grads.lock().unwrap_or_else(|e| e.into_inner()) = ptrs;
    }

    /// Register the base weights' gradients' addresses (bf16 gate and up `[E, I, H]`, down
    /// `[E, H, I]`; the wrapper checked them), added to by every backward; `None` to stop.
    fn set_base_grads(&self, ptrs: Option<[usize; 3]>) {
        *self.shared.base_grads.lock().unwrap_or_else(|e| e.into_inner()) = ptrs;
    }

    /// Queue a forward: `n` tokens of `input` (`[n, H]`, `input_dtype`), `ids` int64 and
    /// `weights` float32 `[n, k]`, into `output` (`[n, H]`, `output_dtype`), saving its cache
    /// when `save`. Returns the ticket to `CpuInfer.sync_until`.
    #[allow(clippy::too_many_arguments)]
    fn submit_forward(
        &self,
        infer: &CpuInfer,
        n: usize,
        input: usize,
        input_dtype: &str,
        ids: usize,
        weights: usize,
        output: usize,
        output_dtype: &str,
        save: bool,
    ) -> PyResult<u64> {
        let b = Buffers {
            n,
            x: input,
            x_dtype: DType::parse(input_dtype)?,
            ids,
            weights,
            out: output,
            out_dtype: DType::parse(output_dtype)?,
            grad_weights: 0,
        };
        let (layer, lora) = self.ready()?;
        let s = self.shared.clone();
        Ok(infer.queue.submit(Box::new(move || forward(&s, &layer, lora, b, save))))
    }

    /// Queue the backward of the newest saved forward: `n` tokens of `grad_output` into
    /// `grad_input` (`[n, H]`) and `grad_weights` (float32 `[n, k]`), the LoRA gradients (if
    /// registered) added to, times `grad_scale`. Returns the ticket.
    #[allow(clippy::too_many_arguments)]
    fn submit_backward(
        &self,
        infer: &CpuInfer,
        n: usize,
        grad_output: usize,
        grad_output_dtype: &str,
        grad_input: usize,
        grad_input_dtype: &str,
        grad_weights: usize,
        grad_scale: f32,
    ) -> PyResult<u64> {
        let b = Buffers {
            n,
            x: grad_output,
            x_dtype: DType::parse(grad_output_dtype)?,
            ids: 0,
            weights: 0,
            out: grad_input,
            out_dtype: DType::parse(grad_input_dtype)?,
            grad_weights,
        };
        let (layer, lora) = self.ready()?;
        let grads = *self.shared.grads.lock().unwrap_or_else(|e| e.into_inner());
        let base = *self.shared.base_grads.lock().unwrap_or_else(|e| e.into_inner());
        let s = self.shared.clone();
        Ok(infer.queue.submit(Box::new(move || backward(&s, &layer, lora, (grads, base), b, grad_scale))))
    }

    /// Queue a serving forward (nothing saved, SGLang's LoRA experts) over staging buffers at
    /// these addresses as `Moe.submit_forward` does (`bsz`: int32 token count, read when the
    /// task runs; `ids` int64 and `weights` float32 `[N, k]`; `input`/`output` `[N, H]`):
    /// with a non-zero `stream` the task is queued by a host function on that CUDA stream (no
    /// ticket), else its ticket is returned. The layer and LoRA are read when the task runs.
    #[allow(clippy::too_many_arguments)]
    fn submit_forward_inference(
        &self,
        infer: &CpuInfer,
        stream: usize,
        bsz: usize,
        input: usize,
        input_dtype: &str,
        ids: usize,
        weights: usize,
        output: usize,
        output_dtype: &str,
    ) -> PyResult<Option<u64>> {
        self.ready()?;
        let (x_dtype, out_dtype) = (DType::parse(input_dtype)?, DType::parse(output_dtype)?);
        let b = Buffers { n: 0, x: input, x_dtype, ids, weights, out: output, out_dtype, grad_weights: 0 };
        let key = Key::Forward {
            moe: self.shared.id,
            addrs: [bsz, input, ids, weights, output, 0],
            dtypes: [x_dtype as u8, out_dtype as u8],
        };
        let s = self.shared.clone();
        infer.submit(stream, key, move || {
            let s = s.clone();
            Box::new(move || {
                // SAFETY: the wrapper's staging buffers live as long as the wrapper's cache of
                // them, and `bsz` holds the token count when the task runs.
                let n = unsafe { *(bsz as *const i32) } as usize;
                let (layer, lora) = ready(&s)?;
                forward(&s, &layer, lora, Buffers { n, ..b }, false)
            })
        })
    }

    /// Forwards saved and not yet backwarded.
    #[getter]
    fn cache_depth(&self) -> usize {
        self.layer().map_or(0, |l| l.cache_depth())
    }

    /// Bytes the saved forwards hold.
    #[getter]
    fn cache_bytes(&self) -> usize {
        self.layer().map_or(0, |l| l.cache_bytes())
    }

    /// Drop every saved forward.
    fn clear_cache(&self) {
        if let Some(l) = self.layer() {
            l.clear_cache();
        }
    }

    /// Whether weights are loaded.
    #[getter]
    fn loaded(&self) -> bool {
        self.layer().is_some()
    }

    /// The backend running the layer (after loading).
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.layer().map(|l| l.backend().name())
    }

    /// Bytes of the packed weights (the inference experts and the backward's transposes).
    #[getter]
    fn weight_bytes(&self) -> usize {
        self.layer().map_or(0, |l| l.bytes())
    }
}

impl SftMoe {
    fn layer(&self) -> Option<Arc<SftLayer>> {
        self.shared.layer.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The loaded layer and the LoRA a step runs with (`None` for the `_SkipLoRA` methods).
    fn ready(&self) -> PyResult<(Arc<SftLayer>, Option<Registered>)> {
        ready(&self.shared).map_err(KTRuntimeError::new_err)
    }
}

/// `s`'s loaded layer and the LoRA a step runs with (`None` for the `_SkipLoRA` methods), or
/// what is missing (no Python error: serving tasks check it on a worker).
fn ready(s: &Shared) -> Result<(Arc<SftLayer>, Option<Registered>), &'static str> {
    let layer = s.layer.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let layer = layer.ok_or("weights are not loaded: call load_weights() or load_weights_from_tensors() first")?;
    let lora = *s.lora.lock().unwrap_or_else(|e| e.into_inner());
    if lora.is_none() && !s.skip_lora {
        return Err("LoRA weights are not initialized: call init_lora_weights() first");
    }
    Ok((layer, lora.filter(|_| !s.skip_lora)))
}

/// The layer's shape on `infer`'s pool: one NUMA part per sub-pool, as an inference layer.
fn layer_config(s: &Shared, infer: &CpuInfer) -> PyResult<MoeConfig> {
    let cfg = MoeConfig { parts: infer.pool.subpools(), ..s.cfg.clone() };
    cfg.validate_for(s.format).map_err(value_error)?;
    Ok(cfg)
}

/// The registered LoRA as slices.
///
/// # Safety
/// The addresses hold the six matrices of `cfg` at this rank, alive while the slices are.
unsafe fn lora_view<'a>(cfg: &MoeConfig, (rank, alpha, p): Registered) -> Lora<'a> {
    let (e, h, i) = (cfg.experts, cfg.hidden, cfg.intermediate);
    let lens = [e * rank * h, e * i * rank, e * rank * h, e * i * rank, e * rank * i, e * h * rank];
    // SAFETY: the caller's contract.
    let m = |k: usize| unsafe { std::slice::from_raw_parts(p[k] as *const bf16, lens[k]) };
    Lora { rank, alpha, gate_a: m(0), gate_b: m(1), up_a: m(2), up_b: m(3), down_a: m(4), down_b: m(5) }
}

/// The body of a forward task.
fn forward(s: &Shared, layer: &SftLayer, lora: Option<Registered>, b: Buffers, save: bool) -> Result<(), String> {
    let (h, k) = (s.cfg.hidden, s.cfg.top_k);
    // SAFETY (every access below): the wrapper's buffers hold `n` rows, stay alive and are not
    // touched by Python until the matching sync; the LoRA it registered stays alive likewise.
    let input = unsafe { b.x_dtype.bf16s(b.x, b.n * h) };
    let ids = unsafe { std::slice::from_raw_parts(b.ids as *const i64, b.n * k) };
    let weights = unsafe { std::slice::from_raw_parts(b.weights as *const f32, b.n * k) };
    let lora = lora.map(|l| unsafe { lora_view(&s.cfg, l) });
    // SAFETY: the wrapper owns the `[E]` mask at `mask_ptr` for the layer's life.
    let mask = unsafe { mask_at(s.mask_ptr, s.cfg.experts) };
    let routing = Routing { tokens: b.n, k, ids, weights, gpu_mask: mask.as_deref() };
    // The output buffer is the wrapper's own, apart from every buffer read here.
    let mut spare = Vec::new();
    let out = unsafe { b.out_dtype.results(b.out, b.n * h, &mut spare) };
    layer.forward(&input, &routing, lora.as_ref(), save, out).map_err(|e| e.to_string())?;
    unsafe { b.out_dtype.store(b.out, out) };
    Ok(())
}

/// The body of a backward task.
fn backward(
    s: &Shared,
    layer: &SftLayer,
    lora: Option<Registered>,
    (grads, base): (Option<Six>, Option<[usize; 3]>),
    b: Buffers,
    grad_scale: f32,
) -> Result<(), String> {
    let (cfg, h, k) = (&s.cfg, s.cfg.hidden, s.cfg.top_k);
    // SAFETY: as in `forward`; the gradients' buffers likewise, and nothing else writes them
    // while the task runs.
    let grad_output = unsafe { b.x_dtype.bf16s(b.x, b.n * h) };
    let grad_weights = unsafe { std::slice::from_raw_parts_mut(b.grad_weights as *mut f32, b.n * k) };
    let view = lora.map(|l| unsafe { lora_view(cfg, l) });
    let grads = match (lora, grads) {
        (Some((rank, _, _)), Some(p)) => {
            let (e, h, i) = (cfg.experts, cfg.hidden, cfg.intermediate);
            let lens = [e * rank * h, e * i * rank, e * rank * h, e * i * rank, e * rank * i, e * h * rank];
            // SAFETY: the wrapper hands six LoRA gradient buffers of these lengths, each apart
            // from every other buffer of the task and written by it alone.
            let m = |k: usize| unsafe { std::slice::from_raw_parts_mut(p[k] as *mut bf16, lens[k]) };
            Some(LoraGrads { gate_a: m(0), gate_b: m(1), up_a: m(2), up_b: m(3), down_a: m(4), down_b: m(5) })
        }
        _ => None,
    };
    let base = base.map(|p| {
        let len = cfg.experts * h * cfg.intermediate;
        // SAFETY: the wrapper hands three `[E, ·, ·]` base gradient buffers, each apart from
        // every other buffer of the task and written by it alone.
        let m = |k: usize| unsafe { std::slice::from_raw_parts_mut(p[k] as *mut bf16, len) };
        BaseGrads { gate: m(0), up: m(1), down: m(2) }
    });
    let mut spare = Vec::new();
    // SAFETY: `b.out` is the wrapper's `[n, H]` gradient buffer of `out_dtype`, apart from
    // every buffer read here.
    let grad_input = unsafe { b.out_dtype.results(b.out, b.n * h, &mut spare) };
    let out = Backward { grad_input, grad_weights, lora: grads, base, grad_scale };
    layer.backward(&grad_output, view.as_ref(), out).map_err(|e| e.to_string())?;
    // SAFETY: as for `grad_input` above; the borrow of it has ended.
    unsafe { b.out_dtype.store(b.out, &spare) };
    Ok(())
}
