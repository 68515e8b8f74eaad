//! Safetensors files mapped read-only: every tensor's dtype, shape and byte range, found through
//! `model.safetensors.index.json` or by reading every `*.safetensors` in the directory. Tensor
//! bytes are used in place (no copy; safetensors data may be only 2-byte aligned, so readers
//! decode with unaligned loads).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::ModelConfig;
use super::layout::Layout;
use super::WeightError;

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorRef {
    file: usize,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A mapped checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, TensorRef>,
    /// `__metadata__` of every file, merged (first file wins).
    metadata: HashMap<String, String>,
    /// Each layer's experts' naming once found: finding it takes up to 72 name lookups, and
    /// the layerwise writes ask for every expert (a tenth of an MXFP4 expert's write).
    layouts: Mutex<HashMap<usize, Layout>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpoint({}, {} files, {} tensors)", self.dir.display(), self.files.len(), self.tensors.len())
    }
}

impl Checkpoint {
    /// Open a directory of shards (or one `.safetensors` file).
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        fn io(p: &Path) -> impl FnOnce(std::io::Error) -> WeightError + '_ {
            move |source| WeightError::Io { path: p.to_path_buf(), source }
        }
        let (dir, mut shards) = if path.is_file() {
            (path.parent().unwrap_or(Path::new(".")).to_path_buf(), vec![path.to_path_buf()])
        } else {
            let mut v: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(io(path))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            (path.to_path_buf(), v)
        };
        // With an index, exactly the shards it names (a stale extra file is ignored).
        let index = dir.join("model.safetensors.index.json");
        if path.is_dir() && index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(io(&index))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| WeightError::Corrupt { path: index.clone(), detail: e.to_string() })?;
            let map = v["weight_map"].as_object().ok_or_else(|| WeightError::Corrupt {
                path: index.clone(),
                detail: "no \"weight_map\" object".into(),
            })?;
            let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            shards = names.into_iter().map(|n| dir.join(n)).collect();
        }
        if shards.is_empty() {
            return Err(WeightError::Empty { path: path.to_path_buf() });
        }
        let mut files = Vec::with_capacity(shards.len());
        let mut tensors = HashMap::new();
        let mut metadata = HashMap::new();
        for (fi, p) in shards.into_iter().enumerate() {
            let file = File::open(&p).map_err(io(&p))?;
            // SAFETY: mapped read-only; a checkpoint rewritten while mapped is the user's error
            // (as with every mmap-based loader), and reads stay in bounds of the mapping.
            let map = unsafe { Mmap::map(&file) }.map_err(io(&p))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| WeightError::Corrupt { path: p.clone(), detail: corrupt_detail(&map, e) })?;
            if let Ok((_, m)) = SafeTensors::read_metadata(&map) {
                for (k, v) in m.metadata().iter().flatten() {
                    metadata.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
            let base = map.as_ptr() as usize;
            for (name, t) in st.tensors() {
                let start = t.data().as_ptr() as usize - base;
                let r = TensorRef {
                    file: fi,
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    start,
                    end: start + t.data().len(),
                };
                tensors.insert(name, r);
            }
            files.push((p, map));
        }
        Ok(Checkpoint { dir, files, tensors, metadata, layouts: Mutex::default() })
    }

    /// The directory it was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A tensor's description.
    pub fn get(&self, name: &str) -> Option<&TensorRef> {
        self.tensors.get(name)
    }

    /// A tensor's bytes, in place in the mapping.
    pub fn bytes(&self, t: &TensorRef) -> &[u8] {
        &self.files[t.file].1[t.start..t.end]
    }

    /// Drop a tensor's pages from this process's resident set (they stay in the page cache and
    /// are read again if touched), so a converter streaming layer by layer stays at one layer.
    pub fn release(&self, t: &TensorRef) {
        const PAGE: usize = 4096;
        let (start, end) = (t.start.next_multiple_of(PAGE), t.end / PAGE * PAGE);
        if end > start {
            // SAFETY: a read-only shared file mapping: MADV_DONTNEED only drops our page-table
            // entries; later reads fault the file's (unchanged) contents back in. Only whole
            // pages inside this tensor are advised.
            let _ = unsafe {
                self.files[t.file].1.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A `__metadata__` value of the files.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// The file holding a tensor.
    pub fn file_of(&self, t: &TensorRef) -> &Path {
        &self.files[t.file].0
    }

    /// Layer `layer`'s layout: the one `find` gave before, else what it gives now (kept if found).
    pub(super) fn layout(
        &self,
        layer: usize,
        find: impl FnOnce() -> Result<Layout, WeightError>,
    ) -> Result<Layout, WeightError> {
        let known = self.layouts.lock().unwrap_or_else(|e| e.into_inner()).get(&layer).cloned();
        if let Some(l) = known {
            return Ok(l);
        }
        let l = find()?;
        self.layouts.lock().unwrap_or_else(|e| e.into_inner()).insert(layer, l.clone());
        Ok(l)
    }

    /// `config.json` beside the weights.
    pub fn config(&self) -> Result<ModelConfig, WeightError> {
        ModelConfig::read(&self.dir.join("config.json"))
    }
}

/// What is wrong with a file safetensors refused, naming the tensor: the first whose bytes run
/// past the end (a truncated file) or whose byte range does not fit its shape and dtype, else
/// the parser's words.
fn corrupt_detail(map: &[u8], e: safetensors::SafeTensorError) -> String {
    if let safetensors::SafeTensorError::InvalidOffset(name) = &e {
        return format!("tensor {name}: its data does not start where the previous tensor's ends");
    }
    let header = map.get(..8).and_then(|b| usize::try_from(u64::from_le_bytes(b.try_into().ok()?)).ok());
    let json = header.and_then(|n| {
        Some((n, serde_json::from_slice::<serde_json::Value>(map.get(8..8usize.checked_add(n)?)?).ok()?))
    });
    if let Some(n) = header.filter(|n| n.saturating_add(8) > map.len()) {
        return format!("its header claims {n} bytes but only {} follow: truncated?", map.len().saturating_sub(8));
    }
    let Some((n, serde_json::Value::Object(tensors))) = json else { return e.to_string() };
    let data = (map.len() - 8 - n) as u64;
    let mut infos: Vec<(&String, u64, u64, Option<u64>)> = tensors
        .iter()
        .filter_map(|(name, v)| {
            let (start, end) = (v["data_offsets"][0].as_u64()?, v["data_offsets"][1].as_u64()?);
            let elems = v["shape"].as_array()?.iter().try_fold(1u64, |n, d| n.checked_mul(d.as_u64()?));
            let bits = match v["dtype"].as_str()? {
                "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => Some(8),
                "U16" | "I16" | "F16" | "BF16" => Some(16),
                "U32" | "I32" | "F32" => Some(32),
                "U64" | "I64" | "F64" => Some(64),
                _ => None,
            };
            Some((name, start, end, elems.zip(bits).and_then(|(n, b)| n.checked_mul(b)).map(|b| b / 8)))
        })
        .collect();
    infos.sort_by_key(|t| t.1);
    if let Some((name, start, end, _)) = infos.iter().find(|t| t.2 > data) {
        return format!(
            "tensor {name}: data [{start}, {end}) lies beyond the end of the file ({data} data bytes): truncated?"
        );
    }
    if let Some((name, start, end, Some(want))) =
        infos.iter().find(|t| t.3.is_some_and(|w| t.2.checked_sub(t.1) != Some(w)))
    {
        return format!("tensor {name}: data [{start}, {end}) does not hold the {want} bytes its shape and dtype need");
    }
    e.to_string()
}
