//! The `MoeLayer` API: building from f32 and from quantized matrices, GPU-resident experts,
//! and clear errors for bad input.

use kt_core::ggml::GgmlType;
use kt_core::reference::REFERENCE;
use kt_core::testing::{random_input, random_routing};
use kt_core::{Error, MoeConfig, QuantMatrix, WeightFormat};
use kt_host::{LayerOptions, MoeLayer};
use kt_tests::{experts, owned};

fn opts() -> LayerOptions {
    LayerOptions { backend: Some(&REFERENCE), ..LayerOptions::threads(2) }
}

#[test]
fn from_quantized_equals_from_f32() {
    let cfg = MoeConfig { parts: 2, ..MoeConfig::new(6, 2, 64, 64) };
    let xs = experts(&cfg, 1);
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for f in [WeightFormat::Bf16, WeightFormat::Int8Row, WeightFormat::Int4Group { group: 32 }] {
        let a = MoeLayer::from_f32(&cfg, f, owned(&xs, &[]), &opts()).unwrap();
        // Quantized whole, then sliced per part. Per-row formats slice exactly, but down's scales
        // then span all of I rather than the part: compare with one part, where they coincide.
        let one = MoeConfig { parts: 1, ..cfg.clone() };
        let a1 = MoeLayer::from_f32(&one, f, owned(&xs, &[]), &opts()).unwrap();
        let b1 = MoeLayer::from_quantized(
            &one,
            |e| {
                let q = |m: &[f32], r, c| QuantMatrix::quantize(f, r, c, m).unwrap();
                Some((q(&xs[e][0], i, h), q(&xs[e][1], i, h), q(&xs[e][2], h, i)))
            },
            f,
            &opts(),
        )
        .unwrap();
        let input = random_input(5, h, 2);
        let (ids, w) = random_routing(5, 2, 6, 3);
        let one_part = a1.forward(&input, &ids, &w, None).unwrap();
        assert_eq!(one_part, b1.forward(&input, &ids, &w, None).unwrap(), "{f}");
        // Two parts: down quantized per part slice and the parts summed; close to one part.
        let two = a.forward(&input, &ids, &w, None).unwrap();
        let f32s = |v: &[half::bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let want: Vec<f64> = f32s(&one_part).iter().map(|&x| f64::from(x)).collect();
        let err = kt_core::testing::mean_rel_err(&f32s(&two), &want);
        assert!(err < 0.05, "{f}: two parts differ from one by {err}");
    }
}

#[test]
fn gpu_resident_experts_are_not_loaded_and_cost_no_memory() {
    let cfg = MoeConfig::new(4, 2, 32, 32);
    let xs = experts(&cfg, 7);
    let layer = MoeLayer::from_f32(&cfg, WeightFormat::Int8Row, owned(&xs, &[1, 3]), &opts()).unwrap();
    assert_eq!(layer.expert_bytes(1), 0);
    assert!(layer.expert_bytes(0) > 0);
    let input = random_input(2, 32, 1);
    // Routed to expert 1 while it is masked: skipped, as a layer holding every expert skips it.
    let mask = [false, true, false, true];
    let all = MoeLayer::from_f32(&cfg, WeightFormat::Int8Row, owned(&xs, &[]), &opts()).unwrap();
    let want = all.forward(&input, &[0, 1, 2, 3], &[0.5; 4], Some(&mask)).unwrap();
    assert_eq!(layer.forward(&input, &[0, 1, 2, 3], &[0.5; 4], Some(&mask)).unwrap(), want);
    assert!(all.bytes() > layer.bytes());
    // Routed to expert 1 with no mask: a clear error naming the expert.
    let e = layer.forward(&input, &[0, 1, 2, 0], &[0.5; 4], None).unwrap_err();
    assert_eq!(e, Error::ExpertNotLoaded { expert: 1 });
    assert!(e.to_string().contains("expert 1"));
}

#[test]
fn bad_input_gives_errors_naming_the_problem() {
    let cfg = MoeConfig { max_tokens: 4, ..MoeConfig::new(4, 2, 32, 32) };
    let xs = experts(&cfg, 7);
    let layer = MoeLayer::from_f32(&cfg, WeightFormat::Bf16, owned(&xs, &[]), &opts()).unwrap();
    let x = random_input(2, 32, 1);
    fn msg<T: std::fmt::Debug>(r: Result<T, Error>) -> String {
        r.unwrap_err().to_string()
    }
    assert!(msg(layer.forward(&x[..33], &[0; 4], &[1.0; 4], None)).contains("hidden_states"));
    assert!(msg(layer.forward(&x, &[0; 3], &[1.0; 4], None)).contains("topk_ids"));
    assert!(msg(layer.forward(&x, &[0; 4], &[1.0; 5], None)).contains("topk_weights"));
    assert!(msg(layer.forward(&x, &[0; 4], &[1.0; 4], Some(&[false; 3]))).contains("gpu_experts_mask"));
    let big = random_input(5, 32, 1);
    assert!(msg(layer.forward(&big, &[0; 10], &[1.0; 10], None)).contains("max_tokens"));
    // Config errors at build time.
    let bad = MoeConfig::new(4, 5, 32, 32);
    assert!(msg(MoeLayer::from_f32(&bad, WeightFormat::Bf16, owned(&xs, &[]), &opts())).contains("top_k"));
    let odd = MoeConfig::new(4, 2, 48, 32);
    let e = msg(MoeLayer::from_f32(&odd, WeightFormat::Int4Group { group: 32 }, |_| None, &opts()));
    assert!(e.contains("hidden = 48") && e.contains("multiple of 32"), "{e}");
    // A matrix of the wrong size.
    let e = msg(MoeLayer::from_f32(
        &cfg,
        WeightFormat::Bf16,
        |_| Some([vec![0.0; 10], vec![0.0; 10], vec![0.0; 10]]),
        &opts(),
    ));
    assert!(e.contains("gate_proj"), "{e}");
    // A NaN weight.
    let e = msg(MoeLayer::from_f32(
        &cfg,
        WeightFormat::Int8Row,
        |_| Some([vec![f32::NAN; 1024], vec![0.0; 1024], vec![0.0; 1024]]),
        &opts(),
    ));
    assert!(e.contains("non-finite"), "{e}");
}

/// Every format runs on the first backend of the registry (best first) that this CPU runs and
/// that serves its three matrices, and gives the reference backend's results.
#[test]
fn automatic_selection_runs_each_format_on_its_backend() {
    let cfg = MoeConfig::new(4, 2, 256, 256);
    let xs = experts(&cfg, 3);
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let ggml = [GgmlType::Q4_K, GgmlType::Q8_0].map(WeightFormat::Ggml);
    let input = random_input(7, cfg.hidden, 5);
    let (ids, w) = random_routing(7, 2, 4, 6);
    for f in WeightFormat::ALL.into_iter().chain(ggml) {
        let auto = MoeLayer::from_f32(&cfg, f, owned(&xs, &[]), &LayerOptions::threads(2)).unwrap();
        let want = kt_host::registry::registered()
            .into_iter()
            .find(|b| b.cpu_support().is_ok() && b.serves(f, i, h) && b.serves(f, h, i))
            .expect("the reference backend serves every format");
        assert_eq!(auto.backend().name(), want.name(), "{f}");
        let oracle = MoeLayer::from_f32(&cfg, f, owned(&xs, &[]), &opts()).unwrap();
        let got: Vec<f32> = auto.forward(&input, &ids, &w, None).unwrap().iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = oracle.forward(&input, &ids, &w, None).unwrap().iter().map(|v| v.to_f32()).collect();
        let failed = kt_core::testing::compare(&got, &want, cfg.hidden, &[f], 1e-2);
        assert!(failed.is_none(), "{f} on {}: {failed:?}", auto.backend().name());
    }
}

/// A backend given explicitly that does not run the format: an error naming the format and
/// the backends that do, not a fallback.
#[test]
fn a_given_backend_that_declines_the_format_is_an_error() {
    let cfg = MoeConfig::new(4, 2, 256, 256);
    let q4k = WeightFormat::Ggml(GgmlType::Q4_K);
    let Some(avx2) = kt_host::registry::registered().into_iter().find(|b| b.name() == "avx2") else {
        eprintln!("skipped: no avx2 backend in this build");
        return;
    };
    let opts = LayerOptions { backend: Some(avx2), ..LayerOptions::threads(1) };
    let e = MoeLayer::from_f32(&cfg, q4k, |_| None, &opts).unwrap_err();
    assert!(matches!(e, Error::FormatNotServed { format, .. } if format == q4k), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("avx2") && msg.contains("q4_K") && msg.contains("reference"), "{msg}");
}

/// Layers built from one `LayerOptions` share one scratch, as a model's layers on one pool
/// should (one per layer held it times the layers): the second layer finds the first one's
/// scratch grown, and forwards interleaved across layers of other shapes, formats and token
/// counts (many enough that Down sums, and few) give the bits of layers with scratch of their
/// own.
#[test]
fn layers_built_from_one_options_share_their_scratch() {
    let bytes = |l: &MoeLayer| l.scratch().lock().unwrap().bytes();
    let shared = LayerOptions::threads(2);
    let wide = MoeConfig::new(8, 8, 1024, 64);
    let narrow = MoeConfig { parts: 2, ..MoeConfig::new(6, 2, 64, 96) };
    let layers = [
        (&wide, WeightFormat::Int8Row, 1),
        (&wide, WeightFormat::Bf16, 2),
        (&narrow, WeightFormat::Int4Group { group: 32 }, 3),
    ]
    .map(|(cfg, f, seed)| {
        let xs = experts(cfg, seed);
        let build = |o: &LayerOptions| MoeLayer::from_f32(cfg, f, owned(&xs, &[]), o).unwrap();
        (cfg, build(&shared), build(&LayerOptions::threads(2)))
    });
    let [(_, first, _), (_, second, _), _] = &layers;
    let input = random_input(320, wide.hidden, 4);
    let (ids, w) = random_routing(320, wide.top_k, wide.experts, 5);
    first.forward(&input, &ids, &w, None).unwrap();
    assert!(bytes(first) > 0);
    assert_eq!(bytes(second), bytes(first), "the second layer's scratch is the first's");
    for (round, n) in [320, 3, 1, 77].into_iter().enumerate() {
        for (l, (cfg, with_shared, with_own)) in layers.iter().enumerate() {
            let seed = (10 * round + l) as u64;
            let input = random_input(n, cfg.hidden, seed);
            let (ids, w) = random_routing(n, cfg.top_k, cfg.experts, seed + 100);
            let want = with_own.forward(&input, &ids, &w, None).unwrap();
            assert_eq!(with_shared.forward(&input, &ids, &w, None).unwrap(), want, "{n} tokens, layer {l}");
        }
    }
}
