//! The `MoeLayer` API: building from f32 and from quantized matrices, GPU-resident experts,
//! and clear errors for bad input.

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
        assert_eq!(a1.forward(&input, &ids, &w, None).unwrap(), b1.forward(&input, &ids, &w, None).unwrap(), "{f}");
        assert!(a.forward(&input, &ids, &w, None).is_ok());
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
    // Routed to expert 1 while it is masked: fine, it is skipped.
    let mask = [false, true, false, true];
    assert!(layer.forward(&input, &[0, 1, 2, 3], &[0.5; 4], Some(&mask)).is_ok());
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

#[test]
fn automatic_backend_selection_serves_every_format() {
    let cfg = MoeConfig::new(4, 2, 128, 128);
    let xs = experts(&cfg, 3);
    for f in WeightFormat::ALL {
        let layer = MoeLayer::from_f32(&cfg, f, owned(&xs, &[]), &LayerOptions::threads(2)).unwrap();
        assert!(kt_host::registry::registered().iter().any(|b| b.name() == layer.backend().name()));
    }
}
