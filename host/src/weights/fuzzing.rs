//! The fuzz entry of the weight readers (`fuzz/fuzz_targets/checkpoint.rs`): arbitrary bytes as
//! a `config.json`, a safetensors file (through layout detection, decoding and KT's converted
//! format, SGLang's layerwise writes) and KT packed bytes. Every outcome must be a value or an
//! error, never a panic, and a layerwise write must stay within the buffers its encoding sizes
//! (exact heap allocations, so AddressSanitizer reports a byte past them).

use kt_core::format::kt_packed::from_kt;
use kt_core::reference::REFERENCE;
use kt_core::{MoeConfig, SerialExecutor, WeightFormat};

use super::gpu_buffer::{self, RankBuffers};
use super::kt_format::load_kt_layer;
use super::{checkpoint_format, expert_f32, stored_reader, Checkpoint, Layout, ModelConfig, Slots};
use crate::layer::LayerOptions;

/// Feed `data` to every reader.
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let _ = ModelConfig::parse(&String::from_utf8_lossy(data));
    let _ = from_kt(WeightFormat::Int4Row, 32, 128, data, vec![1.0; 32]);
    let dir = std::env::temp_dir().join(format!("kt-fuzz-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(dir.join("model.safetensors"), data).is_ok() {
        read_checkpoint(&dir);
    }
    // Not left behind when the run ends.
    let _ = std::fs::remove_dir_all(&dir);
}

/// The checkpoint in `dir`: layout detection and decoding of two layers' experts, KT's
/// converted formats, and 4-bit experts read as stored.
fn read_checkpoint(dir: &std::path::Path) {
    let Ok(ck) = Checkpoint::open(dir) else { return };
    for layer in 0..2 {
        if let Ok(l) = Layout::detect(&ck, layer) {
            for e in 0..2 {
                let _ = expert_f32(&ck, &l, e, 64, 64);
            }
        }
    }
    // The seeds' shapes: H = I = 64, and H 128, I 256 (whole 128 × 128 fp8 blocks at tp 2).
    for shape in [(64, 64), (128, 256)] {
        for tp in [1, 2] {
            layerwise(&ck, shape, tp);
        }
    }
    let cfg = MoeConfig { parts: 1, ..MoeConfig::new(2, 1, 64, 64) };
    let opts =
        LayerOptions { backend: Some(&REFERENCE), ..LayerOptions::executor(std::sync::Arc::new(SerialExecutor)) };
    for format in [WeightFormat::Int8Row, WeightFormat::Int4Row] {
        let _ = load_kt_layer(&ck, 0, format, &cfg, Slots::default(), &opts);
    }
    // A 4-bit checkpoint's nibbles and scales as stored (compressed-tensors, GPTQ), in the group
    // its scales' shape gives. (A statement, not the tail: the reader borrows `ck`.)
    let format = checkpoint_format(&ck, 0, WeightFormat::Int4Group { group: 128 }, true);
    if let Ok(Some(read)) = stored_reader(&ck, 0, format, &cfg, Slots::default()) {
        for e in 0..2 {
            let _ = read(e);
        }
    };
}

/// Expert 0 of layer 0 written for `tp` GPU ranks into buffers of exactly the bytes its
/// encoding takes ([`gpu_buffer::GpuEncoding::rank_bytes`]).
fn layerwise(ck: &Checkpoint, (h, i): (usize, usize), tp: usize) {
    let Ok(layout) = Layout::detect(ck, 0) else { return };
    let Ok(enc) = gpu_buffer::encoding(ck, &layout, 0, h, i) else { return };
    let mut bufs: Vec<[Vec<u8>; 4]> = (0..tp).map(|_| enc.rank_bytes(h, i, tp).map(|n| vec![0u8; n])).collect();
    let ranks: Vec<RankBuffers> = bufs
        .iter_mut()
        .map(|[a, b, c, d]| {
            // A buffer of no bytes (no scales) still has a non-null address, as SGLang's do.
            let at = |v: &mut Vec<u8>| v.as_mut_ptr() as usize;
            RankBuffers { w13: at(a), w13_scale: at(b), w2: at(c), w2_scale: at(d) }
        })
        .collect();
    // SAFETY: each rank's buffers hold what `enc` writes for it (what this entry checks).
    let _ = unsafe { gpu_buffer::write_expert(ck, (0, 0), (h, i), &ranks, &SerialExecutor) };
}
