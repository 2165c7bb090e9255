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
    /// The format or instruction set is not implemented or not available on this machine, or the
    /// operation does not apply to the format (rows into a quantized page).
    Unsupported,
    /// A page's header does not match the geometry and format it was read with: the page is
    /// uninitialized, belongs to another geometry, was written by another build, or is corrupt.
    BadPage,
    /// An input value cannot be represented in the requested format (NaN, infinity, out of range).
    BadValue,
}

/// Why a kernel refused its arguments.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
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

    /// Fewer bytes than a page header were given where a page was expected.
    #[error("page has {got} bytes, fewer than the 64 of a page header; pass the whole page")]
    HeaderTooShort {
        /// Bytes given.
        got: usize,
    },

    /// The page header is all zero bytes.
    #[error(
        "page header is all zero bytes: the page was never initialized; call init_page on every new \
         frame before writing rows into it"
    )]
    HeaderUninitialized,

    /// The header's format byte is not the format the page was read as.
    #[error(
        "page format byte is {got}, expected {} ({want}); the page holds another format than its \
         page-table entry says, or is corrupt",
        want.as_u8()
    )]
    HeaderFormat {
        /// The format byte found.
        got: u8,
        /// The format the caller expected.
        want: Format,
    },

    /// The header was written in a layout version this build does not read.
    #[error(
        "page header version is {got}, but this build of kvmm-kernels reads version 1; the page was \
         written by another build or is corrupt"
    )]
    HeaderVersion {
        /// The version byte found.
        got: u8,
    },

    /// A reserved header byte is not zero.
    #[error(
        "page header byte {offset} is {byte:#04x}, but bytes 28..64 are reserved and must be zero; the \
         page was written by another build or is corrupt"
    )]
    HeaderReserved {
        /// Offset of the first non-zero reserved byte.
        offset: usize,
        /// Its value.
        byte: u8,
    },

    /// A header field disagrees with the geometry and format the page was read with.
    #[error(
        "page header field {field} is {got}, expected {want} for this geometry and format; the page \
         belongs to another geometry or is corrupt"
    )]
    HeaderField {
        /// The field's name, as in the header diagram.
        field: &'static str,
        /// The value found.
        got: u64,
        /// The value the geometry implies.
        want: u64,
    },

    /// The header's token count is impossible for the format: not in `1..=block_tokens` for a
    /// quantized page, not 0 for a 16-bit page.
    #[error(
        "page header says {got} tokens are encoded, but a {format} page of block_tokens = {block_tokens} \
         must say {}; the page is corrupt",
        if format.is_quantized() { "1..=block_tokens" } else { "0" }
    )]
    HeaderTokens {
        /// Tokens found.
        got: usize,
        /// The page's format.
        format: Format,
        /// Token slots per page.
        block_tokens: usize,
    },

    /// More tokens were asked of a quantized page than it encodes.
    #[error(
        "{tokens} tokens were asked of a {format} page that encodes only {encoded}; ask for at most \
         {encoded}, or quantize the page again once it is full"
    )]
    EncodedTokens {
        /// Tokens asked for.
        tokens: usize,
        /// Tokens the page encodes.
        encoded: usize,
        /// The page's format.
        format: Format,
    },

    /// Rows were to be written into, or a page initialized in, a format that is only ever written
    /// whole.
    #[error(
        "rows can only be written into f16 or bf16 pages, not {format} pages; quantized pages are \
         written whole by quantize"
    )]
    NotRowWritable {
        /// The format asked for.
        format: Format,
    },

    /// `quantize` was asked for a conversion it does not do.
    #[error(
        "quantize converts an f16 or bf16 page into q8, q4, q2 or k8v4, not {from} into {to}; lossy \
         pages stay in the format they were quantized to"
    )]
    QuantizePair {
        /// Source format.
        from: Format,
        /// Destination format.
        to: Format,
    },

    /// A value cannot be stored in a quantized page.
    #[error(
        "the {which} at token {token}, KV head {head}, channel {channel} is {value}, which a {to} page \
         cannot store: quantized pages hold finite values within ±65504; keep the page in f16 or bf16"
    )]
    Unquantizable {
        /// "key" or "value".
        which: &'static str,
        /// The value.
        value: f32,
        /// Token slot.
        token: usize,
        /// KV head.
        head: usize,
        /// Channel.
        channel: usize,
        /// The format asked for.
        to: Format,
    },

    /// An output or input buffer of floats has the wrong length.
    #[error("{what} has {got} floats but needs {need}")]
    BufferLength {
        /// What the buffer is, with the rule for its length, e.g. "k_out (tokens × kv_heads × head_dim)".
        what: &'static str,
        /// Floats given.
        got: usize,
        /// Floats needed.
        need: usize,
    },

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
            | Self::BufferLength { .. }
            | Self::HeaderTooShort { .. }
            | Self::NoPages => KernelErrorKind::BadLength,
            Self::TokenRange { .. } | Self::PageTokens { .. } | Self::EncodedTokens { .. } => {
                KernelErrorKind::OutOfRange
            }
            Self::UnsupportedFormat { .. }
            | Self::IsaUnavailable { .. }
            | Self::NotRowWritable { .. }
            | Self::QuantizePair { .. } => KernelErrorKind::Unsupported,
            Self::HeaderUninitialized
            | Self::HeaderFormat { .. }
            | Self::HeaderVersion { .. }
            | Self::HeaderReserved { .. }
            | Self::HeaderField { .. }
            | Self::HeaderTokens { .. } => KernelErrorKind::BadPage,
            Self::Unquantizable { .. } => KernelErrorKind::BadValue,
        }
    }
}
