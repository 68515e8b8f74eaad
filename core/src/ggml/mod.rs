//! GGML's tensor types, as GGUF files store them: `#[repr(C)]` block structs (byte fields
//! only, so any byte slice casts to them) whose scalar `dequantize` is the definition of the
//! format, bit-exact with ggml and gguf-py; quantizers for the activation formats (Q8_0, Q8_K)
//! and for the weight types `kt convert` writes (Q4_0, Q8_0, Q4_K, the float types).
//!
//! | type | columns/block | bytes | value | dotted with |
//! |---|---|---|---|---|
//! | f32, f16, bf16 | 1 | 4, 2, 2 | as stored | f32 |
//! | q4_0, q4_1 | 32 | 18, 20 | `d·(q-8)`, `d·q+m` | Q8_0 |
//! | q5_0, q5_1 | 32 | 22, 24 | `d·(q-16)`, `d·q+m` | Q8_0 |
//! | q8_0 | 32 | 34 | `d·q` | Q8_0 |
//! | iq4_nl | 32 | 18 | `d·K[q]` | Q8_0 |
//! | mxfp4 | 32 | 17 | `2^(e-128)·K[q]` (e2m1 doubled) | Q8_0 |
//! | q2_K…q6_K | 256 | 84, 110, 144, 176, 210 | sub-block scales (and mins) | Q8_K |
//! | iq4_xs | 256 | 136 | `d·(ls-32)·K[q]` | Q8_K |
//! | iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s | 256 | 50, 56, 66, 74, 82, 98, 110 | `d·m·L/2^k`, `L` from a grid | Q8_K |
#![forbid(unsafe_code)]

#[rustfmt::skip]
mod grids;
mod iq4;
mod kquants;
mod lattice;
mod legacy;
mod synth;
mod types;

pub use grids::{
    IQ1S_GRID8, IQ2S_GRID, IQ2S_PACKED, IQ2XS_GRID, IQ2XS_PACKED, IQ2XXS_LEVELS, IQ2XXS_PACKED, IQ3S_GRID, IQ3S_LEVELS,
    IQ3S_PACKED, IQ3XXS_LEVELS, IQ3XXS_PACKED,
};

pub use iq4::{e8m0_half, BlockIq4Nl, BlockIq4Xs, BlockMxfp4, KVALUES_IQ4NL, KVALUES_MXFP4};
pub use kquants::{
    pack_scale_min_k4, q3k_scales, scale_min_k4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K,
};
pub use lattice::{BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs, Lattice, KSIGNS};
pub use legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, QK};
pub use synth::random_matrix;
pub use types::{id_name, ActKind, GgmlType};

use bytemuck::Pod;
use half::{bf16, f16};

/// `roundf`: to nearest, ties away from zero, as ggml's reference quantizers and gguf-py's
/// `np_roundf` round (a result of zero may be +0 where roundf gives -0).
#[inline]
pub fn round_away(x: f32) -> f32 {
    // Below 2^22 a tie is the only case where ties-to-even differs, and x ± 0.5 is exact there.
    if x.abs() < 4_194_304.0 {
        let r = crate::dtype::round_ne(x);
        if (r - x).abs() == 0.5 {
            x + 0.5f32.copysign(x)
        } else {
            r
        }
    } else {
        libm::roundf(x)
    }
}

/// Apply `f` to each block of `src` (whole blocks of `B`) and the matching `N` outputs.
fn blocks<B: Pod>(src: &[u8], out: &mut [f32], n: usize, f: impl Fn(&B, &mut [f32])) {
    let bs: &[B] = bytemuck::cast_slice(&src[..out.len() / n * core::mem::size_of::<B>()]);
    for (b, y) in bs.iter().zip(out.chunks_exact_mut(n)) {
        f(b, y);
    }
}

/// Dequantize one row: `src` holds `out.len() / t.block_elems()` whole blocks of type `t`.
pub fn dequantize_row(t: GgmlType, src: &[u8], out: &mut [f32]) {
    debug_assert_eq!(out.len() % t.block_elems(), 0);
    match t {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => blocks(src, out, QK, BlockQ4_0::dequantize),
        GgmlType::Q4_1 => blocks(src, out, QK, BlockQ4_1::dequantize),
        GgmlType::Q5_0 => blocks(src, out, QK, BlockQ5_0::dequantize),
        GgmlType::Q5_1 => blocks(src, out, QK, BlockQ5_1::dequantize),
        GgmlType::Q8_0 => blocks(src, out, QK, BlockQ8_0::dequantize),
        GgmlType::IQ4_NL => blocks(src, out, QK, BlockIq4Nl::dequantize),
        GgmlType::MXFP4 => blocks(src, out, QK, BlockMxfp4::dequantize),
        GgmlType::Q2_K => blocks(src, out, QK_K, BlockQ2K::dequantize),
        GgmlType::Q3_K => blocks(src, out, QK_K, BlockQ3K::dequantize),
        GgmlType::Q4_K => blocks(src, out, QK_K, BlockQ4K::dequantize),
        GgmlType::Q5_K => blocks(src, out, QK_K, BlockQ5K::dequantize),
        GgmlType::Q6_K => blocks(src, out, QK_K, BlockQ6K::dequantize),
        GgmlType::IQ4_XS => blocks(src, out, QK_K, BlockIq4Xs::dequantize),
        GgmlType::IQ1_S => blocks(src, out, QK_K, BlockIq1S::dequantize),
        GgmlType::IQ1_M => blocks(src, out, QK_K, BlockIq1M::dequantize),
        GgmlType::IQ2_XXS => blocks(src, out, QK_K, BlockIq2Xxs::dequantize),
        GgmlType::IQ2_XS => blocks(src, out, QK_K, BlockIq2Xs::dequantize),
        GgmlType::IQ2_S => blocks(src, out, QK_K, BlockIq2S::dequantize),
        GgmlType::IQ3_XXS => blocks(src, out, QK_K, BlockIq3Xxs::dequantize),
        GgmlType::IQ3_S => blocks(src, out, QK_K, BlockIq3S::dequantize),
    }
}

/// Quantize one row of finite values into `out[..t.row_bytes(x.len())]`. `None` for a type
/// without a quantizer here ([`GgmlType::can_quantize`]).
pub fn quantize_row(t: GgmlType, x: &[f32], out: &mut [u8]) -> Option<()> {
    let out = &mut out[..t.row_bytes(x.len())];
    fn each<B: Pod>(x: &[f32], out: &mut [u8], n: usize, f: impl Fn(&[f32]) -> B) {
        for (xs, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(core::mem::size_of::<B>())) {
            o.copy_from_slice(bytemuck::bytes_of(&f(xs)));
        }
    }
    match t {
        GgmlType::F32 => each(x, out, 1, |v| v[0]),
        GgmlType::F16 => each(x, out, 1, |v| f16::from_f32(v[0])),
        GgmlType::BF16 => each(x, out, 1, |v| bf16::from_f32(v[0])),
        GgmlType::Q4_0 => each(x, out, QK, BlockQ4_0::quantize),
        GgmlType::Q8_0 => each(x, out, QK, BlockQ8_0::quantize),
        GgmlType::Q4_K => each(x, out, QK_K, BlockQ4K::quantize),
        _ => return None,
    }
    Some(())
}

/// Bytes of prepared activations of `rows × cols` for weights of kind `act`.
pub fn act_bytes(act: ActKind, rows: usize, cols: usize) -> usize {
    rows * match act {
        ActKind::F32 => 4 * cols,
        ActKind::Q8_0 => cols / QK * core::mem::size_of::<BlockQ8_0>(),
        ActKind::Q8K => cols / QK_K * core::mem::size_of::<BlockQ8K>(),
    }
}

/// Every row of a tensor of rows `cols` long (`bytes` holds whole rows of type `t`), in f32.
pub fn dequantize(t: GgmlType, bytes: &[u8], cols: usize) -> alloc::vec::Vec<f32> {
    let row = t.row_bytes(cols);
    let rows = bytes.len().checked_div(row).unwrap_or(0);
    let mut out = alloc::vec![0.0f32; rows * cols];
    for (src, o) in bytes.chunks_exact(row.max(1)).zip(out.chunks_exact_mut(cols.max(1))) {
        dequantize_row(t, src, o);
    }
    out
}

/// Prepare one activation row `x` for `act` into `out[..act_bytes(act, 1, x.len())]`.
pub fn quantize_act_row(act: ActKind, x: &[f32], out: &mut [u8]) {
    let t = match act {
        ActKind::F32 => GgmlType::F32,
        ActKind::Q8_0 => GgmlType::Q8_0,
        ActKind::Q8K => {
            let out: &mut [BlockQ8K] = bytemuck::cast_slice_mut(&mut out[..act_bytes(act, 1, x.len())]);
            for (o, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
                *o = BlockQ8K::quantize(xs);
            }
            return;
        }
    };
    quantize_row(t, x, out).expect("f32 and q8_0 quantize");
}

/// Dequantize one prepared activation row (the values the dot products see).
pub fn dequantize_act_row(act: ActKind, src: &[u8], out: &mut [f32]) {
    match act {
        ActKind::F32 => dequantize_row(GgmlType::F32, src, out),
        ActKind::Q8_0 => dequantize_row(GgmlType::Q8_0, src, out),
        ActKind::Q8K => blocks(src, out, QK_K, BlockQ8K::dequantize),
    }
}

#[cfg(test)]
mod tests;
