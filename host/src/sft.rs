//! `SftLayer`: one MoE layer for LoRA fine-tuning ([`kt_core::sft`]): the inference layer's
//! packed experts, their transposes for the backward, and a stack of saved forwards (KT's
//! `max_cache_depth`) that each backward pops.

use std::sync::Mutex;

use half::bf16;
use kt_core::forward::{dequantized_expert_f32, ExpertF32};
use kt_core::sft::{self, Backward, BackwardWeights, Cache, Lora, TransposeFormat};
use kt_core::{Backend, Error, LayerFormat, MoeConfig, PackedMatrix, QuantMatrix, Routing, WeightFormat};

use crate::layer::{LayerOptions, MoeLayer, PartMatrix};
use crate::scratch::{self, Scratch};
use crate::weights::{kt_format, slot_reader, stored_reader, Checkpoint, Layout, Slots, WeightError};

/// An expert's packed transposes (a set per slice of I), or why they are not (`None`: not on
/// the CPU).
type Transposes<E> = Option<Result<Vec<[PackedMatrix; 3]>, E>>;

/// What an expert's transposes are made from.
enum TransposeSource<'c> {
    /// Its matrices (gate and up `[I, H]`, down `[H, I]`), transposed and quantized at load.
    Values([Vec<f32>; 3]),
    /// Transposes a converted file holds, a set per part.
    Converted(Vec<[PartMatrix<'c>; 3]>),
}

/// How an SFT layer is built, besides its weights.
#[derive(Clone, Copy, Debug)]
pub struct SftOptions {
    /// Saved forwards the stack holds (KT's `max_cache_depth`, at least 1).
    pub max_cache_depth: usize,
    /// What the backward's transposes are packed in.
    pub transposes: TransposeFormat,
}

impl Default for SftOptions {
    fn default() -> Self {
        SftOptions { max_cache_depth: 1, transposes: TransposeFormat::Bf16 }
    }
}

impl SftOptions {
    /// A stack of `max_cache_depth`, bf16 transposes.
    pub fn depth(max_cache_depth: usize) -> Self {
        SftOptions { max_cache_depth, ..Self::default() }
    }
}

/// One layer's experts with what an SFT step needs.
pub struct SftLayer {
    base: MoeLayer,
    back: BackwardWeights,
    max_cache_depth: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Saved forwards, newest last.
    saved: Vec<Cache>,
    /// The last popped one, whose buffers the next saved forward fills (a forward not saved
    /// fills the shared scratch's, [`Scratch::unsaved`]).
    recycled: Cache,
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
    /// As [`MoeLayer::from_f32`], with the transposes the backward multiplies by (in bf16,
    /// from the weights as each part quantized them, so it differentiates the function the
    /// forward computes; in the layer's format, from `expert`'s values, as KT), keeping up to
    /// `sft.max_cache_depth` saved forwards. The forward runs the layer's NUMA parts
    /// (`cfg.parts`) as the inference forward sums them.
    pub fn from_f32(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Option<[Vec<f32>; 3]> + Sync,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, Error> {
        Self::try_from_f32(cfg, format, |e| Ok(expert(e)), opts, sft)
    }

    /// [`SftLayer::from_f32`] with a fallible reader (its error type, or the layer's converted
    /// into it). Each expert is read twice: for the inference weights, then for the transposes.
    pub fn try_from_f32<E: From<Error> + Send>(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Result<Option<[Vec<f32>; 3]>, E> + Sync,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, E> {
        check_depth(sft.max_cache_depth)?;
        let base = MoeLayer::try_from_f32(cfg, format, &expert, opts)?;
        let source = |e: usize| -> Result<Option<TransposeSource<'static>>, E> {
            let Some([g, u, d]) = expert(e)? else { return Ok(None) };
            Ok(Some(TransposeSource::Values(match sft.transposes {
                TransposeFormat::Bf16 => dequantized_expert_f32(cfg, format, ExpertF32 { gate: &g, up: &u, down: &d })?,
                TransposeFormat::Layer => [g, u, d],
            })))
        };
        Self::with_transposes(base, source, opts, sft)
    }

    /// `base` with the transposes made from `source(slot)` (`None` for a slot not on the CPU).
    fn with_transposes<'c, E: From<Error> + Send>(
        base: MoeLayer,
        source: impl Fn(usize) -> Result<Option<TransposeSource<'c>>, E> + Sync,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, E> {
        let (cfg, backend) = (base.config().clone(), base.backend());
        let (format, ranges) = BackwardWeights::layout(backend, &cfg, base.format(), sft.transposes)?;
        let packed: Mutex<Vec<Transposes<E>>> = Mutex::new((0..cfg.experts).map(|_| None).collect());
        opts.executor.parallel_for(cfg.experts, &|e, _| {
            let t = source(e).and_then(|x| match x {
                None => Ok(None),
                Some(TransposeSource::Values([g, u, d])) => {
                    Ok(Some(BackwardWeights::pack(backend, &cfg, (format, &ranges), [&g, &u, &d])?))
                }
                Some(TransposeSource::Converted(parts)) => {
                    let pack =
                        |[g, u, d]: [PartMatrix<'_>; 3]| Ok([g.pack(backend)?, u.pack(backend)?, d.pack(backend)?]);
                    Ok(Some(parts.into_iter().map(pack).collect::<Result<Vec<_>, Error>>()?))
                }
            });
            packed.lock().unwrap_or_else(|e| e.into_inner())[e] = t.transpose();
        });
        let mut back = BackwardWeights::new(cfg.experts, ranges);
        for (e, p) in packed.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().enumerate() {
            back.set(e, p.transpose()?)?;
        }
        let max_cache_depth = sft.max_cache_depth;
        Ok(SftLayer { base, back, max_cache_depth, state: Mutex::default() })
    }

    /// Already-quantized experts (a checkpoint's own int4 groups, loaded exactly): `expert(slot)`
    /// gives `(gate, up, down)` in `format` (`None` for a slot not on the CPU), called once per
    /// slot and NUMA part for the layer, then once more for the transposes (from the values).
    pub fn from_quantized(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Option<(QuantMatrix, QuantMatrix, QuantMatrix)> + Sync,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, Error> {
        Self::try_from_quantized(cfg, format, |slot| Ok(expert(slot)), opts, sft)
    }

    /// [`SftLayer::from_quantized`] with a fallible reader.
    pub fn try_from_quantized<E: From<Error> + Send>(
        cfg: &MoeConfig,
        format: WeightFormat,
        expert: impl Fn(usize) -> Result<Option<(QuantMatrix, QuantMatrix, QuantMatrix)>, E> + Sync,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, E> {
        check_depth(sft.max_cache_depth)?;
        let base = MoeLayer::try_from_quantized(cfg, &expert, format, opts)?;
        let source = |slot: usize| -> Result<Option<TransposeSource<'static>>, E> {
            Ok(expert(slot)?.map(|(g, u, d)| TransposeSource::Values([g.dequantize(), u.dequantize(), d.dequantize()])))
        };
        Self::with_transposes(base, source, opts, sft)
    }

    /// Layer `layer` of a Hugging Face safetensors checkpoint (any expert layout and dtype the
    /// inference loader reads) in `format` (a 4-bit checkpoint in its own K-group as stored),
    /// slot `p` holding `slots`' expert.
    pub fn from_checkpoint(
        ck: &Checkpoint,
        layer: usize,
        format: WeightFormat,
        cfg: &MoeConfig,
        slots: Slots<'_>,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, WeightError> {
        let layout = Layout::detect(ck, layer)?;
        if layout.has_biases(ck) {
            return Err(layout.biases_refused(ck, "SFT layers"));
        }
        match stored_reader(ck, layer, format, cfg, slots)? {
            Some(read) => Self::try_from_quantized(cfg, format, read, opts, sft),
            None => Self::try_from_f32(cfg, format, slot_reader(ck, layer, cfg, slots)?, opts, sft),
        }
    }

    /// Layer `layer` of a `kt convert` (or KT-converted) checkpoint in `format`, made for
    /// `cfg.parts` NUMA parts (KT's AMXINT8_SFT / AMXINT4_SFT files): the packed experts as
    /// inference loads them; transposes in the layer's format from the file's own (`kt convert
    /// --backward`, KT's `ffn_*_bwd_exps`) where it has them, else (and in bf16) from the
    /// dequantized parts.
    pub fn from_converted(
        ck: &Checkpoint,
        layer: usize,
        format: WeightFormat,
        cfg: &MoeConfig,
        slots: Slots<'_>,
        opts: &LayerOptions,
        sft: SftOptions,
    ) -> Result<Self, WeightError> {
        check_depth(sft.max_cache_depth)?;
        let base = kt_format::load_kt_layer(ck, layer, format, cfg, slots, opts)?;
        let from_file = sft.transposes == TransposeFormat::Layer && kt_format::has_backward(ck, layer);
        let source = |slot: usize| {
            let Some(e) = slots.expert(slot) else { return Ok(None) };
            Ok(Some(match from_file {
                true => TransposeSource::Converted(kt_format::backward_parts(ck, layer, format, cfg, e)?),
                false => TransposeSource::Values(kt_format::dequantized_expert(ck, layer, format, cfg, e)?),
            }))
        };
        Self::with_transposes(base, source, opts, sft)
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

    /// The format the backward's transposes are packed in (`None` with no expert loaded).
    pub fn transposes_format(&self) -> Option<WeightFormat> {
        self.back.format()
    }

    /// The scratch it shares with the layers built from the same options
    /// ([`LayerOptions::scratch`]).
    pub fn scratch(&self) -> &crate::scratch::SharedScratch {
        self.base.scratch()
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
        let (w, mut scratch) = (self.base.weights(), scratch::lock(self.base.scratch()));
        let Scratch { sft: ws, unsaved, .. } = &mut *scratch;
        let cache = if save_for_backward { &mut st.recycled } else { unsaved };
        sft::forward(&**self.base.executor(), cfg, w, lora, input, routing, out, cache, ws)?;
        if save_for_backward {
            let cache = std::mem::take(&mut st.recycled);
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
        let State { saved, recycled } = &mut *st;
        let cache = saved.last().expect("checked above");
        let (cfg, w) = (self.config(), self.base.weights());
        let mut scratch = scratch::lock(self.base.scratch());
        sft::backward(&**self.base.executor(), cfg, w, &self.back, lora, cache, grad_output, out, &mut scratch.sft)?;
        *recycled = saved.pop().expect("checked above");
        Ok(())
    }

    /// Drop every saved forward.
    pub fn clear_cache(&self) {
        self.lock().saved.clear();
    }
}
