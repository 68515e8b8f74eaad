//! The AVX2 microkernels: a tile of up to `MAX_RUN` tokens × one 16-row panel, accumulated over
//! K in order (one FMA or one i32 add per k per output), so every output element is computed
//! the same way whatever the row block or thread.
//!
//! ```text
//!  float:  per k      w = 16 rows (2 ymm: bf16 words shifted or masked, or e4m3 bit-placed, two k a load), x_t[k] broadcast
//!                     acc[t] += w * x_t[k]                       (2·N FMAs per k)
//!  int8:   per quad   w = 16 rows × 4 k int8 (2 ymm); |w| once, then per token
//!                     acc[t] += madd(maddubs(|w|, sign(x_t quad, w)), 1)
//!          (|w| ≤ 127 and |x| ≤ 127: pair sums fit i16, no saturation)
//!  int4:   per octet  w = table[nibble] (4 ymm: nibble − 8, or mxfp4's 2·e2m1), x + 128 unsigned, per token
//!                     acc[t] += madd(maddubs(x_lo, w_lo) + maddubs(x_hi, w_hi), 1)
//!                     and 128·Σw is subtracted at the end (exact integers throughout)
//! ```

use core::arch::x86_64::*;

use kt_core::format::FP8_BLOCK;
use kt_core::WeightFormat;

use crate::act::Act;
use crate::pack::{nibble_table, Packed, PANEL};
use kt_x86::int4::unsigned_weights;

/// Software prefetch distance in bytes: a task's panels are contiguous, and at ~15 GB/s per
/// core about this much must be in flight to cover DRAM latency.
const PREFETCH: usize = 1536;

/// Distance of the second prefetch, into L2: L1 prefetches alone keep too few lines in flight
/// (docs/tuning.md, "AVX2 kernels"; further ahead was no better).
const PREFETCH_L2: usize = 3 * PREFETCH;

#[inline(always)]
fn prefetch(p: *const u8) {
    kt_x86::prefetch::ahead(p, PREFETCH, PREFETCH_L2);
}

/// Most tokens in one run (6 × 2 accumulators + 2 weights + 1 broadcast = 15 ymm).
///
/// This is the decode/prefill crossover: an expert's tokens are processed in runs of
/// min(tokens, MAX_RUN), so 1-5 tokens are a GEMV that streams the panel once, and more tokens
/// reuse each loaded weight 6 (float) or 4 (int) times: the widest that fit the 16 ymm
/// registers without spills (checked in the asm), each faster than the narrower one
/// (docs/tuning.md, "AVX2 kernels").
pub const MAX_RUN: usize = 6;
/// Most tokens in one int run (more registers per step; see [`MAX_RUN`]).
pub const MAX_RUN_INT: usize = 4;

/// The accumulators of a panel and a run, `[token][row in panel]`.
pub type Acc = [[f32; PANEL]; MAX_RUN];

/// A pair of k-slices of an fp8 panel (`pack`'s layout), k even, as loaded: [`fp8_first`] and
/// [`fp8_second`] decode it.
///
/// # Safety
/// The CPU has AVX2; the pair inside the panel.
#[inline(always)]
unsafe fn fp8_pair(panel: *const u8, k: usize) -> __m256i {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe {
        if k % 4 == 0 {
            prefetch(panel.add(k * 16));
        }
        _mm256_loadu_si256(panel.add(k * 16).cast())
    }
}

/// Rows 0-7 and 8-15 at the pair's first k, as e4m3 → f32 · 2^-120 by bit placement (exact,
/// subnormals included; the 2^120 is in the scale): the weights are the top bytes of the
/// pair's words (3 and 1 of each dword), and an arithmetic shift by 4 then a mask leave sign,
/// exponent and mantissa in f32's places. 4 instructions for 16 weights, as [`fp8_second`]'s 5.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn fp8_first(v: __m256i, m: __m256i) -> [__m256; 2] {
    // SAFETY: register-only AVX2 intrinsics; the inlining kernel enables AVX2.
    unsafe { fp8_words(_mm256_srai_epi16(v, 4), m) }
}

/// Rows 0-7 and 8-15 at the pair's second k: bytes 2 and 0 of each dword, moved up first.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn fp8_second(v: __m256i, m: __m256i) -> [__m256; 2] {
    // SAFETY: register-only AVX2 intrinsics; the inlining kernel enables AVX2.
    unsafe { fp8_words(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4), m) }
}

/// The two f32 of each dword of `t`, an fp8 byte shifted right by 4 in the top of each word:
/// the high word's in place, the low word's moved up, each masked by `m` ([`fp8_mask`]) to
/// sign, exponent and mantissa.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn fp8_words(t: __m256i, m: __m256i) -> [__m256; 2] {
    // SAFETY: register-only AVX2 intrinsics; the inlining kernel enables AVX2.
    unsafe {
        let hi = _mm256_and_si256(t, m);
        let lo = _mm256_and_si256(_mm256_slli_epi32(t, 16), m);
        [_mm256_castsi256_ps(hi), _mm256_castsi256_ps(lo)]
    }
}

/// [`fp8_words`]' mask: sign, exponent and mantissa bits of an f32.
#[repr(align(32))]
struct Fp8Mask([u32; 8]);
static FP8_MASK: Fp8Mask = Fp8Mask([0x87F0_0000; 8]);

/// [`FP8_MASK`] in a register: kept in one for up to two tokens, [`reload`]ed at each use
/// beyond.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn fp8_mask<const N: usize>() -> __m256i {
    // SAFETY: a static of 32 aligned bytes.
    unsafe {
        let p = (&raw const FP8_MASK.0).cast::<__m256i>();
        if N <= 2 {
            _mm256_load_si256(p)
        } else {
            reload(p)
        }
    }
}

/// The 32 bytes at `p` loaded here (from L1), even where the compiler holds them in a register
/// already. In an fp8 tile of more than two tokens the 12 accumulators leave no register for
/// the mask or a loaded pair: the compiler would keep them and spill an accumulator instead
/// (an FMA chain through a store and a load: 20% slower at 6 tokens).
///
/// # Safety
/// 32 readable bytes at `p`, 32-byte aligned (panels start on 64 bytes and pairs take 32).
#[inline(always)]
unsafe fn reload(p: *const __m256i) -> __m256i {
    debug_assert!(p.is_aligned());
    // SAFETY: the caller's contract.
    unsafe { core::ptr::read_volatile(p) }
}

/// Rows 0-7 and 8-15 of a bf16 panel's k-slice, whose dwords pair row j with row 8+j
/// (`pack`'s layout): the low words shifted into f32's top half, the high words masked. Two
/// instructions for 16 weights from one load, where widening each half took two and a load.
///
/// # Safety
/// The CPU has AVX2 and FMA; the slice inside the panel.
#[inline(always)]
unsafe fn bf16_slice(panel: *const u8, k: usize) -> [__m256; 2] {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe {
        let v = _mm256_loadu_si256(panel.add(k * 32).cast());
        let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
        [_mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)), _mm256_castsi256_ps(_mm256_and_si256(v, high))]
    }
}

/// `acc[t] += w · x[t][k]` for the 16 rows of one k-slice.
///
/// # Safety
/// The CPU has AVX2 and FMA; every x row holds k.
#[inline(always)]
unsafe fn fma_slice<const N: usize>(acc: &mut [[__m256; 2]; N], w: [__m256; 2], x: &[*const f32; N], k: usize) {
    for t in 0..N {
        // SAFETY: this function's `# Safety` is the callee's (its features and slices).
        unsafe {
            let xb = _mm256_broadcast_ss(&*x[t].add(k));
            acc[t][0] = _mm256_fmadd_ps(w[0], xb, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w[1], xb, acc[t][1]);
        }
    }
}

/// `acc[t] += Σ_{k in k0..k1} w[k] · x[t][k]` for a bf16 (`BF16`) or fp8 panel (k0 even for
/// fp8). Tiles of one or two tokens keep even and odd k in separate chains (added at the end)
/// so the 4-cycle FMA latency does not bound decode; the order is fixed per tile size either way.
/// fp8 decodes each half of a pair just before its FMAs: at 6 tokens, 12 accumulators leave
/// registers for one k's weights only.
///
/// # Safety
/// AVX2+FMA present; `panel` holds k1 k-slices; each `x[t]` holds k1 floats.
#[target_feature(enable = "avx2,fma")]
unsafe fn float_tile<const N: usize, const BF16: bool>(
    panel: *const u8,
    k0: usize,
    k1: usize,
    x: &[*const f32; N],
    acc: &mut [[__m256; 2]; N],
) {
    debug_assert!(BF16 || k0 % 2 == 0, "fp8 pairs start at an even k");
    let mut a = *acc;
    let mut b = [[_mm256_setzero_ps(); 2]; N];
    let mut k = k0;
    // SAFETY (loads): k < k1 is inside the panel and every x row (caller's contract).
    unsafe {
        if BF16 {
            // Two k an iteration (one cache line, one prefetch), in two chains or one.
            while k + 1 < k1 {
                prefetch(panel.add(k * 32));
                fma_slice(&mut a, bf16_slice(panel, k), x, k);
                fma_slice(if N <= 2 { &mut b } else { &mut a }, bf16_slice(panel, k + 1), x, k + 1);
                k += 2;
            }
            if k < k1 {
                fma_slice(&mut a, bf16_slice(panel, k), x, k);
            }
        } else {
            while k + 1 < k1 {
                let v = fp8_pair(panel, k);
                fma_slice(&mut a, fp8_first(v, fp8_mask::<N>()), x, k);
                if N <= 2 {
                    fma_slice(&mut b, fp8_second(v, fp8_mask::<N>()), x, k + 1);
                } else {
                    // One chain in k order, as bf16's; the pair `reload`ed.
                    let v = reload(panel.add(k * 16).cast());
                    fma_slice(&mut a, fp8_second(v, fp8_mask::<N>()), x, k + 1);
                }
                k += 2;
            }
            if k < k1 {
                fma_slice(&mut a, fp8_first(fp8_pair(panel, k), fp8_mask::<N>()), x, k);
            }
        }
    }
    for t in 0..N {
        acc[t] = [_mm256_add_ps(a[t][0], b[t][0]), _mm256_add_ps(a[t][1], b[t][1])];
    }
}

/// # Safety
/// The CPU has AVX2 and FMA, and the slices hold what the doc says.
#[inline(always)]
unsafe fn int8_step<const N: usize>(
    w0: __m256i,
    w1: __m256i,
    x: &[*const i8; N],
    off: usize,
    acc: &mut [[__m256i; 2]; N],
) {
    // SAFETY: AVX2 by the inlining kernel's features; every pointer read lies in the panel or the
    // activation rows (this function's `# Safety`).
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let (a0, a1) = (_mm256_abs_epi8(w0), _mm256_abs_epi8(w1));
        for t in 0..N {
            let xv = _mm256_set1_epi32(x[t].add(off).cast::<i32>().read_unaligned());
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0)), ones);
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1)), ones);
            acc[t][0] = _mm256_add_epi32(acc[t][0], p0);
            acc[t][1] = _mm256_add_epi32(acc[t][1], p1);
        }
    }
}

/// `acc[t] += Σ w·x` over int8 quads `u0..u1` (signed activations, abs/sign trick).
///
/// # Safety
/// AVX2 present; `panel` holds u1 units; each `x[t]` holds the padded K.
#[target_feature(enable = "avx2")]
unsafe fn int8_tile<const N: usize>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    x: &[*const i8; N],
    acc: &mut [[__m256i; 2]; N],
) {
    let mut a = *acc;
    for u in u0..u1 {
        // SAFETY: u < u1 is inside the panel; x rows hold the padded K (caller's contract).
        unsafe {
            let p = panel.add(u * 64);
            prefetch(p);
            int8_step(_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(32).cast()), x, u * 4, &mut a);
        }
    }
    *acc = a;
}

/// `acc[t] += Σ w·x` over int4 octets `u0..u1`, by one `vpshufb` of `table[nibble]` and
/// `vpmaddubsw`, whose first operand is unsigned: KT's per-row int4 takes the activations
/// unsigned (`x + 128`) and the weights signed (`nibble − 8`; the caller subtracts 128·Σw), the
/// K-group kinds (`UNSIGNED_W`) the weights unsigned (`w + o`: int4-gG's nibble as stored,
/// mxfp4's `2·e2m1 + 12`) and the activations signed (the caller starts at `−o·Σx` of the
/// group: no per-row sums to stream). The two halves of an octet add in i16 (|sum| ≤ 4·255·12,
/// or 4·24·127, < 2^15) before one `vpmaddwd`. Without `LUT` the nibbles are the weights
/// (int4-gG's table is the identity) and the shuffles are left out.
///
/// # Safety
/// AVX2 present; `panel` holds u1 units; each `x[t]` holds the padded K.
#[target_feature(enable = "avx2")]
unsafe fn int4_tile<const N: usize, const UNSIGNED_W: bool, const LUT: bool>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    table: &[i8; 16],
    x: &[*const i8; N],
    acc: &mut [[__m256i; 2]; N],
) {
    let mut a = *acc;
    // SAFETY: 16 readable bytes, broadcast to both lanes.
    let lut = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr().cast())) };
    let (lo4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    for u in u0..u1 {
        // SAFETY: u < u1 is inside the panel; x rows hold the padded K (caller's contract).
        unsafe {
            let p = panel.add(u * 64);
            prefetch(p);
            let b0 = _mm256_loadu_si256(p.cast());
            let b1 = _mm256_loadu_si256(p.add(32).cast());
            let (mut l0, mut l1) = (_mm256_and_si256(b0, lo4), _mm256_and_si256(b1, lo4));
            let (mut h0, mut h1) =
                (_mm256_and_si256(_mm256_srli_epi16(b0, 4), lo4), _mm256_and_si256(_mm256_srli_epi16(b1, 4), lo4));
            if LUT {
                // (Not a closure or `map`: those would not get this function's features.)
                l0 = _mm256_shuffle_epi8(lut, l0);
                l1 = _mm256_shuffle_epi8(lut, l1);
                h0 = _mm256_shuffle_epi8(lut, h0);
                h1 = _mm256_shuffle_epi8(lut, h1);
            }
            for t in 0..N {
                let xl = _mm256_set1_epi32(x[t].add(u * 8).cast::<i32>().read_unaligned());
                let xh = _mm256_set1_epi32(x[t].add(u * 8 + 4).cast::<i32>().read_unaligned());
                let (s0, s1) = if UNSIGNED_W {
                    (
                        _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh)),
                        _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh)),
                    )
                } else {
                    (
                        _mm256_add_epi16(_mm256_maddubs_epi16(xl, l0), _mm256_maddubs_epi16(xh, h0)),
                        _mm256_add_epi16(_mm256_maddubs_epi16(xl, l1), _mm256_maddubs_epi16(xh, h1)),
                    )
                };
                a[t][0] = _mm256_add_epi32(a[t][0], _mm256_madd_epi16(s0, ones));
                a[t][1] = _mm256_add_epi32(a[t][1], _mm256_madd_epi16(s1, ones));
            }
        }
    }
    *acc = a;
}

/// 16 consecutive f32 (one value per panel row) as two ymm.
///
/// # Safety
/// The CPU has AVX2 and FMA, and the slices hold what the doc says.
#[inline(always)]
unsafe fn load16(p: *const f32) -> (__m256, __m256) {
    // SAFETY: the caller passes 16 readable floats.
    unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
}

/// 16 rows' scales from their bf16 bits (exactly: a bf16 is an f32's top half).
///
/// # Safety
/// The CPU has AVX2; 16 readable `u16` at `p`.
#[inline(always)]
unsafe fn bf16_scales16(p: *const u16) -> (__m256, __m256) {
    // SAFETY: the caller's contract.
    unsafe {
        let lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        let hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(8).cast()));
        (_mm256_castsi256_ps(_mm256_slli_epi32::<16>(lo)), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(hi)))
    }
}

/// 16 rows' MX scales from their e8m0 codes `c`: `2^(c − bias)`, exactly (subnormal below
/// 2^-126 and infinite above 2^127, as the f32 products they stand for).
///
/// # Safety
/// The CPU has AVX2; 16 readable bytes at `p`.
#[inline(always)]
unsafe fn mx_scales16(p: *const u8, bias: i32) -> (__m256, __m256) {
    // SAFETY: the caller's contract.
    unsafe { (mx_scales8(p, bias), mx_scales8(p.add(8), bias)) }
}

/// 8 of [`mx_scales16`]: the biased exponent `e = c − bias + 127` placed in the f32 bits
/// (`e ≥ 255`: infinity), or for `e ≤ 0` the subnormal `2^-127 >> −e`.
///
/// # Safety
/// As [`mx_scales16`], for 8 bytes.
#[inline(always)]
unsafe fn mx_scales8(p: *const u8, bias: i32) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let zero = _mm256_setzero_si256();
        let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
        let e = _mm256_sub_epi32(c, _mm256_set1_epi32(bias - 127));
        let normal = _mm256_slli_epi32::<23>(_mm256_min_epi32(e, _mm256_set1_epi32(255)));
        let sub = _mm256_srlv_epi32(_mm256_set1_epi32(0x0040_0000), _mm256_sub_epi32(zero, e));
        _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, zero)))
    }
}

/// Write the accumulators of a tile to `out`.
///
/// # Safety
/// The CPU has AVX2 and FMA, and the slices hold what the doc says.
#[inline(always)]
unsafe fn store_tile<const N: usize>(acc: &[[__m256; 2]; N], out: &mut Acc) {
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: each row of `out` holds 16 floats.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
        }
    }
}

/// `acc[t] - 128·Σw` as f32, for the int4 kernels' unsigned activations.
///
/// # Safety
/// The CPU has AVX2 and FMA, and the slices hold what the doc says.
#[inline(always)]
unsafe fn unbias(acc: __m256i, rowsum: *const i32) -> __m256 {
    // SAFETY: AVX2 by the inlining kernel's features; `rowsum` points at the panel's 8 row sums
    // (the caller's contract).
    unsafe { _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_slli_epi32(_mm256_loadu_si256(rowsum.cast()), 7))) }
}

/// # Safety
/// The CPU has AVX2 and FMA, and the slices hold what the doc says.
#[target_feature(enable = "avx2,fma")]
unsafe fn float_panel<const N: usize>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
    let (x, cols) = (act.x, act.kp);
    let panel = w.panel(p).as_ptr();
    let xs: [*const f32; N] = core::array::from_fn(|t| x[(t0 + t) * cols..].as_ptr());
    let z = _mm256_setzero_ps();
    let mut acc = [[z; 2]; N];
    // SAFETY: panel and x rows span `cols` k-slices; AVX2+FMA are enabled here.
    unsafe {
        match w.format {
            WeightFormat::Bf16 => float_tile::<N, true>(panel, 0, cols, &xs, &mut acc),
            WeightFormat::Mxfp8 => {
                // One scale per row and 32-column group: the group's sums times its 16 scales.
                let g = kt_core::format::mx::MX_BLOCK;
                for b in 0..cols / g {
                    let mut blk = [[z; 2]; N];
                    float_tile::<N, false>(panel, b * g, (b + 1) * g, &xs, &mut blk);
                    let (s0, s1) = mx_scales16(w.codes[(p * (cols / g) + b) * PANEL..].as_ptr(), w.code_bias);
                    for (a, k) in acc.iter_mut().zip(&blk) {
                        *a = [_mm256_fmadd_ps(k[0], s0, a[0]), _mm256_fmadd_ps(k[1], s1, a[1])];
                    }
                }
            }
            WeightFormat::Fp8Channel => {
                float_tile::<N, false>(panel, 0, cols, &xs, &mut acc);
                let (s0, s1) = load16(w.scales[p * PANEL..].as_ptr());
                for a in &mut acc {
                    *a = [_mm256_mul_ps(a[0], s0), _mm256_mul_ps(a[1], s1)];
                }
            }
            _ => {
                let kb = cols.div_ceil(FP8_BLOCK);
                for b in 0..kb {
                    let mut blk = [[z; 2]; N];
                    float_tile::<N, false>(panel, b * FP8_BLOCK, ((b + 1) * FP8_BLOCK).min(cols), &xs, &mut blk);
                    let s = _mm256_set1_ps(w.scales[p * kb + b]);
                    for (a, k) in acc.iter_mut().zip(&blk) {
                        *a = [_mm256_fmadd_ps(k[0], s, a[0]), _mm256_fmadd_ps(k[1], s, a[1])];
                    }
                }
            }
        }
        store_tile(&acc, out);
    }
}

/// # Safety
/// The CPU has AVX2 and FMA, and the slices hold what the doc says.
#[target_feature(enable = "avx2,fma")]
unsafe fn int_panel<const N: usize>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
    let panel = w.panel(p).as_ptr();
    let xs: [*const i8; N] = core::array::from_fn(|t| act.q[(t0 + t) * act.kp..].as_ptr());
    let zi = _mm256_setzero_si256();
    let groups = act.groups;
    // SAFETY: panel holds w.units units and x rows hold kp bytes; AVX2+FMA are enabled here.
    unsafe {
        let mut res = [[_mm256_setzero_ps(); 2]; N];
        let table = nibble_table(w.format);
        match w.format {
            f @ (WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4) => {
                let upg = f.k_group().unwrap_or(w.cols) / 8;
                let (unsigned, offset) = unsigned_weights(f);
                // (int4-gG's nibbles are its weights: no table.)
                let table = unsigned.unwrap_or_default();
                for g in 0..groups {
                    let mut acc = [[zi; 2]; N];
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = [_mm256_set1_epi32(-offset * act.sums[(t0 + t) * groups + g]); 2];
                    }
                    let (u0, u1) = (g * upg, (g + 1) * upg);
                    if unsigned.is_some() {
                        int4_tile::<N, true, true>(panel, u0, u1, &table, &xs, &mut acc);
                    } else {
                        int4_tile::<N, true, false>(panel, u0, u1, &table, &xs, &mut acc);
                    }
                    let at = (p * groups + g) * PANEL;
                    let (s0, s1) = match f {
                        WeightFormat::Mxfp4 => mx_scales16(w.codes[at..].as_ptr(), w.code_bias),
                        _ if !w.scales16.is_empty() => bf16_scales16(w.scales16[at..].as_ptr()),
                        _ => load16(w.scales[at..].as_ptr()),
                    };
                    for t in 0..N {
                        let a = _mm256_set1_ps(act.scales[(t0 + t) * groups + g]);
                        let (m0, m1) = (_mm256_mul_ps(a, s0), _mm256_mul_ps(a, s1));
                        res[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][0]), m0, res[t][0]);
                        res[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][1]), m1, res[t][1]);
                    }
                }
            }
            f => {
                let mut acc = [[zi; 2]; N];
                let int8 = f == WeightFormat::Int8Row;
                if int8 {
                    int8_tile::<N>(panel, 0, w.units, &xs, &mut acc);
                } else {
                    int4_tile::<N, false, true>(panel, 0, w.units, &table, &xs, &mut acc);
                }
                let (s0, s1) = load16(w.scales[p * PANEL..].as_ptr());
                for t in 0..N {
                    let (c0, c1) = if int8 {
                        (_mm256_cvtepi32_ps(acc[t][0]), _mm256_cvtepi32_ps(acc[t][1]))
                    } else {
                        let rs = w.rowsum[p * PANEL..].as_ptr();
                        (unbias(acc[t][0], rs), unbias(acc[t][1], rs.add(8)))
                    };
                    let a = _mm256_set1_ps(act.scales[t0 + t]);
                    // (acc · sa) · sw, the reference's order.
                    res[t][0] = _mm256_mul_ps(_mm256_mul_ps(c0, a), s0);
                    res[t][1] = _mm256_mul_ps(_mm256_mul_ps(c1, a), s1);
                }
            }
        }
        store_tile(&res, out);
    }
}

/// A panel microkernel: tokens `t0..t0+nt` (nt ≤ [`max_run`]) × panel `p` of `w` into
/// `out[..nt]`. Which one a matrix runs is chosen once, when it is packed ([`panel_kernel`]).
///
/// # Safety
/// The CPU supports AVX2 and FMA; `act` was prepared for `w`'s format and K, with at least
/// `t0 + nt` rows.
pub type PanelRun = unsafe fn(w: &Packed, p: usize, act: &Act<'_>, t0: usize, nt: usize, out: &mut Acc);

/// Each panel kernel as a [`PanelRun`]: its token count made a const generic.
macro_rules! panel_runs {
    ($($run:ident = $kernel:ident;)*) => {$(
        /// # Safety
        /// As [`PanelRun`].
        unsafe fn $run(w: &Packed, p: usize, act: &Act<'_>, t0: usize, nt: usize, out: &mut Acc) {
            // SAFETY: this function's `# Safety` is the callee's (its features and slices).
            unsafe { kt_x86::by_tokens!(nt; 1 2 3 4 5 6; $kernel(w, p, act, t0, out)) }
        }
    )*};
}

panel_runs! {
    run_float = float_panel;
    run_int = int_panel;
}

/// The microkernel `w`'s panels run.
pub fn panel_kernel(w: &Packed) -> PanelRun {
    match w.format.int_activations() {
        true => run_int,
        false => run_float,
    }
}

/// Most tokens in one run of `w`: int formats keep two accumulators more per token.
pub fn max_run(w: &Packed) -> usize {
    match w.format.int_activations() {
        true => MAX_RUN_INT,
        false => MAX_RUN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every e8m0 code at each bias the packing uses, against `2^(c − bias)` computed in f64:
    /// normal, subnormal (codes 0 and 1 for mxfp4) and infinite (mxfp8's fold of 2^120).
    #[test]
    fn mx_scales_are_exact_powers_of_two() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            kt_core::skip_isa!("AVX2");
            return;
        }
        for bias in [128, 127, 7] {
            for first in (0..256).step_by(16) {
                let codes: [u8; 16] = core::array::from_fn(|i| (first + i) as u8);
                // SAFETY: AVX2 checked above; 16 bytes.
                let (lo, hi) = unsafe { mx_scales16(codes.as_ptr(), bias) };
                let mut got = [0f32; 16];
                // SAFETY: 16 writable floats.
                unsafe {
                    _mm256_storeu_ps(got.as_mut_ptr(), lo);
                    _mm256_storeu_ps(got.as_mut_ptr().add(8), hi);
                }
                for (c, g) in codes.iter().zip(got) {
                    let want = 2f64.powi(i32::from(*c) - bias) as f32;
                    assert_eq!(g.to_bits(), want.to_bits(), "code {c} bias {bias}: {g:e} against {want:e}");
                }
            }
        }
    }
}
