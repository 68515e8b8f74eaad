//! The GEMM driver: a task's tokens × rows through BLIS's microkernel, in BLIS's own loop
//! order: tokens MC at a time (their A micropanels packed once over the whole K), rows a panel
//! of NR at a time, K a KC-deep slice at a time (the panel's slice dequantized once into a B
//! micropanel, then run against every token run). Every output element is summed KC columns
//! at a time in column order (the first slice overwriting, the next adding): the same sums
//! whatever the task's tokens, rows or thread.

use core::ops::Range;

use crate::act::Act;
use crate::few;
use crate::library::Library;
use crate::matrix::Matrix;

/// Tokens whose A micropanels are packed at once (and whose results a panel keeps).
fn mc(lib: &Library) -> usize {
    lib.mr * 96usize.div_ceil(lib.mr)
}

/// Floats of one token run's A micropanel, kept a multiple of 16 (64 bytes: the
/// microkernels' aligned loads).
fn a_stride(lib: &Library, cols: usize) -> usize {
    (cols * lib.mr).next_multiple_of(16)
}

/// A task's room, for up to two matrices (gate and up, or down alone): their A micropanels,
/// one KC slice of a panel's B micropanel and the results of a panel for MC tokens.
pub struct Room<'a> {
    pub(crate) a: [&'a mut [f32]; 2],
    pub(crate) b: [&'a mut [f32]; 2],
    pub(crate) c: [&'a mut [f32]; 2],
}

/// The next 64-byte-aligned `n` floats of `bytes` and the bytes after them.
fn carve(bytes: &mut [u8], n: usize) -> (&mut [f32], &mut [u8]) {
    let skip = bytes.as_ptr().align_offset(64);
    let (head, rest) = bytes[skip..].split_at_mut((4 * n).next_multiple_of(64));
    (bytemuck::cast_slice_mut(&mut head[..4 * n]), rest)
}

/// Floats of each of a [`Room`]'s parts: (A, B, C).
fn parts(lib: &Library, cols: usize) -> (usize, usize, usize) {
    (mc(lib) / lib.mr * a_stride(lib, cols), lib.kc * lib.nr, mc(lib) * lib.nr)
}

/// Bytes of a [`Room`] for K = `cols`.
pub fn room_bytes(lib: &Library, cols: usize) -> usize {
    let (a, b, c) = parts(lib, cols);
    4 * 2 * (a + b + c) + 7 * 64
}

impl<'a> Room<'a> {
    /// The room in `scratch` (at least [`room_bytes`]).
    pub fn new(lib: &Library, cols: usize, scratch: &'a mut [u8]) -> Room<'a> {
        let (na, nb, nc) = parts(lib, cols);
        let (a0, rest) = carve(scratch, na);
        let (a1, rest) = carve(rest, na);
        let (b0, rest) = carve(rest, nb);
        let (b1, rest) = carve(rest, nb);
        let (c0, rest) = carve(rest, nc);
        let (c1, _) = carve(rest, nc);
        Room { a: [a0, a1], b: [b0, b1], c: [c0, c1] }
    }
}

/// Every (run of at most MR tokens, panel of at most NR rows) of `rows` of the matrices `ms`,
/// each against its activations `acts` of `n` tokens, handed to `emit(t0, m, r0, nr, tiles)`:
/// `tiles[i]` holds matrix `i`'s results, `m` rows of NR floats (the first `nr` of each row
/// are rows `r0..r0 + nr`). `rows.start` is a multiple of NR. A few tokens take our own loop
/// ([`few`]), which gives the same bits.
pub fn for_tiles<const N: usize>(
    lib: &Library,
    ms: [&Matrix; N],
    acts: [&Act<'_>; N],
    n: usize,
    rows: Range<usize>,
    room: &mut Room<'_>,
    mut emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N]),
) {
    if n <= few::tokens(lib) {
        return few::for_rows(lib, ms, acts, n, rows, room, emit);
    }
    let (mr, nr, kc) = (lib.mr, lib.nr, lib.kc);
    let cols = ms[0].cols();
    let stride = a_stride(lib, cols);
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
                    fill(lib, m, r0 / nr, (k0, k), b);
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

/// [`Matrix::micropanel`] with NR fixed at compile time where it is one of BLIS's usual ones,
/// compiled for AVX2 and FMA where the CPU has them (found once: [`Library`]).
fn fill(lib: &Library, m: &Matrix, p: usize, ks: (usize, usize), b: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if lib.avx2_fma {
        // SAFETY: the CPU has AVX2 and FMA (Library::avx2_fma).
        return unsafe { fill_avx2(lib.nr, m, p, ks, b) };
    }
    fill_nr(lib.nr, m, p, ks, b)
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fill_avx2(nr: usize, m: &Matrix, p: usize, ks: (usize, usize), b: &mut [f32]) {
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
