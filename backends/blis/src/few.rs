//! Few tokens (decode). BLIS's microkernel multiplies MR tokens whatever a call holds, so a
//! token alone pays for MR; here a loop of ours takes the tokens one by one over the same B
//! micropanel values and activations, summing in the microkernel's order (KC slices in column
//! order, each a chain from zero, fused or not as [`Sums`] found), so a token's results have
//! the same bits alone or in a batch. [`P`] panels at a time, a sub-slice of each dequantized
//! into L1: their chains hide the multiply-add's latency. Where the CPU and BLIS's configuration
//! have it, [`direct`]'s loop takes these tasks instead.

use crate::direct;
#[cfg(target_arch = "x86_64")]
use crate::library::Simd;
use crate::library::{Library, Sums};
use crate::task::Task;

/// Panels at a time.
const P: usize = 4;

/// Tokens up to which a task runs here rather than on the microkernel: where the
/// microkernel's B micropanel, dequantized once per panel slice, is shared by more tokens,
/// the microkernel's rate wins (docs/tuning.md). At most 12: a task's sums and results share
/// a [`crate::task::Room`]'s C part (`2·P·NR` floats a token of its `MC·NR`, MC ≥ 96).
const FEW_TOKENS: usize = 4;

/// Tokens up to which `lib` runs a task here: none where its microkernel's sums are unknown,
/// its NR is not one this loop is built for or its KC holds no two columns a panel.
pub fn tokens(lib: &Library) -> usize {
    match (lib.sums, lib.nr) {
        (Some(_), 4 | 8 | 12 | 16) if lib.kc >= 2 * P => FEW_TOKENS,
        _ => 0,
    }
}

/// [`crate::kernels::for_tiles`] for a task of `n ≤ tokens(lib)` tokens: every panel of its
/// rows handed to `emit(0, n, r0, nr, tiles)` (`tiles[i]`: matrix `i`'s results, `n` rows of
/// NR floats).
pub fn for_rows<const N: usize>(task: Task<'_, '_, '_, N>, emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N])) {
    let lib = task.lib;
    debug_assert!(task.n <= tokens(lib));
    if let Some(panels) = direct::panels(lib).filter(|_| task.n <= direct::MAX_TOKENS) {
        return direct::for_rows(task, panels, emit);
    }
    macro_rules! nr {
        ($($nr:literal)*) => {
            match (lib.nr, lib.sums == Some(Sums::Fused)) {
                $(
                    ($nr, true) => dispatch::<$nr, true, N>(task, emit),
                    ($nr, false) => dispatch::<$nr, false, N>(task, emit),
                )*
                _ => unreachable!("tokens() is 0 for NR {}", lib.nr),
            }
        };
    }
    nr!(4 8 12 16)
}

/// [`run`] compiled for AVX2 and FMA where the CPU has them (found once: [`Library`]).
#[inline(always)]
fn dispatch<const NR: usize, const FUSED: bool, const N: usize>(
    task: Task<'_, '_, '_, N>,
    emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N]),
) {
    #[cfg(target_arch = "x86_64")]
    if task.lib.simd >= Simd::Avx2 {
        // SAFETY: the CPU has AVX2 and FMA (Library::simd).
        return unsafe { run_avx2::<NR, FUSED, N>(task, emit) };
    }
    run::<NR, FUSED, N>(task, emit)
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<const NR: usize, const FUSED: bool, const N: usize>(
    task: Task<'_, '_, '_, N>,
    emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N]),
) {
    run::<NR, FUSED, N>(task, emit)
}

#[inline(always)]
fn run<const NR: usize, const FUSED: bool, const N: usize>(
    task: Task<'_, '_, '_, N>,
    mut emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N]),
) {
    let Task { lib, ms, acts, n, rows, room } = task;
    let cols = ms[0].cols();
    let (kc, stride) = (lib.kc, cols.next_multiple_of(16));
    for (act, a) in acts.iter().zip(room.a.iter_mut()) {
        act.each_token(cols, n, stride, a);
    }
    // Columns of a sub-slice: P panels' B values fill the room's B part (KC·NR floats); even,
    // for int4's two columns a byte.
    let sub = (kc / P) & !1;
    for g0 in (rows.start..rows.end).step_by(P * NR) {
        let panels = (rows.end - g0).div_ceil(NR).min(P);
        for (((m, a), b), c) in ms.iter().zip(room.a.iter()).zip(room.b.iter_mut()).zip(room.c.iter_mut()) {
            // Results `[panel][token][row]`, then each token's slice sums `[token][panel][row]`.
            let (out, acc) = c.split_at_mut(n * P * NR);
            for k0 in (0..cols).step_by(kc) {
                let k = kc.min(cols - k0);
                acc[..n * P * NR].fill(0.0);
                for s0 in (k0..k0 + k).step_by(sub) {
                    let len = sub.min(k0 + k - s0);
                    for p in 0..panels {
                        m.prefetch(g0 / NR + p, (s0 + sub, sub));
                        m.micropanel::<NR>(g0 / NR + p, (s0, len), &mut b[p * sub * NR..]);
                    }
                    for t in 0..n {
                        let a = &a[t * stride + s0..t * stride + s0 + len];
                        chains::<NR, FUSED>(a, b, sub, &mut acc[t * P * NR..(t + 1) * P * NR]);
                    }
                }
                for t in 0..n {
                    for p in 0..P {
                        let (o, s) = (&mut out[(p * n + t) * NR..][..NR], &acc[(t * P + p) * NR..][..NR]);
                        for (o, &s) in o.iter_mut().zip(s) {
                            *o = if k0 == 0 { s } else { *o + s };
                        }
                    }
                }
            }
        }
        for p in 0..panels {
            let r0 = g0 + p * NR;
            let tiles: [&[f32]; N] = core::array::from_fn(|i| &room.c[i][p * n * NR..(p + 1) * n * NR]);
            emit(0, n, r0, NR.min(rows.end - r0), tiles);
        }
    }
}

/// One token's chains over a sub-slice: `acc[p·NR + j]` steps through `a[l]·b[p][l][j]` for
/// every `l` in order, `b[p]` starting at `p·sub·NR`. Kept in registers: P·NR accumulators.
#[inline(always)]
fn chains<const NR: usize, const FUSED: bool>(a: &[f32], b: &[f32], sub: usize, acc: &mut [f32]) {
    let mut r: [[f32; NR]; P] = core::array::from_fn(|p| core::array::from_fn(|j| acc[p * NR + j]));
    for (l, &x) in a.iter().enumerate() {
        for (p, r) in r.iter_mut().enumerate() {
            let w: &[f32; NR] = b[p * sub * NR + l * NR..][..NR].try_into().expect("NR floats");
            for (r, &w) in r.iter_mut().zip(w) {
                *r = Sums::step::<FUSED>(*r, x, w);
            }
        }
    }
    for (p, r) in r.iter().enumerate() {
        acc[p * NR..(p + 1) * NR].copy_from_slice(r);
    }
}
