//! GGUF models (llama.cpp's format): the container parsed from the mapped bytes ([`parse`]),
//! split files ([`GgufFile`]), and MoE layers built from their stacked expert tensors in
//! whatever GGML types each projection has ([`load_gguf_layer`]); [`write::GgufWriter`] for
//! `kt convert --method q4_k` and friends.

mod file;
mod load;
pub mod parse;
pub mod write;

pub use file::{is_gguf, GgufFile, GgufTensor};
pub use load::{expert_tensor_names, layer_format, load_gguf_layer, moe_config, moe_layers};
