//! [`GgufBuilder`]: writes small GGUF files in memory, for tests of the reader, the model loader and
//! the tokenizer. Test-only; it writes exactly the layout documented in the parent module.

use super::tensor::GgmlType;
use super::value::Value;

/// Collects metadata and tensors, then lays them out as a GGUF v3 file.
#[derive(Debug)]
pub(crate) struct GgufBuilder {
    alignment: usize,
    metadata: Vec<u8>,
    metadata_count: u64,
    infos: Vec<u8>,
    tensor_count: u64,
    data: Vec<u8>,
}

impl GgufBuilder {
    pub(crate) fn new() -> Self {
        Self::with_alignment(super::DEFAULT_ALIGNMENT)
    }

    /// A builder that pads tensor data to `alignment` (the caller writes `general.alignment`).
    pub(crate) fn with_alignment(alignment: usize) -> Self {
        Self {
            alignment,
            metadata: Vec::new(),
            metadata_count: 0,
            infos: Vec::new(),
            tensor_count: 0,
            data: Vec::new(),
        }
    }

    pub(crate) fn kv(&mut self, key: &str, v: Value) -> &mut Self {
        let mut encoded = Vec::new();
        encode_value(&v, &mut encoded);
        self.raw_kv(key, v.type_code(), &encoded)
    }

    /// A metadata entry with an arbitrary type code and value bytes.
    pub(crate) fn raw_kv(&mut self, key: &str, code: u32, value: &[u8]) -> &mut Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(code.to_le_bytes());
        self.metadata.extend(value);
        self.metadata_count += 1;
        self
    }

    /// A tensor whose bytes are appended to the data section, aligned.
    pub(crate) fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, bytes: &[u8]) -> &mut Self {
        let offset = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(offset, 0);
        self.data.extend(bytes);
        self.raw_tensor(name, dims, ty.code(), offset as u64)
    }

    /// A tensor info with arbitrary fields and no data.
    pub(crate) fn raw_tensor(&mut self, name: &str, dims: &[u64], code: u32, offset: u64) -> &mut Self {
        put_string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(code.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.tensor_count += 1;
        self
    }

    /// Raw bytes appended to the data section.
    pub(crate) fn data(&mut self, bytes: &[u8]) -> &mut Self {
        self.data.extend(bytes);
        self
    }

    pub(crate) fn build(&self) -> Vec<u8> {
        let mut out = super::MAGIC.to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.tensor_count.to_le_bytes());
        out.extend(self.metadata_count.to_le_bytes());
        out.extend(&self.metadata);
        out.extend(&self.infos);
        if !self.data.is_empty() {
            out.resize(out.len().next_multiple_of(self.alignment), 0);
            out.extend(&self.data);
        }
        out
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn encode_value(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_string(out, s),
        Value::Array(elem, items) => {
            out.extend(elem.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                encode_value(item, out);
            }
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}
