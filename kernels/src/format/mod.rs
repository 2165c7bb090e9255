//! Page formats: what the bytes inside a page mean.
//!
//! A page holds K and V of `block_tokens` consecutive tokens of one layer, all KV heads. Every page
//! starts with a 64-byte [`header`] that names its format and geometry, so a page can be checked
//! before a byte of it is read. Its [`Format`] says how elements are encoded; its [`PageShape`] says
//! how many there are and where each one lives ([`layout`] for the 16-bit formats, [`quant`] for the
//! quantized ones, with one file per quantized format: [`q8`], [`q4`], [`q2`], [`k8v4`]). [`rows`]
//! writes and reads token rows of 16-bit pages, [`bounds`] gives every page's per-channel key bounds,
//! and [`quant`] converts 16-bit pages into quantized ones and back to `f32`; [`to_page`] turns a
//! quantized page back into a 16-bit page directly.
//!
//! Format codes are an ABI: they are stored in the shared session table (`format_tier & 0xff`) and
//! in every page header, and read by clients built from other versions of this crate. A code, once
//! given, never changes meaning; new formats take new codes.
//!
//! | code | format | keys | values | layout |
//! |---|---|---|---|---|
//! | 0 | (never used: a zeroed entry or header has no format) | | | |
//! | 1 | [`Format::F16`] | IEEE 754 binary16 | same | [`layout`] |
//! | 2 | [`Format::Bf16`] | bfloat16 (the top 16 bits of an f32) | same | [`layout`] |
//! | 3 | [`Format::Q8`] | 8-bit codes, per channel along tokens | 8-bit codes, per token, 32-channel groups | [`q8`] |
//! | 4 | [`Format::Q4`] | 4-bit codes, likewise | 4-bit codes, likewise | [`q4`] |
//! | 5 | [`Format::Q2`] | 2-bit codes, likewise | 2-bit codes, likewise | [`q2`] |
//! | 6 | (reserved for `mixed`) | | | |
//! | 7 | [`Format::K8V4`] | 8-bit codes | 4-bit codes | [`k8v4`] |

pub mod bounds;
#[cfg(target_arch = "x86_64")]
mod dequant_vbmi;
pub mod header;
pub mod k8v4;
pub mod layout;
pub mod q2;
pub mod q4;
pub mod q8;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_avx512;
pub(crate) mod read;
pub mod rows;
#[cfg(target_arch = "x86_64")]
mod rows_avx2;
#[cfg(target_arch = "x86_64")]
mod rows_avx512;
pub mod to_page;

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
    /// 8-bit asymmetric codes for keys and values (see [`q8`]).
    Q8 = 3,
    /// 4-bit asymmetric codes for keys and values (see [`q4`]).
    Q4 = 4,
    /// 2-bit asymmetric codes for keys and values (see [`q2`]).
    Q2 = 5,
    /// 8-bit key codes, 4-bit value codes (see [`k8v4`]): keys never get fewer bits than values.
    K8V4 = 7,
}

impl Format {
    /// Every format this build implements, in code order.
    pub const ALL: [Format; 6] = [Format::F16, Format::Bf16, Format::Q8, Format::Q4, Format::Q2, Format::K8V4];

    /// The quantized formats, the ones [`quant::quantize`] produces.
    pub const QUANTIZED: [Format; 4] = [Format::Q8, Format::Q4, Format::Q2, Format::K8V4];

    /// The ABI code stored in page-table entries and page headers.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The format with ABI code `code`, if this build implements it.
    pub const fn from_u8(code: u8) -> Option<Format> {
        match code {
            1 => Some(Format::F16),
            2 => Some(Format::Bf16),
            3 => Some(Format::Q8),
            4 => Some(Format::Q4),
            5 => Some(Format::Q2),
            7 => Some(Format::K8V4),
            _ => None,
        }
    }

    /// Whether elements are stored as codes plus per-group `(scale, min)` parameters.
    pub const fn is_quantized(self) -> bool {
        !matches!(self, Format::F16 | Format::Bf16)
    }

    /// Storage bits of one key element, excluding per-group parameters: 16, 8, 4 or 2.
    pub const fn k_bits(self) -> u32 {
        match self {
            Format::F16 | Format::Bf16 => 16,
            Format::Q8 | Format::K8V4 => 8,
            Format::Q4 => 4,
            Format::Q2 => 2,
        }
    }

    /// Storage bits of one value element, excluding per-group parameters: 16, 8, 4 or 2.
    pub const fn v_bits(self) -> u32 {
        match self {
            Format::F16 | Format::Bf16 => 16,
            Format::Q8 => 8,
            Format::Q4 | Format::K8V4 => 4,
            Format::Q2 => 2,
        }
    }

    /// Bits of page memory per K or V element, everything included: the header, the key-bounds
    /// summary of 16-bit pages, the quantization parameters and alignment padding, i.e.
    /// `8 × page_bytes / (2 × kv_heads × head_dim × block_tokens)`.
    pub fn bits_per_element(self, shape: PageShape) -> f64 {
        8.0 * shape.page_bytes(self) as f64 / (2 * shape.region_elements()) as f64
    }

    /// Short lowercase name, as used in configuration and messages.
    pub const fn name(self) -> &'static str {
        match self {
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
            Format::Q8 => "q8",
            Format::Q4 => "q4",
            Format::Q2 => "q2",
            Format::K8V4 => "k8v4",
        }
    }

    /// The format named `name` (as [`Format::name`] writes it), if any.
    pub fn from_name(name: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.name() == name)
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
        let codes: Vec<u8> = Format::ALL.iter().map(|f| f.as_u8()).collect();
        assert_eq!(codes, [1, 2, 3, 4, 5, 7]);
        for format in Format::ALL {
            assert_eq!(Format::from_u8(format.as_u8()), Some(format));
        }
        for code in [0u8, 6, 8, 255] {
            assert_eq!(Format::from_u8(code), None);
            assert_eq!(Format::try_from(code), Err(KernelError::UnsupportedFormat { code }));
        }
    }

    #[test]
    fn element_types_map_to_their_formats() {
        assert_eq!(Format::from(ElementType::F16), Format::F16);
        assert_eq!(Format::from(ElementType::Bf16), Format::Bf16);
        assert_eq!(Format::F16.k_bits(), 16);
        assert_eq!((Format::K8V4.k_bits(), Format::K8V4.v_bits()), (8, 4));
        assert_eq!(Format::Bf16.to_string(), "bf16");
    }
}
