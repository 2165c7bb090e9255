//! The AVX-512 page kernel (F, BW, VL; AVX2, FMA and F16C are also required): 16 `f32` lanes.
//!
//! Per KV head, in three passes over the page:
//!
//! 1. **Scores.** Keys are channel-major, so for each channel `d` one 32-byte load is 16 tokens of
//!    that channel; converted to `f32` (`vcvtph2ps` for f16, a 16-bit left shift for bf16) it is
//!    multiplied by the broadcast `q[d]` of each query head of the GQA group (which share the load)
//!    and accumulated, giving 16 scores per head per vector with no horizontal sums. Tiles are 32
//!    tokens (two vectors) × up to 8 heads, all in registers.
//! 2. **Softmax.** Per head: move the running reference only if a score exceeds it by more than
//!    `SLACK` (see `kernel.rs`), then `p_t = exp(s_t − reference)` with a vector `exp` (see `exp.rs`)
//!    and the page sum. The last, partial vector is masked: its unfilled lanes are left out of the
//!    comparison and the max and zeroed after the `exp`, by mask, never by arithmetic.
//! 3. **Values.** For each filled token, load its value row once and FMA `p_t × v_t` into the
//!    accumulators of every head of the group; accumulators are register tiles of up to 4 heads × 64
//!    channels (or 8 heads × 32), loaded and rescaled by `alpha` once per page.
//!
//! While reading one KV head it prefetches the same offsets of the next (or of head 0 of the next
//! page, when the caller names it) into L2 (see `prefetch.rs`), so memory reads overlap the
//! arithmetic.
//!
//! Pages of 8 tokens (narrower than a vector) go to the AVX2 kernel, which the required features
//! include.
//!
//! Memory safety rests on the length contract of `kernel.rs`, checked by the dispatcher before each
//! page: every pointer below is derived from `job.bytes` or a `Running` slice and stays inside the
//! region the comment at its use names.

use std::arch::x86_64::*;

use crate::format::Format;

use super::exp::{EXP_FLOOR, EXP_MAX, LN2_HI, LN2_LO, LOG2E, P};
use super::kernel::{PageJob, Running, SLACK};
use super::prefetch::Prefetch;

pub(super) const LANES: usize = 16;
/// Heads per score or value tile; larger groups take several tiles.
pub(super) const MAX_TILE_HEADS: usize = 8;

/// Expands `$body` once per tile height `1..=8`, with `$g` bound to it as a `const`.
macro_rules! with_heads {
    ($n:expr, $g:ident => $body:expr) => {
        match $n {
            1 => {
                const $g: usize = 1;
                $body
            }
            2 => {
                const $g: usize = 2;
                $body
            }
            3 => {
                const $g: usize = 3;
                $body
            }
            4 => {
                const $g: usize = 4;
                $body
            }
            5 => {
                const $g: usize = 5;
                $body
            }
            6 => {
                const $g: usize = 6;
                $body
            }
            7 => {
                const $g: usize = 7;
                $body
            }
            _ => {
                const $g: usize = 8;
                $body
            }
        }
    };
}
pub(super) use with_heads;

/// Folds one page into the running state.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c, and `job` and `run` must
/// satisfy the length contract of `kernel.rs` (`Running::check`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn page(job: &PageJob<'_>, run: &mut Running<'_>) {
    if job.shape.block_tokens < LANES {
        // SAFETY: the caller guarantees avx2, fma and f16c and the length contract, which is all the
        // AVX2 kernel needs.
        return unsafe { super::avx2::page(job, run) };
    }
    debug_assert!(!job.format.is_quantized(), "quantized pages go to their own kernel");
    match job.format {
        // SAFETY: same features and contract as this function's.
        Format::Bf16 => unsafe { page_in::<true>(job, run) },
        // SAFETY: same features and contract as this function's.
        _ => unsafe { page_in::<false>(job, run) },
    }
}

/// [`page`] for one element encoding (`BF16` = bf16, else f16), `block_tokens ≥ 16`.
///
/// # Safety
///
/// As for [`page`], and `job.shape.block_tokens ≥ 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn page_in<const BF16: bool>(job: &PageJob<'_>, run: &mut Running<'_>) {
    let shape = job.shape;
    let (dim, group, block, tokens) = (shape.head_dim, shape.group(), shape.block_tokens, job.tokens);
    let padded = tokens.next_multiple_of(LANES);
    let head_bytes = dim * block * 2;
    // SAFETY: the page holds a K region of `kv_heads × head_bytes` bytes at `k_offset` and a V
    // region of the same size at `v_offset` (contract: `bytes.len() ≥ page_bytes`, offsets computed
    // from the shape), so both are in bounds.
    let (k_region, v_region) = unsafe { (job.bytes.as_ptr().add(job.k_offset), job.bytes.as_ptr().add(job.v_offset)) };

    for kv in 0..shape.kv_heads {
        let first_q = kv * group;
        // SAFETY: `kv < kv_heads`, so both offsets start a head's block inside its region.
        let (k_head, v_head) = unsafe { (k_region.add(kv * head_bytes), v_region.add(kv * head_bytes)) };
        // Prefetch targets (never dereferenced): the next head's blocks, or head 0 of the next page.
        let ahead = |k: *const u8, v: *const u8| (Prefetch::ahead(k), Prefetch::ahead(v));
        let (ahead_k, ahead_v) = if kv + 1 < shape.kv_heads {
            ahead(k_head.wrapping_add(head_bytes), v_head.wrapping_add(head_bytes))
        } else if let Some(next) = job.next {
            ahead(next.as_ptr().wrapping_add(job.k_offset), next.as_ptr().wrapping_add(job.v_offset))
        } else {
            (Prefetch::none(), Prefetch::none())
        };

        let mut g0 = 0;
        while g0 < group {
            let heads = (group - g0).min(MAX_TILE_HEADS);
            let q = run.q[(first_q + g0) * dim..].as_ptr();
            let out = run.scores[g0 * block..].as_mut_ptr();
            let mut t = 0;
            while t < padded {
                let two = padded - t >= 2 * LANES;
                // SAFETY: `t + 16 × vectors ≤ padded ≤ block`, so every channel row read stays in
                // this head's K block and every store in these heads' `block`-long score rows;
                // `g0 + heads ≤ group` keeps q and score rows inside the group.
                unsafe {
                    let (k, s, pf) = (k_head.add(2 * t), out.add(t), ahead_k.offset(2 * t));
                    // Only the first head tile prefetches; later tiles read the same rows.
                    let pf = if g0 == 0 { pf } else { Prefetch::none() };
                    with_heads!(heads, G => if two {
                        score_tile::<G, 2, BF16>(k, block, dim, q, s, pf)
                    } else {
                        score_tile::<G, 1, BF16>(k, block, dim, q, s, pf)
                    });
                }
                t += if two { 2 * LANES } else { LANES };
            }
            g0 += heads;
        }

        let mut g0 = 0;
        while g0 < group {
            let heads = (group - g0).min(MAX_TILE_HEADS);
            let first = first_q + g0;
            let mut step = SoftmaxStep::default();
            step.reference[..heads].copy_from_slice(&run.reference[first..first + heads]);
            let scores = run.scores[g0 * block..].as_mut_ptr();
            // SAFETY: heads `g0..g0 + heads ≤ group` of the scores, each a row of `block ≥ padded`
            // floats.
            unsafe { with_heads!(heads, G => softmax::<G>(scores, block, tokens, &mut step)) };
            // Kept inline in each ISA file: a shared safe helper (SoftmaxStep generic over the tile
            // width, in kernel.rs) measured ~8% slower at 32k for the SmolLM2 shape (A/B, 2026-11-30).
            for g in 0..heads {
                let qh = first + g;
                run.sum[qh] = step.alpha[g] * run.sum[qh] + step.page_sum[g];
                run.reference[qh] = step.reference[g];
                run.page_ref[qh] = step.reference[g];
                run.page_sum[qh] = step.page_sum[g];
                run.alpha[g0 + g] = step.alpha[g];
            }
            g0 += heads;
        }

        let mut g0 = 0;
        while g0 < group {
            let heads = (group - g0).min(MAX_TILE_HEADS);
            // Register tiles: up to 4 heads × 4 vectors, or 8 heads × 2 vectors.
            let widest = if heads <= 4 { 4 } else { 2 };
            let p = run.scores[g0 * block..].as_ptr();
            let alpha = run.alpha[g0..].as_ptr();
            let acc = run.acc[(first_q + g0) * dim..].as_mut_ptr();
            let mut c = 0;
            while c < dim {
                let left = (dim - c) / LANES;
                let vectors = if left >= widest { widest } else { left.min(2) };
                // SAFETY: channels `c..c + 16 × vectors ≤ dim` of rows `t < tokens ≤ block` of this
                // head's V block; heads `g0..g0 + heads ≤ group` of the scores, alpha and acc rows.
                unsafe {
                    let (v, a, pf) = (v_head.add(2 * c), acc.add(c), ahead_v.offset(2 * c));
                    // Only the first head tile prefetches; later tiles read the same rows.
                    let pf = if g0 == 0 { pf } else { Prefetch::none() };
                    with_heads!(heads, G => match vectors {
                        4 => accumulate::<G, 4, BF16>(v, dim, tokens, p, block, alpha, a, pf),
                        2 => accumulate::<G, 2, BF16>(v, dim, tokens, p, block, alpha, a, pf),
                        _ => accumulate::<G, 1, BF16>(v, dim, tokens, p, block, alpha, a, pf),
                    });
                }
                c += LANES * vectors;
            }
            g0 += heads;
        }
    }
}

/// Loads 16 elements at `src` and widens them to `f32`.
///
/// # Safety
///
/// `src` must be valid for reading 32 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load16<const BF16: bool>(src: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 32 readable bytes; the load is unaligned.
    let raw = unsafe { _mm256_loadu_si256(src.cast()) };
    if BF16 { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw))) } else { _mm512_cvtph_ps(raw) }
}

/// Scores of `16 × NV` tokens for `G` query heads: `out[g × block + i] = Σ_d q[g × dim + d] × k_d[i]`.
///
/// # Safety
///
/// `k` points at token `t` of channel 0 of a channel-major K block with rows of `block` elements, and
/// `16 × NV` elements from `k + d × block` are readable for every `d < dim`; `q` has `G` rows of
/// `dim` floats; `out` has `G` rows of `block` floats with `16 × NV` writable from each row start.
/// `ahead` is a prefetch target laid out like `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn score_tile<const G: usize, const NV: usize, const BF16: bool>(
    k: *const u8,
    block: usize,
    dim: usize,
    q: *const f32,
    out: *mut f32,
    ahead: Prefetch,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; G];
    for d in 0..dim {
        ahead.span(2 * d * block, 32 * NV);
        // SAFETY: channel `d < dim` of the tile, `16 × NV` elements, readable per the contract; the
        // query reads are rows `g < G` at `d < dim`.
        unsafe {
            let row = k.add(2 * d * block);
            let mut keys = [_mm512_setzero_ps(); NV];
            for (j, key) in keys.iter_mut().enumerate() {
                *key = load16::<BF16>(row.add(32 * j));
            }
            for (g, acc) in acc.iter_mut().enumerate() {
                let qd = _mm512_set1_ps(*q.add(g * dim + d));
                for (a, key) in acc.iter_mut().zip(&keys) {
                    *a = _mm512_fmadd_ps(*key, qd, *a);
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (j, a) in acc.iter().enumerate() {
            // SAFETY: row `g < G`, floats `16j..16j + 16 ≤ 16 × NV`, writable per the contract.
            unsafe { _mm512_storeu_ps(out.add(g * block + LANES * j), *a) };
        }
    }
}

/// [`reduce_lanes`] operation: the sum of the lanes.
pub(crate) const SUM: u8 = 0;
/// [`reduce_lanes`] operation: the largest lane (NaN-free inputs).
pub(crate) const MAX: u8 = 1;
/// [`reduce_lanes`] operation: the smallest lane (NaN-free inputs).
pub(crate) const MIN: u8 = 2;

/// `x OP y` lane by lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn combine<const OP: u8>(x: __m512, y: __m512) -> __m512 {
    match OP {
        MAX => _mm512_max_ps(x, y),
        MIN => _mm512_min_ps(x, y),
        _ => _mm512_add_ps(x, y),
    }
}

/// Lane `i < 4` of the result is the sum (`SUM`), the largest (`MAX`) or the smallest (`MIN`) of the 16 lanes of `v[i]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce4<const OP: u8>(v: &[__m512]) -> __m512 {
    let op = combine::<OP>;
    let a0 = op(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    let a1 = op(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    let (x, y) = (_mm512_castps_pd(a0), _mm512_castps_pd(a1));
    // Per 128-bit lane: partial results of v0 .. v3, in order.
    let b = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    let c = op(b, _mm512_shuffle_f32x4::<0b01_00_11_10>(b, b));
    op(c, _mm512_shuffle_f32x4::<0b10_11_00_01>(c, c))
}

/// Lane `i < 8` of the result is the sum (`SUM`), the largest (`MAX`) or the smallest (`MIN`) of the 16 lanes of `v[i]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce8<const OP: u8>(v: &[__m512]) -> __m512 {
    let op = combine::<OP>;
    let mut a = [_mm512_setzero_ps(); 4];
    for (i, a) in a.iter_mut().enumerate() {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        *a = op(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    // b[i], per 128-bit lane: partial results of v4i .. v4i+3, in order.
    let mut b = [_mm512_setzero_ps(); 2];
    for (i, b) in b.iter_mut().enumerate() {
        let (x, y) = (_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
        *b = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // 128-bit lanes: b0 lanes 0 + 1, b0 lanes 2 + 3, b1 lanes 0 + 1, b1 lanes 2 + 3.
    let c = op(_mm512_shuffle_f32x4::<0b10_00_10_00>(b[0], b[1]), _mm512_shuffle_f32x4::<0b11_01_11_01>(b[0], b[1]));
    op(_mm512_shuffle_f32x4::<0b00_00_10_00>(c, c), _mm512_shuffle_f32x4::<0b00_00_11_01>(c, c))
}

/// Lane `i < n` of the result is the sum (`SUM`), the largest (`MAX`) or the smallest (`MIN`) of the 16 lanes of `v[i]`,
/// `n ≤ 8`: a transposing reduction tree (13 or 24 shuffles and operations for up to 4 or 8
/// reductions instead of 8 each, and a short dependency chain). The vectors from `n` on are read;
/// only the lanes below `n` are meaningful.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) fn reduce_lanes<const OP: u8>(v: &[__m512; MAX_TILE_HEADS], n: usize) -> __m512 {
    if n <= 4 { reduce4::<OP>(v) } else { reduce8::<OP>(v) }
}

/// The per-head values of one softmax step, for a tile of up to 8 heads.
#[derive(Default)]
pub(super) struct SoftmaxStep {
    /// In: the running reference of each head. Out: the reference after this page.
    pub reference: [f32; MAX_TILE_HEADS],
    /// Out: Σ exp(s − reference) over the page's filled tokens.
    pub page_sum: [f32; MAX_TILE_HEADS],
    /// Out: exp(old reference − new reference), the rescale of earlier sums.
    pub alpha: [f32; MAX_TILE_HEADS],
}

/// Softmax step of `G` heads over `tokens` scores each, in place: leaves `p_t = exp(s_t − reference)`
/// in the scores (0 in the unfilled lanes of the last vector) and fills `step`.
///
/// A head's reference moves only when one of its filled scores exceeds the reference by more than
/// `SLACK` (always on the first page, where it is −∞); otherwise no max reduction and no `alpha`
/// exponential are needed. The heads are processed side by side so their `exp` chains overlap.
///
/// # Safety
///
/// `scores` must point at `G` rows of `block` floats, each valid for reading and writing
/// `tokens.next_multiple_of(16) ≤ block` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn softmax<const G: usize>(scores: *mut f32, block: usize, tokens: usize, step: &mut SoftmaxStep) {
    let full = tokens / LANES;
    let tail: __mmask16 = ((1u32 << (tokens % LANES)) - 1) as __mmask16;
    let vectors = full + usize::from(tail != 0);
    // Lanes of vector `i` that hold filled tokens.
    let filled = |i: usize| if i < full { !0 } else { tail };
    // Vector `i` of row `g`; for `g < G` and `i < vectors` inside the caller's rows.
    let at = |g: usize, i: usize| scores.wrapping_add(g * block + LANES * i);

    let mut over = [0 as __mmask16; G];
    for i in 0..vectors {
        for (g, over) in over.iter_mut().enumerate() {
            let limit = _mm512_set1_ps(step.reference[g] + SLACK);
            // SAFETY: see `at`.
            let s = unsafe { _mm512_loadu_ps(at(g, i)) };
            *over |= _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(filled(i), s, limit);
        }
    }
    for (g, over) in over.iter().enumerate() {
        let old = step.reference[g];
        step.alpha[g] = 1.0;
        if *over != 0 {
            let mut high = _mm512_set1_ps(f32::NEG_INFINITY);
            for i in 0..vectors {
                // SAFETY: see `at`.
                let s = unsafe { _mm512_loadu_ps(at(g, i)) };
                high = _mm512_mask_max_ps(high, filled(i), high, s);
            }
            let new = old.max(_mm512_reduce_max_ps(high));
            step.reference[g] = new;
            step.alpha[g] = (old - new).exp();
        }
    }

    let mut total = [_mm512_setzero_ps(); G];
    for i in 0..vectors {
        for (g, total) in total.iter_mut().enumerate() {
            let shift = _mm512_set1_ps(step.reference[g]);
            // SAFETY: see `at`.
            unsafe {
                let s = _mm512_loadu_ps(at(g, i));
                let p = _mm512_maskz_mov_ps(filled(i), exp16(_mm512_sub_ps(s, shift)));
                _mm512_storeu_ps(at(g, i), p);
                *total = _mm512_add_ps(*total, p);
            }
        }
    }
    for (g, total) in total.iter().enumerate() {
        step.page_sum[g] = _mm512_reduce_add_ps(*total);
    }
}

/// `exp` of 16 lanes, the scheme of `exp.rs`: inputs are clamped to at least `EXP_FLOOR` (so `−∞`
/// gives 0) and `2^n` is applied with `vscalefps`, which underflows gracefully.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR)), _mm512_set1_ps(EXP_MAX));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(LOG2E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut y = _mm512_set1_ps(P[0]);
    for c in &P[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
    }
    _mm512_scalef_ps(y, n)
}

/// `acc[g] = alpha[g] × acc[g] + Σ_{t < tokens} p[g][t] × v_t` over `16 × WC` channels, for `G` heads.
///
/// # Safety
///
/// `v` points at channel `c` of token row 0 of a token-major V block with rows of `dim` elements, and
/// `16 × WC` elements are readable from `v + t × dim` for every `t < tokens`; `p` has `G` rows of
/// `block ≥ tokens` floats; `alpha` has `G` floats; `acc` has `G` rows of `dim` floats with
/// `16 × WC` readable and writable from each row start. `ahead` is a prefetch target laid out like
/// `v`.
#[expect(clippy::too_many_arguments, reason = "a register-tiled inner kernel; a struct would obscure it")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn accumulate<const G: usize, const WC: usize, const BF16: bool>(
    v: *const u8,
    dim: usize,
    tokens: usize,
    p: *const f32,
    block: usize,
    alpha: *const f32,
    acc: *mut f32,
    ahead: Prefetch,
) {
    let mut sums = [[_mm512_setzero_ps(); WC]; G];
    for (g, sums) in sums.iter_mut().enumerate() {
        // SAFETY: row `g < G` of `alpha` and `acc`, `16 × WC` floats, per the contract.
        unsafe {
            let scale = _mm512_set1_ps(*alpha.add(g));
            for (w, s) in sums.iter_mut().enumerate() {
                *s = _mm512_mul_ps(_mm512_loadu_ps(acc.add(g * dim + LANES * w)), scale);
            }
        }
    }
    for t in 0..tokens {
        ahead.span(2 * t * dim, 32 * WC);
        // SAFETY: token row `t < tokens`, `16 × WC` elements, and `p[g][t]` with `t < block`.
        unsafe {
            let row = v.add(2 * t * dim);
            let mut values = [_mm512_setzero_ps(); WC];
            for (w, value) in values.iter_mut().enumerate() {
                *value = load16::<BF16>(row.add(32 * w));
            }
            for (g, sums) in sums.iter_mut().enumerate() {
                let weight = _mm512_set1_ps(*p.add(g * block + t));
                for (s, value) in sums.iter_mut().zip(&values) {
                    *s = _mm512_fmadd_ps(*value, weight, *s);
                }
            }
        }
    }
    for (g, sums) in sums.iter().enumerate() {
        for (w, s) in sums.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm512_storeu_ps(acc.add(g * dim + LANES * w), *s) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::Isa;

    #[test]
    fn transposing_reductions_give_each_vector_its_lane() {
        if !Isa::Avx512.is_available() {
            return;
        }
        let rows: Vec<[f32; 16]> =
            (0..8).map(|i| std::array::from_fn(|j| ((i * 37 + j * 11) % 23) as f32 - 7.0)).collect();
        for n in [1, 3, 4, 5, 8] {
            // SAFETY: the features were detected just above; the rows are 16 floats each.
            let (sums, maxima) = unsafe { check(&rows, n) };
            for (i, r) in rows.iter().enumerate().take(n) {
                assert_eq!(sums[i], r.iter().sum::<f32>(), "sum {i} of {n}");
                assert_eq!(maxima[i], r.iter().copied().fold(f32::MIN, f32::max), "max {i} of {n}");
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn check(rows: &[[f32; 16]], n: usize) -> ([f32; 16], [f32; 16]) {
        let mut v = [_mm512_setzero_ps(); MAX_TILE_HEADS];
        for (v, r) in v.iter_mut().zip(rows) {
            // SAFETY: 16 floats.
            *v = unsafe { _mm512_loadu_ps(r.as_ptr()) };
        }
        let (mut sums, mut maxima) = ([0.0f32; 16], [0.0f32; 16]);
        // SAFETY: 16 floats each.
        unsafe {
            _mm512_storeu_ps(sums.as_mut_ptr(), reduce_lanes::<SUM>(&v, n));
            _mm512_storeu_ps(maxima.as_mut_ptr(), reduce_lanes::<MAX>(&v, n));
        }
        (sums, maxima)
    }
}
