//! E8M0: an 8-bit power-of-two scale `2^(e-127)` (OCP MX formats); `0xFF` is NaN.

/// One e8m0 scale, stored as its biased exponent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct E8M0(pub u8);

impl E8M0 {
    /// The scale as f32 (`2^-127` is an f32 subnormal, still exact).
    #[inline]
    pub fn to_f32(self) -> f32 {
        match self.0 {
            0xFF => f32::NAN,
            0 => f32::from_bits(0x0040_0000), // 2^-127
            e => f32::from_bits(u32::from(e) << 23),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two() {
        assert_eq!(E8M0(127).to_f32(), 1.0);
        assert_eq!(E8M0(128).to_f32(), 2.0);
        assert_eq!(E8M0(120).to_f32(), 1.0 / 128.0);
        assert_eq!(E8M0(0).to_f32(), libm::exp2f(-127.0));
        assert!(E8M0(255).to_f32().is_nan());
    }
}
