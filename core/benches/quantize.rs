//! Quantization at load (`QuantMatrix::quantize`, what `kt convert` and online quantization
//! from bf16 checkpoints run per weight, one thread): one 2048 × 7168 matrix (DeepSeek-V3's
//! gate) of uniform weights in each format. Items are weights.
//! `cargo bench -p kt-core --bench quantize`

use kt_core::rng::SplitMix64;
use kt_core::{QuantMatrix, WeightFormat};

const ROWS: usize = 2048;
const COLS: usize = 7168;

#[divan::bench(args = ["bf16", "int8", "int4", "int4-g32", "int4-g128", "fp8", "fp8-channel", "mxfp4", "mxfp8"])]
fn quantize(bencher: divan::Bencher, name: &str) {
    let format = WeightFormat::parse(name).expect("a format");
    let mut r = SplitMix64::new(1);
    let w: Vec<f32> = (0..ROWS * COLS).map(|_| r.uniform(0.05)).collect();
    bencher
        .counter(divan::counter::ItemsCount::new(ROWS * COLS))
        .bench_local(|| QuantMatrix::quantize(format, ROWS, COLS, &w).expect("quantizes"));
}

fn main() {
    divan::main();
}
