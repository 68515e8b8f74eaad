//! The MoE shape from a Hugging Face `config.json` (fields of DeepSeek, Qwen-MoE, Mixtral and
//! GLM configs; a multimodal model's `text_config` is used when present).

use std::path::Path;

use serde_json::Value;

use super::WeightError;

/// What a MoE layer needs from the model config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub intermediate: usize,
    /// Transformer layers (MoE or not).
    pub layers: usize,
}

impl ModelConfig {
    /// Read and check `path`.
    pub fn read(path: &Path) -> Result<Self, WeightError> {
        let text = std::fs::read_to_string(path).map_err(|source| WeightError::Io { path: path.into(), source })?;
        Self::parse(&text).map_err(|detail| WeightError::Config { path: path.into(), detail })
    }

    /// Parse the JSON text of a `config.json`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let root: Value = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
        let v = root.get("text_config").filter(|t| t.is_object()).unwrap_or(&root);
        let field = |names: &[&str]| -> Result<usize, String> {
            for n in names {
                if let Some(x) = v.get(*n) {
                    return x
                        .as_u64()
                        .filter(|&x| x > 0)
                        .map(|x| x as usize)
                        .ok_or_else(|| format!("\"{n}\" must be a positive integer, found {x}"));
                }
            }
            Err(format!("none of {names:?} is present"))
        };
        Ok(ModelConfig {
            experts: field(&["n_routed_experts", "num_experts", "num_local_experts"])?,
            top_k: field(&["num_experts_per_tok", "num_experts_per_token"])?,
            hidden: field(&["hidden_size"])?,
            intermediate: field(&["moe_intermediate_size", "intermediate_size"])?,
            layers: field(&["num_hidden_layers"])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_and_text_config() {
        let ds = r#"{"n_routed_experts": 64, "num_experts_per_tok": 6, "hidden_size": 2048,
                     "moe_intermediate_size": 1408, "intermediate_size": 10944, "num_hidden_layers": 27}"#;
        assert_eq!(
            ModelConfig::parse(ds).unwrap(),
            ModelConfig { experts: 64, top_k: 6, hidden: 2048, intermediate: 1408, layers: 27 }
        );
        let mixtral = r#"{"num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 4096,
                          "intermediate_size": 14336, "num_hidden_layers": 32}"#;
        assert_eq!(ModelConfig::parse(mixtral).unwrap().intermediate, 14336);
        let vl = r#"{"text_config": {"num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048,
                     "moe_intermediate_size": 768, "num_hidden_layers": 48}, "vision_config": {}}"#;
        assert_eq!(ModelConfig::parse(vl).unwrap().experts, 128);
    }

    #[test]
    fn bad_configs_name_the_field() {
        assert!(ModelConfig::parse("{").unwrap_err().contains("invalid JSON"));
        let e = ModelConfig::parse(r#"{"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64}"#).unwrap_err();
        assert!(e.contains("moe_intermediate_size"), "{e}");
        let e = ModelConfig::parse(
            r#"{"num_experts": -1, "num_experts_per_tok": 2, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1}"#,
        )
        .unwrap_err();
        assert!(e.contains("num_experts") && e.contains("positive"), "{e}");
    }
}
