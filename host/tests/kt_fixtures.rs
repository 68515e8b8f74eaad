//! KT-Kernel's own converted files and forward outputs (tests/fixtures/kt, written by
//! `bash scripts/kt-fixtures.sh` with KT-Kernel 0.7.2's wheel): our quantization and packing
//! give its bytes exactly, and every backend this CPU runs loads its files and gives its
//! outputs (within 1e-2). Its SFT backward transposes (tests/fixtures/kt_bwd, written by
//! `bash scripts/kt-bwd-fixtures.sh`): `kt convert --backward` gives its bytes exactly.
//!
//! Weights and inputs are not in the fixtures: both sides make them from SplitMix64 (see
//! `scripts/peers/kt_fixtures.py`).

use std::path::{Path, PathBuf};

use kt_core::rng::SplitMix64;
use kt_core::Scales;
use kt_host::weights::kt_format::{expert_tensors, load_kt_layer, plan, ExpertSource};
use kt_host::weights::{Checkpoint, Slots};
use kt_host::{bf16, LayerOptions, MoeConfig, WeightFormat};

/// The case directories under tests/fixtures/`set`, at least `min` of them.
fn fixture_set(set: &str, min: usize) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(set);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    assert!(v.len() >= min, "fixtures missing under {}", dir.display());
    v
}

fn fixtures() -> Vec<PathBuf> {
    fixture_set("kt", 4)
}

/// `n` values ((u >> 40) / 2^24 − 1/2) · scale from SplitMix64(seed), rounded to bf16.
fn values(seed: u64, n: usize, scale: f32) -> Vec<bf16> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| bf16::from_f32(((r.next_u64() >> 40) as f32 / (1u32 << 24) as f32 - 0.5) * scale)).collect()
}

struct Case {
    ck: Checkpoint,
    cfg: MoeConfig,
    format: WeightFormat,
    tokens: Vec<usize>,
}

fn case(dir: &Path) -> Case {
    let ck = Checkpoint::open(dir).unwrap();
    let meta = |k: &str| ck.metadata(k).unwrap_or_else(|| panic!("{}: no {k}", dir.display())).to_string();
    let num = |k: &str| meta(k).parse::<usize>().unwrap();
    let format = match meta("method").as_str() {
        "AMXINT8" => WeightFormat::Int8Row,
        "AMXINT4" => WeightFormat::Int4Row,
        m => panic!("unknown method {m}"),
    };
    let cfg = MoeConfig {
        parts: num("parts"),
        max_tokens: 64,
        ..MoeConfig::new(num("experts"), num("top_k"), num("hidden"), num("intermediate"))
    };
    let tokens = ck.metadata("tokens").map_or(Vec::new(), |t| t.split(',').map(|t| t.parse().unwrap()).collect());
    Case { ck, cfg, format, tokens }
}

fn read<T: bytemuck::Pod>(ck: &Checkpoint, name: &str) -> Vec<T> {
    let r = ck.get(name).unwrap_or_else(|| panic!("no tensor {name}"));
    ck.bytes(r).chunks_exact(size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

#[test]
fn our_quantization_and_packing_give_kts_bytes() {
    check_bytes(fixtures(), false);
}

/// KT's SFT transposes (`save_backward_weights_from_tensors`): `kt convert --backward`'s.
#[test]
fn our_backward_transposes_are_kts_bytes() {
    check_bytes(fixture_set("kt_bwd", 2), true);
}

/// Every tensor each fixture in `dirs` holds (the forward's, or with `backward` the
/// transposes') equals ours, made from the same weights, byte for byte.
fn check_bytes(dirs: Vec<PathBuf>, backward: bool) {
    for dir in dirs {
        let Case { ck, cfg, format, .. } = case(&dir);
        let (e, h, i) = (cfg.experts, cfg.hidden, cfg.intermediate);
        let f32s = |v: Vec<bf16>| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let (gate, up, down) = (
            f32s(values(1, e * i * h, 1.0 / 16.0)),
            f32s(values(2, e * i * h, 1.0 / 16.0)),
            f32s(values(3, e * h * i, 1.0 / 16.0)),
        );
        let plan = plan(&cfg, format, 0, backward).unwrap();
        let per_expert = plan.len() / e;
        let mut checked = 0;
        for x in 0..e {
            let m = |v: &[f32]| v[x * i * h..(x + 1) * i * h].to_vec();
            let ours = expert_tensors(
                &cfg,
                (format, Scales::Absmax),
                &ExpertSource::F32([m(&gate), m(&up), m(&down)]),
                backward,
            )
            .unwrap();
            assert_eq!(ours.len(), per_expert);
            for (t, bytes) in plan[x * per_expert..(x + 1) * per_expert].iter().zip(&ours) {
                if backward != t.name.contains("_bwd_") {
                    continue;
                }
                checked += 1;
                let kt = ck.bytes(ck.get(&t.name).unwrap_or_else(|| panic!("{}: no {}", dir.display(), t.name)));
                let diff = kt.iter().zip(bytes).filter(|(a, b)| a != b).count();
                assert!(
                    kt.len() == bytes.len() && diff == 0,
                    "{}: {} differs in {diff} of {} bytes",
                    dir.display(),
                    t.name,
                    kt.len()
                );
            }
        }
        assert_eq!(checked, 6 * e * cfg.parts, "{}", dir.display());
    }
}

#[test]
fn every_backend_loads_kts_files_and_gives_its_outputs() {
    let (backends, skipped): (Vec<_>, Vec<_>) =
        kt_host::registry::registered().into_iter().partition(|b| b.cpu_support().is_ok());
    for b in skipped {
        kt_core::skip_isa!(format!("{} (backend {})", b.cpu_support().unwrap_err(), b.name()));
    }
    for dir in fixtures() {
        let Case { ck, cfg, format, tokens } = case(&dir);
        for &b in &backends {
            if !b.serves(format, cfg.intermediate / cfg.parts, cfg.hidden) {
                continue;
            }
            let opts = LayerOptions { backend: Some(b), ..LayerOptions::threads(2) };
            let layer = load_kt_layer(&ck, 0, format, &cfg, Slots::default(), &opts).unwrap();
            for &n in &tokens {
                let x = values(200 + n as u64, n * cfg.hidden, 1.0);
                let (ids, w): (Vec<i64>, Vec<f32>) =
                    (read(&ck, &format!("ids.{n}")), read(&ck, &format!("weights.{n}")));
                let want: Vec<u16> = read(&ck, &format!("out.{n}"));
                let got = layer.forward(&x, &ids, &w, None).unwrap();
                let (mut d, mut r) = (0.0f64, 0.0f64);
                for (g, &k) in got.iter().zip(&want) {
                    let k = f64::from(bf16::from_bits(k).to_f32());
                    d += (f64::from(g.to_f32()) - k).abs();
                    r += k.abs();
                }
                assert!(r > 0.0, "{}: KT's output for {n} tokens is all zeros", dir.display());
                let err = d / r;
                assert!(
                    err < 1e-2,
                    "{} on {}: {n} tokens, mean |ours - KT| / mean |KT| = {err:.2e}",
                    b.name(),
                    dir.display()
                );
            }
        }
    }
}
