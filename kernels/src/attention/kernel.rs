//! The contract between [`super::DecodeAttention`] and the per-ISA page kernels.
//!
//! A page kernel folds one validated page into the running online-softmax state of every query head.
//! All kernels MUST compute the same thing (up to `f32` rounding and the accuracy of their `exp`;
//! the integer key scores of `avx512_vnni.rs` also quantize the scaled query to i16 per page, which
//! it bounds and documents):
//!
//! ```text
//!   for every query head qh, with kv = qh / group, and r = reference[qh]:
//!     s_t     = q_qh · k_{kv,t}              for t < tokens   (q is already multiplied by scale)
//!     r_new   = r                            if every s_t ≤ r + SLACK  (a kernel MAY take the max anyway)
//!             = max(r, max_t s_t)            otherwise
//!     alpha   = exp(r − r_new)               (0 when r = −∞, i.e. on the first page)
//!     p_t     = exp(s_t − r_new)             (so p_t ≤ exp(SLACK): no overflow)
//!     acc[qh] = alpha × acc[qh] + Σ_t p_t × v_{kv,t}
//!     sum[qh] = alpha × sum[qh] + Σ_t p_t
//!     reference[qh] = r_new
//!     page_ref[qh] = r_new,  page_sum[qh] = Σ_t p_t
//! ```
//!
//! The scalar kernel always takes the exact running max (the textbook online softmax); the SIMD
//! kernels keep the reference while no score exceeds it by more than [`SLACK`], which skips the
//! page-max reduction, the `alpha` exponential and the rescale on almost every page. Both give the
//! same result up to rounding, since every term is taken relative to the same reference.
//!
//! Kernels MUST NOT let slots `t ≥ tokens` influence any output, whatever bytes they hold: a score of
//! such a slot may be computed (lanes are independent) but is discarded by selection before the
//! `SLACK` test, the max and the sum, and its value row is never loaded into an accumulator. Kernels
//! MUST NOT allocate.
//!
//! Pages of every [`Format`] go through the same contract: quantized pages are read in place (codes
//! and parameters, never widened into a copy of the page), with `k` and `v` above the reconstructed
//! `min + scale × code` of [`crate::format::quant`].
//!
//! Kernels that stream from memory prefetch one KV head ahead: while reading head `h` they prefetch
//! the same offsets of head `h + 1`, and during the last head those of head 0 of `next`, so memory
//! reads overlap the arithmetic instead of following it.

use crate::format::Format;

use super::AttnShape;

/// How far a score may exceed the running reference before a kernel must move the reference up:
/// `p_t ≤ e^8 ≈ 2981`, so sums over a million tokens stay far inside `f32` range.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code, reason = "the NEON kernel always takes the exact max"))]
pub(crate) const SLACK: f32 = 8.0;

/// Heads of a query group whose quantized-kernel scratch is kept at once (the SIMD kernels' largest
/// register tile).
pub(crate) const SCRATCH_HEADS: usize = 8;

/// One page's worth of work, already validated by the caller.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageJob<'a> {
    /// Validated with [`AttnShape::validate`].
    pub shape: AttnShape,
    /// Encoding of `bytes`; its header was checked against `shape` and `format`.
    pub format: Format,
    /// At least `page_bytes` bytes.
    pub bytes: &'a [u8],
    /// Filled token slots, `1..=shape.block_tokens` (and, for quantized pages, at most the tokens
    /// the page encodes).
    pub tokens: usize,
    /// `shape.page_shape().page_bytes(format)`, computed from the shape (never read from the page).
    pub page_bytes: usize,
    /// `shape.page_shape().k_offset(format)`: where the K region or section starts.
    pub k_offset: usize,
    /// `shape.page_shape().v_offset(format)`.
    pub v_offset: usize,
    /// The page that will be fed next, if the caller knows it: a prefetch hint only. Kernels MAY
    /// prefetch its lines (addresses computed with wrapping arithmetic, so its length does not
    /// matter) and MUST NOT read it.
    #[cfg_attr(
        not(target_arch = "x86_64"),
        allow(dead_code, reason = "stable Rust has no aarch64 prefetch intrinsic")
    )]
    pub next: Option<&'a [u8]>,
}

/// The running state of all query heads, owned by [`super::DecodeAttention`] and lent to a kernel for
/// one page. Lengths are exact; `H` is `q_heads`, `D` is `head_dim`, `G` is the group size and `B` is
/// `block_tokens`.
#[derive(Debug)]
pub(crate) struct Running<'a> {
    /// `H × D`: the query, already multiplied by the softmax scale.
    pub q: &'a [f32],
    /// `H`: the running reference `r`: no score seen so far exceeds `r + SLACK` (−∞ before the
    /// first page).
    pub reference: &'a mut [f32],
    /// `H`: Σ exp(s − reference) over all tokens seen so far.
    pub sum: &'a mut [f32],
    /// `H × D`: Σ exp(s − reference) × v over all tokens seen so far (unnormalized output).
    pub acc: &'a mut [f32],
    /// `H`: this page's reference point, the running reference after it.
    pub page_ref: &'a mut [f32],
    /// `H`: Σ exp(s − page_ref) over this page's filled tokens.
    pub page_sum: &'a mut [f32],
    /// `G × B` scratch: scores, then probabilities, of one KV head's query group.
    pub scores: &'a mut [f32],
    /// `G` scratch: the rescale factor `alpha` of each head of the group.
    pub alpha: &'a mut [f32],
    /// `min(G, 8) × D` scratch for quantized keys: the query times each channel's scale.
    pub qk: &'a mut [f32],
    /// `min(G, 8) × ceil(D / 32) × B` scratch for quantized values: each probability times its
    /// token's group scale.
    pub weights: &'a mut [f32],
}

impl Running<'_> {
    /// The length of [`Running::qk`] for `shape`.
    pub fn qk_len(shape: AttnShape) -> usize {
        shape.group().min(SCRATCH_HEADS) * shape.head_dim
    }

    /// The length of [`Running::weights`] for `shape`.
    pub fn weights_len(shape: AttnShape) -> usize {
        shape.group().min(SCRATCH_HEADS) * shape.head_dim.div_ceil(crate::format::quant::V_GROUP) * shape.block_tokens
    }
}

impl Running<'_> {
    /// Checks the documented lengths, which the SIMD kernels rely on for memory safety. Costs a few
    /// comparisons per page.
    pub fn check(&self, job: &PageJob<'_>) {
        let s = job.shape;
        let (h, d, g, b) = (s.q_heads, s.head_dim, s.group(), s.block_tokens);
        assert!(job.tokens >= 1 && job.tokens <= b);
        assert!(job.bytes.len() >= job.page_bytes);
        let page = s.page_shape();
        debug_assert_eq!(job.page_bytes, page.page_bytes(job.format));
        debug_assert_eq!(job.k_offset, page.k_offset(job.format));
        debug_assert_eq!(job.v_offset, page.v_offset(job.format));
        // The offsets lie inside the page whatever the shape (a cheap guard for the debug checks).
        assert!(job.k_offset <= job.v_offset && job.v_offset <= job.page_bytes);
        assert_eq!(self.q.len(), h * d);
        assert_eq!(self.reference.len(), h);
        assert_eq!(self.sum.len(), h);
        assert_eq!(self.acc.len(), h * d);
        assert_eq!(self.page_ref.len(), h);
        assert_eq!(self.page_sum.len(), h);
        assert_eq!(self.scores.len(), g * b);
        assert_eq!(self.alpha.len(), g);
        assert_eq!(self.qk.len(), Self::qk_len(s));
        assert_eq!(self.weights.len(), Self::weights_len(s));
    }
}
