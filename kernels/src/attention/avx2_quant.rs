//! The AVX2 page kernel (with FMA and F16C) for quantized pages (q8, q4, q2, k8v4), read in place:
//! 8 `f32` lanes, 16 registers.
//!
//! The port of `avx512_quant.rs` to AVX2, with the 8-lane machinery of `avx2.rs` (its softmax, its
//! lane masks and reductions, its tile heights). Per KV head, on codes and parameters (layout in
//! `format/quant.rs`):
//!
//! 1. **Scores.** With key channel `d` reconstructed as `min_d + scale_d × c_dt`,
//!    `q · k_t = Σ_d q_d·min_d + Σ_d (q_d·scale_d)·c_dt`. Per page and tile of query heads the kernel
//!    first forms `q'_d = q_d × scale_d` (into `Running::qk`) and the constant `Σ_d q_d × min_d`,
//!    8 channels per step from the parameter pairs; then, keys being channel-major, each channel's
//!    codes of 8 tokens are one load, widened to `f32` (`vpmovzxbd` for 8 bits; for 4 bits a byte
//!    duplication and per-lane shift, or for 16 tokens a nibble split; for 2 bits a broadcast and
//!    per-lane shift, one broadcast for 16 tokens), and one FMA with the broadcast `q'_d` per head,
//!    accumulating onto the constant. Tiles of 16 tokens × up to 4 heads.
//! 2. **Softmax**: exactly the 16-bit kernel's (`avx2::softmax`, the same inline bookkeeping).
//! 3. **Values.** Value `d` of token `t` is `min_{g,t} + scale_{g,t} × c_td` for its 32-channel group
//!    `g`, so `Σ_t p_t v_td = Σ_t (p_t·scale_{g,t})·c_td + Σ_t p_t·min_{g,t}`. A first step forms the
//!    weights `p_t × scale_{g,t}` (into `Running::weights`) and the per-group bias
//!    `Σ_t p_t × min_{g,t}`, 8 tokens per step from the group-major parameters; then for each filled
//!    token the value codes are widened once and FMA'd with each head's broadcast weight into
//!    register tiles of up to 4 heads × 16 channels (2 heads × 32 channels for groups of 1 or 2
//!    heads). Every tile lies inside one value group: tiles of 32 channels start on a multiple of 32.
//!    The sums start at 0 and are added to `alpha × acc + bias` at the end.
//!
//! Unfilled slots: their key scores are computed from whatever codes they hold (any code is a
//! finite number) and discarded by the softmax's masks; their value parameters are masked out of
//! the weights and the bias by selection (a bitwise AND or a blend, never a multiplication by 0),
//! and their value codes are never loaded. So any bytes in them leave the output unchanged.
//!
//! Prefetching follows `avx512_quant.rs`: while reading one KV head, the next head's (or the next
//! page's first head's) parameters at the start and its code rows alongside the rows being read.
//!
//! Every `block_tokens` (8 to 256) is taken: a page is at least one vector of 8 slots. Memory safety
//! rests on the length contract of `kernel.rs`, checked by the dispatcher before each page, and on
//! the header check that fixed the page's format and shape: every pointer below is derived from
//! `job.bytes` or a `Running` slice and stays inside the region the comment at its use names.

use std::arch::x86_64::*;

use crate::format::Format;
use crate::format::quant::V_GROUP;

use super::avx2::{LANES, MAX_TILE_HEADS, SoftmaxStep, lanes_below, reduce_add, softmax, with_heads};
use super::avx512_quant::{HeadBytes, HeadSections};
use super::kernel::{PageJob, Running};
use super::prefetch::Prefetch;

/// Value groups per token at the largest `head_dim` (256).
const MAX_GROUPS: usize = 256 / V_GROUP;

/// Folds one quantized page into the running state.
///
/// # Safety
///
/// The CPU must support avx2, fma and f16c; `job` and `run` must satisfy the length contract of
/// `kernel.rs` (`Running::check`); `job.shape` passed `AttnShape::validate` (so
/// `block_tokens ≥ 8` and `head_dim` is a multiple of 16 in `16..=256`).
#[target_feature(enable = "avx2,fma,f16c")]
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
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn page_in<const KB: usize, const VB: usize>(job: &PageJob<'_>, run: &mut Running<'_>) {
    let shape = job.shape;
    let (dim, group, block, tokens) = (shape.head_dim, shape.group(), shape.block_tokens, job.tokens);
    let groups = dim.div_ceil(V_GROUP);
    let padded = tokens.next_multiple_of(LANES);
    let head = HeadBytes::new::<KB, VB>(dim, block);

    for kv in 0..shape.kv_heads {
        let first_q = kv * group;
        // SAFETY: `kv < kv_heads`; `job` satisfies the length contract (this function's).
        let HeadSections { k_params, v_params, k_codes, v_codes, ahead_k, ahead_v } = unsafe { head.sections(job, kv) };

        let mut g0 = 0;
        while g0 < group {
            let heads = (group - g0).min(MAX_TILE_HEADS);
            let q = run.q[(first_q + g0) * dim..].as_ptr();
            let qk = run.qk.as_mut_ptr();
            let out = run.scores[g0 * block..].as_mut_ptr();
            let mut base = [0.0f32; MAX_TILE_HEADS];
            // SAFETY: `dim` parameter pairs of this head; `heads ≤ min(group, 4)` rows of `dim`
            // floats of q (inside the group) and of the `qk` scratch (`min(group, 8) × dim`).
            unsafe { scale_query(k_params, dim, q, heads, qk, &mut base) };
            let qk = run.qk.as_ptr();
            let mut t = 0;
            while t < padded {
                let two = padded - t >= 2 * LANES;
                // SAFETY: `t + 8 × vectors ≤ padded ≤ block`, so every code row read stays in this
                // head's key codes (`t × KB / 8` bytes into a row of `block × KB / 8`) and every store
                // in these heads' `block`-long score rows; `heads ≤ 4` rows of `qk` and `base`.
                unsafe {
                    let (k, s) = (k_codes.add(t * KB / 8), out.add(t));
                    // The first tile of the first head tile prefetches whole rows; the others read the
                    // same rows.
                    let pf = if g0 == 0 && t == 0 { ahead_k } else { Prefetch::none() };
                    with_heads!(heads, G => if two {
                        score_tile::<G, 2, KB>(k, head.k_row, dim, qk, &base, s, block, pf)
                    } else {
                        score_tile::<G, 1, KB>(k, head.k_row, dim, qk, &base, s, block, pf)
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
            // Inline, as in `avx2.rs` (a shared helper measured slower there).
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
            let mut bias = [[0.0f32; MAX_GROUPS]; MAX_TILE_HEADS];
            // SAFETY: `groups × block` parameter pairs of this head; `heads` rows of `block ≥ padded`
            // probabilities; `heads × groups × block` floats of the weights scratch
            // (`min(group, 8) × groups × block`, and `heads ≤ min(group, 4)`); `groups ≤ 8` since
            // `head_dim ≤ 256`.
            unsafe { weigh_tokens(v_params, block, groups, tokens, p, heads, weights, &mut bias) };
            let weights = run.weights.as_ptr();
            // Register tiles: up to 2 heads × 4 vectors, or 4 heads × 2 vectors. `dim` is a multiple
            // of 16, so `c` advances by 32 until at most 16 channels are left: a 4-vector tile starts
            // on a multiple of 32 and so lies in one value group, as does every 2-vector tile.
            let widest = if heads <= 2 { 4 } else { 2 };
            let alpha = run.alpha[g0..].as_ptr();
            let acc = run.acc[(first_q + g0) * dim..].as_mut_ptr();
            let mut c = 0;
            while c < dim {
                let vectors = if (dim - c) / LANES >= widest { widest } else { 2 };
                let j = c / V_GROUP;
                // SAFETY: channels `c..c + 8 × vectors ≤ dim` of code rows `t < tokens ≤ block` of
                // this head's value codes; row `j < groups` of the weights of heads `< heads` (each
                // `block` floats, heads `groups × block` apart); heads `g0..g0 + heads ≤ group` of
                // alpha and acc.
                unsafe {
                    let (v, a) = (v_codes.add(c * VB / 8), acc.add(c));
                    let pf = if g0 == 0 { ahead_v.offset(c * VB / 8) } else { Prefetch::none() };
                    let tile = ValueTile {
                        v,
                        row: head.v_row,
                        tokens,
                        weights: weights.add(j * block),
                        stride: groups * block,
                        group: j,
                        pf,
                    };
                    with_heads!(heads, G => if vectors == 4 {
                        accumulate::<G, 4, VB>(&tile, alpha, &bias, a, dim)
                    } else {
                        accumulate::<G, 2, VB>(&tile, alpha, &bias, a, dim)
                    });
                }
                c += LANES * vectors;
            }
            g0 += heads;
        }
    }
}

/// 8 consecutive `B`-bit codes starting at `src` (code `i` at bit `i × B`), widened to `f32` in order.
///
/// # Safety
///
/// `src` must be valid for reading `B` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes8<const B: usize>(src: *const u8) -> __m256 {
    // SAFETY: the caller guarantees `B` readable bytes; every load below is unaligned and reads
    // exactly that many.
    let lanes = unsafe {
        match B {
            8 => _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.cast())),
            4 => {
                // Byte i holds codes 2i (low nibble) and 2i + 1: duplicate each byte, widen, and
                // shift odd lanes by 4.
                let x = _mm_cvtsi32_si128(src.cast::<i32>().read_unaligned());
                let pairs = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
                let shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
                _mm256_and_si256(_mm256_srlv_epi32(pairs, shift), _mm256_set1_epi32(0xf))
            }
            _ => {
                // The 8 codes are the 16-bit word at `src`, lowest first: broadcast and shift.
                let word = _mm256_set1_epi32(i32::from(src.cast::<u16>().read_unaligned()));
                let shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
                _mm256_and_si256(_mm256_srlv_epi32(word, shift), _mm256_set1_epi32(0x3))
            }
        }
    };
    _mm256_cvtepi32_ps(lanes)
}

/// 16 consecutive 4-bit codes at `src` (8 bytes) widened to `f32`, split by parity: the even codes
/// (low nibbles) in the first vector, the odd codes in the second. One widening for 16 codes.
///
/// # Safety
///
/// `src` must be valid for reading 8 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn split_nibbles(src: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees 8 readable bytes; the load is unaligned and reads 8.
    let bytes = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.cast())) };
    let even = _mm256_and_si256(bytes, _mm256_set1_epi32(0xf));
    let odd = _mm256_srli_epi32::<4>(bytes);
    (_mm256_cvtepi32_ps(even), _mm256_cvtepi32_ps(odd))
}

/// 16 consecutive 2-bit codes at `src` (4 bytes) widened to `f32` in order: (codes 0..8, codes
/// 8..16). One broadcast of the 32-bit word for both vectors.
///
/// # Safety
///
/// `src` must be valid for reading 4 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn crumbs16(src: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees 4 readable bytes; the load is unaligned and reads 4.
    let word = _mm256_set1_epi32(unsafe { src.cast::<i32>().read_unaligned() });
    let mask = _mm256_set1_epi32(0x3);
    let low = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), mask);
    let high = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)), mask);
    (_mm256_cvtepi32_ps(low), _mm256_cvtepi32_ps(high))
}

/// Lanes `0..16` in order from vectors of the even lanes and the odd lanes ([`split_nibbles`]'s
/// order): returns (lanes 0..8, lanes 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn interleave(even: __m256, odd: __m256) -> (__m256, __m256) {
    // Per 128-bit half: [e0 o0 e1 o1 | e4 o4 e5 o5] and [e2 o2 e3 o3 | e6 o6 e7 o7].
    let low = _mm256_unpacklo_ps(even, odd);
    let high = _mm256_unpackhi_ps(even, odd);
    (_mm256_permute2f128_ps::<0x20>(low, high), _mm256_permute2f128_ps::<0x31>(low, high))
}

/// Loads 8 `(scale, min)` f16 pairs at `src` as two vectors of `f32`.
///
/// # Safety
///
/// `src` must be valid for reading 32 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn params8(src: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees 32 readable bytes; the load is unaligned.
    let pairs = unsafe { _mm256_loadu_si256(src.cast()) };
    // In each 128-bit half, the 4 scales (low 16 bits of each pair) to bytes 0..8 and the 4 mins to
    // bytes 8..16; then the 64-bit quarters [s0..4, m0..4, s4..8, m4..8] to [s0..8, m0..8].
    let order = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let halves = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(pairs, order));
    let scale = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    let min = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves));
    (scale, min)
}

/// For `heads` query rows of `dim` floats at `q`: `qk[g × dim + d] = q[g][d] × scale_d` and
/// `base[g] = Σ_d q[g][d] × min_d`, from the `dim` key parameter pairs at `params`.
///
/// # Safety
///
/// `params` readable for `4 × dim` bytes, `q` for `heads × dim` floats, `qk` writable for
/// `heads × dim` floats; `heads ≤ 4`, `dim` a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_query(
    params: *const u8,
    dim: usize,
    q: *const f32,
    heads: usize,
    qk: *mut f32,
    base: &mut [f32; MAX_TILE_HEADS],
) {
    let mut sums = [_mm256_setzero_ps(); MAX_TILE_HEADS];
    for d in (0..dim).step_by(LANES) {
        // SAFETY: pairs `d..d + 8 ≤ dim`, and floats `d..d + 8` of rows `g < heads`.
        unsafe {
            let (scale, min) = params8(params.add(4 * d));
            for (g, sum) in sums.iter_mut().enumerate().take(heads) {
                let qv = _mm256_loadu_ps(q.add(g * dim + d));
                _mm256_storeu_ps(qk.add(g * dim + d), _mm256_mul_ps(qv, scale));
                *sum = _mm256_fmadd_ps(qv, min, *sum);
            }
        }
    }
    for (b, sum) in base.iter_mut().zip(&sums).take(heads) {
        *b = reduce_add(*sum);
    }
}

/// Scores of `8 × NV` tokens for `G` query heads from `KB`-bit key codes:
/// `out[g × block + i] = base[g] + Σ_d qk[g × dim + d] × c_d[i]`.
///
/// # Safety
///
/// `k` points at the code of token `t` of channel 0 of a head's channel-major key codes with rows of
/// `row` bytes, and `8 × NV` codes from `k + d × row` are readable for every `d < dim`; `qk` has `G`
/// rows of `dim` floats; `out` has `G` rows of `block` floats with `8 × NV` writable from each row
/// start; `G ≤ 4`. `ahead` is a prefetch target laid out like `k`.
#[expect(clippy::too_many_arguments, reason = "a register-tiled inner kernel; a struct would obscure it")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_tile<const G: usize, const NV: usize, const KB: usize>(
    k: *const u8,
    row: usize,
    dim: usize,
    qk: *const f32,
    base: &[f32; MAX_TILE_HEADS],
    out: *mut f32,
    block: usize,
    ahead: Prefetch,
) {
    let mut acc = [[_mm256_setzero_ps(); NV]; G];
    for (g, acc) in acc.iter_mut().enumerate() {
        *acc = [_mm256_set1_ps(base[g]); NV];
    }
    for d in 0..dim {
        // Rows shorter than a line share it: prefetch it once, at the row that starts it.
        if row >= 64 || (d * row).is_multiple_of(64) {
            ahead.span(d * row, row.max(64));
        }
        // SAFETY: channel `d < dim` of the tile, `8 × NV` codes (`KB × NV` bytes), readable per the
        // contract; the `qk` reads are rows `g < G` at `d < dim`.
        unsafe {
            let codes = k.add(d * row);
            let mut keys = [_mm256_setzero_ps(); NV];
            if KB == 4 && NV == 2 {
                // Even tokens in keys[0], odd in keys[1]; interleaved back when stored.
                (keys[0], keys[1]) = split_nibbles(codes);
            } else if KB == 2 && NV == 2 {
                (keys[0], keys[1]) = crumbs16(codes);
            } else {
                for (j, key) in keys.iter_mut().enumerate() {
                    *key = codes8::<KB>(codes.add(KB * j));
                }
            }
            for (g, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_ps(*qk.add(g * dim + d));
                for (a, key) in acc.iter_mut().zip(&keys) {
                    *a = _mm256_fmadd_ps(*key, w, *a);
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        let mut acc = *acc;
        if KB == 4 && NV == 2 {
            (acc[0], acc[1]) = interleave(acc[0], acc[1]);
        }
        for (j, a) in acc.iter().enumerate() {
            // SAFETY: row `g < G`, floats `8j..8j + 8 ≤ 8 × NV`, writable per the contract.
            unsafe { _mm256_storeu_ps(out.add(g * block + LANES * j), *a) };
        }
    }
}

/// For `heads` rows of probabilities `p` (rows of `block` floats): `weights[(g × groups + j) ×
/// block + t] = p[g][t] × scale_{j,t}` for `t < tokens.next_multiple_of(8)` (0 past `tokens`) and
/// `bias[g][j] = Σ_{t < tokens} p[g][t] × min_{j,t}`, from the value parameters at `params`
/// (`groups` rows of `block` pairs). Parameters of unfilled slots are discarded by selection.
///
/// # Safety
///
/// `params` readable for `4 × groups × block` bytes, `p` for `heads` rows of `block ≥
/// tokens.next_multiple_of(8)` floats, `weights` writable for `heads × groups × block` floats;
/// `heads ≤ 4`, `groups ≤ 8`, `1 ≤ tokens ≤ block`.
#[expect(clippy::too_many_arguments, reason = "a register-tiled inner kernel; a struct would obscure it")]
#[expect(clippy::needless_range_loop, reason = "`j` indexes parameter rows and bias columns alike")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weigh_tokens(
    params: *const u8,
    block: usize,
    groups: usize,
    tokens: usize,
    p: *const f32,
    heads: usize,
    weights: *mut f32,
    bias: &mut [[f32; MAX_GROUPS]; MAX_TILE_HEADS],
) {
    let full = tokens / LANES;
    let rest = tokens % LANES;
    let vectors = full + usize::from(rest != 0);
    let (all, tail) = (lanes_below(LANES), lanes_below(rest));
    for j in 0..groups {
        let mut sums = [_mm256_setzero_ps(); MAX_TILE_HEADS];
        for i in 0..vectors {
            let filled = if i < full { all } else { tail };
            // SAFETY: pairs `8i..8i + 8 ≤ block` of group row `j < groups`; probabilities and
            // weights at the same tokens of rows `g < heads`.
            unsafe {
                let (scale, min) = params8(params.add(4 * (j * block + LANES * i)));
                for (g, sum) in sums.iter_mut().enumerate().take(heads) {
                    let pv = _mm256_loadu_ps(p.add(g * block + LANES * i));
                    let w = _mm256_and_ps(filled, _mm256_mul_ps(pv, scale));
                    _mm256_storeu_ps(weights.add((g * groups + j) * block + LANES * i), w);
                    *sum = _mm256_blendv_ps(*sum, _mm256_fmadd_ps(pv, min, *sum), filled);
                }
            }
        }
        for (g, sum) in sums.iter().enumerate().take(heads) {
            bias[g][j] = reduce_add(*sum);
        }
    }
}

/// The value codes and weights one [`accumulate`] call reads: channels of one value group.
#[derive(Clone, Copy)]
struct ValueTile {
    /// Value codes of token 0 at the tile's first channel in a head's token-major codes.
    v: *const u8,
    /// Bytes per token row of codes.
    row: usize,
    /// Filled tokens.
    tokens: usize,
    /// The tile's group row of the weights from [`weigh_tokens`] of the tile's first head.
    weights: *const f32,
    /// Floats from one head's weights to the next's (`groups × block`).
    stride: usize,
    /// The value group of every channel of the tile.
    group: usize,
    /// Prefetch target laid out like `v`.
    pf: Prefetch,
}

/// `acc[g] = alpha[g] × acc[g] + bias[g][group] + Σ_{t < tokens} weights[g][t] × c_t` over `8 × WC`
/// channels of one value group, for `G` heads, from `VB`-bit value codes.
///
/// # Safety
///
/// `8 × WC` codes are readable from `tile.v + t × tile.row` for every `t < tile.tokens`;
/// `tile.weights + g × tile.stride` is readable for `tile.tokens` floats for every `g < G`;
/// `tile.group < 8`; `alpha` has `G ≤ 4` floats; `acc` has `G` rows of `dim` floats with `8 × WC`
/// readable and writable from each row start; `WC` is 2 or 4.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate<const G: usize, const WC: usize, const VB: usize>(
    tile: &ValueTile,
    alpha: *const f32,
    bias: &[[f32; MAX_GROUPS]; MAX_TILE_HEADS],
    acc: *mut f32,
    dim: usize,
) {
    // 4-bit codes of 16 channels are widened at once, split by parity (see `split_nibbles`): then
    // `sums[2j]` holds the even and `sums[2j + 1]` the odd channels of channels `16j ..`.
    let split = VB == 4;
    let mut sums = [[_mm256_setzero_ps(); WC]; G];
    let span = VB * WC;
    for t in 0..tile.tokens {
        // Rows shorter than a line share it: prefetch it once, at the row that starts it.
        if span >= 64 || (t * tile.row).is_multiple_of(64) {
            tile.pf.span(t * tile.row, span.max(64));
        }
        // SAFETY: token row `t < tokens`, `8 × WC` codes (`VB × WC` bytes), and the weight of token
        // `t` of rows `g < G`, per the contract.
        unsafe {
            let row = tile.v.add(t * tile.row);
            let mut values = [_mm256_setzero_ps(); WC];
            if split {
                for (j, pair) in values.chunks_exact_mut(2).enumerate() {
                    (pair[0], pair[1]) = split_nibbles(row.add(8 * j));
                }
            } else if VB == 2 {
                for (j, pair) in values.chunks_exact_mut(2).enumerate() {
                    (pair[0], pair[1]) = crumbs16(row.add(4 * j));
                }
            } else {
                for (w, value) in values.iter_mut().enumerate() {
                    *value = codes8::<VB>(row.add(VB * w));
                }
            }
            for (g, sums) in sums.iter_mut().enumerate() {
                let weight = _mm256_set1_ps(*tile.weights.add(g * tile.stride + t));
                for (s, value) in sums.iter_mut().zip(&values) {
                    *s = _mm256_fmadd_ps(*value, weight, *s);
                }
            }
        }
    }
    for (g, sums) in sums.iter().enumerate() {
        let mut sums = *sums;
        if split {
            for pair in sums.chunks_exact_mut(2) {
                (pair[0], pair[1]) = interleave(pair[0], pair[1]);
            }
        }
        // SAFETY: row `g < G` of `alpha` and `acc`, `8 × WC` floats, per the contract.
        unsafe {
            let scale = _mm256_set1_ps(*alpha.add(g));
            let shift = _mm256_set1_ps(bias[g][tile.group]);
            for (w, s) in sums.iter().enumerate() {
                let at = acc.add(g * dim + LANES * w);
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_fmadd_ps(_mm256_loadu_ps(at), scale, shift), *s));
            }
        }
    }
}
