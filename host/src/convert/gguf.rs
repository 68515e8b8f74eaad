//! `kt convert --method q4_k` (or q4_0, q8_0, f16, bf16, f32): a Hugging Face checkpoint's
//! routed experts as a split GGUF model, one file per MoE layer (`model-0000i-of-0000n.gguf`),
//! under llama.cpp's names (`blk.{L}.ffn_{gate,up,down}_exps.weight`, `[E, I, H]`, `[E, I, H]`,
//! `[E, H, I]`) with the `{arch}.expert_*` metadata in every file: what method LLAMAFILE and
//! `kt bench --weights` run. Only the experts are written (not a model llama.cpp can run on its
//! own). Experts are quantized on a pool and written at their place in the stacked tensors;
//! every file is written under a temporary name, and a rerun keeps the complete ones.

use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kt_core::ggml::GgmlType;
use kt_core::{Error, Executor, LayerFormat, MoeConfig, QuantMatrix, WeightFormat};

use super::{release_layer, ConvertReport, ConvertSpec};
use crate::error::WeightError;
use crate::gguf::expert_tensor_names;
use crate::gguf::parse::parse;
use crate::gguf::write::{GgufWriter, Meta, PlannedTensor};
use crate::pool::Pool;
use crate::weights::{expert_f32, Checkpoint, Layout};

/// Architecture name written (and read back by our loader as the metadata key prefix).
const ARCH: &str = "kt-moe";

/// The three stacked tensors of layer `l`, each in its type of `lf`.
fn plan(cfg: &MoeConfig, lf: LayerFormat, l: usize) -> Vec<PlannedTensor> {
    let (e, h, i) = (cfg.experts, cfg.hidden, cfg.intermediate);
    let ggml = |f: WeightFormat| match f {
        WeightFormat::Ggml(t) => t,
        _ => unreachable!("LayerFormat::ggml gives GGML types"),
    };
    let shapes = [(vec![e, i, h], lf.gate), (vec![e, i, h], lf.up), (vec![e, h, i], lf.down)];
    expert_tensor_names(l)
        .into_iter()
        .zip(shapes)
        .map(|(name, (shape, f))| PlannedTensor { name, shape, t: ggml(f) })
        .collect()
}

/// Whether `path` is a complete file holding exactly `plan` (mapped: only the header is read).
fn complete(path: &Path, plan: &[PlannedTensor]) -> bool {
    let Ok(file) = std::fs::File::open(path) else { return false };
    // SAFETY: mapped read-only, and only this process writes the output directory's files.
    let Ok(bytes) = (unsafe { memmap2::Mmap::map(&file) }) else { return false };
    let Ok(h) = parse(&bytes) else { return false };
    h.tensors.len() == plan.len()
        && h.tensors.iter().zip(plan).all(|(got, want)| {
            let dims: Vec<u64> = want.shape.iter().rev().map(|&d| d as u64).collect();
            got.name == want.name
                && got.dims == dims
                && got.type_id == want.t as u32
                && (h.data_start as u64 + got.offset + want.bytes()) <= bytes.len() as u64
        })
}

/// Run a conversion to GGML type `t`.
pub fn convert_gguf(spec: &ConvertSpec, t: GgmlType) -> Result<ConvertReport, WeightError> {
    let start = Instant::now();
    if !t.can_quantize() {
        return Err(Error::NoQuantizer { format: WeightFormat::Ggml(t) }.into());
    }
    let ck = Checkpoint::open(&spec.input)?;
    let mc = ck.config()?;
    let cfg = MoeConfig::new(mc.experts, mc.top_k, mc.hidden, mc.intermediate);
    // Rows that t's blocks do not divide take llama.cpp's fallback type, if it can be written.
    let lf = LayerFormat::ggml(t, cfg.hidden, cfg.intermediate);
    if let Some(&format) = [lf.gate, lf.down].iter().find(|f| matches!(f, WeightFormat::Ggml(t) if !t.can_quantize())) {
        return Err(Error::NoQuantizer { format }.into());
    }
    cfg.validate_for(lf)?;
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| WeightError::Io { path: p, source }
    };
    let wanted = spec.layers.clone().unwrap_or(0..=mc.layers.saturating_sub(1));
    let moe: Vec<(usize, Layout)> =
        wanted.filter(|&l| l < mc.layers).filter_map(|l| Layout::detect(&ck, l).ok().map(|x| (l, x))).collect();
    if let Some((_, l)) = moe.iter().find(|(_, l)| l.has_biases(&ck)) {
        return Err(l.biases_refused(&ck, "this GGUF conversion"));
    }
    std::fs::create_dir_all(&spec.output).map_err(io(&spec.output))?;
    let n = moe.len();
    let meta: Vec<(String, Meta)> = vec![
        ("general.architecture".into(), Meta::Str(ARCH.into())),
        ("general.name".into(), Meta::Str(format!("routed experts of {}, {t}", spec.input.display()))),
        (format!("{ARCH}.block_count"), Meta::U32(mc.layers as u32)),
        (format!("{ARCH}.expert_count"), Meta::U32(cfg.experts as u32)),
        (format!("{ARCH}.expert_used_count"), Meta::U32(cfg.top_k as u32)),
        (format!("{ARCH}.embedding_length"), Meta::U32(cfg.hidden as u32)),
        (format!("{ARCH}.expert_feed_forward_length"), Meta::U32(cfg.intermediate as u32)),
    ];
    let meta: Vec<(&str, Meta)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let pool = Pool::new(spec.threads);
    let layer_bytes: u64 = plan(&cfg, lf, 0).iter().map(PlannedTensor::bytes).sum();
    let pb = if spec.progress { ProgressBar::new(layer_bytes * n as u64) } else { ProgressBar::hidden() };
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} written, {bytes_per_sec}, ETA {eta}",
    ) {
        pb.set_style(style);
    }
    let mut report = ConvertReport { method: t.to_string(), ..ConvertReport::default() };
    for (idx, (layer, layout)) in moe.iter().enumerate() {
        let path = spec.output.join(format!("model-{:05}-of-{n:05}.gguf", idx + 1));
        let plan = plan(&cfg, lf, *layer);
        if complete(&path, &plan) {
            pb.inc(layer_bytes);
            report.skipped.push(*layer);
            continue;
        }
        pb.set_message(format!("layer {layer} ({}/{n})", idx + 1));
        let w = GgufWriter::create(&path, &meta, plan.clone()).map_err(io(&path))?;
        let chunk = (2 * pool.workers()).max(2);
        for first in (0..cfg.experts).step_by(chunk) {
            let ids: Vec<usize> = (first..(first + chunk).min(cfg.experts)).collect();
            let errors: Mutex<Option<WeightError>> = Mutex::new(None);
            pool.parallel_for(ids.len(), &|k, _| {
                let e = ids[k];
                let r = expert_f32(&ck, layout, e, cfg.hidden, cfg.intermediate).and_then(|x| {
                    for (p, (m, tp)) in x.iter().zip(&plan).enumerate() {
                        let (rows, cols) = (tp.shape[1], tp.shape[2]);
                        let q = QuantMatrix::quantize(WeightFormat::Ggml(tp.t), rows, cols, m)?;
                        w.write_at(p, (e * q.data().len()) as u64, q.data()).map_err(io(&path))?;
                        pb.inc(q.data().len() as u64);
                    }
                    Ok(())
                });
                if let Err(err) = r {
                    errors.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(err);
                }
            });
            if let Some(err) = errors.into_inner().unwrap_or_else(|p| p.into_inner()) {
                return Err(err);
            }
        }
        w.finish().map_err(io(&path))?;
        report.bytes_out += layer_bytes;
        report.bytes_in += release_layer(&ck, layout);
        report.written.push(*layer);
    }
    pb.finish_and_clear();
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}
