//! `kvmm-kernels`: the bytes inside a KV page and the kernels that read them in place.
//!
//! - [`format`](mod@format): page [`Format`]s (ABI codes), the [`PageShape`] layout — keys channel-major, values
//!   token-major — and row writes ([`write_rows`], [`write_rows_raw`] for memory the caller mapped)
//!   and reads ([`read_rows`]).
//! - [`attention`]: fused paged decode attention for one query token, fed one page at a time
//!   ([`DecodeAttention`]; [`DecodeAttention::page_prefetching`] also names the page that comes next,
//!   so its memory reads overlap this page's arithmetic), or [`decode_attention`] over a slice of
//!   pages, with a scalar reference and AVX2, AVX-512 and NEON kernels chosen at run time ([`Isa`]);
//!   [`attention::reference`] is a dense `f64` ground truth for tests.
//! - [`error`]: [`KernelError`], the one error type.
//!
//! No I/O, no async, no allocation on the per-page path. `unsafe` lives only in the per-ISA kernel
//! files and in the raw-pointer row writer.

pub mod attention;
pub mod error;
pub mod format;

pub use attention::reference::{reference_attention_f32, reference_token_mass};
pub use attention::{AttnShape, DecodeAttention, Isa, PageView, decode_attention};
pub use error::{KernelError, KernelErrorKind};
pub use format::rows::{read_rows, write_rows, write_rows_f16, write_rows_f16_raw, write_rows_raw};
pub use format::{ElementType, Format, PageShape};
