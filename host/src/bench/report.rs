//! The end-of-run table and the `--json` object (field names are a contract: other tools read
//! them).

use kt_core::backend::Instructions;
use serde_json::{json, Value};

use super::roofline::Roofline;
use super::Report;

/// A roofline's readings (`best`, each limit's highest over `probes` probes, and `low`, its
/// lowest) as JSON.
pub fn roofline_json(best: &Roofline, low: &Roofline, probes: usize) -> Value {
    let fields = |r: &Roofline| {
        json!({
            "dram_gbps": r.dram_gbps,
            "fma_gflops": r.fma_gflops,
            "int8_gops": r.int8_gops,
            "vnni_gops": r.vnni_gops,
            "fma512_gflops": r.zmm.fma_gflops,
            "int8_512_gops": r.zmm.int8_gops,
            "bf16dot512_gflops": r.zmm.bf16_gflops,
            "amx_int8_gops": r.tiles.int8_gops,
            "amx_bf16_gflops": r.tiles.bf16_gflops,
        })
    };
    let mut v = fields(best);
    v["probes"] = json!(probes);
    v["low"] = fields(low);
    v
}

/// The JSON object of a run.
pub fn to_json(r: &Report) -> Value {
    let t = &r.machine.topology;
    json!({
        "machine": {
            "cpu": r.machine.cpu.model,
            "isa": r.machine.cpu.flags.iter().filter(|f| f.1).map(|f| f.0).collect::<Vec<_>>(),
            "kt_variant": r.machine.cpu.kt_variant(),
            "numa_nodes": t.nodes.len(),
            "physical_cores": t.physical_cores(),
            "logical_cpus": t.logical_cpus,
            "l3_bytes": t.l3_bytes,
            "pool": r.machine.placement.subpools.iter().map(|p| json!({"node": p.node, "cpus": p.cpus})).collect::<Vec<_>>(),
            "mem_total_bytes": t.mem_total,
            "layers": r.layers,
            "seed": r.seed,
            "scales": r.spec.scales.to_string(),
        },
        "roofline": roofline_json(&r.roofline, &r.roofline_low, r.probes),
        "results": r.results.iter().map(|c| json!({
            "preset": c.preset,
            "method": c.method.to_string(),
            "backend": c.backend,
            "threads": c.threads,
            "tokens": c.tokens,
            "ms_best": c.ms_best,
            "ms_median": c.ms_median,
            "gflops": c.gflops,
            "weight_gbps": c.weight_gbps,
            "dram_ratio": c.dram_ratio,
            "stream_ratio": c.stream_ratio,
            "compute_ratio": c.compute_ratio,
            "judged_by": c.judged_by,
            "roofline_ratio": c.roofline_ratio(),
            "roofline_ms": c.ms_best * c.roofline_ratio(),
            "vnni": c.instructions == Instructions::Int8Vnni,
            "instructions": format!("{:?}", c.instructions),
            "rel_err": c.rel_err,
            "blis_sgemm_gflops": c.blis_sgemm_gflops,
            "blis_sgemm_ratio": c.blis_sgemm_gflops.map(|g| c.gflops / g),
            "stages_ms": c.stages.iter().map(|&(l, ms)| json!({"stage": l, "ms": ms})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// The human-readable table.
pub fn print_table(r: &Report) {
    let c = &r.spec.cfg;
    println!(
        "kt bench: {} (E={} k={} H={} I={}), {} thread(s), {} layer(s) rotated, seed {}",
        r.spec.preset, c.experts, c.top_k, c.hidden, c.intermediate, r.spec.threads, r.layers, r.seed
    );
    println!("CPU: {} ({})", r.machine.cpu.model, r.machine.cpu.kt_variant());
    print!("pool:\n{}", r.machine.placement);
    let (hi, lo) = (&r.roofline, &r.roofline_low);
    println!(
        "roofline (same run, {} thread(s), best of {} probes): DRAM {:.1} GB/s, FMA {:.1} GFLOP/s, int8 {:.1} GOP/s",
        r.spec.threads, r.probes, hi.dram_gbps, hi.fma_gflops, hi.int8_gops
    );
    println!(
        "  lowest probe readings:  DRAM {:.1} GB/s, FMA {:.1} GFLOP/s, int8 {:.1} GOP/s",
        lo.dram_gbps, lo.fma_gflops, lo.int8_gops
    );
    if let (Some(v), Some(v_lo)) = (hi.vnni_gops, lo.vnni_gops) {
        println!("  VNNI int8 peak {v:.1} GOP/s (lowest {v_lo:.1}), {:.1}× the int8 figure", v / hi.int8_gops);
    }
    if let (Some(f), Some(i)) = (hi.zmm.fma_gflops, hi.zmm.int8_gops) {
        let bf16 = hi.zmm.bf16_gflops.map_or(String::new(), |b| format!(", vdpbf16ps {b:.1} GFLOP/s"));
        println!("  512-bit peaks: FMA {f:.1} GFLOP/s, int8 (vpmaddubsw) {i:.1} GOP/s{bf16}");
    }
    // The method column fits the longest label (mixed GGML layers read "q4_K (down q5_0)").
    let w = r.results.iter().map(|x| x.method.to_string().chars().count()).max().unwrap_or(0).max(12);
    println!(
        "{:<w$} {:<14} {:>6} {:>10} {:>10} {:>9} {:>9} {:>7} {:>8} {:>9} {:<8} {:>6} {:>9} {:>5}",
        "method",
        "backend",
        "tokens",
        "best ms",
        "median ms",
        "GFLOP/s",
        "GB/s",
        "DRAM×",
        "stream×",
        "compute×",
        "peak",
        "roof×",
        "rel err",
        "reps"
    );
    for x in &r.results {
        println!(
            "{:<w$} {:<14} {:>6} {:>10.3} {:>10.3} {:>9.2} {:>9.2} {:>7.3} {:>8} {:>9.3} {:<8} {:>6.3} {:>9.2e} {:>5}",
            x.method.to_string(),
            x.backend,
            x.tokens,
            x.ms_best,
            x.ms_median,
            x.gflops,
            x.weight_gbps,
            x.dram_ratio,
            x.stream_ratio.map_or("-".to_string(), |r| format!("{r:.3}")),
            x.compute_ratio,
            x.judged_by,
            x.roofline_ratio(),
            x.rel_err,
            x.reps
        );
    }
    println!("GFLOP/s = 2·3·H·I·k·n / best time; GB/s = bytes of the distinct experts touched / best time;");
    println!("DRAM× and compute× are ratios to the roofline's best readings; compute× is to the peak named in");
    println!("the peak column, the instructions the kernels ran on (fma, int8 = vpmaddubsw, vnni = vpdpbusd,");
    println!("bf16dot = vdpbf16ps; -512: in 512-bit registers; amx-int8/-bf16: AMX tiles); roof× = the roofline time");
    println!("max(bytes / DRAM, ops / peak) over the best time (the larger of the two); the roofline was probed");
    println!(
        "before the cases and after each method. stream× (up to {} tokens): the median over the reps of",
        super::STREAM_UP_TO
    );
    println!("the time the pool took to stream the rep's weight bytes from DRAM right after it, over the rep's time.");
    for x in r.results.iter().filter(|x| x.blis_sgemm_gflops.is_some()) {
        let g = x.blis_sgemm_gflops.unwrap_or(f64::NAN);
        println!(
            "blis {} n={}: {:.2} of BLIS's own sgemm on the same shapes ({g:.1} GFLOP/s: one thread's rate × {}, same run)",
            x.method,
            x.tokens,
            x.gflops / g,
            x.threads
        );
    }
    if r.results.iter().any(|x| !x.stages.is_empty()) {
        println!("stages (median µs a forward; serial: the forward's own work outside them, on the calling thread):");
        for x in &r.results {
            let s: Vec<String> = x.stages.iter().map(|(l, ms)| format!("{l} {:.1}", ms * 1e3)).collect();
            println!("  {:<w$} {:<14} {:>6}  {}", x.method.to_string(), x.backend, x.tokens, s.join(", "));
        }
    }
}
