//! Results are bit-identical for any thread count and pool shape, and NUMA parts agree with the
//! reference.

use std::sync::Arc;

use kt_core::ggml::GgmlType;
use kt_core::reference::REFERENCE;
use kt_core::testing::{
    conformance_failures, ggml_conformance_failures, mean_rel_err, random_input, scenario_routing, textbook_moe, Depth,
    Scenario,
};
use kt_core::Backend;
use kt_core::Executor;
use kt_core::{MoeConfig, WeightFormat};
use kt_host::exec::ThreadExecutor;
use kt_host::numa_pool::NumaPool;
use kt_host::pool::Pool;
use kt_host::{registry, LayerOptions, MoeLayer};
use kt_tests::{experts, owned};

fn layer(
    b: &'static dyn Backend,
    cfg: &MoeConfig,
    f: WeightFormat,
    threads: usize,
    xs: &[kt_core::testing::Expert],
) -> MoeLayer {
    on(b, cfg, f, Arc::new(Pool::new(threads)), xs)
}

fn on(
    b: &'static dyn Backend,
    cfg: &MoeConfig,
    f: WeightFormat,
    executor: Arc<dyn Executor>,
    xs: &[kt_core::testing::Expert],
) -> MoeLayer {
    MoeLayer::from_f32(cfg, f, owned(xs, &[]), &LayerOptions { backend: Some(b), ..LayerOptions::executor(executor) })
        .unwrap()
}

fn bits(l: &MoeLayer, input: &[kt_core::bf16], ids: &[i64], w: &[f32], mask: Option<&[bool]>) -> Vec<u16> {
    l.forward(input, ids, w, mask).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// KT's formats and the GGML types with a quantizer here that `b` runs on this shape.
fn formats(b: &dyn Backend, cfg: &MoeConfig) -> Vec<WeightFormat> {
    let ggml = [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::F16].map(WeightFormat::Ggml);
    let (h, i) = (cfg.hidden, cfg.intermediate / cfg.parts);
    WeightFormat::ALL
        .into_iter()
        .chain(ggml)
        .filter(|&f| cfg.validate_for(f).is_ok() && b.serves(f, i, h) && b.serves(f, h, i))
        .collect()
}

/// Every backend this build registers that this CPU can run.
fn runnable() -> Vec<&'static dyn Backend> {
    registry::registered().into_iter().filter(|b| b.cpu_support().is_ok()).collect()
}

#[test]
fn bit_identical_for_any_thread_count() {
    let cfg = MoeConfig { max_tokens: 64, ..MoeConfig::new(12, 3, 128, 256) };
    let xs = experts(&cfg, 5);
    for b in runnable() {
        for f in formats(b, &cfg) {
            let layers: Vec<MoeLayer> = [1, 2, 3, 8].iter().map(|&t| layer(b, &cfg, f, t, &xs)).collect();
            for (tokens, s) in
                [(1, Scenario::Random), (37, Scenario::Random), (29, Scenario::Skewed), (13, Scenario::Masked)]
            {
                let input = random_input(tokens, cfg.hidden, 9);
                let (ids, w, mask) = scenario_routing(s, tokens, &cfg, 11);
                let outs: Vec<Vec<u16>> = layers.iter().map(|l| bits(l, &input, &ids, &w, mask.as_deref())).collect();
                assert!(
                    outs.iter().all(|o| o == &outs[0]),
                    "{} {f} n={tokens} {s:?}: differs by thread count",
                    b.name()
                );
            }
        }
    }
}

#[test]
fn every_backend_conforms_through_threaded_executors() {
    // The whole conformance matrix (formats, shapes, scenarios, 1 and 2 parts) for every backend
    // this CPU runs, through the persistent pool and the scoped-thread executor, against the
    // serial reference.
    for b in runnable() {
        let failures = conformance_failures(b, &Pool::new(3), Depth::Full);
        assert!(failures.is_empty(), "{}: {failures:#?}", b.name());
    }
    let failures = conformance_failures(&REFERENCE, &ThreadExecutor::new(3), Depth::Full);
    assert!(failures.is_empty(), "{failures:#?}");
    // Two sub-pools (the conformance shapes have 1 and 2 parts).
    let numa = NumaPool::with_threads(4, 2).unwrap();
    for b in runnable() {
        let failures = conformance_failures(b, &numa, Depth::Full);
        assert!(failures.is_empty(), "{} on a NUMA pool: {failures:#?}", b.name());
    }
    // The GGML formats (mixed per projection too) of the backends that run them.
    for b in runnable().into_iter().filter(|b| b.name() != REFERENCE.name()) {
        let failures = ggml_conformance_failures(b, &numa);
        assert!(failures.is_empty(), "{} (GGML) on a NUMA pool: {failures:#?}", b.name());
    }
}

#[test]
fn numa_pools_give_the_flat_pools_bits_and_match_the_reference() {
    // Sub-pools only move tasks between threads: with 2 and 4 parts, every pool shape gives
    // the bits of the plain pool, and those agree with the reference backend.
    for parts in [2, 4] {
        let cfg = MoeConfig { parts, max_tokens: 40, ..MoeConfig::new(10, 3, 128, 256) };
        let xs = experts(&cfg, 31);
        for b in runnable() {
            let some =
                [WeightFormat::Bf16, WeightFormat::Int8Row, WeightFormat::Int4Row, WeightFormat::Ggml(GgmlType::Q4_0)];
            for f in formats(b, &cfg).into_iter().filter(|f| some.contains(f)) {
                let flat = layer(b, &cfg, f, 2, &xs);
                let numa: Vec<MoeLayer> = [parts, parts + 1, 2 * parts]
                    .iter()
                    .map(|&t| on(b, &cfg, f, Arc::new(NumaPool::with_threads(t, parts).unwrap()), &xs))
                    .collect();
                let oracle = layer(&REFERENCE, &cfg, f, 1, &xs);
                for (tokens, s) in [(1, Scenario::Random), (33, Scenario::Skewed), (7, Scenario::Masked)] {
                    let input = random_input(tokens, cfg.hidden, 5);
                    let (ids, w, mask) = scenario_routing(s, tokens, &cfg, 6);
                    let want = bits(&flat, &input, &ids, &w, mask.as_deref());
                    for l in &numa {
                        assert_eq!(bits(l, &input, &ids, &w, mask.as_deref()), want, "{} {f} parts {parts}", b.name());
                    }
                    let got: Vec<f32> = want.iter().map(|&v| kt_core::bf16::from_bits(v).to_f32()).collect();
                    let reference: Vec<f64> =
                        oracle.forward(&input, &ids, &w, mask.as_deref()).unwrap().iter().map(|v| v.to_f64()).collect();
                    let err = mean_rel_err(&got, &reference);
                    assert!(err < 1e-2, "{} {f} parts {parts} n={tokens}: {err}", b.name());
                }
            }
        }
    }
}

#[test]
fn numa_parts_match_the_textbook_moe() {
    for parts in [1, 2, 3, 4] {
        let cfg = MoeConfig { parts, max_tokens: 16, ..MoeConfig::new(8, 2, 64, 128) };
        let xs = experts(&cfg, 21);
        let input = random_input(9, cfg.hidden, 3);
        let (ids, w, _) = scenario_routing(Scenario::InvalidIds, 9, &cfg, 4);
        let got = layer(&REFERENCE, &cfg, WeightFormat::Bf16, 2, &xs).forward(&input, &ids, &w, None).unwrap();
        let got: Vec<f32> = got.iter().map(|v| v.to_f32()).collect();
        let r = kt_core::Routing { tokens: 9, k: 2, ids: &ids, weights: &w, gpu_mask: None };
        let deq = kt_core::testing::dequantized(&cfg, WeightFormat::Bf16, &xs);
        let err = mean_rel_err(&got, &textbook_moe(&cfg, &deq, &input, &r));
        assert!(err < 0.01, "parts {parts}: {err}");
    }
}
