//! Prepared activations, block-major so that one weight block meets every token's matching
//! block in one place:
//! - K-quants, IQ4_XS and the lattice types: `[blocks][tokens]` of [`ActK`] (Q8_K as core
//!   quantizes it, the values in the lane layout of [`crate::lanes`]; for an expert on AMX
//!   tiles, [`Layout::T8`], in column order);
//! - 32-column types: `[groups of 8 blocks][tokens]` of [`ActG8`]: Q8_0 blocks (scales widened
//!   to f32) with `s = d·Σq` (ggml's Q8_1: the offsets of the weights fold in with it), the
//!   values in the pairwise order of [`crate::legacy`]; for q8_0 [`ActW8`] (widened to i16),
//!   or on a VNNI CPU [`ActV8`], as the other unsigned types with AVX512-VNNI ([`layout`]); for an expert that runs on AMX tiles, every
//!   32-column type's [`ActT8`] (each block's values in column order, rows of A tiles);
//! - float types: `[tokens][cols]` f32.
//!
//! Values are quantized as core's scalar quantizers do (`d = amax/127`, ties away from zero),
//! here with AVX2.

use core::arch::x86_64::*;

use bytemuck::{Pod, Zeroable};
use half::bf16;
use kt_core::ggml::{ActKind, GgmlType, QK, QK_K};

use crate::legacy::{quad_at, slot, G, ORDER};
use crate::vnni::Vnni;

/// One Q8_K activation block laid out for aligned loads: values first and 320 bytes, so in a
/// 64-byte aligned buffer (the forward pass's) no 32-byte load of them splits a cache line
/// (Q8_K's own layout puts them at offset 4: every other load split two lines).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct ActK {
    /// Values, in the lane layout.
    pub qs: [i8; QK_K],
    /// Sums of each 16 columns (in column order).
    pub bsums: [i16; 16],
    /// Scale.
    pub d: f32,
    pad: [u8; 28],
}

/// 8 activation blocks of 32 columns (a group of [`crate::legacy`]); a row's last group is
/// padded with zero blocks.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct ActG8 {
    /// Scales, block `k` at [`slot`]`(k)`.
    pub d: [f32; G],
    /// `d · Σ qs` of each block, in the same order.
    pub s: [f32; G],
    /// Values, pair p of blocks at `64p`: columns 0..16 of block 2p, of block 2p+1, then
    /// columns 16..32 of each.
    pub qs: [i8; 32 * G],
}

impl ActG8 {
    /// Where column `j` of block `k` of the group is stored.
    pub fn at(k: usize, j: usize) -> usize {
        64 * (k / 2) + 32 * (j / 16) + 16 * (k % 2) + j % 16
    }
}

/// 8 activation blocks of 32 columns for q8_0 weights, widened to i16 and interleaved as
/// [`crate::legacy`] lays out q8_0: column pair c of the 8 blocks, in [`slot`] order, at `16c`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct ActW8 {
    /// Scales, block `k` at [`slot`]`(k)`.
    pub d: [f32; G],
    /// Values.
    pub qs: [i16; 32 * G],
}

impl ActW8 {
    /// Where column `j` of block `k` of the group is stored.
    pub fn at(k: usize, j: usize) -> usize {
        16 * (j / 2) + 2 * slot(k) + j % 2
    }
}

/// 8 activation blocks of 32 columns for q8_0 weights on VNNI (`vpdpbusd`), laid out as the
/// weights' levels are for it ([`quad_at`]): 32-byte register `j` holds in its i32 lane
/// [`slot`]`(k)` 4 columns of block `k`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct ActV8 {
    /// Scales, block `k` at [`slot`]`(k)`.
    pub d: [f32; G],
    /// `d · Σ qs` of each block, in the same order (for the offsets of q4_0, q4_1, q5_0 and
    /// q5_1, whose 512-bit kernels read this layout: `kernels::on_zmm`).
    pub s: [f32; G],
    /// `-128·Σq` of each block, in the same order: the weights' levels are offset by 128 to
    /// make them unsigned, and this takes the offset's products back out.
    pub neg: [i32; G],
    /// Values.
    pub qs: [i8; 32 * G],
}

impl ActV8 {
    /// Where column `j` of block `k` of the group is stored.
    pub fn at(k: usize, j: usize) -> usize {
        quad_at(k, j)
    }
}

/// 8 activation blocks of 32 columns for the AMX tile kernels (`kernels::on_amx`): block `k`'s
/// values in column order at `32k`, so one token's block is one 32-byte row of an A tile and
/// a token tile's rows are `size_of::<ActT8>()` apart. Scales and sums as [`ActG8`]'s, but
/// in block order.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct ActT8 {
    /// Scales, block `k` at `k`.
    pub d: [f32; G],
    /// `d · Σ qs` of each block, in the same order.
    pub s: [f32; G],
    /// Values.
    pub qs: [i8; 32 * G],
}

/// The layout of a 32-column type's activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// [`ActG8`].
    G8,
    /// [`ActW8`].
    W8,
    /// [`ActV8`].
    V8,
    /// [`ActT8`] (an expert on tiles, whatever the type); for the 256-column types, [`ActK`]
    /// with its values in column order.
    T8,
}

/// The layout 32-column type `t` reads where the VNNI encoding `vnni` (if any) runs: q8_0's
/// VNNI kernels and, with AVX512-VNNI, the unsigned 32-column types' ([`crate::vnni::runs`])
/// read [`ActV8`].
pub fn layout(t: GgmlType, vnni: Option<Vnni>) -> Layout {
    use GgmlType::*;
    match t {
        Q8_0 if vnni.is_some() => Layout::V8,
        Q8_0 => Layout::W8,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | MXFP4 | IQ4_NL if vnni == Some(Vnni::Evex) => Layout::V8,
        _ => Layout::G8,
    }
}

/// Bytes of prepared activations for `rows` tokens of `cols` columns: enough for the tile layout
/// too ([`ActT8`] is no larger than the others).
pub fn bytes(t: GgmlType, rows: usize, cols: usize, vnni: Option<Vnni>) -> usize {
    const { assert!(size_of::<ActT8>() <= size_of::<ActG8>() && size_of::<ActT8>() <= size_of::<ActV8>()) };
    layout_bytes(t, layout(t, vnni), rows, cols)
}

/// Bytes of `rows` tokens of `cols` columns prepared in `kind` (for a 32-column type).
fn layout_bytes(t: GgmlType, kind: Layout, rows: usize, cols: usize) -> usize {
    rows * match t.act() {
        ActKind::F32 => 4 * cols,
        ActKind::Q8_0 => {
            (cols / QK).div_ceil(G)
                * match kind {
                    Layout::G8 => size_of::<ActG8>(),
                    Layout::W8 => size_of::<ActW8>(),
                    Layout::V8 => size_of::<ActV8>(),
                    Layout::T8 => size_of::<ActT8>(),
                }
        }
        ActKind::Q8K => cols / QK_K * size_of::<ActK>(),
    }
}

/// Scratch [`prepare`] needs: one token row in f32.
pub fn scratch_bytes(cols: usize) -> usize {
    4 * cols
}

/// Prepare rows `rows` of `src` (`[*, cols]` bf16) into `dst`, a 32-column type's in `kind`
/// ([`layout`], or [`Layout::T8`] for an expert on tiles).
///
/// # Safety
/// AVX2, FMA and F16C must be present.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn prepare(
    t: GgmlType,
    cols: usize,
    src: &[bf16],
    rows: &[u32],
    dst: &mut [u8],
    kind: Layout,
    scratch: &mut [u8],
) {
    let n = rows.len();
    let dst = &mut dst[..layout_bytes(t, kind, n, cols)];
    let x: &mut [f32] = bytemuck::cast_slice_mut(&mut scratch[..scratch_bytes(cols)]);
    for (i, &r) in rows.iter().enumerate() {
        let row = &src[r as usize * cols..(r as usize + 1) * cols];
        for (o, v) in x.iter_mut().zip(row) {
            *o = f32::from_bits(u32::from(v.to_bits()) << 16);
        }
        match t.act() {
            ActKind::F32 => {
                let out: &mut [f32] = bytemuck::cast_slice_mut(&mut dst[4 * i * cols..4 * (i + 1) * cols]);
                out.copy_from_slice(x);
            }
            // SAFETY (all three): AVX2, FMA and F16C by this function's contract.
            ActKind::Q8_0 => match kind {
                Layout::G8 => unsafe { fill::<ActG8>(bytemuck::cast_slice_mut(dst), x, n, i) },
                Layout::W8 => unsafe { fill_wide(bytemuck::cast_slice_mut(dst), x, n, i) },
                Layout::V8 => unsafe { fill_v8(bytemuck::cast_slice_mut(dst), x, n, i) },
                Layout::T8 => unsafe { fill::<ActT8>(bytemuck::cast_slice_mut(dst), x, n, i) },
            },
            ActKind::Q8K => {
                let out: &mut [ActK] = bytemuck::cast_slice_mut(dst);
                for (b, xs) in x.chunks_exact(QK_K).enumerate() {
                    let a = &mut out[b * n + i];
                    // SAFETY (all three): AVX2 and FMA by this function's contract.
                    a.d = unsafe { amax8(xs) } / 127.0;
                    unsafe { quantize(xs, a.d, &mut a.qs) };
                    for (s, q) in a.bsums.iter_mut().zip(a.qs.chunks_exact(16)) {
                        *s = q.iter().map(|&v| i16::from(v)).sum();
                    }
                    // The tiles read them in column order.
                    if kind != Layout::T8 {
                        unsafe { crate::lanes::order_act_avx2(&mut a.qs) };
                    }
                }
            }
        }
    }
}

/// A group of 8 activation blocks in one of the 32-column layouts.
trait Group: Pod {
    /// Store block `k`: its scale, `Σ q` and values.
    fn put(&mut self, k: usize, d: f32, sum: i32, q: &[i8; QK]);
}

impl Group for ActG8 {
    fn put(&mut self, k: usize, d: f32, sum: i32, q: &[i8; QK]) {
        (self.d[slot(k)], self.s[slot(k)]) = (d, d * sum as f32);
        q.iter().enumerate().for_each(|(j, &v)| self.qs[ActG8::at(k, j)] = v);
    }
}

impl Group for ActW8 {
    fn put(&mut self, k: usize, d: f32, _sum: i32, q: &[i8; QK]) {
        self.d[slot(k)] = d;
        q.iter().enumerate().for_each(|(j, &v)| self.qs[ActW8::at(k, j)] = i16::from(v));
    }
}

impl Group for ActV8 {
    fn put(&mut self, k: usize, d: f32, sum: i32, q: &[i8; QK]) {
        (self.d[slot(k)], self.s[slot(k)], self.neg[slot(k)]) = (d, d * sum as f32, -128 * sum);
        q.iter().enumerate().for_each(|(j, &v)| self.qs[ActV8::at(k, j)] = v);
    }
}

impl Group for ActT8 {
    fn put(&mut self, k: usize, d: f32, sum: i32, q: &[i8; QK]) {
        (self.d[k], self.s[k]) = (d, d * sum as f32);
        self.qs[QK * k..QK * (k + 1)].copy_from_slice(q);
    }
}

/// Quantize token `i`'s row `x` into its groups of `out` (`[groups][n]`); the last group's
/// missing blocks are zero.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fill<A: Group>(out: &mut [A], x: &[f32], n: usize, i: usize) {
    let mut q = [0i8; QK];
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        // SAFETY (all three): AVX2, FMA and F16C by this function's contract.
        let d = unsafe { amax8(xs) } / 127.0;
        let sum = unsafe { quantize(xs, d, &mut q) };
        // The scale as Q8_0 stores it, so values equal core's Q8_0 blocks.
        out[(b / G) * n + i].put(b % G, unsafe { f16_rounded(d) }, sum, &q);
    }
    let nb = x.len() / QK;
    if nb % G != 0 {
        (nb % G..G).for_each(|k| out[(nb / G) * n + i].put(k, 0.0, 0, &[0; QK]));
    }
}

/// [`fill`] for [`ActW8`], a group at a time and in registers: each block's 16 column-pair
/// words (levels saturated to i8 as [`quantize`] stores them, then widened), then per half
/// an 8 × 8 transpose of words, so that block `k` lands in lane [`slot`]`(k)` of each pair's
/// register. Storing each value on its own, as [`fill`] does for [`ActG8`], was
/// most of the Gather.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fill_wide(out: &mut [ActW8], x: &[f32], n: usize, i: usize) {
    let nb = x.len() / QK;
    let (lo8, hi8) = (_mm256_set1_epi16(-128), _mm256_set1_epi16(127));
    for g in 0..nb.div_ceil(G) {
        let grp = &mut out[g * n + i];
        // Per slot, the block's words of pairs 0..8 and 8..16; a missing block stays zero.
        let mut words = [[_mm256_setzero_si256(); 2]; G];
        for (s, &k) in ORDER.iter().enumerate() {
            let b = g * G + k;
            if b >= nb {
                grp.d[s] = 0.0;
                continue;
            }
            let xs = &x[b * QK..(b + 1) * QK];
            // SAFETY (all three): AVX2, FMA and F16C by this function's contract.
            let d = unsafe { amax8(xs) } / 127.0;
            let v = unsafe { round32(xs, _mm256_set1_ps(inverse(d))) };
            grp.d[s] = unsafe { f16_rounded(d) };
            for h in 0..2 {
                // i16 columns in order (`packs` interleaves the 128-bit halves), clamped to i8.
                let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(v[2 * h], v[2 * h + 1]));
                words[s][h] = _mm256_max_epi16(lo8, _mm256_min_epi16(hi8, p));
            }
        }
        for h in 0..2 {
            let mut half = [_mm256_setzero_si256(); G];
            for (x, w) in half.iter_mut().zip(&words) {
                *x = w[h];
            }
            // SAFETY: AVX2 by this function's contract.
            let t = unsafe { transpose8(half) };
            for (c, t) in t.iter().enumerate() {
                // SAFETY: register `8h + c` of the 16 in `qs` (512 bytes).
                unsafe { _mm256_storeu_si256(grp.qs.as_mut_ptr().add(16 * (8 * h + c)).cast(), *t) };
            }
        }
    }
}

/// [`fill`] for [`ActV8`], a group at a time: each block quantized in column order, its bytes
/// shuffled so that word `j` holds its 4 columns of register `j`, then an 8 × 8 transpose of
/// words puts block `k` in lane [`slot`]`(k)` of each register (with a store per value, as
/// [`ActV8::put`] does, preparing them took a tenth of a q8_0 prefill's samples, now a
/// twentieth).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fill_v8(out: &mut [ActV8], x: &[f32], n: usize, i: usize) {
    let nb = x.len() / QK;
    // Per 16 columns (one 128-bit half): columns 0, 1, 4, 5, then 2, 3, 6, 7, then the same
    // of 8..16: words 2m, 2m + 1 of the half's m = 0, 1.
    let order = _mm256_setr_epi8(
        0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
    );
    let mut q = [0i8; QK];
    for g in 0..nb.div_ceil(G) {
        let grp = &mut out[g * n + i];
        let mut words = [_mm256_setzero_si256(); G];
        for (s, &k) in ORDER.iter().enumerate() {
            let b = g * G + k;
            if b >= nb {
                (grp.d[s], grp.s[s], grp.neg[s]) = (0.0, 0.0, 0);
                continue;
            }
            let xs = &x[b * QK..(b + 1) * QK];
            // SAFETY (all four): AVX2, FMA and F16C by this function's contract; q is 32 bytes.
            let d = unsafe { amax8(xs) } / 127.0;
            let sum = unsafe { quantize(xs, d, &mut q) };
            let d = unsafe { f16_rounded(d) };
            (grp.d[s], grp.s[s], grp.neg[s]) = (d, d * sum as f32, -128 * sum);
            words[s] = _mm256_shuffle_epi8(unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }, order);
        }
        // SAFETY: AVX2 by this function's contract.
        for (j, t) in unsafe { transpose8(words) }.iter().enumerate() {
            // SAFETY: register j of the 8 in `qs` (256 bytes).
            unsafe { _mm256_storeu_si256(grp.qs.as_mut_ptr().add(32 * j).cast(), *t) };
        }
    }
}

/// The 8 × 8 transpose of 32-bit words: word `c` of register `r` to word `r` of register `c`.
/// (Loops, not closures: closures lack the caller's target features.)
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose8(r: [__m256i; G]) -> [__m256i; G] {
    let mut t = [_mm256_setzero_si256(); G];
    for p in 0..G / 2 {
        // Words 0, 1, 4, 5 (lo) and 2, 3, 6, 7 (hi) of rows 2p and 2p + 1, interleaved.
        t[2 * p] = _mm256_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    let mut u = [_mm256_setzero_si256(); G];
    for q in 0..2 {
        for m in 0..2 {
            // Words (2m, 2m + 4) and (2m + 1, 2m + 5) of rows 4q..4q + 4.
            let (a, b) = (t[4 * q + m], t[4 * q + m + 2]);
            u[4 * q + 2 * m] = _mm256_unpacklo_epi64(a, b);
            u[4 * q + 2 * m + 1] = _mm256_unpackhi_epi64(a, b);
        }
    }
    let mut out = [_mm256_setzero_si256(); G];
    for c in 0..G / 2 {
        out[c] = _mm256_permute2x128_si256::<0x20>(u[c], u[4 + c]);
        out[c + 4] = _mm256_permute2x128_si256::<0x31>(u[c], u[4 + c]);
    }
    out
}

/// `d` rounded to f16 and back (Q8_0 stores its scale as f16; F16C and `half` both round to
/// nearest even).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "f16c")]
unsafe fn f16_rounded(d: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d))))
}

/// The largest `|x|` of a multiple of 8 values, as core's quantizers fold it with `f32::max`,
/// 8 lanes at a time: `max_ps` returns its second operand when either is NaN, so a NaN value
/// is skipped as `f32::max` skips it.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2")]
unsafe fn amax8(x: &[f32]) -> f32 {
    let mut m = _mm256_setzero_ps();
    for c in x.chunks_exact(8) {
        // SAFETY: 8 floats.
        let v = _mm256_andnot_ps(_mm256_set1_ps(-0.0), unsafe { _mm256_loadu_ps(c.as_ptr()) });
        m = _mm256_max_ps(v, m);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: 8 lanes into an [f32; 8].
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    lanes.iter().fold(0.0f32, |a, &v| a.max(v))
}

/// `1/d` to multiply by (0 for a zero scale: its block quantizes to zeros).
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// `roundf(x · id)` (ties away from zero) of 32 values, as i32 lanes, 8 columns a register.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn round32(xs: &[f32], id: __m256) -> [__m256i; 4] {
    assert!(xs.len() >= 32);
    let sign = _mm256_set1_ps(-0.0);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let mut i = [_mm256_setzero_si256(); 4];
    for (k, i) in i.iter_mut().enumerate() {
        // SAFETY: 8·k + 8 ≤ 32 floats, checked above.
        let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * k)) }, id);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
        let away = _mm256_or_ps(_mm256_and_ps(v, sign), one);
        let r = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), away));
        *i = _mm256_cvtps_epi32(r);
    }
    i
}

/// `q = roundf(x / d)` (ties away from zero) for a multiple of 32 values; returns `Σ q`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize(x: &[f32], d: f32, q: &mut [i8]) -> i32 {
    let id = _mm256_set1_ps(inverse(d));
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut sum = _mm256_setzero_si256();
    for (xs, qs) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
        // SAFETY: AVX2 and FMA by this function's contract.
        let i = unsafe { round32(xs, id) };
        i.iter().for_each(|&v| sum = _mm256_add_epi32(sum, v));
        let p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        // SAFETY: qs has 32 bytes.
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), _mm256_permutevar8x32_epi32(p, perm)) };
    }
    let mut lanes = [0i32; 8];
    // SAFETY: 8 i32 lanes into an [i32; 8].
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), sum) };
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use kt_core::ggml::{BlockQ8K, BlockQ8_0};
    use kt_core::rng::SplitMix64;

    use super::*;

    #[test]
    fn matches_core_quantizers_bit_for_bit() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            kt_core::skip_isa!("AVX2, FMA or F16C");
            return;
        }
        let mut r = SplitMix64::new(5);
        for scale in [1e-3f32, 1.0, 300.0] {
            // bf16 inputs, with exact ties (k + 0.5 after scaling) among them.
            let mut x: Vec<f32> = (0..512).map(|_| bf16::from_f32(r.gaussian() * scale).to_f32()).collect();
            x[0] = 127.0;
            x[1..9].copy_from_slice(&[2.5, -2.5, 0.5, -0.5, 1.5, 3.5, -126.5, 0.0]);
            let src: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            // q4_K in the lane layout and in column order (tiles); q8_0 twice: ActW8, ActV8 (two
            // tokens, the same row twice); then ActT8 (tiles); q4_0's ActV8 with AVX512-VNNI.
            let evex = Some(Vnni::Evex);
            let cases = [(GgmlType::Q4_K, None, false), (GgmlType::Q4_K, None, true), (GgmlType::Q4_0, None, false)];
            let q8 =
                [(GgmlType::Q8_0, None, false), (GgmlType::Q8_0, Some(Vnni::Vex), false), (GgmlType::Q5_1, None, true)];
            for (t, vnni, tiles) in cases.into_iter().chain(q8).chain([(GgmlType::Q4_0, evex, false)]) {
                let n = 1 + usize::from(vnni.is_some() || tiles);
                // u32 storage: the blocks hold f32s and need 4-byte alignment.
                let mut words = vec![0u32; bytes(t, n, 512, vnni) / 4];
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                // SAFETY: AVX2, FMA and F16C checked above.
                let kind = if tiles { Layout::T8 } else { layout(t, vnni) };
                unsafe { prepare(t, 512, &src, &vec![0; n], dst, kind, &mut vec![0; scratch_bytes(512)]) };
                if tiles && t == GgmlType::Q4_K {
                    // Token 1 of two, its values in column order.
                    let got: &[ActK] = bytemuck::cast_slice(dst);
                    for b in 0..512 / QK_K {
                        let (g, want) = (&got[b * n + 1], BlockQ8K::quantize(&x[256 * b..]));
                        assert_eq!((g.d, g.qs, g.bsums), (want.d, want.qs, want.bsums), "block {b}");
                    }
                } else if tiles {
                    let got: &[ActT8] = bytemuck::cast_slice(dst);
                    for b in 0..512 / 32 {
                        let (g, k) = (&got[(b / G) * n + 1], b % G);
                        let want = BlockQ8_0::quantize(&x[32 * b..]);
                        assert_eq!((&g.qs[32 * k..32 * k + 32], g.d[k]), (&want.qs[..], want.scale()), "block {b}");
                        let sum: i32 = want.qs.iter().map(|&v| i32::from(v)).sum();
                        assert_eq!(g.s[k], g.d[k] * sum as f32);
                    }
                } else if t == GgmlType::Q4_K {
                    let got: &[ActK] = bytemuck::cast_slice(dst);
                    for (b, g) in got.iter().enumerate() {
                        let mut want = BlockQ8K::quantize(&x[256 * b..]);
                        crate::lanes::order_act(&mut want.qs);
                        assert_eq!((g.d, g.qs, g.bsums), (want.d, want.qs, want.bsums), "block {b}");
                    }
                } else if layout(t, vnni) == Layout::V8 {
                    let got: &[ActV8] = bytemuck::cast_slice(dst);
                    for b in 0..512 / 32 {
                        // Group b / G of token 1 (groups are [group][token]).
                        let (g, k) = (&got[(b / G) * n + 1], b % G);
                        let want = BlockQ8_0::quantize(&x[32 * b..]);
                        let q: Vec<i8> = (0..32).map(|j| g.qs[ActV8::at(k, j)]).collect();
                        assert_eq!((&q[..], g.d[slot(k)]), (&want.qs[..], want.scale()), "block {b}");
                        let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
                        assert_eq!((g.neg[slot(k)], g.s[slot(k)]), (-128 * sum, g.d[slot(k)] * sum as f32));
                    }
                } else if layout(t, vnni) == Layout::W8 {
                    let got: &[ActW8] = bytemuck::cast_slice(dst);
                    for b in 0..512 / 32 {
                        let (g, k) = (&got[b / G], b % G);
                        let want = BlockQ8_0::quantize(&x[32 * b..]);
                        let q: Vec<i8> = (0..32).map(|j| g.qs[ActW8::at(k, j)] as i8).collect();
                        assert_eq!((&q[..], g.d[slot(k)]), (&want.qs[..], want.scale()), "block {b}");
                    }
                } else {
                    let got: &[ActG8] = bytemuck::cast_slice(dst);
                    for b in 0..512 / 32 {
                        let (g, k) = (&got[b / G], b % G);
                        let want = BlockQ8_0::quantize(&x[32 * b..]);
                        let q: Vec<i8> = (0..32).map(|j| g.qs[ActG8::at(k, j)]).collect();
                        assert_eq!((&q[..], g.d[slot(k)]), (&want.qs[..], want.scale()), "block {b}");
                        let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
                        assert_eq!(g.s[slot(k)], g.d[slot(k)] * sum as f32);
                    }
                }
            }
        }
    }
}
