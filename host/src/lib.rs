//! # kt-host
//!
//! The std half of kt-kernel-rs: CPU and topology detection, backend registry and selection,
//! an executor, [`MoeLayer`] (the layer API), and the benchmark behind `kt bench`.
#![doc = "\n\nSee the repository README for the command line."]
#![warn(missing_docs)]

pub mod bench;
pub mod cpu;
pub mod exec;
pub mod gguf;
pub mod layer;
pub mod numa_pool;
pub mod placement;
pub mod pool;
pub mod queue;
pub mod registry;
mod sync;
pub mod topology;
pub mod weights;

pub use kt_core::{bf16, Error, MoeConfig, WeightFormat};
pub use layer::{LayerOptions, MoeLayer};
