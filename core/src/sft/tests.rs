use alloc::vec::Vec;

use super::check::{sft_failures, textbook};
use super::{lora_of, random_lora, LoraMats};
use crate::reference::REFERENCE;
use crate::rng::SplitMix64;
use crate::testing::{random_experts, random_input, scenario_routing, Scenario};
use crate::{MoeConfig, Routing, SerialExecutor};

#[test]
fn the_reference_backend_passes_the_sft_suite() {
    let failures = sft_failures(&REFERENCE, &SerialExecutor);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The textbook's gradients are the derivatives of its output: central differences of
/// `⟨grad_output, out⟩` in a few routing weights, LoRA entries and base weights.
#[test]
fn the_textbook_gradients_are_its_outputs_derivatives() {
    let cfg = MoeConfig::new(3, 2, 16, 8);
    let mut experts = random_experts(&cfg, 3);
    let mut mats = random_lora(&cfg, 2, false, 4);
    let x = random_input(3, cfg.hidden, 5);
    let (ids, mut w, _) = scenario_routing(Scenario::Random, 3, &cfg, 6);
    let mut rng = SplitMix64::new(7);
    let go: Vec<f64> = (0..3 * cfg.hidden).map(|_| f64::from(rng.gaussian())).collect();
    let loss = |mats: &LoraMats, w: &[f32]| {
        let rt = Routing { tokens: 3, k: 2, ids: &ids, weights: w, gpu_mask: None };
        let t = textbook(&cfg, &experts, &experts, &lora_of(mats, 2, 4.0), &x, &rt, &go);
        t.out.iter().zip(&go).map(|(o, g)| o * g).sum::<f64>()
    };
    let rt = Routing { tokens: 3, k: 2, ids: &ids, weights: &w, gpu_mask: None };
    let t = textbook(&cfg, &experts, &experts, &lora_of(&mats, 2, 4.0), &x, &rt, &go);
    // Routing weights: the loss is linear in them.
    for s in 0..6 {
        let (w0, eps) = (w[s], 1e-2);
        w[s] = w0 + eps;
        let up = loss(&mats, &w);
        w[s] = w0 - eps;
        let down = loss(&mats, &w);
        w[s] = w0;
        let fd = (up - down) / (2.0 * f64::from(eps));
        assert!((fd - t.grad_weights[s]).abs() < 1e-3 * (1.0 + fd.abs()), "weight {s}: {fd} vs {}", t.grad_weights[s]);
    }
    // LoRA entries (bf16 steps, so a coarse difference of a smooth function).
    for (m, at) in [(0, 5), (1, 3), (3, 7), (4, 2), (5, 9)] {
        let v0 = mats[m][at];
        let eps = 1.0f32 / 64.0;
        mats[m][at] = half::bf16::from_f32(v0.to_f32() + eps);
        let up = loss(&mats, &w);
        mats[m][at] = half::bf16::from_f32(v0.to_f32() - eps);
        let down = loss(&mats, &w);
        mats[m][at] = v0;
        let fd = (up - down) / (2.0 * f64::from(eps));
        let want = t.grad_lora[m][at];
        assert!((fd - want).abs() < 2e-2 * (1.0 + want.abs()), "lora {m}[{at}]: {fd} vs {want}");
    }
    // Base weights (f32): expert e's matrix p at `at`, within the layer's `[E, ...]` gradient.
    let hi = cfg.hidden * cfg.intermediate;
    for (slot, p, at) in [(0, 0, 5), (1, 1, 17), (2, 2, 100), (3, 2, 3)] {
        let e = ids[slot] as usize;
        let v0 = experts[e][p][at];
        let mut loss_at = |v: f32| {
            experts[e][p][at] = v;
            let rt = Routing { tokens: 3, k: 2, ids: &ids, weights: &w, gpu_mask: None };
            let t = textbook(&cfg, &experts, &experts, &lora_of(&mats, 2, 4.0), &x, &rt, &go);
            t.out.iter().zip(&go).map(|(o, g)| o * g).sum::<f64>()
        };
        let eps = 1e-2f32;
        let fd = (loss_at(v0 + eps) - loss_at(v0 - eps)) / (2.0 * f64::from(eps));
        experts[e][p][at] = v0;
        let want = t.grad_base[p][e * hi + at];
        assert!(want != 0.0, "expert {e} is routed, so its gradient is not zero");
        assert!((fd - want).abs() < 1e-3 * (1.0 + want.abs()), "base {e}/{p}[{at}]: {fd} vs {want}");
    }
}

/// The textbook's clamped activations: their partial derivatives are central differences of
/// their values, away from the clamps' edges, and zero through a clamp that holds.
#[test]
fn the_gated_activations_derivatives_are_their_differences() {
    use super::check::gated;
    use crate::swiglu::Glu;
    let eps = 1e-6;
    for glu in [Glu::SILU, Glu::new(1.5, 0.0).unwrap(), Glu::new(1.5, 1.702).unwrap(), Glu::new(0.0, 1.702).unwrap()] {
        for &(g, u) in &[(0.3, -0.7), (-1.2, 0.4), (2.5, 0.2), (0.8, 2.0), (-2.5, -3.0), (1.1, 1.4)] {
            let (_, dg, du) = gated(glu, g, u);
            let fd_g = (gated(glu, g + eps, u).0 - gated(glu, g - eps, u).0) / (2.0 * eps);
            let fd_u = (gated(glu, g, u + eps).0 - gated(glu, g, u - eps).0) / (2.0 * eps);
            assert!(
                (dg - fd_g).abs() < 1e-6 && (du - fd_u).abs() < 1e-6,
                "{glu:?} at ({g}, {u}): ({dg}, {du}) vs ({fd_g}, {fd_u})"
            );
        }
    }
    // Held clamps pass nothing: the gate above the limit, up beyond it.
    let limited = Glu::new(1.5, 0.0).unwrap();
    assert_eq!(gated(limited, 2.5, 0.2).1, 0.0);
    assert_eq!(gated(limited, 0.8, 2.0).2, 0.0);
    assert!(gated(limited, -2.5, 0.2).1 != 0.0, "the gate is clamped from above only");
}
