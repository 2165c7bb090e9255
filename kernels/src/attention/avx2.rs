//! The AVX2 page kernel (with FMA and F16C): 8 `f32` lanes.
//!
//! The same three passes per KV head as the AVX-512 kernel (see `avx512.rs`), on 8 lanes and 16
//! registers:
//!
//! 1. **Scores**: per channel one 16-byte load = 8 tokens, widened (`vcvtph2ps`, or a 16-bit shift for
//!    bf16), times the broadcast `q[d]` of each head of the group; tiles of 16 tokens × up to 4 heads.
//! 2. **Softmax**: the running reference moves only when a score exceeds it by more than `SLACK`;
//!    vector `exp` from `exp.rs` with `2^n` built in the exponent bits; the partial last vector is
//!    masked by a lane-index compare and blends (left out of the test and the max, 0 after the `exp`).
//! 3. **Values**: per filled token one row load, FMA into register tiles of up to 4 heads × 16
//!    channels (2 heads × 32 channels for small groups).
//!
//! Like the AVX-512 kernel it prefetches one KV head ahead (see `kernel.rs`). It also serves 8-token
//! pages for the AVX-512 kernel. Quantized pages go to `avx2_quant.rs`, which reuses this file's
//! softmax, lane masks, reductions and tile heights. Memory safety rests on the length contract of
//! `kernel.rs`, checked by the dispatcher before each page.

use std::arch::x86_64::*;

use crate::format::Format;

use super::exp::{EXP_MAX, EXP_MIN, LN2_HI, LN2_LO, LOG2E, P};
use super::kernel::{PageJob, Running, SLACK};
use super::prefetch::Prefetch;

/// `f32` lanes per vector.
pub(super) const LANES: usize = 8;
/// Heads per score or value tile; larger groups take several tiles.
pub(super) const MAX_TILE_HEADS: usize = 4;

/// Expands `$body` once per tile height `1..=4`, with `$g` bound to it as a `const`.
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
            _ => {
                const $g: usize = 4;
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
/// The CPU must support avx2, fma and f16c, and `job` and `run` must satisfy the length contract of
/// `kernel.rs` (`Running::check`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn page(job: &PageJob<'_>, run: &mut Running<'_>) {
    debug_assert!(!job.format.is_quantized(), "quantized pages go to their own kernel");
    match job.format {
        // SAFETY: same features and contract as this function's.
        Format::Bf16 => unsafe { page_in::<true>(job, run) },
        // SAFETY: same features and contract as this function's.
        _ => unsafe { page_in::<false>(job, run) },
    }
}

/// [`page`] for one element encoding (`BF16` = bf16, else f16).
///
/// # Safety
///
/// As for [`page`].
#[target_feature(enable = "avx2,fma,f16c")]
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
                // SAFETY: `t + 8 × vectors ≤ padded ≤ block`, so every channel row read stays in
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
            // Register tiles: up to 2 heads × 4 vectors, or 4 heads × 2 vectors; `dim / 8` is even.
            let widest = if heads <= 2 { 4 } else { 2 };
            let p = run.scores[g0 * block..].as_ptr();
            let alpha = run.alpha[g0..].as_ptr();
            let acc = run.acc[(first_q + g0) * dim..].as_mut_ptr();
            let mut c = 0;
            while c < dim {
                let vectors = if (dim - c) / LANES >= widest { widest } else { 2 };
                // SAFETY: channels `c..c + 8 × vectors ≤ dim` (dim is a multiple of 16) of rows
                // `t < tokens ≤ block` of this head's V block; heads `g0..g0 + heads ≤ group` of the
                // scores, alpha and acc rows.
                unsafe {
                    let (v, a, pf) = (v_head.add(2 * c), acc.add(c), ahead_v.offset(2 * c));
                    // Only the first head tile prefetches; later tiles read the same rows.
                    let pf = if g0 == 0 { pf } else { Prefetch::none() };
                    with_heads!(heads, G => if vectors == 4 {
                        accumulate::<G, 4, BF16>(v, dim, tokens, p, block, alpha, a, pf)
                    } else {
                        accumulate::<G, 2, BF16>(v, dim, tokens, p, block, alpha, a, pf)
                    });
                }
                c += LANES * vectors;
            }
            g0 += heads;
        }
    }
}

/// Loads 8 elements at `src` and widens them to `f32`.
///
/// # Safety
///
/// `src` must be valid for reading 16 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const BF16: bool>(src: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
    let raw = unsafe { _mm_loadu_si128(src.cast()) };
    if BF16 { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw))) } else { _mm256_cvtph_ps(raw) }
}

/// Scores of `8 × NV` tokens for `G` query heads: `out[g × block + i] = Σ_d q[g × dim + d] × k_d[i]`.
///
/// # Safety
///
/// `k` points at token `t` of channel 0 of a channel-major K block with rows of `block` elements, and
/// `8 × NV` elements from `k + d × block` are readable for every `d < dim`; `q` has `G` rows of `dim`
/// floats; `out` has `G` rows of `block` floats with `8 × NV` writable from each row start. `ahead` is
/// a prefetch target laid out like `k`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_tile<const G: usize, const NV: usize, const BF16: bool>(
    k: *const u8,
    block: usize,
    dim: usize,
    q: *const f32,
    out: *mut f32,
    ahead: Prefetch,
) {
    let mut acc = [[_mm256_setzero_ps(); NV]; G];
    for d in 0..dim {
        ahead.span(2 * d * block, 16 * NV);
        // SAFETY: channel `d < dim` of the tile, `8 × NV` elements, readable per the contract; the
        // query reads are rows `g < G` at `d < dim`.
        unsafe {
            let row = k.add(2 * d * block);
            let mut keys = [_mm256_setzero_ps(); NV];
            for (j, key) in keys.iter_mut().enumerate() {
                *key = load8::<BF16>(row.add(16 * j));
            }
            for (g, acc) in acc.iter_mut().enumerate() {
                let qd = _mm256_set1_ps(*q.add(g * dim + d));
                for (a, key) in acc.iter_mut().zip(&keys) {
                    *a = _mm256_fmadd_ps(*key, qd, *a);
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (j, a) in acc.iter().enumerate() {
            // SAFETY: row `g < G`, floats `8j..8j + 8 ≤ 8 × NV`, writable per the contract.
            unsafe { _mm256_storeu_ps(out.add(g * block + LANES * j), *a) };
        }
    }
}

/// All-ones in lanes `i < n` (`n ≤ 8`), zero elsewhere.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn lanes_below(n: usize) -> __m256 {
    let index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), index))
}

/// The largest of the 8 lanes (NaN-free inputs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_max(x: __m256) -> f32 {
    let x = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_max_ss(x, _mm_shuffle_ps::<0b01>(x, x));
    _mm_cvtss_f32(x)
}

/// The sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn reduce_add(x: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps::<0b01>(x, x));
    _mm_cvtss_f32(x)
}

/// The per-head values of one softmax step, for a tile of up to 4 heads.
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
/// `tokens.next_multiple_of(8) ≤ block` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn softmax<const G: usize>(scores: *mut f32, block: usize, tokens: usize, step: &mut SoftmaxStep) {
    let full = tokens / LANES;
    let rest = tokens % LANES;
    let vectors = full + usize::from(rest != 0);
    let tail = lanes_below(rest);
    let all = lanes_below(LANES);
    // Lanes of vector `i` that hold filled tokens, as an all-ones/all-zeros lane mask.
    let filled = |i: usize| if i < full { all } else { tail };
    // Vector `i` of row `g`; for `g < G` and `i < vectors` inside the caller's rows.
    let at = |g: usize, i: usize| scores.wrapping_add(g * block + LANES * i);
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);

    let mut over = [_mm256_setzero_ps(); G];
    for i in 0..vectors {
        for (g, over) in over.iter_mut().enumerate() {
            let limit = _mm256_set1_ps(step.reference[g] + SLACK);
            // SAFETY: see `at`.
            let s = unsafe { _mm256_loadu_ps(at(g, i)) };
            *over = _mm256_or_ps(*over, _mm256_and_ps(filled(i), _mm256_cmp_ps::<_CMP_GT_OQ>(s, limit)));
        }
    }
    for (g, over) in over.iter().enumerate() {
        let old = step.reference[g];
        step.alpha[g] = 1.0;
        if _mm256_movemask_ps(*over) != 0 {
            let mut high = neg_inf;
            for i in 0..vectors {
                // SAFETY: see `at`.
                let s = unsafe { _mm256_loadu_ps(at(g, i)) };
                high = _mm256_max_ps(high, _mm256_blendv_ps(neg_inf, s, filled(i)));
            }
            let new = old.max(reduce_max(high));
            step.reference[g] = new;
            step.alpha[g] = (old - new).exp();
        }
    }

    let mut total = [_mm256_setzero_ps(); G];
    for i in 0..vectors {
        for (g, total) in total.iter_mut().enumerate() {
            let shift = _mm256_set1_ps(step.reference[g]);
            // SAFETY: see `at`.
            unsafe {
                let s = _mm256_loadu_ps(at(g, i));
                let p = _mm256_and_ps(filled(i), exp8(_mm256_sub_ps(s, shift)));
                _mm256_storeu_ps(at(g, i), p);
                *total = _mm256_add_ps(*total, p);
            }
        }
    }
    for (g, total) in total.iter().enumerate() {
        step.page_sum[g] = reduce_add(*total);
    }
}

/// `exp` of 8 lanes, the scheme of `exp.rs`; lanes below `EXP_MIN` (and −∞) give exactly 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp8(x: __m256) -> __m256 {
    let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_MIN));
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
    let n =
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut y = _mm256_set1_ps(P[0]);
    for c in &P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
    }
    // n ∈ [-126, 127] after the clamp, so n + 127 is a valid biased exponent.
    let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased));
    _mm256_and_ps(keep, _mm256_mul_ps(y, scale))
}

/// `acc[g] = alpha[g] × acc[g] + Σ_{t < tokens} p[g][t] × v_t` over `8 × WC` channels, for `G` heads.
///
/// # Safety
///
/// `v` points at channel `c` of token row 0 of a token-major V block with rows of `dim` elements, and
/// `8 × WC` elements are readable from `v + t × dim` for every `t < tokens`; `p` has `G` rows of
/// `block ≥ tokens` floats; `alpha` has `G` floats; `acc` has `G` rows of `dim` floats with `8 × WC`
/// readable and writable from each row start. `ahead` is a prefetch target laid out like `v`.
#[expect(clippy::too_many_arguments, reason = "a register-tiled inner kernel; a struct would obscure it")]
#[target_feature(enable = "avx2,fma,f16c")]
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
    let mut sums = [[_mm256_setzero_ps(); WC]; G];
    for (g, sums) in sums.iter_mut().enumerate() {
        // SAFETY: row `g < G` of `alpha` and `acc`, `8 × WC` floats, per the contract.
        unsafe {
            let scale = _mm256_set1_ps(*alpha.add(g));
            for (w, s) in sums.iter_mut().enumerate() {
                *s = _mm256_mul_ps(_mm256_loadu_ps(acc.add(g * dim + LANES * w)), scale);
            }
        }
    }
    for t in 0..tokens {
        ahead.span(2 * t * dim, 16 * WC);
        // SAFETY: token row `t < tokens`, `8 × WC` elements, and `p[g][t]` with `t < block`.
        unsafe {
            let row = v.add(2 * t * dim);
            let mut values = [_mm256_setzero_ps(); WC];
            for (w, value) in values.iter_mut().enumerate() {
                *value = load8::<BF16>(row.add(16 * w));
            }
            for (g, sums) in sums.iter_mut().enumerate() {
                let weight = _mm256_set1_ps(*p.add(g * block + t));
                for (s, value) in sums.iter_mut().zip(&values) {
                    *s = _mm256_fmadd_ps(*value, weight, *s);
                }
            }
        }
    }
    for (g, sums) in sums.iter().enumerate() {
        for (w, s) in sums.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm256_storeu_ps(acc.add(g * dim + LANES * w), *s) };
        }
    }
}
