//! The conformance suite for every sub-variant, the packing layout, and the same bits from
//! every sub-variant where the arithmetic is exact integers.

use kt_core::exec::SerialExecutor;
use kt_core::rng::SplitMix64;
use kt_core::testing::{build_layer, random_experts, random_input, run, scenario_routing, Scenario};
use kt_core::{Backend, MoeConfig, QuantMatrix, WeightFormat};

use crate::imp::{BASE, BF16, VBMI, VNNI};
use crate::{pack, Level, AVX512};

mod best {
    kt_core::conformance_suite!(&crate::AVX512);
}
mod bf16 {
    kt_core::conformance_suite!(&crate::imp::BF16);
}
mod vbmi {
    kt_core::conformance_suite!(&crate::imp::VBMI);
}
mod vnni {
    kt_core::conformance_suite!(&crate::imp::VNNI);
}
mod base {
    kt_core::conformance_suite!(&crate::imp::BASE);
}

#[test]
fn packing_keeps_every_weight() {
    let mut r = SplitMix64::new(3);
    for f in WeightFormat::ALL {
        for (rows, cols) in [(1, 128), (17, 256), (40, 384), (33, 160)] {
            if cols % f.col_multiple() != 0 {
                continue;
            }
            let x: Vec<f32> = (0..rows * cols).map(|_| r.uniform(2.0)).collect();
            let q = QuantMatrix::quantize(f, rows, cols, &x).unwrap();
            let deq = q.dequantize();
            for level in [Level::Base, Level::Bf16] {
                let p = pack::pack(&q, level);
                for row in 0..rows {
                    for c in 0..cols {
                        let got = pack::unpack(&p, row, c);
                        assert_eq!(got, deq[row * cols + c], "{f} {level:?} {rows}x{cols} r{row} c{c}");
                    }
                }
            }
        }
    }
}

/// Outputs of `b` on one layer of `f` for `tokens` tokens routed as `s` says.
fn outputs(b: &'static dyn Backend, f: WeightFormat, cfg: &MoeConfig, tokens: usize, s: Scenario) -> Vec<f32> {
    let experts = random_experts(cfg, 7);
    let layer = build_layer(b, cfg, f, &experts);
    let input = random_input(tokens, cfg.hidden, 8);
    let (ids, w, mask) = scenario_routing(s, tokens, cfg, 9);
    let r = kt_core::Routing { tokens, k: cfg.top_k, ids: &ids, weights: &w, gpu_mask: mask.as_deref() };
    run(&SerialExecutor, cfg, &layer, &input, &r)
}

/// Integer sums are exact, scaled in one order: every sub-variant gives the base's bits, at
/// every token count from one to past two full tiles (all on one expert, or spread with
/// skipped ids).
#[test]
fn int_formats_give_the_same_bits_on_every_sub_variant() {
    let variants: [&'static dyn Backend; 4] = [&BF16, &VBMI, &VNNI, &BASE];
    let runs: Vec<_> = variants.into_iter().filter(|b| b.cpu_support().is_ok()).collect();
    if runs.len() < 2 {
        eprintln!("skipped: this CPU runs {} AVX-512 sub-variants, nothing to compare", runs.len());
        return;
    }
    let cfg = MoeConfig { max_tokens: 40, ..MoeConfig::new(4, 2, 160, 96) };
    let formats =
        [WeightFormat::Int8Row, WeightFormat::Int4Row, WeightFormat::Int4Group { group: 32 }, WeightFormat::Mxfp4];
    for f in formats {
        for (tokens, s) in
            [1, 2, 3, 5, 7, 12, 13, 25, 40].into_iter().flat_map(|n| [(n, Scenario::Skewed), (n, Scenario::InvalidIds)])
        {
            let want = outputs(runs[runs.len() - 1], f, &cfg, tokens, s);
            for b in &runs[..runs.len() - 1] {
                let got = outputs(*b, f, &cfg, tokens, s);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} and {} differ on {f}, {tokens} tokens {s:?}", b.name(), runs[runs.len() - 1].name());
            }
        }
    }
}

/// `avx512` is the widest sub-variant this CPU runs, and reports it under KT's name.
#[test]
fn the_best_variant_is_the_widest_this_cpu_runs() {
    let Ok(()) = AVX512.cpu_support() else {
        eprintln!("skipped: this CPU lacks AVX-512F/BW");
        return;
    };
    let widest = [&BF16, &VBMI, &VNNI, &BASE].into_iter().find(|b| b.cpu_support().is_ok()).unwrap();
    assert_eq!(AVX512.variant(), widest.name());
    assert_eq!(AVX512.level(), widest.level());
}

#[test]
fn fp8_tables_give_every_e4m3_value_in_bf16() {
    let t = crate::kernels::fp8_bf16_bytes();
    for c in 0..127u8 {
        let want = kt_core::dtype::F8E4M3(c).to_f32();
        let bits = u32::from(t[1][usize::from(c)]) << 24 | u32::from(t[0][usize::from(c)]) << 16;
        assert_eq!(f32::from_bits(bits), want, "e4m3 code {c:#04x}");
    }
}
