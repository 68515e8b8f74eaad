//! A 4-bit checkpoint (compressed-tensors "pack-quantized", Kimi-K2's, quantized as
//! compressed-tensors quantizes: scale amax/7.5, levels −8..7) loads as stored into a layer in
//! its own K-group: the inference and SFT layers equal layers built from its nibbles and
//! scales, bit for bit; a layer in another group is requantized from its values. `kt convert`
//! writes it the same way.

use std::path::{Path, PathBuf};

use kt_core::dtype::round_ne;
use kt_core::sft::Backward;
use kt_core::testing::{random_experts, random_input, random_routing};
use kt_core::{bf16, MoeConfig, QuantMatrix, Routing, WeightFormat};
use kt_host::convert::{convert, ConvertSpec};
use kt_host::weights::kt_format::load_kt_layer;
use kt_host::weights::writer::{Planned, StreamWriter};
use kt_host::weights::{load_layer, Checkpoint, Slots};
use kt_host::{LayerOptions, MoeLayer, SftLayer, SftOptions};

const E: usize = 4;
const H: usize = 128;
const I: usize = 256;
const G32: WeightFormat = WeightFormat::Int4Group { group: 32 };

/// One matrix as compressed-tensors stores it: offset-8 nibbles (as int32 words, 8 a word
/// along the row, the low first: little-endian, our byte order) and bf16 scales.
fn quantize(rows: usize, cols: usize, x: &[f32]) -> QuantMatrix {
    let mut data = vec![0u8; rows * cols / 2];
    let mut scales = Vec::new();
    for (r, row) in x.chunks(cols).enumerate() {
        for (g, group) in row.chunks(32).enumerate() {
            let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = half::bf16::from_f32(amax / 7.5).to_f32();
            scales.push(s);
            for (j, v) in group.iter().enumerate() {
                let (c, q) = (g * 32 + j, (round_ne(v / s).clamp(-8.0, 7.0) + 8.0) as u8);
                data[(r * cols + c) / 2] |= q << (4 * (c % 2));
            }
        }
    }
    QuantMatrix::from_parts(G32, rows, cols, data, scales).unwrap()
}

/// A one-layer compressed-tensors checkpoint (Qwen3 naming); its experts as stored. With
/// `nan`, expert 1's up scale 5 is a NaN.
fn write_checkpoint(dir: &Path, nan: bool) -> Vec<[QuantMatrix; 3]> {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = MoeConfig::new(E, 2, H, I);
    let experts: Vec<[QuantMatrix; 3]> = random_experts(&cfg, 9)
        .iter()
        .map(|x| [quantize(I, H, &x[0]), quantize(I, H, &x[1]), quantize(H, I, &x[2])])
        .collect();
    let mut tensors: Vec<(String, &str, Vec<usize>, Vec<u8>)> = Vec::new();
    for (e, ms) in experts.iter().enumerate() {
        for (m, proj) in ms.iter().zip(["gate", "up", "down"]) {
            let stem = format!("model.layers.0.mlp.experts.{e}.{proj}_proj");
            let (rows, cols) = (m.rows(), m.cols());
            let mut scales: Vec<u8> = m.scales().iter().flat_map(|s| half::bf16::from_f32(*s).to_le_bytes()).collect();
            if nan && (e, proj) == (1, "up") {
                scales[10..12].copy_from_slice(&half::bf16::NAN.to_le_bytes());
            }
            tensors.push((format!("{stem}.weight_packed"), "I32", vec![rows, cols / 8], m.data().to_vec()));
            tensors.push((format!("{stem}.weight_scale"), "BF16", vec![rows, cols / 32], scales));
        }
    }
    let plan = tensors
        .iter()
        .map(|(n, d, s, b)| Planned { name: n.clone(), dtype: (*d).into(), shape: s.clone(), bytes: b.len() })
        .collect();
    let mut w = StreamWriter::create(&dir.join("model.safetensors"), plan, &[]).unwrap();
    for (n, _, _, b) in &tensors {
        w.write(n, b).unwrap();
    }
    w.finish().unwrap();
    let config = serde_json::json!({"num_experts": E, "num_experts_per_tok": 2, "hidden_size": H,
        "moe_intermediate_size": I, "num_hidden_layers": 1});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    experts
}

/// `n` tokens (inputs from `seed`, routing from `seed + 1`) and the outputs a layer built from
/// the stored experts gives them: what every path that reads the checkpoint as stored must give.
struct Probe {
    x: Vec<bf16>,
    ids: Vec<i64>,
    w: Vec<f32>,
    want: Vec<bf16>,
}

impl Probe {
    fn new(stored: &[[QuantMatrix; 3]], cfg: &MoeConfig, opts: &LayerOptions, n: usize, seed: u64) -> Probe {
        let x = random_input(n, H, seed);
        let (ids, w) = random_routing(n, 2, E, seed + 1);
        let layer = MoeLayer::from_quantized(cfg, |e| Some(stored[e].clone().into()), G32, opts).unwrap();
        let want = layer.forward(&x, &ids, &w, None).unwrap();
        Probe { x, ids, w, want }
    }

    /// `layer`'s outputs for these tokens.
    fn outputs(&self, layer: &MoeLayer) -> Vec<bf16> {
        layer.forward(&self.x, &self.ids, &self.w, None).unwrap()
    }
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kt-int4-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// An SFT layer's forward output and input gradient, as bits.
fn sft_bits(layer: &SftLayer, x: &[bf16], rt: &Routing<'_>) -> Vec<u16> {
    let mut out = vec![bf16::ZERO; x.len()];
    layer.forward(x, rt, None, true, &mut out).unwrap();
    let (mut gi, mut gw) = (vec![bf16::ZERO; x.len()], vec![0.0f32; rt.ids.len()]);
    let grads = Backward { grad_input: &mut gi, grad_weights: &mut gw, lora: None, base: None, grad_scale: 1.0 };
    layer.backward(&random_input(rt.tokens, H, 5), None, grads).unwrap();
    out.iter().chain(&gi).map(|v| v.to_bits()).collect()
}

#[test]
fn a_4bit_checkpoint_in_its_own_group_loads_as_stored() {
    let dir = tmp("ct");
    let stored = write_checkpoint(&dir, false);
    let ck = Checkpoint::open(&dir).unwrap();
    let cfg = MoeConfig { parts: 2, ..MoeConfig::new(E, 2, H, I) };
    let opts = LayerOptions::threads(2);
    let p = Probe::new(&stored, &cfg, &opts, 5, 3);
    let loaded = load_layer(&ck, 0, G32, &cfg, Slots::default(), &opts).unwrap();
    assert_eq!(p.outputs(&loaded), p.want);
    // In groups of 128 the values are requantized: another layer, other outputs.
    let g128 = load_layer(&ck, 0, WeightFormat::Int4Group { group: 128 }, &cfg, Slots::default(), &opts).unwrap();
    assert_ne!(p.outputs(&g128), p.want);

    let (x, ids, w) = (&p.x, &p.ids, &p.w);
    let rt = Routing { tokens: 5, k: 2, ids, weights: w, gpu_mask: None };
    let sft = SftOptions::default();
    let from_parts = SftLayer::from_quantized(&cfg, G32, |e| Some(stored[e].clone().into()), &opts, sft).unwrap();
    let from_file = SftLayer::from_checkpoint(&ck, 0, G32, &cfg, Slots::default(), &opts, sft).unwrap();
    assert_eq!(sft_bits(&from_file, x, &rt), sft_bits(&from_parts, x, &rt));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `kt convert` in the checkpoint's own group (asked for, or taken by RAWINT4/GPTQ_INT4 as
/// `checkpoint_group`) writes its nibbles and scales as stored (cut into NUMA parts), so the
/// converted layer is the checkpoint's, bit for bit; in another group it requantizes. With
/// `--backward` the transposes come from the stored values.
#[test]
fn kt_convert_writes_a_4bit_checkpoint_in_its_own_group_as_stored() {
    let (dir, out) = (tmp("convert-in"), tmp("convert-out"));
    let stored = write_checkpoint(&dir, false);
    let cfg = MoeConfig { parts: 2, ..MoeConfig::new(E, 2, H, I) };
    let opts = LayerOptions::threads(2);
    let p = Probe::new(&stored, &cfg, &opts, 7, 5);
    let g128 = WeightFormat::Int4Group { group: 128 };
    // (format asked for, checkpoint_group, backward, format written)
    for (format, checkpoint_group, backward, written) in
        [(G32, false, false, G32), (G32, false, true, G32), (g128, true, false, G32), (g128, false, false, g128)]
    {
        let _ = std::fs::remove_dir_all(&out);
        let spec = ConvertSpec {
            input: dir.clone(),
            output: out.clone(),
            format,
            scales: kt_core::Scales::Absmax,
            parts: 2,
            layers: None,
            checkpoint_group,
            backward,
            threads: 2,
            progress: false,
        };
        assert_eq!(convert(&spec).unwrap().method, written.to_string());
        let ck = Checkpoint::open(&out).unwrap();
        let got = p.outputs(&load_kt_layer(&ck, 0, written, &cfg, Slots::default(), &opts).unwrap());
        if written == G32 {
            assert_eq!(got, p.want, "{format} backward {backward}");
        } else {
            assert_ne!(got, p.want, "{format}");
        }
    }
    // Asked for mse scales, a layer written as stored keeps the checkpoint's and names no rule
    // (a rerun with either rule resumes); one requantized in another group names mse.
    for (format, written, rule) in [(G32, G32, None), (g128, g128, Some("mse"))] {
        let _ = std::fs::remove_dir_all(&out);
        let spec = |scales| ConvertSpec {
            input: dir.clone(),
            output: out.clone(),
            format,
            scales,
            parts: 2,
            layers: None,
            checkpoint_group: false,
            backward: false,
            threads: 2,
            progress: false,
        };
        assert_eq!(convert(&spec(kt_core::Scales::Mse)).unwrap().method, written.to_string());
        let layer = Checkpoint::open(&out.join("model-00001-of-00002.safetensors")).unwrap();
        assert_eq!(layer.metadata("scales"), rule, "{format}");
        let ck = Checkpoint::open(&out).unwrap();
        let got = p.outputs(&load_kt_layer(&ck, 0, written, &cfg, Slots::default(), &opts).unwrap());
        assert_eq!(got == p.want, rule.is_none(), "{format}");
        let again = convert(&spec(kt_core::Scales::Absmax)).unwrap();
        assert_eq!(again.skipped.is_empty(), rule.is_some(), "{format}: rerun with absmax");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
}

/// `kt bench --weights` runs RAWINT4 / GPTQ_INT4 as the wrapper does: in the checkpoint's own
/// group (int4-g32 here), `int4-g128` as asked.
#[test]
fn kt_bench_runs_rawint4_in_the_checkpoints_group() {
    let dir = tmp("bench");
    write_checkpoint(&dir, false);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kt"))
        .args(["bench", "--weights", dir.to_str().unwrap(), "--method", "RAWINT4,GPTQ_INT4,int4-g128"])
        .args(["--tokens", "1", "--threads", "1", "--min-time", "0", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let methods: Vec<&str> = v["results"].as_array().unwrap().iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(methods, ["int4-g32", "int4-g32", "int4-g128"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A scale that is no number is refused naming the tensor and the element, as the quantizers
/// refuse such weights (loaded as stored, it would reach the outputs).
#[test]
fn a_4bit_scale_that_is_no_number_is_refused() {
    let dir = tmp("nan");
    write_checkpoint(&dir, true);
    let ck = Checkpoint::open(&dir).unwrap();
    let cfg = MoeConfig::new(E, 2, H, I);
    for f in [G32, WeightFormat::Bf16] {
        let e = load_layer(&ck, 0, f, &cfg, Slots::default(), &LayerOptions::threads(2)).map(|_| ()).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("experts.1.up_proj.weight_scale") && e.contains("NaN at element 5"), "{f}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
