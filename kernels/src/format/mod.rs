//! Page formats: what the bytes inside a page mean.
//!
//! A page holds K and V of `block_tokens` consecutive tokens of one layer, all KV heads. Its
//! [`Format`] says how elements are encoded; its [`PageShape`] says how many there are and where each
//! one lives ([`layout`]). [`rows`] writes and reads token rows in that layout.
//!
//! Format codes are an ABI: they are stored in the shared session table (`format_tier & 0xff`) and
//! read by clients built from other versions of this crate. A code, once given, never changes
//! meaning; new formats take new codes.
//!
//! | code | format | element |
//! |---|---|---|
//! | 0 | (never used: a zeroed entry has no format) | |
//! | 1 | [`Format::F16`] | IEEE 754 binary16, little-endian |
//! | 2 | [`Format::Bf16`] | bfloat16 (the top 16 bits of an f32), little-endian |
//! | 3, 4, 5, 6 | reserved for q8, q4, q2, mixed | |

pub mod layout;
pub mod rows;

use std::fmt;

use crate::error::KernelError;

pub use layout::PageShape;

/// How the elements of a page are encoded. The discriminant is the ABI code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Format {
    /// IEEE 754 binary16, 2 bytes little-endian per element.
    F16 = 1,
    /// bfloat16, 2 bytes little-endian per element.
    Bf16 = 2,
}

impl Format {
    /// Every format this build implements, in code order.
    pub const ALL: [Format; 2] = [Format::F16, Format::Bf16];

    /// The ABI code stored in page-table entries.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The format with ABI code `code`, if this build implements it.
    pub const fn from_u8(code: u8) -> Option<Format> {
        match code {
            1 => Some(Format::F16),
            2 => Some(Format::Bf16),
            _ => None,
        }
    }

    /// Storage bits per K or V element (excluding any per-group metadata of later formats).
    pub const fn bits_per_element(self) -> u32 {
        match self {
            Format::F16 | Format::Bf16 => 16,
        }
    }

    /// Short lowercase name, as used in configuration and messages.
    pub const fn name(self) -> &'static str {
        match self {
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
        }
    }

    /// Bytes per element for the 16-bit formats.
    pub(crate) const fn element_bytes(self) -> usize {
        match self {
            Format::F16 | Format::Bf16 => 2,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TryFrom<u8> for Format {
    type Error = KernelError;

    fn try_from(code: u8) -> Result<Self, Self::Error> {
        Format::from_u8(code).ok_or(KernelError::UnsupportedFormat { code })
    }
}

/// The element type a client writes into its tail pages (the uncompressed formats).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl From<ElementType> for Format {
    fn from(element: ElementType) -> Format {
        match element {
            ElementType::F16 => Format::F16,
            ElementType::Bf16 => Format::Bf16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_codes_round_trip_and_stay_fixed() {
        assert_eq!(Format::F16.as_u8(), 1);
        assert_eq!(Format::Bf16.as_u8(), 2);
        for format in Format::ALL {
            assert_eq!(Format::from_u8(format.as_u8()), Some(format));
        }
        for code in [0u8, 3, 4, 5, 6, 255] {
            assert_eq!(Format::from_u8(code), None);
            assert_eq!(Format::try_from(code), Err(KernelError::UnsupportedFormat { code }));
        }
    }

    #[test]
    fn element_types_map_to_their_formats() {
        assert_eq!(Format::from(ElementType::F16), Format::F16);
        assert_eq!(Format::from(ElementType::Bf16), Format::Bf16);
        assert_eq!(Format::F16.bits_per_element(), 16);
        assert_eq!(Format::Bf16.to_string(), "bf16");
    }
}
