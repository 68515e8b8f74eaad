//! The 256-column GGML block types as the dot kernels read them, in registers ([`KBlock`]):
//! per block the scales of each 16 columns, the mins (the integers multiplying the activation
//! sums) and the f32 scales `d`, `dmin`; per 32-column chunk its levels.
//! `value = d·sc·level − dmin·mn` per 16 columns. (The 32-column types: [`crate::legacy`].)
//!
//! Levels are unsigned (0..63) except for the types whose levels are signed (q8_0, iq4_*),
//! which the kernels multiply with the sign trick of `maddubs` (|w| times the activation given
//! w's sign).

use core::arch::x86_64::*;

use bytemuck::Pod;
use kt_core::ggml::{q3k_scales, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, KVALUES_IQ4NL};

/// A 256-column block type.
pub trait KBlock: Pod {
    /// Levels are signed.
    const SIGNED: bool;
    /// `(scales, mins, d, dmin)`: the i16 scales of each 16 columns, those of the first half
    /// of each chunk in the low lane and of the second half in the high lane ([`chunk_scales`]
    /// picks a chunk's with one shuffle), and the i16 mins of each 16 columns in order.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present.
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32);
    /// Levels of 32-column chunk `c` (0..8).
    ///
    /// # Safety
    /// As [`KBlock::prep`].
    unsafe fn chunk(&self, c: usize) -> __m256i;
}

/// f16 → f32 with F16C.
#[inline(always)]
unsafe fn h(b: [u8; 2]) -> f32 {
    // SAFETY: F16C by the callers' contract.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes(b))))) }
}

#[inline(always)]
unsafe fn load(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    // SAFETY: callers pass at least 32 bytes; AVX by their contract.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// Low nibbles of 16 bytes then their high nibbles, as 32 bytes (the 32-column nibble order).
#[inline(always)]
unsafe fn nibbles16(qs: &[u8]) -> __m256i {
    // SAFETY: 16 bytes (callers pass a block's 16-byte field); AVX2 by contract.
    unsafe {
        let x = _mm_loadu_si128(qs.as_ptr().cast());
        let m = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(x), m), _mm_and_si128(x, m))
    }
}

/// Bytes of `x` shifted right by `s` bits (s < 8), masked to `m`.
#[inline(always)]
unsafe fn bits(x: __m256i, s: usize, m: i8) -> __m256i {
    // SAFETY: AVX2 by contract.
    unsafe { _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(s as i32)), _mm256_set1_epi8(m)) }
}

/// The 16 iq4 levels in both 128-bit lanes, for `pshufb`.
#[inline(always)]
unsafe fn iq4_lut() -> __m256i {
    let k: [i8; 16] = KVALUES_IQ4NL;
    // SAFETY: 16 bytes; AVX by contract.
    unsafe {
        let l = _mm_loadu_si128(k.as_ptr().cast());
        _mm256_set_m128i(l, l)
    }
}

/// 8 per-32-column scales (bytes) as the scale vector: the same 8 in both lanes.
#[inline(always)]
unsafe fn per32(x: u64, signed: bool) -> __m256i {
    // SAFETY: AVX2 by contract.
    unsafe {
        let b = _mm_cvtsi64_si128(x as i64);
        let b = _mm_unpacklo_epi64(b, b);
        if signed {
            _mm256_cvtepi8_epi16(b)
        } else {
            _mm256_cvtepu8_epi16(b)
        }
    }
}

/// 16 per-16-column scales (bytes, in column order) as the scale vector: even groups in the
/// low lane, odd ones in the high lane.
#[inline(always)]
unsafe fn per16(x: __m128i, signed: bool) -> __m256i {
    // SAFETY: AVX2 by contract.
    unsafe {
        let split = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        if signed {
            _mm256_cvtepi8_epi16(split)
        } else {
            _mm256_cvtepu8_epi16(split)
        }
    }
}

/// 8 bytes, each twice, widened to 16 i16 (per-32 mins as per-16 ones, in column order).
#[inline(always)]
unsafe fn twice_u8(x: u64) -> __m256i {
    // SAFETY: AVX2 by contract.
    unsafe {
        let b = _mm_cvtsi64_si128(x as i64);
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b))
    }
}

/// Q4_K/Q5_K's 12 scale bytes as (8 scales, 8 mins), ggml's word-wise unpacking.
#[inline(always)]
fn k4_scales(s: &[u8; 12]) -> (u64, u64) {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc = u64::from(u0 & M1) | (u64::from((u2 & M2) | (((u0 >> 6) & M3) << 4)) << 32);
    let mn = u64::from(u1 & M1) | (u64::from(((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4)) << 32);
    (sc, mn)
}

/// `pshufb` masks picking i16 `c` of each lane, for chunk `c`.
static PICK: [[u8; 32]; 8] = {
    let mut m = [[0u8; 32]; 8];
    let mut c = 0;
    while c < 8 {
        let mut i = 0;
        while i < 32 {
            m[c][i] = (2 * c + i % 2) as u8;
            i += 1;
        }
        c += 1;
    }
    m
};

/// The i16 lanes of chunk `c`: 8 × the scale of its first 16 columns, 8 × its second's.
#[inline(always)]
pub unsafe fn chunk_scales(sv: __m256i, c: usize) -> __m256i {
    // SAFETY: AVX2 by contract; PICK[c] has 32 bytes.
    unsafe { _mm256_shuffle_epi8(sv, _mm256_loadu_si256(PICK[c].as_ptr().cast())) }
}

// SAFETY (every impl below): each unsafe fn requires AVX2/FMA/F16C (its trait's contract), and
// every load stays inside the block's own arrays.

impl KBlock for BlockQ2K {
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        unsafe {
            let x = _mm_loadu_si128(self.scales.as_ptr().cast());
            let m = _mm_set1_epi8(0x0F);
            let mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(x), m));
            (per16(_mm_and_si128(x, m), false), mn, h(self.d), h(self.dmin))
        }
    }
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> __m256i {
        unsafe { bits(load(&self.qs[32 * (c / 4)..]), 2 * (c % 4), 3) }
    }
}

impl KBlock for BlockQ3K {
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        unsafe {
            let x = _mm_loadu_si128(q3k_scales(&self.scales).as_ptr().cast());
            let d = h(self.d);
            (per16(x, true), _mm256_slli_epi16::<2>(_mm256_cvtepi8_epi16(x)), d, d)
        }
    }
    /// `lo2 + 4·hbit` (0..7); the value is that minus 4 (the min).
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> __m256i {
        unsafe {
            let lo = bits(load(&self.qs[32 * (c / 4)..]), 2 * (c % 4), 3);
            let bit = _mm256_set1_epi8((1u8 << c) as i8);
            let clear = _mm256_cmpeq_epi8(_mm256_and_si256(load(&self.hmask), bit), _mm256_setzero_si256());
            _mm256_or_si256(lo, _mm256_andnot_si256(clear, _mm256_set1_epi8(4)))
        }
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

/// Q5_K likewise.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q5KU {
    d: [u8; 2],
    dmin: [u8; 2],
    sc: [u8; 8],
    mn: [u8; 8],
    qh: [u8; 32],
    qs: [u8; 128],
}

/// The scales and mins of Q4_K/Q5_K's 12 packed bytes, one byte each.
fn unpack_k4(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (sc, mn) = k4_scales(s);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// `prep` of [`Q4KU`] and [`Q5KU`]: scales per 32 columns, mins for both 16-column halves.
#[inline(always)]
unsafe fn unpacked_prep(sc: [u8; 8], mn: [u8; 8], d: [u8; 2], dmin: [u8; 2]) -> (__m256i, __m256i, f32, f32) {
    let (sc, mn) = (u64::from_le_bytes(sc), u64::from_le_bytes(mn));
    // SAFETY: AVX2 and F16C by the callers' contract.
    unsafe { (per32(sc, false), twice_u8(mn), h(d), h(dmin)) }
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
        Q5KU { d: b.d, dmin: b.dmin, sc, mn, qh: b.qh, qs: b.qs }
    }
}

impl KBlock for Q4KU {
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        unsafe { unpacked_prep(self.sc, self.mn, self.d, self.dmin) }
    }
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> __m256i {
        unsafe { bits(load(&self.qs[32 * (c / 2)..]), 4 * (c % 2), 0x0F) }
    }
}

impl KBlock for Q5KU {
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        unsafe { unpacked_prep(self.sc, self.mn, self.d, self.dmin) }
    }
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> __m256i {
        unsafe {
            let lo = bits(load(&self.qs[32 * (c / 2)..]), 4 * (c % 2), 0x0F);
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(bits(load(&self.qh), c, 1)))
        }
    }
}

impl KBlock for BlockQ6K {
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        unsafe {
            let x = _mm_loadu_si128(self.scales.as_ptr().cast());
            let d = h(self.d);
            (per16(x, true), _mm256_slli_epi16::<5>(_mm256_cvtepi8_epi16(x)), d, d)
        }
    }
    /// 6-bit levels 0..63; the value is that minus 32 (the min).
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> __m256i {
        let (n, k) = (c / 4, c % 4);
        unsafe {
            let lo = bits(load(&self.ql[64 * n + 32 * (k % 2)..]), 4 * (k / 2), 0x0F);
            let hi = bits(load(&self.qh[32 * n..]), 2 * k, 3);
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
        }
    }
}

impl KBlock for BlockIq4Xs {
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
        let ls: [u8; 8] = core::array::from_fn(|ib| self.scale(ib) as u8);
        unsafe { (per32(u64::from_le_bytes(ls), true), _mm256_setzero_si256(), h(self.d), 0.0) }
    }
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> __m256i {
        unsafe { _mm256_shuffle_epi8(iq4_lut(), nibbles16(&self.qs[16 * c..])) }
    }
}
