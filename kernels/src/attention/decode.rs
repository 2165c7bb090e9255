//! [`DecodeAttention`]: the streaming accumulator that takes pages one at a time.
//!
//! It owns every buffer a call needs — the scaled query, per-head running reference, sum and accumulator,
//! per-page `(reference, sum)` records for the mass, and the kernels' scratch — allocated in
//! [`DecodeAttention::new`] and reused by [`DecodeAttention::reset`], so feeding a page never
//! allocates (the per-page records grow amortized, or not at all after
//! [`DecodeAttention::reserve_pages`] or a reset).
//!
//! Mass of page `p`: the kernel records, per query head, the page's reference point `r` (the running
//! reference after that page, see `kernel.rs`) and `σ = Σ exp(s − r)` over its tokens. At the end,
//! with the final reference `m` and sum `l` of each head, that head's probability mass in the page is
//! `σ × exp(r − m) / l`; `mass[p]` is its mean over the query heads.

use crate::error::KernelError;
use crate::format::header::HeaderCheck;

use super::isa::{Isa, run_page};
use super::kernel::{PageJob, Running};
use super::{AttnShape, PageView};

/// Paged decode attention for one query token, fed one page at a time.
#[derive(Debug)]
pub struct DecodeAttention {
    /// Validated geometry.
    shape: AttnShape,
    /// Kernel in use; always passed [`Isa::is_available`].
    isa: Isa,
    /// `q_heads × head_dim`: the query times the softmax scale.
    q: Vec<f32>,
    /// `q_heads`: running reference point, at least the max score minus `SLACK` (−∞ before the
    /// first page).
    reference: Vec<f32>,
    /// `q_heads`: running Σ exp(s − reference).
    sum: Vec<f32>,
    /// `q_heads × head_dim`: running Σ exp(s − reference) × v.
    acc: Vec<f32>,
    /// `pages × q_heads`: each page's reference point.
    page_ref: Vec<f32>,
    /// `pages × q_heads`: each page's Σ exp(s − reference).
    page_sum: Vec<f32>,
    /// `group × block_tokens` kernel scratch.
    scores: Vec<f32>,
    /// `group` kernel scratch.
    alpha: Vec<f32>,
    /// Quantized-key kernel scratch (see `Running::qk`).
    qk: Vec<f32>,
    /// Quantized-value kernel scratch (see `Running::weights`).
    weights: Vec<f32>,
    /// The expected page headers of this geometry, for the per-page check.
    headers: HeaderCheck,
    /// Pages fed since `new` or the last `reset`.
    pages: usize,
}

impl DecodeAttention {
    /// Starts attention of query `q` (`q_heads × head_dim` floats) with softmax scale `scale`
    /// (usually `1 / sqrt(head_dim)`), using the best kernel of this CPU ([`Isa::detect`]).
    pub fn new(shape: AttnShape, q: &[f32], scale: f32) -> Result<Self, KernelError> {
        Self::with_isa(Isa::detect(), shape, q, scale)
    }

    /// Like [`DecodeAttention::new`] with a chosen kernel, for tests and benchmarks; fails if `isa`
    /// is not available here.
    pub fn with_isa(isa: Isa, shape: AttnShape, q: &[f32], scale: f32) -> Result<Self, KernelError> {
        if !isa.is_available() {
            return Err(KernelError::IsaUnavailable { isa: isa.name() });
        }
        shape.validate()?;
        let heads = shape.q_heads;
        let mut this = DecodeAttention {
            shape,
            isa,
            q: vec![0.0; heads * shape.head_dim],
            reference: vec![f32::NEG_INFINITY; heads],
            sum: vec![0.0; heads],
            acc: vec![0.0; heads * shape.head_dim],
            page_ref: Vec::new(),
            page_sum: Vec::new(),
            scores: vec![0.0; shape.group() * shape.block_tokens],
            alpha: vec![0.0; shape.group()],
            qk: vec![0.0; Running::qk_len(shape)],
            weights: vec![0.0; Running::weights_len(shape)],
            headers: HeaderCheck::new(shape.page_shape()),
            pages: 0,
        };
        this.reset(q, scale)?;
        Ok(this)
    }

    /// Starts over with a new query, keeping every buffer (and the kernel choice).
    pub fn reset(&mut self, q: &[f32], scale: f32) -> Result<(), KernelError> {
        let shape = self.shape;
        if q.len() != shape.q_heads * shape.head_dim {
            return Err(KernelError::QueryLength { got: q.len(), q_heads: shape.q_heads, head_dim: shape.head_dim });
        }
        for (dst, src) in self.q.iter_mut().zip(q) {
            *dst = src * scale;
        }
        self.reference.fill(f32::NEG_INFINITY);
        self.sum.fill(0.0);
        self.acc.fill(0.0);
        self.page_ref.clear();
        self.page_sum.clear();
        self.pages = 0;
        Ok(())
    }

    /// Reserves room for the per-page mass records of `pages` more pages.
    pub fn reserve_pages(&mut self, pages: usize) {
        let n = pages.saturating_mul(self.shape.q_heads);
        self.page_ref.reserve(n);
        self.page_sum.reserve(n);
    }

    /// The geometry.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }

    /// The kernel in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Pages fed so far; `finish` wants a mass slot for each.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Folds the next page into the running state. On error nothing changes.
    pub fn page(&mut self, page: PageView<'_>) -> Result<(), KernelError> {
        self.fold(page, None)
    }

    /// Like [`DecodeAttention::page`], and while reading `page` prefetches `next`, the bytes of the
    /// page that will be fed after it, so its memory reads overlap this page's arithmetic. `next` is
    /// only a hint: it is never read, and any slice (even a short one) is harmless.
    pub fn page_prefetching(&mut self, page: PageView<'_>, next: &[u8]) -> Result<(), KernelError> {
        self.fold(page, Some(next))
    }

    fn fold(&mut self, page: PageView<'_>, next: Option<&[u8]>) -> Result<(), KernelError> {
        let shape = self.shape;
        let (encoded, regions) = self.headers.check(page.format, page.bytes)?;
        if page.tokens == 0 || page.tokens > shape.block_tokens {
            return Err(KernelError::PageTokens {
                page: self.pages,
                tokens: page.tokens,
                block_tokens: shape.block_tokens,
            });
        }
        if page.tokens > encoded {
            return Err(KernelError::EncodedTokens { tokens: page.tokens, encoded, format: page.format });
        }
        let heads = shape.q_heads;
        let start = self.page_ref.len();
        self.page_ref.resize(start + heads, 0.0);
        self.page_sum.resize(start + heads, 0.0);
        let job = PageJob {
            shape,
            format: page.format,
            bytes: page.bytes,
            tokens: page.tokens,
            page_bytes: regions.page_bytes,
            k_offset: regions.k_offset,
            v_offset: regions.v_offset,
            next,
        };
        let mut run = Running {
            q: &self.q,
            reference: &mut self.reference,
            sum: &mut self.sum,
            acc: &mut self.acc,
            page_ref: &mut self.page_ref[start..],
            page_sum: &mut self.page_sum[start..],
            scores: &mut self.scores,
            alpha: &mut self.alpha,
            qk: &mut self.qk,
            weights: &mut self.weights,
        };
        run_page(self.isa, &job, &mut run);
        self.pages += 1;
        Ok(())
    }

    /// Writes the attention output (`q_heads × head_dim`) and each page's attention mass (one slot
    /// per page fed, summing to 1) without consuming the state, so it can be [`reset`] and reused.
    ///
    /// [`reset`]: DecodeAttention::reset
    pub fn write_output(&self, out: &mut [f32], mass: &mut [f32]) -> Result<(), KernelError> {
        let shape = self.shape;
        let (heads, dim) = (shape.q_heads, shape.head_dim);
        if out.len() != heads * dim {
            return Err(KernelError::OutputLength { got: out.len(), q_heads: heads, head_dim: dim });
        }
        if mass.len() != self.pages {
            return Err(KernelError::MassLength { got: mass.len(), need: self.pages, per: "page" });
        }
        if self.pages == 0 {
            return Err(KernelError::NoPages);
        }
        for qh in 0..heads {
            let inv = 1.0 / self.sum[qh];
            let row = qh * dim..(qh + 1) * dim;
            for (o, a) in out[row.clone()].iter_mut().zip(&self.acc[row]) {
                *o = a * inv;
            }
        }
        // Head by head, so each head's factor exp(r − m) / l is computed once per distinct page
        // reference r; references move rarely, so this is about one exponential per head.
        mass.fill(0.0);
        for qh in 0..heads {
            let (last, total) = (self.reference[qh], self.sum[qh] as f64);
            let mut seen = f32::NAN;
            let mut factor = 0.0f64;
            for (p, m) in mass.iter_mut().enumerate() {
                let at = p * heads + qh;
                let r = self.page_ref[at];
                if r != seen {
                    factor = ((r - last) as f64).exp() / total;
                    seen = r;
                }
                *m += (self.page_sum[at] as f64 * factor) as f32;
            }
        }
        let per_head = 1.0 / heads as f32;
        for m in mass.iter_mut() {
            *m *= per_head;
        }
        Ok(())
    }

    /// Writes the output and per-page mass (see [`DecodeAttention::write_output`]) and ends the call.
    pub fn finish(self, out: &mut [f32], mass: &mut [f32]) -> Result<(), KernelError> {
        self.write_output(out, mass)
    }
}

/// Decode attention over `pages` in order, in one call: `out` gets `q_heads × head_dim` floats and
/// `mass` one slot per page (see [`DecodeAttention`]).
pub fn decode_attention(
    shape: AttnShape,
    q: &[f32],
    scale: f32,
    pages: &[PageView<'_>],
    out: &mut [f32],
    mass: &mut [f32],
) -> Result<(), KernelError> {
    let mut attention = DecodeAttention::new(shape, q, scale)?;
    // Fail on wrong output buffers before doing the work.
    if out.len() != shape.q_heads * shape.head_dim {
        return Err(KernelError::OutputLength { got: out.len(), q_heads: shape.q_heads, head_dim: shape.head_dim });
    }
    if mass.len() != pages.len() {
        return Err(KernelError::MassLength { got: mass.len(), need: pages.len(), per: "page" });
    }
    attention.reserve_pages(pages.len());
    for (i, page) in pages.iter().enumerate() {
        match pages.get(i + 1) {
            Some(next) => attention.page_prefetching(*page, next.bytes)?,
            None => attention.page(*page)?,
        }
    }
    attention.finish(out, mass)
}
