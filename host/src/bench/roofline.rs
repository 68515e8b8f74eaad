//! The machine's roofline, measured in the same run as the kernels it judges: DRAM read
//! bandwidth, FP32 FMA peak and int8-dot peak, each with the pool's threads on the pool's CPUs,
//! best of a few tries. `kt bench` probes before and after each method and keeps the best
//! reading of each limit ([`Roofline::max`]): on a shared machine one probe can read half the
//! bandwidth, and a kernel's best over thousands of reps set against a low reading gave ratios
//! above 1.
//!
//! The compute loops are `kt_peak`'s, inline asm the compiler cannot hoist work out of.
//! The int8 peak is the AVX2 loop the kernels' instructions come from; where the CPU has VNNI,
//! its `vpdpbusd` peak is read as well, in the widest registers it runs (512-bit with
//! AVX512-VNNI: nearly twice the 256-bit form with two 512-bit units; a CPU that splits them
//! gains less):
//! kernels that run on VNNI (`Instructions::Int8Vnni`) are set against that one, whatever
//! width they use, so the ratio is to what the CPU can do ([`Roofline::peak`]). Where the CPU
//! has AVX-512, the 512-bit FMA and `vpmaddubsw` peaks are read too (the AVX-512 kernels are
//! judged by them), and with AVX512-BF16 the `vdpbf16ps` peak.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

/// The three limits, for `threads` threads.
#[derive(Clone, Copy, Debug)]
pub struct Roofline {
    /// DRAM read bandwidth, GB/s (1e9 bytes/s).
    pub dram_gbps: f64,
    /// FP32 FMA peak, GFLOP/s (an FMA counts 2).
    pub fma_gflops: f64,
    /// int8 dot peak, GOP/s (`vpmaddubsw` multiply-adds, 2 ops each).
    pub int8_gops: f64,
    /// VNNI int8 dot peak, GOP/s (`vpdpbusd`: zmm with AVX512-VNNI, else ymm), where the CPU
    /// has AVX-VNNI or AVX512-VNNI.
    pub vnni_gops: Option<f64>,
    /// The 512-bit peaks, where the CPU has AVX-512F/BW (and BF16 for `vdpbf16ps`).
    pub zmm: Zmm,
    /// The AMX tile peaks, where the CPU has AMX and Linux grants it.
    pub tiles: Tiles,
}

/// The AMX tile peaks (a 2×2 block of tiles loaded from L1, `kt_backend_amx::probe`): int8
/// (`tdpbusd`, GOP/s) and bf16 (`tdpbf16ps`, GFLOP/s).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tiles {
    /// `tdpbusd`.
    pub int8_gops: Option<f64>,
    /// `tdpbf16ps`.
    pub bf16_gflops: Option<f64>,
}

impl Tiles {
    fn combine(self, o: Tiles, f: fn(f64, f64) -> f64) -> Tiles {
        Tiles {
            int8_gops: either(self.int8_gops, o.int8_gops, f),
            bf16_gflops: either(self.bf16_gflops, o.bf16_gflops, f),
        }
    }
}

/// The 512-bit peaks: FMA (GFLOP/s), `vpmaddubsw` chains (GOP/s) and `vdpbf16ps` (GFLOP/s, a
/// bf16 pair's two products and two adds count 4).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Zmm {
    /// `vfmadd231ps zmm`.
    pub fma_gflops: Option<f64>,
    /// `vpmaddubsw → vpmaddwd → vpaddd` on zmm.
    pub int8_gops: Option<f64>,
    /// `vdpbf16ps zmm`.
    pub bf16_gflops: Option<f64>,
}

impl Zmm {
    fn combine(self, o: Zmm, f: fn(f64, f64) -> f64) -> Zmm {
        Zmm {
            fma_gflops: either(self.fma_gflops, o.fma_gflops, f),
            int8_gops: either(self.int8_gops, o.int8_gops, f),
            bf16_gflops: either(self.bf16_gflops, o.bf16_gflops, f),
        }
    }
}

impl Roofline {
    /// The compute peak a kernel on `ins` is judged against, and its name: GOP/s for the int8
    /// families, GFLOP/s (FMA) otherwise, in the register width the kernels use.
    pub fn peak(&self, ins: kt_core::backend::Instructions) -> (f64, &'static str) {
        use kt_core::backend::Instructions;
        let or =
            |zmm: Option<f64>, name: &'static str, fallback: (f64, &'static str)| zmm.map_or(fallback, |v| (v, name));
        match ins {
            Instructions::Int8Vnni => or(self.vnni_gops, "vnni", (self.int8_gops, "int8")),
            Instructions::Int8Pairs => (self.int8_gops, "int8"),
            Instructions::Int8PairsZmm => or(self.zmm.int8_gops, "int8-512", (self.int8_gops, "int8")),
            Instructions::FmaF32Zmm => or(self.zmm.fma_gflops, "fma-512", (self.fma_gflops, "fma")),
            Instructions::Bf16DotZmm => or(self.zmm.bf16_gflops, "bf16dot", (self.fma_gflops, "fma")),
            Instructions::AmxInt8 => or(self.tiles.int8_gops, "amx-int8", self.peak(Instructions::Int8Vnni)),
            Instructions::AmxBf16 => or(self.tiles.bf16_gflops, "amx-bf16", self.peak(Instructions::Bf16DotZmm)),
            _ => (self.fma_gflops, "fma"),
        }
    }

    /// The higher reading of each limit.
    pub fn max(self, o: Roofline) -> Roofline {
        Roofline {
            dram_gbps: self.dram_gbps.max(o.dram_gbps),
            fma_gflops: self.fma_gflops.max(o.fma_gflops),
            int8_gops: self.int8_gops.max(o.int8_gops),
            vnni_gops: either(self.vnni_gops, o.vnni_gops, f64::max),
            zmm: self.zmm.combine(o.zmm, f64::max),
            tiles: self.tiles.combine(o.tiles, f64::max),
        }
    }

    /// The lower reading of each limit (the spread of a run's probes, for the report).
    pub fn min(self, o: Roofline) -> Roofline {
        Roofline {
            dram_gbps: self.dram_gbps.min(o.dram_gbps),
            fma_gflops: self.fma_gflops.min(o.fma_gflops),
            int8_gops: self.int8_gops.min(o.int8_gops),
            vnni_gops: either(self.vnni_gops, o.vnni_gops, f64::min),
            zmm: self.zmm.combine(o.zmm, f64::min),
            tiles: self.tiles.combine(o.tiles, f64::min),
        }
    }
}

/// `f` of both readings, or the one there is.
fn either(a: Option<f64>, b: Option<f64>, f: fn(f64, f64) -> f64) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(f(x, y)),
        (x, y) => x.or(y),
    }
}

/// The probe's threads: `n` of them, thread `t` pinned to `cpus[t]` where listed (the pool's
/// CPUs). Pinned explicitly, they do not inherit the pinning of a caller that is itself a pool
/// worker, which would stack them all on its one CPU.
#[derive(Clone, Copy, Debug)]
pub struct Threads<'a> {
    /// How many.
    pub n: usize,
    /// OS CPU of each; shorter (or empty) leaves the rest where the OS puts them.
    pub cpus: &'a [usize],
}

impl Threads<'_> {
    /// `n` threads wherever the OS puts them.
    pub fn unpinned(n: usize) -> Threads<'static> {
        Threads { n, cpus: &[] }
    }

    fn pin(&self, t: usize) {
        if let Some(&cpu) = self.cpus.get(t) {
            // Best effort: an unpinned probe still measures, only less like the pool.
            crate::pool::pin_current_thread(cpu);
        }
    }
}

/// Run `f(thread)` on `th`'s threads started together; seconds until the last finishes.
fn timed_threads(th: Threads<'_>, f: impl Fn(usize) + Sync) -> f64 {
    let start = Barrier::new(th.n + 1);
    let end = Barrier::new(th.n + 1);
    std::thread::scope(|s| {
        for t in 0..th.n {
            let (start, end, f) = (&start, &end, &f);
            s.spawn(move || {
                th.pin(t);
                start.wait();
                f(t);
                end.wait();
            });
        }
        start.wait();
        let t0 = Instant::now();
        end.wait();
        t0.elapsed().as_secs_f64()
    })
}

/// Fastest of `tries` runs of [`timed_threads`], seconds.
fn best_seconds(tries: usize, th: Threads<'_>, f: impl Fn(usize) + Sync) -> f64 {
    (0..tries).map(|_| timed_threads(th, &f)).fold(f64::INFINITY, f64::min)
}

/// Read bandwidth over a `bytes`-long array split among `th`'s threads, best of 5 passes.
pub fn dram_gbps(th: Threads<'_>, bytes: usize) -> f64 {
    let words = (bytes / 8).next_multiple_of(32 * th.n);
    let mut buf = vec![0u64; words];
    // Fault the pages in from the threads that will read them (first touch, on their nodes).
    let chunk = words / th.n;
    std::thread::scope(|s| {
        for (t, part) in buf.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                th.pin(t);
                part.iter_mut().enumerate().for_each(|(i, w)| *w = i as u64);
            });
        }
    });
    let parts: Vec<&[u64]> = buf.chunks(chunk).collect();
    let best = best_seconds(5, th, |t| {
        black_box(read_sum(parts[t]));
    });
    (words * 8) as f64 / best / 1e9
}

/// The sum of `xs` (a read of every byte that the compiler cannot drop).
pub(super) fn read_sum(xs: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked).
        return unsafe { read_sum_avx2(xs) };
    }
    xs.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_sum_avx2(xs: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: c has 16 u64 = 4 × 32 bytes; unaligned loads are allowed.
            let v = unsafe { _mm256_loadu_si256(c.as_ptr().add(4 * i).cast()) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let s = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    let mut lanes = [0u64; 4];
    // SAFETY: lanes is 32 bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
    lanes.iter().chain(tail).fold(0u64, |a, &x| a.wrapping_add(x))
}

/// Iterations of the compute loops per try (about 0.1 s at this machine's clock).
const ITERS: u64 = 20_000_000;

/// FP32 FMA peak: 12 independent `vfmadd231ps ymm` chains per thread, best of 3.
pub fn fma_gflops(th: Threads<'_>) -> f64 {
    let best = best_seconds(3, th, |_| fma_loop(ITERS));
    // 12 FMAs × 8 lanes × 2 flops per iteration.
    (th.n as u64 * ITERS * 12 * 8 * 2) as f64 / best / 1e9
}

/// int8 dot peak: 8 independent `vpmaddubsw → vpmaddwd → vpaddd` chains per thread, best of 3.
pub fn int8_gops(th: Threads<'_>) -> f64 {
    let best = best_seconds(3, th, |_| int8_loop(ITERS));
    // 8 × vpmaddubsw of 32 byte pairs, 2 ops per multiply-add.
    (th.n as u64 * ITERS * 8 * 32 * 2) as f64 / best / 1e9
}

/// The rate of `l` ([`kt_peak::Loop`]) on `th`'s threads, best of 3; `None` where the CPU
/// lacks its instructions.
#[cfg(target_arch = "x86_64")]
fn loop_rate(th: Threads<'_>, l: kt_peak::Loop) -> Option<f64> {
    let ops = l.ops()?;
    let best = best_seconds(3, th, |_| {
        l.run(ITERS);
    });
    Some((th.n as u64 * ITERS * ops) as f64 / best / 1e9)
}

/// VNNI int8 dot peak: 14 independent `vpdpbusd` chains per thread (its 5-cycle latency
/// needs 10 to fill two ports) in the widest registers the CPU runs it on, best of 3; `None`
/// without AVX-VNNI or AVX512-VNNI.
pub fn vnni_gops(th: Threads<'_>) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    return loop_rate(th, kt_peak::Loop::Vnni);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = th;
        None
    }
}

fn fma_loop(iters: u64) {
    #[cfg(target_arch = "x86_64")]
    if kt_peak::Loop::Fma.run(iters) {
        return;
    }
    let mut acc = [0.0f32; 12];
    for i in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(black_box(1.0), i as f32);
        }
    }
    black_box(acc);
}

fn int8_loop(iters: u64) {
    #[cfg(target_arch = "x86_64")]
    if kt_peak::Loop::Int8.run(iters) {
        return;
    }
    let mut acc = [0i32; 8];
    for i in 0..iters {
        for a in &mut acc {
            *a = a.wrapping_add(black_box(i as i32) * 3);
        }
    }
    black_box(acc);
}

/// The 512-bit peaks ([`Zmm`]), each best of 3; `None` for those the CPU lacks.
pub fn zmm_peaks(th: Threads<'_>) -> Zmm {
    #[cfg(target_arch = "x86_64")]
    {
        use kt_peak::Loop;
        Zmm {
            fma_gflops: loop_rate(th, Loop::Fma512),
            int8_gops: loop_rate(th, Loop::Int8Zmm),
            bf16_gflops: loop_rate(th, Loop::Bf16Zmm),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = th;
        Zmm::default()
    }
}

/// The AMX tile peaks ([`Tiles`]), each best of 3; `None` where the CPU lacks AMX (or Linux
/// refuses it) or the build lacks the `amx` backend.
pub fn tile_peaks(th: Threads<'_>) -> Tiles {
    #[cfg(all(feature = "amx", target_arch = "x86_64"))]
    {
        use kt_backend_amx::probe::{block_steps, ops_per_step};
        const STEPS: u64 = 2_000_000;
        if block_steps(false, 1).is_ok() {
            let rate = |bf16: bool| {
                let secs = best_seconds(3, th, |_| block_steps(bf16, STEPS).expect("granted above"));
                Some((th.n as u64 * STEPS * ops_per_step(bf16)) as f64 / secs / 1e9)
            };
            return Tiles { int8_gops: rate(false), bf16_gflops: rate(true) };
        }
    }
    let _ = th;
    Tiles::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loops_run_and_report_positive_rates() {
        // Correctness of the harness only (no timing assertion): finite, positive numbers.
        fma_loop(1000);
        int8_loop(1000);
        #[cfg(target_arch = "x86_64")]
        {
            use kt_peak::Loop;
            assert_eq!(vnni_gops(Threads::unpinned(1)).is_some(), Loop::Vnni.ops().is_some());
            assert!(vnni_gops(Threads::unpinned(1)).is_none_or(|g| g.is_finite() && g > 0.0));
            let z = zmm_peaks(Threads::unpinned(1));
            for (rate, l) in
                [(z.fma_gflops, Loop::Fma512), (z.int8_gops, Loop::Int8Zmm), (z.bf16_gflops, Loop::Bf16Zmm)]
            {
                assert_eq!(rate.is_some(), l.ops().is_some(), "{l:?}");
                assert!(rate.is_none_or(|g| g.is_finite() && g > 0.0), "{l:?}");
            }
        }
        assert_eq!(read_sum(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]), 153);
        let bw = dram_gbps(Threads::unpinned(1), 1 << 20);
        assert!(bw.is_finite() && bw > 0.0);
    }

    #[test]
    fn max_and_min_take_each_limit_on_its_own() {
        let z = |f: f64| Zmm { fma_gflops: Some(f), int8_gops: None, bf16_gflops: None };
        let t = Tiles { int8_gops: Some(9000.0), bf16_gflops: None };
        let a = Roofline {
            dram_gbps: 20.0,
            fma_gflops: 150.0,
            int8_gops: 310.0,
            vnni_gops: Some(700.0),
            zmm: z(300.0),
            tiles: Tiles::default(),
        };
        let b = Roofline {
            dram_gbps: 25.0,
            fma_gflops: 140.0,
            int8_gops: 300.0,
            vnni_gops: Some(650.0),
            zmm: z(290.0),
            tiles: t,
        };
        let (hi, lo) = (a.max(b), a.min(b));
        assert_eq!((hi.dram_gbps, hi.fma_gflops, hi.int8_gops, hi.vnni_gops), (25.0, 150.0, 310.0, Some(700.0)));
        assert_eq!((lo.dram_gbps, lo.fma_gflops, lo.int8_gops, lo.vnni_gops), (20.0, 140.0, 300.0, Some(650.0)));
        assert_eq!((hi.zmm.fma_gflops, lo.zmm.fma_gflops, hi.zmm.int8_gops), (Some(300.0), Some(290.0), None));
        use kt_core::backend::Instructions;
        assert_eq!(a.peak(Instructions::FmaF32Zmm), (300.0, "fma-512"));
        assert_eq!(a.peak(Instructions::Int8PairsZmm), (310.0, "int8"), "no 512-bit reading: the 256-bit one");
        assert_eq!(a.peak(Instructions::Int8Vnni), (700.0, "vnni"));
        assert_eq!(a.peak(Instructions::Bf16DotZmm), (150.0, "fma"), "no vdpbf16ps reading: the FMA one");
        assert_eq!(a.peak(Instructions::AmxInt8), (700.0, "vnni"), "no tile reading: the VNNI one");
        assert_eq!(a.max(b).peak(Instructions::AmxInt8), (9000.0, "amx-int8"));
        assert_eq!(a.max(b).peak(Instructions::AmxBf16), (150.0, "fma"), "no tile bf16: vdpbf16ps's, else FMA");
        let none = Roofline { vnni_gops: None, ..a };
        assert_eq!(none.max(b).vnni_gops, Some(650.0));
        assert_eq!(none.min(none).vnni_gops, None);
    }

    /// A probe started by a caller pinned to one CPU (as `kt bench`'s main thread is, once the
    /// pool runs) still runs its threads on the CPUs it is given.
    #[cfg(target_os = "linux")]
    #[test]
    fn probe_threads_run_on_their_cpus_not_the_callers() {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        if cpus < 2 {
            eprintln!("skipped: one CPU");
            return;
        }
        std::thread::spawn(move || {
            assert!(crate::pool::pin_current_thread(0), "pins the caller");
            let seen: Vec<std::sync::atomic::AtomicI32> = (0..2).map(|_| (-1).into()).collect();
            let want = [cpus - 1, cpus - 1];
            timed_threads(Threads { n: 2, cpus: &want }, |t| {
                // SAFETY: sched_getcpu takes no arguments and only reads the calling thread's state.
                seen[t].store(unsafe { libc::sched_getcpu() }, std::sync::atomic::Ordering::Relaxed);
            });
            let seen: Vec<i32> = seen.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect();
            assert_eq!(seen, [want[0] as i32, want[1] as i32]);
        })
        .join()
        .expect("the probe thread's assertions hold");
    }
}
