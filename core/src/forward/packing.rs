//! Quantizing and packing one expert's matrices into a layer's parts: from f32 (with what the
//! kernels will then multiply by, dequantized) or from matrices already quantized.

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use super::ExpertWeights;
use crate::{Backend, Error, LayerFormat, MoeConfig, QuantMatrix, Scales};

/// One expert in f32, row-major: gate and up `[I, H]`, down `[H, I]`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertF32<'a> {
    /// gate_proj.
    pub gate: &'a [f32],
    /// up_proj.
    pub up: &'a [f32],
    /// down_proj.
    pub down: &'a [f32],
}

/// Quantize one f32 expert per part (each part's slice quantized on its own, as KT's converter
/// does: down's per-row scales cover only the part's columns) and pack it with `backend`.
pub fn pack_expert_f32(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    format: impl Into<LayerFormat>,
    x: ExpertF32<'_>,
) -> Result<Vec<ExpertWeights>, Error> {
    let format = format.into();
    cfg.part_ranges(format)?.into_iter().map(|r| pack_part_f32(backend, cfg, format, Scales::Absmax, x, r)).collect()
}

/// The part of [`pack_expert_f32`] that owns rows `part` of I (one of `cfg.part_ranges`), its
/// scales chosen by `scales`.
pub fn pack_part_f32(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    format: LayerFormat,
    scales: Scales,
    x: ExpertF32<'_>,
    part: Range<usize>,
) -> Result<ExpertWeights, Error> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for (what, m) in [("gate_proj", x.gate), ("up_proj", x.up), ("down_proj", x.down)] {
        if m.len() != h * i {
            return Err(Error::ShapeMismatch { what, expected: h * i, found: m.len() });
        }
    }
    let r = part;
    let rows = |f, m: &[f32]| QuantMatrix::quantize_with(f, scales, r.len(), h, &m[r.start * h..r.end * h]);
    let down = crate::mat::columns(x.down, i, r.clone());
    Ok(ExpertWeights {
        gate: backend.pack(&rows(format.gate, x.gate)?)?,
        up: backend.pack(&rows(format.up, x.up)?)?,
        down: backend.pack(&QuantMatrix::quantize_with(format.down, scales, h, r.len(), &down)?)?,
    })
}

/// What a layer packed by [`pack_expert_f32`] multiplies by: each part's slices quantized to
/// `format` and dequantized again, put back together (gate and up `[I, H]`, down `[H, I]`).
pub fn dequantized_expert_f32(
    cfg: &MoeConfig,
    format: impl Into<LayerFormat>,
    x: ExpertF32<'_>,
) -> Result<[Vec<f32>; 3], Error> {
    let format = format.into();
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for (what, m) in [("gate_proj", x.gate), ("up_proj", x.up), ("down_proj", x.down)] {
        if m.len() != h * i {
            return Err(Error::ShapeMismatch { what, expected: h * i, found: m.len() });
        }
    }
    let (mut g, mut u, mut d) = (vec![0.0f32; i * h], vec![0.0f32; i * h], vec![0.0f32; h * i]);
    for r in cfg.part_ranges(format)? {
        let rows = |f, m: &[f32], out: &mut [f32]| -> Result<(), Error> {
            let q = QuantMatrix::quantize(f, r.len(), h, &m[r.start * h..r.end * h])?;
            out[r.start * h..r.end * h].copy_from_slice(&q.dequantize());
            Ok(())
        };
        rows(format.gate, x.gate, &mut g)?;
        rows(format.up, x.up, &mut u)?;
        let down = crate::mat::columns(x.down, i, r.clone());
        let q = QuantMatrix::quantize(format.down, h, r.len(), &down)?.dequantize();
        crate::mat::set_columns(&mut d, i, r, &q);
    }
    Ok([g, u, d])
}

/// Slice already-quantized matrices into parts (exact) and pack them with `backend`.
pub fn pack_expert(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    down: &QuantMatrix,
) -> Result<Vec<ExpertWeights>, Error> {
    let format = LayerFormat { gate: gate.format(), up: up.format(), down: down.format() };
    cfg.part_ranges(format)?.into_iter().map(|r| pack_part(backend, cfg, gate, up, down, r)).collect()
}

/// The part of [`pack_expert`] that owns rows `part` of I (one of `cfg.part_ranges`).
pub fn pack_part(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    down: &QuantMatrix,
    part: Range<usize>,
) -> Result<ExpertWeights, Error> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for (what, m, rows, cols) in [("gate_proj", gate, i, h), ("up_proj", up, i, h), ("down_proj", down, h, i)] {
        if (m.rows(), m.cols()) != (rows, cols) {
            return Err(Error::ShapeMismatch { what, expected: rows * cols, found: m.rows() * m.cols() });
        }
    }
    Ok(ExpertWeights {
        gate: backend.pack(&gate.slice_rows(part.clone())?)?,
        up: backend.pack(&up.slice_rows(part.clone())?)?,
        down: backend.pack(&down.slice_cols(part)?)?,
    })
}
