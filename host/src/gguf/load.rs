//! MoE layers from a GGUF model: the shape from `{arch}.expert_count`, `expert_used_count`,
//! `embedding_length`, `expert_feed_forward_length`, `block_count`; the experts from the
//! stacked tensors `blk.{L}.ffn_{gate,up,down}_exps.weight` (`[E, I, H]`, `[E, I, H]`,
//! `[E, H, I]` outermost first), each projection in its own type.

use kt_core::{LayerFormat, MoeConfig, QuantMatrix, WeightFormat};

use super::file::{GgufFile, GgufTensor};
use crate::error::WeightError;
use crate::layer::{LayerOptions, MoeLayer};
use crate::slots::Slots;

/// The three stacked expert tensors of layer `l`: gate, up, down.
pub fn expert_tensor_names(l: usize) -> [String; 3] {
    ["gate", "up", "down"].map(|p| format!("blk.{l}.ffn_{p}_exps.weight"))
}

/// The MoE shape in a GGUF model's metadata (E, k, H, I; one part, default max tokens).
pub fn moe_config(f: &GgufFile) -> Result<MoeConfig, WeightError> {
    let arch = f.arch()?;
    let key = |k: &str| f.meta_usize(&format!("{arch}.{k}"));
    let (e, k, h) = (key("expert_count")?, key("expert_used_count")?, key("embedding_length")?);
    let i = match key("expert_feed_forward_length") {
        Ok(i) => i,
        // Older conversions lack it: take it from the first layer with experts.
        Err(err) => match moe_layers(f).first() {
            Some(&l) => f.tensor(&expert_tensor_names(l)[0])?.dims.get(1).map_or(0, |&d| d as usize),
            None => return Err(err),
        },
    };
    Ok(MoeConfig::new(e, k, h, i))
}

/// The layers that have routed experts, in order (from the tensor names: a header's
/// `block_count` may claim anything).
pub fn moe_layers(f: &GgufFile) -> Vec<usize> {
    let mut v: Vec<usize> =
        f.names().filter_map(|n| n.strip_prefix("blk.")?.strip_suffix(".ffn_gate_exps.weight")?.parse().ok()).collect();
    v.sort_unstable();
    v
}

/// The formats of layer `l`'s gate, up and down tensors.
pub fn layer_format(f: &GgufFile, l: usize) -> Result<LayerFormat, WeightError> {
    let [g, u, d] = expert_tensor_names(l).map(|n| f.tensor(&n).map(|t| WeightFormat::Ggml(t.t)));
    Ok(LayerFormat { gate: g?, up: u?, down: d? })
}

/// Check a stacked tensor's dims (`[cols, rows, E]` in ggml order) against the config.
fn check(name: &str, t: &GgufTensor<'_>, cols: usize, rows: usize, experts: usize) -> Result<(), WeightError> {
    let want = [cols as u64, rows as u64, experts as u64];
    if t.dims != want {
        let rev = |d: &[u64]| d.iter().rev().map(|&x| x as usize).collect::<Vec<_>>();
        return Err(WeightError::Shape { name: name.to_string(), expected: rev(&want), found: rev(t.dims) });
    }
    Ok(())
}

/// Build MoE layer `layer` of the file: `cfg` gives the shape (checked against the tensors)
/// and the NUMA parts; `slots` which expert fills each slot. Each part's rows (gate, up) and
/// columns (down) are copied out of the mapping by the part's own sub-pool, so they are
/// first touched on its node.
pub fn load_gguf_layer(
    f: &GgufFile,
    layer: usize,
    cfg: &MoeConfig,
    slots: Slots<'_>,
    opts: &LayerOptions,
) -> Result<MoeLayer, WeightError> {
    let names = expert_tensor_names(layer);
    // gpt-oss's experts add biases and take a clamped SwiGLU, which a GGUF layer does not
    // apply here: refused, not run without them.
    let biases = ["gate", "up", "down"].map(|p| format!("blk.{layer}.ffn_{p}_exps.bias"));
    if let Some(b) = biases.iter().find(|b| f.contains(b)) {
        return Err(f.config_error(format!(
            "tensor {b}: experts with biases (gpt-oss) are not supported in GGUF models; the model's Hugging Face \
             checkpoint runs with its biases (method MXFP4)"
        )));
    }
    let [g, u, d] = [0, 1, 2].map(|i| f.tensor(&names[i]));
    let (g, u, d) = (g?, u?, d?);
    let (h, i, e) = (cfg.hidden, cfg.intermediate, cfg.experts);
    check(&names[0], &g, h, i, e)?;
    check(&names[1], &u, h, i, e)?;
    check(&names[2], &d, i, h, e)?;
    let format = layer_format(f, layer)?;
    let ranges = cfg.part_ranges(format)?;
    let rows = |t: &GgufTensor<'_>, e: usize, r: std::ops::Range<usize>| -> Result<QuantMatrix, WeightError> {
        let rb = t.t.row_bytes(h);
        let at = e * i * rb;
        let bytes = t.bytes[at + r.start * rb..at + r.end * rb].to_vec();
        Ok(QuantMatrix::from_parts(WeightFormat::Ggml(t.t), r.len(), h, bytes, Vec::new())?)
    };
    let layer = MoeLayer::from_part_matrices(
        cfg,
        format,
        |slot, p| {
            let Some(ex) = slots.expert(slot) else { return Ok(None) };
            let r = ranges[p].clone();
            let (rb, bb) = (d.t.row_bytes(i), d.t.row_bytes(r.start));
            let cols = d.t.row_bytes(r.len());
            let base = ex * h * rb;
            let mut down = Vec::with_capacity(h * cols);
            for row in 0..h {
                down.extend_from_slice(&d.bytes[base + row * rb + bb..][..cols]);
            }
            let down = QuantMatrix::from_parts(WeightFormat::Ggml(d.t), h, r.len(), down, Vec::new())?;
            Ok(Some((rows(&g, ex, r.clone())?, rows(&u, ex, r)?, down)))
        },
        opts,
    );
    for n in &names {
        f.release(n);
    }
    layer
}
