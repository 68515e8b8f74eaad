//! `LayerFormat`: the formats of one layer's three projections. GGUF files may store them in
//! different types (Q4_K_M keeps down in Q6_K); every other source uses one format for all.

use core::fmt;

use super::WeightFormat;
use crate::ggml::GgmlType;
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

    /// Only GGML types may differ between the projections (as GGUF files store them), and then
    /// freely: a forward prepares activations once per layout the kernels read. KT's formats
    /// are one per layer.
    pub fn check(&self) -> Result<(), Error> {
        let ok = match (self.gate, self.up, self.down) {
            (WeightFormat::Ggml(_), WeightFormat::Ggml(_), WeightFormat::Ggml(_)) => true,
            _ => self.is_uniform(),
        };
        if ok {
            Ok(())
        } else {
            Err(Error::IncompatibleFormats { formats: *self })
        }
    }

    /// GGML type `t` for a layer of `hidden` × `intermediate`, as llama.cpp's quantizer stores
    /// it: each projection in `t` where its blocks divide the projection's rows (gate and up
    /// have rows of `hidden` columns, down of `intermediate`), else in [`GgmlType::fallback`].
    /// The one place that decides it, for `kt bench` and `kt convert` alike.
    pub fn ggml(t: GgmlType, hidden: usize, intermediate: usize) -> LayerFormat {
        let fit = |cols: usize| WeightFormat::Ggml(if cols % t.block_elems() == 0 { t } else { t.fallback() });
        LayerFormat { gate: fit(hidden), up: fit(hidden), down: fit(intermediate) }
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
