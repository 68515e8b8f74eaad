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
    /// `KT_KERNEL_CPU_VARIANT` (or an explicit choice) names no backend with kernels in this build.
    UnknownVariant {
        /// The value given.
        value: String,
        /// The accepted values in this build, comma-separated.
        valid: String,
    },
    /// The backend chosen for a layer (forced, or given explicitly) does not run its format.
    FormatNotServed {
        /// The backend.
        backend: &'static str,
        /// How it was chosen, e.g. `KT_KERNEL_CPU_VARIANT=avx2`.
        chosen_by: String,
        /// The format it declines.
        format: WeightFormat,
        /// The backends of this build that run it on this CPU, comma-separated.
        serving: String,
    },
    /// A format that a file layout or an operation does not have (KT's packed files hold
    /// AMXINT8 and AMXINT4 only, for one).
    UnsupportedFormat {
        /// The format.
        format: WeightFormat,
        /// Where it is not supported, and what is.
        context: &'static str,
    },
    /// A packed matrix offered to a layer run by another backend than the one that packed it.
    PackedByOther {
        /// The layer's backend.
        layer: &'static str,
        /// The backend that packed the matrix.
        packed_by: &'static str,
    },
    /// An expert's matrices are not in the formats the layer was declared with.
    FormatMismatch {
        /// The expert.
        expert: usize,
        /// The layer's formats.
        expected: crate::LayerFormat,
        /// The expert's.
        found: crate::LayerFormat,
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
    /// An SFT backward with no saved forward to differentiate.
    NoForwardCache,
    /// An SFT forward asked to save its cache while `max_cache_depth` caches wait for their
    /// backward.
    CacheFull {
        /// The layer's `max_cache_depth`.
        depth: usize,
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
                "formats {formats} cannot run in one layer: only GGML types may differ between gate, up and \
                 down; KT's formats are one per layer"
            ),
            Error::NoBackend { format, detail } => {
                write!(f, "no available backend can run format {format}: {detail}")
            }
            Error::UnknownVariant { value, valid } => write!(
                f,
                "unknown CPU variant {value:?} (KT_KERNEL_CPU_VARIANT): no backend of that name has kernels in \
                 this build; valid values: {valid}"
            ),
            Error::FormatNotServed { backend, chosen_by, format, serving } => write!(
                f,
                "backend {backend} ({chosen_by}) does not run format {format}; backends of this build that do on \
                 this CPU: {serving}"
            ),
            Error::UnsupportedFormat { format, context } => write!(f, "format {format} is not supported {context}"),
            Error::PackedByOther { layer, packed_by } => write!(
                f,
                "a matrix packed by backend {packed_by} cannot join a layer run by backend {layer}: pack it with {layer}"
            ),
            Error::FormatMismatch { expert, expected, found } => {
                write!(f, "expert {expert} has formats {found}, but the layer was declared {expected}")
            }
            Error::VariantUnavailable { variant, reason } => {
                write!(f, "CPU variant {variant:?} cannot be used: {reason}")
            }
            Error::NoForwardCache => write!(
                f,
                "no saved forward to differentiate: call forward with save_for_backward=True before backward"
            ),
            Error::CacheFull { depth } => write!(
                f,
                "max_cache_depth = {depth} forwards are already saved without their backward: run backward first, \
                 or build the layer with a larger max_cache_depth"
            ),
            Error::ExpertNotLoaded { expert } => write!(
                f,
                "expert {expert} is routed to the CPU but its weights were not loaded (it was GPU-resident when the layer was built)"
            ),
        }
    }
}

impl core::error::Error for Error {}
