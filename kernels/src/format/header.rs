//! The 64-byte header at the start of every page, in every format.
//!
//! The header names the page's format and geometry so a page can be checked before a byte of it is
//! read: a page whose format byte, version, geometry or length is wrong is rejected with a
//! [`KernelError`] that names the field, never read out of bounds. Readers compute every offset from
//! the [`PageShape`] they were given and only check that the header's offsets agree; they never
//! address memory with an offset read from the page.
//!
//! ```text
//!  byte  0      1        2       3       4          6          8             10       12
//!       +------+--------+-------+-------+----------+----------+-------------+--------+------------+
//!       |format|version |k_bits |v_bits |kv_heads  |head_dim  |block_tokens |tokens  |page_bytes  |
//!       | u8   | u8 = 1 | u8    | u8    |u16 LE    |u16 LE    |u16 LE       |u16 LE  |u32 LE      |
//!       +------+--------+-------+-------+----------+----------+-------------+--------+------------+
//!  byte 16              20            24            28                                          64
//!       +--------------+-------------+-------------+--------------------------------------------+
//!       |bounds_offset |k_offset     |v_offset     | reserved, zero                             |
//!       |u32 LE        |u32 LE       |u32 LE       |                                            |
//!       +--------------+-------------+-------------+--------------------------------------------+
//! ```
//!
//! - `format`: the [`Format`] ABI code (1 f16, 2 bf16, 3 q8, 4 q4, 5 q2, 7 k8v4); 0 means the
//!   page was never initialized.
//! - `k_bits`, `v_bits`: code bits of keys and values (16 for the 16-bit formats).
//! - `tokens`: quantized pages: token slots encoded, `1..=block_tokens`, written by
//!   [`crate::format::quant::quantize`]. 16-bit pages: always 0, since the client's own token count
//!   says how many slots are filled (rows are appended without touching the header).
//! - `page_bytes`, `bounds_offset`, `k_offset`, `v_offset`: [`PageShape::page_bytes`] and the region
//!   offsets of the [layout](super::layout); `bounds_offset` is 0 for quantized formats.
//!
//! [`init_page`] writes the header and the empty key bounds of a new 16-bit page; the daemon calls
//! it on every frame it hands out. Quantized pages get their header from `quantize`, written last,
//! so a page whose quantization failed half-way is never mistaken for a valid one.

use half::{bf16, f16};

use crate::error::KernelError;
use crate::format::{Format, PageShape};

/// Bytes of the header at the start of every page.
pub const HEADER_BYTES: usize = 64;

/// The header layout this build writes and reads.
pub const HEADER_VERSION: u8 = 1;

/// First reserved byte; bytes `RESERVED..HEADER_BYTES` must be zero.
const RESERVED: usize = 28;

/// The decoded fields of a page header (see the module documentation for their meaning).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageHeader {
    /// The page's format.
    pub format: Format,
    /// Header layout version, [`HEADER_VERSION`].
    pub version: u8,
    /// Code bits per key element.
    pub k_bits: u8,
    /// Code bits per value element.
    pub v_bits: u8,
    /// KV heads stored in the page.
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Token slots in the page.
    pub block_tokens: u16,
    /// Quantized pages: token slots encoded; 16-bit pages: 0.
    pub tokens: u16,
    /// Bytes of the whole page, header included.
    pub page_bytes: u32,
    /// Byte offset of the key-bounds region (16-bit formats; 0 for quantized ones).
    pub bounds_offset: u32,
    /// Byte offset of the K region or section.
    pub k_offset: u32,
    /// Byte offset of the V region or section.
    pub v_offset: u32,
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Narrows a value [`PageShape::validate`] has bounded; saturates rather than wraps if it was not.
fn narrow16(x: usize) -> u16 {
    u16::try_from(x).unwrap_or(u16::MAX)
}

fn narrow32(x: usize) -> u32 {
    u32::try_from(x).unwrap_or(u32::MAX)
}

impl PageHeader {
    /// The header a page of `shape` in `format` must carry when it encodes `tokens` token slots
    /// (quantized formats, `1..=block_tokens`) or for any 16-bit page (`tokens` must be 0).
    pub fn new(shape: PageShape, format: Format, tokens: usize) -> Result<PageHeader, KernelError> {
        shape.check_format(format)?;
        if !tokens_valid(shape, format, tokens) {
            return Err(KernelError::HeaderTokens { got: tokens, format, block_tokens: shape.block_tokens });
        }
        Ok(Self::expected(shape, format, tokens))
    }

    /// [`PageHeader::new`] without the checks, for a shape that passed `check_format`.
    pub(crate) fn expected(shape: PageShape, format: Format, tokens: usize) -> PageHeader {
        PageHeader {
            format,
            version: HEADER_VERSION,
            k_bits: format.k_bits() as u8,
            v_bits: format.v_bits() as u8,
            kv_heads: narrow16(shape.kv_heads),
            head_dim: narrow16(shape.head_dim),
            block_tokens: narrow16(shape.block_tokens),
            tokens: narrow16(tokens),
            page_bytes: narrow32(shape.page_bytes(format)),
            bounds_offset: narrow32(shape.bounds_offset(format)),
            k_offset: narrow32(shape.k_offset(format)),
            v_offset: narrow32(shape.v_offset(format)),
        }
    }

    /// The 64 header bytes, reserved bytes zero.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0] = self.format.as_u8();
        out[1] = self.version;
        out[2] = self.k_bits;
        out[3] = self.v_bits;
        out[4..6].copy_from_slice(&self.kv_heads.to_le_bytes());
        out[6..8].copy_from_slice(&self.head_dim.to_le_bytes());
        out[8..10].copy_from_slice(&self.block_tokens.to_le_bytes());
        out[10..12].copy_from_slice(&self.tokens.to_le_bytes());
        out[12..16].copy_from_slice(&self.page_bytes.to_le_bytes());
        out[16..20].copy_from_slice(&self.bounds_offset.to_le_bytes());
        out[20..24].copy_from_slice(&self.k_offset.to_le_bytes());
        out[24..28].copy_from_slice(&self.v_offset.to_le_bytes());
        out
    }

    /// Parses the first 64 bytes of `page` without comparing them to any geometry: fails if there
    /// are fewer, if they are all zero (an uninitialized page), if the format code is unknown or if
    /// a reserved byte is set.
    pub fn decode(page: &[u8]) -> Result<PageHeader, KernelError> {
        let Some(bytes) = page.get(..HEADER_BYTES) else {
            return Err(KernelError::HeaderTooShort { got: page.len() });
        };
        if bytes.iter().all(|&b| b == 0) {
            return Err(KernelError::HeaderUninitialized);
        }
        let format = Format::try_from(bytes[0])?;
        if let Some(offset) = (RESERVED..HEADER_BYTES).find(|&i| bytes[i] != 0) {
            return Err(KernelError::HeaderReserved { offset, byte: bytes[offset] });
        }
        Ok(PageHeader {
            format,
            version: bytes[1],
            k_bits: bytes[2],
            v_bits: bytes[3],
            kv_heads: u16_at(bytes, 4),
            head_dim: u16_at(bytes, 6),
            block_tokens: u16_at(bytes, 8),
            tokens: u16_at(bytes, 10),
            page_bytes: u32_at(bytes, 12),
            bounds_offset: u32_at(bytes, 16),
            k_offset: u32_at(bytes, 20),
            v_offset: u32_at(bytes, 24),
        })
    }

    /// Checks that `page` is a whole page of `shape` in `format` and that its header says so,
    /// field by field; returns the header. The first mismatch is the error, in the order: length,
    /// uninitialized, format, version, reserved bytes, each geometry and offset field, tokens.
    pub fn validate(shape: PageShape, format: Format, page: &[u8]) -> Result<PageHeader, KernelError> {
        shape.check_page(format, page.len())?;
        let want = PageHeader::expected(shape, format, 0);
        // The common, valid case; any mismatch is explained field by field below.
        if let Some(tokens) = matching_tokens(shape, format, page, &want.encode()) {
            return Ok(PageHeader { tokens: narrow16(tokens), ..want });
        }
        if page[..HEADER_BYTES].iter().all(|&b| b == 0) {
            return Err(KernelError::HeaderUninitialized);
        }
        if page[0] != format.as_u8() {
            return Err(KernelError::HeaderFormat { got: page[0], want: format });
        }
        if page[1] != HEADER_VERSION {
            return Err(KernelError::HeaderVersion { got: page[1] });
        }
        let header = PageHeader::decode(page)?;
        let fields: [(&'static str, u64, u64); 9] = [
            ("k_bits", header.k_bits.into(), want.k_bits.into()),
            ("v_bits", header.v_bits.into(), want.v_bits.into()),
            ("kv_heads", header.kv_heads.into(), want.kv_heads.into()),
            ("head_dim", header.head_dim.into(), want.head_dim.into()),
            ("block_tokens", header.block_tokens.into(), want.block_tokens.into()),
            ("page_bytes", header.page_bytes.into(), want.page_bytes.into()),
            ("bounds_offset", header.bounds_offset.into(), want.bounds_offset.into()),
            ("k_offset", header.k_offset.into(), want.k_offset.into()),
            ("v_offset", header.v_offset.into(), want.v_offset.into()),
        ];
        if let Some(&(field, got, want)) = fields.iter().find(|(_, got, want)| got != want) {
            return Err(KernelError::HeaderField { field, got, want });
        }
        let tokens = usize::from(header.tokens);
        if !tokens_valid(shape, format, tokens) {
            return Err(KernelError::HeaderTokens { got: tokens, format, block_tokens: shape.block_tokens });
        }
        Ok(header)
    }
}

/// Whether a header of `format` may encode `tokens`: quantized pages hold `1..=block_tokens`
/// filled slots, 16-bit pages always say 0 (their filled count lives in the page table).
fn tokens_valid(shape: PageShape, format: Format, tokens: usize) -> bool {
    if format.is_quantized() { (1..=shape.block_tokens).contains(&tokens) } else { tokens == 0 }
}

/// The token count of the header at the start of `page` when it is `want` (the expected header of
/// `shape` in `format`, with `tokens` 0) but for that count and the count is valid; `None` otherwise.
/// The valid case of every header check: one or two short compares.
fn matching_tokens(shape: PageShape, format: Format, page: &[u8], want: &[u8; HEADER_BYTES]) -> Option<usize> {
    let tokens = usize::from(u16_at(page, 10));
    let matches = page[..10] == want[..10] && page[12..HEADER_BYTES] == want[12..];
    (matches && tokens_valid(shape, format, tokens)).then_some(tokens)
}

/// Writes the header of an empty 16-bit page of `shape` in `format` into `page` and sets every
/// key bound to empty (`min = +∞`, `max = −∞`, in the page's element type). The K and V regions are
/// left as they are (frames come zeroed from the daemon; unfilled slots are never read anyway).
///
/// Quantized formats are refused: their pages are written whole by
/// [`crate::format::quant::quantize`].
pub fn init_page(shape: PageShape, format: Format, page: &mut [u8]) -> Result<(), KernelError> {
    if format.is_quantized() {
        return Err(KernelError::NotRowWritable { format });
    }
    shape.check_page(format, page.len())?;
    page[..HEADER_BYTES].copy_from_slice(&PageHeader::expected(shape, format, 0).encode());
    let (lo, hi) = match format {
        Format::Bf16 => (bf16::INFINITY.to_bits(), bf16::NEG_INFINITY.to_bits()),
        _ => (f16::INFINITY.to_bits(), f16::NEG_INFINITY.to_bits()),
    };
    let mut pair = [0u8; 4];
    pair[..2].copy_from_slice(&lo.to_le_bytes());
    pair[2..].copy_from_slice(&hi.to_le_bytes());
    let start = shape.bounds_offset(format);
    let end = start + 4 * shape.kv_heads * shape.head_dim;
    for chunk in page[start..end].chunks_exact_mut(4) {
        chunk.copy_from_slice(&pair);
    }
    page[end..shape.k_offset(format)].fill(0);
    Ok(())
}

/// Where a page of one format lives, for one geometry: computed once, so the per-page path does no
/// layout arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Regions {
    /// [`PageShape::page_bytes`].
    pub page_bytes: usize,
    /// [`PageShape::k_offset`].
    pub k_offset: usize,
    /// [`PageShape::v_offset`].
    pub v_offset: usize,
}

/// The expected headers and regions of one geometry, computed once, so the per-page check is a
/// 64-byte compare.
#[derive(Clone, Debug)]
pub(crate) struct HeaderCheck {
    /// The geometry.
    shape: PageShape,
    /// `expected[code]`: the header of a page of this shape in the format with that ABI code, with
    /// `tokens` 0, and its regions; `None` for codes this build does not implement or the shape does
    /// not allow.
    expected: [Option<([u8; HEADER_BYTES], Regions)>; 8],
}

impl HeaderCheck {
    /// Encodes the expected header of every format `shape` allows.
    pub fn new(shape: PageShape) -> HeaderCheck {
        let mut expected = [None; 8];
        for format in Format::ALL {
            if shape.check_format(format).is_ok() {
                let regions = Regions {
                    page_bytes: shape.page_bytes(format),
                    k_offset: shape.k_offset(format),
                    v_offset: shape.v_offset(format),
                };
                expected[usize::from(format.as_u8())] =
                    Some((PageHeader::expected(shape, format, 0).encode(), regions));
            }
        }
        HeaderCheck { shape, expected }
    }

    /// Checks `page` as [`PageHeader::validate`] does against the geometry and `format`; returns the
    /// tokens it encodes (quantized formats) or `usize::MAX` (16-bit formats, whose filled count the
    /// caller knows), and the page's regions. The common, valid case costs one or two short
    /// compares; any mismatch is explained by the full check.
    pub fn check(&self, format: Format, page: &[u8]) -> Result<(usize, Regions), KernelError> {
        if let Some((want, regions)) = &self.expected[usize::from(format.as_u8())]
            && page.len() >= regions.page_bytes
            && let Some(tokens) = matching_tokens(self.shape, format, page, want)
        {
            return Ok((if format.is_quantized() { tokens } else { usize::MAX }, *regions));
        }
        PageHeader::validate(self.shape, format, page)?;
        // Validation passed where the fast path did not: impossible, as both compare the same
        // fields; report the page as not matching rather than trust it.
        Err(KernelError::HeaderField { field: "header bytes", got: 0, want: 1 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: PageShape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };

    fn page(format: Format) -> Vec<u8> {
        let mut page = vec![0u8; SMOL.page_bytes(format)];
        page[..HEADER_BYTES].copy_from_slice(&PageHeader::expected(SMOL, format, 0).encode());
        page
    }

    #[test]
    fn header_fields_sit_at_their_documented_bytes() {
        let h = PageHeader::new(SMOL, Format::Q4, 17).unwrap();
        let b = h.encode();
        assert_eq!(&b[..4], &[4, 1, 4, 4]);
        assert_eq!(u16_at(&b, 4), 3);
        assert_eq!(u16_at(&b, 6), 64);
        assert_eq!(u16_at(&b, 8), 32);
        assert_eq!(u16_at(&b, 10), 17);
        assert_eq!(u32_at(&b, 12) as usize, SMOL.page_bytes(Format::Q4));
        assert_eq!(u32_at(&b, 16), 0);
        assert_eq!(u32_at(&b, 20), 64);
        assert_eq!(u32_at(&b, 24) as usize, SMOL.v_offset(Format::Q4));
        assert!(b[RESERVED..].iter().all(|&x| x == 0));
        assert_eq!(PageHeader::decode(&b).unwrap(), h);
    }

    #[test]
    fn every_field_mismatch_names_the_field() {
        let cases: [(usize, u8, &str); 6] = [
            (2, 9, "k_bits"),
            (4, 4, "kv_heads"),
            (6, 65, "head_dim"),
            (8, 16, "block_tokens"),
            (12, 1, "page_bytes"),
            (20, 128, "k_offset"),
        ];
        for (at, byte, field) in cases {
            let mut p = page(Format::F16);
            p[at] = byte;
            let err = PageHeader::validate(SMOL, Format::F16, &p).unwrap_err();
            assert!(matches!(err, KernelError::HeaderField { field: f, .. } if f == field), "{at}: {err}");
        }
    }

    #[test]
    fn fast_check_agrees_with_the_full_check() {
        let check = HeaderCheck::new(SMOL);
        let mut p = page(Format::Q8);
        p[10] = 5;
        let regions =
            Regions { page_bytes: SMOL.page_bytes(Format::Q8), k_offset: 64, v_offset: SMOL.v_offset(Format::Q8) };
        assert_eq!(check.check(Format::Q8, &p), Ok((5, regions)));
        p[10] = 0;
        assert_eq!(
            check.check(Format::Q8, &p),
            Err(KernelError::HeaderTokens { got: 0, format: Format::Q8, block_tokens: 32 })
        );
        let p = page(Format::Bf16);
        assert_eq!(check.check(Format::Bf16, &p).map(|(t, _)| t), Ok(usize::MAX));
        assert_eq!(check.check(Format::F16, &p), Err(KernelError::HeaderFormat { got: 2, want: Format::F16 }));
    }
}
