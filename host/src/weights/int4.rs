//! 4-bit checkpoints as stored (our K-group int4's coding: a layer in the checkpoint's group
//! loads them bit for bit, as KT's RAWINT4 does) or decoded to f32: compressed-tensors
//! "pack-quantized" (`weight_packed`, 8 nibbles per int32 along K, low nibble first, value
//! `nibble − 8`, bf16/f16/f32 `weight_scale` `[N, K/g]`, g from the shapes) and GPTQ (`qweight`
//! `[K/8, N]` int32 packed along K, `scales` `[K/g, N]`; symmetric without act-order only,
//! checked from `quantization_config`).

use kt_core::format::{int4_group, QuantMatrix};
use kt_core::WeightFormat;
use safetensors::Dtype;
use serde_json::Value;

use super::{Checkpoint, WeightError};

/// A 4-bit checkpoint matrix as stored: offset-8 nibbles row-major `[rows, cols/2]` (the even
/// column low; value `(nibble − 8) · scale`) and one scale per `group` columns of a row: the
/// coding of our K-group int4, so a matching group loads bit for bit.
pub struct Nibbles {
    /// Nibbles, `[rows, cols/2]`.
    pub data: Vec<u8>,
    /// Scales, `[rows, cols/group]`.
    pub scales: Vec<f32>,
    /// Columns per scale.
    pub group: usize,
}

impl Nibbles {
    /// The values, `[rows, cols]` (K-group int4's definition, for any group).
    pub fn decode(&self, cols: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; self.data.len() * 2];
        let rows = self.data.chunks(cols / 2).zip(self.scales.chunks(cols / self.group));
        for ((row, scales), o) in rows.zip(out.chunks_mut(cols)) {
            int4_group::dequantize_row(row, self.group, scales, o);
        }
        out
    }

    /// As our K-group int4 matrix, if its group is one we run (32, 64, 128).
    pub fn matrix(self, rows: usize, cols: usize) -> Option<QuantMatrix> {
        let group = u16::try_from(self.group).ok().filter(|g| [32, 64, 128].contains(g))?;
        QuantMatrix::from_parts(WeightFormat::Int4Group { group }, rows, cols, self.data, self.scales).ok()
    }
}

/// `{stem}`'s 4-bit tensors as stored (compressed-tensors `weight_packed`, or GPTQ `qweight`),
/// `None` if it has neither.
pub fn stored(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> Result<Option<Nibbles>, WeightError> {
    if ck.contains(&format!("{stem}.weight_packed")) {
        return compressed(ck, stem, rows, cols).map(Some);
    }
    if ck.contains(&format!("{stem}.qweight")) {
        return gptq(ck, stem, rows, cols).map(Some);
    }
    Ok(None)
}

/// The columns per scale of `{stem}`'s 4-bit tensors, from its scales' shape (compressed-tensors
/// `[N, K/g]` beside a `[N, K/8]` `weight_packed`; GPTQ `[K/g, N]` beside a `[K/8, N]`
/// `qweight`); `None` for other tensors.
pub fn group(ck: &Checkpoint, stem: &str) -> Option<usize> {
    let get = |name: String| ck.get(&name);
    let (words, scales, axis) = match get(format!("{stem}.weight_packed")) {
        Some(w) => (w, get(format!("{stem}.weight_scale"))?, 1),
        None => (get(format!("{stem}.qweight"))?, get(format!("{stem}.scales"))?, 0),
    };
    let nibbles = if words.dtype == Dtype::I32 { 8 } else { 2 };
    let (cols, groups) = (nibbles * *words.shape.get(axis)?, *scales.shape.get(axis)?);
    (groups > 0 && cols % groups == 0).then(|| cols / groups)
}

/// A scale tensor's values and shape; a scale that is not a finite number is refused (as the
/// quantizers refuse such weights): loaded as stored, it would reach the outputs.
fn scales(ck: &Checkpoint, name: &str) -> Result<(Vec<f32>, Vec<usize>), WeightError> {
    let t = ck.get(name).ok_or_else(|| WeightError::Missing { name: name.into() })?;
    let v = super::load::floats(name, t.dtype, ck.bytes(t))?;
    if let Some(at) = v.iter().position(|s| !s.is_finite()) {
        let detail = format!("scale {} at element {at}; 4-bit scales must be finite numbers", v[at]);
        return Err(WeightError::Value { name: name.into(), detail });
    }
    Ok((v, t.shape.clone()))
}

fn packed<'a>(ck: &'a Checkpoint, name: &str, shape: [usize; 2]) -> Result<&'a [u8], WeightError> {
    let t = ck.get(name).ok_or_else(|| WeightError::Missing { name: name.into() })?;
    let want_i32 = [shape[0], shape[1] / 8];
    let want_u8 = [shape[0], shape[1] / 2];
    match t.dtype {
        Dtype::I32 if t.shape == want_i32 => Ok(ck.bytes(t)),
        Dtype::U8 | Dtype::I8 if t.shape == want_u8 => Ok(ck.bytes(t)),
        Dtype::I32 | Dtype::U8 | Dtype::I8 => {
            Err(WeightError::Shape { name: name.into(), expected: want_i32.to_vec(), found: t.shape.clone() })
        }
        other => Err(WeightError::Dtype {
            name: name.into(),
            found: format!("{other:?}"),
            expected: "I32 (or U8) packed nibbles",
        }),
    }
}

/// compressed-tensors `{stem}.weight_packed` (int32 words of 8 nibbles along a row, the low
/// first: little-endian bytes in our order) + `{stem}.weight_scale` `[rows, cols/g]`.
fn compressed(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> Result<Nibbles, WeightError> {
    let q = packed(ck, &format!("{stem}.weight_packed"), [rows, cols / 8 * 8])?;
    let sname = format!("{stem}.weight_scale");
    let (s, shape) = scales(ck, &sname)?;
    let groups = shape.get(1).copied().unwrap_or(0);
    if shape.first() != Some(&rows) || groups == 0 || cols % groups != 0 || cols % 8 != 0 {
        return Err(WeightError::Shape { name: sname, expected: vec![rows, cols / 32], found: shape });
    }
    Ok(Nibbles { data: q.to_vec(), scales: s, group: cols / groups })
}

/// GPTQ `{stem}.qweight` (`[K/8, N]` int32 packed along K) + `{stem}.scales` (`[K/g, N]`),
/// transposed to rows = N outputs.
fn gptq(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> Result<Nibbles, WeightError> {
    let qc = quantization_config(ck);
    let field = |k: &str| qc.as_ref().and_then(|q| q.get(k));
    let sym = field("sym").and_then(Value::as_bool).unwrap_or(true);
    let desc_act = field("desc_act").and_then(Value::as_bool).unwrap_or(false);
    let bits = field("bits").and_then(Value::as_u64).unwrap_or(4);
    let qname = format!("{stem}.qweight");
    if !sym || desc_act || bits != 4 {
        return Err(WeightError::Dtype {
            name: qname,
            found: format!("GPTQ bits={bits} sym={sym} desc_act={desc_act}"),
            expected: "GPTQ 4-bit, sym=true, desc_act=false",
        });
    }
    // qweight is [K/8, N]: word (k/8, n) holds k..k+8 of column n, low nibble first.
    let t = ck.get(&qname).ok_or_else(|| WeightError::Missing { name: qname.clone() })?;
    if t.dtype != Dtype::I32 || t.shape != [cols / 8, rows] || cols % 8 != 0 {
        return Err(WeightError::Shape { name: qname, expected: vec![cols / 8, rows], found: t.shape.clone() });
    }
    let q = ck.bytes(t);
    let sname = format!("{stem}.scales");
    let (s, shape) = scales(ck, &sname)?;
    let groups = shape.first().copied().unwrap_or(0);
    if shape.get(1) != Some(&rows) || groups == 0 || cols % groups != 0 {
        return Err(WeightError::Shape { name: sname, expected: vec![cols / 128, rows], found: shape });
    }
    let mut data = vec![0u8; rows * cols / 2];
    for k in 0..cols {
        for n in 0..rows {
            let word = (k / 8) * rows + n;
            let v = (q[word * 4 + (k % 8) / 2] >> (4 * (k % 2))) & 0x0F;
            data[(n * cols + k) / 2] |= v << (4 * (k % 2));
        }
    }
    let scales = (0..rows * groups).map(|i| s[(i % groups) * rows + i / groups]).collect();
    Ok(Nibbles { data, scales, group: cols / groups })
}

/// `quantization_config` of the checkpoint's `config.json`, if any.
fn quantization_config(ck: &Checkpoint) -> Option<Value> {
    let text = std::fs::read_to_string(ck.dir().join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    let root = v.get("text_config").and_then(|t| t.get("quantization_config")).or_else(|| v.get("quantization_config"));
    root.cloned()
}
