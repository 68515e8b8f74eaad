//! FP8 E4M3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN is
//! `S.1111.111`, largest finite 448. As in DeepSeek-V3 checkpoints and OCP FP8.

/// One fp8 e4m3 value, stored as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

impl F8E4M3 {
    /// Largest finite magnitude.
    pub const MAX: f32 = 448.0;

    /// Exact conversion to f32 (every e4m3 value is an f32, and a bf16): a normal code's
    /// exponent and mantissa bits placed in f32's (the reference kernels and the quantizers'
    /// checks call this per weight; `exp2f` had been a tenth of a `kt bench` of fp8).
    #[inline]
    pub fn to_f32(self) -> f32 {
        let b = self.0;
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (u32::from((b >> 3) & 0x0F), u32::from(b & 0x07));
        let mag = match (e, m) {
            (15, 7) => return f32::NAN,
            (0, _) => m as f32 * (1.0 / 512.0), // subnormal: m/8 · 2^-6
            _ => f32::from_bits(((e + 127 - 7) << 23) | (m << 20)), // (1 + m/8) · 2^(e-7)
        };
        sign * mag
    }

    /// Round to nearest even, saturating to ±448 ("satfinite"); NaN stays NaN. Without
    /// branches on the value (random weights mispredicted the old ones: `kt convert` and the
    /// quantizers call this per weight): a normal result is |x|'s bits rounded at mantissa bit
    /// 20 and rebiased, a subnormal one |x| · 2^9 rounded, the saturation a minimum.
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let a = bits & 0x7FFF_FFFF;
        // |x| ≥ 2^-6 (f32 exponent ≥ 121): the top 3 mantissa bits rounded to nearest even (a
        // carry moves into the exponent), the exponent rebiased from 127 to 7.
        let normal = (a.wrapping_add(0x7_FFFF + ((a >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
        // Below: steps of 2^-9, a count of 8 being the smallest normal.
        let subnormal = super::round_ne(f32::from_bits(a) * 512.0) as u32;
        let q = if a < 121 << 23 { subnormal } else { normal.min(0x7E) };
        let q = if a > 0x7F80_0000 { 0x7F } else { q };
        F8E4M3(sign | q as u8)
    }

    /// `from_f32(x).to_f32()` for finite `x`, in f32 without a code or a branch (the scale
    /// search rounds every weight once per candidate scale): a normal result is |x|'s bits
    /// rounded at mantissa bit 20, a subnormal one |x| rounded to a multiple of 2^-9.
    #[inline]
    pub fn round(x: f32) -> f32 {
        let bits = x.to_bits();
        let a = bits & 0x7FFF_FFFF;
        let normal = f32::from_bits(a.wrapping_add(0x7_FFFF + ((a >> 20) & 1)) & 0xFFF0_0000).min(Self::MAX);
        let subnormal = super::round_ne_small(f32::from_bits(a) * 512.0) * (1.0 / 512.0);
        let mag = if a < 121 << 23 { subnormal } else { normal };
        f32::from_bits(mag.to_bits() | (bits & 0x8000_0000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounding case by case, as it was first written: the oracle of [`F8E4M3::from_f32`].
    fn from_f32_by_cases(x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        if x.is_nan() {
            return sign | 0x7F;
        }
        let a = x.abs();
        if a >= F8E4M3::MAX {
            return sign | 0x7E;
        }
        if a < 1.0 / 64.0 {
            return sign | crate::dtype::round_ne(a * 512.0) as u8;
        }
        let bits = a.to_bits();
        let (exp, man) = (((bits >> 23) & 0xFF) as i32 - 127, bits & 0x7F_FFFF);
        let (keep, rest, half) = (man >> 20, man & 0xF_FFFF, 0x8_0000);
        let mut q = keep + u32::from(rest > half || (rest == half && keep & 1 == 1));
        let mut e = exp + 7;
        if q == 8 {
            q = 0;
            e += 1;
        }
        if e > 15 || (e == 15 && q == 7) {
            return sign | 0x7E;
        }
        sign | ((e as u8) << 3) | q as u8
    }

    /// Every sign, exponent and top 11 mantissa bits (where e4m3 keeps its 3 and where its
    /// ties lie, bit 19) with 8 patterns of the low 12 (zero, one, around their middle, all
    /// ones, two others): the same code as the oracle. (Every f32 was checked once: docs/tuning.md.)
    #[test]
    fn from_f32_gives_the_oracles_code() {
        let mut checked = 0u64;
        for hi in 0..=0xF_FFFFu32 {
            for lo in [0u32, 1, 0x7FF, 0x800, 0x801, 0xFFF, 0x123, 0xA5A] {
                let x = f32::from_bits(hi << 12 | lo);
                assert_eq!(F8E4M3::from_f32(x).0, from_f32_by_cases(x), "{x:e} ({:#010x})", x.to_bits());
                checked += 1;
            }
        }
        assert_eq!(checked, 8 << 20);
    }

    /// [`F8E4M3::round`] against the code's value on the same inputs as the test above.
    #[test]
    fn round_is_the_value_of_the_code() {
        for hi in 0..=0xF_FFFFu32 {
            for lo in [0u32, 0x7FF, 0x800, 0xFFF] {
                let x = f32::from_bits(hi << 12 | lo);
                if x.is_finite() {
                    let want = F8E4M3::from_f32(x).to_f32();
                    assert_eq!(F8E4M3::round(x).to_bits(), want.to_bits(), "{x:e} ({:#010x})", x.to_bits());
                }
            }
        }
    }

    #[test]
    fn every_code_has_its_e4m3_value() {
        for b in 0..=255u8 {
            let (e, m) = (i32::from((b >> 3) & 0x0F), f64::from(b & 0x07));
            let mag = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
            let want = if b & 0x80 != 0 { -mag } else { mag };
            let got = F8E4M3(b).to_f32();
            if b & 0x7F == 0x7F {
                assert!(got.is_nan(), "code {b:#04x}: {got}");
            } else {
                assert_eq!(got.to_bits(), (want as f32).to_bits(), "code {b:#04x}: {got} against {want}");
            }
        }
    }

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0..=255u8 {
            let v = F8E4M3(b).to_f32();
            if v.is_nan() {
                assert_eq!(b & 0x7F, 0x7F);
                continue;
            }
            let back = F8E4M3::from_f32(v);
            // -0 and +0 are distinct codes and both round-trip.
            assert_eq!(back.0, b, "code {b:#04x} value {v}");
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(F8E4M3(0x7E).to_f32(), 448.0);
        assert_eq!(F8E4M3(0x01).to_f32(), 1.0 / 512.0);
        assert_eq!(F8E4M3(0x38).to_f32(), 1.0);
        assert_eq!(F8E4M3::from_f32(1e9).0, 0x7E);
        assert_eq!(F8E4M3::from_f32(-1e9).0, 0xFE);
        assert_eq!(F8E4M3::from_f32(f32::INFINITY).0, 0x7E);
        // 1.0625 is halfway between 1.0 and 1.125: ties to even (1.0).
        assert_eq!(F8E4M3::from_f32(1.0625).to_f32(), 1.0);
        // 1.1875 is halfway between 1.125 and 1.25: ties to even (1.25).
        assert_eq!(F8E4M3::from_f32(1.1875).to_f32(), 1.25);
    }

    #[test]
    fn rounding_is_nearest_against_brute_force() {
        let finite: alloc::vec::Vec<f32> = (0..=0x7Eu8).map(|b| F8E4M3(b).to_f32()).collect();
        let mut x = 0.0f32;
        while x < 460.0 {
            let got = F8E4M3::from_f32(x).to_f32();
            let best =
                finite.iter().copied().min_by(|a, b| (a - x).abs().partial_cmp(&(b - x).abs()).unwrap()).unwrap();
            assert!((got - x).abs() <= (best - x).abs(), "x={x} got={got} best={best}");
            x += 0.013;
        }
    }
}
