//! The tile kernels: a block of up to [`MAX_RUN`] tokens × one 32-row panel, over the whole
//! K, on the AVX-512 backend's packed bytes (`kt_zmm::pack`) and prepared
//! activations (`act`), generic over the tile seam ([`TileOps`]).
//!
//! ```text
//!  tiles  C0 = tokens 0-15 × rows 0-15   C1 = tokens 0-15 × rows 16-31     (i32 or f32)
//!         C2 = tokens 16-31 × rows 0-15  C3 = tokens 16-31 × rows 16-31
//!         A4, A5 = the two token halves' 64 K bytes; B6, B7 = the two row halves'
//!  per 64 K bytes: C0 += A4·B6, C1 += A4·B7, C2 += A5·B6, C3 += A5·B7
//!
//!  B tiles straight from the packed bytes: a 128-byte unit is one B row of each half
//!    int8, KT's order   B6 = run + 2048·j, B7 = + 1024, stride 64 (KT's BufferB tiles)
//!    int8, bf16 panels  B6 = panel + 2048·j, B7 = + 64, stride 128
//!  int4 (KT's order): each 2048-byte tile of 128 K unpacked in L1 to four int8 B tiles (low
//!    nibbles = k 0-63, high = k 64-127; values n, the 16 is in the scale)
//!  K-group int4, mxfp4 (panels): 8 units (64 K) unpacked in L1 to one int8 B tile per half, a
//!    unit's low nibbles (k 0-3 of 16 rows) one B row, its high ones (k 4-7) the next; g32
//!    steps 32 K (B tiles of 8 rows, A of 32 bytes)
//!  fp8, mxfp8 (panels in bf16-pair order): 8 units (32 K) decoded in L1 to one bf16 B tile per
//!    half (`fp8_tile_rows`: a unit's (k0,k1) pairs one B row, its (k2,k3) the next); mxfp8's
//!    scales, where they fold (`Packed::folds`), added into the decoded elements' exponents, so
//!    the C tiles sum the whole K into the results
//! ```
//!
//! Integer tiles multiply the int8 + 128 activations (`tdpbusd`: unsigned × signed) and take
//! off 128·Σw after, then scale as the AVX-512 kernels do, `((Σ + bias) · s_act) · s_w` (per
//! row); the K-group kinds multiply signed activations by signed weights (`tdpbssd`) and add
//! `Σ_g · (s_act,g · s_w,g)` fused (the C tiles stored and cleared at each group's end): the
//! sums are exact, so the results are theirs bit for bit. Scaled float blocks (fp8's 128 K, mxfp8's 32) are stored and added the same way, in
//! the tiles' own order of additions (close to the AVX-512 kernels', not the same bits), except
//! mxfp8's where they fold.

use kt_core::format::mx::MX_BLOCK;
use kt_core::format::FP8_BLOCK;
use kt_core::WeightFormat;
use kt_x86::prefetch::share_to_l2;
use kt_zmm::act::Act;
use kt_zmm::kernels::group_scales_f32;
use kt_zmm::pack::{Packed, HALF, KT_TILE, PANEL, UNIT};

use crate::tile::{TileConfig, TileOps, COLSB, ROWS};

/// Most tokens in one run: two A tiles of 16 rows.
pub const MAX_RUN: usize = 2 * ROWS;

/// The results of a panel and a run, `[token][row in panel]`.
pub type Acc = [[f32; PANEL]; MAX_RUN];

/// The tile product of a step ([`dp`]): `tdpbusd` (u8 activations × i8 weights).
pub(crate) const US8: u8 = 0;
/// `tdpbssd` (i8 × i8).
pub(crate) const SS8: u8 = 1;
/// `tdpbf16ps`.
pub(crate) const BF16: u8 = 2;

/// Units a tile step of the decoded formats covers: 64 K of int4, 32 K of fp8.
const STEP_UNITS: usize = 8;

/// Whether the tile kernels run `w`: int8 and bf16 whose K is whole tiles (64 bytes), KT's
/// int4, the K-group int4 kinds, and the fp8 kinds packed in bf16 pairs whose K is whole
/// steps (32 values). Others run on the AVX-512 kernels.
pub fn runs(w: &Packed) -> bool {
    match w.format {
        WeightFormat::Int8Row | WeightFormat::Bf16 => w.kt || w.units % ROWS == 0,
        WeightFormat::Int4Row => w.kt,
        // K is a multiple of the group (`col_multiple`), so of a step's 4 or 8 units.
        WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 => !w.kt,
        WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => w.pairs && w.units % STEP_UNITS == 0,
        _ => false,
    }
}

/// Tokens per expert from which an expert of `format` runs on tiles unless `KT_AMX_TILE_FROM`
/// says otherwise (None: on the AVX-512 kernels always); `folds`: mxfp8's scales fold
/// (`Packed::folds`). Each is where the tiles first beat the AVX-512 kernels in the device
/// job's `tile-from` phase (`bash scripts/device-amx.sh run tile-from`; the measurements in
/// docs/performance.md, "Acc thresholds per format"); never for K-group int4 in groups of 32
/// and mxfp4, whose C tiles are stored and rescaled every 32 K and lost at every token count.
///
/// Not measured on tiles, set by kin: mxfp8 whose scales fold as fp8 (the C tiles sum the whole
/// K; never where they do not, rescaled every 32 K as mxfp4), K-group int4 in groups of 128 or
/// more as KT's int4 (rescaled every 128 K as fp8's blocks), of 64 never.
pub const fn measured_tile_from(format: WeightFormat, folds: bool) -> Option<usize> {
    match format {
        WeightFormat::Int8Row => Some(4),
        WeightFormat::Int4Row => Some(8),
        WeightFormat::Int4Group { group } if group >= 128 => Some(8),
        WeightFormat::Bf16 | WeightFormat::Fp8Block | WeightFormat::Fp8Channel => Some(2),
        WeightFormat::Mxfp8 if folds => Some(2),
        _ => None,
    }
}

/// Clear the C tiles.
///
/// # Safety
/// As [`step`].
#[inline(always)]
unsafe fn zero_c<T: TileOps>(t: &mut T, two: bool) {
    // SAFETY: the caller's contract.
    unsafe {
        t.zero::<0>();
        t.zero::<1>();
        if two {
            t.zero::<2>();
            t.zero::<3>();
        }
    }
}

/// One 64-byte K step: B6, B7 from `b` (`b + half`), A4, A5 from `a` (`a + 16·stride`).
///
/// # Safety
/// As [`TileOps`], with the tiles configured by [`TileOps::config`]; `two`: the second token half is.
#[inline(always)]
pub(crate) unsafe fn step<T: TileOps, const OP: u8>(
    t: &mut T,
    (a, a_stride): (*const u8, usize),
    (b, half, b_stride): (*const u8, usize, usize),
    two: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        t.load::<4>(a, a_stride);
        t.load::<6>(b, b_stride);
        t.load::<7>(b.add(half), b_stride);
        dp::<T, OP, 0, 4, 6>(t);
        dp::<T, OP, 1, 4, 7>(t);
        if two {
            t.load::<5>(a.add(ROWS * a_stride), a_stride);
            dp::<T, OP, 2, 5, 6>(t);
            dp::<T, OP, 3, 5, 7>(t);
        }
    }
}

/// `C += A · B` by the product `OP` names ([`US8`], [`SS8`], [`BF16`]).
///
/// # Safety
/// As [`TileOps`].
#[inline(always)]
unsafe fn dp<T: TileOps, const OP: u8, const C: u8, const A: u8, const B: u8>(t: &mut T) {
    // SAFETY: the caller's contract.
    unsafe {
        match OP {
            BF16 => t.dpbf16ps::<C, A, B>(),
            SS8 => t.dpbssd::<C, A, B>(),
            _ => t.dpbusd::<C, A, B>(),
        }
    }
}

/// Store the C tiles into `c` (`[token][row]`, i32 or f32 values).
///
/// # Safety
/// As [`step`].
#[inline(always)]
pub(crate) unsafe fn store_c<T: TileOps, V>(t: &mut T, c: &mut [[V; PANEL]; MAX_RUN], two: bool) {
    const { assert!(size_of::<V>() == 4) };
    let stride = 4 * PANEL;
    let p = c.as_mut_ptr().cast::<u8>();
    // SAFETY: `c` holds 32 rows of 32 values: each tile's 16 × 64 bytes fit at its corner.
    unsafe {
        t.store::<0>(p, stride);
        t.store::<1>(p.add(4 * HALF), stride);
        if two {
            t.store::<2>(p.add(ROWS * stride), stride);
            t.store::<3>(p.add(ROWS * stride + 4 * HALF), stride);
        }
    }
}

/// Decoded B tiles of one step: KT int4's four ([`unpack_int4`]), or one per half `HALF_B`
/// bytes apart (64-byte rows) for the K-group and fp8 kinds.
#[repr(C, align(64))]
struct BTiles([u8; 2 * KT_TILE]);

/// A task's buffers for a [`TileRun`], kept across its blocks (zeroing 4 KB per block showed
/// as 2% of a forward's samples).
#[repr(C, align(64))]
pub struct Work {
    /// The C tiles as stored, `[token][row]`.
    c: [[u32; PANEL]; MAX_RUN],
    /// Decoded B tiles.
    b: BTiles,
}

impl Default for Work {
    fn default() -> Self {
        Work { c: [[0; PANEL]; MAX_RUN], b: BTiles([0; 2 * KT_TILE]) }
    }
}

/// Bytes of one half's B tile.
const HALF_B: usize = ROWS * COLSB;

/// Units `u0..u0+n` (n ≤ 8) of a K-group int4 panel as int8 B tiles: unit `j`'s half `h` as
/// rows `2j` (low nibbles) and `2j + 1` (high nibbles) of half `h`'s tile, each nibble through
/// the format's table.
///
/// # Safety
/// AVX-512F/BW are present; `panel` holds `u0 + n` units.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_group(panel: *const u8, u0: usize, n: usize, lut: &[i8; 16], dst: &mut BTiles) {
    use core::arch::x86_64::*;
    debug_assert!(n <= STEP_UNITS);
    // SAFETY: the caller's contract; 128·n ≤ HALF_B bytes per half of `dst`.
    unsafe {
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(lut.as_ptr().cast()));
        let low = _mm512_set1_epi8(0x0F);
        for j in 0..n {
            for h in 0..2 {
                let v = _mm512_loadu_si512(panel.add((u0 + j) * UNIT + 64 * h).cast());
                let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low));
                let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
                let d = dst.0.as_mut_ptr().add(h * HALF_B + 2 * j * COLSB);
                _mm512_storeu_si512(d.cast(), lo);
                _mm512_storeu_si512(d.add(COLSB).cast(), hi);
            }
        }
    }
}

/// `out[t][r] += c[t][r] · (sa(t) · sw[r])`, one fused multiply-add, as the AVX-512 kernels
/// add up K-groups; `c` holds i32 sums (`INT`) or f32 ones.
///
/// # Safety
/// AVX-512F is present.
#[target_feature(enable = "avx512f")]
unsafe fn add_scaled<const INT: bool>(
    out: &mut Acc,
    c: &[[u32; PANEL]; MAX_RUN],
    nt: usize,
    sw: &[f32; PANEL],
    sa: impl Fn(usize) -> f32,
) {
    use core::arch::x86_64::*;
    // SAFETY: every row holds PANEL = 2·16 values.
    unsafe {
        for t in 0..nt {
            let a = _mm512_set1_ps(sa(t));
            for h in 0..2 {
                let at = h * HALF;
                let c = _mm512_loadu_si512(c[t].as_ptr().add(at).cast());
                let sum = if INT { _mm512_cvtepi32_ps(c) } else { _mm512_castsi512_ps(c) };
                let s = _mm512_mul_ps(a, _mm512_loadu_ps(sw.as_ptr().add(at)));
                let o = out[t].as_mut_ptr().add(at);
                _mm512_storeu_ps(o, _mm512_fmadd_ps(sum, s, _mm512_loadu_ps(o)));
            }
        }
    }
}

/// [`unpack_int4`] a byte at a time: the definition the tests hold it to.
#[cfg(test)]
fn unpack_int4_scalar(src: &[u8], dst: &mut [u8; 2 * KT_TILE]) {
    for (i, &b) in src[..KT_TILE].iter().enumerate() {
        dst[i] = ((b << 4) as i8 >> 4) as u8;
        dst[KT_TILE + i] = (b as i8 >> 4) as u8;
    }
}

/// KT int4's 2048-byte tile as four int8 B tiles `[low half 0, low half 1, high 0, high 1]`:
/// each nibble's two's-complement value, 64 bytes at a time through a `vpshufb` table of the
/// 16 values.
///
/// # Safety
/// AVX-512F/BW are present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_int4(src: &[u8], dst: &mut [u8; 2 * KT_TILE]) {
    use core::arch::x86_64::*;
    assert!(src.len() >= KT_TILE);
    let table = kt_x86::int4::nibble_table(WeightFormat::Int4Row);
    // SAFETY: 16 readable bytes; i + 64 ≤ KT_TILE bytes of `src` (asserted) and of each half
    // of `dst`.
    unsafe {
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr().cast()));
        let low = _mm512_set1_epi8(0x0F);
        for i in (0..KT_TILE).step_by(64) {
            let v = _mm512_loadu_si512(src.as_ptr().add(i).cast());
            let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low));
            let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
            _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), lo);
            _mm512_storeu_si512(dst.as_mut_ptr().add(KT_TILE + i).cast(), hi);
        }
    }
}

/// A token block of a tile kernel: tokens `t0..t0 + nt` (nt ≤ [`MAX_RUN`]), and its share of
/// the next panel's bytes to bring into L2 (share `share.0` of `share.1`).
#[derive(Clone, Copy, Debug)]
pub struct Block {
    /// First token.
    pub t0: usize,
    /// Tokens.
    pub nt: usize,
    /// Which share of the next panel's prefetch this block does, of how many.
    pub share: (usize, usize),
}

/// A tile kernel: block `b`'s tokens × panel `p` of `w` into `out[..b.nt]`, with `work`'s
/// buffers, bringing its share of the next panel's bytes into L2 a line or so a K step: the
/// callers take every token block of a group before the next panel, so the weights stream from
/// DRAM once a group, behind the tiles. Which one a matrix runs is chosen once, when it is
/// packed ([`tile_kernel`]).
///
/// # Safety
/// `t`'s CPU contract ([`TileOps`]) and AVX-512F/BW/VBMI; `w` the matrix the kernel was chosen
/// for; `act` prepared by the AVX-512 kernels at their bf16 level for `w`'s format and K, with
/// at least `b.t0 + b.nt` rows.
pub type TileRun<T> = unsafe fn(&mut T, &Packed, usize, &Act<'_>, Block, &mut Work, &mut Acc);

/// The tile kernel of `w`, where tiles run it ([`runs`]).
pub fn tile_kernel<T: TileOps>(w: &Packed) -> Option<TileRun<T>> {
    if !runs(w) {
        return None;
    }
    Some(match w.format {
        WeightFormat::Bf16 => tile_run::<T, PATH_BF16>,
        WeightFormat::Int8Row => tile_run::<T, PATH_INT8>,
        WeightFormat::Int4Row => tile_run::<T, PATH_INT4>,
        WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 => tile_run::<T, PATH_GROUP>,
        WeightFormat::Fp8Block | WeightFormat::Fp8Channel | WeightFormat::Mxfp8 => tile_run::<T, PATH_FP8>,
        _ => return None,
    })
}

/// The tile paths: bf16's whole-K sums, stored as the results; per-row int8's and KT int4's
/// whole-K integer sums, then scaled ([`epilogue`]); the K-group kinds' ([`group_block`]); the
/// fp8 kinds' on bf16 activations ([`fp8_block`]).
const PATH_BF16: u8 = 0;
const PATH_INT8: u8 = 1;
const PATH_INT4: u8 = 2;
const PATH_GROUP: u8 = 3;
const PATH_FP8: u8 = 4;

/// [`TileRun`] of the path `PATH`, chosen when it is compiled.
///
/// # Safety
/// As [`TileRun`], for a `w` of `PATH`.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_run<T: TileOps, const PATH: u8>(
    t: &mut T,
    w: &Packed,
    p: usize,
    act: &Act<'_>,
    b: Block,
    work: &mut Work,
    out: &mut Acc,
) {
    debug_assert!((1..=MAX_RUN).contains(&b.nt));
    // SAFETY: the caller's contract.
    unsafe {
        match PATH {
            PATH_BF16 => whole_block::<T, f32, PATH>(t, w, p, act, b, &mut work.b, out),
            PATH_INT8 | PATH_INT4 => {
                whole_block::<T, u32, PATH>(t, w, p, act, b, &mut work.b, &mut work.c);
                epilogue(w, p, act, b.t0, b.nt, &work.c, out);
            }
            PATH_GROUP => {
                let sa = |tok: usize, g: usize| act.scales[(b.t0 + tok) * act.groups + g];
                group_block(t, w, p, (act.q[b.t0 * act.kp..].as_ptr(), act.kp), sa, b, work, out)
            }
            _ => fp8_block(t, w, p, (act.x16[b.t0 * act.kp..].as_ptr().cast(), 2 * act.kp), b, work, out),
        }
    }
}

/// Run `s` of the panel after `p` (its bytes of the same K as run `s` of `p`), which the work
/// on `p` prefetches into L2 ([`Prefetch`]); empty after the last panel.
fn next_run(w: &Packed, p: usize, s: usize) -> &[u8] {
    if (p + 1) * PANEL >= w.rows {
        return &[];
    }
    let Some((at, units)) = w.run(p + 1, s) else { return &[] };
    // A run is `units` units of UNIT bytes (panel order: the whole panel; KT's order: its K
    // block's tiles of 16 units), cut at the end of the data.
    let data = w.data.as_slice();
    let start = at as usize - data.as_ptr() as usize;
    &data[start..(start + units.len() * UNIT).min(data.len())]
}

/// A block's share of a run of the next panel ([`next_run`]), brought into L2 a part a K step.
struct Prefetch<'a> {
    next: &'a [u8],
    /// The block's first part, and the parts of the run.
    first: usize,
    parts: usize,
}

impl<'a> Prefetch<'a> {
    /// Block `b`'s share of `next`, over `steps` K steps.
    fn new(next: &'a [u8], b: Block, steps: usize) -> Self {
        Prefetch { next, first: b.share.0 * steps, parts: b.share.1 * steps }
    }

    /// Step `j`'s part.
    #[inline(always)]
    fn step(&self, j: usize) {
        share_to_l2(self.next, self.first + j, self.parts);
    }
}

/// bf16, per-row int8 and KT's int4 (`PATH`): the block's sums over the whole K into `c`
/// (i32, or f32 for bf16), with `b` for int4's unpacked tiles.
///
/// # Safety
/// As [`TileRun`], for a `w` of `PATH`.
#[allow(clippy::too_many_arguments)]
unsafe fn whole_block<T: TileOps, V, const PATH: u8>(
    t: &mut T,
    w: &Packed,
    p: usize,
    act: &Act<'_>,
    blk: Block,
    b: &mut BTiles,
    c: &mut [[V; PANEL]; MAX_RUN],
) {
    let (Block { t0, nt, .. }, kp) = (blk, act.kp);
    let two = nt > ROWS;
    // SAFETY: the caller's contract; every address below lies in the panel's runs and the
    // activation rows t0..t0+nt (the second half only when `two`).
    unsafe {
        t.config(&TileConfig::block(nt, COLSB));
        zero_c(t, two);
        match PATH {
            PATH_BF16 => {
                let (a, stride) = (act.x16[t0 * kp..].as_ptr().cast::<u8>(), 2 * kp);
                let (panel, steps) = (w.panel(p).as_ptr(), w.units / ROWS);
                let next = Prefetch::new(next_run(w, p, 0), blk, steps);
                for j in 0..steps {
                    next.step(j);
                    let b = (panel.add(j * ROWS * UNIT), 64, UNIT);
                    step::<T, BF16>(t, (a.add(j * COLSB), stride), b, two);
                }
            }
            PATH_INT8 => {
                let a = act.q[t0 * kp..].as_ptr();
                let mut s = 0;
                while let Some((run, units)) = w.run(p, s) {
                    let steps = units.len() / ROWS;
                    let next = Prefetch::new(next_run(w, p, s), blk, steps);
                    for j in 0..steps {
                        next.step(j);
                        let k = 4 * units.start + j * COLSB;
                        let b = match w.kt {
                            true => (run.add(j * KT_TILE), KT_TILE / 2, COLSB),
                            false => (run.add(j * ROWS * UNIT), 64, UNIT),
                        };
                        step::<T, US8>(t, (a.add(k), kp), b, two);
                    }
                    s += 1;
                }
            }
            _ => {
                let a = act.q[t0 * kp..].as_ptr();
                let mut s = 0;
                while let Some((run, units)) = w.run(p, s) {
                    let steps = units.len() / ROWS;
                    let next = Prefetch::new(next_run(w, p, s), blk, steps);
                    for j in 0..steps {
                        next.step(j);
                        let k = 8 * units.start + j * 2 * COLSB;
                        unpack_int4(core::slice::from_raw_parts(run.add(j * KT_TILE), KT_TILE), &mut b.0);
                        step::<T, US8>(t, (a.add(k), kp), (b.0.as_ptr(), KT_TILE / 2, COLSB), two);
                        step::<T, US8>(t, (a.add(k + COLSB), kp), (b.0[KT_TILE..].as_ptr(), KT_TILE / 2, COLSB), two);
                    }
                    s += 1;
                }
            }
        }
        store_c(t, c, two);
    }
}

/// K-group int4 and mxfp4: each group's integer sums stored and added, scaled, into `out`.
///
/// # Safety
/// As [`TileRun`]; `a` the block's first activation row, rows `stride` bytes apart.
#[allow(clippy::too_many_arguments)]
unsafe fn group_block<T: TileOps>(
    t: &mut T,
    w: &Packed,
    p: usize,
    (a, stride): (*const u8, usize),
    sa: impl Fn(usize, usize) -> f32,
    b: Block,
    work: &mut Work,
    out: &mut Acc,
) {
    let (nt, two) = (b.nt, b.nt > ROWS);
    let upg = w.format.k_group().expect("a K-group format") / 8;
    let step_units = upg.min(STEP_UNITS);
    let lut = kt_x86::int4::nibble_table(w.format);
    let (panel, steps) = (w.panel(p).as_ptr(), w.units / step_units);
    let next = Prefetch::new(next_run(w, p, 0), b, steps);
    let groups = w.units / upg;
    out[..nt].iter_mut().for_each(|o| o.fill(0.0));
    // SAFETY: the caller's contract; the units g·upg.. of every group lie in the panel, and an
    // int8 activation row holds K = 8·units bytes.
    unsafe {
        t.config(&TileConfig::block(nt, 8 * step_units));
        for g in 0..groups {
            zero_c(t, two);
            for u in (g * upg..(g + 1) * upg).step_by(step_units) {
                next.step(u / step_units);
                unpack_group(panel, u, step_units, &lut, &mut work.b);
                step::<T, SS8>(t, (a.add(8 * u), stride), (work.b.0.as_ptr(), HALF_B, COLSB), two);
            }
            store_c(t, &mut work.c, two);
            let at = (p * groups + g) * PANEL;
            add_scaled::<true>(out, &work.c, nt, &group_scales_f32(w, at), |tok| sa(tok, g));
        }
    }
}

/// fp8 (128×128 blocks or per row) and mxfp8: each scale block's f32 sums stored and added,
/// scaled, into `out` (per-row scales: one block, multiplied); or, for mxfp8 whose scales fold
/// (`Packed::folds`), the scales in the decoded elements and the whole K summed in the C tiles,
/// which hold the results.
///
/// # Safety
/// As [`TileRun`]; `a` the block's first bf16 activation row, rows `stride` bytes apart.
#[allow(clippy::too_many_arguments)]
unsafe fn fp8_block<T: TileOps>(
    t: &mut T,
    w: &Packed,
    p: usize,
    (a, stride): (*const u8, usize),
    b: Block,
    work: &mut Work,
    out: &mut Acc,
) {
    let (nt, two) = (b.nt, b.nt > ROWS);
    // (units per scale block, scales per block: one for the panel or one per row)
    let (per_block, per_row) = match w.format {
        _ if w.folds => (w.units, false),
        WeightFormat::Fp8Channel => (w.units, true),
        WeightFormat::Mxfp8 => (MX_BLOCK / 4, true),
        _ => (FP8_BLOCK / 4, false),
    };
    let blocks = w.units.div_ceil(per_block);
    let (panel, steps) = (w.panel(p).as_ptr(), w.units / STEP_UNITS);
    let next = Prefetch::new(next_run(w, p, 0), b, steps);
    if !w.folds {
        out[..nt].iter_mut().for_each(|o| o.fill(0.0));
    }
    // SAFETY: the caller's contract; units % 8 == 0 (`runs`), so every step's 8 units lie in
    // the panel and its 32 K in the activation rows (2 bytes each); a step is an MX group, whose
    // 32 codes sit at `[panel][group]`.
    unsafe {
        t.config(&TileConfig::block(nt, COLSB));
        for blk in 0..blocks {
            zero_c(t, two);
            for u in (blk * per_block..((blk + 1) * per_block).min(w.units)).step_by(STEP_UNITS) {
                let j = u / STEP_UNITS;
                next.step(j);
                let fold = w.folds.then(|| (w.codes[(p * steps + j) * PANEL..].as_ptr(), w.code_bias));
                let dst = work.b.0.as_mut_ptr();
                kt_zmm::fp8_tile_rows(panel, u, u + STEP_UNITS, [dst, dst.add(HALF_B)], fold);
                step::<T, BF16>(t, (a.add(8 * u), stride), (work.b.0.as_ptr(), HALF_B, COLSB), two);
            }
            if w.folds {
                store_c(t, out, two);
                continue;
            }
            store_c(t, &mut work.c, two);
            let s: [f32; PANEL] = match per_row {
                true => group_scales_f32(w, (p * blocks + blk) * PANEL),
                false => [w.scales[p * blocks + blk]; PANEL],
            };
            add_scaled::<false>(out, &work.c, nt, &s, |_| 1.0);
        }
    }
}

/// Integer sums as results, `((Σ + bias) · s_act) · s_w` (two roundings, as the AVX-512
/// kernels), 16 rows at a time.
///
/// # Safety
/// AVX-512F is present; `act` is integer, with at least `t0 + nt` scales.
#[target_feature(enable = "avx512f")]
unsafe fn epilogue(
    w: &Packed,
    p: usize,
    act: &Act<'_>,
    t0: usize,
    nt: usize,
    c: &[[u32; PANEL]; MAX_RUN],
    out: &mut Acc,
) {
    use core::arch::x86_64::*;
    let scales = act.scales;
    let rows = p * PANEL..(p + 1) * PANEL;
    let (bias, sw) = (&w.bias[rows.clone()], &w.scales[rows]);
    // SAFETY: AVX-512F by the contract; every row of `c`, `out`, `bias` and `sw` holds
    // PANEL = 2·16 values.
    unsafe {
        for (tok, (o, c)) in out.iter_mut().zip(c).enumerate().take(nt) {
            let sa = _mm512_set1_ps(scales[t0 + tok]);
            for h in (0..PANEL).step_by(HALF) {
                let sum = _mm512_add_epi32(
                    _mm512_loadu_si512(c[h..].as_ptr().cast()),
                    _mm512_loadu_si512(bias[h..].as_ptr().cast()),
                );
                let x = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), sa), _mm512_loadu_ps(sw[h..].as_ptr()));
                _mm512_storeu_ps(o[h..].as_mut_ptr(), x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_unpack_gives_each_nibbles_value() {
        let src: Vec<u8> = (0..KT_TILE).map(|i| (i * 37 + i / 7) as u8).collect();
        let vector = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
        if !vector {
            kt_core::skip_isa!("AVX-512F/BW (the vector unpacking; the scalar one is checked)");
        }
        for vector in [false, vector] {
            let mut got = [0u8; 2 * KT_TILE];
            match vector {
                // SAFETY: AVX-512F/BW checked above.
                true => unsafe { unpack_int4(&src, &mut got) },
                false => unpack_int4_scalar(&src, &mut got),
            }
            for (i, &b) in src.iter().enumerate() {
                let lo = if b & 8 != 0 { (b & 15) as i8 - 16 } else { (b & 15) as i8 };
                let hi = if b & 0x80 != 0 { (b >> 4) as i8 - 16 } else { (b >> 4) as i8 };
                assert_eq!((got[i] as i8, got[KT_TILE + i] as i8), (lo, hi), "byte {i}: {b:#04x}");
            }
        }
    }
}
