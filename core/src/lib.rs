//! # kt-core
//!
//! The `no_std` heart of kt-kernel-rs, the CPU half of CPU/GPU hybrid MoE inference.
//!
//! **For callers** (the host crate, the Python bindings): describe a layer with [`MoeConfig`],
//! quantize expert matrices into a [`format::QuantMatrix`], let a [`Backend`] pack them, and run
//! [`forward::forward`] with an [`Executor`]. Validation returns [`Error`], never panics.
//!
//! **For backend authors**: implement [`Backend`]. A backend *must* compute every output element
//! of a task by itself in a fixed order (the task graph relies on that for results that are
//! bit-identical for any thread count), *must not* panic on shapes it declared it supports, and
//! runs the conformance suite of `kt_core::testing` (feature `test-util`) with one line.
//! The trait's life cycle, selection by formats and the per-worker scratch are described in
//! [`backend`] and the repository's `docs/architecture.md`.
//!
//! **Must not** use `std`, threads or files (the host's job), nor hold a backend's kernels.
#![no_std]
#![warn(missing_docs)]

extern crate alloc;
#[cfg(test)]
extern crate std;

pub mod aligned;
pub mod backend;
pub mod balance;
pub mod bias;
pub mod config;
pub mod dtype;
mod error;
pub mod exec;
pub mod format;
pub mod forward;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod ggml;
#[cfg(any(test, feature = "test-util"))]
pub mod kernel_case;
pub mod mat;
pub mod plan;
pub mod reference;
pub mod rng;
pub mod routing;
pub mod select;
pub mod sft;
pub mod swiglu;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
mod workers;

pub use backend::{Backend, PackedMatrix};
pub use config::MoeConfig;
pub use error::Error;
pub use exec::{Executor, SerialExecutor};
pub use format::{LayerFormat, QuantMatrix, Scales, WeightFormat};
pub use half::{bf16, f16};
pub use routing::Routing;
