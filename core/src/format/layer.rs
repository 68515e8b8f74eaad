//! `LayerFormat`: the formats of one layer's three projections. GGUF files may store them in
//! different types (Q4_K_M keeps down in Q6_K); every other source uses one format for all.

use core::fmt;

use super::WeightFormat;
use crate::Error;

/// gate, up and down formats of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerFormat {
    /// gate_proj `[I, H]`.
    pub gate: WeightFormat,
    /// up_proj `[I, H]`.
    pub up: WeightFormat,
    /// down_proj `[H, I]`.
    pub down: WeightFormat,
}

impl From<WeightFormat> for LayerFormat {
    fn from(f: WeightFormat) -> Self {
        LayerFormat { gate: f, up: f, down: f }
    }
}

impl LayerFormat {
    /// One format for all three.
    pub fn is_uniform(&self) -> bool {
        self.gate == self.up && self.up == self.down
    }

    /// gate and up read one prepared activation, so they must want the same one; only GGML
    /// types may differ at all (KT's formats are one per layer).
    pub fn check(&self) -> Result<(), Error> {
        let ok = match (self.gate, self.up, self.down) {
            (WeightFormat::Ggml(g), WeightFormat::Ggml(u), WeightFormat::Ggml(_)) => g.act() == u.act(),
            _ => self.is_uniform(),
        };
        if ok {
            Ok(())
        } else {
            Err(Error::IncompatibleFormats { formats: *self })
        }
    }

    /// NUMA parts split I at multiples of this: every part's slice stays whole blocks of each.
    pub fn split_granularity(&self) -> usize {
        [self.gate, self.up, self.down].iter().map(|f| f.split_granularity()).max().unwrap_or(1)
    }
}

impl fmt::Display for LayerFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_uniform() {
            write!(f, "{}", self.gate)
        } else if self.gate == self.up {
            write!(f, "{} (down {})", self.gate, self.down)
        } else {
            write!(f, "gate {}, up {}, down {}", self.gate, self.up, self.down)
        }
    }
}
