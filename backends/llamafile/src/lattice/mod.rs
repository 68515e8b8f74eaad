//! The lattice types (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s) as [`KBlock`]s.
//! Their levels are table lookups, not bit fields, so they stay as GGUF stores them. For many
//! tokens they are put in the lane layout of [`crate::lanes`] as they are decoded: each
//! 16-column row of the block is two 8-column grid entries, a row and the row 8 below fill a
//! register (four u64 lookups, their sign bits applied in one `psignb` or iq1's shift in one
//! `paddb`), and one [`transpose`] gives the registers. For one to eight tokens the tokens'
//! values go to row order instead and each block's levels are looked up once for all of them
//! ([`KBlock::rows_dots`]), its fields taken in registers ([`Fields`]). Levels are signed;
//! scales are the types' integers `m` per 16 columns and `d·2^-SHIFT` the block's f32 scale,
//! as core's [`Lattice`] defines the values.

use core::arch::x86_64::*;

use kt_core::ggml::{BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs, Lattice};

use crate::decode::KBlock;
use crate::lanes::{transpose, REGS};
pub use fields::Fields;

mod fields;

/// The most registers whose pair sums fit in i16 when added: `fold · 2 · max|level| · max|a|
/// ≤ 32767`, a power of two up to 8, for activations up to `max_act` in magnitude (127 signed,
/// 255 unsigned: [`KBlock::ACT_FOLD`]).
const fn fold(max_level: u8, max_act: usize) -> usize {
    let mut f = 8;
    while f > 1 && f * 2 * max_level as usize * max_act > 32767 {
        f /= 2;
    }
    f
}

/// Register `j`'s byte of each column from the block's [`Fields::group_bytes`]: groups `2j`,
/// `2j + 1` in the low half (16-column row `j`), `2j + 16`, `2j + 17` in the high one (row
/// `j + 8`), each group's byte in its 8 columns.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn column_bytes(group_bytes: __m256i, j: usize) -> __m256i {
    // SAFETY: a 32-byte load of a static; AVX2 by the callers' contract.
    unsafe { _mm256_shuffle_epi8(group_bytes, _mm256_loadu_si256(SPREAD[j].as_ptr().cast())) }
}

/// [`column_bytes`]' `vpshufb` control for register `j`: in each half, bytes 0-7 take byte
/// `2j` and bytes 8-15 byte `2j + 1` of that half.
static SPREAD: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut j = 0;
    while j < 8 {
        let mut i = 0;
        while i < 32 {
            t[j][i] = (2 * j + (i % 16) / 8) as u8;
            i += 1;
        }
        j += 1;
    }
    t
};

/// ±1 per byte from [`column_bytes`] of sign bytes: −1 where the column's bit is set.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn plus_minus(column_bytes: __m256i) -> __m256i {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let minus = _mm256_cmpeq_epi8(_mm256_and_si256(column_bytes, bit), bit);
        _mm256_or_si256(minus, _mm256_set1_epi8(1))
    }
}

/// Register `j`'s levels before signs and shifts: the grid entries of its 4 groups (`unsigned`:
/// [`Fields::unsigned_grid_of`]'s).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn grid_reg<L: Fields>(b: &L, ix: &L::Indices, j: usize, unsigned: bool) -> __m256i {
    let g = [2 * j, 2 * j + 1, 2 * j + 16, 2 * j + 17];
    let at = |g: usize| if unsigned { b.unsigned_grid_of(ix, g) } else { b.grid_of(ix, g) } as i64;
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe { _mm256_set_epi64x(at(g[3]), at(g[2]), at(g[1]), at(g[0])) }
}

/// `[e(0), …, e(7)]`, one expression a register written out: a loop over the registers with
/// the grid lookups in it was not unrolled for iq3_xxs and iq3_s (1.15-1.25× the time), and a
/// closure would not inherit the caller's target features.
macro_rules! by_register {
    (|$j:ident| $e:expr) => {
        [
            {
                let $j = 0;
                $e
            },
            {
                let $j = 1;
                $e
            },
            {
                let $j = 2;
                $e
            },
            {
                let $j = 3;
                $e
            },
            {
                let $j = 4;
                $e
            },
            {
                let $j = 5;
                $e
            },
            {
                let $j = 6;
                $e
            },
            {
                let $j = 7;
                $e
            },
        ]
    };
}

/// Register `j`'s (rows `j` and `j + 8`) signed levels: its grid entries with their signs
/// applied or iq1's shifts added. `ix` and `gb` are the block's [`Fields::indices`] and
/// [`Fields::group_bytes`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn signed_levels<L: Fields>(b: &L, ix: &L::Indices, gb: __m256i, j: usize) -> __m256i {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let (grid, c) = (grid_reg(b, ix, j, false), column_bytes(gb, j));
        match L::SIGNS {
            true => _mm256_sign_epi8(grid, plus_minus(c)),
            false => _mm256_add_epi8(grid, c),
        }
    }
}

/// The block's registers in the lane layout ([`KBlock::regs`]), for the kernels of more tokens
/// than [`KBlock::rows_dots`] serves: each register's [`signed_levels`] in row order, from the
/// block's fields in registers ([`Fields`]), then one [`transpose`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn regs<L: Fields>(b: &L) -> [__m256i; REGS] {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let (gb, ix) = (b.group_bytes(), b.indices());
        transpose(by_register!(|j| signed_levels(b, &ix, gb, j)))
    }
}

/// Register `j`'s (rows `j` and `j + 8`) levels for the row-order dots: the unsigned levels and
/// what a token's values take the signs from (±1 for the types with sign bits, iq1_m's signed
/// levels; unused for an [`Fields::OFFSET`] type, whose unsigned levels multiply the values as
/// they are). `ix` and `gb` are the block's [`Fields::indices`] and [`Fields::group_bytes`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn row_levels<L: Fields>(b: &L, ix: &L::Indices, gb: __m256i, j: usize) -> [__m256i; 2] {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        if L::OFFSET {
            return [grid_reg(b, ix, j, true), _mm256_setzero_si256()];
        }
        if L::SIGNS {
            return [grid_reg(b, ix, j, false), plus_minus(column_bytes(gb, j))];
        }
        let x = signed_levels(b, ix, gb, j);
        [_mm256_abs_epi8(x), x]
    }
}

/// A register's pair sums (i16) with one token's values `a` in row order, from its
/// [`row_levels`].
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn pair_sums_of<L: Fields>([v, s]: [__m256i; 2], a: __m256i) -> __m256i {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        match L::OFFSET {
            true => _mm256_maddubs_epi16(v, a),
            false => _mm256_maddubs_epi16(v, _mm256_sign_epi8(a, s)),
        }
    }
}

/// One token's 8 registers' [`pair_sums_of`], scaled and summed into the lanes of the lane
/// layout (lane `l` of each half: rows `2l`, `2l + 1`, one 32-column group), so the i32 lanes
/// equal the lane-layout kernels' exactly (the same integers, summed exactly); `bsums` are the
/// token's sums of each 16 columns, `sc` and `offsets` the block's [`Fields::scales`] and
/// [`Fields::offsets`]. A group's two rows are added in i16 first where they share a scale
/// ([`Fields::SCALE32`]; 2 · 2 · 62 · 128 < 2^15), which then multiplies the group's sum: 4
/// horizontal adds and one multiply where the rows scaled apart take 8 scale shuffles and 7.
/// An [`Fields::OFFSET`] type's sums of its unsigned levels get (shift − 8) times the token's
/// sum of each group.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn lane_sums<L: Fields>(p: &[__m256i; REGS], bsums: __m256i, sc: __m256i, offsets: __m256i) -> __m256i {
    const { assert!(4 * L::MAX_LEVEL as usize * 128 < 1 << 15) };
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        if L::SCALE32 {
            let ones = _mm256_set1_epi16(1);
            let mut g = [_mm256_setzero_si256(); 4];
            for l in 0..4 {
                g[l] = _mm256_madd_epi16(_mm256_add_epi16(p[2 * l], p[2 * l + 1]), ones);
            }
            let mut sums = _mm256_hadd_epi32(_mm256_hadd_epi32(g[0], g[1]), _mm256_hadd_epi32(g[2], g[3]));
            if L::OFFSET {
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(bsums, offsets));
            }
            // i32 lane g of `sc` holds group g's scale in both words.
            return _mm256_mullo_epi32(sums, _mm256_srli_epi32::<16>(sc));
        }
        let mut r = [_mm256_setzero_si256(); REGS];
        for j in 0..REGS {
            // Scale j in every word of the low half, scale j + 8 in the high half's.
            let at = _mm256_set1_epi16(i16::from_le_bytes([2 * j as u8, 2 * j as u8 + 1]));
            r[j] = _mm256_madd_epi16(p[j], _mm256_shuffle_epi8(sc, at));
        }
        let q = [
            _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3])),
            _mm256_hadd_epi32(_mm256_hadd_epi32(r[4], r[5]), _mm256_hadd_epi32(r[6], r[7])),
        ];
        _mm256_hadd_epi32(q[0], q[1])
    }
}

/// [`KBlock::rows_dots`]: for one token each register's levels used as they are made, for more
/// all made once, then each token's sums.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn rows_dots<L: Fields, const TN: usize>(
    b: &L,
    a: &[[__m256i; REGS]; TN],
    sc: __m256i,
    bsums: &[__m256i; TN],
) -> [__m256i; TN] {
    // SAFETY: register operations; AVX2 by the callers' contract.
    unsafe {
        let (gb, ix, offsets) = (b.group_bytes(), b.indices(), b.offsets());
        let mut out = [_mm256_setzero_si256(); TN];
        if TN == 1 {
            let p = by_register!(|j| pair_sums_of::<L>(row_levels(b, &ix, gb, j), a[0][j]));
            out[0] = lane_sums::<L>(&p, bsums[0], sc, offsets);
            return out;
        }
        let levels = by_register!(|j| row_levels(b, &ix, gb, j));
        for t in 0..TN {
            let p = by_register!(|j| pair_sums_of::<L>(levels[j], a[t][j]));
            out[t] = lane_sums::<L>(&p, bsums[t], sc, offsets);
        }
        out
    }
}

/// `(scales, no mins, d·2^-SHIFT, 0)` ([`KBlock::prep`]).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn prep<L: Fields>(b: &L) -> (__m256i, __m256i, f32, f32) {
    // SAFETY: AVX2 and F16C by the callers' contract.
    unsafe {
        let sc = b.scales();
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(b.d_bits()))));
        (sc, _mm256_setzero_si256(), d / (1u32 << L::SHIFT) as f32, 0.0)
    }
}

macro_rules! lattice_blocks {
    ($($b:ty),*) => {$(
        // SAFETY (each fn): the trait's contract (AVX2, FMA, F16C); every read is a
        // bounds-checked index of the block's arrays or the grid tables.
        impl KBlock for $b {
            const SIGNED: bool = true;
            const NO_MINS: bool = true;
            const ROWS_DOT: bool = true;
            const FOLD: usize = fold(<$b as Lattice>::MAX_LEVEL, 127);
            const ACT_FOLD: usize = fold(<$b as Lattice>::MAX_LEVEL, 255);
            const WHOLE: bool = true;
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn prep(&self) -> (__m256i, __m256i, f32, f32) {
                // SAFETY: forwarded: the trait method's `# Safety` is the function's.
                unsafe { prep(self) }
            }
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn reg(&self, r: usize) -> __m256i {
                // SAFETY: forwarded: the trait method's `# Safety` is the function's.
                unsafe { regs(self)[r] }
            }
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn regs(&self) -> [__m256i; REGS] {
                // SAFETY: forwarded: the trait method's `# Safety` is the function's.
                unsafe { regs(self) }
            }
            /// # Safety
            /// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
            #[inline(always)]
            unsafe fn rows_dots<const TN: usize>(
                &self,
                a: &[[__m256i; REGS]; TN],
                sc: __m256i,
                bsums: &[__m256i; TN],
            ) -> [__m256i; TN] {
                // SAFETY: forwarded: the trait method's `# Safety` is the function's.
                unsafe { rows_dots(self, a, sc, bsums) }
            }
        }
    )*};
}

lattice_blocks!(BlockIq1S, BlockIq1M, BlockIq2Xxs, BlockIq2Xs, BlockIq2S, BlockIq3Xxs, BlockIq3S);

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

    /// [`KBlock::rows_dots`]' i32 lanes are the scaled sums of the lane layout's lanes (lane `l`
    /// of each half: the columns of its 16-column rows `2l`, `2l + 1`). Activations of −128
    /// (ours stop at −127; ggml's Q8_K gives −128 to a block's largest value) times a negative
    /// level count as the lane-layout kernels take them: `psignb` negates −128 to itself. An
    /// [`Fields::OFFSET`] type's unsigned levels multiply −128 as it is, so its activations
    /// stop at −127, as the kernels' own do.
    fn check_rows_dot<B: Fields + KBlock>(t: GgmlType) {
        let mut rng = kt_core::rng::SplitMix64::new(5);
        let least = if B::OFFSET { -127 } else { -128 };
        for seed in 0..8 {
            let m = ggml::random_matrix(t, 1, QK_K, seed);
            let blk: &B = bytemuck::from_bytes(m.data());
            let x: [i8; QK_K] =
                core::array::from_fn(|c| if c % 37 == 0 { least } else { (rng.next_u64() as i8).max(least) });
            let mut lanes = x;
            crate::lanes::order_act(&mut lanes);
            let mut got = [0i32; 8];
            // SAFETY: AVX2, FMA and F16C checked by the caller; 32 bytes a register.
            unsafe {
                let regs = core::array::from_fn(|r| _mm256_loadu_si256(lanes[32 * r..].as_ptr().cast()));
                let bsums: [i16; 16] =
                    core::array::from_fn(|h| x[16 * h..16 * h + 16].iter().map(|&v| i16::from(v)).sum());
                let bsums = _mm256_loadu_si256(bsums.as_ptr().cast());
                let [sums] = KBlock::rows_dots(blk, &[transpose(regs)], KBlock::prep(blk).0, &[bsums]);
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
            assert_eq!(fold(max, 127), f);
        }
        // Unsigned activations (`KBlock::ACT_FOLD`).
        for (max, f) in [(9, 4), (15, 4), (43, 1), (62, 1)] {
            assert_eq!(fold(max, 255), f);
        }
    }
}
