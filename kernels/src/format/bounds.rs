//! Per-channel key bounds of a page, the same API for every format (Quest-style page summaries).
//!
//! For every KV head `h` and channel `d`, [`key_bounds`] gives an interval `[lo, hi]` that contains
//! the key of every token stored in the page:
//!
//! - 16-bit pages keep a running summary next to the header (see [`super::layout`]), widened by
//!   every row write; an empty page reads `lo = +∞, hi = −∞`; NaN keys are not included.
//! - Quantized pages are bounded by their key parameters: `[min, min + scale × (2^b − 1)]`, which by
//!   the rounding rule of [`super::quant`] contains every encoded key and every reconstructed one.
//!
//! From the bounds, `Σ_d max(q_d × lo_d, q_d × hi_d)` is an upper bound of `q · k` over the page's
//! keys, which page selection ranks pages by.

use crate::error::KernelError;
use crate::format::header::PageHeader;
use crate::format::read::PageReader;
use crate::format::{Format, PageShape};

/// Writes the key bounds of every KV head and channel of `page` into `lo` and `hi`
/// (`kv_heads × head_dim` floats each, `lo[h × head_dim + d]`), after checking the page's header.
pub fn key_bounds(
    shape: PageShape,
    format: Format,
    page: &[u8],
    lo: &mut [f32],
    hi: &mut [f32],
) -> Result<(), KernelError> {
    PageHeader::validate(shape, format, page)?;
    let need = shape.kv_heads * shape.head_dim;
    for (what, got) in [("lo (kv_heads × head_dim)", lo.len()), ("hi (kv_heads × head_dim)", hi.len())] {
        if got != need {
            return Err(KernelError::BufferLength { what, got, need });
        }
    }
    key_bounds_unchecked(shape, format, page, lo, hi);
    Ok(())
}

/// [`key_bounds`] for a page whose header and the buffer lengths were already checked.
pub(crate) fn key_bounds_unchecked(shape: PageShape, format: Format, page: &[u8], lo: &mut [f32], hi: &mut [f32]) {
    let reader = PageReader::new(shape, format, page);
    for h in 0..shape.kv_heads {
        for d in 0..shape.head_dim {
            let (a, b) = reader.key_bounds(h, d);
            lo[h * shape.head_dim + d] = a;
            hi[h * shape.head_dim + d] = b;
        }
    }
}
