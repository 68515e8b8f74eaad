//! One thread running one kernel over many matrices from DRAM, against a plain read of as many
//! bytes: whether a decode kernel streams its weights at the rate the memory gives one core,
//! with the layer's other work (activations, SwiGLU, tasks, the second thread) left out.
//!
//! Each format quantizes one qwen3-30b-a3b gate (768 × 2048), packs it `count` times (distinct
//! memory, 128 MB or more in all, so each pass comes from DRAM), then alternates 15 times: one
//! token through every matrix (`down`, one task each) and a read of a huge-page buffer of the
//! same bytes. Prints best and median GB/s of both and the median, min and max over the reps of
//! the read's time over the kernels' (`stream×`, as `kt bench`'s paired ratio).
//! `cargo run --release -p kt-backend-avx512 --example stream -- [FORMATS] [COUNT]`
//! (default `bf16,fp8,mxfp8,int8,int4,int4-g32,mxfp4` and enough matrices for 128 MB).

use std::time::Instant;

use kt_backend_avx512::AVX512_BF16;
use kt_core::kernel_case::KernelCase;
use kt_core::rng::SplitMix64;
use kt_core::{Backend, QuantMatrix, WeightFormat};

const ROWS: usize = 768;
const COLS: usize = 2048;
const REPS: usize = 15;

fn main() {
    if let Err(missing) = AVX512_BF16.cpu_support() {
        eprintln!("skipped: this CPU lacks {missing}");
        return;
    }
    let mut args = std::env::args().skip(1);
    let formats = args.next().unwrap_or_else(|| "bf16,fp8,mxfp8,int8,int4,int4-g32,mxfp4".into());
    let count = args.next().map(|c| match c.parse::<usize>() {
        Ok(n) if n > 0 => n,
        _ => usage(&format!("COUNT {c:?} is not a number of matrices, 1 or more")),
    });
    let mut r = SplitMix64::new(1);
    let w: Vec<f32> = (0..ROWS * COLS).map(|_| r.uniform(0.05)).collect();
    for name in formats.split(',') {
        let Some(format) = WeightFormat::parse(name) else {
            usage(&format!("{name:?} is not a weight format"));
        };
        let m = QuantMatrix::quantize(format, ROWS, COLS, &w).expect("quantizes");
        let each = format.matrix_bytes(ROWS, COLS);
        let count = count.unwrap_or((128usize << 20).div_ceil(each));
        let mut cases: Vec<KernelCase> = (0..count).map(|i| KernelCase::new(&AVX512_BF16, &m, 1, i as u64)).collect();
        let words = each * count / 8;
        let mut buf = kt_x86::memory::weight_buffer(words * 8);
        let read: &mut [u64] = bytemuck::cast_slice_mut(&mut buf.as_mut_slice()[..words * 8]);
        read.iter_mut().enumerate().for_each(|(i, x)| *x = i as u64 | 1);
        let (mut kernel, mut stream) = (Vec::new(), Vec::new());
        for _ in 0..REPS {
            let t = Instant::now();
            cases.iter_mut().for_each(KernelCase::run);
            kernel.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            std::hint::black_box(read.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
            stream.push(t.elapsed().as_secs_f64());
        }
        let mut ratio: Vec<f64> = stream.iter().zip(&kernel).map(|(s, k)| s / k).collect();
        ratio.sort_by(f64::total_cmp);
        let gbps = |ts: &mut Vec<f64>| {
            ts.sort_by(f64::total_cmp);
            let bytes = (words * 8) as f64 / 1e9;
            (bytes / ts[0], bytes / ts[ts.len() / 2])
        };
        let ((kb, km), (sb, sm)) = (gbps(&mut kernel), gbps(&mut stream));
        println!(
            "{name:>9}: {count} matrices, {:.0} MB; kernel {kb:.1} / {km:.1} GB/s (best / median), \
             read {sb:.1} / {sm:.1}; stream× {:.2} [{:.2}..{:.2}]",
            (words * 8) as f64 / 1e6,
            ratio[REPS / 2],
            ratio[0],
            ratio[REPS - 1]
        );
    }
}

/// Say what was wrong with the arguments and what is expected, and exit with status 2.
fn usage(why: &str) -> ! {
    eprintln!("{why}; usage: stream [FORMATS (comma list, e.g. bf16,mxfp4)] [COUNT]");
    std::process::exit(2)
}
