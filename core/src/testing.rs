//! Test helpers and the backend conformance suite (feature `test-util`).
//!
//! A backend crate runs the whole suite with one line:
//! `#[test] fn conformance() { kt_core::testing::conformance(&MY_BACKEND) }`.
//! It compares the backend with the reference backend on the same quantized weights over every
//! format the backend supports and awkward shapes: n = 1, primes, n > E, duplicates, negative
//! and out-of-range ids, masked experts, all-masked tokens, skewed routing, 1 and 2 parts,
//! KT's clamped activations and expert biases.

use alloc::format;
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;

use half::bf16;

use crate::backend::{ActLayout, Instructions, TaskShape};
use crate::bias::ExpertBias;
use crate::forward::{forward, pack_expert_f32, ExpertF32, LayerWeights, Workspace};
use crate::ggml::GgmlType;
use crate::mat::MatMut;
use crate::reference::REFERENCE;
use crate::rng::SplitMix64;
use crate::{
    Backend, Error, Executor, LayerFormat, MoeConfig, PackedMatrix, QuantMatrix, Routing, SerialExecutor, WeightFormat,
};

/// One expert in f32: gate `[I,H]`, up `[I,H]`, down `[H,I]`.
pub type Expert = [Vec<f32>; 3];

/// Gaussian experts, std `1/sqrt(fan_in)` (the DESIGN accuracy setting).
pub fn random_experts(cfg: &MoeConfig, seed: u64) -> Vec<Expert> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    (0..cfg.experts)
        .map(|e| {
            let mut r = SplitMix64::stream(seed, e as u64);
            let mut m = |len: usize, fan_in: usize| {
                let s = 1.0 / libm::sqrtf(fan_in as f32);
                (0..len).map(|_| r.gaussian() * s).collect::<Vec<f32>>()
            };
            [m(i * h, h), m(i * h, h), m(h * i, i)]
        })
        .collect()
}

/// Gaussian hidden states, std 1, rounded to bf16.
pub fn random_input(tokens: usize, hidden: usize, seed: u64) -> Vec<bf16> {
    let mut r = SplitMix64::new(seed);
    (0..tokens * hidden).map(|_| bf16::from_f32(r.gaussian())).collect()
}

pub use crate::rng::random_routing;

/// Quantize and pack every expert with `backend` (serially).
pub fn build_layer(
    backend: &'static dyn Backend,
    cfg: &MoeConfig,
    format: WeightFormat,
    experts: &[Expert],
) -> LayerWeights {
    let mut layer = LayerWeights::empty(cfg, format, backend).expect("valid test config");
    for (e, [g, u, d]) in experts.iter().enumerate() {
        let packed = pack_expert_f32(backend, cfg, format, ExpertF32 { gate: g, up: u, down: d }).expect("pack");
        layer.set_expert(e, packed).expect("packed by the layer's backend");
    }
    layer
}

/// Each expert's matrices quantized to `format` and dequantized again (what the kernels of a
/// layer of `cfg.parts` parts see).
pub fn dequantized(cfg: &MoeConfig, format: WeightFormat, experts: &[Expert]) -> Vec<Expert> {
    experts
        .iter()
        .map(|[g, u, d]| {
            crate::forward::dequantized_expert_f32(cfg, format, ExpertF32 { gate: g, up: u, down: d }).expect("finite")
        })
        .collect()
}

/// The textbook MoE in f64, no intermediate rounding: `Σ_j w·down(silu(gate·x)·(up·x))`.
pub fn textbook_moe(cfg: &MoeConfig, experts: &[Expert], input: &[bf16], routing: &Routing<'_>) -> Vec<f64> {
    textbook(cfg, experts, None, input, routing, false)
}

/// [`textbook_moe`] with expert biases: `Σ_j w·(down(silu(gate·x + b_g)·(up·x + b_u)) + b_d)`.
pub fn textbook_moe_biased(
    cfg: &MoeConfig,
    experts: &[Expert],
    biases: &[ExpertBias],
    input: &[bf16],
    routing: &Routing<'_>,
) -> Vec<f64> {
    textbook(cfg, experts, Some(biases), input, routing, false)
}

/// The magnitude of the textbook MoE's terms, `Σ_j |w|·Σ_i |down|·|silu(g)·u|`: the scale
/// against which rounding of intermediates is judged, robust to outputs that cancel.
pub fn textbook_moe_magnitude(cfg: &MoeConfig, experts: &[Expert], input: &[bf16], routing: &Routing<'_>) -> Vec<f64> {
    textbook(cfg, experts, None, input, routing, true)
}

fn textbook(
    cfg: &MoeConfig,
    experts: &[Expert],
    biases: Option<&[ExpertBias]>,
    input: &[bf16],
    routing: &Routing<'_>,
    magnitude: bool,
) -> Vec<f64> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let mut out = vec![0.0f64; routing.tokens * h];
    for t in 0..routing.tokens {
        let x: Vec<f64> = input[t * h..(t + 1) * h].iter().map(|v| f64::from(v.to_f32())).collect();
        for j in 0..routing.k {
            let Some(e) = routing.expert(t, j, cfg.experts) else { continue };
            let [g, u, d] = &experts[e];
            let b = biases.map(|b| &b[e]);
            let bias = |v: Option<&Vec<f32>>, r: usize| v.map_or(0.0, |v| f64::from(v[r]));
            let dot = |m: &[f32], r: usize, v: &[f64]| -> f64 {
                v.iter().enumerate().map(|(c, vc)| f64::from(m[r * v.len() + c]) * vc).sum()
            };
            let act: Vec<f64> = (0..i)
                .map(|r| {
                    let gv = dot(g, r, &x) + bias(b.map(|b| &b.gate), r);
                    let uv = dot(u, r, &x) + bias(b.map(|b| &b.up), r);
                    gv / (1.0 + libm::exp(-gv)) * uv
                })
                .collect();
            let wt = f64::from(routing.weights[t * routing.k + j]);
            for r in 0..h {
                out[t * h + r] += if magnitude {
                    wt.abs() * act.iter().enumerate().map(|(c, a)| f64::from(d[r * i + c]).abs() * a.abs()).sum::<f64>()
                } else {
                    wt * (dot(d, r, &act) + bias(b.map(|b| &b.down), r))
                };
            }
        }
    }
    out
}

/// mean |out − ref| / mean |ref| (the metric of KT's tests and ours); 0 when both are 0.
pub fn mean_rel_err(out: &[f32], reference: &[f64]) -> f64 {
    let num: f64 = out.iter().zip(reference).map(|(a, b)| (f64::from(*a) - b).abs()).sum();
    let den: f64 = reference.iter().map(|b| b.abs()).sum();
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// The step of the activations `format`'s kernels read, relative to their row's largest value:
/// a backend and the reference may round an intermediate to the other side of one step (their
/// f32 sums run in other orders), and that is all they may differ by. int8 activations
/// (per token, per K-group, or GGML's Q8 blocks) step by 1/127; float activations by bf16's
/// 2^-8 (the SwiGLU output `h` is bf16 for every format).
pub fn act_step(format: WeightFormat) -> f64 {
    let int8 = match format {
        WeightFormat::Ggml(t) => !matches!(t.act(), crate::ggml::ActKind::F32),
        f => f.int_activations(),
    };
    if int8 {
        1.0 / 127.0
    } else {
        1.0 / 256.0
    }
}

/// How many activation steps ([`act_step`]) of its row's RMS one output element may be off
/// the reference by, beyond its own bf16 rounding: about three times the worst element any
/// backend of this workspace reaches over the suite (docs/architecture.md, "Numerics"). One
/// element wrong by its own magnitude is off by tens of steps.
pub const ELEMENT_STEPS: f64 = 2.0;

/// Where `got` strays from `want` (both `[tokens, hidden]`) by more than a layer of
/// `formats` allows element by element: `|got − want| ≤ ELEMENT_STEPS · step · rms(want's row)
/// + 2^-7 · |want|` (one ulp of the output's bf16 rounding: two sums a hair apart may round to
/// neighbouring values), `step` the coarsest of the formats' [`act_step`]. A row of zeros must stay zeros. Returns the worst element as a line.
pub fn element_failure(got: &[f32], want: &[f32], hidden: usize, formats: &[WeightFormat]) -> Option<String> {
    let step = formats.iter().map(|&f| act_step(f)).fold(0.0, f64::max);
    let mut worst: Option<(f64, usize, f32, f32)> = None;
    for (t, (g, w)) in got.chunks(hidden).zip(want.chunks(hidden)).enumerate() {
        let rms = libm::sqrt(w.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / hidden as f64);
        for (c, (&a, &b)) in g.iter().zip(w).enumerate() {
            let off = (f64::from(a) - f64::from(b)).abs();
            let allowed = ELEMENT_STEPS * step * rms + f64::from(b).abs() / 128.0;
            // off in units of the allowance (infinite where nothing may differ).
            let excess = if off == 0.0 {
                0.0
            } else if allowed == 0.0 {
                f64::INFINITY
            } else {
                off / allowed
            };
            if (excess > 1.0 || excess.is_nan()) && worst.is_none_or(|(x, ..)| excess > x) {
                worst = Some((excess, t * hidden + c, a, b));
            }
        }
    }
    worst.map(|(x, at, a, b)| {
        let (t, c) = (at / hidden, at % hidden);
        format!("element [{t}][{c}] {a} against {b}: {x:.1}× its bound")
    })
}

/// Whether `got` fails against `want`: not finite, mean relative error above `mean_limit`, or
/// one element out of [`element_failure`]'s bound. Returns what failed as a line.
pub fn compare(got: &[f32], want: &[f32], hidden: usize, formats: &[WeightFormat], mean_limit: f64) -> Option<String> {
    if let Some(at) = got.iter().position(|v| !v.is_finite()) {
        return Some(format!("element {at} is {}", got[at]));
    }
    let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
    let err = mean_rel_err(got, &want64);
    if err > mean_limit {
        return Some(format!("rel err {err:.3e}"));
    }
    element_failure(got, want, hidden, formats).map(|e| format!("rel err {err:.3e}, {e}"))
}

/// Run one forward on the layer's backend and return the output as f32.
pub fn run(
    exec: &dyn Executor,
    cfg: &MoeConfig,
    layer: &LayerWeights,
    input: &[bf16],
    routing: &Routing<'_>,
) -> Vec<f32> {
    let mut out = vec![bf16::ZERO; routing.tokens * cfg.hidden];
    forward(exec, cfg, layer, input, routing, &mut out, &mut Workspace::default()).expect("forward");
    out.iter().map(|v| v.to_f32()).collect()
}

/// A routing scenario of the conformance suite.
#[derive(Clone, Copy, Debug)]
pub enum Scenario {
    /// Distinct random experts per token.
    Random,
    /// Every slot of every token goes to expert 0 (duplicates included).
    Skewed,
    /// Random, with negative and out-of-range ids sprinkled in.
    InvalidIds,
    /// Random, with half the experts GPU-resident.
    Masked,
    /// Every expert GPU-resident: the output must be exactly zero.
    AllMasked,
}

/// Outputs of `b` on one random layer of `f` (seed 7) for `tokens` random tokens (seed 8)
/// routed as `s` says (seed 9): what tests comparing two backends' bits run.
pub fn layer_outputs(
    b: &'static dyn Backend,
    f: WeightFormat,
    cfg: &MoeConfig,
    tokens: usize,
    s: Scenario,
) -> Vec<f32> {
    let experts = random_experts(cfg, 7);
    let layer = build_layer(b, cfg, f, &experts);
    let input = random_input(tokens, cfg.hidden, 8);
    let (ids, w, mask) = scenario_routing(s, tokens, cfg, 9);
    let r = crate::Routing { tokens, k: cfg.top_k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
    run(&SerialExecutor, cfg, &layer, &input, &r)
}

/// Ids, weights and mask for a scenario.
pub fn scenario_routing(
    s: Scenario,
    tokens: usize,
    cfg: &MoeConfig,
    seed: u64,
) -> (Vec<i64>, Vec<f32>, Option<Vec<bool>>) {
    let (mut ids, w) = random_routing(tokens, cfg.top_k, cfg.experts, seed);
    let mask = match s {
        Scenario::Random => None,
        Scenario::Skewed => {
            ids.iter_mut().for_each(|id| *id = 0);
            None
        }
        Scenario::InvalidIds => {
            for (i, id) in ids.iter_mut().enumerate() {
                match i % 5 {
                    1 => *id = -1,
                    3 => *id = cfg.experts as i64 + i as i64,
                    _ => {}
                }
            }
            None
        }
        Scenario::Masked => Some((0..cfg.experts).map(|e| e % 2 == 1).collect()),
        Scenario::AllMasked => Some(vec![true; cfg.experts]),
    };
    (ids, w, mask)
}

/// Shapes (E, k, H, I) the suite uses for a format: minimal sizes the format allows, odd ones,
/// one where H is not a multiple of the FP8 block, and for a format that allows any K, odd H
/// and I (a K that fills no kernel's unit: bf16 pairs, int8 quads).
pub fn shapes(format: WeightFormat) -> Vec<(usize, usize, usize, usize)> {
    let m = format.col_multiple().max(2);
    let mut v = vec![
        (8, 2, 2 * m, 2 * m),
        (6, 3, 3 * m, 5 * m),
        (1, 1, m, m),
        (9, 4, 160.max(m), 96.max(2 * m)),
        (4, 2, 128, 256),
    ];
    if format.col_multiple() == 1 {
        v.extend([(5, 2, 7, 5), (3, 2, 131, 33)]);
    }
    v
}

/// Compare `backend` with the reference backend on every supported format, shape, token count
/// and scenario, with 1 and 2 parts, and the suite's other sections, to `depth`. Panics listing the failing cases; returns `Err(missing ISA)`
/// without running anything if this CPU cannot run the backend.
pub fn conformance(backend: &'static dyn Backend, depth: Depth) -> Result<(), &'static str> {
    backend.cpu_support()?;
    let mut failures = conformance_failures(backend, &SerialExecutor, depth);
    if depth == Depth::Full {
        failures.extend(ggml_conformance_failures(backend, &SerialExecutor));
        failures.extend(glu_failures(backend, &SerialExecutor));
        failures.extend(bias_failures(backend, &SerialExecutor));
        failures.extend(sum_in_down_failures(backend, &SerialExecutor));
    }
    failures.extend(stored_scale_failures(backend, &SerialExecutor));
    failures.extend(extreme_int4_failures(backend, &SerialExecutor));
    failures.extend(mx_tiny_scale_failures(backend, &SerialExecutor));
    failures.extend(
        accuracy_failures(backend, &SerialExecutor).into_iter().filter(|&(_, err, limit)| err >= limit).map(
            |(f, err, limit)| format!("{} {f}: error {err:.4} against the fp32 MoE, limit {limit}", backend.name()),
        ),
    );
    assert!(failures.is_empty(), "{} conformance failures:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

/// How much of the suite [`conformance`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// Everything.
    Full,
    /// For an emulated CPU (`KT_CONFORMANCE=quick`: scripts/test-aarch64.sh under qemu, tens of
    /// times slower): the main sweep on the three smallest shapes of each format at 1, 3 and 17
    /// tokens, every scenario and both part counts, with the extreme-value, stored-scale,
    /// MX-scale and accuracy checks; the GLU, bias, GGML and sum-in-Down sections, whose code
    /// is the same portable Rust on every CPU, only at full depth.
    Quick,
}

impl Depth {
    /// The depth `KT_CONFORMANCE` names (`quick`; anything else, or unset, is full).
    pub fn named(value: Option<&str>) -> Depth {
        match value {
            Some("quick") => Depth::Quick,
            _ => Depth::Full,
        }
    }
}

/// DESIGN.md's limits: mean relative error against an fp32 MoE on the original Gaussian weights.
pub const ACCURACY_LIMITS: [(WeightFormat, f64); 9] = [
    (WeightFormat::Bf16, 0.01),
    (WeightFormat::Fp8Block, 0.05),
    (WeightFormat::Fp8Channel, 0.05),
    (WeightFormat::Int8Row, 0.04),
    (WeightFormat::Int4Row, 0.30),
    (WeightFormat::Int4Group { group: 32 }, 0.20),
    (WeightFormat::Int4Group { group: 128 }, 0.30),
    (WeightFormat::Mxfp4, 0.30),
    (WeightFormat::Mxfp8, 0.06),
];

/// `(format, error, limit)` of `backend` against an unquantized MoE computed in f64 (E=8, k=2,
/// H=256, I=512, 16 tokens, Gaussian weights and inputs), for every format it supports.
pub fn accuracy_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<(WeightFormat, f64, f64)> {
    let cfg = MoeConfig { max_tokens: 16, ..MoeConfig::new(8, 2, 256, 512) };
    let experts = random_experts(&cfg, 42);
    let input = random_input(16, cfg.hidden, 43);
    let (ids, w) = random_routing(16, cfg.top_k, cfg.experts, 44);
    let r = Routing { tokens: 16, k: 2, ids: &ids, weights: &w, gpu_mask: None };
    let exact = textbook_moe(&cfg, &experts, &input, &r);
    ACCURACY_LIMITS
        .iter()
        .filter(|(f, _)| {
            backend.serves(*f, cfg.intermediate, cfg.hidden) && backend.serves(*f, cfg.hidden, cfg.intermediate)
        })
        .map(|&(f, limit)| {
            let layer = build_layer(backend, &cfg, f, &experts);
            (f, mean_rel_err(&run(exec, &cfg, &layer, &input, &r), &exact), limit)
        })
        .collect()
}

/// Whether `required`, the value of `KT_REQUIRE_ISA` (ISA families separated by commas:
/// `avx2`, `avx512`, `amx`, ..., or `all`), names the family of `missing`, what a test found
/// this CPU lacks ("AVX-512F/BW", "AMX-INT8"...): case, dashes and underscores aside, `missing`
/// contains one of the names.
pub fn isa_required(missing: &str, required: &str) -> bool {
    let squash =
        |s: &str| s.chars().filter(char::is_ascii_alphanumeric).map(|c| c.to_ascii_lowercase()).collect::<String>();
    let missing = squash(missing);
    required.split(',').map(squash).filter(|r| !r.is_empty()).any(|r| r == "all" || missing.contains(&r))
}

/// What a test does where this CPU lacks an instruction set (`missing` describes it): prints
/// "skipped: this CPU lacks {missing}", or panics where `KT_REQUIRE_ISA` names its family
/// ([`isa_required`]), so a run on a machine that has the ISA cannot pass by skipping.
/// A macro: the printing and the environment are the test's (this crate has no `std`).
#[macro_export]
macro_rules! skip_isa {
    ($missing:expr) => {{
        let missing: &str = &$missing;
        let required = ::std::env::var("KT_REQUIRE_ISA").unwrap_or_default();
        if $crate::testing::isa_required(missing, &required) {
            panic!("KT_REQUIRE_ISA={required}, and this CPU lacks {missing}");
        }
        eprintln!("skipped: this CPU lacks {missing}");
    }};
}

/// Returns from the test it is in ([`skip_isa!`]: printing that it was skipped and why, or
/// failing under `KT_REQUIRE_ISA`), unless this CPU runs the backend:
/// `kt_core::skip_unless_runs!(&MY_BACKEND);`
#[macro_export]
macro_rules! skip_unless_runs {
    ($backend:expr) => {
        if let Err(missing) = $crate::Backend::cpu_support($backend) {
            $crate::skip_isa!(missing);
            return;
        }
    };
}

/// One line in a backend crate's tests runs the whole suite, inference and SFT
/// ([`crate::sft::check`]), skipped ([`skip_isa!`]) where the CPU lacks the backend's ISA:
/// `kt_core::conformance_suite!(&MY_BACKEND);`
#[macro_export]
macro_rules! conformance_suite {
    ($backend:expr) => {
        #[test]
        fn conformance() {
            let depth = $crate::testing::Depth::named(::std::env::var("KT_CONFORMANCE").ok().as_deref());
            if let Err(missing) = $crate::testing::conformance($backend, depth) {
                $crate::skip_isa!(missing);
            }
        }

        #[test]
        fn sft_conformance() {
            let backend: &'static dyn $crate::Backend = $backend;
            $crate::skip_unless_runs!(backend);
            let failures = $crate::sft::check::sft_failures(backend, &$crate::SerialExecutor);
            assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
        }
    };
}

/// The failing cases of [`conformance`], each as a line (empty when the backend conforms).
pub fn conformance_failures(backend: &'static dyn Backend, exec: &dyn Executor, depth: Depth) -> Vec<String> {
    let mut failures = Vec::new();
    let scenarios = [Scenario::Random, Scenario::Skewed, Scenario::InvalidIds, Scenario::Masked, Scenario::AllMasked];
    let (shape_count, token_counts): (usize, &[usize]) = match depth {
        Depth::Full => (usize::MAX, &[1, 3, 17, 40]),
        Depth::Quick => (3, &[1, 3, 17]),
    };
    for format in WeightFormat::ALL {
        for (si, (e, k, h, i)) in shapes(format).into_iter().take(shape_count).enumerate() {
            for parts in [1, 2] {
                let cfg = MoeConfig { parts, max_tokens: 64, ..MoeConfig::new(e, k, h, i) };
                if cfg.validate_for(format).is_err()
                    || !backend.serves(format, i, h)
                    || !backend.serves(format, h, i / parts)
                {
                    continue;
                }
                let experts = random_experts(&cfg, 1000 + si as u64);
                let ours = build_layer(backend, &cfg, format, &experts);
                let oracle = build_layer(&REFERENCE, &cfg, format, &experts);
                for &tokens in token_counts {
                    let input = random_input(tokens, h, tokens as u64);
                    for s in scenarios {
                        let (ids, w, mask) = scenario_routing(s, tokens, &cfg, 7 * tokens as u64);
                        let r = Routing { tokens, k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
                        let got = run(exec, &cfg, &ours, &input, &r);
                        let want = run(&SerialExecutor, &cfg, &oracle, &input, &r);
                        let exact_zero = matches!(s, Scenario::AllMasked) && got.iter().any(|&v| v != 0.0);
                        let failed = compare(&got, &want, h, &[format], 1e-2)
                            .or_else(|| exact_zero.then(|| "not all zero".into()));
                        if let Some(why) = failed {
                            failures.push(format!(
                                "{} {format} E{e} k{k} H{h} I{i} parts{parts} n{tokens} {s:?}: {why}",
                                backend.name()
                            ));
                        }
                    }
                }
            }
        }
    }
    failures
}

/// KT's clamped SwiGLU variants ([`crate::swiglu::Glu`]) on every format `backend` serves (and
/// two GGML types), against the reference with the same variant: clamps that bite (limit 0.5
/// on unit-scale gate/up values), with and without the "swigluoai" form.
pub fn glu_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    use crate::swiglu::Glu;
    let mut failures = Vec::new();
    let formats = WeightFormat::ALL.into_iter().chain([GgmlType::Q4_0, GgmlType::Q4_K].map(WeightFormat::Ggml));
    for format in formats {
        let (h, i) = (256, 512);
        if !backend.serves(format, i, h) || !backend.serves(format, h, i) {
            continue;
        }
        for (gi, glu) in [Glu::new(0.5, 0.0), Glu::new(0.5, 1.702)].into_iter().flatten().enumerate() {
            let cfg = MoeConfig { max_tokens: 16, glu, ..MoeConfig::new(6, 2, h, i) };
            let layers = layer_pair(backend, &cfg, format, 5);
            for tokens in [1, 9] {
                if let Some(why) = against_oracle(exec, &cfg, &layers, tokens, 3 + gi as u64) {
                    failures.push(format!("{} {format} {glu:?} n{tokens}: {why}", backend.name()));
                }
            }
        }
    }
    failures
}

/// `backend`'s layer and the reference's of the same random experts of `seed` (GGML-quantized
/// ones for a GGML type).
fn layer_pair(
    backend: &'static dyn Backend,
    cfg: &MoeConfig,
    format: WeightFormat,
    seed: u64,
) -> (LayerWeights, LayerWeights) {
    if let WeightFormat::Ggml(_) = format {
        let build = |b| build_ggml_layer(b, cfg, format.into(), seed).0;
        return (build(backend), build(&REFERENCE));
    }
    let experts = random_experts(cfg, seed);
    (build_layer(backend, cfg, format, &experts), build_layer(&REFERENCE, cfg, format, &experts))
}

/// What fails of the first layer against the second (the reference) on `tokens` random
/// tokens (seed `seed`, k 2 of the first 6 experts): [`compare`] with a mean limit of 1e-2.
fn against_oracle(
    exec: &dyn Executor,
    cfg: &MoeConfig,
    (ours, oracle): &(LayerWeights, LayerWeights),
    tokens: usize,
    seed: u64,
) -> Option<String> {
    let input = random_input(tokens, cfg.hidden, seed);
    let (ids, w) = random_routing(tokens, 2, 6, 11);
    let r = Routing { tokens, k: 2, ids: &ids, weights: &w, gpu_mask: None };
    check(exec, cfg, ours, oracle, &input, &r, 1e-2)
}

/// [`compare`] of `ours` against `oracle` (the reference, run serially) on `input` routed by
/// `r`, the elements bounded by the steps of `ours`' formats.
fn check(
    exec: &dyn Executor,
    cfg: &MoeConfig,
    ours: &LayerWeights,
    oracle: &LayerWeights,
    input: &[bf16],
    r: &Routing<'_>,
    mean_limit: f64,
) -> Option<String> {
    let got = run(exec, cfg, ours, input, r);
    let want = run(&SerialExecutor, cfg, oracle, input, r);
    let f = ours.format;
    compare(&got, &want, cfg.hidden, &[f.gate, f.up, f.down], mean_limit)
}

/// `backend`'s layer and the reference's, of experts whose matrices `matrix(rows, cols)` makes
/// (gate and up `[I, H]`, then down `[H, I]`).
fn quantized_pair(
    backend: &'static dyn Backend,
    cfg: &MoeConfig,
    format: WeightFormat,
    mut matrix: impl FnMut(usize, usize) -> QuantMatrix,
) -> (LayerWeights, LayerWeights) {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let experts: Vec<[QuantMatrix; 3]> = (0..cfg.experts).map(|_| [matrix(i, h), matrix(i, h), matrix(h, i)]).collect();
    let build = |b| build_quantized_layer(b, cfg, format, &experts);
    (build(backend), build(&REFERENCE))
}

/// K-group int4 layers of stored scales that are f16 values, not bf16 (a GPTQ checkpoint's,
/// loaded as stored), and of bf16 ones, on every group `backend` serves: against the reference
/// within 1e-5 at decode and prefill token counts, where scales rounded to bf16 anywhere
/// would be off by ~1e-3.
pub fn stored_scale_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    let mut failures = Vec::new();
    let mut r = SplitMix64::new(23);
    let (h, i) = (256, 128);
    for group in [32u16, 128] {
        let format = WeightFormat::Int4Group { group };
        if !backend.serves(format, i, h) || !backend.serves(format, h, i) {
            continue;
        }
        for f16 in [true, false] {
            let cfg = MoeConfig { max_tokens: 16, ..MoeConfig::new(6, 2, h, i) };
            let matrix = |rows: usize, cols: usize| {
                let data = (0..rows * cols / 2).map(|_| (r.next_u64() & 0xFF) as u8).collect();
                let scales = (0..rows * cols / usize::from(group))
                    .map(|_| 0.004 + r.uniform(0.002).abs())
                    .map(|s| if f16 { half::f16::from_f32(s).to_f32() } else { half::bf16::from_f32(s).to_f32() })
                    .collect();
                QuantMatrix::from_parts(format, rows, cols, data, scales).expect("consistent parts")
            };
            let (ours, oracle) = quantized_pair(backend, &cfg, format, matrix);
            for tokens in [1, 4, 13] {
                let input = random_input(tokens, h, tokens as u64);
                let (ids, w) = random_routing(tokens, 2, 6, 5);
                let rt = Routing { tokens, k: 2, ids: &ids, weights: &w, gpu_mask: None };
                if let Some(why) = check(exec, &cfg, &ours, &oracle, &input, &rt, 1e-5) {
                    let kind = if f16 { "f16" } else { "bf16" };
                    failures.push(format!("{} {format} with {kind} scales n{tokens}: {why}", backend.name()));
                }
            }
        }
    }
    failures
}

/// Layers of every int4 kind whose weights all sit at the level of the largest product (KT's
/// int4 at −8, int4-gG at its nibble 15, mxfp4 at +6), fed constant inputs of either sign, so
/// every activation is ±127 as well: the kernels' narrow integer sums (i16 in `vpmaddubsw`'s
/// pairs, and in several units added before widening) at their bounds, against the reference
/// within 1e-5.
pub fn extreme_int4_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    let mut failures = Vec::new();
    let (h, i) = (256, 128);
    let kinds = [
        (WeightFormat::Int4Row, 0x88u8, 0.01f32),
        (WeightFormat::Int4Group { group: 32 }, 0xFF, 0.01),
        (WeightFormat::Int4Group { group: 128 }, 0xFF, 0.01),
        (WeightFormat::Mxfp4, 0x77, 1.0 / 64.0),
    ];
    for (format, byte, scale) in kinds {
        if !backend.serves(format, i, h) || !backend.serves(format, h, i) {
            continue;
        }
        let cfg = MoeConfig { max_tokens: 16, ..MoeConfig::new(4, 2, h, i) };
        let matrix = |rows: usize, cols: usize| {
            let scales = vec![scale; format.scale_count(rows, cols)];
            QuantMatrix::from_parts(format, rows, cols, vec![byte; rows * cols / 2], scales).expect("consistent parts")
        };
        let (ours, oracle) = quantized_pair(backend, &cfg, format, matrix);
        for (tokens, x) in [(1, 1.0), (1, -1.0), (2, 1.0), (4, -1.0), (13, 1.0)] {
            let input = vec![bf16::from_f32(x); tokens * h];
            let (ids, w) = random_routing(tokens, 2, 4, 3);
            let rt = Routing { tokens, k: 2, ids: &ids, weights: &w, gpu_mask: None };
            if let Some(why) = check(exec, &cfg, &ours, &oracle, &input, &rt, 1e-5) {
                failures.push(format!("{} {format} at its extreme level, x = {x}, n{tokens}: {why}", backend.name()));
            }
        }
    }
    failures
}

/// MX layers in which every seventh row has a block scaled by 2^-122, near e8m0's bottom
/// (mxfp8's elements times it leave bf16's normal range, so the AMX tiles cannot fold those
/// scales into the decoded elements and sum each 32-column group apart), or by 2^-127, e8m0's
/// smallest (a subnormal f32 scale once mxfp4's ½ is folded in, so the AVX-512 kernels keep
/// the codes instead of exponent fields), the rest by 2^-5 to 2^-7, elements random: against
/// the reference within 1e-2 at decode and prefill token counts.
pub fn mx_tiny_scale_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    let mut failures = Vec::new();
    let mut r = SplitMix64::new(29);
    let (h, i) = (256, 128);
    for (format, tiny) in [WeightFormat::Mxfp4, WeightFormat::Mxfp8].into_iter().flat_map(|f| [(f, -122), (f, -127)]) {
        if !backend.serves(format, i, h) || !backend.serves(format, h, i) {
            continue;
        }
        let cfg = MoeConfig { max_tokens: 40, ..MoeConfig::new(6, 2, h, i) };
        let matrix = |rows: usize, cols: usize| {
            let data = (0..format.data_bytes(rows, cols))
                .map(|_| match (r.next_u64() & 0xFF) as u8 {
                    0x7F | 0xFF if format == WeightFormat::Mxfp8 => 0x7E, // (e4m3's NaN codes)
                    b => b,
                })
                .collect();
            let groups = cols / crate::format::mx::MX_BLOCK;
            let scales = (0..rows * groups)
                .map(|at| if at / groups % 7 == 3 && at % groups == 0 { tiny } else { -5 - (at % 3) as i32 })
                .map(crate::format::mx::pow2)
                .collect();
            QuantMatrix::from_parts(format, rows, cols, data, scales).expect("consistent parts")
        };
        let (ours, oracle) = quantized_pair(backend, &cfg, format, matrix);
        for tokens in [1, 4, 13, 40] {
            let input = random_input(tokens, h, tokens as u64);
            let (ids, w) = random_routing(tokens, 2, 6, 13);
            let rt = Routing { tokens, k: 2, ids: &ids, weights: &w, gpu_mask: None };
            if let Some(why) = check(exec, &cfg, &ours, &oracle, &input, &rt, 1e-2) {
                failures.push(format!("{} {format} with scales of 2^{tiny} n{tokens}: {why}", backend.name()));
            }
        }
    }
    failures
}

/// A forward of 320 tokens, whose results pass [`crate::plan::SUM_IN_DOWN_FROM`] (Down sums
/// them into the output), against the same tokens in forwards of 16 (Reduce sums them), bit
/// for bit: invalid ids, a token naming an expert twice, down biases, 1 and 2 parts, on the
/// first of int8, bf16 and q4_0 the backend serves.
pub fn sum_in_down_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    let (h, i, n, k) = (1024, 64, 320, 8);
    let formats = [WeightFormat::Int8Row, WeightFormat::Bf16, WeightFormat::Ggml(GgmlType::Q4_0)];
    let Some(format) = formats.into_iter().find(|&f| backend.serves(f, i, h) && backend.serves(f, h, i / 2)) else {
        return Vec::new();
    };
    let mut failures = Vec::new();
    let (mut ids, w) = random_routing(n, k, 16, 31);
    // Every 13th slot invalid; some token's slot its slot before's expert again.
    for s in 0..n * k {
        match s % 13 {
            0 => ids[s] = -1,
            5 if s % k > 0 => ids[s] = ids[s - 1],
            _ => {}
        }
    }
    let input = random_input(n, h, 32);
    for parts in [1, 2] {
        let cfg = MoeConfig { parts, max_tokens: n, ..MoeConfig::new(16, k, h, i) };
        let mut layer = match format {
            WeightFormat::Ggml(_) => build_ggml_layer(backend, &cfg, format.into(), 33).0,
            _ => build_layer(backend, &cfg, format, &random_experts(&cfg, 33)),
        };
        for (e, b) in random_biases(&cfg, 34).into_iter().enumerate().filter(|&(e, _)| e % 3 == 0) {
            layer.set_bias(e, b).expect("valid bias");
        }
        let whole = Routing { tokens: n, k, ids: &ids, weights: &w, gpu_mask: None };
        let plan = crate::plan::Plan::build(&cfg, &whole, &vec![i / parts; parts], 1, 1, 8).expect("valid routing");
        assert!(plan.sum_in_down(), "the case must pass SUM_IN_DOWN_FROM");
        let got = run(exec, &cfg, &layer, &input, &whole);
        for c in 0..n / 16 {
            let (sl, tk) = (c * 16 * k..(c + 1) * 16 * k, c * 16 * h..(c + 1) * 16 * h);
            let part = Routing { tokens: 16, k, ids: &ids[sl.clone()], weights: &w[sl], gpu_mask: None };
            let want = run(exec, &cfg, &layer, &input[tk.clone()], &part);
            if want.iter().zip(&got[tk]).any(|(a, b)| a.to_bits() != b.to_bits()) {
                failures.push(format!(
                    "{} {format} parts{parts}: tokens {}.. differ summed in Down",
                    backend.name(),
                    c * 16
                ));
            }
        }
    }
    failures
}

/// Random expert biases, one per expert: gate's and up's std 0.5 (of the order of their
/// sums, so they move the activation), down's 0.1.
pub fn random_biases(cfg: &MoeConfig, seed: u64) -> Vec<ExpertBias> {
    (0..cfg.experts)
        .map(|e| {
            let mut r = SplitMix64::stream(seed, e as u64);
            let mut v = |len: usize, s: f32| (0..len).map(|_| r.gaussian() * s).collect::<Vec<f32>>();
            ExpertBias { gate: v(cfg.intermediate, 0.5), up: v(cfg.intermediate, 0.5), down: v(cfg.hidden, 0.1) }
        })
        .collect()
}

/// Expert biases (gpt-oss's) on every format `backend` serves (and two GGML types), with 1 and
/// 2 parts (gate's and up's split with the rows, down's added once), plain SwiGLU and
/// gpt-oss's clamped form, against the reference with the same biases.
pub fn bias_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    use crate::swiglu::Glu;
    let mut failures = Vec::new();
    let formats = WeightFormat::ALL.into_iter().chain([GgmlType::Q4_0, GgmlType::Q4_K].map(WeightFormat::Ggml));
    for format in formats {
        let (h, i) = (256, 512);
        if !backend.serves(format, i, h) || !backend.serves(format, h, i / 2) {
            continue;
        }
        for (parts, glu) in [(1, Glu::SILU), (2, Glu::SILU), (2, Glu::new(7.0, 1.702).expect("finite"))] {
            let cfg = MoeConfig { max_tokens: 40, glu, parts, ..MoeConfig::new(6, 2, h, i) };
            if cfg.validate_for(format).is_err() {
                continue;
            }
            let (mut ours, mut oracle) = layer_pair(backend, &cfg, format, 5);
            // Expert 3 keeps none.
            for (e, b) in random_biases(&cfg, 6).into_iter().enumerate().filter(|&(e, _)| e != 3) {
                ours.set_bias(e, b.clone()).expect("valid bias");
                oracle.set_bias(e, b).expect("valid bias");
            }
            let layers = (ours, oracle);
            for tokens in [1, 9, 40] {
                if let Some(why) = against_oracle(exec, &cfg, &layers, tokens, 3 + tokens as u64) {
                    failures
                        .push(format!("{} {format} biases, parts {parts}, {glu:?} n{tokens}: {why}", backend.name()));
                }
            }
        }
    }
    failures
}

/// One random expert of formats `lf` (gate/up `[I,H]`, down `[H,I]`), as
/// [`crate::ggml::random_matrix`].
pub fn random_ggml_expert(cfg: &MoeConfig, lf: LayerFormat, seed: u64) -> [QuantMatrix; 3] {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let m = |f: WeightFormat, r, c, s| match f {
        WeightFormat::Ggml(t) => crate::ggml::random_matrix(t, r, c, s),
        _ => panic!("GGML formats only"),
    };
    [m(lf.gate, i, h, seed), m(lf.up, i, h, seed ^ 1), m(lf.down, h, i, seed ^ 2)]
}

/// Layer formats the GGML conformance runs: each type alone, and mixes as GGUF files have them.
pub fn ggml_layer_formats() -> Vec<LayerFormat> {
    let g = WeightFormat::Ggml;
    let mut v: Vec<LayerFormat> = GgmlType::ALL.iter().map(|&t| g(t).into()).collect();
    v.push(LayerFormat { gate: g(GgmlType::Q4_K), up: g(GgmlType::Q4_K), down: g(GgmlType::Q6_K) });
    v.push(LayerFormat { gate: g(GgmlType::Q4_0), up: g(GgmlType::IQ4_NL), down: g(GgmlType::Q5_K) });
    v.push(LayerFormat { gate: g(GgmlType::IQ4_XS), up: g(GgmlType::Q3_K), down: g(GgmlType::Q8_0) });
    v.push(LayerFormat { gate: g(GgmlType::F16), up: g(GgmlType::BF16), down: g(GgmlType::Q2_K) });
    // q8_0 reads its activations in a layout of its own: beside another 32-column type.
    v.push(LayerFormat { gate: g(GgmlType::Q8_0), up: g(GgmlType::Q4_1), down: g(GgmlType::Q5_0) });
    v.push(LayerFormat { gate: g(GgmlType::Q5_1), up: g(GgmlType::Q8_0), down: g(GgmlType::Q8_0) });
    // gate and up reading different activation kinds (Q8_K, Q8_0, f32): each prepared once.
    v.push(LayerFormat { gate: g(GgmlType::Q4_K), up: g(GgmlType::Q8_0), down: g(GgmlType::F16) });
    v.push(LayerFormat { gate: g(GgmlType::F32), up: g(GgmlType::IQ4_XS), down: g(GgmlType::Q4_0) });
    v
}

/// Build a layer of random GGML experts packed by `backend`; also returns the experts
/// dequantized (what an fp32 MoE on the same weights reads).
pub fn build_ggml_layer(
    backend: &'static dyn Backend,
    cfg: &MoeConfig,
    lf: LayerFormat,
    seed: u64,
) -> (LayerWeights, Vec<Expert>) {
    let experts: Vec<[QuantMatrix; 3]> =
        (0..cfg.experts).map(|e| random_ggml_expert(cfg, lf, seed + e as u64)).collect();
    let deq = experts.iter().map(|m| m.each_ref().map(QuantMatrix::dequantize)).collect();
    (build_quantized_layer(backend, cfg, lf, &experts), deq)
}

/// A layer of already-quantized experts (`[gate, up, down]` in `lf`) packed by `backend`.
pub fn build_quantized_layer(
    backend: &'static dyn Backend,
    cfg: &MoeConfig,
    lf: impl Into<LayerFormat>,
    experts: &[[QuantMatrix; 3]],
) -> LayerWeights {
    let mut layer = LayerWeights::empty(cfg, lf, backend).expect("valid test config");
    for (e, [g, u, d]) in experts.iter().enumerate() {
        let packed = crate::forward::pack_expert(backend, cfg, g, u, d).expect("pack");
        layer.set_expert(e, packed).expect("packed by the layer's backend");
    }
    layer
}

/// The GGML half of the conformance suite: for every layer format of [`ggml_layer_formats`]
/// that `backend` supports, on 1 and 2 parts, odd token counts and every routing scenario,
/// the backend against the reference backend (mean relative error ≤ 1e-2) and against an
/// fp32 MoE on the dequantized weights (≤ 0.03).
pub fn ggml_conformance_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    ggml_failures(backend, exec, true)
}

/// The fp32 half of [`ggml_conformance_failures`] alone: `backend` against an fp32 MoE on the
/// dequantized weights (≤ 0.03), on the same layers, shapes and routings (for the reference
/// backend itself, which the other half would compare with itself).
pub fn ggml_accuracy_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    ggml_failures(backend, exec, false)
}

fn ggml_failures(backend: &'static dyn Backend, exec: &dyn Executor, against_reference: bool) -> Vec<String> {
    let mut failures = Vec::new();
    let scenarios = [Scenario::Random, Scenario::Skewed, Scenario::InvalidIds, Scenario::Masked, Scenario::AllMasked];
    for (li, lf) in ggml_layer_formats().into_iter().enumerate() {
        let m = lf.split_granularity();
        for (e, k, h, i, parts) in [(5, 2, m, 2 * m, 2), (3, 3, 2 * m, m, 1), (9, 2, m.max(64) * 2, m.max(64), 1)] {
            let cfg = MoeConfig { parts, max_tokens: 64, ..MoeConfig::new(e, k, h, i) };
            let ip = i / parts;
            if cfg.validate_for(lf).is_err()
                || ![(lf.gate, ip, h), (lf.up, ip, h), (lf.down, h, ip)]
                    .iter()
                    .all(|&(f, r, c)| backend.serves(f, r, c))
            {
                continue;
            }
            let seed = 77 + li as u64 * 1000 + h as u64;
            let (ours, deq) = build_ggml_layer(backend, &cfg, lf, seed);
            let oracle = against_reference.then(|| build_ggml_layer(&REFERENCE, &cfg, lf, seed).0);
            for tokens in [1, 7, 33] {
                let input = random_input(tokens, h, tokens as u64);
                for s in scenarios {
                    let (ids, w, mask) = scenario_routing(s, tokens, &cfg, 5 * tokens as u64);
                    let r = Routing { tokens, k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
                    let got = run(exec, &cfg, &ours, &input, &r);
                    let against = oracle.as_ref().and_then(|oracle| {
                        let want = run(&SerialExecutor, &cfg, oracle, &input, &r);
                        compare(&got, &want, h, &[lf.gate, lf.up, lf.down], 1e-2)
                    });
                    let fp32 = textbook_moe(&cfg, &deq, &input, &r);
                    let err32 = mean_rel_err(&got, &fp32);
                    let bad_zero = matches!(s, Scenario::AllMasked) && got.iter().any(|&v| v != 0.0);
                    if against.is_some() || err32 > 0.03 || bad_zero || got.iter().any(|v| !v.is_finite()) {
                        failures.push(format!(
                            "{} {lf} E{e} k{k} H{h} I{i} parts{parts} n{tokens} {s:?}: {} vs reference, \
                             {err32:.3e} vs fp32",
                            backend.name(),
                            against.as_deref().unwrap_or("within bounds"),
                        ));
                    }
                }
            }
        }
    }
    failures
}

/// The reference backend under another name, serving one format, on a CPU that may lack it:
/// a second backend for tests of selection and of layers. Matrices it packs carry its name.
#[derive(Debug)]
pub struct OnlyFormat {
    /// Its name.
    pub name: &'static str,
    /// The one format it serves.
    pub format: WeightFormat,
    /// What `cpu_support` answers.
    pub cpu: Result<(), &'static str>,
}

impl Backend for OnlyFormat {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_support(&self) -> Result<(), &'static str> {
        self.cpu
    }
    fn serves(&self, format: WeightFormat, rows: usize, cols: usize) -> bool {
        format == self.format && REFERENCE.serves(format, rows, cols)
    }
    fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
        let bytes = REFERENCE.pack(m)?.bytes();
        Ok(PackedMatrix::new(self.name, m.format(), m.rows(), m.cols(), bytes, m.clone()))
    }
    fn act_layout(&self, format: WeightFormat) -> ActLayout {
        REFERENCE.act_layout(format)
    }
    fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
        REFERENCE.act_bytes(format, rows, cols)
    }
    fn scratch_bytes(&self, shape: TaskShape) -> usize {
        REFERENCE.scratch_bytes(shape)
    }
    fn quantize_act(&self, f: WeightFormat, cols: usize, src: &[bf16], rows: &[u32], dst: &mut [u8], s: &mut [u8]) {
        REFERENCE.quantize_act(f, cols, src, rows, dst, s)
    }
    fn gate_up(
        &self,
        gate: &PackedMatrix,
        up: &PackedMatrix,
        rows: core::ops::Range<usize>,
        ag: &[u8],
        au: &[u8],
        glu: crate::swiglu::Glu,
        bias: Option<crate::bias::GateUpBias<'_>>,
        h: MatMut<'_, bf16>,
        s: &mut [u8],
    ) {
        REFERENCE.gate_up(gate, up, rows, ag, au, glu, bias, h, s)
    }
    fn down(&self, d: &PackedMatrix, rows: core::ops::Range<usize>, a: &[u8], y: MatMut<'_, f32>, s: &mut [u8]) {
        REFERENCE.down(d, rows, a, y, s)
    }
    fn instructions(&self, format: WeightFormat) -> Instructions {
        REFERENCE.instructions(format)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_required_matches_families_not_spellings() {
        assert!(isa_required("AVX-512F/BW", "avx512"));
        assert!(isa_required("AMX-INT8 (the hardware tiles)", "avx2, AMX"));
        assert!(isa_required("AVX2, FMA or F16C", "avx2"));
        assert!(isa_required("F16C", "all"));
        assert!(!isa_required("AVX-512F/BW", "avx2,amx"));
        assert!(!isa_required("AMX", ""));
        assert!(!isa_required("AMX", " , "));
    }

    #[test]
    fn one_element_off_by_its_magnitude_fails_where_the_mean_passes() {
        let hidden = 160;
        let mut r = SplitMix64::new(3);
        let want: Vec<f32> = (0..40 * hidden).map(|_| r.gaussian()).collect();
        let mut got = want.clone();
        let at = 17 * hidden + 5;
        got[at] *= 2.0;
        let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        assert!(mean_rel_err(&got, &want64) < 1e-2);
        for f in [WeightFormat::Bf16, WeightFormat::Int8Row, WeightFormat::Ggml(GgmlType::Q4_K)] {
            let why = compare(&got, &want, hidden, &[f], 1e-2).expect("caught");
            assert!(why.contains("[17][5]"), "{why}");
            assert_eq!(compare(&want, &want, hidden, &[f], 1e-2), None);
        }
        // A row of zeros stays zeros.
        let mut zeros = vec![0.0f32; 2 * hidden];
        assert_eq!(compare(&zeros, &zeros.clone(), hidden, &[WeightFormat::Bf16], 1e-2), None);
        zeros[hidden + 3] = 1e-30;
        assert!(compare(&zeros, &vec![0.0; 2 * hidden], hidden, &[WeightFormat::Bf16], 1e-2).is_some());
    }
}
