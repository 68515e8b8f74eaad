//! # kt-host
//!
//! The std half of kt-kernel-rs: CPU and topology detection, the backend registry (best
//! first, selection by formats), the NUMA pool and task queue, [`MoeLayer`] (the layer API),
//! weights IO ([`weights`] for checkpoints and KT's files, [`gguf`], both opened through
//! [`source::WeightSource`]), conversion ([`convert`]) and the benchmark behind `kt bench`.
//!
//! **Must not** compute: every kernel runs in a backend, through `kt_core::forward`. The
//! `weights` and `gguf` modules do not import each other ([`error`] and [`slots`] are theirs
//! to share).
#![doc = "\n\nSee the repository README for the command line."]
#![warn(missing_docs)]

pub mod bench;
pub mod convert;
pub mod cpu;
pub mod error;
pub mod exec;
pub mod gguf;
pub mod layer;
pub mod numa_pool;
pub mod placement;
pub mod pool;
pub mod queue;
pub mod registry;
pub mod scratch;
pub mod sft;
pub mod slots;
pub mod soak;
pub mod source;
mod sync;
pub mod tmpfile;
pub mod topology;
pub mod weights;

pub use kt_core::{bf16, Error, MoeConfig, WeightFormat};
pub use layer::{LayerOptions, MoeLayer};
pub use sft::{SftLayer, SftOptions};
