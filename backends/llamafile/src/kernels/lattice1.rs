//! One token against iq2_xxs rows in 512-bit registers (AVX512-VNNI with VBMI and DQ), the
//! type of the 2-bit DeepSeek and Kimi GGUFs: its grid lookups, not memory, bound its decode,
//! and here they are table lookups in registers instead of a scalar load per 8 columns.
//!
//! A block's 8 parts of 32 columns lie across a register's 8 qword lanes: register `p` (0..4)
//! holds in lane `s` the 8 levels of part `s`'s grid entry `p`, and the token's values are put
//! in that order once per tile (from the lane layout of [`crate::lanes`], one `vpermi2b` a
//! register). The grid's 256 entries are kept as 2-bit level codes, their low and high bytes
//! in 8 registers: one `vpshufb` lays each lane's 4 index bytes out twice, four `vpermi2b`
//! and three blends give each lane its entries' code bytes, and per register one
//! `vpmultishiftqb` spreads a code a byte and one `vpermb` turns codes into levels. The signs
//! go to the values: `vpmultishiftqb` cuts each part's four 7-bit sign fields from its stored
//! word, a 128-byte table (`vpermi2b`) expands them to ggml's even-parity sign bytes, and per
//! register a `vpmultishiftqb` puts each column's bit on top of its byte for the mask of a
//! masked subtract. Four `vpdpbusd` leave each part's sum in its lane's two dwords; one add,
//! the part's scale (`vpmuldq`) and a convert give the 8 f32 lanes of the AVX2 one-token
//! kernel ([`super::kquant1`]), summed in its order: the same bits.
//!
//! Tried and slower on Zen 5 (the dots bench, one token): the grid from `vpgatherqq` (94 µs
//! against 57), or from scalar loads (94), and the masks by `vpshufbitqmb` (2.5× slower).
//! Built from rustc 1.89 only (`build.rs`).

#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;
use core::ops::Range;

use kt_core::ggml::{even_parity_signs, BlockIq2Xxs, IQ2XXS_PACKED};

use super::{hsum4, prefetch_next, Packed, Tile, R};
use crate::act::ActK;

/// Whether this CPU runs [`iq2xxs_gemv`] (beside the AVX512-VNNI its callers checked).
pub(super) fn runs() -> bool {
    is_x86_feature_detected!("avx512vbmi") && is_x86_feature_detected!("avx512dq")
}

/// A table for 512-bit loads.
#[repr(C, align(64))]
struct Aligned<T>(T);

/// ggml's sign bytes of the 128 stored 7-bit fields.
static SIGNS: Aligned<[u8; 128]> = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = even_parity_signs(i as u32);
        i += 1;
    }
    Aligned(t)
};

/// The grid's level codes (2 bits a column), the low bytes of its 256 entries, then the high.
static CODES: Aligned<[u8; 512]> = {
    let mut t = [0u8; 512];
    let mut i = 0;
    while i < 256 {
        t[i] = IQ2XXS_PACKED[i] as u8;
        t[256 + i] = (IQ2XXS_PACKED[i] >> 8) as u8;
        i += 1;
    }
    Aligned(t)
};

/// A code (a byte's low 2 bits) to its level: `vpermb`'s 64 entries.
static LEVELS: Aligned<[u8; 64]> = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        t[j] = [8, 25, 43, 0][j % 4];
        j += 1;
    }
    Aligned(t)
};

/// The byte of the lane-layout values that holds column `c` ([`crate::lanes::column`]'s
/// inverse).
const fn lane_byte(c: usize) -> usize {
    32 * ((c % 16) / 2) + 2 * (c / 16) + c % 2
}

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

/// [`super::gemv`] for iq2_xxs.
///
/// # Safety
/// AVX512-VNNI (with F, BW, VL), VBMI and DQ ([`runs`]), AVX2, FMA and F16C must be present;
/// `act` must hold one token's [`ActK`] blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")]
pub(super) unsafe fn iq2xxs_gemv(w: &Packed, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    one_token_tiles!(w, rows, act, out, ActK, |tile, res| unsafe { iq2xxs_tile(&tile, &mut res) })
}

/// One tile of [`iq2xxs_gemv`].
///
/// # Safety
/// As [`iq2xxs_gemv`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")]
unsafe fn iq2xxs_tile(tile: &Tile<'_, ActK>, out: &mut [[f32; R]]) {
    let blocks: [&[BlockIq2Xxs]; R] = array!(&[][..]; R, |i| bytemuck::cast_slice(tile.row(i)));
    let acts = tile.act();
    let mut acc = [_mm256_setzero_ps(); R];
    // SAFETY (whole function): this function's features; every load reads inside a static
    // table, a block (64 bytes of `qs`) or an activation block (256 bytes of `qs`).
    unsafe {
        macro_rules! load {
            ($t:expr) => {
                _mm512_load_si512($t.as_ptr().cast())
            };
        }
        let zero = _mm512_setzero_si512();
        let codes = array!(zero; 8, |t| load!(CODES.0[64 * t..]));
        let twice = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11));
        let (signs, levels) = ((load!(SIGNS.0), load!(SIGNS.0[64..])), load!(LEVELS.0));
        // Bits 32 + 7p of each lane's word: part `s`'s sign field `p` in byte p.
        let fields = _mm512_set1_epi64(i64::from_le_bytes([32, 39, 46, 53, 0, 0, 0, 0]));
        // Column k's code of entry 0 in byte k (bits 2k of its low byte, 2k − 8 of its high
        // one); entry p's 8p bits further.
        let spread = _mm512_set1_epi64(i64::from_le_bytes([0, 2, 4, 6, 32, 34, 36, 38]));
        // Column k's sign bit of entry 0 (bit k of sign byte 0) at the top of byte k.
        let sign_at = _mm512_set1_epi64(i64::from_le_bytes([57, 58, 59, 60, 61, 62, 63, 0]));
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
                let q = _mm512_loadu_si512(blk.qs.as_ptr().cast());
                // Lane s: the codes of part s's 4 grid entries, low bytes then high bytes (128
                // entries a `vpermi2b`; bit 7 of the index picks the half).
                let idx = _mm512_shuffle_epi8(q, twice);
                let r = array!(zero; 4, |h| _mm512_permutex2var_epi8(codes[2 * h], idx, codes[2 * h + 1]));
                let k7 = _mm512_movepi8_mask(idx);
                let (low, high) = (_mm512_mask_blend_epi8(k7, r[0], r[1]), _mm512_mask_blend_epi8(k7, r[2], r[3]));
                let codes_of = _mm512_mask_blend_epi8(0xF0F0_F0F0_F0F0_F0F0, low, high);
                let sign_bytes = _mm512_permutex2var_epi8(signs.0, _mm512_multishift_epi64_epi8(fields, q), signs.1);
                let mut sums = zero;
                for p in 0..4 {
                    // Lane s: part s's entry p, its levels and its signs' mask.
                    let at = _mm512_set1_epi8(8 * p as i8);
                    let lv = _mm512_permutexvar_epi8(
                        _mm512_multishift_epi64_epi8(_mm512_add_epi8(spread, at), codes_of),
                        levels,
                    );
                    let neg =
                        _mm512_movepi8_mask(_mm512_multishift_epi64_epi8(_mm512_add_epi8(sign_at, at), sign_bytes));
                    let signed = _mm512_mask_sub_epi8(x[p], neg, zero, x[p]);
                    sums = _mm512_dpbusd_epi32(sums, lv, signed);
                }
                // Each part's two dwords added, times its scale 2·(word >> 28) + 1.
                let parts = _mm512_add_epi32(sums, _mm512_srli_epi64::<32>(sums));
                let scale = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi64::<59>(q), _mm512_set1_epi64(0x1E)),
                    _mm512_set1_epi64(1),
                );
                let dots = _mm512_cvtepi64_ps(_mm512_mul_epi32(parts, scale));
                let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes(blk.d))))) / 8.0;
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

    /// Rows of 8 blocks whose parts use every grid index, every sign field and every scale
    /// (and 9 rows: a short last tile; and a call starting at row 3) give the AVX2 one-token
    /// kernel's bits, for activations with ties and the largest values at both signs.
    #[test]
    fn every_index_sign_and_scale_gives_the_avx2_kernels_bits() {
        if crate::vnni::detect() != Some(Vnni::Evex) || !runs() {
            eprintln!("skipped: this CPU lacks AVX512-VNNI, VBMI or DQ");
            return;
        }
        let (rows, cols) = (9, 8 * QK_K);
        let mut data = Vec::new();
        for (r, b) in (0..rows).flat_map(|r| (0..cols / QK_K).map(move |b| (r, b))) {
            let block = r * cols / QK_K + b;
            data.extend(f16::from_f32(0.003 * (1 + block % 7) as f32).to_le_bytes());
            for s in 0..8 {
                let part = 8 * block + s;
                data.extend((0..4).map(|p| ((4 * part + p) * 7 % 256) as u8));
                let fields = (0..4).fold(0u32, |w, p| w | (((4 * part + p) * 37 % 128) as u32) << (7 * p));
                data.extend((fields | ((part % 16) as u32) << 28).to_le_bytes());
            }
        }
        let (t, vnni) = (GgmlType::IQ2_XXS, Some(Vnni::Evex));
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
            // SAFETY: the features checked above (AVX2, FMA and F16C with AVX512-VNNI); one
            // token's activations for `t`, prepared as the backend prepares them.
            unsafe {
                crate::act::prepare(t, cols, &x, &[0], act.as_mut_slice(), kind, scratch.as_mut_slice());
                iq2xxs_gemv(&w, range.clone(), act.as_slice(), &mut got);
                super::super::kquant1::<BlockIq2Xxs>(&w, range.clone(), act.as_slice(), &mut want);
            }
            let bits = |v: &[f32]| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "rows {range:?}: {got:?} against {want:?}");
            assert!(want.iter().all(|y| y.is_finite() && *y != 0.0), "{want:?}");
        }
    }
}
