//! Packing at load: a GGML matrix's blocks rearranged for the kernels, once.
//!
//! ```text
//!  32-column types:   row = [group of 8 blocks: 8 scales | 8×16 level bytes (| q5 high bits)] …   (crate::legacy)
//!                     q8_0 for VNNI: the same groups, levels + 128 in 4-column lanes
//!  256-column types:  row = [block: scales (unpacked for q3_K, q4_K, q5_K, iq4_xs) | levels] …
//!                     levels in the lane layout (crate::lanes): register r, i16 lane h holds
//!                     columns 16h + 2r and 16h + 2r + 1; q3_K, q5_K, q6_K in planes of whole levels
//!  lattice, floats:   as GGUF stores them
//! ```

use kt_core::ggml::{self, ActKind, GgmlType, QK, QK_K};
use kt_x86::memory::{weight_buffer, WeightBuf};

use crate::decode::{Iq4XsU, Q3KU, Q4KU, Q5KU, Q6KP};
use crate::lanes::{relevel, Relevel};
use crate::legacy;
use crate::vnni::{self, Vnni};

/// Rows per kernel tile; a tile's rows also set how far ahead the kernels prefetch
/// ([`Packed::prefetch`]).
pub const R: usize = 4;

/// A GGML matrix packed for the kernels: rows of whole blocks, row-major; the 32-column
/// quantized types in groups of 8 blocks ([`crate::legacy`]; q8_0 for VNNI in 4-column
/// lanes), the 256-column ones with their levels in the lane layout ([`crate::lanes`]; q3_K,
/// q4_K, q5_K and iq4_xs with scales unpacked, q3_K's, q5_K's and q6_K's levels in planes of
/// their own), the float types as GGUF stores them.
#[derive(Debug)]
pub struct Packed {
    /// Its type.
    pub t: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    pub(crate) row_bytes: usize,
    /// Blocks (256-column types) or groups (32-column ones) per row: a kernel's slices.
    pub(crate) slices: usize,
    /// Bytes of one slice.
    pub(crate) slice_bytes: usize,
    /// Bytes of the next tile to prefetch per slice (`kernels::prefetch_next`).
    pub(crate) prefetch: usize,
    /// The VNNI encoding its kernels use (`kernels::on_vnni`: q8_0, packed for it by
    /// [`legacy::to_quads`], the unsigned 32-column types, q4_K and q5_K); `None` for the
    /// others.
    #[cfg_attr(not(vnni_intrinsics), allow(dead_code))] // Always `None` there.
    pub(crate) vnni: Option<Vnni>,
    /// Packed for a CPU with AVX512-VNNI, whose 512-bit kernels also serve q2_K, q3_K, q6_K and
    /// the lattice types (`kernels::on_zmm`, by `vpmaddubsw`: their scales of 16 columns split
    /// `vpdpbusd`'s lanes); the other 32-column types' levels then in their 4-column lanes
    /// ([`legacy::to_nibble_quads`]).
    #[cfg_attr(not(vnni_intrinsics), allow(dead_code))] // Always `false` there.
    pub(crate) zmm: bool,
    /// Packed for AVX512-VNNI on a CPU that also has VBMI and DQ, whose one-token kernels of
    /// the lattice types need them (`kernels::lattice1`).
    #[cfg_attr(not(vnni_intrinsics), allow(dead_code))] // Always `false` there.
    pub(crate) lattice1: bool,
    /// Row-major blocks, in this thread's huge-page arena ([`weight_buffer`]).
    pub data: WeightBuf,
}

impl Packed {
    /// Pack a matrix (GGUF bytes `src`) for the kernels of VNNI encoding `vnni` where its type
    /// has them ([`vnni::runs`]; q8_0 then in 4-column lanes), else for the AVX2 ones.
    pub fn new(t: GgmlType, rows: usize, cols: usize, src: &[u8], vnni: Option<Vnni>) -> Self {
        let row_bytes = Self::row_len(t, cols);
        let slices = if t.act() == ActKind::Q8_0 { (cols / QK).div_ceil(legacy::G) } else { cols / QK_K };
        let slice_bytes = row_bytes / slices.max(1);
        let prefetch = (R * row_bytes).div_ceil(slices.max(1)).next_multiple_of(64);
        let zmm = vnni == Some(Vnni::Evex);
        let lattice1 = zmm && is_x86_feature_detected!("avx512vbmi") && is_x86_feature_detected!("avx512dq");
        let vnni = vnni.filter(|_| vnni::runs(t));
        let k = |data| Packed { t, rows, cols, row_bytes, slices, slice_bytes, prefetch, vnni, zmm, lattice1, data };
        match t {
            GgmlType::Q2_K => return k(releveled(src, |b: &ggml::BlockQ2K| *b)),
            GgmlType::Q3_K => return k(releveled(src, Q3KU::from_block)),
            GgmlType::Q4_K => return k(releveled(src, Q4KU::from_block)),
            GgmlType::Q5_K => return k(releveled(src, Q5KU::from_block)),
            GgmlType::Q6_K => return k(releveled(src, Q6KP::from_block)),
            GgmlType::IQ4_XS => return k(releveled(src, Iq4XsU::from_block)),
            // The lattice and float types run as GGUF stores them.
            _ if t.is_lattice() || t.act() == ActKind::F32 => return k(WeightBuf::copy_of(src)),
            _ => {}
        }
        let mut data = weight_buffer(rows * row_bytes);
        for (o, s) in data.chunks_exact_mut(row_bytes.max(1)).zip(src.chunks_exact(t.row_bytes(cols).max(1))) {
            legacy::repack_row(t, s, o);
            if vnni.is_some() && t == GgmlType::Q8_0 {
                legacy::to_quads(o);
            } else if zmm && t != GgmlType::Q8_0 {
                legacy::to_nibble_quads(t, o);
            }
        }
        k(data)
    }

    fn row_len(t: GgmlType, cols: usize) -> usize {
        match t {
            _ if t.act() == ActKind::Q8_0 => legacy::row_bytes(t, cols),
            GgmlType::Q3_K => cols / QK_K * size_of::<Q3KU>(),
            GgmlType::Q4_K => cols / QK_K * size_of::<Q4KU>(),
            GgmlType::Q5_K => cols / QK_K * size_of::<Q5KU>(),
            GgmlType::IQ4_XS => cols / QK_K * size_of::<Iq4XsU>(),
            _ => t.row_bytes(cols),
        }
    }
}

/// GGUF blocks `src` (of type `S`) as kernel blocks `B` in the lane layout.
fn releveled<S: bytemuck::Pod, B: Relevel>(src: &[u8], from: impl Fn(&S) -> B) -> WeightBuf {
    let blocks: &[S] = bytemuck::cast_slice(src);
    let mut out = weight_buffer(blocks.len() * size_of::<B>());
    for (o, b) in out.chunks_exact_mut(size_of::<B>()).zip(blocks) {
        o.copy_from_slice(bytemuck::bytes_of(&relevel(&from(b))));
    }
    out
}
