//! The AVX-512 microkernels: a tile of up to [`MAX_RUN`] tokens × one 32-row panel (two zmm of
//! accumulators per token), accumulated over K in order, so every output element is computed
//! the same way whatever the row block, thread or tile size.
//!
//! ```text
//!  per unit (128 bytes: two zmm r0 = rows 0-15, r1 = rows 16-31)
//!  float   bf16: w = r << 16, r & 0xFFFF0000 (k0, k1); fp8: byte j placed in the f32 bits
//!          acc[t][h] += w[h] · x_t[k]                                  (vfmadd231ps)
//!  bf16 dot (avx512_bf16: bf16, and fp8 packed in pairs, at every token count)
//!          bf16: acc[t][h] = vdpbf16ps(acc[t][h], r[h], x_t[k0,k1] as a bf16 pair)
//!          fp8:  r[h] → bf16 by two vpermi2b byte tables + the sign (vpternlogd), unpacked
//!                to (k0,k1) and (k2,k3) pairs of 16 rows: two vdpbf16ps per token (one
//!                token's: in two chains, added per block)
//!  int8    vnni: acc[t][h] = vpdpbusd(acc[t][h], x_t quad + 128, r[h]), from −128·Σw
//!          base: |w| · (x_t · sign w) by vpmaddubsw → vpmaddwd (|x| ≤ 127: no saturation)
//!  int4    lo, hi = table[nibble] (vpshufb; vbmi: vpermb, unmasked); vnni: two vpdpbusd
//!          (k0..3, k4..7; one token's: in two chains); base: vpmaddubsw(x + 128, lo) +
//!          vpmaddubsw(x + 128, hi) in i16 → vpmaddwd; from −128·Σw
//!  int4-gG, mxfp4: the roles swapped: weights unsigned (w + o: int4-gG's nibble as stored,
//!          mxfp4's through a table), activations signed; each group's accumulators start at
//!          −o·Σx_g (prepared with the activations, `act`), so the panels carry no per-row
//!          bias: decode streams 0.5625 bytes a weight (int4-g32, bf16 scales), not 0.75. (The
//!          broadcasts stay instructions: folded into vpdpbusd as {1to16} operands by `asm!`
//!          they measured the same.)
//! ```
//!
//! The integer sums are exact in every variant, and scaled in the same order (the reference's:
//! `(Σ · s_act) · s_w`, or `Σ · (s_act · s_w)` summed over K-groups), so `avx512_base` and the
//! VNNI variants give the same bits.
//!
//! fp8 at the bf16 level has a second kernel (`StagedRun`): where a task runs three token
//! tiles or more on a panel, the panel is decoded once into the task's scratch (`stage_fp8`)
//! and each tile reads its bf16 pairs there, summed as the decoding tiles sum them.

// Tiles index tokens, halves and their pointers with one counter; iterators would hide it.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;
use core::ops::Range;

use half::bf16;
use kt_core::format::FP8_BLOCK;
use kt_core::swiglu::Glu;
use kt_core::WeightFormat;
use kt_x86::int4::{nibble_table, unsigned_weights};
use kt_x86::prefetch::SCALE_GROUPS_AHEAD;
use kt_x86::swiglu::glu16;

use crate::act::Act;
use crate::level::Level;
use crate::pack::{GroupScales, Packed, HALF, KT_TILE, PANEL, UNIT};

/// Most tokens in one run: 2 × 12 accumulators + 2-4 weight registers + a broadcast fit the
/// 32 zmm registers.
pub const MAX_RUN: usize = 12;

/// Most tokens in one run of `w`: [`MAX_RUN`], or 8 for fp8 in bf16-pair order, whose four
/// table registers and decoded pairs leave room for 16 accumulators without spilling.
pub fn max_run(w: &Packed) -> usize {
    if w.pairs {
        8
    } else {
        MAX_RUN
    }
}

/// Fewest token tiles of a panel that have it staged ([`StagedRun`]): for two, writing the
/// decoded panel and reading it back cost more than decoding it twice (docs/tuning.md).
pub const STAGE_FROM_TILES: usize = 3;

/// The accumulators of a panel and a run, `[token][row in panel]`.
pub type Acc = [[f32; PANEL]; MAX_RUN];

/// Software prefetch distance: at ~15 GB/s per core this much must be in flight to cover
/// DRAM latency (as in the AVX2 kernels), and an L2 prefetch three times further.
const PREFETCH: usize = 2048;
const PREFETCH_L2: usize = 3 * PREFETCH;

/// Most tokens of a tile that streams its weights as decode does, once from DRAM: such a tile
/// prefetches them into L1 too only where [`kt_x86::prefetch::l1_at_decode`] says so
/// ([`ahead`]). Larger tiles read a panel again from the caches, where the L1 prefetch pays on
/// every CPU measured (docs/tuning.md).
const DECODE_TOKENS: usize = 4;

/// What an `N`-token tile's weight loads prefetch ahead.
#[derive(Clone, Copy)]
enum Ahead {
    /// Into L1 and L2.
    Both,
    /// Into L2 only, each line asked for twice: `PREFETCH_L2` and twice that ahead, where one
    /// request a line left decode well short of a plain read (docs/tuning.md, "Decode tiles
    /// prefetch"; both at one distance, or the further one alone, measured no better).
    L2,
    /// Nothing: the hardware prefetchers alone, for bf16 decode where they stream its one load a
    /// `vdpbf16ps` at a plain read's speed and an L2 prefetch held it back; the other kinds'
    /// work between loads needs the L2 prefetch (docs/tuning.md, "Decode tiles prefetch").
    Off,
}

/// What an `N`-token tile of bf16 (`BF16`) or another kind prefetches.
#[inline(always)]
fn ahead<const N: usize, const BF16: bool>() -> Ahead {
    match N > DECODE_TOKENS || kt_x86::prefetch::l1_at_decode() {
        true => Ahead::Both,
        false if BF16 => Ahead::Off,
        false => Ahead::L2,
    }
}

/// Unit `u` of `panel`: rows 0-15 and 16-31, with both lines of the unit prefetched as `pf`
/// says, `PREFETCH` ahead into L1 and `PREFETCH_L2` into L2 (a task's panels are contiguous,
/// so that runs into the next panel).
///
/// # Safety
/// AVX-512F is present (inlined into the kernels, whose features it uses); `panel` holds more
/// than `u` units.
#[inline(always)]
unsafe fn load_unit(panel: *const u8, u: usize, pf: Ahead) -> [__m512i; 2] {
    // SAFETY: the caller's contract.
    unsafe { load_halves(panel.add(u * UNIT), 64, panel.add(u * UNIT), pf) }
}

/// The two halves at `p` and `p + second`, with the two lines at `at` (the stretch's
/// `i`-th 128 bytes: in memory order whatever the layout) prefetched as [`load_unit`] says.
///
/// # Safety
/// As [`load_unit`].
#[inline(always)]
unsafe fn load_halves(p: *const u8, second: usize, at: *const u8, pf: Ahead) -> [__m512i; 2] {
    // SAFETY: the caller's contract; prefetches never fault.
    unsafe {
        for line in [at, at.wrapping_add(64)] {
            match pf {
                Ahead::Both => kt_x86::prefetch::ahead(line, PREFETCH, PREFETCH_L2),
                Ahead::L2 => {
                    kt_x86::prefetch::to_l2(line, PREFETCH_L2);
                    kt_x86::prefetch::to_l2(line, 2 * PREFETCH_L2);
                }
                Ahead::Off => {}
            }
        }
        [_mm512_loadu_si512(p.cast()), _mm512_loadu_si512(p.add(second).cast())]
    }
}

/// The weights of the unit's `j`-th k as f32: bf16 by its position in the dword, e4m3 by bit
/// placement (f32 · 2^-120, exact with subnormals; the 2^120 is in the scale).
///
/// No closures in these helpers: a closure gets no target features, so the intrinsics in it
/// would stay calls.
///
/// # Safety
/// AVX-512F is present (inlined into the kernels, whose features it uses).
#[inline(always)]
unsafe fn decode<const BF16: bool>(r: [__m512i; 2], j: usize) -> [__m512; 2] {
    // SAFETY: the caller's contract.
    unsafe { [decode_half::<BF16>(r[0], j), decode_half::<BF16>(r[1], j)] }
}

/// [`decode`] of one half.
///
/// # Safety
/// As [`decode`].
#[inline(always)]
unsafe fn decode_half<const BF16: bool>(v: __m512i, j: usize) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe {
        if BF16 {
            let w = if j == 0 { _mm512_slli_epi32::<16>(v) } else { _mm512_and_si512(v, _mm512_set1_epi32(-65536)) };
            _mm512_castsi512_ps(w)
        } else {
            let top = match j {
                0 => _mm512_slli_epi32::<24>(v),
                1 => _mm512_slli_epi32::<16>(v),
                2 => _mm512_slli_epi32::<8>(v),
                _ => v,
            };
            let placed = _mm512_and_si512(_mm512_srai_epi32::<4>(top), _mm512_set1_epi32(0x87F0_0000u32 as i32));
            _mm512_castsi512_ps(placed)
        }
    }
}

/// `acc[t] += Σ w · x[t]` over units `u0..u1` of a bf16 (`BF16`) or fp8 panel (`pf`: as
/// [`load_unit`]).
///
/// # Safety
/// AVX-512F is present; `panel` holds `u1` units and each `x[t]` the padded K.
#[inline(always)]
unsafe fn float_units<const N: usize, const BF16: bool>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    x: &[*const f32; N],
    pf: Ahead,
    acc: &mut [[__m512; 2]; N],
) {
    let kpu = if BF16 { 2 } else { 4 };
    let mut a = *acc;
    for u in u0..u1 {
        // SAFETY: u < u1 is inside the panel; x rows hold the padded K (caller's contract).
        unsafe {
            let r = load_unit(panel, u, pf);
            for j in 0..kpu {
                let w = decode::<BF16>(r, j);
                for t in 0..N {
                    let xb = _mm512_set1_ps(*x[t].add(u * kpu + j));
                    a[t][0] = _mm512_fmadd_ps(w[0], xb, a[t][0]);
                    a[t][1] = _mm512_fmadd_ps(w[1], xb, a[t][1]);
                }
            }
        }
    }
    *acc = a;
}

/// Write the accumulators of a tile to `out`.
///
/// # Safety
/// AVX-512F is present (inlined into the kernels, whose features it uses).
#[inline(always)]
unsafe fn store_tile<const N: usize>(acc: &[[__m512; 2]; N], out: &mut Acc) {
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: each row of `out` holds 32 floats.
        unsafe {
            _mm512_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm512_storeu_ps(o.as_mut_ptr().add(HALF), a[1]);
        }
    }
}

/// One token's SwiGLU over a panel's gate and up results, half a panel (16 rows) at a time, its
/// rows `within` into `out` as bf16 (this backend's tiles and the AMX backend's blocks), through
/// [`put_panel`].
///
/// # Safety
/// The CPU supports AVX2 and FMA.
pub unsafe fn glu_panel(glu: Glu, g: &[f32; PANEL], u: &[f32; PANEL], within: Range<usize>, out: &mut [bf16]) {
    let mut hv = [bf16::ZERO; PANEL];
    for half in 0..2 {
        let r = half * HALF..(half + 1) * HALF;
        let (gh, uh) = (g[r.clone()].try_into().unwrap(), u[r.clone()].try_into().unwrap());
        let o: &mut [u16; HALF] = bytemuck::cast_slice_mut(&mut hv[r]).try_into().unwrap();
        // SAFETY: the caller's contract.
        unsafe { glu16(glu, gh, uh, o) };
    }
    put_panel(out, &hv, within);
}

/// `out` = rows `within` of one token's panel results `res`: a fixed-size copy for a whole
/// panel (inlined moves, where a slice copy of unknown length calls `memcpy` per token and panel).
#[inline(always)]
pub fn put_panel<T: Copy>(out: &mut [T], res: &[T; PANEL], within: Range<usize>) {
    match <&mut [T; PANEL]>::try_from(&mut *out) {
        Ok(whole) => *whole = *res,
        Err(_) => out.copy_from_slice(&res[within]),
    }
}

/// 32 consecutive f32 (one per panel row) as two zmm.
///
/// # Safety
/// AVX-512F is present; 32 readable floats.
#[inline(always)]
unsafe fn load32(p: *const f32) -> [__m512; 2] {
    // SAFETY: the caller's contract.
    unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(HALF))] }
}

/// The same 512 bits as bf16 pairs.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain data, every bit pattern valid.
    unsafe { core::mem::transmute::<__m512i, __m512bh>(v) }
}

/// `acc[t] += Σ w · x[t]` over units `u0..u1` of a bf16 panel by `vdpbf16ps`, the weights as
/// packed against each token's bf16 pair of the unit (`pf`: as [`load_unit`]).
///
/// # Safety
/// AVX-512F/BF16 are present (inlined into a kernel that enables them); `panel` holds `u1`
/// units; each `x[t]` the padded K in bf16.
#[inline(always)]
unsafe fn bf16_dot_units<const N: usize>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    x: &[*const u32; N],
    pf: Ahead,
    acc: &mut [[__m512; 2]; N],
) {
    let mut a = *acc;
    for u in u0..u1 {
        // SAFETY: u < u1 is inside the panel; a row of kp = 2·units bf16 holds `units` pairs.
        unsafe {
            let r = load_unit(panel, u, pf);
            let w = [bh(r[0]), bh(r[1])];
            for t in 0..N {
                let xv = bh(_mm512_set1_epi32(x[t].add(u).read_unaligned() as i32));
                a[t][0] = _mm512_dpbf16_ps(a[t][0], w[0], xv);
                a[t][1] = _mm512_dpbf16_ps(a[t][1], w[1], xv);
            }
        }
    }
    *acc = a;
}

/// e4m3 → bf16 as two 128-entry byte tables (low byte, high byte without the sign) for
/// `vpermi2b`, which reads 7 bits of each index: every e4m3 value, subnormals included, is a
/// bf16 exactly.
struct Fp8Tables {
    lo: [__m512i; 2],
    hi: [__m512i; 2],
}

impl Fp8Tables {
    /// # Safety
    /// AVX-512F is present (inlined into the kernels, whose features it uses).
    #[inline(always)]
    unsafe fn new() -> Fp8Tables {
        static BYTES: [[u8; 128]; 2] = fp8_bf16_bytes();
        // SAFETY: 128 readable bytes each.
        unsafe {
            let t =
                |b: &[u8; 128]| [_mm512_loadu_si512(b.as_ptr().cast()), _mm512_loadu_si512(b[64..].as_ptr().cast())];
            Fp8Tables { lo: t(&BYTES[0]), hi: t(&BYTES[1]) }
        }
    }
}

/// The low and high bytes of bf16(e4m3 code c) for c < 128 (the sign bit clear).
pub const fn fp8_bf16_bytes() -> [[u8; 128]; 2] {
    let mut t = [[0u8; 128]; 2];
    let mut c = 0;
    while c < 128 {
        let (e, m) = ((c >> 3) as u32, (c & 7) as u32);
        // f32 bits of the value: subnormal m/8·2^-6 normalized, else (1 + m/8)·2^(e-7).
        let bits = if e == 0 {
            if m == 0 {
                0
            } else {
                let shift = m.leading_zeros() - 29; // m = 1 → 2, 2..3 → 1, 4..7 → 0
                let exp = 127 - 6 - 3 + (2 - shift); // value = m·2^-9
                (exp << 23) | (((m << (shift + 1)) & 7) << 20)
            }
        } else {
            ((e + 120) << 23) | (m << 20)
        };
        t[0][c] = (bits >> 16) as u8;
        t[1][c] = (bits >> 24) as u8;
        c += 1;
    }
    t
}

/// One half of an fp8 unit in bf16-pair order (`pack`) decoded: its 16 rows' (k0,k1) bf16
/// pairs, then their (k2,k3): each bf16 from the byte tables (`vpermi2b`), its sign put back
/// (`vpternlogd`), low and high bytes interleaved.
///
/// # Safety
/// AVX-512F/BW/VBMI are present (inlined into a kernel that enables them).
#[inline(always)]
unsafe fn fp8_pairs(tab: &Fp8Tables, half: __m512i) -> [__m512i; 2] {
    // SAFETY: register operations only, under the caller's features.
    unsafe {
        let lo = _mm512_permutex2var_epi8(tab.lo[0], half, tab.lo[1]);
        let hi = _mm512_permutex2var_epi8(tab.hi[0], half, tab.hi[1]);
        let hi = _mm512_ternarylogic_epi32::<0xF8>(hi, half, _mm512_set1_epi8(-128)); // hi | (r & 0x80)
        [_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)]
    }
}

/// Units `u0..u1` of an fp8 panel in bf16-pair order (`pack`) decoded for AMX bf16 tiles: unit
/// `u`'s half `h` as its (k0,k1) then (k2,k3) pairs of 16 rows, the two 64-byte rows of a B
/// tile at `dst[h] + 128·(u − u0)`. With `fold`, the 32 rows' e8m0 codes of these units' group
/// and their bias, each row's scale is folded in ([`mx_exponent_steps`]).
///
/// # Safety
/// AVX-512F/BW/VBMI are present; `panel` holds `u1` units; each `dst[h]` has `128·(u1 − u0)`
/// writable bytes; `fold`'s codes are 32 readable bytes and `pack::mx_folds` holds for them.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub unsafe fn fp8_tile_rows(panel: *const u8, u0: usize, u1: usize, dst: [*mut u8; 2], fold: Option<(*const u8, i32)>) {
    // SAFETY: the caller's contract.
    unsafe {
        let tab = Fp8Tables::new();
        #[allow(clippy::manual_map)] // (`map`'s closure would not get this function's features)
        let steps = match fold {
            Some((codes, bias)) => Some(mx_exponent_steps(codes, bias)),
            None => None,
        };
        for u in u0..u1 {
            // Prefill staging: the tiles read it again from the caches.
            let r = load_unit(panel, u, Ahead::Both);
            for h in 0..2 {
                let [mut w01, mut w23] = fp8_pairs(&tab, r[h]);
                if let Some(s) = steps {
                    (w01, w23) = (fold_exponents(w01, s[h]), fold_exponents(w23, s[h]));
                }
                let d = dst[h].add(UNIT * (u - u0));
                _mm512_storeu_si512(d.cast(), w01);
                _mm512_storeu_si512(d.add(64).cast(), w23);
            }
        }
    }
}

/// What folds 32 rows' MX scales `2^(c − bias)` into bf16 values of theirs in B-tile order
/// (dword `i` of half `h` = row `16h + i`): `(c − bias) << 7`, the step of the exponent
/// field, in both 16-bit halves of each row's dword.
///
/// # Safety
/// AVX-512F is present (inlined into the callers, whose features it uses); 32 readable bytes at
/// `codes`.
#[inline(always)]
pub unsafe fn mx_exponent_steps(codes: *const u8, bias: i32) -> [__m512i; 2] {
    // SAFETY: the caller's contract. (No closures: they would not get the callers' features.)
    unsafe {
        let (b, low) = (_mm512_set1_epi32(bias), _mm512_set1_epi32(0xFFFF));
        let mut steps = [_mm512_setzero_si512(); 2];
        for (h, s) in steps.iter_mut().enumerate() {
            let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.add(h * HALF).cast()));
            let step = _mm512_and_si512(_mm512_slli_epi32::<7>(_mm512_sub_epi32(c, b)), low);
            *s = _mm512_or_si512(step, _mm512_slli_epi32::<16>(step));
        }
        steps
    }
}

/// bf16 values `w` times their rows' scales: each nonzero one's exponent field stepped by
/// `step` ([`mx_exponent_steps`]), exact where `pack::mx_folds` holds (the result normal); ±0
/// stay.
///
/// # Safety
/// AVX-512F/BW are present (inlined into the callers, whose features it uses).
#[inline(always)]
pub unsafe fn fold_exponents(w: __m512i, step: __m512i) -> __m512i {
    // SAFETY: register operations only, under the caller's features.
    unsafe { _mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF)), w, step) }
}

/// `acc[t] += Σ w · x[t]` over units `u0..u1` of an fp8 panel packed in bf16-pair order
/// (`pack`): each half to bf16 by the byte tables (`vpermi2b`), its sign put back
/// (`vpternlogd`), unpacked to 16 rows of (k0,k1) and of (k2,k3), then two `vdpbf16ps`.
/// Tiles of up to [`SPLIT_TOKENS`] tokens keep the (k0,k1) and (k2,k3) products in separate
/// chains, added at the end: with one chain per token and half, each unit's two dependent
/// `vdpbf16ps` made their latency, not their issue rate, bound decode. The order is fixed per
/// tile size either way. `pf`: as [`load_unit`].
///
/// # Safety
/// AVX-512F/BW/VBMI/BF16 are present (inlined into a kernel that enables them); `panel` holds
/// `u1` units; each `x[t]` the padded K in bf16.
#[inline(always)]
unsafe fn fp8_dot_units<const N: usize>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    tab: &Fp8Tables,
    x: &[*const u32; N],
    pf: Ahead,
    acc: &mut [[__m512; 2]; N],
) {
    // SAFETY: the caller's contract; u < u1 is inside the panel.
    unsafe {
        let (mut a, mut b) = (*acc, [[_mm512_setzero_ps(); 2]; N]);
        for u in u0..u1 {
            fp8_dot_unit::<N>(panel, u, tab, x, pf, &mut a, &mut b);
        }
        *acc = add_chains(a, b);
    }
}

/// Most tokens of a tile whose kernels split each accumulator's chain of dependent dot
/// instructions in two: fp8's (k0,k1) and (k2,k3) pairs, int4's low and high nibbles (exact
/// sums there, so the same bits). At two tokens and more the other tokens' chains hide the
/// latency (a split measured the same or slower).
const SPLIT_TOKENS: usize = 1;

/// Unit `u` of an fp8 panel in bf16-pair order into `a` (its (k0,k1) products) and `b` (its
/// (k2,k3) ones) up to [`SPLIT_TOKENS`] tokens, else both into `a`, the (k0,k1) first. `pf`:
/// as [`load_unit`].
///
/// # Safety
/// As [`fp8_dot_units`], `u` inside the panel (a row of kp = 4·units bf16 holds 2·units pairs).
#[inline(always)]
unsafe fn fp8_dot_unit<const N: usize>(
    panel: *const u8,
    u: usize,
    tab: &Fp8Tables,
    x: &[*const u32; N],
    pf: Ahead,
    a: &mut [[__m512; 2]; N],
    b: &mut [[__m512; 2]; N],
) {
    // SAFETY: the caller's contract.
    unsafe {
        let r = load_unit(panel, u, pf);
        for h in 0..2 {
            pair_dots::<N>(fp8_pairs(tab, r[h]), h, u, x, a, b);
        }
    }
}

/// Half `h` of fp8 unit `u`, decoded to its (k0,k1) and (k2,k3) bf16 pairs `w`, into every
/// token's chains as [`fp8_dot_unit`] says: the one sum order of a decoded and a staged unit.
///
/// # Safety
/// AVX-512F/BF16 are present (inlined into a kernel that enables them); each `x[t]` holds the
/// unit's two pairs.
#[inline(always)]
unsafe fn pair_dots<const N: usize>(
    w: [__m512i; 2],
    h: usize,
    u: usize,
    x: &[*const u32; N],
    a: &mut [[__m512; 2]; N],
    b: &mut [[__m512; 2]; N],
) {
    let [w01, w23] = w.map(bh);
    for t in 0..N {
        // SAFETY: the caller's contract.
        unsafe {
            let x01 = bh(_mm512_set1_epi32(x[t].add(2 * u).read_unaligned() as i32));
            let x23 = bh(_mm512_set1_epi32(x[t].add(2 * u + 1).read_unaligned() as i32));
            if N <= SPLIT_TOKENS {
                a[t][h] = _mm512_dpbf16_ps(a[t][h], w01, x01);
                b[t][h] = _mm512_dpbf16_ps(b[t][h], w23, x23);
            } else {
                a[t][h] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[t][h], w01, x01), w23, x23);
            }
        }
    }
}

/// [`fp8_dot_units`] on a panel staged by [`stage_fp8`]: the same sums, the decoding done.
///
/// # Safety
/// AVX-512F/BF16 are present (inlined into a kernel that enables them); `stage` holds the
/// panel's units decoded; each `x[t]` the padded K in bf16.
#[inline(always)]
unsafe fn staged_dot_units<const N: usize>(
    stage: *const u8,
    units: usize,
    (u0, u1): (usize, usize),
    x: &[*const u32; N],
    acc: &mut [[__m512; 2]; N],
) {
    // SAFETY: the caller's contract: half h of unit u at stage + (h·units + u)·UNIT.
    unsafe {
        let (mut a, mut b) = (*acc, [[_mm512_setzero_ps(); 2]; N]);
        for u in u0..u1 {
            for h in 0..2 {
                let d = stage.add((h * units + u) * UNIT);
                let w = [_mm512_loadu_si512(d.cast()), _mm512_loadu_si512(d.add(64).cast())];
                pair_dots::<N>(w, h, u, x, &mut a, &mut b);
            }
        }
        *acc = add_chains(a, b);
    }
}

/// Bytes [`stage_fp8`] writes for one panel of a `format` matrix of `cols` columns packed for
/// `level`: its units as bf16 pairs, twice their size; 0 where it packs no pairs.
pub fn stage_bytes(format: WeightFormat, level: Level, cols: usize) -> usize {
    match crate::pack::pairs(format, level) {
        true => 2 * cols.div_ceil(crate::pack::unit_k(format)) * UNIT,
        false => 0,
    }
}

/// Panel `p` of an fp8 matrix packed in bf16-pair order, decoded once into `stage` for every
/// token tile of a task to read ([`StagedRun`]), where each tile decoded it again. Half `h`
/// of unit `u` lands at `(h·units + u)·128` ([`fp8_tile_rows`]' layout).
///
/// # Safety
/// AVX-512F/BW/VBMI are present; `w` is such a matrix ([`staged_kernel`] gave its kernel).
pub unsafe fn stage_fp8(w: &Packed, p: usize, stage: &mut [u8]) {
    assert!(
        stage.len() >= 2 * w.panel_bytes(),
        "stage of {} bytes, a panel needs {}",
        stage.len(),
        2 * w.panel_bytes()
    );
    let d = stage.as_mut_ptr();
    // SAFETY: the caller's contract; `stage` holds both halves' 128·units bytes.
    unsafe { fp8_tile_rows(w.panel(p).as_ptr(), 0, w.units, [d, d.add(w.units * UNIT)], None) }
}

/// Units `u0..u1` of an fp8 panel: bit-placed for FMAs, or (`DOT`) decoded by the tables for
/// `vdpbf16ps`.
///
/// # Safety
/// The features of `DOT`'s kernel (below); `panel` holds `u1` units; `x` (or `x16` if `DOT`)
/// rows the padded K.
#[inline(always)]
unsafe fn fp8_span<const N: usize, const DOT: bool>(
    panel: Panel,
    (u0, u1): (usize, usize),
    tab: &Fp8Tables,
    x: &[*const f32; N],
    x16: &[*const u32; N],
    pf: Ahead,
    acc: &mut [[__m512; 2]; N],
) {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe {
        match panel {
            Panel::Staged(stage, units) => staged_dot_units::<N>(stage, units, (u0, u1), x16, acc),
            Panel::Packed(p) if DOT => fp8_dot_units::<N>(p, u0, u1, tab, x16, pf, acc),
            Panel::Packed(p) => float_units::<N, false>(p, u0, u1, x, pf, acc),
        }
    }
}

/// Where an fp8 tile reads its panel's weights.
#[derive(Clone, Copy)]
enum Panel {
    /// The packed bytes, decoded as they are read.
    Packed(*const u8),
    /// Decoded already by [`stage_fp8`] (for `vdpbf16ps`): the stage and the panel's units.
    Staged(*const u8, usize),
}

/// An fp8 panel's tile: per-block sums times the block's scale(s), added block by block; with
/// `STAGED` (and `DOT`) the panel's weights read decoded at `stage` ([`stage_fp8`]).
///
/// # Safety
/// AVX-512F/BW (and VBMI/BF16 if `DOT`) are present; `act`'s bf16 rows (if `DOT`) or f32
/// rows (if not) hold `t0 + N` tokens; `w` packed for `DOT` (`pairs` for the fp8 kinds);
/// `stage` (if `STAGED`) holds panel `p` staged.
#[inline(always)]
unsafe fn float_body<const N: usize, const DOT: bool, const STAGED: bool>(
    w: &Packed,
    p: usize,
    stage: *const u8,
    act: &Act<'_>,
    t0: usize,
    out: &mut Acc,
) {
    let (x, x16, kp) = (act.x, act.x16, act.kp);
    // A constant once inlined: the staged kernel holds no decoding.
    let panel = if STAGED { Panel::Staged(stage, w.units) } else { Panel::Packed(w.panel(p).as_ptr()) };
    // The dot kernels read only the bf16 rows, the FMA ones only the f32 rows (`act`).
    let xs: [*const f32; N] =
        core::array::from_fn(|t| if DOT { core::ptr::null() } else { x[(t0 + t) * kp..].as_ptr() });
    let xh: [*const u32; N] =
        core::array::from_fn(|t| if DOT { x16[(t0 + t) * kp..].as_ptr().cast() } else { core::ptr::null() });
    // SAFETY: the panel spans w.units units, x and x16 rows kp = unit_k·units values, scales as
    // `pack` lays them out.
    unsafe {
        let z = _mm512_setzero_ps();
        let mut acc = [[z; 2]; N];
        let span = |u0: usize, units: usize| (u0, (u0 + units).min(w.units));
        // (units per scale block, scale stride between blocks, per-row scales?)
        let (per_block, stride, rows) = match w.format {
            WeightFormat::Fp8Channel => (w.units, 0, true),
            WeightFormat::Mxfp8 => (kt_core::format::mx::MX_BLOCK / 4, PANEL, true),
            _ => (FP8_BLOCK / 4, 1, false),
        };
        let tab = Fp8Tables::new();
        let pf = ahead::<N, false>();
        let blocks = w.units.div_ceil(per_block);
        let base = if rows { p * blocks * PANEL } else { p * blocks };
        for b in 0..blocks {
            let mut blk = [[z; 2]; N];
            if w.format == WeightFormat::Mxfp8 {
                kt_x86::prefetch::scales(w.scales_at(base + (b + SCALE_GROUPS_AHEAD) * stride));
            }
            fp8_span::<N, DOT>(panel, span(b * per_block, per_block), &tab, &xs, &xh, pf, &mut blk);
            let s = match rows {
                true => group_scales(w, base + b * stride),
                false => [_mm512_set1_ps(w.scales[base + b * stride]); 2],
            };
            for t in 0..N {
                for h in 0..2 {
                    acc[t][h] = if w.format == WeightFormat::Fp8Channel {
                        _mm512_mul_ps(blk[t][h], s[h])
                    } else {
                        _mm512_fmadd_ps(blk[t][h], s[h], acc[t][h])
                    };
                }
            }
        }
        store_tile(&acc, out);
    }
}

/// A bf16 panel's tile, by `vdpbf16ps` (`DOT`) or widened into FMAs. Kept out of the fp8
/// kernels' function: beside them LLVM hoisted the fp8 byte tables above the format test, and
/// with 4 registers fewer one of the 24 accumulators of a 12-token tile went through the stack
/// every unit (a store-to-load chain each unit: docs/performance.md, "bf16 tiles").
///
/// # Safety
/// As [`float_body`].
#[inline(always)]
unsafe fn bf16_body<const N: usize, const DOT: bool>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
    let (x, x16, kp, panel) = (act.x, act.x16, act.kp, w.panel(p).as_ptr());
    // SAFETY: the panel spans w.units units, x and x16 rows kp = 2·units values.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        if DOT {
            let xh: [*const u32; N] = core::array::from_fn(|t| x16[(t0 + t) * kp..].as_ptr().cast());
            bf16_dot_units::<N>(panel, 0, w.units, &xh, ahead::<N, true>(), &mut acc)
        } else {
            let xs: [*const f32; N] = core::array::from_fn(|t| x[(t0 + t) * kp..].as_ptr());
            float_units::<N, true>(panel, 0, w.units, &xs, ahead::<N, true>(), &mut acc)
        }
        store_tile(&acc, out);
    }
}

/// The float tile kernels: each body compiled with only the features its level allows.
macro_rules! float_kernels {
    ($($name:ident = $body:ident::<$($g:literal),+>($($extra:expr),*) with $features:literal;)*) => {$(
        /// # Safety
        #[doc = concat!("The CPU has ", $features, "; as [`float_body`].")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const N: usize>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
            // SAFETY: this function's `# Safety` is the callee's (its features and slices).
            unsafe { $body::<N, $($g),+>(w, p, $($extra,)* act, t0, out) }
        }
    )*};
}

float_kernels! {
    bf16_panel = bf16_body::<false>() with "avx512f,avx512bw";
    bf16_panel_dot = bf16_body::<true>() with "avx512f,avx512bw,avx512bf16";
    float_panel = float_body::<false, false>(core::ptr::null()) with "avx512f,avx512bw";
    float_panel_dot = float_body::<true, false>(core::ptr::null()) with "avx512f,avx512bw,avx512vbmi,avx512bf16";
}

/// The staged fp8 tile ([`StagedRun`]).
///
/// # Safety
/// As [`float_body`] with `STAGED`, at the bf16 level.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16")]
unsafe fn float_panel_staged<const N: usize>(
    w: &Packed,
    p: usize,
    stage: *const u8,
    act: &Act<'_>,
    t0: usize,
    out: &mut Acc,
) {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe { float_body::<N, true, true>(w, p, stage, act, t0, out) }
}

/// `acc[t] += Σ w · x[t]` over units `u0..u1` of an int8 or int4 (`INT4`) panel, with
/// `vpdpbusd` (`VNNI`) or `vpmaddubsw`/`vpmaddwd`. Activations are int8 + 128, so the sums
/// gain 128·Σw, which the accumulators start without (−128·Σw), except for int8 without VNNI,
/// whose sums are exact and start at 0 (see the module docs). `KT`: `panel` is a run in KT's
/// order that starts at unit `u0` (`pack`), whose int4 bytes pair k with k + 64. int4 on VNNI
/// keeps its low and high nibbles in two chains up to [`SPLIT_TOKENS`] tokens.
///
/// # Safety
/// AVX-512F/BW (and VNNI if `VNNI`) are present; `panel` holds `u1` units (a KT run `u1 − u0`);
/// each `x[t]` the padded K.
#[inline(always)]
unsafe fn int_units<const N: usize, const INT4: bool, const VNNI: bool, const VBMI: bool, const KT: bool>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    lut: __m512i,
    x: &[*const u8; N],
    acc: &mut [[__m512i; 2]; N],
) {
    // SAFETY: AVX-512F/BW (and VNNI where used) by the contract; u < u1 is inside the panel and
    // every quad read lies in the padded K of its row.
    unsafe {
        let (ones, flip, zero) = (_mm512_set1_epi16(1), _mm512_set1_epi8(-128), _mm512_setzero_si512());
        let (mut a, mut b) = (*acc, [[zero; 2]; N]);
        // One pointer walk per stretch: KT's order in tiles of 16 units (stride 64, second half
        // 1024 on), panels in one stretch (stride 128, second half 64 on). (A unit index turned
        // into an address inside the loop cost 25% at 12 tokens: its registers spilled.)
        let (stride, second, per) = if KT { (64, KT_TILE / 2, 16) } else { (UNIT, 64, u1 - u0) };
        let pf = ahead::<N, false>();
        let mut start = u0;
        while start < u1 {
            let end = (start + per).min(u1);
            let base = if KT { panel.add((start - u0) / 16 * KT_TILE) } else { panel.add(start * UNIT) };
            for (i, u) in (start..end).enumerate() {
                let r = load_halves(base.add(i * stride), second, base.wrapping_add(i * UNIT), pf);
                if INT4 {
                    let [lo, hi] = nibbles::<true, VBMI>(r, lut);
                    // Where the unit's low and high nibbles' k are (module docs of `pack`).
                    let (kl, kh) = if KT { (start / 16 * 128 + 4 * i, 64) } else { (8 * u, 4) };
                    for t in 0..N {
                        let (xl, xh) = (quad(x[t], kl), quad(x[t], kl + kh));
                        for h in 0..2 {
                            if VNNI && N <= SPLIT_TOKENS {
                                a[t][h] = _mm512_dpbusd_epi32(a[t][h], xl, lo[h]);
                                b[t][h] = _mm512_dpbusd_epi32(b[t][h], xh, hi[h]);
                            } else if VNNI {
                                a[t][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[t][h], xl, lo[h]), xh, hi[h]);
                            } else {
                                let s =
                                    _mm512_add_epi16(_mm512_maddubs_epi16(xl, lo[h]), _mm512_maddubs_epi16(xh, hi[h]));
                                a[t][h] = _mm512_add_epi32(a[t][h], _mm512_madd_epi16(s, ones));
                            }
                        }
                    }
                } else if VNNI {
                    for t in 0..N {
                        let xv = quad(x[t], 4 * u);
                        for h in 0..2 {
                            a[t][h] = _mm512_dpbusd_epi32(a[t][h], xv, r[h]);
                        }
                    }
                } else {
                    let abs = [_mm512_abs_epi8(r[0]), _mm512_abs_epi8(r[1])];
                    let neg = [_mm512_movepi8_mask(r[0]), _mm512_movepi8_mask(r[1])];
                    for t in 0..N {
                        let xs = _mm512_xor_si512(quad(x[t], 4 * u), flip);
                        for h in 0..2 {
                            let xv = _mm512_mask_sub_epi8(xs, neg[h], zero, xs);
                            a[t][h] =
                                _mm512_add_epi32(a[t][h], _mm512_madd_epi16(_mm512_maddubs_epi16(abs[h], xv), ones));
                        }
                    }
                }
            }
            start = end;
        }
        *acc = if INT4 && VNNI { add_chains(a, b) } else { a };
    }
}

/// The four bytes at `x + at` broadcast to every dword.
///
/// # Safety
/// AVX-512F is present (inlined into the kernels); 4 readable bytes at `x + at`.
#[inline(always)]
unsafe fn quad(x: *const u8, at: usize) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe { _mm512_set1_epi32(x.add(at).cast::<i32>().read_unaligned()) }
}

/// A unit's two halves' low nibbles and high nibbles, each through `lut` (its 16 bytes in
/// every 128-bit lane) when `LUT`. With `VBMI`, `vpermb` looks them up unmasked: it reads six
/// bits of each index, and the repeated table maps all four values of the upper two to the
/// same entry (the four masks of a unit's ten instructions saved).
///
/// # Safety
/// AVX-512F/BW (and VBMI if `VBMI`) are present (inlined into the kernels, whose features it
/// uses).
#[inline(always)]
unsafe fn nibbles<const LUT: bool, const VBMI: bool>(r: [__m512i; 2], lut: __m512i) -> [[__m512i; 2]; 2] {
    // SAFETY: the caller's contract. (No closures: they would not get the kernels' features.)
    unsafe {
        if LUT && VBMI {
            let hi = [_mm512_srli_epi16::<4>(r[0]), _mm512_srli_epi16::<4>(r[1])];
            return [
                [_mm512_permutexvar_epi8(r[0], lut), _mm512_permutexvar_epi8(r[1], lut)],
                [_mm512_permutexvar_epi8(hi[0], lut), _mm512_permutexvar_epi8(hi[1], lut)],
            ];
        }
        let lo4 = _mm512_set1_epi8(0x0F);
        let lo = [_mm512_and_si512(r[0], lo4), _mm512_and_si512(r[1], lo4)];
        let hi = [_mm512_srli_epi16::<4>(r[0]), _mm512_srli_epi16::<4>(r[1])];
        let hi = [_mm512_and_si512(hi[0], lo4), _mm512_and_si512(hi[1], lo4)];
        if !LUT {
            return [lo, hi];
        }
        [
            [_mm512_shuffle_epi8(lut, lo[0]), _mm512_shuffle_epi8(lut, lo[1])],
            [_mm512_shuffle_epi8(lut, hi[0]), _mm512_shuffle_epi8(lut, hi[1])],
        ]
    }
}

/// 32 rows' MX scales from their e8m0 codes `c`: `2^(c − bias)` (`pack::mx_scale`), exactly
/// (`vscalefps` makes subnormals and infinities as the f32 products would).
///
/// # Safety
/// AVX-512F is present (inlined into the kernels); 32 readable bytes at `p`.
#[inline(always)]
unsafe fn mx_scales(p: *const u8, bias: i32) -> [__m512; 2] {
    // SAFETY: the caller's contract. (No closures: they would not get the kernels' features.)
    unsafe {
        let (one, bias) = (_mm512_set1_ps(1.0), _mm512_set1_ps(bias as f32));
        let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())));
        let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(HALF).cast())));
        [_mm512_scalef_ps(one, _mm512_sub_ps(lo, bias)), _mm512_scalef_ps(one, _mm512_sub_ps(hi, bias))]
    }
}

/// 32 rows' MX scales from their codes as f32 exponent fields (`Packed::exponents`): each
/// code `c` placed as the bits `c << 23`.
///
/// # Safety
/// AVX-512F is present (inlined into the kernels); 32 readable bytes at `p`.
#[inline(always)]
unsafe fn exponent_scales(p: *const u8) -> [__m512; 2] {
    // SAFETY: the caller's contract. (No closures: they would not get the kernels' features.)
    unsafe {
        let lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
        let hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(HALF).cast()));
        [_mm512_castsi512_ps(_mm512_slli_epi32::<23>(lo)), _mm512_castsi512_ps(_mm512_slli_epi32::<23>(hi))]
    }
}

/// The 32 rows' scales at `at` (`[panel][group][32]` index) of a K-group, MX or per-row fp8 matrix.
///
/// # Safety
/// AVX-512F is present (inlined into the kernels); the matrix holds 32 scales at `at`.
#[inline(always)]
unsafe fn group_scales(w: &Packed, at: usize) -> [__m512; 2] {
    // SAFETY: the caller's contract; the slices check `at`.
    unsafe {
        match w.group_scale_kind() {
            GroupScales::Codes(c, bias) => mx_scales(c[at..at + PANEL].as_ptr(), bias),
            GroupScales::Exponents(c) => exponent_scales(c[at..at + PANEL].as_ptr()),
            GroupScales::Bf16(s) => bf16_scales(s[at..at + PANEL].as_ptr()),
            GroupScales::F32(s) => load32(s[at..at + PANEL].as_ptr()),
        }
    }
}

/// [`Packed::group_scales`] widened in registers: the AMX kernels' per-group epilogue, where
/// widening 32 codes one at a time was a third of its time.
///
/// # Safety
/// AVX-512F is present; the matrix holds 32 scales at `at`.
#[target_feature(enable = "avx512f")]
pub unsafe fn group_scales_f32(w: &Packed, at: usize) -> [f32; PANEL] {
    let mut out = [0.0; PANEL];
    // SAFETY: the caller's contract; `out` holds 32 floats.
    unsafe {
        let [lo, hi] = group_scales(w, at);
        _mm512_storeu_ps(out.as_mut_ptr(), lo);
        _mm512_storeu_ps(out.as_mut_ptr().add(HALF), hi);
    }
    out
}

/// 32 rows' scales from their bf16 bits (exactly: a bf16 is an f32's top half).
///
/// # Safety
/// AVX-512F is present (inlined into the kernels); 32 readable `u16` at `p`.
#[inline(always)]
unsafe fn bf16_scales(p: *const u16) -> [__m512; 2] {
    // SAFETY: the caller's contract. (No closures: they would not get the kernels' features.)
    unsafe {
        let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(HALF).cast()));
        [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(lo)), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi))]
    }
}

/// `acc[t] += Σ (w + o) · x[t]` over units `u0..u1` of a K-group int4 or mxfp4 panel: each
/// nibble unsigned (through `lut` when `LUT`), the signed activations broadcast from memory
/// into `vpdpbusd` (`VNNI`: low and high nibbles in two chains up to [`SPLIT_TOKENS`] tokens)
/// or `vpmaddubsw`/`vpmaddwd` (|x| ≤ 127, w + o ≤ 24: no saturation). `pf`: as [`load_unit`].
///
/// # Safety
/// AVX-512F/BW (and VNNI if `VNNI`) are present; `panel` holds `u1` units; each `x[t]` the
/// padded K.
#[inline(always)]
unsafe fn group_units<const N: usize, const LUT: bool, const VNNI: bool, const VBMI: bool>(
    panel: *const u8,
    u0: usize,
    u1: usize,
    lut: __m512i,
    x: &[*const u8; N],
    pf: Ahead,
    acc: &mut [[__m512i; 2]; N],
) {
    // SAFETY: AVX-512F/BW (and VNNI where used) by the contract; u < u1 is inside the panel and
    // every quad read lies in the padded K of its row.
    unsafe {
        let ones = _mm512_set1_epi16(1);
        let (mut a, mut b) = (*acc, [[_mm512_setzero_si512(); 2]; N]);
        for u in u0..u1 {
            let [lo, hi] = nibbles::<LUT, VBMI>(load_unit(panel, u, pf), lut);
            for t in 0..N {
                let (xl, xh) = (quad(x[t], 8 * u), quad(x[t], 8 * u + 4));
                for h in 0..2 {
                    if VNNI && N <= SPLIT_TOKENS {
                        a[t][h] = _mm512_dpbusd_epi32(a[t][h], lo[h], xl);
                        b[t][h] = _mm512_dpbusd_epi32(b[t][h], hi[h], xh);
                    } else if VNNI {
                        a[t][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[t][h], lo[h], xl), hi[h], xh);
                    } else {
                        let s = _mm512_add_epi16(_mm512_maddubs_epi16(lo[h], xl), _mm512_maddubs_epi16(hi[h], xh));
                        a[t][h] = _mm512_add_epi32(a[t][h], _mm512_madd_epi16(s, ones));
                    }
                }
            }
        }
        *acc = if VNNI { add_chains(a, b) } else { a };
    }
}

/// A register of a chain's sums: i32 lanes (exact) or f32.
trait ChainSum: Copy {
    /// `a + b` lane by lane.
    ///
    /// # Safety
    /// AVX-512F is present (inlined into the kernels, whose features it uses).
    unsafe fn add(a: Self, b: Self) -> Self;
}

impl ChainSum for __m512i {
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { _mm512_add_epi32(a, b) }
    }
}

impl ChainSum for __m512 {
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { _mm512_add_ps(a, b) }
    }
}

/// Two chains of sums as one: `a + b` for tiles of up to [`SPLIT_TOKENS`] tokens (the kernels
/// that split call it), else `a` (the only chain).
///
/// # Safety
/// AVX-512F is present (inlined into the kernels, whose features it uses).
#[inline(always)]
unsafe fn add_chains<V: ChainSum, const N: usize>(a: [[V; 2]; N], b: [[V; 2]; N]) -> [[V; 2]; N] {
    if N > SPLIT_TOKENS {
        return a;
    }
    let mut sum = a;
    for t in 0..N {
        for h in 0..2 {
            // SAFETY: register operations only, under the caller's features. (No closure: it
            // would not get them.)
            sum[t][h] = unsafe { V::add(a[t][h], b[t][h]) };
        }
    }
    sum
}

/// # Safety
/// AVX-512F/BW (and VNNI if `VNNI`) are present; `act` holds `t0 + N` rows for `w`'s format.
/// The scales (and the per-row kinds' biases) hold 32 per panel and group (`pack`).
#[inline(always)]
unsafe fn int_panel<const N: usize, const VNNI: bool, const VBMI: bool>(
    w: &Packed,
    p: usize,
    act: &Act<'_>,
    t0: usize,
    out: &mut Acc,
) {
    let xs: [*const u8; N] = core::array::from_fn(|t| act.q[(t0 + t) * act.kp..].as_ptr());
    let groups = act.groups;
    let table = nibble_table(w.format);
    // SAFETY: the panel holds w.units units, x rows kp bytes, scales and biases 32 per panel
    // and group (caller's contract and `pack`).
    unsafe {
        // The accumulators' start: −128·Σw, or 0 for int8 without VNNI (exact signed sums).
        let biased = VNNI || w.format != WeightFormat::Int8Row;
        let start = |at: usize| -> [__m512i; 2] {
            if biased {
                let b = w.bias[at..].as_ptr();
                [_mm512_loadu_si512(b.cast()), _mm512_loadu_si512(b.add(HALF).cast())]
            } else {
                [_mm512_setzero_si512(); 2]
            }
        };
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr().cast()));
        let mut res = [[_mm512_setzero_ps(); 2]; N];
        match w.format {
            f @ (WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4) => {
                let upg = f.k_group().unwrap_or(w.cols) / 8;
                let panel = w.panel(p).as_ptr();
                let table = unsigned_weights(f).0;
                let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(table.unwrap_or_default().as_ptr().cast()));
                // Token t's scale and start of group g at `t · groups + g`, read unchecked: a
                // check per token and group held the rescale's instructions in order.
                let tile = t0 * groups..(t0 + N) * groups;
                let (scales, starts) = (act.scales[tile.clone()].as_ptr(), act.starts[tile].as_ptr());
                let pf = ahead::<N, false>();
                for g in 0..groups {
                    let at = (p * groups + g) * PANEL;
                    let mut acc = [[_mm512_setzero_si512(); 2]; N];
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = [_mm512_set1_epi32(*starts.add(t * groups + g)); 2];
                    }
                    kt_x86::prefetch::scales(w.scales_at(at + SCALE_GROUPS_AHEAD * PANEL));
                    let (u0, u1) = (g * upg, (g + 1) * upg);
                    match table {
                        Some(_) => group_units::<N, true, VNNI, VBMI>(panel, u0, u1, lut, &xs, pf, &mut acc),
                        None => group_units::<N, false, VNNI, VBMI>(panel, u0, u1, lut, &xs, pf, &mut acc),
                    }
                    let s = group_scales(w, at);
                    for t in 0..N {
                        let a = _mm512_set1_ps(*scales.add(t * groups + g));
                        for h in 0..2 {
                            let sum = _mm512_cvtepi32_ps(acc[t][h]);
                            res[t][h] = _mm512_fmadd_ps(sum, _mm512_mul_ps(a, s[h]), res[t][h]);
                        }
                    }
                }
            }
            f => {
                let mut acc = [start(p * PANEL); N];
                let mut s = 0;
                while let Some((run, units)) = w.run(p, s) {
                    let (u0, u1) = (units.start, units.end);
                    match (f == WeightFormat::Int8Row, w.kt) {
                        (true, true) => int_units::<N, false, VNNI, VBMI, true>(run, u0, u1, lut, &xs, &mut acc),
                        (true, false) => int_units::<N, false, VNNI, VBMI, false>(run, u0, u1, lut, &xs, &mut acc),
                        (false, true) => int_units::<N, true, VNNI, VBMI, true>(run, u0, u1, lut, &xs, &mut acc),
                        (false, false) => int_units::<N, true, VNNI, VBMI, false>(run, u0, u1, lut, &xs, &mut acc),
                    }
                    s += 1;
                }
                let s = load32(w.scales[p * PANEL..].as_ptr());
                for t in 0..N {
                    let a = _mm512_set1_ps(act.scales[t0 + t]);
                    for h in 0..2 {
                        // (Σ · sa) · sw, the reference's order.
                        res[t][h] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[t][h]), a), s[h]);
                    }
                }
            }
        }
        store_tile(&res, out);
    }
}

/// # Safety
/// As [`int_panel`], with AVX-512F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn int_panel_base<const N: usize>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
    // SAFETY: forwarded; compiled without VNNI so no instruction of it can appear.
    unsafe { int_panel::<N, false, false>(w, p, act, t0, out) }
}

/// # Safety
/// As [`int_panel`], with AVX-512F/BW/VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn int_panel_vnni<const N: usize>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe { int_panel::<N, true, false>(w, p, act, t0, out) }
}

/// # Safety
/// As [`int_panel`], with AVX-512F/BW/VNNI/VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn int_panel_vbmi<const N: usize>(w: &Packed, p: usize, act: &Act<'_>, t0: usize, out: &mut Acc) {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe { int_panel::<N, true, true>(w, p, act, t0, out) }
}

/// A panel microkernel: tokens `t0..t0+nt` (nt ≤ [`max_run`]) × panel `p` of `w` into
/// `out[..nt]`. Which one a matrix runs is chosen once, when it is packed ([`panel_kernel`]).
///
/// # Safety
/// The CPU runs the level the kernel was chosen for; `act` was prepared for `w`'s format and
/// K at that level, with at least `t0 + nt` rows.
pub type PanelRun = unsafe fn(w: &Packed, p: usize, act: &Act<'_>, t0: usize, nt: usize, out: &mut Acc);

/// Each panel kernel as a [`PanelRun`]: its token count made a const generic.
macro_rules! panel_runs {
    ($($run:ident = $kernel:ident;)*) => {$(
        /// # Safety
        /// As [`PanelRun`].
        unsafe fn $run(w: &Packed, p: usize, act: &Act<'_>, t0: usize, nt: usize, out: &mut Acc) {
            // SAFETY: this function's `# Safety` is the callee's (its features and slices).
            unsafe { kt_x86::by_tokens!(nt; 1 2 3 4 5 6 7 8 9 10 11 12; $kernel(w, p, act, t0, out)) }
        }
    )*};
}

panel_runs! {
    run_bf16 = bf16_panel;
    run_bf16_dot = bf16_panel_dot;
    run_float = float_panel;
    run_float_dot = float_panel_dot;
    run_int_base = int_panel_base;
    run_int_vnni = int_panel_vnni;
    run_int_vbmi = int_panel_vbmi;
}

/// The microkernel `w`'s panels run at `level` (`w` packed for that level).
pub fn panel_kernel(level: Level, w: &Packed) -> PanelRun {
    match (w.format, level) {
        // bf16 weights, and fp8 ones packed in pairs, run on vdpbf16ps at the bf16 level at
        // every token count: where its peak is twice the FMA's it wins outright, and where it
        // equals it (one 32-pair instruction a cycle against two 16-lane FMAs) it still needs
        // no widening and one broadcast per two k (docs/tuning.md).
        (WeightFormat::Bf16, Level::Bf16) => run_bf16_dot,
        (WeightFormat::Bf16, _) => run_bf16,
        (f, Level::Vbmi | Level::Bf16) if f.int_activations() => run_int_vbmi,
        (f, Level::Vnni) if f.int_activations() => run_int_vnni,
        (f, Level::Base) if f.int_activations() => run_int_base,
        (_, Level::Bf16) if w.pairs => run_float_dot,
        _ => run_float,
    }
}

/// A panel microkernel on panel `p` staged at `stage` by [`stage_fp8`]: otherwise as
/// [`PanelRun`], and the same sums.
///
/// # Safety
/// As [`PanelRun`]; `stage` holds panel `p` of `w` staged.
pub type StagedRun =
    unsafe fn(w: &Packed, p: usize, stage: *const u8, act: &Act<'_>, t0: usize, nt: usize, out: &mut Acc);

/// # Safety
/// As [`StagedRun`].
unsafe fn run_float_staged(w: &Packed, p: usize, stage: *const u8, act: &Act<'_>, t0: usize, nt: usize, out: &mut Acc) {
    // SAFETY: this function's `# Safety` is the callee's (its features and slices).
    unsafe { kt_x86::by_tokens!(nt; 1 2 3 4 5 6 7 8 9 10 11 12; float_panel_staged(w, p, stage, act, t0, out)) }
}

/// The staged kernel of `w` at `level`, where it has one: fp8 in bf16-pair order on
/// `vdpbf16ps`, whose decoding (two `vpermi2b`, a `vpternlogd` and two unpacks a half unit)
/// each token tile of a panel repeated.
pub fn staged_kernel(level: Level, w: &Packed) -> Option<StagedRun> {
    (level == Level::Bf16 && w.pairs && !w.kt).then_some(run_float_staged as StagedRun)
}

#[cfg(test)]
mod mx_tests {
    use super::*;

    /// Every e8m0 code at each bias the packing uses, against `2^(c − bias)` computed in f64:
    /// normal, subnormal (codes 0 and 1 for mxfp4) and infinite (mxfp8's fold of 2^120).
    #[test]
    fn mx_scales_are_exact_powers_of_two() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            kt_core::skip_isa!("AVX-512F");
            return;
        }
        for bias in [128, 127, 7] {
            for first in (0..256).step_by(32) {
                let codes: [u8; 32] = core::array::from_fn(|i| (first + i) as u8);
                let mut got = [0f32; 32];
                // SAFETY: AVX-512F checked above; 32 bytes in, 32 floats out.
                unsafe {
                    let [lo, hi] = mx_scales(codes.as_ptr(), bias);
                    _mm512_storeu_ps(got.as_mut_ptr(), lo);
                    _mm512_storeu_ps(got.as_mut_ptr().add(16), hi);
                }
                for (c, g) in codes.iter().zip(got) {
                    let want = 2f64.powi(i32::from(*c) - bias) as f32;
                    assert_eq!(g.to_bits(), want.to_bits(), "code {c} bias {bias}: {g:e} against {want:e}");
                    assert_eq!(g.to_bits(), crate::pack::mx_scale(*c, bias).to_bits(), "code {c} bias {bias}");
                }
            }
        }
    }
}
