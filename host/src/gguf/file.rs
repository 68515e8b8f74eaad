//! GGUF files mapped read-only: one file, or every part of a split model
//! (`name-00001-of-00003.gguf`, any part given). Tensor bytes are read in place.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use kt_core::ggml::{id_name, GgmlType};
use memmap2::Mmap;

use super::parse::{parse, Header, Value};
use crate::error::WeightError;

/// One tensor of a GGUF file.
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    /// Its type.
    pub t: GgmlType,
    /// Dimensions, ggml order (`ne0`, the row length, first).
    pub dims: &'a [u64],
    /// Its bytes, in place in the mapping.
    pub bytes: &'a [u8],
}

struct Entry {
    file: usize,
    info: super::parse::TensorInfo,
    start: usize,
}

/// A mapped GGUF model.
pub struct GgufFile {
    path: PathBuf,
    maps: Vec<(PathBuf, Mmap)>,
    metadata: Header,
    tensors: HashMap<String, Entry>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GgufFile({}, {} file(s), {} tensors)", self.path.display(), self.maps.len(), self.tensors.len())
    }
}

/// `(prefix, count)` of a split file name `prefix-0000i-of-0000n.gguf`.
fn split_name(p: &Path) -> Option<(String, usize)> {
    let name = p.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let (rest, count) = name.rsplit_once("-of-")?;
    let (prefix, index) = rest.rsplit_once('-')?;
    let ok = |s: &str| s.len() == 5 && s.bytes().all(|c| c.is_ascii_digit());
    if !(ok(index) && ok(count)) {
        return None;
    }
    Some((prefix.to_string(), count.parse().ok()?))
}

impl GgufFile {
    /// Open a `.gguf` file, all parts of a split one, or every `*.gguf` of a directory (their
    /// tensors together, as KT's loader reads a directory).
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let parts = match split_name(path) {
            _ if path.is_dir() => {
                let rd =
                    std::fs::read_dir(path).map_err(|source| WeightError::Io { path: path.to_path_buf(), source })?;
                let mut v: Vec<PathBuf> = rd
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
                    .collect();
                v.sort();
                if v.is_empty() {
                    return Err(WeightError::Empty { path: path.to_path_buf() });
                }
                v
            }
            Some((prefix, n)) if n > 1 => {
                let dir = path.parent().unwrap_or(Path::new("."));
                (1..=n).map(|i| dir.join(format!("{prefix}-{i:05}-of-{n:05}.gguf"))).collect()
            }
            _ => vec![path.to_path_buf()],
        };
        let mut maps = Vec::with_capacity(parts.len());
        let mut tensors = HashMap::new();
        let mut first: Option<Header> = None;
        for (fi, p) in parts.into_iter().enumerate() {
            let io = |source| WeightError::Io { path: p.clone(), source };
            let file = File::open(&p).map_err(io)?;
            // SAFETY: mapped read-only; a file rewritten while mapped is the user's error (as
            // with every mmap-based loader), and every read is bounds-checked below.
            let map = unsafe { Mmap::map(&file) }.map_err(io)?;
            let corrupt = |detail: String| WeightError::Corrupt { path: p.clone(), detail };
            let h = parse(&map).map_err(corrupt)?;
            for info in &h.tensors {
                let start = usize::try_from(info.offset).ok().and_then(|o| o.checked_add(h.data_start));
                let Some(start) = start.filter(|&s| s <= map.len()) else {
                    return Err(corrupt(format!(
                        "tensor {}: data offset {} lies beyond the end of the file ({} bytes): truncated?",
                        info.name,
                        info.offset,
                        map.len()
                    )));
                };
                let e = Entry { file: fi, info: info.clone(), start };
                if tensors.insert(info.name.clone(), e).is_some() {
                    return Err(corrupt(format!("tensor {} appears twice", info.name)));
                }
            }
            first.get_or_insert(h);
            maps.push((p, map));
        }
        let metadata = first.expect("at least one file");
        Ok(GgufFile { path: path.to_path_buf(), maps, metadata, tensors })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value (of the first file).
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A metadata value that must be a non-negative integer.
    pub fn meta_usize(&self, key: &str) -> Result<usize, WeightError> {
        let v = self.meta(key).ok_or_else(|| self.config_error(format!("metadata key {key} is missing")))?;
        v.as_usize().ok_or_else(|| self.config_error(format!("metadata {key} = {v}, expected a non-negative integer")))
    }

    /// `general.architecture` (the prefix of the model's keys).
    pub fn arch(&self) -> Result<&str, WeightError> {
        let v = self.meta("general.architecture");
        v.and_then(Value::as_str).ok_or_else(|| self.config_error("metadata general.architecture is missing".into()))
    }

    pub(super) fn config_error(&self, detail: String) -> WeightError {
        WeightError::Config { path: self.path.clone(), detail }
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor, its type supported and its bytes inside the file.
    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>, WeightError> {
        let e = self.tensors.get(name).ok_or_else(|| WeightError::Missing { name: name.to_string() })?;
        let (path, map) = &self.maps[e.file];
        let Some(t) = GgmlType::from_id(e.info.type_id) else {
            return Err(WeightError::Dtype {
                name: name.to_string(),
                found: format!("{} (ggml type {})", id_name(e.info.type_id), e.info.type_id),
                expected:
                    "f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, \
                           mxfp4, iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs or iq3_s",
            });
        };
        let dims = &e.info.dims[..];
        let shape_err =
            |why: &str| WeightError::Corrupt { path: path.clone(), detail: format!("tensor {name}: {why}") };
        if dims[0] % t.block_elems() as u64 != 0 {
            return Err(shape_err(&format!(
                "row length {} is not a multiple of {t}'s block of {}",
                dims[0],
                t.block_elems()
            )));
        }
        let rows = dims[1..].iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let size = rows
            .and_then(|r| r.checked_mul((dims[0] / t.block_elems() as u64).checked_mul(t.block_bytes() as u64)?))
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| shape_err(&format!("dimensions {dims:?} overflow")))?;
        let bytes = e.start.checked_add(size).and_then(|end| map.get(e.start..end)).ok_or_else(|| {
            shape_err(&format!(
                "data [{}, {}) lies beyond the end of the file ({} bytes): truncated?",
                e.start,
                e.start.saturating_add(size),
                map.len()
            ))
        })?;
        Ok(GgufTensor { t, dims, bytes })
    }

    /// Drop a tensor's pages from this process's resident set (they stay in the page cache),
    /// so loading layer after layer keeps one layer of the file mapped in.
    pub fn release(&self, name: &str) {
        const PAGE: usize = 4096;
        let Ok(t) = self.tensor(name) else { return };
        let e = &self.tensors[name];
        let map = &self.maps[e.file].1;
        let (start, end) = (e.start.next_multiple_of(PAGE), (e.start + t.bytes.len()) / PAGE * PAGE);
        if end > start {
            // SAFETY: a read-only shared file mapping: MADV_DONTNEED only drops our page-table
            // entries; later reads fault the unchanged file contents back in.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }
}

/// Whether `path` is a GGUF model: a `.gguf` file, or a directory holding one.
pub fn is_gguf(path: &Path) -> bool {
    let gguf = |p: &Path| p.extension().is_some_and(|x| x == "gguf");
    if path.is_dir() {
        std::fs::read_dir(path).is_ok_and(|rd| rd.filter_map(|e| e.ok()).any(|e| gguf(&e.path())))
    } else {
        gguf(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        assert_eq!(
            split_name(Path::new("/m/Qwen3-30B-Q4_K_M-00002-of-00003.gguf")),
            Some(("Qwen3-30B-Q4_K_M".into(), 3))
        );
        assert_eq!(split_name(Path::new("model.gguf")), None);
        assert_eq!(split_name(Path::new("a-1-of-3.gguf")), None);
    }
}
