//! A forward after warm-up performs no heap allocation: every buffer (the plan, prepared
//! activations, intermediate results, each worker's scratch) is owned by the layer's workspace
//! and only grows. Checked with a counting global allocator for every backend this CPU runs and
//! every format it serves, on the host's thread pool and on a NUMA pool of two parts, for the
//! same token count with other routing and for fewer tokens. A binary of its own (no libtest), so only these forwards run.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kt_core::testing::{ggml_layer_formats, random_ggml_expert, random_input, random_routing};
use kt_core::{Backend, MoeConfig, WeightFormat};
use kt_host::numa_pool::NumaPool;
use kt_host::pool::Pool;
use kt_host::{LayerOptions, MoeLayer};
use kt_tests::{experts, owned};

/// Counts allocations (and reallocations) while `COUNTING` is set.
struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static COUNTING: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) != 0 {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) != 0 {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made while `f` runs.
fn allocations(f: impl FnOnce()) -> usize {
    let before = ALLOCS.load(Ordering::SeqCst);
    COUNTING.store(1, Ordering::SeqCst);
    f();
    COUNTING.store(0, Ordering::SeqCst);
    ALLOCS.load(Ordering::SeqCst) - before
}

/// Warm up with `n` tokens, then count the allocations of forwards with other routing (n and
/// fewer tokens, with and without a GPU mask).
fn check(layer: &MoeLayer, what: &str, failures: &mut Vec<String>) {
    let (e, h, k) = (layer.config().experts, layer.config().hidden, layer.config().top_k);
    let n = layer.config().max_tokens;
    let input = random_input(n, h, 1);
    let mut out = vec![kt_core::bf16::ZERO; n * h];
    let (ids, w) = random_routing(n, k, e, 2);
    layer.forward_into(&input, &ids, &w, None, &mut out).expect("warm-up forward");
    let mask: Vec<bool> = (0..e).map(|i| i % 3 == 0).collect();
    for (tokens, seed, gpu) in [(n, 3, None), (n, 4, Some(&mask[..])), (n / 2 + 1, 5, None), (1, 6, None)] {
        let (ids, w) = random_routing(tokens, k, e, seed);
        let (x, o) = (&input[..tokens * h], &mut out[..tokens * h]);
        let mut result = Ok(());
        let count = allocations(|| result = layer.forward_into(x, &ids, &w, gpu, o));
        result.expect("forward");
        if count != 0 {
            failures.push(format!("{what} on {}, {tokens} tokens: {count} allocations", layer.backend().name()));
        }
    }
}

fn main() {
    let backends: Vec<&'static dyn Backend> =
        kt_host::registry::registered().into_iter().filter(|b| b.cpu_support().is_ok()).collect();
    let skipped: Vec<_> = kt_host::registry::registered().into_iter().filter(|b| b.cpu_support().is_err()).collect();
    for b in skipped {
        kt_core::skip_isa!(format!("{} (backend {})", b.cpu_support().unwrap_err(), b.name()));
    }
    // The host's pool, and a NUMA pool of two sub-pools (two NUMA parts of I) on this machine.
    let mut executors: Vec<(Arc<dyn kt_core::Executor>, usize)> = vec![(Arc::new(Pool::new(2)), 1)];
    match NumaPool::with_threads(2, 2) {
        Ok(p) => executors.push((Arc::new(p), 2)),
        Err(e) => println!("skipped the two-part NUMA pool: {e}"),
    }
    let (mut checked, mut failed, mut failures) = (0, 0, Vec::new());
    for ((pool, parts), &b) in executors.iter().flat_map(|e| backends.iter().map(move |b| (e, b))) {
        let opts = LayerOptions { backend: Some(b), ..LayerOptions::executor(pool.clone()) };
        let cfg = MoeConfig { max_tokens: 40, parts: *parts, ..MoeConfig::new(8, 2, 256, 512) };
        let xs = experts(&cfg, 7);
        for f in WeightFormat::ALL.into_iter().filter(|&f| b.serves(f, 512, 256) && b.serves(f, 256, 512)) {
            let layer = MoeLayer::from_f32(&cfg, f, owned(&xs, &[]), &opts).expect("layer");
            let before = failures.len();
            check(&layer, &format!("{f}, {parts} part(s)"), &mut failures);
            (checked, failed) = (checked + 1, failed + usize::from(failures.len() > before));
        }
        // Past SUM_IN_DOWN_FROM at 80 tokens (Down sums into the output), below at 41 and 1
        // (Reduce sums y, which the warm-up left grown).
        let wide = MoeConfig { max_tokens: 80, parts: *parts, ..MoeConfig::new(8, 8, 4096, 64) };
        assert!(parts * 80 * 8 * kt_core::forward::y_stride(4096) * 4 > kt_core::plan::SUM_IN_DOWN_FROM);
        if let Some(f) = [WeightFormat::Int8Row, WeightFormat::Bf16].into_iter().find(|&f| b.serves(f, 64, 4096)) {
            let layer = MoeLayer::from_f32(&wide, f, owned(&experts(&wide, 8), &[]), &opts).expect("layer");
            let before = failures.len();
            check(&layer, &format!("{f}, {parts} part(s), summed in Down"), &mut failures);
            (checked, failed) = (checked + 1, failed + usize::from(failures.len() > before));
        }
        for lf in ggml_layer_formats() {
            let shapes = [(lf.gate, 512, 256), (lf.up, 512, 256), (lf.down, 256, 512)];
            if !shapes.iter().all(|&(f, r, c)| b.serves(f, r, c)) {
                continue;
            }
            let experts = |e: usize| {
                let [g, u, d] = random_ggml_expert(&cfg, lf, 10 + e as u64);
                Some((g, u, d))
            };
            let layer = MoeLayer::from_quantized(&cfg, experts, lf, &opts).expect("GGML layer");
            let before = failures.len();
            check(&layer, &format!("{lf}, {parts} part(s)"), &mut failures);
            (checked, failed) = (checked + 1, failed + usize::from(failures.len() > before));
        }
    }
    for f in &failures {
        println!("FAILED {f}");
    }
    println!("no_alloc: {} passed, {failed} failed", checked - failed);
    if !failures.is_empty() {
        std::process::exit(1);
    }
}
