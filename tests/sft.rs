//! LoRA fine-tuning on every backend: the SFT suite through a thread pool, and
//! `kt_host::SftLayer`'s steps bit-identical for any thread count, its cache stack and errors.

use std::sync::Arc;

use kt_core::bf16;
use kt_core::sft::check::sft_failures;
use kt_core::sft::{lora_of, random_lora, Backward, LoraGrads, LoraMats};
use kt_core::testing::{random_input, scenario_routing, Scenario};
use kt_core::{Backend, Error, MoeConfig, Routing, WeightFormat};
use kt_host::pool::Pool;
use kt_host::{registry, LayerOptions, SftLayer, SftOptions};
use kt_tests::{experts, owned};

/// A backward's outputs, LoRA gradients unscaled.
fn outs<'a>(gi: &'a mut [bf16], gw: &'a mut [f32], lora: Option<LoraGrads<'a>>) -> Backward<'a> {
    Backward { grad_input: gi, grad_weights: gw, lora, base: None, grad_scale: 1.0 }
}

/// Every backend this build registers that this CPU can run.
fn runnable() -> Vec<&'static dyn Backend> {
    registry::registered().into_iter().filter(|b| b.cpu_support().is_ok()).collect()
}

#[test]
fn every_backend_passes_the_sft_suite() {
    let pool = Pool::new(2);
    let failures: Vec<String> = runnable().into_iter().flat_map(|b| sft_failures(b, &pool)).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One step's results: output, input gradient, weights' gradient and the six LoRA gradients,
/// as bits.
fn step(layer: &SftLayer, cfg: &MoeConfig, mats: &LoraMats, tokens: usize, seed: u64) -> Vec<Vec<u32>> {
    let x = random_input(tokens, cfg.hidden, seed);
    let (ids, w, mask) = scenario_routing(Scenario::Masked, tokens, cfg, seed);
    let l = lora_of(mats, 4, 8.0);
    let mut out = vec![bf16::ZERO; tokens * cfg.hidden];
    let rt = Routing { tokens, k: cfg.top_k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
    layer.forward(&x, &rt, Some(&l), true, &mut out).unwrap();
    let go = random_input(tokens, cfg.hidden, seed + 1);
    let (mut gi, mut gw) = (vec![bf16::ZERO; tokens * cfg.hidden], vec![0.0f32; tokens * cfg.top_k]);
    let mut grads = random_lora(cfg, 4, true, 0);
    let [a, b, c, d, e, f] = &mut grads;
    let lg = LoraGrads { gate_a: a, gate_b: b, up_a: c, up_b: d, down_a: e, down_b: f };
    layer.backward(&go, Some(&l), outs(&mut gi, &mut gw, Some(lg))).unwrap();
    let b16 = |v: &[bf16]| v.iter().map(|x| u32::from(x.to_bits())).collect::<Vec<_>>();
    let mut all = vec![b16(&out), b16(&gi), gw.iter().map(|x| x.to_bits()).collect()];
    all.extend(grads.iter().map(|g| b16(g)));
    all
}

fn sft_layer(b: &'static dyn Backend, cfg: &MoeConfig, f: WeightFormat, threads: usize, depth: usize) -> SftLayer {
    let xs = experts(cfg, 3);
    let opts = LayerOptions { backend: Some(b), ..LayerOptions::executor(Arc::new(Pool::new(threads))) };
    SftLayer::from_f32(cfg, f, owned(&xs, &[]), &opts, SftOptions::depth(depth)).unwrap()
}

#[test]
fn sft_steps_are_bit_identical_for_any_thread_count() {
    for parts in [1, 2] {
        let cfg = MoeConfig { max_tokens: 64, parts, ..MoeConfig::new(8, 2, 256, 128) };
        let mats = random_lora(&cfg, 4, false, 9);
        for b in runnable() {
            for f in [WeightFormat::Bf16, WeightFormat::Int8Row] {
                if !(b.serves(f, 128, 256) && b.serves(f, 256, 128)) {
                    continue;
                }
                let one = step(&sft_layer(b, &cfg, f, 1, 1), &cfg, &mats, 37, 5);
                let three = step(&sft_layer(b, &cfg, f, 3, 1), &cfg, &mats, 37, 5);
                assert!(one == three, "{} {f} {parts} parts: results differ between 1 and 3 threads", b.name());
            }
        }
    }
}

#[test]
fn saved_forwards_are_a_stack_of_max_cache_depth() {
    let cfg = MoeConfig { max_tokens: 16, ..MoeConfig::new(4, 2, 256, 128) };
    let layer = sft_layer(&kt_core::reference::REFERENCE, &cfg, WeightFormat::Bf16, 2, 2);
    let mats = random_lora(&cfg, 4, false, 9);
    let l = lora_of(&mats, 4, 8.0);
    let (h, k) = (cfg.hidden, cfg.top_k);
    let (mut gi, mut gw) = (vec![bf16::ZERO; 3 * h], vec![0.0f32; 3 * k]);
    let go = random_input(3, h, 1);
    assert_eq!(layer.backward(&go, Some(&l), outs(&mut gi, &mut gw, None)), Err(Error::NoForwardCache));
    // Two saved forwards of 3 and 5 tokens, a third refused; backwards pop the newest first.
    let run = |tokens: usize, seed: u64, save: bool| {
        let x = random_input(tokens, h, seed);
        let (ids, w, _) = scenario_routing(Scenario::Random, tokens, &cfg, seed);
        let mut out = vec![bf16::ZERO; tokens * h];
        let rt = Routing { tokens, k, ids: &ids, weights: &w, gpu_mask: None };
        layer.forward(&x, &rt, Some(&l), save, &mut out).map(|()| out)
    };
    run(3, 1, true).unwrap();
    run(5, 2, true).unwrap();
    assert_eq!(layer.cache_depth(), 2);
    assert!(layer.cache_bytes() > 0);
    assert_eq!(run(3, 3, true), Err(Error::CacheFull { depth: 2 }));
    run(3, 3, false).unwrap();
    // The newest (5 tokens) first: a 3-token gradient is refused, naming the shape.
    let e = layer.backward(&go, Some(&l), outs(&mut gi, &mut gw, None)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { expected, .. } if expected == 5 * h), "{e}");
    let go5 = random_input(5, h, 2);
    let (mut gi5, mut gw5) = (vec![bf16::ZERO; 5 * h], vec![0.0f32; 5 * k]);
    layer.backward(&go5, Some(&l), outs(&mut gi5, &mut gw5, None)).unwrap();
    layer.backward(&go, Some(&l), outs(&mut gi, &mut gw, None)).unwrap();
    assert_eq!(layer.cache_depth(), 0);
    // The first forward's backward, run alone, gives the same bits.
    let alone = sft_layer(&kt_core::reference::REFERENCE, &cfg, WeightFormat::Bf16, 1, 1);
    let x = random_input(3, h, 1);
    let (ids, w, _) = scenario_routing(Scenario::Random, 3, &cfg, 1);
    let mut out = vec![bf16::ZERO; 3 * h];
    alone
        .forward(&x, &Routing { tokens: 3, k, ids: &ids, weights: &w, gpu_mask: None }, Some(&l), true, &mut out)
        .unwrap();
    let (mut gi1, mut gw1) = (vec![bf16::ZERO; 3 * h], vec![0.0f32; 3 * k]);
    alone.backward(&go, Some(&l), outs(&mut gi1, &mut gw1, None)).unwrap();
    assert_eq!((gi1, gw1), (gi, gw));
}

#[test]
fn sft_layers_refuse_what_they_cannot_run() {
    let cfg = MoeConfig::new(4, 2, 256, 128);
    let xs = experts(&cfg, 3);
    let opts = LayerOptions::threads(1);
    let e = SftLayer::from_f32(&cfg, WeightFormat::Bf16, owned(&xs, &[]), &opts, SftOptions::depth(0)).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { field: "max_cache_depth", .. }), "{e}");
    // A LoRA of the wrong shape.
    let layer = SftLayer::from_f32(&cfg, WeightFormat::Bf16, owned(&xs, &[]), &opts, SftOptions::default()).unwrap();
    let mats = random_lora(&MoeConfig::new(4, 2, 256, 64), 4, false, 1);
    let x = random_input(2, 256, 1);
    let mut out = vec![bf16::ZERO; 512];
    let rt = Routing { tokens: 2, k: 2, ids: &[0, 1, 2, 3], weights: &[0.5; 4], gpu_mask: None };
    let e = layer.forward(&x, &rt, Some(&lora_of(&mats, 4, 8.0)), true, &mut out).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { what: "gate_lora_b [E, I, r]", .. }), "{e}");
}

/// SFT layers built from one `LayerOptions` share one scratch through a training step's order
/// (every layer's forward, a forward not saved, then the backwards in reverse), with the bits
/// of layers that have scratch of their own: the backward reads its forward's cache, never
/// the scratch another layer has since written.
#[test]
fn sft_layers_of_one_options_share_their_scratch() {
    let cfg = MoeConfig { max_tokens: 64, parts: 2, ..MoeConfig::new(8, 2, 256, 128) };
    let mats = random_lora(&cfg, 4, false, 9);
    let l = lora_of(&mats, 4, 8.0);
    let formats = [WeightFormat::Bf16, WeightFormat::Int8Row, WeightFormat::Bf16];
    let layer = |j: usize, opts: &LayerOptions| {
        let xs = experts(&cfg, 10 + j as u64);
        SftLayer::from_f32(&cfg, formats[j], owned(&xs, &[]), opts, SftOptions::depth(1)).unwrap()
    };
    let shared_opts = LayerOptions::threads(2);
    let shared: Vec<_> = (0..3).map(|j| layer(j, &shared_opts)).collect();
    let own: Vec<_> = (0..3).map(|j| layer(j, &LayerOptions::threads(2))).collect();
    // Each layer its own token count, so the scratch grows and is reused between them.
    let tokens = [37, 5, 64];
    let train = |layers: &[SftLayer]| {
        let mut bits = Vec::new();
        // Every layer's saved forward, then one not saved (a serving call) between them and
        // the backwards.
        for (j, save) in [(0, true), (1, true), (2, true), (1, false)] {
            let (n, seed) = (tokens[j] - usize::from(!save), j as u64);
            let (x, (ids, w, mask)) =
                (random_input(n, cfg.hidden, seed), scenario_routing(Scenario::Masked, n, &cfg, seed));
            let rt = Routing { tokens: n, k: cfg.top_k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
            let mut out = vec![bf16::ZERO; n * cfg.hidden];
            layers[j].forward(&x, &rt, Some(&l), save, &mut out).unwrap();
            bits.push(out.iter().map(|v| u32::from(v.to_bits())).collect::<Vec<_>>());
        }
        for (j, layer) in layers.iter().enumerate().rev() {
            let n = tokens[j];
            let go = random_input(n, cfg.hidden, 50 + j as u64);
            let (mut gi, mut gw) = (vec![bf16::ZERO; n * cfg.hidden], vec![0.0f32; n * cfg.top_k]);
            layer.backward(&go, Some(&l), outs(&mut gi, &mut gw, None)).unwrap();
            bits.push(gi.iter().map(|v| u32::from(v.to_bits())).chain(gw.iter().map(|v| v.to_bits())).collect());
        }
        bits
    };
    assert!(train(&shared) == train(&own), "shared scratch changed a result");
    assert!(shared.iter().all(|s| Arc::ptr_eq(s.scratch(), shared[0].scratch())));
    let bytes = |s: &SftLayer| s.scratch().lock().unwrap().bytes();
    assert!(bytes(&shared[0]) > 0 && bytes(&shared[0]) < own.iter().map(bytes).sum::<usize>());
}
