//! The LoRA matrices, their gradients, and the base weights transposed for the backward.

use alloc::format;
use alloc::vec::Vec;

use half::bf16;

use crate::{Backend, Error, MoeConfig, PackedMatrix, QuantMatrix, WeightFormat};

/// A projection of an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Proj {
    Gate,
    Up,
    Down,
}

impl Proj {
    /// `(in, out)` widths.
    pub(crate) fn dims(self, cfg: &MoeConfig) -> (usize, usize) {
        match self {
            Proj::Gate | Proj::Up => (cfg.hidden, cfg.intermediate),
            Proj::Down => (cfg.intermediate, cfg.hidden),
        }
    }
}

/// The LoRA matrices of a layer's experts, row-major bf16, as SGLang's and KT's
/// `init_lora_weights` pass them: A `[E, r, in]`, B `[E, out, r]`.
#[derive(Clone, Copy, Debug)]
pub struct Lora<'a> {
    /// Rank r.
    pub rank: usize,
    /// `alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f32,
    /// `[E, r, H]`.
    pub gate_a: &'a [bf16],
    /// `[E, I, r]`.
    pub gate_b: &'a [bf16],
    /// `[E, r, H]`.
    pub up_a: &'a [bf16],
    /// `[E, I, r]`.
    pub up_b: &'a [bf16],
    /// `[E, r, I]`.
    pub down_a: &'a [bf16],
    /// `[E, H, r]`.
    pub down_b: &'a [bf16],
}

impl<'a> Lora<'a> {
    /// The update's scale, `alpha / rank`.
    pub fn scaling(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// Check the rank, alpha and every matrix's length against `cfg`.
    pub fn validate(&self, cfg: &MoeConfig) -> Result<(), Error> {
        if self.rank == 0 {
            return Err(Error::InvalidConfig { field: "lora_rank", value: 0, expected: "a positive rank".into() });
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::InvalidConfig {
                field: "lora_alpha",
                value: self.alpha as usize,
                expected: format!("a positive finite number (got {})", self.alpha),
            });
        }
        let [ga, gb, ua, ub, da, db] = lengths(cfg, self.rank);
        let check = |what, want: usize, found: usize| match want == found {
            true => Ok(()),
            false => Err(Error::ShapeMismatch { what, expected: want, found }),
        };
        check("gate_lora_a [E, r, H]", ga, self.gate_a.len())?;
        check("gate_lora_b [E, I, r]", gb, self.gate_b.len())?;
        check("up_lora_a [E, r, H]", ua, self.up_a.len())?;
        check("up_lora_b [E, I, r]", ub, self.up_b.len())?;
        check("down_lora_a [E, r, I]", da, self.down_a.len())?;
        check("down_lora_b [E, H, r]", db, self.down_b.len())
    }

    /// Expert `e`'s `(A [r, in], B [out, r])` of projection `p`.
    pub(crate) fn of(&self, p: Proj, e: usize, cfg: &MoeConfig) -> (&'a [bf16], &'a [bf16]) {
        let (din, dout) = p.dims(cfg);
        let r = self.rank;
        let (a, b) = match p {
            Proj::Gate => (self.gate_a, self.gate_b),
            Proj::Up => (self.up_a, self.up_b),
            Proj::Down => (self.down_a, self.down_b),
        };
        (&a[e * r * din..(e + 1) * r * din], &b[e * dout * r..(e + 1) * dout * r])
    }
}

/// Element counts of the six LoRA matrices of `cfg` at rank `r`, in [`Lora`]'s field order.
fn lengths(cfg: &MoeConfig, r: usize) -> [usize; 6] {
    let (e, h, i) = (cfg.experts, cfg.hidden, cfg.intermediate);
    [e * r * h, e * i * r, e * r * h, e * i * r, e * r * i, e * h * r]
}

/// Where the backward adds the LoRA matrices' gradients (`+=`, bf16 as KT keeps them), in
/// [`Lora`]'s shapes.
#[derive(Debug)]
pub struct LoraGrads<'a> {
    /// `[E, r, H]`.
    pub gate_a: &'a mut [bf16],
    /// `[E, I, r]`.
    pub gate_b: &'a mut [bf16],
    /// `[E, r, H]`.
    pub up_a: &'a mut [bf16],
    /// `[E, I, r]`.
    pub up_b: &'a mut [bf16],
    /// `[E, r, I]`.
    pub down_a: &'a mut [bf16],
    /// `[E, H, r]`.
    pub down_b: &'a mut [bf16],
}

impl LoraGrads<'_> {
    /// Check every gradient's length against `cfg` at rank `r`.
    pub fn validate(&self, cfg: &MoeConfig, r: usize) -> Result<(), Error> {
        let found = [self.gate_a.len(), self.gate_b.len(), self.up_a.len(), self.up_b.len()];
        let found = [found[0], found[1], found[2], found[3], self.down_a.len(), self.down_b.len()];
        let names = ["grad_gate_lora_a", "grad_gate_lora_b", "grad_up_lora_a", "grad_up_lora_b"];
        let names = [names[0], names[1], names[2], names[3], "grad_down_lora_a", "grad_down_lora_b"];
        for ((want, found), what) in lengths(cfg, r).into_iter().zip(found).zip(names) {
            if want != found {
                return Err(Error::ShapeMismatch { what, expected: want, found });
            }
        }
        Ok(())
    }
}

/// The base weights transposed and packed by the layer's backend in the layer's formats, for
/// the backward's products (KT's `ffn_*_bwd_exps`): per expert `W_gᵀ`, `W_uᵀ` `[H, I]` and
/// `W_dᵀ` `[I, H]`. Quantized formats are quantized again from the transposed values, as
/// KT's converter does.
#[derive(Debug)]
pub struct BackwardWeights {
    pub(crate) experts: Vec<Option<[PackedMatrix; 3]>>,
}

impl BackwardWeights {
    /// No expert yet, for a layer of `experts`.
    pub fn new(experts: usize) -> Self {
        BackwardWeights { experts: (0..experts).map(|_| None).collect() }
    }

    /// An expert's transposes from its f32 matrices (gate and up `[I, H]`, down `[H, I]`),
    /// packed by `backend` in `format` ([`BackwardWeights::format_for`]).
    pub fn pack(
        backend: &dyn Backend,
        cfg: &MoeConfig,
        format: WeightFormat,
        [gate, up, down]: [&[f32]; 3],
    ) -> Result<[PackedMatrix; 3], Error> {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let pack = |src: &[f32], rows: usize, cols: usize, what| {
            if src.len() != rows * cols {
                return Err(Error::ShapeMismatch { what, expected: rows * cols, found: src.len() });
            }
            // The transpose of a `cols × rows` matrix.
            let t: Vec<f32> = (0..rows * cols).map(|at| src[(at % cols) * rows + at / cols]).collect();
            backend.pack(&QuantMatrix::quantize(format, rows, cols, &t)?)
        };
        Ok([pack(gate, h, i, "gate_proj")?, pack(up, h, i, "up_proj")?, pack(down, i, h, "down_proj")?])
    }

    /// Install expert `e`'s transposes (`None`: not on the CPU).
    pub fn set(&mut self, e: usize, packed: Option<[PackedMatrix; 3]>) -> Result<(), Error> {
        let n = self.experts.len();
        let slot = self.experts.get_mut(e).ok_or_else(|| Error::InvalidConfig {
            field: "expert",
            value: e,
            expected: format!("below experts = {n}"),
        })?;
        *slot = packed;
        Ok(())
    }

    /// The format the transposes are packed in on `backend`: bf16 (KT's `Bf16`, or GGML's
    /// for the GGML backend), whatever the layer's own, so the backward multiplies by the
    /// forward's dequantized weights to bf16 precision instead of quantizing them a second way
    /// (a 4-bit base quantized again across its other axis would add its whole error again).
    pub fn format_for(backend: &dyn Backend, cfg: &MoeConfig) -> Result<WeightFormat, Error> {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let ggml = WeightFormat::Ggml(crate::ggml::GgmlType::BF16);
        [WeightFormat::Bf16, ggml].into_iter().find(|&f| backend.serves(f, h, i) && backend.serves(f, i, h)).ok_or(
            Error::UnsupportedFormat { format: WeightFormat::Bf16, context: "by this backend for the SFT backward" },
        )
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.experts.iter().flatten().flat_map(|m| m.iter()).map(PackedMatrix::bytes).sum()
    }
}

/// Six LoRA matrices in [`Lora`]'s order, owned.
pub type LoraMats = [Vec<bf16>; 6];

/// Random LoRA matrices of rank `r` (std 0.1; B zero when `zero_b`).
pub fn random_lora(cfg: &MoeConfig, r: usize, zero_b: bool, seed: u64) -> LoraMats {
    let (e, h, i) = (cfg.experts, cfg.hidden, cfg.intermediate);
    let mut rng = crate::rng::SplitMix64::new(seed);
    let mut m = |len: usize, zero: bool| -> Vec<bf16> {
        (0..len).map(|_| bf16::from_f32(if zero { 0.0 } else { 0.1 * rng.gaussian() })).collect()
    };
    [
        m(e * r * h, false),
        m(e * i * r, zero_b),
        m(e * r * h, false),
        m(e * i * r, zero_b),
        m(e * r * i, false),
        m(e * h * r, zero_b),
    ]
}

/// [`Lora`] over owned matrices.
pub fn lora_of(m: &LoraMats, rank: usize, alpha: f32) -> Lora<'_> {
    Lora { rank, alpha, gate_a: &m[0], gate_b: &m[1], up_a: &m[2], up_b: &m[3], down_a: &m[4], down_b: &m[5] }
}
