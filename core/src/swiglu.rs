//! SwiGLU as KT computes it: gate and up results rounded to bf16, `silu(g)·u` in f32 with
//! `silu(g) = g / (1 + exp(-g))` (`-g` clamped to 88 as KT's `act_fn`), the result rounded to bf16.
//! [`Glu`] adds KT's clamped variants (its `swiglu_limit` and `swiglu_alpha`).
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

/// The gated activation of a layer: plain SwiGLU, or KT's clamped variants. With `limit > 0`
/// the gate is clamped to at most `limit` and up to `[-limit, limit]`, then `silu(g)·u`; with
/// `alpha > 0` ("swigluoai", MiniMax-M3) both are clamped to `[-limit, limit]` (when `limit > 0`)
/// and the result is `g·sigmoid(alpha·g)·(u + 1)`. Kept as bits so configs stay `Eq`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Glu {
    limit: u32,
    alpha: u32,
}

impl Glu {
    /// Plain SwiGLU.
    pub const SILU: Glu = Glu { limit: 0, alpha: 0 };

    /// KT's `swiglu_limit` and `swiglu_alpha` (0 = off); `None` if either is negative or not finite.
    pub fn new(limit: f32, alpha: f32) -> Option<Glu> {
        let ok = |x: f32| x.is_finite() && x >= 0.0;
        (ok(limit) && ok(alpha)).then(|| Glu { limit: (limit + 0.0).to_bits(), alpha: (alpha + 0.0).to_bits() })
    }

    /// The clamp limit (0 = none).
    pub fn limit(self) -> f32 {
        f32::from_bits(self.limit)
    }

    /// The sigmoid slope of the "swigluoai" form (0 = plain SiLU form).
    pub fn alpha(self) -> f32 {
        f32::from_bits(self.alpha)
    }

    /// Plain SwiGLU: backends use their fused fast path.
    pub fn is_silu(self) -> bool {
        self == Self::SILU
    }

    /// `bf16(act(bf16(g), bf16(u)))` per the type's docs.
    #[inline]
    pub fn apply(self, g: f32, u: f32) -> bf16 {
        if self.is_silu() {
            return swiglu(g, u);
        }
        let (mut g, mut u) = (bf16::from_f32(g).to_f32(), bf16::from_f32(u).to_f32());
        let (limit, alpha) = (self.limit(), self.alpha());
        if limit > 0.0 {
            g = if alpha > 0.0 { g.clamp(-limit, limit) } else { g.min(limit) };
            u = u.clamp(-limit, limit);
        }
        let v = if alpha > 0.0 { g / (1.0 + libm::expf((-alpha * g).min(88.0))) * (u + 1.0) } else { silu(g) * u };
        bf16::from_f32(v)
    }
}

impl Glu {
    /// `(dg, du)` of [`Glu::apply`]'s value at the bf16 `g`, `u` it saw, given `dh`: zero
    /// through a clamp that held (the gate above `limit`, up outside `±limit`), as torch's clamp
    /// passes gradients only inside its bounds.
    #[inline]
    pub fn backward(self, g: f32, u: f32, dh: f32) -> (f32, f32) {
        let sigmoid = |x: f32| 1.0 / (1.0 + libm::expf((-x).min(88.0)));
        if self.is_silu() {
            let s = sigmoid(g);
            return (dh * u * s * (1.0 + g * (1.0 - s)), dh * silu(g));
        }
        let (limit, alpha) = (self.limit(), self.alpha());
        let clamps = limit > 0.0;
        let low = if alpha > 0.0 { -limit } else { f32::NEG_INFINITY };
        let (gc, uc) = if clamps { (g.clamp(low, limit), u.clamp(-limit, limit)) } else { (g, u) };
        let pass_g = if !clamps || (low..=limit).contains(&g) { 1.0 } else { 0.0 };
        let pass_u = if !clamps || (-limit..=limit).contains(&u) { 1.0 } else { 0.0 };
        if alpha > 0.0 {
            let s = sigmoid(alpha * gc);
            (pass_g * dh * (uc + 1.0) * s * (1.0 + alpha * gc * (1.0 - s)), pass_u * dh * gc * s)
        } else {
            let s = sigmoid(gc);
            (pass_g * dh * uc * s * (1.0 + gc * (1.0 - s)), pass_u * dh * silu(gc))
        }
    }
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

    #[test]
    fn clamped_variants() {
        assert_eq!(Glu::new(0.0, 0.0), Some(Glu::SILU));
        assert_eq!(Glu::new(-1.0, 0.0), None);
        assert_eq!(Glu::new(f32::NAN, 0.0), None);
        let limited = Glu::new(7.0, 0.0).unwrap();
        assert_eq!(limited.apply(10.0, 9.0), swiglu(7.0, 7.0));
        assert_eq!(limited.apply(-10.0, -9.0), swiglu(-10.0, -7.0), "the gate is clamped from above only");
        let oai = Glu::new(7.0, 1.702).unwrap();
        let want = |g: f32, u: f32| bf16::from_f32(g / (1.0 + libm::expf(-1.702 * g)) * (u + 1.0));
        assert_eq!(oai.apply(10.0, -9.0), want(7.0, -7.0));
        assert_eq!(oai.apply(-10.0, 0.5), want(-7.0, 0.5));
        assert_eq!(Glu::new(0.0, 1.702).unwrap().apply(30.0, 2.0), want(30.0, 2.0), "no clamp without a limit");
    }
}
