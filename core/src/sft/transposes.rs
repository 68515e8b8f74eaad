//! The base weights transposed for the backward's products (KT's `ffn_*_bwd_exps`), packed
//! once when the layer loads.

use alloc::format;
use alloc::vec::Vec;
use core::ops::Range;

use crate::{Backend, Error, LayerFormat, MoeConfig, PackedMatrix, QuantMatrix, WeightFormat};

/// What the transposes are packed in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransposeFormat {
    /// bf16 copies of the forward's dequantized weights, whole: the backward differentiates
    /// what the forward computes, to bf16 precision, at 2 bytes a weight.
    #[default]
    Bf16,
    /// The layer's own format, per NUMA part (KT's): `W_gᵀ`, `W_uᵀ` of each part `[H, I_p]`,
    /// `W_dᵀ` `[I_p, H]`, quantized again across the other axis (from the original weights,
    /// as KT's converter does). An int4 layer's transposes take a quarter of bf16's memory;
    /// the gradients carry that second quantization's error.
    Layer,
}

/// Per expert and slice of I, `W_gᵀ`, `W_uᵀ` (`[H, I_s]`) and `W_dᵀ` (`[I_s, H]`), packed by
/// the layer's backend.
#[derive(Debug)]
pub struct BackwardWeights {
    /// The slices of I: all of it for bf16, the layer's parts for its own format.
    pub(crate) ranges: Vec<Range<usize>>,
    pub(crate) experts: Vec<Option<Vec<[PackedMatrix; 3]>>>,
}

impl BackwardWeights {
    /// No expert yet, for a layer of `experts` whose transposes are cut in `ranges` of I
    /// ([`BackwardWeights::layout`]).
    pub fn new(experts: usize, ranges: Vec<Range<usize>>) -> Self {
        BackwardWeights { ranges, experts: (0..experts).map(|_| None).collect() }
    }

    /// The format and slices of I of `kind` transposes of a layer of `cfg` in `layer` formats
    /// on `backend`: bf16 (KT's `Bf16`, or GGML's for the GGML backend) whole, or the layer's
    /// format by its parts, each checked to run on `backend`.
    pub fn layout(
        backend: &dyn Backend,
        cfg: &MoeConfig,
        layer: LayerFormat,
        kind: TransposeFormat,
    ) -> Result<(WeightFormat, Vec<Range<usize>>), Error> {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let (format, ranges) = match kind {
            TransposeFormat::Bf16 => {
                let ggml = WeightFormat::Ggml(crate::ggml::GgmlType::BF16);
                let f = [WeightFormat::Bf16, ggml]
                    .into_iter()
                    .find(|&f| backend.serves(f, h, i) && backend.serves(f, i, h));
                let context = "by this backend for the SFT backward";
                (f.ok_or(Error::UnsupportedFormat { format: WeightFormat::Bf16, context })?, alloc::vec![0..i])
            }
            TransposeFormat::Layer if layer.gate != layer.up || layer.gate != layer.down => {
                return Err(Error::InvalidConfig {
                    field: "transposes in the layer's format",
                    value: 0,
                    expected: format!("one format for gate, up and down, not {layer}"),
                })
            }
            TransposeFormat::Layer => (layer.gate, cfg.part_ranges(layer)?),
        };
        if ranges.iter().any(|r| !backend.serves(format, h, r.len()) || !backend.serves(format, r.len(), h)) {
            let context = "by this backend for the SFT backward's transposes ([H, I_p] and [I_p, H])";
            return Err(Error::UnsupportedFormat { format, context });
        }
        Ok((format, ranges))
    }

    /// An expert's transposes from its f32 matrices (gate and up `[I, H]`, down `[H, I]`),
    /// quantized to `format`, a set per slice of `ranges`, packed by `backend`.
    pub fn pack(
        backend: &dyn Backend,
        cfg: &MoeConfig,
        layout: (WeightFormat, &[Range<usize>]),
        expert: [&[f32]; 3],
    ) -> Result<Vec<[PackedMatrix; 3]>, Error> {
        Self::quantize(cfg, layout, expert)?
            .iter()
            .map(|[g, u, d]| Ok([backend.pack(g)?, backend.pack(u)?, backend.pack(d)?]))
            .collect()
    }

    /// [`BackwardWeights::pack`]'s matrices before packing.
    pub fn quantize(
        cfg: &MoeConfig,
        (format, ranges): (WeightFormat, &[Range<usize>]),
        [gate, up, down]: [&[f32]; 3],
    ) -> Result<Vec<[QuantMatrix; 3]>, Error> {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        for (what, m) in [("gate_proj", gate), ("up_proj", up), ("down_proj", down)] {
            if m.len() != h * i {
                return Err(Error::ShapeMismatch { what, expected: h * i, found: m.len() });
            }
        }
        let quantize = |rows: usize, cols: usize, at: &dyn Fn(usize, usize) -> f32| {
            let t: Vec<f32> = (0..rows * cols).map(|x| at(x / cols, x % cols)).collect();
            QuantMatrix::quantize(format, rows, cols, &t)
        };
        ranges
            .iter()
            .map(|r| {
                let (s, ip) = (r.start, r.len());
                Ok([
                    quantize(h, ip, &|row, c| gate[(s + c) * h + row])?,
                    quantize(h, ip, &|row, c| up[(s + c) * h + row])?,
                    quantize(ip, h, &|row, c| down[c * i + s + row])?,
                ])
            })
            .collect()
    }

    /// Install expert `e`'s transposes, a set per slice (`None`: not on the CPU).
    pub fn set(&mut self, e: usize, packed: Option<Vec<[PackedMatrix; 3]>>) -> Result<(), Error> {
        let n = self.experts.len();
        let (slices, ranges) = (packed.as_ref().map_or(self.ranges.len(), Vec::len), &self.ranges);
        if slices != ranges.len() {
            return Err(Error::ShapeMismatch {
                what: "slices of an expert's transposes",
                expected: ranges.len(),
                found: slices,
            });
        }
        for (r, [g, u, d]) in ranges.iter().zip(packed.iter().flatten()) {
            let found = [(g.rows(), g.cols()), (u.rows(), u.cols()), (d.rows(), d.cols())];
            let h = g.rows();
            if found != [(h, r.len()), (h, r.len()), (r.len(), h)] {
                return Err(Error::ShapeMismatch {
                    what: "an expert's transposes (rows × cols)",
                    expected: r.len(),
                    found: d.rows(),
                });
            }
        }
        let slot = self.experts.get_mut(e).ok_or_else(|| Error::InvalidConfig {
            field: "expert",
            value: e,
            expected: format!("below experts = {n}"),
        })?;
        *slot = packed;
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.experts.iter().flatten().flatten().flat_map(|m| m.iter()).map(PackedMatrix::bytes).sum()
    }

    /// The format the transposes are packed in (`None` with none loaded).
    pub fn format(&self) -> Option<WeightFormat> {
        self.experts.iter().flatten().flatten().flat_map(|m| m.iter()).map(PackedMatrix::format).next()
    }
}
