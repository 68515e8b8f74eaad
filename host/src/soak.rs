//! `kt soak`: many forwards of [`MoeLayer`]s as a server makes them, hours long if asked, to
//! catch what a unit test cannot: memory that grows, descriptors that leak, results that drift.
//! Several layers, random routing (invalid ids and duplicate experts included), token counts
//! from 1 to `max_tokens`, each layer's GPU mask flipped between two states. Every output is
//! compared bit for bit with the first forward of the same inputs (made during the warm-up,
//! which also reaches every buffer size), and RSS and open descriptors are reported every
//! `report_every` forwards.

use std::collections::HashMap;
use std::time::Instant;

use half::bf16;
use kt_core::rng::SplitMix64;
use kt_core::{MoeConfig, WeightFormat};

use crate::bench::synth;
use crate::layer::{LayerOptions, MoeLayer};

/// What to run.
#[derive(Clone, Debug)]
pub struct SoakSpec {
    /// Layer shape (`max_tokens` bounds the token count of a forward).
    pub cfg: MoeConfig,
    /// Weight format.
    pub format: WeightFormat,
    /// Layers, each with its own weights.
    pub layers: usize,
    /// Distinct inputs (token count, routing) per layer.
    pub cases: usize,
    /// Stop after this many forwards after the warm-up ...
    pub forwards: usize,
    /// ... or after this many seconds, whichever comes first.
    pub seconds: f64,
    /// Forwards between two reports.
    pub report_every: usize,
    /// RSS growth after the warm-up that fails the run, bytes.
    pub max_rss_growth: u64,
    /// Growth of open file descriptors after the warm-up that fails the run.
    pub max_fd_growth: usize,
    /// Seed of weights, inputs and the order of forwards.
    pub seed: u64,
}

/// A report line: where the run stands.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SoakPoint {
    /// Forwards checked so far (after the warm-up).
    pub forwards: usize,
    /// Since the warm-up ended.
    pub seconds: f64,
    /// Resident set, bytes.
    pub rss: u64,
    /// Open file descriptors.
    pub fds: usize,
}

impl std::fmt::Display for SoakPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rate = self.forwards as f64 / self.seconds.max(1e-9);
        write!(
            f,
            "{} forwards, {rate:.0}/s, RSS {:.1} MiB, {} open fds",
            self.forwards,
            self.rss as f64 / (1u64 << 20) as f64,
            self.fds
        )
    }
}

/// Resident set size of this process, bytes (0 where /proc is not there).
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// One forward's inputs.
struct Case {
    input: Vec<bf16>,
    ids: Vec<i64>,
    weights: Vec<f32>,
}

fn point(forwards: usize, since: Instant) -> SoakPoint {
    SoakPoint { forwards, seconds: since.elapsed().as_secs_f64(), rss: rss_bytes(), fds: open_fds() }
}

/// Run the soak; `report` gets the state after the warm-up and every `report_every` forwards.
/// Returns the first and last points, or what went wrong (a differing output, RSS growth, a
/// forward error).
pub fn soak(
    spec: &SoakSpec,
    opts: &LayerOptions,
    mut report: impl FnMut(&SoakPoint),
) -> Result<[SoakPoint; 2], String> {
    let cfg = &spec.cfg;
    let (h, k, e) = (cfg.hidden, cfg.top_k, cfg.experts);
    let layers = (0..spec.layers)
        .map(|l| MoeLayer::from_f32(cfg, spec.format, |x| Some(synth::expert(cfg, spec.seed, l, x)), opts))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("building the layers: {err}"))?;
    let mut rng = SplitMix64::new(spec.seed);
    let cases: Vec<Case> = (0..spec.cases)
        .map(|c| {
            // Token counts 1..=max_tokens, the first case the largest (all buffers reached).
            let n = if c == 0 { cfg.max_tokens } else { 1 + rng.below(cfg.max_tokens) };
            let ids = (0..n * k)
                .map(|_| match rng.below(40) {
                    0 => -1,
                    1 => (e + rng.below(3)) as i64,
                    _ => rng.below(e) as i64,
                })
                .collect();
            let weights = (0..n * k).map(|_| rng.next_f32()).collect();
            Case { input: synth::input(n, h, rng.next_u64()), ids, weights }
        })
        .collect();
    // Two mask states per layer, flipped in turn; state 0 masks nothing.
    let masks: Vec<[Vec<bool>; 2]> =
        (0..spec.layers).map(|_| [vec![false; e], (0..e).map(|_| rng.below(4) == 0).collect()]).collect();
    let mut out = vec![bf16::ZERO; cfg.max_tokens * h];
    let run = |l: usize, c: usize, m: usize, out: &mut [bf16]| -> Result<(), String> {
        let case = &cases[c];
        let o = &mut out[..case.input.len()];
        layers[l]
            .forward_into(&case.input, &case.ids, &case.weights, Some(&masks[l][m]), o)
            .map_err(|err| format!("layer {l}, case {c}, mask {m}: {err}"))
    };

    // Warm-up: the reference output of every (layer, case, mask).
    let mut reference = HashMap::new();
    for l in 0..spec.layers {
        for c in 0..spec.cases {
            for m in 0..2 {
                run(l, c, m, &mut out)?;
                reference.insert((l, c, m), out[..cases[c].input.len()].to_vec());
            }
        }
    }
    let start = Instant::now();
    let first = point(0, start);
    report(&first);
    let mut done = 0;
    while done < spec.forwards && start.elapsed().as_secs_f64() < spec.seconds {
        let (l, c, m) = (rng.below(spec.layers), rng.below(spec.cases), rng.below(2));
        run(l, c, m, &mut out)?;
        if out[..cases[c].input.len()] != reference[&(l, c, m)][..] {
            return Err(format!("forward {done}: layer {l}, case {c}, mask {m} differs from its first forward"));
        }
        done += 1;
        if done % spec.report_every == 0 {
            report(&point(done, start));
        }
    }
    let last = point(done, start);
    if done % spec.report_every != 0 {
        report(&last);
    }
    let growth = last.rss.saturating_sub(first.rss);
    if growth > spec.max_rss_growth {
        return Err(format!(
            "RSS grew by {:.2} MiB after the warm-up ({} → {} bytes), more than the {:.2} MiB allowed",
            growth as f64 / (1u64 << 20) as f64,
            first.rss,
            last.rss,
            spec.max_rss_growth as f64 / (1u64 << 20) as f64
        ));
    }
    if last.fds.saturating_sub(first.fds) > spec.max_fd_growth {
        return Err(format!("open file descriptors grew from {} to {}", first.fds, last.fds));
    }
    Ok([first, last])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_soak_checks_every_forward_and_reports() {
        let spec = SoakSpec {
            cfg: MoeConfig { max_tokens: 9, ..MoeConfig::new(8, 2, 64, 128) },
            format: WeightFormat::Int8Row,
            layers: 2,
            cases: 5,
            forwards: 300,
            seconds: 60.0,
            report_every: 100,
            // The other tests of this binary allocate and open files at the same time: RSS and
            // descriptors are the process's. `kt soak` (its own process, in the test command's
            // soak smoke) checks both bounds.
            max_rss_growth: u64::MAX,
            max_fd_growth: usize::MAX,
            seed: 3,
        };
        let mut points = Vec::new();
        let [first, last] = soak(&spec, &LayerOptions::threads(2), |p| points.push(*p)).unwrap();
        assert_eq!(points.iter().map(|p| p.forwards).collect::<Vec<_>>(), [0, 100, 200, 300]);
        assert_eq!((first.forwards, last.forwards), (0, 300));
        assert!(first.rss > 0 && first.fds > 0);
    }
}
