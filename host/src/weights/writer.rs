//! A safetensors file written front to back: the header first (every tensor's size is known
//! before its bytes are), then each tensor's bytes as they are produced, so a converter never
//! holds more than the tensors in flight. It is a [`TmpFile`]: renamed when complete, removed
//! when dropped before that.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::tmpfile::TmpFile;

/// One tensor to be written: name, safetensors dtype, shape, byte length.
#[derive(Clone, Debug)]
pub struct Planned {
    /// Tensor name.
    pub name: String,
    /// Safetensors dtype string (`I8`, `F32`, `BF16`, ...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub bytes: usize,
}

/// An open output file.
pub struct StreamWriter {
    out: BufWriter<File>,
    tmp: TmpFile,
    plan: Vec<Planned>,
    next: usize,
}

impl StreamWriter {
    /// Start `path` (as `path.tmp`) with these tensors, in this order, and `metadata`.
    pub fn create(path: &Path, plan: Vec<Planned>, metadata: &[(&str, String)]) -> std::io::Result<Self> {
        let mut header = serde_json::Map::new();
        let meta: serde_json::Map<String, serde_json::Value> =
            metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::String(v.clone()))).collect();
        if !meta.is_empty() {
            header.insert("__metadata__".into(), serde_json::Value::Object(meta));
        }
        let mut at = 0usize;
        for t in &plan {
            header.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [at, at + t.bytes]}),
            );
            at += t.bytes;
        }
        let mut h = serde_json::Value::Object(header).to_string().into_bytes();
        h.resize(h.len().next_multiple_of(8), b' ');
        let (tmp, file) = TmpFile::create(path)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(h.len() as u64).to_le_bytes())?;
        out.write_all(&h)?;
        Ok(StreamWriter { out, tmp, plan, next: 0 })
    }

    /// The bytes of the next planned tensor.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        let t = self.plan.get(self.next).ok_or_else(|| std::io::Error::other(format!("{name}: not planned")))?;
        if t.name != name || t.bytes != bytes.len() {
            return Err(std::io::Error::other(format!(
                "writer out of order: got {name} ({} bytes), expected {} ({} bytes)",
                bytes.len(),
                t.name,
                t.bytes
            )));
        }
        self.next += 1;
        self.out.write_all(bytes)
    }

    /// Flush, sync and rename to the real name (every planned tensor must have been written).
    pub fn finish(self) -> std::io::Result<()> {
        if self.next != self.plan.len() {
            return Err(std::io::Error::other(format!("{} of {} tensors written", self.next, self.plan.len())));
        }
        let file = self.out.into_inner().map_err(|e| e.into_error())?;
        self.tmp.commit(file)
    }
}
