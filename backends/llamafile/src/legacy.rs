//! The 32-column types repacked for the kernels, 8 blocks to a group: the 8 f16 scales (and
//! the 8 f16 offsets of the `_1` types) together, then the levels arranged so that one 32-byte
//! load holds the first 16 columns of two blocks and the next the last 16 (nibbles: the two
//! blocks' bytes side by side already do). Activations are laid out the same way
//! ([`crate::act::ActG8`]), so `maddubs` then `madd` give each block's sum in its own half of
//! the register, and the scales of 8 blocks are converted and multiplied at once. The 8 blocks'
//! sums of one row and token are gathered into one register ([`block_sums`]) in the order
//! 0, 2, 4, 6, 1, 3, 5, 7, which is the order the scales (and offsets) are stored in: one
//! conversion and one multiply-add per group instead of one per pair.
//! q8_0 is laid out otherwise: column pair c of the 8 blocks (in that order) at `16c`, for a
//! kernel that widens levels and activations to i16 and needs no sign trick (`vpmaddwd` alone
//! gives each block's share in its own lane; [`crate::act::ActW8`]); or, for the VNNI kernel,
//! 4 columns of each block to a 32-bit lane ([`quad_at`], [`to_quads`]), levels + 128. For the
//! 512-bit kernels the 4- and 5-bit types' levels take the same places, as nibbles
//! ([`to_nibble_quads`]).
//! q5_0's and q5_1's fifth bits follow the nibbles as one 32-byte bit plane ([`plane`]): a
//! shift and a mask give each register's, where GGUF's per-block words needed a broadcast, a
//! shuffle and a compare (q5_0 decode measured 1.9× faster).
//! mxfp4's nibbles index its e2m1 levels (doubled, as ggml keeps them) plus 12, [`MXFP4_LUT`]:
//! unsigned like q5_0's, with the 12 taken off as q5_0's 16 is ([`offset`]), so it runs on the
//! unsigned types' kernels, VNNI and tiles included. Its e8m0 scale `2^(e − 128)` goes into the
//! f16 slot, exact from 2^-24 to 2^15 (a block below holds values under 2^-21 and is taken as
//! zero; [`mxfp4_scales_fit`] finds those above, which the backend refuses).
//! The 512-bit kernels take iq4_nl's levels plus 128 ([`IQ4NL_LUT`], [`Iq4NlV`]) and take
//! 128·Σa back out of each block's integer sum, as q8_0's do: the sums of AVX2's sign trick,
//! so its results.
//! A group has the bytes of its 8 blocks (mxfp4's with a 2-byte scale); a row's last group is
//! padded with zero blocks.

use core::arch::x86_64::*;

use half::f16;
use kt_core::ggml::{e8m0_half, GgmlType, KVALUES_IQ4NL, KVALUES_MXFP4, QK};

/// Blocks per group.
pub const G: usize = 8;

/// Where block `k` of a group keeps its scale and offset: slots 0..4 hold the even blocks,
/// 4..8 the odd ones ([`block_sums`]'s order).
pub const fn slot(k: usize) -> usize {
    if k % 2 == 0 {
        k / 2
    } else {
        4 + k / 2
    }
}

/// The block at each slot ([`slot`]'s inverse).
pub const ORDER: [usize; G] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Where column `col` of block `k` of a group is among its 256 levels in the layout of the q8_0
/// VNNI kernel: register `j = 2m + h` holds in lane [`slot`]`(k)` columns `8m + 2h` + 0, 1, 4, 5
/// (the order in which two `unpack`s of column pairs would put them).
pub const fn quad_at(k: usize, col: usize) -> usize {
    let (m, r) = (col / 8, col % 8);
    32 * (2 * m + r / 2 % 2) + 4 * slot(k) + r % 2 + 2 * (r / 4)
}

/// [`quad_at`] of every block and column, and where each place's level comes from in a
/// repacked q8_0 group's column pairs: tables, so that packing a row looks them up (computed
/// per level, they took most of a q4_0 load's time).
const QUADS: ([[u8; QK]; G], [u8; 32 * G]) = {
    let (mut at, mut from) = ([[0u8; QK]; G], [0u8; 32 * G]);
    let mut k = 0;
    while k < G {
        let mut col = 0;
        while col < QK {
            at[k][col] = quad_at(k, col) as u8;
            from[quad_at(k, col)] = (16 * (col / 2) + 2 * slot(k) + col % 2) as u8;
            col += 1;
        }
        k += 1;
    }
    (at, from)
};

/// A repacked q8_0 row (column pairs) put in place into the VNNI kernel's layout: levels at
/// [`quad_at`], + 128 (unsigned, for `vpdpbusd`'s unsigned operand). Moving each group at
/// load rather than in the kernel made q8_0 prefill tiles about a tenth faster.
pub fn to_quads(row: &mut [u8]) {
    let (at, gb) = (2 * G, group_bytes(GgmlType::Q8_0));
    for g in row.chunks_exact_mut(gb) {
        let pairs: [u8; 32 * G] = g[at..].try_into().expect("a q8_0 group's levels");
        for (q, &f) in g[at..].iter_mut().zip(&QUADS.1) {
            *q = pairs[usize::from(f)] ^ 0x80;
        }
    }
}

/// A repacked row of a 4- or 5-bit 32-column type put in place into the 512-bit kernels'
/// layout (`kernels::on_zmm`): each group's levels at [`quad_at`], as q8_0's are for VNNI,
/// register `j`'s byte `i` in the low nibble of byte `32·j + i` for `j < 4` and in the high
/// nibble of byte `32·(j − 4) + i`, so that one 64-byte load and a mask (or a shift and a
/// mask) give two whole registers; q5's fifth bits in a plane of the same shape, bit `j` of
/// byte `i` for register `j`'s byte `i`. The kernels used to move them so per token tile (a
/// shuffle and a permute per two registers), which at one token was as much work as the dot.
pub fn to_nibble_quads(t: GgmlType, row: &mut [u8]) {
    let (at, gb) = (levels_at(t), group_bytes(t));
    let five = matches!(t, GgmlType::Q5_0 | GgmlType::Q5_1);
    for g in row.chunks_exact_mut(gb) {
        let mut quads = [0u8; 32 * G];
        for (k, places) in QUADS.0.iter().enumerate() {
            for i in 0..16 {
                let (lo, hi, byte) = (usize::from(places[i]), usize::from(places[i + 16]), g[at + 16 * k + i]);
                (quads[lo], quads[hi]) = (byte & 0xF, byte >> 4);
                if five {
                    let plane = g[at + 16 * G + 16 * (k % 2) + i] >> (2 * (k / 2));
                    quads[lo] |= (plane & 1) << 4;
                    quads[hi] |= ((plane >> 1) & 1) << 4;
                }
            }
        }
        for (i, b) in g[at..at + 16 * G].iter_mut().enumerate() {
            *b = (quads[i] & 0xF) | ((quads[i + 16 * G] & 0xF) << 4);
        }
        if five {
            for (i, b) in g[at + 16 * G..at + 20 * G].iter_mut().enumerate() {
                *b = (0..G).fold(0, |b, j| b | (quads[32 * j + i] >> 4) << j);
            }
        }
    }
}

/// Bytes of one group of `t`.
pub fn group_bytes(t: GgmlType) -> usize {
    match t {
        // An f16 scale in place of the e8m0 byte.
        GgmlType::MXFP4 => G * (t.block_bytes() + 1),
        _ => G * t.block_bytes(),
    }
}

/// The largest e8m0 code whose `2^(e − 128)` an f16 holds (2^15).
const MXFP4_MAX_E: u8 = 143;

/// Whether every block scale of MXFP4 rows `src` fits the f16 the kernels keep it as.
pub fn mxfp4_scales_fit(src: &[u8]) -> bool {
    src.chunks_exact(GgmlType::MXFP4.block_bytes()).all(|b| b[0] <= MXFP4_MAX_E)
}

/// `levels + bias`, as bytes.
const fn biased(levels: [i8; 16], bias: i16) -> [u8; 16] {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (levels[i] as i16 + bias) as u8;
        i += 1;
    }
    t
}

/// mxfp4's levels as the kernels take them: its table + 12, 0..=24.
pub const MXFP4_LUT: [u8; 16] = biased(KVALUES_MXFP4, 12);

/// iq4_nl's levels as the 512-bit kernels take them: its table + 128, 1..=241.
pub const IQ4NL_LUT: [u8; 16] = biased(KVALUES_IQ4NL, 128);

/// iq4_nl's signed levels, as bytes.
const IQ4NL_SIGNED: [u8; 16] = biased(KVALUES_IQ4NL, 0);

/// The table a nibble indexes in the tile kernels (int8 levels), for the types that have one:
/// iq4_nl's signed levels, mxfp4's unsigned ones ([`MXFP4_LUT`]).
pub fn lut(t: GgmlType) -> Option<&'static [u8; 16]> {
    match t {
        GgmlType::IQ4_NL => Some(&IQ4NL_SIGNED),
        GgmlType::MXFP4 => Some(&MXFP4_LUT),
        _ => None,
    }
}

/// Bytes of a repacked row of `cols` columns.
pub fn row_bytes(t: GgmlType, cols: usize) -> usize {
    (cols / QK).div_ceil(G) * group_bytes(t)
}

/// Per block: (d, m, 16 bytes of nibbles or 32 signed levels, 5th bits).
fn fields(t: GgmlType, b: &[u8]) -> ([u8; 2], [u8; 2], &[u8], u32) {
    let qh = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let d = [b[0], b[1]];
    match t {
        GgmlType::MXFP4 => (f16::from_f32(e8m0_half(b[0])).to_le_bytes(), [0; 2], &b[1..17], 0),
        GgmlType::Q4_0 | GgmlType::IQ4_NL => (d, [0; 2], &b[2..18], 0),
        GgmlType::Q4_1 => (d, [b[2], b[3]], &b[4..20], 0),
        GgmlType::Q5_0 => (d, [0; 2], &b[6..22], qh(2)),
        GgmlType::Q5_1 => (d, [b[2], b[3]], &b[8..24], qh(4)),
        GgmlType::Q8_0 => (d, [0; 2], &b[2..34], 0),
        _ => unreachable!("32-column types only"),
    }
}

/// Repack one row (`src`: its GGUF blocks) into `out[..row_bytes]`.
pub fn repack_row(t: GgmlType, src: &[u8], out: &mut [u8]) {
    let (bb, gb) = (t.block_bytes(), group_bytes(t));
    let nb = src.len() / bb;
    out.fill(0);
    for (g, o) in out.chunks_exact_mut(gb).enumerate() {
        // The group's blocks (the row's last group may have fewer).
        let mut all: [&[u8]; G] = [&[]; G];
        let n = (0..G)
            .map_while(|k| src.get((g * G + k) * bb..(g * G + k + 1) * bb))
            .zip(&mut all)
            .map(|(b, a)| *a = b)
            .count();
        let blocks = &all[..n];
        debug_assert!(g * G < nb);
        let mut qh = [0u32; G];
        for (k, b) in blocks.iter().enumerate() {
            let (d, m, _, h) = fields(t, b);
            o[2 * slot(k)..2 * slot(k) + 2].copy_from_slice(&d);
            if matches!(t, GgmlType::Q4_1 | GgmlType::Q5_1) {
                o[2 * G + 2 * slot(k)..2 * G + 2 * slot(k) + 2].copy_from_slice(&m);
            }
            qh[k] = h;
        }
        let mut at = levels_at(t);
        if t == GgmlType::Q8_0 {
            // Column pair c (columns 2c, 2c+1) of the 8 blocks in slot order: widened to i16,
            // one `madd` gives each block's share in its own lane ([`crate::act::ActW8`]).
            let levels: [&[u8]; G] = core::array::from_fn(|k| blocks.get(k).map_or(&[0u8; 32][..], |b| fields(t, b).2));
            for c in 0..QK / 2 {
                for k in ORDER {
                    put(o, &mut at, &levels[k][2 * c..2 * c + 2]);
                }
            }
        } else {
            for k in 0..G {
                put(o, &mut at, blocks.get(k).map_or(&[0u8; 16][..], |b| fields(t, b).2));
            }
        }
        if matches!(t, GgmlType::Q5_0 | GgmlType::Q5_1) {
            put(o, &mut at, &plane(&qh));
        }
    }
}

/// The fifth bits of a group's 8 blocks (`qh`) as one 32-byte plane: bit `i` of byte `j` is
/// the fifth bit of byte `j` of level register `i` (pair `i / 2`, columns `16·(i % 2)..` of
/// both blocks), so a register's bits are one shift and one mask away ([`five_bits`]).
fn plane(qh: &[u32; G]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for i in 0..G {
        let (p, half) = (i / 2, 16 * (i % 2));
        for (j, o) in out.iter_mut().enumerate() {
            let (k, col) = if j < 16 { (2 * p, half + j) } else { (2 * p + 1, half + j - 16) };
            *o |= (((qh[k] >> col) & 1) as u8) << i;
        }
    }
    out
}

fn put(o: &mut [u8], at: &mut usize, bytes: &[u8]) {
    o[*at..*at + bytes.len()].copy_from_slice(bytes);
    *at += bytes.len();
}

/// How a type's per-column offset `m` is found.
#[derive(Clone, Copy, PartialEq)]
pub enum Offset {
    /// None (`m = 0`).
    Zero,
    /// `m = k·d`.
    OfD(f32),
    /// Stored f16 after the scales.
    Stored,
}

/// The offset of 32-column type `t`'s levels (q4_0's and q5_0's are unsigned, their midpoint
/// in `m`).
pub const fn offset(t: GgmlType) -> Offset {
    match t {
        GgmlType::Q4_0 => Offset::OfD(-8.0),
        GgmlType::Q5_0 => Offset::OfD(-16.0),
        GgmlType::MXFP4 => Offset::OfD(-12.0),
        GgmlType::Q4_1 | GgmlType::Q5_1 => Offset::Stored,
        _ => Offset::Zero,
    }
}

/// Byte offset of the levels in a group of 32-column type `t`: after the 8 scales, and the 8
/// offsets of the `_1` types.
pub const fn levels_at(t: GgmlType) -> usize {
    match t {
        GgmlType::Q4_1 | GgmlType::Q5_1 => 4 * G,
        _ => 2 * G,
    }
}

/// A repacked 32-column type.
pub trait LGroup {
    /// Levels are signed (q8_0, iq4_nl): no two pairs' `maddubs` sums may be added in i16.
    const SIGNED: bool;
    /// Levels are 0..=15: a whole block's pair sums (16 of them) still fit in i16.
    const FOUR_BIT: bool;
    /// Its offset.
    const OFFSET: Offset;
    /// Byte offset of the levels in a group.
    const LEVELS: usize;
    /// Fifth bits follow the nibbles ([`plane`]: q5_0, q5_1).
    const PLANE: bool = false;
    /// Unsigned levels are this table's entries at the nibbles ([`MXFP4_LUT`], [`IQ4NL_LUT`]).
    const LUT: Option<[u8; 16]> = None;
    /// The levels carry + 128 that the activations' `-128·Σa` ([`crate::act::ActV8`]) takes
    /// back out of each block's sum ([`Iq4NlV`], [`Q80V`]).
    const PLUS_128: bool = false;
    /// The levels are whole bytes already in the 4-column lanes ([`to_quads`]: q8_0 for the
    /// 512-bit kernels), no nibbles to split.
    const BYTES: bool = false;
}

/// A repacked 32-column type whose groups the AVX2 kernels read in pairs of blocks.
pub trait PairLevels: LGroup {
    /// The levels of pair `p` (blocks 2p, 2p+1): (columns 0..16 of both, columns 16..32).
    ///
    /// # Safety
    /// AVX2 must be present; `g` is one whole group.
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i);
}

/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn load(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    // SAFETY: ≥ 32 bytes; AVX by the callers' contract.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// Nibbles of two blocks' 32 bytes: (low, high).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn nibbles(x: __m256i) -> (__m256i, __m256i) {
    // SAFETY: AVX2 by contract.
    unsafe {
        let m = _mm256_set1_epi8(0x0F);
        (_mm256_and_si256(x, m), _mm256_and_si256(_mm256_srli_epi16::<4>(x), m))
    }
}

/// Bit `i` of every byte of `plane` as 0x10 (`i` a constant once the callers' loops unroll).
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub(crate) unsafe fn bit4(plane: __m256i, i: usize) -> __m256i {
    // SAFETY: AVX2 by contract. 16-bit shifts move no bit across a byte into bit 4 or 12.
    unsafe {
        let v = match i {
            0 => _mm256_slli_epi16::<4>(plane),
            1 => _mm256_slli_epi16::<3>(plane),
            2 => _mm256_slli_epi16::<2>(plane),
            3 => _mm256_slli_epi16::<1>(plane),
            4 => plane,
            5 => _mm256_srli_epi16::<1>(plane),
            6 => _mm256_srli_epi16::<2>(plane),
            _ => _mm256_srli_epi16::<3>(plane),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x10))
    }
}

/// Nibbles plus fifth bits (their [`plane`] after the 8 blocks' nibbles) of pair `p`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
unsafe fn five_bits(g: &[u8], levels: usize, p: usize) -> (__m256i, __m256i) {
    // SAFETY: AVX2 by contract; the group holds the nibbles and the plane.
    unsafe {
        let (lo, hi) = nibbles(load(&g[levels + 32 * p..]));
        let plane = load(&g[levels + 16 * G..]);
        (_mm256_or_si256(lo, bit4(plane, 2 * p)), _mm256_or_si256(hi, bit4(plane, 2 * p + 1)))
    }
}

/// Marker types, one per repacked format.
pub struct Q40;
/// q4_1.
pub struct Q41;
/// q5_0.
pub struct Q50;
/// q5_1.
pub struct Q51;
/// iq4_nl.
pub struct Iq4Nl;
/// iq4_nl in the 512-bit kernels.
pub struct Iq4NlV;
/// q8_0 in the 512-bit kernels.
pub struct Q80V;
/// mxfp4.
pub struct Mxfp4;

// SAFETY (every `PairLevels` impl): AVX2 by the trait's contract; loads stay inside the group.
impl LGroup for Q40 {
    const SIGNED: bool = false;
    const FOUR_BIT: bool = true;
    const OFFSET: Offset = offset(GgmlType::Q4_0);
    const LEVELS: usize = levels_at(GgmlType::Q4_0);
}

impl PairLevels for Q40 {
    #[inline(always)]
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of the group's
        // slice, which holds them (bounds-checked).
        unsafe { nibbles(load(&g[Self::LEVELS + 32 * p..])) }
    }
}

impl LGroup for Q41 {
    const SIGNED: bool = false;
    const FOUR_BIT: bool = true;
    const OFFSET: Offset = offset(GgmlType::Q4_1);
    const LEVELS: usize = levels_at(GgmlType::Q4_1);
}

impl PairLevels for Q41 {
    #[inline(always)]
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of the group's
        // slice, which holds them (bounds-checked).
        unsafe { nibbles(load(&g[Self::LEVELS + 32 * p..])) }
    }
}

impl LGroup for Q50 {
    const SIGNED: bool = false;
    const FOUR_BIT: bool = false;
    const PLANE: bool = true;
    const OFFSET: Offset = offset(GgmlType::Q5_0);
    const LEVELS: usize = levels_at(GgmlType::Q5_0);
}

impl PairLevels for Q50 {
    #[inline(always)]
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of the group's
        // slice, which holds them (bounds-checked).
        unsafe { five_bits(g, Self::LEVELS, p) }
    }
}

impl LGroup for Q51 {
    const SIGNED: bool = false;
    const FOUR_BIT: bool = false;
    const PLANE: bool = true;
    const OFFSET: Offset = offset(GgmlType::Q5_1);
    const LEVELS: usize = levels_at(GgmlType::Q5_1);
}

impl PairLevels for Q51 {
    #[inline(always)]
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of the group's
        // slice, which holds them (bounds-checked).
        unsafe { five_bits(g, Self::LEVELS, p) }
    }
}

impl LGroup for Mxfp4 {
    const SIGNED: bool = false;
    // Levels up to 24.
    const FOUR_BIT: bool = false;
    const OFFSET: Offset = offset(GgmlType::MXFP4);
    const LEVELS: usize = levels_at(GgmlType::MXFP4);
    const LUT: Option<[u8; 16]> = Some(MXFP4_LUT);
}

impl PairLevels for Mxfp4 {
    #[inline(always)]
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of the group's
        // slice, which holds them (bounds-checked).
        unsafe { looked_up(&MXFP4_LUT, load(&g[Self::LEVELS + 32 * p..])) }
    }
}

/// iq4_nl in the 512-bit kernels ([`IQ4NL_LUT`]): its levels carry + 128, which those kernels
/// take back out of each block's sum.
impl LGroup for Iq4NlV {
    const SIGNED: bool = false;
    const FOUR_BIT: bool = false;
    const OFFSET: Offset = offset(GgmlType::IQ4_NL);
    const LEVELS: usize = levels_at(GgmlType::IQ4_NL);
    const LUT: Option<[u8; 16]> = Some(IQ4NL_LUT);
    const PLUS_128: bool = true;
}

/// q8_0 in the 512-bit kernels: its levels + 128 in the 4-column lanes ([`to_quads`]), so
/// each block's sum starts at -128·Σa, as [`Iq4NlV`]'s.
impl LGroup for Q80V {
    const SIGNED: bool = false;
    const FOUR_BIT: bool = false;
    const OFFSET: Offset = offset(GgmlType::Q8_0);
    const LEVELS: usize = levels_at(GgmlType::Q8_0);
    const PLUS_128: bool = true;
    const BYTES: bool = true;
}

impl LGroup for Iq4Nl {
    const SIGNED: bool = true;
    const FOUR_BIT: bool = false;
    const OFFSET: Offset = offset(GgmlType::IQ4_NL);
    const LEVELS: usize = levels_at(GgmlType::IQ4_NL);
}

impl PairLevels for Iq4Nl {
    #[inline(always)]
    unsafe fn pair(g: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: AVX2 by the inlining kernels' features; `load` reads 32 bytes of the group's
        // slice, which holds them (bounds-checked).
        unsafe { looked_up(&IQ4NL_SIGNED, load(&g[Self::LEVELS + 32 * p..])) }
    }
}

/// [`nibbles`] of two blocks' 32 bytes, each replaced by its entry of `table`.
///
/// # Safety
/// AVX2 is present (inlined into functions that enable it).
#[inline(always)]
unsafe fn looked_up(table: &[u8; 16], x: __m256i) -> (__m256i, __m256i) {
    // SAFETY: AVX2 by the callers' contract; 16 bytes of `table`.
    unsafe {
        let l = _mm_loadu_si128(table.as_ptr().cast());
        let lut = _mm256_set_m128i(l, l);
        let (lo, hi) = nibbles(x);
        (_mm256_shuffle_epi8(lut, lo), _mm256_shuffle_epi8(lut, hi))
    }
}

/// One row and token's 8 block sums of a group, from the 4 pairs' `madd` results
/// (`[pair p: block 2p ×4 | block 2p+1 ×4]` partial sums), as `[0, 2, 4, 6 | 1, 3, 5, 7]`.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub unsafe fn block_sums(m: [__m256i; 4]) -> __m256i {
    // SAFETY: AVX2 by the callers' contract.
    unsafe {
        let fold = |x, y| _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));
        let (r01, r23) = (fold(m[0], m[1]), fold(m[2], m[3])); // [0 2 0 2 | 1 3 1 3], [4 6 4 6 | 5 7 5 7]
        _mm256_add_epi32(_mm256_unpacklo_epi64(r01, r23), _mm256_unpackhi_epi64(r01, r23))
    }
}

/// As [`block_sums`] from the 4 pairs' i16 `maddubs` sums (`[block 2p ×8 | block 2p+1 ×8]`) of
/// 4-bit levels, folded in i16 (16 products of ≤ 15 · 127 each fit) with one `madd` at the end.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub unsafe fn block_sums16(s: [__m256i; 4]) -> __m256i {
    // SAFETY: AVX2 by the callers' contract.
    unsafe {
        let fold = |x, y| _mm256_add_epi16(_mm256_unpacklo_epi16(x, y), _mm256_unpackhi_epi16(x, y));
        let (r01, r23) = (fold(s[0], s[1]), fold(s[2], s[3])); // i16 [0 2 ×4 | 1 3 ×4], [4 6 ×4 | 5 7 ×4]
        let q = _mm256_add_epi16(_mm256_unpacklo_epi32(r01, r23), _mm256_unpackhi_epi32(r01, r23)); // [0 2 4 6 ×2 | ..]
        let pairs = _mm256_setr_epi8(
            0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
        );
        _mm256_madd_epi16(_mm256_shuffle_epi8(q, pairs), _mm256_set1_epi16(1))
    }
}

/// The 8 scales (or offsets) of a group as f32 (F16C), in [`slot`] order.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[inline(always)]
pub unsafe fn scales(g: &[u8], at: usize) -> __m256 {
    // SAFETY: 16 bytes at `at` inside the group; F16C by the callers' contract.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(g[at..at + 16].as_ptr().cast())) }
}

#[cfg(test)]
mod tests {
    use half::f16;
    use kt_core::ggml::{dequantize_row, random_matrix};

    use super::*;

    /// Undo the repacking in scalar code: every block's values from the repacked bytes.
    fn unpack(t: GgmlType, row: &[u8], cols: usize) -> Vec<f32> {
        let gb = group_bytes(t);
        let mut out = vec![0.0f32; cols];
        for (c, o) in out.iter_mut().enumerate() {
            let (blk, j) = (c / QK, c % QK);
            let (g, k) = (&row[(blk / G) * gb..][..gb], blk % G);
            let s = 2 * slot(k);
            let d = f16::from_le_bytes([g[s], g[s + 1]]).to_f32();
            let m = match t {
                GgmlType::Q4_1 | GgmlType::Q5_1 => f16::from_le_bytes([g[16 + s], g[17 + s]]).to_f32(),
                _ => 0.0,
            };
            let lv = levels_at(t);
            let (p, second) = (k / 2, k % 2);
            let q: f32 = if t == GgmlType::Q8_0 {
                f32::from(g[lv + 16 * (j / 2) + 2 * slot(k) + j % 2] as i8)
            } else {
                let byte = g[lv + 16 * k + j % 16];
                let mut n = if j < 16 { byte & 0xF } else { byte >> 4 };
                if matches!(t, GgmlType::Q5_0 | GgmlType::Q5_1) {
                    let byte = g[lv + 16 * G + 16 * second + j % 16];
                    n |= ((byte >> (2 * p + j / 16)) & 1) << 4;
                }
                match t {
                    GgmlType::IQ4_NL => f32::from(KVALUES_IQ4NL[usize::from(n)]),
                    GgmlType::MXFP4 => f32::from(KVALUES_MXFP4[usize::from(n)]),
                    GgmlType::Q4_0 => f32::from(n as i8 - 8),
                    GgmlType::Q5_0 => f32::from(n as i8 - 16),
                    _ => f32::from(n),
                }
            };
            *o = q * d + m;
        }
        out
    }

    #[test]
    fn quads_keep_every_value() {
        let cols = 320;
        let m = random_matrix(GgmlType::Q8_0, 2, cols, 7);
        for r in 0..2 {
            let mut pairs = vec![0u8; row_bytes(GgmlType::Q8_0, cols)];
            repack_row(GgmlType::Q8_0, m.row_data(r), &mut pairs);
            let mut quads = pairs.clone();
            to_quads(&mut quads);
            let gb = group_bytes(GgmlType::Q8_0);
            for c in 0..cols {
                let (blk, j) = (c / QK, c % QK);
                let g = (blk / G) * gb;
                // Scales stay; each level moves, + 128.
                assert_eq!(quads[g..g + 2 * G], pairs[g..g + 2 * G]);
                let (q, p) = (
                    quads[g + 2 * G + quad_at(blk % G, j)],
                    pairs[g + 2 * G + 16 * (j / 2) + 2 * slot(blk % G) + j % 2],
                );
                assert_eq!(q, p ^ 0x80, "row {r} column {c}");
            }
        }
        // quad_at is a permutation of a group's levels.
        let mut seen = [false; 32 * G];
        (0..G).for_each(|k| (0..QK).for_each(|c| seen[quad_at(k, c)] = true));
        assert!(seen.iter().all(|&s| s));
    }

    /// Each level of a 4- or 5-bit row is where [`to_nibble_quads`] says: register `j`'s byte
    /// `i` (its place by [`quad_at`]) in nibble `j / 4` of byte `32·(j % 4) + i`, its fifth
    /// bit at bit `j` of plane byte `i`; the scales stay.
    #[test]
    fn nibble_quads_keep_every_value() {
        for t in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL, GgmlType::MXFP4] {
            let cols = 320;
            let m = random_matrix(t, 2, cols, 9);
            let (at, gb) = (levels_at(t), group_bytes(t));
            let five = matches!(t, GgmlType::Q5_0 | GgmlType::Q5_1);
            for r in 0..2 {
                let mut pairs = vec![0u8; row_bytes(t, cols)];
                repack_row(t, m.row_data(r), &mut pairs);
                let mut quads = pairs.clone();
                to_nibble_quads(t, &mut quads);
                for c in 0..cols {
                    let (g, k, col) = ((c / QK / G) * gb, c / QK % G, c % QK);
                    assert_eq!(quads[g..g + at], pairs[g..g + at], "{t} scales");
                    // The level as the AVX2 layout keeps it ([`unpack`] above).
                    let byte = pairs[g + at + 16 * k + col % 16];
                    let mut want = if col < 16 { byte & 0xF } else { byte >> 4 };
                    let (j, i) = (quad_at(k, col) / 32, quad_at(k, col) % 32);
                    let mut got = (quads[g + at + 32 * (j % 4) + i] >> (4 * (j / 4))) & 0xF;
                    if five {
                        want |=
                            ((pairs[g + at + 16 * G + 16 * (k % 2) + col % 16] >> (2 * (k / 2) + col / 16)) & 1) << 4;
                        got |= ((quads[g + at + 16 * G + i] >> j) & 1) << 4;
                    }
                    assert_eq!(got, want, "{t} row {r} column {c}");
                }
            }
        }
    }

    #[test]
    fn repacking_keeps_every_value() {
        for t in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::IQ4_NL,
            GgmlType::MXFP4,
        ] {
            for cols in [32, 96, 256, 320] {
                let m = random_matrix(t, 3, cols, cols as u64);
                for r in 0..3 {
                    let mut packed = vec![0u8; row_bytes(t, cols)];
                    repack_row(t, m.row_data(r), &mut packed);
                    let mut want = vec![0.0f32; cols];
                    dequantize_row(t, m.row_data(r), &mut want);
                    assert_eq!(unpack(t, &packed, cols), want, "{t} cols {cols} row {r}");
                }
            }
        }
    }
}
