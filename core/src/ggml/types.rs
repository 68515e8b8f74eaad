//! `GgmlType`: the tensor types a GGUF file names, with ggml's ids and block geometry.

use core::fmt;

/// What a weight type's dot products read the activations as (ggml's `vec_dot_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActKind {
    /// f32 rows (for the float weight types).
    F32,
    /// [`super::BlockQ8_0`] per 32 columns (for the legacy 32-column types, IQ4_NL and MXFP4).
    Q8_0,
    /// [`super::BlockQ8K`] per 256 columns (for the K-quants, IQ4_XS and the lattice types).
    Q8K,
}

macro_rules! ggml_types {
    ($($v:ident = $id:literal, $name:literal, $blk:literal, $bytes:literal, $act:ident;)*) => {
        /// A ggml tensor type that this crate can run, by its ggml/GGUF id.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        pub enum GgmlType { $( #[doc = $name] $v = $id, )* }

        impl GgmlType {
            /// Every supported type.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$v),*];

            /// The type with ggml id `id`, if this crate runs it.
            pub const fn from_id(id: u32) -> Option<GgmlType> {
                match id { $($id => Some(GgmlType::$v),)* _ => None }
            }
            /// ggml's name (`q4_K`, `iq4_xs`, ...).
            pub fn name(self) -> &'static str {
                match self { $(GgmlType::$v => $name,)* }
            }
            /// Columns per block.
            pub fn block_elems(self) -> usize {
                match self { $(GgmlType::$v => $blk,)* }
            }
            /// Bytes per block.
            pub fn block_bytes(self) -> usize {
                match self { $(GgmlType::$v => $bytes,)* }
            }
            /// The activation format its dot products read.
            pub fn act(self) -> ActKind {
                match self { $(GgmlType::$v => ActKind::$act,)* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "f32", 1, 4, F32;
    F16 = 1, "f16", 1, 2, F32;
    Q4_0 = 2, "q4_0", 32, 18, Q8_0;
    Q4_1 = 3, "q4_1", 32, 20, Q8_0;
    Q5_0 = 6, "q5_0", 32, 22, Q8_0;
    Q5_1 = 7, "q5_1", 32, 24, Q8_0;
    Q8_0 = 8, "q8_0", 32, 34, Q8_0;
    Q2_K = 10, "q2_K", 256, 84, Q8K;
    Q3_K = 11, "q3_K", 256, 110, Q8K;
    Q4_K = 12, "q4_K", 256, 144, Q8K;
    Q5_K = 13, "q5_K", 256, 176, Q8K;
    Q6_K = 14, "q6_K", 256, 210, Q8K;
    IQ4_NL = 20, "iq4_nl", 32, 18, Q8_0;
    MXFP4 = 39, "mxfp4", 32, 17, Q8_0;
    IQ4_XS = 23, "iq4_xs", 256, 136, Q8K;
    IQ2_XXS = 16, "iq2_xxs", 256, 66, Q8K;
    IQ2_XS = 17, "iq2_xs", 256, 74, Q8K;
    IQ3_XXS = 18, "iq3_xxs", 256, 98, Q8K;
    IQ1_S = 19, "iq1_s", 256, 50, Q8K;
    IQ3_S = 21, "iq3_s", 256, 110, Q8K;
    IQ2_S = 22, "iq2_s", 256, 82, Q8K;
    IQ1_M = 29, "iq1_m", 256, 56, Q8K;
    BF16 = 30, "bf16", 1, 2, F32;
}

impl GgmlType {
    /// Parse ggml's name (any case, `-` for `_`, optionally prefixed `ggml-`), e.g. `q4_k`,
    /// `Q6_K`, `iq4-xs`, `ggml-bf16`.
    pub fn parse(s: &str) -> Option<GgmlType> {
        let s = s.trim().replace('-', "_");
        let s = s.strip_prefix("ggml_").or_else(|| s.strip_prefix("GGML_")).unwrap_or(&s);
        GgmlType::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// Bytes of one row of `cols` columns (a multiple of [`GgmlType::block_elems`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }

    /// The type llama.cpp's quantizer uses instead of `self` for a tensor whose rows are not a
    /// multiple of 256 columns (e.g. DeepSeek-V2-Lite's down projection, I = 1408).
    pub fn fallback(self) -> GgmlType {
        match self {
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::IQ4_XS => GgmlType::IQ4_NL,
            t if t.is_lattice() => GgmlType::IQ4_NL,
            GgmlType::Q4_K => GgmlType::Q5_0,
            GgmlType::Q5_K => GgmlType::Q5_1,
            GgmlType::Q6_K => GgmlType::Q8_0,
            t => t,
        }
    }

    /// A lattice type ([`super::Lattice`]: iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s).
    pub fn is_lattice(self) -> bool {
        use GgmlType::*;
        matches!(self, IQ1_S | IQ1_M | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S)
    }

    /// Can [`super::quantize_row`] write it (so `kt convert` can produce it)?
    pub fn can_quantize(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K
        )
    }
}

/// ggml's name for any id GGUF defines, to name what is not supported.
pub fn id_name(id: u32) -> &'static str {
    match GgmlType::from_id(id) {
        Some(t) => t.name(),
        None => match id {
            9 => "q8_1",
            15 => "q8_K",
            24 => "i8",
            25 => "i16",
            26 => "i32",
            27 => "i64",
            28 => "f64",
            34 => "tq1_0",
            35 => "tq2_0",
            _ => "unknown",
        },
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
