//! Quantization at load (`QuantMatrix::quantize`, what `kt convert` and online quantization
//! from bf16 checkpoints run per weight, one thread): one 2048 × 7168 matrix (DeepSeek-V3's
//! gate) of Gaussian weights in each format, with absmax scales and with the `mse` search. Items
//! are weights.
//! `cargo bench -p kt-core --bench quantize`

use kt_core::rng::SplitMix64;
use kt_core::{QuantMatrix, Scales, WeightFormat};

const ROWS: usize = 2048;
const COLS: usize = 7168;

const FORMATS: [&str; 9] = ["bf16", "int8", "int4", "int4-g32", "int4-g128", "fp8", "fp8-channel", "mxfp4", "mxfp8"];

fn run(bencher: divan::Bencher, name: &str, scales: Scales) {
    let format = WeightFormat::parse(name).expect("a format");
    let mut r = SplitMix64::new(1);
    let w: Vec<f32> = (0..ROWS * COLS).map(|_| r.gaussian() * 0.02).collect();
    bencher
        .counter(divan::counter::ItemsCount::new(ROWS * COLS))
        .bench_local(|| QuantMatrix::quantize_with(format, scales, ROWS, COLS, &w).expect("quantizes"));
}

#[divan::bench(args = FORMATS)]
fn absmax(bencher: divan::Bencher, name: &str) {
    run(bencher, name, Scales::Absmax);
}

#[divan::bench(args = &FORMATS[1..])]
fn mse(bencher: divan::Bencher, name: &str) {
    run(bencher, name, Scales::Mse);
}

fn main() {
    divan::main();
}
