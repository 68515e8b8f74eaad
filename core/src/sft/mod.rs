//! LoRA fine-tuning of a layer's routed experts (KT-Kernel's SFT MoE): a forward that keeps
//! what the backward needs, and the backward that turns the upstream gradient into the
//! gradients of the input, the routing weights and the LoRA matrices (and, for full
//! fine-tuning, of the base weights).
//!
//! Every projection of every expert gets a low-rank update, `proj(x) = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` with
//! `s = alpha / rank`, A `[E, r, in]` and B `[E, out, r]` in bf16; the base weights W are the
//! layer's packed inference matrices, in any format, frozen unless their gradients are asked
//! for (with respect to their dequantized values: the caller updates a bf16 copy and packs the
//! layer again, as KT's `update_base_weights` does).
//!
//! ```text
//!  forward, per active expert (one task), its rows x (a token each):
//!    g = W_g·x + s·B_g·(A_g·x),  u = W_u·x + s·B_u·(A_u·x)         base by Backend::down
//!    h = bf16(silu(bf16 g)·bf16 u)                                   as the inference forward
//!    y = W_d·h + s·B_d·(A_d·h)
//!  per token: out = bf16(Σ_j w_j·y_j)                  its rows ascending (by expert, then j)
//!  cache: x, and per row g, u, y and the three A·(input) of rank r
//!
//!  backward, per active expert, with gy = w·grad_out of each row:
//!    grad_weights = ⟨grad_out, y⟩
//!    dh = W_dᵀ·gy + s·A_dᵀ·(B_dᵀ·gy)        W_dᵀ packed once ([`BackwardWeights`])
//!    dg, du from silu's derivative at bf16 g, u
//!    dx = W_gᵀ·dg + W_uᵀ·du + s·(A_gᵀ·(B_gᵀ·dg) + A_uᵀ·(B_uᵀ·du))
//!    grad B += s·(output grad)·(A·input)ᵀ,  grad A += s·(Bᵀ·output grad)·inputᵀ   (each expert's
//!    rows in order, into its own slice of the gradients: one task writes each)
//!    full-weight gradients, when asked for: grad W_d += gy·hᵀ, grad W_g += dg·xᵀ, grad W_u += du·xᵀ
//!  per token: grad_input = bf16(Σ_j dx_j)                             j ascending
//! ```
//!
//! The base products run on the layer's backend (`down`, whose per-element results do not
//! depend on the rows asked for), so with every B zero the output is the inference forward's
//! bit for bit (the SwiGLU between the projections is the backend's too); the LoRA products
//! and that SwiGLU are the backend's [`SftKernels`] (f32 vector loops on x86). Results are
//! bit-identical for any thread count: every element is written by one task in a fixed order.

mod backward;
mod cache;
#[cfg(any(test, feature = "test-util"))]
pub mod check;
mod forward;
mod kernels;
mod lora;
mod transposes;

pub use backward::{backward, Backward, BaseGrads};
pub use cache::Cache;
pub use forward::{forward, Workspace};
pub use kernels::{add_scaled, widen_rows, LoraBack, OuterFn, SftKernels, OUTER_ROWS, PORTABLE};
pub use lora::{lora_of, random_lora, Lora, LoraGrads, LoraMats};
pub use transposes::{BackwardWeights, TransposeFormat};

#[cfg(test)]
mod tests;
