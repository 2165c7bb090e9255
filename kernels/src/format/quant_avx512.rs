//! AVX-512 quantize and dequantize: the same bytes and floats as the scalar code of `quant.rs`.
//!
//! **Quantize**, per KV head: keys 16 channels at a time (each channel's tokens are contiguous in
//! the channel-major source, so a group's min and max are one vector load per 32 tokens and a
//! reduction), then the parameters of those 16 groups at once, then each channel's codes; values
//! one 32-channel group at a time for 16 tokens (their parameter pairs are 64 contiguous bytes,
//! group-major). The min and max are found on the raw 16-bit patterns, 32 lanes a vector, mapped to
//! integers in the order of their values (no conversion to f32 in that pass; a NaN comes out as
//! the smallest or largest, so the range check catches it), and only the 16 results converted.
//! 8-bit codes are clamped and packed by one saturating narrowing.
//!
//! The parameters follow the rounding rule of `quant.rs` exactly, with directed-rounding
//! instructions instead of the scalar search: `min` = `vcvtps2ph` toward −∞; `scale` = the f16
//! toward +∞ of `(max − min) / L` computed in f32 rounding up (so it is at least the exact
//! quotient and at most one f16 step above the smallest covering f16), then one step down if that
//! smaller f16 still covers, tested exactly as `fma(s, L, min) ≥ max` rounded toward −∞; `inv` and
//! the codes with the same f32 operations in the same order as the scalar code (no fused
//! operations there). Any element that is not finite or beyond ±65504 makes [`quantize`] give up,
//! and the caller reruns the scalar code, which names the element.
//!
//! **Dequantize**: values row by row (`vpmovzxbd` or a nibble or crumb unpack, then one FMA with the
//! group's broadcast scale and min, which equals the scalar `min + scale × code` since the product
//! is exact); keys 16 channels × 16 tokens at a time, transposed in registers into token-major rows.
//!
//! Where VBMI is available ([`crate::Isa::Avx512Vnni`]), `dequant_vbmi.rs` dequantizes instead,
//! transposing key codes as bytes.
//!
//! Both need `block_tokens` a multiple of 16 (the dispatcher in `quant.rs` checks). Memory safety
//! rests on the lengths checked by the callers in `quant.rs`: every pointer below is derived from a
//! page slice at an offset the [`QuantLayout`] or [`PageShape`] computes, inside the region the
//! comment at its use names.

use std::arch::x86_64::*;

use crate::format::quant::{MAX_QUANTIZED, QuantLayout, V_GROUP};
use crate::format::{Format, PageShape};

const LANES: usize = 16;
/// How far ahead of its reads the first pass asks for the source's cache lines. A source page
/// coming from memory arrives in time for the second pass, but not for the first: the reductions
/// and parameters between the two keep the out-of-order window from reaching the next loads
/// early. With this, f16 → q8 out of cache went from 3.6–3.9 to 4.2–4.6 GB/s of f16 on the
/// development VM (2 KiB to 16 KiB gave the same within noise).
const AHEAD: usize = 4096;

/// Why the vector quantizer gave up: an element it cannot encode (the scalar code names it).
#[derive(Debug)]
pub(crate) struct Unencodable;

/// Loads up to 16 elements of a 16-bit page (lanes outside `mask` read nothing and are 0) as f32.
///
/// # Safety
///
/// The lanes in `mask` must be readable 2-byte elements from `src`; the CPU must support the
/// enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load_wide(src: *const u8, mask: __mmask16, bf16: bool) -> __m512 {
    // SAFETY: a masked load touches only the lanes in `mask`, which the caller guarantees.
    let raw = unsafe { _mm256_maskz_loadu_epi16(mask, src.cast()) };
    if bf16 { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw))) } else { _mm512_cvtph_ps(raw) }
}

/// The 16-bit patterns of `x` (f16 or bf16, sign and magnitude) as i16 in the order of their values:
/// negative patterns have their magnitude bits flipped. −0 sorts just below +0 and NaN beyond ±∞.
/// The map is its own inverse.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn sortable(x: __m512i) -> __m512i {
    // x ^ (sign mask & 0x7fff) in one ternary-logic operation (A ^ (B & C) is 0x78).
    _mm512_ternarylogic_epi32::<0x78>(x, _mm512_srai_epi16::<15>(x), _mm512_set1_epi16(0x7fff))
}

/// The smallest and largest value of the lanes in `mask` of `count` 32-lane rows of 16-bit elements
/// in sortable order ([`sortable`]): `row(i)` for `i < count`; rows from `count` to 16 fold nothing
/// and give +0. Prefetches [`AHEAD`] bytes past each load, up to `last`, the source's last byte.
///
/// # Safety
///
/// For each `i < count`, the `mask` lanes of 2-byte elements from `row(i)` must be readable; the CPU
/// must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn row_bounds(
    count: usize,
    vectors: usize,
    mask: impl Fn(usize) -> __mmask32,
    row: impl Fn(usize) -> *const u8,
    last: *const u8,
) -> ([__m512; LANES], [__m512; LANES]) {
    let (mut lows, mut highs) = ([_mm512_setzero_ps(); LANES], [_mm512_setzero_ps(); LANES]);
    for i in 0..count {
        let r = row(i);
        let (mut low, mut high) = (_mm512_set1_epi16(i16::MAX), _mm512_set1_epi16(i16::MIN));
        for j in 0..vectors {
            let m = mask(j);
            _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(64 * j + AHEAD).min(last).cast());
            // SAFETY: the caller guarantees the `m` lanes of vector `j` of row `i`.
            let x = sortable(unsafe { _mm512_maskz_loadu_epi16(m, r.add(64 * j).cast()) });
            low = _mm512_mask_min_epi16(low, m, low, x);
            high = _mm512_mask_max_epi16(high, m, high, x);
        }
        (lows[i], highs[i]) = (_mm512_castsi512_ps(low), _mm512_castsi512_ps(high));
    }
    (lows, highs)
}

/// Lane `i` of the result is the value of the 16-bit pattern `op` folds from the 32 sortable
/// lanes of `v[i]` ([`row_bounds`]), as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn fold_rows(v: &[__m512; LANES], op: impl Fn(__m512i, __m512i) -> __m512i + Copy, bf16: bool) -> __m512 {
    let folded = reduce16(v, |a, b| _mm512_castsi512_ps(op(_mm512_castps_si512(a), _mm512_castps_si512(b))));
    // Each dword now holds two 16-bit candidates of its row: fold them into the low half.
    let pair = _mm512_castps_si512(folded);
    let bits = sortable(op(pair, _mm512_srli_epi32::<16>(pair)));
    if bf16 { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)) } else { _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)) }
}

/// Lane `i` of the result is `op` folded over the 16 lanes of `v[i]`: sixteen horizontal
/// reductions in 15 two-shuffle steps (halves, quarters, pairs, single lanes) instead of sixteen
/// separate ones. `op` is min or max, so the order of folding does not change the result.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce16(v: &[__m512; LANES], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    // Fold 1, pairs of vectors: 256-bit halves. Lanes 0..8 of `r[k]` fold `v[a]`, 8..16 fold `v[b]`,
    // where the inputs are taken in the order that makes the last step land group `i` in lane `i`
    // (group 4e + j ends in lane 4j + e without it).
    const ORDER: [usize; LANES] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
    let halves = |a: __m512, b: __m512| {
        op(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
    };
    let r: [__m512; 8] = std::array::from_fn(|k| halves(v[ORDER[2 * k]], v[ORDER[2 * k + 1]]));
    // Fold 2: 128-bit quarters; quarter q of `s[m]` folds the input of position 4m + q.
    let quarters = |a: __m512, b: __m512| {
        op(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
    };
    let s: [__m512; 4] = std::array::from_fn(|m| quarters(r[2 * m], r[2 * m + 1]));
    // Folds 3 and 4 inside each quarter: pairs of lanes, then single lanes.
    let pairs =
        |a: __m512, b: __m512| op(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b));
    let singles =
        |a: __m512, b: __m512| op(_mm512_shuffle_ps::<0b10_00_10_00>(a, b), _mm512_shuffle_ps::<0b11_01_11_01>(a, b));
    singles(pairs(s[0], s[1]), pairs(s[2], s[3]))
}

/// Whether groups with smallest values `lo` and largest `hi` can be quantized: every element finite
/// and within ±65504 (a NaN among the elements is the smallest or largest in sortable order, and
/// fails both ordered comparisons).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn in_range(lo: __m512, hi: __m512) -> bool {
    let limit = _mm512_set1_ps(MAX_QUANTIZED);
    let fine = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(hi, limit)
        & _mm512_cmp_ps_mask::<_CMP_GE_OQ>(lo, _mm512_sub_ps(_mm512_setzero_ps(), limit));
    fine == !0
}

/// The parameters of 16 groups with smallest values `lo` and largest `hi` and `levels = 2^b − 1`:
/// the `(scale, min)` pairs as 16 little-endian dwords (scale in the low half), `min` and `inv` as
/// f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn group_params(lo: __m512, hi: __m512, levels: f32) -> (__m512i, __m512, __m512) {
    const DOWN: i32 = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
    const UP: i32 = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;
    let n = _mm512_set1_ps(levels);
    // −0.0 + 0.0 = +0.0: both zeros count as +0, as in the scalar rule.
    let (lo, hi) = (_mm512_add_ps(lo, _mm512_setzero_ps()), _mm512_add_ps(hi, _mm512_setzero_ps()));
    let min_h = _mm512_cvt_roundps_ph::<DOWN>(lo);
    let min = _mm512_cvtph_ps(min_h);
    let quotient = _mm512_div_round_ps::<UP>(_mm512_sub_round_ps::<UP>(hi, min), n);
    let scale = _mm512_cvtepu16_epi32(_mm512_cvt_roundps_ph::<UP>(quotient));
    // One f16 step down, where there is one and it still covers the group.
    let positive = _mm512_cmpgt_epi32_mask(scale, _mm512_setzero_si512());
    let below = _mm512_sub_epi32(scale, _mm512_set1_epi32(1));
    let below_f = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(below));
    let reach = _mm512_fmadd_round_ps::<DOWN>(below_f, n, min);
    let covers = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(positive, reach, hi);
    let scale = _mm512_mask_mov_epi32(scale, covers, below);
    let scale_f = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(scale));
    let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(scale_f, _mm512_setzero_ps());
    let inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), scale_f);
    let pairs = _mm512_or_si512(scale, _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(min_h)));
    (pairs, min, inv)
}

/// `floor((x − min) × inv + 0.5)` of the 16 lanes of `x`, the scalar operations in the scalar order,
/// as u32 (the code before the clamp to `2^B − 1` that [`pack16`] applies).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn encode16(x: __m512, min: __m512, inv: __m512) -> __m512i {
    let y = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(x, min), inv), _mm512_set1_ps(0.5));
    // One conversion rounding toward −∞ is the floor and the conversion (y ≥ 0.5 is never negative;
    // beyond u32 it gives u32::MAX, which the clamp brings to the top code).
    _mm512_cvt_roundps_epu32::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(y)
}

/// Stores the 16 codes `min(2^B − 1, floor)` (lanes outside `mask` 0) packed `B` bits each, lowest
/// first: `2 × B` bytes at `dst`.
///
/// # Safety
///
/// `dst` must be valid for writing `2 × B` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn pack16<const B: usize>(floor: __m512i, mask: __mmask16, dst: *mut u8) {
    if B == 8 {
        // One saturating narrowing is the clamp to 255 and the packing.
        // SAFETY: the caller guarantees 16 writable bytes.
        unsafe { _mm_storeu_si128(dst.cast(), _mm512_maskz_cvtusepi32_epi8(mask, floor)) };
        return;
    }
    let codes = _mm512_maskz_mov_epi32(mask, _mm512_min_epu32(floor, _mm512_set1_epi32((1 << B) - 1)));
    let bytes = _mm512_cvtepi32_epi8(codes);
    // SAFETY: the caller guarantees `2 × B` writable bytes; each arm's store writes that many.
    unsafe {
        match B {
            4 => {
                // 16-bit lane = b0 | b1 << 8, b ≤ 15: b0 | (b1 << 4), then one byte per lane.
                let pairs = _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0xff)), _mm_srli_epi16::<4>(bytes));
                _mm_storel_epi64(dst.cast(), _mm_packus_epi16(pairs, pairs));
            }
            _ => {
                // Twice: pairs of 2-bit codes into 4 bits, then pairs of those into a byte.
                let pairs = _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0xff)), _mm_srli_epi16::<6>(bytes));
                let quads = _mm_or_si128(_mm_and_si128(pairs, _mm_set1_epi32(0xffff)), _mm_srli_epi32::<12>(pairs));
                dst.cast::<i32>().write_unaligned(_mm_cvtsi128_si32(_mm_cvtepi32_epi8(quads)));
            }
        }
    }
}

/// Quantizes the first `tokens` slots of the 16-bit page `src` (format `from`) into `dst`, whose
/// `page_bytes` are zero, leaving the header to the caller.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c; `src` is at least
/// `page_bytes(from)` long, `dst` at least `layout`'s page bytes; `1 ≤ tokens ≤ block_tokens`,
/// `block_tokens` a multiple of 16, `head_dim` a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn quantize(
    layout: &QuantLayout,
    from: Format,
    src: &[u8],
    tokens: usize,
    dst: &mut [u8],
) -> Result<(), Unencodable> {
    // SAFETY: same features and contract; the widths match the layout's.
    unsafe {
        match (layout.k_bits, layout.v_bits) {
            (8, 8) => quantize_in::<8, 8>(layout, from, src, tokens, dst),
            (8, 4) => quantize_in::<8, 4>(layout, from, src, tokens, dst),
            (4, 4) => quantize_in::<4, 4>(layout, from, src, tokens, dst),
            _ => quantize_in::<2, 2>(layout, from, src, tokens, dst),
        }
    }
}

/// [`quantize`] for `KB`-bit keys and `VB`-bit values.
///
/// # Safety
///
/// As for [`quantize`], with the layout's widths equal to `KB` and `VB`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn quantize_in<const KB: usize, const VB: usize>(
    layout: &QuantLayout,
    from: Format,
    src: &[u8],
    tokens: usize,
    dst: &mut [u8],
) -> Result<(), Unencodable> {
    let shape = layout.shape;
    let (dim, block) = (shape.head_dim, shape.block_tokens);
    let bf16 = from == Format::Bf16;
    let (k_levels, v_levels) = ((1u32 << KB) - 1, (1u32 << VB) - 1);
    let vectors = tokens.div_ceil(LANES);
    let mask = |j: usize| -> __mmask16 {
        let left = tokens - LANES * j;
        if left >= LANES { !0 } else { ((1u32 << left) - 1) as __mmask16 }
    };
    // The first pass reads 32 elements a vector, as 16-bit patterns.
    let wide_vectors = tokens.div_ceil(2 * LANES);
    let wide_mask = |j: usize| -> __mmask32 {
        let left = tokens - 2 * LANES * j;
        if left >= 2 * LANES { !0 } else { (1u32 << left) - 1 }
    };
    let last = src.as_ptr().wrapping_add(src.len() - 1);
    let (src, out) = (src.as_ptr(), dst.as_mut_ptr());
    // Source rows, computed once: key channel rows of `block` elements, value token rows of `dim`.
    let (k_rows, v_rows) = (shape.k_byte(0, 0, 0), shape.v_byte(0, 0, 0));
    let k_row = |h: usize, d: usize| src.wrapping_add(k_rows + 2 * (h * dim + d) * block);
    let v_row = |h: usize, t: usize, c: usize| src.wrapping_add(v_rows + 2 * ((h * block + t) * dim + c));
    let min16 = |a, b| _mm512_min_epi16(a, b);
    let max16 = |a, b| _mm512_max_epi16(a, b);

    for h in 0..shape.kv_heads {
        for d0 in (0..dim).step_by(LANES) {
            // SAFETY: channels `d0..d0 + 16 ≤ dim` of head `h`: lanes of tokens `< tokens ≤ block` of
            // their rows inside the source's K region.
            let (lows, highs) = unsafe { row_bounds(LANES, wide_vectors, wide_mask, |i| k_row(h, d0 + i), last) };
            let (low, high) = (fold_rows(&lows, min16, bf16), fold_rows(&highs, max16, bf16));
            if !in_range(low, high) {
                return Err(Unencodable);
            }
            let (pairs, min, inv) = group_params(low, high, k_levels as f32);
            // SAFETY: the 16 pairs of channels `d0..d0 + 16 ≤ dim` of head `h`, 64 bytes of the page.
            unsafe { _mm512_storeu_si512(out.add(layout.k_param(h, d0)).cast(), pairs) };
            let (mut mins, mut invs) = ([0.0f32; LANES], [0.0f32; LANES]);
            // SAFETY: the 16-float arrays just above.
            unsafe {
                _mm512_storeu_ps(mins.as_mut_ptr(), min);
                _mm512_storeu_ps(invs.as_mut_ptr(), inv);
            }
            for i in 0..LANES {
                let row = k_row(h, d0 + i);
                let codes = out.wrapping_add(layout.k_codes(h) + (d0 + i) * layout.k_row_bytes());
                let (min, inv) = (_mm512_set1_ps(mins[i]), _mm512_set1_ps(invs[i]));
                for j in 0..vectors {
                    // SAFETY: the lanes of tokens `< tokens` of this channel's row, as in the first
                    // pass; the codes of tokens `16j..16j + 16 ≤ block` of its row, `2 × KB` bytes.
                    unsafe {
                        let x = load_wide(row.add(32 * j), mask(j), bf16);
                        pack16::<KB>(encode16(x, min, inv), mask(j), codes.add(2 * KB * j));
                    }
                }
            }
        }

        for g in 0..layout.v_groups() {
            let c0 = g * V_GROUP;
            let width = (dim - c0).min(V_GROUP);
            let row_mask = if width >= 2 * LANES { !0 } else { (1u32 << width) - 1 };
            for t0 in (0..tokens).step_by(LANES) {
                let count = (tokens - t0).min(LANES);
                // SAFETY: channels `c0..c0 + width ≤ dim` of tokens `t0..t0 + count ≤ tokens` of head
                // `h`, inside the source's V region. Token slots past `count` fold nothing (+0): their
                // parameters are computed and not stored.
                let (lows, highs) = unsafe { row_bounds(count, 1, |_| row_mask, |i| v_row(h, t0 + i, c0), last) };
                let (low, high) = (fold_rows(&lows, min16, bf16), fold_rows(&highs, max16, bf16));
                if !in_range(low, high) {
                    return Err(Unencodable);
                }
                let (pairs, min, inv) = group_params(low, high, v_levels as f32);
                let filled = ((1u32 << count) - 1) as __mmask16;
                // SAFETY: the pairs of tokens `t0..t0 + count ≤ block` of group `g` of head `h`.
                unsafe { _mm512_mask_storeu_epi32(out.add(layout.v_param(h, g, t0)).cast(), filled, pairs) };
                let (mut mins, mut invs) = ([0.0f32; LANES], [0.0f32; LANES]);
                // SAFETY: the 16-float arrays just above.
                unsafe {
                    _mm512_storeu_ps(mins.as_mut_ptr(), min);
                    _mm512_storeu_ps(invs.as_mut_ptr(), inv);
                }
                for i in 0..count {
                    let row = v_row(h, t0 + i, c0);
                    let codes = out.wrapping_add(layout.v_codes(h) + (t0 + i) * layout.v_row_bytes() + c0 * VB / 8);
                    let (min, inv) = (_mm512_set1_ps(mins[i]), _mm512_set1_ps(invs[i]));
                    for j in 0..width / LANES {
                        // SAFETY: channels `c0 + 16j .. + 16 ≤ dim` of this token's row, as in the
                        // first pass; their codes, `2 × VB` bytes.
                        unsafe {
                            let x = load_wide(row.add(32 * j), !0, bf16);
                            pack16::<VB>(encode16(x, min, inv), !0, codes.add(2 * VB * j));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Dequantizes the first `tokens` slots of the quantized page `page` into token-major rows.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c; `page` is at least
/// `layout`'s page bytes long; `k_out` and `v_out` hold `tokens × kv_heads × head_dim` floats;
/// `tokens ≤ block_tokens`, `block_tokens` a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn dequantize(
    layout: &QuantLayout,
    page: &[u8],
    tokens: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) {
    // SAFETY: same features and contract; the widths match the layout's.
    unsafe {
        match (layout.k_bits, layout.v_bits) {
            (8, 8) => dequantize_in::<8, 8>(layout, page, tokens, k_out, v_out),
            (8, 4) => dequantize_in::<8, 4>(layout, page, tokens, k_out, v_out),
            (4, 4) => dequantize_in::<4, 4>(layout, page, tokens, k_out, v_out),
            _ => dequantize_in::<2, 2>(layout, page, tokens, k_out, v_out),
        }
    }
}

/// [`dequantize`] for `KB`-bit keys and `VB`-bit values.
///
/// # Safety
///
/// As for [`dequantize`], with the layout's widths equal to `KB` and `VB`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dequantize_in<const KB: usize, const VB: usize>(
    layout: &QuantLayout,
    page: &[u8],
    tokens: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) {
    let shape: PageShape = layout.shape;
    let (heads, dim) = (shape.kv_heads, shape.head_dim);
    let bytes = page.as_ptr();
    let (k_out, v_out) = (k_out.as_mut_ptr(), v_out.as_mut_ptr());
    for h in 0..heads {
        for d0 in (0..dim).step_by(LANES) {
            // SAFETY: the 16 key pairs of channels `d0..d0 + 16 ≤ dim` of head `h`.
            let (scale, min) = unsafe { crate::attention::avx512_quant::params16(bytes.add(layout.k_param(h, d0))) };
            let (mut scales, mut mins) = ([0.0f32; LANES], [0.0f32; LANES]);
            // SAFETY: the 16-float arrays just above.
            unsafe {
                _mm512_storeu_ps(scales.as_mut_ptr(), scale);
                _mm512_storeu_ps(mins.as_mut_ptr(), min);
            }
            for t0 in (0..tokens).step_by(LANES) {
                let mut rows = [_mm512_setzero_ps(); LANES];
                for (i, r) in rows.iter_mut().enumerate() {
                    let codes = layout.k_codes(h) + (d0 + i) * layout.k_row_bytes() + t0 * KB / 8;
                    // SAFETY: 16 codes of tokens `t0..t0 + 16 ≤ block` of channel `d0 + i` of head `h`.
                    let c = unsafe { crate::attention::avx512_quant::codes16::<KB>(bytes.add(codes)) };
                    *r = _mm512_fmadd_ps(c, _mm512_set1_ps(scales[i]), _mm512_set1_ps(mins[i]));
                }
                transpose16(&mut rows);
                for (j, r) in rows.iter().enumerate().take(tokens - t0) {
                    // SAFETY: row `t0 + j < tokens`, channels `d0..d0 + 16 ≤ dim` of head `h`.
                    unsafe { _mm512_storeu_ps(k_out.add(((t0 + j) * heads + h) * dim + d0), *r) };
                }
            }
        }
        for t in 0..tokens {
            let row = layout.v_codes(h) + t * layout.v_row_bytes();
            for g in 0..layout.v_groups() {
                let at = layout.v_param(h, g, t);
                let pair = u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]]);
                let halves = _mm_cvtph_ps(_mm_cvtsi32_si128(pair as i32));
                let scale = _mm512_broadcastss_ps(halves);
                let min = _mm512_broadcastss_ps(_mm_movehdup_ps(halves));
                for c in (g * V_GROUP..((g + 1) * V_GROUP).min(dim)).step_by(LANES) {
                    // SAFETY: 16 codes of channels `c..c + 16 ≤ dim` of token `t` of head `h`; 16
                    // floats of output row `t < tokens`.
                    unsafe {
                        let codes = crate::attention::avx512_quant::codes16::<VB>(bytes.add(row + c * VB / 8));
                        _mm512_storeu_ps(v_out.add((t * heads + h) * dim + c), _mm512_fmadd_ps(codes, scale, min));
                    }
                }
            }
        }
    }
}

/// Transposes a 16 × 16 block of floats held as 16 rows: afterwards `rows[j][i]` is the former
/// `rows[i][j]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn transpose16(rows: &mut [__m512; LANES]) {
    let mut a = [_mm512_setzero_ps(); LANES];
    for i in 0..8 {
        a[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    // b[4i + k]: rows 4i..4i + 4, columns k + 4L in 128-bit lane L.
    let mut b = [_mm512_setzero_ps(); LANES];
    let lo = |x: __m512, y: __m512| _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
    let hi = |x: __m512, y: __m512| _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
    for i in 0..4 {
        b[4 * i] = lo(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = hi(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = lo(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = hi(a[4 * i + 1], a[4 * i + 3]);
    }
    for k in 0..4 {
        let c_lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(b[k], b[4 + k]);
        let c_hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(b[k], b[4 + k]);
        let d_lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(b[8 + k], b[12 + k]);
        let d_hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(b[8 + k], b[12 + k]);
        rows[k] = _mm512_shuffle_f32x4::<0b10_00_10_00>(c_lo, d_lo);
        rows[k + 8] = _mm512_shuffle_f32x4::<0b11_01_11_01>(c_lo, d_lo);
        rows[k + 4] = _mm512_shuffle_f32x4::<0b10_00_10_00>(c_hi, d_hi);
        rows[k + 12] = _mm512_shuffle_f32x4::<0b11_01_11_01>(c_hi, d_hi);
    }
}
