//! Dot kernels: a tile of [`R`] weight rows against every token, [`TC`] tokens at a time.
//! Each weight block is decoded once per tile ([`crate::decode`]; for one token straight into
//! registers, for more into [`DecK`] buffers) and dotted with the matching block of each
//! token: `maddubs` (u8 levels × i8 activations, pairs summed to i16), then to i32 by a
//! `madd` with the 16-column scales (K-quants, in the lane layout of [`crate::lanes`], several
//! registers summed in i16 first) or by gathering block sums (32-column types), then f32;
//! q8_0, the unsigned 32-column types, q4_K, q5_K and iq4_xs on VNNI by `vpdpbusd`
//! ([`on_vnni`]; with AVX512-VNNI in 512-bit registers, [`on_zmm`], where iq4_nl runs too,
//! and q2_K, q3_K, q6_K and the lattice types by `maddubs`; one token of the lattice types
//! by `vpdpbusd`, [`lattice1`]); every
//! quantized type on AMX int8 tiles for an expert with many tokens ([`on_amx`]). Every
//! output is computed in block order by one call, whatever the tile: results do not depend on
//! how rows are split over tasks.

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;
use core::marker::PhantomData;
use core::ops::Range;

use kt_core::ggml::{self, ActKind, GgmlType, QK};

use crate::act::{ActG8, ActK, ActW8};
use crate::decode::{reg_of, KBlock};
use crate::lanes::REGS;
use crate::legacy::{self, Offset, PairLevels};
pub use crate::pack::{Packed, R};

/// `[e(0), …, e(n - 1)]` (`init` fills first), built by a loop: `core::array::from_fn`'s and
/// `map`'s closures lack the caller's target features and were compiled out of line, a call per
/// element inside the kernels.
macro_rules! array {
    ($init:expr; $n:expr, |$i:ident| $e:expr) => {{
        let mut a = [$init; $n];
        for $i in 0..$n {
            a[$i] = $e;
        }
        a
    }};
}

/// `$f!(B)` with `B` the kernels' block type of 256-column type `$t` (the lane layout's:
/// [`crate::decode`]'s for the K-quants and iq4_xs, core's for q2_K and the lattice types), or
/// `$other` for a type of another kind.
macro_rules! by_kblock {
    ($t:expr, $f:ident, $other:expr) => {
        match $t {
            GgmlType::Q2_K => $f!(kt_core::ggml::BlockQ2K),
            GgmlType::Q3_K => $f!(crate::decode::Q3KU),
            GgmlType::Q4_K => $f!(crate::decode::Q4KU),
            GgmlType::Q5_K => $f!(crate::decode::Q5KU),
            GgmlType::Q6_K => $f!(crate::decode::Q6KP),
            GgmlType::IQ4_XS => $f!(crate::decode::Iq4XsU),
            GgmlType::IQ1_S => $f!(kt_core::ggml::BlockIq1S),
            GgmlType::IQ1_M => $f!(kt_core::ggml::BlockIq1M),
            GgmlType::IQ2_XXS => $f!(kt_core::ggml::BlockIq2Xxs),
            GgmlType::IQ2_XS => $f!(kt_core::ggml::BlockIq2Xs),
            GgmlType::IQ2_S => $f!(kt_core::ggml::BlockIq2S),
            GgmlType::IQ3_XXS => $f!(kt_core::ggml::BlockIq3Xxs),
            GgmlType::IQ3_S => $f!(kt_core::ggml::BlockIq3S),
            _ => $other,
        }
    };
}

/// Tokens per accumulator tile for up to `TC` tokens, `2·TC` above (fewer for small batches,
/// whose accumulators then stay in registers). Each tile decodes or widens every block once:
/// an expert's share of a 512-token prefill is often just above 32 tokens, and one tile of
/// 64 instead of two of 17 was 5-8% faster at 33 tokens; below, the smaller tile keeps the
/// K-quants' zeroing of their accumulators (a memset per call) at half.
const TC: usize = 32;

/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn ld<T>(p: &[T]) -> __m256i {
    debug_assert!(size_of_val(p) >= 32);
    // SAFETY: callers pass ≥ 32 bytes.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// A 256-column block decoded for several tokens.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct DecK {
    /// Unsigned levels (|w| for signed types), per register.
    v: [[u8; 32]; REGS],
    /// Signed levels (signed types only).
    w: [[u8; 32]; REGS],
    /// `128·Σ level·scale` of each i32 lane ([`KBlock::ACT_FOLD`] types only).
    corr: [i32; 8],
    /// Scales of each 16 columns.
    sc: [i16; 16],
    /// Mins of each 16 columns.
    mn: [i16; 16],
    /// [`KBlock::prep32`] for [`KBlock::PER32`] types.
    dsc: [f32; 8],
    dmn: [f32; 8],
    d: f32,
    dmin: f32,
}

/// One q8_0 group of one row widened to i16 ([`wide`]).
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct W16([[i16; 16]; QK / 2]);

/// Accumulators of one tile of up to `2·TC` tokens ([`wide`], [`legacy`](fn@legacy), [`kquant()`]), set by the tile's
/// first group rather than zeroed per call (a `memset` of up to 8 KiB a tile: q8_0's down
/// shape 3-7% slower in alternated `dots` runs). A matrix of no columns never sets them, so
/// [`dots`] answers zeros for it without a kernel.
type Acc = [[__m256; 2 * TC]; R];

/// Decoded blocks and accumulators of one tile, reused across calls; the accumulators first
/// and 64-byte aligned, for 512-bit loads ([`on_zmm`]).
#[repr(C, align(64))]
pub struct Scratch {
    acc: Acc,
    k: [DecK; R],
    w: [W16; R],
    #[cfg(vnni_intrinsics)]
    pairs: on_zmm::Pairs,
    /// Signed levels beside their magnitudes in `pairs` ([`on_zmm::kquant16`]).
    #[cfg(vnni_intrinsics)]
    signs: on_zmm::Pairs,
}

impl Scratch {
    /// A `Scratch` at the start of `bytes` (64-byte aligned, as a worker's scratch is), and the
    /// bytes after it. The fields are plain numbers, for which every bit pattern is a value, so
    /// whatever a previous task left there is a valid (if meaningless) `Scratch`: the kernels
    /// set what they read first.
    pub fn from_bytes(bytes: &mut [u8]) -> (&mut Scratch, &mut [u8]) {
        assert!(
            bytes.as_ptr().align_offset(align_of::<Scratch>()) == 0 && bytes.len() >= size_of::<Scratch>(),
            "scratch must be 64-byte aligned and hold a Scratch ({} bytes)",
            size_of::<Scratch>()
        );
        let (head, rest) = bytes.split_at_mut(size_of::<Scratch>());
        // SAFETY: aligned and long enough (checked), exclusively borrowed, and every bit pattern
        // is a valid Scratch (arrays of integers, floats and __m256).
        (unsafe { &mut *head.as_mut_ptr().cast::<Scratch>() }, rest)
    }
}

/// One call's operands: `R` rows (the last ones repeated when `nr < R`), `nb` blocks each,
/// against `n` tokens' activations (bytes, read as `A` by [`Tile::act`]), results into
/// `out[t][i]`.
/// Nothing is copied on its way to a kernel: the rows are one slice, and [`Tile::cast`]
/// reinterprets the reference. A copy loaded with 32-byte loads from fields stored 8 bytes at a
/// time cannot be forwarded from the store buffer and waits for it to drain; `perf` put a fifth
/// of a q4_K down projection's samples on such a copy, though the cost was the drain itself
/// (result stores thrashing one L1 set, see `y_stride` in core's forward pass): without the copy
/// the time stayed and the samples spread.
#[repr(C)]
struct Tile<'a, A> {
    /// The matrix's type.
    t: GgmlType,
    /// Rows `r0..r0 + nr`.
    data: &'a [u8],
    row_bytes: usize,
    nr: usize,
    nb: usize,
    act: &'a [u8],
    n: usize,
    /// Bytes of one slice of a row.
    slice_bytes: usize,
    /// Bytes of the next tile to prefetch per slice ([`prefetch_next`]).
    prefetch: usize,
    /// Whether a 32-column kernel also asks for the third tile ahead ([`prefetch_ahead`]).
    far: bool,
    layout: PhantomData<&'a [A]>,
}

impl<'a, A: bytemuck::Pod> Tile<'a, A> {
    /// Rows `r0..r0 + nr` of `w` (`nr ≤ R`).
    fn new(w: &'a Packed, r0: usize, nr: usize, act: &'a [u8], n: usize) -> Self {
        let (nb, slice_bytes, prefetch, row_bytes) = (w.slices, w.slice_bytes, w.prefetch, w.row_bytes);
        let data = &w.data[r0 * row_bytes..(r0 + nr) * row_bytes];
        let far = n <= FAR_TOKENS && kt_x86::prefetch::far_at_decode();
        Tile { t: w.t, data, row_bytes, nr, nb, act, n, slice_bytes, prefetch, far, layout: PhantomData }
    }

    /// The same tile with its activations read as `B` (the layout its type's kernel reads).
    fn cast<B: bytemuck::Pod>(&self) -> &Tile<'a, B> {
        // SAFETY: `repr(C)` and `A` only in a zero-sized field: both types have one layout.
        unsafe { &*(self as *const Self).cast() }
    }

    /// The activations, `[blocks][n]` (one token's: `[blocks]`).
    #[inline(always)]
    fn act(&self) -> &'a [A] {
        bytemuck::cast_slice(self.act)
    }
}

impl<'a, A> Tile<'a, A> {
    /// Row `i` of the tile (its last row for `i ≥ nr`).
    #[inline(always)]
    fn row(&self, i: usize) -> &'a [u8] {
        &self.data[i.min(self.nr - 1) * self.row_bytes..][..self.row_bytes]
    }

    /// Its `R` rows.
    #[inline(always)]
    fn rows(&self) -> [&'a [u8]; R] {
        array!(&[][..]; R, |i| self.row(i))
    }
}

/// `out[t][i] = row r0+i · token t` for `i < nr ≤ R`, `t < n`, `act` prepared for `w.t`;
/// for two tokens or more ([`gemv`] serves one).
///
/// # Safety
/// AVX2, FMA and F16C must be present, and the features of the VNNI encoding `w` was packed
/// for; `act` must hold `n` tokens prepared by [`crate::act`] (for VNNI as `w` was).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots<const ID: u32>(
    w: &Packed,
    r0: usize,
    nr: usize,
    act: &[u8],
    n: usize,
    out: &mut [[f32; R]],
    scratch: &mut Scratch,
) {
    debug_assert!((1..=R).contains(&nr) && r0 + nr <= w.rows && n != 1 && w.t as u32 == ID);
    let t = const { ty::<ID>() };
    if w.cols == 0 {
        out[..n].fill([0.0; R]);
        return;
    }
    // The activations as bytes; each kernel reads them in its type's layout (`cast`).
    let raw = Tile::<u8>::new(w, r0, nr, act, n);
    #[cfg(vnni_intrinsics)]
    if let Some(v) = w.vnni.filter(|_| const { crate::vnni::runs(ty::<ID>()) }) {
        // SAFETY: the caller's contract.
        return unsafe { on_vnni::dots::<ID>(v, &raw, out, scratch) };
    }
    #[cfg(vnni_intrinsics)]
    if w.zmm {
        use crate::decode::{Q3KU, Q6KP};
        use kt_core::ggml::*;
        let (tile, lv, signs, acc) = (raw.cast::<ActK>(), &mut scratch.pairs, &mut scratch.signs, &mut scratch.acc);
        macro_rules! z {
            ($b:ty) => {
                // SAFETY: the caller's contract (AVX512-VNNI, so AVX512F, BW and VL); act
                // holds [blocks][n] ActK.
                return unsafe { on_zmm::kquant16::<$b>(tile, out, lv, signs, acc) }
            };
        }
        match t {
            GgmlType::Q2_K => z!(BlockQ2K),
            GgmlType::Q3_K => z!(Q3KU),
            GgmlType::Q6_K => z!(Q6KP),
            GgmlType::IQ1_S => z!(BlockIq1S),
            GgmlType::IQ1_M => z!(BlockIq1M),
            GgmlType::IQ2_XXS => z!(BlockIq2Xxs),
            GgmlType::IQ2_XS => z!(BlockIq2Xs),
            GgmlType::IQ2_S => z!(BlockIq2S),
            GgmlType::IQ3_XXS => z!(BlockIq3Xxs),
            GgmlType::IQ3_S => z!(BlockIq3S),
            // Its levels + 128 through `vpdpbusd` ([`legacy::Iq4NlV`]), AVX2's sums.
            GgmlType::IQ4_NL => {
                // SAFETY: as above; act holds [groups][n] ActV8.
                return unsafe { on_zmm::legacy_dots::<ID>(raw.cast(), out, &mut scratch.pairs, &mut scratch.acc) };
            }
            _ => {}
        }
    }
    macro_rules! k {
        ($b:ty) => {{
            let tile = raw.cast::<ActK>();
            // SAFETY: the caller's contract; act holds [blocks][n] ActK.
            unsafe {
                match n {
                    2..=kquant::FEW_ROWS if <$b as KBlock>::ROWS_DOT => kquant_few::<$b>(&tile, out),
                    ..=TC => kquant::<TC, $b>(&tile, out, &mut scratch.k, &mut scratch.acc),
                    _ => kquant::<{ 2 * TC }, $b>(&tile, out, &mut scratch.k, &mut scratch.acc),
                }
            }
        }};
    }
    macro_rules! l {
        ($b:ty) => {{
            // SAFETY: the caller's contract; act holds [groups][n] ActG8, rows are repacked.
            unsafe { legacy_tiles::<$b, Maddubs>(&raw, out, scratch) }
        }};
    }
    by_kblock!(
        t,
        k,
        match t {
            GgmlType::Q4_0 => l!(legacy::Q40),
            GgmlType::Q4_1 => l!(legacy::Q41),
            GgmlType::Q5_0 => l!(legacy::Q50),
            GgmlType::Q5_1 => l!(legacy::Q51),
            GgmlType::Q8_0 => {
                let tile = raw.cast::<ActW8>();
                // SAFETY: the caller's contract; act holds [groups][n] ActW8, rows are repacked.
                unsafe {
                    match n {
                        ..=TC => wide::<TC, { 2 * TC }>(tile, out, &mut scratch.w, &mut scratch.acc),
                        _ => wide::<{ 2 * TC }, { 2 * TC }>(tile, out, &mut scratch.w, &mut scratch.acc),
                    }
                }
            }
            GgmlType::IQ4_NL => l!(legacy::Iq4Nl),
            GgmlType::MXFP4 => l!(legacy::Mxfp4),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                debug_assert_eq!(t.act(), ActKind::F32);
                // SAFETY: the caller's contract; act holds [n][cols] f32.
                let tile = raw.cast::<f32>();
                unsafe { float(t, tile.rows(), nr, w.cols, tile.act(), n, out) }
            }
            t => unreachable!("{t} is a 256-column type"),
        }
    )
}

/// The body of a one-token kernel over rows `$rows` of `$w`: each tile (activations `$A`) into
/// `$tile` and its results' slot `$res` for `$call`, whose row results go to `$out` (a whole
/// tile's as a fixed-size move: a slice of run-time length was a call to `memcpy` per 4 rows).
macro_rules! one_token_tiles {
    ($w:expr, $rows:expr, $act:expr, $out:expr, $A:ty, |$tile:ident, $res:ident| $call:expr) => {{
        let (w, rows, out) = ($w, $rows, $out);
        let mut $res = [[0.0f32; R]; 1];
        for r0 in rows.clone().step_by(R) {
            let (nr, at) = (R.min(rows.end - r0), r0 - rows.start);
            let $tile = Tile::<$A>::new(w, r0, nr, $act, 1);
            $call;
            if nr == R {
                out[at..at + R].copy_from_slice(&$res[0]);
            } else {
                out[at..at + nr].copy_from_slice(&$res[0][..nr]);
            }
        }
    }};
}

/// `$call` for the groups of `$tn` tokens, `$nt` at a time (a constant of at most 8), then the
/// rest in one group: `K` is a group's size, a constant, and `t` its first token. (Six tokens
/// and a tail of one at a time paid a pass over every weight register per token of the tail:
/// three of the 33 tokens.) For the VNNI kernels.
#[cfg_attr(not(vnni_intrinsics), allow(unused_macros))]
macro_rules! groups {
    ($nt:expr, $tn:expr, |$K:ident, $t:ident| $call:expr) => {{
        const { assert!($nt <= 8) };
        let mut $t = 0;
        while $t < $tn {
            let k = ($tn - $t).min($nt);
            groups!(@size k, $nt, $K, $call; 8, 7, 6, 5, 4, 3, 2);
            $t += k;
        }
    }};
    // `$call` with `$K` = `$k` if it is one of the sizes (those above `$nt` compiled out), else 1.
    (@size $k:ident, $nt:expr, $K:ident, $call:expr; $n:literal $(, $rest:literal)*) => {
        if $nt >= $n && $k == $n {
            const $K: usize = $n;
            $call
        } else {
            groups!(@size $k, $nt, $K, $call; $($rest),*)
        }
    };
    (@size $k:ident, $nt:expr, $K:ident, $call:expr;) => {{
        const $K: usize = 1;
        $call
    }};
}

/// `p`, through an `asm` statement that LLVM must assume has effects, so that what is read
/// through it is read where the caller reads it, not hoisted out of a loop.
#[cfg_attr(not(vnni_intrinsics), allow(dead_code))]
#[inline(always)]
fn fresh<T>(p: *const T) -> *const T {
    // The address as an integer (its provenance exposed, and taken back below).
    let mut a = p as usize;
    // SAFETY: an empty statement; it reads and writes only `a`'s register.
    unsafe { core::arch::asm!("/* {0} */", inout(reg) a, options(nomem, nostack, preserves_flags)) };
    a as *const T
}

/// The type whose ggml id is `ID`: a kernel generic over it has its type matches resolved
/// when it is compiled ([`Kernels::of`] picks the instance once per matrix).
const fn ty<const ID: u32>() -> GgmlType {
    match GgmlType::from_id(ID) {
        Some(t) => t,
        None => panic!("not a ggml type of ours"),
    }
}

/// A panel microkernel: a panel of rows `r0..r0 + nr` against two tokens or more ([`dots`]).
pub type PanelRun = unsafe fn(&Packed, usize, usize, &[u8], usize, &mut [[f32; R]], &mut Scratch);
/// One token against a range of rows ([`gemv`]).
pub type Gemv = unsafe fn(&Packed, Range<usize>, &[u8], &mut [f32]);

/// A packed matrix's kernels: its type's instances of [`dots`] and [`gemv`], chosen once when
/// it is packed, so a call runs no match on the type.
#[derive(Clone, Copy)]
pub struct Kernels {
    /// Two tokens or more.
    pub panel_run: PanelRun,
    /// One token.
    pub gemv: Gemv,
}

impl Kernels {
    /// The kernels of a matrix of type `t`.
    pub fn of(t: GgmlType) -> Kernels {
        macro_rules! of {
            ($($v:ident)*) => {
                match t {
                    $(GgmlType::$v => {
                        const ID: u32 = GgmlType::$v as u32;
                        Kernels { panel_run: dots::<ID>, gemv: gemv::<ID> }
                    })*
                }
            };
        }
        of!(F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL MXFP4 IQ4_XS IQ2_XXS IQ2_XS IQ3_XXS
            IQ1_S IQ3_S IQ2_S IQ1_M)
    }
}

// After the macros, which they use.
mod float;
mod kquant;
#[cfg(vnni_intrinsics)]
mod lattice1;
#[cfg(vnni_intrinsics)]
pub mod on_amx;
#[cfg(vnni_intrinsics)]
mod on_vnni;
#[cfg(vnni_intrinsics)]
mod on_zmm;
mod q32;

use float::*;
use kquant::*;
use q32::*;

/// `out[i] = row rows.start+i · the one token` for the rows `rows` of `w`, `act` prepared for
/// `w.t` with one token: every tile in one call. A call per tile (type dispatch, tile setup, a
/// closure per result) was 6.5% of decode's samples; one call per task runs 1-9% fewer
/// instructions (callgrind, q6_K to q4_0).
///
/// # Safety
/// AVX2, FMA and F16C must be present; `act` must hold one token prepared by [`crate::act`].
unsafe fn gemv<const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    debug_assert!(rows.end <= w.rows && out.len() >= rows.len() && w.t as u32 == ID);
    let t = const { ty::<ID>() };
    #[cfg(vnni_intrinsics)]
    if let Some(v) = w.vnni.filter(|_| const { crate::vnni::runs(ty::<ID>()) }) {
        // SAFETY: the caller's contract.
        return unsafe { on_vnni::gemv::<ID>(v, w, rows, act, out) };
    }
    #[cfg(vnni_intrinsics)]
    if w.zmm && t == GgmlType::IQ4_NL {
        // SAFETY: the caller's contract; packed for AVX512-VNNI, act holds one token's ActV8.
        return unsafe { on_zmm::legacy_gemv::<ID>(w, rows, act, out) };
    }
    #[cfg(vnni_intrinsics)]
    if w.zmm && matches!(t, GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K) {
        // SAFETY: the caller's contract; packed for AVX512-VNNI, act holds one token's ActK.
        return unsafe { on_zmm::k16_gemv::<ID>(w, rows, act, out) };
    }
    #[cfg(vnni_intrinsics)]
    if w.lattice1 && const { lattice1::runs(ty::<ID>()) } {
        // SAFETY: the caller's contract; packed for AVX512-VNNI, VBMI and DQ checked.
        return unsafe { lattice1::gemv::<ID>(w, rows, act, out) };
    }
    // SAFETY (every arm): the caller's contract; act holds one token in `w.t`'s layout.
    unsafe {
        macro_rules! k {
            ($b:ty) => {
                kquant1::<$b>(w, rows, act, out)
            };
        }
        by_kblock!(
            t,
            k,
            match t {
                GgmlType::Q4_0 => legacy1::<legacy::Q40>(w, rows, act, out),
                GgmlType::Q4_1 => legacy1::<legacy::Q41>(w, rows, act, out),
                GgmlType::Q5_0 => legacy1::<legacy::Q50>(w, rows, act, out),
                GgmlType::Q5_1 => legacy1::<legacy::Q51>(w, rows, act, out),
                GgmlType::IQ4_NL => legacy1::<legacy::Iq4Nl>(w, rows, act, out),
                GgmlType::MXFP4 => legacy1::<legacy::Mxfp4>(w, rows, act, out),
                GgmlType::Q8_0 => wide1(w, rows, act, out),
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                    one_token_tiles!(w, rows, act, out, f32, |tile, res| float(
                        t,
                        tile.rows(),
                        tile.nr,
                        w.cols,
                        tile.act(),
                        1,
                        &mut res
                    ))
                }
                t => unreachable!("{t} is a 256-column type"),
            }
        )
    }
}

/// Group `g` of each row of a 32-column tile.
#[inline(always)]
fn group<'a, A>(tile: &Tile<'a, A>, g: usize) -> [&'a [u8]; R] {
    let gb = tile.slice_bytes;
    array!(&[][..]; R, |i| &tile.row(i)[g * gb..(g + 1) * gb])
}

/// Group `g` of each row of a 32-column tile and the group's 8 scales per row, for the token
/// tile starting at `t0`; the first token tile also prefetches the next tile's share.
///
/// # Safety
/// AVX2 and F16C must be present (inlined into the kernels, whose features they are).
#[inline(always)]
unsafe fn open_group<'a, A>(tile: &Tile<'a, A>, t0: usize, g: usize) -> ([&'a [u8]; R], [__m256; R]) {
    if t0 == 0 {
        prefetch_ahead(tile, g, tile.far);
    }
    let grp = group(tile, g);
    // SAFETY: the caller's contract; each group starts with its 8 f16 scales.
    let dw = array!(unsafe { _mm256_setzero_ps() }; R, |i| unsafe { legacy::scales(grp[i], 0) });
    (grp, dw)
}

/// `out[t][i]` = the sum of `acc[i][t]`'s lanes, for every row of the tile (those past its
/// `nr` repeat its last, and callers read only the first `nr`).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn write_out<const TC: usize>(acc: &[[__m256; TC]; R], out: &mut [[f32; R]]) {
    for (t, o) in out.iter_mut().enumerate() {
        // SAFETY: AVX by the callers' features.
        *o = unsafe { hsum4([acc[0][t], acc[1][t], acc[2][t], acc[3][t]]) };
    }
}

/// The lane sums of a tile's `R` = 4 rows' accumulators, three `hadd`s putting the four side
/// by side: 5 instructions a token where [`hsum`] on each row takes 24.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn hsum4(v: [__m256; R]) -> [f32; R] {
    const { assert!(R == 4) };
    // SAFETY: AVX by the callers' features.
    unsafe {
        let s = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let mut out = [0.0f32; R];
        _mm_storeu_ps(out.as_mut_ptr(), _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s)));
        out
    }
}

/// `acc + x·y`, or `x·y` for a tile's first slice (`first`): the scratch accumulators
/// ([`Acc`]) are not zeroed between calls.
#[inline(always)]
fn add_product(first: bool, x: __m256, y: __m256, acc: __m256) -> __m256 {
    // SAFETY: AVX and FMA in every caller (target_feature functions).
    unsafe {
        if first {
            _mm256_mul_ps(x, y)
        } else {
            _mm256_fmadd_ps(x, y, acc)
        }
    }
}

/// The token tiles `(first, count)` of `n` tokens: as few tiles of at most `TC` as can be, all
/// but the last of one size: 33 tokens are 17 + 16, not 32 + 1, whose lone token would pay a
/// whole decode of every block.
fn token_tiles<const TC: usize>(n: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = n.div_ceil(n.div_ceil(TC).max(1)).max(1);
    (0..n).step_by(step).map(move |t0| (t0, step.min(n - t0)))
}

/// Prefetch the `b`-th of `nb` slices of the tile after this one (its rows follow these) into
/// L1, and of the tile after that into L2: a tile's rows are short streams that the hardware
/// prefetcher does not ramp up on, and L1 prefetches alone keep too few lines in flight
/// (docs/tuning.md, "GGUF kernels").
/// Stopping at the caller's last row, or prefetching its first tiles at its start, measured
/// no better: past its rows are the first of the task another thread is starting.
#[inline(always)]
fn prefetch_next<A>(tile: &Tile<'_, A>, b: usize) {
    prefetch_ahead(tile, b, false);
}

/// Most tokens of a tile whose 32-column kernel asks for the third tile ahead too: decode's,
/// which streams its rows once from DRAM.
const FAR_TOKENS: usize = 4;

/// [`prefetch_next`], and with `far` the same slice of the third tile ahead into L2 as well,
/// where [`kt_x86::prefetch::far_at_decode`] says so (`Tile::far`): there the two requests left
/// one-token decode well short of a plain read (docs/tuning.md, "GGUF kernels").
#[inline(always)]
fn prefetch_ahead<A>(tile: &Tile<'_, A>, b: usize, far: bool) {
    let len = R * tile.row_bytes;
    let next = tile.data.as_ptr().wrapping_add(len);
    let step = tile.prefetch;
    let mut off = b * step;
    while off < ((b + 1) * step).min(len) {
        let line = next.wrapping_add(off);
        kt_x86::prefetch::ahead(line, 0, len);
        if far {
            kt_x86::prefetch::to_l2(line, 2 * len);
        }
        off += 64;
    }
}

/// `maddubs` of levels `x` with activations `a` (|x|·sign(a, x) for signed levels).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub(crate) unsafe fn pair_sums(signed: bool, x: __m256i, a: __m256i) -> __m256i {
    // SAFETY: AVX2 in every caller (target_feature functions).
    unsafe {
        if signed {
            _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(a, x))
        } else {
            _mm256_maddubs_epi16(x, a)
        }
    }
}
