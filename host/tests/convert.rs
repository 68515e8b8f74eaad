//! `kt convert` end to end: a bf16 checkpoint (written here) to KT's INT8/INT4 format, file
//! sizes by KT's formulas, a rerun after kill -9 gives identical files, loading with the part
//! count the files were made for equals online quantization, and clear errors otherwise.

use std::path::{Path, PathBuf};
use std::process::Command;

use kt_core::reference::REFERENCE;
use kt_core::sft::TransposeFormat;
use kt_core::testing::{random_experts, random_input, random_routing};
use kt_core::{MoeConfig, WeightFormat};
use kt_host::weights::kt_format::{has_backward, key, load_kt_layer};
use kt_host::weights::writer::{Planned, StreamWriter};
use kt_host::weights::{Checkpoint, Slots};
use kt_host::{LayerOptions, MoeLayer, SftLayer, SftOptions};

const E: usize = 4;
const H: usize = 128;
const I: usize = 256;

/// One SFT step's output, input gradient, weights' gradient and LoRA gradients, as bits.
fn sft_step(layer: &SftLayer, cfg: &MoeConfig) -> Vec<Vec<u32>> {
    use kt_core::sft::{lora_of, random_lora, Backward, LoraGrads};
    use kt_core::{bf16, Routing};
    let (n, k) = (5, cfg.top_k);
    let x = random_input(n, H, 3);
    let (ids, w) = random_routing(n, k, E, 4);
    let mats = random_lora(cfg, 4, false, 5);
    let l = lora_of(&mats, 4, 8.0);
    let mut out = vec![bf16::ZERO; n * H];
    let rt = Routing { tokens: n, k, ids: &ids, weights: &w, gpu_mask: None };
    layer.forward(&x, &rt, Some(&l), true, &mut out).unwrap();
    let (mut gi, mut gw) = (vec![bf16::ZERO; n * H], vec![0.0f32; n * k]);
    let mut grads = random_lora(cfg, 4, true, 6);
    let [a, b, c, d, e, f] = &mut grads;
    let lora = Some(LoraGrads { gate_a: a, gate_b: b, up_a: c, up_b: d, down_a: e, down_b: f });
    let outs = Backward { grad_input: &mut gi, grad_weights: &mut gw, lora, base: None, grad_scale: 1.0 };
    layer.backward(&random_input(n, H, 7), Some(&l), outs).unwrap();
    let bits = |v: &[bf16]| v.iter().map(|x| u32::from(x.to_bits())).collect::<Vec<u32>>();
    let mut all = vec![bits(&out), bits(&gi), gw.iter().map(|x| x.to_bits()).collect()];
    all.extend(grads.iter().map(|g| bits(g)));
    all
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kt-convert-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect()
}

/// Layers 1 and 2 are MoE (deepseek naming, bf16); layer 0 is dense. Returns each MoE layer's
/// experts (bf16-rounded f32).
fn write_checkpoint(dir: &Path) -> Vec<Vec<[Vec<f32>; 3]>> {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = MoeConfig::new(E, 2, H, I);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = vec![
        ("model.embed_tokens.weight".into(), vec![8, H], bf16_bytes(&vec![0.5; 8 * H])),
        ("model.layers.0.mlp.down_proj.weight".into(), vec![H, 16], bf16_bytes(&vec![0.25; 16 * H])),
    ];
    let mut layers = Vec::new();
    for l in [1usize, 2] {
        let xs = random_experts(&cfg, l as u64);
        for (e, x) in xs.iter().enumerate() {
            for (p, (proj, shape)) in [("gate", [I, H]), ("up", [I, H]), ("down", [H, I])].into_iter().enumerate() {
                tensors.push((
                    format!("model.layers.{l}.mlp.experts.{e}.{proj}_proj.weight"),
                    shape.to_vec(),
                    bf16_bytes(&x[p]),
                ));
            }
        }
        let rounded = xs
            .iter()
            .map(|x| x.clone().map(|m| m.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect()))
            .collect();
        layers.push(rounded);
    }
    let plan = tensors
        .iter()
        .map(|(n, s, b)| Planned { name: n.clone(), dtype: "BF16".into(), shape: s.clone(), bytes: b.len() })
        .collect();
    let mut w = StreamWriter::create(&dir.join("model.safetensors"), plan, &[]).unwrap();
    for (n, _, b) in &tensors {
        w.write(n, b).unwrap();
    }
    w.finish().unwrap();
    let config = serde_json::json!({"n_routed_experts": E, "num_experts_per_tok": 2, "hidden_size": H,
        "moe_intermediate_size": I, "num_hidden_layers": 3});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    layers
}

fn kt(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kt")).args(args).envs(env.iter().copied()).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn convert(input: &Path, output: &Path, method: &str, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let (i, o) = (input.to_str().unwrap(), output.to_str().unwrap());
    kt(&["convert", "--input", i, "--output", o, "--method", method, "--parts", "2", "--threads", "2"], env)
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn convert_sizes_resume_and_load() {
    let (input, out_a, out_b) = (tmp("in"), tmp("a"), tmp("b"));
    let layers = write_checkpoint(&input);

    // Uninterrupted run.
    let started = std::time::Instant::now();
    let (code, stdout, err) = convert(&input, &out_a, "int8", &[]);
    let run_ms = started.elapsed().as_millis() as u64;
    assert_eq!(code, Some(0), "{err}");
    assert!(stdout.contains("2 layer(s) written, 0 already complete, method AMXINT8"), "{stdout}");
    let names: Vec<String> = files(&out_a).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json"
        ]
    );
    let ck = Checkpoint::open(&out_a).unwrap();
    // KT's sizes per part (I/2 = 128 rows): INT8 weight R·C bytes, scale 4·R bytes.
    let t = ck.get(&key(2, 0, 3, 1, "weight")).unwrap();
    assert_eq!((format!("{:?}", t.dtype), ck.bytes(t).len()), ("I8".to_string(), 128 * H));
    assert_eq!(ck.bytes(ck.get(&key(2, 2, 0, 0, "scale")).unwrap()).len(), 4 * H);
    assert!(ck.contains("embed_tokens.weight") && ck.contains("blk.0.mlp.down_proj.weight"));
    assert_eq!(ck.metadata("numa_parts"), Some("2"));

    // kt bench runs on the converted files and on the original checkpoint.
    for (dir, method) in [(&out_a, "int8"), (&input, "bf16")] {
        let d = dir.to_str().unwrap();
        let args =
            ["bench", "--weights", d, "--method", method, "--numa-parts", "2", "--threads", "2", "--tokens", "1,3"];
        let (code, out, err) = kt(&[&args[..], &["--min-time", "0", "--json"]].concat(), &[]);
        assert_eq!(code, Some(0), "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["results"].as_array().unwrap().len(), 2, "{out}");
        assert!(v["results"][0]["preset"].as_str().unwrap().starts_with("checkpoint"));
    }
    let (code, _, err) = kt(&["bench", "--weights", out_a.to_str().unwrap(), "--method", "int8", "--tokens", "1"], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("converted for 2 NUMA part(s) but 1 requested"), "{err}");

    // Killed (SIGKILL) at random points of a run (the seed printed, to replay a failure), then
    // rerun: every file the kill left under a final name is already complete (byte for byte the
    // uninterrupted run's), and the rerun keeps only complete layers and ends with the
    // uninterrupted run's files. (A kill after the run finished leaves nothing to redo.)
    let seed = std::env::var("KT_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    println!("kill points: KT_TEST_SEED={seed}, uninterrupted run {run_ms} ms");
    let mut rng = seed;
    let reference = files(&out_a);
    for run in 0..6 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let delay_ms = rng % (run_ms + run_ms / 4 + 1);
        let out = PathBuf::from(format!("{}-{run}", out_b.display()));
        let _ = std::fs::remove_dir_all(&out);
        let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
        let mut child = Command::new(env!("CARGO_BIN_EXE_kt"))
            .args(["convert", "--input", i, "--output", o, "--method", "int8", "--parts", "2", "--threads", "2"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        if out.exists() {
            for (name, bytes) in files(&out).into_iter().filter(|(n, _)| !n.ends_with(".tmp")) {
                let want = reference.iter().find(|(n, _)| *n == name).map(|(_, b)| b);
                assert!(want == Some(&bytes), "killed after {delay_ms} ms: {name} is incomplete");
            }
        }
        let (code, stdout, err) = convert(&input, &out, "int8", &[]);
        assert_eq!(code, Some(0), "{err}");
        assert!(stdout.contains("already complete"), "{stdout}");
        assert!(reference == files(&out), "killed after {delay_ms} ms: the rerun's files differ (or a .tmp is left)");
        std::fs::remove_dir_all(&out).unwrap();
    }

    // Loading with the converted part count equals quantizing online; another count is refused.
    let cfg = MoeConfig { parts: 2, max_tokens: 8, ..MoeConfig::new(E, 2, H, I) };
    let opts = LayerOptions { backend: Some(&REFERENCE), ..LayerOptions::threads(2) };
    let loaded = load_kt_layer(&ck, 2, WeightFormat::Int8Row, &cfg, Slots::default(), &opts).unwrap();
    let online = MoeLayer::from_f32(&cfg, WeightFormat::Int8Row, |e| Some(layers[1][e].clone()), &opts).unwrap();
    let input_x = random_input(5, H, 1);
    let (ids, w) = random_routing(5, 2, E, 2);
    assert_eq!(loaded.forward(&input_x, &ids, &w, None).unwrap(), online.forward(&input_x, &ids, &w, None).unwrap());
    for parts in [1, 4] {
        let e =
            load_kt_layer(&ck, 2, WeightFormat::Int8Row, &MoeConfig { parts, ..cfg.clone() }, Slots::default(), &opts)
                .unwrap_err()
                .to_string();
        assert!(e.contains("converted for 2 NUMA part(s)") && e.contains(&format!("{parts} requested")), "{e}");
    }
    let e = load_kt_layer(&ck, 2, WeightFormat::Int4Row, &cfg, Slots::default(), &opts).unwrap_err().to_string();
    assert!(e.contains("converted as AMXINT8 but loaded as AMXINT4"), "{e}");

    // GPU-resident slots are neither read nor packed: no bytes, and the CPU part of the output
    // is the same as a full layer's under that mask; routing to one unmasked is an error.
    let gpu = [false, true, false, true];
    let mask = Slots { map: None, gpu: Some(&gpu) };
    for l in [
        load_kt_layer(&ck, 2, WeightFormat::Int8Row, &cfg, mask, &opts).unwrap(),
        kt_host::weights::load_layer(&Checkpoint::open(&input).unwrap(), 2, WeightFormat::Int8Row, &cfg, mask, &opts)
            .unwrap(),
    ] {
        assert_eq!((l.expert_bytes(1), l.expert_bytes(3)), (0, 0));
        assert!(l.expert_bytes(0) > 0);
        let want = loaded.forward(&input_x, &ids, &w, Some(&gpu)).unwrap();
        assert_eq!(l.forward(&input_x, &ids, &w, Some(&gpu)).unwrap(), want);
        assert!(l.forward(&input_x, &ids, &w, None).unwrap_err().to_string().contains("expert"));
    }

    // int4 files are half the size and load too.
    let out_c = tmp("c");
    assert_eq!(convert(&input, &out_c, "AMXINT4", &[]).0, Some(0));
    let ck4 = Checkpoint::open(&out_c).unwrap();
    assert_eq!(ck4.bytes(ck4.get(&key(1, 1, 0, 0, "weight")).unwrap()).len(), 128 * H / 2);
    let l4 = load_kt_layer(&ck4, 1, WeightFormat::Int4Row, &cfg, Slots::default(), &opts).unwrap();
    let o4 = MoeLayer::from_f32(&cfg, WeightFormat::Int4Row, |e| Some(layers[0][e].clone()), &opts).unwrap();
    assert_eq!(l4.forward(&input_x, &ids, &w, None).unwrap(), o4.forward(&input_x, &ids, &w, None).unwrap());

    // SFT layers load converted files (KT's AMXINT8_SFT / AMXINT4_SFT take only these), slots
    // mapped: a step gives the bits of the same layer quantized online, with bf16 transposes
    // and with transposes in the layer's format, read from `--backward` files (KT's
    // `ffn_*_bwd_exps`, quantized from the same values as online).
    let map = [2usize, 0, 3, 1];
    let slots = Slots { map: Some(&map), gpu: None };
    let (bf16_t, layer_t) =
        (SftOptions::default(), SftOptions { transposes: TransposeFormat::Layer, ..Default::default() });
    for (method, layer, format) in [("int8", 2, WeightFormat::Int8Row), ("int4", 1, WeightFormat::Int4Row)] {
        let out = tmp(&format!("bwd-{method}"));
        let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
        let args = ["convert", "--input", i, "--output", o, "--method", method, "--parts", "2", "--backward"];
        assert_eq!(kt(&args, &[]).0, Some(0), "{method}");
        let ckb = Checkpoint::open(&out).unwrap();
        let plain = if format == WeightFormat::Int8Row { &ck } else { &ck4 };
        assert!(has_backward(&ckb, layer) && !has_backward(plain, layer));
        let expert = |slot: usize| Some(layers[layer - 1][map[slot]].clone());
        for (sft, files) in [(bf16_t, [plain, &ckb]), (layer_t, [&ckb, &ckb])] {
            let online = sft_step(&SftLayer::from_f32(&cfg, format, expert, &opts, sft).unwrap(), &cfg);
            for ck in files {
                let from_file = SftLayer::from_converted(ck, layer, format, &cfg, slots, &opts, sft).unwrap();
                assert!(sft_step(&from_file, &cfg) == online, "{format} {:?}", sft.transposes);
            }
        }
        // Transposes in the layer's format take its bytes (a quarter of bf16's for int4).
        let sizes = [bf16_t, layer_t]
            .map(|sft| SftLayer::from_converted(&ckb, layer, format, &cfg, slots, &opts, sft).unwrap().bytes());
        assert!(sizes[1] < sizes[0], "{sizes:?}");
        std::fs::remove_dir_all(&out).unwrap();
    }

    // Our other formats convert and load exactly too (same keys, their own bytes).
    for (method, format) in [
        ("int4-g32", WeightFormat::Int4Group { group: 32 }),
        ("bf16", WeightFormat::Bf16),
        ("fp8", WeightFormat::Fp8Block),
        ("mxfp4", WeightFormat::Mxfp4),
        ("MXFP8", WeightFormat::Mxfp8),
    ] {
        let out = tmp(method);
        assert_eq!(convert(&input, &out, method, &[]).0, Some(0), "{method}");
        let ck = Checkpoint::open(&out).unwrap();
        let l = load_kt_layer(&ck, 1, format, &cfg, Slots::default(), &opts).unwrap();
        let o = MoeLayer::from_f32(&cfg, format, |e| Some(layers[0][e].clone()), &opts).unwrap();
        assert_eq!(
            l.forward(&input_x, &ids, &w, None).unwrap(),
            o.forward(&input_x, &ids, &w, None).unwrap(),
            "{method}"
        );
        let e = load_kt_layer(&ck, 1, WeightFormat::Int8Row, &cfg, Slots::default(), &opts).unwrap_err().to_string();
        assert!(e.contains(&format!("converted as {format}")), "{e}");
        std::fs::remove_dir_all(&out).unwrap();
    }

    for d in [&input, &out_a, &out_c] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// Runs `script` with `sh` in a private mount namespace (root only) with `$OUT` a fresh tmpfs of
/// `size`, `$KT` the binary and `$IN`/`$REF` the given directories; `None` (and a line saying
/// why) where mount namespaces are not allowed.
fn in_tmpfs(size: &str, input: &Path, reference: &Path, script: &str) -> Option<(String, String)> {
    let mnt = tmp(&format!("mnt-{size}"));
    std::fs::create_dir_all(&mnt).unwrap();
    let full = format!("mount -t tmpfs -o size={size} tmpfs \"$OUT\" || exit 99\n{script}");
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &full])
        .env("OUT", &mnt)
        .env("KT", env!("CARGO_BIN_EXE_kt"))
        .env("IN", input)
        .env("REF", reference)
        .output();
    let _ = std::fs::remove_dir_all(&mnt);
    match out {
        Ok(o) if o.status.code() != Some(99) && o.status.code() != Some(1) || o.status.success() => {
            Some((String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into()))
        }
        Ok(o) => {
            println!("skipped: no private tmpfs here ({})", String::from_utf8_lossy(&o.stderr).trim());
            None
        }
        Err(e) => {
            println!("skipped: unshare not runnable here ({e})");
            None
        }
    }
}

#[test]
fn full_disk_and_read_only_output_are_one_error_and_leave_no_partial_file() {
    let (input, reference) = (tmp("fault-in"), tmp("fault-ref"));
    write_checkpoint(&input);
    assert_eq!(convert(&input, &reference, "int8", &[]).0, Some(0));
    let run = r#"$KT convert --input "$IN" --output "$OUT/m" --method int8 --parts 2 --threads 2 > /dev/null"#;
    let list = r#"echo "rc=$?"; (cd "$OUT/m" && find . -type f | sort)"#;

    // A disk with room for the first layer's file only: one error naming the file and the
    // cause, nothing partial left; with room again, the rerun completes the same files.
    let script = format!(
        "{run}\n{list}\nmount -o remount,size=8m \"$OUT\"\n{run}\necho \"rc=$?\"\n\
         for f in \"$REF\"/*; do cmp -s \"$f\" \"$OUT/m/${{f##*/}}\" || echo \"differs: $f\"; done\n\
         echo files=$(ls \"$OUT/m\" | wc -l)"
    );
    let Some((out, err)) = in_tmpfs("600k", &input, &reference, &script) else { return };
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("rc=2"), "{out}{err}");
    let left: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("rc=")).collect();
    assert_eq!(left, ["./model-00001-of-00003.safetensors"], "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("model-00002-of-00003.safetensors") && err.contains("No space left on device"), "{err}");
    assert!(out.ends_with("files=6\n") && !out.contains("differs") && out.contains("rc=0"), "{out}");

    // A read-only output directory: one error naming it, nothing written.
    let script = format!("mkdir \"$OUT/m\"\nmount -o remount,ro \"$OUT\"\n{run}\n{list}");
    let Some((out, err)) = in_tmpfs("1m", &input, &reference, &script) else { return };
    assert_eq!(out, "rc=2\n", "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/m/model-00001-of-00003.safetensors") && err.contains("Read-only file system"), "{err}");
    for d in [&input, &reference] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn truncated_or_corrupted_converted_files_are_refused_naming_file_and_tensor() {
    let (input, out) = (tmp("trunc-in"), tmp("trunc-out"));
    write_checkpoint(&input);
    assert_eq!(convert(&input, &out, "int8", &[]).0, Some(0));
    let shard = out.join("model-00002-of-00003.safetensors");
    let good = std::fs::read(&shard).unwrap();
    let load = || {
        let cfg = MoeConfig { parts: 2, max_tokens: 8, ..MoeConfig::new(E, 2, H, I) };
        let opts = LayerOptions { backend: Some(&REFERENCE), ..LayerOptions::threads(1) };
        Checkpoint::open(&out)
            .and_then(|ck| load_kt_layer(&ck, 2, WeightFormat::Int8Row, &cfg, Slots::default(), &opts))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let header = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize + 8;
    for cut in [good.len() - 1, header + (good.len() - header) / 2, header + 1] {
        std::fs::write(&shard, &good[..cut]).unwrap();
        let e = load();
        assert!(
            e.contains(shard.to_str().unwrap()) && e.contains("tensor blk.2.ffn_") && e.contains("truncated"),
            "{e}"
        );
    }
    // Cut inside the header, and a header whose offsets were overwritten: the file named, and
    // the tensor where the parser names one.
    std::fs::write(&shard, &good[..header / 2]).unwrap();
    assert!(load().contains(shard.to_str().unwrap()), "{}", load());
    let text = String::from_utf8_lossy(&good[8..header]).into_owned();
    let first = text.find("\"data_offsets\":[0,").unwrap();
    let mut bad = good.clone();
    bad[8 + first + 18] = b'9';
    std::fs::write(&shard, &bad).unwrap();
    let e = load();
    assert!(e.contains(shard.to_str().unwrap()) && e.contains("blk.2.ffn_"), "{e}");
    for d in [&input, &out] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn bad_convert_arguments_are_one_line_errors() {
    let input = tmp("bad");
    write_checkpoint(&input);
    let i = input.to_str().unwrap();
    for (args, needle) in [
        (vec!["convert", "--input", i, "--output", "/proc/kt-out", "--method", "int8"], "/proc/kt-out"),
        (vec!["convert", "--input", "/nonexistent/x", "--output", "/tmp/x", "--method", "int8"], "/nonexistent/x"),
        (vec!["convert", "--input", i, "--output", "/tmp/x", "--method", "int3"], "unknown method"),
        (vec!["convert", "--input", i, "--output", "/tmp/x", "--layers", "5-2"], "--layers"),
        (vec!["convert", "--input", i, "--output", "/tmp/x", "--parts", "0"], "--parts"),
    ] {
        let (code, out, err) = kt(&args, &[]);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&input).unwrap();
}

/// gpt-oss's experts carry biases, which neither KT's converted format nor GGUF conversion
/// holds: one line naming them, and no output.
#[test]
fn experts_with_biases_are_refused_by_convert() {
    let input = tmp("biases");
    std::fs::create_dir_all(&input).unwrap();
    let p = "model.layers.0.mlp.experts";
    let tensors = [
        (format!("{p}.gate_up_proj"), vec![E, H, 2 * I]),
        (format!("{p}.gate_up_proj_bias"), vec![E, 2 * I]),
        (format!("{p}.down_proj"), vec![E, I, H]),
        (format!("{p}.down_proj_bias"), vec![E, H]),
    ];
    let plan = tensors
        .iter()
        .map(|(n, s)| Planned {
            name: n.clone(),
            dtype: "BF16".into(),
            shape: s.clone(),
            bytes: 2 * s.iter().product::<usize>(),
        })
        .collect();
    let mut w = StreamWriter::create(&input.join("model.safetensors"), plan, &[]).unwrap();
    for (n, s) in &tensors {
        w.write(n, &bf16_bytes(&vec![0.5; s.iter().product()])).unwrap();
    }
    w.finish().unwrap();
    let config = serde_json::json!({"num_local_experts": E, "num_experts_per_tok": 2, "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": 1});
    std::fs::write(input.join("config.json"), config.to_string()).unwrap();
    for method in ["int8", "q8_0"] {
        let output = tmp(&format!("biases-out-{method}"));
        let (code, _, err) = convert(&input, &output, method, &[]);
        assert_ne!(code, Some(0), "{method}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("biases") && err.contains("model.layers.0"), "{method}: {err}");
        assert!(!output.exists(), "{method}: output directory made");
    }
    std::fs::remove_dir_all(&input).unwrap();
}

/// `kt bench --layerwise`: every expert of the first MoE layer (layer 1 here) written for 2
/// GPU ranks on the pool, reported in the documented JSON; a file that is not a Hugging Face
/// checkpoint (KT's converted format) is refused in one line.
#[test]
fn layerwise_bench_writes_the_first_moe_layer_on_the_pool() {
    let (input, converted) = (tmp("layerwise-in"), tmp("layerwise-kt"));
    write_checkpoint(&input);
    let d = input.to_str().unwrap();
    let args = ["bench", "--weights", d, "--layerwise", "--tp", "2", "--threads", "2", "--min-time", "0", "--json"];
    let (code, out, err) = kt(&args, &[]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let r = &v["layerwise"];
    assert_eq!(
        (r["encoding"].as_str(), r["layer"].as_u64(), r["tp"].as_u64()),
        (Some("Bf16"), Some(1), Some(2)),
        "{out}"
    );
    assert_eq!((r["experts"].as_u64(), r["threads"].as_u64()), (Some(E as u64), Some(2)), "{out}");
    assert_eq!(r["expert_bytes"].as_u64(), Some((3 * H * I * 2) as u64), "{out}");
    assert!(r["reps"].as_u64().is_some_and(|n| n >= 3), "{out}");
    for key in ["ms_best", "ms_median", "gbps", "dram_gbps", "dram_ratio"] {
        assert!(r[key].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()), "{key}: {out}");
    }
    let (code, _, err) = convert(&input, &converted, "int8", &[]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = kt(&["bench", "--weights", converted.to_str().unwrap(), "--layerwise"], &[]);
    assert_eq!((code, out.as_str()), (Some(2), ""), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("not a Hugging Face safetensors checkpoint"), "{err}");
    for d in [input, converted] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn convert_to_gguf_loads_as_online_quantization_and_benches() {
    let (input, out) = (tmp("gguf-in"), tmp("gguf-out"));
    let layers = write_checkpoint(&input);
    let (code, stdout, err) = convert(&input, &out, "q8_0", &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(stdout.contains("2 layer(s) written, 0 already complete, method q8_0"), "{stdout}");
    let names: Vec<String> = files(&out).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]);

    // Every expert of layer 2 equals quantizing the same f32 weights online (same quantizer).
    use kt_host::gguf::{load_gguf_layer, moe_config, moe_layers, GgufFile};
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(moe_layers(&f), [1, 2]);
    let cfg = MoeConfig { parts: 2, ..moe_config(&f).unwrap() };
    assert_eq!((cfg.experts, cfg.hidden, cfg.intermediate), (E, H, I));
    let opts = LayerOptions::threads(2);
    let from_file = load_gguf_layer(&f, 2, &cfg, Slots::default(), &opts).unwrap();
    let q8 = WeightFormat::Ggml(kt_core::ggml::GgmlType::Q8_0);
    let online = MoeLayer::from_f32(&cfg, q8, |e| Some(layers[1][e].clone()), &opts).unwrap();
    let x = random_input(5, H, 3);
    let (ids, w) = random_routing(5, 2, E, 4);
    assert_eq!(from_file.forward(&x, &ids, &w, None).unwrap(), online.forward(&x, &ids, &w, None).unwrap());

    // A rerun keeps both files; kt bench runs the GGUF in its own type.
    let (code, stdout, err) = convert(&input, &out, "q8_0", &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(stdout.contains("0 layer(s) written, 2 already complete"), "{stdout}");
    let d = out.to_str().unwrap();
    let (code, bench, err) =
        kt(&["bench", "--weights", d, "--threads", "2", "--tokens", "1,3", "--min-time", "0", "--json"], &[]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(bench.trim()).unwrap();
    let r = &v["results"][0];
    let backend = if cfg!(feature = "llamafile") { "llamafile" } else { "reference" };
    assert_eq!((r["method"].as_str(), r["backend"].as_str()), (Some("q8_0"), Some(backend)), "{bench}");
    assert!(r["rel_err"].as_f64().is_some_and(|e| e < 1e-2), "{bench}");
    // Another method on a GGUF model is refused, naming its types.
    let (code, _, err) = kt(&["bench", "--weights", d, "--method", "int8", "--min-time", "0"], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("GGUF model in q8_0"), "{err}");
    // A type without a quantizer here is named.
    let q6 = tmp("gguf-q6");
    let (code, _, err) = convert(&input, &q6, "q6_k", &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("q6_K cannot be quantized"), "{err}");
    assert!(!q6.exists(), "a refused conversion leaves no output folder");
    std::fs::remove_dir_all(&input).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
}

/// `--scales mse`: the files hold the searched scales exactly (loading them equals quantizing
/// the same weights with `LayerOptions::scales`), a 4-bit layer is closer to the unquantized
/// one than absmax's, a rerun with the other rule rewrites rather than resumes, and the rule is
/// refused where it chooses nothing.
#[test]
fn mse_scales_convert_exactly_and_resume_by_rule() {
    let input = tmp("mse-in");
    let layers = write_checkpoint(&input);
    let cfg = MoeConfig { parts: 2, ..MoeConfig::new(E, 2, H, I) };
    let opts = LayerOptions { backend: Some(&REFERENCE), ..LayerOptions::threads(2) };
    let mse = LayerOptions { scales: kt_core::Scales::Mse, ..opts.clone() };
    let (n, k) = (6, 2);
    let x = random_input(n, H, 11);
    let (ids, w) = random_routing(n, k, E, 12);
    let exact = MoeLayer::from_f32(&cfg, WeightFormat::Bf16, |e| Some(layers[0][e].clone()), &opts).unwrap();
    let want = exact.forward(&x, &ids, &w, None).unwrap();
    let sq = |out: &[half::bf16]| -> f64 {
        out.iter().zip(&want).map(|(a, b)| (f64::from(a.to_f32()) - f64::from(b.to_f32())).powi(2)).sum()
    };
    let run = |method: &str, out: &Path, scales: &str| {
        let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
        kt(
            &[
                "convert",
                "--input",
                i,
                "--output",
                o,
                "--method",
                method,
                "--parts",
                "2",
                "--threads",
                "2",
                "--scales",
                scales,
            ],
            &[],
        )
    };
    for (method, format) in [
        ("int4", WeightFormat::Int4Row),
        ("int4-g32", WeightFormat::Int4Group { group: 32 }),
        ("int8", WeightFormat::Int8Row),
        ("fp8", WeightFormat::Fp8Block),
        ("mxfp4", WeightFormat::Mxfp4),
    ] {
        let (out_mse, out_abs) = (tmp(&format!("mse-{method}")), tmp(&format!("abs-{method}")));
        let (code, stdout, err) = run(method, &out_mse, "mse");
        assert_eq!(code, Some(0), "{method}: {err}");
        assert!(stdout.contains("2 layer(s) written, 0 already complete"), "{stdout}");
        assert_eq!(run(method, &out_abs, "absmax").0, Some(0));
        let load = |dir: &Path| {
            let ck = Checkpoint::open(dir).unwrap();
            load_kt_layer(&ck, 1, format, &cfg, Slots::default(), &opts).unwrap().forward(&x, &ids, &w, None).unwrap()
        };
        let online = MoeLayer::from_f32(&cfg, format, |e| Some(layers[0][e].clone()), &mse).unwrap();
        let got = load(&out_mse);
        assert_eq!(got, online.forward(&x, &ids, &w, None).unwrap(), "{method}");
        // Where the weights' gain is large (4 bits) it shows in the layer's output; int8's and
        // fp8's (under 1%) drown in the activations' rounding at six tokens.
        let (e_mse, e_abs) = (sq(&got), sq(&load(&out_abs)));
        assert!(e_mse < e_abs || !method.contains('4'), "{method}: mse {e_mse} against absmax {e_abs}");

        // The rule is part of what a rerun checks: the same rule resumes, the other rewrites.
        let (_, stdout, _) = run(method, &out_mse, "mse");
        assert!(stdout.contains("0 layer(s) written, 2 already complete"), "{stdout}");
        let (_, stdout, _) = run(method, &out_mse, "absmax");
        assert!(stdout.contains("2 layer(s) written, 0 already complete"), "{stdout}");
        assert_eq!(files(&out_mse), files(&out_abs), "{method}: absmax over mse gives absmax's files");
        for d in [&out_mse, &out_abs] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
    let out = tmp("mse-refused");
    for (method, what) in [("q8_0", "format q8_0 is not supported with scales \"mse\""), ("bf16", "bf16 has none")] {
        let (code, _, err) = run(method, &out, "mse");
        assert_eq!(code, Some(2), "{method}");
        assert!(err.contains(what), "{method}: {err}");
    }
    let (code, _, err) = run("int4", &out, "l2");
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown --scales \"l2\"; valid values: absmax, mse"), "{err}");
    assert!(!out.exists(), "a refused conversion writes nothing");
    std::fs::remove_dir_all(&input).unwrap();
}
