//! The lane layout of the 256-column blocks: register `r` (0..8) of a block holds, in its
//! i16 lane `h` (bytes 2h and 2h + 1), columns `16h + 2r` and `16h + 2r + 1`. Every lane of
//! every register then belongs to one 16-column group, so the `maddubs` pair sums of several
//! registers add up in i16 and one `madd` with the 16 group scales serves them all
//! ([`crate::decode::KBlock::FOLD`]), where chunk-ordered registers each need their scales
//! shuffled into place and a `madd` of their own.
//!
//! Weights are put in this order at load by moving each level inside the block's own bit
//! fields ([`relevel`]), so a register decodes as a chunk of the GGUF layout does; activations
//! when they are quantized ([`order_act_avx2`]); the lattice types' levels, looked up from
//! tables, as they are decoded ([`transpose`]). Scales, mins and the activations' 16-column sums
//! keep their column order.

use bytemuck::Pod;
use kt_core::ggml::QK_K;

/// Registers per block.
pub const REGS: usize = 8;

/// A block type whose levels are bit fields: moved into the lane layout at load
/// ([`relevel`]), or from one type's fields into another's ([`refield`]).
pub trait Relevel: Pod {
    /// Where the levels of columns `16h..16h + 16` of chunk `c` live: up to three bit fields,
    /// low bits first, each in 16 consecutive bytes.
    fn fields(c: usize, h: usize) -> Fields;
}

/// A level's bit fields, low bits first, [`NONE`] after the last.
pub type Fields = [Field; 3];

/// Bits `shift..shift + width` of bytes `at..at + 16` of a block, one column each (`width` 0:
/// no field).
#[derive(Clone, Copy)]
pub struct Field {
    /// Byte offset in the block.
    pub at: usize,
    /// First bit.
    pub shift: u32,
    /// Bits.
    pub width: u32,
}

/// No field.
pub const NONE: Field = Field { at: 0, shift: 0, width: 0 };

/// Bits `shift..shift + width` of bytes `at..`.
pub const fn field(at: usize, shift: usize, width: u32) -> Field {
    Field { at, shift: shift as u32, width }
}

/// The column of byte `b` of register `r`.
pub const fn column(r: usize, b: usize) -> usize {
    16 * (b / 2) + 2 * r + b % 2
}

/// An activation block's values from column order into the lane layout: the definition that
/// [`order_act_avx2`] is tested against, and [`relevel`]'s way on a CPU without AVX2.
pub fn order_act(qs: &mut [i8; QK_K]) {
    let src = *qs;
    for r in 0..REGS {
        for b in 0..32 {
            qs[32 * r + b] = src[column(r, b)];
        }
    }
}

/// An activation block's values from column order into the lane layout
/// ([`column`](fn@column)), in registers: the block is 16 rows of 16 columns, i.e. of 8
/// two-column words, and register `r` is word `r` of every row, a transpose. Rows `j` and
/// `j + 8` share register `j`, so an 8 × 8 word transpose within each 128-bit half gives rows
/// 0..8 of word `r` in the low half of register `r` and rows 8..16 in the high one. (Byte by
/// byte, as the tests' definition does it, was over a third of the Q8_K activations'
/// preparation.)
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2")]
pub unsafe fn order_act_avx2(qs: &mut [i8; QK_K]) {
    use core::arch::x86_64::*;
    let p = qs.as_ptr();
    // SAFETY (loads and stores): 16-byte rows j and j + 8 of the 256 bytes, and the 8 32-byte
    // registers, all inside `qs`.
    let mut y = [_mm256_setzero_si256(); 8];
    for (j, y) in y.iter_mut().enumerate() {
        *y = unsafe { _mm256_loadu2_m128i(p.add(16 * (j + 8)).cast(), p.add(16 * j).cast()) };
    }
    let out = qs.as_mut_ptr();
    // SAFETY: AVX2, this function's feature.
    for (r, v) in unsafe { transpose(y) }.into_iter().enumerate() {
        unsafe { _mm256_storeu_si256(out.add(32 * r).cast(), v) };
    }
}

/// The registers of a block in the lane layout from its 16-column rows: `y[j]` holds row `j`
/// in its low half and row `j + 8` in its high one ([`order_act_avx2`]).
///
/// # Safety
/// AVX2 must be present (inlined into callers with the feature).
#[inline(always)]
pub unsafe fn transpose(y: [core::arch::x86_64::__m256i; 8]) -> [core::arch::x86_64::__m256i; REGS] {
    use core::arch::x86_64::*;
    // SAFETY: register operations only; AVX2 by the caller's contract.
    unsafe {
        let mut a = [_mm256_setzero_si256(); 8];
        for k in 0..4 {
            a[2 * k] = _mm256_unpacklo_epi16(y[2 * k], y[2 * k + 1]);
            a[2 * k + 1] = _mm256_unpackhi_epi16(y[2 * k], y[2 * k + 1]);
        }
        let mut b = [_mm256_setzero_si256(); 8];
        for q in 0..2 {
            for m in 0..2 {
                let (lo, hi) = (a[4 * q + m], a[4 * q + m + 2]);
                b[4 * q + 2 * m] = _mm256_unpacklo_epi32(lo, hi);
                b[4 * q + 2 * m + 1] = _mm256_unpackhi_epi32(lo, hi);
            }
        }
        let mut out = [_mm256_setzero_si256(); REGS];
        for m in 0..4 {
            // b[m] and b[4 + m] hold words 2m and 2m + 1 of rows 0..4 and 4..8 (per half).
            out[2 * m] = _mm256_unpacklo_epi64(b[m], b[4 + m]);
            out[2 * m + 1] = _mm256_unpackhi_epi64(b[m], b[4 + m]);
        }
        out
    }
}

/// `blk` with its levels in the lane layout: the level of chunk `r`, column `b` (GGUF's
/// addressing) becomes that of column [`column`](fn@column)`(r, b)`. The levels are read out in
/// column order, put in the lane layout as the activations are ([`order_act_avx2`]: the
/// byte-by-byte move had become half of packing a K-quant), and written back 16 at a time.
pub fn relevel<B: Relevel>(blk: &B) -> B {
    let src = bytemuck::bytes_of(blk);
    let mut lv = [0u8; QK_K];
    for (g, o) in lv.chunks_exact_mut(16).enumerate() {
        o.copy_from_slice(&read(src, B::fields(g / 2, g % 2)));
    }
    let lanes: &mut [i8; QK_K] = bytemuck::cast_mut(&mut lv);
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked on the line above.
        unsafe { order_act_avx2(lanes) };
    } else {
        order_act(lanes);
    }
    let mut out = *blk;
    let dst = bytemuck::bytes_of_mut(&mut out);
    for (j, v) in lv.chunks_exact(16).enumerate() {
        write(dst, B::fields(j / 2, j % 2), v.try_into().expect("16 levels"));
    }
    out
}

/// `dst` with the levels of `src`, chunk by chunk in GGUF's addressing, moved from `S`'s bit
/// fields into `D`'s (the other bytes of `dst` as given).
pub fn refield<S: Relevel, D: Relevel>(src: &S, mut dst: D) -> D {
    let (a, b) = (bytemuck::bytes_of(src), bytemuck::bytes_of_mut(&mut dst));
    for c in 0..REGS {
        for h in 0..2 {
            write(b, D::fields(c, h), read(a, S::fields(c, h)));
        }
    }
    dst
}

/// The 16 levels that `fields` describe. The 16 bytes of a field are taken as one `u128`
/// (a field never crosses its byte, so shifting the word and masking every byte is each
/// byte's shift and mask): byte by byte, with the fields known only at run time, this and
/// [`write()`] were three quarters of packing q3_K.
fn read(bytes: &[u8], fields: Fields) -> [u8; 16] {
    let (mut lv, mut at) = (0u128, 0);
    for f in fields.into_iter().take_while(|f| f.width > 0) {
        lv |= ((word(bytes, f) >> f.shift) & masks(f)) << at;
        at += f.width;
    }
    lv.to_le_bytes()
}

/// Put the 16 levels `v` in `fields`, leaving their bytes' other bits. (Shifting the word
/// right by a field's width brings the next byte's low bits into each byte's top ones, which
/// the later, narrower fields never read: a level's widths add up to 8 at most.)
fn write(bytes: &mut [u8], fields: Fields, v: [u8; 16]) {
    let mut x = u128::from_le_bytes(v);
    for f in fields.into_iter().take_while(|f| f.width > 0) {
        let m = masks(f);
        let o = (word(bytes, f) & !(m << f.shift)) | ((x & m) << f.shift);
        bytes[f.at..f.at + 16].copy_from_slice(&o.to_le_bytes());
        x >>= f.width;
    }
}

/// A field's 16 bytes as one little-endian word.
fn word(bytes: &[u8], f: Field) -> u128 {
    u128::from_le_bytes(bytes[f.at..f.at + 16].try_into().expect("16 bytes"))
}

/// The field's mask in every byte of a word.
fn masks(f: Field) -> u128 {
    u128::from(mask(f)) * (u128::MAX / 255)
}

fn mask(f: Field) -> u8 {
    ((1u16 << f.width) - 1) as u8
}

#[cfg(test)]
mod tests {
    use core::ops::Range;

    use kt_core::ggml::{self, GgmlType};

    use super::*;
    use crate::decode::{Iq4XsU, KBlock, Q3KU, Q4KU, Q5KU, Q6KP};

    #[test]
    fn order_act_avx2_is_order_act() {
        if !is_x86_feature_detected!("avx2") {
            kt_core::skip_isa!("AVX2");
            return;
        }
        let mut r = kt_core::rng::SplitMix64::new(9);
        for _ in 0..4 {
            let qs: [i8; QK_K] = core::array::from_fn(|_| r.next_u64() as i8);
            let (mut want, mut got) = (qs, qs);
            order_act(&mut want);
            // SAFETY: AVX2 checked above.
            unsafe { order_act_avx2(&mut got) };
            assert_eq!(got, want);
        }
    }

    #[test]
    fn every_column_is_placed_once() {
        let mut seen = [false; QK_K];
        for r in 0..REGS {
            for b in 0..32 {
                assert!(!std::mem::replace(&mut seen[column(r, b)], true));
                assert_eq!(column(r, b) / 16, b / 2, "lane h holds 16 columns h");
            }
        }
    }

    /// The registers of a releveled block, as the kernels decode them, hold each column's
    /// level as the GGUF layout stores it (the fields of chunk c/32, column c%32), and no bit
    /// outside the levels changed.
    fn check<B: Relevel + KBlock>(t: GgmlType, from: impl Fn(&[u8]) -> B) {
        let m = ggml::random_matrix(t, 1, QK_K, 7);
        let blk = from(m.data());
        let moved = relevel(&blk);
        let (a, b) = (bytemuck::bytes_of(&blk), bytemuck::bytes_of(&moved));
        for r in 0..REGS {
            let mut reg = [0u8; 32];
            // SAFETY: AVX2, FMA and F16C checked by the caller.
            unsafe { core::arch::x86_64::_mm256_storeu_si256(reg.as_mut_ptr().cast(), moved.reg(r)) };
            for (j, &got) in reg.iter().enumerate() {
                let c = column(r, j);
                let level = level(a, B::fields(c / 32, (c % 32) / 16), c % 16);
                let want = if B::SIGNED { ggml::KVALUES_IQ4NL[usize::from(level)] as u8 } else { level };
                assert_eq!(got, want, "{t:?} register {r} byte {j}");
            }
        }
        let mut level_bits = vec![0u8; a.len()];
        for c in 0..REGS {
            for h in 0..2 {
                for f in B::fields(c, h) {
                    level_bits[f.at..f.at + 16].iter_mut().for_each(|b| *b |= mask(f) << f.shift);
                }
            }
        }
        for (i, m) in level_bits.iter().enumerate() {
            assert_eq!(a[i] & !m, b[i] & !m, "{t:?} byte {i} outside the levels changed");
        }
    }

    /// The level of column `k` of 16 described by `fields`, bit by bit.
    fn level(bytes: &[u8], fields: Fields, k: usize) -> u8 {
        let (mut v, mut at) = (0, 0);
        for f in fields {
            v |= ((bytes[f.at + k] >> f.shift) & mask(f)) << at;
            at += f.width;
        }
        v
    }

    #[test]
    fn relevel_moves_each_level_to_its_column() {
        kt_core::skip_unless_runs!(&crate::LLAMAFILE);
        fn cast<B: Relevel + KBlock>(d: &[u8]) -> B {
            *bytemuck::from_bytes(d)
        }
        check::<ggml::BlockQ2K>(GgmlType::Q2_K, cast);
        check::<Q3KU>(GgmlType::Q3_K, |d| Q3KU::from_block(bytemuck::from_bytes(d)));
        check::<Q6KP>(GgmlType::Q6_K, |d| Q6KP::from_block(bytemuck::from_bytes(d)));
        check::<Iq4XsU>(GgmlType::IQ4_XS, |d| Iq4XsU::from_block(bytemuck::from_bytes(d)));
        check::<Q4KU>(GgmlType::Q4_K, |d| Q4KU::from_block(bytemuck::from_bytes(d)));
        check::<Q5KU>(GgmlType::Q5_K, |d| Q5KU::from_block(bytemuck::from_bytes(d)));
    }

    /// `D`'s fields hold every level of `S`'s (a GGUF block), chunk by chunk, and use each bit
    /// of its bytes `planes` once.
    fn keeps_every_level<S: Relevel, D: Relevel>(t: GgmlType, from: impl Fn(&S) -> D, planes: Range<usize>) {
        let m = ggml::random_matrix(t, 4, QK_K, 11);
        for src in m.data().chunks_exact(size_of::<S>()) {
            let gguf: &S = bytemuck::from_bytes(src);
            let (a, packed) = (bytemuck::bytes_of(gguf), from(gguf));
            let b = bytemuck::bytes_of(&packed);
            let mut used = vec![0u8; b.len()];
            for c in 0..REGS {
                for h in 0..2 {
                    for k in 0..16 {
                        let (want, got) = (level(a, S::fields(c, h), k), level(b, D::fields(c, h), k));
                        assert_eq!(got, want, "{t:?} chunk {c} column {}", 16 * h + k);
                    }
                    for f in D::fields(c, h).into_iter().filter(|f| f.width > 0) {
                        for u in &mut used[f.at..f.at + 16] {
                            assert_eq!(*u & (mask(f) << f.shift), 0, "{t:?}: a bit used twice");
                            *u |= mask(f) << f.shift;
                        }
                    }
                }
            }
            assert!(used[planes.clone()].iter().all(|&u| u == 0xFF), "{t:?}: every bit of the planes holds a level's");
        }
    }

    #[test]
    fn planes_keep_every_level() {
        keeps_every_level(GgmlType::Q6_K, Q6KP::from_block, 0..192);
        keeps_every_level(GgmlType::Q5_K, Q5KU::from_block, 20..180);
        keeps_every_level(GgmlType::Q3_K, Q3KU::from_block, 0..96);
        keeps_every_level(GgmlType::IQ4_XS, Iq4XsU::from_block, 10..138);
    }
}
