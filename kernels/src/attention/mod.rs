//! Fused paged decode attention: one query token against a sequence of KV pages.
//!
//! For every query head `qh` (using KV head `qh / (q_heads / kv_heads)`, grouped-query attention),
//! over all filled token slots of all pages fed, in order:
//!
//! ```text
//!   s_t   = scale × (q_qh · k_t)
//!   p_t   = exp(s_t − max_u s_u) / Σ_u exp(s_u − max_u s_u)
//!   out   = Σ_t p_t × v_t
//!   mass[page] = (1 / q_heads) × Σ_qh Σ_{t in page} p_t        (so Σ_page mass = 1)
//! ```
//!
//! [`DecodeAttention`] computes this one page at a time with an online softmax in `f32` (running max,
//! running sum, one accumulator row per query head), so a caller can pin a page, feed it, and unpin it.
//! Pages are read in place in their [`Format`]; slots past a page's `tokens` may hold any bytes,
//! including NaN patterns from a reused frame, and never reach the output: their scores are replaced
//! by selection, never multiplied by zero, and their values are never loaded into an accumulator.
//!
//! Pages of every [`Format`] may be mixed in one call; quantized pages are read in place (codes and
//! parameters), never widened into an f16 copy.
//!
//! Implementations: `scalar` (the reference, straight from the definition, every format), `avx2`
//! (AVX2 + FMA + F16C; `avx2_quant` for the quantized formats), `avx512` (AVX-512F/BW/VL;
//! `avx512_quant` for the quantized formats), `avx512vnni` (the same plus DQ, VNNI and VBMI:
//! `avx512_vnni` computes the key scores of quantized pages with 16-bit integer dot products) and
//! `neon` (every format), chosen once per process by [`Isa::detect`] or forced with
//! [`DecodeAttention::with_isa`]. The AVX-512 kernels hand quantized pages of 8 token slots to
//! `avx2_quant`. [`reference`](mod@reference) is a dense `f64` reference that knows nothing of
//! pages, the ground truth for tests.

mod decode;
mod exp;
mod isa;
mod kernel;
pub mod reference;
mod scalar;
pub mod select;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_quant;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_quant;
#[cfg(target_arch = "x86_64")]
mod avx512_select;
#[cfg(target_arch = "x86_64")]
mod avx512_vnni;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod prefetch;

pub use decode::{DecodeAttention, decode_attention};
pub use isa::Isa;
pub use select::{decode_attention_selected, page_score_bounds, select_pages};

use crate::error::KernelError;
use crate::format::{Format, PageShape};

/// The head geometry of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnShape {
    /// Query heads; a positive multiple of `kv_heads`.
    pub q_heads: usize,
    /// KV heads stored in each page.
    pub kv_heads: usize,
    /// Elements per head, a multiple of 16 in `16..=256`.
    pub head_dim: usize,
    /// Token slots per page, a power of two in `8..=256`.
    pub block_tokens: usize,
}

impl AttnShape {
    /// Query heads served by each KV head (`q_heads / kv_heads`).
    pub const fn group(self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// The shape of the pages this attention reads.
    pub const fn page_shape(self) -> PageShape {
        PageShape { kv_heads: self.kv_heads, head_dim: self.head_dim, block_tokens: self.block_tokens }
    }

    /// Checks the rules the kernels rely on (the same as `kvmm_shm::Geometry`'s for these fields).
    pub fn validate(self) -> Result<(), KernelError> {
        if self.kv_heads == 0 || self.kv_heads > 256 {
            return Err(KernelError::InvalidShape {
                what: "kv_heads",
                value: self.kv_heads,
                rule: "it must be in 1..=256",
            });
        }
        if self.q_heads == 0 || self.q_heads > 1024 || !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(KernelError::GroupMismatch { q_heads: self.q_heads, kv_heads: self.kv_heads });
        }
        if !self.head_dim.is_multiple_of(16) || !(16..=256).contains(&self.head_dim) {
            return Err(KernelError::InvalidShape {
                what: "head_dim",
                value: self.head_dim,
                rule: "it must be a multiple of 16 in 16..=256",
            });
        }
        if !self.block_tokens.is_power_of_two() || !(8..=256).contains(&self.block_tokens) {
            return Err(KernelError::InvalidShape {
                what: "block_tokens",
                value: self.block_tokens,
                rule: "it must be a power of two in 8..=256",
            });
        }
        Ok(())
    }
}

/// One page as attention sees it: its bytes, their format, and how many token slots are filled.
///
/// Every page is checked before it is read: its header must match the attention's geometry and
/// `format` ([`crate::format::header`]), or [`DecodeAttention::page`] fails with the mismatch.
#[derive(Clone, Copy, Debug)]
pub struct PageView<'a> {
    /// At least `page_bytes(format)` bytes laid out as in [`crate::format::layout`] (16-bit) or
    /// [`crate::format::quant`] (quantized); extra bytes are ignored.
    pub bytes: &'a [u8],
    /// How the elements are encoded; pages of different formats may be mixed in one call.
    pub format: Format,
    /// Filled token slots, `1..=block_tokens` (for quantized pages, at most the tokens the page
    /// encodes); slots from `tokens` on are ignored whatever they hold.
    pub tokens: usize,
}
