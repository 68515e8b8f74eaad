//! The weights a forward reads: each expert's packed matrices per NUMA part, and the layer that
//! holds them with the backend that packed them.

use alloc::vec::Vec;
use core::ops::Range;

use crate::bias::ExpertBias;
use crate::{Backend, Error, LayerFormat, MoeConfig, PackedMatrix};

/// One expert's packed matrices for one part: gate/up `[I_p, H]`, down `[H, I_p]`.
#[derive(Debug)]
pub struct ExpertWeights {
    /// gate_proj rows of the part.
    pub gate: PackedMatrix,
    /// up_proj rows of the part.
    pub up: PackedMatrix,
    /// down_proj columns of the part.
    pub down: PackedMatrix,
}

impl ExpertWeights {
    /// Bytes of the three matrices.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

/// The experts of one NUMA part.
#[derive(Debug)]
pub struct PartWeights {
    /// The slice of I this part owns.
    pub range: Range<usize>,
    /// Indexed by expert id; `None` for experts not loaded (GPU-resident).
    pub experts: Vec<Option<ExpertWeights>>,
}

/// All packed weights of one layer and the backend that packed them, which is the backend
/// that runs it: a matrix packed by another is refused when it is installed.
#[derive(Debug)]
pub struct LayerWeights {
    backend: &'static dyn Backend,
    /// The formats the matrices were packed from.
    pub format: LayerFormat,
    /// One entry per NUMA part.
    pub parts: Vec<PartWeights>,
    /// Expert biases by expert id (gpt-oss's); empty for a layer without any.
    biases: Vec<Option<ExpertBias>>,
    /// H, which down's biases have.
    hidden: usize,
}

impl LayerWeights {
    /// A layer run by `backend` with no expert loaded yet.
    pub fn empty(
        cfg: &MoeConfig,
        format: impl Into<LayerFormat>,
        backend: &'static dyn Backend,
    ) -> Result<Self, Error> {
        let format = format.into();
        cfg.validate_for(format)?;
        let parts = cfg
            .part_ranges(format)?
            .into_iter()
            .map(|range| PartWeights { range, experts: (0..cfg.experts).map(|_| None).collect() })
            .collect();
        Ok(LayerWeights { backend, format, parts, biases: Vec::new(), hidden: cfg.hidden })
    }

    /// The backend that packed the weights and runs the layer.
    pub fn backend(&self) -> &'static dyn Backend {
        self.backend
    }

    /// Install expert `e` (one [`ExpertWeights`] per part, as [`pack_expert`](super::pack_expert) returns). Its
    /// matrices must have been packed by the layer's backend from the layer's formats.
    pub fn set_expert(&mut self, e: usize, per_part: Vec<ExpertWeights>) -> Result<(), Error> {
        if e >= self.parts.first().map_or(0, |p| p.experts.len()) {
            let expected = self.parts.first().map_or(0, |p| p.experts.len());
            return Err(Error::ShapeMismatch { what: "expert id (below the layer's experts)", expected, found: e });
        }
        if per_part.len() != self.parts.len() {
            return Err(Error::ShapeMismatch {
                what: "parts of an expert",
                expected: self.parts.len(),
                found: per_part.len(),
            });
        }
        for w in &per_part {
            let found = LayerFormat { gate: w.gate.format(), up: w.up.format(), down: w.down.format() };
            if found != self.format {
                return Err(Error::FormatMismatch { expert: e, expected: self.format, found });
            }
            if let Some(m) = [&w.gate, &w.up, &w.down].into_iter().find(|m| m.packed_by() != self.backend.name()) {
                return Err(Error::PackedByOther { layer: self.backend.name(), packed_by: m.packed_by() });
            }
        }
        for (p, w) in self.parts.iter_mut().zip(per_part) {
            p.experts[e] = Some(w);
        }
        Ok(())
    }

    /// Give expert `e` biases (of the layer's full H and I, checked against its parts).
    pub fn set_bias(&mut self, e: usize, bias: ExpertBias) -> Result<(), Error> {
        let experts = self.parts.first().map_or(0, |p| p.experts.len());
        if e >= experts {
            return Err(Error::ShapeMismatch {
                what: "expert id (below the layer's experts)",
                expected: experts,
                found: e,
            });
        }
        let intermediate = self.parts.last().map_or(0, |p| p.range.end);
        bias.validate(self.hidden, intermediate)?;
        if self.biases.is_empty() {
            self.biases = (0..experts).map(|_| None).collect();
        }
        self.biases[e] = Some(bias);
        Ok(())
    }

    /// Expert `e`'s biases, if it has any.
    pub fn bias(&self, e: usize) -> Option<&ExpertBias> {
        self.biases.get(e).and_then(Option::as_ref)
    }

    /// Bytes of expert `e` over all parts (0 if not loaded).
    pub fn expert_bytes(&self, e: usize) -> usize {
        self.parts.iter().filter_map(|p| p.experts[e].as_ref()).map(ExpertWeights::bytes).sum()
    }

    /// Bytes of every loaded expert.
    pub fn bytes(&self) -> usize {
        (0..self.parts.first().map_or(0, |p| p.experts.len())).map(|e| self.expert_bytes(e)).sum()
    }
}
