//! A GGUF reader: [`Gguf`] holds a whole file in memory, its validated metadata and tensor table.
//!
//! GGUF (ggml's model container, versions 2 and 3, which share this layout) is little-endian:
//!
//! ```text
//!  offset 0
//!  +--------+-------------+------------------+-------------------+
//!  | "GGUF" | version u32 | tensor_count u64 | metadata_count u64 |
//!  +--------+-------------+------------------+-------------------+
//!  offset 24: metadata_count entries                     (value encodings: see `value`)
//!  +--------------+---------------+-------+
//!  | key: string  | type code u32 | value |      string = len u64 | len bytes of UTF-8
//!  +--------------+---------------+-------+
//!  then tensor_count tensor infos
//!  +---------------+------------+------------------+-----------------+------------+
//!  | name: string  | n_dims u32 | ne: u64[n_dims]  | ggml type u32   | offset u64 |
//!  +---------------+------------+------------------+-----------------+------------+
//!  then zero padding up to a multiple of the alignment A (`general.alignment`, default 32)
//!  data section: each tensor's bytes at data_start + offset, offset a multiple of A
//! ```
//!
//! [`Gguf::parse`] checks, with a sentence that names the file and the field: the magic and
//! version; that every count, string and array fits in the bytes that remain (so garbage counts
//! never allocate); that strings are UTF-8 and keys and tensor names unique; that the alignment is
//! a power of two; that every tensor has 1 to 4 dimensions, a known type ([`GgmlType`]) and a first
//! dimension of whole blocks; and that every tensor's offset is aligned and its bytes lie inside
//! the file without overlapping another tensor's. What the metadata and tensors *mean* is the
//! business of the model loader ([`crate::model::gguf`]) and the tokenizer.

pub mod tensor;
pub mod value;

#[cfg(test)]
pub(crate) mod builder;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub use tensor::{GgmlType, TensorInfo};
pub use value::Value;

use crate::cursor::Cursor;
use crate::error::InferError;

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// The most dimensions a ggml tensor has.
pub const MAX_DIMS: u32 = 4;
/// How deeply arrays may nest inside arrays.
const MAX_ARRAY_DEPTH: usize = 4;

/// Whether the file at `path` starts with the GGUF magic (a file shorter than four bytes does not).
pub fn is_gguf(path: &Path) -> Result<bool, InferError> {
    use std::io::Read;
    let io = |source| InferError::Io { path: path.to_owned(), source };
    let mut magic = Vec::with_capacity(MAGIC.len());
    std::fs::File::open(path).map_err(io)?.take(MAGIC.len() as u64).read_to_end(&mut magic).map_err(io)?;
    Ok(magic == MAGIC)
}

/// A parsed GGUF file.
#[derive(Clone)]
pub struct Gguf {
    /// The file, for error messages.
    path: PathBuf,
    /// The whole file; tensor data is read from it in place.
    bytes: Vec<u8>,
    /// The format version (2 or 3).
    version: u32,
    /// The alignment of tensor data, a power of two.
    alignment: usize,
    /// Metadata by key.
    metadata: BTreeMap<String, Value>,
    /// Tensors in file order.
    tensors: Vec<TensorInfo>,
    /// Index into `tensors` by name.
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("bytes", &self.bytes.len())
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Reads and validates the file at `path`.
    pub fn read(path: &Path) -> Result<Self, InferError> {
        let bytes = std::fs::read(path).map_err(|source| InferError::Io { path: path.to_owned(), source })?;
        Self::parse(bytes, path)
    }

    /// Validates a file already in memory; `path` names it in errors.
    pub fn parse(bytes: Vec<u8>, path: &Path) -> Result<Self, InferError> {
        let (version, metadata, infos, infos_end) =
            parse_header(&bytes).map_err(|reason| InferError::Gguf { path: path.to_owned(), reason })?;
        let mut file = Self {
            path: path.to_owned(),
            bytes,
            version,
            alignment: DEFAULT_ALIGNMENT,
            metadata,
            tensors: Vec::new(),
            by_name: HashMap::new(),
        };
        file.alignment = file.alignment()?;
        file.tensors = place_tensors(infos, infos_end, file.alignment, file.bytes.len()).map_err(|r| file.error(r))?;
        file.by_name = file.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(file)
    }

    fn alignment(&self) -> Result<usize, InferError> {
        let Some(value) = self.get("general.alignment") else { return Ok(DEFAULT_ALIGNMENT) };
        match value.as_u64().and_then(|a| usize::try_from(a).ok()) {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => Ok(a),
            _ => Err(self.error(format!(
                "its general.alignment is {value:?}, but it must be a power of two no larger than 1 MiB"
            ))),
        }
    }

    /// An error about this file, `reason` completing the sentence "PATH is not a usable GGUF model: ".
    pub fn error(&self, reason: String) -> InferError {
        InferError::Gguf { path: self.path.clone(), reason }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// The metadata value at `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The value at `key`, or an error saying it is missing.
    fn require(&self, key: &str) -> Result<&Value, InferError> {
        self.get(key).ok_or_else(|| self.error(format!("its metadata has no {key}")))
    }

    fn wrong_type(&self, key: &str, value: &Value, wanted: &str) -> InferError {
        self.error(format!("its metadata {key} is {}, but it must be {wanted}", value.describe_type()))
    }

    /// The string at `key`.
    pub fn require_str(&self, key: &str) -> Result<&str, InferError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong_type(key, v, "a string"))
    }

    /// The non-negative integer at `key` (any integer type).
    pub fn require_u64(&self, key: &str) -> Result<u64, InferError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| self.wrong_type(key, v, "a non-negative integer"))
    }

    /// The float at `key` (`f32` or `f64`).
    pub fn require_f32(&self, key: &str) -> Result<f32, InferError> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| self.wrong_type(key, v, "a float"))
    }

    /// The boolean at `key`, if present.
    pub fn optional_bool(&self, key: &str) -> Result<Option<bool>, InferError> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, v, "a bool"))).transpose()
    }

    /// The array at `key`.
    pub fn require_array(&self, key: &str) -> Result<&[Value], InferError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.wrong_type(key, v, "an array"))
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of `tensor`, which must come from this file's [`tensors`](Self::tensors).
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        &self.bytes[tensor.start..][..tensor.size]
    }
}

/// A tensor info as read, before it is placed in the data section.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    code: u32,
    offset: u64,
}

type Header = (u32, BTreeMap<String, Value>, Vec<RawTensor>, usize);

fn parse_header(bytes: &[u8]) -> Result<Header, String> {
    let mut r = Cursor::at(bytes, 0);
    let magic = r.take(4).ok_or_else(|| format!("it is {} bytes long, too short for a GGUF header", bytes.len()))?;
    if magic != MAGIC {
        return Err(format!("it starts with {:?}, not the magic \"GGUF\"", String::from_utf8_lossy(magic)));
    }
    let truncated = |what: &str, at: usize| {
        format!(
            "it ends at byte {} in the middle of {what} (which starts at byte {at}); the file is truncated",
            bytes.len()
        )
    };
    let version = r.u32().ok_or_else(|| truncated("the version", 4))?;
    if !(2..=3).contains(&version) {
        return Err(format!("it is GGUF version {version}, but this reader knows versions 2 and 3"));
    }
    let tensor_count = r.u64().ok_or_else(|| truncated("the tensor count", 8))?;
    let metadata_count = r.u64().ok_or_else(|| truncated("the metadata count", 16))?;
    // Every metadata entry takes at least 13 bytes (empty key, type, one byte of value) and every
    // tensor info at least 32 (empty name, one dimension, type, offset).
    let fits = |count: u64, min: u64| count.checked_mul(min).is_some_and(|n| n <= r.remaining() as u64);
    if !fits(metadata_count, 13) || !fits(tensor_count, 32) {
        return Err(format!(
            "its header claims {metadata_count} metadata entries and {tensor_count} tensors, more than its {} \
             bytes can hold; the file is truncated or not GGUF",
            bytes.len()
        ));
    }

    let mut metadata = BTreeMap::new();
    for i in 0..metadata_count {
        let at = r.offset();
        let key = read_string(&mut r).map_err(|e| format!("metadata entry {i} (at byte {at}) has a bad key: {e}"))?;
        let code = r.u32().ok_or_else(|| truncated(&format!("the type of metadata {key}"), at))?;
        let value = read_value(&mut r, code, 0).map_err(|e| format!("its metadata {key} (at byte {at}) {e}"))?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("its metadata has the key {key} twice"));
        }
    }

    let mut tensors = Vec::with_capacity(tensor_count as usize);
    let mut names = HashMap::new();
    for i in 0..tensor_count {
        let at = r.offset();
        let bad = |e: String| format!("tensor info {i} (at byte {at}) {e}");
        let name = read_string(&mut r).map_err(|e| bad(format!("has a bad name: {e}")))?;
        let n_dims = r.u32().ok_or_else(|| truncated(&format!("tensor info {name}"), at))?;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(format!("tensor {name} has {n_dims} dimensions, but ggml tensors have 1 to {MAX_DIMS}"));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64().ok_or_else(|| truncated(&format!("tensor info {name}"), at))?);
        }
        let code = r.u32().ok_or_else(|| truncated(&format!("tensor info {name}"), at))?;
        let offset = r.u64().ok_or_else(|| truncated(&format!("tensor info {name}"), at))?;
        if names.insert(name.clone(), i).is_some() {
            return Err(format!("it has two tensors named {name}"));
        }
        tensors.push(RawTensor { name, dims, code, offset });
    }
    Ok((version, metadata, tensors, r.offset()))
}

/// Reads a GGUF string: a `u64` length and that many bytes of UTF-8.
fn read_string(r: &mut Cursor<'_>) -> Result<String, String> {
    let at = r.offset();
    let len = r.u64().ok_or("the file ends inside a string length")?;
    let bytes = usize::try_from(len).ok().and_then(|n| r.take(n)).ok_or_else(|| {
        format!("the string at byte {at} claims {len} bytes, but only {} remain; the file is truncated", r.remaining())
    })?;
    String::from_utf8(bytes.to_vec()).map_err(|e| format!("the string at byte {at} is not UTF-8 ({e})"))
}

/// Reads one value of type `code`; `depth` counts enclosing arrays. Errors complete "its metadata
/// KEY ...".
fn read_value(r: &mut Cursor<'_>, code: u32, depth: usize) -> Result<Value, String> {
    let short = || "runs past the end of the file; the file is truncated".to_owned();
    Ok(match code {
        0 => Value::U8(r.u8().ok_or_else(short)?),
        1 => Value::I8(i8::from_le_bytes([r.u8().ok_or_else(short)?])),
        2 => Value::U16(r.u16().ok_or_else(short)?),
        3 => Value::I16(r.u16().ok_or_else(short)? as i16),
        4 => Value::U32(r.u32().ok_or_else(short)?),
        5 => Value::I32(r.i32().ok_or_else(short)?),
        6 => Value::F32(r.f32().ok_or_else(short)?),
        7 => match r.u8().ok_or_else(short)? {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(format!("is a bool stored as {b}, but a bool is 0 or 1")),
        },
        value::STRING => Value::String(read_string(r).map_err(|e| format!("has a bad string: {e}"))?),
        value::ARRAY => {
            let elem = r.u32().ok_or_else(short)?;
            let count = r.u64().ok_or_else(short)?;
            if depth >= MAX_ARRAY_DEPTH {
                return Err(format!("nests arrays more than {MAX_ARRAY_DEPTH} deep"));
            }
            let min = value::fixed_size(elem).unwrap_or(if elem == value::STRING { 8 } else { 12 }) as u64;
            if count.checked_mul(min).is_none_or(|n| n > r.remaining() as u64) {
                return Err(format!(
                    "is an array of {count} {} values, more than the {} remaining bytes can hold; the file is \
                     truncated",
                    value::type_name(elem),
                    r.remaining()
                ));
            }
            let mut items = Vec::with_capacity(count as usize);
            for i in 0..count {
                items.push(read_value(r, elem, depth + 1).map_err(|e| format!("element {i} {e}"))?);
            }
            Value::Array(elem, items)
        }
        10 => Value::U64(r.u64().ok_or_else(short)?),
        11 => Value::I64(r.u64().ok_or_else(short)? as i64),
        12 => Value::F64(f64::from_bits(r.u64().ok_or_else(short)?)),
        other => return Err(format!("has the type code {other}, which is not a GGUF value type (0..=12)")),
    })
}

/// Places every tensor in the data section and checks sizes, alignment, bounds and overlaps.
fn place_tensors(
    raw: Vec<RawTensor>,
    infos_end: usize,
    alignment: usize,
    file_len: usize,
) -> Result<Vec<TensorInfo>, String> {
    let data_start = infos_end.next_multiple_of(alignment);
    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let name = &t.name;
        let ggml_type = GgmlType::from_code(t.code)
            .ok_or_else(|| format!("tensor {name} has ggml type code {}, which this reader does not know", t.code))?;
        let elements = t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n < 1 << 60);
        let Some(elements) = elements else {
            return Err(format!("tensor {name} has the impossible shape {:?}", t.dims));
        };
        let block = ggml_type.block_elements();
        if !t.dims[0].is_multiple_of(block) {
            return Err(format!(
                "tensor {name} is {ggml_type} with shape {:?}, but its first dimension must be a multiple of the \
                 {block}-element block",
                t.dims
            ));
        }
        let size = elements / block * ggml_type.block_bytes();
        if !t.offset.is_multiple_of(alignment as u64) {
            return Err(format!(
                "tensor {name} starts at data offset {}, which is not a multiple of the alignment {alignment}",
                t.offset
            ));
        }
        let start = (data_start as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(size));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(format!("tensor {name} has the impossible data offset {}", t.offset));
        };
        if end > file_len as u64 {
            return Err(format!(
                "tensor {name} ({ggml_type} {:?}, {size} bytes) spans bytes {start}..{end}, past the end of the \
                 {file_len}-byte file; the file is truncated",
                t.dims
            ));
        }
        tensors.push(TensorInfo { name: t.name, dims: t.dims, ggml_type, start: start as usize, size: size as usize });
    }
    let mut by_start: Vec<&TensorInfo> = tensors.iter().collect();
    by_start.sort_by_key(|t| t.start);
    for pair in by_start.windows(2) {
        if pair[0].start + pair[0].size > pair[1].start {
            return Err(format!("tensors {} and {} overlap in the data section", pair[0].name, pair[1].name));
        }
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::builder::GgufBuilder;
    use super::*;

    fn parse(bytes: Vec<u8>) -> Result<Gguf, String> {
        Gguf::parse(bytes, Path::new("m.gguf")).map_err(|e| e.to_string())
    }

    fn small() -> GgufBuilder {
        let mut b = GgufBuilder::new();
        b.kv("general.architecture", Value::String("llama".into()));
        b.kv("answer", Value::I32(42));
        b.kv("list", Value::Array(value::STRING, vec![Value::String("a".into()), Value::String("bc".into())]));
        b.tensor("a", &[4, 2], GgmlType::F32, &[0u8; 32]);
        b.tensor("b", &[32], GgmlType::Q8_0, &[1u8; 34]);
        b
    }

    #[test]
    fn a_small_file_round_trips_metadata_and_tensor_bytes() {
        let g = parse(small().build()).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.require_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.require_u64("answer").unwrap(), 42);
        assert_eq!(g.require_array("list").unwrap().len(), 2);
        let b = g.tensor("b").unwrap();
        assert_eq!((b.ggml_type, b.size, b.start % 32), (GgmlType::Q8_0, 34, 0));
        assert_eq!(g.tensor_data(b), &[1u8; 34]);
        assert_eq!(g.tensors().len(), 2);
    }

    #[test]
    fn missing_and_mistyped_keys_are_named() {
        let g = parse(small().build()).unwrap();
        let msg = g.require_u64("nope").unwrap_err().to_string();
        assert_eq!(msg, "m.gguf is not a usable GGUF model: its metadata has no nope");
        let msg = g.require_f32("list").unwrap_err().to_string();
        assert!(msg.contains("its metadata list is array of string, but it must be a float"), "{msg}");
    }

    #[test]
    fn a_wrong_magic_or_version_is_rejected() {
        let mut bytes = small().build();
        bytes[..4].copy_from_slice(b"GGML");
        assert!(parse(bytes).unwrap_err().contains("not the magic \"GGUF\""));
        let mut bytes = small().build();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(parse(bytes).unwrap_err().contains("GGUF version 1, but this reader knows versions 2 and 3"));
    }

    #[test]
    fn absurd_counts_are_rejected_before_allocating() {
        let mut bytes = small().build();
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(bytes).unwrap_err().contains("more than its"));
    }

    #[test]
    fn a_string_longer_than_the_file_is_reported_as_truncation() {
        let mut bytes = small().build();
        // The first key's length is at byte 24.
        bytes[24..32].copy_from_slice(&1_000_000u64.to_le_bytes());
        let msg = parse(bytes).unwrap_err();
        assert!(msg.contains("metadata entry 0 (at byte 24) has a bad key"), "{msg}");
        assert!(msg.contains("claims 1000000 bytes"), "{msg}");
    }

    #[test]
    fn a_truncated_data_section_names_the_tensor() {
        let bytes = small().build();
        let msg = parse(bytes[..bytes.len() - 1].to_vec()).unwrap_err();
        assert!(msg.contains("tensor b (Q8_0 [32], 34 bytes) spans bytes"), "{msg}");
        assert!(msg.contains("past the end"), "{msg}");
    }

    #[test]
    fn unknown_types_partial_blocks_and_misaligned_offsets_are_rejected() {
        let mut b = GgufBuilder::new();
        b.raw_tensor("t", &[32], 99, 0);
        assert!(parse(b.build()).unwrap_err().contains("tensor t has ggml type code 99"));
        let mut b = GgufBuilder::new();
        b.raw_tensor("t", &[16], GgmlType::Q4_1.code(), 0);
        assert!(parse(b.build()).unwrap_err().contains("multiple of the 32-element block"));
        let mut b = GgufBuilder::new();
        b.raw_tensor("t", &[1], 0, 4);
        assert!(parse(b.build()).unwrap_err().contains("not a multiple of the alignment 32"));
    }

    #[test]
    fn overlapping_tensors_and_duplicate_names_are_rejected() {
        let mut b = GgufBuilder::new();
        b.raw_tensor("x", &[16], 0, 0);
        b.raw_tensor("y", &[16], 0, 32);
        b.data(&[0u8; 128]);
        assert!(parse(b.build()).unwrap_err().contains("tensors x and y overlap"));
        let mut b = GgufBuilder::new();
        b.raw_tensor("x", &[1], 0, 0);
        b.raw_tensor("x", &[1], 0, 32);
        assert!(parse(b.build()).unwrap_err().contains("two tensors named x"));
    }

    #[test]
    fn a_custom_alignment_is_honoured_and_a_bad_one_refused() {
        let mut b = GgufBuilder::with_alignment(64);
        b.kv("general.alignment", Value::U32(64));
        b.tensor("a", &[1], GgmlType::F32, &[0u8; 4]);
        b.tensor("b", &[1], GgmlType::F32, &[7u8; 4]);
        let g = parse(b.build()).unwrap();
        assert_eq!(g.tensor("b").unwrap().start % 64, 0);
        assert_eq!(g.tensor_data(g.tensor("b").unwrap()), &[7u8; 4]);
        let mut b = GgufBuilder::new();
        b.kv("general.alignment", Value::U32(48));
        assert!(parse(b.build()).unwrap_err().contains("must be a power of two"));
    }

    #[test]
    fn bad_values_are_reported_with_their_key() {
        let mut b = GgufBuilder::new();
        b.raw_kv("flag", 7, &[2]);
        assert!(parse(b.build()).unwrap_err().contains("its metadata flag (at byte 24) is a bool stored as 2"));
        let mut b = GgufBuilder::new();
        b.raw_kv("weird", 13, &[0; 8]);
        assert!(parse(b.build()).unwrap_err().contains("type code 13, which is not a GGUF value type"));
        let mut b = GgufBuilder::new();
        b.kv("k", Value::U8(1));
        b.kv("k", Value::U8(2));
        assert!(parse(b.build()).unwrap_err().contains("the key k twice"));
    }
}
