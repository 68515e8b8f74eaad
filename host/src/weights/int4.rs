//! 4-bit checkpoints decoded to f32: compressed-tensors "pack-quantized" (`weight_packed`, 8
//! nibbles per int32 along K, low nibble first, value `nibble − 8`, bf16/f16/f32 `weight_scale`
//! `[N, K/g]`, g from the shapes) and GPTQ (`qweight` `[K/8, N]` int32 packed along K, `scales`
//! `[K/g, N]`; symmetric without act-order only, checked from `quantization_config`).

use safetensors::Dtype;
use serde_json::Value;

use super::{Checkpoint, WeightError};

fn nibble(words: &[u8], idx: usize) -> i32 {
    i32::from((words[idx / 2] >> (4 * (idx % 2))) & 0x0F) - 8
}

fn scales(ck: &Checkpoint, name: &str) -> Result<(Vec<f32>, Vec<usize>), WeightError> {
    let t = ck.get(name).ok_or_else(|| WeightError::Missing { name: name.into() })?;
    Ok((super::load::floats(name, t.dtype, ck.bytes(t))?, t.shape.clone()))
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

/// compressed-tensors `{stem}.weight_packed` + `{stem}.weight_scale` as an f32 `[rows, cols]`.
pub fn compressed(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> Result<Vec<f32>, WeightError> {
    let q = packed(ck, &format!("{stem}.weight_packed"), [rows, cols / 8 * 8])?;
    let sname = format!("{stem}.weight_scale");
    let (s, shape) = scales(ck, &sname)?;
    let groups = shape.get(1).copied().unwrap_or(0);
    if shape.first() != Some(&rows) || groups == 0 || cols % groups != 0 || cols % 8 != 0 {
        return Err(WeightError::Shape { name: sname, expected: vec![rows, cols / 32], found: shape });
    }
    let g = cols / groups;
    Ok((0..rows * cols).map(|i| nibble(q, i) as f32 * s[(i / cols) * groups + (i % cols) / g]).collect())
}

/// GPTQ `{stem}.qweight` + `{stem}.scales` as an f32 `[rows, cols]` (rows = N outputs).
pub fn gptq(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> Result<Vec<f32>, WeightError> {
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
    let g = cols / groups;
    let mut out = vec![0.0f32; rows * cols];
    for k in 0..cols {
        for n in 0..rows {
            let word = (k / 8) * rows + n;
            let v = nibble(&q[word * 4..word * 4 + 4], k % 8);
            out[n * cols + k] = v as f32 * s[(k / g) * rows + n];
        }
    }
    Ok(out)
}

/// `quantization_config` of the checkpoint's `config.json`, if any.
fn quantization_config(ck: &Checkpoint) -> Option<Value> {
    let text = std::fs::read_to_string(ck.dir().join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    let root = v.get("text_config").and_then(|t| t.get("quantization_config")).or_else(|| v.get("quantization_config"));
    root.cloned()
}
