//! `kvmm-kernels`: the bytes inside a KV page and the kernels that read them in place.
//!
//! - [`format`](mod@format): page [`Format`]s (ABI codes: f16, bf16 and the quantized q8, q4, q2,
//!   k8v4), the 64-byte [`PageHeader`] every page starts with ([`init_page`] writes it), the
//!   [`PageShape`] layout — keys channel-major, values token-major — row writes ([`write_rows`]
//!   from f32, f16 or bf16 rows, [`write_rows_raw`] for memory the caller mapped) and reads
//!   ([`read_rows`]), conversion to and from the quantized formats ([`quantize`], [`dequantize`] to
//!   rows, [`dequantize_page`] to a 16-bit page) and per-channel key bounds of every page
//!   ([`key_bounds`]).
//! - [`attention`]: fused paged decode attention for one query token, fed one page at a time
//!   ([`DecodeAttention`]; [`DecodeAttention::page_prefetching`] also names the page that comes next,
//!   so its memory reads overlap this page's arithmetic), or [`decode_attention`] over a slice of
//!   pages, with a scalar reference and AVX2, AVX-512 (with VNNI: integer key scores for quantized
//!   pages) and NEON kernels chosen at run time ([`Isa`]; each reads every format);
//!   [`attention::reference`] is a dense `f64` ground truth for tests. [`select_pages`] ranks pages
//!   by an upper bound of their scores from the key bounds (Quest) and keeps the best under a page
//!   budget; [`decode_attention_selected`] attends over those only.
//! - [`precision`]: adaptive precision, the format each page of a layer keeps when compressed,
//!   chosen from its attention mass on a [`precision::Ladder`] at a uniform format's bytes
//!   ([`precision::allocate_by_mass`]).
//! - [`error`]: [`KernelError`], the one error type.
//!
//! No I/O, no async, no allocation on the per-page path. `unsafe` lives only in the per-ISA kernel
//! files and in the raw-pointer row writer.

pub mod attention;
pub mod error;
pub mod format;
pub mod precision;

pub use attention::reference::{reference_attention_f32, reference_token_mass};
pub use attention::{
    AttnShape, DecodeAttention, Isa, PageView, decode_attention, decode_attention_selected, page_score_bounds,
    select_pages,
};
pub use error::{KernelError, KernelErrorKind};
pub use format::bounds::key_bounds;
pub use format::header::{HEADER_BYTES, PageHeader, init_page};
pub use format::quant::{QuantLayout, dequantize, dequantize_with, quantize, quantize_with, requantize};
pub use format::rows::{
    RowElement, read_rows, truncate_rows, truncate_rows_with, write_rows, write_rows_raw, write_rows_with,
};
pub use format::to_page::{dequantize_page, dequantize_page_with};
pub use format::{ElementType, Format, PageShape};
