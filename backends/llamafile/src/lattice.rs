//! The lattice types (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s) as [`KBlock`]s.
//! Their levels are table lookups, not bit fields, so they stay as GGUF stores them and are
//! put in the lane layout of [`crate::lanes`] as they are decoded: each 16-column row of the
//! block is two 8-column grid entries, a row and the row 8 below fill a register (four u64
//! lookups, their sign bits applied in one `psignb` or iq1's shift in one `paddb`), and one
//! [`transpose`] gives the registers. Levels are signed; scales are the types' integers `m`
//! per 16 columns and `d·2^-SHIFT` the block's f32 scale, as core's [`Lattice`] defines the
//! values.

use core::arch::x86_64::*;

use kt_core::ggml::{
    BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs, Lattice, KSIGNS,
};

use crate::decode::KBlock;
use crate::kernels::pair_sums;
use crate::lanes::{transpose, REGS};

/// The most registers whose pair sums fit in i16 when added: `fold · 2 · max|level| · 127 ≤
/// 32767`, a power of two up to 8.
const fn fold(max_level: u8) -> usize {
    let mut f = 8;
    while f > 1 && f * 2 * max_level as usize * 127 > 32767 {
        f /= 2;
    }
    f
}

/// Byte `k` of `s` (a byte of each of a register's four 8-column groups: low half 0, 1; high
/// half 2, 3) in each byte of its group.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn spread(s: u32) -> __m256i {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let at = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        _mm256_shuffle_epi8(_mm256_set1_epi32(s as i32), at)
    }
}

/// ±1 per byte: -1 for the columns whose bit is set in their group's sign byte in `s`
/// ([`spread`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn sign_vector(s: u32) -> __m256i {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let bytes = spread(s);
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let neg = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        _mm256_or_si256(neg, _mm256_set1_epi8(1))
    }
}

/// The block's registers in the lane layout ([`KBlock::regs`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn regs<L: Lattice>(b: &L) -> [__m256i; REGS] {
    let (mut lv, mut sg) = ([0u64; 32], [0u8; 32]);
    b.groups(&mut lv, &mut sg);
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let mut y = [_mm256_setzero_si256(); 8];
        for (j, y) in y.iter_mut().enumerate() {
            // Row j (groups 2j, 2j + 1) in the low half, row j + 8 in the high one.
            let g = [2 * j, 2 * j + 1, 2 * j + 16, 2 * j + 17];
            let v = _mm256_set_epi64x(lv[g[3]] as i64, lv[g[2]] as i64, lv[g[1]] as i64, lv[g[0]] as i64);
            let s = u32::from_le_bytes([sg[g[0]], sg[g[1]], sg[g[2]], sg[g[3]]]);
            *y = if L::SIGNS { _mm256_sign_epi8(v, sign_vector(s)) } else { _mm256_add_epi8(v, spread(s)) };
        }
        transpose(y)
    }
}

/// ±1 in each byte of a sign byte's 8 columns (−1 where its bit is set): a register's signs
/// in four loads.
static SIGN_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut s = 0;
    while s < 256 {
        let mut k = 0;
        while k < 8 {
            t[s] |= (if s >> k & 1 == 1 { 0xFF } else { 0x01 }) << (8 * k);
            k += 1;
        }
        s += 1;
    }
    t
};

/// [`SIGN_BYTES`] of ggml's even-parity sign byte of 7 stored bits (`Lattice::sign_bits`):
/// one lookup where two would be.
static EVEN_SIGN_BYTES: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = SIGN_BYTES[KSIGNS[i] as usize];
        i += 1;
    }
    t
};

/// Row `j`'s (and row `j + 8`'s) products with one token's values `a` in row order, summed in
/// pairs and scaled: the levels stay unsigned for the types with sign bits, which go to the
/// activations instead.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn row_dot<L: Lattice>(b: &L, j: usize, a: __m256i, sc: __m256i) -> __m256i {
    let g = [2 * j, 2 * j + 1, 2 * j + 16, 2 * j + 17];
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let v = _mm256_set_epi64x(b.grid(g[3]) as i64, b.grid(g[2]) as i64, b.grid(g[1]) as i64, b.grid(g[0]) as i64);
        let p = if L::SIGNS {
            let sign = |g: usize| match L::EVEN_SIGNS {
                true => EVEN_SIGN_BYTES[(b.sign_bits(g) & 0x7F) as usize] as i64,
                false => SIGN_BYTES[usize::from(b.signs(g))] as i64,
            };
            let s = _mm256_set_epi64x(sign(g[3]), sign(g[2]), sign(g[1]), sign(g[0]));
            _mm256_maddubs_epi16(v, _mm256_sign_epi8(a, s))
        } else {
            let s = u32::from_le_bytes([
                b.shift(g[0]) as u8,
                b.shift(g[1]) as u8,
                b.shift(g[2]) as u8,
                b.shift(g[3]) as u8,
            ]);
            pair_sums(true, _mm256_add_epi8(v, spread(s)), a)
        };
        // Scale j in every word of the low half, scale j + 8 in the high half's.
        let at = _mm256_set1_epi16(i16::from_le_bytes([2 * j as u8, 2 * j as u8 + 1]));
        _mm256_madd_epi16(p, _mm256_shuffle_epi8(sc, at))
    }
}

/// [`KBlock::rows_dot`]: the 8 rows' sums, then pairs of 16-column rows added into the lanes
/// of the lane layout (lane `l` of each half: rows `2l`, `2l + 1`), so the i32 lanes equal
/// the lane-layout kernels' exactly (the same integers, summed exactly).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn rows_dot<L: Lattice>(b: &L, a: &[__m256i; REGS], sc: __m256i) -> __m256i {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        // (No closures: they would not inherit the caller's target features.)
        let r: [__m256i; REGS] = [
            row_dot(b, 0, a[0], sc),
            row_dot(b, 1, a[1], sc),
            row_dot(b, 2, a[2], sc),
            row_dot(b, 3, a[3], sc),
            row_dot(b, 4, a[4], sc),
            row_dot(b, 5, a[5], sc),
            row_dot(b, 6, a[6], sc),
            row_dot(b, 7, a[7], sc),
        ];
        let q = [
            _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3])),
            _mm256_hadd_epi32(_mm256_hadd_epi32(r[4], r[5]), _mm256_hadd_epi32(r[6], r[7])),
        ];
        _mm256_hadd_epi32(q[0], q[1])
    }
}

/// `(scales, no mins, d·2^-SHIFT, 0)` ([`KBlock::prep`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn prep<L: Lattice>(b: &L) -> (__m256i, __m256i, f32, f32) {
    let mut m = [0u8; 16];
    for (h, m) in m.iter_mut().enumerate() {
        *m = b.scale(h);
    }
    // SAFETY: 16 bytes; AVX2 and F16C by the callers' contract.
    unsafe {
        let sc = _mm256_cvtepu8_epi16(_mm_loadu_si128(m.as_ptr().cast()));
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(b.d_bits()))));
        (sc, _mm256_setzero_si256(), d / (1u32 << L::SHIFT) as f32, 0.0)
    }
}

macro_rules! lattice_blocks {
    ($($b:ty: $rows:expr),*) => {$(
        // SAFETY (each fn): the trait's contract (AVX2, FMA, F16C); every read is a
        // bounds-checked index of the block's arrays or the grid tables.
        impl KBlock for $b {
            const SIGNED: bool = true;
            const ROWS_DOT: bool = $rows;
            const FOLD: usize = fold(<$b as Lattice>::MAX_LEVEL);
            const WHOLE: bool = true;
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
                unsafe { prep(self) }
            }
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn reg(&self, r: usize) -> __m256i {
                unsafe { regs(self)[r] }
            }
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn regs(&self) -> [__m256i; REGS] {
                unsafe { regs(self) }
            }
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn rows_dot(&self, a: &[__m256i; REGS], sc: __m256i) -> __m256i {
                unsafe { rows_dot(self, a, sc) }
            }
        }
    )*};
}

// Which take the one-token row-order dot: measured, alternated with the lane layout's.
lattice_blocks!(
    BlockIq1S: false,
    BlockIq1M: true,
    BlockIq2Xxs: true,
    BlockIq2Xs: true,
    BlockIq2S: false,
    BlockIq3Xxs: true,
    BlockIq3S: false
);

#[cfg(test)]
mod tests {
    use kt_core::ggml::{self, GgmlType, QK_K};

    use super::*;
    use crate::lanes::column;

    /// `$check::<B>(t)` for every lattice block type `B` and its GGML type `t`.
    macro_rules! every_type {
        ($check:ident) => {
            $check::<BlockIq1S>(GgmlType::IQ1_S);
            $check::<BlockIq1M>(GgmlType::IQ1_M);
            $check::<BlockIq2Xxs>(GgmlType::IQ2_XXS);
            $check::<BlockIq2Xs>(GgmlType::IQ2_XS);
            $check::<BlockIq2S>(GgmlType::IQ2_S);
            $check::<BlockIq3Xxs>(GgmlType::IQ3_XXS);
            $check::<BlockIq3S>(GgmlType::IQ3_S);
        };
    }

    /// Each register byte is the signed level of its lane-layout column, as core's scalar
    /// definition gives it; the scales and `d` are core's.
    fn check<B: Lattice + KBlock>(t: GgmlType) {
        for seed in 0..8 {
            let m = ggml::random_matrix(t, 1, QK_K, seed);
            let blk: &B = bytemuck::from_bytes(m.data());
            let mut reg = [[0i8; 32]; REGS];
            // SAFETY: AVX2, FMA and F16C checked by the caller.
            let (sc, mn, d, dmin) = unsafe {
                for (r, v) in KBlock::regs(blk).into_iter().enumerate() {
                    _mm256_storeu_si256(reg[r].as_mut_ptr().cast(), v);
                }
                KBlock::prep(blk)
            };
            for (r, reg) in reg.iter().enumerate() {
                for (j, &got) in reg.iter().enumerate() {
                    let c = column(r, j);
                    assert_eq!(got, Lattice::levels(blk, c / 8)[c % 8], "{t} register {r} byte {j}");
                    assert!(got.unsigned_abs() <= B::MAX_LEVEL);
                }
            }
            let (mut s, mut z) = ([0i16; 16], [1i16; 16]);
            // SAFETY: 32 bytes each.
            unsafe {
                _mm256_storeu_si256(s.as_mut_ptr().cast(), sc);
                _mm256_storeu_si256(z.as_mut_ptr().cast(), mn);
            }
            assert_eq!(s, core::array::from_fn(|h| i16::from(blk.scale(h))), "{t}");
            assert_eq!((z, dmin), ([0; 16], 0.0));
            assert_eq!(d, blk.d() / (1u32 << B::SHIFT) as f32);
        }
    }

    #[test]
    fn registers_hold_each_columns_signed_level_in_the_lane_layout() {
        kt_core::skip_unless_runs!(&crate::LLAMAFILE);
        every_type!(check);
    }

    /// [`KBlock::rows_dot`]'s i32 lanes are the scaled sums of the lane layout's lanes (lane `l`
    /// of each half: the columns of its 16-column rows `2l`, `2l + 1`). Activations of −128
    /// (ours stop at −127; ggml's Q8_K gives −128 to a block's largest value) times a negative
    /// level count as the lane-layout kernels take them: `psignb` negates −128 to itself.
    fn check_rows_dot<B: Lattice + KBlock>(t: GgmlType) {
        let mut rng = kt_core::rng::SplitMix64::new(5);
        for seed in 0..8 {
            let m = ggml::random_matrix(t, 1, QK_K, seed);
            let blk: &B = bytemuck::from_bytes(m.data());
            let x: [i8; QK_K] = core::array::from_fn(|c| if c % 37 == 0 { -128 } else { rng.next_u64() as i8 });
            let mut lanes = x;
            crate::lanes::order_act(&mut lanes);
            let mut got = [0i32; 8];
            // SAFETY: AVX2, FMA and F16C checked by the caller; 32 bytes a register.
            unsafe {
                let regs = core::array::from_fn(|r| _mm256_loadu_si256(lanes[32 * r..].as_ptr().cast()));
                let sums = KBlock::rows_dot(blk, &transpose(regs), KBlock::prep(blk).0);
                _mm256_storeu_si256(got.as_mut_ptr().cast(), sums);
            }
            let want: [i32; 8] = core::array::from_fn(|l| {
                (32 * l..32 * l + 32)
                    .map(|c| {
                        let level = Lattice::levels(blk, c / 8)[c % 8];
                        let x = if level < 0 { x[c].wrapping_neg() } else { x[c] };
                        i32::from(level.unsigned_abs()) * i32::from(x) * i32::from(blk.scale(c / 16))
                    })
                    .sum()
            });
            assert_eq!(got, want, "{t} seed {seed}");
        }
    }

    #[test]
    fn one_token_rows_give_the_lane_layouts_sums() {
        kt_core::skip_unless_runs!(&crate::LLAMAFILE);
        every_type!(check_rows_dot);
    }

    #[test]
    fn folds_keep_pair_sums_in_i16() {
        for (max, f) in [(9, 8), (15, 8), (43, 2), (62, 2), (127, 1)] {
            assert_eq!(fold(max), f);
        }
    }
}
