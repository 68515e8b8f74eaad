//! Weight formats. Each format is defined by its scalar `quantize` and `dequantize` in its own
//! module; backends pack a [`QuantMatrix`] (the canonical, row-major logical layout) into
//! whatever layout their kernels read.
//!
//! | format | element | scales | KT name |
//! |---|---|---|---|
//! | `bf16` | bf16 | none | BF16 |
//! | `int8` | i8, symmetric | f32 per row, amax/127 | AMXINT8 |
//! | `int4` | signed nibble n, value 16·n·d | f32 per row d = amax/112 | AMXINT4 |
//! | `int4-gG` | offset-8 nibble | bf16 per G columns of a row, amax/7 | RAWINT4 |
//! | `fp8` | e4m3 | f32 per 128×128 block, amax/448 | FP8 |
//! | `fp8-channel` | e4m3 | f32 per row, amax/448 | FP8_PERCHANNEL |
//! | `mxfp4` | e2m1 nibble | e8m0 per 32 columns of a row (OCP MX) | MXFP4 |
//! | `mxfp8` | e4m3 | e8m0 per 32 columns of a row (OCP MX) | MXFP8 |
//! | `q4_K`, `q8_0`, ... | GGML blocks ([`crate::ggml`]) | inside the blocks | LLAMAFILE |
#![forbid(unsafe_code)]

pub mod bf16;
pub mod fp8_block;
pub mod fp8_channel;
pub mod int4_group;
pub mod int4_row;
pub mod int8_row;
pub mod kt_packed;
mod layer;
mod matrix;
pub mod mx;
mod scales;

pub use layer::LayerFormat;
pub use matrix::QuantMatrix;
pub use scales::{Scales, MARGIN};

use core::fmt;

use crate::ggml::GgmlType;

/// Largest |weight| a quantizer accepts: bf16 rounds larger values to infinity, and a scale
/// times its largest level could round past f32::MAX.
pub const MAX_ABS: f32 = 3.0e38;

/// Side of the square FP8 scale blocks (DeepSeek-V3's `weight_block_size`).
pub const FP8_BLOCK: usize = 128;

/// A weight format: how one expert matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WeightFormat {
    /// bf16 weights, computed in fp32.
    Bf16,
    /// Per-row symmetric int8 (KT AMXINT8).
    Int8Row,
    /// Per-row symmetric int4 exactly as KT's AMXINT4.
    Int4Row,
    /// K-group symmetric int4 with offset-8 nibbles and bf16 scales (KT RAWINT4).
    Int4Group {
        /// Columns per scale: 32, 64 or 128.
        group: u16,
    },
    /// FP8 e4m3 with one f32 scale per 128×128 block.
    Fp8Block,
    /// FP8 e4m3 with one f32 scale per row.
    Fp8Channel,
    /// OCP MXFP4: e2m1 elements, one e8m0 scale per 32 columns of a row.
    Mxfp4,
    /// OCP MXFP8: e4m3 elements, one e8m0 scale per 32 columns of a row.
    Mxfp8,
    /// A GGML tensor type as GGUF files store it, row after row of its blocks.
    Ggml(GgmlType),
}

impl WeightFormat {
    /// Every KT format, for listings and tests (the GGML ones are [`GgmlType::ALL`]).
    pub const ALL: [WeightFormat; 10] = [
        WeightFormat::Bf16,
        WeightFormat::Int8Row,
        WeightFormat::Int4Row,
        WeightFormat::Int4Group { group: 32 },
        WeightFormat::Int4Group { group: 64 },
        WeightFormat::Int4Group { group: 128 },
        WeightFormat::Fp8Block,
        WeightFormat::Fp8Channel,
        WeightFormat::Mxfp4,
        WeightFormat::Mxfp8,
    ];

    /// Parse a method name: ours (`bf16`, `int8`, `int4`, `int4-g32`, `fp8`, `fp8-channel`) or
    /// KT's (`BF16`, `AMXINT8`, `AMXINT4`, `MOE_INT8` and `MOE_INT4` ([`Self::is_kt_moe_kernel`]),
    /// `RAWINT4` and `GPTQ_INT4` (group 128 here; loaders and `kt convert` take a 4-bit
    /// checkpoint's own group: [`Self::takes_checkpoint_group`]), `FP8`, `FP8_PERCHANNEL`).
    pub fn parse(s: &str) -> Option<WeightFormat> {
        Some(match Self::normalized(s).as_str() {
            "bf16" => WeightFormat::Bf16,
            "int8" | "amxint8" | "moe-int8" => WeightFormat::Int8Row,
            "int4" | "amxint4" | "moe-int4" => WeightFormat::Int4Row,
            "int4-g32" => WeightFormat::Int4Group { group: 32 },
            "int4-g64" => WeightFormat::Int4Group { group: 64 },
            "int4-g128" | "rawint4" | "gptq-int4" => WeightFormat::Int4Group { group: 128 },
            "fp8" | "fp8-block" => WeightFormat::Fp8Block,
            "fp8-channel" | "fp8-perchannel" => WeightFormat::Fp8Channel,
            "mxfp4" => WeightFormat::Mxfp4,
            "mxfp8" => WeightFormat::Mxfp8,
            _ => return GgmlType::parse(s).map(WeightFormat::Ggml),
        })
    }

    /// Whether method `s` is KT's RAWINT4 or GPTQ_INT4, which run a 4-bit checkpoint (compressed-
    /// tensors or GPTQ) in its own K-group, its nibbles and scales as stored, as KT's RAWINT4
    /// does; [`Self::parse`] gives their format for other inputs (groups of 128).
    pub fn takes_checkpoint_group(s: &str) -> bool {
        matches!(Self::normalized(s).as_str(), "rawint4" | "gptq-int4")
    }

    /// Whether method `s` is KT's MOE_INT8 or MOE_INT4 (its general kernel, AOCL-BLIS on AMD
    /// and KML on ARM): run here in AMXINT8's and AMXINT4's numerics ([`Self::parse`]: the same
    /// scales and grids; KT's general kernel divides where AMX multiplies and rounds half away
    /// where it rounds to even), while the files KT converted for it hold that kernel's own
    /// layout, which only it reads.
    pub fn is_kt_moe_kernel(s: &str) -> bool {
        matches!(Self::normalized(s).as_str(), "moe-int8" | "moe-int4")
    }

    /// A method name as [`Self::parse`] matches it: trimmed, lower case, `_` as `-`.
    fn normalized(s: &str) -> alloc::string::String {
        s.trim().to_ascii_lowercase().replace('_', "-")
    }

    /// The names [`WeightFormat::parse`] accepts, for error messages.
    pub const NAMES: &'static str =
        "bf16, int8, int4, int4-g32, int4-g64, int4-g128, fp8, fp8-channel, mxfp4, mxfp8 (or KT's BF16, AMXINT8, AMXINT4, MOE_INT8, MOE_INT4, RAWINT4, GPTQ_INT4, FP8, FP8_PERCHANNEL, MXFP4, MXFP8), or a GGML type: f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, ggml-mxfp4, iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s";

    /// Activations are quantized to int8 per token (per K-group for the grouped formats).
    pub fn int_activations(self) -> bool {
        matches!(
            self,
            WeightFormat::Int8Row | WeightFormat::Int4Row | WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4
        )
    }

    /// Whether [`Scales::Mse`] applies: the formats whose scales a quantizer here chooses.
    pub fn searches_scales(self) -> bool {
        !matches!(self, WeightFormat::Bf16 | WeightFormat::Ggml(_))
    }

    /// Columns per activation scale for the formats whose int8 activations are quantized per
    /// K-group (`int4-gG`, `mxfp4`); `None` for per-token ones and float activations.
    pub fn act_group(self) -> Option<usize> {
        self.k_group().filter(|_| self.int_activations())
    }

    /// Columns per scale along a row, for the formats with K-group scales.
    pub fn k_group(self) -> Option<usize> {
        match self {
            WeightFormat::Int4Group { group } => Some(usize::from(group)),
            WeightFormat::Mxfp4 | WeightFormat::Mxfp8 => Some(mx::MX_BLOCK),
            _ => None,
        }
    }

    /// Its dot products are integer ones (int8 activations, or GGML's Q8 blocks): the int8
    /// peak is its compute roofline, the FMA peak otherwise.
    pub fn int_dot(self) -> bool {
        match self {
            WeightFormat::Ggml(t) => t.act() != crate::ggml::ActKind::F32,
            f => f.int_activations(),
        }
    }

    /// Columns (the K dimension) must be a multiple of this.
    pub fn col_multiple(self) -> usize {
        match self {
            WeightFormat::Int4Row => 2,
            WeightFormat::Ggml(t) => t.block_elems(),
            f => f.k_group().unwrap_or(1),
        }
    }

    /// NUMA parts split I at multiples of this (so every slice stays a whole matrix of the format).
    pub fn split_granularity(self) -> usize {
        match self {
            WeightFormat::Fp8Block => FP8_BLOCK,
            f => f.col_multiple(),
        }
    }

    /// Bytes of element data of a `rows × cols` matrix.
    pub fn data_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            WeightFormat::Bf16 => rows * cols * 2,
            WeightFormat::Int8Row | WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => {
                rows * cols
            }
            WeightFormat::Int4Row | WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 => rows * cols.div_ceil(2),
            WeightFormat::Ggml(t) => rows * t.row_bytes(cols),
        }
    }

    /// Number of scales of a `rows × cols` matrix.
    pub fn scale_count(self, rows: usize, cols: usize) -> usize {
        match self {
            WeightFormat::Bf16 | WeightFormat::Ggml(_) => 0,
            WeightFormat::Int8Row | WeightFormat::Int4Row | WeightFormat::Fp8Channel => rows,
            WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 | WeightFormat::Mxfp8 => {
                rows * cols.div_ceil(self.k_group().unwrap_or(1))
            }
            WeightFormat::Fp8Block => rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK),
        }
    }

    /// Bytes one stored scale takes on disk and in packed form.
    pub fn scale_bytes(self) -> usize {
        match self {
            WeightFormat::Bf16 | WeightFormat::Ggml(_) => 0,
            WeightFormat::Int4Group { .. } => 2,
            WeightFormat::Mxfp4 | WeightFormat::Mxfp8 => 1,
            _ => 4,
        }
    }

    /// Total stored bytes of a `rows × cols` matrix (data + scales).
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        self.data_bytes(rows, cols) + self.scale_count(rows, cols) * self.scale_bytes()
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightFormat::Bf16 => f.write_str("bf16"),
            WeightFormat::Int8Row => f.write_str("int8"),
            WeightFormat::Int4Row => f.write_str("int4"),
            WeightFormat::Int4Group { group } => write!(f, "int4-g{group}"),
            WeightFormat::Fp8Block => f.write_str("fp8"),
            WeightFormat::Fp8Channel => f.write_str("fp8-channel"),
            WeightFormat::Mxfp4 => f.write_str("mxfp4"),
            WeightFormat::Mxfp8 => f.write_str("mxfp8"),
            // KT's bf16 and mxfp4 are other formats (bf16 activations; MX scales per row
            // panel): keep the names apart.
            WeightFormat::Ggml(GgmlType::BF16) => f.write_str("ggml-bf16"),
            WeightFormat::Ggml(GgmlType::MXFP4) => f.write_str("ggml-mxfp4"),
            WeightFormat::Ggml(t) => f.write_str(t.name()),
        }
    }
}

/// The value of a stored nibble (low nibble = even column) as a signed 4-bit integer.
#[inline]
pub(crate) fn signed_nibble(data_row: &[u8], c: usize) -> i8 {
    let b = data_row[c / 2];
    let nib = if c % 2 == 0 { b << 4 } else { b & 0xF0 };
    (nib as i8) >> 4
}

/// The raw 0..15 nibble (low nibble = even column).
#[inline]
pub(crate) fn raw_nibble(data_row: &[u8], c: usize) -> u8 {
    let b = data_row[c / 2];
    if c % 2 == 0 {
        b & 0x0F
    } else {
        b >> 4
    }
}

/// Store nibble `v & 0xF` at column `c` of a zero-initialised row.
#[inline]
pub(crate) fn put_nibble(data_row: &mut [u8], c: usize, v: u8) {
    let v = v & 0x0F;
    data_row[c / 2] |= if c % 2 == 0 { v } else { v << 4 };
}

/// Largest |x| of a slice (0 for an empty one). Inputs are finite (checked by the caller).
#[inline]
pub(crate) fn amax(xs: &[f32]) -> f32 {
    xs.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// `1/d`, or 0 for a zero scale, as KT computes its quantization multiplier. Where `1/d`
/// overflows (amax in the f32 subnormal range, below ~1e-36) it is 0 too, so such a row is
/// stored as zeros instead of saturated garbage; its error is below its tiny amax.
#[inline]
pub(crate) fn inverse(d: f32) -> f32 {
    let inv = 1.0 / d;
    if d != 0.0 && inv.is_finite() {
        inv
    } else {
        0.0
    }
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for f in WeightFormat::ALL {
            let name = alloc::format!("{f}");
            assert_eq!(WeightFormat::parse(&name), Some(f), "{name}");
        }
        assert_eq!(WeightFormat::parse("AMXINT4"), Some(WeightFormat::Int4Row));
        assert_eq!(WeightFormat::parse("MOE_INT8"), Some(WeightFormat::Int8Row));
        assert_eq!(WeightFormat::parse("MOE_INT4"), Some(WeightFormat::Int4Row));
        assert!(WeightFormat::is_kt_moe_kernel("MOE_INT8") && !WeightFormat::is_kt_moe_kernel("AMXINT8"));
        assert_eq!(WeightFormat::parse("FP8_PERCHANNEL"), Some(WeightFormat::Fp8Channel));
        assert_eq!(WeightFormat::parse("int3"), None);
        for &t in GgmlType::ALL {
            let f = WeightFormat::Ggml(t);
            assert_eq!(WeightFormat::parse(&alloc::format!("{f}")), Some(f));
        }
    }

    #[test]
    fn kt_byte_sizes() {
        // KT §3.1: INT8 = R·C, INT4 = R·C/2 bytes, +4R scale bytes.
        assert_eq!(WeightFormat::Int8Row.data_bytes(2048, 7168), 2048 * 7168);
        assert_eq!(WeightFormat::Int4Row.data_bytes(2048, 7168), 2048 * 7168 / 2);
        assert_eq!(WeightFormat::Int4Row.scale_count(2048, 7168) * 4, 4 * 2048);
    }
}
