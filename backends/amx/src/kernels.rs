//! The tile kernels: a block of up to [`MAX_TOKENS`] tokens × one 32-row panel, over the whole
//! K, on the AVX-512 backend's packed bytes (`kt_backend_avx512::pack`) and prepared
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
//! ```
//!
//! Integer tiles multiply the int8 + 128 activations (`tdpbusd`: unsigned × signed) and take
//! off 128·Σw after, then scale as the AVX-512 kernels do, `((Σ + bias) · s_act) · s_w`: the
//! sums are exact, so the results are theirs bit for bit.

use kt_backend_avx512::act::Act;
use kt_backend_avx512::pack::{Packed, HALF, KT_TILE, PANEL, UNIT};
use kt_core::WeightFormat;

use crate::tile::{TileConfig, TileOps, COLSB, ROWS};

/// Most tokens in one block: two A tiles of 16 rows.
pub const MAX_TOKENS: usize = 2 * ROWS;

/// Results of a block: `[token][row in panel]`.
pub type Block = [[f32; PANEL]; MAX_TOKENS];

/// Whether the tile kernels run `w`: int8 whose K is whole tiles (64 bytes), KT's int4, and
/// bf16 whose K is whole tiles (32 values). The other formats run on the AVX-512 kernels.
pub fn runs(w: &Packed) -> bool {
    match w.format {
        WeightFormat::Int8Row | WeightFormat::Bf16 => w.kt || w.units % ROWS == 0,
        WeightFormat::Int4Row => w.kt,
        _ => false,
    }
}

/// The tiles' shapes for a block of `nt` tokens: A and C rows are the tokens of each half.
pub(crate) fn config(nt: usize) -> TileConfig {
    let (r0, r1) = (nt.min(ROWS), nt.saturating_sub(ROWS));
    let c = TileConfig::new().with(0, r0, COLSB).with(1, r0, COLSB).with(4, r0, COLSB);
    let c = c.with(6, ROWS, COLSB).with(7, ROWS, COLSB);
    match r1 {
        0 => c,
        _ => c.with(2, r1, COLSB).with(3, r1, COLSB).with(5, r1, COLSB),
    }
}

/// One 64-byte K step: B6, B7 from `b` (`b + half`), A4, A5 from `a` (`a + 16·stride`).
///
/// # Safety
/// As [`TileOps`], with the tiles configured by [`config`]; `two`: the second token half is.
#[inline(always)]
pub(crate) unsafe fn step<T: TileOps, const BF16: bool>(
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
        if BF16 {
            t.dpbf16ps::<0, 4, 6>();
            t.dpbf16ps::<1, 4, 7>();
        } else {
            t.dpbusd::<0, 4, 6>();
            t.dpbusd::<1, 4, 7>();
        }
        if two {
            t.load::<5>(a.add(ROWS * a_stride), a_stride);
            if BF16 {
                t.dpbf16ps::<2, 5, 6>();
                t.dpbf16ps::<3, 5, 7>();
            } else {
                t.dpbusd::<2, 5, 6>();
                t.dpbusd::<3, 5, 7>();
            }
        }
    }
}

/// Store the C tiles into `c` (`[token][row]`, 4-byte values).
///
/// # Safety
/// As [`step`].
#[inline(always)]
pub(crate) unsafe fn store_c<T: TileOps>(t: &mut T, c: &mut [[u32; PANEL]; MAX_TOKENS], two: bool) {
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

/// KT int4's 2048-byte tile as four int8 B tiles `[low half 0, low half 1, high 0, high 1]`:
/// each nibble's two's-complement value.
fn unpack_int4(src: &[u8], dst: &mut [u8; 2 * KT_TILE]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512BW checked; `src` holds a tile (asserted inside).
        return unsafe { unpack_int4_avx512(src, dst) };
    }
    unpack_int4_scalar(src, dst)
}

/// [`unpack_int4`] a byte at a time (CPUs without AVX-512BW: the emulator's tests there).
fn unpack_int4_scalar(src: &[u8], dst: &mut [u8; 2 * KT_TILE]) {
    for (i, &b) in src[..KT_TILE].iter().enumerate() {
        dst[i] = ((b << 4) as i8 >> 4) as u8;
        dst[KT_TILE + i] = (b as i8 >> 4) as u8;
    }
}

/// [`unpack_int4`] 64 bytes at a time: each nibble through a `vpshufb` table of the 16 values.
///
/// # Safety
/// AVX-512F/BW are present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_int4_avx512(src: &[u8], dst: &mut [u8; 2 * KT_TILE]) {
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

/// Tokens `t0..t0+nt` (nt ≤ [`MAX_TOKENS`]) × panel `p` of `w` into `out[..nt]`.
///
/// # Safety
/// `t`'s CPU contract ([`TileOps`]); [`runs`]`(w)`; `act` prepared by the AVX-512 backend at
/// its bf16 level for `w`'s format and K, with at least `t0 + nt` rows.
pub unsafe fn panel_block<T: TileOps>(
    t: &mut T,
    w: &Packed,
    p: usize,
    act: &Act<'_>,
    t0: usize,
    nt: usize,
    out: &mut Block,
) {
    debug_assert!(runs(w) && (1..=MAX_TOKENS).contains(&nt));
    let two = nt > ROWS;
    let mut c = [[0u32; PANEL]; MAX_TOKENS];
    // SAFETY: the caller's contract; every address below lies in the panel's runs and the
    // activation rows t0..t0+nt (the second half only when `two`).
    unsafe {
        t.config(&config(nt));
        t.zero::<0>();
        t.zero::<1>();
        if two {
            t.zero::<2>();
            t.zero::<3>();
        }
        match (act, w.format) {
            (&Act::Float { x16, kp, .. }, _) => {
                let (a, stride) = (x16[t0 * kp..].as_ptr().cast::<u8>(), 2 * kp);
                let panel = w.panel(p).as_ptr();
                for j in 0..w.units / ROWS {
                    let b = (panel.add(j * ROWS * UNIT), 64, UNIT);
                    step::<T, true>(t, (a.add(j * COLSB), stride), b, two);
                }
            }
            (&Act::Int { q, kp, .. }, WeightFormat::Int8Row) => {
                let a = q[t0 * kp..].as_ptr();
                let mut s = 0;
                while let Some((run, units)) = w.run(p, s) {
                    for j in 0..units.len() / ROWS {
                        let k = 4 * units.start + j * COLSB;
                        let b = match w.kt {
                            true => (run.add(j * KT_TILE), KT_TILE / 2, COLSB),
                            false => (run.add(j * ROWS * UNIT), 64, UNIT),
                        };
                        step::<T, false>(t, (a.add(k), kp), b, two);
                    }
                    s += 1;
                }
            }
            (&Act::Int { q, kp, .. }, _) => {
                let a = q[t0 * kp..].as_ptr();
                let mut b = [0u8; 2 * KT_TILE];
                let mut s = 0;
                while let Some((run, units)) = w.run(p, s) {
                    for j in 0..units.len() / ROWS {
                        let k = 8 * units.start + j * 2 * COLSB;
                        unpack_int4(core::slice::from_raw_parts(run.add(j * KT_TILE), KT_TILE), &mut b);
                        step::<T, false>(t, (a.add(k), kp), (b.as_ptr(), KT_TILE / 2, COLSB), two);
                        step::<T, false>(t, (a.add(k + COLSB), kp), (b[KT_TILE..].as_ptr(), KT_TILE / 2, COLSB), two);
                    }
                    s += 1;
                }
            }
        }
        store_c(t, &mut c, two);
    }
    epilogue(w, p, act, t0, nt, &c, out);
}

/// The block's sums as results: f32 as they are, integers `((Σ + bias) · s_act) · s_w`.
fn epilogue(
    w: &Packed,
    p: usize,
    act: &Act<'_>,
    t0: usize,
    nt: usize,
    c: &[[u32; PANEL]; MAX_TOKENS],
    out: &mut Block,
) {
    let rows = p * PANEL..(p + 1) * PANEL;
    for (tok, (o, c)) in out.iter_mut().zip(c).enumerate().take(nt) {
        match act {
            Act::Float { .. } => {
                for (o, &c) in o.iter_mut().zip(c) {
                    *o = f32::from_bits(c);
                }
            }
            &Act::Int { scales, .. } => {
                let sa = scales[t0 + tok];
                let (bias, sw) = (&w.bias[rows.clone()], &w.scales[rows.clone()]);
                for (((o, &c), &b), &s) in o.iter_mut().zip(c).zip(bias).zip(sw) {
                    *o = ((c as i32).wrapping_add(b) as f32 * sa) * s;
                }
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
        // Whichever branch this CPU takes, and the scalar one.
        for unpack in [unpack_int4, unpack_int4_scalar] {
            let mut got = [0u8; 2 * KT_TILE];
            unpack(&src, &mut got);
            for (i, &b) in src.iter().enumerate() {
                let lo = if b & 8 != 0 { (b & 15) as i8 - 16 } else { (b & 15) as i8 };
                let hi = if b & 0x80 != 0 { (b >> 4) as i8 - 16 } else { (b >> 4) as i8 };
                assert_eq!((got[i] as i8, got[KT_TILE + i] as i8), (lo, hi), "byte {i}: {b:#04x}");
            }
        }
    }
}
