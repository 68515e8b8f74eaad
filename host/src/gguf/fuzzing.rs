//! The fuzz entry of the GGUF reader (`fuzz/fuzz_targets/gguf.rs`): arbitrary bytes as a GGUF
//! header, as a whole file (tensor lookup, dequantization of what it finds, a MoE layer when
//! the metadata describes a small one) and as blocks of every GGML type. Every outcome must be
//! a value or an error, never a panic or an out-of-bounds read.

use kt_core::ggml::{dequantize_row, GgmlType};
use kt_core::reference::REFERENCE;
use kt_core::SerialExecutor;

use super::{load_gguf_layer, moe_config, moe_layers, parse::parse, GgufFile};
use crate::layer::LayerOptions;
use crate::slots::Slots;

/// Elements dequantized per tensor at most (a header may claim any size).
const MAX_ELEMS: usize = 1 << 16;

/// Feed `data` to the parser, the file reader and the block decoders.
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let _ = parse(data);
    for &t in GgmlType::ALL {
        let blocks = data.len() / t.block_bytes();
        let mut out = vec![0.0f32; blocks * t.block_elems()];
        dequantize_row(t, &data[..blocks * t.block_bytes()], &mut out);
    }
    let path = std::env::temp_dir().join(format!("kt-fuzz-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        read_file(&path);
    }
    // Not left behind when the run ends.
    let _ = std::fs::remove_file(&path);
}

/// Every tensor of the GGUF file at `path`, and its first MoE layer when the metadata
/// describes a small one.
fn read_file(path: &std::path::Path) {
    let Ok(f) = GgufFile::open(path) else { return };
    let names: Vec<String> = f.names().map(str::to_string).collect();
    for n in &names {
        if let Ok(t) = f.tensor(n) {
            let cols = t.dims[0] as usize;
            let rb = t.t.row_bytes(cols);
            if cols > 0 && cols <= MAX_ELEMS {
                let mut out = vec![0.0f32; cols];
                if let Some(row) = t.bytes.get(..rb) {
                    dequantize_row(t.t, row, &mut out);
                }
            }
        }
    }
    if let (Ok(cfg), Some(&layer)) = (moe_config(&f), moe_layers(&f).first()) {
        // Checked: the metadata may claim any sizes (a fuzz run found this product overflowing).
        let elems = cfg.experts.checked_mul(cfg.hidden).and_then(|x| x.checked_mul(cfg.intermediate));
        if elems.is_some_and(|e| e <= MAX_ELEMS) && cfg.validate().is_ok() {
            let opts = LayerOptions {
                backend: Some(&REFERENCE),
                ..LayerOptions::executor(std::sync::Arc::new(SerialExecutor))
            };
            let _ = load_gguf_layer(&f, layer, &cfg, Slots::default(), &opts);
        }
    }
}
