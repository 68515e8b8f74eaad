//! `Moe`: one MoE layer of the `CpuInfer` engine. Weights come from `[E, I, H]`/`[E, H, I]`
//! arrays (online quantization); a forward is a queued task that reads the staging buffers by
//! address when it runs, so the wrapper's pinned buffers and CUDA-graph replays feed it.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use kt_core::{MoeConfig, Scales, WeightFormat};
use kt_host::error::WeightError;
use kt_host::slots::Slots;
use kt_host::source::WeightSource;
use kt_host::{LayerOptions, MoeLayer};
use pyo3::prelude::*;

use crate::cuda::Key;
use crate::errors::{KTNotImplementedError, KTRuntimeError};
use crate::infer::CpuInfer;
use crate::value_error;

/// Element types of staging buffers and weight arrays.
#[derive(Clone, Copy, Debug)]
#[repr(u8)]
pub(crate) enum DType {
    Bf16,
    F16,
    F32,
}

impl DType {
    pub(crate) fn parse(s: &str) -> PyResult<Self> {
        match s {
            "bf16" => Ok(DType::Bf16),
            "f16" => Ok(DType::F16),
            "f32" => Ok(DType::F32),
            _ => Err(value_error(format!("unsupported dtype {s:?}; expected bfloat16, float16 or float32"))),
        }
    }

    /// `len` elements at `ptr` as f32.
    ///
    /// # Safety
    /// `ptr` must address `len` readable elements of this type.
    pub(crate) unsafe fn read(self, ptr: usize, len: usize) -> Vec<f32> {
        // SAFETY: per the contract above.
        unsafe {
            match self {
                DType::Bf16 => std::slice::from_raw_parts(ptr as *const bf16, len).iter().map(|v| v.to_f32()).collect(),
                DType::F16 => std::slice::from_raw_parts(ptr as *const f16, len).iter().map(|v| v.to_f32()).collect(),
                DType::F32 => std::slice::from_raw_parts(ptr as *const f32, len).to_vec(),
            }
        }
    }

    /// `len` values at `ptr` as bf16: bf16 ones read where they are (SGLang's hidden states: at
    /// 8192 tokens of H 7168 a copy into a fresh buffer faults in 117 MB of new pages).
    ///
    /// # Safety
    /// `ptr` must address `len` readable elements of this type, unchanged while the result lives.
    pub(crate) unsafe fn bf16s<'a>(self, ptr: usize, len: usize) -> Cow<'a, [bf16]> {
        // SAFETY: per the contract above.
        unsafe {
            match self {
                DType::Bf16 => Cow::Borrowed(std::slice::from_raw_parts(ptr as *const bf16, len)),
                d => Cow::Owned(d.read(ptr, len).into_iter().map(bf16::from_f32).collect()),
            }
        }
    }

    /// Where a task puts `len` bf16 results bound for `ptr`: that buffer itself for bf16, else
    /// `spare`, grown, for [`DType::store`] to convert.
    ///
    /// # Safety
    /// As [`DType::write`], and nothing else reads or writes `ptr`'s elements while the result
    /// lives.
    pub(crate) unsafe fn results(self, ptr: usize, len: usize, spare: &mut Vec<bf16>) -> &mut [bf16] {
        match self {
            // SAFETY: per the contract above.
            DType::Bf16 => unsafe { std::slice::from_raw_parts_mut(ptr as *mut bf16, len) },
            _ => {
                spare.resize(len, bf16::ZERO);
                spare
            }
        }
    }

    /// Results from [`DType::results`] into the buffer at `ptr` (bf16 ones are there already).
    ///
    /// # Safety
    /// As [`DType::write`].
    pub(crate) unsafe fn store(self, ptr: usize, results: &[bf16]) {
        if !matches!(self, DType::Bf16) {
            let v: Vec<f32> = results.iter().map(|x| x.to_f32()).collect();
            // SAFETY: per the contract above.
            unsafe { self.write(ptr, &v) };
        }
    }

    /// Bytes of one element.
    pub(crate) fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// Write `v` at `ptr`, rounding to nearest even.
    ///
    /// # Safety
    /// `ptr` must address `v.len()` writable elements of this type, aliased by nothing else.
    pub(crate) unsafe fn write(self, ptr: usize, v: &[f32]) {
        // SAFETY: per the contract above.
        unsafe {
            match self {
                DType::Bf16 => std::slice::from_raw_parts_mut(ptr as *mut bf16, v.len())
                    .iter_mut()
                    .zip(v)
                    .for_each(|(o, &x)| *o = bf16::from_f32(x)),
                DType::F16 => std::slice::from_raw_parts_mut(ptr as *mut f16, v.len())
                    .iter_mut()
                    .zip(v)
                    .for_each(|(o, &x)| *o = f16::from_f32(x)),
                DType::F32 => std::slice::from_raw_parts_mut(ptr as *mut f32, v.len()).copy_from_slice(v),
            }
        }
    }
}

struct Shared {
    id: u64,
    cfg: MoeConfig,
    /// The method's format; `None` for LLAMAFILE, whose GGUF file decides.
    format: Option<WeightFormat>,
    /// Whether a 4-bit checkpoint's own K-group replaces the format's (KT's RAWINT4 and
    /// GPTQ_INT4 load their checkpoints as stored).
    checkpoint_group: bool,
    /// KT's method name as given (MOE_INT8 and MOE_INT4 refuse KT's files for them).
    method: String,
    /// How weights quantized at load choose their scales.
    scales: Scales,
    /// The wrapper's `gpu_experts_mask` (`[E]` bytes, nonzero = on the GPU), read at every
    /// forward; 0 = none.
    mask_ptr: usize,
    /// Whether a load leaves out the experts the mask puts on the GPU then
    /// (`KT_KERNEL_SKIP_GPU_EXPERTS=1`).
    skip_gpu_experts: bool,
    layer: Mutex<Option<Arc<MoeLayer>>>,
    /// Where `load_from_checkpoint` read the layer, for the layerwise prefill's GPU buffers.
    origin: Mutex<Option<Origin>>,
}

/// A checkpoint-loaded layer's source: the checkpoint, the layer index and the slot map.
type Origin = (Arc<WeightSource>, usize, Vec<usize>);

/// One layer's experts on the CPU.
#[pyclass(frozen, module = "kt_kernel.kt_kernel_ext")]
pub struct Moe {
    shared: Arc<Shared>,
}

/// Staging buffer addresses of one forward (the wrapper keeps them alive and in place).
#[derive(Clone, Copy)]
struct Staging {
    bsz: usize,
    input: usize,
    input_dtype: DType,
    ids: usize,
    weights: usize,
    output: usize,
    output_dtype: DType,
    /// A `[N, H]` buffer of the output's dtype added to the result (a previous layer's deferred
    /// experts), or 0.
    addend: usize,
}

#[pymethods]
impl Moe {
    /// A layer of `experts` experts, `top_k` per token, hidden `hidden`, intermediate
    /// `intermediate`, at most `max_tokens` per forward, in `method` (KT's method names), split
    /// into one NUMA part per sub-pool of `infer`. `mask_ptr` is the address of the `[E]` bool
    /// mask the wrapper owns (0 for none). `swiglu_limit`/`swiglu_alpha` select KT's clamped
    /// SwiGLU (0: plain). With `skip_gpu_experts` a load reads and packs only the experts the
    /// mask leaves on the CPU at that moment (KT keeps them all, for masks updated later).
    /// `scales` ("absmax" or "mse") chooses the scales of weights quantized at load.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (infer, experts, top_k, hidden, intermediate, max_tokens, method, mask_ptr, swiglu_limit = 0.0, swiglu_alpha = 0.0, skip_gpu_experts = false, scales = "absmax"))]
    fn new(
        infer: &CpuInfer,
        experts: usize,
        top_k: usize,
        hidden: usize,
        intermediate: usize,
        max_tokens: usize,
        method: &str,
        mask_ptr: usize,
        swiglu_limit: f32,
        swiglu_alpha: f32,
        skip_gpu_experts: bool,
        scales: &str,
    ) -> PyResult<Self> {
        // RAWINT4 and GPTQ_INT4 run as our K-group int4 in a 4-bit checkpoint's own group (its
        // nibbles and scales as stored), else in groups of 128; LLAMAFILE runs the GGUF file's
        // own types.
        let parsed = match method {
            "LLAMAFILE" => Some(None),
            _ => WeightFormat::parse(method).map(Some),
        };
        let format = parsed.ok_or_else(|| {
            KTNotImplementedError::new_err(format!(
                "method {method} has no CPU backend in this build yet; working methods: {}, LLAMAFILE",
                WeightFormat::NAMES
            ))
        })?;
        let glu = kt_core::swiglu::Glu::new(swiglu_limit, swiglu_alpha).ok_or_else(|| {
            value_error(format!(
                "swiglu_limit and swiglu_alpha must be finite and >= 0, got {swiglu_limit} and {swiglu_alpha}"
            ))
        })?;
        let cfg = MoeConfig {
            max_tokens,
            parts: infer.pool.subpools(),
            glu,
            ..MoeConfig::new(experts, top_k, hidden, intermediate)
        };
        match format {
            Some(f) => cfg.validate_for(f).map_err(value_error)?,
            None => cfg.validate().map_err(value_error)?,
        }
        let scales = Scales::parse(scales)
            .ok_or_else(|| value_error(format!("unknown scales {scales:?}; valid: {}", Scales::NAMES)))?;
        match format {
            Some(f) => scales.check(f).map_err(value_error)?,
            None if scales != Scales::Absmax => {
                return Err(value_error(format!(
                    "scales '{scales}' is not supported with method {method}: its GGUF types' quantizers pick their \
                     own scales (GGML types); use scales=\"absmax\""
                )))
            }
            None => {}
        }
        let id = next_layer_id();
        Ok(Moe {
            shared: Arc::new(Shared {
                id,
                cfg,
                format,
                checkpoint_group: WeightFormat::takes_checkpoint_group(method),
                method: method.to_string(),
                scales,
                mask_ptr,
                skip_gpu_experts,
                layer: Mutex::new(None),
                origin: Mutex::new(None),
            }),
        })
    }

    /// Quantize and pack experts from row-major arrays at these addresses: gate and up
    /// `[E, I, H]`, down `[E, H, I]`, all of `dtype`; slot `p` gets logical expert `map[p]`.
    /// Blocks (GIL released) until every expert is packed on the engine's pool.
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
        let dtype = DType::parse(dtype)?;
        let s = &self.shared;
        let Some(format) = s.format else {
            return Err(value_error(
                "LLAMAFILE runs GGUF files as they are: pass weight_path (a .gguf file or directory) and call \
                 load_weights(); to quantize tensors use a method such as AMXINT8 or q4_k",
            ));
        };
        let (e, h, i) = (s.cfg.experts, s.cfg.hidden, s.cfg.intermediate);
        let map = checked_map(&map, e)?;
        let opts = LayerOptions { scales: s.scales, ..infer.layer_options() };
        let on_gpu = s.left_out();
        let slots = Slots { map: Some(&map), gpu: on_gpu.as_deref() };
        let layer = py.detach(|| {
            MoeLayer::from_f32(
                &s.cfg,
                format,
                // SAFETY: the wrapper checked shapes, dtypes and contiguity of the three arrays
                // and keeps them alive for this call.
                |slot| {
                    slots.expert(slot).map(|logical| unsafe { array_expert(dtype, [gate, up, down], logical, h, i) })
                },
                &opts,
            )
        });
        let layer = layer.map_err(value_error)?;
        *s.layer.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(layer));
        *s.origin.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    /// Load layer `layer` from the checkpoint at `path` (a directory or one file): KT's
    /// converted INT8/INT4 format (made for this many NUMA parts), or a Hugging Face safetensors
    /// checkpoint (layout and dtype detected) quantized to this layer's method. Slot `p` gets
    /// logical expert `map[p]`. Blocks, GIL released.
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
        let opts = LayerOptions { scales: s.scales, ..infer.layer_options() };
        let on_gpu = s.left_out();
        let loaded = py.detach(|| -> Result<(MoeLayer, Arc<WeightSource>), WeightError> {
            // Every expert is packed (as KT) unless asked otherwise: SGLang's dynamic expert
            // update moves experts between GPU and CPU by updating the mask in place.
            let slots = Slots { map: Some(&map), gpu: on_gpu.as_deref() };
            let src = source(&path)?;
            src.check_kt_kernel_layout(&s.method)?;
            let format = s.format.map(|f| src.layer_format(layer, f, s.checkpoint_group));
            Ok((src.load_layer(layer, format, &s.cfg, slots, &opts)?, src))
        });
        let (l, src) = loaded.map_err(value_error)?;
        *s.layer.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(l));
        *s.origin.lock().unwrap_or_else(|e| e.into_inner()) = Some((src, layer, map));
        Ok(())
    }

    /// Write slot `expert`'s weights for SGLang's layerwise prefill into one set of host
    /// buffers per GPU tensor-parallel rank (addresses; `kt_host::weights::gpu_buffer` gives the
    /// layout), read from the checkpoint `load_from_checkpoint` loaded, on `infer`'s threads.
    /// Returns the encoding written (`Bf16`, `Fp8Block`, `Fp8Row`, `Int4 { group: g }`, ...).
    /// Blocks, GIL released.
    #[allow(clippy::too_many_arguments)]
    fn write_gpu_expert(
        &self,
        py: Python<'_>,
        infer: &CpuInfer,
        expert: usize,
        w13: Vec<usize>,
        w13_scale: Vec<usize>,
        w2: Vec<usize>,
        w2_scale: Vec<usize>,
    ) -> PyResult<String> {
        use kt_host::weights::gpu_buffer::{write_expert, RankBuffers};
        let s = &self.shared;
        let origin = s.origin.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some((src, layer, map)) = origin else {
            return Err(KTRuntimeError::new_err(
                "layerwise prefill writes experts from the checkpoint: load this layer with load_weights() from a \
                 Hugging Face safetensors checkpoint first",
            ));
        };
        let WeightSource::Hf(ck) = &*src else {
            return Err(KTNotImplementedError::new_err(format!(
                "layerwise prefill needs a Hugging Face safetensors checkpoint (the GPU layer's own weights); {} is \
                 not one",
                src.path().display()
            )));
        };
        let tp = w13.len();
        if tp == 0 || [w13_scale.len(), w2.len(), w2_scale.len()] != [tp; 3] || w13.iter().chain(&w2).any(|&p| p == 0) {
            return Err(value_error(format!(
                "expected one non-null w13 and w2 buffer address per GPU rank and as many scale addresses, got {}, {}, \
                 {}, {}",
                w13.len(),
                w13_scale.len(),
                w2.len(),
                w2_scale.len()
            )));
        }
        let logical = *map
            .get(expert)
            .ok_or_else(|| value_error(format!("expert_id {expert} is not a slot in [0, {})", s.cfg.experts)))?;
        let ranks: Vec<RankBuffers> = (0..tp)
            .map(|r| RankBuffers { w13: w13[r], w13_scale: w13_scale[r], w2: w2[r], w2_scale: w2_scale[r] })
            .collect();
        let (h, i) = (s.cfg.hidden, s.cfg.intermediate);
        // SAFETY: SGLang's (and the tests') buffers hold one expert each in the GPU layer's
        // layout for this many ranks, which the wrapper documents and the caller sizes.
        let pool = &*infer.pool;
        let enc = py.detach(|| unsafe { write_expert(ck, (layer, logical), (h, i), &ranks, pool) });
        Ok(format!("{:?}", enc.map_err(value_error)?))
    }

    /// Queue a forward over the staging buffers at these addresses (`bsz`: int32 token count,
    /// read when the task runs; `ids` int64 and `weights` float32 `[N, k]`; `input`/`output`
    /// `[N, H]` of their dtypes). `addend` (0 = none) is a `[N, H]` buffer of the output dtype
    /// added to the result: a previous layer's deferred experts. Returns the task's ticket for
    /// `CpuInfer.sync_until`; with a non-zero `stream` the task is queued by a host function on
    /// that CUDA stream and there is none.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (infer, stream, bsz, input, input_dtype, ids, weights, output, output_dtype, addend = 0))]
    fn submit_forward(
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
        addend: usize,
    ) -> PyResult<Option<u64>> {
        if self.shared.layer.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            return Err(KTRuntimeError::new_err("weights are not loaded: call load_weights first"));
        }
        let st = Staging {
            bsz,
            input,
            input_dtype: DType::parse(input_dtype)?,
            ids,
            weights,
            output,
            output_dtype: DType::parse(output_dtype)?,
            addend,
        };
        let shared = self.shared.clone();
        let key = Key::Forward {
            moe: shared.id,
            addrs: [st.bsz, st.input, st.ids, st.weights, st.output, st.addend],
            dtypes: [st.input_dtype as u8, st.output_dtype as u8],
        };
        infer.submit(stream, key, move || {
            let shared = shared.clone();
            Box::new(move || forward(&shared, st))
        })
    }

    /// Bytes of the packed experts this layer holds on the CPU (0 before a load).
    #[getter]
    fn bytes(&self) -> usize {
        self.shared.layer.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |l| l.bytes())
    }

    /// Whether weights are loaded.
    #[getter]
    fn loaded(&self) -> bool {
        self.shared.layer.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The backend running the layer (after loading).
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.shared.layer.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|l| l.backend().name())
    }
}

/// Expert `l` of row-major arrays at these addresses (gate and up `[E, I, H]`, down `[E, H, I]`,
/// of `dtype`) as f32.
///
/// # Safety
/// The addresses hold arrays of those shapes (`E > l`) and type.
pub(crate) unsafe fn array_expert(
    dtype: DType,
    [gate, up, down]: [usize; 3],
    l: usize,
    h: usize,
    i: usize,
) -> [Vec<f32>; 3] {
    let at = |base: usize| base + l * i * h * dtype.size();
    // SAFETY: the caller's contract.
    unsafe { [dtype.read(at(gate), i * h), dtype.read(at(up), i * h), dtype.read(at(down), h * i)] }
}

/// A process-unique id for a native layer (what its CUDA host functions are keyed by).
pub(crate) fn next_layer_id() -> u64 {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// The physical→logical expert map as indices, each checked to be an expert id.
pub(crate) fn checked_map(map: &[i64], e: usize) -> PyResult<Vec<usize>> {
    if map.len() != e {
        return Err(value_error(format!("physical_to_logical_map has {} entries, expected {e}", map.len())));
    }
    map.iter()
        .enumerate()
        .map(|(p, &l)| {
            usize::try_from(l).ok().filter(|&l| l < e).ok_or_else(|| {
                value_error(format!("physical_to_logical_map[{p}] = {l} is not an expert id in [0, {e})"))
            })
        })
        .collect()
}

/// The process's weights (KT keeps one loader per process): reopened only for a new path.
pub(crate) fn source(path: &std::path::Path) -> Result<Arc<WeightSource>, WeightError> {
    static OPEN: Mutex<Option<(std::path::PathBuf, Arc<WeightSource>)>> = Mutex::new(None);
    let mut slot = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, src)) = slot.as_ref().filter(|(p, _)| p == path) {
        return Ok(src.clone());
    }
    let src = Arc::new(WeightSource::open(path)?);
    *slot = Some((path.to_path_buf(), src.clone()));
    Ok(src)
}

/// The `[E]` bool mask at `ptr` as it is now (nonzero bytes: on the GPU), `None` for 0.
///
/// # Safety
/// A nonzero `ptr` addresses `experts` readable bytes.
pub(crate) unsafe fn mask_at(ptr: usize, experts: usize) -> Option<Vec<bool>> {
    // SAFETY: per the contract above.
    (ptr != 0)
        .then(|| unsafe { std::slice::from_raw_parts(ptr as *const u8, experts) }.iter().map(|&b| b != 0).collect())
}

impl Shared {
    /// The wrapper's mask as it is now, `None` without one.
    fn mask(&self) -> Option<Vec<bool>> {
        // SAFETY: the wrapper owns the `[E]` mask at `mask_ptr` for the layer's life.
        unsafe { mask_at(self.mask_ptr, self.cfg.experts) }
    }

    /// The slots a load leaves out: those on the GPU now, where `skip_gpu_experts`.
    fn left_out(&self) -> Option<Vec<bool>> {
        self.mask().filter(|_| self.skip_gpu_experts)
    }
}

/// The body of a forward task.
fn forward(s: &Shared, st: Staging) -> Result<(), String> {
    let layer = s.layer.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or("weights are not loaded")?;
    let (h, k) = (s.cfg.hidden, s.cfg.top_k);
    // SAFETY (all reads and writes below): the wrapper's staging buffers hold at least
    // max_tokens rows, stay alive and are not touched by Python until the matching sync.
    let n = unsafe { *(st.bsz as *const i32) };
    if n < 0 || n as usize > s.cfg.max_tokens {
        return Err(format!("{n} tokens in one forward; chunked_prefill_size allows at most {}", s.cfg.max_tokens));
    }
    let n = n as usize;
    let input = unsafe { st.input_dtype.bf16s(st.input, n * h) };
    let ids = unsafe { std::slice::from_raw_parts(st.ids as *const i64, n * k) };
    let weights = unsafe { std::slice::from_raw_parts(st.weights as *const f32, n * k) };
    let mask = s.mask();
    // The output buffer is the wrapper's own, apart from every buffer read here.
    let mut spare = Vec::new();
    let out = unsafe { st.output_dtype.results(st.output, n * h, &mut spare) };
    layer.forward_into(&input, ids, weights, mask.as_deref(), out).map_err(|err| match err {
        kt_core::Error::ExpertNotLoaded { expert } if s.skip_gpu_experts => format!(
            "slot {expert} is routed to the CPU (gpu_experts_mask is false for it) but was on the GPU when this layer \
             was loaded, and KT_KERNEL_SKIP_GPU_EXPERTS=1 left it out of CPU memory: unset it to update the mask in \
             place (--kt-enable-dynamic-expert-update)"
        ),
        err => err.to_string(),
    })?;
    // The addend (another buffer of the wrapper's) is added in f32 and rounded once, to the
    // output's dtype.
    match (st.output_dtype, st.addend) {
        (DType::Bf16, 0) => {}
        (DType::Bf16, at) => {
            let prev = unsafe { std::slice::from_raw_parts(at as *const bf16, n * h) };
            out.iter_mut().zip(prev).for_each(|(o, p)| *o = bf16::from_f32(o.to_f32() + p.to_f32()));
        }
        (d, at) => {
            let mut v: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
            if at != 0 {
                v.iter_mut().zip(unsafe { d.read(at, n * h) }).for_each(|(a, b)| *a += b);
            }
            unsafe { d.write(st.output, &v) };
        }
    }
    Ok(())
}
