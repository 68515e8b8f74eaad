//! SwiGLU as KT computes it: gate and up results rounded to bf16, `silu(g)·u` in f32 with
//! `silu(g) = g / (1 + exp(-g))` (`-g` clamped to 88 as KT's `act_fn`), the result rounded to bf16.
#![forbid(unsafe_code)]

use half::bf16;

/// `silu(g) = g / (1 + e^-g)`.
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + libm::expf((-g).min(88.0)))
}

/// `bf16(silu(bf16(g)) · bf16(u))`.
#[inline]
pub fn swiglu(g: f32, u: f32) -> bf16 {
    let g = bf16::from_f32(g).to_f32();
    let u = bf16::from_f32(u).to_f32();
    bf16::from_f32(silu(g) * u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_points() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        // -g is clamped to 88 before exp, so a very negative g gives a tiny finite value.
        assert!(silu(-200.0).abs() < 1e-30 && silu(-200.0) <= 0.0);
        assert_eq!(swiglu(2.0, 0.0).to_f32(), 0.0);
    }
}
