//! Random valid GGML matrices: the test vectors of the types gguf-py cannot quantize, and the
//! synthetic weights `kt bench` runs them on.

use alloc::vec::Vec;

use super::GgmlType;
use crate::rng::SplitMix64;
use crate::{QuantMatrix, WeightFormat};

/// Byte offsets of a GGML block's f16 scale fields (`d`, and `m`/`dmin` where it has one).
fn ggml_scale_offsets(t: GgmlType) -> &'static [usize] {
    match t {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::IQ1_M | GgmlType::MXFP4 => &[],
        _ => &[0],
    }
}

/// A random valid `rows × cols` matrix of GGML type `t`: Gaussian values for the float types,
/// else random block bytes with finite scales sized so values are about `1/sqrt(cols)` (how
/// K-quant and IQ test vectors are made, as gguf-py cannot quantize them).
pub fn random_matrix(t: GgmlType, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
    let format = WeightFormat::Ggml(t);
    let mut r = SplitMix64::new(seed);
    let std = 1.0 / libm::sqrtf(cols as f32);
    let data = match t {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let x: Vec<f32> = (0..rows * cols).map(|_| r.gaussian() * std).collect();
            return QuantMatrix::quantize(format, rows, cols, &x).expect("float types quantize");
        }
        _ => {
            let mut data: Vec<u8> = (0..format.data_bytes(rows, cols)).map(|_| r.next_u64() as u8).collect();
            // Typical |level × sub-scale| of each type, so that d·that ≈ std.
            let typical = match t {
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => 8.0,
                GgmlType::Q8_0 => 64.0,
                GgmlType::IQ4_NL => 64.0,
                GgmlType::MXFP4 => 4.5,
                GgmlType::IQ4_XS => 64.0 * 16.0,
                GgmlType::Q6_K => 32.0 * 64.0,
                GgmlType::Q2_K => 2.0 * 8.0,
                GgmlType::Q3_K => 4.0 * 16.0,
                // Lattice types: mean scale times mean |level|, over 2^SHIFT.
                GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ2_S => 16.0 * 25.0 / 8.0,
                GgmlType::IQ3_XXS => 16.0 * 33.0 / 4.0,
                GgmlType::IQ3_S => 16.0 * 8.0,
                GgmlType::IQ1_S | GgmlType::IQ1_M => 8.0 * 5.7 / 8.0,
                _ => 8.0 * 32.0,
            };
            // The offset (m, or dmin times the 6-bit mins) that centres the levels, as
            // trained weights are centred.
            let centre = match t {
                GgmlType::Q4_1 => -7.5,
                GgmlType::Q5_1 => -15.5,
                GgmlType::Q2_K => 1.5,
                GgmlType::Q4_K => 7.5,
                GgmlType::Q5_K => 15.5,
                _ => 0.0,
            };
            for block in data.chunks_exact_mut(t.block_bytes()) {
                // K-quant mins equal to their sub-block's scale, so that `centre` centres
                // every sub-block.
                match t {
                    GgmlType::Q2_K => block[..16].iter_mut().for_each(|b| *b = (*b & 0xF) * 0x11),
                    GgmlType::Q4_K | GgmlType::Q5_K => {
                        let sc: [u8; 8] = core::array::from_fn(|_| (r.next_u64() % 64) as u8);
                        block[4..16].copy_from_slice(&super::pack_scale_min_k4(&sc, &sc));
                    }
                    _ => {}
                }
                let d = std / typical * (0.5 + r.next_f32());
                for (&at, v) in ggml_scale_offsets(t).iter().zip([d, d * centre]) {
                    block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
                if t == GgmlType::IQ1_M {
                    // Its f16 `d` is the top nibbles of the four scale words (bytes 49, 51, 53, 55).
                    let bits = half::f16::from_f32(d).to_bits();
                    for k in 0..4 {
                        let b = &mut block[49 + 2 * k];
                        *b = (*b & 0x0F) | (((bits >> (4 * k)) & 0xF) as u8) << 4;
                    }
                }
                if t == GgmlType::MXFP4 {
                    // Its scale is the e8m0 code of a power of two, 2^(e - 128), nearest to d.
                    block[0] = (128.0 + libm::roundf(libm::log2f(d))) as u8;
                }
            }
            data
        }
    };
    QuantMatrix::from_parts(format, rows, cols, data, Vec::new()).expect("sizes from the format")
}
