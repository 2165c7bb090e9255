//! [`GgmlType`]: the element types a GGUF tensor may have, and [`TensorInfo`]: where a tensor lies.
//!
//! A ggml type stores its elements in blocks: `block_elements` consecutive elements of the first
//! dimension take `block_bytes` bytes. A tensor's first dimension must therefore be a whole number
//! of blocks, and its size is `elements / block_elements × block_bytes`. The table covers ggml's
//! stable, widely used types (the plain floats and integers, the legacy `Q*_0`/`Q*_1` and the
//! k-quants); a file with any other type code is refused by the reader, because its size, and so
//! the position of everything after it, cannot be checked.
//!
//! ```text
//!  code  name  elems  bytes        code  name  elems  bytes        code  name  elems  bytes
//!   0    F32     1      4            8   Q8_0    32     34          14   Q6_K   256    210
//!   1    F16     1      2            9   Q8_1    32     36          15   Q8_K   256    292
//!   2    Q4_0   32     18           10   Q2_K   256     84          24   I8       1      1
//!   3    Q4_1   32     20           11   Q3_K   256    110          25   I16      1      2
//!   6    Q5_0   32     22           12   Q4_K   256    144          26   I32      1      4
//!   7    Q5_1   32     24           13   Q5_K   256    176          27   I64      1      8
//!                                                                   28   F64      1      8
//!                                                                   30   BF16     1      2
//! ```

/// A ggml tensor element type this reader can size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, reason = "the names ggml and GGUF tools print")]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// 4-bit, scale per 32.
    Q4_0,
    /// 4-bit, scale and offset per 32.
    Q4_1,
    /// 5-bit, scale per 32.
    Q5_0,
    /// 5-bit, scale and offset per 32.
    Q5_1,
    /// 8-bit, scale per 32.
    Q8_0,
    /// 8-bit, scale and sum per 32.
    Q8_1,
    /// k-quant, 2-bit.
    Q2_K,
    /// k-quant, 3-bit.
    Q3_K,
    /// k-quant, 4-bit.
    Q4_K,
    /// k-quant, 5-bit.
    Q5_K,
    /// k-quant, 6-bit.
    Q6_K,
    /// k-quant, 8-bit.
    Q8_K,
    /// 8-bit integer.
    I8,
    /// 16-bit integer.
    I16,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
    /// 64-bit float.
    F64,
    /// bfloat16.
    BF16,
}

/// Code, type, elements per block, bytes per block: the table in the module documentation.
const TABLE: [(u32, GgmlType, u64, u64); 20] = [
    (0, GgmlType::F32, 1, 4),
    (1, GgmlType::F16, 1, 2),
    (2, GgmlType::Q4_0, 32, 18),
    (3, GgmlType::Q4_1, 32, 20),
    (6, GgmlType::Q5_0, 32, 22),
    (7, GgmlType::Q5_1, 32, 24),
    (8, GgmlType::Q8_0, 32, 34),
    (9, GgmlType::Q8_1, 32, 36),
    (10, GgmlType::Q2_K, 256, 84),
    (11, GgmlType::Q3_K, 256, 110),
    (12, GgmlType::Q4_K, 256, 144),
    (13, GgmlType::Q5_K, 256, 176),
    (14, GgmlType::Q6_K, 256, 210),
    (15, GgmlType::Q8_K, 256, 292),
    (24, GgmlType::I8, 1, 1),
    (25, GgmlType::I16, 1, 2),
    (26, GgmlType::I32, 1, 4),
    (27, GgmlType::I64, 1, 8),
    (28, GgmlType::F64, 1, 8),
    (30, GgmlType::BF16, 1, 2),
];

impl GgmlType {
    /// The type with ggml code `code`, if this reader knows it.
    pub fn from_code(code: u32) -> Option<Self> {
        TABLE.iter().find(|row| row.0 == code).map(|row| row.1)
    }

    fn row(self) -> (u32, GgmlType, u64, u64) {
        *TABLE.iter().find(|row| row.1 == self).expect("every variant has a row in TABLE")
    }

    /// The ggml code.
    pub fn code(self) -> u32 {
        self.row().0
    }

    /// Elements per block.
    pub fn block_elements(self) -> u64 {
        self.row().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.row().3
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// A tensor's name, shape, type and place in the file, as validated by the reader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// The ggml shape `[ne0, ne1, ...]`: `ne0` is the fastest-varying (contiguous) dimension, so a
    /// matrix `[in, out]` is stored row-major as `W[out][in]`.
    pub dims: Vec<u64>,
    /// The element type.
    pub ggml_type: GgmlType,
    /// Offset of the first byte from the start of the file (not from the data section).
    pub start: usize,
    /// Bytes the tensor occupies.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements (the product of `dims`).
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape as ggml tools print it: `[576, 49152]`.
    pub fn shape(&self) -> String {
        format!("{:?}", self.dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_through_its_code() {
        for (code, ty, elems, bytes) in TABLE {
            assert_eq!(GgmlType::from_code(code), Some(ty));
            assert_eq!((ty.code(), ty.block_elements(), ty.block_bytes()), (code, elems, bytes));
        }
        assert_eq!(GgmlType::from_code(4), None, "Q4_2 was removed from ggml");
        assert_eq!(GgmlType::Q4_1.to_string(), "Q4_1");
    }
}
