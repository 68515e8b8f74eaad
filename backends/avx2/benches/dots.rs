//! One projection's dots on one thread (qwen3-30b-a3b's gate: 768 × 2048, in cache after the
//! first rep): the kernels' own speed, for 1 and 4 tokens (decode, and an expert's share of a
//! batched one) and 6 and 24 (the float tile and four of them: prefill). `peak`: the 256-bit
//! FMA and `vpmaddubsw` chains the float and int kernels are judged by, timed on the same
//! thread in the same run (`kt_peak`, as `kt bench`'s roofline runs them). Items are
//! operations (2·rows·cols·tokens), so a kernel's Gitem/s over its peak's is its ratio to the
//! roofline. Prints nothing but a skip line on a CPU without AVX2 and FMA.
//! `cargo bench -p kt-backend-avx2 --bench dots`

use kt_backend_avx2::AVX2;
use kt_core::kernel_case::KernelCase;
use kt_core::rng::SplitMix64;
use kt_core::{Backend, QuantMatrix, WeightFormat};

const ROWS: usize = 768;
const COLS: usize = 2048;

#[divan::bench(args = ["bf16", "fp8", "mxfp8", "int8", "int4", "int4-g32", "mxfp4"], consts = [1, 4, 6, 24])]
fn dots<const N: usize>(bencher: divan::Bencher, name: &str) {
    if let Err(missing) = AVX2.cpu_support() {
        eprintln!("skipped {name}: this CPU lacks {missing}");
        return;
    }
    let format = WeightFormat::parse(name).expect("a format");
    let mut r = SplitMix64::new(1);
    let w: Vec<f32> = (0..ROWS * COLS).map(|_| r.uniform(0.05)).collect();
    let mut case = KernelCase::new(&AVX2, &QuantMatrix::quantize(format, ROWS, COLS, &w).expect("quantizes"), N, 2);
    bencher.counter(divan::counter::ItemsCount::new(case.ops())).bench_local(|| case.run());
}

/// `fma`: 256-bit `vfmadd231ps` chains (the float kernels); `int8`: `vpmaddubsw → vpmaddwd →
/// vpaddd` chains (the int kernels).
#[divan::bench(args = ["fma", "int8"])]
fn peak(bencher: divan::Bencher, name: &str) {
    use kt_peak::Loop;
    const ITERS: u64 = 100_000;
    let l = if name == "fma" { Loop::Fma } else { Loop::Int8 };
    let Some(ops) = l.ops() else {
        eprintln!("skipped peak {name}: this CPU lacks its instructions");
        return;
    };
    bencher.counter(divan::counter::ItemsCount::new(ops * ITERS)).bench_local(|| l.run(ITERS));
}

fn main() {
    divan::main();
}
