//! Expert biases (gpt-oss's experts add them; KT's MoE has none): `g = x·W_gateᵀ + b_gate`,
//! `u = x·W_upᵀ + b_up` before the activation and `y = h·W_downᵀ + b_down` before the routing
//! weight. They stay in f32 beside the packed matrices: the backends add gate's and up's to
//! their f32 sums before the activation rounds them, the forward adds down's once per slot.
#![forbid(unsafe_code)]

use alloc::vec::Vec;
use core::ops::Range;

use crate::Error;

/// One expert's biases: gate and up `[I]`, down `[H]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertBias {
    /// Added to gate's outputs.
    pub gate: Vec<f32>,
    /// Added to up's outputs.
    pub up: Vec<f32>,
    /// Added to down's outputs.
    pub down: Vec<f32>,
}

impl ExpertBias {
    /// Check the lengths against `hidden` H and `intermediate` I.
    pub fn validate(&self, hidden: usize, intermediate: usize) -> Result<(), Error> {
        for (what, v, want) in [
            ("gate bias (intermediate)", &self.gate, intermediate),
            ("up bias (intermediate)", &self.up, intermediate),
            ("down bias (hidden)", &self.down, hidden),
        ] {
            if v.len() != want {
                return Err(Error::ShapeMismatch { what, expected: want, found: v.len() });
            }
        }
        Ok(())
    }

    /// Gate's and up's biases of the rows `range` (a NUMA part's).
    pub fn gate_up(&self, range: Range<usize>) -> GateUpBias<'_> {
        GateUpBias { gate: &self.gate[range.clone()], up: &self.up[range] }
    }
}

/// Gate's and up's biases for the rows of one part, indexed as its rows.
#[derive(Clone, Copy, Debug)]
pub struct GateUpBias<'a> {
    /// Added to gate's row `r`.
    pub gate: &'a [f32],
    /// Added to up's row `r`.
    pub up: &'a [f32],
}

impl GateUpBias<'_> {
    /// Add the biases to the lanes `lanes` of `g` and `u`, lane `j` holding row `first + j`.
    #[inline]
    pub fn add(&self, first: usize, lanes: Range<usize>, g: &mut [f32], u: &mut [f32]) {
        for j in lanes {
            g[j] += self.gate[first + j];
            u[j] += self.up[first + j];
        }
    }
}

/// `g` and `u` (lane `j` holding row `first + j`) with `bias` added to the lanes `lanes`, copied
/// into `room`; as they are without biases (no copy on the common path).
#[inline]
pub fn with_bias<'a, const N: usize>(
    bias: Option<GateUpBias<'_>>,
    first: usize,
    lanes: Range<usize>,
    [g, u]: [&'a [f32; N]; 2],
    room: &'a mut [[f32; N]; 2],
) -> (&'a [f32; N], &'a [f32; N]) {
    let Some(b) = bias else { return (g, u) };
    *room = [*g, *u];
    let [rg, ru] = room;
    b.add(first, lanes, rg, ru);
    (rg, ru)
}
