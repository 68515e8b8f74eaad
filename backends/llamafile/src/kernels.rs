//! Dot kernels: a tile of [`R`] weight rows against every token, [`TC`] tokens at a time.
//! Each weight block is decoded once per tile ([`crate::decode`]; for one token straight into
//! registers, for more into [`DecK`] buffers) and dotted with the matching block of each
//! token: `maddubs` (u8 levels × i8 activations, pairs summed to i16), then to i32 by a
//! `madd` with the 16-column scales (K-quants, in the lane layout of [`crate::lanes`], several
//! registers summed in i16 first) or by gathering block sums (32-column types), then f32;
//! q8_0, the unsigned 32-column types, q4_K and q5_K on VNNI by `vpdpbusd` ([`on_vnni`]; with
//! AVX512-VNNI q4_K, q5_K and q8_0 for several tokens in 512-bit registers, [`on_zmm`]). Every
//! output is computed in block order by one call, whatever the tile: results do not depend on
//! how rows are split over tasks.

// Tiles index rows, tokens and blocks of several arrays with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;
use core::marker::PhantomData;
use core::ops::Range;

use kt_core::ggml::{self, ActKind, GgmlType, QK, QK_K};

use crate::act::{ActG8, ActK, ActW8};
use crate::decode::{reg_of, Iq4XsU, KBlock, Relevel, Q3KU, Q4KU, Q5KU, Q6KP};
use crate::lanes::{relevel, REGS};
use crate::legacy::{self, LGroup, Offset};
use crate::vnni::{self, Vnni};

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

/// Rows per tile.
pub const R: usize = 4;
/// Tokens per accumulator tile for up to `TC` tokens, `2·TC` above (fewer for small batches,
/// whose accumulators then stay in registers). Each tile decodes or widens every block once:
/// an expert's share of a 512-token prefill is often just above 32 tokens, and one tile of
/// 64 instead of two of 17 was 5-8% faster at 33 tokens; below, the smaller tile keeps the
/// K-quants' zeroing of their accumulators (a memset per call) at half.
const TC: usize = 32;

/// A GGML matrix packed for the kernels: rows of whole blocks, row-major; the 32-column
/// quantized types in groups of 8 blocks ([`crate::legacy`]; q8_0 for VNNI in 4-column
/// lanes), the 256-column ones with their levels in the lane layout ([`crate::lanes`]; q3_K,
/// q4_K, q5_K and iq4_xs with scales unpacked, q3_K's, q5_K's and q6_K's levels in planes of
/// their own), the float types as GGUF stores them.
#[derive(Debug)]
pub struct Packed {
    /// Its type.
    pub t: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    row_bytes: usize,
    /// Blocks (256-column types) or groups (32-column ones) per row: a kernel's slices.
    slices: usize,
    /// Bytes of one slice.
    slice_bytes: usize,
    /// Bytes of the next tile to prefetch per slice ([`prefetch_next`]).
    prefetch: usize,
    /// The VNNI encoding its kernels use ([`on_vnni`]: q8_0, packed for it by
    /// [`legacy::to_quads`], the unsigned 32-column types, q4_K and q5_K); `None` for the
    /// others.
    #[cfg_attr(not(vnni_intrinsics), allow(dead_code))] // Always `None` there.
    vnni: Option<Vnni>,
    /// Row-major blocks.
    pub data: Vec<u8>,
}

impl Packed {
    /// Pack a matrix (GGUF bytes `src`) for the kernels of VNNI encoding `vnni` where its type
    /// has them ([`vnni::runs`]; q8_0 then in 4-column lanes), else for the AVX2 ones.
    pub fn new(t: GgmlType, rows: usize, cols: usize, src: &[u8], vnni: Option<Vnni>) -> Self {
        let row_bytes = Self::row_len(t, cols);
        let slices = if t.act() == ActKind::Q8_0 { (cols / QK).div_ceil(legacy::G) } else { cols / QK_K };
        let slice_bytes = row_bytes / slices.max(1);
        let prefetch = (R * row_bytes).div_ceil(slices.max(1)).next_multiple_of(64);
        let vnni = vnni.filter(|_| vnni::runs(t));
        let k = |data| Packed { t, rows, cols, row_bytes, slices, slice_bytes, prefetch, vnni, data };
        match t {
            GgmlType::Q2_K => return k(releveled(src, |b: &ggml::BlockQ2K| *b)),
            GgmlType::Q3_K => return k(releveled(src, Q3KU::from_block)),
            GgmlType::Q4_K => return k(releveled(src, Q4KU::from_block)),
            GgmlType::Q5_K => return k(releveled(src, Q5KU::from_block)),
            GgmlType::Q6_K => return k(releveled(src, Q6KP::from_block)),
            GgmlType::IQ4_XS => return k(releveled(src, Iq4XsU::from_block)),
            // The lattice and float types run as GGUF stores them.
            _ if t.is_lattice() || t.act() == ActKind::F32 => return k(src.to_vec()),
            _ => {}
        }
        let mut data = vec![0u8; rows * row_bytes];
        for (o, s) in data.chunks_exact_mut(row_bytes.max(1)).zip(src.chunks_exact(t.row_bytes(cols).max(1))) {
            legacy::repack_row(t, s, o);
            if vnni.is_some() && t == GgmlType::Q8_0 {
                legacy::to_quads(o);
            }
        }
        k(data)
    }

    fn row_len(t: GgmlType, cols: usize) -> usize {
        match t {
            _ if t.act() == ActKind::Q8_0 => legacy::row_bytes(t, cols),
            GgmlType::Q3_K => cols / QK_K * size_of::<Q3KU>(),
            GgmlType::Q4_K => cols / QK_K * size_of::<Q4KU>(),
            GgmlType::Q5_K => cols / QK_K * size_of::<Q5KU>(),
            GgmlType::IQ4_XS => cols / QK_K * size_of::<Iq4XsU>(),
            _ => t.row_bytes(cols),
        }
    }
}

/// GGUF blocks `src` (of type `S`) as kernel blocks `B` in the lane layout.
fn releveled<S: bytemuck::Pod, B: Relevel>(src: &[u8], from: impl Fn(&S) -> B) -> Vec<u8> {
    let blocks: &[S] = bytemuck::cast_slice(src);
    let mut out = vec![0u8; blocks.len() * size_of::<B>()];
    for (o, b) in out.chunks_exact_mut(size_of::<B>()).zip(blocks) {
        o.copy_from_slice(bytemuck::bytes_of(&relevel(&from(b))));
    }
    out
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

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

/// Accumulators of one tile of up to `2·TC` tokens ([`wide`], [`legacy`](fn@legacy), [`kquant`]), set by the tile's
/// first group rather than zeroed per call (a `memset` of up to 8 KiB a tile: q8_0's down
/// shape 3-7% slower in alternated `dots` runs). A matrix of no columns never sets them; its
/// tiles then read the zeros of [`Scratch::new`], made afresh for each task.
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
}

impl Scratch {
    /// Fresh buffers.
    pub fn new() -> Box<Self> {
        let z = DecK {
            v: [[0; 32]; REGS],
            w: [[0; 32]; REGS],
            sc: [0; 16],
            mn: [0; 16],
            dsc: [0.0; 8],
            dmn: [0.0; 8],
            d: 0.0,
            dmin: 0.0,
        };
        // SAFETY: an `__m256` is 32 bytes of plain data, for which all zeros are 0.0 lanes.
        let acc: Acc = unsafe { core::mem::zeroed() };
        Box::new(Scratch {
            acc,
            k: [z; R],
            w: [W16([[0; 16]; QK / 2]); R],
            #[cfg(vnni_intrinsics)]
            pairs: on_zmm::Pairs::ZERO,
        })
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
    layout: PhantomData<&'a [A]>,
}

impl<'a, A: bytemuck::Pod> Tile<'a, A> {
    /// Rows `r0..r0 + nr` of `w` (`nr ≤ R`).
    fn new(w: &'a Packed, r0: usize, nr: usize, act: &'a [u8], n: usize) -> Self {
        let (nb, slice_bytes, prefetch, row_bytes) = (w.slices, w.slice_bytes, w.prefetch, w.row_bytes);
        let data = &w.data[r0 * row_bytes..(r0 + nr) * row_bytes];
        Tile { t: w.t, data, row_bytes, nr, nb, act, n, slice_bytes, prefetch, layout: PhantomData }
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
pub unsafe fn dots(
    w: &Packed,
    r0: usize,
    nr: usize,
    act: &[u8],
    n: usize,
    out: &mut [[f32; R]],
    scratch: &mut Scratch,
) {
    debug_assert!((1..=R).contains(&nr) && r0 + nr <= w.rows && n != 1);
    // The activations as bytes; each kernel reads them in its type's layout (`cast`).
    let raw = Tile::<u8>::new(w, r0, nr, act, n);
    #[cfg(vnni_intrinsics)]
    if let Some(v) = w.vnni {
        // SAFETY: the caller's contract.
        return unsafe { on_vnni::dots(v, &raw, out, scratch) };
    }
    macro_rules! k {
        ($b:ty) => {{
            let tile = raw.cast::<ActK>();
            // SAFETY: the caller's contract; act holds [blocks][n] ActK.
            unsafe {
                match n {
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
    match w.t {
        GgmlType::Q2_K => k!(ggml::BlockQ2K),
        GgmlType::Q3_K => k!(Q3KU),
        GgmlType::Q4_K => k!(Q4KU),
        GgmlType::Q5_K => k!(Q5KU),
        GgmlType::Q6_K => k!(Q6KP),
        GgmlType::IQ4_XS => k!(Iq4XsU),
        GgmlType::IQ1_S => k!(ggml::BlockIq1S),
        GgmlType::IQ1_M => k!(ggml::BlockIq1M),
        GgmlType::IQ2_XXS => k!(ggml::BlockIq2Xxs),
        GgmlType::IQ2_XS => k!(ggml::BlockIq2Xs),
        GgmlType::IQ2_S => k!(ggml::BlockIq2S),
        GgmlType::IQ3_XXS => k!(ggml::BlockIq3Xxs),
        GgmlType::IQ3_S => k!(ggml::BlockIq3S),
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
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            debug_assert_eq!(w.t.act(), ActKind::F32);
            // SAFETY: the caller's contract; act holds [n][cols] f32.
            let tile = raw.cast::<f32>();
            unsafe { float(w.t, tile.rows(), nr, w.cols, tile.act(), n, out) }
        }
    }
}

/// The body of a one-token kernel over rows `$rows` of `$w`: each tile (activations `$A`) into
/// `$tile` and its results' slot `$res` for `$call`, whose row results go to `$out`.
macro_rules! one_token_tiles {
    ($w:expr, $rows:expr, $act:expr, $out:expr, $A:ty, |$tile:ident, $res:ident| $call:expr) => {{
        let (w, rows, out) = ($w, $rows, $out);
        let mut $res = [[0.0f32; R]; 1];
        for r0 in rows.clone().step_by(R) {
            let nr = R.min(rows.end - r0);
            let $tile = Tile::<$A>::new(w, r0, nr, $act, 1);
            $call;
            out[r0 - rows.start..][..nr].copy_from_slice(&$res[0][..nr]);
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

// After the macros, which they use.
#[cfg(vnni_intrinsics)]
mod on_vnni;
#[cfg(vnni_intrinsics)]
mod on_zmm;

/// `out[i] = row rows.start+i · the one token` for the rows `rows` of `w`, `act` prepared for
/// `w.t` with one token: every tile in one call. A call per tile (type dispatch, tile setup, a
/// closure per result) was 6.5% of decode's samples; one call per task runs 1-9% fewer
/// instructions (callgrind, q6_K to q4_0).
///
/// # Safety
/// AVX2, FMA and F16C must be present; `act` must hold one token prepared by [`crate::act`].
pub unsafe fn gemv(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    debug_assert!(rows.end <= w.rows && out.len() >= rows.len());
    #[cfg(vnni_intrinsics)]
    if let Some(v) = w.vnni {
        // SAFETY: the caller's contract.
        return unsafe { on_vnni::gemv(v, w, rows, act, out) };
    }
    // SAFETY (every arm): the caller's contract; act holds one token in `w.t`'s layout.
    unsafe {
        match w.t {
            GgmlType::Q2_K => kquant1::<ggml::BlockQ2K>(w, rows, act, out),
            GgmlType::Q3_K => kquant1::<Q3KU>(w, rows, act, out),
            GgmlType::Q4_K => kquant1::<Q4KU>(w, rows, act, out),
            GgmlType::Q5_K => kquant1::<Q5KU>(w, rows, act, out),
            GgmlType::Q6_K => kquant1::<Q6KP>(w, rows, act, out),
            GgmlType::IQ4_XS => kquant1::<Iq4XsU>(w, rows, act, out),
            GgmlType::IQ1_S => kquant1::<ggml::BlockIq1S>(w, rows, act, out),
            GgmlType::IQ1_M => kquant1::<ggml::BlockIq1M>(w, rows, act, out),
            GgmlType::IQ2_XXS => kquant1::<ggml::BlockIq2Xxs>(w, rows, act, out),
            GgmlType::IQ2_XS => kquant1::<ggml::BlockIq2Xs>(w, rows, act, out),
            GgmlType::IQ2_S => kquant1::<ggml::BlockIq2S>(w, rows, act, out),
            GgmlType::IQ3_XXS => kquant1::<ggml::BlockIq3Xxs>(w, rows, act, out),
            GgmlType::IQ3_S => kquant1::<ggml::BlockIq3S>(w, rows, act, out),
            GgmlType::Q4_0 => legacy1::<legacy::Q40>(w, rows, act, out),
            GgmlType::Q4_1 => legacy1::<legacy::Q41>(w, rows, act, out),
            GgmlType::Q5_0 => legacy1::<legacy::Q50>(w, rows, act, out),
            GgmlType::Q5_1 => legacy1::<legacy::Q51>(w, rows, act, out),
            GgmlType::IQ4_NL => legacy1::<legacy::Iq4Nl>(w, rows, act, out),
            GgmlType::Q8_0 => wide1(w, rows, act, out),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                one_token_tiles!(w, rows, act, out, f32, |tile, res| float(
                    w.t,
                    tile.rows(),
                    tile.nr,
                    w.cols,
                    tile.act(),
                    1,
                    &mut res
                ))
            }
        }
    }
}

/// [`legacy`](fn@legacy) for one token, rows `rows` ([`gemv`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy1<L: LGroup>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    one_token_tiles!(w, rows, act, out, ActG8, |tile, res| unsafe {
        legacy::<1, 1, L>(&tile, &mut res, &mut [[_mm256_setzero_ps(); 1]; R])
    })
}

/// [`wide`] for one token, rows `rows` ([`gemv`]): pieces widened where used, no scratch.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide1(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    one_token_tiles!(w, rows, act, out, ActW8, |tile, res| unsafe {
        wide::<1, 1>(&tile, &mut res, &mut [], &mut [[_mm256_setzero_ps(); 1]; R])
    })
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
        prefetch_next(tile, g);
    }
    let grp = group(tile, g);
    // SAFETY: the caller's contract; each group starts with its 8 f16 scales.
    let dw = array!(unsafe { _mm256_setzero_ps() }; R, |i| unsafe { legacy::scales(grp[i], 0) });
    (grp, dw)
}

/// `out[t][i]` = the sum of `acc[i][t]`'s lanes, for every row of the tile (those past its
/// `nr` repeat its last, and callers read only the first `nr`).
#[inline(always)]
unsafe fn write_out<const TC: usize>(acc: &[[__m256; TC]; R], out: &mut [[f32; R]]) {
    for (t, o) in out.iter_mut().enumerate() {
        // SAFETY: AVX by the callers' features.
        *o = unsafe { hsum4([acc[0][t], acc[1][t], acc[2][t], acc[3][t]]) };
    }
}

/// The lane sums of a tile's `R` = 4 rows' accumulators, three `hadd`s putting the four side
/// by side: 5 instructions a token where [`hsum`] on each row takes 24.
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
/// prefetcher does not ramp up on, and L1 prefetches alone keep too few lines in flight on a
/// Xeon (MoE decode from DRAM at 0.59-0.69 of the probe with them, 0.73-0.87 with both).
/// Stopping at the caller's last row, or prefetching its first tiles at its start, measured
/// no better: past its rows are the first of the task another thread is starting.
#[inline(always)]
fn prefetch_next<A>(tile: &Tile<'_, A>, b: usize) {
    let len = R * tile.row_bytes;
    let next = tile.data.as_ptr().wrapping_add(len);
    let step = tile.prefetch;
    let mut off = b * step;
    while off < ((b + 1) * step).min(len) {
        // SAFETY: prefetching has no architectural effect and does not fault, whatever the
        // address (the pointer is never dereferenced).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off).cast());
            _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(off + len).cast());
        }
        off += 64;
    }
}

/// `maddubs` of levels `x` with activations `a` (|x|·sign(a, x) for signed levels).
#[inline(always)]
unsafe fn pair_sums(signed: bool, x: __m256i, a: __m256i) -> __m256i {
    // SAFETY: AVX2 in every caller (target_feature functions).
    unsafe {
        if signed {
            _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(a, x))
        } else {
            _mm256_maddubs_epi16(x, a)
        }
    }
}

/// One block's levels `blk` with its activations `a`, as i32 lanes already scaled per 16
/// columns by `sc`: pair sums added in i16, [`KBlock::FOLD`] registers at a time, then one
/// `madd` with the scales per fold.
#[inline(always)]
unsafe fn block_dot<B: KBlock>(blk: &B, a: &ActK, sc: __m256i) -> __m256i {
    // SAFETY: AVX2 in every caller (target_feature functions); loads inside the blocks.
    unsafe {
        let mut sum = _mm256_setzero_si256();
        let whole = if B::WHOLE { blk.regs() } else { [sum; REGS] };
        for f in (0..REGS).step_by(B::FOLD) {
            let mut p = pair_sums(B::SIGNED, reg_of(blk, &whole, f), ld(&a.qs[32 * f..]));
            for r in f + 1..f + B::FOLD {
                p = _mm256_add_epi16(p, pair_sums(B::SIGNED, reg_of(blk, &whole, r), ld(&a.qs[32 * r..])));
            }
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, sc));
        }
        sum
    }
}

/// A [`KBlock::PER32`] block's step for one row and token: `acc·keep + s·(d·scale)·da −
/// (dmin·min)·(da·Σa)` per 32-column part, `keep` all ones but for a tile's first block
/// (zeros: [`keep`]), `s` the parts' sums of levels times activations, `sc` the block's
/// [`KBlock::prep32`], `(da, m)` the token's [`act32`].
#[inline(always)]
unsafe fn per32(keep: __m256, acc: __m256, s: __m256i, (dsc, dmn): (__m256, __m256), da: __m256, m: __m256) -> __m256 {
    // SAFETY: AVX and FMA in every caller (target_feature functions).
    unsafe {
        let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dsc, da), _mm256_and_ps(acc, keep));
        _mm256_fnmadd_ps(dmn, m, x)
    }
}

/// [`per32`]'s mask for block `b`: the accumulators are not zeroed per tile ([`Acc`]), so the
/// first block clears what they held, as a mask rather than a branch (with `add_product`'s
/// branch LLVM no longer unrolled the VNNI kernel's token loop and spilled its sums).
#[inline(always)]
fn keep(b: usize) -> __m256 {
    // SAFETY: AVX in every caller (target_feature functions).
    unsafe { _mm256_castsi256_ps(_mm256_set1_epi32(-i32::from(b != 0))) }
}

/// An activation block's scale and `da·Σa` of each 32 columns, for [`per32`].
#[inline(always)]
unsafe fn act32(a: &ActK) -> (__m256, __m256) {
    // SAFETY: AVX2 in every caller (target_feature functions); the sums are 32 bytes.
    unsafe {
        let da = _mm256_set1_ps(a.d);
        let sums = _mm256_madd_epi16(ld(&a.bsums), _mm256_set1_epi16(1));
        (da, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), da))
    }
}

/// K-quants for one token, rows `rows` ([`gemv`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant1<B: KBlock>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    // SAFETY: this function's features; the caller's contract.
    one_token_tiles!(w, rows, act, out, ActK, |tile, res| unsafe { kquant1_tile::<B>(&tile, &mut res) })
}

/// One tile of [`kquant1`]: every register decoded in place and used at once, a row at a time
/// ([`block_dot`]; measured faster than a register at a time for all rows).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant1_tile<B: KBlock>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (mut acc, acts) = ([_mm256_setzero_ps(); R], tile.act());
    for b in 0..tile.nb {
        prefetch_next(tile, b);
        let a = &acts[b];
        let da = _mm256_set1_ps(a.d);
        // SAFETY (whole loop): AVX2/FMA/F16C present (this function's features); loads stay
        // inside the blocks' arrays.
        if B::PER32 {
            let (da, m) = unsafe { act32(a) };
            for i in 0..R {
                let blk = &blocks[i][b];
                let s = unsafe { block_dot(blk, a, _mm256_set1_epi16(1)) };
                acc[i] = unsafe { per32(keep(b), acc[i], s, blk.prep32(), da, m) };
            }
            continue;
        }
        let bs = unsafe { ld(&a.bsums) };
        for i in 0..R {
            let blk = &blocks[i][b];
            let (sc, mn, d, dmin) = unsafe { blk.prep() };
            let (mins, dots) = (_mm256_madd_epi16(bs, mn), unsafe { block_dot(blk, a, sc) });
            if B::MINS_IN_D {
                let x = _mm256_cvtepi32_ps(_mm256_sub_epi32(dots, mins));
                acc[i] = _mm256_fmadd_ps(x, _mm256_mul_ps(_mm256_set1_ps(d), da), acc[i]);
                continue;
            }
            let (mins, dots) = (_mm256_cvtepi32_ps(mins), _mm256_cvtepi32_ps(dots));
            acc[i] = _mm256_fnmadd_ps(mins, _mm256_mul_ps(_mm256_set1_ps(dmin), da), acc[i]);
            acc[i] = _mm256_fmadd_ps(dots, _mm256_mul_ps(_mm256_set1_ps(d), da), acc[i]);
        }
    }
    // SAFETY: AVX present.
    out[0] = unsafe { hsum4(acc) };
}

/// K-quants for several tokens: each block decoded once into [`DecK`] and dotted with
/// `TC` tokens at a time.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant<const TC: usize, B: KBlock>(
    tile: &Tile<'_, ActK>,
    out: &mut [[f32; R]],
    dec: &mut [DecK; R],
    acc: &mut Acc,
) {
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let (n, acts) = (tile.n, tile.act());
    for (t0, tn) in token_tiles::<TC>(n) {
        for b in 0..tile.nb {
            // Block 0 sets the accumulators ([`Acc`]).
            let first = b == 0;
            if t0 == 0 {
                prefetch_next(tile, b);
            }
            // SAFETY (whole loop): as in kquant1; stores stay inside the DecK arrays.
            for i in 0..R {
                let blk = &blocks[i][b];
                let o = &mut dec[i];
                let (sc, mn, d, dmin) = unsafe { blk.prep() };
                let whole = if B::WHOLE { unsafe { blk.regs() } } else { [sc; REGS] };
                for r in 0..REGS {
                    let x = unsafe { reg_of(blk, &whole, r) };
                    unsafe {
                        if B::SIGNED {
                            _mm256_store_si256(o.v[r].as_mut_ptr().cast(), _mm256_abs_epi8(x));
                            _mm256_store_si256(o.w[r].as_mut_ptr().cast(), x);
                        } else {
                            _mm256_store_si256(o.v[r].as_mut_ptr().cast(), x);
                        }
                    }
                }
                unsafe {
                    if B::PER32 {
                        let (dsc, dmn) = blk.prep32();
                        _mm256_store_ps(o.dsc.as_mut_ptr(), dsc);
                        _mm256_store_ps(o.dmn.as_mut_ptr(), dmn);
                    } else {
                        _mm256_store_si256(o.sc.as_mut_ptr().cast(), sc);
                        _mm256_store_si256(o.mn.as_mut_ptr().cast(), mn);
                    }
                }
                (o.d, o.dmin) = (d, dmin);
            }
            for t in 0..tn {
                let a = &acts[b * n + t0 + t];
                let mut isum = [_mm256_setzero_si256(); R];
                for f in (0..REGS).step_by(B::FOLD) {
                    let mut p = [_mm256_setzero_si256(); R];
                    for r in f..f + B::FOLD {
                        let av = unsafe { ld(&a.qs[32 * r..]) };
                        for i in 0..R {
                            let d = &dec[i];
                            let s = unsafe {
                                if B::SIGNED {
                                    _mm256_maddubs_epi16(ld(&d.v[r]), _mm256_sign_epi8(av, ld(&d.w[r])))
                                } else {
                                    _mm256_maddubs_epi16(ld(&d.v[r]), av)
                                }
                            };
                            p[i] = _mm256_add_epi16(p[i], s);
                        }
                    }
                    for i in 0..R {
                        // PER32 types' parts are summed unscaled, and scaled in f32 by `per32`.
                        let sc = if B::PER32 { _mm256_set1_epi16(1) } else { unsafe { ld(&dec[i].sc) } };
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p[i], sc));
                    }
                }
                if B::PER32 {
                    let (da, m) = unsafe { act32(a) };
                    for i in 0..R {
                        let d = &dec[i];
                        let sc = unsafe { (_mm256_load_ps(d.dsc.as_ptr()), _mm256_load_ps(d.dmn.as_ptr())) };
                        acc[i][t] = unsafe { per32(keep(b), acc[i][t], isum[i], sc, da, m) };
                    }
                    continue;
                }
                let bs = unsafe { ld(&a.bsums) };
                let da = _mm256_set1_ps(a.d);
                for i in 0..R {
                    let d = &dec[i];
                    let mins = _mm256_madd_epi16(bs, unsafe { ld(&d.mn) });
                    let s = _mm256_mul_ps(_mm256_set1_ps(d.d), da);
                    let m = _mm256_mul_ps(_mm256_set1_ps(d.dmin), da);
                    let x = add_product(first, _mm256_cvtepi32_ps(isum[i]), s, acc[i][t]);
                    acc[i][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), m, x);
                }
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// The 32-column types for several tokens: [`legacy_with`] in the accumulator tile that fits `n`.
///
/// # Safety
/// As [`dots`]; `P`'s features present (inlined into functions that enable them).
#[inline(always)]
unsafe fn legacy_tiles<L: LGroup, P: PairSums>(raw: &Tile<'_, u8>, out: &mut [[f32; R]], scratch: &mut Scratch) {
    let tile = raw.cast::<ActG8>();
    // SAFETY: the caller's contract.
    unsafe {
        match tile.n {
            ..=4 => legacy_with::<4, 4, L, P>(tile, out, &mut [[_mm256_setzero_ps(); 4]; R]),
            5..=TC => legacy_with::<TC, { 2 * TC }, L, P>(tile, out, &mut scratch.acc),
            _ => legacy_with::<{ 2 * TC }, { 2 * TC }, L, P>(tile, out, &mut scratch.acc),
        }
    }
}

/// How the 32-column kernel sums the products of a pair of blocks with unsigned levels
/// (`lo`, `hi`: columns 0..16 and 16..32 of both) and their activations (`aa`, `ab`).
trait PairSums {
    /// The sums come out in i32 lanes (4 columns each), else in i16 (column pairs).
    const I32: bool;
    /// The sums.
    ///
    /// # Safety
    /// The implementation's features must be present (inlined into kernels that enable them).
    unsafe fn sums(lo: __m256i, aa: __m256i, hi: __m256i, ab: __m256i) -> __m256i;
}

/// AVX2: `maddubs` on each half, the halves added in i16 (levels ≤ 31: no overflow).
struct Maddubs;

impl PairSums for Maddubs {
    const I32: bool = false;
    #[inline(always)]
    unsafe fn sums(lo: __m256i, aa: __m256i, hi: __m256i, ab: __m256i) -> __m256i {
        // SAFETY: AVX2 by the caller's contract.
        unsafe { _mm256_add_epi16(_mm256_maddubs_epi16(lo, aa), _mm256_maddubs_epi16(hi, ab)) }
    }
}

/// [`legacy_with`] on AVX2.
/// (Inlined into [`legacy1`], whose features are the same.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const TC: usize, const A: usize, L: LGroup>(
    tile: &Tile<'_, ActG8>,
    out: &mut [[f32; R]],
    acc: &mut [[__m256; A]; R],
) {
    // SAFETY: this function's features; the caller's contract.
    unsafe { legacy_with::<TC, A, L, Maddubs>(tile, out, acc) }
}

/// 32-column types, repacked ([`crate::legacy`]): per group of 8 blocks, row and token, the 4
/// pairs' sums (`P`; signed levels always by `maddubs` and the sign trick) gathered into one
/// register of 8 block sums, then one multiply-add with the 8 scale products, into `acc`
/// ([`Acc`]). The block sums are exact integers whichever `P`: the results do not depend on it.
///
/// # Safety
/// AVX2, FMA, F16C and `P`'s features must be present (inlined into functions that enable
/// them); the tile's activations are `ActG8` for its type.
#[inline(always)]
#[allow(unused_unsafe)] // It runs inlined: one block for the intrinsics, the inner ones for their notes.
unsafe fn legacy_with<const TC: usize, const A: usize, L: LGroup, P: PairSums>(
    tile: &Tile<'_, ActG8>,
    out: &mut [[f32; R]],
    acc: &mut [[__m256; A]; R],
) {
    // SAFETY (whole body, its inner blocks noting what each relies on): AVX2, FMA, F16C and
    // `P`'s features by the caller's contract; loads stay inside the groups and the activation
    // blocks.
    unsafe {
        let (n, ng, ones, acts) = (tile.n, tile.nb, _mm256_set1_epi16(1), tile.act());
        for (t0, tn) in token_tiles::<TC>(n) {
            for g in 0..ng {
                // `A` = 1 (one token): the caller's zeroed registers, added to; else group 0 sets them.
                let first = A > 1 && g == 0;
                // SAFETY (whole loop): AVX2/FMA/F16C present (the caller's contract); loads stay
                // inside the groups and the activation blocks.
                let (grp, dw) = unsafe { open_group(tile, t0, g) };
                let mw = array!(_mm256_setzero_ps(); R, |i| match L::OFFSET {
                    Offset::Zero => _mm256_setzero_ps(),
                    Offset::OfD(k) => _mm256_mul_ps(dw[i], _mm256_set1_ps(k)),
                    Offset::Stored => unsafe { legacy::scales(grp[i], 2 * legacy::G) },
                });
                // With several tokens, unsigned levels (nibbles, fifth bits) are decoded once for all
                // of them; signed ones (iq4_nl: levels and their magnitudes) cost more registers
                // than they save, so they, and everything for one token, are decoded where used.
                let hoist = TC > 1 && !L::SIGNED;
                let mut lv = [[(_mm256_setzero_si256(), _mm256_setzero_si256()); 4]; R];
                if hoist {
                    for i in 0..R {
                        for p in 0..4 {
                            lv[i][p] = unsafe { L::pair(grp[i], p) };
                        }
                    }
                }
                for t in 0..tn {
                    let a = &acts[g * n + t0 + t];
                    let (da, sa) = unsafe { (_mm256_loadu_ps(a.d.as_ptr()), _mm256_loadu_ps(a.s.as_ptr())) };
                    let sc = array!(_mm256_setzero_ps(); R, |i| _mm256_mul_ps(dw[i], da));
                    let offset = L::OFFSET != Offset::Zero;
                    if offset {
                        for i in 0..R {
                            acc[i][t] = add_product(first, mw[i], sa, acc[i][t]);
                        }
                    }
                    for i in 0..R {
                        let mut parts = [_mm256_setzero_si256(); 4];
                        for p in 0..4 {
                            let (aa, ab) = unsafe { (ld(&a.qs[64 * p..]), ld(&a.qs[64 * p + 32..])) };
                            let (lo, hi) = if hoist { lv[i][p] } else { unsafe { L::pair(grp[i], p) } };
                            parts[p] = if L::SIGNED {
                                let pa = unsafe { pair_sums(true, lo, aa) };
                                let pb = unsafe { pair_sums(true, hi, ab) };
                                _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones))
                            } else if P::I32 {
                                unsafe { P::sums(lo, aa, hi, ab) }
                            } else {
                                // Levels ≤ 31: two pair sums fit in i16 together.
                                let s16 = unsafe { P::sums(lo, aa, hi, ab) };
                                if L::FOUR_BIT {
                                    s16
                                } else {
                                    _mm256_madd_epi16(s16, ones)
                                }
                            };
                        }
                        let v = unsafe {
                            if L::FOUR_BIT && !P::I32 {
                                legacy::block_sums16(parts)
                            } else {
                                legacy::block_sums(parts)
                            }
                        };
                        acc[i][t] = add_product(first && !offset, _mm256_cvtepi32_ps(v), sc[i], acc[i][t]);
                    }
                }
            }
            unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
        }
    }
}

/// Piece `c` (column pair c of the 8 blocks) of a q8_0 group, widened to i16.
#[inline(always)]
unsafe fn q8_piece(g: &[u8], c: usize) -> __m256i {
    let at = 2 * legacy::G + 16 * c;
    debug_assert!(g.len() >= at + 16);
    // SAFETY: 16 bytes at `at` inside the group; AVX2 by the callers' contract.
    unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(g.as_ptr().add(at).cast())) }
}

/// `x`, through an empty `asm` statement that LLVM must assume changes it, so that the adds
/// into an accumulator stay one after another. Without it the piece loop was unrolled, its adds
/// regrouped into one tree per accumulator, all 16 pieces kept live and spilled; with an opaque
/// trip count instead (the earlier remedy) it kept a loop with a counter of its own, 24 µops a
/// piece where this loop has 23 (q8_0 tiles 1-4% faster in alternated `dots` runs).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn in_order(mut x: __m256i) -> __m256i {
    // SAFETY: an empty statement; it reads and writes only `x`'s register.
    unsafe { core::arch::asm!("/* {0} */", inout(ymm_reg) x, options(pure, nomem, nostack, preserves_flags)) };
    x
}

/// `NT` tokens' dots with one q8_0 group of each row (`widened`: its pieces in `w16`, else
/// widened here), added to `acc[i][t..t + NT]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_tokens<const NT: usize, const TC: usize>(
    grp: &[&[u8]; R],
    w16: &[W16],
    act: &[ActW8],
    dw: &[__m256; R],
    acc: &mut [[__m256; TC]],
    t: usize,
    widened: bool,
    first: bool,
) {
    // SAFETY (whole function): AVX2/FMA by the callers' features; loads stay inside the
    // groups, the scratch and the activation blocks.
    unsafe {
        let mut s = [[_mm256_setzero_si256(); NT]; R];
        for c in 0..QK / 2 {
            let av = array!(_mm256_setzero_si256(); NT, |k| ld(&act[k].qs[16 * c..]));
            for i in 0..R {
                let w = if widened { ld(&w16[i].0[c]) } else { q8_piece(grp[i], c) };
                for k in 0..NT {
                    s[i][k] = in_order(_mm256_add_epi32(s[i][k], _mm256_madd_epi16(w, av[k])));
                }
            }
        }
        for k in 0..NT {
            let da = _mm256_loadu_ps(act[k].d.as_ptr());
            for i in 0..R {
                let sc = _mm256_mul_ps(dw[i], da);
                acc[i][t + k] = add_product(first, _mm256_cvtepi32_ps(s[i][k]), sc, acc[i][t + k]);
            }
        }
    }
}

/// q8_0, repacked ([`crate::legacy`]) and with [`ActW8`] activations: levels widened to i16
/// (once per group for all tokens when there are several), so each 16-value piece is one
/// `madd` whose lanes are the 8 blocks' shares, summed over the group's 16 pieces: no sign
/// trick, no gathering, one conversion and one FMA per group.
/// `w16`: scratch for `R` rows' widened pieces with several tokens, unused (empty) for one;
/// `acc`: the tile's accumulators ([`Acc`]).
/// (Inlined into [`wide1`], whose features are the same.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide<const TC: usize, const A: usize>(
    tile: &Tile<'_, ActW8>,
    out: &mut [[f32; R]],
    w16: &mut [W16],
    acc: &mut [[__m256; A]; R],
) {
    const PIECES: usize = QK / 2;
    let (n, ng, acts) = (tile.n, tile.nb, tile.act());
    for (t0, tn) in token_tiles::<TC>(n) {
        for g in 0..ng {
            // `A` = 1 (one token): the caller's zeroed registers, added to; else group 0 sets them.
            let first = A > 1 && g == 0;
            // SAFETY (whole loop): AVX2/FMA/F16C present (this function's features); loads stay
            // inside the groups (16 bytes of levels per piece after the 16 of scales), the
            // activation blocks and the scratch.
            let (grp, dw) = unsafe { open_group(tile, t0, g) };
            if TC > 1 {
                for i in 0..R {
                    for c in 0..PIECES {
                        unsafe { _mm256_store_si256(w16[i].0[c].as_mut_ptr().cast(), q8_piece(grp[i], c)) };
                    }
                }
            }
            // Two tokens at a time when there are several: each widened piece, loaded once,
            // serves both (half the weight loads per `madd`; 4 rows × 2 tokens is what fits in
            // the registers).
            let mut t = 0;
            while TC > 1 && t + 2 <= tn {
                unsafe { wide_tokens::<2, A>(&grp, w16, &acts[g * n + t0 + t..], &dw, acc, t, true, first) };
                t += 2;
            }
            if t < tn {
                unsafe { wide_tokens::<1, A>(&grp, w16, &acts[g * n + t0 + t..], &dw, acc, t, TC > 1, first) };
            }
        }
        unsafe { write_out(acc, &mut out[t0..t0 + tn]) };
    }
}

/// Float rows: each row converted to f32 once, then dotted with every token.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float(t: GgmlType, rows: [&[u8]; R], nr: usize, cols: usize, act: &[f32], n: usize, out: &mut [[f32; R]]) {
    let mut buf = vec![0.0f32; nr * cols];
    for (i, b) in buf.chunks_exact_mut(cols).enumerate() {
        let src = rows[i];
        let mut c = 0;
        if t == GgmlType::F16 {
            while c + 8 <= cols {
                // SAFETY: 16 bytes of src and 8 floats of b at c.
                unsafe {
                    let h = _mm_loadu_si128(src.as_ptr().add(2 * c).cast());
                    _mm256_storeu_ps(b.as_mut_ptr().add(c), _mm256_cvtph_ps(h));
                }
                c += 8;
            }
        }
        ggml::dequantize_row(t, &src[c * t.block_bytes()..], &mut b[c..]);
    }
    for (tok, o) in out[..n].iter_mut().enumerate() {
        let x = &act[tok * cols..(tok + 1) * cols];
        for (i, w) in buf.chunks_exact(cols).enumerate() {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c + 32 <= cols {
                for (k, a) in acc.iter_mut().enumerate() {
                    // SAFETY: c + 8k + 8 ≤ cols for both slices.
                    unsafe {
                        let wv = _mm256_loadu_ps(w.as_ptr().add(c + 8 * k));
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(c + 8 * k)), *a);
                    }
                }
                c += 32;
            }
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            // SAFETY: AVX present.
            let mut s = unsafe { hsum(v) };
            for j in c..cols {
                s += w[j] * x[j];
            }
            o[i] = s;
        }
    }
}
