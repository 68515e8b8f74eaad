//! DeepSeek-V4-Flash's MXFP4 experts decoded to f32: `{stem}.weight` (I8 or U8 `[N, K/2]`,
//! e2m1 nibbles, the even column in the low nibble) and `{stem}.scale` (F8_E8M0 or U8
//! `[N, K/32]`, `2^(code − 127)`; code 255 is no number and refused). Quantizing the values to
//! MXFP4 again gives the same nibbles and scales (the OCP rule puts each block's largest value
//! back on the e2m1 grid), so such a layer loads exactly.

use kt_core::format::mx::FP4_X2;
use safetensors::Dtype;

use super::{Checkpoint, TensorRef, WeightError};

/// Whether `{stem}.weight` of `[rows, cols]` is stored as MXFP4 (packed bytes and a `.scale`).
pub fn is_mxfp4(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> bool {
    let packed = ck.get(&format!("{stem}.weight"));
    packed.is_some_and(|t| matches!(t.dtype, Dtype::I8 | Dtype::U8) && t.shape == [rows, cols / 2])
        && ck.contains(&format!("{stem}.scale"))
}

/// `{stem}.weight`'s packed bytes and `{stem}.scale`'s codes, their shapes and the scales'
/// dtype checked.
pub fn stored<'a>(
    ck: &'a Checkpoint,
    stem: &str,
    rows: usize,
    cols: usize,
) -> Result<(&'a [u8], &'a [u8]), WeightError> {
    let (wname, sname) = (format!("{stem}.weight"), format!("{stem}.scale"));
    let get = |n: &str| ck.get(n).ok_or_else(|| WeightError::Missing { name: n.into() });
    let (w, s) = (get(&wname)?, get(&sname)?);
    if cols % 32 != 0 || w.shape != [rows, cols / 2] {
        return Err(WeightError::Shape { name: wname, expected: vec![rows, cols / 2], found: w.shape.clone() });
    }
    Ok((ck.bytes(w), codes_of(ck, &sname, s, rows, cols)?))
}

/// `2^(c − 127)` as f32 bits: exponent bits `c` (`c = 0`: 2^-127, a subnormal; 255: no number).
fn scale_bits(c: u8) -> u32 {
    match c {
        0 => 0x0040_0000,
        255 => 0x7FC0_0000,
        c => u32::from(c) << 23,
    }
}

/// `2^(c − 127)`, an e8m0 scale (code 255: no number).
pub fn scale(c: u8) -> f32 {
    f32::from_bits(scale_bits(c))
}

/// The e8m0 scale tensor `name` of a `[rows, cols]` matrix (`[rows, cols/32]`, F8_E8M0 or
/// U8) as its codes, its dtype and shape checked (not its codes: see [`finite`]).
pub fn codes<'a>(ck: &'a Checkpoint, name: &str, rows: usize, cols: usize) -> Result<&'a [u8], WeightError> {
    let s = ck.get(name).ok_or_else(|| WeightError::Missing { name: name.into() })?;
    codes_of(ck, name, s, rows, cols)
}

/// [`codes`] of the tensor `s` (named `name`).
fn codes_of<'a>(
    ck: &'a Checkpoint,
    name: &str,
    s: &TensorRef,
    rows: usize,
    cols: usize,
) -> Result<&'a [u8], WeightError> {
    if !matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8) {
        let found = format!("{:?}", s.dtype);
        return Err(WeightError::Dtype { name: name.into(), found, expected: "F8_E8M0 (or U8) e8m0 scales" });
    }
    if cols % 32 != 0 || s.shape != [rows, cols / 32] {
        return Err(WeightError::Shape { name: name.into(), expected: vec![rows, cols / 32], found: s.shape.clone() });
    }
    Ok(ck.bytes(s))
}

/// Refuse an e8m0 code 255 (no number) in the scales of tensor `name` (the readers that decode
/// do; the layerwise writes copy a layer's codes, which its load checked).
pub fn finite(name: &str, codes: &[u8]) -> Result<(), WeightError> {
    match codes.iter().position(|&c| c == 0xFF) {
        Some(at) => Err(WeightError::Value {
            name: name.into(),
            detail: format!("scale code 0xff (no number) at element {at}; e8m0 scales must be finite (codes 0-254)"),
        }),
        None => Ok(()),
    }
}

/// `2^(c − 127)` as bf16 bits (exact: a bf16 has f32's exponent): one code, what the tests
/// check [`scales_bf16`] against.
#[cfg(test)]
pub fn scale_bf16(c: u8) -> u16 {
    (scale_bits(c) >> 16) as u16
}

/// `2^(c − 127)` as bf16 bits (exact: a bf16 has f32's exponent) for every code of `codes`
/// into `out` (2 bytes each, little-endian), without branches so that it runs in vector
/// registers (the layerwise writes widen every scale row).
pub fn scales_bf16(codes: &[u8], out: &mut [u8]) {
    debug_assert_eq!(out.len(), 2 * codes.len());
    for (&c, o) in codes.iter().zip(out.chunks_exact_mut(2)) {
        // Codes 0 (2^-127, f32 0x0040_0000) and 255 (NaN, 0x7FC0_0000) set the mantissa's top bit.
        let v = u16::from(c) << 7 | u16::from(c == 0 || c == 255) << 6;
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// `{stem}.weight` and `{stem}.scale` as an f32 `[rows, cols]`; a scale code 255 is refused.
pub fn packed(ck: &Checkpoint, stem: &str, rows: usize, cols: usize) -> Result<Vec<f32>, WeightError> {
    let (bytes, codes) = stored(ck, stem, rows, cols)?;
    decode(&format!("{stem}.scale"), bytes, codes, rows, cols)
}

/// Packed e2m1 `bytes` (`[rows, cols/2]`, the even column in the low nibble) with e8m0 `codes`
/// (`[rows, cols/32]`, of tensor `scales`) as an f32 `[rows, cols]`; a code 255 is refused.
pub fn decode(scales: &str, bytes: &[u8], codes: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>, WeightError> {
    finite(scales, codes)?;
    Ok((0..rows * cols)
        .map(|i| {
            let nibble = (bytes[i / 2] >> (4 * (i % 2))) & 0x0F;
            let scale = f32::from_bits(scale_bits(codes[(i / cols) * (cols / 32) + (i % cols) / 32]));
            f32::from(FP4_X2[nibble as usize]) * 0.5 * scale
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_rows_widen_as_each_code_does() {
        let codes: Vec<u8> = (0..=255).chain([0, 255, 127, 1]).collect();
        let mut out = vec![0u8; 2 * codes.len()];
        scales_bf16(&codes, &mut out);
        for (c, o) in codes.iter().zip(out.chunks_exact(2)) {
            assert_eq!(u16::from_le_bytes([o[0], o[1]]), scale_bf16(*c), "code {c}");
        }
    }
}
