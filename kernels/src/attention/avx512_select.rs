//! The AVX-512 page-bound kernel of page selection (`select.rs`): a page's score bound for every
//! query head as one dot product per head, for up to `select::BATCH` pages of one format at once.
//!
//! Each KV head's `head_dim` bound pairs are contiguous (16-bit pages: `(lo, hi)` in the page's
//! element type; quantized pages: the key parameters `(scale, min)`), so 8 channels' pairs are 16
//! consecutive f16 or bf16 values, one load widened to 16 `f32` lanes; the query, rearranged by
//! `BoundQuery` to match (`[min(q, 0), max(q, 0)]` or `[L·max(q, 0), q]` per channel), is FMA'd with
//! it per head of the group; the heads' lane sums are reduced 16 at a time by a transposing tree.
//!
//! **Batches.** The coefficients are `2 × head_dim` floats per query head (32 KiB for Llama-3-8B),
//! more than L1 keeps beside the pages, and a page needs one FMA per coefficient vector loaded: one
//! page at a time, the loop waits on L2. Several pages at once load each coefficient vector once
//! and FMA it into every page's accumulators (tiles of 4 heads × 4 pages, 16 accumulators).
//!
//! Memory safety rests on the page and buffer lengths checked by the caller.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::format::Format;
use crate::format::header::HEADER_BYTES;

use super::AttnShape;
use super::avx512::exp16;
use super::prefetch::Prefetch;
use super::select::BATCH;

const LANES: usize = 16;

/// Query heads per dot-product tile: `BATCH × TILE_HEADS` accumulators stay in registers.
const TILE_HEADS: usize = 4;

/// For each page `p` of `pages` (at most [`BATCH`], all of `format`), writes `out[p × q_heads +
/// qh] = Σ_i coefficients[qh][i] × pairs_kv[i]` over the `2 × head_dim` pair values of the KV head
/// `kv` of query head `qh`.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c; `shape` passed
/// `AttnShape::validate`; each page holds at least `page_bytes(format)` bytes; `coefficients` holds
/// `q_heads × 2 × head_dim` floats and `out` `pages.len() × q_heads`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn bounds(shape: AttnShape, coefficients: &[f32], format: Format, pages: &[&[u8]], out: &mut [f32]) {
    // SAFETY: the caller's contract, for as many pages as given.
    unsafe {
        match pages.len() {
            1 => bounds_in::<1>(shape, coefficients, format, pages, out),
            2 => bounds_in::<2>(shape, coefficients, format, pages, out),
            3 => bounds_in::<3>(shape, coefficients, format, pages, out),
            _ => bounds_in::<BATCH>(shape, coefficients, format, pages, out),
        }
    }
}

/// [`bounds`] for `P` pages (`pages.len() == P`).
///
/// # Safety
///
/// As for [`bounds`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn bounds_in<const P: usize>(
    shape: AttnShape,
    coefficients: &[f32],
    format: Format,
    pages: &[&[u8]],
    out: &mut [f32],
) {
    assert_eq!(pages.len(), P);
    let (dim, group, heads_total) = (shape.head_dim, shape.group(), shape.q_heads);
    let bf16 = format == Format::Bf16;
    let stride = pair_stride(shape, format);
    // Per page, per-head lane sums are collected 16 at a time and reduced together (see `reduce16`).
    // Left unwritten until used (zeroing them took a tenth of SmolLM2's selection).
    let mut lanes = [[MaybeUninit::<__m512>::uninit(); LANES]; P];
    let mut held = 0;
    let mut first_held = 0;
    for kv in 0..shape.kv_heads {
        let at = HEADER_BYTES + kv * stride;
        // SAFETY: `4 × head_dim` bytes of this head's pairs lie inside the bounds region or the key
        // parameters of each page.
        let pairs: [*const u8; P] = std::array::from_fn(|p| unsafe { pages[p].as_ptr().add(at) });
        let mut g0 = 0;
        while g0 < group {
            let heads = (group - g0).min(TILE_HEADS).min(LANES - held);
            let first = kv * group + g0;
            // SAFETY: `2 × dim` pair values of each page; rows `first..first + heads ≤ q_heads` of
            // the coefficients, `2 × dim` floats each; `held + heads ≤ 16` vectors of each page's
            // `lanes`.
            unsafe {
                let c = coefficients.as_ptr().add(first * 2 * dim);
                match heads {
                    1 => dot::<1, P>(&pairs, bf16, 2 * dim, c, &mut lanes, held),
                    2 => dot::<2, P>(&pairs, bf16, 2 * dim, c, &mut lanes, held),
                    3 => dot::<3, P>(&pairs, bf16, 2 * dim, c, &mut lanes, held),
                    _ => dot::<TILE_HEADS, P>(&pairs, bf16, 2 * dim, c, &mut lanes, held),
                }
            }
            held += heads;
            if held == LANES || first + heads == heads_total {
                let keep = ((1u32 << held) - 1) as __mmask16;
                for (p, lanes) in lanes.iter_mut().enumerate() {
                    for lane in &mut lanes[held..] {
                        lane.write(_mm512_setzero_ps());
                    }
                    // SAFETY: vectors `0..held` were written by the `dot` calls since the last
                    // reduction (`held` counts what they wrote) and the others just above, so all 16
                    // are initialized; `MaybeUninit<T>` has `T`'s layout.
                    let sums = reduce16(unsafe { &*lanes.as_ptr().cast::<[__m512; LANES]>() });
                    // SAFETY: `held` floats of page `p`'s row of `out` from `first_held`, the heads
                    // just summed.
                    unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(p * heads_total + first_held), keep, sums) };
                }
                first_held += held;
                held = 0;
            }
            g0 += heads;
        }
    }
}

/// Bytes from one KV head's `4 × head_dim` bytes of pairs to the next, the first starting right
/// after the header: the bounds region (16-bit pages) or a whole K section (quantized pages:
/// parameters and codes), as in `layout.rs` and `QuantLayout`.
fn pair_stride(shape: AttnShape, format: Format) -> usize {
    let dim = shape.head_dim;
    let stride =
        if format.is_quantized() { 4 * dim + dim * shape.block_tokens * format.k_bits() as usize / 8 } else { 4 * dim };
    debug_assert_eq!(
        HEADER_BYTES + stride,
        match crate::format::quant::QuantLayout::new(shape.page_shape(), format) {
            Ok(l) => l.k_params(1),
            Err(_) => shape.page_shape().bound_byte(1, 0),
        }
    );
    stride
}

/// Prefetches into L2 the lines [`bounds`] reads of a page: its header and every KV head's pairs.
/// Pages are far apart and their pairs a few lines each (a quantized page's heads a K section
/// apart), so the hardware prefetcher does not find them.
pub(super) fn prefetch_pairs(shape: AttnShape, format: Format, bytes: &[u8]) {
    let ahead = Prefetch::ahead(bytes.as_ptr());
    let (stride, pairs) = (pair_stride(shape, format), 4 * shape.head_dim);
    if stride == pairs {
        // 16-bit pages: the header and all heads' pairs are one region.
        ahead.span(0, HEADER_BYTES + shape.kv_heads * pairs);
        return;
    }
    ahead.span(0, HEADER_BYTES);
    for kv in 0..shape.kv_heads {
        ahead.span(HEADER_BYTES + kv * stride, pairs);
    }
}

/// `select::rank_pages` on 16 heads per vector: the per-head best bound and the sum of
/// `exp(scale·(U − best))` over pages (lanes of non-finite bounds masked off), then each page's
/// largest `scale·U − offset` across its heads (`+∞` when a bound is NaN or `+∞`).
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c; `bound.len()` is a
/// multiple of `heads`, which is positive.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn rank_pages(bound: &[f32], heads: usize, scale: f32) -> Vec<f32> {
    let pages = bound.len() / heads;
    let mut ranks = vec![f32::NEG_INFINITY; pages];
    let s = _mm512_set1_ps(scale);
    let infinity = _mm512_set1_ps(f32::INFINITY);
    for h0 in (0..heads).step_by(LANES) {
        let lanes = ((1u32 << (heads - h0).min(LANES)) - 1) as __mmask16;
        // Row `p` of this head tile; the masked loads and stores touch only `lanes`.
        let at = |p: usize| bound.as_ptr().wrapping_add(p * heads + h0);
        let finite =
            |u: __m512, lanes: __mmask16| _mm512_mask_cmp_ps_mask::<_CMP_LT_OQ>(lanes, _mm512_abs_ps(u), infinity);
        let mut best = _mm512_set1_ps(f32::NEG_INFINITY);
        for p in 0..pages {
            // SAFETY: row `p < pages`, heads `h0..` in `lanes` are inside `bound`.
            let u = unsafe { _mm512_maskz_loadu_ps(lanes, at(p)) };
            best = _mm512_mask_max_ps(best, finite(u, lanes), best, u);
        }
        let mut total = _mm512_setzero_ps();
        for p in 0..pages {
            // SAFETY: as above.
            let u = unsafe { _mm512_maskz_loadu_ps(lanes, at(p)) };
            let e = exp16(_mm512_mul_ps(s, _mm512_sub_ps(u, best)));
            total = _mm512_mask_add_ps(total, finite(u, lanes), total, e);
        }
        let mut t = [0.0f32; LANES];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(t.as_mut_ptr(), total) };
        let logs: [f32; LANES] = std::array::from_fn(|i| t[i].ln());
        // SAFETY: 16 floats.
        let offset = _mm512_fmadd_ps(s, best, unsafe { _mm512_loadu_ps(logs.as_ptr()) });
        for (p, rank) in ranks.iter_mut().enumerate() {
            // SAFETY: as above.
            let u = unsafe { _mm512_maskz_loadu_ps(lanes, at(p)) };
            let wild =
                lanes & !finite(u, lanes) & !_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(u, _mm512_set1_ps(f32::NEG_INFINITY));
            if wild != 0 {
                *rank = f32::INFINITY;
                continue;
            }
            let r = _mm512_mask_reduce_max_ps(finite(u, lanes), _mm512_fmsub_ps(s, u, offset));
            *rank = rank.max(r);
        }
    }
    ranks
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`: a transposing reduction tree,
/// 45 shuffles and adds for 16 sums instead of 16 separate reductions.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce16(v: &[__m512; LANES]) -> __m512 {
    // a[i], per 128-bit lane: partial sums [v2i, v2i+1, v2i, v2i+1].
    let mut a = [_mm512_setzero_ps(); 8];
    for (i, a) in a.iter_mut().enumerate() {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        *a = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    // b[i], per 128-bit lane: partial sums of v4i .. v4i+3, in order.
    let mut b = [_mm512_setzero_ps(); 4];
    for (i, b) in b.iter_mut().enumerate() {
        let (x, y) = (_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
        *b = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // Sum the four 128-bit lanes of each b[i] into lane i of the result.
    let even = |x, y| _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
    let odd = |x, y| _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
    let c0 = _mm512_add_ps(even(b[0], b[1]), odd(b[0], b[1]));
    let c1 = _mm512_add_ps(even(b[2], b[3]), odd(b[2], b[3]));
    _mm512_add_ps(even(c0, c1), odd(c0, c1))
}

/// For each page `p`, writes `out[p][at + g]` = lane sums of `Σ_{i < n} c[g × n + i] × x_{p,i}` for `G`
/// rows (reduce the lanes for the dot products), with `x_p` the `n` 16-bit values at `pairs[p]`
/// (f16, or bf16 when `bf16`). Each coefficient vector is loaded once for the `P` pages.
///
/// # Safety
///
/// Each `pairs[p]` readable for `2 × n` bytes, `c` for `G × n` floats; `at + G ≤ 16`; `n` a
/// multiple of 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot<const G: usize, const P: usize>(
    pairs: &[*const u8; P],
    bf16: bool,
    n: usize,
    c: *const f32,
    out: &mut [[MaybeUninit<__m512>; LANES]; P],
    at: usize,
) {
    let mut sums = [[_mm512_setzero_ps(); G]; P];
    for i in (0..n).step_by(LANES) {
        // SAFETY: values `i..i + 16 ≤ n` of each page and the same floats of each coefficient row.
        unsafe {
            let x: [__m512; P] = std::array::from_fn(|p| {
                let raw = _mm256_loadu_si256(pairs[p].add(2 * i).cast());
                if bf16 {
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
                } else {
                    _mm512_cvtph_ps(raw)
                }
            });
            for g in 0..G {
                let coefficient = _mm512_loadu_ps(c.add(g * n + i));
                for (sums, x) in sums.iter_mut().zip(&x) {
                    sums[g] = _mm512_fmadd_ps(coefficient, *x, sums[g]);
                }
            }
        }
    }
    for (out, sums) in out.iter_mut().zip(&sums) {
        for (out, sum) in out[at..at + G].iter_mut().zip(sums) {
            out.write(*sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce16_sums_each_vector_into_its_lane() {
        if !crate::attention::Isa::Avx512.is_available() {
            return;
        }
        let rows: Vec<[f32; 16]> = (0..16).map(|i| std::array::from_fn(|j| (i * 100 + j) as f32)).collect();
        // SAFETY: avx512 was detected just above; the arrays are 16 floats each.
        let got = unsafe { check(&rows) };
        let want: Vec<f32> = rows.iter().map(|r| r.iter().sum()).collect();
        assert_eq!(got.to_vec(), want);
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn check(rows: &[[f32; 16]]) -> [f32; 16] {
        let mut v = [_mm512_setzero_ps(); LANES];
        for (v, r) in v.iter_mut().zip(rows) {
            // SAFETY: 16 floats.
            *v = unsafe { _mm512_loadu_ps(r.as_ptr()) };
        }
        let mut out = [0.0f32; 16];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), reduce16(&v)) };
        out
    }
}
