//! Prepared activations, K zero-padded to the format's unit (`pack::unit_k`):
//!
//! ```text
//!  fp8 kinds   [rows × Kp] f32
//!  bf16        [rows × Kp] f32, then [rows × Kp] bf16 (the pairs `vdpbf16ps` broadcasts)
//!  int kinds   [rows × Kp] u8 = int8 + 128, then [rows × groups] f32 scales (4-byte aligned)
//! ```
//!
//! int8 values are quantized exactly as the reference backend does (per token, or per K-group
//! for `int4-gG` and `mxfp4`); padding is 0x80, a zero.

use half::bf16;
use kt_core::format::int8_row;
use kt_core::WeightFormat;

use crate::pack::unit_k;

/// Scale groups per token row.
pub fn groups(f: WeightFormat, cols: usize) -> usize {
    f.act_group().map_or(1, |g| cols / g)
}

/// K padded to a whole unit.
pub fn padded(f: WeightFormat, cols: usize) -> usize {
    cols.next_multiple_of(unit_k(f))
}

/// End of the int8 (or f32) part, where the next part starts.
fn first_part(f: WeightFormat, rows: usize, cols: usize) -> usize {
    if f.int_activations() {
        (rows * padded(f, cols)).next_multiple_of(4)
    } else {
        4 * rows * padded(f, cols)
    }
}

pub fn bytes(f: WeightFormat, rows: usize, cols: usize) -> usize {
    first_part(f, rows, cols)
        + match f {
            WeightFormat::Bf16 => 2 * rows * padded(f, cols),
            f if f.int_activations() => 4 * rows * groups(f, cols),
            _ => 0,
        }
}

/// The layout `f`'s kernels read: formats with the same value share one prepared copy.
pub fn layout(f: WeightFormat) -> u32 {
    match f {
        WeightFormat::Bf16 => 10,
        WeightFormat::Int8Row => 1,
        WeightFormat::Int4Row => 2,
        // mxfp4 reads what int4-g32 reads.
        f => f.act_group().map_or(0, |g| 1000 + g as u32),
    }
}

/// Scratch [`prepare`] needs: one token row in f32.
pub fn scratch_bytes(cols: usize) -> usize {
    4 * cols
}

/// Prepare rows `rows` of `src` for format `f` into `dst`; `scratch` holds [`scratch_bytes`].
pub fn prepare(f: WeightFormat, cols: usize, src: &[bf16], rows: &[u32], dst: &mut [u8], scratch: &mut [u8]) {
    let row = |i: usize| &src[rows[i] as usize * cols..(rows[i] as usize + 1) * cols];
    let kp = padded(f, cols);
    let (first, rest) = dst.split_at_mut(first_part(f, rows.len(), cols));
    if !f.int_activations() {
        let d: &mut [f32] = bytemuck::cast_slice_mut(first);
        for (i, o) in d.chunks_exact_mut(kp).enumerate() {
            for (o, v) in o.iter_mut().zip(row(i)) {
                *o = v.to_f32();
            }
            o[cols..].fill(0.0);
        }
        if f == WeightFormat::Bf16 {
            let b: &mut [bf16] = bytemuck::cast_slice_mut(&mut rest[..2 * rows.len() * kp]);
            for (i, o) in b.chunks_exact_mut(kp).enumerate() {
                o[..cols].copy_from_slice(row(i));
                o[cols..].fill(bf16::ZERO);
            }
        }
        return;
    }
    let g = groups(f, cols);
    let gw = cols / g;
    let scales: &mut [f32] = bytemuck::cast_slice_mut(&mut rest[..4 * rows.len() * g]);
    let x: &mut [f32] = bytemuck::cast_slice_mut(&mut scratch[..4 * cols]);
    for i in 0..rows.len() {
        for (o, v) in x.iter_mut().zip(row(i)) {
            *o = v.to_f32();
        }
        let qrow = &mut first[i * kp..(i + 1) * kp];
        qrow[cols..].fill(0x80);
        for gi in 0..g {
            let (vals, d) = int8_row::quantize_row(&x[gi * gw..(gi + 1) * gw]);
            scales[i * g + gi] = d;
            for (o, v) in qrow[gi * gw..].iter_mut().zip(vals) {
                *o = v as u8 ^ 0x80;
            }
        }
    }
}

/// A view of prepared activations.
pub enum Act<'a> {
    /// f32 rows of `kp`, and for bf16 weights the same rows in bf16.
    Float { x: &'a [f32], x16: &'a [bf16], kp: usize },
    /// int8 + 128 rows of `kp`, with `groups` scales per row.
    Int { q: &'a [u8], kp: usize, scales: &'a [f32], groups: usize },
}

impl<'a> Act<'a> {
    pub fn parse(f: WeightFormat, cols: usize, rows: usize, b: &'a [u8]) -> Act<'a> {
        let kp = padded(f, cols);
        let (first, rest) = b.split_at(first_part(f, rows, cols));
        if !f.int_activations() {
            let x16: &[bf16] = if f == WeightFormat::Bf16 { bytemuck::cast_slice(&rest[..2 * rows * kp]) } else { &[] };
            return Act::Float { x: bytemuck::cast_slice(first), x16, kp };
        }
        let g = groups(f, cols);
        Act::Int { q: &first[..rows * kp], kp, scales: bytemuck::cast_slice(&rest[..4 * rows * g]), groups: g }
    }
}
