//! One projection's dots on one thread (qwen3-30b-a3b's gate: 768 × 2048), for one token
//! (decode, weights from cache: the kernel's own cost), 4 (an expert's share of a batched
//! decode) and 20 and 33 (an expert's share of a 512-token prefill); `down`: its down
//! projection's shape (2048 × 768). Divide 2·768·2048·n by the time for GOP/s. `pack`: the gate matrix packed at load (repacking, levels moved to
//! the lane layout), in GGUF bytes per second. `/avx2`: the AVX2 kernels where the CPU would
//! run VNNI ones (`LLAMAFILE_AVX2`). `peak`: the instruction peaks the kernels are judged by,
//! timed on the same thread in the same run; items are operations, so a kernel's Gitem/s over
//! its peak's is its ratio to the roofline.
//! `cargo bench -p kt-backend-llamafile --bench dots`

use kt_backend_llamafile::{Llamafile, LLAMAFILE, LLAMAFILE_AVX2};
use kt_core::ggml::{random_matrix, GgmlType};
use kt_core::kernel_case::KernelCase;
use kt_core::Backend;

const ROWS: usize = 768;
const COLS: usize = 2048;

#[divan::bench(args = ["q2_K", "q3_K", "q4_K", "q4_K/avx2", "q5_K", "q5_K/avx2", "q6_K", "iq4_xs", "q8_0", "q8_0/avx2", "q4_0", "q4_0/avx2", "q5_0", "q5_0/avx2", "iq2_xxs", "iq2_xxs/avx2", "iq3_xxs", "iq3_xxs/avx2", "iq3_s", "iq3_s/avx2", "iq2_xs", "iq2_xs/avx2", "iq2_s", "iq2_s/avx2", "iq1_s", "iq1_s/avx2", "iq1_m", "iq1_m/avx2"], consts = [1, 4, 20, 33])]
fn dots<const N: usize>(bencher: divan::Bencher, name: &str) {
    run::<N>(bencher, name, ROWS, COLS);
}

/// The down projection's shape (2048 × 768): a third of the columns, so per-tile costs
/// (accumulators, horizontal sums, stores) weigh three times as much.
#[divan::bench(args = ["q4_K", "q4_K/avx2", "q8_0", "q8_0/avx2", "q4_0", "q4_0/avx2"], consts = [20, 33])]
fn down<const N: usize>(bencher: divan::Bencher, name: &str) {
    run::<N>(bencher, name, COLS, ROWS);
}

fn run<const N: usize>(bencher: divan::Bencher, name: &str, rows: usize, cols: usize) {
    if LLAMAFILE.cpu_support().is_err() {
        return;
    }
    let (name, b): (_, &'static Llamafile) = match name.strip_suffix("/avx2") {
        Some(name) => (name, &LLAMAFILE_AVX2),
        None => (name, &LLAMAFILE),
    };
    let t = GgmlType::parse(name).expect("a GGML type");
    let mut case = KernelCase::new(b, &random_matrix(t, rows, cols, 1), N, 2);
    bencher.counter(divan::counter::ItemsCount::new(case.ops())).bench_local(|| case.run());
}

/// `vnni`: the widest `vpdpbusd` (the VNNI kernels); `int8`: AVX2's `vpmaddubsw` chain (the
/// `/avx2` kernels); `int8-512`: its 512-bit form (q2_K, q3_K, q6_K and the lattice types
/// with AVX512-VNNI). `kt_peak`'s loops, as `kt bench`'s roofline runs them.
#[divan::bench(args = ["vnni", "int8", "int8-512"])]
fn peak(bencher: divan::Bencher, name: &str) {
    use kt_peak::Loop;
    const ITERS: u64 = 100_000;
    let l = match name {
        "vnni" => Loop::Vnni,
        "int8" => Loop::Int8,
        _ => Loop::Int8Zmm,
    };
    let Some(ops) = l.ops() else {
        eprintln!("skipped peak {name}: this CPU lacks its instructions");
        return;
    };
    bencher.counter(divan::counter::ItemsCount::new(ops * ITERS)).bench_local(|| l.run(ITERS));
}

#[divan::bench(args = ["q3_K", "q4_K", "q5_K", "q6_K", "q8_0", "q4_0"])]
fn pack(bencher: divan::Bencher, name: &str) {
    let t = GgmlType::parse(name).expect("a GGML type");
    let m = random_matrix(t, ROWS, COLS, 1);
    bencher.counter(divan::counter::BytesCount::new(m.data().len())).bench_local(|| LLAMAFILE.pack(&m).expect("packs"));
}

fn main() {
    divan::main();
}
