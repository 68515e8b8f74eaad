//! How a quantizer picks the scale of each row, K-group or block: `absmax` (KT's rule, the
//! largest magnitude onto the grid's top level; `kt convert` writes KT's exact bytes with it) or
//! `mse` (the scale of least squared error on the format's own grid). Either way the bytes are
//! in the format's layout, so every kernel, KT's included, reads them unchanged.
//!
//! Squared error because a layer's output error is the weights': for activations uncorrelated
//! along K, `E‖ΔW·x‖² = σ²·‖ΔW‖²`. The search tries absmax's scale, a ladder of smaller ones
//! ([`Grid::LADDER`]) and then least-squares refits (the best candidate's codes held,
//! `s = Σx·c / Σc²`), each candidate as the format stores it and scored by quantizing with the
//! format's own rounding. Few candidates keep `kt convert` within twice its absmax time; a finer
//! ladder gained under 1% (docs/accuracy.md).

use core::fmt;

use super::{inverse, WeightFormat};
use crate::Error;

/// How each row's, group's or block's scale is chosen when quantizing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scales {
    /// KT's rule: the largest magnitude maps to the grid's top level (KT's bytes exactly).
    #[default]
    Absmax,
    /// The scale with the least squared weight error on the format's grid; absmax's where no
    /// candidate beats it by [`MARGIN`].
    Mse,
}

impl Scales {
    /// The names [`Scales::parse`] accepts, for error messages.
    pub const NAMES: &'static str = "absmax, mse";

    /// Parse `absmax` or `mse` (case and surrounding space ignored).
    pub fn parse(s: &str) -> Option<Scales> {
        match s.trim().to_ascii_lowercase().as_str() {
            "absmax" => Some(Scales::Absmax),
            "mse" => Some(Scales::Mse),
            _ => None,
        }
    }

    /// Whether `format` takes these scales: [`Scales::Mse`] is refused for bf16 (no scales)
    /// and the GGML types (their quantizers pick their own).
    pub fn check(self, format: WeightFormat) -> Result<(), Error> {
        if self == Scales::Absmax || format.searches_scales() {
            return Ok(());
        }
        Err(Error::UnsupportedFormat {
            format,
            context: "with scales \"mse\": it chooses the scales of int8, int4, int4-gG, fp8, fp8-channel, \
                      mxfp4 and mxfp8 (bf16 has none; GGML types' quantizers pick their own)",
        })
    }

    /// The scale for weights `xs` (one row, group, or a block's row slices) given absmax's:
    /// absmax's, or the search's under [`Scales::Mse`].
    pub(crate) fn pick<G: Grid>(self, xs: &[&[f32]], absmax: f32) -> f32 {
        match self {
            Scales::Absmax => absmax,
            Scales::Mse => search::<G>(xs, absmax).unwrap_or(absmax),
        }
    }
}

impl fmt::Display for Scales {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scales::Absmax => "absmax",
            Scales::Mse => "mse",
        })
    }
}

/// How much lower (relatively) a candidate's error must be to replace absmax's scale: above the
/// f32 summation's rounding, so a row never ends with more error than absmax's (property-tested
/// in f64), and a gain this small is not worth leaving KT's bytes for.
pub const MARGIN: f64 = 1e-3;

/// A format's element grid, as the search sees it.
pub(crate) trait Grid {
    /// Factors of absmax's scale tried before the refits.
    const LADDER: &'static [f32];
    /// Least-squares refits at most (each stops the search when it does not improve).
    const REFITS: usize;
    /// The grid value nearest `v` (a weight divided by the scale), as the format rounds it and
    /// within the codes the format's kernels take.
    fn nearest(v: f32) -> f32;
    /// A scale as the format stores it.
    fn stored(s: f32) -> f32 {
        s
    }
}

/// What quantizing some weights with one scale gives: the squared error and the sums the
/// least-squares scale of those codes needs.
#[derive(Clone, Copy, Debug)]
struct Fit {
    scale: f32,
    err: f64,
    xc: f64,
    cc: f64,
}

/// The relative gain below which refits stop.
const REFIT_GAIN: f64 = 1e-3;

/// Lanes of the f32 partial sums (vectorizable; summed in f64 per slice).
const LANES: usize = 8;
/// Weights whose codes are made before their sums are taken.
const BLOCK: usize = 64;

fn fit<G: Grid>(xs: &[&[f32]], scale: f32) -> Fit {
    let inv = inverse(scale);
    let mut acc = Lanes::default();
    let (mut err, mut xc, mut cc) = (0.0f64, 0.0f64, 0.0f64);
    // Codes a block at a time, then the sums over them: two loops the compiler vectorizes,
    // where one loop doing both stays mostly scalar.
    let (mut codes, mut padded) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
    for x in xs {
        for blk in x.chunks(BLOCK) {
            let blk = if blk.len() % LANES == 0 {
                blk
            } else {
                // Zeros add nothing to any sum.
                let n = blk.len().next_multiple_of(LANES);
                padded[..n].fill(0.0);
                padded[..blk.len()].copy_from_slice(blk);
                &padded[..n]
            };
            for (c, &v) in codes.iter_mut().zip(blk) {
                *c = G::nearest(v * inv);
            }
            acc.add(blk, &codes[..blk.len()], scale);
        }
        // Into f64 per slice (a block's rows, or one row or group): the f32 sums stay short.
        let (e, p, q) = acc.take();
        (err, xc, cc) = (err + e, xc + p, cc + q);
    }
    Fit { scale, err, xc, cc }
}

/// Per-lane f32 partial sums of [`fit`].
#[derive(Default)]
struct Lanes {
    err: [f32; LANES],
    xc: [f32; LANES],
    cc: [f32; LANES],
}

impl Lanes {
    /// The three sums, the lanes cleared.
    fn take(&mut self) -> (f64, f64, f64) {
        // Lanes halved pairwise in f32, then widened: three roundings on sums already in f32.
        let total = |a: &mut [f32; LANES]| {
            let mut v = core::mem::take(a);
            let mut n = LANES;
            while n > 1 {
                n /= 2;
                for l in 0..n {
                    v[l] += v[l + n];
                }
            }
            f64::from(v[0])
        };
        (total(&mut self.err), total(&mut self.xc), total(&mut self.cc))
    }

    #[inline(always)]
    fn add(&mut self, x: &[f32], codes: &[f32], scale: f32) {
        for (x, c) in x.chunks_exact(LANES).zip(codes.chunks_exact(LANES)) {
            for l in 0..LANES {
                let d = x[l] - c[l] * scale;
                self.err[l] += d * d;
            }
            for l in 0..LANES {
                self.xc[l] += x[l] * c[l];
            }
            for l in 0..LANES {
                self.cc[l] += c[l] * c[l];
            }
        }
    }
}

/// The searched scale, or `None` where none beats absmax's by [`MARGIN`].
fn search<G: Grid>(xs: &[&[f32]], absmax: f32) -> Option<f32> {
    let base = fit::<G>(xs, absmax);
    if base.err == 0.0 {
        return None;
    }
    let mut best = base;
    // Down the ladder while the error falls (it rises again past the best scale): a smaller
    // factor than one that lost is not tried.
    let mut floor = 0.0;
    for &f in G::LADDER {
        if f <= floor {
            continue;
        }
        let c = fit::<G>(xs, G::stored(absmax * f));
        if c.err < best.err {
            best = c;
        } else if f < 1.0 {
            floor = f;
        }
    }
    for _ in 0..G::REFITS {
        let s = G::stored((best.xc / best.cc) as f32);
        if best.cc == 0.0 || !(s.is_finite() && s > 0.0) || s == best.scale {
            break;
        }
        let c = fit::<G>(xs, s);
        if c.err >= best.err {
            break;
        }
        // A refit that gained little is near the fixed point: another would gain less.
        let small = c.err > best.err * (1.0 - REFIT_GAIN);
        best = c;
        if small {
            break;
        }
    }
    (best.err < base.err * (1.0 - MARGIN)).then_some(best.scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Integers -7..=7.
    struct Sym7;
    impl Grid for Sym7 {
        const LADDER: &'static [f32] = &[0.85, 0.7, 0.55];
        const REFITS: usize = 3;
        fn nearest(v: f32) -> f32 {
            libm::rintf(v).clamp(-7.0, 7.0)
        }
    }

    fn err(x: &[f32], s: f32) -> f64 {
        x.iter().map(|&v| (f64::from(v) - f64::from(Sym7::nearest(v / s) * s)).powi(2)).sum()
    }

    #[test]
    fn names_round_trip() {
        for s in [Scales::Absmax, Scales::Mse] {
            assert_eq!(Scales::parse(&alloc::format!(" {s} ")), Some(s));
        }
        assert_eq!(Scales::parse("MSE"), Some(Scales::Mse));
        assert_eq!(Scales::parse("l2"), None);
    }

    /// A Gaussian row: absmax spends the grid's top levels on a few weights; the search
    /// gives a smaller scale and less error.
    #[test]
    fn a_gaussian_row_gets_a_smaller_scale_with_less_error() {
        let mut r = crate::rng::SplitMix64::new(7);
        let x: alloc::vec::Vec<f32> = (0..256).map(|_| r.gaussian()).collect();
        let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 7.0;
        let s = Scales::Mse.pick::<Sym7>(&[&x], absmax);
        assert!(s < absmax, "{s} vs {absmax}");
        assert!(err(&x, s) < err(&x, absmax) * 0.8, "{} vs {}", err(&x, s), err(&x, absmax));
        assert_eq!(Scales::Absmax.pick::<Sym7>(&[&x], absmax), absmax);
    }

    /// Values on absmax's grid: nothing beats it, absmax's scale stays (and a zero row's).
    #[test]
    fn exact_rows_keep_absmax() {
        let x: alloc::vec::Vec<f32> = (-7..=7).map(|i| i as f32 * 0.5).collect();
        assert_eq!(Scales::Mse.pick::<Sym7>(&[&x], 0.5), 0.5);
        assert_eq!(Scales::Mse.pick::<Sym7>(&[&[0.0; 8]], 0.0), 0.0);
    }
}
