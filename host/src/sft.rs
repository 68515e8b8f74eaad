//! `SftLayer`: one MoE layer for LoRA fine-tuning ([`kt_core::sft`]): the inference layer's
//! packed experts, their transposes for the backward, and a stack of saved forwards (KT's
//! `max_cache_depth`) that each backward pops.

use std::sync::Mutex;

use half::bf16;
use kt_core::forward::{dequantized_expert_f32, ExpertF32};
use kt_core::sft::{self, Backward, BackwardWeights, Cache, Lora};
use kt_core::{Backend, Error, LayerFormat, MoeConfig, PackedMatrix, Routing, WeightFormat};

use crate::layer::{LayerOptions, MoeLayer};
use crate::weights::{kt_format, slot_reader, Checkpoint, Slots, WeightError};

/// An expert's packed transposes, or why they are not (`None`: not on the CPU).
type Transposes<E> = Option<Result<[PackedMatrix; 3], E>>;

/// One layer's experts with what an SFT step needs.
pub struct SftLayer {
    base: MoeLayer,
    back: BackwardWeights,
    max_cache_depth: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    ws: sft::Workspace,
    /// Saved forwards, newest last.
    saved: Vec<Cache>,
    /// The cache of forwards not saved, reused.
    spare: Cache,
}

impl std::fmt::Debug for SftLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SftLayer({:?}, max_cache_depth {})", self.base, self.max_cache_depth)
    }
}

/// A saved-forward stack holds at least one.
fn check_depth(max_cache_depth: usize) -> Result<(), Error> {
    match max_cache_depth {
        0 => Err(Error::InvalidConfig { field: "max_cache_depth", value: 0, expected: "at least 1".into() }),
        _ => Ok(()),
    }
}

impl SftLayer {
    /// As [`MoeLayer::from_f32`], with the transposes the backward multiplies by (from the
    /// weights as each part quantized them, so it differentiates the function the forward
    /// computes), keeping up
    /// to `max_cache_depth` saved forwards. The forward runs the layer's NUMA parts (`cfg.parts`)
    /// as the inference forward sums them; the transposes are whole matrices.
    pub fn from_f32(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Option<[Vec<f32>; 3]> + Sync,
        opts: &LayerOptions,
        max_cache_depth: usize,
    ) -> Result<Self, Error> {
        Self::try_from_f32(cfg, format, |e| Ok(expert(e)), opts, max_cache_depth)
    }

    /// [`SftLayer::from_f32`] with a fallible reader (its error type, or the layer's converted
    /// into it). Each expert is read twice: for the inference weights, then for the transposes.
    pub fn try_from_f32<E: From<Error> + Send>(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Result<Option<[Vec<f32>; 3]>, E> + Sync,
        opts: &LayerOptions,
        max_cache_depth: usize,
    ) -> Result<Self, E> {
        check_depth(max_cache_depth)?;
        let base = MoeLayer::try_from_f32(cfg, format, &expert, opts)?;
        let dequantized = |e: usize| -> Result<Option<[Vec<f32>; 3]>, E> {
            let Some([g, u, d]) = expert(e)? else { return Ok(None) };
            Ok(Some(dequantized_expert_f32(cfg, format, ExpertF32 { gate: &g, up: &u, down: &d })?))
        };
        Self::with_transposes(base, dequantized, opts, max_cache_depth)
    }

    /// `base` with the transposes of what its forward multiplies by (`dequantized(slot)`: the
    /// slot's gate, up and down as f32, or `None` for a slot not on the CPU).
    fn with_transposes<E: From<Error> + Send>(
        base: MoeLayer,
        dequantized: impl Fn(usize) -> Result<Option<[Vec<f32>; 3]>, E> + Sync,
        opts: &LayerOptions,
        max_cache_depth: usize,
    ) -> Result<Self, E> {
        let (cfg, backend) = (base.config().clone(), base.backend());
        let bf = BackwardWeights::format_for(backend, &cfg)?;
        let packed: Mutex<Vec<Transposes<E>>> = Mutex::new((0..cfg.experts).map(|_| None).collect());
        opts.executor.parallel_for(cfg.experts, &|e, _| {
            let t = dequantized(e).and_then(|x| {
                let Some([g, u, d]) = x else { return Ok(None) };
                Ok(Some(BackwardWeights::pack(backend, &cfg, bf, [&g, &u, &d]).map_err(E::from)?))
            });
            packed.lock().unwrap_or_else(|e| e.into_inner())[e] = t.transpose();
        });
        let mut back = BackwardWeights::new(cfg.experts);
        for (e, p) in packed.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().enumerate() {
            back.set(e, p.transpose()?)?;
        }
        Ok(SftLayer { base, back, max_cache_depth, state: Mutex::default() })
    }

    /// Layer `layer` of a Hugging Face safetensors checkpoint (any expert layout and dtype the
    /// inference loader reads) in `format`, slot `p` holding `slots`' expert.
    pub fn from_checkpoint(
        ck: &Checkpoint,
        layer: usize,
        format: WeightFormat,
        cfg: &MoeConfig,
        slots: Slots<'_>,
        opts: &LayerOptions,
        max_cache_depth: usize,
    ) -> Result<Self, WeightError> {
        Self::try_from_f32(cfg, format, slot_reader(ck, layer, cfg, slots)?, opts, max_cache_depth)
    }

    /// Layer `layer` of a `kt convert` (or KT-converted) checkpoint in `format`, made for
    /// `cfg.parts` NUMA parts (KT's AMXINT8_SFT / AMXINT4_SFT files): the packed experts as
    /// inference loads them, the transposes from their dequantized parts.
    pub fn from_converted(
        ck: &Checkpoint,
        layer: usize,
        format: WeightFormat,
        cfg: &MoeConfig,
        slots: Slots<'_>,
        opts: &LayerOptions,
        max_cache_depth: usize,
    ) -> Result<Self, WeightError> {
        check_depth(max_cache_depth)?;
        let base = kt_format::load_kt_layer(ck, layer, format, cfg, slots, opts)?;
        let dequantized = |slot: usize| match slots.expert(slot) {
            Some(e) => kt_format::dequantized_expert(ck, layer, format, cfg, e).map(Some),
            None => Ok(None),
        };
        Self::with_transposes(base, dequantized, opts, max_cache_depth)
    }

    /// The layer's shape.
    pub fn config(&self) -> &MoeConfig {
        self.base.config()
    }

    /// The backend running it.
    pub fn backend(&self) -> &'static dyn Backend {
        self.base.backend()
    }

    /// The formats of its weights.
    pub fn format(&self) -> LayerFormat {
        self.base.format()
    }

    /// Bytes of the packed weights: the inference experts and their transposes.
    pub fn bytes(&self) -> usize {
        self.base.bytes() + self.back.bytes()
    }

    /// Forwards saved and not yet backwarded.
    pub fn cache_depth(&self) -> usize {
        self.lock().saved.len()
    }

    /// Bytes the saved forwards hold.
    pub fn cache_bytes(&self) -> usize {
        self.lock().saved.iter().map(Cache::bytes).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `out[n,H]` (as [`MoeLayer::forward`], with `lora` on every projection; `None`: the base
    /// alone) for `routing`, saving what the backward needs when `save_for_backward`.
    pub fn forward(
        &self,
        input: &[bf16],
        routing: &Routing<'_>,
        lora: Option<&Lora<'_>>,
        save_for_backward: bool,
        out: &mut [bf16],
    ) -> Result<(), Error> {
        let cfg = self.config();
        let mut st = self.lock();
        if save_for_backward && st.saved.len() >= self.max_cache_depth {
            return Err(Error::CacheFull { depth: self.max_cache_depth });
        }
        let State { ws, spare, .. } = &mut *st;
        let w = self.base.weights();
        sft::forward(&**self.base.executor(), cfg, w, lora, input, routing, out, spare, ws)?;
        if save_for_backward {
            let cache = std::mem::take(&mut st.spare);
            st.saved.push(cache);
        }
        Ok(())
    }

    /// The backward of the newest saved forward (which it pops), with the `lora` that forward
    /// ran with: `out`'s input and weight gradients written, its LoRA gradients (if any) added
    /// to.
    pub fn backward(&self, grad_output: &[bf16], lora: Option<&Lora<'_>>, out: Backward<'_>) -> Result<(), Error> {
        let mut st = self.lock();
        let cache = st.saved.last().ok_or(Error::NoForwardCache)?;
        if grad_output.len() != cache.tokens() * self.config().hidden {
            return Err(Error::ShapeMismatch {
                what: "grad_output (the saved forward's tokens × hidden)",
                expected: cache.tokens() * self.config().hidden,
                found: grad_output.len(),
            });
        }
        let State { ws, saved, spare } = &mut *st;
        let cache = saved.last().expect("checked above");
        let (cfg, w) = (self.config(), self.base.weights());
        sft::backward(&**self.base.executor(), cfg, w, &self.back, lora, cache, grad_output, out, ws)?;
        // The popped cache's buffers serve the next unsaved forward.
        *spare = saved.pop().expect("checked above");
        Ok(())
    }

    /// Drop every saved forward.
    pub fn clear_cache(&self) {
        self.lock().saved.clear();
    }
}
