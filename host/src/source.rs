//! `WeightSource`: any weights this crate reads (a Hugging Face checkpoint, KT's converted
//! files, a GGUF model), opened once and asked for layer after layer, so `kt bench` and the
//! Python package share one dispatch.

use std::path::Path;

use kt_core::{LayerFormat, MoeConfig, WeightFormat};

use crate::error::WeightError;
use crate::gguf::{self, GgufFile};
use crate::layer::{LayerOptions, MoeLayer};
use crate::slots::Slots;
use crate::weights::{checkpoint_format, kt_format, load_layer, Checkpoint, Layout};

/// An opened checkpoint of any kind.
#[derive(Debug)]
pub enum WeightSource {
    /// Hugging Face safetensors, quantized at load.
    Hf(Checkpoint),
    /// KT's converted format (or ours in its layout), loaded as stored.
    Kt(Checkpoint),
    /// A GGUF model, run in its own types.
    Gguf(GgufFile),
}

impl WeightSource {
    /// Open `path`: a `.gguf` file or a directory of them, else a safetensors checkpoint.
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        if gguf::is_gguf(path) {
            return Ok(WeightSource::Gguf(GgufFile::open(path)?));
        }
        let ck = Checkpoint::open(path)?;
        Ok(if kt_format::is_kt_converted(&ck) { WeightSource::Kt(ck) } else { WeightSource::Hf(ck) })
    }

    /// `Err` where `method` is KT's MOE_INT8 or MOE_INT4 and this is a checkpoint KT-Kernel
    /// converted (ours record their method; KT's files for its general kernel hold that
    /// kernel's own layout: [`WeightError::KtKernelLayout`]).
    pub fn check_kt_kernel_layout(&self, method: &str) -> Result<(), WeightError> {
        match self {
            WeightSource::Kt(ck) if WeightFormat::is_kt_moe_kernel(method) && ck.metadata("method").is_none() => {
                Err(WeightError::KtKernelLayout { path: ck.dir().to_path_buf(), method: method.to_string() })
            }
            _ => Ok(()),
        }
    }

    /// The layers with routed experts, in order.
    pub fn moe_layers(&self) -> Vec<usize> {
        match self {
            WeightSource::Gguf(f) => gguf::moe_layers(f),
            WeightSource::Hf(ck) | WeightSource::Kt(ck) => (0..ck.config().map_or(0, |c| c.layers))
                .filter(|&l| kt_format::kt_parts(ck, l) > 0 || Layout::detect(ck, l).is_ok())
                .collect(),
        }
    }

    /// Build layer `layer` in `method` (`None`: the file's own types, for GGUF only).
    pub fn load_layer(
        &self,
        layer: usize,
        method: Option<WeightFormat>,
        cfg: &MoeConfig,
        slots: Slots<'_>,
        opts: &LayerOptions,
    ) -> Result<MoeLayer, WeightError> {
        match (self, method) {
            (WeightSource::Gguf(f), None) => gguf::load_gguf_layer(f, layer, cfg, slots, opts),
            (WeightSource::Gguf(f), Some(m)) => Err(WeightError::Config {
                path: f.path().to_path_buf(),
                detail: format!("a GGUF model runs in its own types with method LLAMAFILE, not as {m}"),
            }),
            (WeightSource::Kt(ck), Some(m)) => kt_format::load_kt_layer(ck, layer, m, cfg, slots, opts),
            (WeightSource::Hf(ck), Some(m)) => load_layer(ck, layer, m, cfg, slots, opts),
            (WeightSource::Kt(ck) | WeightSource::Hf(ck), None) => Err(WeightError::Config {
                path: ck.dir().to_path_buf(),
                detail: "method LLAMAFILE runs GGUF models, and this is a safetensors checkpoint".into(),
            }),
        }
    }

    /// The format layer `layer` loads in for `method`: `method`, or with `checkpoint_group`
    /// (KT's RAWINT4 / GPTQ_INT4) and a K-group int4 method, a 4-bit checkpoint's own group
    /// ([`checkpoint_format`]), or the group a file `kt convert` wrote in.
    pub fn layer_format(&self, layer: usize, method: WeightFormat, checkpoint_group: bool) -> WeightFormat {
        match self {
            WeightSource::Hf(ck) => checkpoint_format(ck, layer, method, checkpoint_group),
            WeightSource::Kt(ck) if checkpoint_group && matches!(method, WeightFormat::Int4Group { .. }) => ck
                .metadata("method")
                .and_then(WeightFormat::parse)
                .filter(|f| matches!(f, WeightFormat::Int4Group { .. }))
                .unwrap_or(method),
            _ => method,
        }
    }

    /// Its MoE shape: `config.json`'s, or a GGUF model's metadata.
    pub fn moe_config(&self) -> Result<MoeConfig, WeightError> {
        match self {
            WeightSource::Gguf(f) => gguf::moe_config(f),
            WeightSource::Hf(ck) | WeightSource::Kt(ck) => {
                let mc = ck.config()?;
                Ok(MoeConfig::new(mc.experts, mc.top_k, mc.hidden, mc.intermediate))
            }
        }
    }

    /// The types a GGUF model stores its first MoE layer in; `None` for a checkpoint, which
    /// runs in whatever method is asked for.
    pub fn own_format(&self) -> Result<Option<LayerFormat>, WeightError> {
        let WeightSource::Gguf(f) = self else { return Ok(None) };
        let Some(&first) = gguf::moe_layers(f).first() else {
            return Err(WeightError::Config { path: f.path().to_path_buf(), detail: "no layer has experts".into() });
        };
        gguf::layer_format(f, first).map(Some)
    }

    /// Where it was opened from.
    pub fn path(&self) -> &Path {
        match self {
            WeightSource::Gguf(f) => f.path(),
            WeightSource::Hf(ck) | WeightSource::Kt(ck) => ck.dir(),
        }
    }
}
