//! [`Value`]: one GGUF metadata value, and how each type is encoded.
//!
//! Every value is preceded in the file by its type code (`u32`); arrays carry their element type
//! once, then a count, then the elements without per-element type codes. Little-endian throughout.
//!
//! ```text
//!  code  type     encoding                    code  type     encoding
//!   0    u8       1 byte                        7    bool     1 byte, 0 or 1
//!   1    i8       1 byte                        8    string   len: u64 | len bytes of UTF-8
//!   2    u16      2 bytes                       9    array    elem type: u32 | count: u64 | elements
//!   3    i16      2 bytes                      10    u64      8 bytes
//!   4    u32      4 bytes                      11    i64      8 bytes
//!   5    i32      4 bytes                      12    f64      8 bytes
//!   6    f32      4 bytes
//! ```

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: the element type code and the elements (all of that type).
    Array(u32, Vec<Value>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

/// The type code of an array.
pub const ARRAY: u32 = 9;
/// The type code of a string.
pub const STRING: u32 = 8;

/// The name of a type code, for messages.
pub fn type_name(code: u32) -> &'static str {
    match code {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        STRING => "string",
        ARRAY => "array",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => "unknown",
    }
}

/// Bytes one value of a fixed-size type occupies; `None` for strings, arrays and unknown codes.
pub fn fixed_size(code: u32) -> Option<usize> {
    match code {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

impl Value {
    /// The type code.
    pub fn type_code(&self) -> u32 {
        match self {
            Self::U8(_) => 0,
            Self::I8(_) => 1,
            Self::U16(_) => 2,
            Self::I16(_) => 3,
            Self::U32(_) => 4,
            Self::I32(_) => 5,
            Self::F32(_) => 6,
            Self::Bool(_) => 7,
            Self::String(_) => STRING,
            Self::Array(..) => ARRAY,
            Self::U64(_) => 10,
            Self::I64(_) => 11,
            Self::F64(_) => 12,
        }
    }

    /// A description of the type for messages: `u32`, or `array of string`.
    pub fn describe_type(&self) -> String {
        match self {
            Self::Array(elem, _) => format!("array of {}", type_name(*elem)),
            other => type_name(other.type_code()).to_owned(),
        }
    }

    /// Any integer type holding a value that is not negative, as `u64`. Converters write counts as
    /// `u32`, `i32` or `u64` depending on their version, so readers accept them all.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type, as `i64` (`None` for a `u64` above `i64::MAX`).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// An `f32`, or an `f64` narrowed to `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            Self::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements of an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(_, items) => Some(items),
            _ => None,
        }
    }
}
