//! The reference backend: plain scalar Rust, obviously correct, slow. It is the oracle every
//! other backend is tested against, and the definition of the MoE numerics:
//!
//! - bf16/fp8 formats: bf16 activations, fp32 products accumulated in column order (fp8 block:
//!   per 128-column block, then times the block scale, blocks in order; mxfp8 the same per
//!   32-column group);
//! - int formats: activations quantized per token (per K-group for `int4-gG` and `mxfp4`) to
//!   int8 with `amax/127`, exact i32 dot products, times activation scale then weight scale
//!   (mxfp4: weights `2·e2m1` as integers, the ½ in the weight scale);
//! - GGML types: activations prepared as the type's `vec_dot_type` ([`ggml::ActKind`]: f32,
//!   Q8_0 or Q8_K blocks); per activation block, `Σ w·q` over the dequantized weights in
//!   column order, times the block's scale, blocks in order;
//! - SwiGLU (or the layer's clamped variant) per [`crate::swiglu`]: gate/up rounded to bf16,
//!   result rounded to bf16.
#![forbid(unsafe_code)]

use core::ops::Range;

use half::bf16;

use crate::backend::{ActLayout, Instructions, TaskShape};
use crate::bias::GateUpBias;
use crate::dtype::F8E4M3;
use crate::format::{self, int4_group, int4_row, int8_row, mx, FP8_BLOCK};
use crate::ggml::{self, ActKind, BlockQ8K, BlockQ8_0};
use crate::mat::MatMut;
use crate::swiglu::Glu;
use crate::{Backend, Error, PackedMatrix, QuantMatrix, WeightFormat};

/// The reference backend.
#[derive(Debug)]
pub struct Reference;

/// The one instance, for registries.
pub static REFERENCE: Reference = Reference;

/// Activation groups per row: K-groups for `int4-gG` and `mxfp4`, else one per token.
fn act_groups(format: WeightFormat, cols: usize) -> usize {
    format.act_group().map_or(1, |g| cols / g)
}

/// Prepared activations as the reference reads them.
enum Act<'a> {
    /// bf16 rows.
    Float(&'a [bf16]),
    /// int8 rows with `groups` scales per row.
    Int { q: &'a [i8], scales: &'a [f32], groups: usize },
    /// GGML activation rows of `row_bytes` each.
    Ggml { kind: ActKind, bytes: &'a [u8], row_bytes: usize },
}

impl<'a> Act<'a> {
    fn parse(format: WeightFormat, cols: usize, bytes: &'a [u8]) -> Act<'a> {
        if let WeightFormat::Ggml(t) = format {
            return Act::Ggml { kind: t.act(), bytes, row_bytes: ggml::act_bytes(t.act(), 1, cols) };
        }
        if !format.int_activations() {
            return Act::Float(bytemuck::cast_slice(bytes));
        }
        let groups = act_groups(format, cols);
        let rows = bytes.len() / (cols + 4 * groups); // exact: see act_bytes
        let q_end = (rows * cols).next_multiple_of(4);
        Act::Int {
            q: bytemuck::cast_slice(&bytes[..rows * cols]),
            scales: bytemuck::cast_slice(&bytes[q_end..q_end + 4 * rows * groups]),
            groups,
        }
    }
}

/// Row `r` of `m` dotted with activation row `t`, per the module's definition; `wf` is room for
/// one dequantized row (GGML types).
fn dot(m: &QuantMatrix, r: usize, act: &Act<'_>, t: usize, wf: &mut [f32]) -> f32 {
    let (cols, w) = (m.cols(), m.row_data(r));
    match (m.format(), act) {
        (WeightFormat::Bf16, Act::Float(x)) => {
            let x = &x[t * cols..(t + 1) * cols];
            (0..cols).fold(0.0f32, |acc, c| acc + format::bf16::element(w, c).to_f32() * x[c].to_f32())
        }
        (WeightFormat::Fp8Channel, Act::Float(x)) => {
            let x = &x[t * cols..(t + 1) * cols];
            let s = (0..cols).fold(0.0f32, |acc, c| acc + F8E4M3(w[c]).to_f32() * x[c].to_f32());
            s * m.scales()[r]
        }
        (WeightFormat::Fp8Block, Act::Float(x)) => {
            let per_row = cols.div_ceil(FP8_BLOCK);
            fp8_blocks(w, &x[t * cols..(t + 1) * cols], FP8_BLOCK, &m.scales()[(r / FP8_BLOCK) * per_row..])
        }
        (WeightFormat::Mxfp8, Act::Float(x)) => {
            let per_row = cols / mx::MX_BLOCK;
            fp8_blocks(w, &x[t * cols..(t + 1) * cols], mx::MX_BLOCK, &m.scales()[r * per_row..(r + 1) * per_row])
        }
        (WeightFormat::Int8Row, Act::Int { q, scales, .. }) => {
            let q = &q[t * cols..(t + 1) * cols];
            let acc: i32 = (0..cols).map(|c| i32::from(q[c]) * i32::from(w[c] as i8)).sum();
            acc as f32 * scales[t] * m.scales()[r]
        }
        (WeightFormat::Int4Row, Act::Int { q, scales, .. }) => {
            let q = &q[t * cols..(t + 1) * cols];
            let acc: i32 = (0..cols).map(|c| i32::from(q[c]) * i32::from(int4_row::weight_i8(w, c))).sum();
            acc as f32 * scales[t] * m.scales()[r]
        }
        (f @ (WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4), Act::Int { q, scales, groups }) => {
            // mxfp4's integers are 2·e2m1: the ½ goes into the weight scale.
            let mxfp4 = f == WeightFormat::Mxfp4;
            let weight = if mxfp4 { mx::fp4_x2 } else { int4_group::weight_i8 };
            let half = if mxfp4 { 0.5 } else { 1.0 };
            let g = cols / groups;
            let q = &q[t * cols..(t + 1) * cols];
            let (sa, sw) = (&scales[t * groups..(t + 1) * groups], &m.scales()[r * groups..(r + 1) * groups]);
            (0..*groups).fold(0.0f32, |acc, gi| {
                let d: i32 = (gi * g..(gi + 1) * g).map(|c| i32::from(q[c]) * i32::from(weight(w, c))).sum();
                acc + d as f32 * (sa[gi] * (half * sw[gi]))
            })
        }
        (WeightFormat::Ggml(_), &Act::Ggml { kind, bytes, row_bytes }) => {
            let wf = &mut wf[..cols];
            m.dequantize_row(r, wf);
            ggml_dot(kind, wf, &bytes[t * row_bytes..(t + 1) * row_bytes])
        }
        _ => unreachable!("activations were prepared for this matrix's format"),
    }
}

/// e4m3 weights `w` dotted with `x` per `width`-column block (the last may be short), each
/// block's sum times its scale, blocks in order.
fn fp8_blocks(w: &[u8], x: &[bf16], width: usize, scales: &[f32]) -> f32 {
    (0..x.len().div_ceil(width)).fold(0.0f32, |acc, b| {
        let cs = b * width..((b + 1) * width).min(x.len());
        let s = cs.fold(0.0f32, |s, c| s + F8E4M3(w[c]).to_f32() * x[c].to_f32());
        acc + s * scales[b]
    })
}

/// Dequantized weights `w` dotted with one prepared GGML activation row.
fn ggml_dot(kind: ActKind, w: &[f32], act: &[u8]) -> f32 {
    fn blocks<B: bytemuck::Pod>(w: &[f32], act: &[u8], n: usize, f: impl Fn(&B) -> (&[i8], f32)) -> f32 {
        let size = core::mem::size_of::<B>();
        w.chunks_exact(n).zip(act.chunks_exact(size)).fold(0.0f32, |acc, (w, b)| {
            let b = bytemuck::pod_read_unaligned::<B>(b);
            let (q, d) = f(&b);
            acc + w.iter().zip(q).fold(0.0f32, |s, (w, &q)| s + w * f32::from(q)) * d
        })
    }
    match kind {
        ActKind::F32 => {
            let x = act.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            w.iter().zip(x).fold(0.0f32, |s, (w, x)| s + w * x)
        }
        ActKind::Q8_0 => blocks::<BlockQ8_0>(w, act, ggml::QK, |b| (&b.qs[..], b.scale())),
        ActKind::Q8K => blocks::<BlockQ8K>(w, act, ggml::QK_K, |b| (&b.qs[..], b.d)),
    }
}

fn matrix(p: &PackedMatrix) -> &QuantMatrix {
    p.inner::<QuantMatrix>()
}

/// `scratch` as room for `len` f32 (the reference asks for `4·cols` bytes).
fn floats(scratch: &mut [u8], len: usize) -> &mut [f32] {
    bytemuck::cast_slice_mut(&mut scratch[..4 * len])
}

impl Backend for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn cpu_support(&self) -> Result<(), &'static str> {
        Ok(())
    }

    fn serves(&self, format: WeightFormat, _rows: usize, cols: usize) -> bool {
        cols % format.col_multiple() == 0
    }

    fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error> {
        let bytes = m.data().len() + m.scales().len() * m.format().scale_bytes();
        Ok(PackedMatrix::new(self.name(), m.format(), m.rows(), m.cols(), bytes, m.clone()))
    }

    /// One layout per activation kind: bf16 rows, int8 rows with per-token (or per-group)
    /// scales, and each GGML `vec_dot_type`.
    fn act_layout(&self, format: WeightFormat) -> ActLayout {
        ActLayout(match format {
            WeightFormat::Ggml(t) => 16 + t.act() as u32,
            f if f.act_group().is_some() => 1000 + f.act_group().unwrap_or(0) as u32,
            f if f.int_activations() => 1,
            _ => 0,
        })
    }

    fn scratch_bytes(&self, shape: TaskShape) -> usize {
        4 * shape.cols
    }

    fn instructions(&self, _format: WeightFormat) -> Instructions {
        Instructions::Scalar
    }

    fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize {
        if let WeightFormat::Ggml(t) = format {
            return ggml::act_bytes(t.act(), rows, cols);
        }
        if format.int_activations() {
            (rows * cols).next_multiple_of(4) + 4 * rows * act_groups(format, cols)
        } else {
            2 * rows * cols
        }
    }

    fn quantize_act(
        &self,
        format: WeightFormat,
        cols: usize,
        src: &[bf16],
        rows: &[u32],
        dst: &mut [u8],
        scratch: &mut [u8],
    ) {
        let row = |i: usize| &src[rows[i] as usize * cols..(rows[i] as usize + 1) * cols];
        let x = floats(scratch, cols);
        if let WeightFormat::Ggml(t) = format {
            let rb = ggml::act_bytes(t.act(), 1, cols);
            for (i, out) in dst.chunks_exact_mut(rb.max(1)).take(rows.len()).enumerate() {
                for (x, v) in x.iter_mut().zip(row(i)) {
                    *x = v.to_f32();
                }
                ggml::quantize_act_row(t.act(), x, out);
            }
            return;
        }
        if !format.int_activations() {
            let d: &mut [bf16] = bytemuck::cast_slice_mut(&mut dst[..2 * rows.len() * cols]);
            for (i, o) in d.chunks_exact_mut(cols.max(1)).enumerate().take(rows.len()) {
                o.copy_from_slice(row(i));
            }
            return;
        }
        let groups = act_groups(format, cols);
        let g = cols / groups;
        let q_end = (rows.len() * cols).next_multiple_of(4);
        let (q, rest) = dst.split_at_mut(q_end);
        let scales: &mut [f32] = bytemuck::cast_slice_mut(&mut rest[..4 * rows.len() * groups]);
        for i in 0..rows.len() {
            for (x, v) in x.iter_mut().zip(row(i)) {
                *x = v.to_f32();
            }
            for gi in 0..groups {
                let (vals, d) = int8_row::quantize_row(&x[gi * g..(gi + 1) * g]);
                scales[i * groups + gi] = d;
                for (o, v) in q[i * cols + gi * g..].iter_mut().zip(vals) {
                    *o = v as u8;
                }
            }
        }
    }

    fn gate_up(
        &self,
        gate: &PackedMatrix,
        up: &PackedMatrix,
        rows: Range<usize>,
        act_gate: &[u8],
        act_up: &[u8],
        glu: Glu,
        bias: Option<GateUpBias<'_>>,
        mut h: MatMut<'_, bf16>,
        scratch: &mut [u8],
    ) {
        let (gate, up) = (matrix(gate), matrix(up));
        let (ag, au) = (Act::parse(gate.format(), gate.cols(), act_gate), Act::parse(up.format(), up.cols(), act_up));
        let wf = floats(scratch, gate.cols());
        for t in 0..h.rows() {
            let out = h.row_mut(t);
            for (o, r) in out.iter_mut().zip(rows.clone()) {
                let (mut g, mut u) = ([dot(gate, r, &ag, t, wf)], [dot(up, r, &au, t, wf)]);
                if let Some(b) = bias {
                    b.add(r, 0..1, &mut g, &mut u);
                }
                *o = glu.apply(g[0], u[0]);
            }
        }
    }

    fn down(&self, down: &PackedMatrix, rows: Range<usize>, act: &[u8], mut y: MatMut<'_, f32>, scratch: &mut [u8]) {
        let down = matrix(down);
        let act = Act::parse(down.format(), down.cols(), act);
        let wf = floats(scratch, down.cols());
        for t in 0..y.rows() {
            for (o, r) in y.row_mut(t).iter_mut().zip(rows.clone()) {
                *o = dot(down, r, &act, t, wf);
            }
        }
    }
}

#[cfg(test)]
mod tests;
