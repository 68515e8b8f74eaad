//! The LoRA matrices, their gradients, and the base weights transposed for the backward.

use alloc::format;
use alloc::vec::Vec;

use half::bf16;

use crate::{Error, MoeConfig};

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
