//! Where each K and V element of a 16-bit page lives.
//!
//! Keys are channel-major, so one vector load covers consecutive tokens of one channel and decode
//! attention gets scores for many tokens without horizontal sums; values are token-major, one row per
//! token, as they are accumulated. Elements are 2 bytes, little-endian (f16 or bf16 bits).
//!
//! ```text
//!  offset 0                                   K region: kv_heads × head_dim × block_tokens elements
//!  +-------------------------------------------------------------------------------------------+
//!  | h0 d0: t0 t1 ... t(B-1) | h0 d1: t0 ... t(B-1) | ... | h(H-1) d(D-1): t0 ... t(B-1)      |
//!  +-------------------------------------------------------------------------------------------+
//!  offset kv_heads*head_dim*block_tokens*2     V region: kv_heads × block_tokens × head_dim elements
//!  +-------------------------------------------------------------------------------------------+
//!  | h0 t0: d0 ... d(D-1) | h0 t1: d0 ... d(D-1) | ... | h(H-1) t(B-1): d0 ... d(D-1)          |
//!  +-------------------------------------------------------------------------------------------+
//!  page_bytes = 2 (K,V) × kv_heads × block_tokens × head_dim × 2 bytes
//! ```
//!
//! Index helpers count *elements* from the start of the page (so V indices start at
//! [`PageShape::region_elements`]); multiply by the element size for byte offsets.

use crate::error::KernelError;
use crate::format::Format;

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

impl PageShape {
    /// Elements in the K region (equal to the V region): `kv_heads × head_dim × block_tokens`.
    ///
    /// Only meaningful for shapes that pass [`PageShape::validate`], which rules out overflow.
    pub const fn region_elements(self) -> usize {
        self.kv_heads * self.head_dim * self.block_tokens
    }

    /// Bytes of the K region, which is also the byte offset of the V region.
    pub const fn k_region_bytes(self, format: Format) -> usize {
        self.region_elements() * format.element_bytes()
    }

    /// Bytes of one whole page (K and V) in `format`.
    pub const fn page_bytes(self, format: Format) -> usize {
        2 * self.k_region_bytes(format)
    }

    /// Element index of key channel `d` of KV head `h` at token slot `t`.
    pub const fn k_index(self, h: usize, d: usize, t: usize) -> usize {
        (h * self.head_dim + d) * self.block_tokens + t
    }

    /// Element index of value channel `d` of KV head `h` at token slot `t`.
    pub const fn v_index(self, h: usize, t: usize, d: usize) -> usize {
        self.region_elements() + (h * self.block_tokens + t) * self.head_dim + d
    }

    /// Checks that every dimension is positive and that a page's byte size fits in `usize`.
    pub fn validate(self) -> Result<(), KernelError> {
        for (what, value) in
            [("kv_heads", self.kv_heads), ("head_dim", self.head_dim), ("block_tokens", self.block_tokens)]
        {
            if value == 0 {
                return Err(KernelError::InvalidShape { what, value, rule: "a page needs at least one of each" });
            }
        }
        let fits = self
            .kv_heads
            .checked_mul(self.head_dim)
            .and_then(|n| n.checked_mul(self.block_tokens))
            .and_then(|n| n.checked_mul(4))
            .is_some_and(|n| n <= isize::MAX as usize);
        if !fits {
            return Err(KernelError::InvalidShape {
                what: "kv_heads × head_dim × block_tokens",
                value: self.kv_heads.saturating_mul(self.head_dim).saturating_mul(self.block_tokens),
                rule: "a page of that many elements does not fit in memory",
            });
        }
        Ok(())
    }

    /// Checks the shape and that `page_len` bytes hold at least one page in `format`.
    pub fn check_page(self, format: Format, page_len: usize) -> Result<(), KernelError> {
        self.validate()?;
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
    fn smollm2_page_is_24_kib_with_v_after_k() {
        assert_eq!(SMOL.page_bytes(Format::F16), 2 * 3 * 32 * 64 * 2);
        assert_eq!(SMOL.k_region_bytes(Format::Bf16), 3 * 32 * 64 * 2);
        assert_eq!(SMOL.k_index(0, 0, 0), 0);
        assert_eq!(SMOL.k_index(0, 0, 31), 31);
        assert_eq!(SMOL.k_index(0, 1, 0), 32);
        assert_eq!(SMOL.k_index(1, 0, 0), 64 * 32);
        assert_eq!(SMOL.v_index(0, 0, 0), SMOL.region_elements());
        assert_eq!(SMOL.v_index(0, 1, 0), SMOL.region_elements() + 64);
        assert_eq!(SMOL.v_index(2, 31, 63) + 1, 2 * SMOL.region_elements());
    }

    #[test]
    fn zero_dimension_is_rejected_with_its_name() {
        let shape = PageShape { head_dim: 0, ..SMOL };
        let err = shape.validate().unwrap_err();
        assert!(err.to_string().starts_with("head_dim is 0"), "{err}");
    }

    #[test]
    fn page_one_byte_short_is_rejected() {
        let need = SMOL.page_bytes(Format::F16);
        assert!(SMOL.check_page(Format::F16, need).is_ok());
        let err = SMOL.check_page(Format::F16, need - 1).unwrap_err();
        assert_eq!(err.kind(), crate::KernelErrorKind::BadLength);
    }
}
