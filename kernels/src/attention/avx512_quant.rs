//! The AVX-512 page kernel for quantized pages (q8, q4, q2, k8v4), read in place: 16 `f32` lanes.
//!
//! The three passes of the 16-bit kernel (`avx512.rs`), per KV head, on codes and parameters
//! instead of elements (layout in `format/quant.rs`):
//!
//! 1. **Scores.** With key channel `d` reconstructed as `min_d + scale_d × c_dt`,
//!    `q · k_t = Σ_d q_d·min_d + Σ_d (q_d·scale_d)·c_dt`. Per page and query head the kernel first
//!    forms `q'_d = q_d × scale_d` (into `Running::qk`) and the constant `Σ_d q_d × min_d`, 16
//!    channels per step from the parameter pairs; then, keys being channel-major, each channel's
//!    codes of 16 tokens are one load, widened to `f32` (`vpmovzxbd` for 8 bits; for 4 and 2 bits a
//!    nibble unpack or a broadcast and per-lane shift), and one FMA with the broadcast `q'_d` per
//!    head of the GQA group, accumulating onto the constant. Tiles of 32 tokens × up to 8 heads.
//! 2. **Softmax**: exactly the 16-bit kernel's (`avx512::softmax`, the same inline bookkeeping).
//! 3. **Values.** Value `d` of token `t` is `min_{g,t} + scale_{g,t} × c_td` for its 32-channel group
//!    `g`, so `Σ_t p_t v_td = Σ_t (p_t·scale_{g,t})·c_td + Σ_t p_t·min_{g,t}`. A first step forms the
//!    weights `p_t × scale_{g,t}` (into `Running::weights`) and the per-group bias `Σ_t p_t ×
//!    min_{g,t}`, 16 tokens per step from the group-major parameters; then for each filled token the
//!    value codes are widened once and FMA'd with each head's broadcast weight into register tiles
//!    of up to 4 heads × 64 channels (or 8 × 32), which start from `alpha × acc + bias`.
//!
//! Unfilled slots: their key scores are computed from whatever codes they hold (any code is a
//! finite number) and discarded by the softmax's masks; their value parameters are masked out of
//! the weights and the bias by selection, and their value codes are never loaded. So any bytes in
//! them leave the output unchanged.
//!
//! Prefetching follows `kernel.rs`: while reading one KV head, the next head's (or the next page's
//! first head's) parameters at the start and its code rows alongside the rows being read.
//!
//! `avx512_vnni.rs` reuses this file's query scaling and score tiles (its fallback for coarse
//! integer queries) and its whole value pass (`weigh_tokens`, `accumulate`).
//!
//! Pages of fewer than 16 token slots go to the scalar kernel (the dispatcher checks). Memory safety
//! rests on the length contract of `kernel.rs`, checked by the dispatcher before each page, and on
//! the header check that fixed the page's format and shape: every pointer below is derived from
//! `job.bytes` or a `Running` slice and stays inside the region the comment at its use names.

use std::arch::x86_64::*;

use crate::format::Format;
use crate::format::quant::V_GROUP;

use super::avx512::{LANES, MAX_TILE_HEADS, SoftmaxStep, softmax, with_heads};
use super::kernel::{PageJob, Running};
use super::prefetch::Prefetch;

/// Folds one quantized page into the running state.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c; `job` and `run` must
/// satisfy the length contract of `kernel.rs` (`Running::check`); `job.format` is quantized and
/// `job.shape.block_tokens ≥ 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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

/// Byte extents of one KV head's sections in a page with `KB`-bit keys and `VB`-bit values.
#[derive(Clone, Copy)]
pub(super) struct HeadBytes {
    /// Key parameters then codes of one head.
    pub k: usize,
    /// Value parameters then codes of one head.
    pub v: usize,
    /// Bytes of the key parameters (`4 × head_dim`).
    pub k_params: usize,
    /// Bytes of the value parameters (`4 × groups × block_tokens`).
    pub v_params: usize,
    /// Bytes of one channel's key codes.
    pub k_row: usize,
    /// Bytes of one token's value codes.
    pub v_row: usize,
}

/// One KV head's sections in a page and the prefetch targets that go with them, from
/// [`HeadBytes::sections`].
pub(super) struct HeadSections {
    /// The head's key parameters, then (`k_codes`) its key codes.
    pub k_params: *const u8,
    /// The head's value parameters, then (`v_codes`) its value codes.
    pub v_params: *const u8,
    /// The head's key codes.
    pub k_codes: *const u8,
    /// The head's value codes.
    pub v_codes: *const u8,
    /// The key codes of the next head (or of head 0 of the next page), whose parameters were just
    /// prefetched; [`Prefetch::none`] on a page's last head without a next page.
    pub ahead_k: Prefetch,
    /// Likewise for the value codes.
    pub ahead_v: Prefetch,
}

impl HeadBytes {
    /// Locates KV head `kv`'s sections in `job`'s page and prefetches the parameters of the head
    /// that comes next (the next head's sections, or head 0 of the next page).
    ///
    /// # Safety
    ///
    /// `kv < kv_heads`, and `job` satisfies the length contract of `kernel.rs` for a page whose
    /// sections `self` describes (`bytes.len() ≥ page_bytes`, offsets and sizes computed from the
    /// shape the header was checked against).
    #[inline]
    pub unsafe fn sections(&self, job: &PageJob<'_>, kv: usize) -> HeadSections {
        // SAFETY: the page holds `kv_heads` K sections of `self.k` bytes at `k_offset` and as many V
        // sections of `self.v` bytes at `v_offset`, and `kv < kv_heads`; the codes follow the
        // parameters inside the same head section.
        let (k_params, v_params, k_codes, v_codes) = unsafe {
            let k_params = job.bytes.as_ptr().add(job.k_offset + kv * self.k);
            let v_params = job.bytes.as_ptr().add(job.v_offset + kv * self.v);
            (k_params, v_params, k_params.add(self.k_params), v_params.add(self.v_params))
        };
        // Prefetch targets (never dereferenced).
        let (ahead_k, ahead_v) = if kv + 1 < job.shape.kv_heads {
            (Prefetch::ahead(k_params.wrapping_add(self.k)), Prefetch::ahead(v_params.wrapping_add(self.v)))
        } else if let Some(next) = job.next {
            let next = next.as_ptr();
            (Prefetch::ahead(next.wrapping_add(job.k_offset)), Prefetch::ahead(next.wrapping_add(job.v_offset)))
        } else {
            (Prefetch::none(), Prefetch::none())
        };
        ahead_k.span(0, self.k_params);
        ahead_v.span(0, self.v_params);
        HeadSections {
            k_params,
            v_params,
            k_codes,
            v_codes,
            ahead_k: ahead_k.offset(self.k_params),
            ahead_v: ahead_v.offset(self.v_params),
        }
    }

    pub const fn new<const KB: usize, const VB: usize>(dim: usize, block: usize) -> HeadBytes {
        let groups = dim.div_ceil(V_GROUP);
        let (k_row, v_row) = (block * KB / 8, dim * VB / 8);
        HeadBytes {
            k: 4 * dim + dim * k_row,
            v: 4 * groups * block + block * v_row,
            k_params: 4 * dim,
            v_params: 4 * groups * block,
            k_row,
            v_row,
        }
    }
}

/// [`page`] for `KB`-bit keys and `VB`-bit values.
///
/// # Safety
///
/// As for [`page`], and `job.format` has those code widths.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
            // SAFETY: `dim` parameter pairs of this head; `heads ≤ min(group, 8)` rows of `dim`
            // floats of q (inside the group) and of the `qk` scratch (`min(group, 8) × dim`).
            unsafe { scale_query(k_params, dim, q, heads, qk, &mut base) };
            let qk = run.qk.as_ptr();
            let mut t = 0;
            while t < padded {
                let two = padded - t >= 2 * LANES;
                // SAFETY: `t + 16 × vectors ≤ padded ≤ block`, so every code row read stays in this
                // head's key codes (`t × KB / 8` bytes into a row of `block × KB / 8`) and every store
                // in these heads' `block`-long score rows; `heads ≤ 8` rows of `qk` and `base`.
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
            // SAFETY: `groups × block` parameter pairs of this head; `heads` rows of `block ≥ padded`
            // probabilities; `heads × groups × block` floats of the weights scratch
            // (`min(group, 8) × groups × block`); `groups ≤ 8` since `head_dim ≤ 256`.
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
                // SAFETY: channels `c..c + 16 × vectors ≤ dim` of code rows `t < tokens ≤ block` of
                // this head's value codes; weights rows of these heads and groups `≤ (c + 16 ×
                // vectors) / 32 < groups`; heads `g0..g0 + heads ≤ group` of alpha and acc.
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

/// 16 consecutive `B`-bit codes starting at `src` (code `i` at bit `i × B`), widened to `f32` in order.
///
/// # Safety
///
/// `src` must be valid for reading `2 × B` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn codes16<const B: usize>(src: *const u8) -> __m512 {
    // SAFETY: the caller guarantees `2 × B` readable bytes; every load below is unaligned and reads
    // exactly that many.
    let lanes = unsafe {
        match B {
            8 => _mm512_cvtepu8_epi32(_mm_loadu_si128(src.cast())),
            4 => {
                // Byte i holds codes 2i (low nibble) and 2i + 1: duplicate each byte, widen, and
                // shift odd lanes by 4.
                let x = _mm_loadl_epi64(src.cast());
                let pairs = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
                let shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
                _mm512_and_si512(_mm512_srlv_epi32(pairs, shift), _mm512_set1_epi32(0xf))
            }
            _ => {
                // The 16 codes are the 32-bit word at `src`, lowest first: broadcast and shift.
                let word = _mm512_set1_epi32(src.cast::<i32>().read_unaligned());
                let shift = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                _mm512_and_si512(_mm512_srlv_epi32(word, shift), _mm512_set1_epi32(0x3))
            }
        }
    };
    _mm512_cvtepi32_ps(lanes)
}

/// Loads 16 `(scale, min)` f16 pairs at `src` as two vectors of `f32`.
///
/// # Safety
///
/// `src` must be valid for reading 64 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn params16(src: *const u8) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 64 readable bytes; the load is unaligned.
    let pairs = unsafe { _mm512_loadu_si512(src.cast()) };
    let scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
    let min = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(pairs)));
    (scale, min)
}

/// For `heads` query rows of `dim` floats at `q`: `qk[g × dim + d] = q[g][d] × scale_d` and
/// `base[g] = Σ_d q[g][d] × min_d`, from the `dim` key parameter pairs at `params`.
///
/// # Safety
///
/// `params` readable for `4 × dim` bytes, `q` for `heads × dim` floats, `qk` writable for
/// `heads × dim` floats; `heads ≤ 8`, `dim` a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn scale_query(
    params: *const u8,
    dim: usize,
    q: *const f32,
    heads: usize,
    qk: *mut f32,
    base: &mut [f32; MAX_TILE_HEADS],
) {
    let mut sums = [_mm512_setzero_ps(); MAX_TILE_HEADS];
    for d in (0..dim).step_by(LANES) {
        // SAFETY: pairs `d..d + 16 ≤ dim`, and floats `d..d + 16` of rows `g < heads`.
        unsafe {
            let (scale, min) = params16(params.add(4 * d));
            for (g, sum) in sums.iter_mut().enumerate().take(heads) {
                let qv = _mm512_loadu_ps(q.add(g * dim + d));
                _mm512_storeu_ps(qk.add(g * dim + d), _mm512_mul_ps(qv, scale));
                *sum = _mm512_fmadd_ps(qv, min, *sum);
            }
        }
    }
    for (b, sum) in base.iter_mut().zip(&sums).take(heads) {
        *b = _mm512_reduce_add_ps(*sum);
    }
}

/// Scores of `16 × NV` tokens for `G` query heads from `KB`-bit key codes:
/// `out[g × block + i] = base[g] + Σ_d qk[g × dim + d] × c_d[i]`.
///
/// # Safety
///
/// `k` points at the code of token `t` of channel 0 of a head's channel-major key codes with rows of
/// `row` bytes, and `16 × NV` codes from `k + d × row` are readable for every `d < dim`; `qk` has `G`
/// rows of `dim` floats; `out` has `G` rows of `block` floats with `16 × NV` writable from each row
/// start. `ahead` is a prefetch target laid out like `k`.
#[expect(clippy::too_many_arguments, reason = "a register-tiled inner kernel; a struct would obscure it")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn score_tile<const G: usize, const NV: usize, const KB: usize>(
    k: *const u8,
    row: usize,
    dim: usize,
    qk: *const f32,
    base: &[f32; MAX_TILE_HEADS],
    out: *mut f32,
    block: usize,
    ahead: Prefetch,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; G];
    for (g, acc) in acc.iter_mut().enumerate() {
        *acc = [_mm512_set1_ps(base[g]); NV];
    }
    let bytes = 2 * KB;
    for d in 0..dim {
        // Rows shorter than a line share it: prefetch it once, at the row that starts it.
        if row >= 64 || (d * row).is_multiple_of(64) {
            ahead.span(d * row, row.max(64));
        }
        // SAFETY: channel `d < dim` of the tile, `16 × NV` codes, readable per the contract; the
        // `qk` reads are rows `g < G` at `d < dim`.
        unsafe {
            let codes = k.add(d * row);
            let mut keys = [_mm512_setzero_ps(); NV];
            if KB == 4 && NV == 2 {
                // Even tokens in keys[0], odd in keys[1]; interleaved back when stored.
                (keys[0], keys[1]) = split_nibbles(codes);
            } else {
                for (j, key) in keys.iter_mut().enumerate() {
                    *key = codes16::<KB>(codes.add(bytes * j));
                }
            }
            for (g, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*qk.add(g * dim + d));
                for (a, key) in acc.iter_mut().zip(&keys) {
                    *a = _mm512_fmadd_ps(*key, w, *a);
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
            // SAFETY: row `g < G`, floats `16j..16j + 16 ≤ 16 × NV`, writable per the contract.
            unsafe { _mm512_storeu_ps(out.add(g * block + LANES * j), *a) };
        }
    }
}

/// 32 consecutive 4-bit codes at `src` (16 bytes) widened to `f32`, split by parity: the even codes
/// (low nibbles) in the first vector, the odd codes in the second. One widening for 32 codes.
///
/// # Safety
///
/// `src` must be valid for reading 16 bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn split_nibbles(src: *const u8) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
    let bytes = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(src.cast())) };
    let even = _mm512_and_si512(bytes, _mm512_set1_epi32(0xf));
    let odd = _mm512_srli_epi32::<4>(bytes);
    (_mm512_cvtepi32_ps(even), _mm512_cvtepi32_ps(odd))
}

/// Lanes `0..32` in order from vectors of the even lanes and the odd lanes ([`split_nibbles`]'s
/// order): returns (lanes 0..16, lanes 16..32).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) fn interleave(even: __m512, odd: __m512) -> (__m512, __m512) {
    let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    (_mm512_permutex2var_ps(even, low, odd), _mm512_permutex2var_ps(even, high, odd))
}

/// The inverse of [`interleave`]: from lanes `0..16` and `16..32`, the even lanes and the odd lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn deinterleave(first: __m512, second: __m512) -> (__m512, __m512) {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (_mm512_permutex2var_ps(first, even, second), _mm512_permutex2var_ps(first, odd, second))
}

/// For `heads` rows of probabilities `p` (rows of `block` floats): `weights[(g × groups + j) ×
/// block + t] = p[g][t] × scale_{j,t}` for `t < tokens.next_multiple_of(16)` (0 past `tokens`) and
/// `bias[g][j] = Σ_{t < tokens} p[g][t] × min_{j,t}`, from the value parameters at `params`
/// (`groups` rows of `block` pairs). Parameters of unfilled slots are discarded by selection.
///
/// # Safety
///
/// `params` readable for `4 × groups × block` bytes, `p` for `heads` rows of `block ≥
/// tokens.next_multiple_of(16)` floats, `weights` writable for `heads × groups × block` floats;
/// `heads ≤ 8`, `groups ≤ 8`, `1 ≤ tokens ≤ block`.
#[expect(clippy::too_many_arguments, reason = "a register-tiled inner kernel; a struct would obscure it")]
#[expect(clippy::needless_range_loop, reason = "`j` indexes parameter rows and bias columns alike")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn weigh_tokens(
    params: *const u8,
    block: usize,
    groups: usize,
    tokens: usize,
    p: *const f32,
    heads: usize,
    weights: *mut f32,
    bias: &mut [[f32; 256 / V_GROUP]; MAX_TILE_HEADS],
) {
    let full = tokens / LANES;
    let tail: __mmask16 = ((1u32 << (tokens % LANES)) - 1) as __mmask16;
    let vectors = full + usize::from(tail != 0);
    for j in 0..groups {
        let mut sums = [_mm512_setzero_ps(); MAX_TILE_HEADS];
        for i in 0..vectors {
            let filled = if i < full { !0 } else { tail };
            // SAFETY: pairs `16i..16i + 16 ≤ block` of group row `j < groups`; probabilities and
            // weights at the same tokens of rows `g < heads`.
            unsafe {
                let (scale, min) = params16(params.add(4 * (j * block + LANES * i)));
                for (g, sum) in sums.iter_mut().enumerate().take(heads) {
                    let pv = _mm512_loadu_ps(p.add(g * block + LANES * i));
                    let w = _mm512_maskz_mul_ps(filled, pv, scale);
                    _mm512_storeu_ps(weights.add((g * groups + j) * block + LANES * i), w);
                    *sum = _mm512_mask3_fmadd_ps(pv, min, *sum, filled);
                }
            }
        }
        for (g, sum) in sums.iter().enumerate().take(heads) {
            bias[g][j] = _mm512_reduce_add_ps(*sum);
        }
    }
}

/// The value codes and weights one [`accumulate`] call reads.
#[derive(Clone, Copy)]
pub(super) struct ValueTile {
    /// Value codes of token 0 at channel `c` of a head's token-major codes.
    pub v: *const u8,
    /// Bytes per token row of codes.
    pub row: usize,
    /// Filled tokens.
    pub tokens: usize,
    /// The weights from [`weigh_tokens`] of the tile's first head.
    pub weights: *const f32,
    /// Value groups per token.
    pub groups: usize,
    /// Token slots per page (the weights' row length).
    pub block: usize,
    /// First channel of the tile; a multiple of 32 when the tile is wider than 16 channels.
    pub c: usize,
    /// Prefetch target laid out like `v`.
    pub pf: Prefetch,
}

/// `acc[g] = alpha[g] × acc[g] + bias[g][group] + Σ_{t < tokens} weights[g][group][t] × c_t` over
/// `16 × WC` channels from channel `tile.c`, for `G` heads, from `VB`-bit value codes.
///
/// # Safety
///
/// `16 × WC` codes are readable from `tile.v + t × tile.row` for every `t < tile.tokens`; the
/// weights have `G × groups` rows of `block` floats covering groups `tile.c / 32 ..= (tile.c + 16 ×
/// WC − 1) / 32 < groups`, and `tile.c` is a multiple of 32 when `WC ≥ 2`; `alpha` has `G` floats;
/// `acc` has `G` rows of `dim` floats with `16 × WC` readable and writable from each row start.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn accumulate<const G: usize, const WC: usize, const VB: usize>(
    tile: &ValueTile,
    alpha: *const f32,
    bias: &[[f32; 256 / V_GROUP]; MAX_TILE_HEADS],
    acc: *mut f32,
    dim: usize,
) {
    // Vector `w` covers channels `c + 16w ..`, in group `first + w / 2`.
    let first = tile.c / V_GROUP;
    let group_of = |w: usize| first + (tile.c % V_GROUP + LANES * w) / V_GROUP;
    // 4-bit codes of 32 channels are widened at once, split by parity (see `split_nibbles`): then
    // `sums[2j]` holds the even and `sums[2j + 1]` the odd channels of channels `c + 32j ..`.
    let split = VB == 4 && WC >= 2;
    let mut sums = [[_mm512_setzero_ps(); WC]; G];
    for (g, sums) in sums.iter_mut().enumerate() {
        // SAFETY: row `g < G` of `alpha` and `acc`, `16 × WC` floats, per the contract.
        unsafe {
            let scale = _mm512_set1_ps(*alpha.add(g));
            for (w, s) in sums.iter_mut().enumerate() {
                *s = _mm512_loadu_ps(acc.add(g * dim + LANES * w));
            }
            if split {
                for pair in sums.chunks_exact_mut(2) {
                    (pair[0], pair[1]) = deinterleave(pair[0], pair[1]);
                }
            }
            for (w, s) in sums.iter_mut().enumerate() {
                *s = _mm512_fmadd_ps(*s, scale, _mm512_set1_ps(bias[g][group_of(w)]));
            }
        }
    }
    let bytes = 2 * VB;
    let span = bytes * WC;
    for t in 0..tile.tokens {
        // Rows shorter than a line share it: prefetch it once, at the row that starts it.
        if span >= 64 || (t * tile.row).is_multiple_of(64) {
            tile.pf.span(t * tile.row, span.max(64));
        }
        // SAFETY: token row `t < tokens`, `16 × WC` codes, and weights of rows `g < G`, groups
        // `group_of(w)` at `t < block`.
        unsafe {
            let row = tile.v.add(t * tile.row);
            let mut values = [_mm512_setzero_ps(); WC];
            if split {
                for (j, pair) in values.chunks_exact_mut(2).enumerate() {
                    (pair[0], pair[1]) = split_nibbles(row.add(16 * j));
                }
            } else {
                for (w, value) in values.iter_mut().enumerate() {
                    *value = codes16::<VB>(row.add(bytes * w));
                }
            }
            for (g, sums) in sums.iter_mut().enumerate() {
                let at = |w: usize| tile.weights.add((g * tile.groups + group_of(w)) * tile.block + t);
                // Vectors 2j and 2j + 1 share a group (tiles wider than 16 channels start on a group).
                let mut weight = _mm512_set1_ps(*at(0));
                for (w, (s, value)) in sums.iter_mut().zip(&values).enumerate() {
                    if w > 0 && w % 2 == 0 {
                        weight = _mm512_set1_ps(*at(w));
                    }
                    *s = _mm512_fmadd_ps(*value, weight, *s);
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
        for (w, s) in sums.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm512_storeu_ps(acc.add(g * dim + LANES * w), *s) };
        }
    }
}
