//! How a checkpoint names a layer's experts, detected as KT's loaders do: a fused
//! `mlp.experts.gate_up_proj [E, 2I, H]` + `down_proj [E, H, I]`, or per-expert tensors named
//! deepseek-style (`mlp.experts.{e}.{gate,up,down}_proj`), mixtral-style
//! (`block_sparse_moe.experts.{e}.{w1,w3,w2}`), mistral-style (`experts.{e}.{w1,w3,w2}`) or
//! DeepSeek-V4-style (`ffn.experts.{e}.{w1,w3,w2}`), or gpt-oss's fused MXFP4 blocks, under
//! `model.layers.{L}`, `layers.{L}` or a multimodal model's `language_model` prefixes.

use super::{Checkpoint, WeightError};

/// The naming scheme of a layer's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `{base}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`
    Deepseek,
    /// `{base}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
    Mixtral,
    /// `{base}.experts.{e}.{w1,w3,w2}.weight`
    Mistral,
    /// `{base}.ffn.experts.{e}.{w1,w3,w2}.weight` (DeepSeek-V4-Flash, MXFP4 with `.scale`)
    Ffn,
    /// `{base}.mlp.experts.gate_up_proj` and `{base}.mlp.experts.down_proj`, all experts stacked.
    Fused,
    /// gpt-oss's MXFP4: `{base}.mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`, all
    /// experts stacked, gate's and up's rows interleaved (`gpt_oss`).
    GptOss,
}

/// A detected layout and the layer's name prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The scheme.
    pub kind: ExpertLayout,
    /// e.g. `model.layers.3`.
    pub base: String,
}

/// Gate, up, down.
pub const PROJ: [&str; 3] = ["gate", "up", "down"];

impl Layout {
    /// Find layer `layer`'s experts in `ck` (probed once per layer and checkpoint).
    pub fn detect(ck: &Checkpoint, layer: usize) -> Result<Layout, WeightError> {
        ck.layout(layer, || Self::probe(ck, layer))
    }

    /// Try every prefix and naming scheme in turn.
    fn probe(ck: &Checkpoint, layer: usize) -> Result<Layout, WeightError> {
        let bases = [
            format!("model.layers.{layer}"),
            format!("model.language_model.layers.{layer}"),
            format!("language_model.model.layers.{layer}"),
            format!("layers.{layer}"),
        ];
        let mut tried = Vec::new();
        for base in &bases {
            let kinds = [ExpertLayout::GptOss, ExpertLayout::Fused, ExpertLayout::Deepseek, ExpertLayout::Mixtral];
            for kind in kinds.into_iter().chain([ExpertLayout::Mistral, ExpertLayout::Ffn]) {
                let l = Layout { kind, base: base.clone() };
                let mut probes = match kind {
                    ExpertLayout::Fused => vec![format!("{base}.mlp.experts.gate_up_proj")],
                    ExpertLayout::GptOss => vec![format!("{base}.mlp.experts.gate_up_proj_blocks")],
                    // bf16/fp8 `weight`, compressed-tensors `weight_packed`, GPTQ `qweight`
                    _ => ["weight", "weight_packed", "qweight"].map(|s| l.expert_tensor(0, 0, s)).to_vec(),
                };
                if probes.iter().any(|p| ck.contains(p)) {
                    return Ok(l);
                }
                tried.push(probes.swap_remove(0));
            }
        }
        Err(WeightError::UnknownLayout { layer, tried })
    }

    /// Expert `e`'s projection `proj` tensor name without its `.weight`: what its scales and
    /// 4-bit tensors are named from.
    pub fn expert_stem(&self, e: usize, proj: usize) -> String {
        let w = self.expert_tensor(e, proj, "weight");
        w.strip_suffix(".weight").map(str::to_owned).unwrap_or(w)
    }

    /// The name of expert `e`'s projection `proj` (0 gate, 1 up, 2 down), tensor `suffix`
    /// (`weight`, `weight_scale_inv`, `weight_scale`); per-expert layouts only.
    pub fn expert_tensor(&self, e: usize, proj: usize, suffix: &str) -> String {
        let b = &self.base;
        match self.kind {
            ExpertLayout::Deepseek | ExpertLayout::Fused | ExpertLayout::GptOss => {
                format!("{b}.mlp.experts.{e}.{}_proj.{suffix}", PROJ[proj])
            }
            ExpertLayout::Mixtral => format!("{b}.block_sparse_moe.experts.{e}.{}.{suffix}", ["w1", "w3", "w2"][proj]),
            ExpertLayout::Mistral => format!("{b}.experts.{e}.{}.{suffix}", ["w1", "w3", "w2"][proj]),
            ExpertLayout::Ffn => format!("{b}.ffn.experts.{e}.{}.{suffix}", ["w1", "w3", "w2"][proj]),
        }
    }

    /// The fused layout's `(gate_up, down)` tensor names.
    pub fn fused_tensors(&self) -> (String, String) {
        (format!("{}.mlp.experts.gate_up_proj", self.base), format!("{}.mlp.experts.down_proj", self.base))
    }

    /// Whether the layer's experts carry biases (gpt-oss's, MXFP4 or dequantized to a fused
    /// layout): only [`crate::weights::load_layer`] keeps them.
    pub fn has_biases(&self, ck: &Checkpoint) -> bool {
        matches!(self.kind, ExpertLayout::GptOss | ExpertLayout::Fused)
            && ck.contains(&format!("{}.mlp.experts.gate_up_proj_bias", self.base))
    }

    /// The error for a path that cannot carry expert biases (`what` names it).
    pub fn biases_refused(&self, ck: &Checkpoint, what: &str) -> WeightError {
        WeightError::Config {
            path: ck.dir().to_path_buf(),
            detail: format!(
                "{}'s experts carry biases (gpt-oss), which {what} cannot hold; inference layers loaded from \
                 the checkpoint itself keep them (KTMoEWrapper.load_weights, kt bench --weights)",
                self.base
            ),
        }
    }
}
