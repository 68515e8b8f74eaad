//! Prepared activations. Float formats: `[rows × K]` f32. Int formats: `[rows × Kp]` int8
//! (K zero-padded to a whole unit), then `[rows × groups]` f32 scales at a 4-byte boundary;
//! quantized exactly as the reference backend does (per token, or per K-group for `int4-gG` and
//! `mxfp4`). For KT's per-row int4 the bytes are stored offset by +128 (unsigned); the K-group
//! kinds keep them signed and add `[rows × groups]` i32 sums of each group's values, with which
//! their kernels start (`kernels`).

use half::bf16;
use kt_core::format::int8_row;
use kt_core::WeightFormat;

use crate::pack::{is_int4, unit_k};

/// Scale groups per token row.
pub fn groups(f: WeightFormat, cols: usize) -> usize {
    f.act_group().map_or(1, |g| cols / g)
}

/// K padded to a whole unit.
pub fn padded(f: WeightFormat, cols: usize) -> usize {
    cols.next_multiple_of(unit_k(f))
}

/// Whether `f`'s activations are signed with group sums (the K-group kinds).
fn summed(f: WeightFormat) -> bool {
    f.k_group().is_some() && is_int4(f)
}

pub fn bytes(f: WeightFormat, rows: usize, cols: usize) -> usize {
    if f.int_activations() {
        let tables = if summed(f) { 2 } else { 1 };
        (rows * padded(f, cols)).next_multiple_of(4) + 4 * tables * rows * groups(f, cols)
    } else {
        4 * rows * cols
    }
}

/// The layout `f`'s kernels read: f32 rows for the float formats; int8 rows padded to the
/// format's unit, plain for int8 and the K-group kinds (with their group sums) and +128 for
/// KT's int4, with one scale per token or per K-group.
pub fn layout(f: WeightFormat) -> u32 {
    match f {
        WeightFormat::Int8Row => 1,
        WeightFormat::Int4Row => 2,
        // mxfp4 reads what int4-g32 reads: the same activations serve both.
        _ => f.act_group().map_or(0, |g| 1000 + g as u32),
    }
}

/// Scratch [`prepare`] needs: one token row in f32.
pub fn scratch_bytes(cols: usize) -> usize {
    4 * cols
}

/// Prepare rows `rows` of `src` for format `f` into `dst`; `scratch` holds [`scratch_bytes`].
pub fn prepare(f: WeightFormat, cols: usize, src: &[bf16], rows: &[u32], dst: &mut [u8], scratch: &mut [u8]) {
    let row = |i: usize| &src[rows[i] as usize * cols..(rows[i] as usize + 1) * cols];
    if !f.int_activations() {
        let d: &mut [f32] = bytemuck::cast_slice_mut(&mut dst[..4 * rows.len() * cols]);
        for (i, o) in d.chunks_exact_mut(cols).enumerate() {
            for (o, v) in o.iter_mut().zip(row(i)) {
                *o = v.to_f32();
            }
        }
        return;
    }
    let (kp, g) = (padded(f, cols), groups(f, cols));
    let gw = cols / g;
    let q_end = (rows.len() * kp).next_multiple_of(4);
    let (q, rest) = dst.split_at_mut(q_end);
    let (scales, sums) = rest.split_at_mut(4 * rows.len() * g);
    let scales: &mut [f32] = bytemuck::cast_slice_mut(scales);
    let sums: &mut [i32] = bytemuck::cast_slice_mut(&mut sums[..if summed(f) { 4 * rows.len() * g } else { 0 }]);
    let x: &mut [f32] = bytemuck::cast_slice_mut(&mut scratch[..4 * cols]);
    for i in 0..rows.len() {
        for (o, v) in x.iter_mut().zip(row(i)) {
            *o = v.to_f32();
        }
        let qrow = &mut q[i * kp..(i + 1) * kp];
        let offset = if f == WeightFormat::Int4Row { 0x80 } else { 0 };
        qrow[cols..].fill(offset);
        for gi in 0..g {
            let (vals, d) = int8_row::quantize_row(&x[gi * gw..(gi + 1) * gw]);
            scales[i * g + gi] = d;
            let mut sum = 0;
            for (o, v) in qrow[gi * gw..].iter_mut().zip(vals) {
                sum += i32::from(v);
                *o = v as u8 ^ offset;
            }
            if let Some(s) = sums.get_mut(i * g + gi) {
                *s = sum;
            }
        }
    }
}

/// A view of prepared activations: f32 rows (float formats) or int8 rows with their scales;
/// the fields of the other kind are empty. One struct for both, so a matrix's kernel (chosen
/// when it was packed) reads its own kind without a match per call.
#[derive(Clone, Copy, Default)]
pub struct Act<'a> {
    /// f32 rows of `kp` = K (float formats).
    pub x: &'a [f32],
    /// int8 rows of `kp` (int formats).
    pub q: &'a [i8],
    /// Values per row.
    pub kp: usize,
    /// `[row][group]` scales of the int8 rows.
    pub scales: &'a [f32],
    /// Scale groups per row.
    pub groups: usize,
    /// Each group's Σx (the K-group kinds; else empty).
    pub sums: &'a [i32],
}

impl<'a> Act<'a> {
    pub fn parse(f: WeightFormat, cols: usize, rows: usize, b: &'a [u8]) -> Act<'a> {
        if !f.int_activations() {
            return Act { x: bytemuck::cast_slice(&b[..4 * rows * cols]), kp: cols, ..Act::default() };
        }
        let (kp, g) = (padded(f, cols), groups(f, cols));
        let (q_end, n) = ((rows * kp).next_multiple_of(4), 4 * rows * g);
        let sums = if summed(f) { bytemuck::cast_slice(&b[q_end + n..q_end + 2 * n]) } else { &[] };
        Act {
            q: bytemuck::cast_slice(&b[..rows * kp]),
            kp,
            scales: bytemuck::cast_slice(&b[q_end..q_end + n]),
            groups: g,
            sums,
            ..Act::default()
        }
    }
}
