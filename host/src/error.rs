//! What can be wrong with a checkpoint, each naming the file or tensor and what was expected.

use std::fmt;
use std::path::PathBuf;

/// A checkpoint that cannot be read or does not fit the layer asked for.
#[derive(Debug)]
#[non_exhaustive]
pub enum WeightError {
    /// A file could not be opened or mapped.
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not valid safetensors / JSON (truncated, corrupt, offsets outside the file).
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        detail: String,
    },
    /// The directory has no safetensors files.
    Empty {
        /// The directory.
        path: PathBuf,
    },
    /// `config.json` lacks a field or has a bad value.
    Config {
        /// The file.
        path: PathBuf,
        /// What is missing or wrong.
        detail: String,
    },
    /// No known expert layout matches the layer.
    UnknownLayout {
        /// The layer.
        layer: usize,
        /// The names that were tried.
        tried: Vec<String>,
    },
    /// An expected tensor is absent.
    Missing {
        /// The tensor.
        name: String,
    },
    /// A tensor's shape differs from the config's.
    Shape {
        /// The tensor.
        name: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Found shape.
        found: Vec<usize>,
    },
    /// A tensor's dtype cannot be decoded here.
    Dtype {
        /// The tensor.
        name: String,
        /// Its dtype.
        found: String,
        /// What would be accepted.
        expected: &'static str,
    },
    /// A tensor holds a value its format cannot stand for.
    Value {
        /// The tensor.
        name: String,
        /// What and where.
        detail: String,
    },
    /// A converted checkpoint made for another NUMA part count.
    Parts {
        /// The checkpoint.
        path: PathBuf,
        /// Parts in the file.
        found: usize,
        /// Parts asked for (threadpool_count / --numa-parts).
        requested: usize,
    },
    /// A converted checkpoint made in another method.
    Method {
        /// The checkpoint.
        path: PathBuf,
        /// The method it was converted to.
        found: String,
        /// The method asked for.
        requested: String,
    },
    /// A checkpoint KT-Kernel converted for its general kernel (MOE_INT8, MOE_INT4), whose
    /// bytes are that kernel's own layout.
    KtKernelLayout {
        /// The checkpoint.
        path: PathBuf,
        /// The method asked for.
        method: String,
    },
    /// The weights do not make a valid layer (shape vs format, no backend).
    Layer(kt_core::Error),
}

impl fmt::Display for WeightError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            WeightError::Corrupt { path, detail } => write!(f, "{}: not a valid file: {detail}", path.display()),
            WeightError::Empty { path } => write!(f, "{}: no *.safetensors or *.gguf files found", path.display()),
            WeightError::Config { path, detail } => write!(f, "{}: {detail}", path.display()),
            WeightError::UnknownLayout { layer, tried } => write!(
                f,
                "layer {layer}: no MoE expert tensors in a known layout (deepseek, mixtral, mistral, fused, \
                 DeepSeek-V4, gpt-oss); tried {}",
                tried.join(", ")
            ),
            WeightError::Missing { name } => write!(f, "tensor {name} is missing from the checkpoint"),
            WeightError::Shape { name, expected, found } => {
                write!(f, "tensor {name} has shape {found:?}, expected {expected:?} (from config.json)")
            }
            WeightError::Dtype { name, found, expected } => {
                write!(f, "tensor {name} has dtype {found}, expected {expected}")
            }
            WeightError::Value { name, detail } => write!(f, "tensor {name}: {detail}"),
            WeightError::Parts { path, found, requested } => write!(
                f,
                "{}: converted for {found} NUMA part(s) but {requested} requested; convert again with --parts \
                 {requested} or run with {found} part(s) (threadpool_count)",
                path.display()
            ),
            WeightError::Method { path, found, requested } => write!(
                f,
                "{}: converted as {found} but loaded as {requested}; load it with {found} or convert again with \
                 --method {requested}",
                path.display()
            ),
            WeightError::KtKernelLayout { path, method } => write!(
                f,
                "{}: converted by KT-Kernel for {method}, whose files hold its AOCL-BLIS/KML kernel's own \
                 layout (an AOCL reorder, or bytes KT's converter writes from an unset buffer), which only \
                 that kernel reads; {method} runs {} here: load the Hugging Face checkpoint as weight_path \
                 (quantized at load), or convert it with kt convert --method {method} and load that",
                path.display(),
                if method.to_ascii_uppercase().contains("INT4") { "AMXINT4's numerics" } else { "AMXINT8's numerics" },
            ),
            WeightError::Layer(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for WeightError {}

impl From<kt_core::Error> for WeightError {
    fn from(e: kt_core::Error) -> Self {
        WeightError::Layer(e)
    }
}
