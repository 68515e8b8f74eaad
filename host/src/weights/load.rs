//! Decoding a layer's experts to f32 (bf16, f16, f32, fp8 e4m3 with 128×128 block,
//! per-channel or e8m0 per-32 (MXFP8) scales, MXFP4; unaligned reads, as safetensors data may be 2-byte aligned) and packing
//! them into a [`MoeLayer`] on the layer's pool.

use kt_core::dtype::{f16, F8E4M3};
use kt_core::format::QuantMatrix;
use kt_core::{MoeConfig, WeightFormat};
use safetensors::Dtype;

use super::layout::{ExpertLayout, Layout};
use super::{Checkpoint, WeightError};
use crate::layer::{LayerOptions, MoeLayer};
use crate::slots::Slots;

fn le16(b: &[u8]) -> impl Iterator<Item = u16> + '_ {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// A float tensor's elements as f32 (bf16, f16, f32).
pub(super) fn floats(name: &str, dtype: Dtype, b: &[u8]) -> Result<Vec<f32>, WeightError> {
    Ok(match dtype {
        // bf16 is the top half of an f32: a shift (exact, NaN payloads kept).
        Dtype::BF16 => {
            b.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
        }
        Dtype::F16 => le16(b).map(|v| f16::from_bits(v).to_f32()).collect(),
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        other => {
            return Err(WeightError::Dtype {
                name: name.into(),
                found: format!("{other:?}"),
                expected: "BF16, F16, F32 or F8_E4M3",
            })
        }
    })
}

/// Matrix `name` (`[rows, cols]`) as f32, fp8 dequantized with its scales.
fn matrix(ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, WeightError> {
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    let Some(t) = ck.get(name) else {
        // 4-bit checkpoints name their tensors differently.
        return match super::int4::stored(ck, stem, rows, cols)? {
            Some(n) => Ok(n.decode(cols)),
            None => Err(WeightError::Missing { name: name.into() }),
        };
    };
    if super::mxfp4::is_mxfp4(ck, stem, rows, cols) {
        return super::mxfp4::packed(ck, stem, rows, cols);
    }
    if t.shape != [rows, cols] {
        return Err(WeightError::Shape { name: name.into(), expected: vec![rows, cols], found: t.shape.clone() });
    }
    let b = ck.bytes(t);
    if t.dtype != Dtype::F8_E4M3 {
        return floats(name, t.dtype, b);
    }
    let (scale_name, s) = [format!("{stem}.weight_scale_inv"), format!("{stem}.weight_scale")]
        .into_iter()
        .find_map(|n| ck.get(&n).cloned().map(|s| (n, s)))
        .ok_or_else(|| WeightError::Missing {
            name: format!("{stem}.weight_scale_inv (or .weight_scale) for fp8 {name}"),
        })?;
    if matches!(s.dtype, Dtype::U8 | Dtype::F8_E8M0) {
        // MXFP8 (the KT fork's MiniMax-M3): an e8m0 scale per 32 columns of a row.
        let codes = super::mxfp4::codes(ck, &scale_name, rows, cols)?;
        super::mxfp4::finite(&scale_name, codes)?;
        let scale = |i: usize| super::mxfp4::scale(codes[(i / cols) * (cols / 32) + (i % cols) / 32]);
        return Ok(b.iter().enumerate().map(|(i, &q)| F8E4M3(q).to_f32() * scale(i)).collect());
    }
    let scales = floats(&scale_name, s.dtype, ck.bytes(&s))?;
    let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
    // Block scales [ceil(N/128), ceil(K/128)], or one per row ([N] or [N, 1]).
    let scale_of: Box<dyn Fn(usize, usize) -> f32> = if s.shape == [br, bc] && !(bc == 1 && br == rows) {
        Box::new(|r, c| scales[(r / 128) * bc + c / 128])
    } else if s.shape == [rows] || s.shape == [rows, 1] {
        Box::new(|r, _| scales[r])
    } else {
        return Err(WeightError::Shape { name: scale_name, expected: vec![br, bc], found: s.shape.clone() });
    };
    Ok(b.iter().enumerate().map(|(i, &q)| F8E4M3(q).to_f32() * scale_of(i / cols, i % cols)).collect())
}

/// Expert `e` of a layer as f32 `[gate [I,H], up [I,H], down [H,I]]`.
pub fn expert_f32(
    ck: &Checkpoint,
    layout: &Layout,
    e: usize,
    hidden: usize,
    intermediate: usize,
) -> Result<[Vec<f32>; 3], WeightError> {
    let (h, i) = (hidden, intermediate);
    if layout.kind == ExpertLayout::GptOss {
        return super::gpt_oss::expert(ck, &layout.base, e, h, i);
    }
    if layout.kind != ExpertLayout::Fused {
        return Ok([
            matrix(ck, &layout.expert_tensor(e, 0, "weight"), i, h)?,
            matrix(ck, &layout.expert_tensor(e, 1, "weight"), i, h)?,
            matrix(ck, &layout.expert_tensor(e, 2, "weight"), h, i)?,
        ]);
    }
    let (gu_name, d_name) = layout.fused_tensors();
    let get = |n: &str| ck.get(n).ok_or_else(|| WeightError::Missing { name: n.into() });
    let (gu, d) = (get(&gu_name)?, get(&d_name)?);
    let experts = gu.shape.first().copied().unwrap_or(0);
    let slice = |t: &super::TensorRef, name: &str, per: usize| -> Result<Vec<f32>, WeightError> {
        if e >= experts || t.shape.first() != Some(&experts) {
            return Err(WeightError::Missing { name: format!("{name}[{e}]") });
        }
        let esize = match t.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(WeightError::Dtype {
                    name: name.into(),
                    found: format!("{other:?}"),
                    expected: "BF16, F16 or F32",
                })
            }
        };
        floats(name, t.dtype, &ck.bytes(t)[e * per * esize..(e + 1) * per * esize])
    };
    // gate_up is [E, 2I, H] (first I rows gate), or [E, H, 2I] as some exports store it. With
    // biases it is gpt-oss's (whose H and I may be equal, so shapes cannot tell): gate_up
    // [E, H, 2I] with gate's and up's columns interleaved, down [E, I, H].
    let gpt_oss = layout.has_biases(ck);
    let rows_first = !gpt_oss && gu.shape.get(1..) == Some(&[2 * i, h][..]);
    if !rows_first && gu.shape.get(1..) != Some(&[h, 2 * i][..]) {
        let expected = if gpt_oss { vec![experts, h, 2 * i] } else { vec![experts, 2 * i, h] };
        return Err(WeightError::Shape { name: gu_name, expected, found: gu.shape.clone() });
    }
    let g_u = slice(gu, &gu_name, 2 * i * h)?;
    let (gate, up) = if rows_first {
        (g_u[..i * h].to_vec(), g_u[i * h..].to_vec())
    } else {
        // Gate's row r is column r (gpt-oss: 2r), up's i + r (2r + 1).
        let col = |r: usize, up: bool| if gpt_oss { 2 * r + usize::from(up) } else { r + i * usize::from(up) };
        let g_u = &g_u;
        let t = |up: bool| (0..i).flat_map(|r| (0..h).map(move |c| g_u[c * 2 * i + col(r, up)])).collect();
        (t(false), t(true))
    };
    let down_shape = if gpt_oss { [i, h] } else { [h, i] };
    if d.shape.get(1..) != Some(&down_shape[..]) {
        let found = d.shape.clone();
        return Err(WeightError::Shape { name: d_name, expected: vec![experts, down_shape[0], down_shape[1]], found });
    }
    let down = slice(d, &d_name, h * i)?;
    if gpt_oss {
        // [I, H] to [H, I].
        return Ok([
            gate,
            up,
            (0..h).flat_map(|r| (0..i).map(move |c| (r, c))).map(|(r, c)| down[c * h + r]).collect(),
        ]);
    }
    Ok([gate, up, down])
}

/// Build layer `layer` of the checkpoint in `format`: `cfg` gives the shape (E, k, H, I, max
/// tokens, parts; checked against the tensors), `slots` which expert fills each slot, and every
/// CPU expert is decoded, quantized and packed on `opts`' pool (a 4-bit checkpoint's in its own
/// K-group taken as stored: [`stored_reader`]), with its biases where the experts have them
/// (gpt-oss).
pub fn load_layer(
    ck: &Checkpoint,
    layer: usize,
    format: WeightFormat,
    cfg: &MoeConfig,
    slots: Slots<'_>,
    opts: &LayerOptions,
) -> Result<MoeLayer, WeightError> {
    let mut built = match stored_reader(ck, layer, format, cfg, slots)? {
        Some(read) => MoeLayer::try_from_quantized(cfg, read, format, opts)?,
        None => MoeLayer::try_from_f32(cfg, format, slot_reader(ck, layer, cfg, slots)?, opts)?,
    };
    let layout = Layout::detect(ck, layer)?;
    for slot in 0..cfg.experts {
        let Some(e) = slots.expert(slot) else { continue };
        if let Some(b) = super::gpt_oss::bias(ck, &layout, e, cfg.hidden, cfg.intermediate)? {
            built.set_bias(slot, b)?;
        }
    }
    Ok(built)
}

/// An expert's gate, up and down as a checkpoint stores them.
pub type StoredExpert = (QuantMatrix, QuantMatrix, QuantMatrix);

/// For a layer in `format` that is its 4-bit checkpoint's own K-group int4 (compressed-tensors
/// or GPTQ in that group), slot `p`'s expert with its nibbles and scales as stored (`Ok(None)`
/// for a GPU-resident slot): a layer built from it holds the checkpoint's values exactly, as
/// KT's RAWINT4 does, where requantizing them would move them (compressed-tensors scales are
/// amax/7.5 and use the level −8; ours amax/7). `None` for any other layer.
#[allow(clippy::type_complexity)]
pub fn stored_reader<'a>(
    ck: &'a Checkpoint,
    layer: usize,
    format: WeightFormat,
    cfg: &MoeConfig,
    slots: Slots<'a>,
) -> Result<Option<impl Fn(usize) -> Result<Option<StoredExpert>, WeightError> + Sync + 'a>, WeightError> {
    if !matches!(format, WeightFormat::Int4Group { .. }) {
        return Ok(None);
    }
    let layout = Layout::detect(ck, layer)?;
    if format.k_group() != int4_group(ck, &layout) {
        return Ok(None);
    }
    let (h, i) = (cfg.hidden, cfg.intermediate);
    Ok(Some(move |slot: usize| -> Result<Option<StoredExpert>, WeightError> {
        let Some(e) = slots.expert(slot) else { return Ok(None) };
        let m = |p: usize, rows, cols| -> Result<QuantMatrix, WeightError> {
            let stem = layout.expert_stem(e, p);
            let n = super::int4::stored(ck, &stem, rows, cols)?
                .ok_or(WeightError::Missing { name: format!("{stem}.weight_packed") })?;
            n.matrix(rows, cols).ok_or(WeightError::Config {
                path: ck.dir().to_path_buf(),
                detail: format!("{stem}: its scales' group differs from expert 0's ({format})"),
            })
        };
        Ok(Some((m(0, i, h)?, m(1, i, h)?, m(2, h, i)?)))
    }))
}

/// The format layer `layer` of a Hugging Face checkpoint is built in for `format`: `format`, or
/// where it is K-group int4 and `checkpoint_group` (KT's RAWINT4 / GPTQ_INT4:
/// `WeightFormat::takes_checkpoint_group`), the layer's 4-bit experts' own group, which loads
/// them as stored ([`stored_reader`]).
pub fn checkpoint_format(ck: &Checkpoint, layer: usize, format: WeightFormat, checkpoint_group: bool) -> WeightFormat {
    if !(checkpoint_group && matches!(format, WeightFormat::Int4Group { .. })) {
        return format;
    }
    let group = Layout::detect(ck, layer).ok().and_then(|l| int4_group(ck, &l));
    group.map_or(format, |g| WeightFormat::Int4Group { group: g as u16 })
}

/// The K-group of a layer's 4-bit experts (compressed-tensors or GPTQ, from expert 0's gate
/// scales' shape), if its experts are stored so and the group is one our K-group int4 runs (32,
/// 64, 128).
pub fn int4_group(ck: &Checkpoint, layout: &Layout) -> Option<usize> {
    if matches!(layout.kind, ExpertLayout::Fused | ExpertLayout::GptOss) {
        return None;
    }
    super::int4::group(ck, &layout.expert_stem(0, 0)).filter(|g| [32, 64, 128].contains(g))
}

/// An expert's gate `[I,H]`, up `[I,H]` and down `[H,I]` in f32.
type F32Expert = [Vec<f32>; 3];

/// Slot `p`'s expert of layer `layer` as f32 (`Ok(None)` for a GPU-resident slot): the reader
/// the inference and SFT layers are built from.
pub fn slot_reader<'a>(
    ck: &'a Checkpoint,
    layer: usize,
    cfg: &MoeConfig,
    slots: Slots<'a>,
) -> Result<impl Fn(usize) -> Result<Option<F32Expert>, WeightError> + Sync + 'a, WeightError> {
    let (layout, h, i) = (Layout::detect(ck, layer)?, cfg.hidden, cfg.intermediate);
    Ok(move |slot| slots.expert(slot).map(|e| expert_f32(ck, &layout, e, h, i)).transpose())
}
