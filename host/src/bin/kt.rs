//! `kt`: the command line of kt-kernel-rs. It only translates arguments and calls the host API.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use kt_core::{LayerFormat, MoeConfig, Scales, WeightFormat};
use kt_host::bench::{self, BenchSpec};
use kt_host::cpu::CpuInfo;
use kt_host::placement::{cpulist, PoolConfig};
use kt_host::registry;
use kt_host::source::WeightSource;
use kt_host::topology::{Source, Topology};

#[derive(Parser)]
#[command(name = "kt", version, about = "CPU Mixture-of-Experts kernels for CPU/GPU hybrid inference")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// CPU model, ISA flags, NUMA nodes and cores, the pool that would be built, backends.
    Info(PoolArgs),
    /// Time one MoE layer with synthetic weights against the roofline measured in the same run.
    Bench(BenchArgs),
    /// Convert a Hugging Face checkpoint to KT's INT8/INT4 format, on the CPU, resumably.
    Convert(ConvertArgs),
    /// Many forwards of several layers as a server makes them: every output checked against
    /// the first forward of the same inputs, RSS and open descriptors reported as it goes.
    Soak(SoakArgs),
}

#[derive(Args)]
struct SoakArgs {
    /// Forwards to check after the warm-up.
    #[arg(long, default_value_t = 10_000)]
    forwards: usize,
    /// Stop earlier after this many seconds.
    #[arg(long, default_value_t = f64::INFINITY)]
    seconds: f64,
    /// Weight format (as kt bench's --method).
    #[arg(long, default_value = "int8")]
    method: String,
    /// Layers, each with its own weights.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Largest token count of a forward (counts from 1 to it are drawn).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Compute threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// RSS growth after the warm-up that fails the run, MiB.
    #[arg(long, default_value_t = 1.0)]
    max_rss_growth_mib: f64,
    /// Seed of weights, inputs and the order of forwards.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(Args)]
struct ConvertArgs {
    /// Checkpoint directory (safetensors shards and config.json).
    #[arg(long)]
    input: std::path::PathBuf,
    /// Output directory.
    #[arg(long)]
    output: std::path::PathBuf,
    /// int8 (KT AMXINT8) or int4 (KT AMXINT4), KT's packed files; one of ours: bf16,
    /// int4-g32, int4-g64, int4-g128 (RAWINT4 / GPTQ_INT4: a 4-bit checkpoint's own group, as
    /// stored, else 128), fp8, fp8-channel, mxfp4, mxfp8; or a GGML type (q8_0, q4_k, ...),
    /// written as GGUF.
    #[arg(long, default_value = "int8")]
    method: String,
    /// NUMA parts the files are for (KT's threadpool_count; must match at load).
    #[arg(long, default_value_t = 2)]
    parts: usize,
    /// Layers to convert, e.g. 3-7 or 5 (default: all).
    #[arg(long)]
    layers: Option<String>,
    /// Quantization threads (default: one per physical core).
    #[arg(long)]
    threads: Option<usize>,
    /// Also write the backward's transposes (KT's ffn_*_bwd_exps), which SFT layers with
    /// transposes in the layer's format load instead of making them.
    #[arg(long)]
    backward: bool,
    /// How each row's or group's scale is chosen: absmax (KT's rule and bytes) or mse (the
    /// scale of least squared error on the format's grid; the same layout, lower error).
    #[arg(long, default_value = "absmax")]
    scales: String,
}

/// `--scales`, or the usage error naming the accepted values.
fn parse_scales(s: &str) -> Result<Scales, String> {
    Scales::parse(s).ok_or_else(|| format!("unknown --scales {s:?}; valid values: {}", Scales::NAMES))
}

#[derive(Args)]
struct PoolArgs {
    /// Compute threads (default: one per physical core).
    #[arg(long)]
    threads: Option<usize>,
    /// NUMA parts: sub-pools, each owning a slice of I (default: one per NUMA node for
    /// `kt info`, 1 for `kt bench`).
    #[arg(long, alias = "parts")]
    numa_parts: Option<usize>,
    /// Also put workers on SMT siblings once the physical cores are used.
    #[arg(long)]
    smt: bool,
}

impl PoolArgs {
    /// The pool these flags describe on `topo`.
    fn config(&self, topo: &Topology, default_parts: usize) -> Result<PoolConfig, String> {
        if self.threads == Some(0) || self.numa_parts == Some(0) {
            return Err("--threads and --numa-parts must be positive".into());
        }
        let mut c = match (self.threads, self.numa_parts) {
            (None, None) if default_parts == 0 => PoolConfig::per_node(topo),
            (t, p) => {
                let parts = p.unwrap_or(default_parts.max(1));
                PoolConfig::split(topo, t.unwrap_or_else(|| default_threads(topo).max(parts)), parts)
                    .map_err(|e| e.to_string())?
            }
        };
        c.smt = self.smt;
        Ok(c)
    }
}

/// One thread per physical core this process may use.
fn default_threads(topo: &Topology) -> usize {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    topo.physical_cores().clamp(1, allowed)
}

#[derive(Args)]
struct BenchArgs {
    /// Model shape: qwen3-30b-a3b, deepseek-v2-lite, deepseek-v3, kimi-k2, gpt-oss-120b, mixtral-8x7b.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    preset: String,
    /// Override the preset's hidden size H.
    #[arg(long)]
    hidden: Option<usize>,
    /// Override the preset's expert intermediate size I.
    #[arg(long)]
    intermediate: Option<usize>,
    /// Override the preset's routed expert count E.
    #[arg(long)]
    experts: Option<usize>,
    /// Override the preset's experts per token k.
    #[arg(long)]
    top_k: Option<usize>,
    /// Weight formats, comma-separated: bf16, int8, int4, int4-g32, int4-g64, int4-g128, fp8,
    /// fp8-channel, mxfp4, mxfp8 (or KT's method names), or GGML types (q4_0, q4_1, q5_0, q5_1, q8_0, q2_k..q6_k, iq4_nl, iq4_xs, ggml-mxfp4,
    /// iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, f16, f32) [default: bf16; a GGUF
    /// --weights file runs its own types]
    #[arg(long, value_delimiter = ',')]
    method: Vec<String>,
    /// Tokens per forward, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    tokens: Vec<usize>,
    #[command(flatten)]
    pool: PoolArgs,
    /// Distinct layers rotated so decode streams weights from DRAM (default: > 2× L3).
    #[arg(long)]
    layers: Option<usize>,
    /// Seed of weights, inputs and routing.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// How the weights' scales are chosen when quantizing them here: absmax or mse (as kt
    /// convert's --scales; the same kernels run either).
    #[arg(long, default_value = "absmax")]
    scales: String,
    /// Time each case for at least this many seconds (and at least 3 reps).
    #[arg(long, default_value_t = 1.0)]
    min_time: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also time each stage of the forward (Gather, GateUp, Down, Reduce, Merge) and its
    /// serial work: the medians a forward, after the table (`stages_ms` in the JSON).
    #[arg(long, conflicts_with_all = ["layerwise", "sft"])]
    stages: bool,
    /// Use a checkpoint's weights (Hugging Face safetensors, or KT's converted format) instead
    /// of synthetic ones; the shape comes from its config.json.
    #[arg(long)]
    weights: Option<std::path::PathBuf>,
    /// Time SGLang's layerwise-prefill writes instead (every expert of the --weights
    /// checkpoint's first MoE layer into GPU-layout host buffers) on the pool's threads,
    /// against their DRAM read bandwidth.
    #[arg(long, requires = "weights")]
    layerwise: bool,
    /// GPU tensor-parallel ranks each --layerwise write splits an expert over.
    #[arg(long, default_value_t = 1, requires = "layerwise")]
    tp: usize,
    /// Time LoRA fine-tuning instead, with LoRA of this rank on every projection: the
    /// inference forward, the forward that saves its cache, and its backward.
    #[arg(long, value_name = "RANK", conflicts_with_all = ["layerwise", "weights"])]
    sft: Option<usize>,
    /// With --sft: full fine-tuning, the backward adding the base weights' gradients too.
    #[arg(long, requires = "sft")]
    full_weight_grad: bool,
    /// With --sft: the backward's transposes in bf16 (exact) or in the layer's format (KT's).
    #[arg(long, requires = "sft", default_value = "bf16", value_parser = ["bf16", "layer"])]
    transposes: String,
}

/// A one-line usage error (exit status 2).
fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("kt: error: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            let _ = e.print(); // --help, --version
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("invalid arguments").trim_start_matches("error: ");
            return usage(first);
        }
    };
    match cli.cmd {
        Cmd::Info(p) => info(&p),
        Cmd::Bench(a) => run_bench(a),
        Cmd::Convert(a) => run_convert(a),
        Cmd::Soak(a) => run_soak(&a),
    }
}

fn info(pool: &PoolArgs) -> ExitCode {
    let cpu = CpuInfo::detect();
    let topo = Topology::detect();
    let placement = match pool.config(&topo, 0).and_then(|c| c.place(&topo).map_err(|e| e.to_string())) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    println!("kt-kernel-rs {}", env!("CARGO_PKG_VERSION"));
    println!("CPU:         {} ({})", cpu.model, std::env::consts::ARCH);
    let (on, off): (Vec<&(&str, bool)>, Vec<_>) = cpu.flags.iter().partition(|f| f.1);
    println!("ISA:         {}", on.iter().map(|f| f.0).collect::<Vec<_>>().join(" "));
    println!("missing:     {}", off.iter().map(|f| f.0).collect::<Vec<_>>().join(" "));
    println!("KT variant:  {}", cpu.kt_variant());
    println!(
        "topology:    {} NUMA node(s), {} physical core(s), {} logical CPU(s), L3 {} MiB, {:.1} GiB available of {:.1} GiB (from {})",
        topo.nodes.len(),
        topo.physical_cores(),
        topo.logical_cpus,
        topo.l3_bytes >> 20,
        topo.mem_available as f64 / (1u64 << 30) as f64,
        topo.mem_total as f64 / (1u64 << 30) as f64,
        match topo.source {
            Source::Hwloc => "hwloc",
            Source::Sysfs => "sysfs",
        }
    );
    for n in &topo.nodes {
        let smt = n.cores.iter().map(Vec::len).max().unwrap_or(1);
        let first: Vec<usize> = n.cores.iter().filter_map(|c| c.first().copied()).collect();
        println!(
            "  node {}:    {} core(s) on CPUs {} ({smt} thread(s) per core)",
            n.os_index,
            n.cores.len(),
            cpulist(&first)
        );
    }
    println!("huge pages:  {}", huge_pages_line());
    print!("pool:\n{placement}");
    println!("backends (best first; a layer runs on the first that serves its formats):");
    for b in registry::registered() {
        let line = match b.cpu_support() {
            Ok(()) => format!("available; runs {}", served(b)),
            Err(missing) => format!("unavailable: this CPU lacks {missing}"),
        };
        println!("  {:<10} {line}", b.name());
    }
    #[cfg(feature = "blis")]
    match kt_backend_blis::library() {
        Some(Ok((version, arch, few))) => {
            println!("BLIS:        {version}, its {arch} configuration's microkernel");
            match few {
                0 => println!("             (every task on it: its sums could not be matched by a loop of ours)"),
                n => println!("             (tasks of up to {n} tokens on a loop of ours that sums as it does)"),
            }
        }
        Some(Err(missing)) => println!("BLIS:        unusable: needs {missing}"),
        None => {}
    }
    match registry::select_default() {
        Ok(s) => {
            println!("selected:    {}", s.backend.name());
            ExitCode::SUCCESS
        }
        Err(e) => usage(e),
    }
}

/// Whether packed weights can sit on transparent huge pages (`kt_x86::memory`'s arenas
/// advise them; decode streams every routed expert from DRAM).
fn huge_pages_line() -> String {
    match kt_x86::memory::huge_page_mode().as_deref() {
        Some(m @ ("always" | "madvise")) => format!("transparent, {m}: packed weights on 2 MiB pages"),
        Some(m) => format!(
            "transparent, {m}: packed weights stay on 4 KiB pages (`echo madvise > {}` as root lets them)",
            kt_x86::memory::THP_ENABLED
        ),
        None => "none: this kernel has no transparent huge pages; packed weights on 4 KiB pages".into(),
    }
}

/// The formats `b` serves, and which of them run on VNNI here.
fn served(b: &dyn kt_core::Backend) -> String {
    use kt_core::backend::Instructions;
    // Shapes every format can take: rows and columns a multiple of any block.
    let serves = |f: &WeightFormat| b.serves(*f, 256, 4096);
    let ours: Vec<WeightFormat> = WeightFormat::ALL.into_iter().filter(serves).collect();
    let ggml: Vec<WeightFormat> =
        kt_core::ggml::GgmlType::ALL.iter().map(|&t| WeightFormat::Ggml(t)).filter(serves).collect();
    let mut parts: Vec<String> = Vec::new();
    if !ours.is_empty() {
        parts.push(ours.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(", "));
    }
    if !ggml.is_empty() {
        parts.push(format!("{} GGML types", ggml.len()));
    }
    let on_vnni: Vec<String> = ours
        .iter()
        .chain(&ggml)
        .filter(|f| b.instructions(**f) == Instructions::Int8Vnni)
        .map(|f| f.to_string())
        .collect();
    let on_tiles: Vec<String> = ours
        .iter()
        .chain(&ggml)
        .filter(|f| matches!(b.instructions(**f), Instructions::AmxInt8 | Instructions::AmxBf16))
        .map(|f| f.to_string())
        .collect();
    let mut s = parts.join(" and ");
    if !on_vnni.is_empty() {
        s += &format!(" (on VNNI: {})", on_vnni.join(", "));
    }
    if !on_tiles.is_empty() {
        s += &format!(" (on AMX tiles for many tokens per expert: {})", on_tiles.join(", "));
    }
    s
}

fn run_bench(a: BenchArgs) -> ExitCode {
    let Some(p) = bench::preset(&a.preset) else {
        let names: Vec<_> = bench::PRESETS.iter().map(|p| p.name).collect();
        return usage(format!("unknown preset {:?}; valid presets: {}", a.preset, names.join(", ")));
    };
    let mut methods: Vec<LayerFormat> = Vec::new();
    for m in &a.method {
        match WeightFormat::parse(m) {
            Some(f) => methods.push(f.into()),
            None => return usage(format!("unknown method {m:?}; valid methods: {}", WeightFormat::NAMES)),
        }
    }
    if a.tokens.is_empty() || a.tokens.contains(&0) {
        return usage("--tokens must list positive token counts");
    }
    if a.layers == Some(0) {
        return usage("--layers must be positive");
    }
    let topo = Topology::detect();
    let pool = match a.pool.config(&topo, 1) {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    if !(a.min_time.is_finite() && a.min_time >= 0.0) {
        return usage("--min-time must be a non-negative number of seconds");
    }
    if a.layerwise {
        return run_layerwise(&a, &pool, &topo);
    }
    let mut p = p;
    let mut source = None;
    if let Some(w) = &a.weights {
        // Opened once: its shape here, its layers for every method of the run.
        let opened = WeightSource::open(w).and_then(|src| Ok((src.moe_config()?, src.own_format()?, src)));
        let (mc, gguf_format, src) = match opened {
            Ok(x) => x,
            Err(e) => return usage(e),
        };
        source = Some(std::sync::Arc::new(src));
        p = bench::Preset {
            name: "checkpoint",
            hidden: mc.hidden,
            intermediate: mc.intermediate,
            experts: mc.experts,
            top_k: mc.top_k,
        };
        if a.hidden.is_some() || a.intermediate.is_some() || a.experts.is_some() {
            return usage("--weights takes the shape from the checkpoint; drop --hidden/--intermediate/--experts");
        }
        if let Some(f) = gguf_format {
            if !methods.is_empty() && methods != [f] {
                return usage(format!(
                    "{} is a GGUF model in {f}: it runs in its own types; drop --method",
                    w.display()
                ));
            }
            methods = vec![f];
        }
        // KT's RAWINT4 / GPTQ_INT4 run a 4-bit checkpoint in its own group, as the wrapper does.
        if let Some(src) = &source {
            let first = src.moe_layers().first().copied().unwrap_or(0);
            for (m, name) in methods.iter_mut().zip(&a.method) {
                let f = src.layer_format(first, m.gate, WeightFormat::takes_checkpoint_group(name));
                if f != m.gate {
                    *m = f.into();
                }
            }
        }
    }
    if methods.is_empty() {
        methods.push(WeightFormat::Bf16.into());
    }
    let custom = a.hidden.is_some() || a.intermediate.is_some() || a.experts.is_some() || a.top_k.is_some();
    let cfg = MoeConfig {
        parts: pool.subpools.len(),
        max_tokens: a.tokens.iter().copied().max().unwrap_or(1),
        ..MoeConfig::new(
            a.experts.unwrap_or(p.experts),
            a.top_k.unwrap_or(p.top_k),
            a.hidden.unwrap_or(p.hidden),
            a.intermediate.unwrap_or(p.intermediate),
        )
    };
    // GGML types whose 256-column blocks do not divide a row fall back as llama.cpp's do.
    for m in &mut methods {
        if let WeightFormat::Ggml(t) = m.gate {
            *m = LayerFormat::ggml(t, cfg.hidden, cfg.intermediate);
        }
    }
    for &m in &methods {
        if let Err(e) = cfg.validate_for(m) {
            return usage(e);
        }
    }
    let scales = match parse_scales(&a.scales) {
        Ok(s) => s,
        Err(e) => return usage(e),
    };
    for m in &methods {
        if let Err(e) = scales.check(m.gate) {
            return usage(e);
        }
    }
    if let Some(rank) = a.sft {
        if scales != Scales::Absmax {
            return usage("--scales mse is for inference layers; --sft quantizes with absmax");
        }
        return run_sft(&a, cfg, &methods, rank, &pool, &topo);
    }
    let spec = BenchSpec {
        preset: match &a.weights {
            Some(w) => format!("checkpoint {}", w.display()),
            None if custom => format!("{} (custom)", p.name),
            None => p.name.to_string(),
        },
        cfg,
        methods,
        scales,
        tokens: a.tokens,
        threads: pool.threads(),
        smt: pool.smt,
        weights: source,
        layers: a.layers,
        seed: a.seed,
        min_seconds: a.min_time,
        progress: true,
        stages: a.stages,
    };
    match bench::run(&spec) {
        Ok(r) if a.json => {
            println!("{}", bench::to_json(&r));
            ExitCode::SUCCESS
        }
        Ok(r) => {
            // After the run, so that an error is the only line a failed run prints.
            eprintln!("kt bench: seed {} (pass --seed to reproduce)", spec.seed);
            bench::print_table(&r);
            ExitCode::SUCCESS
        }
        Err(e) => usage(e),
    }
}

/// `kt bench --sft RANK`: per method and token count, the inference forward, the forward with
/// its cache and the backward (best / median ms), their ratios, each one's ratio to its
/// roofline (probed before the cases and after each method) and the cache's bytes.
fn run_sft(
    a: &BenchArgs,
    cfg: MoeConfig,
    methods: &[LayerFormat],
    rank: usize,
    pool: &PoolConfig,
    topo: &Topology,
) -> ExitCode {
    if rank == 0 {
        return usage("--sft takes a positive LoRA rank");
    }
    let executor = match kt_host::numa_pool::NumaPool::new(pool, topo) {
        Ok(p) => std::sync::Arc::new(p),
        Err(e) => return usage(e),
    };
    let (cpus, dram_bytes) = (bench::pool_cpus(executor.placement()), bench::dram_probe_bytes(topo));
    let probe = |when: &str| bench::probe(pool.threads(), true, &cpus, dram_bytes, when);
    let mut probes = vec![probe("before the cases")];
    executor.pin_caller();
    let mut rows = Vec::new();
    for m in methods {
        if m.gate != m.up || m.gate != m.down {
            return usage(format!("--sft runs one format per layer, not {m}"));
        }
        let transposes = match a.transposes.as_str() {
            "layer" => kt_core::sft::TransposeFormat::Layer,
            _ => kt_core::sft::TransposeFormat::Bf16,
        };
        let run = bench::sft::Run {
            rank,
            full_weight_grad: a.full_weight_grad,
            transposes,
            min_seconds: a.min_time,
            seed: a.seed,
        };
        match bench::sft::run(&cfg, m.gate, &a.tokens, executor.clone(), &run) {
            Ok(cases) => rows.extend(cases.into_iter().map(|c| (m.gate, c))),
            Err(e) => return usage(e),
        }
        probes.push(probe(&format!("after {m}")));
    }
    let roof = probes.iter().copied().reduce(bench::roofline::Roofline::max).expect("probed before the cases");
    let low = probes.iter().copied().reduce(bench::roofline::Roofline::min).expect("probed before the cases");
    // Roofline time over best time of the inference forward, the forward with cache, the backward.
    let ratios = |c: &bench::sft::SftCase| {
        let [f, b] = c.roof.map(|s| s.ms(&roof));
        [f / c.inference.0, f / c.forward.0, b / c.backward.0]
    };
    if a.json {
        let cases: Vec<_> = rows
            .iter()
            .map(|(f, c)| {
                serde_json::json!({
                    "method": f.to_string(), "tokens": c.tokens, "rank": rank, "reps": c.reps,
                    "full_weight_grad": a.full_weight_grad, "transposes": a.transposes,
                    "inference_ms": [c.inference.0, c.inference.1], "forward_ms": [c.forward.0, c.forward.1],
                    "backward_ms": [c.backward.0, c.backward.1], "cache_bytes": c.cache_bytes,
                    "weight_bytes": c.weight_bytes,
                    "roofline_ms": c.roof.map(|s| s.ms(&roof)), "roofline_ratio": ratios(c),
                    "touched_bytes": c.roof.map(|s| s.bytes),
                    "peak": c.roof.map(|s| roof.peak(s.instructions).1),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "sft": cases, "threads": pool.threads(), "experts": cfg.experts,
            "hidden": cfg.hidden, "intermediate": cfg.intermediate, "top_k": cfg.top_k,
            "roofline": bench::report::roofline_json(&roof, &low, probes.len()) })
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "SFT, LoRA rank {rank} on every projection{}, {} transposes, E {} k {} H {} I {}, {} thread(s); ms best / median",
        if a.full_weight_grad { " and the base weights' gradients" } else { "" },
        a.transposes,
        cfg.experts,
        cfg.top_k,
        cfg.hidden,
        cfg.intermediate,
        pool.threads()
    );
    println!(
        "{:<12} {:>6} {:>17} {:>17} {:>17} {:>8} {:>8} {:>20} {:>10} {:>10}",
        "method",
        "tokens",
        "inference",
        "forward+cache",
        "backward",
        "fwd/inf",
        "bwd/fwd",
        "roof× inf/fwd/bwd",
        "cache MB",
        "weights MB"
    );
    for (f, c) in &rows {
        let [ri, rf, rb] = ratios(c);
        println!(
            "{:<12} {:>6} {:>8.2} / {:>6.2} {:>8.2} / {:>6.2} {:>8.2} / {:>6.2} {:>8.2} {:>8.2} {:>6.2} {:>6.2} {:>6.2} {:>10.1} {:>10.1}",
            f.to_string(),
            c.tokens,
            c.inference.0,
            c.inference.1,
            c.forward.0,
            c.forward.1,
            c.backward.0,
            c.backward.1,
            c.forward.0 / c.inference.0,
            c.backward.0 / c.forward.0,
            ri,
            rf,
            rb,
            c.cache_bytes as f64 / 1e6,
            c.weight_bytes as f64 / 1e6
        );
    }
    let peaks: Vec<String> = rows
        .iter()
        .map(|(f, c)| format!("{f}: {} / {}", roof.peak(c.roof[0].instructions).1, roof.peak(c.roof[1].instructions).1))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    println!(
        "roof× = max(bytes of the experts touched / DRAM, 2·3·H·I·k·n / peak) over the best time (the backward's \
         bytes are the transposes', its ops twice with --full-weight-grad; LoRA's rank-r products left out); \
         best of {} probes: DRAM {:.1} GB/s; peaks forward / backward: {}",
        probes.len(),
        roof.dram_gbps,
        peaks.join(", ")
    );
    ExitCode::SUCCESS
}

/// `kt bench --layerwise --weights DIR`: one line (or JSON object) for the first MoE layer.
fn run_layerwise(a: &BenchArgs, pool: &PoolConfig, topo: &Topology) -> ExitCode {
    let w = a.weights.as_ref().expect("clap requires --weights");
    let opened = WeightSource::open(w).and_then(|src| Ok((src.moe_config()?, src)));
    let (mc, src) = match opened {
        Ok(x) => x,
        Err(e) => return usage(e),
    };
    let (WeightSource::Hf(ck), Some(&layer)) = (&src, src.moe_layers().first()) else {
        return usage(format!(
            "{} is not a Hugging Face safetensors checkpoint with MoE layers, which --layerwise writes from",
            w.display()
        ));
    };
    if a.tp == 0 {
        return usage("--tp must be positive");
    }
    let executor = match kt_host::numa_pool::NumaPool::new(pool, topo) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    let shape = (mc.hidden, mc.intermediate, mc.experts);
    let r = match bench::layerwise::run(ck, layer, shape, a.tp, (&executor, bench::dram_probe_bytes(topo)), a.min_time)
    {
        Ok(r) => r,
        Err(e) => return usage(e),
    };
    if a.json {
        let j = serde_json::json!({"layerwise": {
            "encoding": format!("{:?}", r.encoding), "layer": r.layer, "tp": r.tp, "experts": r.experts,
            "expert_bytes": r.expert_bytes, "ms_best": r.ms_best, "ms_median": r.ms_median, "gbps": r.gbps,
            "threads": r.threads, "dram_gbps": r.dram_gbps, "dram_ratio": r.dram_ratio(), "reps": r.reps,
        }});
        println!("{j}");
    } else {
        println!(
            "layerwise writes, layer {} ({:?}, tp {}): {:.2} MB an expert, best {:.3} ms, median {:.3} ms over {} reps of {} experts: \
             {:.1} GB/s on {} thread(s), {:.2} x their DRAM read ({:.1} GB/s)",
            r.layer,
            r.encoding,
            r.tp,
            r.expert_bytes as f64 / 1e6,
            r.ms_best,
            r.ms_median,
            r.reps,
            r.experts,
            r.gbps,
            r.threads,
            r.dram_ratio(),
            r.dram_gbps
        );
    }
    ExitCode::SUCCESS
}

fn run_convert(a: ConvertArgs) -> ExitCode {
    let Some(format) = WeightFormat::parse(&a.method) else {
        return usage(format!("unknown method {:?}; valid methods: {}", a.method, WeightFormat::NAMES));
    };
    if a.parts == 0 || a.threads == Some(0) {
        return usage("--parts and --threads must be positive");
    }
    let layers = match a.layers.as_deref().map(parse_layers) {
        None => None,
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => return usage(e),
    };
    let scales = match parse_scales(&a.scales) {
        Ok(s) => s,
        Err(e) => return usage(e),
    };
    let spec = kt_host::convert::ConvertSpec {
        input: a.input,
        output: a.output,
        format,
        scales,
        parts: a.parts,
        layers,
        checkpoint_group: WeightFormat::takes_checkpoint_group(&a.method),
        backward: a.backward,
        threads: a.threads.unwrap_or_else(|| default_threads(&Topology::detect())),
        progress: true,
    };
    match kt_host::convert::convert(&spec) {
        Ok(r) => {
            println!(
                "kt convert: {} layer(s) written, {} already complete, method {}, {:.2} GB in, {:.2} GB out, {:.1} s ({:.2} GB/s of input)",
                r.written.len(),
                r.skipped.len(),
                r.method,
                r.bytes_in as f64 / 1e9,
                r.bytes_out as f64 / 1e9,
                r.seconds,
                r.bytes_in as f64 / 1e9 / r.seconds.max(1e-9)
            );
            ExitCode::SUCCESS
        }
        Err(e) => usage(e),
    }
}

fn run_soak(a: &SoakArgs) -> ExitCode {
    let Some(format) = WeightFormat::parse(&a.method) else {
        return usage(format!("unknown method {:?}; valid methods: {}", a.method, WeightFormat::NAMES));
    };
    if a.layers == 0 || a.max_tokens == 0 || a.threads == 0 || a.forwards == 0 {
        return usage("--layers, --max-tokens, --threads and --forwards must be positive");
    }
    // A small MoE (16 experts, top-4) whose width suits every format's block size.
    let h = format.col_multiple().max(128);
    let spec = kt_host::soak::SoakSpec {
        cfg: MoeConfig { max_tokens: a.max_tokens, ..MoeConfig::new(16, 4, h, 2 * h) },
        format,
        layers: a.layers,
        cases: 32,
        forwards: a.forwards,
        seconds: a.seconds,
        report_every: 1000,
        max_rss_growth: (a.max_rss_growth_mib * (1u64 << 20) as f64) as u64,
        max_fd_growth: 0,
        seed: a.seed,
    };
    let opts = kt_host::LayerOptions::threads(a.threads);
    match kt_host::soak::soak(&spec, &opts, |p| println!("kt soak: {p}")) {
        Ok([first, last]) => {
            let growth = last.rss as i64 - first.rss as i64;
            println!("kt soak: passed, {} forwards checked, RSS {growth:+} bytes after the warm-up", last.forwards);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kt soak: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `A-B` (inclusive) or `A`.
fn parse_layers(s: &str) -> Result<std::ops::RangeInclusive<usize>, String> {
    let bad = || format!("--layers {s:?}: expected A-B or A (layer numbers)");
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b): (usize, usize) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if a > b {
        return Err(bad());
    }
    Ok(a..=b)
}
