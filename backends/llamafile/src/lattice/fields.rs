//! A lattice block's per-group fields for the one-token kernel, all of a block's at once in
//! registers: the sign byte (or iq1's shift) of each 8-column group and the scale of each 16
//! columns, which [`Lattice`] gives one at a time (as scalar code, a lookup or a dozen
//! operations each: most of a one-token block's work). ggml's even-parity sign bytes of 7
//! stored bits get their eighth bit from two nibble lookups of the parity.

use core::arch::x86_64::*;

use kt_core::ggml::{
    BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs, Lattice, IQ1S_GRID8, IQ2S_GRID,
    IQ2XS_GRID, IQ3S_GRID,
};

/// The fields in registers.
///
/// # Safety (each fn)
/// The CPU has AVX2 (the callers' target features: every fn is inlined).
pub trait Fields: Lattice {
    /// One scale per 32 columns (both of a group's [`Fields::scales`] lanes hold it).
    const SCALE32: bool;
    /// The block's grid indices, all at once, where they are put together from bit fields
    /// (a shift, a mask and an or each, one at a time); `()` where each is a byte or a u16's
    /// low bits as stored.
    type Indices: Copy;
    /// The block's [`Fields::Indices`].
    unsafe fn indices(&self) -> Self::Indices;
    /// [`Lattice::grid`] of group `g`, by the block's [`Fields::indices`].
    fn grid_of(&self, ix: &Self::Indices, g: usize) -> u64;
    /// The levels are taken unsigned ([`Fields::unsigned_grid_of`]: iq1_s's −8, 0, 8 as 0, 8,
    /// 16, one `vpmaddubsw` where signed levels take three operations) and the group's
    /// [`Fields::offsets`] times the token's sum of its columns added to their dot, exactly.
    const OFFSET: bool = false;
    /// [`Fields::grid_of`] plus 8 in each byte (an [`Fields::OFFSET`] type's).
    #[inline(always)]
    fn unsigned_grid_of(&self, ix: &Self::Indices, g: usize) -> u64 {
        self.grid_of(ix, g)
    }
    /// i16 lane `h`: [`Lattice::shift`] − 8 of columns `16h..16h + 16` (an [`Fields::OFFSET`]
    /// type's; one shift per 16 columns).
    #[inline(always)]
    unsafe fn offsets(&self) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_setzero_si256() }
    }
    /// Byte `g`: 8-column group `g`'s sign byte ([`Lattice::signs`]), or for a type without
    /// signs its shift ([`Lattice::shift`]) as a byte.
    unsafe fn group_bytes(&self) -> __m256i;
    /// i16 lane `h`: the scale of columns `16h..16h + 16` ([`Lattice::scale`]).
    unsafe fn scales(&self) -> __m256i;
}

/// iq1_s's and iq1_m's grid entries (−8, 0, 8 a byte) plus 8 in each byte.
static IQ1S_GRID_U: [u64; 2048] = {
    let mut t = [0u64; 2048];
    let mut i = 0;
    while i < 2048 {
        let mut k = 0;
        while k < 8 {
            let level = (IQ1S_GRID8[i] >> (8 * k)) as u8 as i8;
            t[i] |= ((level + 8) as u64) << (8 * k);
            k += 1;
        }
        i += 1;
    }
    t
};

/// [`Fields::Indices`] of a type whose grid index is a byte or a u16's low bits as stored:
/// none kept, each lookup [`Lattice::grid`].
macro_rules! plain_indices {
    () => {
        type Indices = ();
        #[inline(always)]
        unsafe fn indices(&self) {}
        #[inline(always)]
        fn grid_of(&self, _: &(), g: usize) -> u64 {
            self.grid(g)
        }
    };
}

/// `2n + 1` in each i16 lane: the lattice types' scale of a field `n`.
#[inline(always)]
unsafe fn odd(n: __m256i) -> __m256i {
    // SAFETY: register operations.
    unsafe { _mm256_or_si256(_mm256_slli_epi16::<1>(n), _mm256_set1_epi16(1)) }
}

/// Scales of the types with a u32 per 32 columns whose top nibble is the scale field (iq2_xxs,
/// iq3_xxs): each field in both of its 16-column lanes.
#[inline(always)]
unsafe fn top_nibble_scales(words: __m256i) -> __m256i {
    // SAFETY: register operations.
    unsafe {
        let n = _mm256_srli_epi32::<28>(words);
        odd(_mm256_or_si256(n, _mm256_slli_epi32::<16>(n)))
    }
}

/// Scales from 16 nibbles, low nibble first (iq2_xs, iq2_s).
#[inline(always)]
unsafe fn nibble_scales(p: &[u8; 8]) -> __m256i {
    // SAFETY: 8 bytes read; register operations.
    unsafe {
        let x = _mm_loadl_epi64(p.as_ptr().cast());
        let m = _mm_set1_epi8(0x0F);
        let n = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16::<4>(x), m));
        odd(_mm256_cvtepu8_epi16(n))
    }
}

/// Each byte's low 7 bits with ggml's eighth sign bit: set where the 7 have an odd count
/// ([`kt_core::ggml::KSIGNS`]); the other bits of `x` must be clear.
#[inline(always)]
unsafe fn even_parity(x: __m256i) -> __m256i {
    // SAFETY: register operations.
    unsafe {
        // 0x80 for the nibbles of odd parity.
        let odd = _mm256_setr_epi8(
            0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0, 0, -128, -128, 0, -128, 0, 0, -128,
            -128, 0, 0, -128, 0, -128, -128, 0,
        );
        let m = _mm256_set1_epi8(0x0F);
        let lo = _mm256_shuffle_epi8(odd, _mm256_and_si256(x, m));
        let hi = _mm256_shuffle_epi8(odd, _mm256_and_si256(_mm256_srli_epi16::<4>(x), m));
        _mm256_or_si256(x, _mm256_xor_si256(lo, hi))
    }
}

/// The 8 u32 of signs and scale of iq2_xxs's 32-column groups, which alternate with the grid
/// words in its `qs`.
#[inline(always)]
unsafe fn iq2xxs_words(qs: &[u8; 64]) -> __m256i {
    // SAFETY: 64 bytes read; register operations.
    unsafe {
        let (a, b) = (_mm256_loadu_ps(qs.as_ptr().cast()), _mm256_loadu_ps(qs.as_ptr().add(32).cast()));
        // Per half: words 1 and 3 of `a`, then of `b`: groups 0, 1, 4, 5 | 2, 3, 6, 7.
        let w = _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(a, b));
        _mm256_permute4x64_epi64::<0b11_01_10_00>(w)
    }
}

/// The four 7-bit sign fields of each u32 (bits 0-27), one a byte, with their eighth bits.
#[inline(always)]
unsafe fn seven_bit_signs(w: __m256i) -> __m256i {
    // SAFETY: register operations.
    unsafe {
        // Field k (bits 7k..7k + 7) to byte k: shifted left by k. (No closure: it would not
        // inherit the caller's target features.)
        let f0 = _mm256_and_si256(w, _mm256_set1_epi32(0x7F));
        let f1 = _mm256_and_si256(_mm256_slli_epi32::<1>(w), _mm256_set1_epi32(0x7F << 8));
        let f2 = _mm256_and_si256(_mm256_slli_epi32::<2>(w), _mm256_set1_epi32(0x7F << 16));
        let f3 = _mm256_and_si256(_mm256_slli_epi32::<3>(w), _mm256_set1_epi32(0x7F << 24));
        let b = _mm256_or_si256(_mm256_or_si256(f0, f1), _mm256_or_si256(f2, f3));
        even_parity(b)
    }
}

impl Fields for BlockIq2Xxs {
    const SCALE32: bool = true;
    plain_indices!();
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: the trait's contract.
        unsafe { seven_bit_signs(iq2xxs_words(&self.qs)) }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: the trait's contract.
        unsafe { top_nibble_scales(iq2xxs_words(&self.qs)) }
    }
}

impl Fields for BlockIq3Xxs {
    const SCALE32: bool = true;
    plain_indices!();
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: 32 bytes; the trait's contract.
        unsafe { seven_bit_signs(_mm256_loadu_si256(self.scales_signs.as_ptr().cast())) }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: 32 bytes; the trait's contract.
        unsafe { top_nibble_scales(_mm256_loadu_si256(self.scales_signs.as_ptr().cast())) }
    }
}

impl Fields for BlockIq2Xs {
    const SCALE32: bool = false;
    type Indices = [u16; 32];
    #[inline(always)]
    unsafe fn indices(&self) -> [u16; 32] {
        let mut ix = [0u16; 32];
        // SAFETY: 64 bytes read, 64 stored; register operations.
        unsafe {
            // Each group's u16, its 7 sign bits cleared off the 9-bit index.
            let m = _mm256_set1_epi16(511);
            for h in 0..2 {
                let q = _mm256_loadu_si256(self.qs[32 * h..].as_ptr().cast());
                _mm256_storeu_si256(ix[16 * h..].as_mut_ptr().cast(), _mm256_and_si256(q, m));
            }
        }
        ix
    }
    #[inline(always)]
    fn grid_of(&self, ix: &[u16; 32], g: usize) -> u64 {
        IQ2XS_GRID[usize::from(ix[g] & 511)]
    }
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: 64 bytes; the trait's contract.
        unsafe {
            // Each group's u16 holds its 7 sign bits above a 9-bit grid index.
            let a = _mm256_srli_epi16::<9>(_mm256_loadu_si256(self.qs.as_ptr().cast()));
            let b = _mm256_srli_epi16::<9>(_mm256_loadu_si256(self.qs.as_ptr().add(32).cast()));
            // (The pack interleaves the halves' 8-byte runs: a0 b0 a1 b1.)
            let bytes = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(a, b));
            even_parity(bytes)
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: the trait's contract.
        unsafe { nibble_scales(&self.scales) }
    }
}

impl Fields for BlockIq2S {
    const SCALE32: bool = false;
    type Indices = [u16; 32];
    #[inline(always)]
    unsafe fn indices(&self) -> [u16; 32] {
        let mut ix = [0u16; 32];
        // SAFETY: 16 bytes of `qs` and 4 of `qh` a step, 32 bytes stored; register operations.
        unsafe {
            // Index g: byte g of `qs`, bits 2(g % 4), 2(g % 4) + 1 of `qh[g / 4]` above it:
            // that byte in word g, shifted by a multiply to bits 8-9.
            let byte = _mm256_setr_epi8(
                0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 1, -1, 1, -1, 1, -1, 2, -1, 2, -1, 2, -1, 2, -1, 3, -1, 3, -1, 3,
                -1, 3, -1,
            );
            let up = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
            for m in 0..2 {
                let low = _mm256_cvtepu8_epi16(_mm_loadu_si128(self.qs[16 * m..].as_ptr().cast()));
                let qh = [self.qh[4 * m], self.qh[4 * m + 1], self.qh[4 * m + 2], self.qh[4 * m + 3]];
                let q = _mm256_set1_epi32(i32::from_le_bytes(qh));
                let high =
                    _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(q, byte), up), _mm256_set1_epi16(0x300));
                _mm256_storeu_si256(ix[16 * m..].as_mut_ptr().cast(), _mm256_or_si256(low, high));
            }
        }
        ix
    }
    #[inline(always)]
    fn grid_of(&self, ix: &[u16; 32], g: usize) -> u64 {
        IQ2S_GRID[usize::from(ix[g] & 1023)]
    }
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: 32 bytes.
        unsafe { _mm256_loadu_si256(self.signs.as_ptr().cast()) }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: the trait's contract.
        unsafe { nibble_scales(&self.scales) }
    }
}

impl Fields for BlockIq3S {
    const SCALE32: bool = true;
    type Indices = [u16; 64];
    #[inline(always)]
    unsafe fn indices(&self) -> [u16; 64] {
        let mut ix = [0u16; 64];
        // SAFETY: 16 bytes of `qs` and 2 of `qh` a step, 32 bytes stored; register operations.
        unsafe {
            // Index j: byte j of `qs` and bit j of `qh` (as a little-endian bit string) above it.
            let bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
            for m in 0..4 {
                let low = _mm256_cvtepu8_epi16(_mm_loadu_si128(self.qs[16 * m..].as_ptr().cast()));
                let h = _mm256_set1_epi16(i16::from_le_bytes([self.qh[2 * m], self.qh[2 * m + 1]]));
                let high = _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, bit), bit), _mm256_set1_epi16(256));
                _mm256_storeu_si256(ix[16 * m..].as_mut_ptr().cast(), _mm256_or_si256(low, high));
            }
        }
        ix
    }
    #[inline(always)]
    fn grid_of(&self, ix: &[u16; 64], g: usize) -> u64 {
        let at = |i: usize| u64::from(IQ3S_GRID[usize::from(ix[i] & 511)]);
        at(2 * g) | at(2 * g + 1) << 32
    }
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: 32 bytes.
        unsafe { _mm256_loadu_si256(self.signs.as_ptr().cast()) }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: 4 bytes read; register operations.
        unsafe {
            // 8 nibbles, one per 32 columns: each in two bytes, then widened.
            let x = _mm_cvtsi32_si128(i32::from_le_bytes(self.scales));
            let m = _mm_set1_epi8(0x0F);
            let n = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16::<4>(x), m));
            odd(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(n, n)))
        }
    }
}

impl Fields for BlockIq1S {
    const SCALE32: bool = true;
    type Indices = [u32; 32];
    #[inline(always)]
    unsafe fn indices(&self) -> [u32; 32] {
        let mut ix = [0u32; 32];
        // SAFETY: 16 bytes of `qh`, 8 of `qs` a step, 32 bytes stored; register operations.
        unsafe {
            // Index g: byte g of `qs`, bits 3(g % 4) to 3(g % 4) + 2 of u16 g / 4 of `qh` above it.
            let words = _mm256_cvtepu16_epi32(_mm_loadu_si128(self.qh.as_ptr().cast()));
            let shifts = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9);
            for m in 0..4 {
                let at = _mm256_setr_epi32(
                    2 * m as i32,
                    2 * m as i32,
                    2 * m as i32,
                    2 * m as i32,
                    2 * m as i32 + 1,
                    2 * m as i32 + 1,
                    2 * m as i32 + 1,
                    2 * m as i32 + 1,
                );
                let w = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(words, at), shifts);
                let high = _mm256_slli_epi32::<8>(_mm256_and_si256(w, _mm256_set1_epi32(7)));
                let low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(self.qs[8 * m..].as_ptr().cast()));
                _mm256_storeu_si256(ix[8 * m..].as_mut_ptr().cast(), _mm256_or_si256(low, high));
            }
        }
        ix
    }
    #[inline(always)]
    fn grid_of(&self, ix: &[u32; 32], g: usize) -> u64 {
        IQ1S_GRID8[ix[g] as usize & 2047]
    }
    const OFFSET: bool = true;
    #[inline(always)]
    fn unsigned_grid_of(&self, ix: &[u32; 32], g: usize) -> u64 {
        IQ1S_GRID_U[ix[g] as usize & 2047]
    }
    #[inline(always)]
    unsafe fn offsets(&self) -> __m256i {
        // SAFETY: 16 bytes; register operations.
        unsafe {
            // Bit 15 of each 32 columns' u16: −1 − 8 where set, else 1 − 8, in both its lanes.
            let qh = _mm_loadu_si128(self.qh.as_ptr().cast());
            let s = _mm_sub_epi16(_mm_slli_epi16::<1>(_mm_srai_epi16::<15>(qh)), _mm_set1_epi16(7));
            _mm256_set_m128i(_mm_unpackhi_epi16(s, s), _mm_unpacklo_epi16(s, s))
        }
    }
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: 16 bytes; register operations.
        unsafe {
            // Bit 15 of each 32 columns' u16: −1 where set, else +1, in its 4 groups' bytes.
            let qh = _mm_loadu_si128(self.qh.as_ptr().cast());
            let s = _mm_or_si128(_mm_slli_epi16::<1>(_mm_srai_epi16::<15>(qh)), _mm_set1_epi16(1));
            let b = _mm256_broadcastsi128_si256(_mm_packs_epi16(s, s));
            _mm256_shuffle_epi8(
                b,
                _mm256_setr_epi8(
                    0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
                ),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: 16 bytes; register operations.
        unsafe {
            // Bits 12-14 of each 32 columns' u16, in both of its 16-column lanes.
            let n = _mm_and_si128(_mm_srli_epi16::<12>(_mm_loadu_si128(self.qh.as_ptr().cast())), _mm_set1_epi16(7));
            odd(_mm256_set_m128i(_mm_unpackhi_epi16(n, n), _mm_unpacklo_epi16(n, n)))
        }
    }
}

impl Fields for BlockIq1M {
    const SCALE32: bool = false;
    type Indices = [u16; 32];
    #[inline(always)]
    unsafe fn indices(&self) -> [u16; 32] {
        let mut ix = [0u16; 32];
        // SAFETY: 16 bytes of `qh` and of `qs` read, 32 bytes stored a half; register operations.
        unsafe {
            // Index g: byte g of `qs`, the low 3 bits of nibble g of `qh` (low nibble first) above it.
            let x = _mm_loadu_si128(self.qh.as_ptr().cast());
            let m = _mm_set1_epi8(7);
            let (lo, hi) = (_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16::<4>(x), m));
            let nibbles = [_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)];
            for (h, n) in nibbles.into_iter().enumerate() {
                let low = _mm256_cvtepu8_epi16(_mm_loadu_si128(self.qs[16 * h..].as_ptr().cast()));
                let high = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(n));
                _mm256_storeu_si256(ix[16 * h..].as_mut_ptr().cast(), _mm256_or_si256(low, high));
            }
        }
        ix
    }
    #[inline(always)]
    fn grid_of(&self, ix: &[u16; 32], g: usize) -> u64 {
        IQ1S_GRID8[usize::from(ix[g] & 2047)]
    }
    #[inline(always)]
    unsafe fn group_bytes(&self) -> __m256i {
        // SAFETY: 16 bytes; register operations.
        unsafe {
            // Bit 3 of each group's nibble, low nibble first: −1 where set, else +1.
            let qh = _mm_loadu_si128(self.qh.as_ptr().cast());
            let m = _mm_set1_epi8(0x08);
            let (lo, hi) = (_mm_and_si128(qh, m), _mm_and_si128(_mm_srli_epi16::<4>(qh), m));
            let bits = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
            _mm256_or_si256(_mm256_cmpeq_epi8(bits, _mm256_set1_epi8(0x08)), _mm256_set1_epi8(1))
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> __m256i {
        // SAFETY: 8 bytes read; register operations.
        unsafe {
            // Four 3-bit fields a u16: each u16 in its four lanes, field k shifted to the top
            // (a multiply by 2^(13 − 3k)) and down to the bottom.
            let x = _mm256_broadcastsi128_si256(_mm_loadl_epi64(self.scales.as_ptr().cast()));
            let words = _mm256_shuffle_epi8(
                x,
                _mm256_setr_epi8(
                    0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7,
                ),
            );
            let up = _mm256_mullo_epi16(
                words,
                _mm256_setr_epi16(
                    1 << 13,
                    1 << 10,
                    1 << 7,
                    1 << 4,
                    1 << 13,
                    1 << 10,
                    1 << 7,
                    1 << 4,
                    1 << 13,
                    1 << 10,
                    1 << 7,
                    1 << 4,
                    1 << 13,
                    1 << 10,
                    1 << 7,
                    1 << 4,
                ),
            );
            odd(_mm256_srli_epi16::<13>(up))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of random bytes (every field of every type takes any bit pattern), all zeros and
    /// all ones.
    fn blocks<B: Lattice>() -> Vec<B> {
        let mut rng = kt_core::rng::SplitMix64::new(17);
        let mut raw: Vec<Vec<u8>> = vec![vec![0; size_of::<B>()], vec![0xFF; size_of::<B>()]];
        raw.extend((0..64).map(|_| (0..size_of::<B>()).map(|_| rng.next_u64() as u8).collect()));
        raw.iter().map(|b| bytemuck::pod_read_unaligned(b)).collect()
    }

    /// Each field in registers equals [`Lattice`]'s scalar definition.
    fn check<B: Fields>(name: &str) {
        for (i, b) in blocks::<B>().iter().enumerate() {
            let (mut bytes, mut scales, mut offsets) = ([0u8; 32], [0i16; 16], [0i16; 16]);
            // SAFETY: AVX2 checked by the caller; 32 bytes each.
            let ix = unsafe {
                _mm256_storeu_si256(bytes.as_mut_ptr().cast(), b.group_bytes());
                _mm256_storeu_si256(offsets.as_mut_ptr().cast(), b.offsets());
                _mm256_storeu_si256(scales.as_mut_ptr().cast(), b.scales());
                b.indices()
            };
            for (g, &got) in bytes.iter().enumerate() {
                let want = if B::SIGNS { b.signs(g) } else { b.shift(g) as u8 };
                assert_eq!(got, want, "{name} block {i} group {g}: sign or shift byte");
                assert_eq!(b.grid_of(&ix, g), b.grid(g), "{name} block {i} group {g}: grid entry");
                if B::OFFSET {
                    let plus8 = b.grid(g).to_le_bytes().map(|l| (l as i8 + 8) as u8);
                    assert_eq!(b.unsigned_grid_of(&ix, g).to_le_bytes(), plus8, "{name} block {i} group {g}");
                    assert_eq!(offsets[g / 2], i16::from(b.shift(g)) - 8, "{name} block {i} group {g}: offset");
                }
            }
            for (h, &got) in scales.iter().enumerate() {
                assert_eq!(got, i16::from(b.scale(h)), "{name} block {i} scale {h}");
                if B::SCALE32 {
                    assert_eq!(b.scale(h), b.scale(h ^ 1), "{name}: one scale per 32 columns");
                }
            }
        }
    }

    #[test]
    fn fields_in_registers_are_the_scalar_ones() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            kt_core::skip_isa!("AVX2");
            return;
        }
        check::<BlockIq1S>("iq1_s");
        check::<BlockIq1M>("iq1_m");
        check::<BlockIq2Xxs>("iq2_xxs");
        check::<BlockIq2Xs>("iq2_xs");
        check::<BlockIq2S>("iq2_s");
        check::<BlockIq3Xxs>("iq3_xxs");
        check::<BlockIq3S>("iq3_s");
    }
}
