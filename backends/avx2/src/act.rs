//! Prepared activations. Float formats: `[rows × K]` f32. Int formats: `[rows × Kp]` int8
//! (K zero-padded to a whole unit), then `[rows × groups]` f32 scales at a 4-byte boundary;
//! quantized exactly as the reference backend does (per token, or per K-group for `int4-gG` and
//! `mxfp4`).
//! For the int4 formats the bytes are stored offset by +128 (unsigned), see `kernels`.

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

pub fn bytes(f: WeightFormat, rows: usize, cols: usize) -> usize {
    if f.int_activations() {
        (rows * padded(f, cols)).next_multiple_of(4) + 4 * rows * groups(f, cols)
    } else {
        4 * rows * cols
    }
}

/// The layout `f`'s kernels read: f32 rows for the float formats; int8 rows padded to the
/// format's unit, plain for int8 and +128 for int4, with one scale per token or per K-group.
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
    let scales: &mut [f32] = bytemuck::cast_slice_mut(&mut rest[..4 * rows.len() * g]);
    let x: &mut [f32] = bytemuck::cast_slice_mut(&mut scratch[..4 * cols]);
    for i in 0..rows.len() {
        for (o, v) in x.iter_mut().zip(row(i)) {
            *o = v.to_f32();
        }
        let qrow = &mut q[i * kp..(i + 1) * kp];
        let offset = if f == WeightFormat::Int8Row { 0 } else { 0x80 };
        qrow[cols..].fill(offset);
        for gi in 0..g {
            let (vals, d) = int8_row::quantize_row(&x[gi * gw..(gi + 1) * gw]);
            scales[i * g + gi] = d;
            for (o, v) in qrow[gi * gw..].iter_mut().zip(vals) {
                *o = v as u8 ^ offset;
            }
        }
    }
}

/// A view of prepared activations.
pub enum Act<'a> {
    Float { x: &'a [f32], cols: usize },
    Int { q: &'a [i8], kp: usize, scales: &'a [f32], groups: usize },
}

impl<'a> Act<'a> {
    pub fn parse(f: WeightFormat, cols: usize, rows: usize, b: &'a [u8]) -> Act<'a> {
        if !f.int_activations() {
            return Act::Float { x: bytemuck::cast_slice(&b[..4 * rows * cols]), cols };
        }
        let (kp, g) = (padded(f, cols), groups(f, cols));
        let q_end = (rows * kp).next_multiple_of(4);
        Act::Int {
            q: bytemuck::cast_slice(&b[..rows * kp]),
            kp,
            scales: bytemuck::cast_slice(&b[q_end..q_end + 4 * rows * g]),
            groups: g,
        }
    }
}
