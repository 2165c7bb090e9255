//! A session's geometry: the model dimensions that fix the size of every page and table.
//!
//! A [`Geometry`] is given at attach, checked once by [`Geometry::validate`], and then copied into the
//! session table's header, from which clients read it back. The rules (see ARCHITECTURE.md, "Geometry
//! and pages") keep every derived size small enough that no arithmetic in this crate can overflow:
//!
//! | field | rule |
//! |---|---|
//! | `layers` | `1..=512` |
//! | `kv_heads` | `1..=256` |
//! | `q_heads` | `1..=1024`, a multiple of `kv_heads` |
//! | `head_dim` | a multiple of 16 in `16..=256` |
//! | `block_tokens` | a power of two in `8..=256` |
//! | `max_tokens` | `1..=1 << 20` |
//!
//! So a page is at most 2 × 256 × 256 × 256 × 2 B = 64 MiB, a layer has at most 2^17 blocks, and a
//! session at most 2^26 pages.

use kvmm_kernels::{AttnShape, ElementType, Format, PageShape};

use crate::layout;

/// Tokens per page unless the client asks otherwise.
pub const DEFAULT_BLOCK_TOKENS: u32 = 32;

/// Largest accepted `layers`.
pub const MAX_LAYERS: u32 = 512;
/// Largest accepted `kv_heads`.
pub const MAX_KV_HEADS: u32 = 256;
/// Largest accepted `q_heads`.
pub const MAX_Q_HEADS: u32 = 1024;
/// Largest accepted `head_dim`.
pub const MAX_HEAD_DIM: u32 = 256;
/// Smallest accepted `block_tokens`.
pub const MIN_BLOCK_TOKENS: u32 = 8;
/// Largest accepted `block_tokens`.
pub const MAX_BLOCK_TOKENS: u32 = 256;
/// Largest accepted `max_tokens`.
pub const MAX_TOKENS: u32 = 1 << 20;

/// The dimensions of one session's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// Transformer layers; each has its own pages.
    pub layers: u32,
    /// KV heads per layer (all stored in every page).
    pub kv_heads: u32,
    /// Query heads per layer; `q_heads / kv_heads` query heads share each KV head.
    pub q_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Token slots per page.
    pub block_tokens: u32,
    /// Element type of uncompressed pages (the tail pages clients write).
    pub element_type: ElementType,
    /// Largest context the session may reach; fixes the table size.
    pub max_tokens: u32,
}

/// Why a [`Geometry`] was refused. Each message names the field, its value and the rule.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GeometryError {
    /// `layers` outside `1..=512`.
    #[error("layers ({0}) must be between 1 and {MAX_LAYERS}")]
    Layers(u32),
    /// `kv_heads` outside `1..=256`.
    #[error("kv_heads ({0}) must be between 1 and {MAX_KV_HEADS}")]
    KvHeads(u32),
    /// `q_heads` outside `1..=1024`.
    #[error("q_heads ({0}) must be between 1 and {MAX_Q_HEADS}")]
    QHeads(u32),
    /// `q_heads` not a multiple of `kv_heads`.
    #[error("q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for grouped-query attention")]
    QHeadsNotMultiple {
        /// Query heads given.
        q_heads: u32,
        /// KV heads given.
        kv_heads: u32,
    },
    /// `head_dim` not a multiple of 16 in `16..=256`.
    #[error("head_dim ({0}) must be a multiple of 16 between 16 and {MAX_HEAD_DIM}")]
    HeadDim(u32),
    /// `block_tokens` not a power of two in `8..=256`.
    #[error("block_tokens ({0}) must be a power of two between {MIN_BLOCK_TOKENS} and {MAX_BLOCK_TOKENS}")]
    BlockTokens(u32),
    /// `max_tokens` outside `1..=1 << 20`.
    #[error("max_tokens ({0}) must be between 1 and {MAX_TOKENS} (1 << 20)")]
    MaxTokens(u32),
    /// An element-type code read from shared memory or the wire is unknown.
    #[error("element type code ({0}) must be 1 (f16) or 2 (bf16)")]
    ElementTypeCode(u32),
}

impl Geometry {
    /// An f16 geometry with the default page size ([`DEFAULT_BLOCK_TOKENS`] tokens); not yet validated.
    pub fn new(layers: u32, kv_heads: u32, q_heads: u32, head_dim: u32, max_tokens: u32) -> Geometry {
        Geometry {
            layers,
            kv_heads,
            q_heads,
            head_dim,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            element_type: ElementType::F16,
            max_tokens,
        }
    }

    /// Checks every rule of the module table, reporting the first field that breaks one.
    pub fn validate(&self) -> Result<(), GeometryError> {
        if !(1..=MAX_LAYERS).contains(&self.layers) {
            return Err(GeometryError::Layers(self.layers));
        }
        if !(1..=MAX_KV_HEADS).contains(&self.kv_heads) {
            return Err(GeometryError::KvHeads(self.kv_heads));
        }
        if !(1..=MAX_Q_HEADS).contains(&self.q_heads) {
            return Err(GeometryError::QHeads(self.q_heads));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(GeometryError::QHeadsNotMultiple { q_heads: self.q_heads, kv_heads: self.kv_heads });
        }
        if !(16..=MAX_HEAD_DIM).contains(&self.head_dim) || !self.head_dim.is_multiple_of(16) {
            return Err(GeometryError::HeadDim(self.head_dim));
        }
        if !(MIN_BLOCK_TOKENS..=MAX_BLOCK_TOKENS).contains(&self.block_tokens) || !self.block_tokens.is_power_of_two() {
            return Err(GeometryError::BlockTokens(self.block_tokens));
        }
        if !(1..=MAX_TOKENS).contains(&self.max_tokens) {
            return Err(GeometryError::MaxTokens(self.max_tokens));
        }
        Ok(())
    }

    /// Pages per layer: `ceil(max_tokens / block_tokens)`.
    pub fn blocks_per_layer(&self) -> u32 {
        self.max_tokens.div_ceil(self.block_tokens.max(1))
    }

    /// Pages in the session: `layers × blocks_per_layer`.
    pub fn pages(&self) -> u64 {
        u64::from(self.layers) * u64::from(self.blocks_per_layer())
    }

    /// Query heads per KV head.
    pub fn group(&self) -> u32 {
        self.q_heads / self.kv_heads.max(1)
    }

    /// The format of uncompressed pages.
    pub fn format(&self) -> Format {
        Format::from(self.element_type)
    }

    /// The kernels' view of one page's dimensions.
    pub fn page_shape(&self) -> PageShape {
        PageShape {
            kv_heads: self.kv_heads as usize,
            head_dim: self.head_dim as usize,
            block_tokens: self.block_tokens as usize,
        }
    }

    /// The kernels' view of the attention heads.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape {
            q_heads: self.q_heads as usize,
            kv_heads: self.kv_heads as usize,
            head_dim: self.head_dim as usize,
            block_tokens: self.block_tokens as usize,
        }
    }

    /// Bytes of one page in the session's element type (f16 or bf16): header, key bounds, K and V,
    /// as `kvmm_kernels::PageShape::page_bytes` lays them out.
    pub fn page_bytes(&self) -> u64 {
        // The kernels' layout is the one source of truth for page sizes.
        self.page_shape().page_bytes(self.format()) as u64
    }

    /// Bytes of the session-table memfd for this geometry.
    pub fn table_bytes(&self) -> u64 {
        layout::table_bytes(self)
    }

    /// Bytes of the client-region memfd for this geometry.
    pub fn client_region_bytes(&self) -> u64 {
        layout::client_region_bytes(self)
    }
}

/// The ABI code of an element type (the same number as its [`Format`] code).
pub fn element_type_code(element_type: ElementType) -> u32 {
    u32::from(Format::from(element_type).as_u8())
}

/// The element type with ABI code `code`.
pub fn element_type_from_code(code: u32) -> Result<ElementType, GeometryError> {
    match code {
        1 => Ok(ElementType::F16),
        2 => Ok(ElementType::Bf16),
        _ => Err(GeometryError::ElementTypeCode(code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_8b() -> Geometry {
        Geometry {
            layers: 32,
            kv_heads: 8,
            q_heads: 32,
            head_dim: 128,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            element_type: ElementType::F16,
            max_tokens: 8192,
        }
    }

    fn message(g: Geometry) -> String {
        g.validate().err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn a_llama_shaped_geometry_is_valid_and_sized() {
        let g = llama_8b();
        assert_eq!(g.validate(), Ok(()));
        assert_eq!(g.blocks_per_layer(), 256);
        assert_eq!(g.pages(), 32 * 256);
        assert_eq!(g.group(), 4);
        // 64-byte header, key bounds (min/max f16 per channel), then K and V.
        let payload = 2 * 8 * 32 * 128 * 2;
        assert!(g.page_bytes() >= 64 + 8 * 128 * 4 + payload);
        assert_eq!(g.page_bytes(), g.page_shape().page_bytes(g.format()) as u64);
    }

    #[test]
    fn blocks_per_layer_rounds_up() {
        let g = Geometry { max_tokens: 33, ..llama_8b() };
        assert_eq!(g.blocks_per_layer(), 2);
        let g = Geometry { max_tokens: 1, block_tokens: 256, ..llama_8b() };
        assert_eq!(g.blocks_per_layer(), 1);
    }

    #[test]
    fn each_broken_rule_names_its_field_value_and_rule() {
        let g = llama_8b();
        assert_eq!(message(Geometry { layers: 0, ..g }), "layers (0) must be between 1 and 512");
        assert_eq!(message(Geometry { layers: 513, ..g }), "layers (513) must be between 1 and 512");
        assert_eq!(message(Geometry { kv_heads: 0, ..g }), "kv_heads (0) must be between 1 and 256");
        assert_eq!(message(Geometry { kv_heads: 257, q_heads: 257, ..g }), "kv_heads (257) must be between 1 and 256");
        assert_eq!(message(Geometry { q_heads: 0, ..g }), "q_heads (0) must be between 1 and 1024");
        assert_eq!(message(Geometry { q_heads: 1032, ..g }), "q_heads (1032) must be between 1 and 1024");
        assert_eq!(
            message(Geometry { q_heads: 10, kv_heads: 3, ..g }),
            "q_heads (10) must be a multiple of kv_heads (3) for grouped-query attention"
        );
        for head_dim in [0, 8, 24, 272] {
            assert_eq!(
                message(Geometry { head_dim, ..g }),
                format!("head_dim ({head_dim}) must be a multiple of 16 between 16 and 256")
            );
        }
        for block_tokens in [0, 4, 48, 512] {
            assert_eq!(
                message(Geometry { block_tokens, ..g }),
                format!("block_tokens ({block_tokens}) must be a power of two between 8 and 256")
            );
        }
        for max_tokens in [0, (1 << 20) + 1] {
            assert_eq!(
                message(Geometry { max_tokens, ..g }),
                format!("max_tokens ({max_tokens}) must be between 1 and 1048576 (1 << 20)")
            );
        }
    }

    #[test]
    fn extremes_inside_the_rules_are_valid() {
        let g = Geometry {
            layers: 512,
            kv_heads: 256,
            q_heads: 1024,
            head_dim: 256,
            block_tokens: 8,
            element_type: ElementType::Bf16,
            max_tokens: 1 << 20,
        };
        assert_eq!(g.validate(), Ok(()));
        assert_eq!(g.pages(), 512 << 17);
        let g = Geometry {
            layers: 1,
            kv_heads: 1,
            q_heads: 1,
            head_dim: 16,
            block_tokens: 256,
            element_type: ElementType::F16,
            max_tokens: 1,
        };
        assert_eq!(g.validate(), Ok(()));
    }

    #[test]
    fn element_type_codes_match_format_codes() {
        assert_eq!(element_type_code(ElementType::F16), 1);
        assert_eq!(element_type_code(ElementType::Bf16), 2);
        assert_eq!(element_type_from_code(2), Ok(ElementType::Bf16));
        assert_eq!(
            element_type_from_code(3).map_err(|e| e.to_string()),
            Err("element type code (3) must be 1 (f16) or 2 (bf16)".to_owned())
        );
    }
}
