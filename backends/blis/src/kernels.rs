//! The GEMM driver: a task's tokens × rows through BLIS's microkernel, in BLIS's own loop
//! order: tokens MC at a time (their A micropanels packed once over the whole K), rows a panel
//! of NR at a time, K a KC-deep slice at a time (the panel's slice dequantized once into a B
//! micropanel, then run against every token run). Every output element is summed KC columns
//! at a time in column order (the first slice overwriting, the next adding): the same sums
//! whatever the task's tokens, rows or thread.

use kt_core::WeightFormat;

use crate::few;
use crate::library::{Library, Simd};
use crate::matrix::Matrix;
use crate::task::{a_stride, mc, Task};

/// Every (run of at most MR tokens, panel of at most NR rows) of `rows` of the matrices `ms`,
/// each against its activations `acts` of `n` tokens, handed to `emit(t0, m, r0, nr, tiles)`:
/// `tiles[i]` holds matrix `i`'s results, `m` rows of NR floats (the first `nr` of each row
/// are rows `r0..r0 + nr`). `rows.start` is a multiple of NR. A few tokens take our own loop
/// ([`few`]), which gives the same bits.
pub fn for_tiles<const N: usize>(
    task: Task<'_, '_, '_, N>,
    mut emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N]),
) {
    if task.n <= few::tokens(task.lib) {
        return few::for_rows(task, emit);
    }
    let Task { lib, ms, acts, n, rows, room } = task;
    let (mr, nr, kc) = (lib.mr, lib.nr, lib.kc);
    let cols = ms[0].cols();
    let stride = a_stride(lib, cols);
    let simd = fill_simd(lib, ms[0]);
    for mc0 in (0..n).step_by(mc(lib)) {
        let tokens = mc(lib).min(n - mc0);
        let runs = tokens.div_ceil(mr);
        let run = |g: usize| mr.min(tokens - g * mr);
        for (act, a) in acts.iter().zip(room.a.iter_mut()) {
            for g in 0..runs {
                act.micropanel(cols, (mc0 + g * mr, run(g)), mr, &mut a[g * stride..]);
            }
        }
        for r0 in (rows.start..rows.end).step_by(nr) {
            let nrl = nr.min(rows.end - r0);
            for k0 in (0..cols).step_by(kc) {
                let k = kc.min(cols - k0);
                let beta = if k0 == 0 { 0.0 } else { 1.0 };
                for (((m, a), b), c) in ms.iter().zip(room.a.iter()).zip(room.b.iter_mut()).zip(room.c.iter_mut()) {
                    fill(simd, nr, m, r0 / nr, (k0, k), b);
                    for g in 0..runs {
                        let (a, next_a) =
                            (&a[g * stride + k0 * mr..], a[((g + 1) % runs) * stride + k0 * mr..].as_ptr());
                        let (next, c) = ((next_a, b.as_ptr()), &mut c[g * mr * nr..]);
                        // SAFETY: run(g) ≤ MR and nrl ≤ NR; A's run and slice start 64-byte
                        // aligned (carve, a_stride, KC·MR a multiple of 16: Library) and hold
                        // k·MR floats, B holds k·NR from an aligned start; C holds MR rows of NR.
                        unsafe { lib.sgemm((run(g), nrl, k), a, &b[..], beta, c, nr, next) };
                    }
                }
            }
            for g in 0..runs {
                let tiles: [&[f32]; N] = core::array::from_fn(|i| &room.c[i][g * mr * nr..(g * mr + run(g)) * nr]);
                emit(mc0 + g * mr, run(g), r0, nrl, tiles);
            }
        }
    }
}

/// The vectors a task's fills run on: AVX-512 for the e4m3 formats, whose decode is
/// arithmetic (twice the weights an instruction), AVX2 and FMA for the others (where AVX-512
/// made the prefill slower: docs/tuning.md); found once a task.
fn fill_simd(lib: &Library, m: &Matrix) -> Simd {
    match (lib.simd, m.format()) {
        (Simd::Avx512, WeightFormat::Fp8Channel | WeightFormat::Fp8Block | WeightFormat::Mxfp8) => Simd::Avx512,
        (simd, _) => simd.min(Simd::Avx2),
    }
}

/// [`Matrix::micropanel`] with NR fixed at compile time where it is one of BLIS's usual ones,
/// compiled for `simd` ([`fill_simd`]).
fn fill(simd: Simd, nr: usize, m: &Matrix, p: usize, ks: (usize, usize), b: &mut [f32]) {
    match simd {
        #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
        // SAFETY: the CPU has AVX-512 F, BW and VL, AVX2 and FMA (Library::simd).
        Simd::Avx512 => unsafe { fill_avx512(nr, m, p, ks, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (Library::simd).
        Simd::Avx2 => unsafe { fill_avx2(nr, m, p, ks, b) },
        _ => fill_nr(nr, m, p, ks, b),
    }
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fill_avx2(nr: usize, m: &Matrix, p: usize, ks: (usize, usize), b: &mut [f32]) {
    fill_nr(nr, m, p, ks, b)
}

/// # Safety
/// The CPU has AVX-512 F, BW and VL, AVX2 and FMA.
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl")]
unsafe fn fill_avx512(nr: usize, m: &Matrix, p: usize, ks: (usize, usize), b: &mut [f32]) {
    fill_nr(nr, m, p, ks, b)
}

#[inline(always)]
fn fill_nr(nr: usize, m: &Matrix, p: usize, ks: (usize, usize), b: &mut [f32]) {
    match nr {
        16 => m.micropanel::<16>(p, ks, b),
        12 => m.micropanel::<12>(p, ks, b),
        8 => m.micropanel::<8>(p, ks, b),
        4 => m.micropanel::<4>(p, ks, b),
        _ => m.micropanel::<0>(p, ks, b),
    }
}
