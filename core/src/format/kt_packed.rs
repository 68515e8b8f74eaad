//! KT-Kernel's packed weight bytes for AMXINT8 / AMXINT4 (`BufferB` in `amx_buffers.hpp`), the
//! layout of its converted files: rows in N_BLOCK chunks (64 int8, 128 int4), each split into
//! K_BLOCK chunks (3584 K), each a run of 32-row × 64-byte tiles laid out consecutively; a tile
//! is two 16-row halves, each stored as the transpose of a 16×16 matrix of 32-bit words (VNNI:
//! 4 consecutive K bytes per word). int4 packs two values per byte inside each 128-K step: the
//! low nibble is k, the high nibble k + 64. Scales are one f32 per row, stored separately.
//!
//! ```text
//!  byte(r, b) = nb·Kb + kb·nb_size + n·kb_size + k·32          (tile start, b = byte column)
//!             + (r%32 / 16)·1024 + ((b%64)/4 · 16 + r%16)·4 + b%4
//! ```
//! with `nb`, `kb` the starts of the row and byte-column blocks, `n`, `k` the 32-row and 64-byte
//! tile starts inside them, `Kb` the bytes per row.

use alloc::vec;
use alloc::vec::Vec;

use super::{put_nibble, QuantMatrix, WeightFormat};
use crate::Error;

/// (rows per N block, bytes per K block) of KT's int8 and int4 kernels.
fn blocks(format: WeightFormat) -> Option<(usize, usize)> {
    match format {
        WeightFormat::Int8Row => Some((64, 3584)),
        WeightFormat::Int4Row => Some((128, 3584 / 2)),
        _ => None,
    }
}

/// Bytes of a packed `rows × cols` matrix, or the error naming the constraint KT's kernels
/// impose (rows % 32, cols % 64 for int8 / % 128 for int4).
pub fn packed_bytes(format: WeightFormat, rows: usize, cols: usize) -> Result<usize, Error> {
    let kmul = match format {
        WeightFormat::Int8Row => 64,
        WeightFormat::Int4Row => 128,
        _ => {
            let context = "in KT's packed files, which hold AMXINT8 (int8) and AMXINT4 (int4) only";
            return Err(Error::UnsupportedFormat { format, context });
        }
    };
    if rows % 32 != 0 {
        return Err(Error::FormatShape { format, what: "rows (KT packing)", value: rows, multiple: 32 });
    }
    if cols % kmul != 0 {
        return Err(Error::FormatShape { format, what: "columns (KT packing)", value: cols, multiple: kmul });
    }
    Ok(format.data_bytes(rows, cols))
}

/// Offset of byte column `b` of row `r` in a packed matrix of `rows` rows of `row_bytes`.
fn offset(r: usize, b: usize, rows: usize, row_bytes: usize, n_block: usize, k_block: usize) -> usize {
    let nb = r / n_block * n_block;
    let nb_size = n_block.min(rows - nb);
    let kb = b / k_block * k_block;
    let kb_size = k_block.min(row_bytes - kb);
    let n = (r - nb) / 32 * 32;
    let k = (b - kb) / 64 * 64;
    let tile = nb * row_bytes + kb * nb_size + n * kb_size + k * 32;
    tile + (r % 32 / 16) * 1024 + ((b % 64) / 4 * 16 + r % 16) * 4 + b % 4
}

/// Byte column and nibble (false = low) holding column `c` of an int4 row in KT's order.
fn int4_place(c: usize) -> (usize, bool) {
    (c / 128 * 64 + c % 64, c % 128 >= 64)
}

/// Row `r`'s bytes in KT's order before tiling: int8 as is; int4 with column k in the low
/// nibble and k + 64 in the high nibble of byte `(k/128)·64 + k%64`.
fn kt_row(format: WeightFormat, row: &[u8], cols: usize, out: &mut [u8]) {
    if format == WeightFormat::Int8Row {
        out.copy_from_slice(row);
        return;
    }
    // Each 128-column step: byte j = column j (low) | column j + 64 (high); logical bytes hold
    // columns 2m (low) and 2m + 1 (high).
    let nib = |c: usize| (row[c / 2] >> (4 * (c % 2))) & 0x0F;
    for (s, step) in out.chunks_exact_mut(64).enumerate() {
        let base = s * 128;
        for (j, o) in step.iter_mut().enumerate() {
            *o = nib(base + j) | nib(base + 64 + j) << 4;
        }
    }
    debug_assert_eq!(out.len() * 2, cols);
}

/// Visit every 4-byte word of a packed matrix: `f(row, byte column, packed offset)`. Words are
/// the unit of KT's transposition, so each is copied whole.
fn for_each_word(rows: usize, rb: usize, (nblk, kblk): (usize, usize), mut f: impl FnMut(usize, usize, usize)) {
    for r in 0..rows {
        for t in (0..rb).step_by(64) {
            let base = offset(r, t, rows, rb, nblk, kblk);
            for w in 0..16 {
                f(r, t + 4 * w, base + 64 * w);
            }
        }
    }
}

/// A `rows × cols` shape's bytes per row and (N block, K block). The shape must be one
/// [`packed_bytes`] accepts.
fn geometry(format: WeightFormat, rows: usize, cols: usize) -> (usize, (usize, usize)) {
    (format.data_bytes(rows, cols) / rows, blocks(format).expect("an int8 or int4 format"))
}

/// [`packed_bytes`] of the shape, with `data` checked to hold exactly that many.
pub fn checked_len(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Result<usize, Error> {
    let len = packed_bytes(format, rows, cols)?;
    if data.len() != len {
        return Err(Error::ShapeMismatch { what: "KT packed weight bytes", expected: len, found: data.len() });
    }
    Ok(len)
}

/// A per-row int8 or int4 matrix in KT's packed byte order.
pub fn to_kt(m: &QuantMatrix) -> Result<Vec<u8>, Error> {
    let (rows, cols, format) = (m.rows(), m.cols(), m.format());
    let len = packed_bytes(format, rows, cols)?;
    let rb = len / rows;
    let mut ordered = vec![0u8; len];
    for (r, out) in ordered.chunks_exact_mut(rb).enumerate() {
        kt_row(format, &m.data()[r * rb..(r + 1) * rb], cols, out);
    }
    let mut out = vec![0u8; len];
    for_each_word(rows, rb, blocks(format).expect("checked by packed_bytes"), |r, b, at| {
        out[at..at + 4].copy_from_slice(&ordered[r * rb + b..r * rb + b + 4]);
    });
    Ok(out)
}

/// Where column `c` of row `r` lives in a packed `rows × cols` matrix: (byte offset, whether
/// it is the high nibble). The shape must be one [`packed_bytes`] accepts.
pub fn position(format: WeightFormat, rows: usize, cols: usize, r: usize, c: usize) -> (usize, bool) {
    let (rb, (nblk, kblk)) = geometry(format, rows, cols);
    let (b, high) = if format == WeightFormat::Int4Row { int4_place(c) } else { (c, false) };
    (offset(r, b, rows, rb, nblk, kblk), high)
}

/// Run `s` of the 32-row tile at row `r0` (a multiple of 32): `(byte offset, byte columns)` of
/// its `s`-th K block, `None` past the last. Inside a run the 64-byte-column tiles follow each
/// other (2048 bytes each), so a kernel streams a run as one array. The shape must be one
/// [`packed_bytes`] accepts.
pub fn row_tile_run(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    r0: usize,
    s: usize,
) -> Option<(usize, core::ops::Range<usize>)> {
    let (rb, (nblk, kblk)) = geometry(format, rows, cols);
    let kb = s * kblk;
    (kb < rb).then(|| (offset(r0, kb, rows, rb, nblk, kblk), kb..(kb + kblk).min(rb)))
}

/// Σ of each row's signed weights (int4: the nibble's value n, not 16·n), read from packed
/// bytes: what a kernel that offsets activations to unsigned takes off.
pub fn row_sums(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Vec<i32> {
    let (rb, (nblk, kblk)) = geometry(format, rows, cols);
    let mut sums = vec![0i32; rows];
    for_each_word(rows, rb, (nblk, kblk), |r, _, at| {
        for &b in &data[at..at + 4] {
            sums[r] += if format == WeightFormat::Int4Row {
                i32::from((b << 4) as i8 >> 4) + i32::from(b as i8 >> 4)
            } else {
                i32::from(b as i8)
            };
        }
    });
    sums
}

/// The matrix stored in KT's packed bytes `data` with per-row `scales`.
pub fn from_kt(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: &[u8],
    scales: Vec<f32>,
) -> Result<QuantMatrix, Error> {
    let len = checked_len(format, rows, cols, data)?;
    let rb = len / rows;
    let mut ordered = vec![0u8; len];
    for_each_word(rows, rb, blocks(format).expect("checked by packed_bytes"), |r, b, at| {
        ordered[r * rb + b..r * rb + b + 4].copy_from_slice(&data[at..at + 4]);
    });
    if format == WeightFormat::Int4Row {
        let mut logical = vec![0u8; len];
        for (src, row) in ordered.chunks_exact(rb).zip(logical.chunks_exact_mut(rb)) {
            for c in 0..cols {
                let (b, high) = int4_place(c);
                put_nibble(row, c, if high { src[b] >> 4 } else { src[b] & 0x0F });
            }
        }
        ordered = logical;
    }
    QuantMatrix::from_parts(format, rows, cols, ordered, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
        let mut r = SplitMix64::new(seed);
        let x: Vec<f32> = (0..rows * cols).map(|_| r.next_f32() - 0.5).collect();
        QuantMatrix::quantize(format, rows, cols, &x).unwrap()
    }

    #[test]
    fn round_trips_across_block_edges() {
        // 7168 columns cross a K_BLOCK; 96 and 160 rows end in partial N blocks.
        for (format, rows, cols) in [
            (WeightFormat::Int8Row, 96, 7168),
            (WeightFormat::Int8Row, 32, 64),
            (WeightFormat::Int4Row, 160, 7168),
            (WeightFormat::Int4Row, 32, 128),
        ] {
            let m = random(format, rows, cols, rows as u64);
            let packed = to_kt(&m).unwrap();
            assert_eq!(packed.len(), packed_bytes(format, rows, cols).unwrap());
            let back = from_kt(format, rows, cols, &packed, m.scales().to_vec()).unwrap();
            assert_eq!(back, m, "{format} {rows}x{cols}");
        }
    }

    #[test]
    fn byte_positions_follow_kts_formula() {
        // Within the first tile: row r, K byte b lands at word (b/4)*16 + r of its half.
        let (rows, rb) = (64, 128);
        assert_eq!(offset(0, 0, rows, rb, 64, 3584), 0);
        assert_eq!(offset(1, 0, rows, rb, 64, 3584), 4);
        assert_eq!(offset(0, 4, rows, rb, 64, 3584), 64);
        assert_eq!(offset(16, 0, rows, rb, 64, 3584), 1024);
        assert_eq!(offset(0, 64, rows, rb, 64, 3584), 64 * 32, "second K tile follows the first");
        assert_eq!(offset(32, 0, rows, rb, 64, 3584), 32 * rb, "second row tile after all K tiles");
        // Second K block of 3584 bytes: after the whole first block of this N block.
        assert_eq!(offset(0, 3584, 64, 4096, 64, 3584), 3584 * 64);
        // int4: column 64 is the high nibble of byte column 0, column 128 starts byte column 64.
        assert_eq!(int4_place(64), (0, true));
        assert_eq!(int4_place(128), (64, false));
        assert_eq!(int4_place(200), (72, true));
    }

    #[test]
    fn positions_runs_and_sums_agree_with_the_packed_bytes() {
        for (format, rows, cols) in [(WeightFormat::Int8Row, 96, 7168), (WeightFormat::Int4Row, 160, 7424)] {
            let m = random(format, rows, cols, 5);
            let packed = to_kt(&m).unwrap();
            let deq = m.dequantize();
            let mut sums = vec![0i32; rows];
            for r in 0..rows {
                for c in 0..cols {
                    let (at, high) = position(format, rows, cols, r, c);
                    let w = match (format, high) {
                        (WeightFormat::Int8Row, _) => packed[at] as i8,
                        (_, false) => (packed[at] << 4) as i8 >> 4,
                        (_, true) => packed[at] as i8 >> 4,
                    };
                    let unit = if format == WeightFormat::Int4Row { 16.0 } else { 1.0 };
                    assert_eq!(f32::from(w) * unit * m.scales()[r], deq[r * cols + c], "{format} r{r} c{c}");
                    sums[r] += i32::from(w);
                }
            }
            assert_eq!(row_sums(format, rows, cols, &packed), sums);
            // A tile's runs cover its K once, each run's first byte being row r0's first.
            for r0 in (0..rows).step_by(32) {
                let runs: Vec<_> = (0..).map_while(|s| row_tile_run(format, rows, cols, r0, s)).collect();
                assert_eq!(runs.iter().map(|(_, k)| k.len()).sum::<usize>(), packed.len() / rows);
                for (at, k) in runs {
                    let c = if format == WeightFormat::Int4Row { k.start / 64 * 128 } else { k.start };
                    assert_eq!(position(format, rows, cols, r0, c).0, at);
                }
            }
        }
    }

    #[test]
    fn shapes_kt_cannot_pack_are_errors() {
        assert!(packed_bytes(WeightFormat::Int8Row, 33, 64).is_err());
        assert!(packed_bytes(WeightFormat::Int4Row, 32, 64).is_err());
        assert!(packed_bytes(WeightFormat::Bf16, 32, 64).is_err());
        assert!(from_kt(WeightFormat::Int8Row, 32, 64, &[0; 10], vec![1.0; 32]).is_err());
    }
}
