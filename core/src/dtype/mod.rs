//! Scalar number types: bf16 and f16 (from `half`), fp8 e4m3 and e8m0 scales, and the rounding
//! helpers every format shares.

mod e8m0;
mod fp8;

pub use e8m0::E8M0;
pub use fp8::F8E4M3;
pub use half::{bf16, f16};

/// 1.5 · 2^23: adding and subtracting it rounds any |x| < 2^22 to an integer, to nearest even
/// in the FPU's default mode.
const MAGIC: f32 = 12_582_912.0;

/// Round to nearest, ties to even, as `cvtps2dq` does under the default MXCSR: far faster than
/// a software `rintf` on CPUs built without SSE4.1; larger values are already integers.
#[inline]
pub fn round_ne(x: f32) -> f32 {
    if x.abs() < 4_194_304.0 {
        round_ne_small(x)
    } else {
        x
    }
}

/// [`round_ne`] for |x| < 2^22, without the branch (loops over it vectorize).
#[inline]
pub fn round_ne_small(x: f32) -> f32 {
    (x + MAGIC) - MAGIC
}

/// Round-to-nearest-even then saturate to i8, as KT's `cvtps_epi32` + `cvtsepi32_epi8` pair.
/// NaN maps to 0 (callers reject non-finite inputs before they get here).
#[inline]
pub fn quantize_i8(x: f32) -> i8 {
    let r = round_ne(x);
    if r.is_nan() {
        0
    } else {
        r.clamp(-128.0, 127.0) as i8
    }
}

/// [`quantize_i8`] for finite |x| < 2^22 (where [`round_ne`] is the magic-number add), without
/// branches so that loops over it vectorize. Same result as `quantize_i8` in that range.
#[inline]
pub fn quantize_i8_small(x: f32) -> i8 {
    round_ne_small(x).clamp(-128.0, 127.0) as i8
}

/// `bf16::from_f32(x)` (to nearest, ties to even; a NaN stays a quiet NaN), the same bits,
/// without branches so that loops over it vectorize: `half`'s branches per element, and the
/// forward's merge ran it scalar over every output element (58 M at 8192 tokens of H 7168).
#[inline]
pub fn bf16_round(x: f32) -> bf16 {
    let b = x.to_bits();
    // Adding 0x7fff plus the kept part's lowest bit carries into it exactly when the dropped
    // half is above one half, or is one half and the kept part is odd.
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    bf16::from_bits((if b & 0x7fff_ffff > 0x7f80_0000 { quiet_nan } else { rounded }) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_is_halfs_rounding_bit_for_bit() {
        // Every sign, exponent and kept mantissa, with the dropped half below, at, above one
        // half and at its ends: the ties, carries into the exponent, infinities and NaNs.
        for high in 0..=u16::MAX {
            for low in [0, 1, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff] {
                let x = f32::from_bits(u32::from(high) << 16 | low);
                assert_eq!(bf16_round(x).to_bits(), bf16::from_f32(x).to_bits(), "{:#010x}", x.to_bits());
            }
        }
    }

    #[test]
    fn round_ne_matches_rintf() {
        let mut x = -300.0f32;
        while x < 300.0 {
            assert_eq!(round_ne(x), libm::rintf(x), "{x}");
            x += 0.125; // hits every tie
        }
        for x in [0.5, 1.5, 2.5, -0.5, -2.5, 4194303.5, 1e10, -1e10, 8388609.0, f32::NAN] {
            assert!(round_ne(x) == libm::rintf(x) || x.is_nan(), "{x}");
        }
        assert!(round_ne(f32::NAN).is_nan());
    }

    #[test]
    fn small_quantizer_equals_the_general_one_in_its_range() {
        let mut x = -200.0f32;
        while x < 200.0 {
            assert_eq!(quantize_i8_small(x), quantize_i8(x), "{x}");
            x += 0.0625;
        }
        for x in [127.49, 127.5, 128.5, -128.5, -129.0, 4194303.0, -4194303.0, 1e-40, -0.0] {
            assert_eq!(quantize_i8_small(x), quantize_i8(x), "{x}");
        }
    }
}
