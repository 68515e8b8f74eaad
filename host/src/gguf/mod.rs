//! GGUF models (llama.cpp's format): the container parsed from the mapped bytes ([`parse`]),
//! split files ([`GgufFile`]), and MoE layers built from their stacked expert tensors in
//! whatever GGML types each projection has ([`load_gguf_layer`]); [`write::GgufWriter`] for
//! `kt convert --method q4_k` and friends.

mod file;
pub mod fuzzing;
mod load;
pub mod parse;
pub mod write;

pub use file::{is_gguf, GgufFile, GgufTensor};
pub use load::{expert_tensor_names, layer_format, load_gguf_layer, moe_config, moe_layers};

#[cfg(test)]
mod tests {
    use kt_core::ggml::GgmlType;

    use super::parse::{parse, Value};
    use super::write::{GgufWriter, Meta, PlannedTensor};

    /// A small file from our writer: metadata, two tensors, their data.
    fn sample(tag: &str) -> Vec<u8> {
        let path = std::env::temp_dir().join(format!("kt-gguf-{tag}-{}.gguf", std::process::id()));
        let plan = vec![
            PlannedTensor { name: "a".into(), shape: vec![3, 64], t: GgmlType::Q8_0 },
            PlannedTensor { name: "b".into(), shape: vec![256], t: GgmlType::Q4_K },
        ];
        let meta = [("general.architecture", Meta::Str("x".into())), ("x.expert_count", Meta::U32(7))];
        let w = GgufWriter::create(&path, &meta, plan).unwrap();
        w.write_at(0, 0, &[1u8; 3 * 68]).unwrap();
        assert!(w.write_at(1, 100, &[0u8; 45]).is_err(), "writes past a tensor are refused");
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        bytes
    }

    #[test]
    fn written_files_parse_back() {
        let b = sample("parse");
        let h = parse(&b).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.get("x.expert_count"), Some(&Value::Int(7)));
        assert_eq!(h.get("general.architecture").and_then(Value::as_str), Some("x"));
        assert_eq!((h.tensors[0].dims.clone(), h.tensors[0].type_id), (vec![64, 3], 8));
        assert_eq!((h.tensors[1].offset % 32, h.data_start % 32), (0, 0));
        assert_eq!(&b[h.data_start..h.data_start + 3 * 68], &[1u8; 3 * 68][..]);
    }

    #[test]
    fn every_truncated_header_is_an_error() {
        let b = sample("truncated");
        let header_end = parse(&b).unwrap().data_start;
        for len in 0..header_end.min(b.len()) {
            // The infos end before the padding to the alignment; past that the header parses.
            if let Err(e) = parse(&b[..len]) {
                assert!(e.contains("truncated") || e.contains("not a GGUF"), "{len}: {e}");
            }
        }
        assert!(parse(&b[..header_end - 40]).is_err());
    }
}
