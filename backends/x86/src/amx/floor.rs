//! [`Floor`]: tiles whose products do nothing, for measuring on a CPU without AMX what a tile
//! path costs besides the tile products (decoding B tiles, preparing activations, the
//! epilogues, the memory traffic of the tile loads and stores), as the `tile-floor` feature's
//! hardware tiles. Loads read every byte of their rows (so the weights still stream from
//! DRAM), stores write theirs; the results are wrong.

// Built only where build.rs found rustc ≥ 1.89 (the 512-bit intrinsics).
#![allow(clippy::incompatible_msrv)]

use core::arch::x86_64::*;

use super::{TileConfig, TileOps, Tiles};

/// The floor's tiles: the configuration (loads and stores move the configured rows) and a
/// sink the loaded bytes fold into (so the loads are not optimized away).
#[derive(Clone, Copy, Debug, Default)]
pub struct Floor {
    cfg: TileConfig,
    sink: u64,
}

/// XOR of `rows` rows of `colsb` bytes at `p`, `stride` apart.
///
/// # Safety
/// AVX-512F/BW present; the rows readable.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn read(p: *const u8, stride: usize, rows: usize, colsb: usize) -> u64 {
    let mask = crate::copy::first_bytes(colsb);
    // SAFETY: the caller's contract; masked loads touch only the row's `colsb` bytes.
    unsafe {
        let mut x = _mm512_setzero_si512();
        for r in 0..rows {
            x = _mm512_xor_si512(x, _mm512_maskz_loadu_epi8(mask, p.add(r * stride).cast()));
        }
        _mm_cvtsi128_si64(_mm512_castsi512_si128(x)) as u64
    }
}

/// `rows` rows of `colsb` bytes at `p`, `stride` apart, set to `v`'s bytes.
///
/// # Safety
/// AVX-512F/BW present; the rows writable.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn write(p: *mut u8, stride: usize, rows: usize, colsb: usize, v: u64) {
    let mask = crate::copy::first_bytes(colsb);
    // SAFETY: the caller's contract; masked stores touch only the row's `colsb` bytes.
    unsafe {
        let v = _mm512_set1_epi64(v as i64);
        for r in 0..rows {
            // A whole row unmasked, as `tilestored` costs: a full-mask masked store is slower
            // (Zen 5, `kt_x86::copy`).
            match mask {
                u64::MAX => _mm512_storeu_si512(p.add(r * stride).cast(), v),
                _ => _mm512_mask_storeu_epi8(p.add(r * stride).cast(), mask, v),
            }
        }
    }
}

impl TileOps for Floor {
    #[inline(always)]
    unsafe fn config(&mut self, cfg: &TileConfig) {
        self.cfg = *cfg;
    }

    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {}

    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
        let (rows, colsb) = (self.cfg.rows(usize::from(T)), self.cfg.colsb(usize::from(T)));
        // SAFETY: AVX-512BW (`available`) and the rows (the trait's contract).
        self.sink ^= unsafe { read(p, stride, rows, colsb) };
    }

    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
        let (rows, colsb) = (self.cfg.rows(usize::from(T)), self.cfg.colsb(usize::from(T)));
        // SAFETY: as in `load`.
        unsafe { write(p, stride, rows, colsb, self.sink) };
    }

    #[inline(always)]
    unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self) {}

    #[inline(always)]
    unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self) {}

    #[inline(always)]
    unsafe fn dpbf16ps<const C: u8, const A: u8, const B: u8>(&mut self) {}
}

impl Tiles for Floor {
    fn available() -> Result<(), &'static str> {
        match is_x86_feature_detected!("avx512bw") {
            true => Ok(()),
            false => Err("AVX-512BW (the tile floor's loads)"),
        }
    }
}
