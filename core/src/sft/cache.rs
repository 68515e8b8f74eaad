//! What a forward keeps for its backward.

use alloc::vec::Vec;

use half::bf16;

use crate::plan::ActiveExpert;

/// One forward's saved state (KT's `ForwardCache`): its input and routing, where each routed
/// (token, slot) pair's row is, and per row what the backward reads: bf16 `g` and `u` (the
/// values SwiGLU saw), the f32 expert output `y` (for the routing weights' gradient) and the
/// three rank-r products `A·input`. A forward fills it whether or not its caller keeps it.
#[derive(Debug, Default)]
pub struct Cache {
    pub(crate) tokens: usize,
    pub(crate) k: usize,
    /// `[tokens, k]`.
    pub(crate) weights: Vec<f32>,
    /// `[tokens, H]`.
    pub(crate) x: Vec<bf16>,
    pub(crate) experts: Vec<ActiveExpert>,
    /// Per row, its token.
    pub(crate) row_tokens: Vec<u32>,
    /// Per row, its slot `t·k + j`.
    pub(crate) row_slots: Vec<u32>,
    /// `[rows, I]` each.
    pub(crate) g: Vec<bf16>,
    pub(crate) u: Vec<bf16>,
    /// `[rows, H]`.
    pub(crate) y: Vec<f32>,
    /// `[rows, r]` each: `A_g·x`, `A_u·x`, `A_d·h`.
    pub(crate) ax_g: Vec<f32>,
    pub(crate) ax_u: Vec<f32>,
    pub(crate) ah: Vec<f32>,
}

impl Cache {
    /// Tokens of the forward it holds.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Bytes of what it holds (its vectors' lengths, not their capacity).
    pub fn bytes(&self) -> usize {
        4 * (self.weights.len() + self.row_tokens.len() + self.row_slots.len() + self.y.len())
            + 2 * (self.x.len() + self.g.len() + self.u.len())
            + 4 * (self.ax_g.len() + self.ax_u.len() + self.ah.len())
            + self.experts.len() * size_of::<ActiveExpert>()
    }
}
