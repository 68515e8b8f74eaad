//! The `kt` binary: `info`, `bench --json` schema, and one-line errors with exit status 2.

use std::process::Command;

fn kt(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kt")).args(args).env_remove("KT_KERNEL_CPU_VARIANT").output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn info_reports_cpu_and_backends() {
    let (code, out, _) = kt(&["info"]);
    assert_eq!(code, 0);
    assert!(out.contains("CPU:") && out.contains("KT variant:") && out.contains("selected:"), "{out}");
    assert!(out.contains("reference"), "{out}");
    // The transparent-huge-page mode, as the kernel reports it.
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let line = out.lines().find(|l| l.starts_with("huge pages:")).unwrap_or_else(|| panic!("{out}"));
    match thp.split_whitespace().find(|w| w.starts_with('[')) {
        Some("[never]") => assert!(line.contains("never") && line.contains("4 KiB"), "{line}"),
        Some(m) => assert!(line.contains(m.trim_matches(['[', ']'])) && line.contains("2 MiB"), "{line}"),
        None => assert!(line.contains("none"), "{line}"),
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert!(out.lines().any(|l| l.starts_with("ISA:") && l.contains("avx2")), "{out}");
    }
    // Kernels said to run on VNNI only where the CPU has it, and then llamafile's q8_0 and the
    // AVX-512 backends' int8 among them.
    for l in out.lines().filter(|l| l.contains("on VNNI:")) {
        assert!(out.lines().any(|l| l.starts_with("ISA:") && l.contains("vnni")), "{out}");
        let name = l.split_whitespace().next().unwrap_or("");
        let vnni_part = l.split("on VNNI:").nth(1).unwrap_or("");
        match name {
            // (q8_0 on AMX tiles where the CPU has them: that list follows on the line.)
            "llamafile" => assert!(vnni_part.contains("q8_0"), "{out}"),
            n if n.starts_with("avx512") => assert!(vnni_part.contains("int8") && n != "avx512_base", "{out}"),
            _ => {}
        }
    }
    // Kernels said to run on AMX tiles only where the CPU has them.
    if out.lines().any(|l| l.contains("on AMX tiles")) {
        assert!(out.lines().any(|l| l.starts_with("ISA:") && l.contains("amx")), "{out}");
    }
}

#[test]
fn info_shows_the_pool_for_planned_machines() {
    // hwloc reads HWLOC_SYNTHETIC; without the hwloc feature the running machine is shown.
    if !cfg!(feature = "hwloc") {
        eprintln!("skipped: built without the hwloc feature, which reads HWLOC_SYNTHETIC");
        return;
    }
    let run = |topo: &str, args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kt")).arg("info").args(args).env("HWLOC_SYNTHETIC", topo).output();
        let out = out.unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = run("numa:2 core:4 pu:2", &[]);
    assert!(out.contains("2 NUMA node(s), 8 physical core(s), 16 logical CPU(s)"), "{out}");
    assert!(out.contains("sub-pool 0: node 0, 4 thread(s) on CPUs 0,2,4,6"), "{out}");
    assert!(out.contains("sub-pool 1: node 1, 4 thread(s) on CPUs 8,10,12,14"), "{out}");
    let out = run("numa:4 core:8 pu:1", &["--threads", "8", "--numa-parts", "4"]);
    assert!(out.contains("sub-pool 3: node 3, 2 thread(s) on CPUs 24-25"), "{out}");
    let out = run("numa:1 core:2 pu:1", &["--threads", "3"]);
    assert!(out.contains("warning: sub-pool 0") && out.contains("share cores"), "{out}");
}

#[test]
fn forced_unknown_variant_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kt")).arg("info").env("KT_KERNEL_CPU_VARIANT", "sse9").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sse9") && err.contains("valid values") && err.contains("reference"), "{err}");
    // The valid values are this build's backends with kernels.
    if cfg!(all(feature = "avx2", target_arch = "x86_64")) {
        assert!(err.contains("avx2"), "{err}");
    }
}

/// A forced backend that does not run the method: an error naming the format and the backends
/// that do, exit status 2 (no silent fallback to another backend).
#[test]
fn forced_backend_that_declines_the_format_is_a_clear_error() {
    let has_avx2 = Command::new(env!("CARGO_BIN_EXE_kt")).arg("info").output().unwrap();
    if !String::from_utf8_lossy(&has_avx2.stdout)
        .lines()
        .any(|l| l.trim_start().starts_with("avx2") && l.contains("available;"))
    {
        eprintln!("skipped the avx2 half: no avx2 backend runs here");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kt"))
        .args(["bench", "--experts", "4", "--top-k", "2", "--hidden", "256", "--intermediate", "256"])
        .args(["--method", "q4_k", "--tokens", "1", "--min-time", "0", "--layers", "1"])
        .env("KT_KERNEL_CPU_VARIANT", "avx2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("avx2") && err.contains("q4_K") && err.contains("llamafile"), "{err}");
}

#[test]
fn bench_json_has_the_documented_schema() {
    let (code, out, err) = kt(&[
        "bench",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--hidden",
        "64",
        "--intermediate",
        "64",
        "--tokens",
        "1,5",
        "--method",
        "bf16,int4-g32,q8_0",
        "--layers",
        "1",
        "--min-time",
        "0",
        "--threads",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object on stdout");
    let roof = &v["roofline"];
    for k in ["dram_gbps", "fma_gflops", "int8_gops"] {
        assert!(roof[k].as_f64().is_some_and(|x| x > 0.0), "roofline.{k}");
        // The best reading over the probes, the lowest beside it.
        assert!(roof["low"][k].as_f64().is_some_and(|x| x > 0.0 && x <= roof[k].as_f64().unwrap()), "roofline.low.{k}");
    }
    // Present where the CPU has VNNI, null elsewhere; never anything else.
    let vnni = &roof["vnni_gops"];
    assert!(vnni.is_null() || vnni.as_f64().is_some_and(|x| x > 0.0), "roofline.vnni_gops: {vnni}");
    assert_eq!(vnni.is_null(), roof["low"]["vnni_gops"].is_null());
    assert_eq!(roof["probes"], 4, "one probe before the cases, one after each of the 3 methods");
    assert!(v["machine"]["cpu"].is_string());
    assert_eq!(v["machine"]["scales"], "absmax");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 6);
    for r in results {
        for k in ["preset", "method", "backend"] {
            assert!(r[k].is_string(), "{k}");
        }
        for k in ["threads", "tokens"] {
            assert!(r[k].is_u64(), "{k}");
        }
        for k in ["ms_best", "ms_median", "gflops", "weight_gbps", "dram_ratio", "compute_ratio", "rel_err"] {
            assert!(r[k].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "{k} = {}", r[k]);
        }
        assert!(r["ms_best"].as_f64() <= r["ms_median"].as_f64());
        // Decode cases (up to 4 tokens) pair each rep with a DRAM read of its weight bytes.
        let stream = &r["stream_ratio"];
        match r["tokens"].as_u64() {
            Some(1) => assert!(stream.as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "stream_ratio = {stream}"),
            _ => assert!(stream.is_null(), "stream_ratio = {stream} for 5 tokens"),
        }
        // Ratios are to the best probe readings of the instructions the kernels ran on: what
        // each backend says it runs (the reference: scalar; avx2: FMA for bf16, int8 pairs for
        // int4; llamafile's q8_0: VNNI where the CPU has it and rustc was 1.89 or later).
        let f = |k: &str| r[k].as_f64().unwrap();
        let ins = r["instructions"].as_str().expect("instructions: a string");
        let on_vnni = r["vnni"].as_bool().expect("vnni: a bool");
        assert_eq!(on_vnni, ins == "Int8Vnni", "{r}");
        let avx512_bf16 = std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("avx512vnni");
        let amx = !roof["amx_int8_gops"].is_null();
        let expected = match (r["backend"].as_str().unwrap(), r["method"].as_str().unwrap()) {
            ("reference", _) => "Scalar",
            ("avx2", "bf16") => "FmaF32",
            ("avx2", _) => "Int8Pairs",
            // The widest sub-variant this CPU runs: vdpbf16ps with AVX512-BF16, else FMA; VNNI
            // for the int formats where the CPU has it, else vpmaddubsw.
            ("avx512", "bf16") if avx512_bf16 => "Bf16DotZmm",
            ("avx512", "bf16") => "FmaF32Zmm",
            ("avx512", _) if std::arch::is_x86_feature_detected!("avx512vnni") => "Int8Vnni",
            ("avx512", _) => "Int8PairsZmm",
            // An AMX CPU: bf16 on bf16 tiles; int4 in groups of 32 on the AVX-512 kernels (the
            // tiles lose there: `measured_tile_from`).
            ("amx", "bf16") => "AmxBf16",
            ("amx", _) => "Int8Vnni",
            // An AMX CPU: llamafile's 32-column types on int8 tiles.
            ("llamafile", _) if ins == "AmxInt8" && amx => "AmxInt8",
            ("llamafile", _) if vnni.is_null() => "Int8Pairs",
            // A VNNI CPU: VNNI, unless a rustc older than 1.89 built the crate without its kernels.
            ("llamafile", _) if ins == "Int8Pairs" => "Int8Pairs",
            ("llamafile", _) => "Int8Vnni",
            (b, m) => panic!("unexpected backend {b} for {m}"),
        };
        assert_eq!(ins, expected, "{r}");
        let judged = r["judged_by"].as_str().expect("judged_by: a string");
        let peak = match ins {
            "Int8Vnni" => vnni.as_f64(),
            "AmxInt8" => roof["amx_int8_gops"].as_f64().or(vnni.as_f64()),
            "AmxBf16" => roof["amx_bf16_gflops"].as_f64(),
            "Int8Pairs" => roof["int8_gops"].as_f64(),
            "Int8PairsZmm" => roof["int8_512_gops"].as_f64(),
            "FmaF32Zmm" => roof["fma512_gflops"].as_f64(),
            "Bf16DotZmm" => roof["bf16dot512_gflops"].as_f64(),
            _ => roof["fma_gflops"].as_f64(),
        };
        let named = ["vnni", "int8", "int8-512", "fma-512", "bf16dot", "fma", "amx-int8", "amx-bf16"];
        assert!(named.contains(&judged), "judged_by {judged}");
        assert!(
            (f("dram_ratio") - f("weight_gbps") / roof["dram_gbps"].as_f64().unwrap()).abs() <= 1e-9 * f("dram_ratio")
        );
        assert!((f("compute_ratio") - f("gflops") / peak.unwrap()).abs() <= 1e-9 * f("compute_ratio"));
        assert_eq!(r["stages_ms"], serde_json::json!([]), "stages only with --stages");
    }
    assert_eq!(results[1]["tokens"], 5);
    assert_eq!(results[2]["method"], "int4-g32");
}

/// `--stages`: each case's forward stages as it ran them, then its serial work, in the JSON
/// and after the table.
#[test]
fn bench_stages_names_each_stage() {
    let args = ["bench", "--experts", "4", "--top-k", "2", "--hidden", "64", "--intermediate", "64", "--tokens", "1"];
    let args =
        [&args[..], &["--method", "bf16", "--layers", "1", "--min-time", "0", "--threads", "2", "--stages"]].concat();
    let (code, out, err) = kt(&[&args[..], &["--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object on stdout");
    let stages = v["results"][0]["stages_ms"].as_array().expect("stages_ms: an array");
    let names: Vec<&str> = stages.iter().map(|s| s["stage"].as_str().expect("a stage name")).collect();
    assert_eq!(names, ["Gather", "GateUp", "Down", "Reduce", "serial"], "{v}");
    assert!(stages.iter().all(|s| s["ms"].as_f64().is_some_and(|ms| ms.is_finite() && ms >= 0.0)), "{v}");
    let (code, out, err) = kt(&args);
    assert_eq!(code, 0, "{err}");
    let line = out.lines().skip_while(|l| !l.starts_with("stages (median")).nth(1).unwrap_or_default();
    assert!(line.contains("bf16") && line.contains("GateUp") && line.contains("serial"), "{out}");
}

#[test]
fn bad_bench_input_is_one_line_and_exit_2() {
    for (args, needle) in [
        (&["bench", "--preset", "gpt5"][..], "unknown preset"),
        (&["bench", "--method", "int3"][..], "unknown method"),
        (&["bench", "--hidden", "0"][..], "hidden = 0"),
        (&["bench", "--hidden", "-5"][..], "-5"),
        (&["bench", "--experts", "4", "--top-k", "8"][..], "top_k = 8"),
        (&["bench", "--hidden", "48", "--method", "int4-g32"][..], "multiple of 32"),
        (&["bench", "--tokens", "0"][..], "--tokens"),
        (&["bench", "--threads", "0"][..], "--threads"),
        (&["bench", "--numa-parts", "0"][..], "--numa-parts"),
        (&["info", "--threads", "0"][..], "--threads"),
        (&["bench", "--threads", "1", "--numa-parts", "2"][..], "2 NUMA parts"),
        (&["bench", "--preset", "deepseek-v3", "--layers", "20", "--method", "bf16"][..], "GB"),
        (&["bench", "--preset", "kimi-k2", "--layers", "20", "--method", "int4-g32"][..], "GB"),
        (&["bench", "--preset", "gpt-oss-120b", "--method", "int4-g128"][..], "multiple of 128"),
        (&["bench", "--experts", "8", "--tokens", "50000000"][..], "--tokens"),
        (&["bench", "--nonsense"][..], "--nonsense"),
        (&["bench", "--sft", "0", "--hidden", "256", "--intermediate", "128"][..], "positive LoRA rank"),
        (&["bench", "--scales", "l2", "--method", "int4"][..], "valid values: absmax, mse"),
        (&["bench", "--scales", "mse", "--method", "int4,bf16"][..], "format bf16 is not supported with scales"),
        (&["bench", "--scales", "mse", "--method", "q4_0"][..], "GGML types' quantizers pick their own"),
        (&["bench", "--scales", "mse", "--method", "int8", "--sft", "4"][..], "--sft quantizes with absmax"),
    ] {
        let (code, out, err) = kt(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: nothing on stdout");
        let lines: Vec<_> = err.lines().filter(|l| !l.starts_with("kt bench: seed")).collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line, got {err:?}");
        assert!(lines[0].contains(needle), "{args:?}: {err}");
    }
}

/// `kt bench --sft`: one JSON object of per-case times, cache bytes and roofline ratios, each
/// step timed, the roofline probed before the cases and after each method.
#[test]
fn bench_sft_json_has_the_documented_schema() {
    let args = ["bench", "--sft", "4", "--hidden", "256", "--intermediate", "128"];
    let more = ["--experts", "8", "--top-k", "2", "--tokens", "5,17", "--threads", "1", "--min-time", "0", "--json"];
    // A GGML type too: its layer runs on the llamafile backend, with GGML bf16 transposes.
    let (code, out, err) = kt(&[&args[..], &more[..], &["--method", "bf16,int8,q4_0"]].concat());
    assert_eq!(code, 0, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!((j["threads"].as_u64(), j["hidden"].as_u64(), j["top_k"].as_u64()), (Some(1), Some(256), Some(2)));
    let cases = j["sft"].as_array().expect("sft: a list");
    assert_eq!(cases.len(), 6, "{j}");
    for c in cases {
        assert!(["bf16", "int8", "q4_0"].contains(&c["method"].as_str().unwrap()) && c["rank"] == 4, "{c}");
        for k in ["inference_ms", "forward_ms", "backward_ms"] {
            let (best, median) = (c[k][0].as_f64().unwrap(), c[k][1].as_f64().unwrap());
            assert!(best > 0.0 && best <= median, "{k}: {c}");
        }
        assert!(c["cache_bytes"].as_u64().unwrap() > 0 && c["reps"].as_u64().unwrap() >= 3, "{c}");
        assert_eq!(c["full_weight_grad"], false, "{c}");
        // Each step against its roofline: positive times, the bytes of the experts touched (the
        // backward's transposes in bf16 outweigh int8's experts), a named peak.
        for i in 0..3 {
            assert!(c["roofline_ratio"][i].as_f64().is_some_and(|r| r > 0.0), "{c}");
        }
        let (fwd, bwd) = (c["touched_bytes"][0].as_u64().unwrap(), c["touched_bytes"][1].as_u64().unwrap());
        assert!(fwd > 0 && (c["method"] != "int8" || bwd > fwd), "{c}");
        assert!(c["peak"][0].as_str().is_some_and(|p| !p.is_empty()), "{c}");
    }
    assert!(j["roofline"]["dram_gbps"].as_f64().is_some_and(|d| d > 0.0) && j["roofline"]["probes"] == 4, "{j}");
    // Full fine-tuning's backward, on two NUMA parts, with transposes in the layer's format.
    let full = ["--experts", "8", "--top-k", "2", "--tokens", "5,17", "--min-time", "0", "--json"];
    let more = ["--full-weight-grad", "--transposes", "layer", "--threads", "2", "--numa-parts", "2"];
    let (code, out, err) = kt(&[&args[..], &full[..], &more[..], &["--method", "bf16,int8"]].concat());
    assert_eq!(code, 0, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    let cases = j["sft"].as_array().expect("sft: a list");
    assert!(cases.len() == 4 && cases.iter().all(|c| c["full_weight_grad"] == true), "{j}");
    assert!(cases.iter().all(|c| c["transposes"] == "layer" && c["weight_bytes"].as_u64() > Some(0)), "{j}");
}

/// `kt bench --scales mse` quantizes its synthetic weights with the search and says so; the
/// kernels check out against the reference on those weights as on absmax's.
#[test]
fn bench_runs_mse_scales() {
    let args = ["bench", "--experts", "4", "--top-k", "2", "--hidden", "64", "--intermediate", "64", "--tokens", "3"];
    let more = ["--method", "int4-g32", "--layers", "1", "--min-time", "0", "--threads", "1", "--json"];
    let (code, out, err) = kt(&[&args[..], &more[..], &["--scales", "mse"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object on stdout");
    assert_eq!(v["machine"]["scales"], "mse");
    for r in v["results"].as_array().unwrap() {
        assert!(r["rel_err"].as_f64().is_some_and(|e| e < 0.05), "{r}");
    }
}
