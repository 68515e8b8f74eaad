//! Up to four tokens (decode), summed straight from the decoded weights: each panel's compact
//! bytes decoded a column at a time into vector registers and multiplied into every token's
//! chains, which stay in registers too ([`Lane`]s), without a B micropanel in between; four
//! panels at a time. The sums are the microkernel's (KC slices in column order, each a chain
//! of fused multiply-adds from zero, then `c + chain`), so a token has the same bits here as
//! in a batch. Built where the lanes pay: fused sums, NR of 8, 12 or 16, AVX2 or AVX-512 (x86)
//! or NEON (aarch64); elsewhere such tasks take the few-token loop ([`crate::few`]).

use crate::lanes::Lane;
use crate::library::{Library, Sums};
use crate::matrix::{prefetch_line, Format, Matrix, Reader};
use crate::task::Task;

/// Panels at a time: their chains hide the multiply-add's latency.
const P: usize = 4;

/// Bytes of a panel prefetched ahead of the column being summed.
const AHEAD: usize = 1024;

/// Lanes a panel's chains may take: NR ≤ 16 floats in lanes of four or more.
const LANES: usize = 4;

/// A panel group's chains for one matrix, compiled for the lanes it runs on: one loop for each
/// token count (fixed at compile time: the chains' registers), a function each (so each is
/// optimized apart).
type Panels = [unsafe fn(&Matrix, Call<'_>); MAX_TOKENS];

/// [`Panels`] of the loop `$f` for `NR` = `$nr` in lanes `$l`.
macro_rules! counts {
    ($f:ident, $nr:literal, $l:ty) => {
        [$f::<$nr, $l, 1>, $f::<$nr, $l, 2>, $f::<$nr, $l, 3>, $f::<$nr, $l, 4>]
    };
}

/// The loop for `lib`'s configuration, where one is built for it (chosen once a task).
pub fn panels(lib: &Library) -> Option<Panels> {
    if lib.sums != Some(Sums::Fused) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::library::Simd;
        use core::arch::x86_64::{__m128, __m256};
        match (lib.simd, lib.nr) {
            #[cfg(avx512_intrinsics)]
            (Simd::Avx512, 16) => Some(counts!(avx512, 16, core::arch::x86_64::__m512)),
            (Simd::Baseline, _) => None,
            (_, 16) => Some(counts!(avx2, 16, __m256)),
            (_, 12) => Some(counts!(avx2, 12, __m128)),
            (_, 8) => Some(counts!(avx2, 8, __m256)),
            _ => None,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        match lib.nr {
            16 => Some(counts!(neon, 16, core::arch::aarch64::float32x4_t)),
            12 => Some(counts!(neon, 12, core::arch::aarch64::float32x4_t)),
            8 => Some(counts!(neon, 8, core::arch::aarch64::float32x4_t)),
            _ => None,
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    None
}

/// # Safety
/// The CPU has AVX-512 F, BW and VL, AVX2 and FMA.
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
#[allow(clippy::incompatible_msrv)]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl")]
unsafe fn avx512<const NR: usize, L: Lane, const T: usize>(m: &Matrix, call: Call<'_>) {
    m.read(Chains::<NR, L, T>(call, core::marker::PhantomData))
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const NR: usize, L: Lane, const T: usize>(m: &Matrix, call: Call<'_>) {
    m.read(Chains::<NR, L, T>(call, core::marker::PhantomData))
}

/// # Safety
/// None: NEON is in aarch64's baseline (the signature is the x86 loops').
#[cfg(target_arch = "aarch64")]
unsafe fn neon<const NR: usize, L: Lane, const T: usize>(m: &Matrix, call: Call<'_>) {
    m.read(Chains::<NR, L, T>(call, core::marker::PhantomData))
}

/// [`crate::kernels::for_tiles`] for a task of up to [`MAX_TOKENS`] tokens on `panels` (from
/// [`panels`]).
pub fn for_rows<const N: usize>(
    task: Task<'_, '_, '_, N>,
    panels: Panels,
    mut emit: impl FnMut(usize, usize, usize, usize, [&[f32]; N]),
) {
    let Task { lib, ms, acts, n, rows, room } = task;
    debug_assert!((1..=MAX_TOKENS).contains(&n));
    let (nr, cols) = (lib.nr, ms[0].cols());
    for (act, a) in acts.iter().zip(room.a.iter_mut()) {
        act.each_token(cols, n, cols, a);
    }
    let last = (rows.end - 1) / nr;
    for g0 in (rows.start..rows.end).step_by(P * nr) {
        for ((m, a), c) in ms.iter().zip(room.a.iter()).zip(room.c.iter_mut()) {
            let call = Call { p0: g0 / nr, last, kc: lib.kc, a: &a[..n * cols], out: &mut c[..P * n * nr] };
            // SAFETY: `panels` chose the loop for this CPU (Library::simd).
            unsafe { panels[n - 1](m, call) };
        }
        for (p, r0) in (g0..rows.end).step_by(nr).take(P).enumerate() {
            let at = p * n * nr;
            let tiles: [&[f32]; N] = core::array::from_fn(|i| &room.c[i][at..at + n * nr]);
            emit(0, n, r0, nr.min(rows.end - r0), tiles);
        }
    }
}

/// Tokens a task may have here: their chains and a column's weights fill the registers.
pub const MAX_TOKENS: usize = 4;

/// The results `out[(p·T + t)·NR + j]` of the loop's `T` tokens for panels `p0 + p` (those past
/// `last` repeat it, their results unused) against their activations `a` (`T` rows of K).
pub struct Call<'x> {
    p0: usize,
    last: usize,
    kc: usize,
    a: &'x [f32],
    out: &'x mut [f32],
}

/// [`Call`] of `T` tokens read with its matrix's format, NR rows a panel in lanes `L`.
struct Chains<'x, const NR: usize, L, const T: usize>(Call<'x>, core::marker::PhantomData<L>);

impl<const NR: usize, L: Lane, const T: usize> Reader for Chains<'_, NR, L, T> {
    type Out = ();

    #[inline(always)]
    fn read<const UB: usize, const PER: usize>(
        self,
        m: &Matrix,
        f: Format<impl Fn(&[u8], usize) -> f32, impl Fn(usize, usize) -> f32>,
    ) {
        let Call { p0, last, kc, a, out, .. } = self.0;
        let cols = m.cols();
        let ps: [usize; P] = core::array::from_fn(|p| (p0 + p).min(last));
        let panels: [&[u8]; P] = ps.map(|p| m.panel::<UB, PER>(p));
        let (mut sc, mut sums) = ([[0.0f32; NR]; P], [[[0.0f32; NR]; T]; P]);
        for k0 in (0..cols).step_by(kc) {
            let end = cols.min(k0 + kc);
            let mut acc = [[[L::zero(); LANES]; T]; P];
            // The column whose scales come next (a division a group, not a column).
            let mut next = k0;
            // The slice's units of each panel and its activations, a unit's columns at a time.
            let span = k0 / PER * NR * UB..end / PER * NR * UB;
            let [s0, s1, s2, s3] = panels.map(|panel| panel[span.clone()].chunks_exact(NR * UB));
            let units = s0.zip(s1).zip(s2).zip(s3);
            for (i, (((u0, u1), u2), u3)) in units.enumerate() {
                let u = k0 / PER + i;
                let at = u * NR * UB;
                // The first unit to start in a cache line asks for the line AHEAD bytes on.
                if at % 64 < NR * UB {
                    panels.iter().filter_map(|panel| panel.get(at + AHEAD)).for_each(prefetch_line);
                }
                // A unit's columns one by one, each with its element index known at compile
                // time (a 4-bit unit's two nibbles decode without a select).
                macro_rules! column_e {
                    ($e:literal) => {{
                        let k = u * PER + $e;
                        if k == next {
                            for (&p, sc) in ps.iter().zip(sc.iter_mut()) {
                                f.scales(m, p, k, sc);
                            }
                            next = (k / f.group + 1) * f.group;
                        }
                        let x: [L; T] = core::array::from_fn(|t| L::splat(a[t * cols + k]));
                        let decode = |b: &[u8]| (f.decode)(b, $e);
                        // Each panel's chains by name, not by a run-time index: kept in registers.
                        let [a0, a1, a2, a3] = &mut acc;
                        let sc = sc.each_ref().map(|sc| f.scaled().then_some(sc));
                        column::<NR, UB, L, T>(a0, sc[0], u0, &x, decode);
                        column::<NR, UB, L, T>(a1, sc[1], u1, &x, decode);
                        column::<NR, UB, L, T>(a2, sc[2], u2, &x, decode);
                        column::<NR, UB, L, T>(a3, sc[3], u3, &x, decode);
                    }};
                }
                column_e!(0);
                if PER == 2 {
                    column_e!(1);
                }
            }
            for (s, acc) in sums.iter_mut().flatten().zip(acc.iter().flatten()) {
                let mut chains = [0.0f32; NR];
                for (c, lane) in acc.iter().take(NR / L::W).enumerate() {
                    lane.store(&mut chains[c * L::W..]);
                }
                for (s, c) in s.iter_mut().zip(chains) {
                    *s = if k0 == 0 { c } else { *s + c };
                }
            }
        }
        out.iter_mut().zip(sums.iter().flatten().flatten()).for_each(|(o, s)| *o = *s);
    }
}

/// Call column of a panel into the chains of `T` tokens (`NR / L::W` lanes of `acc[t]`): token
/// `t`'s row `j` steps through `x[t] · decode(unit j) · sc[j]` (without `sc`: an unscaled
/// format's `x[t] · decode(unit j)`). Decoded and scaled into an
/// array first, once for every token: the compiler vectorizes that loop, and the lanes load it.
#[inline(always)]
fn column<const NR: usize, const UB: usize, L: Lane, const T: usize>(
    acc: &mut [[L; LANES]; T],
    sc: Option<&[f32; NR]>,
    units: &[u8],
    x: &[L; T],
    decode: impl Fn(&[u8]) -> f32,
) {
    let mut w = [0.0f32; NR];
    for j in 0..NR {
        let e = decode(&units[j * UB..(j + 1) * UB]);
        w[j] = sc.map_or(e, |sc| e * sc[j]);
    }
    for c in 0..NR / L::W {
        let w = L::load(&w[c * L::W..]);
        for (acc, &x) in acc.iter_mut().zip(x) {
            acc[c] = L::fma(acc[c], x, w);
        }
    }
}
