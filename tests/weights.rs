//! Hugging Face checkpoints: safetensors files written here byte by byte (the format is an
//! 8-byte header length, a JSON header and the data), in every expert layout and dtype the
//! loader reads, loaded into layers and compared with layers built from the same f32 values.

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use kt_core::dtype::F8E4M3;
use kt_core::reference::REFERENCE;
use kt_core::swiglu::Glu;
use kt_core::testing::{random_input, random_routing};
use kt_core::{MoeConfig, WeightFormat};
use kt_host::weights::{expert_f32, load_layer, Checkpoint, ExpertLayout, Layout, Slots, WeightError};
use kt_host::{LayerOptions, MoeLayer};
use kt_tests::experts;

struct T {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn write_safetensors(path: &Path, tensors: &[T]) {
    let mut header = serde_json::Map::new();
    let mut at = 0;
    for t in tensors {
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [at, at + t.data.len()]}),
        );
        at += t.data.len();
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    tensors.iter().for_each(|t| out.extend(&t.data));
    std::fs::write(path, out).unwrap();
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect()
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kt-weights-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(d: &Path, cfg: &MoeConfig) {
    let c = serde_json::json!({"text_config": {"num_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
        "hidden_size": cfg.hidden, "moe_intermediate_size": cfg.intermediate, "num_hidden_layers": 2}});
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
}

const CFG: MoeConfig =
    MoeConfig { experts: 4, top_k: 2, hidden: 128, intermediate: 256, max_tokens: 16, parts: 1, glu: Glu::SILU };

fn round(v: &[f32], enc: fn(&[f32]) -> Vec<u8>, dec: fn(&[u8]) -> Vec<f32>) -> Vec<f32> {
    dec(&enc(v))
}

fn dec_bf16(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
}

fn dec_f16(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
}

/// Layer 1 of a two-shard deepseek-style bf16 checkpoint (with index) loads to the same bits as
/// a layer built from the bf16-rounded values, with a permuting expert map.
#[test]
fn sharded_deepseek_bf16_checkpoint_loads_exactly() {
    let d = dir("ds");
    let cfg = CFG;
    config(&d, &cfg);
    let xs = experts(&cfg, 3);
    let mut shards: [Vec<T>; 2] = [Vec::new(), Vec::new()];
    let mut map = serde_json::Map::new();
    for (e, x) in xs.iter().enumerate() {
        for (p, (proj, m)) in [("gate", &x[0]), ("up", &x[1]), ("down", &x[2])].into_iter().enumerate() {
            let name = format!("model.language_model.layers.1.mlp.experts.{e}.{proj}_proj.weight");
            let shape = if p == 2 { vec![cfg.hidden, cfg.intermediate] } else { vec![cfg.intermediate, cfg.hidden] };
            let file = format!("model-0000{}-of-00002.safetensors", e % 2 + 1);
            map.insert(name.clone(), serde_json::Value::String(file));
            shards[e % 2].push(T { name, dtype: "BF16", shape, data: bf16_bytes(m) });
        }
    }
    shards[0].push(T { name: "model.embed_tokens.weight".into(), dtype: "F32", shape: vec![2, 2], data: vec![0; 16] });
    for (i, s) in shards.iter().enumerate() {
        write_safetensors(&d.join(format!("model-0000{}-of-00002.safetensors", i + 1)), s);
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let ck = Checkpoint::open(&d).unwrap();
    let mc = ck.config().unwrap();
    assert_eq!((mc.experts, mc.top_k, mc.hidden, mc.intermediate), (4, 2, 128, 256));
    let layout = Layout::detect(&ck, 1).unwrap();
    assert_eq!(layout.kind, ExpertLayout::Deepseek);
    let opts = LayerOptions { backend: Some(&REFERENCE), ..LayerOptions::threads(2) };
    let order = [2usize, 0, 3, 1];
    for f in [WeightFormat::Bf16, WeightFormat::Int8Row] {
        let loaded = load_layer(&ck, 1, f, &cfg, Slots { map: Some(&order), gpu: None }, &opts).unwrap();
        let direct = MoeLayer::from_f32(
            &cfg,
            f,
            |slot| {
                let x = &xs[order[slot]];
                Some([&x[0], &x[1], &x[2]].map(|m| round(m, bf16_bytes, dec_bf16)))
            },
            &opts,
        )
        .unwrap();
        let input = random_input(5, cfg.hidden, 1);
        let (ids, w) = random_routing(5, cfg.top_k, cfg.experts, 2);
        assert_eq!(loaded.forward(&input, &ids, &w, None).unwrap(), direct.forward(&input, &ids, &w, None).unwrap());
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn mixtral_f16_fused_f32_and_fp8_block_and_channel_scales_decode() {
    let d = dir("layouts");
    let (h, i) = (CFG.hidden, CFG.intermediate);
    let xs = experts(&CFG, 4);
    let x = &xs[1];
    // Mixtral naming, f16.
    let mut t: Vec<T> = [("w1", &x[0], [i, h]), ("w3", &x[1], [i, h]), ("w2", &x[2], [h, i])]
        .into_iter()
        .map(|(n, m, s)| T {
            name: format!("model.layers.0.block_sparse_moe.experts.0.{n}.weight"),
            dtype: "F16",
            shape: s.to_vec(),
            data: f16_bytes(m),
        })
        .collect();
    // Mistral naming (no block_sparse_moe), layer 3, under the language_model prefix.
    for (n, m, sh) in [("w1", &x[0], [i, h]), ("w3", &x[1], [i, h]), ("w2", &x[2], [h, i])] {
        let name = format!("language_model.model.layers.3.experts.0.{n}.weight");
        t.push(T { name, dtype: "F32", shape: sh.to_vec(), data: f32_bytes(m) });
    }
    // Fused layer 1, f32: gate_up [E, 2I, H], down [E, H, I] (expert 0 of 1).
    let gu: Vec<f32> = x[0].iter().chain(&x[1]).copied().collect();
    t.push(T {
        name: "model.layers.1.mlp.experts.gate_up_proj".into(),
        dtype: "F32",
        shape: vec![1, 2 * i, h],
        data: f32_bytes(&gu),
    });
    t.push(T {
        name: "model.layers.1.mlp.experts.down_proj".into(),
        dtype: "F32",
        shape: vec![1, h, i],
        data: f32_bytes(&x[2]),
    });
    // Layer 2, fp8 with 128×128 block scales (bf16) on gate/up and per-row scales on down.
    let fp8 = |m: &[f32]| -> Vec<u8> { m.iter().map(|v| F8E4M3::from_f32(v * 8.0).0).collect() };
    let block_scales = vec![0.125f32; (i / 128) * (h / 128)];
    for (p, m, shape) in [("gate", &x[0], [i, h]), ("up", &x[1], [i, h])] {
        let base = format!("model.layers.2.mlp.experts.0.{p}_proj");
        t.push(T { name: format!("{base}.weight"), dtype: "F8_E4M3", shape: shape.to_vec(), data: fp8(m) });
        t.push(T {
            name: format!("{base}.weight_scale_inv"),
            dtype: "BF16",
            shape: vec![i / 128, h / 128],
            data: bf16_bytes(&block_scales),
        });
    }
    let base = "model.layers.2.mlp.experts.0.down_proj";
    t.push(T { name: format!("{base}.weight"), dtype: "F8_E4M3", shape: vec![h, i], data: fp8(&x[2]) });
    t.push(T {
        name: format!("{base}.weight_scale"),
        dtype: "F32",
        shape: vec![h, 1],
        data: f32_bytes(&vec![0.125; h]),
    });
    write_safetensors(&d.join("model.safetensors"), &t);
    let ck = Checkpoint::open(&d).unwrap();

    let mix = Layout::detect(&ck, 0).unwrap();
    assert_eq!(mix.kind, ExpertLayout::Mixtral);
    let got = expert_f32(&ck, &mix, 0, h, i).unwrap();
    assert_eq!(got[1], round(&x[1], f16_bytes, dec_f16));

    let mistral = Layout::detect(&ck, 3).unwrap();
    assert_eq!((mistral.kind, mistral.base.as_str()), (ExpertLayout::Mistral, "language_model.model.layers.3"));
    assert_eq!(expert_f32(&ck, &mistral, 0, h, i).unwrap(), [x[0].clone(), x[1].clone(), x[2].clone()]);

    let fused = Layout::detect(&ck, 1).unwrap();
    assert_eq!(fused.kind, ExpertLayout::Fused);
    assert_eq!(expert_f32(&ck, &fused, 0, h, i).unwrap(), [x[0].clone(), x[1].clone(), x[2].clone()]);

    let f8 = expert_f32(&ck, &Layout::detect(&ck, 2).unwrap(), 0, h, i).unwrap();
    for (got, want) in f8.iter().zip([&x[0], &x[1], &x[2]]) {
        let expect: Vec<f32> = want.iter().map(|v| F8E4M3::from_f32(v * 8.0).to_f32() * 0.125).collect();
        assert_eq!(got, &expect);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let d = dir("bad");
    let (h, i) = (CFG.hidden, CFG.intermediate);
    let ok = |n: &str, s: Vec<usize>| T {
        name: n.into(),
        dtype: "BF16",
        shape: s.clone(),
        data: vec![0; 2 * s.iter().product::<usize>()],
    };
    write_safetensors(
        &d.join("a.safetensors"),
        &[
            ok("model.layers.0.mlp.experts.0.gate_proj.weight", vec![i, h]),
            ok("model.layers.0.mlp.experts.0.up_proj.weight", vec![i, h + 1]),
            ok("model.layers.0.mlp.experts.0.down_proj.weight", vec![h, i]),
            T {
                name: "model.layers.0.mlp.experts.1.gate_proj.weight".into(),
                dtype: "I8",
                shape: vec![i, h],
                data: vec![0; i * h],
            },
        ],
    );
    let ck = Checkpoint::open(&d).unwrap();
    let l = Layout::detect(&ck, 0).unwrap();
    let e = expert_f32(&ck, &l, 0, h, i).unwrap_err().to_string();
    assert!(e.contains("up_proj") && e.contains("[256, 129]") && e.contains("[256, 128]"), "{e}");
    let e = expert_f32(&ck, &l, 1, h, i).unwrap_err().to_string();
    assert!(e.contains("experts.1.gate_proj") && e.contains("I8"), "{e}");
    let e = expert_f32(&ck, &l, 2, h, i).unwrap_err().to_string();
    assert!(e.contains("experts.2.gate_proj") && e.contains("missing"), "{e}");
    let e = Layout::detect(&ck, 7).unwrap_err();
    assert!(matches!(e, WeightError::UnknownLayout { layer: 7, .. }) && e.to_string().contains("model.layers.7"));
    let e = load_layer(&ck, 0, WeightFormat::Bf16, &CFG, Slots::default(), &LayerOptions::threads(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("up_proj"), "{e}");
    assert!(ck.config().unwrap_err().to_string().contains("config.json"));

    // Truncated: the header promises more data than the file has.
    let bytes = std::fs::read(d.join("a.safetensors")).unwrap();
    std::fs::write(d.join("a.safetensors"), &bytes[..bytes.len() - 100]).unwrap();
    let e = Checkpoint::open(&d).unwrap_err().to_string();
    assert!(e.contains("a.safetensors") && e.contains("not a valid file"), "{e}");
    std::fs::remove_file(d.join("a.safetensors")).unwrap();
    assert!(Checkpoint::open(&d).unwrap_err().to_string().contains("no *.safetensors"));
    assert!(Checkpoint::open(&d.join("nope")).unwrap_err().to_string().contains("nope"));
    std::fs::remove_dir_all(&d).unwrap();
}

/// compressed-tensors int4: `weight_packed` (int32, 8 nibbles low first, value nibble − 8) and
/// bf16 `weight_scale` `[N, K/32]`, decoded exactly.
#[test]
fn compressed_tensors_int4_decodes() {
    let d = dir("ct");
    let (h, i) = (CFG.hidden, CFG.intermediate);
    let mut r = kt_core::rng::SplitMix64::new(9);
    let mut t = Vec::new();
    let mut want = Vec::new();
    for (p, (rows, cols)) in [("gate", (i, h)), ("up", (i, h)), ("down", (h, i))] {
        let nibbles: Vec<u8> = (0..rows * cols).map(|_| r.below(16) as u8).collect();
        let scales: Vec<f32> = (0..rows * cols / 32).map(|_| bf16::from_f32(r.next_f32() + 0.01).to_f32()).collect();
        let packed: Vec<u8> = nibbles.chunks_exact(2).map(|p| p[0] | p[1] << 4).collect();
        let base = format!("model.layers.0.mlp.experts.0.{p}_proj");
        t.push(T { name: format!("{base}.weight_packed"), dtype: "I32", shape: vec![rows, cols / 8], data: packed });
        t.push(T {
            name: format!("{base}.weight_scale"),
            dtype: "BF16",
            shape: vec![rows, cols / 32],
            data: bf16_bytes(&scales),
        });
        want.push(
            (0..rows * cols)
                .map(|k| (f32::from(nibbles[k]) - 8.0) * scales[(k / cols) * (cols / 32) + (k % cols) / 32])
                .collect::<Vec<f32>>(),
        );
    }
    write_safetensors(&d.join("model.safetensors"), &t);
    let ck = Checkpoint::open(&d).unwrap();
    let l = Layout::detect(&ck, 0).unwrap();
    assert_eq!(l.kind, ExpertLayout::Deepseek);
    let got = expert_f32(&ck, &l, 0, h, i).unwrap();
    assert_eq!(got.to_vec(), want);
    std::fs::remove_dir_all(&d).unwrap();
}
