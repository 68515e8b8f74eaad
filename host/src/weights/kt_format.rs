//! KT-Kernel's converted format (its `convert_cpu_weights.py` output, merged mode): one
//! safetensors shard per layer with, per expert `e` and NUMA part `n`,
//! `blk.{L}.ffn_{gate|up|down}_exps.{e}.numa.{n}.weight` (1-D int8: KT's packed bytes, see
//! `kt_core::format::kt_packed`) and `.scale` (1-D f32, one per row). Part `n` holds rows
//! `I_n` of gate/up and the same columns of down, each quantized on its own. Files we write also
//! record the part count and method in `__metadata__`; at load the part count is read from the
//! keys, and a file made for another count is refused naming both (down's per-part scales
//! cannot be merged exactly).
//!
//! With `kt convert --backward` each expert also has the backward's transposes, KT's
//! `blk.{L}.ffn_{gate|up|down}_bwd_exps.{e}.numa.{n}.{weight|scale}`: per part `W_gᵀ`, `W_uᵀ`
//! `[H, I_n]` and `W_dᵀ` `[I_n, H]`, quantized from the original values in the same format.
//!
//! Our other formats (bf16, K-group int4, fp8) use the same keys with the format's own bytes
//! (`U8`, the `QuantMatrix` layout) and f32 scales (none for bf16); `__metadata__` names the
//! format. KT has no converted form for them.

use std::sync::Mutex;

use kt_core::format::kt_packed::{packed_bytes, to_kt};
use kt_core::mat::{columns, set_columns};
use kt_core::sft::BackwardWeights;
use kt_core::{MoeConfig, QuantMatrix, Scales, WeightFormat};

use super::writer::{Planned, StreamWriter};
use super::{Checkpoint, Slots, StoredExpert, WeightError};
use crate::layer::{LayerOptions, MoeLayer, PartMatrix};

const PROJ: [&str; 3] = ["gate", "up", "down"];

/// One expert's tensors in file order, or why they could not be made.
type ExpertResult = Result<Vec<Vec<u8>>, WeightError>;

/// The key of one tensor.
pub fn key(layer: usize, proj: usize, e: usize, part: usize, what: &str) -> String {
    format!("blk.{layer}.ffn_{}_exps.{e}.numa.{part}.{what}", PROJ[proj])
}

/// The key of one tensor of the backward's transposes (KT's `ffn_*_bwd_exps`: per part `n`,
/// `W_gᵀ`, `W_uᵀ` `[H, I_n]` and `W_dᵀ` `[I_n, H]`).
pub fn bwd_key(layer: usize, proj: usize, e: usize, part: usize, what: &str) -> String {
    format!("blk.{layer}.ffn_{}_bwd_exps.{e}.numa.{part}.{what}", PROJ[proj])
}

/// Whether layer `layer` of `ck` holds the backward's transposes.
pub fn has_backward(ck: &Checkpoint, layer: usize) -> bool {
    ck.contains(&bwd_key(layer, 0, 0, 0, "weight"))
}

/// Whether a checkpoint is in KT's converted format.
pub fn is_kt_converted(ck: &Checkpoint) -> bool {
    ck.names().any(|n| n.starts_with("blk.") && n.contains("_exps."))
}

/// NUMA parts a layer was converted for (0 if the layer is absent).
pub fn kt_parts(ck: &Checkpoint, layer: usize) -> usize {
    (0..).take_while(|&n| ck.contains(&key(layer, 1, 0, n, "weight"))).count()
}

/// Rows and columns of projection `proj` of a part `ip` rows of I wide (`bwd`: of its
/// transpose).
fn dims(proj: usize, hidden: usize, ip: usize, bwd: bool) -> (usize, usize) {
    match (proj == 2) != bwd {
        true => (hidden, ip),
        false => (ip, hidden),
    }
}

/// Whether KT's packed layout holds this format (else our own layout does).
fn kt_packed(format: WeightFormat) -> bool {
    matches!(format, WeightFormat::Int8Row | WeightFormat::Int4Row)
}

/// (weight bytes, scale count) of one part matrix.
fn sizes(format: WeightFormat, rows: usize, cols: usize) -> Result<(usize, usize), WeightError> {
    let bytes = if kt_packed(format) {
        packed_bytes(format, rows, cols).map_err(WeightError::Layer)?
    } else {
        format.data_bytes(rows, cols)
    };
    Ok((bytes, format.scale_count(rows, cols)))
}

/// The tensors of one converted layer, in file order (expert; projection, part; weight, scale;
/// then with `backward` the same for the transposes).
pub fn plan(cfg: &MoeConfig, format: WeightFormat, layer: usize, backward: bool) -> Result<Vec<Planned>, WeightError> {
    let ranges = cfg.part_ranges(format).map_err(WeightError::Layer)?;
    let dtype = if kt_packed(format) { "I8" } else { "U8" };
    let mut v = Vec::new();
    for e in 0..cfg.experts {
        for bwd in [false, true].into_iter().take(1 + usize::from(backward)) {
            let name =
                |proj, n, what| if bwd { bwd_key(layer, proj, e, n, what) } else { key(layer, proj, e, n, what) };
            for proj in 0..3 {
                for (n, r) in ranges.iter().enumerate() {
                    let (rows, cols) = dims(proj, cfg.hidden, r.len(), bwd);
                    let (bytes, scales) = sizes(format, rows, cols)?;
                    v.push(Planned { name: name(proj, n, "weight"), dtype: dtype.into(), shape: vec![bytes], bytes });
                    if scales > 0 {
                        let name = name(proj, n, "scale");
                        v.push(Planned { name, dtype: "F32".into(), shape: vec![scales], bytes: 4 * scales });
                    }
                }
            }
        }
    }
    Ok(v)
}

/// The method name recorded in `__metadata__`: KT's ("AMXINT8"/"AMXINT4") or ours.
pub fn method_name(format: WeightFormat) -> String {
    match format {
        WeightFormat::Int8Row => "AMXINT8".into(),
        WeightFormat::Int4Row => "AMXINT4".into(),
        f => f.to_string(),
    }
}

/// An expert to write: in f32 (quantized here), or a 4-bit checkpoint's experts in the
/// layer's own K-group as stored (`stored_reader`), cut into parts bit for bit.
pub enum ExpertSource {
    /// Gate `[I,H]`, up `[I,H]` and down `[H,I]` in f32.
    F32([Vec<f32>; 3]),
    /// Gate, up and down as the checkpoint stores them.
    Stored(StoredExpert),
}

/// One expert into its KT tensors (weight bytes, scale bytes) in [`plan`] order, its scales
/// chosen by `scales` (the transposes' are absmax's); with `backward`, its transposes too
/// (quantized from these values, as KT's converter does).
pub fn expert_tensors(
    cfg: &MoeConfig,
    (format, scales): (WeightFormat, Scales),
    x: &ExpertSource,
    backward: bool,
) -> Result<Vec<Vec<u8>>, WeightError> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let ranges = cfg.part_ranges(format).map_err(WeightError::Layer)?;
    let mut out = Vec::new();
    let mut push = |q: &QuantMatrix| -> Result<(), WeightError> {
        out.push(if kt_packed(format) { to_kt(q).map_err(WeightError::Layer)? } else { q.data().to_vec() });
        if !q.scales().is_empty() {
            out.push(q.scales().iter().flat_map(|s| s.to_le_bytes()).collect());
        }
        Ok(())
    };
    match x {
        ExpertSource::F32(m) => {
            for (proj, m) in m.iter().enumerate() {
                for r in &ranges {
                    let (rows, cols) = dims(proj, h, r.len(), false);
                    let slice: Vec<f32> =
                        if proj == 2 { columns(m, i, r.clone()) } else { m[r.start * h..r.end * h].to_vec() };
                    let q = QuantMatrix::quantize_with(format, scales, rows, cols, &slice);
                    push(&q.map_err(WeightError::Layer)?)?;
                }
            }
        }
        ExpertSource::Stored((gate, up, down)) => {
            for (proj, m) in [gate, up, down].into_iter().enumerate() {
                for r in &ranges {
                    let part = if proj == 2 { m.slice_cols(r.clone()) } else { m.slice_rows(r.clone()) };
                    push(&part.map_err(WeightError::Layer)?)?;
                }
            }
        }
    }
    if backward {
        let dequantized;
        let m = match x {
            ExpertSource::F32(m) => m,
            ExpertSource::Stored((gate, up, down)) => {
                dequantized = [gate.dequantize(), up.dequantize(), down.dequantize()];
                &dequantized
            }
        };
        let t = BackwardWeights::quantize(cfg, (format, &ranges), [&m[0], &m[1], &m[2]]).map_err(WeightError::Layer)?;
        for proj in 0..3 {
            for part in &t {
                push(&part[proj])?;
            }
        }
    }
    Ok(out)
}

/// Write `layer`'s experts to `path`; `expert(e)` gives each (called from `exec`'s threads, a
/// few experts at a time, in order of writing). Returns the bytes written.
#[allow(clippy::too_many_arguments)]
pub fn write_layer(
    path: &std::path::Path,
    cfg: &MoeConfig,
    (format, scales): (WeightFormat, Scales),
    layer: usize,
    backward: bool,
    exec: &dyn kt_core::Executor,
    expert: impl Fn(usize) -> Result<ExpertSource, WeightError> + Sync,
    mut progress: impl FnMut(usize, u64),
) -> Result<u64, WeightError> {
    let method = method_name(format);
    let plan = plan(cfg, format, layer, backward)?;
    let total: u64 = plan.iter().map(|t| t.bytes as u64).sum();
    let io = |source| WeightError::Io { path: path.to_path_buf(), source };
    let mut meta = vec![
        ("format", "kt-kernel-converted".to_string()),
        ("method", method),
        ("numa_parts", cfg.parts.to_string()),
        ("layer", layer.to_string()),
    ];
    // Absmax files carry no key, as before (and as KT's own).
    if scales != Scales::Absmax {
        meta.push(("scales", scales.to_string()));
    }
    let mut w = StreamWriter::create(path, plan.clone(), &meta).map_err(io)?;
    let per_expert = plan.len() / cfg.experts.max(1);
    let chunk = (2 * exec.workers()).max(2);
    for start in (0..cfg.experts).step_by(chunk) {
        let ids: Vec<usize> = (start..(start + chunk).min(cfg.experts)).collect();
        let slots: Vec<Mutex<Option<ExpertResult>>> = ids.iter().map(|_| Mutex::new(None)).collect();
        exec.parallel_for(ids.len(), &|t, _| {
            let r = expert(ids[t]).and_then(|x| expert_tensors(cfg, (format, scales), &x, backward));
            *slots[t].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        for (j, slot) in slots.into_iter().enumerate() {
            let tensors = slot.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every task ran")?;
            let e = ids[j];
            for (k, bytes) in tensors.iter().enumerate() {
                w.write(&plan[e * per_expert + k].name, bytes).map_err(io)?;
            }
            progress(e, tensors.iter().map(|b| b.len() as u64).sum());
        }
    }
    w.finish().map_err(io)?;
    Ok(total)
}

/// Whether `path` is a complete converted layer for this config and scale rule (resume skips
/// it).
pub fn verify_layer(
    path: &std::path::Path,
    cfg: &MoeConfig,
    (format, scales): (WeightFormat, Scales),
    layer: usize,
    backward: bool,
) -> bool {
    let Ok(ck) = Checkpoint::open(path) else { return false };
    let Ok(plan) = plan(cfg, format, layer, backward) else { return false };
    ck.metadata("method") == Some(method_name(format).as_str())
        && ck.metadata("numa_parts") == Some(cfg.parts.to_string().as_str())
        && ck.metadata("scales").unwrap_or("absmax") == scales.to_string()
        && plan.iter().all(|t| ck.get(&t.name).is_some_and(|r| ck.bytes(r).len() == t.bytes))
}

/// Check that `ck` holds layer `layer` converted for `cfg.parts` parts in `format`.
fn check_layer(ck: &Checkpoint, layer: usize, format: WeightFormat, cfg: &MoeConfig) -> Result<(), WeightError> {
    let parts = kt_parts(ck, layer);
    if parts == 0 {
        return Err(WeightError::Missing { name: key(layer, 1, 0, 0, "weight") });
    }
    if parts != cfg.parts {
        return Err(WeightError::Parts { path: ck.dir().to_path_buf(), found: parts, requested: cfg.parts });
    }
    // Files we wrote name their format; KT's do not (their sizes are checked instead).
    if let Some(m) = ck.metadata("method").filter(|m| *m != method_name(format)) {
        let (found, requested) = (m.to_string(), method_name(format));
        return Err(WeightError::Method { path: ck.dir().to_path_buf(), found, requested });
    }
    Ok(())
}

/// Projection `proj` of expert `e`, part `n` of layer `layer` (`ranges`: the parts' slices of
/// I), or with `bwd` its transpose.
fn read_part<'c>(
    ck: &'c Checkpoint,
    (layer, format, hidden): (usize, WeightFormat, usize),
    ranges: &[std::ops::Range<usize>],
    (e, proj, n): (usize, usize, usize),
    bwd: bool,
) -> Result<PartMatrix<'c>, WeightError> {
    let (rows, cols) = dims(proj, hidden, ranges[n].len(), bwd);
    let get = |what: &str| {
        let name = if bwd { bwd_key(layer, proj, e, n, what) } else { key(layer, proj, e, n, what) };
        ck.get(&name).map(|t| (name.clone(), ck.bytes(t))).ok_or(WeightError::Missing { name })
    };
    let (want, count) = sizes(format, rows, cols)?;
    let (wn, wb) = get("weight")?;
    if wb.len() != want {
        return Err(WeightError::Shape { name: wn, expected: vec![want], found: vec![wb.len()] });
    }
    let scales: Vec<f32> = if count == 0 {
        Vec::new()
    } else {
        let (sn, sb) = get("scale")?;
        if sb.len() != 4 * count {
            return Err(WeightError::Shape { name: sn, expected: vec![count], found: vec![sb.len() / 4] });
        }
        sb.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    if kt_packed(format) {
        return Ok(PartMatrix::Kt { format, rows, cols, bytes: wb, scales });
    }
    QuantMatrix::from_parts(format, rows, cols, wb.to_vec(), scales).map(PartMatrix::Quant).map_err(WeightError::Layer)
}

/// Build layer `layer` from a converted checkpoint; `cfg.parts` must equal the file's part
/// count, and `format` its method (from the tensor sizes, so KT-written files load too);
/// GPU-resident `slots` are not read.
pub fn load_kt_layer(
    ck: &Checkpoint,
    layer: usize,
    format: WeightFormat,
    cfg: &MoeConfig,
    slots: Slots<'_>,
    opts: &LayerOptions,
) -> Result<MoeLayer, WeightError> {
    check_layer(ck, layer, format, cfg)?;
    let ranges = cfg.part_ranges(format).map_err(WeightError::Layer)?;
    let read =
        |e: usize, proj: usize, n: usize| read_part(ck, (layer, format, cfg.hidden), &ranges, (e, proj, n), false);
    MoeLayer::from_part_sources(
        cfg,
        format,
        |slot, n| {
            let Some(e) = slots.expert(slot) else { return Ok(None) };
            Ok(Some([read(e, 0, n)?, read(e, 1, n)?, read(e, 2, n)?]))
        },
        opts,
    )
}

/// Logical expert `e` of a converted layer as the forward multiplies by it: its parts
/// dequantized and put together (gate and up `[I, H]` by rows, down `[H, I]` by columns).
pub fn dequantized_expert(
    ck: &Checkpoint,
    layer: usize,
    format: WeightFormat,
    cfg: &MoeConfig,
    e: usize,
) -> Result<[Vec<f32>; 3], WeightError> {
    check_layer(ck, layer, format, cfg)?;
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let ranges = cfg.part_ranges(format).map_err(WeightError::Layer)?;
    let mut out = [vec![0.0f32; i * h], vec![0.0f32; i * h], vec![0.0f32; h * i]];
    for (n, r) in ranges.iter().enumerate() {
        for (proj, whole) in out.iter_mut().enumerate() {
            let m = read_part(ck, (layer, format, h), &ranges, (e, proj, n), false)?;
            let m = m.dequantize().map_err(WeightError::Layer)?;
            if proj == 2 {
                set_columns(whole, i, r.clone(), &m);
            } else {
                whole[r.start * h..r.end * h].copy_from_slice(&m);
            }
        }
    }
    Ok(out)
}

/// Logical expert `e`'s transposes as the file holds them (KT's `ffn_*_bwd_exps`), a
/// `[gate, up, down]` per part.
pub fn backward_parts<'c>(
    ck: &'c Checkpoint,
    layer: usize,
    format: WeightFormat,
    cfg: &MoeConfig,
    e: usize,
) -> Result<Vec<[PartMatrix<'c>; 3]>, WeightError> {
    check_layer(ck, layer, format, cfg)?;
    let ranges = cfg.part_ranges(format).map_err(WeightError::Layer)?;
    let read = |proj, n| read_part(ck, (layer, format, cfg.hidden), &ranges, (e, proj, n), true);
    (0..ranges.len()).map(|n| Ok([read(0, n)?, read(1, n)?, read(2, n)?])).collect()
}
