//! Each weight block decoded into small integers the dot kernels read 32 at a time:
//! `value = d·sc·v − dmin·mn` per 16 columns for the 256-column types ([`DecK`]), and
//! `value = d·v + m` per 32 columns for the others ([`Dec32`]). `v` is unsigned (0..63) except
//! for the types whose levels are signed (q8_0, iq4_*), which also keep the signed `w` for the
//! sign trick of `maddubs` (|w| times the activation given w's sign).

use core::arch::x86_64::*;

use half::f16;
use kt_core::ggml::{
    q3k_scales, BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0,
    BlockQ5_1, BlockQ6K, BlockQ8_0, KVALUES_IQ4NL,
};

/// A decoded 256-column block.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct DecK {
    /// Unsigned levels (|w| for signed types).
    pub v: [u8; 256],
    /// Signed levels (signed types only).
    pub w: [i8; 256],
    /// Per 32-column chunk, the i16 scale of each of its 16 pairs' lanes: 8 × the scale of
    /// columns 0..16, 8 × that of 16..32.
    pub sc: [[i16; 16]; 8],
    /// Per 16 columns, the integer multiplying the activation sums.
    pub mn: [i16; 16],
    /// Scale of `sc`.
    pub d: f32,
    /// Scale of `mn` (subtracted).
    pub dmin: f32,
}

impl DecK {
    /// An empty buffer.
    pub fn new() -> Self {
        DecK { v: [0; 256], w: [0; 256], sc: [[0; 16]; 8], mn: [0; 16], d: 0.0, dmin: 0.0 }
    }

    /// Store the per-16-column scales `sv` as the 8 chunk vectors and the mins `mn`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scales(&mut self, sv: __m256i, mn: __m256i) {
        // Chunk c: dword c (scales 2c, 2c+1) everywhere, then the low i16 in the low lane and
        // the high i16 in the high lane.
        let pick = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
        );
        for c in 0..8 {
            let dw = _mm256_permutevar8x32_epi32(sv, _mm256_set1_epi32(c as i32));
            // SAFETY: 32-byte rows of sc and mn.
            unsafe { _mm256_storeu_si256(self.sc[c].as_mut_ptr().cast(), _mm256_shuffle_epi8(dw, pick)) };
        }
        // SAFETY: as above.
        unsafe { _mm256_storeu_si256(self.mn.as_mut_ptr().cast(), mn) };
    }
}

/// 8 bytes, each twice, widened to 16 i16 (per-32 values as per-16 ones).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn twice_u8(x: u64) -> __m256i {
    let b = _mm_cvtsi64_si128(x as i64);
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b))
}

/// Q4_K/Q5_K's 12 scale bytes as (8 scales, 8 mins), ggml's word-wise unpacking.
#[inline]
fn k4_scales(s: &[u8; 12]) -> (u64, u64) {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc = u64::from(u0 & M1) | u64::from((u2 & M2) | (((u0 >> 6) & M3) << 4)) << 32;
    let mn = u64::from(u1 & M1) | u64::from(((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4)) << 32;
    (sc, mn)
}

/// A decoded 32-column block.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct Dec32 {
    /// Unsigned levels (|w| for signed types).
    pub v: [u8; 32],
    /// Signed levels (signed types only).
    pub w: [i8; 32],
    /// Scale.
    pub d: f32,
    /// Offset per column.
    pub m: f32,
}

impl Dec32 {
    /// An empty buffer.
    pub fn new() -> Self {
        Dec32 { v: [0; 32], w: [0; 32], d: 0.0, m: 0.0 }
    }
}

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    // SAFETY: callers pass at least 32 bytes.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store(p: &mut [u8], v: __m256i) {
    debug_assert!(p.len() >= 32);
    // SAFETY: callers pass at least 32 bytes.
    unsafe { _mm256_storeu_si256(p.as_mut_ptr().cast(), v) }
}

/// Low nibbles of 16 bytes then their high nibbles, as 32 bytes (the 32-column nibble order).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles16(qs: &[u8; 16]) -> __m256i {
    // SAFETY: 16 bytes.
    let x = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let m = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(x), m), _mm_and_si128(x, m))
}

/// Bit `j` of `x` as byte `j`: 0xFF where set.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bits32(x: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Signed levels `w`: store them and their magnitudes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn signed(v: &mut [u8], w: &mut [i8], x: __m256i) {
    // SAFETY: both hold ≥ 32 bytes (callers' chunks).
    unsafe {
        store(v, _mm256_abs_epi8(x));
        store(bytemuck::cast_slice_mut(w), x);
    }
}

/// Bits `s, s+1` of each byte, moved to bits 4, 5.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn high2(qh: __m256i, s: i32) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(3)))
}

/// The 16 iq4 levels in both 128-bit lanes, for `pshufb`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq4_lut() -> __m256i {
    let k: [i8; 16] = KVALUES_IQ4NL;
    // SAFETY: 16 bytes.
    let l = unsafe { _mm_loadu_si128(k.as_ptr().cast()) };
    _mm256_set_m128i(l, l)
}

macro_rules! decoders {
    ($($(#[$m:meta])* $name:ident($b:ident: $t:ty, $o:ident: $ot:ty) { $($body:tt)* })*) => {$(
        $(#[$m])*
        /// # Safety
        /// AVX2 must be present.
        #[target_feature(enable = "avx2")]
        pub unsafe fn $name($b: &$t, $o: &mut $ot) {
            // SAFETY: AVX2 by the contract; every load and store stays inside its array.
            unsafe { $($body)* }
        }
    )*};
}

decoders! {
    /// q4_0: `d·(q − 8)` as `d·q − 8d`.
    q4_0(b: BlockQ4_0, o: Dec32) {
        store(&mut o.v, nibbles16(&b.qs));
        o.d = h(b.d);
        o.m = -8.0 * o.d;
    }
    /// q4_1: `d·q + m`.
    q4_1(b: BlockQ4_1, o: Dec32) {
        store(&mut o.v, nibbles16(&b.qs));
        (o.d, o.m) = (h(b.d), h(b.m));
    }
    /// q5_0: `d·(q − 16)`.
    q5_0(b: BlockQ5_0, o: Dec32) {
        let hi = _mm256_and_si256(bits32(u32::from_le_bytes(b.qh)), _mm256_set1_epi8(0x10));
        store(&mut o.v, _mm256_or_si256(nibbles16(&b.qs), hi));
        o.d = h(b.d);
        o.m = -16.0 * o.d;
    }
    /// q5_1: `d·q + m`.
    q5_1(b: BlockQ5_1, o: Dec32) {
        let hi = _mm256_and_si256(bits32(u32::from_le_bytes(b.qh)), _mm256_set1_epi8(0x10));
        store(&mut o.v, _mm256_or_si256(nibbles16(&b.qs), hi));
        (o.d, o.m) = (h(b.d), h(b.m));
    }
    /// q8_0: signed `d·q`.
    q8_0(b: BlockQ8_0, o: Dec32) {
        signed(&mut o.v, &mut o.w, load(bytemuck::cast_slice(&b.qs)));
        (o.d, o.m) = (h(b.d), 0.0);
    }
    /// iq4_nl: signed `d·K[q]`.
    iq4_nl(b: BlockIq4Nl, o: Dec32) {
        signed(&mut o.v, &mut o.w, _mm256_shuffle_epi8(iq4_lut(), nibbles16(&b.qs)));
        (o.d, o.m) = (h(b.d), 0.0);
    }
    /// q2_K: 2-bit levels, 4-bit scale and min per 16 columns.
    q2_k(b: BlockQ2K, o: DecK) {
        let m3 = _mm256_set1_epi8(3);
        for n in 0..2 {
            let q = load(&b.qs[32 * n..]);
            store(&mut o.v[128 * n..], _mm256_and_si256(q, m3));
            store(&mut o.v[128 * n + 32..], _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3));
            store(&mut o.v[128 * n + 64..], _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3));
            store(&mut o.v[128 * n + 96..], _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3));
        }
        let x = _mm_loadu_si128(b.scales.as_ptr().cast());
        let m = _mm_set1_epi8(0x0F);
        let mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(x), m));
        o.scales(_mm256_cvtepu8_epi16(_mm_and_si128(x, m)), mn);
        (o.d, o.dmin) = (h(b.d), h(b.dmin));
    }
    /// q3_K: `lo2 + 4·hbit` (0..7) minus 4, 6-bit signed scales per 16 columns.
    q3_k(b: BlockQ3K, o: DecK) {
        let (m3, four, hm) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4), load(&b.hmask));
        for n in 0..2 {
            let q = load(&b.qs[32 * n..]);
            for j in 0..4 {
                let lo = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j as i32)), m3);
                let bit = _mm256_set1_epi8((1u8 << (4 * n + j)) as i8);
                let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                store(&mut o.v[128 * n + 32 * j..], _mm256_or_si256(lo, _mm256_andnot_si256(clear, four)));
            }
        }
        let sv = _mm256_cvtepi8_epi16(_mm_loadu_si128(q3k_scales(&b.scales).as_ptr().cast()));
        o.scales(sv, _mm256_slli_epi16::<2>(sv));
        o.d = h(b.d);
        o.dmin = o.d;
    }
    /// q4_K: nibbles, 6-bit scale and min per 32 columns.
    q4_k(b: BlockQ4K, o: DecK) {
        let m = _mm256_set1_epi8(0x0F);
        for c in 0..4 {
            let q = load(&b.qs[32 * c..]);
            store(&mut o.v[64 * c..], _mm256_and_si256(q, m));
            store(&mut o.v[64 * c + 32..], _mm256_and_si256(_mm256_srli_epi16::<4>(q), m));
        }
        let (sc, mn) = k4_scales(&b.scales);
        o.scales(twice_u8(sc), twice_u8(mn));
        (o.d, o.dmin) = (h(b.d), h(b.dmin));
    }
    /// q5_K: nibbles plus a fifth bit, 6-bit scale and min per 32 columns.
    q5_k(b: BlockQ5K, o: DecK) {
        let (m, one) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
        let qh = load(&b.qh);
        for c in 0..4 {
            let q = load(&b.qs[32 * c..]);
            let h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32)), one);
            let h1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32 + 1)), one);
            store(&mut o.v[64 * c..], _mm256_or_si256(_mm256_and_si256(q, m), _mm256_slli_epi16::<4>(h0)));
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m);
            store(&mut o.v[64 * c + 32..], _mm256_or_si256(hi, _mm256_slli_epi16::<4>(h1)));
        }
        let (sc, mn) = k4_scales(&b.scales);
        o.scales(twice_u8(sc), twice_u8(mn));
        (o.d, o.dmin) = (h(b.d), h(b.dmin));
    }
    /// q6_K: 6-bit levels (0..63) minus 32, i8 scales per 16 columns.
    q6_k(b: BlockQ6K, o: DecK) {
        let m4 = _mm256_set1_epi8(0x0F);
        for n in 0..2 {
            let (l0, l1, qh) = (load(&b.ql[64 * n..]), load(&b.ql[64 * n + 32..]), load(&b.qh[32 * n..]));
            let lo0 = _mm256_and_si256(l0, m4);
            let lo1 = _mm256_and_si256(l1, m4);
            let hi0 = _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4);
            let hi1 = _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4);
            store(&mut o.v[128 * n..], _mm256_or_si256(lo0, high2(qh, 0)));
            store(&mut o.v[128 * n + 32..], _mm256_or_si256(lo1, high2(qh, 2)));
            store(&mut o.v[128 * n + 64..], _mm256_or_si256(hi0, high2(qh, 4)));
            store(&mut o.v[128 * n + 96..], _mm256_or_si256(hi1, high2(qh, 6)));
        }
        let sv = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.scales.as_ptr().cast()));
        o.scales(sv, _mm256_slli_epi16::<5>(sv));
        o.d = h(b.d);
        o.dmin = o.d;
    }
    /// iq4_xs: signed `K[q]`, scale `ls − 32` per 32 columns.
    iq4_xs(b: BlockIq4Xs, o: DecK) {
        let lut = iq4_lut();
        for ib in 0..8 {
            let qs: &[u8; 16] = b.qs[16 * ib..16 * ib + 16].try_into().expect("16 bytes");
            let x = _mm256_shuffle_epi8(lut, nibbles16(qs));
            signed(&mut o.v[32 * ib..], &mut o.w[32 * ib..], x);
        }
        let ls: [u8; 8] = core::array::from_fn(|ib| b.scale(ib) as u8);
        let sv = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128(i64::from_le_bytes(ls)), _mm_cvtsi64_si128(i64::from_le_bytes(ls))));
        o.scales(sv, _mm256_setzero_si256());
        (o.d, o.dmin) = (h(b.d), 0.0);
    }
}
