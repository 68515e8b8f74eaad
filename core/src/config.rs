//! `MoeConfig`: the shape of one MoE layer and how it is split across NUMA parts.
#![forbid(unsafe_code)]

use alloc::format;
use alloc::vec::Vec;
use core::ops::Range;

use crate::swiglu::Glu;
use crate::{Error, LayerFormat, WeightFormat};

/// Shape of one routed-expert MoE layer (KT's `MOEConfig`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Routed experts of the layer, GPU-resident ones included (E).
    pub experts: usize,
    /// Experts selected per token (k).
    pub top_k: usize,
    /// Hidden size (H): gate/up input and down output width.
    pub hidden: usize,
    /// Full, un-sharded intermediate size (I).
    pub intermediate: usize,
    /// Most tokens one forward may carry (KT's `chunked_prefill_size`).
    pub max_tokens: usize,
    /// NUMA parts: tensor-parallel slices of I (KT's `threadpool_count`).
    pub parts: usize,
    /// The gated activation (KT's `swiglu_limit`/`swiglu_alpha`; plain SwiGLU by default).
    pub glu: Glu,
}

impl MoeConfig {
    /// A config with one part and `max_tokens` = 1024.
    pub fn new(experts: usize, top_k: usize, hidden: usize, intermediate: usize) -> Self {
        MoeConfig { experts, top_k, hidden, intermediate, max_tokens: 1024, parts: 1, glu: Glu::SILU }
    }

    /// Check the sizes alone (no format).
    pub fn validate(&self) -> Result<(), Error> {
        let positive = |field, value: usize| {
            if value == 0 {
                Err(Error::InvalidConfig { field, value, expected: "a positive number".into() })
            } else {
                Ok(())
            }
        };
        positive("experts", self.experts)?;
        positive("top_k", self.top_k)?;
        positive("hidden", self.hidden)?;
        positive("intermediate", self.intermediate)?;
        positive("max_tokens", self.max_tokens)?;
        positive("parts", self.parts)?;
        if self.top_k > self.experts {
            return Err(Error::InvalidConfig {
                field: "top_k",
                value: self.top_k,
                expected: format!("at most experts = {}", self.experts),
            });
        }
        if self.parts > self.intermediate {
            return Err(Error::InvalidConfig {
                field: "parts",
                value: self.parts,
                expected: format!("at most intermediate = {}", self.intermediate),
            });
        }
        Ok(())
    }

    /// Check the sizes against what the formats need (gate/up columns are H, down's are I; KT
    /// formats also want I a multiple of their own), and that I splits into `parts`.
    pub fn validate_for(&self, format: impl Into<LayerFormat>) -> Result<(), Error> {
        let lf = format.into();
        self.validate()?;
        lf.check()?;
        let mut needs = alloc::vec![
            (lf.gate, "hidden", self.hidden),
            (lf.up, "hidden", self.hidden),
            (lf.down, "intermediate", self.intermediate)
        ];
        if !matches!(lf.gate, WeightFormat::Ggml(_)) {
            needs.push((lf.gate, "intermediate", self.intermediate));
        }
        for (format, what, value) in needs {
            let multiple = format.col_multiple();
            if value % multiple != 0 {
                return Err(Error::FormatShape { format, what, value, multiple });
            }
        }
        self.part_ranges(lf).map(|_| ())
    }

    /// The slice of I each NUMA part owns: gate/up rows and down columns. Parts get whole units
    /// of `format.split_granularity()` columns, as evenly as possible, extra units to the first.
    pub fn part_ranges(&self, format: impl Into<LayerFormat>) -> Result<Vec<Range<usize>>, Error> {
        let format = format.into();
        if self.parts == 1 {
            return Ok(alloc::vec![0..self.intermediate]);
        }
        let g = format.split_granularity();
        let units = self.intermediate / g;
        if self.intermediate % g != 0 || units < self.parts {
            return Err(Error::InvalidConfig {
                field: "parts",
                value: self.parts,
                expected: format!(
                    "a split of intermediate = {} into whole blocks of {g} columns (format {format}), \
                     i.e. at most {units} parts",
                    self.intermediate
                ),
            });
        }
        let (base, extra) = (units / self.parts, units % self.parts);
        let mut start = 0;
        Ok((0..self.parts)
            .map(|p| {
                let len = (base + usize::from(p < extra)) * g;
                let r = start..start + len;
                start += len;
                r
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_zero_and_k_above_e() {
        let mut c = MoeConfig::new(8, 2, 64, 64);
        assert!(c.validate().is_ok());
        c.top_k = 9;
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field: "top_k", .. })));
        c.top_k = 0;
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field: "top_k", .. })));
    }

    #[test]
    fn uneven_split_by_whole_blocks() {
        let mut c = MoeConfig::new(8, 2, 64, 96);
        c.parts = 2;
        let r = c.part_ranges(WeightFormat::Int4Group { group: 32 }).unwrap();
        assert_eq!(r, [0..64, 64..96]);
        c.parts = 4;
        assert!(c.part_ranges(WeightFormat::Int4Group { group: 32 }).is_err());
        assert_eq!(c.part_ranges(WeightFormat::Bf16).unwrap(), [0..24, 24..48, 48..72, 72..96]);
    }

    #[test]
    fn format_multiples() {
        let c = MoeConfig::new(8, 2, 48, 64);
        assert!(c.validate_for(WeightFormat::Int4Group { group: 32 }).is_err());
        assert!(c.validate_for(WeightFormat::Int8Row).is_ok());
    }
}
