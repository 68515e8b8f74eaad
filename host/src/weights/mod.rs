//! Weights from Hugging Face checkpoints: safetensors files mapped into memory (one file or a
//! sharded directory with `model.safetensors.index.json`), `config.json`, the expert naming
//! layouts KT's loaders detect, and the dtypes they decode (bf16, f16, f32, fp8 e4m3 with block
//! or per-channel scales, compressed-tensors and GPTQ int4, MXFP4), gpt-oss's expert biases, KT's
//! converted format. [`load_layer`] builds a [`crate::MoeLayer`] from one layer.

mod checkpoint;
mod config;
pub mod fuzzing;
mod gpt_oss;
pub mod gpu_buffer;
mod int4;
pub mod kt_format;
mod layout;
mod load;
mod mxfp4;
pub mod writer;

pub use crate::error::WeightError;
pub use crate::slots::Slots;
pub use checkpoint::{Checkpoint, TensorRef};
pub use config::ModelConfig;
pub use layout::{ExpertLayout, Layout};
pub use load::{checkpoint_format, expert_f32, int4_group, load_layer, slot_reader, stored_reader, StoredExpert};
