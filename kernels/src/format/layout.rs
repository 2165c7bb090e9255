//! Where each region of a page lives, for every format, and where each K and V element of a 16-bit
//! page lives.
//!
//! Every page starts with the 64-byte [header](super::header). 16-bit pages (f16, bf16) then hold a
//! key-bounds summary (per KV head and channel, the smallest and largest key written so far, in the
//! page's own element type, Quest-style) and the K and V regions. Keys are channel-major, so one
//! vector load covers consecutive tokens of one channel and decode attention gets scores for many
//! tokens without horizontal sums; values are token-major, one row per token, as they are
//! accumulated. Elements are 2 bytes, little-endian (f16 or bf16 bits). Regions start on 64-byte
//! boundaries (relative to the page, whose frame the daemon allocates 64-byte aligned); the gaps
//! are zero.
//!
//! ```text
//!  offset 0            64                        k_offset                      v_offset
//!  +------------------+-------------------------+-----------------------------+-----------------------------+
//!  | header (64 B)    | bounds: [H][D] × (min,  | K: [H][D][B] elements       | V: [H][B][D] elements       |
//!  | format, geometry | max), 2 B each; padded  | h0 d0: t0 t1 ... t(B-1) |   | h0 t0: d0 ... d(D-1) |      |
//!  |                  | to 64 B                 | h0 d1: t0 ... | ...         | h0 t1: d0 ... | ...         |
//!  +------------------+-------------------------+-----------------------------+-----------------------------+
//!  k_offset   = 64 + round_up(4·H·D, 64)
//!  v_offset   = k_offset + round_up(2·H·D·B, 64)
//!  page_bytes = v_offset + round_up(2·H·B·D, 64)            (H = kv_heads, D = head_dim, B = block_tokens)
//! ```
//!
//! An initialized but empty page ([`super::header::init_page`]) has bounds `min = +∞`, `max = −∞`;
//! every row write widens them ([`super::rows`]), so they always contain every key written (a
//! reused slot may leave them wider than the keys now stored, never narrower). NaN keys are left out
//! of the bounds.
//!
//! Quantized pages have no bounds region (their key parameters bound each channel) and their own
//! K and V sections, described in [`super::quant`]. [`PageShape`]'s region methods give the offsets
//! of every format; readers compute them from the shape, never from the header, and only check that
//! the header agrees.

use crate::error::KernelError;
use crate::format::Format;
use crate::format::header::HEADER_BYTES;
use crate::format::quant::V_GROUP;

/// The dimensions of one page: how many KV heads, elements per head, and token slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageShape {
    /// KV heads stored in the page.
    pub kv_heads: usize,
    /// Elements per head (per K or V row).
    pub head_dim: usize,
    /// Token slots in the page.
    pub block_tokens: usize,
}

/// Byte extents of a page's regions, computed in `u64` so oversized shapes cannot overflow.
#[derive(Clone, Copy, Debug)]
struct Regions {
    bounds_offset: u64,
    k_offset: u64,
    k_bytes: u64,
    v_offset: u64,
    v_bytes: u64,
    page_bytes: u64,
}

const fn round64(x: u64) -> u64 {
    x.div_ceil(64) * 64
}

impl PageShape {
    /// Elements in the K region (equal to the V region): `kv_heads × head_dim × block_tokens`.
    ///
    /// Only meaningful for shapes that pass [`PageShape::validate`], which rules out overflow.
    pub const fn region_elements(self) -> usize {
        self.kv_heads * self.head_dim * self.block_tokens
    }

    #[inline]
    const fn regions(self, format: Format) -> Regions {
        let (h, d, b) = (self.kv_heads as u64, self.head_dim as u64, self.block_tokens as u64);
        let header = HEADER_BYTES as u64;
        if format.is_quantized() {
            let (kb, vb) = (format.k_bits() as u64, format.v_bits() as u64);
            let groups = d.div_ceil(V_GROUP as u64);
            let k_bytes = h * (4 * d + (d * b * kb).div_ceil(8));
            let v_offset = round64(header + k_bytes);
            let v_bytes = h * (4 * groups * b + (b * d * vb).div_ceil(8));
            Regions {
                bounds_offset: 0,
                k_offset: header,
                k_bytes,
                v_offset,
                v_bytes,
                page_bytes: round64(v_offset + v_bytes),
            }
        } else {
            let k_offset = header + round64(4 * h * d);
            let k_bytes = 2 * h * d * b;
            let v_offset = k_offset + round64(k_bytes);
            Regions {
                bounds_offset: header,
                k_offset,
                k_bytes,
                v_offset,
                v_bytes: k_bytes,
                page_bytes: v_offset + round64(k_bytes),
            }
        }
    }

    /// Byte offset of the key-bounds region of a 16-bit page; 0 (no such region) for quantized
    /// formats.
    pub const fn bounds_offset(self, format: Format) -> usize {
        self.regions(format).bounds_offset as usize
    }

    /// Byte offset of the K region (16-bit) or K section (quantized: parameters and codes).
    pub const fn k_offset(self, format: Format) -> usize {
        self.regions(format).k_offset as usize
    }

    /// Bytes of the K region or section, without padding.
    pub const fn k_bytes(self, format: Format) -> usize {
        self.regions(format).k_bytes as usize
    }

    /// Byte offset of the V region or section, a multiple of 64.
    pub const fn v_offset(self, format: Format) -> usize {
        self.regions(format).v_offset as usize
    }

    /// Bytes of the V region or section, without padding.
    pub const fn v_bytes(self, format: Format) -> usize {
        self.regions(format).v_bytes as usize
    }

    /// Bytes of one whole page in `format`: header, bounds or parameters, K and V, padding. The
    /// daemon sizes frames with this.
    pub const fn page_bytes(self, format: Format) -> usize {
        self.regions(format).page_bytes as usize
    }

    /// Byte offset in a 16-bit page of key channel `d` of KV head `h` at token slot `t`.
    pub const fn k_byte(self, h: usize, d: usize, t: usize) -> usize {
        self.k_offset(Format::F16) + 2 * ((h * self.head_dim + d) * self.block_tokens + t)
    }

    /// Byte offset in a 16-bit page of value channel `d` of KV head `h` at token slot `t`.
    pub const fn v_byte(self, h: usize, t: usize, d: usize) -> usize {
        self.v_offset(Format::F16) + 2 * ((h * self.block_tokens + t) * self.head_dim + d)
    }

    /// Byte offset in a 16-bit page of the `(min, max)` key bounds of channel `d` of KV head `h`
    /// (two elements of the page's type, min first).
    pub const fn bound_byte(self, h: usize, d: usize) -> usize {
        HEADER_BYTES + 4 * (h * self.head_dim + d)
    }

    /// Checks that every dimension is in `1..=65535` (a header stores each in 16 bits) and that a
    /// page of any format fits the header's 32-bit size field.
    pub fn validate(self) -> Result<(), KernelError> {
        for (what, value) in
            [("kv_heads", self.kv_heads), ("head_dim", self.head_dim), ("block_tokens", self.block_tokens)]
        {
            if value == 0 {
                return Err(KernelError::InvalidShape { what, value, rule: "a page needs at least one of each" });
            }
            if value > usize::from(u16::MAX) {
                return Err(KernelError::InvalidShape {
                    what,
                    value,
                    rule: "a page header stores it in 16 bits, so it must be at most 65535",
                });
            }
        }
        let largest = Format::ALL.iter().map(|f| self.regions(*f).page_bytes).max().unwrap_or(0);
        if largest > u64::from(u32::MAX) {
            return Err(KernelError::InvalidShape {
                what: "kv_heads × head_dim × block_tokens",
                value: self.region_elements(),
                rule: "a page of that many elements exceeds the 4 GiB a page header can describe",
            });
        }
        Ok(())
    }

    /// Checks the rules a format adds to [`PageShape::validate`]: quantized pages need `head_dim`
    /// a multiple of 16 and `block_tokens` a multiple of 8, so codes fill whole bytes and vectors.
    pub fn check_format(self, format: Format) -> Result<(), KernelError> {
        self.validate()?;
        if format.is_quantized() {
            if !self.head_dim.is_multiple_of(16) {
                return Err(KernelError::InvalidShape {
                    what: "head_dim",
                    value: self.head_dim,
                    rule: "quantized pages need a multiple of 16",
                });
            }
            if !self.block_tokens.is_multiple_of(8) {
                return Err(KernelError::InvalidShape {
                    what: "block_tokens",
                    value: self.block_tokens,
                    rule: "quantized pages need a multiple of 8",
                });
            }
        }
        Ok(())
    }

    /// Checks the shape against `format` and that `page_len` bytes hold at least one page.
    pub fn check_page(self, format: Format, page_len: usize) -> Result<(), KernelError> {
        self.check_format(format)?;
        self.check_len(format, page_len)
    }

    /// The length half of [`PageShape::check_page`], for a shape already checked against `format`.
    pub(crate) fn check_len(self, format: Format, page_len: usize) -> Result<(), KernelError> {
        let need = self.page_bytes(format);
        if page_len < need {
            return Err(KernelError::PageTooShort {
                got: page_len,
                need,
                format,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                block_tokens: self.block_tokens,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: PageShape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };

    #[test]
    fn smollm2_f16_page_is_header_bounds_k_and_v_with_v_after_k() {
        let kv = 3 * 32 * 64 * 2;
        assert_eq!(SMOL.bounds_offset(Format::F16), 64);
        assert_eq!(SMOL.k_offset(Format::F16), 64 + 3 * 64 * 4);
        assert_eq!(SMOL.v_offset(Format::F16), SMOL.k_offset(Format::F16) + kv);
        assert_eq!(SMOL.page_bytes(Format::F16), 64 + 768 + 2 * kv);
        assert_eq!(SMOL.page_bytes(Format::Bf16), SMOL.page_bytes(Format::F16));
        let k = SMOL.k_offset(Format::F16);
        assert_eq!(SMOL.k_byte(0, 0, 0), k);
        assert_eq!(SMOL.k_byte(0, 0, 31), k + 62);
        assert_eq!(SMOL.k_byte(0, 1, 0), k + 64);
        assert_eq!(SMOL.k_byte(1, 0, 0), k + 64 * 32 * 2);
        let v = SMOL.v_offset(Format::F16);
        assert_eq!(SMOL.v_byte(0, 0, 0), v);
        assert_eq!(SMOL.v_byte(0, 1, 0), v + 128);
        assert_eq!(SMOL.v_byte(2, 31, 63) + 2, SMOL.page_bytes(Format::F16));
        assert_eq!(SMOL.bound_byte(2, 63) + 4, SMOL.k_offset(Format::F16));
    }

    #[test]
    fn regions_start_on_64_byte_boundaries_for_odd_shapes() {
        for shape in [
            PageShape { kv_heads: 1, head_dim: 1, block_tokens: 1 },
            PageShape { kv_heads: 3, head_dim: 5, block_tokens: 7 },
            PageShape { kv_heads: 2, head_dim: 48, block_tokens: 8 },
        ] {
            for format in Format::ALL {
                if shape.check_format(format).is_err() {
                    continue;
                }
                assert_eq!(shape.k_offset(format) % 64, 0, "{shape:?} {format}");
                assert_eq!(shape.v_offset(format) % 64, 0, "{shape:?} {format}");
                assert_eq!(shape.page_bytes(format) % 64, 0, "{shape:?} {format}");
                assert!(shape.k_offset(format) + shape.k_bytes(format) <= shape.v_offset(format));
                assert!(shape.v_offset(format) + shape.v_bytes(format) <= shape.page_bytes(format));
            }
        }
    }

    #[test]
    fn zero_dimension_is_rejected_with_its_name() {
        let shape = PageShape { head_dim: 0, ..SMOL };
        let err = shape.validate().unwrap_err();
        assert!(err.to_string().starts_with("head_dim is 0"), "{err}");
    }

    #[test]
    fn dimension_past_sixteen_bits_is_rejected() {
        let shape = PageShape { block_tokens: 65536, ..SMOL };
        let err = shape.validate().unwrap_err();
        assert!(err.to_string().contains("at most 65535"), "{err}");
        let huge = PageShape { kv_heads: 65535, head_dim: 65535, block_tokens: 2 };
        assert!(huge.validate().unwrap_err().to_string().contains("4 GiB"));
    }

    #[test]
    fn quantized_formats_need_whole_byte_vector_shapes() {
        let shape = PageShape { head_dim: 24, ..SMOL };
        assert!(shape.check_format(Format::F16).is_ok());
        let err = shape.check_format(Format::Q4).unwrap_err();
        assert_eq!(err.to_string(), "head_dim is 24, but quantized pages need a multiple of 16");
    }

    #[test]
    fn page_one_byte_short_is_rejected() {
        for format in Format::ALL {
            let need = SMOL.page_bytes(format);
            assert!(SMOL.check_page(format, need).is_ok());
            let err = SMOL.check_page(format, need - 1).unwrap_err();
            assert_eq!(err.kind(), crate::KernelErrorKind::BadLength);
        }
    }
}
