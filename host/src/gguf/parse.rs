//! The GGUF container (v2 and v3, little-endian) parsed from a byte slice: header, metadata
//! and tensor infos, every length and offset checked against the bytes there are, so a
//! truncated or corrupt file is an error naming what is wrong, never a panic or a huge
//! allocation.

use std::fmt;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any of GGUF's integer types, widened.
    Int(i128),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// A UTF-8 string (invalid UTF-8 replaced).
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as a non-negative integer.
    pub fn as_usize(&self) -> Option<usize> {
        match *self {
            Value::Int(v) => usize::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(v) => write!(f, "{v}"),
            Value::Float(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Array(a) => write!(f, "[{} values]", a.len()),
        }
    }
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// Dimensions, ggml order (`ne0`, the contiguous one, first).
    pub dims: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// Offset of its data from the start of the data section.
    pub offset: u64,
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct Header {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of tensor data (`general.alignment`, default 32).
    pub alignment: usize,
    /// Absolute offset of the data section.
    pub data_start: usize,
}

impl Header {
    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

/// Deepest array nesting accepted (real files use 1).
const MAX_DEPTH: usize = 4;

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            format!("truncated: {what} needs {n} bytes at offset {}, the file has {}", self.at, self.b.len())
        })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    /// A count of items each at least `min_size` bytes: more than the rest of the file could
    /// hold is corrupt (and would otherwise allocate without bound).
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize, String> {
        let n = self.u64(what)?;
        let room = (self.b.len() - self.at) / min_size.max(1);
        usize::try_from(n).ok().filter(|&n| n <= room).ok_or_else(|| {
            let (at, left) = (self.at - 8, self.b.len() - self.at);
            format!("truncated or corrupt: {what} = {n} at offset {at} cannot fit in the {left} bytes left")
        })
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.count(what, 1)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, String> {
        let mut int = |n: usize, signed: bool| -> Result<Value, String> {
            let b = self.take(n, key)?;
            let mut w = [0u8; 16];
            w[..n].copy_from_slice(b);
            if signed && b[n - 1] & 0x80 != 0 {
                w[n..].fill(0xFF);
            }
            Ok(Value::Int(i128::from_le_bytes(w)))
        };
        Ok(match ty {
            0 => int(1, false)?,
            1 => int(1, true)?,
            2 => int(2, false)?,
            3 => int(2, true)?,
            4 => int(4, false)?,
            5 => int(4, true)?,
            10 => int(8, false)?,
            11 => int(8, true)?,
            6 => Value::Float(f64::from(f32::from_le_bytes(self.take(4, key)?.try_into().expect("4 bytes")))),
            12 => Value::Float(f64::from_le_bytes(self.take(8, key)?.try_into().expect("8 bytes"))),
            7 => Value::Bool(self.take(1, key)?[0] != 0),
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("metadata {key}: arrays nested deeper than {MAX_DEPTH}"));
                }
                let elem = self.u32(key)?;
                let n = self.count(key, 1)?;
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(v)
            }
            t => return Err(format!("metadata {key}: unknown value type {t} at offset {}", self.at - 4)),
        })
    }
}

/// Parse a GGUF file's header from its bytes.
pub fn parse(b: &[u8]) -> Result<Header, String> {
    let mut r = Reader { b, at: 0 };
    let magic = r.take(4, "the magic")?;
    if magic != b"GGUF" {
        return Err(format!("not a GGUF file: it starts with {magic:02x?}, expected \"GGUF\""));
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (2 and 3 are)"));
    }
    // A tensor info is at least 8 (name) + 4 + 4 + 8 bytes; a metadata pair 8 + 4 + 1.
    let n_tensors = r.u64("the tensor count")?;
    let n_kv = r.count("the metadata count", 13)?;
    let mut metadata = Vec::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let ty = r.u32(&key)?;
        let v = r.value(ty, &key, 0)?;
        metadata.push((key, v));
    }
    let room = (b.len() - r.at) / 24;
    let n_tensors = usize::try_from(n_tensors).ok().filter(|&n| n <= room).ok_or_else(|| {
        format!("truncated or corrupt: tensor count {n_tensors} cannot fit in the {} bytes left", b.len() - r.at)
    })?;
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string("a tensor name")?;
        let nd = r.u32(&name)? as usize;
        if nd == 0 || nd > 4 {
            return Err(format!("tensor {name}: {nd} dimensions (GGUF tensors have 1 to 4)"));
        }
        let dims = (0..nd).map(|_| r.u64(&name)).collect::<Result<Vec<_>, _>>()?;
        let type_id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        tensors.push(TensorInfo { name, dims, type_id, offset });
    }
    let header = Header { version, metadata, tensors, alignment: 32, data_start: 0 };
    let alignment = match header.get("general.alignment") {
        None => 32,
        Some(v) => v
            .as_usize()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| format!("general.alignment = {v} is not a power of two"))?,
    };
    let data_start = r.at.next_multiple_of(alignment);
    for t in &header.tensors {
        if t.offset % alignment as u64 != 0 {
            return Err(format!(
                "tensor {}: offset {} is not a multiple of the alignment {alignment}",
                t.name, t.offset
            ));
        }
    }
    Ok(Header { alignment, data_start, ..header })
}
