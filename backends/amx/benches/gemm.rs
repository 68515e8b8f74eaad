//! Hot-weight GEMM on one thread: one expert's 2048 × 7168 projection (DeepSeek-V3's gate)
//! against 256 tokens, the weights in cache after the first rep, through the backend's `down`
//! (one task over every row): the tile kernels' own speed, against the peaks `peak` times on
//! the same thread in the same run (the tile block `kt bench` probes, and the 512-bit
//! `vpdpbusd` and `vdpbf16ps` for `/avx512`). Items are operations (2·rows·cols·tokens), so a
//! kernel's Gitem/s over its peak's is its ratio to the roofline. `/avx512`: the `avx512_bf16`
//! kernels on the same shape. Prints nothing but a skip line on a CPU without AMX (or without
//! AVX-512 for `/avx512`).
//! `cargo bench -p kt-backend-amx --bench gemm`

use kt_core::kernel_case::KernelCase;
use kt_core::rng::SplitMix64;
use kt_core::{Backend, QuantMatrix, WeightFormat};

const ROWS: usize = 2048;
const COLS: usize = 7168;
const TOKENS: usize = 256;

/// The `amx` backend never on tiles (its tile type unused): the `avx512_bf16` kernels on the
/// same packed bytes, on any AVX-512 CPU with BF16.
static AVX512: kt_backend_amx::AmxBackend<kt_backend_amx::tile::Emulator> =
    kt_backend_amx::AmxBackend::new("amx_avx512", usize::MAX);

#[divan::bench(args = ["int8", "int8/avx512", "int4", "int4/avx512", "bf16", "bf16/avx512"])]
fn gemm(bencher: divan::Bencher, name: &str) {
    let (name, b): (_, &'static dyn Backend) = match name.strip_suffix("/avx512") {
        Some(name) => (name, &AVX512),
        None => (name, &kt_backend_amx::AMX),
    };
    if let Err(missing) = b.cpu_support() {
        eprintln!("skipped {}: this CPU lacks {missing}", b.name());
        return;
    }
    let format = WeightFormat::parse(name).expect("a format");
    let mut r = SplitMix64::new(1);
    let w: Vec<f32> = (0..ROWS * COLS).map(|_| r.uniform(0.05)).collect();
    let m = QuantMatrix::quantize(format, ROWS, COLS, &w).expect("quantizes");
    let mut case = KernelCase::new(b, &m, TOKENS, 2);
    bencher.counter(divan::counter::ItemsCount::new(case.ops())).bench_local(|| case.run());
}

/// `amx-int8`, `amx-bf16`: the kernels' 2×2 tile block from L1 (`kt_backend_amx::probe`);
/// `vnni`, `bf16-512`: the 512-bit `vpdpbusd` and `vdpbf16ps` chains (`kt_peak`).
#[divan::bench(args = ["amx-int8", "amx-bf16", "vnni", "bf16-512"])]
fn peak(bencher: divan::Bencher, name: &str) {
    use kt_backend_amx::probe::{block_steps, ops_per_step};
    use kt_peak::Loop;
    const STEPS: u64 = 10_000;
    let (ops, run): (_, Box<dyn Fn()>) = match name {
        "amx-int8" | "amx-bf16" => {
            let bf16 = name == "amx-bf16";
            if let Err(missing) = block_steps(bf16, 1) {
                eprintln!("skipped peak {name}: this CPU lacks {missing}");
                return;
            }
            (ops_per_step(bf16) * STEPS, Box::new(move || block_steps(bf16, STEPS).expect("granted above")))
        }
        _ => {
            let l = if name == "vnni" { Loop::Vnni } else { Loop::Bf16Zmm };
            let Some(ops) = l.ops() else {
                eprintln!("skipped peak {name}: this CPU lacks its instructions");
                return;
            };
            (ops * 10 * STEPS, Box::new(move || assert!(l.run(10 * STEPS))))
        }
    };
    bencher.counter(divan::counter::ItemsCount::new(ops)).bench_local(run);
}

fn main() {
    divan::main();
}
