//! `QuantMatrix`: one expert matrix `[rows, cols]` (out × in) in a format's canonical layout.

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use super::{bf16, fp8_block, fp8_channel, int4_group, int4_row, int8_row, mx, Scales, WeightFormat, FP8_BLOCK};
use crate::{ggml, Error};

/// A quantized matrix in the canonical layout of its format: row-major element data (nibbles
/// packed low = even column) and f32 scales (values exact in the format's scale type).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    scales: Vec<f32>,
}

impl QuantMatrix {
    /// Quantize a row-major f32 matrix with absmax scales (KT's bytes). Non-finite values and
    /// |x| > [`super::MAX_ABS`] are refused: no format here encodes them, and scales near
    /// f32::MAX would overflow.
    pub fn quantize(format: WeightFormat, rows: usize, cols: usize, src: &[f32]) -> Result<Self, Error> {
        Self::quantize_with(format, Scales::Absmax, rows, cols, src)
    }

    /// [`QuantMatrix::quantize`] with each scale chosen by `scales` ([`Scales::check`]).
    pub fn quantize_with(
        format: WeightFormat,
        scales: Scales,
        rows: usize,
        cols: usize,
        src: &[f32],
    ) -> Result<Self, Error> {
        scales.check(format)?;
        if src.len() != rows * cols {
            return Err(Error::ShapeMismatch { what: "weight matrix", expected: rows * cols, found: src.len() });
        }
        if cols % format.col_multiple() != 0 {
            return Err(Error::FormatShape { format, what: "columns", value: cols, multiple: format.col_multiple() });
        }
        // One branch-free pass (NaN fails `<=`), and a search only when it fails.
        if !src.iter().fold(true, |ok, x| ok & (x.abs() <= super::MAX_ABS)) {
            let i = src.iter().position(|x| !x.is_finite() || x.abs() > super::MAX_ABS).unwrap_or(0);
            return Err(Error::NonFinite { what: "weight matrix", row: i / cols.max(1), col: i % cols.max(1) });
        }
        let (data, scales) = match format {
            WeightFormat::Bf16 => (bf16::quantize(src), Vec::new()),
            WeightFormat::Int8Row => int8_row::quantize(rows, cols, src, scales),
            WeightFormat::Int4Row => int4_row::quantize(rows, cols, src, scales),
            WeightFormat::Int4Group { group } => int4_group::quantize(rows, cols, usize::from(group), src, scales),
            WeightFormat::Fp8Block => fp8_block::quantize(rows, cols, src, scales),
            WeightFormat::Fp8Channel => fp8_channel::quantize(rows, cols, src, scales),
            WeightFormat::Mxfp4 => mx::quantize_fp4(rows, cols, src, scales),
            WeightFormat::Mxfp8 => mx::quantize_fp8(rows, cols, src, scales),
            WeightFormat::Ggml(t) => {
                let mut data = vec![0u8; format.data_bytes(rows, cols)];
                let rb = t.row_bytes(cols);
                for (x, o) in src.chunks_exact(cols.max(1)).zip(data.chunks_exact_mut(rb.max(1))) {
                    ggml::quantize_row(t, x, o).ok_or(Error::NoQuantizer { format })?;
                }
                (data, Vec::new())
            }
        };
        Ok(QuantMatrix { format, rows, cols, data, scales })
    }

    /// Wrap already-quantized data (a loaded file), checking every length.
    pub fn from_parts(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> Result<Self, Error> {
        if cols % format.col_multiple() != 0 {
            return Err(Error::FormatShape { format, what: "columns", value: cols, multiple: format.col_multiple() });
        }
        let want = format.data_bytes(rows, cols);
        if data.len() != want {
            return Err(Error::ShapeMismatch { what: "weight data bytes", expected: want, found: data.len() });
        }
        let want = format.scale_count(rows, cols);
        if scales.len() != want {
            return Err(Error::ShapeMismatch { what: "weight scales", expected: want, found: scales.len() });
        }
        Ok(QuantMatrix { format, rows, cols, data, scales })
    }

    /// The format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input columns (K).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Element data, row-major.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
    /// Scales (layout per format, see the module table).
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }
    /// Bytes of element data of one row.
    pub fn row_bytes(&self) -> usize {
        self.format.data_bytes(1, self.cols)
    }
    /// Element data of row `r`.
    pub fn row_data(&self, r: usize) -> &[u8] {
        let b = self.row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    /// Dequantize row `r` into `out[..cols]`: the definition of the format.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let out = &mut out[..self.cols];
        let d = self.row_data(r);
        match self.format {
            WeightFormat::Bf16 => bf16::dequantize_row(d, out),
            WeightFormat::Int8Row => int8_row::dequantize_row(d, self.scales[r], out),
            WeightFormat::Int4Row => int4_row::dequantize_row(d, self.scales[r], out),
            WeightFormat::Int4Group { group } => {
                let g = usize::from(group);
                let per_row = self.cols / g;
                int4_group::dequantize_row(d, g, &self.scales[r * per_row..(r + 1) * per_row], out)
            }
            WeightFormat::Fp8Block => {
                let per_row = self.cols.div_ceil(FP8_BLOCK);
                let br = r / FP8_BLOCK;
                fp8_block::dequantize_row(d, &self.scales[br * per_row..(br + 1) * per_row], out)
            }
            WeightFormat::Fp8Channel => fp8_channel::dequantize_row(d, self.scales[r], out),
            WeightFormat::Mxfp4 | WeightFormat::Mxfp8 => {
                let per_row = self.cols / mx::MX_BLOCK;
                let s = &self.scales[r * per_row..(r + 1) * per_row];
                if self.format == WeightFormat::Mxfp4 {
                    mx::dequantize_fp4_row(d, s, out);
                } else {
                    mx::dequantize_fp8_row(d, s, out);
                }
            }
            WeightFormat::Ggml(t) => ggml::dequantize_row(t, d, out),
        }
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut out[r * self.cols..]);
        }
        out
    }

    /// Rows `range` as a matrix of their own, exact (scales follow their rows).
    pub fn slice_rows(&self, range: Range<usize>) -> Result<Self, Error> {
        self.check_range("row range", &range, self.rows)?;
        if self.format == WeightFormat::Fp8Block {
            self.check_block_aligned("row range", &range, self.rows)?;
        }
        let rb = self.row_bytes();
        let data = self.data[range.start * rb..range.end * rb].to_vec();
        let scales = match self.format {
            WeightFormat::Bf16 | WeightFormat::Ggml(_) => Vec::new(),
            f if f.k_group().is_some() => {
                let per_row = self.cols / f.k_group().unwrap_or(1);
                self.scales[range.start * per_row..range.end * per_row].to_vec()
            }
            WeightFormat::Fp8Block => {
                let per_row = self.cols.div_ceil(FP8_BLOCK);
                let (b0, b1) = (range.start / FP8_BLOCK, range.end.div_ceil(FP8_BLOCK));
                self.scales[b0 * per_row..b1 * per_row].to_vec()
            }
            _ => self.scales[range.clone()].to_vec(),
        };
        Ok(QuantMatrix { format: self.format, rows: range.len(), cols: self.cols, data, scales })
    }

    /// Columns `range` as a matrix of their own, exact: per-row scales are kept (not re-fitted to
    /// the slice), group and block scales are cut at their boundaries.
    pub fn slice_cols(&self, range: Range<usize>) -> Result<Self, Error> {
        self.check_range("column range", &range, self.cols)?;
        let m = self.format.col_multiple();
        if range.start % m != 0 || range.len() % m != 0 {
            return Err(Error::FormatShape {
                format: self.format,
                what: "column slice",
                value: range.start,
                multiple: m,
            });
        }
        if self.format == WeightFormat::Fp8Block {
            self.check_block_aligned("column range", &range, self.cols)?;
        }
        let fmt = self.format;
        let (b0, b1) = (fmt.data_bytes(1, range.start), fmt.data_bytes(1, range.end));
        let mut data = Vec::with_capacity(self.rows * (b1 - b0));
        for r in 0..self.rows {
            data.extend_from_slice(&self.row_data(r)[b0..b1]);
        }
        let scales = match fmt {
            f if f.k_group().is_some() => {
                let g = f.k_group().unwrap_or(1);
                let per_row = self.cols / g;
                (0..self.rows)
                    .flat_map(|r| {
                        self.scales[r * per_row + range.start / g..r * per_row + range.end / g].iter().copied()
                    })
                    .collect()
            }
            WeightFormat::Fp8Block => {
                let per_row = self.cols.div_ceil(FP8_BLOCK);
                let (c0, c1) = (range.start / FP8_BLOCK, range.end.div_ceil(FP8_BLOCK));
                (0..self.rows.div_ceil(FP8_BLOCK))
                    .flat_map(|br| self.scales[br * per_row + c0..br * per_row + c1].iter().copied())
                    .collect()
            }
            _ => self.scales.clone(),
        };
        Ok(QuantMatrix { format: fmt, rows: self.rows, cols: range.len(), data, scales })
    }

    fn check_range(&self, what: &'static str, r: &Range<usize>, len: usize) -> Result<(), Error> {
        if r.start > r.end || r.end > len {
            return Err(Error::ShapeMismatch { what, expected: len, found: r.end });
        }
        Ok(())
    }

    fn check_block_aligned(&self, what: &'static str, r: &Range<usize>, len: usize) -> Result<(), Error> {
        if r.start % FP8_BLOCK != 0 || (r.end % FP8_BLOCK != 0 && r.end != len) {
            return Err(Error::FormatShape { format: self.format, what, value: r.start, multiple: FP8_BLOCK });
        }
        Ok(())
    }
}
