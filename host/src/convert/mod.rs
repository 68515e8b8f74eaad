//! `kt convert`: a Hugging Face checkpoint to KT's converted INT8/INT4 format (or our other
//! formats under the same keys), on the CPU (fp8
//! dequantized here, no GPU), one layer at a time (peak memory ≈ the experts in flight plus the
//! mapped input pages), quantized on a thread pool, with a progress bar, and resumable: every
//! file is a [`TmpFile`] (renamed when complete, removed on an error), and a rerun skips layers
//! whose output verifies. GGML methods (`q4_k`, ...) write GGUF instead (module `gguf`).

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kt_core::{MoeConfig, Scales, WeightFormat};

use crate::error::WeightError;
use crate::pool::Pool;
use crate::tmpfile::TmpFile;
use crate::weights::kt_format::{method_name, plan, verify_layer, write_layer, ExpertSource};
use crate::weights::writer::{Planned, StreamWriter};
use crate::weights::{checkpoint_format, expert_f32, stored_reader, Checkpoint, Layout, Slots};

mod gguf;

/// What to convert.
#[derive(Clone, Debug)]
pub struct ConvertSpec {
    /// Checkpoint directory.
    pub input: PathBuf,
    /// Output directory (created).
    pub output: PathBuf,
    /// AMXINT8 (`Int8Row`) or AMXINT4 (`Int4Row`) in KT's packed layout, or another format in
    /// ours.
    pub format: WeightFormat,
    /// How each row's or group's scale is chosen: KT's absmax (KT's exact bytes) or the
    /// error-minimizing search; a 4-bit checkpoint written as stored keeps its own.
    pub scales: Scales,
    /// NUMA parts the files are made for (KT's `threadpool_count`).
    pub parts: usize,
    /// Layers to convert (default: all).
    pub layers: Option<RangeInclusive<usize>>,
    /// KT's RAWINT4 / GPTQ_INT4 (`WeightFormat::takes_checkpoint_group`): a 4-bit checkpoint
    /// (compressed-tensors, GPTQ) is written in its own K-group, as stored, in place of
    /// `format`'s.
    pub checkpoint_group: bool,
    /// Also write the backward's transposes (KT's `ffn_*_bwd_exps`, for SFT).
    pub backward: bool,
    /// Quantization threads.
    pub threads: usize,
    /// Show a progress bar.
    pub progress: bool,
}

/// What a conversion did.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    /// The method written (`__metadata__`'s), with a 4-bit checkpoint's own group where taken.
    pub method: String,
    /// MoE layers written now.
    pub written: Vec<usize>,
    /// MoE layers whose complete output was already there.
    pub skipped: Vec<usize>,
    /// Bytes of expert weights read (input dtype).
    pub bytes_in: u64,
    /// Bytes written.
    pub bytes_out: u64,
    /// Wall time.
    pub seconds: f64,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> WeightError + '_ {
    move |source| WeightError::Io { path: path.to_path_buf(), source }
}

/// Whether a tensor belongs to a layer's routed experts (converted, not copied).
fn is_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// KT's name for a copied tensor: `model.layers.` → `blk.`, then a leading `model.` dropped.
fn kt_name(name: &str) -> String {
    let n = name.replace("model.layers.", "blk.");
    n.strip_prefix("model.").map_or(n.clone(), str::to_string)
}

/// Run a conversion.
pub fn convert(spec: &ConvertSpec) -> Result<ConvertReport, WeightError> {
    spec.scales.check(spec.format).map_err(WeightError::Layer)?;
    if let WeightFormat::Ggml(t) = spec.format {
        return gguf::convert_gguf(spec, t);
    }
    let start = Instant::now();
    let ck = Checkpoint::open(&spec.input)?;
    let mc = ck.config()?;
    let cfg = MoeConfig { parts: spec.parts, ..MoeConfig::new(mc.experts, mc.top_k, mc.hidden, mc.intermediate) };
    let wanted = spec.layers.clone().unwrap_or(0..=mc.layers.saturating_sub(1));
    let moe: Vec<(usize, Layout)> =
        wanted.filter(|&l| l < mc.layers).filter_map(|l| Layout::detect(&ck, l).ok().map(|x| (l, x))).collect();
    let format =
        moe.first().map_or(spec.format, |&(l, _)| checkpoint_format(&ck, l, spec.format, spec.checkpoint_group));
    cfg.validate_for(format).map_err(WeightError::Layer)?;
    // Also checks the packing constraints, before any work.
    let layer_bytes: u64 = plan(&cfg, format, 0, spec.backward)?.iter().map(|t| t.bytes as u64).sum();
    if let Some((_, l)) = moe.iter().find(|(_, l)| l.has_biases(&ck)) {
        return Err(l.biases_refused(&ck, "KT's converted format"));
    }
    std::fs::create_dir_all(&spec.output).map_err(io(&spec.output))?;
    let total = moe.len() + 1;
    let shard = |i: usize| format!("model-{:05}-of-{total:05}.safetensors", i + 1);
    let pool = Pool::new(spec.threads);
    let pb = if spec.progress { ProgressBar::new(layer_bytes * moe.len() as u64) } else { ProgressBar::hidden() };
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} written, {bytes_per_sec}, ETA {eta}",
    ) {
        pb.set_style(style);
    }
    let mut report = ConvertReport { method: method_name(format), ..ConvertReport::default() };
    let mut weight_map = serde_json::Map::new();
    for (i, (layer, layout)) in moe.iter().enumerate() {
        let path = spec.output.join(shard(i));
        for t in plan(&cfg, format, *layer, spec.backward)? {
            weight_map.insert(t.name, shard(i).into());
        }
        // A 4-bit checkpoint in the format's own K-group is written as stored, not requantized:
        // its scales are its own, whatever rule was asked for (the file names none).
        let stored = stored_reader(&ck, *layer, format, &cfg, Slots::default())?;
        let scales = if stored.is_some() { Scales::Absmax } else { spec.scales };
        if verify_layer(&path, &cfg, (format, scales), *layer, spec.backward) {
            pb.inc(layer_bytes);
            report.skipped.push(*layer);
            continue;
        }
        pb.set_message(format!("layer {layer} ({}/{})", i + 1, moe.len()));
        let written = write_layer(
            &path,
            &cfg,
            (format, scales),
            *layer,
            spec.backward,
            &pool,
            |e| match &stored {
                Some(read) => Ok(ExpertSource::Stored(read(e)?.expect("no GPU slots"))),
                None => expert_f32(&ck, layout, e, cfg.hidden, cfg.intermediate).map(ExpertSource::F32),
            },
            |e, bytes| {
                pb.set_message(format!("layer {layer} ({}/{}), expert {e}/{}", i + 1, moe.len(), cfg.experts));
                pb.inc(bytes);
            },
        )?;
        report.bytes_out += written;
        report.bytes_in += release_layer(&ck, layout);
        report.written.push(*layer);
    }
    pb.finish_and_clear();

    // Everything else (embeddings, attention, norms, shared experts) under KT's names.
    let rest_path = spec.output.join(shard(moe.len()));
    let mut rest: Vec<(&str, String)> =
        ck.names().filter(|n| !is_expert(n)).map(|n| (n, kt_name(n))).collect::<Vec<_>>();
    rest.sort();
    let rest_plan: Vec<Planned> = rest
        .iter()
        .map(|(n, k)| {
            let t = ck.get(n).expect("listed");
            Planned {
                name: k.clone(),
                dtype: format!("{:?}", t.dtype),
                shape: t.shape.clone(),
                bytes: ck.bytes(t).len(),
            }
        })
        .collect();
    let mut w = StreamWriter::create(&rest_path, rest_plan, &[("format", "kt-kernel-converted".into())])
        .map_err(io(&rest_path))?;
    for (n, k) in &rest {
        w.write(k, ck.bytes(ck.get(n).expect("listed"))).map_err(io(&rest_path))?;
        weight_map.insert(k.clone(), shard(moe.len()).into());
    }
    w.finish().map_err(io(&rest_path))?;

    let index = spec.output.join("model.safetensors.index.json");
    let text = serde_json::json!({"metadata": {"format": "kt-kernel-converted"}, "weight_map": weight_map}).to_string();
    TmpFile::write(&index, text.as_bytes()).map_err(io(&index))?;
    for f in
        ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
    {
        let src = ck.dir().join(f);
        if src.is_file() {
            let dst = spec.output.join(f);
            std::fs::read(&src).map_err(io(&src)).and_then(|b| TmpFile::write(&dst, &b).map_err(io(&dst)))?;
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

/// Drop the pages of every expert tensor of a layer (weights, scales, packed int4, ...) once it
/// is converted; returns their bytes.
pub(super) fn release_layer(ck: &Checkpoint, layout: &Layout) -> u64 {
    let prefix = format!("{}.", layout.base);
    let tensors: Vec<_> =
        ck.names().filter(|n| n.starts_with(&prefix) && is_expert(n)).filter_map(|n| ck.get(n)).collect();
    tensors.iter().for_each(|t| ck.release(t));
    tensors.iter().map(|t| ck.bytes(t).len() as u64).sum()
}
