//! A GGUF (v3) file written with every tensor's place fixed up front: the header (metadata,
//! tensor infos) first, then each tensor's bytes written at its offset in any order, so a
//! converter writes expert by expert into the stacked `[E, ...]` tensors without holding one.
//! It is a [`TmpFile`]: renamed when complete, removed when dropped before that.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use kt_core::ggml::GgmlType;

use crate::tmpfile::TmpFile;

/// Alignment of tensor data (GGUF's default).
const ALIGN: u64 = 32;

/// A metadata value to write.
#[derive(Clone, Debug)]
pub enum Meta {
    /// GGUF u32.
    U32(u32),
    /// GGUF string.
    Str(String),
}

/// One tensor to be written.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    /// Name.
    pub name: String,
    /// Dimensions, outermost first (as numpy / torch; written reversed, ggml order).
    pub shape: Vec<usize>,
    /// Type.
    pub t: GgmlType,
}

impl PlannedTensor {
    /// Bytes of its data.
    pub fn bytes(&self) -> u64 {
        let cols = *self.shape.last().unwrap_or(&0);
        let rows: usize = self.shape[..self.shape.len().saturating_sub(1)].iter().product();
        (rows * self.t.row_bytes(cols)) as u64
    }
}

/// An open output file.
pub struct GgufWriter {
    file: File,
    tmp: TmpFile,
    /// Absolute start of each planned tensor.
    starts: Vec<u64>,
    plan: Vec<PlannedTensor>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufWriter {
    /// Start `path` (as `path.tmp`) with `metadata` and room for `plan`.
    pub fn create(path: &Path, metadata: &[(&str, Meta)], plan: Vec<PlannedTensor>) -> std::io::Result<Self> {
        let mut h = Vec::new();
        h.extend_from_slice(b"GGUF");
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(plan.len() as u64).to_le_bytes());
        h.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            string(&mut h, k);
            match v {
                Meta::U32(x) => {
                    h.extend_from_slice(&4u32.to_le_bytes());
                    h.extend_from_slice(&x.to_le_bytes());
                }
                Meta::Str(s) => {
                    h.extend_from_slice(&8u32.to_le_bytes());
                    string(&mut h, s);
                }
            }
        }
        let mut offset = 0u64;
        let mut rel = Vec::with_capacity(plan.len());
        for t in &plan {
            string(&mut h, &t.name);
            h.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                h.extend_from_slice(&(d as u64).to_le_bytes());
            }
            h.extend_from_slice(&(t.t as u32).to_le_bytes());
            h.extend_from_slice(&offset.to_le_bytes());
            rel.push(offset);
            offset = (offset + t.bytes()).next_multiple_of(ALIGN);
        }
        h.resize(h.len().next_multiple_of(ALIGN as usize), 0);
        let data_start = h.len() as u64;
        let (tmp, file) = TmpFile::create(path)?;
        let mut w = BufWriter::new(&file);
        w.write_all(&h)?;
        w.flush()?;
        drop(w);
        let end = plan.last().map_or(data_start, |t| data_start + rel[rel.len() - 1] + t.bytes());
        file.set_len(end)?;
        let starts = rel.into_iter().map(|o| data_start + o).collect();
        Ok(GgufWriter { file, tmp, starts, plan })
    }

    /// Write `bytes` into planned tensor `i` at byte `offset` of its data.
    pub fn write_at(&self, i: usize, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        let t = &self.plan[i];
        if offset + bytes.len() as u64 > t.bytes() {
            return Err(std::io::Error::other(format!(
                "{}: {} bytes at {offset} overrun its {} bytes",
                t.name,
                bytes.len(),
                t.bytes()
            )));
        }
        self.file.write_all_at(bytes, self.starts[i] + offset)
    }

    /// Flush and move the file to its real name.
    pub fn finish(self) -> std::io::Result<()> {
        self.tmp.commit(self.file)
    }
}
