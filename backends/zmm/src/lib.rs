//! # kt-zmm
//!
//! The AVX-512 kernels for every weight format of ours (bf16, per-row int8, KT int4, K-group
//! int4, fp8 block and per-channel, mxfp4, mxfp8), at each of KT's instruction levels
//! ([`Level`]): what the `avx512` backends run, and what the `amx` backend runs below its tile
//! thresholds and reads its tiles from. Weights are packed into 32-row panels of 128-byte units
//! (`pack`); activations prepared per token (`act`); one microkernel family (`kernels`) serves
//! decode and prefill (runs of up to 12 tokens × 32 rows); a [`Matrix`] is a packed matrix
//! with the microkernel its level runs on it, chosen when it is packed; [`Zmm`] is a level's
//! whole set of backend operations. Built with rustc ≥ 1.89 (`build.rs`); with an older one it holds nothing.
//!
//! **Must not** depend on a backend crate, nor be a backend itself (the `avx512` and `amx`
//! crates register them).
//!
//! # Safety
//! Every `unsafe fn` here needs the instructions of the level it runs (checked once by the
//! backend's `cpu_support` before it is selected) and slices as long as its doc says.

// The 1.89 intrinsics are compiled only where build.rs found rustc ≥ 1.89.
#![allow(clippy::incompatible_msrv)]

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod act;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod kernels;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod level;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod matrix;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub mod pack;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
mod zmm;

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use kernels::{fold_exponents, fp8_tile_rows, glu_panel, mx_exponent_steps, put_panel};
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use level::Level;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use matrix::Matrix;
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
pub use zmm::{best_level, support, Zmm};
