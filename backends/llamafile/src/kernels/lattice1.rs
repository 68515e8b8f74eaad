//! One token against the lattice types (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs,
//! iq3_s) in 512-bit registers (AVX512-VNNI with VBMI and DQ), the types of the 1.6-3.4-bit
//! DeepSeek and Kimi GGUFs: their grid lookups, not memory, bound their decode, and here they
//! are table lookups in registers (up to 1024 entries) or one gather a register (iq1's 2048)
//! instead of a scalar load per 8 (iq1, iq2) or 4 (iq3) columns.
//!
//! A block's 8 parts of 32 columns lie across a register's 8 qword lanes: register `p` (0..4)
//! holds in lane `s` columns `8p..8p + 8` of part `s`, and the token's values are put in that
//! order once per tile (from the lane layout of [`crate::lanes`], one `vpermi2b` a register).
//! A grid's entries are kept as level codes (2 or 3 bits a column) in tables of 256 code
//! bytes, low and high: two `vpermi2b` and a blend look up 64 index bytes in one
//! ([`table_bytes`]), blends by the index's bits 8 and 9 pick among tables, and per register
//! one `vpmultishiftqb` spreads a code a byte and one `vpermb` turns codes into levels
//! ([`Zmm::dot_regs`]). The signs go to the values: each part's sign bytes (stored, or
//! ggml's 7-bit fields cut by `vpmultishiftqb` and expanded by a 128-byte table), and per
//! register a `vpmultishiftqb` puts each column's bit on top of its byte for the mask of a
//! masked subtract. Four `vpdpbusd` leave each part's sum in its lane's two dwords (two sums
//! where scales cover 16 columns); one add, the part's scale (`vpmuldq`) and a convert give
//! the 8 f32 lanes of the AVX2 one-token kernel ([`super::kquant1`]), summed in its order:
//! the same bits. iq1's signed levels `8·g ± 1` go in as magnitudes with their signs' masks
//! ([`iq1_regs`]).
//!
//! Tried and slower (docs/tuning.md): the grid from `vpgatherqq` or from scalar loads, and the
//! masks by `vpshufbitqmb`. Built from rustc 1.89 only (`build.rs`).

#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;
use core::ops::Range;

use kt_core::ggml::{
    BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs, GgmlType, Lattice, IQ1S_GRID8,
    IQ2S_PACKED, IQ2XS_PACKED, IQ2XXS_LEVELS, IQ2XXS_PACKED, IQ3S_LEVELS, IQ3S_PACKED, IQ3XXS_LEVELS, IQ3XXS_PACKED,
    KSIGNS,
};

use super::{hsum4, prefetch_next, Packed, Tile, R};
use crate::act::ActK;

/// Whether [`gemv`] serves type `t`, for a matrix packed where it runs (`Packed::lattice1`).
pub(super) const fn runs(t: GgmlType) -> bool {
    matches!(
        t,
        GgmlType::IQ1_S
            | GgmlType::IQ1_M
            | GgmlType::IQ2_XXS
            | GgmlType::IQ2_XS
            | GgmlType::IQ2_S
            | GgmlType::IQ3_XXS
            | GgmlType::IQ3_S
    )
}

/// A table for 512-bit loads.
#[repr(C, align(64))]
struct Aligned<T>(T);

/// ggml's sign bytes of the 128 stored 7-bit fields.
static SIGNS: Aligned<[u8; 128]> = Aligned(KSIGNS);

/// A grid's level codes in 256-byte tables: the low bytes of its entries, 256 a table, then
/// the high bytes (`M` = 2 · entries / 256).
const fn code_bytes<const M: usize>(packed: &[u16]) -> Aligned<[[u8; 256]; M]> {
    let mut t = [[0u8; 256]; M];
    let mut i = 0;
    while i < packed.len() {
        t[i / 256][i % 256] = packed[i] as u8;
        t[M / 2 + i / 256][i % 256] = (packed[i] >> 8) as u8;
        i += 1;
    }
    Aligned(t)
}

static IQ2XXS_CODES: Aligned<[[u8; 256]; 2]> = code_bytes(&IQ2XXS_PACKED);
static IQ3XXS_CODES: Aligned<[[u8; 256]; 2]> = code_bytes(&IQ3XXS_PACKED);
static IQ2XS_CODES: Aligned<[[u8; 256]; 4]> = code_bytes(&IQ2XS_PACKED);
static IQ2S_CODES: Aligned<[[u8; 256]; 8]> = code_bytes(&IQ2S_PACKED);
static IQ3S_CODES: Aligned<[[u8; 256]; 4]> = code_bytes(&IQ3S_PACKED);

/// A code (a byte's low `bits` bits) to its level of `levels`: `vpermb`'s 64 entries.
const fn level_table(levels: &[i8], bits: u32) -> Aligned<[u8; 64]> {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        let c = j % (1 << bits);
        t[j] = if c < levels.len() { levels[c] as u8 } else { 0 };
        j += 1;
    }
    Aligned(t)
}

/// One table for the three iq2 types: gguf-py gives iq2_xs and iq2_s iq2_xxs' levels.
static IQ2_LEVEL_TABLE: Aligned<[u8; 64]> = level_table(&IQ2XXS_LEVELS, 2);
static IQ3XXS_LEVEL_TABLE: Aligned<[u8; 64]> = level_table(&IQ3XXS_LEVELS, 3);
static IQ3S_LEVEL_TABLE: Aligned<[u8; 64]> = level_table(&IQ3S_LEVELS, 3);

/// `vpermi2d` indices for iq3's register `p`: lane `s` takes the code words of part `s`'s
/// entries `2p`, `2p + 1` (dword `p` of its 128-bit lane `s / 2` of the low unpack for even
/// `s`, of the high unpack for odd).
static IQ3_PLACE: Aligned<[[u32; 16]; 4]> = {
    let mut t = [[0u32; 16]; 4];
    let mut j = 0;
    while j < 64 {
        let (p, d) = (j / 16, j % 16);
        let s = d / 2;
        t[p][d] = (16 * (s % 2) + 4 * (s / 2) + p) as u32;
        j += 1;
    }
    Aligned(t)
};

/// The byte of the lane-layout values that holds column `c` ([`crate::lanes::column`]'s
/// inverse).
const fn lane_byte(c: usize) -> usize {
    32 * ((c % 16) / 2) + 2 * (c / 16) + c % 2
}

/// `vpermb` indices laying each lane's 4 bytes (bytes `4s..4s + 4` of 32) out twice.
static TWICE4: Aligned<[u8; 64]> = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        t[j] = (4 * (j / 8) + j % 4) as u8;
        j += 1;
    }
    Aligned(t)
};

/// `vpermb` indices putting byte `4s + p` of 32 at byte `8s` (lane `s`'s low byte), one table
/// a `p`.
static EVERY_FOURTH: Aligned<[[u8; 64]; 4]> = {
    let mut t = [[0u8; 64]; 4];
    let mut j = 0;
    while j < 256 {
        let (p, b) = (j / 64, j % 64);
        t[p][b] = (4 * (b / 8) + p) as u8;
        j += 1;
    }
    Aligned(t)
};

/// `vpermi2b` indices putting register `p`'s values in place: byte `8s + k` is column
/// `32s + 8p + k`, read from the 128 lane-layout bytes at `128·(p % 2)`.
static VALUE_ORDER: Aligned<[[u8; 64]; 4]> = {
    let mut t = [[0u8; 64]; 4];
    let mut j = 0;
    while j < 256 {
        let (p, j64) = (j / 64, j % 64);
        t[p][j64] = (lane_byte(32 * (j64 / 8) + 8 * p + j64 % 8) - 128 * (p % 2)) as u8;
        j += 1;
    }
    Aligned(t)
};

/// `_mm512_load_si512` of a 64-byte aligned table's bytes from `$t` on.
macro_rules! load {
    ($t:expr) => {
        _mm512_load_si512($t.as_ptr().cast())
    };
}

/// A lattice type of this kernel: its levels, signs and scales, a block's part `s` in lane `s`.
trait Zmm: Lattice {
    /// The block's levels as `vpdpbusd`'s unsigned bytes, register `p` holding columns
    /// `8p..8p + 8` of part `s` in lane `s`, and each register's mask of negated columns.
    ///
    /// # Safety
    /// As [`gemv`].
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]);
    /// Lane `s`: part `s`'s scale, `2·field + 1`, as an i64; with [`Zmm::HALVES`] that of its
    /// first 16 columns, and the second's apart.
    ///
    /// # Safety
    /// As [`gemv`].
    unsafe fn scales(&self) -> (__m512i, __m512i);
    /// Scales cover 16 columns (registers 0, 1 and 2, 3 of a part), not 32.
    const HALVES: bool = false;
}

/// [`Zmm::dot_regs`] of the types whose levels are unsigned and signs apart: the levels `lv`,
/// and a `vpmultishiftqb` a register putting each column's bit of `signs` (lane `s`: byte `p`
/// is part `s`'s sign byte of columns `8p..8p + 8`, bit `k` set: column `8p + k` negated) on
/// top of its byte for the mask.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn with_signs(lv: [__m512i; 4], signs: __m512i) -> ([__m512i; 4], [__mmask64; 4]) {
    // SAFETY: register operations; the callers' features.
    unsafe {
        // Column k's sign bit of register 0 (bit k of sign byte 0) at the top of byte k.
        let at = _mm512_set1_epi64(i64::from_le_bytes([57, 58, 59, 60, 61, 62, 63, 0]));
        let neg = array!(0; 4, |p| _mm512_movepi8_mask(_mm512_multishift_epi64_epi8(
            _mm512_add_epi8(at, _mm512_set1_epi8(8 * p as i8)),
            signs
        )));
        (lv, neg)
    }
}

/// Byte `i` of the 256-byte `table` for each index byte `i` of `idx` (`vpermi2b` a 128-byte
/// half; `k7`, the indices' bit 7, picks the half).
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn table_bytes(idx: __m512i, k7: __mmask64, table: &[u8; 256]) -> __m512i {
    // SAFETY: 64-byte loads inside the aligned table; the callers' features.
    unsafe {
        let low = _mm512_permutex2var_epi8(load!(table[..]), idx, load!(table[64..]));
        let high = _mm512_permutex2var_epi8(load!(table[128..]), idx, load!(table[192..]));
        _mm512_mask_blend_epi8(k7, low, high)
    }
}

/// The iq3 types' level registers from each entry's code bytes `low`, `high` (lane `s`, byte
/// `e`: part `s`'s entry `e`, 4 levels of 3 bits): register `p` takes entries `2p`, `2p + 1`.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn iq3_regs(low: __m512i, high: __m512i, levels: &Aligned<[u8; 64]>) -> [__m512i; 4] {
    // SAFETY: register operations and the aligned tables; the callers' features.
    unsafe {
        // Code words: parts 2L (low unpack) and 2L + 1 (high) in 128-bit lane L.
        let (even, odd) = (_mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high));
        // Column k's code in byte k: bits 3k of entry 2p's word, 3(k − 4) of the next.
        let spread = _mm512_set1_epi64(i64::from_le_bytes([0, 3, 6, 9, 16, 19, 22, 25]));
        let levels = load!(levels.0);
        array!(even; 4, |p| _mm512_permutexvar_epi8(
            _mm512_multishift_epi64_epi8(spread, _mm512_permutex2var_epi32(even, load!(IQ3_PLACE.0[p]), odd)),
            levels
        ))
    }
}

/// The iq2 types' level registers from `codes` (lane `s`: the low code bytes of part `s`'s 4
/// entries, then their high bytes; an entry is 8 levels of 2 bits): register `p` is entry
/// `p`.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn iq2_regs(codes: __m512i) -> [__m512i; 4] {
    // SAFETY: register operations and the aligned table; the callers' features.
    unsafe {
        // Column k's code of entry 0 in byte k (bits 2k of its low byte, 2k − 8 of its high
        // one); entry p's 8p bits further.
        let spread = _mm512_set1_epi64(i64::from_le_bytes([0, 2, 4, 6, 32, 34, 36, 38]));
        let levels = load!(IQ2_LEVEL_TABLE.0);
        array!(codes; 4, |p| _mm512_permutexvar_epi8(
            _mm512_multishift_epi64_epi8(_mm512_add_epi8(spread, _mm512_set1_epi8(8 * p as i8)), codes),
            levels
        ))
    }
}

/// Sign bytes from each lane's four 7-bit fields at bits `at` (ggml's stored signs of
/// iq2_xxs, iq2_xs, iq3_xxs): cut by `vpmultishiftqb`, expanded to its even-parity bytes by
/// a 128-byte table.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn parity_signs(words: __m512i, at: [u8; 4]) -> __m512i {
    // SAFETY: register operations and the aligned table; the callers' features.
    unsafe {
        let fields = _mm512_set1_epi64(i64::from_le_bytes([at[0], at[1], at[2], at[3], 0, 0, 0, 0]));
        _mm512_permutex2var_epi8(load!(SIGNS.0), _mm512_multishift_epi64_epi8(fields, words), load!(SIGNS.0[64..]))
    }
}

/// Lane `s`: bytes `4s..4s + 4` of `bytes` (iq2_s' and iq3_s' stored sign bytes).
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn four_a_lane(bytes: &[u8; 32]) -> __m512i {
    // SAFETY: 32 bytes; the callers' features.
    unsafe { _mm512_cvtepu32_epi64(_mm256_loadu_si256(bytes.as_ptr().cast())) }
}

/// The iq2_xs and iq2_s scales (two nibbles a part's byte, 16 columns each) as
/// [`Zmm::scales`] gives them.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn nibble_pairs(scales: [u8; 8]) -> (__m512i, __m512i) {
    // SAFETY: register operations; the callers' features.
    unsafe {
        let v = _mm512_set1_epi64(i64::from_le_bytes(scales));
        let at = _mm512_setr_epi64(0, 8, 16, 24, 32, 40, 48, 56);
        (odd_scales(v, at, 0xF), odd_scales(v, _mm512_add_epi64(at, _mm512_set1_epi64(4)), 0xF))
    }
}

/// `2·field + 1` of each lane's field at bit `at`, `mask` its width (0xF or 7).
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn odd_scales(v: __m512i, at: __m512i, mask: i64) -> __m512i {
    // SAFETY: register operations; the callers' features.
    unsafe {
        let field = _mm512_and_si512(_mm512_srlv_epi64(v, at), _mm512_set1_epi64(mask));
        _mm512_or_si512(_mm512_add_epi64(field, field), _mm512_set1_epi64(1))
    }
}

/// Lane `s`: part `s`'s 4 grid bytes, then its word (4 × 7 sign bits, the scale in bits
/// 28..32); register `p` is entry `p` of each part, a 16-bit code of 8 levels.
impl Zmm for BlockIq2Xxs {
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: 64 bytes of `qs`; register operations, the callers' features.
        unsafe {
            let q = _mm512_loadu_si512(self.qs.as_ptr().cast());
            let twice = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11));
            let idx = _mm512_shuffle_epi8(q, twice);
            let k7 = _mm512_movepi8_mask(idx);
            let low = table_bytes(idx, k7, &IQ2XXS_CODES.0[0]);
            with_signs(
                iq2_regs(_mm512_mask_blend_epi8(0xF0F0_F0F0_F0F0_F0F0, low, table_bytes(idx, k7, &IQ2XXS_CODES.0[1]))),
                parity_signs(q, [32, 39, 46, 53]),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: as above.
        let s = unsafe { odd_scales(_mm512_loadu_si512(self.qs.as_ptr().cast()), _mm512_set1_epi64(60), 0xF) };
        (s, s)
    }
}

/// Lane `s`: part `s`'s 4 u16, each a 9-bit grid index and 7 sign bits; two scale nibbles a
/// part (16 columns each).
impl Zmm for BlockIq2Xs {
    const HALVES: bool = true;
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: 64 bytes of `qs`; register operations, the callers' features.
        unsafe {
            let q = _mm512_loadu_si512(self.qs.as_ptr().cast());
            // Each lane's index low bytes twice, and their ninth bits in the same places.
            let twice = _mm_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 8, 10, 12, 14, 8, 10, 12, 14);
            let idx = _mm512_shuffle_epi8(q, _mm512_broadcast_i32x4(twice));
            let ninth = _mm512_shuffle_epi8(q, _mm512_broadcast_i32x4(_mm_add_epi8(twice, _mm_set1_epi8(1))));
            let (k7, k8) = (_mm512_movepi8_mask(idx), _mm512_test_epi8_mask(ninth, _mm512_set1_epi8(1)));
            let t = &IQ2XS_CODES.0;
            let low = _mm512_mask_blend_epi8(k8, table_bytes(idx, k7, &t[0]), table_bytes(idx, k7, &t[1]));
            let high = _mm512_mask_blend_epi8(k8, table_bytes(idx, k7, &t[2]), table_bytes(idx, k7, &t[3]));
            with_signs(
                iq2_regs(_mm512_mask_blend_epi8(0xF0F0_F0F0_F0F0_F0F0, low, high)),
                parity_signs(q, [9, 25, 41, 57]),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: register operations; the callers' features.
        unsafe { nibble_pairs(self.scales) }
    }
}

/// Lane `s`: part `s`'s 4 index low bytes, sign bytes and index high bit pairs (byte `s` of
/// `qh`); two scale nibbles a part, as iq2_xs.
impl Zmm for BlockIq2S {
    const HALVES: bool = true;
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: 32 bytes of `qs`, 8 of `qh`; register operations, the callers' features.
        unsafe {
            let q = _mm512_castsi256_si512(_mm256_loadu_si256(self.qs.as_ptr().cast()));
            // Each lane's 4 index bytes twice.
            let idx = _mm512_permutexvar_epi8(load!(TWICE4.0), q);
            // Byte e's index bits 8 and 9 (bits 2(e % 4) and 2(e % 4) + 1 of its lane's `qh`
            // byte) on top of it, for masks.
            let qh = _mm512_cvtepu8_epi64(_mm_loadl_epi64(self.qh.as_ptr().cast()));
            let bit8 = _mm512_set1_epi64(i64::from_le_bytes([57, 59, 61, 63, 57, 59, 61, 63]));
            let k8 = _mm512_movepi8_mask(_mm512_multishift_epi64_epi8(bit8, qh));
            let k9 = _mm512_movepi8_mask(_mm512_multishift_epi64_epi8(_mm512_add_epi8(bit8, _mm512_set1_epi8(1)), qh));
            let k7 = _mm512_movepi8_mask(idx);
            // Code byte h (0 low, 1 high) of each index: 256 entries a table, bits 8 and 9 pick.
            let t = &IQ2S_CODES.0;
            let half = array!(idx; 2, |h| {
                let quarter = array!(idx; 4, |c| table_bytes(idx, k7, &t[4 * h + c]));
                let low = _mm512_mask_blend_epi8(k8, quarter[0], quarter[1]);
                _mm512_mask_blend_epi8(k9, low, _mm512_mask_blend_epi8(k8, quarter[2], quarter[3]))
            });
            with_signs(
                iq2_regs(_mm512_mask_blend_epi8(0xF0F0_F0F0_F0F0_F0F0, half[0], half[1])),
                four_a_lane(&self.signs),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: register operations; the callers' features.
        unsafe { nibble_pairs(self.scales) }
    }
}

/// The iq1 types' levels `8·g ± 1` (their signs carried) as [`Zmm::dot_regs`] gives them:
/// register `p`'s 2048-entry grid indices from `qs` byte `4s + p` and the low 3 bits of
/// `high_shift(p).0` (lane `s`), by one gather (the grid's 16 KB fit no registers), plus
/// `high_shift(p).1` (±1 in each byte); magnitudes by `vpabsb`, the signs' mask by
/// `vpmovb2m`.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn iq1_regs(qs: &[u8; 32], high_shift: impl Fn(usize) -> (__m512i, __m512i)) -> ([__m512i; 4], [__mmask64; 4]) {
    // SAFETY: 32 bytes of `qs`; the gathers read the grid at indices below 2048; the callers'
    // features.
    unsafe {
        let q = _mm512_castsi256_si512(_mm256_loadu_si256(qs.as_ptr().cast()));
        let (mut lv, mut neg) = ([q; 4], [0; 4]);
        for p in 0..4 {
            let (high, shift) = high_shift(p);
            // Lane s: index low byte 4s + p, zero-extended, and its high bits.
            let low = _mm512_maskz_permutexvar_epi8(0x0101_0101_0101_0101, load!(EVERY_FOURTH.0[p]), q);
            let index = _mm512_or_si512(low, _mm512_slli_epi64::<8>(_mm512_and_si512(high, _mm512_set1_epi64(7))));
            let levels = _mm512_add_epi8(_mm512_i64gather_epi64::<8>(index, IQ1S_GRID8.as_ptr().cast()), shift);
            (lv[p], neg[p]) = (_mm512_abs_epi8(levels), _mm512_movepi8_mask(levels));
        }
        (lv, neg)
    }
}

/// Lane `s`: part `s`'s 4 index low bytes and its u16 of their high 3 bits each, scale and
/// shift sign; its levels `8·g ± 1` carry their signs ([`iq1_regs`]).
impl Zmm for BlockIq1S {
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: 32 bytes of `qs`, 16 of `qh`; register operations, the callers' features.
        unsafe {
            let qh = iq1s_words(self);
            let minus = _mm512_test_epi64_mask(qh, _mm512_set1_epi64(0x8000));
            let shift = _mm512_mask_blend_epi64(minus, _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
            // Register p's high index bits: bits 3p of the word.
            iq1_regs(&self.qs, |p| (_mm512_srl_epi64(qh, _mm_cvtsi32_si128(3 * p as i32)), shift))
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: register operations; the callers' features.
        let s = unsafe { odd_scales(iq1s_words(self), _mm512_set1_epi64(12), 7) };
        (s, s)
    }
}

/// Lane `s`: part `s`'s 4 index low bytes and 4 nibbles (3 high index bits and the shift's
/// sign, per 8 columns: bytes `2s`, `2s + 1` of `qh`); 3-bit scales of 16 columns, 4 a u16
/// of `scales` (whose top nibbles hold `d`).
impl Zmm for BlockIq1M {
    const HALVES: bool = true;
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: the 16 bytes of `qh`; register operations, the callers' features.
        unsafe {
            let nibbles = _mm512_cvtepu16_epi64(_mm_loadu_si128(self.qh.as_ptr().cast()));
            iq1_regs(&self.qs, |p| {
                let nibble = _mm512_srl_epi64(nibbles, _mm_cvtsi32_si128(4 * p as i32));
                let minus = _mm512_test_epi64_mask(nibble, _mm512_set1_epi64(8));
                (nibble, _mm512_mask_blend_epi64(minus, _mm512_set1_epi8(1), _mm512_set1_epi8(-1)))
            })
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: register operations; the callers' features.
        unsafe {
            // Lane s: 16-column scales 2s and 2s + 1, bits 6·(s % 2) and 3 more of u16 s / 2.
            let v = _mm512_set1_epi64(i64::from_le_bytes(self.scales));
            let at = _mm512_setr_epi64(0, 6, 16, 22, 32, 38, 48, 54);
            (odd_scales(v, at, 7), odd_scales(v, _mm512_add_epi64(at, _mm512_set1_epi64(3)), 7))
        }
    }
}

/// Lane `s`: iq1_s part `s`'s u16 of `qh`.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn iq1s_words(b: &BlockIq1S) -> __m512i {
    // SAFETY: the 16 bytes of `qh`; the callers' features.
    unsafe { _mm512_cvtepu16_epi64(_mm_loadu_si128(b.qh.as_ptr().cast())) }
}

/// Lane `s`: part `s`'s 8 grid bytes (entries of 4 columns); its word (as iq2_xxs') apart.
impl Zmm for BlockIq3Xxs {
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: 64 bytes of `qs`; the callers' features.
        unsafe {
            let q = _mm512_loadu_si512(self.qs.as_ptr().cast());
            let k7 = _mm512_movepi8_mask(q);
            let (t, levels) = (&IQ3XXS_CODES.0, &IQ3XXS_LEVEL_TABLE);
            with_signs(
                iq3_regs(table_bytes(q, k7, &t[0]), table_bytes(q, k7, &t[1]), levels),
                parity_signs(iq3xxs_words(self), [0, 7, 14, 21]),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: as above.
        let s = unsafe { odd_scales(iq3xxs_words(self), _mm512_set1_epi64(28), 0xF) };
        (s, s)
    }
}

/// Lane `s`: iq3_xxs part `s`'s word.
///
/// # Safety
/// As [`gemv`].
#[inline(always)]
unsafe fn iq3xxs_words(b: &BlockIq3Xxs) -> __m512i {
    // SAFETY: the 32 bytes of `scales_signs`; the callers' features.
    unsafe { _mm512_cvtepu32_epi64(_mm256_loadu_si256(b.scales_signs.as_ptr().cast())) }
}

/// Lane `s`: part `s`'s 8 grid bytes, their ninth bits in byte `s` of `qh`, its 4 sign bytes
/// and its scale nibble `s`.
impl Zmm for BlockIq3S {
    #[inline(always)]
    unsafe fn dot_regs(&self) -> ([__m512i; 4], [__mmask64; 4]) {
        // SAFETY: 64 bytes of `qs`; the callers' features.
        unsafe {
            let q = _mm512_loadu_si512(self.qs.as_ptr().cast());
            let (k7, k8) = (_mm512_movepi8_mask(q), u64::from_le_bytes(self.qh));
            let t = &IQ3S_CODES.0;
            let low = _mm512_mask_blend_epi8(k8, table_bytes(q, k7, &t[0]), table_bytes(q, k7, &t[1]));
            let high = _mm512_mask_blend_epi8(k8, table_bytes(q, k7, &t[2]), table_bytes(q, k7, &t[3]));
            with_signs(iq3_regs(low, high, &IQ3S_LEVEL_TABLE), four_a_lane(&self.signs))
        }
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m512i, __m512i) {
        // SAFETY: register operations; the callers' features.
        let s = unsafe {
            let v = _mm512_set1_epi64(i64::from(u32::from_le_bytes(self.scales)));
            odd_scales(v, _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28), 0xF)
        };
        (s, s)
    }
}

/// [`super::gemv`] for iq2_xxs and iq3_xxs ([`runs`]).
///
/// # Safety
/// AVX512-VNNI (with F, BW, VL), VBMI and DQ ([`runs`]), AVX2, FMA and F16C must be present;
/// `act` must hold one token's [`ActK`] blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")]
pub(super) unsafe fn gemv<const ID: u32>(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    macro_rules! run {
        ($b:ty) => {
            // SAFETY: this function's features; `act` holds one token prepared for the type (the
            // caller's contract).
            one_token_tiles!(w, rows, act, out, ActK, |tile, res| unsafe { tile_dots::<$b>(&tile, &mut res) })
        };
    }
    match const { super::ty::<ID>() } {
        GgmlType::IQ1_S => run!(BlockIq1S),
        GgmlType::IQ1_M => run!(BlockIq1M),
        GgmlType::IQ2_XXS => run!(BlockIq2Xxs),
        GgmlType::IQ2_XS => run!(BlockIq2Xs),
        GgmlType::IQ2_S => run!(BlockIq2S),
        GgmlType::IQ3_XXS => run!(BlockIq3Xxs),
        GgmlType::IQ3_S => run!(BlockIq3S),
        t => unreachable!("{t} has no 512-bit one-token kernel"),
    }
}

/// One tile of [`gemv`].
///
/// # Safety
/// As [`gemv`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")]
unsafe fn tile_dots<B: Zmm>(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    let blocks: [&[B]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let acts = tile.act();
    let mut acc = [_mm256_setzero_ps(); R];
    // SAFETY (whole function): this function's features; every load reads inside a static
    // table, a block or an activation block (256 bytes of `qs`).
    unsafe {
        let zero = _mm512_setzero_si512();
        let unit = (1u32 << B::SHIFT) as f32;
        for b in 0..tile.nb {
            prefetch_next(tile, b);
            let a = &acts[b];
            let v = array!(zero; 4, |r| _mm512_loadu_si512(a.qs[64 * r..].as_ptr().cast()));
            let x = array!(zero; 4, |p| _mm512_permutex2var_epi8(
                v[2 * (p % 2)],
                load!(VALUE_ORDER.0[p]),
                v[2 * (p % 2) + 1]
            ));
            let da = _mm256_set1_ps(a.d);
            // The AVX2 kernel's mins step (zero mins times 0·da), kept for its bits.
            let no_mins = _mm256_mul_ps(_mm256_setzero_ps(), da);
            for i in 0..R {
                let blk = &blocks[i][b];
                let (lv, neg) = blk.dot_regs();
                // Registers 0, 1 and 2, 3 apart where their scales differ (HALVES).
                let mut sums = [zero; 2];
                for p in 0..4 {
                    let signed = _mm512_mask_sub_epi8(x[p], neg[p], zero, x[p]);
                    let h = usize::from(B::HALVES && p >= 2);
                    sums[h] = _mm512_dpbusd_epi32(sums[h], lv[p], signed);
                }
                // Each part's two dwords added, times its scale.
                let (first, second) = blk.scales();
                let parts = array!(zero; 2, |h| _mm512_add_epi32(sums[h], _mm512_srli_epi64::<32>(sums[h])));
                let mut products = _mm512_mul_epi32(parts[0], first);
                if B::HALVES {
                    products = _mm512_add_epi64(products, _mm512_mul_epi32(parts[1], second));
                }
                let dots = _mm512_cvtepi64_ps(products);
                let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(blk.d_bits())))) / unit;
                acc[i] = _mm256_fnmadd_ps(_mm256_setzero_ps(), no_mins, acc[i]);
                acc[i] = _mm256_fmadd_ps(dots, _mm256_mul_ps(_mm256_set1_ps(d), da), acc[i]);
            }
        }
        out[0] = hsum4(acc);
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use kt_core::aligned::AlignedBuf;
    use kt_core::ggml::{GgmlType, QK_K};
    use kt_core::rng::SplitMix64;

    use super::*;
    use crate::vnni::Vnni;

    /// Block `n` of type `t`, its parts' grid indices, sign fields (or bytes) and scales
    /// running through every value as `n` does.
    fn block(t: GgmlType, n: usize) -> Vec<u8> {
        let mut out = f16::from_f32(0.003 * (1 + n % 7) as f32).to_le_bytes().to_vec();
        let word = |part: usize| {
            let fields = (0..4).fold(0u32, |w, p| w | (((4 * part + p) * 37 % 128) as u32) << (7 * p));
            (fields | ((part % 16) as u32) << 28).to_le_bytes()
        };
        let index = |i: usize| (i * 7 % 256) as u8;
        let parts = 8 * n..8 * n + 8;
        match t {
            GgmlType::IQ2_XXS => parts.for_each(|part| {
                out.extend((0..4).map(|e| index(4 * part + e)));
                out.extend(word(part));
            }),
            GgmlType::IQ2_XS => {
                // 9-bit indices with 7 sign bits above, two scale nibbles a part.
                out.extend(parts.flat_map(|part| {
                    (0..4).flat_map(move |p| {
                        let g = 4 * part + p;
                        ((g * 7 % 512) as u16 | ((g * 37 % 128) as u16) << 9).to_le_bytes()
                    })
                }));
                out.extend((0..8).map(|j| (((8 * n + j) % 16) | (((8 * n + j + 3) % 16) << 4)) as u8));
            }
            GgmlType::IQ1_S => {
                // 11-bit indices (low bytes, then a u16 a part: 4 × 3 high bits, scale, shift
                // sign); the sign where the block number's bit matches, both shifts seen.
                out.extend(parts.clone().flat_map(|part| (0..4).map(move |p| index(4 * part + p))));
                out.extend(parts.flat_map(|part| {
                    let high = (0..4).fold(0u16, |w, p| w | (((4 * part + p) * 5 % 8) as u16) << (3 * p));
                    (high | ((part % 8) as u16) << 12 | ((part / 3 % 2) as u16) << 15).to_le_bytes()
                }));
            }
            GgmlType::IQ1_M => {
                // Index low bytes; a nibble per 8 columns (3 high index bits, the shift's sign);
                // 3-bit scales of 16 columns under d's nibbles (d as the block's u16 in `out`).
                out.clear();
                out.extend(parts.clone().flat_map(|part| (0..4).map(move |p| index(4 * part + p))));
                out.extend(parts.flat_map(|part| {
                    (0..2)
                        .map(move |j| (((4 * part + 2 * j) * 5 % 16) | (((4 * part + 2 * j + 1) * 3 % 16) << 4)) as u8)
                }));
                let d = f16::from_f32(0.003 * (1 + n % 7) as f32).to_bits();
                out.extend((0..4).flat_map(|i| {
                    let sc = (0..4).fold(0u16, |w, k| w | (((8 * n + 4 * i + k) % 8) as u16) << (3 * k));
                    (sc | (d >> (4 * i) & 0xF) << 12).to_le_bytes()
                }));
            }
            GgmlType::IQ2_S => {
                // Index low bytes, sign bytes, index high bit pairs, two scale nibbles a part.
                out.extend(parts.clone().flat_map(|part| (0..4).map(move |p| index(4 * part + p))));
                out.extend(parts.clone().flat_map(|part| (0..4).map(move |p| ((4 * part + p) * 53 % 256) as u8)));
                out.extend(parts.map(|part| (part * 29 % 256) as u8));
                out.extend((0..8).map(|j| (((8 * n + j) % 16) | (((8 * n + j + 3) % 16) << 4)) as u8));
            }
            GgmlType::IQ3_XXS => {
                parts.clone().for_each(|part| out.extend((0..8).map(|e| index(8 * part + e))));
                parts.for_each(|part| out.extend(word(part)));
            }
            _ => {
                // iq3_s: 9-bit indices (their ninth bits in `qh`), sign bytes, scale nibbles.
                parts.clone().for_each(|part| out.extend((0..8).map(|e| index(8 * part + e))));
                out.extend(parts.clone().map(|part| (part * 29 % 256) as u8));
                out.extend(parts.clone().flat_map(|part| (0..4).map(move |p| ((4 * part + p) * 53 % 256) as u8)));
                out.extend((0..4).map(|j| (((8 * n + 2 * j) % 16) | (((8 * n + 2 * j + 1) % 16) << 4)) as u8));
            }
        }
        out
    }

    /// Rows of 8 blocks whose parts use every grid index, every sign field and every scale
    /// (and 9 rows: a short last tile; and a call starting at row 3) give the AVX2 one-token
    /// kernel's bits, for activations with ties and the largest values at both signs.
    fn gives_the_avx2_kernels_bits<B: Zmm + crate::decode::KBlock, const ID: u32>() {
        let t = super::super::ty::<ID>();
        let (rows, cols) = (9, 8 * QK_K);
        let data: Vec<u8> = (0..rows * cols / QK_K).flat_map(|n| block(t, n)).collect();
        assert_eq!(data.len(), t.row_bytes(cols) * rows);
        let vnni = Some(Vnni::Evex);
        let w = Packed::new(t, rows, cols, &data, vnni);
        let mut rng = SplitMix64::new(3);
        let x: Vec<bf16> = (0..cols)
            .map(|c| match c % 97 {
                0 => bf16::from_f32(-4.0),
                1 => bf16::from_f32(4.0),
                2 | 3 => bf16::from_f32(1.5),
                _ => bf16::from_f32(rng.gaussian()),
            })
            .collect();
        let mut act = AlignedBuf::zeroed(crate::act::bytes(t, 1, cols, vnni));
        let mut scratch = AlignedBuf::zeroed(crate::act::scratch_bytes(cols));
        let kind = crate::act::layout(t, vnni);
        for range in [0..rows, 3..rows] {
            let (mut got, mut want) = (vec![0.0f32; range.len()], vec![1.0f32; range.len()]);
            // SAFETY: the caller checked the features (AVX2, FMA and F16C with AVX512-VNNI,
            // VBMI, DQ); one token's activations for `t`, prepared as the backend prepares them.
            unsafe {
                crate::act::prepare(t, cols, &x, &[0], act.as_mut_slice(), kind, scratch.as_mut_slice());
                gemv::<ID>(&w, range.clone(), act.as_slice(), &mut got);
                super::super::kquant1::<B>(&w, range.clone(), act.as_slice(), &mut want);
            }
            let bits = |v: &[f32]| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{t} rows {range:?}: {got:?} against {want:?}");
            assert!(want.iter().all(|y| y.is_finite() && *y != 0.0), "{t}: {want:?}");
        }
    }

    #[test]
    fn every_index_sign_and_scale_gives_the_avx2_kernels_bits() {
        let (vbmi, dq) = (is_x86_feature_detected!("avx512vbmi"), is_x86_feature_detected!("avx512dq"));
        if crate::vnni::detect() != Some(Vnni::Evex) || !vbmi || !dq {
            kt_core::skip_isa!("AVX512-VNNI, VBMI or DQ");
            return;
        }
        gives_the_avx2_kernels_bits::<BlockIq1S, { GgmlType::IQ1_S as u32 }>();
        gives_the_avx2_kernels_bits::<BlockIq1M, { GgmlType::IQ1_M as u32 }>();
        gives_the_avx2_kernels_bits::<BlockIq2Xxs, { GgmlType::IQ2_XXS as u32 }>();
        gives_the_avx2_kernels_bits::<BlockIq2Xs, { GgmlType::IQ2_XS as u32 }>();
        gives_the_avx2_kernels_bits::<BlockIq2S, { GgmlType::IQ2_S as u32 }>();
        gives_the_avx2_kernels_bits::<BlockIq3Xxs, { GgmlType::IQ3_XXS as u32 }>();
        gives_the_avx2_kernels_bits::<BlockIq3S, { GgmlType::IQ3_S as u32 }>();
    }
}
