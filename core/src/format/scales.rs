//! How a quantizer picks the scale of each row, K-group or block: `absmax` (KT's rule, the
//! largest magnitude onto the grid's top level; `kt convert` writes KT's exact bytes with it) or
//! `mse` (the scale of least squared error on the format's own grid). Either way the bytes are
//! in the format's layout, so every kernel, KT's included, reads them unchanged.
//!
//! Squared error because a layer's output error is the weights': for activations uncorrelated
//! along K, `E‖ΔW·x‖² = σ²·‖ΔW‖²`. The search tries absmax's scale, a ladder of smaller ones
//! ([`Grid::LADDER`]), a few around the ladder's best ([`Grid::LOCAL`]) and then least-squares
//! refits (the best candidate's codes held, `s = Σx·c / Σc²`), each candidate as the format
//! stores it and scored by quantizing with the format's own rounding. Few candidates, so that `kt convert` stays near twice its absmax
//! time (docs/accuracy.md has the numbers and what a finer search would gain).

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

    /// The scale for weights `xs` (one row, or a block's row slices) given absmax's: absmax's,
    /// or the search's under [`Scales::Mse`].
    pub(crate) fn pick<G: Grid>(self, xs: &[&[f32]], absmax: f32) -> f32 {
        match self {
            Scales::Absmax => absmax,
            Scales::Mse => search::<G>(&[absmax; W], |s| fit_shared::<G>(xs, s))[0],
        }
    }

    /// [`Scales::pick`] for each K-group of `group` columns of `row`: `scales` holds absmax's
    /// and gets the chosen ones.
    pub(crate) fn pick_groups<G: Grid>(self, row: &[f32], group: usize, scales: &mut [f32]) {
        if self == Scales::Absmax {
            return;
        }
        // Eight groups transposed into lanes: vector i holds column i of each.
        let mut lanes = alloc::vec![[0.0f32; W]; group];
        for (g0, s) in (0..scales.len()).step_by(W).zip(scales.chunks_mut(W)) {
            for (l, x) in row[g0 * group..].chunks(group).take(s.len()).enumerate() {
                for (v, &x) in lanes.iter_mut().zip(x) {
                    v[l] = x;
                }
            }
            for v in lanes.iter_mut() {
                v[s.len()..].fill(0.0);
            }
            let s0: Lanes = core::array::from_fn(|l| s.get(l).copied().unwrap_or(0.0));
            let chosen = search::<G>(&s0, |sc| {
                let (mut sums, mut acc) = (Sums::default(), [[0.0f32; W]; 3]);
                let inv: Lanes = core::array::from_fn(|l| fit_inverse::<G>(sc[l]));
                accumulate::<G>(&lanes, &inv, &mut acc);
                sums.add(&mut acc, sc, &inv);
                sums
            });
            s.copy_from_slice(&chosen[..s.len()]);
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
    /// Factors of the ladder's best scale tried next (a lane's own), before the refits: the
    /// error has many local minima in the scale, and the refits only find the nearest.
    const LOCAL: &'static [f32] = &[];
    /// Least-squares refits at most (each stops the search when it does not improve).
    const REFITS: usize;
    /// Whether a fit makes a block's codes before their sums (two loops): faster where
    /// [`Grid::nearest`] is costly (the float grids), slower for the integer ones.
    const CODES_FIRST: bool = false;
    /// The largest magnitude [`Grid::nearest`] gives: a scale times it must be a finite f32,
    /// as the weights dequantize.
    const LARGEST: f32;
    /// The grid value nearest `v` (a weight divided by the scale), as the format rounds it and
    /// within the codes the format's kernels take.
    fn nearest(v: f32) -> f32;
    /// A scale as the format stores it.
    fn stored(s: f32) -> f32 {
        s
    }
}

/// Weights a fit handles side by side: lane `l` of each vector is one weight. For a row or
/// block (one scale) the lanes are neighbouring columns and their sums are added at the end;
/// for K-groups each lane is a group of its own (its own scale and sums, no sum across lanes),
/// so a row's groups are searched eight at a time without a horizontal sum per group.
const W: usize = 8;
type Lanes = [f32; W];

/// What quantizing with one scale per lane gives: the squared error and the sums the
/// least-squares scale of those codes needs, per lane.
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    err: [f64; W],
    xc: [f64; W],
    cc: [f64; W],
}

/// The relative gain below which refits stop.
const REFIT_GAIN: f64 = 1e-3;

/// Adds the fit of vectors `v` at per-lane scales of inverse `inv` to f32 lane sums `acc`, in units
/// of the scale (squared error, Σu·c, Σc² for u = x · inv).
#[inline(always)]
fn accumulate<G: Grid>(v: &[Lanes], inv: &Lanes, acc: &mut [Lanes; 3]) {
    // In units of the scale (`u = x / s`): no scale in the loop.
    let sums = |acc: &mut [Lanes; 3], u: &Lanes, c: &Lanes| {
        for l in 0..W {
            let d = u[l] - c[l];
            acc[0][l] += d * d;
        }
        for l in 0..W {
            acc[1][l] += u[l] * c[l];
        }
        for l in 0..W {
            acc[2][l] += c[l] * c[l];
        }
    };
    if !G::CODES_FIRST {
        for x in v {
            let u: Lanes = core::array::from_fn(|l| x[l] * inv[l]);
            sums(acc, &u, &core::array::from_fn(|l| G::nearest(u[l])));
        }
        return;
    }
    let mut codes = [[0.0f32; W]; 8];
    for v in v.chunks(8) {
        for (c, x) in codes.iter_mut().zip(v) {
            *c = core::array::from_fn(|l| G::nearest(x[l] * inv[l]));
        }
        for (c, x) in codes.iter().zip(v) {
            sums(acc, &core::array::from_fn(|l| x[l] * inv[l]), c);
        }
    }
}

impl Sums {
    /// Adds f32 lane sums in units of `scale` (clearing them), in the weights' units: short sums
    /// stay in f32, totals in f64. A scale without a finite inverse quantizes everything to
    /// zero, which the sums would not show: its error is infinite.
    fn add(&mut self, acc: &mut [Lanes; 3], scale: &Lanes, inv: &Lanes) {
        let [err, uc, cc] = core::mem::take(acc);
        for l in 0..W {
            let s = f64::from(scale[l]);
            let usable = scale[l] == 0.0 || inv[l] != 0.0;
            self.err[l] += if usable { f64::from(err[l]) * s * s } else { f64::INFINITY };
            self.xc[l] += f64::from(uc[l]) * s;
            self.cc[l] += f64::from(cc[l]);
        }
    }

    /// Every lane holding the sum over all lanes.
    fn summed(self) -> Sums {
        let all = |a: [f64; W]| [a.iter().sum::<f64>(); W];
        Sums { err: all(self.err), xc: all(self.xc), cc: all(self.cc) }
    }
}

/// The inverse a fit quantizes with: 0, an unusable scale ([`Sums::add`]: infinite error), where
/// the grid's largest value times `s` is no finite f32 (such weights would dequantize to
/// infinity).
fn fit_inverse<G: Grid>(s: f32) -> f32 {
    if (G::LARGEST * s).is_finite() {
        inverse(s)
    } else {
        0.0
    }
}

/// One scale over row slices `xs` (a row, or a block's rows); every lane holds the totals.
fn fit_shared<G: Grid>(xs: &[&[f32]], scale: &Lanes) -> Sums {
    let inv: Lanes = core::array::from_fn(|l| fit_inverse::<G>(scale[l]));
    let (mut sums, mut acc) = (Sums::default(), [[0.0f32; W]; 3]);
    for x in xs {
        let whole = x.len() / W * W;
        accumulate::<G>(bytemuck::cast_slice(&x[..whole]), &inv, &mut acc);
        if whole < x.len() {
            // Zeros add nothing to any sum.
            let mut tail = [0.0f32; W];
            tail[..x.len() - whole].copy_from_slice(&x[whole..]);
            accumulate::<G>(&[tail], &inv, &mut acc);
        }
        // Into f64 per slice: the f32 sums stay short.
        sums.add(&mut acc, scale, &inv);
    }
    sums.summed()
}

/// Per-lane scales `s0` (absmax's) searched with `fit`: the chosen scale of each lane, absmax's
/// where no candidate beats it by [`MARGIN`].
fn search<G: Grid>(s0: &Lanes, fit: impl Fn(&Lanes) -> Sums) -> Lanes {
    let base = fit(s0);
    let (mut scale, mut best) = (*s0, base);
    let take = |scale: &mut Lanes, best: &mut Sums, l: usize, s: f32, c: &Sums| {
        scale[l] = s;
        (best.err[l], best.xc[l], best.cc[l]) = (c.err[l], c.xc[l], c.cc[l]);
    };
    // Down the ladder while the error falls (it rises again past the best scale): a lane does
    // not take a smaller factor than one that lost for it.
    let mut floor = [0.0f32; W];
    for &f in G::LADDER {
        if floor.iter().all(|&x| f <= x) {
            continue;
        }
        let s: Lanes = core::array::from_fn(|l| G::stored(s0[l] * f));
        let c = fit(&s);
        for l in 0..W {
            if f <= floor[l] {
                continue;
            }
            if c.err[l] < best.err[l] {
                take(&mut scale, &mut best, l, s[l], &c);
            } else if f < 1.0 {
                floor[l] = f;
            }
        }
    }
    let center = scale;
    for &f in G::LOCAL {
        let s: Lanes = core::array::from_fn(|l| G::stored(center[l] * f));
        let c = fit(&s);
        for (l, &s) in s.iter().enumerate() {
            if c.err[l] < best.err[l] {
                take(&mut scale, &mut best, l, s, &c);
            }
        }
    }
    let mut done = [false; W];
    for _ in 0..G::REFITS {
        let s: Lanes = core::array::from_fn(|l| G::stored((best.xc[l] / best.cc[l]) as f32));
        for l in 0..W {
            done[l] |= best.cc[l] == 0.0 || !(s[l].is_finite() && s[l] > 0.0) || s[l] == scale[l];
        }
        if done.iter().all(|&d| d) {
            break;
        }
        let c = fit(&s);
        for l in 0..W {
            if done[l] {
                continue;
            }
            if c.err[l] >= best.err[l] {
                done[l] = true;
                continue;
            }
            // A refit that gained little is near the fixed point: another would gain less.
            done[l] = c.err[l] > best.err[l] * (1.0 - REFIT_GAIN);
            take(&mut scale, &mut best, l, s[l], &c);
        }
    }
    let beaten = |l: usize| base.err[l].is_finite() && best.err[l] < base.err[l] * (1.0 - MARGIN);
    core::array::from_fn(|l| if beaten(l) { scale[l] } else { s0[l] })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Integers -7..=7.
    struct Sym7;
    impl Grid for Sym7 {
        const LADDER: &'static [f32] = &[0.85, 0.7, 0.55];
        const REFITS: usize = 3;
        const LARGEST: f32 = 7.0;
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
