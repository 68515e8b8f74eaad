//! The reference backend against an f64 textbook MoE (with expert biases too), and the accuracy of each format against
//! the unquantized MoE (DESIGN.md's thresholds).

use alloc::vec;

use proptest::prelude::*;

use super::REFERENCE;
use crate::bias::ExpertBias;
use crate::testing::{
    build_layer, dequantized, mean_rel_err, random_biases, random_experts, random_input, run, scenario_routing,
    textbook_moe, textbook_moe_biased, textbook_moe_magnitude, Scenario,
};
use crate::{MoeConfig, Routing, SerialExecutor, WeightFormat};

/// Error of the reference against the textbook MoE on the *same* (dequantized) weights: only
/// bf16 intermediates and, for int formats, int8 activations differ.
fn same_weights_tolerance(f: WeightFormat) -> f64 {
    if f.int_activations() {
        0.05
    } else {
        0.01
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn reference_matches_textbook(
        fi in 0usize..8,
        e in 1usize..7,
        k_raw in 1usize..4,
        tokens in prop_oneof![Just(1usize), 2usize..12],
        scen in 0usize..5,
        parts in 1usize..3,
        seed in any::<u64>(),
    ) {
        let format = WeightFormat::ALL[fi];
        let m = format.col_multiple().max(2);
        let k = k_raw.min(e);
        let cfg = MoeConfig { parts, max_tokens: 16, ..MoeConfig::new(e, k, 2 * m, 4 * m) };
        prop_assume!(cfg.validate_for(format).is_ok());
        let experts = random_experts(&cfg, seed);
        let layer = build_layer(&REFERENCE, &cfg, format, &experts);
        let input = random_input(tokens, cfg.hidden, seed ^ 1);
        let s = [Scenario::Random, Scenario::Skewed, Scenario::InvalidIds, Scenario::Masked, Scenario::AllMasked][scen];
        let (ids, w, mask) = scenario_routing(s, tokens, &cfg, seed ^ 2);
        let r = Routing { tokens, k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
        let got = run(&SerialExecutor, &cfg, &layer, &input, &r);
        // With several parts down is quantized per part slice: compare on those exact weights.
        // Per part's quantization, as the layer does (down's scales cover a part's columns).
        let deq = dequantized(&cfg, format, &experts);
        let want = textbook_moe(&cfg, &deq, &input, &r);
        if matches!(s, Scenario::AllMasked) {
            prop_assert!(got.iter().all(|&v| v == 0.0));
        } else {
            // Judged against the size of the terms: tiny shapes can cancel to a small output,
            // where bf16 rounding of the intermediates is a large part of it.
            let scale: f64 = textbook_moe_magnitude(&cfg, &deq, &input, &r).iter().sum();
            let err: f64 = got.iter().zip(&want).map(|(a, b)| (f64::from(*a) - b).abs()).sum::<f64>() / scale.max(f64::MIN_POSITIVE);
            prop_assert!(err < same_weights_tolerance(format), "{} err {}", format, err);
        }
        for t in 0..tokens {
            if (0..k).all(|j| r.expert(t, j, e).is_none()) {
                prop_assert!(got[t * cfg.hidden..(t + 1) * cfg.hidden].iter().all(|&v| v == 0.0));
            }
        }
    }
}

/// Expert biases as gpt-oss adds them (gate's and up's before the activation, down's before
/// the routing weight), with 1 and 2 parts (down's bias added once), against the f64 textbook
/// on the same weights; an expert without biases, and a bias of the wrong length refused.
#[test]
fn expert_biases_match_the_textbook() {
    for parts in [1, 2] {
        let cfg = MoeConfig { parts, max_tokens: 16, ..MoeConfig::new(6, 2, 128, 256) };
        let experts = random_experts(&cfg, 21);
        let mut biases = random_biases(&cfg, 22);
        let mut layer = build_layer(&REFERENCE, &cfg, WeightFormat::Bf16, &experts);
        for (e, b) in biases.iter().enumerate().filter(|&(e, _)| e != 2) {
            layer.set_bias(e, b.clone()).unwrap();
        }
        biases[2] = ExpertBias { gate: vec![0.0; 256], up: vec![0.0; 256], down: vec![0.0; 128] };
        let input = random_input(9, cfg.hidden, 23);
        let (ids, w) = crate::testing::random_routing(9, 2, 6, 24);
        let r = Routing { tokens: 9, k: 2, ids: &ids, weights: &w, gpu_mask: None };
        let got = run(&SerialExecutor, &cfg, &layer, &input, &r);
        let deq = dequantized(&cfg, WeightFormat::Bf16, &experts);
        let err = mean_rel_err(&got, &textbook_moe_biased(&cfg, &deq, &biases, &input, &r));
        assert!(err < 5e-3, "parts {parts}: {err}");
        let unbiased = mean_rel_err(&got, &textbook_moe(&cfg, &deq, &input, &r));
        assert!(unbiased > 0.1, "the biases move the output: {unbiased}");
    }
    let cfg = MoeConfig::new(6, 2, 128, 256);
    let mut layer = build_layer(&REFERENCE, &cfg, WeightFormat::Bf16, &random_experts(&cfg, 1));
    let short = ExpertBias { gate: vec![0.0; 256], up: vec![0.0; 256], down: vec![0.0; 127] };
    assert!(layer.set_bias(0, short).is_err());
}

/// DESIGN.md: mean relative error against an fp32 MoE on the original Gaussian weights.
#[test]
fn accuracy_against_unquantized_moe() {
    let results = crate::testing::accuracy_failures(&REFERENCE, &SerialExecutor);
    assert_eq!(results.len(), crate::testing::ACCURACY_LIMITS.len());
    for (format, err, limit) in results {
        std::eprintln!("accuracy {format}: {err:.4} (limit {limit})");
        assert!(err < limit, "{format}: {err:.4} >= {limit}");
    }
}

#[test]
fn reference_ggml_layers_match_fp32_on_dequantized_weights() {
    let failures = crate::testing::ggml_accuracy_failures(&REFERENCE, &SerialExecutor);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
