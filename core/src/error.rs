//! The one error type of the core crate boundary. Every message names the parameter, tensor or
//! value that is wrong and what was expected.

use alloc::string::String;
use core::fmt;

use crate::format::WeightFormat;

/// What went wrong, with enough detail to fix the input.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of range (`field` = value, expected `expected`).
    InvalidConfig {
        /// The parameter's name as a user writes it.
        field: &'static str,
        /// The value given.
        value: usize,
        /// What would have been accepted.
        expected: String,
    },
    /// A buffer or tensor has the wrong length or shape.
    ShapeMismatch {
        /// Which tensor.
        what: &'static str,
        /// Expected element count (or dimension).
        expected: usize,
        /// Found element count (or dimension).
        found: usize,
    },
    /// More tokens in one call than the layer was built for.
    TooManyTokens {
        /// Tokens in the call.
        tokens: usize,
        /// The layer's `max_tokens` (KT's `chunked_prefill_size`).
        max: usize,
    },
    /// A quantizer met NaN, infinity or |x| > 3e38; formats here define no encoding for them.
    NonFinite {
        /// Which tensor.
        what: &'static str,
        /// Row of the first offending value.
        row: usize,
        /// Column of the first offending value.
        col: usize,
    },
    /// A shape a format cannot represent (e.g. odd columns for 4-bit nibbles).
    FormatShape {
        /// The format.
        format: WeightFormat,
        /// Which dimension.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The multiple it must be.
        multiple: usize,
    },
    /// The format can be read and run but not written (GGML's K-quants other than q4_K, IQ
    /// types): there is no quantizer for it here.
    NoQuantizer {
        /// The format asked for.
        format: WeightFormat,
    },
    /// A layer whose projections' formats cannot run together.
    IncompatibleFormats {
        /// The formats.
        formats: crate::LayerFormat,
    },
    /// No compiled-in, CPU-supported backend can run this format and shape.
    NoBackend {
        /// The format asked for.
        format: WeightFormat,
        /// Why each candidate declined.
        detail: String,
    },
    /// `KT_KERNEL_CPU_VARIANT` (or an explicit choice) names no known variant.
    UnknownVariant {
        /// The value given.
        value: String,
        /// The accepted values.
        valid: &'static [&'static str],
    },
    /// A known variant that this build or this CPU cannot run.
    VariantUnavailable {
        /// The variant asked for.
        variant: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A routed expert has no weights in this layer (not loaded, e.g. GPU-resident at load).
    ExpertNotLoaded {
        /// The expert id.
        expert: usize,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidConfig { field, value, expected } => {
                write!(f, "invalid {field} = {value}: expected {expected}")
            }
            Error::ShapeMismatch { what, expected, found } => {
                write!(f, "{what} has {found} elements, expected {expected}")
            }
            Error::TooManyTokens { tokens, max } => write!(
                f,
                "{tokens} tokens in one call exceed the layer's max_tokens (chunked_prefill_size) = {max}"
            ),
            Error::NonFinite { what, row, col } => write!(
                f,
                "{what} has a non-finite or out-of-range value at row {row}, column {col}: weights must be finite with |x| <= 3e38"
            ),
            Error::FormatShape { format, what, value, multiple } => write!(
                f,
                "{what} = {value} is not a multiple of {multiple}, which format {format} needs"
            ),
            Error::NoQuantizer { format } => write!(
                f,
                "format {format} cannot be quantized here (it is read from GGUF files as it is); quantize to \
                 one of q4_0, q8_0, q4_K, f16, bf16, f32 or a KT format instead"
            ),
            Error::IncompatibleFormats { formats } => write!(
                f,
                "formats {formats} cannot run in one layer: gate and up must read the same activations (both \
                 K-quants or iq4_xs, both 32-column GGML types, or both float) and KT formats cannot be mixed"
            ),
            Error::NoBackend { format, detail } => {
                write!(f, "no available backend can run format {format}: {detail}")
            }
            Error::UnknownVariant { value, valid } => write!(
                f,
                "unknown CPU variant {value:?} (KT_KERNEL_CPU_VARIANT); valid values: {}",
                valid.join(", ")
            ),
            Error::VariantUnavailable { variant, reason } => {
                write!(f, "CPU variant {variant:?} cannot be used: {reason}")
            }
            Error::ExpertNotLoaded { expert } => write!(
                f,
                "expert {expert} is routed to the CPU but its weights were not loaded (it was GPU-resident when the layer was built)"
            ),
        }
    }
}

impl core::error::Error for Error {}
