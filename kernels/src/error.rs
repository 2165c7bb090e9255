//! The one error type of `kvmm-kernels`.
//!
//! Every fallible entry point (row writes, page reads, decode attention) checks its arguments up front
//! and reports the first mismatch as a [`KernelError`]. No kernel fails half-way: once validation
//! passes, the work runs to completion. Messages are whole sentences that say what was given, what
//! the geometry needs, and therefore what to change; [`KernelError::kind`] gives a small, stable
//! classification for callers that map errors onto other codes (gRPC status, exit codes).

use crate::format::Format;

/// A small, stable classification of [`KernelError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelErrorKind {
    /// The geometry itself is not one the kernels accept (zero heads, head_dim not a multiple of 16,
    /// q_heads not a multiple of kv_heads, ...).
    InvalidShape,
    /// A buffer (query, rows, page, output, mass) has the wrong number of elements or bytes.
    BadLength,
    /// A token index or count lies outside the page.
    OutOfRange,
    /// The format or instruction set is not implemented or not available on this machine.
    Unsupported,
}

/// Why a kernel refused its arguments.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelError {
    /// A dimension of the geometry is outside what the kernels support.
    #[error("{what} is {value}, but {rule}")]
    InvalidShape {
        /// The offending dimension, e.g. "head_dim".
        what: &'static str,
        /// Its value.
        value: usize,
        /// The rule it breaks, as the end of a sentence.
        rule: &'static str,
    },

    /// Grouped-query attention needs every KV head to serve the same number of query heads.
    #[error(
        "q_heads is {q_heads}, which is not a positive multiple of kv_heads = {kv_heads}; \
         every KV head must serve the same number of query heads"
    )]
    GroupMismatch {
        /// Query heads in the shape.
        q_heads: usize,
        /// KV heads in the shape.
        kv_heads: usize,
    },

    /// The query vector does not hold `q_heads × head_dim` floats.
    #[error(
        "query has {got} floats but this geometry needs q_heads × head_dim = \
         {q_heads} × {head_dim} = {}",
        q_heads * head_dim
    )]
    QueryLength {
        /// Floats given.
        got: usize,
        /// Query heads in the shape.
        q_heads: usize,
        /// Elements per head.
        head_dim: usize,
    },

    /// Key or value rows are not a whole number of tokens.
    #[error(
        "{which} hold {got} elements, which is not a whole number of tokens of \
         kv_heads × head_dim = {kv_heads} × {head_dim} = {} elements each",
        kv_heads * head_dim
    )]
    RowLength {
        /// "keys" or "values".
        which: &'static str,
        /// Elements given.
        got: usize,
        /// KV heads in the shape.
        kv_heads: usize,
        /// Elements per head.
        head_dim: usize,
    },

    /// Keys and values describe different numbers of tokens.
    #[error("keys hold {k_len} elements but values hold {v_len}; give both for the same tokens")]
    KeyValueMismatch {
        /// Elements of keys given.
        k_len: usize,
        /// Elements of values given.
        v_len: usize,
    },

    /// The page buffer is shorter than one page of its shape and format.
    #[error(
        "page has {got} bytes but a {format} page of kv_heads = {kv_heads}, head_dim = {head_dim}, \
         block_tokens = {block_tokens} needs {need}"
    )]
    PageTooShort {
        /// Bytes given.
        got: usize,
        /// Bytes one page needs.
        need: usize,
        /// The page's format.
        format: Format,
        /// KV heads in the shape.
        kv_heads: usize,
        /// Elements per head.
        head_dim: usize,
        /// Token slots per page.
        block_tokens: usize,
    },

    /// Rows were written or read past the page's last token slot.
    #[error(
        "tokens {first}..{} do not fit in a page of block_tokens = {block_tokens}; \
         start a new page at token {block_tokens}",
        first + count
    )]
    TokenRange {
        /// First token slot addressed.
        first: usize,
        /// Number of tokens addressed.
        count: usize,
        /// Token slots per page.
        block_tokens: usize,
    },

    /// A page handed to attention claims a filled-token count outside `1..=block_tokens`.
    #[error(
        "page {page} says {tokens} tokens are filled, but a page holds 1..={block_tokens}; \
         leave empty pages out"
    )]
    PageTokens {
        /// Index of the page in the order it was fed.
        page: usize,
        /// Filled tokens claimed.
        tokens: usize,
        /// Token slots per page.
        block_tokens: usize,
    },

    /// The format code is not one this build implements.
    #[error("page format code {code} is not implemented by this build of kvmm-kernels")]
    UnsupportedFormat {
        /// The raw format code.
        code: u8,
    },

    /// The output buffer does not hold `q_heads × head_dim` floats.
    #[error(
        "output has {got} floats but this geometry needs q_heads × head_dim = \
         {q_heads} × {head_dim} = {}",
        q_heads * head_dim
    )]
    OutputLength {
        /// Floats given.
        got: usize,
        /// Query heads in the shape.
        q_heads: usize,
        /// Elements per head.
        head_dim: usize,
    },

    /// The attention-mass buffer does not have one slot per page fed.
    #[error("mass has {got} slots but needs one per {per}, {need} in all")]
    MassLength {
        /// Slots given.
        got: usize,
        /// Slots needed.
        need: usize,
        /// What each slot stands for: "page" (decode attention) or "token" (the dense reference).
        per: &'static str,
    },

    /// Attention finished without a single page.
    #[error("no page was fed, so attention has nothing to attend to; feed at least one page")]
    NoPages,

    /// The requested instruction set cannot run on this machine.
    #[error("the {isa} kernel was requested but this CPU or build does not support it; use Isa::detect()")]
    IsaUnavailable {
        /// Name of the instruction set.
        isa: &'static str,
    },
}

impl KernelError {
    /// The stable classification of this error.
    pub fn kind(&self) -> KernelErrorKind {
        match self {
            Self::InvalidShape { .. } | Self::GroupMismatch { .. } => KernelErrorKind::InvalidShape,
            Self::QueryLength { .. }
            | Self::RowLength { .. }
            | Self::KeyValueMismatch { .. }
            | Self::PageTooShort { .. }
            | Self::OutputLength { .. }
            | Self::MassLength { .. }
            | Self::NoPages => KernelErrorKind::BadLength,
            Self::TokenRange { .. } | Self::PageTokens { .. } => KernelErrorKind::OutOfRange,
            Self::UnsupportedFormat { .. } | Self::IsaUnavailable { .. } => KernelErrorKind::Unsupported,
        }
    }
}
