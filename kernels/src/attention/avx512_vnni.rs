//! The AVX-512 VNNI page kernel for quantized pages (q8, q4, q2, k8v4): integer key scores.
//!
//! The passes of `avx512_quant.rs` (scores, softmax, values), with the key scores computed on
//! 16-bit integers by `vpdpwssd` (16 lanes, each `acc + a0·b0 + a1·b1` on i16 pairs into i32)
//! instead of widening every code to `f32` for an FMA. Codes are never converted to floats: one
//! `vpermb` (VBMI) turns 64 bytes of codes into 16 dword lanes holding two zero-extended codes, and
//! one `vpdpwssd` per query head multiplies them by a pair of 16-bit query elements. The softmax and
//! the values are exactly `avx512_quant.rs`'s (same functions, `f32` FMAs).
//!
//! **Query.** With key channel `d` reconstructed as `min_d + scale_d × c_dt`, per page, KV head and
//! query head the kernel forms `q'_d = q_d × scale_d` (f32) and quantizes it symmetrically to i16
//! with one step per query head, `s = max_d |q'_d| / 32767`, `q16_d = round(q'_d / s)`. Then
//!
//! ```text
//!   score_t = Σ_d q_d·min_d + center × Σ_d (q'_d − s·q16_d) + s × Σ_d q16_d × c_dt
//! ```
//!
//! where the middle term (the rounding residual times the middle code `center = (2^kb − 1) / 2`)
//! removes the mean of the rounding error, leaving `Σ_d (q'_d − s·q16_d)(c_dt − center)`: each
//! residual is at most `s / 2`, 1.5e-5 of the largest `|q'_d|`, so a score moves by at most
//! `(s / 2) × Σ_d |c_dt − center|`, typically (independent residuals, codes spread over their
//! range) `σ = s × sqrt(D) × (2^kb − 1) / 12`. That is an absolute error in logits, which the
//! softmax turns into a relative error of about `σ` in the probabilities. A key's own quantization
//! error is `scale_d / 2` per channel, 2 (q2) to 128 (q8) times larger per element than this step
//! relative to its range.
//!
//! **Precision guard.** Where `σ` would exceed [`MAX_SCORE_ERROR`] (2e-5 logits: large logits,
//! from large query or key magnitudes or a large softmax scale) a tile of query heads takes the
//! `f32` FMA score path of `avx512_quant.rs` instead, so the outputs stay within about 1e-4 of the
//! scalar kernel's (relative to the largest output of each head) in every regime; with the usual
//! `1 / sqrt(head_dim)` scale and keys and queries of magnitude up to 2, `σ` is about 2e-5 at most
//! and the integer path runs.
//!
//! **Exactness.** The integer sums are exact: with `|q16| ≤ 32767`, codes below 256 and `head_dim ≤
//! 256`, `|Σ| ≤ 256 × 255 × 32767 < 2^31` (checked per page).
//!
//! **Key tiles.** Keys are channel-major, so a 64-byte load holds `64 / T` channel rows of the
//! tile's `T` bytes (`T` = the tile's tokens × kb / 8; a tile is 32 or 16 tokens). Two zero-masking
//! `vpermb` put the codes of two channels at one byte offset into the two i16 halves of each dword,
//! so a lane is one byte offset of one channel pair. For 4- and 2-bit codes a byte holds 2 or 4
//! tokens; rather than splitting nibbles before the multiply, the kernel multiplies the whole byte
//! and its right shifts by 4 (or 2, 4, 6) and separates the tokens after the channel loop by exact
//! integer algebra: byte `b = c0 + 16·c1` gives `Σq·c0 = Σq·b − 16·Σq·(b >> 4)` (for 2 bits,
//! `c_i = (b >> 2i) − 4·(b >> 2i + 2)`). Where a vector holds several channel pairs at once (narrow
//! tiles), the query is broadcast in the matching pattern and lanes of the same tokens are summed
//! after the loop. Tiles whose rows are not contiguous in the page (block_tokens above 32, or the
//! last 16 tokens of a wider page) are first copied into a stack buffer of contiguous rows.
//!
//! Unfilled slots: their key scores are computed from whatever codes they hold (any byte is a small
//! integer) and discarded by the softmax's masks; the value path is `avx512_quant.rs`'s.
//!
//! Pages of fewer than 16 token slots go to the scalar kernel (the dispatcher checks). Memory safety
//! rests on the length contract of `kernel.rs`, checked by the dispatcher before each page, and on
//! the header check that fixed the page's format and shape: every pointer below is derived from
//! `job.bytes`, a `Running` slice or a stack buffer, and stays inside the region the comment at its
//! use names.

use std::arch::x86_64::*;
use std::hint::black_box;
use std::mem::MaybeUninit;

use crate::format::Format;
use crate::format::quant::V_GROUP;

use super::avx512::{LANES, MAX, MAX_TILE_HEADS, SUM, SoftmaxStep, reduce_lanes, softmax, with_heads};
use super::avx512_quant::{HeadBytes, ValueTile, accumulate, scale_query, score_tile as score_tile_f32, weigh_tokens};
use super::kernel::{PageJob, Running};
use super::prefetch::Prefetch;

/// `vpdpwssd`: per dword lane, `acc + a.lo × b.lo + a.hi × b.hi` on i16 halves (wrapping).
///
/// Inline assembly rather than `_mm512_dpwssd_epi32`: for the generic x86-64 scheduling model
/// LLVM's machine combiner splits most of these into `vpmaddwd` + `vpaddd` to shorten the
/// accumulator's dependency chain (found in the disassembly: 239 of 376 in one build), two uops on
/// the two vector ports where one suffices; the loops here keep enough accumulators instead.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: one register-only AVX-512 VNNI instruction, which this function's target features
    // (and so every caller's) include; it touches no memory, stack or flags.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The largest magnitude of a quantized query element.
const Q_MAX: f32 = 32767.0;

/// Below this largest magnitude a query row is treated as zero (all its value goes into the
/// residual correction), so `Q_MAX / top` cannot overflow.
const Q_TINY: f32 = 1e-30;

/// The largest typical score error, in logits, for which a tile of query heads uses integer
/// scores (see the module documentation): about the error at the usual softmax scale for keys
/// and queries of magnitude 2, and a relative error of 2e-5 in the probabilities.
const MAX_SCORE_ERROR: f32 = 2e-5;

/// Bytes of the stack buffer for a key tile whose rows are not contiguous in the page: `head_dim`
/// rows of at most 32 bytes (32 tokens of 8-bit codes).
const STAGE_BYTES: usize = 256 * 32;

/// Keeps the even bytes of each dword's words: after `vpermb`, byte `4L` and `4L + 2` hold codes and
/// bytes `4L + 1`, `4L + 3` are zero, so each dword is two zero-extended i16 codes.
const WORD_LOW_BYTES: __mmask64 = 0x5555_5555_5555_5555;

/// Folds one quantized page into the running state.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx512dq, avx512vnni, avx512vbmi, avx2, fma
/// and f16c; `job` and `run` must satisfy the length contract of `kernel.rs` (`Running::check`);
/// `job.format` is quantized and `job.shape.block_tokens ≥ 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn page(job: &PageJob<'_>, run: &mut Running<'_>) {
    debug_assert!(job.shape.block_tokens >= LANES);
    match job.format {
        // SAFETY: same features and contract as this function's; the format has these widths.
        Format::Q8 => unsafe { page_in::<8, 8>(job, run) },
        // SAFETY: as above.
        Format::Q4 => unsafe { page_in::<4, 4>(job, run) },
        // SAFETY: as above.
        Format::Q2 => unsafe { page_in::<2, 2>(job, run) },
        // SAFETY: as above.
        Format::K8V4 => unsafe { page_in::<8, 4>(job, run) },
        _ => super::scalar::page(job, run),
    }
}

/// [`page`] for `KB`-bit keys and `VB`-bit values.
///
/// # Safety
///
/// As for [`page`], and `job.format` has those code widths.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn page_in<const KB: usize, const VB: usize>(job: &PageJob<'_>, run: &mut Running<'_>) {
    let shape = job.shape;
    let (dim, group, block, tokens) = (shape.head_dim, shape.group(), shape.block_tokens, job.tokens);
    // The bounds that keep every integer sum below 2^31 (and the stack buffers large enough).
    assert!(dim <= 256 && block <= 256, "the integer kernel needs head_dim and block_tokens ≤ 256");
    let groups = dim.div_ceil(V_GROUP);
    let padded = tokens.next_multiple_of(LANES);
    let head = HeadBytes::new::<KB, VB>(dim, block);
    // SAFETY: the page holds `kv_heads` K sections of `head.k` bytes at `k_offset` and as many V
    // sections of `head.v` bytes at `v_offset` (contract: `bytes.len() ≥ page_bytes`, offsets and
    // sizes computed from the shape the header was checked against).
    let (k_section, v_section) =
        unsafe { (job.bytes.as_ptr().add(job.k_offset), job.bytes.as_ptr().add(job.v_offset)) };
    let mut stage = MaybeUninit::<[__m512i; STAGE_BYTES / 64]>::uninit();
    let stage = stage.as_mut_ptr().cast::<u8>();
    // The i16 query of a tile of up to 8 heads of 256 channels, `dim / 2` dwords per head.
    let mut q16 = MaybeUninit::<[__m512i; MAX_TILE_HEADS * 256 / 32]>::uninit();
    let q16 = q16.as_mut_ptr().cast::<i32>();
    let center = ((1u32 << KB) - 1) as f32 / 2.0;
    // 2-bit keys need 4 accumulators per head and vector: at most 4 heads per integer tile.
    let score_heads = if KB == 2 { 4 } else { MAX_TILE_HEADS };

    for kv in 0..shape.kv_heads {
        let first_q = kv * group;
        // SAFETY: `kv < kv_heads`, so each offset starts this head's section inside its region.
        let (k_params, v_params) = unsafe { (k_section.add(kv * head.k), v_section.add(kv * head.v)) };
        // SAFETY: the codes follow the parameters inside the same head section.
        let (k_codes, v_codes) = unsafe { (k_params.add(head.k_params), v_params.add(head.v_params)) };
        // Prefetch targets: the next head's sections, or head 0 of the next page; without one, this
        // head's own sections (already in cache), so the hot loops need no check.
        let (ahead_k, ahead_v) = if kv + 1 < shape.kv_heads {
            (k_params.wrapping_add(head.k), v_params.wrapping_add(head.v))
        } else if let Some(next) = job.next {
            (next.as_ptr().wrapping_add(job.k_offset), next.as_ptr().wrapping_add(job.v_offset))
        } else {
            (k_params, v_params)
        };
        let (ahead_k, ahead_v) = (Prefetch::ahead(ahead_k), Prefetch::ahead(ahead_v));
        ahead_k.span(0, head.k_params);
        ahead_v.span(0, head.v_params);
        let (ahead_k, ahead_v) = (ahead_k.offset(head.k_params), ahead_v.offset(head.v_params));

        let mut g0 = 0;
        while g0 < group {
            let heads = (group - g0).min(score_heads);
            let q = run.q[(first_q + g0) * dim..].as_ptr();
            let out = run.scores[g0 * block..].as_mut_ptr();
            let (mut offsets, mut steps) = ([0.0f32; MAX_TILE_HEADS], [0.0f32; MAX_TILE_HEADS]);
            let tile = QueryTile { params: k_params, dim, q, q16, center };
            // SAFETY: `dim` parameter pairs of this head; `heads ≤ min(group, 8)` rows of `dim`
            // floats of q (inside the group); `heads × dim / 2 ≤ 8 × 128` dwords of `q16`.
            let integer = unsafe { with_heads!(heads, G => quantize_tile::<G, KB>(&tile, &mut offsets, &mut steps)) };
            if !integer {
                // Too coarse for these heads: the f32 scores of `avx512_quant.rs`.
                let qk = run.qk.as_mut_ptr();
                // SAFETY: as above; `heads × dim` floats of the `qk` scratch (`min(group, 8) ×
                // dim`); the tile loop as in `avx512_quant.rs`: `t + 16 × vectors ≤ padded ≤
                // block` tokens of every code row of this head and of these heads' score rows.
                unsafe {
                    scale_query(k_params, dim, q, heads, qk, &mut offsets);
                    let mut t = 0;
                    while t < padded {
                        let two = padded - t >= 2 * LANES;
                        let (k, s) = (k_codes.add(t * KB / 8), out.add(t));
                        let pf = if g0 == 0 && t == 0 { ahead_k } else { Prefetch::none() };
                        with_heads!(heads, G => if two {
                            score_tile_f32::<G, 2, KB>(k, head.k_row, dim, qk, &offsets, s, block, pf)
                        } else {
                            score_tile_f32::<G, 1, KB>(k, head.k_row, dim, qk, &offsets, s, block, pf)
                        });
                        t += if two { 2 * LANES } else { LANES };
                    }
                }
                g0 += heads;
                continue;
            }
            let mut t = 0;
            while t < padded {
                let two = padded - t >= 2 * LANES;
                let tile = if two { 4 * KB } else { 2 * KB };
                // Every tile prefetches the next head's copy of the lines it reads: repeats are
                // cheap, and the loop needs no branch.
                let pf = ahead_k.offset(t * KB / 8);
                // SAFETY: `t + 16 × vectors ≤ padded ≤ block`, so the tile's `tile` bytes of every
                // code row lie in this head's key codes (`t × KB / 8` bytes into a row of
                // `block × KB / 8`); the stage holds `dim × tile ≤ 256 × 32` bytes; every store is in
                // these heads' `block`-long score rows; `heads` rows of `q16`.
                unsafe {
                    let codes = k_codes.add(t * KB / 8);
                    let (rows, pf) = if head.k_row == tile {
                        (codes, pf)
                    } else {
                        stage_rows(codes, head.k_row, dim, tile, stage, pf);
                        // The copy prefetched the rows; the loop's prefetches hit the stage.
                        (stage.cast_const(), Prefetch::ahead(stage))
                    };
                    let fold = (offsets.as_ptr(), steps.as_ptr());
                    let s = out.add(t);
                    with_heads!(heads, G => if two {
                        score_tile::<G, 2, KB>(rows, dim, q16, fold, s, block, pf)
                    } else {
                        score_tile::<G, 1, KB>(rows, dim, q16, fold, s, block, pf)
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
            // Inline, as in `avx512.rs` (a shared helper measured slower there).
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
            let p = run.scores[g0 * block..].as_ptr();
            let weights = run.weights.as_mut_ptr();
            let mut bias = [[0.0f32; 256 / V_GROUP]; MAX_TILE_HEADS];
            // SAFETY: as in `avx512_quant.rs`: `groups × block` parameter pairs of this head;
            // `heads` rows of `block ≥ padded` probabilities; `heads × groups × block` floats of the
            // weights scratch (`min(group, 8) × groups × block`); `groups ≤ 8` since `head_dim ≤
            // 256`.
            unsafe { weigh_tokens(v_params, block, groups, tokens, p, heads, weights, &mut bias) };
            let weights = run.weights.as_ptr();
            // Register tiles: up to 4 heads × 4 vectors, or 8 heads × 2 vectors.
            let widest = if heads <= 4 { 4 } else { 2 };
            let alpha = run.alpha[g0..].as_ptr();
            let acc = run.acc[(first_q + g0) * dim..].as_mut_ptr();
            let mut c = 0;
            while c < dim {
                let left = (dim - c) / LANES;
                let vectors = if left >= widest { widest } else { left.min(2) };
                // SAFETY: as in `avx512_quant.rs`: channels `c..c + 16 × vectors ≤ dim` of code rows
                // `t < tokens ≤ block` of this head's value codes; weights rows of these heads and
                // groups `≤ (c + 16 × vectors) / 32 < groups`; heads `g0..g0 + heads ≤ group` of
                // alpha and acc.
                unsafe {
                    let (v, a) = (v_codes.add(c * VB / 8), acc.add(c));
                    let pf = if g0 == 0 { ahead_v.offset(c * VB / 8) } else { Prefetch::none() };
                    let tile = ValueTile { v, row: head.v_row, tokens, weights, groups, block, c, pf };
                    with_heads!(heads, G => match vectors {
                        4 => accumulate::<G, 4, VB>(&tile, alpha, &bias, a, dim),
                        2 => accumulate::<G, 2, VB>(&tile, alpha, &bias, a, dim),
                        _ => accumulate::<G, 1, VB>(&tile, alpha, &bias, a, dim),
                    });
                }
                c += LANES * vectors;
            }
            g0 += heads;
        }
    }
}

/// `vpermw` indices that gather the low halves of 16 dwords into words 0..16 and the high halves
/// into words 16..32.
const SPLIT_PAIRS: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        idx[i] = 2 * i as u16;
        idx[16 + i] = 2 * i as u16 + 1;
        i += 1;
    }
    idx
};

/// The split-pairs index, opaque to the compiler (which would otherwise lower the `vpermw` to two
/// two-uop truncations).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
fn split_index() -> __m512i {
    // SAFETY: the table is 64 bytes.
    black_box(unsafe { _mm512_loadu_si512(SPLIT_PAIRS.as_ptr().cast()) })
}

/// 16 `(scale, min)` f16 pairs at `src` as two vectors of `f32`, with one `vpermw` (`split` is
/// [`split_index`]).
///
/// # Safety
///
/// `src` must be valid for reading 64 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn pairs16(src: *const u8, split: __m512i) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 64 readable bytes; the load is unaligned.
    let halves = _mm512_permutexvar_epi16(split, unsafe { _mm512_loadu_si512(src.cast()) });
    (_mm512_cvtph_ps(_mm512_castsi512_si256(halves)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(halves)))
}

/// One tile of query heads sharing a KV head, for [`quantize_tile`].
struct QueryTile {
    /// The KV head's key parameters: `dim` pairs.
    params: *const u8,
    /// Channels per head.
    dim: usize,
    /// The tile's first query row (rows of `dim` floats, already times the softmax scale).
    q: *const f32,
    /// The tile's quantized query: rows of `dim / 2` dwords.
    q16: *mut i32,
    /// The middle key code `(2^kb − 1) / 2`.
    center: f32,
}

/// Quantizes the scaled query of `G` heads sharing a KV head (see the module documentation):
/// writes head `g`'s i16 query into its `q16` row (channels `d`, `d + 1` in dword `d / 2`, low
/// half first), its step `s` into `steps[g]` and its score offset `Σ_d q_d·min_d + center × Σ_d
/// (q'_d − s·q16_d)` into `offsets[g]`. The maxima and sums of all heads are lanes of one
/// transposing reduction each. Returns whether every head's typical score error is within
/// [`MAX_SCORE_ERROR`]; if not, the outputs are unspecified and the caller takes the f32 path.
///
/// # Safety
///
/// `tile.params` readable for `4 × dim` bytes, `tile.q` for `G × dim` floats; `tile.q16` writable
/// for `G × dim / 2` dwords; `G ≤ 8`; `dim` a multiple of 16 and at most 256; the CPU must support
/// the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn quantize_tile<const G: usize, const KB: usize>(
    tile: &QueryTile,
    offsets: &mut [f32; MAX_TILE_HEADS],
    steps: &mut [f32; MAX_TILE_HEADS],
) -> bool {
    // `max(|a|, |b|)` with the sign cleared.
    const MAX_ABS: i32 = 0b1011;
    let (dim, q) = (tile.dim, tile.q);
    let split = split_index();
    let middle = _mm512_set1_ps(tile.center);
    // `q'` of up to 8 heads of at most 256 channels.
    let mut scaled = MaybeUninit::<[__m512; MAX_TILE_HEADS * 256 / LANES]>::uninit();
    let scaled = scaled.as_mut_ptr().cast::<f32>();
    let mut peaks = [_mm512_setzero_ps(); MAX_TILE_HEADS];
    let mut sums = [_mm512_setzero_ps(); G];
    for d in (0..dim).step_by(LANES) {
        // SAFETY: pairs `d..d + 16 ≤ dim`, and floats `d..d + 16` of rows `g < G` of `q` and of the
        // stack buffer (8 rows of 256).
        unsafe {
            let (scale, min) = pairs16(tile.params.add(4 * d), split);
            // Σ_d q_d·(min_d + center·scale_d) = Σ q·min + center·Σ q'.
            let shifted = _mm512_fmadd_ps(scale, middle, min);
            for g in 0..G {
                let qv = _mm512_loadu_ps(q.add(g * dim + d));
                let product = _mm512_mul_ps(qv, scale);
                _mm512_storeu_ps(scaled.add(g * 256 + d), product);
                peaks[g] = _mm512_range_ps::<MAX_ABS>(peaks[g], product);
                sums[g] = _mm512_fmadd_ps(qv, shifted, sums[g]);
            }
        }
    }
    let tops = reduce_lanes::<MAX>(&peaks, G);
    let step = _mm512_mul_ps(tops, _mm512_set1_ps(1.0 / Q_MAX));
    // σ = s × sqrt(D) × (2^kb − 1) / 12 (a residual's deviation, 1/√12 of a step, times a code's,
    // 1/√12 of its range, summed over D channels); NaN (a corrupt page) compares false.
    let sigma = (dim as f32).sqrt() * ((1u32 << KB) - 1) as f32 / 12.0;
    let fine =
        _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_mul_ps(step, _mm512_set1_ps(sigma)), _mm512_set1_ps(MAX_SCORE_ERROR));
    let heads_mask = ((1u32 << G) - 1) as __mmask16;
    if fine & heads_mask != heads_mask {
        return false;
    }
    let nonzero = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(tops, _mm512_set1_ps(Q_TINY));
    let step = _mm512_maskz_mov_ps(nonzero, step);
    let (mut inv, mut correction) = ([0.0f32; LANES], [0.0f32; LANES]);
    // SAFETY: 16-float arrays.
    unsafe {
        _mm512_storeu_ps(inv.as_mut_ptr(), _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(Q_MAX), tops));
        _mm512_storeu_ps(correction.as_mut_ptr(), _mm512_mul_ps(step, middle));
    }
    let mut residuals = [_mm512_setzero_ps(); MAX_TILE_HEADS];
    for g in 0..G {
        let inv = _mm512_set1_ps(inv[g]);
        let mut total = _mm512_setzero_si512();
        for d in (0..dim).step_by(LANES) {
            // SAFETY: row `g < G` of the stack buffer (written above) and dwords `d / 2 .. d / 2 +
            // 8` of row `g` of `q16` (`dim / 2` dwords).
            unsafe {
                let a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(scaled.add(g * 256 + d)), inv));
                _mm256_storeu_si256(tile.q16.add((g * dim + d) / 2).cast(), _mm512_cvtsepi32_epi16(a));
                total = _mm512_add_epi32(total, a);
            }
        }
        // |Σ q16| ≤ 256 × 32767 < 2^24: exact in f32.
        residuals[g] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(correction[g]), sums[g]);
    }
    // SAFETY: 8-float stores, the lengths of both arrays (lanes from `G` on are unused).
    unsafe {
        _mm256_storeu_ps(offsets.as_mut_ptr(), _mm512_castps512_ps256(reduce_lanes::<SUM>(&residuals, G)));
        _mm256_storeu_ps(steps.as_mut_ptr(), _mm512_castps512_ps256(step));
    }
    true
}

/// Copies `dim` rows of `tile` bytes (at `src + d × row`) into `dst` back to back, prefetching the
/// same rows of `ahead`.
///
/// # Safety
///
/// `tile` is 4, 8, 16 or 32; `src + d × row` readable for `tile` bytes for every `d < dim`; `dst`
/// writable for `dim × tile` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn stage_rows(src: *const u8, row: usize, dim: usize, tile: usize, dst: *mut u8, ahead: Prefetch) {
    for d in 0..dim {
        if row >= 64 || (d * row).is_multiple_of(64) {
            ahead.span(d * row, row.max(64));
        }
        // SAFETY: `tile` bytes of row `d` and of slot `d` of `dst`, per the contract.
        unsafe {
            let (from, to) = (src.add(d * row), dst.add(d * tile));
            match tile {
                32 => _mm256_storeu_si256(to.cast(), _mm256_loadu_si256(from.cast())),
                16 => _mm_storeu_si128(to.cast(), _mm_loadu_si128(from.cast())),
                8 => to.cast::<u64>().write_unaligned(from.cast::<u64>().read_unaligned()),
                _ => to.cast::<u32>().write_unaligned(from.cast::<u32>().read_unaligned()),
            }
        }
    }
}

/// `vpermb` indices for a key tile of `nv` vectors of `kb`-bit codes: for vector `e` and dword
/// lane `L`, bytes `4L` and `4L + 2` pick the codes byte of the two channels of one channel pair at
/// one byte offset from 64 contiguous bytes holding `64 / T` rows of `T = 2 × kb × nv` bytes.
///
/// With two rows per load (8-bit, 32 tokens) the vectors split the pair's 32 bytes in halves;
/// otherwise vector `e` holds pairs `e × P .. (e + 1) × P` (`P = rows / 4`), lane `L` pair
/// `e × P + L mod P` at byte offset `L / P`.
const fn key_indices(kb: usize, nv: usize) -> [[u8; 64]; 2] {
    let tile = 2 * kb * nv;
    let rows = 64 / tile;
    let mut idx = [[0u8; 64]; 2];
    let mut e = 0;
    while e < 2 {
        let mut lane = 0;
        while lane < 16 {
            let (a, b) = if rows == 2 {
                (16 * e + lane, tile + 16 * e + lane)
            } else {
                let per = rows / 4;
                let pair = per * e + lane % per;
                (2 * pair * tile + lane / per, (2 * pair + 1) * tile + lane / per)
            };
            idx[e][4 * lane] = a as u8;
            idx[e][4 * lane + 2] = b as u8;
            lane += 1;
        }
        e += 1;
    }
    idx
}

/// The [`key_indices`] of one tile shape, computed at compile time.
struct KeyIndices<const KB: usize, const NV: usize>;

impl<const KB: usize, const NV: usize> KeyIndices<KB, NV> {
    const IDX: [[u8; 64]; 2] = key_indices(KB, NV);
}

/// Scores of `16 × NV` tokens for `G` query heads from `KB`-bit key codes:
/// `out[g × block + i] = offset[g] + step[g] × Σ_d q16[g][d] × c_d[i]`, with `fold = (offsets,
/// steps)` of the tile's heads.
///
/// # Safety
///
/// `rows` holds `dim` contiguous code rows of the tile, `2 × KB × NV` bytes each; `qk` has `G` rows
/// of `dim / 2` dwords (i16 pairs, as [`quantize_tile`] writes them); `fold.0` and
/// `fold.1` have `G` floats; `out` has `G` rows of `block` floats with `16 × NV` writable from each
/// row start; `dim` a multiple of 16 and at most 256; the CPU must support the enabled features.
/// `ahead` is a prefetch target laid out like `rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn score_tile<const G: usize, const NV: usize, const KB: usize>(
    rows: *const u8,
    dim: usize,
    qk: *const i32,
    fold: (*const f32, *const f32),
    out: *mut f32,
    block: usize,
    ahead: Prefetch,
) {
    let tile = 2 * KB * NV;
    let per_load = 64 / tile;
    // SAFETY: the index tables are 64 bytes each. Opaque to the compiler (as is the mask), which
    // would otherwise rewrite the zero-masking `vpermb` as a `vpermb` and an AND.
    let (idx0, idx1) = black_box(unsafe {
        let idx = &KeyIndices::<KB, NV>::IDX;
        (_mm512_loadu_si512(idx[0].as_ptr().cast()), _mm512_loadu_si512(idx[1].as_ptr().cast()))
    });
    let low_bytes = black_box(WORD_LOW_BYTES);
    let half = dim / 2;
    // `vpdpwssd` has a 5-cycle latency: with few heads, each accumulator would wait on itself, so
    // they get twice as many (by iteration parity or by vector) and are summed after the loop.
    let split = G <= 3;
    // Slots per head: 8-bit codes, 32 tokens: one per vector (and parity); 8-bit, 16 tokens: one
    // per vector; 4-bit: one per shift variant (and vector); 2-bit: one per shift variant.
    let mut acc = [[_mm512_setzero_si512(); 4]; G];
    // One step: the 64 code bytes of load `i` into accumulator set `parity` (a macro rather than a
    // closure, which the compiler may leave uninlined in this hot loop).
    macro_rules! step {
        ($i:expr, $parity:expr) => {{
            let i: usize = $i;
            ahead.line(64 * i);
            // SAFETY: 64 bytes = rows `i × per_load .. (i + 1) × per_load ≤ dim` of `rows`; query
            // pairs `i × per_load / 2 ..` (at most `per_load / 2` of them, inside `dim / 2`) of rows
            // `g < G`.
            unsafe {
                let x = _mm512_loadu_si512(rows.add(64 * i).cast());
                let p = [
                    _mm512_maskz_permutexvar_epi8(low_bytes, idx0, x),
                    _mm512_maskz_permutexvar_epi8(low_bytes, idx1, x),
                ];
                let pair = i * per_load / 2;
                let set = if split { 2 * $parity } else { 0 };
                for (g, acc) in acc.iter_mut().enumerate() {
                    let at = |k: usize| qk.add(g * half + pair + k);
                    match (KB, NV) {
                        (8, 2) => {
                            let w = _mm512_set1_epi32(*at(0));
                            acc[set] = dpwssd(acc[set], p[0], w);
                            acc[set + 1] = dpwssd(acc[set + 1], p[1], w);
                        }
                        (8, 1) => {
                            acc[set] = dpwssd(acc[set], p[0], _mm512_set1_epi32(*at(0)));
                            acc[set + 1] = dpwssd(acc[set + 1], p[1], _mm512_set1_epi32(*at(1)));
                        }
                        (4, nv) => {
                            for (e, p) in p.iter().enumerate() {
                                let w = if nv == 2 {
                                    _mm512_set1_epi32(*at(e))
                                } else {
                                    _mm512_set1_epi64(at(2 * e).cast::<i64>().read_unaligned())
                                };
                                let slot = if split { 2 * e } else { 0 };
                                acc[slot] = dpwssd(acc[slot], *p, w);
                                acc[slot + 1] = dpwssd(acc[slot + 1], _mm512_srli_epi16::<4>(*p), w);
                            }
                        }
                        (_, nv) => {
                            for (e, p) in p.iter().enumerate() {
                                let w = if nv == 2 {
                                    _mm512_set1_epi64(at(2 * e).cast::<i64>().read_unaligned())
                                } else {
                                    _mm512_broadcast_i32x4(_mm_loadu_si128(at(4 * e).cast()))
                                };
                                acc[0] = dpwssd(acc[0], *p, w);
                                acc[1] = dpwssd(acc[1], _mm512_srli_epi16::<2>(*p), w);
                                acc[2] = dpwssd(acc[2], _mm512_srli_epi16::<4>(*p), w);
                                acc[3] = dpwssd(acc[3], _mm512_srli_epi16::<6>(*p), w);
                            }
                        }
                    }
                }
            }
        }};
    }
    let steps = dim / per_load;
    let mut i = 0;
    while i + 1 < steps {
        step!(i, 0);
        step!(i + 1, 1);
        i += 2;
    }
    if i < steps {
        step!(i, 0);
    }
    for (g, acc) in acc.iter().enumerate() {
        let add = _mm512_add_epi32;
        // The slots of one head in the layout `tokens_in_order` expects.
        let slots = match KB {
            8 if NV == 2 => [add(acc[0], acc[2]), add(acc[1], acc[3]), acc[2], acc[3]],
            8 => [add(add(acc[0], acc[1]), add(acc[2], acc[3])), acc[1], acc[2], acc[3]],
            4 => [add(acc[0], acc[2]), add(acc[1], acc[3]), acc[2], acc[3]],
            _ => *acc,
        };
        let sums = tokens_in_order::<NV, KB>(&slots);
        // SAFETY: `g < G` floats of each fold row.
        let (b, s) = unsafe { (_mm512_set1_ps(*fold.0.add(g)), _mm512_set1_ps(*fold.1.add(g))) };
        for (j, sum) in sums.iter().enumerate().take(NV) {
            // SAFETY: row `g < G`, floats `16j..16j + 16 ≤ 16 × NV`, writable per the contract.
            unsafe {
                _mm512_storeu_ps(out.add(g * block + LANES * j), _mm512_fmadd_ps(_mm512_cvtepi32_ps(*sum), s, b))
            };
        }
    }
}

/// Swaps adjacent dword lanes (`0xb1` = lanes 1, 0, 3, 2).
const SWAP_PAIRS: _MM_PERM_ENUM = 0xb1;
/// Swaps adjacent dword pairs within each 128-bit lane (`0x4e` = lanes 2, 3, 0, 1).
const SWAP_QUADS: _MM_PERM_ENUM = 0x4e;

/// The integer key sums of one head, from the accumulators of [`score_tile`] to one i32 per token
/// in token order (vector `j` = tokens `16j..16j + 16` of the tile).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
fn tokens_in_order<const NV: usize, const KB: usize>(acc: &[__m512i; 4]) -> [__m512i; 2] {
    let sub_times =
        |a: __m512i, b: __m512i, shift: u32| _mm512_sub_epi32(a, _mm512_sllv_epi32(b, _mm512_set1_epi32(shift as i32)));
    let fold_pairs = |x: __m512i| _mm512_add_epi32(x, _mm512_shuffle_epi32::<SWAP_PAIRS>(x));
    match (KB, NV) {
        (8, _) => [acc[0], acc[1]],
        (4, 2) => {
            // Lane L holds byte L: tokens 2L (low nibble) and 2L + 1.
            let (even, odd) = (sub_times(acc[0], acc[1], 4), acc[1]);
            let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            [_mm512_permutex2var_epi32(even, low, odd), _mm512_permutex2var_epi32(even, high, odd)]
        }
        (4, _) => {
            // Lane 2j + k: byte j of pair k; tokens 2j and 2j + 1.
            let (even, odd) = (fold_pairs(sub_times(acc[0], acc[1], 4)), fold_pairs(acc[1]));
            [_mm512_mask_blend_epi32(0xaaaa, even, odd), _mm512_setzero_si512()]
        }
        (_, 2) => {
            // Lane 2j + k: byte j of pair k; tokens 4j .. 4j + 4.
            let c = [
                fold_pairs(sub_times(acc[0], acc[1], 2)),
                fold_pairs(sub_times(acc[1], acc[2], 2)),
                fold_pairs(sub_times(acc[2], acc[3], 2)),
                fold_pairs(acc[3]),
            ];
            let (first, second) =
                (_mm512_mask_blend_epi32(0xaaaa, c[0], c[1]), _mm512_mask_blend_epi32(0xaaaa, c[2], c[3]));
            let low = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
            let high = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
            [_mm512_permutex2var_epi64(first, low, second), _mm512_permutex2var_epi64(first, high, second)]
        }
        _ => {
            // Lane 4j + k: byte j of pair k; tokens 4j .. 4j + 4.
            let fold = |x: __m512i| {
                let x = fold_pairs(x);
                _mm512_add_epi32(x, _mm512_shuffle_epi32::<SWAP_QUADS>(x))
            };
            let c = [
                fold(sub_times(acc[0], acc[1], 2)),
                fold(sub_times(acc[1], acc[2], 2)),
                fold(sub_times(acc[2], acc[3], 2)),
                fold(acc[3]),
            ];
            let x = _mm512_mask_mov_epi32(c[0], 0x2222, c[1]);
            let x = _mm512_mask_mov_epi32(x, 0x4444, c[2]);
            [_mm512_mask_mov_epi32(x, 0x8888, c[3]), _mm512_setzero_si512()]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_indices_pair_two_channel_rows_per_dword() {
        // 8-bit codes, 32 tokens: rows 0 and 1 of 32 bytes, vector e = tokens 16e .. 16e + 16.
        let idx = key_indices(8, 2);
        assert_eq!((idx[0][0], idx[0][2]), (0, 32));
        assert_eq!((idx[1][4 * 15], idx[1][4 * 15 + 2]), (31, 63));
        // 4-bit codes, 16 tokens: 8 rows of 8 bytes, vector e = pairs 2e, 2e + 1 alternating.
        let idx = key_indices(4, 1);
        assert_eq!((idx[0][4], idx[0][6]), (16, 24), "lane 1: pair 1 (rows 2, 3), byte 0");
        assert_eq!((idx[1][4 * 3], idx[1][4 * 3 + 2]), (49, 57), "lane 3 of vector 1: pair 3, byte 1");
    }
}
