//! `kt bench`: one MoE layer with synthetic weights, timed against the roofline measured in the
//! same run. Reports best and median ms, GFLOP/s (2·3·H·I·k·n / t), weight GB/s (bytes of the
//! distinct experts touched / t), their ratios to the roofline, and the error against the
//! reference backend on up to 16 of the tokens.

pub mod layerwise;
pub mod report;
pub mod roofline;
pub mod sft;
pub mod stages;
pub mod stream;
pub mod synth;

use std::fmt;
use std::time::Instant;

use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use kt_core::backend::Instructions;
use kt_core::reference::REFERENCE;
use kt_core::{Backend, LayerFormat, MoeConfig, Scales, WeightFormat};

pub use report::{print_table, to_json};
pub use roofline::Roofline;

use crate::cpu::CpuInfo;
use crate::error::WeightError;
use crate::layer::{LayerOptions, MoeLayer};
use crate::numa_pool::NumaPool;
use crate::placement::{Placement, PoolConfig, PoolError};
use crate::slots::Slots;
use crate::source::WeightSource;
use crate::topology::Topology;

/// Token counts up to this are decode cases: each rep is paired with a DRAM read of its weight
/// bytes ([`stream`]).
pub const STREAM_UP_TO: usize = 4;

/// A model shape to benchmark.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    /// Name on the command line.
    pub name: &'static str,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub intermediate: usize,
    /// Routed experts E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
}

/// The shapes `--preset` knows.
pub const PRESETS: [Preset; 6] = [
    Preset { name: "qwen3-30b-a3b", hidden: 2048, intermediate: 768, experts: 128, top_k: 8 },
    Preset { name: "deepseek-v2-lite", hidden: 2048, intermediate: 1408, experts: 64, top_k: 6 },
    Preset { name: "deepseek-v3", hidden: 7168, intermediate: 2048, experts: 256, top_k: 8 },
    // Kimi-K2 ships int4 in groups of 32 (int4-g32, KT's RAWINT4), gpt-oss MXFP4.
    Preset { name: "kimi-k2", hidden: 7168, intermediate: 2048, experts: 384, top_k: 8 },
    Preset { name: "gpt-oss-120b", hidden: 2880, intermediate: 2880, experts: 128, top_k: 4 },
    Preset { name: "mixtral-8x7b", hidden: 4096, intermediate: 14336, experts: 8, top_k: 2 },
];

/// Find a preset by name.
pub fn preset(name: &str) -> Option<Preset> {
    PRESETS.iter().copied().find(|p| p.name == name)
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchSpec {
    /// Preset name (for the report).
    pub preset: String,
    /// Layer shape.
    pub cfg: MoeConfig,
    /// Weight formats to run.
    pub methods: Vec<LayerFormat>,
    /// How weights quantized here choose their scales.
    pub scales: Scales,
    /// Token counts per forward.
    pub tokens: Vec<usize>,
    /// Compute threads, split over `cfg.parts` sub-pools.
    pub threads: usize,
    /// Let workers use SMT siblings once the physical cores are taken.
    pub smt: bool,
    /// Real weights (a Hugging Face or KT-converted checkpoint, or a GGUF model), opened once
    /// for every method, instead of synthetic ones; `cfg` must be its shape.
    pub weights: Option<std::sync::Arc<WeightSource>>,
    /// Distinct layers rotated; `None` = enough to exceed 2× the L3 size.
    pub layers: Option<usize>,
    /// Seed of weights, inputs and routing.
    pub seed: u64,
    /// Time each case for at least this long (and at least 3 reps).
    pub min_seconds: f64,
    /// Draw progress bars on stderr.
    pub progress: bool,
    /// Time each stage of the forward too ([`CaseResult::stages`]).
    pub stages: bool,
}

/// One measured case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Preset name.
    pub preset: String,
    /// Weight formats.
    pub method: LayerFormat,
    /// Backend that ran it.
    pub backend: &'static str,
    /// Compute threads.
    pub threads: usize,
    /// Tokens per forward.
    pub tokens: usize,
    /// Fastest rep, ms.
    pub ms_best: f64,
    /// Median rep, ms.
    pub ms_median: f64,
    /// 2·3·H·I·k·n / best time.
    pub gflops: f64,
    /// Distinct experts' bytes / best time.
    pub weight_gbps: f64,
    /// weight_gbps / roofline DRAM bandwidth (the run's best reading).
    pub dram_ratio: f64,
    /// gflops / the peak of the instructions the kernels run on (FMA for float kernels, the
    /// AVX2 int8 loop for `Int8Pairs`, the VNNI one for `Int8Vnni`, the 512-bit ones for the
    /// AVX-512 kernels).
    pub compute_ratio: f64,
    /// The peak `compute_ratio` is to ([`Roofline::peak`]'s name: `fma`, `fma-512`, `int8`,
    /// `int8-512`, `vnni`, `bf16dot`, `amx-int8`, `amx-bf16`).
    pub judged_by: &'static str,
    /// The instruction family of the gate's kernels (`Backend::instructions`).
    pub instructions: Instructions,
    /// For up to [`STREAM_UP_TO`] tokens: the median over the reps of the time the pool took
    /// to stream that rep's weight bytes from DRAM right after it, over the rep's own time
    /// ([`stream`]).
    pub stream_ratio: Option<f64>,
    /// mean |out − ref| / mean |ref| against the reference backend, ≤ 16 tokens.
    pub rel_err: f64,
    /// For the blis backend at more than [`STREAM_UP_TO`] tokens: BLIS's own sgemm rate on
    /// this case's shapes (an expert's average tokens against gate, up and down), GFLOP/s, one
    /// thread's times the case's threads, measured in the same run.
    pub blis_sgemm_gflops: Option<f64>,
    /// Reps timed.
    pub reps: usize,
    /// With [`BenchSpec::stages`]: per stage of the forward (`Gather`, `GateUp`, `Down`,
    /// `Reduce`, `Merge`, as it ran them), the median over the reps of its ms, and `serial`:
    /// the forward's time outside them (its plan and buffers, on the calling thread).
    pub stages: Vec<(&'static str, f64)>,
}

impl CaseResult {
    /// The roofline time max(bytes / DRAM, ops / peak) over the best time: the larger of the
    /// two ratios (an MoE layer on AMX stays memory-bound up to many tokens per expert).
    pub fn roofline_ratio(&self) -> f64 {
        self.dram_ratio.max(self.compute_ratio)
    }
}

/// The machine, as the report describes it.
#[derive(Clone, Debug)]
pub struct Machine {
    /// CPU and ISA flags.
    pub cpu: CpuInfo,
    /// NUMA, cores, caches, memory.
    pub topology: Topology,
    /// Where the pool's threads ran (one sub-pool per NUMA part).
    pub placement: Placement,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct Report {
    /// Where it ran.
    pub machine: Machine,
    /// The roofline of this run: the best reading of each limit over its probes.
    pub roofline: Roofline,
    /// The lowest reading of each limit over the same probes.
    pub roofline_low: Roofline,
    /// Probes taken: one before the cases and one after each method.
    pub probes: usize,
    /// Layers rotated.
    pub layers: usize,
    /// The seed used.
    pub seed: u64,
    /// The spec.
    pub spec: BenchSpec,
    /// One entry per (method, tokens).
    pub results: Vec<CaseResult>,
}

/// Why a benchmark could not run.
#[derive(Debug)]
#[non_exhaustive]
pub enum BenchError {
    /// Invalid shape or format, or no backend.
    Core(kt_core::Error),
    /// The weights would not fit in free memory.
    OutOfMemory {
        /// Bytes the run needs.
        needed: u64,
        /// Bytes available.
        available: u64,
        /// Layers it would build.
        layers: usize,
    },
    /// The pool cannot be built (threads vs parts, nodes).
    Pool(PoolError),
    /// The checkpoint given with `--weights` cannot be loaded.
    Weights(WeightError),
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Core(e) => write!(f, "{e}"),
            BenchError::OutOfMemory { needed, available, layers } => write!(
                f,
                "the weights and scratch need {:.1} GB ({layers} layer(s)) but only {:.1} GB of memory is available; \
                 use fewer --experts, --layers or --tokens, or a smaller --method",
                *needed as f64 / 1e9,
                *available as f64 / 1e9
            ),
            BenchError::Pool(e) => write!(f, "{e}"),
            BenchError::Weights(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for BenchError {}

impl From<WeightError> for BenchError {
    fn from(e: WeightError) -> Self {
        BenchError::Weights(e)
    }
}

impl From<PoolError> for BenchError {
    fn from(e: PoolError) -> Self {
        BenchError::Pool(e)
    }
}

impl From<kt_core::Error> for BenchError {
    fn from(e: kt_core::Error) -> Self {
        BenchError::Core(e)
    }
}

/// Stored bytes of one layer's experts in `format`.
pub fn layer_bytes(cfg: &MoeConfig, format: impl Into<LayerFormat>) -> u64 {
    let (f, h, i) = (format.into(), cfg.hidden, cfg.intermediate);
    (cfg.experts * (f.gate.matrix_bytes(i, h) + f.up.matrix_bytes(i, h) + f.down.matrix_bytes(h, i))) as u64
}

/// Upper bound of a forward's scratch for `n` tokens: per routed row the gathered activations,
/// h, prepared h and the f32 down output; per token and part the f32 partial output.
pub fn scratch_bytes(cfg: &MoeConfig, n: usize) -> u64 {
    let (h, i, rows) = (cfg.hidden as u64, cfg.intermediate as u64, (n * cfg.top_k) as u64);
    rows * (4 * h + 2 * i + 4 * i + 4 * h * cfg.parts as u64) + n as u64 * h * (4 * cfg.parts as u64 + 2)
}

/// Bytes the DRAM probe reads: 8× the L3 and at least 512 MB, and where memory allows an
/// eighth of what is available, up to 4 GB: on a VM whose host holds more cache than it shows,
/// smaller probes read the host's cache, not DRAM.
pub fn dram_probe_bytes(topology: &Topology) -> usize {
    let spare = usize::try_from(topology.mem_available / 8).unwrap_or(usize::MAX).min(4 << 30);
    (8 * topology.l3_bytes).max(512 << 20).max(spare)
}

/// The CPUs of a pool's sub-pools, which the probes run on.
pub fn pool_cpus(placement: &Placement) -> Vec<usize> {
    placement.subpools.iter().flat_map(|p| p.cpus.iter().copied()).collect()
}

/// Bytes of the decode cases' DRAM stream ([`stream`]): the probe's, where a case has up to
/// [`STREAM_UP_TO`] tokens.
fn stream_bytes(spec: &BenchSpec, topology: &Topology) -> usize {
    if spec.tokens.iter().any(|&n| n <= STREAM_UP_TO) {
        dram_probe_bytes(topology)
    } else {
        0
    }
}

/// Layers to rotate: as asked, or enough that their bytes exceed 2× the L3 size.
fn layer_count(spec: &BenchSpec, l3: usize, per_layer: u64) -> usize {
    spec.layers.unwrap_or_else(|| ((2 * l3 as u64).div_ceil(per_layer.max(1))).clamp(1, 64) as usize)
}

fn bar(progress: bool, len: u64, template: &str) -> ProgressBar {
    if !progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style);
    }
    pb
}

/// One reading of the roofline with `threads` threads on `cpus` (the pool's), reading
/// `dram_bytes` for the DRAM probe, a spinner saying which part runs (with `progress`).
pub fn probe(threads: usize, progress: bool, cpus: &[usize], dram_bytes: usize, when: &str) -> Roofline {
    let th = roofline::Threads { n: threads, cpus };
    let spin = bar(progress, 6, &format!("{{spinner}} measuring the roofline {when} ({{pos}}/{{len}}) {{msg}}"));
    spin.set_message("DRAM read");
    let dram_gbps = roofline::dram_gbps(th, dram_bytes);
    spin.inc(1);
    spin.set_message("FMA peak");
    let fma_gflops = roofline::fma_gflops(th);
    spin.inc(1);
    spin.set_message("int8 peak");
    let int8_gops = roofline::int8_gops(th);
    spin.inc(1);
    spin.set_message("VNNI int8 peak");
    let vnni_gops = roofline::vnni_gops(th);
    spin.inc(1);
    spin.set_message("512-bit peaks");
    let zmm = roofline::zmm_peaks(th);
    spin.inc(1);
    spin.set_message("AMX tile peaks");
    let tiles = roofline::tile_peaks(th);
    spin.finish_and_clear();
    Roofline { dram_gbps, fma_gflops, int8_gops, vnni_gops, zmm, tiles }
}

/// Run the benchmark.
pub fn run(spec: &BenchSpec) -> Result<Report, BenchError> {
    let cfg = &spec.cfg;
    for &m in &spec.methods {
        cfg.validate_for(m)?;
    }
    let topology = Topology::detect();
    let pool_config = PoolConfig { smt: spec.smt, ..PoolConfig::split(&topology, spec.threads, cfg.parts)? };
    let pool = std::sync::Arc::new(NumaPool::new(&pool_config, &topology)?);
    let machine = Machine { cpu: CpuInfo::detect(), placement: pool.placement().clone(), topology };
    // Check memory for every method before spending time on the roofline.
    let stream_len = stream_bytes(spec, &machine.topology);
    let mut plans = Vec::new();
    for &m in &spec.methods {
        let per_layer = layer_bytes(cfg, m);
        let layers = layer_count(spec, machine.topology.l3_bytes, per_layer);
        // The reference copy of the experts that check accuracy (of a checkpoint's, every one),
        // and the forward's scratch.
        let routed: usize = spec.tokens.iter().map(|&n| n.min(CHECKED_TOKENS) * cfg.top_k).sum();
        let checked = match spec.weights {
            Some(_) => cfg.experts,
            None => routed.min(cfg.experts),
        } as u64;
        let needed = per_layer * layers as u64
            + per_layer / cfg.experts.max(1) as u64 * checked
            + scratch_bytes(cfg, spec.tokens.iter().copied().max().unwrap_or(1))
            + stream_len as u64;
        let available = machine.topology.mem_available;
        if available > 0 && needed > available / 10 * 9 {
            return Err(BenchError::OutOfMemory { needed, available, layers });
        }
        plans.push((m, layers));
    }
    let dram_bytes = dram_probe_bytes(&machine.topology);
    let cpus = pool_cpus(&machine.placement);
    let probe = |when: &str| probe(spec.threads, spec.progress, &cpus, dram_bytes, when);
    let mut probes = vec![probe("before the cases")];
    // This thread is worker 0 of sub-pool 0: keep it on its CPU, off the pinned workers' ones
    // (the probes pin their own threads).
    pool.pin_caller();

    let mut stream = (stream_len > 0).then(|| stream::Stream::new(&pool, stream_len));
    let mut results = Vec::new();
    let mut layers_used = 0;
    for (method, layers) in plans {
        layers_used = layers_used.max(layers);
        results.extend(run_method(spec, method, layers, pool.clone(), stream.as_mut())?);
        probes.push(probe(&format!("after {method}")));
    }
    let roof = probes.iter().copied().reduce(Roofline::max).expect("probed before the cases");
    let roofline_low = probes.iter().copied().reduce(Roofline::min).expect("probed before the cases");
    for r in &mut results {
        let (peak, name) = roof.peak(r.instructions);
        r.dram_ratio = r.weight_gbps / roof.dram_gbps;
        r.compute_ratio = r.gflops / peak;
        r.judged_by = name;
        if r.backend == "blis" && r.tokens > STREAM_UP_TO {
            r.blis_sgemm_gflops = blis_sgemm_gflops(&spec.cfg, r.tokens, spec.threads, spec.min_seconds);
        }
    }
    Ok(Report {
        machine,
        roofline: roof,
        roofline_low,
        probes: probes.len(),
        layers: layers_used,
        seed: spec.seed,
        spec: spec.clone(),
        results,
    })
}

/// BLIS's own sgemm rate on the GEMMs of a forward of `tokens` tokens (an expert's average
/// tokens `m` against gate and up, `[m, H] · [I, H]ᵀ`, and down, `[m, I] · [H, I]ᵀ`), GFLOP/s:
/// the blis backend's yardstick. One BLIS thread, times `threads`: BLIS's own threads would
/// compete with the pool's spinning workers (docs/tuning.md); `None` in a build without the
/// blis backend.
fn blis_sgemm_gflops(cfg: &MoeConfig, tokens: usize, threads: usize, min_secs: f64) -> Option<f64> {
    #[cfg(feature = "blis")]
    {
        let m = (tokens * cfg.top_k).div_ceil(cfg.experts).max(1);
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let up = kt_backend_blis::sgemm_gflops(m, i, h, 1, min_secs.min(0.5))?.ok()?;
        let down = kt_backend_blis::sgemm_gflops(m, h, i, 1, min_secs.min(0.5))?.ok()?;
        // Two gate/up GEMMs and one down of equal FLOPs: the time-weighted rate.
        Some(threads as f64 * 3.0 / (2.0 / up + 1.0 / down))
    }
    #[cfg(not(feature = "blis"))]
    {
        let _ = (cfg, tokens, threads, min_secs);
        None
    }
}

/// Tokens of each case whose output is checked against the reference backend.
const CHECKED_TOKENS: usize = 16;

/// The experts the accuracy check's tokens route to, in any case of `spec`: the only ones the
/// reference copy of layer 0 holds (a whole copy would double a large model's memory).
fn checked_experts(spec: &BenchSpec, cfg: &MoeConfig) -> Vec<bool> {
    let mut seen = vec![false; cfg.experts];
    for &n in &spec.tokens {
        let (ids, _) = &synth::routings(n, cfg.top_k, cfg.experts, spec.seed)[0];
        for &e in &ids[..n.min(CHECKED_TOKENS) * cfg.top_k] {
            seen[e as usize] = true;
        }
    }
    seen
}

fn run_method(
    spec: &BenchSpec,
    method: LayerFormat,
    layers: usize,
    pool: std::sync::Arc<NumaPool>,
    mut stream: Option<&mut stream::Stream>,
) -> Result<Vec<CaseResult>, BenchError> {
    let cfg = &MoeConfig { max_tokens: spec.tokens.iter().copied().max().unwrap_or(1), ..spec.cfg.clone() };
    let clock = spec.stages.then(|| std::sync::Arc::new(stages::StageClock::new(pool.clone())));
    let opts = LayerOptions {
        scales: spec.scales,
        ..match &clock {
            Some(c) => LayerOptions::executor(c.clone()),
            None => LayerOptions::executor(pool.clone()),
        }
    };
    // Each expert is generated once per part (every part packs its own slice on its node).
    let pb = bar(
        spec.progress,
        (cfg.experts * cfg.parts * (layers + 1)) as u64,
        "{spinner} generating {msg} weights [{bar:30}] {pos}/{len} expert slices ({elapsed})",
    );
    pb.set_message(method.to_string());
    let source = spec.weights.as_deref();
    // A checkpoint's MoE layers, in order (layer l of the run is the l-th of them).
    let moe_layers = source.map_or_else(Vec::new, WeightSource::moe_layers);
    let layers = if source.is_some() { layers.min(moe_layers.len()) } else { layers };
    let checked = checked_experts(spec, cfg);
    // `keep`: the experts built (the oracle's are those the accuracy check routes to).
    let build =
        |l: usize, opts: &LayerOptions, keep: &(dyn Fn(usize) -> bool + Sync)| -> Result<MoeLayer, BenchError> {
            if let Some(src) = source {
                // GGUF runs in its own types; other checkpoints in the method asked for.
                let m = (!matches!(src, WeightSource::Gguf(_))).then_some(method.gate);
                return Ok(src.load_layer(moe_layers[l], m, cfg, Slots::default(), opts)?);
            }
            match method.gate {
                WeightFormat::Ggml(_) => Ok(MoeLayer::from_quantized(
                    cfg,
                    |e| {
                        pb.inc(1);
                        keep(e).then(|| synth::ggml_expert(cfg, method, spec.seed, l, e))
                    },
                    method,
                    opts,
                )?),
                _ => Ok(MoeLayer::from_f32(
                    cfg,
                    method,
                    |e| {
                        pb.inc(1);
                        keep(e).then(|| synth::expert(cfg, spec.seed, l, e))
                    },
                    opts,
                )?),
            }
        };
    if let (Some(src), true) = (&source, moe_layers.is_empty()) {
        let name = format!("MoE expert tensors (in any layer) in {}", src.path().display());
        return Err(BenchError::Weights(WeightError::Missing { name }));
    }
    let built: Vec<MoeLayer> = (0..layers).map(|l| build(l, &opts, &|_| true)).collect::<Result<_, _>>()?;
    let backend = built[0].backend();
    let oracle = if backend.name() == REFERENCE.name() {
        None
    } else {
        Some(build(0, &LayerOptions { backend: Some(&REFERENCE), ..opts.clone() }, &|e| checked[e])?)
    };
    pb.finish_and_clear();

    let cases = bar(spec.progress, spec.tokens.len() as u64, "{spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})");
    let mut out = Vec::new();
    for &n in &spec.tokens {
        cases.set_message(format!("{method} on {}, {n} token(s)", backend.name()));
        let paired = stream.as_deref_mut().filter(|_| n <= STREAM_UP_TO).map(|s| (s, &*pool));
        let oracle = oracle.as_ref().unwrap_or(&built[0]);
        out.push(run_case(spec, cfg, &built, oracle, n, paired, clock.as_deref())?);
        cases.inc(1);
    }
    cases.finish_and_clear();
    Ok(out)
}

fn run_case(
    spec: &BenchSpec,
    cfg: &MoeConfig,
    layers: &[MoeLayer],
    oracle: &MoeLayer,
    n: usize,
    mut paired: Option<(&mut stream::Stream, &NumaPool)>,
    clock: Option<&stages::StageClock>,
) -> Result<CaseResult, BenchError> {
    let (h, k) = (cfg.hidden, cfg.top_k);
    let input = synth::input(n, h, spec.seed ^ 0xA11CE);
    let routings = synth::routings(n, k, cfg.experts, spec.seed);
    let touched = |l: &MoeLayer, ids: &[i64]| -> u64 {
        let mut seen = vec![false; cfg.experts];
        ids.iter().for_each(|&e| seen[e as usize] = true);
        seen.iter().enumerate().filter(|(_, &s)| s).map(|(e, _)| l.expert_bytes(e) as u64).sum()
    };
    let mut out = vec![bf16::ZERO; n * h];
    // Warm-up grows the workspace; then time reps rotating layers and, once every layer has
    // had one, routings: a cycle visits each pair of layer and routing once.
    layers[0].forward_into(&input, &routings[0].0, &routings[0].1, None, &mut out)?;
    if let Some(c) = clock {
        c.take();
    }
    let mut stage_reps = Vec::new();
    let mut times = Vec::new();
    let mut streamed = Vec::new();
    let mut best = (f64::INFINITY, 0u64);
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < spec.min_seconds && times.len() < 10_000) {
        let i = times.len();
        let (layer, (ids, w)) = (&layers[i % layers.len()], &routings[i / layers.len() % routings.len()]);
        let t0 = Instant::now();
        layer.forward_into(&input, ids, w, None, &mut out)?;
        let t = t0.elapsed().as_secs_f64();
        times.push(t);
        if let Some(c) = clock {
            stage_reps.push((t, c.take()));
        }
        let bytes = touched(layer, ids);
        if let Some((stream, pool)) = paired.as_mut() {
            streamed.push(stream.read(pool, bytes as usize) / t);
        }
        if t < best.0 {
            best = (t, bytes);
        }
    }
    streamed.sort_by(f64::total_cmp);
    let stream_ratio = streamed.get(streamed.len() / 2).copied();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let flops = 2.0 * 3.0 * (h * cfg.intermediate * k * n) as f64;
    let gflops = flops / best.0 / 1e9;
    let weight_gbps = best.1 as f64 / best.0 / 1e9;

    // Accuracy: the first ≤16 tokens of layer 0 against the reference backend.
    let m = n.min(CHECKED_TOKENS);
    let (ids, w) = &routings[0];
    let got = layers[0].forward(&input, ids, w, None)?;
    let want = oracle.forward(&input[..m * h], &ids[..m * k], &w[..m * k], None)?;
    let num: f64 = got[..m * h].iter().zip(&want).map(|(a, b)| f64::from((a.to_f32() - b.to_f32()).abs())).sum();
    let den: f64 = want.iter().map(|b| f64::from(b.to_f32().abs())).sum();
    Ok(CaseResult {
        preset: spec.preset.clone(),
        method: layers[0].format(),
        backend: layers[0].backend().name(),
        instructions: layers[0].backend().instructions(layers[0].format().gate),
        threads: spec.threads,
        tokens: n,
        ms_best: best.0 * 1e3,
        ms_median: median * 1e3,
        gflops,
        weight_gbps,
        // Set by `run` against the best of all the run's probes.
        dram_ratio: f64::NAN,
        compute_ratio: f64::NAN,
        judged_by: "",
        stream_ratio,
        rel_err: if den > 0.0 { num / den } else { num },
        blis_sgemm_gflops: None,
        reps: times.len(),
        stages: stages::medians(&stage_reps).into_iter().map(|(l, s)| (l, s * 1e3)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Node, Source};

    /// The probe's size: 8× the L3 (at least 512 MB), or an eighth of the available memory up
    /// to 4 GB where that is more.
    #[test]
    fn the_dram_probe_outgrows_caches_within_free_memory() {
        let machine = |l3_mb: usize, available_gb: u64| Topology {
            nodes: vec![Node { os_index: 0, cores: vec![vec![0]] }],
            logical_cpus: 1,
            l3_bytes: l3_mb << 20,
            mem_available: available_gb << 30,
            mem_total: available_gb << 30,
            source: Source::Sysfs,
        };
        assert_eq!(dram_probe_bytes(&machine(32, 0)), 512 << 20);
        assert_eq!(dram_probe_bytes(&machine(32, 2)), 512 << 20);
        assert_eq!(dram_probe_bytes(&machine(32, 20)), 20 << 27);
        assert_eq!(dram_probe_bytes(&machine(32, 512)), 4 << 30);
        assert_eq!(dram_probe_bytes(&machine(1152, 16)), (8 * 1152) << 20);
    }
}
