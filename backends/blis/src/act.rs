//! Prepared activations: the reference backend's (bf16 rows, or int8 rows with their scales per
//! token or K-group: `kt_core::reference`), read here into BLIS's packed A micropanels of MR
//! tokens in f32 (the int8 values times their scales: the reference's numbers, summed in f32).

use half::bf16;
use kt_core::backend::Backend;
use kt_core::reference::REFERENCE;
use kt_core::WeightFormat;

/// A view of `rows` prepared activation rows of K = `cols`.
pub enum Act<'a> {
    /// bf16 rows.
    Float(&'a [bf16]),
    /// int8 rows with `groups` scales each (`cols / groups` columns a scale).
    Int { q: &'a [i8], scales: &'a [f32], groups: usize },
}

impl<'a> Act<'a> {
    /// The reference's layout of `bytes` for `rows` rows of `format`.
    pub fn parse(format: WeightFormat, cols: usize, rows: usize, bytes: &'a [u8]) -> Act<'a> {
        if !format.int_activations() {
            return Act::Float(bytemuck::cast_slice(&bytes[..2 * rows * cols]));
        }
        let groups = format.act_group().map_or(1, |g| cols / g);
        let q_end = (rows * cols).next_multiple_of(4);
        let scales = bytemuck::cast_slice(&bytes[q_end..q_end + 4 * rows * groups]);
        Act::Int { q: bytemuck::cast_slice(&bytes[..rows * cols]), scales, groups }
    }

    /// Tokens `0..n` each alone in f32 (an A micropanel of MR = 1), `stride` floats apart in
    /// `dst`: what the few-token loops sum.
    pub fn each_token(&self, cols: usize, n: usize, stride: usize, dst: &mut [f32]) {
        for t in 0..n {
            self.micropanel(cols, (t, 1), 1, &mut dst[t * stride..]);
        }
    }

    /// Tokens `t0..t0 + m` (m ≤ `mr`) as one A micropanel over the whole K: `dst[k·mr + i]` is
    /// token `t0 + i`'s value `k`, zero for `i ≥ m`.
    pub fn micropanel(&self, cols: usize, (t0, m): (usize, usize), mr: usize, dst: &mut [f32]) {
        let dst = &mut dst[..cols * mr];
        dst.fill(0.0);
        for i in 0..m {
            let t = t0 + i;
            match *self {
                Act::Float(x) => {
                    for (k, v) in x[t * cols..(t + 1) * cols].iter().enumerate() {
                        dst[k * mr + i] = v.to_f32();
                    }
                }
                Act::Int { q, scales, groups } => {
                    let g = cols / groups;
                    for (k, &v) in q[t * cols..(t + 1) * cols].iter().enumerate() {
                        dst[k * mr + i] = f32::from(v) * scales[t * groups + k / g];
                    }
                }
            }
        }
    }
}

/// The layout the reference prepares (what [`Act::parse`] reads).
pub fn layout(format: WeightFormat) -> kt_core::backend::ActLayout {
    REFERENCE.act_layout(format)
}
