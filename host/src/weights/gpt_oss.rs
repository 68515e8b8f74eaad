//! gpt-oss's experts: `{base}.mlp.experts.gate_up_proj_blocks` (U8 `[E, 2I, H/32, 16]`, e2m1
//! pairs, the even column in the low nibble), `gate_up_proj_scales` (U8 `[E, 2I, H/32]`, e8m0)
//! and `gate_up_proj_bias` (`[E, 2I]`), `down_proj_{blocks,scales,bias}` (`[E, H, I/32, 16]`,
//! `[E, H, I/32]`, `[E, H]`). Gate's and up's rows interleave, row `2j` gate's `j` and row
//! `2j + 1` up's (the model's `gate_up[..., ::2]` and `[..., 1::2]`), and their biases alike.
//! A checkpoint dequantized to bf16 keeps the biases and stores `gate_up_proj` as `[E, H, 2I]`
//! with interleaved columns and `down_proj` as `[E, I, H]` (read by the fused path of
//! [`super::expert_f32`]).

use kt_core::bias::ExpertBias;
use safetensors::Dtype;

use super::layout::Layout;
use super::load::floats;
use super::{mxfp4, Checkpoint, WeightError};

/// Expert `e` as f32 `[gate [I,H], up [I,H], down [H,I]]`.
pub fn expert(ck: &Checkpoint, base: &str, e: usize, h: usize, i: usize) -> Result<[Vec<f32>; 3], WeightError> {
    let (gate, up) = deinterleave(&blocks(ck, base, "gate_up_proj", e, 2 * i, h)?, i, h);
    Ok([gate, up, blocks(ck, base, "down_proj", e, h, i)?])
}

/// Expert `e`'s biases, where the layer has them.
pub fn bias(ck: &Checkpoint, layout: &Layout, e: usize, h: usize, i: usize) -> Result<Option<ExpertBias>, WeightError> {
    if !layout.has_biases(ck) {
        return Ok(None);
    }
    let gate_up = vector(ck, &format!("{}.mlp.experts.gate_up_proj_bias", layout.base), e, 2 * i)?;
    let (gate, up) = deinterleave(&gate_up, i, 1);
    let down = vector(ck, &format!("{}.mlp.experts.down_proj_bias", layout.base), e, h)?;
    Ok(Some(ExpertBias { gate, up, down }))
}

/// Rows `[2n, cols]` as (the even rows, the odd rows).
fn deinterleave(v: &[f32], n: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let rows =
        |first: usize| (0..n).flat_map(|r| &v[(2 * r + first) * cols..(2 * r + first + 1) * cols]).copied().collect();
    (rows(0), rows(1))
}

/// Expert `e`'s `{name}_blocks` and `{name}_scales` decoded to f32 `[rows, cols]`.
fn blocks(
    ck: &Checkpoint,
    base: &str,
    name: &str,
    e: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, WeightError> {
    let (bname, sname) = (format!("{base}.mlp.experts.{name}_blocks"), format!("{base}.mlp.experts.{name}_scales"));
    let get = |n: &str| ck.get(n).ok_or_else(|| WeightError::Missing { name: n.into() });
    let (b, s) = (get(&bname)?, get(&sname)?);
    let experts = b.shape.first().copied().unwrap_or(0);
    if cols % 32 != 0 || b.shape != [experts, rows, cols / 32, 16] || !matches!(b.dtype, Dtype::U8 | Dtype::I8) {
        let found = format!("{:?} {:?}", b.dtype, b.shape);
        let expected = "U8 [experts, rows, cols/32, 16] (e2m1 pairs)";
        return Err(WeightError::Dtype { name: bname, found, expected });
    }
    if s.shape != [experts, rows, cols / 32] || !matches!(s.dtype, Dtype::U8 | Dtype::F8_E8M0) {
        let found = format!("{:?} {:?}", s.dtype, s.shape);
        return Err(WeightError::Dtype { name: sname, found, expected: "U8 [experts, rows, cols/32] (e8m0)" });
    }
    if e >= experts {
        return Err(WeightError::Missing { name: format!("{bname}[{e}]") });
    }
    let (pb, ps) = (rows * cols / 2, rows * cols / 32);
    mxfp4::decode(&sname, &ck.bytes(b)[e * pb..(e + 1) * pb], &ck.bytes(s)[e * ps..(e + 1) * ps], rows, cols)
}

/// Row `e` of the `[E, len]` float tensor `name`.
fn vector(ck: &Checkpoint, name: &str, e: usize, len: usize) -> Result<Vec<f32>, WeightError> {
    let t = ck.get(name).ok_or_else(|| WeightError::Missing { name: name.into() })?;
    let experts = t.shape.first().copied().unwrap_or(0);
    if t.shape != [experts, len] {
        return Err(WeightError::Shape { name: name.into(), expected: vec![experts, len], found: t.shape.clone() });
    }
    if e >= experts {
        return Err(WeightError::Missing { name: format!("{name}[{e}]") });
    }
    let size = t.dtype.bitsize() / 8;
    floats(name, t.dtype, &ck.bytes(t)[e * len * size..(e + 1) * len * size])
}
