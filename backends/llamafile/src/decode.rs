//! The 256-column GGML block types as the dot kernels read them, in registers ([`KBlock`]):
//! per block the scales of each 16 columns, the mins (the integers multiplying the activation
//! sums) and the f32 scales `d`, `dmin`; 8 registers of levels in the lane layout of
//! [`crate::lanes`] (each the levels of one 32-column chunk as GGUF stores them, after the
//! levels were moved at load; q3_K's, q5_K's and q6_K's in planes of whole levels, [`Q3KU`],
//! [`Q5KU`], [`Q6KP`]).
//! `value = d·sc·level − dmin·mn` per 16 columns.
//! (The 32-column types: [`crate::legacy`].)
//!
//! Levels are unsigned (0..63) except for iq4_xs's and the lattice types' ([`crate::lattice`]),
//! which are signed and which the kernels multiply with the sign trick of `maddubs` (|w| times
//! the activation given w's sign), or, where the levels are small, with the activations
//! unsigned ([`KBlock::ACT_FOLD`]).

use core::arch::x86_64::*;
use core::mem::offset_of;

use bytemuck::Pod;
use kt_core::ggml::{q3k_scales, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, KVALUES_IQ4NL};

use crate::lanes::{field, Fields, Relevel, NONE, REGS};

/// A 256-column block type.
pub trait KBlock: Pod {
    /// Levels are signed.
    const SIGNED: bool;
    /// Registers whose `maddubs` pair sums may be added in i16 before the `madd` with the
    /// scales: the most that cannot overflow (FOLD · 2 · max|level| · 127 ≤ 32767).
    const FOLD: usize;
    /// `(scales, mins, d, dmin)`: the i16 scales and the i16 mins of each 16 columns, in
    /// column order (lane h of every register belongs to 16 columns h).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present.
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32);
    /// Levels of register `r` (0..8): chunk `r` as GGUF lays out its levels.
    ///
    /// # Safety
    /// As [`KBlock::prep`].
    unsafe fn reg(&self, r: usize) -> __m256i;
    /// Register `r` as `vpdpbusd`'s unsigned operand: the levels, + 128 for a signed type (the
    /// default flips each level's sign bit; iq4_xs looks its levels up so from its table).
    ///
    /// # Safety
    /// As [`KBlock::prep`].
    #[inline(always)]
    unsafe fn ureg(&self, r: usize) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            let x = self.reg(r);
            if Self::SIGNED {
                _mm256_xor_si256(x, _mm256_set1_epi8(i8::MIN))
            } else {
                x
            }
        }
    }
    /// The kernels take every register at once from [`KBlock::regs`] instead of calling
    /// [`KBlock::reg`] for each: the lattice types' levels are table lookups put in the lane
    /// layout by one transpose of all 8 registers ([`crate::lattice`]).
    const WHOLE: bool = false;
    /// Every register's levels (the default, register by register, is for completeness: the
    /// kernels call it only for [`KBlock::WHOLE`] types, which implement it).
    ///
    /// # Safety
    /// As [`KBlock::prep`].
    #[inline(always)]
    unsafe fn regs(&self) -> [__m256i; REGS] {
        // SAFETY: the caller's contract.
        unsafe { [0, 1, 2, 3, 4, 5, 6, 7].map(|r| self.reg(r)) }
    }
    /// The one-token kernel takes this type's levels in row order ([`KBlock::rows_dots`]): the
    /// lattice types, whose levels are looked up (1.1-1.4x faster than putting them in the lane
    /// layout, once their per-block fields are taken in registers, `crate::lattice`).
    const ROWS_DOT: bool = false;
    /// Tokens' dots with the block for a [`KBlock::ROWS_DOT`] type, each token's values in row
    /// order (`a[t][j]`: 16-column rows `j` and `j + 8`, [`crate::lanes::transpose`] of its
    /// lane-layout registers), `sc` the block's [`KBlock::prep`] scales and `bsums[t]` the
    /// token's sums of each 16 columns: the i32 lanes the lane-layout dot gives, without
    /// putting the levels in that layout (the one- and few-token kernels; the default, never
    /// called, is for the other types).
    ///
    /// # Safety
    /// As [`KBlock::prep`].
    #[inline(always)]
    unsafe fn rows_dots<const TN: usize>(
        &self,
        _a: &[[__m256i; REGS]; TN],
        _sc: __m256i,
        _bsums: &[__m256i; TN],
    ) -> [__m256i; TN] {
        unreachable!("rows_dots of a block type whose levels are not looked up")
    }
    /// No mins (iq4_xs, the lattice types): the kernels leave their terms out (the same bits: they
    /// would subtract exact zeros).
    const NO_MINS: bool = false;
    /// For a [`KBlock::SIGNED`] type whose levels are small enough, the registers whose pair
    /// sums may be added in i16 when the many-token kernel multiplies the activations unsigned
    /// (`a + 128`) with the signed levels (`ACT_FOLD · 2 · 255 · max|level| ≤ 32767`), taking
    /// `128·Σ level·scale` off once a block and row: no `psignb` per token, row and register.
    /// 0: the sign trick (iq4_xs, whose levels reach 127).
    const ACT_FOLD: usize = 0;
    /// The mins are in units of `d` (`dmin == d`: q3_K, q6_K), so the one-token kernel
    /// subtracts them from the dots in i32 (exact: both stay far below 2³¹) and converts and
    /// scales once.
    const MINS_IN_D: bool = false;
    /// Each level times its 16 columns' scale fits `vpdpbusd`'s unsigned byte: `Some((o, c))`
    /// where `(level − o)·scale + c` lies in 0..=255 for every level and scale (q2_K: `(0, 0)`,
    /// 0..45; q3_K: `(4, 124)`, 0..252). The 512-bit many-token kernel stores them so, scaled
    /// once a block and row, and multiplies them with each token in one `vpdpbusd` a register,
    /// where the `maddubs` pair sums took a second multiply by the scales (`vpdpwssd`); per 16
    /// columns it takes `(c − o·scale)·Σa` back out of the i32 sums, which are then the same.
    /// An offset `o` is the type's min (its mins are `o·scale`, [`KBlock::MINS_IN_D`]).
    const SCALED: Option<(i16, i16)> = None;
    /// Scales and mins cover 32 columns (q4_K, q5_K; iq4_xs, which has no mins). In the lane layout i32 lane `l` of every
    /// register holds columns of 32-column part `l` only, so the kernels sum each part's
    /// products in i32 unscaled (a `madd` with ones, or `vpdpbusd`) and scale them in f32 by
    /// [`KBlock::prep32`] ([`crate::kernels`]' `per32`): two fewer multiplies per row, token
    /// and block than a `madd` with the scales and one with the mins, and the same
    /// arithmetic for the AVX2 and the VNNI kernels.
    const PER32: bool = false;
    /// `(d·scale, dmin·min)` of each 32 columns in f32, exact (an f16 times 6 bits), for
    /// [`KBlock::PER32`] types (the default, never called, is for the others).
    ///
    /// # Safety
    /// As [`KBlock::prep`].
    #[inline(always)]
    unsafe fn prep32(&self) -> (__m256, __m256) {
        unreachable!("prep32 of a block type whose scales cover 16 columns")
    }
}

/// Register `r` of `blk`, from `whole` (its [`KBlock::regs`]) for a [`KBlock::WHOLE`] type.
///
/// # Safety
/// As [`KBlock::reg`].
#[inline(always)]
pub unsafe fn reg_of<B: KBlock>(blk: &B, whole: &[__m256i; REGS], r: usize) -> __m256i {
    if B::WHOLE {
        whole[r]
    } else {
        // SAFETY: the caller's contract (as KBlock::reg).
        unsafe { blk.reg(r) }
    }
}

/// f16 → f32 with F16C.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn h(b: [u8; 2]) -> f32 {
    // SAFETY: F16C by the callers' contract.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes(b))))) }
}

/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn load(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    // SAFETY: callers pass at least 32 bytes; AVX by their contract.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// Bytes of `x` shifted right by `s` bits (s < 8), masked to `m` (the shift is of 16-bit
/// lanes: `m` must clear the bits a byte takes from its neighbour).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn bits(x: __m256i, s: usize, m: i8) -> __m256i {
    // SAFETY: AVX2 by contract.
    unsafe { _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(s as i32)), _mm256_set1_epi8(m)) }
}

/// The 16 iq4 levels in both 128-bit lanes, for `pshufb`; with `PLUS128` each + 128, as
/// `vpdpbusd`'s unsigned operand ([`KBlock::ureg`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn iq4_lut<const PLUS128: bool>() -> __m256i {
    let k: [i8; 16] = const {
        let mut k = KVALUES_IQ4NL;
        let mut i = 0;
        while PLUS128 && i < 16 {
            k[i] ^= i8::MIN;
            i += 1;
        }
        k
    };
    // SAFETY: 16 bytes; AVX by contract.
    unsafe {
        let l = _mm_loadu_si128(k.as_ptr().cast());
        _mm256_set_m128i(l, l)
    }
}

/// 8 bytes, each twice, widened to 16 i16 (per-32 scales or mins as per-16 ones).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn twice(x: u64, signed: bool) -> __m256i {
    // SAFETY: AVX2 by contract.
    unsafe {
        let b = _mm_cvtsi64_si128(x as i64);
        let b = _mm_unpacklo_epi8(b, b);
        if signed {
            _mm256_cvtepi8_epi16(b)
        } else {
            _mm256_cvtepu8_epi16(b)
        }
    }
}

/// Q4_K/Q5_K's 12 packed scale bytes as 8 scales and 8 mins, one byte each (ggml's word-wise
/// unpacking).
fn unpack_k4(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc = u64::from(u0 & M1) | (u64::from((u2 & M2) | (((u0 >> 6) & M3) << 4)) << 32);
    let mn = u64::from(u1 & M1) | (u64::from(((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4)) << 32);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

// SAFETY (every impl below): each unsafe fn requires AVX2/FMA/F16C (its trait's contract), and
// every load stays inside the block's own arrays.

impl KBlock for BlockQ2K {
    const SIGNED: bool = false;
    const FOLD: usize = 8;
    const SCALED: Option<(i16, i16)> = Some((0, 0));
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: AVX2 (and F16C) by the inlining kernels' features; loads read this block's own
        // fields.
        unsafe {
            let x = _mm_loadu_si128(self.scales.as_ptr().cast());
            let m = _mm_set1_epi8(0x0F);
            let mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(x), m));
            (_mm256_cvtepu8_epi16(_mm_and_si128(x, m)), mn, h(self.d), h(self.dmin))
        }
    }
    #[inline(always)]
    unsafe fn reg(&self, r: usize) -> __m256i {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of `qs`
        // (bounds-checked slice).
        unsafe { bits(load(&self.qs[32 * (r / 4)..]), 2 * (r % 4), 3) }
    }
}

impl Relevel for BlockQ2K {
    fn fields(c: usize, h: usize) -> Fields {
        [field(offset_of!(Self, qs) + 32 * (c / 4) + 16 * h, 2 * (c % 4), 2), NONE, NONE]
    }
}

/// Q3_K with its 16 scales unpacked to bytes at load (4 more bytes a block: the scalar
/// unpacking per block, row and token was most of its one-token kernel) and its levels in three
/// 3-bit planes: chunks 0..3 are the low 3 bits of a plane's bytes, chunks 3..6 the next 3,
/// chunks 6 and 7 the top 2 bits of planes 0 and 1 with their third bit in plane 2's. 19
/// operations decode a block where GGUF's 2-bit planes and bit mask take about 48.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q3KU {
    q: [[u8; 32]; 3],
    sc: [i8; 16],
    d: [u8; 2],
}

impl Q3KU {
    /// From a GGUF block.
    pub fn from_block(b: &BlockQ3K) -> Self {
        crate::lanes::refield(b, Q3KU { q: [[0; 32]; 3], sc: q3k_scales(&b.scales), d: b.d })
    }
}

impl KBlock for Q3KU {
    const SIGNED: bool = false;
    const FOLD: usize = 8;
    const MINS_IN_D: bool = true;
    const SCALED: Option<(i16, i16)> = Some((4, 124));
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: AVX2 (and F16C) by the inlining kernels' features; loads read this block's own
        // fields.
        unsafe {
            let s = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.sc.as_ptr().cast()));
            let d = h(self.d);
            (s, _mm256_slli_epi16::<2>(s), d, d)
        }
    }
    /// Levels 0..7; the value is that minus 4 (the min).
    #[inline(always)]
    unsafe fn reg(&self, r: usize) -> __m256i {
        // SAFETY: AVX2 by contract; each plane is 32 bytes.
        unsafe {
            let at = |j: usize, shift: usize, m: i8| bits(load(&self.q[j]), shift, m);
            match r {
                0..3 => at(r, 0, 0x07),
                3..6 => at(r - 3, 3, 0x07),
                6 => _mm256_or_si256(at(0, 6, 0x03), at(2, 4, 0x04)),
                _ => _mm256_or_si256(at(1, 6, 0x03), at(2, 5, 0x04)),
            }
        }
    }
}

impl Relevel for Q3KU {
    fn fields(c: usize, h: usize) -> Fields {
        let at = |j: usize| offset_of!(Self, q) + 32 * j + 16 * h;
        match c {
            0..3 => [field(at(c), 0, 3), NONE, NONE],
            3..6 => [field(at(c - 3), 3, 3), NONE, NONE],
            6 => [field(at(0), 6, 2), field(at(2), 6, 1), NONE],
            _ => [field(at(1), 6, 2), field(at(2), 7, 1), NONE],
        }
    }
}

/// GGUF's q3_K layout: what [`Q3KU::from_block`] reads.
impl Relevel for BlockQ3K {
    fn fields(c: usize, h: usize) -> Fields {
        let lo = field(offset_of!(Self, qs) + 32 * (c / 4) + 16 * h, 2 * (c % 4), 2);
        [lo, field(offset_of!(Self, hmask) + 16 * h, c, 1), NONE]
    }
}

/// Q4_K with its 6-bit scales and mins unpacked to bytes at load (4 more bytes a block, no
/// per-block unpacking in the kernel).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q4KU {
    d: [u8; 2],
    dmin: [u8; 2],
    sc: [u8; 8],
    mn: [u8; 8],
    qs: [u8; 128],
}

/// Q5_K likewise, with its levels in five 5-bit planes: chunks 0..5 are the low 5 bits of a
/// plane's bytes, chunks 5..8 lie in their top 3 bits (chunk 5 in planes 0 and 1, 6 in 1..4,
/// 7 in 3 and 4). Five registers then decode in one `and`, the other three in 5, 8 and 5
/// operations: 23 for a block where GGUF's nibbles and bit plane take about 36.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q5KU {
    d: [u8; 2],
    dmin: [u8; 2],
    sc: [u8; 8],
    mn: [u8; 8],
    q: [[u8; 32]; 5],
}

/// `prep` of [`Q4KU`] and [`Q5KU`]: scales and mins per 32 columns, for both 16-column halves.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn unpacked_prep(sc: [u8; 8], mn: [u8; 8], d: [u8; 2], dmin: [u8; 2]) -> (__m256i, __m256i, f32, f32) {
    let (sc, mn) = (u64::from_le_bytes(sc), u64::from_le_bytes(mn));
    // SAFETY: AVX2 and F16C by the callers' contract.
    unsafe { (twice(sc, false), twice(mn, false), h(d), h(dmin)) }
}

/// `prep32` of [`Q4KU`] and [`Q5KU`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn unpacked_prep32(sc: [u8; 8], mn: [u8; 8], d: [u8; 2], dmin: [u8; 2]) -> (__m256, __m256) {
    // SAFETY: AVX2 and F16C by the callers' contract.
    unsafe {
        let f = |x: [u8; 8]| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(x))));
        (_mm256_mul_ps(_mm256_set1_ps(h(d)), f(sc)), _mm256_mul_ps(_mm256_set1_ps(h(dmin)), f(mn)))
    }
}

impl Q4KU {
    /// From a GGUF block.
    pub fn from_block(b: &BlockQ4K) -> Self {
        let (sc, mn) = unpack_k4(&b.scales);
        Q4KU { d: b.d, dmin: b.dmin, sc, mn, qs: b.qs }
    }
}

impl Q5KU {
    /// From a GGUF block.
    pub fn from_block(b: &BlockQ5K) -> Self {
        let (sc, mn) = unpack_k4(&b.scales);
        crate::lanes::refield(b, Q5KU { d: b.d, dmin: b.dmin, sc, mn, q: [[0; 32]; 5] })
    }
}

impl KBlock for Q4KU {
    const SIGNED: bool = false;
    const FOLD: usize = 8;
    const PER32: bool = true;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: AVX2 by the inlining kernels' features; register-only.
        unsafe { unpacked_prep(self.sc, self.mn, self.d, self.dmin) }
    }
    #[inline(always)]
    unsafe fn prep32(&self) -> (__m256, __m256) {
        // SAFETY: AVX2 by the inlining kernels' features; register-only.
        unsafe { unpacked_prep32(self.sc, self.mn, self.d, self.dmin) }
    }
    #[inline(always)]
    unsafe fn reg(&self, r: usize) -> __m256i {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of `qs`
        // (bounds-checked slice).
        unsafe { bits(load(&self.qs[32 * (r / 2)..]), 4 * (r % 2), 0x0F) }
    }
}

impl Relevel for Q4KU {
    fn fields(c: usize, h: usize) -> Fields {
        [field(offset_of!(Self, qs) + 32 * (c / 2) + 16 * h, 4 * (c % 2), 4), NONE, NONE]
    }
}

impl KBlock for Q5KU {
    const SIGNED: bool = false;
    const FOLD: usize = 4;
    const PER32: bool = true;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: AVX2 by the inlining kernels' features; register-only.
        unsafe { unpacked_prep(self.sc, self.mn, self.d, self.dmin) }
    }
    #[inline(always)]
    unsafe fn prep32(&self) -> (__m256, __m256) {
        // SAFETY: AVX2 by the inlining kernels' features; register-only.
        unsafe { unpacked_prep32(self.sc, self.mn, self.d, self.dmin) }
    }
    #[inline(always)]
    unsafe fn reg(&self, r: usize) -> __m256i {
        // SAFETY: AVX2 by contract; each plane is 32 bytes.
        unsafe {
            let at = |j: usize, shift: usize, m: i8| bits(load(&self.q[j]), shift, m);
            match r {
                0..5 => at(r, 0, 0x1F),
                5 => _mm256_or_si256(at(0, 5, 0x07), at(1, 2, 0x18)),
                6 => _mm256_or_si256(_mm256_or_si256(at(1, 7, 0x01), at(2, 4, 0x0E)), at(3, 1, 0x10)),
                _ => _mm256_or_si256(at(3, 6, 0x03), at(4, 3, 0x1C)),
            }
        }
    }
}

impl Relevel for Q5KU {
    fn fields(c: usize, h: usize) -> Fields {
        let at = |j: usize| offset_of!(Self, q) + 32 * j + 16 * h;
        match c {
            0..5 => [field(at(c), 0, 5), NONE, NONE],
            5 => [field(at(0), 5, 3), field(at(1), 5, 2), NONE],
            6 => [field(at(1), 7, 1), field(at(2), 5, 3), field(at(3), 5, 1)],
            _ => [field(at(3), 6, 2), field(at(4), 5, 3), NONE],
        }
    }
}

/// GGUF's q5_K layout: what [`Q5KU::from_block`] reads.
impl Relevel for BlockQ5K {
    fn fields(c: usize, h: usize) -> Fields {
        let lo = field(offset_of!(Self, qs) + 32 * (c / 2) + 16 * h, 4 * (c % 2), 4);
        [lo, field(offset_of!(Self, qh) + 16 * h, c, 1), NONE]
    }
}

/// Q6_K with its levels in three 6-bit planes: of each 4 chunks, chunks 0..3 are the low 6
/// bits of a plane's bytes and the fourth chunk's level lies in their top 2 bits (2 bits a
/// plane). Three registers of four then decode in one `and`, the fourth in eight operations:
/// 11 for four where GGUF's nibble and 2-bit planes take 17 (q6_K decoding was throughput
/// bound on these). Same size as GGUF's block.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q6KP {
    /// The planes of chunks 0..4 and 4..8.
    q: [[u8; 96]; 2],
    scales: [i8; 16],
    d: [u8; 2],
}

impl Q6KP {
    /// From a GGUF block.
    pub fn from_block(b: &BlockQ6K) -> Self {
        crate::lanes::refield(b, Q6KP { q: [[0; 96]; 2], scales: b.scales, d: b.d })
    }
}

impl KBlock for Q6KP {
    const SIGNED: bool = false;
    const FOLD: usize = 2;
    const MINS_IN_D: bool = true;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: AVX2 (and F16C) by the inlining kernels' features; loads read this block's own
        // fields.
        unsafe {
            let x = _mm_loadu_si128(self.scales.as_ptr().cast());
            let d = h(self.d);
            let s = _mm256_cvtepi8_epi16(x);
            (s, _mm256_slli_epi16::<5>(s), d, d)
        }
    }
    /// 6-bit levels 0..63; the value is that minus 32 (the min).
    #[inline(always)]
    unsafe fn reg(&self, r: usize) -> __m256i {
        let (half, j) = (r / 4, r % 4);
        // SAFETY: AVX2 by contract; plane j is 32 of the 96 bytes.
        unsafe {
            let at = |j: usize, shift: usize, m: i8| bits(load(&self.q[half][32 * j..]), shift, m);
            if j < 3 {
                return at(j, 0, 0x3F);
            }
            // Plane j's top bits are bits 2j..2j + 2 of the level ([`bits`] shifts 16-bit
            // lanes: the bits a byte takes from its neighbour are masked off).
            _mm256_or_si256(_mm256_or_si256(at(0, 6, 0x03), at(1, 4, 0x0C)), at(2, 2, 0x30))
        }
    }
}

impl Relevel for Q6KP {
    fn fields(c: usize, h: usize) -> Fields {
        let (m, j) = (c / 4, c % 4);
        let at = |j: usize| offset_of!(Self, q) + 96 * m + 32 * j + 16 * h;
        if j < 3 {
            [field(at(j), 0, 6), NONE, NONE]
        } else {
            [field(at(0), 6, 2), field(at(1), 6, 2), field(at(2), 6, 2)]
        }
    }
}

/// GGUF's q6_K layout: what [`Q6KP::from_block`] reads.
impl Relevel for BlockQ6K {
    fn fields(c: usize, h: usize) -> Fields {
        let (n, k) = (c / 4, c % 4);
        let lo = field(offset_of!(Self, ql) + 64 * n + 32 * (k % 2) + 16 * h, 4 * (k / 2), 4);
        [lo, field(offset_of!(Self, qh) + 32 * n + 16 * h, 2 * k, 2), NONE]
    }
}

/// IQ4_XS with its 8 scales unpacked to bytes at load (2 more bytes a block: the scalar
/// unpacking per block, row and token was most of its one-token kernel) and its nibbles paired
/// as Q4_K's: a 32-byte load gives two registers (an `and`, or a shift and an `and`) where
/// GGUF's 16 bytes a chunk take a load, two operations and an insert each.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Iq4XsU {
    d: [u8; 2],
    sc: [u8; 8],
    qs: [u8; 128],
}

impl Iq4XsU {
    /// From a GGUF block.
    pub fn from_block(b: &BlockIq4Xs) -> Self {
        let sc = core::array::from_fn(|ib| b.scale(ib) as u8);
        crate::lanes::refield(b, Iq4XsU { d: b.d, sc, qs: [0; 128] })
    }
}

impl KBlock for Iq4XsU {
    const SIGNED: bool = true;
    const FOLD: usize = 1;
    const PER32: bool = true;
    const NO_MINS: bool = true;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: AVX2 (and F16C) by the inlining kernels' features; loads read this block's own
        // fields.
        unsafe { (twice(u64::from_le_bytes(self.sc), true), _mm256_setzero_si256(), h(self.d), 0.0) }
    }
    #[inline(always)]
    unsafe fn prep32(&self) -> (__m256, __m256) {
        // SAFETY: AVX2 (and F16C) by the inlining kernels' features; loads read this block's own
        // fields.
        unsafe {
            let sc = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(self.sc)));
            (_mm256_mul_ps(_mm256_set1_ps(h(self.d)), _mm256_cvtepi32_ps(sc)), _mm256_setzero_ps())
        }
    }
    #[inline(always)]
    unsafe fn reg(&self, r: usize) -> __m256i {
        // SAFETY: forwarded: `lookup` needs what this method does.
        unsafe { self.lookup::<false>(r) }
    }
    #[inline(always)]
    unsafe fn ureg(&self, r: usize) -> __m256i {
        // SAFETY: forwarded: `lookup` needs what this method does.
        unsafe { self.lookup::<true>(r) }
    }
}

impl Iq4XsU {
    /// Register `r`'s levels from the table, + 128 with `PLUS128` ([`iq4_lut`]).
    ///
    /// # Safety
    /// AVX2 (inlined into kernels that enable it).
    #[inline(always)]
    unsafe fn lookup<const PLUS128: bool>(&self, r: usize) -> __m256i {
        // SAFETY: AVX2 by the contract; `r < 8`, so the 32 bytes lie inside `qs`.
        unsafe { _mm256_shuffle_epi8(iq4_lut::<PLUS128>(), bits(load(&self.qs[32 * (r / 2)..]), 4 * (r % 2), 0x0F)) }
    }
}

impl Relevel for Iq4XsU {
    fn fields(c: usize, h: usize) -> Fields {
        [field(offset_of!(Self, qs) + 32 * (c / 2) + 16 * h, 4 * (c % 2), 4), NONE, NONE]
    }
}

/// GGUF's iq4_xs layout: what [`Iq4XsU::from_block`] reads.
impl Relevel for BlockIq4Xs {
    fn fields(c: usize, h: usize) -> Fields {
        [field(offset_of!(Self, qs) + 16 * c, 4 * h, 4), NONE, NONE]
    }
}
